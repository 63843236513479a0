"""The engine's matrix products against oneDNN's with weights packed once (what vLLM-CPU runs),
at SmolLM2's shapes.

    python bench/bench_gemm.py [--rows 32,64] [--threads 2]  # torch's own kernels
    /tmp/vv/bin/python bench/bench_gemm.py  # with vLLM installed: its onednn_mm beside them

GFLOP/s (median of --repeats calls after 3) of F.linear, model.transformer.linear (the engine's: the
split bmm where it pays), torch's oneDNN path with a packed weight
(torch.ops.mkldnn._reorder_linear_weight for --pack-rows rows, then _linear_pointwise) and, where
vLLM imports, vllm._custom_ops.onednn_mm; and each one's largest relative error against fp64.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model.transformer import linear  # noqa: E402

# q/k/v, o, gate/up, down, lm_head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def timed(f, repeats: int) -> float:
    for _ in range(3):
        f()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,64")
    ap.add_argument("--pack-rows", type=int, default=64,
                    help="the row count torch's packed weight is laid out for")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import vllm._custom_ops as ops
    except ImportError:
        ops = None
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads; GFLOP/s (max relative error vs fp64)\n")
    names = (["F.linear", "ours", f"mkldnn packed ({args.pack_rows})"]
             + (["vLLM onednn_mm"] if ops else []))
    print("| weight | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, args.pack_rows)
        handle = ops.create_onednn_mm(w.t(), 32) if ops else None
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=g)
            ref = x.double() @ w.double().t()
            fns = [lambda: F.linear(x, w), lambda: linear(x, w),
                   lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")]
            if ops:
                fns.append(lambda: ops.onednn_mm(handle, x, None))
            cells = []
            for f in fns:
                err = ((f().double() - ref).abs().max() / ref.abs().max()).item()
                cells.append(f"{2 * m * n * k / timed(f, args.repeats) / 1e9:.0f} ({err:.1e})")
            print(f"| {n} x {k} | {m} | " + " | ".join(cells) + " |", flush=True)
    print(f"\ncommand: {Path(sys.executable).name} bench/bench_gemm.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
