"""One layer's decode attention over the KV cache, the engine's two CPU paths side by side: the
masked batched products over the longest live row's span (engine/engine.py's torch path) and
kernels/cpu.c's cache_attention over each row's own span. SmolLM2-135M's heads (9 query, 3 kv,
head_dim 64) by default; each row's position drawn from a range like a rollout's; ms per call,
median of --repeats, the two alternated.

    python bench/bench_cache_attention.py --rows 8 16 32 64 --spans 100 300
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--spans", type=int, nargs=2, default=[100, 300],
                    help="the rows' positions lie in [lo, hi)")
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64],
                    help="query heads, kv heads, head_dim")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    torch.set_num_threads(args.threads)
    from kernels import cpu
    from engine.engine import _row_mask
    if cpu.backend() != "c":
        sys.exit("bench_cache_attention.py: the C kernels are not built here")
    hq, hkv, d = args.heads
    lo, hi = args.spans
    torch.manual_seed(0)
    print(f"{args.threads} threads, heads {hq}/{hkv}, head_dim {d}, positions in [{lo}, {hi}), "
          f"median of {args.repeats}; ms per layer call\n")
    print("| rows | columns read by the products / by C | batched products | C, own spans | "
          "products / C |")
    print("|---:|---:|---:|---:|---:|")
    for n in args.rows:
        k, v = torch.randn(n, hkv, hi, d), torch.randn(n, hkv, hi, d)
        q, pos, slots = torch.randn(n, hq, d), torch.randint(lo, hi, (n,)), torch.arange(n)
        span = int(pos.max()) + 1

        def products():
            mask = _row_mask(pos, span, hkv)  # built per decode step in the engine, as here
            scores = torch.baddbmm(mask, q.view(n, hkv, -1, d).flatten(0, 1),
                                   k[:, :, :span].flatten(0, 1).transpose(1, 2), alpha=d ** -0.5)
            return torch.bmm(torch.softmax(scores, -1), v[:, :, :span].flatten(0, 1)).view(n, -1)

        def c():
            return cpu.cache_attention(q, k, v, slots, pos)
        torch.testing.assert_close(products(), c(), atol=1e-5, rtol=1e-5)
        times = {products: [], c: []}
        for _ in range(args.repeats):
            for f in times:
                t0 = time.perf_counter()
                f()
                times[f].append(time.perf_counter() - t0)
        a, b = (statistics.median(times[f]) * 1e3 for f in (products, c))
        print(f"| {n} | {n * span} / {int((pos + 1).sum())} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    print(f"\ncommand: python bench/bench_cache_attention.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
