"""data/trace.py: the TRACE loader on real files and on synthetic ones (records, JSON Lines and their error
messages, through common/jsonl.py), and the over-long filter. The embedded benchmark: tests/test_embedded.py."""

import json
from pathlib import Path

import pytest

from data.conventions import score
from data.trace import Example, filter_overlong, filter_report, load_task

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(__file__).resolve().parents[2] / "shared" / "trace"


# --- real TRACE files ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task,counts", [("FOMC", (5000, 496, 496)), ("NumGLUE-cm", (5000, 41, 81)),
                                         ("NumGLUE-ds", (5000, 164, 325))])
def test_real_trace_files(task, counts):
    if not (SHARED / task).is_dir():
        pytest.skip(f"{SHARED / task} not present")
    for split, n in zip(("train", "eval", "test"), counts):
        exs = load_task(SHARED, task, split)
        assert len(exs) == n
        assert [e.idx for e in exs] == list(range(n))
        assert all(e.task == task and e.prompt and e.answer for e in exs)
        # every gold answer scores 100 against itself under the task metric
        assert all(score(task, e.answer, e.answer, e.prompt) == 100 for e in exs)
    if task == "FOMC":
        assert {e.answer for e in exs} == {"A", "B", "C"}
        assert exs[0].prompt.startswith("What is the monetary policy stance")


def test_real_train_subsample_keeps_source_index():
    if not (SHARED / "FOMC").is_dir():
        pytest.skip("shared TRACE data not present")
    full = load_task(SHARED, "FOMC", "train")
    sub = load_task(SHARED, "FOMC", "train", max_train=100, seed=3)
    assert len(sub) == 100 and sub == load_task(SHARED, "FOMC", "train", max_train=100, seed=3)
    assert sub != load_task(SHARED, "FOMC", "train", max_train=100, seed=4)
    assert all(full[e.idx] == e for e in sub)
    assert [e.idx for e in sub] == sorted(e.idx for e in sub)


# --- loader on synthetic files ---------------------------------------------------------------------------------

def _write(root, task, split, text):
    d = root / task
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{split}.json").write_text(text, encoding="utf-8")
    return d / f"{split}.json"


def test_loader_json_list_jsonl_and_subsample(tmp_path):
    recs = [{"prompt": f"p{i}", "answer": f"a{i}", "extra": 1} for i in range(10)]
    _write(tmp_path, "FOMC", "train", json.dumps(recs))
    exs = load_task(tmp_path, "FOMC", "train")
    assert exs[3] == Example("FOMC", 3, "p3", "a3")
    sub = load_task(tmp_path, "FOMC", "train", max_train=4, seed=0)
    assert len(sub) == 4 and all(e.prompt == f"p{e.idx}" for e in sub)
    # JSON Lines (blank lines allowed), under .json or .jsonl
    _write(tmp_path, "FOMC", "eval", "\n".join(json.dumps(r) for r in recs[:3]) + "\n\n")
    assert [e.answer for e in load_task(tmp_path, "FOMC", "eval")] == ["a0", "a1", "a2"]
    (tmp_path / "FOMC" / "test.jsonl").write_text(json.dumps(recs[0]) + "\n", encoding="utf-8")
    assert load_task(tmp_path, "FOMC", "test")[0].prompt == "p0"
    # eval/test are never subsampled
    assert len(load_task(tmp_path, "FOMC", "eval", max_train=1)) == 3


def _err(tmp_path, text, split="train"):
    path = _write(tmp_path, "FOMC", split, text)
    with pytest.raises(ValueError) as e:
        load_task(tmp_path, "FOMC", split)
    msg = str(e.value)
    assert str(path) in msg, msg
    return msg


def test_loader_errors_name_file_record_field(tmp_path):
    good = {"prompt": "p", "answer": "A"}
    # malformed JSON in the third record of a list
    msg = _err(tmp_path, json.dumps([good, good])[:-1] + ', {"prompt": "p", "answer": }]')
    assert "malformed JSON in record 2" in msg and "line 1" in msg
    # missing field
    msg = _err(tmp_path, json.dumps([good, {"prompt": "p"}]))
    assert "record 1" in msg and "missing field 'answer'" in msg
    # non-string field
    msg = _err(tmp_path, json.dumps([{"prompt": "p", "answer": 3}]))
    assert "record 0" in msg and "field 'answer' must be a string, got int" in msg
    # not an object
    assert "record 1" in _err(tmp_path, json.dumps([good, ["p", "A"]]))
    # empty file / empty list
    assert "empty" in _err(tmp_path, "")
    assert "empty" in _err(tmp_path, "  \n")
    assert "no records" in _err(tmp_path, "[]")
    # JSON Lines: record number and line number
    msg = _err(tmp_path, json.dumps(good) + "\n\n" + '{"prompt": "p", "answer": "A"\n')
    assert "malformed JSON in record 1 (line 3, column" in msg
    msg = _err(tmp_path, json.dumps(good) + "\n" + json.dumps({"answer": "A"}) + "\n")
    assert "record 1 (line 2)" in msg and "missing field 'prompt'" in msg
    # trailing garbage after the list
    assert "after record 0" in _err(tmp_path, json.dumps([good]) + " x")


def test_loader_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(ValueError, match=r"MeetingBank[/\\]test\.json: file not found"):
        load_task(tmp_path, "MeetingBank", "test")
    with pytest.raises(ValueError, match=r"unknown task 'FOMX'; valid tasks: C-STANCE, FOMC, MeetingBank"):
        load_task(tmp_path, "FOMX", "train")
    with pytest.raises(ValueError, match=r"unknown split 'dev'"):
        load_task(tmp_path, "FOMC", "dev")


def test_jsonl_with_raw_line_separators_inside_strings_is_read(tmp_path):
    """A hand-written file (another tool's, or ours before U+2028/U+2029/U+0085 were escaped) holds them raw: valid
    JSON Lines, read whole; a "\r\n" line end is accepted, and line numbers count '\n' only."""
    text = ('{"prompt": "a\u2028b", "answer": "A"}\n'
            '{"prompt": "c\u2029d\u0085e", "answer": "B"}\r\n'
            '\n'
            '{"prompt": "f", "answer": "C"}\n')
    path = _write(tmp_path, "FOMC", "train", text)
    assert [(e.prompt, e.answer) for e in load_task(tmp_path, "FOMC", "train")] == \
        [("a\u2028b", "A"), ("c\u2029d\u0085e", "B"), ("f", "C")]
    path.write_text(text + '{"prompt": "g\u2028", "answer": }\n', encoding="utf-8")
    assert "malformed JSON in record 3 (line 5, column" in _err(tmp_path, path.read_text(encoding="utf-8"))


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]


@pytest.mark.parametrize("const", NON_FINITE)
def test_records_refuse_non_finite_numbers_naming_file_record_and_constant(tmp_path, const):
    """Python's JSON reader takes NaN, Infinity and 1e999 (an infinity); the record readers refuse them, in a JSON
    Lines file (record and line) and in a JSON list (record), with the field that holds them."""
    good = '{"prompt": "p", "answer": "A"}'
    bad = f'{{"prompt": "p", "answer": "A", "score": {const}}}'
    msg = _err(tmp_path, f"{good}\n{bad}\n")
    assert f"record 1 (line 2): field 'score': {const} is " in msg and "\n" not in msg, msg
    msg = _err(tmp_path, f"[{good},\n {bad}]")
    assert f"record 1 (line 2): field 'score': {const} is " in msg and "\n" not in msg, msg


def test_jsonl_integers_too_long_for_python_are_one_error(tmp_path):
    msg = _err(tmp_path, '{"prompt": "p", "answer": "A", "n": ' + "9" * 5000 + "}\n")
    assert "record 0 (line 1): an integer of 5000 digits is too large" in msg


def test_filter_overlong():
    exs = [Example("FOMC", i, "w " * i, "A") for i in range(10)]
    kept, dropped = filter_overlong(exs, lambda p, a: len(p.split()) + len(a.split()), max_len=5)
    assert [e.idx for e in kept] == [0, 1, 2, 3, 4] and dropped == 5
    assert filter_report("FOMC", "train", 10, dropped, max_len=5) == \
        "FOMC/train: kept 5/10 (dropped 5 over 5 tokens)"


def test_load_filtered_stops_tokenizing_at_the_limit_when_asked(tmp_path, capsys):
    """count_all=False (drift.py): the same examples as filtering the whole split, with no example past the
    limit-th kept one measured, and the drops counted among those read."""
    from data.trace import load_filtered
    (tmp_path / "FOMC").mkdir()
    rows = [{"prompt": "w " * (i % 7), "answer": "A"} for i in range(40)]  # lengths 1..7, 0-based i % 7 words
    (tmp_path / "FOMC" / "test.json").write_text(json.dumps(rows))
    seen = []

    def length(p, a):
        seen.append(p)
        return len(p.split()) + len(a.split())
    full, full_dropped = load_filtered(tmp_path, ["FOMC"], "test", length, 5, limit=6)
    assert len(seen) == 40 and full_dropped == {"FOMC": 10}  # every example measured: i % 7 in (5, 6) dropped
    seen.clear()
    lazy, lazy_dropped = load_filtered(tmp_path, ["FOMC"], "test", length, 5, limit=6, count_all=False)
    assert lazy == full and [e.idx for e in lazy] == [0, 1, 2, 3, 4, 7]
    assert len(seen) == 8 and lazy_dropped == {"FOMC": 2}  # read 0..7: 5 and 6 (6 and 7 tokens) dropped
    assert "FOMC/test: kept 6/8 (dropped 2 over 5 tokens), 8 of 40 read for the limit of 6" in capsys.readouterr().out
