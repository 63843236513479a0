"""drift.py against a naive full-vocabulary computation with transformers' own Llama: identical checkpoints give 0,
a perturbed one gives the naive value, bad input writes nothing. Its log-prob kernels: test_logprobs.py."""
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data.embedded import write_benchmark  # noqa: E402
from data.trace import load_task  # noqa: E402
from model.tokenizer import ChatTokenizer  # noqa: E402
import forkserver
from tiny import hf, naive  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace")
    write_benchmark(root, n_train=2, n_eval=1, n_test=5, tasks="FOMC,NumGLUE-cm")
    return root


# --- drift.py ------------------------------------------------------------------------------------------------------

def run_drift(*args):
    return forkserver.run([sys.executable, "drift.py", *map(str, args), "--engine", "native", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)


def read_rows(out):
    return [json.loads(line) for line in (out / "drift_samples.jsonl").read_text().splitlines()]


def test_drift_identical_checkpoints_is_zero(ckpts, data_root, tmp_path):
    r = run_drift("--ckpt", ckpts / "same", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                  "FOMC,NumGLUE-cm", "--max-new-tokens", "6", "--out", tmp_path / "d")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "d" / "drift.json").read_text())
    assert list(summary["tasks"]) == ["FOMC", "NumGLUE-cm"]
    for s in [*summary["tasks"].values(), summary["all"]]:
        assert s["mean_seq_kl"] == s["median_seq_kl"] == s["kl_per_token"] == 0.0
        assert s["gold_nll_cur"] == s["gold_nll_ref"] > 0
    assert summary["tasks"]["FOMC"]["n"] == 5 and summary["all"]["n"] == 10
    assert all(r["kl"] == [0.0] * r["num_tokens"] for r in read_rows(tmp_path / "d"))


def test_drift_equals_naive_kl_on_a_perturbed_checkpoint(ckpts, data_root, tmp_path):
    out = tmp_path / "d"
    r = run_drift("--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                  "NumGLUE-cm,FOMC", "--max-new-tokens", "8", "--limit", "3", "--out", out)
    assert r.returncode == 0, r.stderr
    summary, rows = json.loads((out / "drift.json").read_text()), read_rows(out)
    assert [(x["task"], x["idx"]) for x in rows] == [("NumGLUE-cm", i) for i in range(3)] + \
        [("FOMC", i) for i in range(3)]
    tok = ChatTokenizer.from_dir(ckpts / "cur")
    hf_cur, hf_ref = hf(ckpts / "cur"), hf(ckpts / "prev")
    test = {t: {ex.idx: ex for ex in load_task(data_root, t, "test")} for t in ("FOMC", "NumGLUE-cm")}
    for x in rows:
        ex = test[x["task"]][x["idx"]]
        prompt = tok.prompt_ids(ex.prompt)
        _, _, kl = naive(hf_cur, hf_ref, prompt, x["token_ids"])
        assert x["kl"] == pytest.approx(kl.tolist(), abs=1e-5, rel=1e-3)
        assert x["seq_kl"] == pytest.approx(kl.sum().item(), rel=1e-4)
        # gold NLL: the response tokens of training's encoding (answer + end-of-turn), under each model
        ids, labels = tok.encode_sft(ex.prompt, ex.answer)
        start = next(t for t, lab in enumerate(labels) if lab != -100)
        gold = [t for t in labels if t != -100]
        assert ids[:start] == prompt and x["gold_tokens"] == len(gold)
        lp, lq, _ = naive(hf_cur, hf_ref, prompt, gold)
        assert x["gold_nll_cur"] == pytest.approx(-lp.sum().item(), rel=1e-4)
        assert x["gold_nll_ref"] == pytest.approx(-lq.sum().item(), rel=1e-4)
    # the summary is the documented aggregate of the rows
    for task in ("NumGLUE-cm", "FOMC"):
        rs, s = [x for x in rows if x["task"] == task], summary["tasks"][task]
        assert s["n"] == 3 and s["mean_seq_kl"] == pytest.approx(statistics.fmean(x["seq_kl"] for x in rs))
        assert s["median_seq_kl"] == pytest.approx(statistics.median(x["seq_kl"] for x in rs))
        assert s["kl_per_token"] == pytest.approx(sum(x["seq_kl"] for x in rs) / sum(x["num_tokens"] for x in rs))
        assert s["gold_nll_cur"] == pytest.approx(sum(x["gold_nll_cur"] for x in rs) /
                                                  sum(x["gold_tokens"] for x in rs))
        assert s["mean_seq_kl"] > 0.01
    assert summary["temperature"] == 1.0 and summary["limit"] == 3 and summary["ref"] == str(ckpts / "prev")
    assert "| NumGLUE-cm | 3 |" in r.stdout


def test_drift_refuses_checkpoints_with_different_tokenizers(ckpts, data_root, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpts / "prev", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "<|pad|>"
    (other / "tokenizer.json").write_text(json.dumps(spec))
    r = run_drift("--ckpt", ckpts / "cur", "--ref", other, "--data", data_root, "--out", tmp_path / "d")
    assert r.returncode != 0 and "different tokenizers" in r.stderr
    assert not (tmp_path / "d").exists()
    r = run_drift("--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks", "FOMC,Nope",
                  "--out", tmp_path / "d")
    assert r.returncode != 0 and "unknown task 'Nope'" in r.stderr
    assert not (tmp_path / "d").exists()


def test_drift_refuses_a_length_cap_past_the_model_context_before_loading(ckpts, data_root, tmp_path, monkeypatch):
    """--max-new-tokens 10**9 would size the KV cache for 10**9 columns: one line naming the flag and the model's
    context, before any weights load."""
    import drift
    import model.checkpoint
    import engine.sampling
    from common.errors import InputError

    def never(*a, **kw):
        raise AssertionError("the weights were loaded or sampling started")
    monkeypatch.setattr(engine.sampling, "generate", never)
    monkeypatch.setattr(model.checkpoint, "load_model", never)
    with pytest.raises(InputError, match=r"^--max-new-tokens: 1000000000 new tokens "
                                         r"is more than the model's context \(max_position_embeddings 4096 in "):
        drift.main([str(a) for a in ["--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                                     "FOMC", "--max-new-tokens", 10**9, "--limit", "1", "--engine", "native", "--quiet",
                                     "--out", tmp_path / "d"]])
    assert not (tmp_path / "d").exists()


def test_drift_refuses_a_non_finite_kl_and_writes_nothing(ckpts, data_root, tmp_path, monkeypatch):
    import drift
    import model.logprobs
    from common.errors import InputError
    real = model.logprobs.response_stats

    def overflowing(*a, **kw):  # what an overflow in either model gives
        rows = real(*a, **kw)
        rows[0]["kl"] = rows[0]["kl"] + [float("nan")]
        return rows
    monkeypatch.setattr(model.logprobs, "response_stats", overflowing)
    with pytest.raises(InputError, match="non-finite KL or NLL on FOMC example 0"):
        drift.main([str(a) for a in ["--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                                     "FOMC", "--max-new-tokens", "2", "--limit", "1", "--engine", "native", "--quiet",
                                     "--out", tmp_path / "d"]])
    assert not (tmp_path / "d").exists()
