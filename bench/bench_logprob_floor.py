"""How far apart fp32 log-probs of the same greedy tokens come out of: an engine at different batch
sizes, two engines (this checkout's and --before's), and the trainer's teacher-forced pass. The
floor under any "engine A within X of engine B" goal: an engine disagrees with itself by as much
when only its batch size changes.

    python bench/bench_logprob_floor.py --before DIR [--model smollm2] [--prompts 32]
        [--max-new-tokens 32] [--batch-sizes 1,8,32] [--threads 2]

Each engine runs in a process of its own on the rollout mix of bench_engine.py (greedy, stop at
end-of-turn), once per batch size. The reference is --before's engine at the first batch size; the
teacher-forced log-probs are this checkout's model over prompt + response
(model.logprobs.response_stats, what rollout.py --check-logprobs compares with).
Prints, per engine and batch size, how many responses equal the reference's and the largest
|log-prob difference| over their tokens, to the reference and to the teacher-forced pass.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_engine import checkpoint, mix_prompts  # noqa: E402


def worker(args):
    """One engine, one process: responses at each batch size, as JSON on stdout."""
    import torch
    torch.set_num_threads(args.threads)
    job = json.loads(Path(args.job).read_text())
    # the engine under test: args.root's (nothing of the project imported yet)
    sys.path.insert(0, str(args.root))
    from model.checkpoint import load_model
    try:
        from engine.native import sample
    except ImportError:  # a --before checkout from before the rename
        from model.generate import generate as sample
    model = load_model(job["ckpt"])
    out = {bs: [[o["token_ids"], o["logprobs"]] for o in sample(
        model, job["prompts"], temperature=0.0, max_new_tokens=job["max_new_tokens"],
        stop_ids=job["stop_ids"], batch_size=bs, progress=False)] for bs in job["batch_sizes"]}
    print(json.dumps(out))


def max_diff(outs, ref_tokens, ref_logprobs):
    """(responses whose tokens equal the reference's, max |log-prob difference|
    over their tokens)."""
    same, worst = 0, 0.0
    for (tokens, lps), rt, rl in zip(outs, ref_tokens, ref_logprobs):
        if tokens == rt:
            same += 1
            worst = max(worst, max(abs(a - b) for a, b in zip(lps, rl)))
    return same, worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path,
                    help="another checkout (e.g. a worktree of an earlier commit)")
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.before is None:
        ap.error("--before DIR is required (e.g. a git worktree of an earlier commit)")
    import tempfile

    import torch
    torch.set_num_threads(args.threads)
    ckpt = checkpoint(args.model)
    prompts, stop = mix_prompts(ckpt, args.prompts)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    job = Path(tempfile.mkdtemp()) / "job.json"
    job.write_text(json.dumps(dict(ckpt=str(ckpt), prompts=prompts, stop_ids=stop,
                                   batch_sizes=sizes, max_new_tokens=args.max_new_tokens)))
    runs = {}
    for name, root in (("before", args.before.resolve()), ("this checkout", REPO)):
        out = subprocess.run([sys.executable, __file__, "--worker", "--root", str(root),
                              "--job", str(job), "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True).stdout
        runs[name] = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
    from model.checkpoint import load_model
    from model.logprobs import response_stats
    ref = runs["before"][sizes[0]]
    ref_tokens = [t for t, _ in ref]
    forced = [s["logprobs"] for s in response_stats(load_model(ckpt),
                                                    list(zip(prompts, ref_tokens)), packed=False)]
    print(f"{args.model}, fp32, {args.threads} threads, {len(prompts)} prompts of the rollout mix, "
          f"greedy, <= {args.max_new_tokens} new tokens; reference: before at batch {sizes[0]}\n")
    print("| engine | batch size | responses equal | max |dlogp| to the reference | "
          "max |dlogp| to teacher-forced |")
    print("|---|---:|---:|---:|---:|")
    for name, run in runs.items():
        for bs in sizes:
            same, d_ref = max_diff(run[bs], ref_tokens, [lp for _, lp in ref])
            _, d_tf = max_diff(run[bs], ref_tokens, forced)
            print(f"| {name} | {bs} | {same}/{len(prompts)} | {d_ref:.2e} | {d_tf:.2e} |")
    print(f"\ncommand: python bench/bench_logprob_floor.py --before {args.before} "
          f"--model {args.model} --prompts {args.prompts} --max-new-tokens {args.max_new_tokens} "
          f"--batch-sizes {args.batch_sizes} --threads {args.threads}")


if __name__ == "__main__":
    main()
