"""buffer_nll.py: a buffer's per-token NLL under a checkpoint, against transformers' own Llama."""
import json
import statistics

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.tokenizer import ChatTokenizer  # noqa: E402
from tiny import hf  # noqa: E402


def test_buffer_nll_equals_transformers_per_token_nll(ckpts, tmp_path):
    import buffer_nll
    recs = [{"prompt": "What is the stance?", "response": "A", "task": "FOMC", "source": "gold"},
            {"prompt": "Policy is fine.", "response": "C. neutral", "task": "FOMC", "source": "gold"},
            {"prompt": "How many apples?", "response": "The answer is 12.", "task": "NumGLUE-cm", "source": "gold"},
            {"prompt": "apples " * 40, "response": "1", "task": "NumGLUE-cm", "source": "gold"}]
    path = tmp_path / "buffer.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = buffer_nll.main(["--ckpt", str(ckpts / "prev"), "--buffer", str(path), "--max-len", "60", "--quiet"])
    assert out == tmp_path / "buffer_stats.json"
    stats = json.loads(out.read_text())
    tok = ChatTokenizer.from_dir(ckpts / "prev")
    model = hf(ckpts / "prev")
    per, tok_max = {}, {}
    for r in recs[:3]:
        ids, labels = tok.encode_sft(r["prompt"], r["response"])
        assert len(ids) <= 60
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        tgt = torch.tensor(labels[1:])
        nll = torch.nn.functional.cross_entropy(logits[tgt != -100], tgt[tgt != -100], reduction="none")
        per.setdefault(r["task"], []).append(nll.mean().item())
        tok_max[r["task"]] = max(tok_max.get(r["task"], 0.0), nll.max().item())
    assert stats["dropped_overlong"] == 1 and stats["budget"] == 4 and stats["scorer"] == "gold"
    for task in ("FOMC", "NumGLUE-cm"):
        s = stats["tasks"][task]["selected"]
        assert s["n"] == len(per[task]) and stats["tasks"][task]["rejected"] is None
        assert s["nll_mean"] == pytest.approx(statistics.fmean(per[task]), rel=1e-4)
        assert s["nll_max"] == pytest.approx(max(per[task]), rel=1e-4)
        assert s["token_nll_max"] == pytest.approx(tok_max[task], rel=1e-4)
    assert stats["all"]["selected"]["nll_max"] == pytest.approx(max(max(v) for v in per.values()), rel=1e-4)
