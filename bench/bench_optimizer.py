"""AdamW's step over train.py's model: foreach (one op per tensor list) vs fused (one kernel), on
the tiny base, plus grad-norm clipping for scale. --fsdp wraps the model in FSDP2 as train.py does
for more than one rank (or another compute dtype), where foreach dispatches every op through
DTensor; without it, the plain module train.py trains in a world of one in fp32.

    python bench/bench_optimizer.py [--steps 50] [--repeats 5] [--threads 1]

Builds the model as train.py does (train.build_model, a world of one), sets zero gradients, and
times opt.step() for each variant, variants alternated, --repeats times, 3 warm-up steps each;
prints the median ms per step and the ratio.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fsdp", action="store_true",
                   help="wrap the model in FSDP2 (DTensor parameters)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    import train
    from model.base import ensure_base
    torch.set_num_threads(args.threads)
    _, _, device = train.setup_distributed()
    model = train.build_model(ensure_base("tiny"), device, torch.float32, shard=args.fsdp)
    for q in model.parameters():
        q.grad = torch.zeros_like(q)

    times = {"foreach": [], "fused": [], "clip": []}
    for _ in range(args.repeats):
        for kind in ("foreach", "fused"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{kind: True})
            for _ in range(3):
                opt.step()
            t = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            times[kind].append((time.perf_counter() - t) / args.steps * 1e3)
        t = time.perf_counter()
        for _ in range(args.steps):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        times["clip"].append((time.perf_counter() - t) / args.steps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"load average "
          f"{open('/proc/loadavg').read().split()[0] if os.path.exists('/proc/loadavg') else '?'}")
    print(f"| AdamW step | median ms (tiny base, {'FSDP2' if args.fsdp else 'plain module'}, "
          f"world 1) |\n|---|---:|")
    print(f"| foreach | {med['foreach']:.2f} |\n"
          f"| fused | {med['fused']:.2f} ({med['foreach'] / med['fused']:.1f}x) |")
    print(f"| (clip_grad_norm_, for scale) | {med['clip']:.2f} |")


if __name__ == "__main__":
    main()
