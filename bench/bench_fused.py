"""Fused projections in training on the CPU: q/k/v (and gate/up) as three (two) F.linear calls vs
one call over the concatenated weight, forward + backward (input and weight gradients), fp32, at the
tiny base's and SmolLM2-135M's shapes and packed micro-batches of 2,048 and 8,192 tokens. The two
are alternated --repeats times; prints the median milliseconds of each and the ratio.
(model/transformer.py trains and samples the fused form.)

    python bench/bench_fused.py [--threads 2] [--repeats 5]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # hidden size, rows of each projection of the group
    ("tiny base", "q/k/v"): (128, (128, 64, 64)),
    ("tiny base", "gate/up"): (128, (384, 384)),
    ("SmolLM2-135M", "q/k/v"): (576, (576, 192, 192)),
    ("SmolLM2-135M", "gate/up"): (576, (1536, 1536)),
}


def timings(hidden: int, outs: tuple, tokens: int, repeats: int, calls: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    ws = [torch.randn(o, hidden, generator=g, requires_grad=True) for o in outs]
    fused = torch.cat([w.detach() for w in ws]).requires_grad_()
    grads = [torch.randn(tokens, o, generator=g) for o in outs]
    grad_fused = torch.cat(grads, 1)

    def separate():
        torch.autograd.backward([F.linear(x, w) for w in ws], grads)

    def one():
        F.linear(x, fused).backward(grad_fused)

    out = {"separate": [], "fused": []}
    for _ in range(repeats):
        for name, f in (("separate", separate), ("fused", one)):
            f()  # warm
            t = time.perf_counter()
            for _ in range(calls):
                f()
            out[name].append((time.perf_counter() - t) / calls * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"`python bench/bench_fused.py --threads {args.threads} --repeats {args.repeats}`, fp32, "
          f"forward + backward\n")
    print("| model | group | tokens | separate (ms) | fused (ms) | separate / fused |\n"
          "|---|---|---:|---:|---:|---:|")
    for (model, group), (hidden, outs) in SHAPES.items():
        for tokens in (2048, 8192):
            calls = max(2, int(2e9 / (6 * tokens * hidden * sum(outs))))  # ~2 GFLOP per timing
            t = timings(hidden, outs, tokens, args.repeats, calls)
            print(f"| {model} | {group} | {tokens} | {t['separate']:.2f} | {t['fused']:.2f} | "
                  f"{t['separate'] / t['fused']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
