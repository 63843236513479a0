"""The extra cost of on-policy SDFT per optimizer step, vs plain SFT (and sft-kl), on the tiny base.

    python bench/bench_sdft.py [--tasks C-STANCE,MeetingBank] [--steps 20] [--repeats 3]
        [--threads 1] [--max-new-tokens 40]

Runs `train.py --max-steps STEPS` on each embedded task (C-STANCE: one-letter answers; MeetingBank:
summaries that reach the response cap) with the run.py tiny preset's settings (global batch 4, lr
5e-4, max length 512, micro-batch 4096 tokens) for each objective, objectives alternating, --repeats
times. A step's time is taken from train.py's own log (tokens / tokens_per_s: the step from batch
selection to the end of the optimizer and EMA updates, process start-up and the final save
excluded); step 1 of every run (warm-up) is left out. SDFT's log also splits out generation
(`gen_seconds`); the rest of its step is the teacher forward on prompt+demonstration+response plus
the student's forward/backward on prompt+response. Prints a Markdown table (medians over all steps
of all repeats, ratios to SFT) and the machine load before/after.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRESET = ["--global-batch", "4", "--lr", "5e-4", "--max-len", "512", "--micro-tokens", "4096",
          "--epochs", "8", "--save-every", "0", "--quiet"]


def load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="C-STANCE,MeetingBank",
                   help="embedded tasks, one table row group each")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS of each run (run.py's tiny preset: 1)")
    p.add_argument("--max-new-tokens", type=int, default=40,
                   help="SDFT response cap (the measurement in BENCHMARKS.md: 40)")
    args = p.parse_args()

    from data.embedded import ensure_embedded
    from model.base import ensure_base
    base, root = ensure_base("tiny"), ensure_embedded()
    objectives = {"sft": [], "sft-kl": ["--objective", "sft-kl"],
                  "sdft": ["--objective", "sdft",
                           "--sdft-max-new-tokens", str(args.max_new_tokens)]}
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = str(args.threads)
    rows = []
    load_before = load()
    for task in args.tasks.split(","):
        step_s = {o: [] for o in objectives}
        gen_s, sampled, gold = [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for name, extra in objectives.items():
                    out = Path(tmp) / f"{name}-{r}"
                    subprocess.run([sys.executable, str(REPO / "train.py"), "--model", str(base),
                                    "--data", str(root / task / "train.json"), "--out", str(out),
                                    "--max-steps", str(args.steps), *PRESET, *extra],
                                   check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
                    log = [json.loads(line)
                           for line in (out / "train_log.jsonl").read_text().splitlines()][1:]
                    step_s[name] += [x["tokens"] / x["tokens_per_s"] for x in log]
                    if name == "sdft":
                        gen_s.extend(x["gen_seconds"] for x in log)
                        sampled.extend(x["target_tokens"] for x in log)
                    elif name == "sft":
                        gold.extend(x["target_tokens"] for x in log)
        med = {o: statistics.median(v) for o, v in step_s.items()}
        g = statistics.median(gen_s)
        rows += [f"| {task} | sft | {med['sft']:.3f} | 1.00x | - | "
                 f"{statistics.median(gold):.0f} (gold) |",
                 f"| {task} | sft-kl | {med['sft-kl']:.3f} | {med['sft-kl'] / med['sft']:.2f}x | "
                 f"- | {statistics.median(gold):.0f} (gold) |",
                 f"| {task} | sdft | {med['sdft']:.3f} | {med['sdft'] / med['sft']:.2f}x | "
                 f"{g:.3f} s ({g / med['sdft']:.0%}) | "
                 f"{statistics.median(sampled):.0f} (sampled) |"]
    load_after = load()
    print(f"\ntiny base, global batch 4, {args.steps - 1} timed steps x {args.repeats} repeats "
          f"per objective and task, OMP_NUM_THREADS={args.threads}, "
          f"SDFT cap {args.max_new_tokens} tokens/prompt; "
          f"load average {load_before} before, {load_after} after\n")
    print("| task | objective | median s/step | vs sft | of which generation | "
          "response tokens per step (median) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\ncommand: python bench/bench_sdft.py --tasks {args.tasks} --steps {args.steps} "
          f"--repeats {args.repeats} --threads {args.threads} "
          f"--max-new-tokens {args.max_new_tokens}")


if __name__ == "__main__":
    main()
