"""bench/bench_gpu.py's CPU smoke path runs end to end (the GPU grid itself needs a GPU): every variant reports,
the timed tokens are the mix's documents, and the rollout generates batch x new tokens (random weights never stop), or
in the rollout-mix row each prompt's own answer length."""
import json
import os
import sys
from pathlib import Path
import forkserver

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def test_bench_gpu_cpu_smoke_path(tmp_path):
    from bench_gpu import mix_lengths
    out = tmp_path / "bench.jsonl"
    cmd = [sys.executable, str(REPO / "bench" / "bench_gpu.py"), "--device", "cpu", "--configs", "tiny", "--mixes",
           "trace", "--steps", "1", "--warmup", "1", "--global-batch", "8", "--micro-tokens", "2048", "--max-len",
           "512", "--rollout-batches", "1,3", "--rollout-new-tokens", "5", "--rollout-mix-prompts", "6",
           "--out", str(out)]
    p = forkserver.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    # activation checkpointing x compiled blocks (checkpointing around a compiled block included)
    assert [(r["ac"], r["compiled"], r["attn"], r["ce"]) for r in train] == [
        (ac, comp, "sdpa", "chunked") for ac in (False, True) for comp in (False, True)]
    docs = mix_lengths("trace", 2 * 8, 512)  # warm-up step + timed step, 8 documents each
    assert {r["micro_tokens"] for r in train} == {2048}
    mean_doc = sum(n for n, _ in docs) / len(docs)
    for r in train:
        assert r["mean_doc"] == round(mean_doc, 1) and r["tokens_per_s_per_gpu"] > 0 and r["peak_memory_gb"] > 0
        assert r["dtype"] == "float32" and r["attention"] == "sdpa" and r["world"] == 1
    rollouts = [r for r in rows if r.get("kind") == "rollout"]
    mix_new = sum(min(a, 5) for _, a in mix_lengths("trace", 6, 512, seed=1))  # each prompt capped at its answer
    assert [(r["batch"], r["new_tokens"]) for r in rollouts] == [(1, 5), (3, 15), ("mix", mix_new)]
    assert mix_new < 6 * 5  # the mix's letter answers end early
    assert "| tiny | trace | on | on | sdpa | chunked | 1 | 2048 |" in p.stdout


def test_profile_decode_cpu_path_reports_the_step_and_the_ops(tmp_path):
    """bench/profile_decode.py (the decode profile that found the cuDNN per-shape plans on the H100) runs on CPU."""
    cmd = [sys.executable, str(REPO / "bench" / "profile_decode.py"), "--device", "cpu", "--config", "tiny",
           "--batch", "2", "--prompt-len", "20", "--new-tokens", "6", "--rows", "5"]
    p = forkserver.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "config tiny, cpu float32, batch 2, prompt 20, 6 new tokens, SDPA default" in p.stdout
    assert "decode step cold" in p.stdout and "mkldnn::_linear_pointwise" in p.stdout  # the packed products
