"""A matmul of a few rows on the CPU: torch.nn.Linear vs model.transformer.Linear, whose sampling
path multiplies by the weight's two row halves in one bmm, per (fused) weight shape of SmolLM2-135M
and of the tiny base.

    python bench/bench_linear.py [--threads 2] [--rows 1,2,4,8,16,37,64,128,512] [--repeats 5]

Each call reads a different weight of a pool larger than the caches, as a decode step reads
each layer's weight once; both modules hold the same weights and are called as modules, under
torch.no_grad. Prints microseconds per call (median of --repeats timings, the two alternated)
and the ratio; '*' marks the shapes and row counts where Linear takes the split path
(model.transformer.split_rows: a few rows, or up to SPLIT_MAX_ROWS_LARGE rows of a large
weight padded to a multiple of SPLIT_ROW_MULTIPLE); elsewhere it calls F.linear as nn.Linear
does, after its checks.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.transformer import Linear, split_rows  # noqa: E402

SHAPES = {  # (out, in) of each projection
    "SmolLM2-135M": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576),
                     "down": (576, 1536), "lm_head": (49152, 576)},
    "tiny base": {"qkv": (256, 128), "o": (128, 128), "gate_up": (768, 128), "down": (128, 384),
                  "lm_head": (1024, 128)},
}


def per_call(fn, weights, x, calls):
    """Seconds per call of fn(x, w), cycling through `weights`."""
    t = time.perf_counter()
    for i in range(calls):
        fn(x, weights[i % len(weights)])
    return (time.perf_counter() - t) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,37,64,128,512")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {args.threads} thread(s); us per call, nn.Linear / Linear "
          f"(ratio); * = split path\n")
    for model, shapes in SHAPES.items():
        print(f"| {model}: rows | " + " | ".join(shapes) + " |")
        print("|---:|" + "---:|" * len(shapes))
        pools = {}
        for name, (n, k) in shapes.items():
            ours = [Linear(k, n, bias=False) for _ in range(max(1, int(64e6 // (n * k * 4))))]
            stock = [torch.nn.Linear(k, n, bias=False) for _ in ours]
            for a, b in zip(stock, ours):
                a.weight = b.weight
            pools[name] = stock, ours
        for m in rows:
            cells = []
            for name, (n, k) in shapes.items():
                stock, ours = pools[name]
                x = torch.randn(m, k)
                calls = max(20, int(2e8 // (n * k * 4)))
                call = lambda x, layer: layer(x)  # noqa: E731
                with torch.no_grad():
                    # warm-up: every weight touched, every path taken once
                    for layer in stock + ours:
                        call(x, layer)
                    ta, tb = [], []
                    for _ in range(args.repeats):
                        ta.append(per_call(call, stock, x, calls))
                        tb.append(per_call(call, ours, x, calls))
                a, b = statistics.median(ta), statistics.median(tb)
                split = split_rows(m, ours[0].weight) > 0
                cells.append(f"{a * 1e6:.0f} / {b * 1e6:.0f} ({a / b:.2f}x){' *' if split else ''}")
            print(f"| {m} | " + " | ".join(cells) + " |", flush=True)
        print()
    print(f"command: python bench/bench_linear.py --threads {args.threads} --rows {args.rows} "
          f"--repeats {args.repeats}")


if __name__ == "__main__":
    main()
