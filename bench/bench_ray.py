"""run.py's Ray executor against the local one on the same cores: a small grid (2 tasks x 2 methods
x 2 seeds, 22 steps, a random tiny Llama) on Ray's 2-node harness (ray.cluster_utils.Cluster, a head
and a second node of 1 CPU each, bound to 127.0.0.1) against the local executor with --jobs 2; and
one step at a time (--jobs 1 on both) for the per-step overhead, (wall_ray - wall_local) / steps.
Alternated, medians of --repeats; each run on an empty run directory with a warm embedded-benchmark
cache; the runs' results.json compared (they must be equal).

    python bench/bench_ray.py --repeats 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# every node on 127.0.0.1 (read when ray is imported)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def command(base: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), "--model", str(base), "--tasks", "C-STANCE,Py150",
            "--methods", "sft,opr-ru", "--seeds", "0,1", "--n-train", "8", "--eval-limit", "4",
            "--epochs", "1", "--global-batch", "4", "--lr", "1e-4", "--max-new-tokens", "6",
            "--rho", "0.5", "--eval-repeats", "1", "--drift-limit", "4", "--quiet",
            "--out", str(out), *extra]


def timed(cmd, env) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"bench_ray: {' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from model.base import write_random_tiny
    from ray.cluster_utils import Cluster
    root = Path(tempfile.mkdtemp(prefix="bench_ray-"))
    write_random_tiny(root / "base")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"))
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=1, object_store_memory=80 << 20))
    cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    print(f"bench_ray: the 2-node harness up in {time.perf_counter() - t0:.1f} s", flush=True)
    ray = ["--executor", "ray", "--ray-address", cluster.address]
    setups = {"local, --jobs 2": ["--jobs", "2"], "ray, 2 nodes x 1 CPU": ray,
              "local, --jobs 1": ["--jobs", "1"], "ray, --jobs 1": [*ray, "--jobs", "1"]}
    # the embedded benchmark's cache, once
    timed(command(root / "base", root / "warm", "--jobs", "2"), env)
    walls, results, n = {k: [] for k in setups}, {}, 0
    for r in range(args.repeats):
        for name, extra in setups.items():
            out = root / f"run-{n}"
            n += 1
            walls[name].append(timed(command(root / "base", out, *extra), env))
            results[name] = json.loads((out / "results.json").read_text())["methods"]
            steps = len(json.loads((out / "manifest.json").read_text()))
            print(f"  repeat {r}: {name}: {walls[name][-1]:.1f} s", flush=True)
    cluster.shutdown()
    same = all(v == results["local, --jobs 2"] for v in results.values())
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"\n{steps} steps, medians of {args.repeats} (s); results equal across setups: {same}")
    print("| setup | wall s (median) | runs |\n|---|---:|---|")
    for k, v in walls.items():
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    print(f"\nthe grid: ray / local = {med['ray, 2 nodes x 1 CPU'] / med['local, --jobs 2']:.2f}x; "
          f"per-step overhead one at a time: "
          f"{(med['ray, --jobs 1'] - med['local, --jobs 1']) / steps:+.2f} s")


if __name__ == "__main__":
    main()
