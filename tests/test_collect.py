"""reporting/collect.py: reading a run's step outputs back into results.json's numbers."""
import json

import pytest

from common.outputs import write_jsonl


def test_read_eval_names_the_bad_prediction_record(tmp_path):
    """reporting.collect.read_eval reads idx, score and num_tokens of every prediction: a record without one, or with a
    string idx, is one line naming file, record and field (it was a KeyError in collect); a good file gives
    per-example scores ordered by idx, averaged over repeats."""
    from reporting.collect import read_eval
    (tmp_path / "scores.json").write_text(json.dumps({"scores": {"FOMC": 50.0}}))
    good = [{"task": "FOMC", "idx": i, "prediction": p, "gold": "A", "finish_reason": "stop", "num_tokens": 1,
             "score": s} for i, p, s in [(3, "A", 100.0), (1, "B", 0.0), (3, "B", 0)]]
    write_jsonl(tmp_path / "predictions.jsonl", good)
    scores, per_example, diag = read_eval(tmp_path, {})
    assert scores == {"FOMC": 50.0} and per_example == {"FOMC": [0.0, 50.0]} and diag["FOMC"]["n"] == 3
    for bad, field, want in [({"score": None}, "score", "missing field 'score'"),
                             ({"idx": "1"}, "idx", "field 'idx' must be int, got str")]:
        rec = {**good[1], **bad}
        if bad[field] is None:
            del rec[field]
        write_jsonl(tmp_path / "predictions.jsonl", [good[0], rec])
        with pytest.raises(ValueError) as e:
            read_eval(tmp_path, {})
        assert str(e.value) == f"{tmp_path / 'predictions.jsonl'}: record 1 (line 2): {want}"
