"""Data-parallel generation workers (engine/workers.py): torchrun's ranks each sample a share of the prompts and the
outputs equal one process's. The shares balance by length; rollout.py, evaluate.py and drift.py as 2 ranks
(torchrun's variables, tests/forkserver.run_ranks) at 1 thread each write what one process at 1 thread writes (the
same tokens; log-probs and KLs within the engine's batch-composition tolerance, since each worker batches a different
set of prompts)."""
import json
import os
import sys
from pathlib import Path

import pytest

from engine.workers import shards
import forkserver
from tiny import free_port

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4  # tests/test_rollout.py's engine-vs-reference tolerance on a log-prob


def test_shards_balance_by_length_and_keep_input_order():
    """Longest first to the least loaded worker: costs 9,7,5,4,3,2 over 2 workers -> {9,4,2}=15 and {7,5,3}=15."""
    costs = [3, 9, 2, 7, 4, 5]
    assert shards(costs, 2) == [[1, 2, 4], [0, 3, 5]]
    assert sum(costs[i] for i in shards(costs, 2)[0]) == sum(costs[i] for i in shards(costs, 2)[1]) == 15
    parts = shards(list(range(1, 101)), 3)
    assert sorted(i for p in parts for i in p) == list(range(100)) and all(p == sorted(p) for p in parts)
    assert max(sum(i + 1 for i in p) for p in parts) - min(sum(i + 1 for i in p) for p in parts) <= 100
    assert shards([5], 4) == [[0], [], [], []]  # more workers than prompts: the others sample nothing


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama with a chat template, and a TRACE-layout root of two tasks with prompts of many lengths."""
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("workers")
    write_random_tiny(root / "ckpt")
    data = root / "data"
    for task, make in (("FOMC", lambda i: ("What is the stance? " + "The rate rises. " * (i % 7), "ABC"[i % 3])),
                       ("NumGLUE-cm", lambda i: (f"Anna has {i} apples and gets {i % 5} more. " * (1 + i % 4)
                                                 + "How many?", str(i + i % 5)))):
        (data / task).mkdir(parents=True)
        recs = [dict(zip(("prompt", "answer"), make(i))) for i in range(13)]
        for split in ("train", "test"):
            (data / task / f"{split}.json").write_text(json.dumps(recs))
    return root


def launch(setup, script, workers, out, *extra):
    cmd = [sys.executable, str(REPO / script), "--ckpt", str(setup / "ckpt"), "--data", str(setup / "data"),
           "--tasks", "FOMC,NumGLUE-cm", "--max-new-tokens", "12", "--out", str(out), "--quiet", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(setup / "cache"))
    if workers > 1:  # torchrun's ranks, forked (run.py --gen-workers runs these scripts under torchrun itself)
        p = forkserver.run_ranks(workers, cmd, cwd=REPO, env=env, text=True, timeout=600, port=free_port())
    else:
        p = forkserver.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_rollout_two_workers_equal_one(setup, tmp_path):
    for n in (1, 2):
        launch(setup, "rollout.py", n, tmp_path / f"r{n}.jsonl", "--check-logprobs", "4")
    one, two = records(tmp_path / "r1.jsonl"), records(tmp_path / "r2.jsonl")
    assert len(one) == 26
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert [{k: v for k, v in r.items() if k not in ("logprobs", "mean_logprob")} for r in two] == \
           [{k: v for k, v in r.items() if k not in ("logprobs", "mean_logprob")} for r in one]
    assert max(abs(a - b) for r, s in zip(one, two) for a, b in zip(r["logprobs"], s["logprobs"])) < TOL
    summary = json.loads((tmp_path / "r2_summary.json").read_text())  # rank 0 checked the merged rollouts
    assert summary["n"] == 26 and summary["workers"] == 2 and summary["logprob_check"]["k"] == 4 and not summary["logprob_check"]["warned"]
    assert not list(tmp_path.glob("*.tmp*"))


def test_evaluate_two_workers_equal_one(setup, tmp_path):
    for n in (1, 2):
        launch(setup, "evaluate.py", n, tmp_path / f"e{n}", "--repeats", "2")
    assert (tmp_path / "e2" / "predictions.jsonl").read_bytes() == (tmp_path / "e1" / "predictions.jsonl").read_bytes()
    s1, s2 = (json.loads((tmp_path / f"e{n}" / "scores.json").read_text()) for n in (1, 2))
    assert s1 == s2


def test_drift_two_workers_equal_one(setup, tmp_path):
    """drift.py's sampling and both models' teacher-forced passes are shared out (the reference is the same
    checkpoint: every KL is ~0, the gold NLLs are not)."""
    for n in (1, 2):
        launch(setup, "drift.py", n, tmp_path / f"d{n}", "--ref", str(setup / "ckpt"), "--limit", "20")
    one, two = records(tmp_path / "d1" / "drift_samples.jsonl"), records(tmp_path / "d2" / "drift_samples.jsonl")
    assert [r["token_ids"] for r in one] == [r["token_ids"] for r in two] and len(one) == 26
    for a, b in zip(one, two):
        assert b["gold_nll_cur"] == pytest.approx(a["gold_nll_cur"], abs=TOL * a["gold_tokens"])
        assert b["seq_kl"] == pytest.approx(a["seq_kl"], abs=TOL)
