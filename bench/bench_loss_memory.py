"""Peak memory and time of the LM loss forward+backward: naive (materialised [N, V] logits) vs
kernels.fused_linear_cross_entropy. Defaults: Qwen2.5-0.5B's vocab 151,936 and hidden 896,
8,192 tokens, fp32.

Each variant runs in a fresh subprocess: torch's CPU allocations are invisible to tracemalloc, so
the peak is the process RSS high-water mark (getrusage ru_maxrss) minus its value right after the
inputs were allocated. It includes the [V, H] weight gradient, which both variants must produce.

    python bench/bench_loss_memory.py              # loss: naive vs fused
    python bench/bench_loss_memory.py \
        --target-share 0.1                         # ... when 90% of the tokens are prompt (ignored)
    python bench/bench_loss_memory.py --tokens 1400 --vocab 49152 --hidden 576 \
        --target-share 0.1                         # SmolLM2
    python bench/bench_loss_memory.py --attention  # varlen SDPA: 4-D + enable_gqa vs 3-D variants
"""

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_high_water_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def available_mb() -> float:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


def child(variant: str, tokens: int, vocab: int, hidden_size: int, repeats: int,
          target_share: float) -> dict:
    from kernels import cross_entropy

    cross_entropy.set_backend("chunked")  # the CPU path; on CUDA the wrapper would call liger
    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    # Filled in place: a `0.02 * randn` temporary would raise the baseline
    # high-water mark by [V, H].
    weight = torch.empty(vocab, hidden_size).normal_(0, 0.02).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[torch.rand(tokens) >= target_share] = -100  # the prompt tokens, as in SFT

    def step():
        if variant == "naive":
            loss = F.cross_entropy(hidden @ weight.T, labels, reduction="sum", ignore_index=-100)
        else:
            loss = cross_entropy.fused_linear_cross_entropy(hidden, weight, labels)
        loss.backward()
        return loss.item()

    baseline = rss_high_water_mb()
    times, loss = [], None
    for _ in range(repeats):
        hidden.grad = weight.grad = None
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "peak_mb": rss_high_water_mb() - baseline, "times": times,
            "loss": loss}


def run_loss(args) -> None:
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    rows = []
    for variant in ("naive", "fused"):
        need_mb = 4 * logits_mb if variant == "naive" else 0
        if need_mb > available_mb():
            print(f"skipping {variant}: needs ~{need_mb:.0f} MB, {available_mb():.0f} MB available")
            continue
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--repeats",
               str(args.repeats), "--target-share", str(args.target_share)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"\nLoss forward+backward, N={args.tokens} tokens, V={args.vocab}, H={args.hidden}, "
          f"fp32, CPU, {args.target_share:.0%} of them targets, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}; "
          f"fp32 [N, V] logits alone = {logits_mb:.0f} MB")
    print(f"command: python bench/bench_loss_memory.py --tokens {args.tokens} --vocab {args.vocab} "
          f"--hidden {args.hidden} --repeats {args.repeats} --target-share {args.target_share}\n")
    print("| variant | peak memory above inputs (MB) | time fwd+bwd (s), median | loss |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['peak_mb']:.0f} | {statistics.median(r['times']):.2f} | "
              f"{r['loss']:.4f} |")
    by = {r["variant"]: r for r in rows}
    if "naive" in by:
        naive, fused = by["naive"], by["fused"]
        print(f"\nfused / naive: peak memory {fused['peak_mb'] / naive['peak_mb']:.1%}, "
              f"time {statistics.median(fused['times']) / statistics.median(naive['times']):.2f}x")


def run_attention(args) -> None:
    """Why kernels/attention.py feeds SDPA 4-D per-document tensors with enable_gqa: on CPU
    those take the flash kernel; 3-D ones (with or without the kv heads repeated by hand)
    take the math path."""
    from kernels.attention import _sdpa, _sdpa_loop
    torch.manual_seed(0)

    def attend_3d(q, k, v, cu, repeat):
        n_rep = q.shape[1] // k.shape[1]
        if repeat:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        bounds = cu.tolist()
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            qd, kd, vd = (x[s:e].transpose(0, 1) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                       enable_gqa=not repeat)
                        .transpose(0, 1))
        return torch.cat(outs)

    def attend_padded(q, k, v, cu):
        # one SDPA call: every document right-padded to the longest, [n_docs, H, L, D], is_causal.
        # Exact for the real positions (a query sees only earlier keys, never the padding after it);
        # the padded rows are dropped
        lens = cu[1:] - cu[:-1]
        ar = torch.arange(int(lens.max()), dtype=torch.int32)
        valid = ar[None] < lens[:, None]
        idx = torch.where(valid, cu[:-1, None] + ar[None], 0).long()
        qp, kp, vp = (x[idx].transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)[valid]

    variants = {"3-D, kv repeated (before)": lambda *a: attend_3d(*a, repeat=True),
                "3-D, enable_gqa": lambda *a: attend_3d(*a, repeat=False),
                "4-D, enable_gqa, autograd loop":  # before
                    lambda q, k, v, cu: _sdpa_loop(q, k, v, cu.tolist()),
                "4-D, one autograd node (kernels/attention.py)":
                    lambda q, k, v, cu: _sdpa(q, k, v, cu, None),
                "one call, documents padded": attend_padded}
    print(f"\nvarlen SDPA fwd+bwd per packed micro-batch, CPU fp32, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeats}, variants alternated")
    print(f"command: python bench/bench_loss_memory.py --attention --repeats {args.repeats}\n")
    print("| shape | " + " | ".join(f"{v} (ms)" for v in variants)
          + " | 3-D repeated / now | loop / now |")
    print("|---|" + "---:|" * (len(variants) + 2))
    rng = random.Random(0)
    mixed = [rng.randint(20, 90) for _ in range(16)]
    shapes = {"tiny base: 16 docs of 51 tokens, 4/2 heads, dim 32": ([51] * 16, 4, 2, 32),
              f"tiny base: 16 docs of 20-90 tokens ({sum(mixed)} in all), 4/2 heads, dim 32":
                  (mixed, 4, 2, 32),
              "SmolLM2: docs [300, 512, 97, 1, 640, 498], 9/3 heads, dim 64":
                  ([300, 512, 97, 1, 640, 498], 9, 3, 64)}
    for name, (lengths, hq, hkv, d) in shapes.items():
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        q = torch.randn(sum(lengths), hq, d, requires_grad=True)
        k = torch.randn(sum(lengths), hkv, d, requires_grad=True)
        v = torch.randn(sum(lengths), hkv, d, requires_grad=True)
        ref = variants["3-D, kv repeated (before)"](q, k, v, cu)
        for f in variants.values():  # all agree
            assert (f(q, k, v, cu) - ref).abs().max() < 1e-5
        ts = {m: [] for m in variants}
        for _ in range(args.repeats):
            for m, f in variants.items():
                f(q, k, v, cu).sum().backward()  # warm-up
                t0 = time.perf_counter()
                f(q, k, v, cu).sum().backward()
                ts[m].append(1e3 * (time.perf_counter() - t0))
        ms = {m: statistics.median(t) for m, t in ts.items()}
        now = ms["4-D, one autograd node (kernels/attention.py)"]
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in ms.values()) +
              f" | {ms['3-D, kv repeated (before)'] / now:.2f}x | "
              f"{ms['4-D, enable_gqa, autograd loop'] / now:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-share", type=float, default=0.9,
                   help="share of the tokens with a target, the rest ignored like prompt tokens "
                        "(default: %(default)s)")
    p.add_argument("--attention", action="store_true", help="compare SDPA GQA variants instead")
    p.add_argument("--child", choices=["naive", "fused"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.repeats,
                               args.target_share)))
    elif args.attention:
        run_attention(args)
    else:
        run_loss(args)


if __name__ == "__main__":
    main()
