"""Failure behaviour, measured: bad inputs across the five scripts and SIGKILLs
of the run.py driver.

    python bench/bench_reliability.py [--kills 6] [--seed 0] [--delay 5 30] [--skip-cases]

1. Bad inputs: every case of tests/test_reliability.py's table (flags out of range, missing /
   non-UTF-8 / malformed / single-object input files, broken checkpoints, foreign outputs),
   run as a subprocess. A case is clean when the script exits non-zero with exactly one error
   line naming the offending file or flag, prints no traceback and leaves its working
   directory byte for byte as it was.
2. Kills: a small pipeline (random tiny Llama, 2 tasks, sft + replay, 7 steps) runs once
   uninterrupted; then the same command is started again in a fresh directory and its driver alone
   is SIGKILLed after a random --delay LO HI seconds (default 5-30), --kills times (or until it
   finishes), each time checking that no step process outlives the driver, then run to the end.
   Survived = the resumed run's results.json matrices equal the uninterrupted run's exactly.
Prints Markdown tables and the command.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import test_reliability as rel  # noqa: E402


def bad_inputs(env) -> list[tuple[str, bool, str]]:
    rows = []
    for case_id, script, make in rel.CASES:
        with tempfile.TemporaryDirectory() as d:
            work = Path(d)
            argv, named = make(env, work)
            before = rel.snapshot(work)
            r = rel.run(rel.T[script], argv, env)
            errors = [line for line in r.stderr.splitlines() if "error" in line]
            clean = (r.returncode != 0 and "Traceback" not in r.stderr and len(errors) == 1
                     and named in errors[0] and rel.snapshot(work) == before)
            rows.append((case_id, clean, errors[0] if errors else r.stderr.strip()[-200:]))
            print(f"{'clean' if clean else 'NOT CLEAN'} {case_id}: {rows[-1][2][:160]}", flush=True)
    return rows


def step_children(pid: int) -> list[int]:
    """Every process below the driver `pid`: its steps, and with the zygote (pipeline/zygote.py) the
    zygote and the steps it forked."""
    parents = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit():
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    out, frontier = [], {pid}
    while frontier:
        frontier = {c for c, parent in parents.items() if parent in frontier}
        out += sorted(frontier)
    return out


def pipeline(env, out: Path) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), *map(str, rel.run_args(env, out.parent)[:-1]),
            str(out), "--methods", "sft,replay", "--rho", "0.5"]


def kills(env, n: int, seed: int, root: Path, delay=(5, 30)) -> dict:
    rng = random.Random(seed)
    t0 = time.time()
    ref = subprocess.run(pipeline(env, root / "ref"), cwd=REPO, env=env["env"],
                         capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-2000:]
    uninterrupted_s = time.time() - t0
    out = root / "killed"
    done, orphans, killed, hit = False, 0, 0, 0
    for _ in range(n):
        p = subprocess.Popen(pipeline(env, out), cwd=REPO, env=env["env"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        time.sleep(rng.uniform(*delay))
        if p.poll() is not None:
            done = p.returncode == 0
            p.communicate()
            break
        kids = step_children(p.pid)
        hit += bool(kids)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        killed += 1
        time.sleep(3)
        alive = [k for k in kids if Path(f"/proc/{k}").exists()
                 and Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        orphans += len(alive)
        for k in alive:
            os.kill(k, signal.SIGKILL)
        p.communicate()
    if not done:
        r = subprocess.run(pipeline(env, out), cwd=REPO, env=env["env"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
    a = json.loads((root / "ref" / "results.json").read_text())["methods"]
    b = json.loads((out / "results.json").read_text())["methods"]
    same = {m: ([s["matrix"] for s in a[m]["seeds"].values()]
                == [s["matrix"] for s in b[m]["seeds"].values()])
            for m in a}
    return dict(kills=killed, with_steps=hit, orphans=orphans, identical=all(same.values()),
                uninterrupted_s=uninterrupted_s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay", type=float, nargs=2, default=(5, 30), metavar=("LO", "HI"),
                    help="seconds between starting the driver and killing it, uniform in [LO, HI]")
    ap.add_argument("--skip-cases", action="store_true", help="only the kill test")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        env = rel.make_env(root)
        rows = [] if args.skip_cases else bad_inputs(env)
        k = kills(env, args.kills, args.seed, root, args.delay)
    print(f"\ncommand: python bench/bench_reliability.py --kills {args.kills} --seed {args.seed} "
          f"--delay {args.delay[0]:g} {args.delay[1]:g}"
          f"{' --skip-cases' if args.skip_cases else ''}")
    if rows:
        by_script = {}
        for case_id, clean, _ in rows:
            s = case_id.split("-")[0]
            by_script.setdefault(s, [0, 0])
            by_script[s][0] += 1
            by_script[s][1] += clean
        print("\n| script | bad-input cases | clean |\n|---|---:|---:|")
        for s, (n, c) in by_script.items():
            print(f"| {s}.py | {n} | {c} |")
        print(f"| all | {len(rows)} | {sum(c for _, c, _ in rows)} |")
    print("\n| driver SIGKILLs | of them with steps running | steps outliving the driver | "
          "resumed results identical | uninterrupted run |")
    print("|---:|---:|---:|---|---:|")
    print(f"| {k['kills']} | {k['with_steps']} | {k['orphans']} | {k['identical']} | "
          f"{k['uninterrupted_s']:.0f} s |")


if __name__ == "__main__":
    main()
