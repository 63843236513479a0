"""Compiled blocks on the CPU, one model forward + backward (train.py's packed loss) per step:
eager vs each block through torch.compile(fullgraph=True) with the token dimension dynamic from
the start (train.py --compile's choice: one graph for every micro-batch length) or specialised on
the first length and made dynamic at the first change (torch.compile's default, "auto"). Random
weights, packed documents of 20-200 tokens, a different total length each step (as packed
micro-batches are). Each variant in a fresh process, alternated over --repeats; prints the median
step time (steps 4..N), the first step's time (the compilation) and the first step's loss (the
same in every variant).

    python bench/bench_compile.py          # tiny base shape + SmolLM2-135M's width, 2 threads
    python bench/bench_compile.py --shapes tiny --repeats 3
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (vocab, hidden, intermediate, layers, heads, kv heads, head_dim, tokens per step); SmolLM2-135M's
# width, 6 of its 30 layers (a step of all 30 at 2 threads takes ~15 s)
SHAPES = {"tiny": (1024, 128, 384, 4, 4, 2, 32, 4096),
          "smollm2": (49152, 576, 1536, 6, 9, 3, 64, 2048)}
VARIANTS = ("eager", "dynamic", "auto")


def child(shape: str, variant: str, steps: int):
    import torch
    from model.config import ModelConfig
    from model.transformer import Transformer
    from model.objectives import nll
    v, h, i, layers, heads, kv, hd, tokens = SHAPES[shape]
    cfg = ModelConfig("llama", v, h, i, layers, heads, kv, hd,
                      tie_word_embeddings=shape == "smollm2")
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.tie_weights()
    if variant != "eager":
        for block in model.model.layers:
            block.compile(fullgraph=True, dynamic=True if variant == "dynamic" else None)
    rng = random.Random(0)
    times, loss1 = [], None
    for step in range(steps):
        total = tokens - rng.randint(0, 300)
        lens = []
        while sum(lens) < total - 200:
            lens.append(rng.randint(20, 200))
        lens.append(total - sum(lens))
        ids = torch.randint(0, v, (1, total), generator=torch.Generator().manual_seed(step))
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        t = time.perf_counter()
        loss = model(ids, pos, cu_seqlens=cu, max_seqlen=max(lens), loss=nll(ids))
        loss.backward()
        times.append(time.perf_counter() - t)
        loss1 = loss1 if loss1 is not None else loss.item()
    print(json.dumps({"first_s": times[0], "median_ms": 1e3 * statistics.median(times[3:]),
                      "loss1": loss1}))


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="tiny,smollm2",
                    help="comma list of %s (default: %%(default)s)" % list(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12,
                    help="steps per process; the first 3 are not timed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.steps)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    print(f"`python bench/bench_compile.py {' '.join(sys.argv[1:])}`, "
          f"{args.threads} thread(s), fp32\n")
    print("| shape | variant | median step (ms) | vs eager | first step (s) | step-1 loss |\n"
          "|---|---|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        res = {v: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v in VARIANTS:
                out = subprocess.run([sys.executable, __file__, "--child", shape, v,
                                      "--steps", str(args.steps)],
                                     env=env, capture_output=True, text=True, check=True).stdout
                res[v].append(json.loads(out.strip().splitlines()[-1]))
        eager = statistics.median(r["median_ms"] for r in res["eager"])
        for v, rs in res.items():
            ms = statistics.median(r["median_ms"] for r in rs)
            print(f"| {shape} | {v} | {ms:.1f} | {eager / ms:.2f}x | "
                  f"{statistics.median(r['first_s'] for r in rs):.1f} | {rs[0]['loss1']:.4f} |",
                  flush=True)


if __name__ == "__main__":
    main()
