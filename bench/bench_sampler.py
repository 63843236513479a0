"""The sampler's per-step cost on real next-token distributions: greedy, and temperature 0.1 and 1.0
with the full Gumbel-max draw (every vocabulary entry's noise, in one piece: the sampler before
2026-11-28) and with today's engine.sampler.sample (noise only for the tokens that can win; the full
draw a few rows at a time where most can).

    python bench/bench_sampler.py [--model smollm2] [--trace ../shared/trace] [--rows 16,32,64]
        [--threads 2]

The logits are SmolLM2's (fp32) at every response position of T 0.1 and T 1.0 rollouts of real TRACE
training prompts (--trace; the embedded tasks without it), so the candidate counts are a real
model's; each timed call samples --rows rows drawn from the pool of its temperature (median of
--repeats calls). Also checks that both draws pick the same tokens on every pooled row.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def full_sample(logits, temperature, keys, counters):
    """The sampler before: the whole [n, V] noise tensor at once (engine.engine's full
    draw in one piece)."""
    from engine.sampler import _full_draw
    logits = logits.float()
    tokens = _full_draw(logits, temperature, keys, counters, rows=len(logits))
    return tokens, logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def pool(model, prompts, stop, temperature, max_new_tokens):
    """fp32 logits [positions, V] at every response position of one rollout of `prompts`."""
    from engine.engine import Engine
    outs = Engine(model, max_seqs=len(prompts)).run(prompts, temperature=temperature, stop_ids=stop,
                                                    seed=0, max_new_tokens=max_new_tokens,
                                                    progress=False)
    w, rows = model.lm_head.weight, []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor(p + o["token_ids"])
            h = model(ids[None], torch.arange(len(ids))[None],
                      cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32),
                      max_seqlen=len(ids), return_hidden=True)[0]
            rows.append((h[len(p) - 1:-1] @ w.T).float())
    return torch.cat(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--trace", type=Path,
                    help="TRACE root for real prompts (default: the embedded tasks)")
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kernels import retain_freed_memory
    # as the scripts that sample do (rollout.py, evaluate.py, train.py): freed pages reused
    retain_freed_memory()
    from bench_engine import checkpoint, mix_prompts
    from model.checkpoint import load_model
    from engine.sampler import sample
    ckpt = checkpoint(args.model)
    prompts, stop = mix_prompts(ckpt, args.prompts, args.trace)
    model = load_model(ckpt).eval()
    pools = {t: pool(model, prompts, stop, t, args.max_new_tokens) for t in (0.1, 1.0)}
    g = torch.Generator().manual_seed(0)
    # the same tokens on every pooled row, keyed as the engine keys them
    for t, lg in pools.items():
        keys, ctr = (torch.randint(0, 1 << 62, (len(lg),), generator=g),
                     torch.randint(0, 512, (len(lg),), generator=g))
        assert torch.equal(sample(lg, t, keys, ctr)[0], full_sample(lg, t, keys, ctr)[0]), t
        assert torch.equal(sample(lg, t, keys, ctr)[1], full_sample(lg, t, keys, ctr)[1]), t

    def timed(fn, lg, t, n):
        ts = []
        for _ in range(args.repeats):
            idx = torch.randint(0, len(lg), (n,), generator=g)
            x, keys, ctr = (lg[idx].contiguous(), torch.randint(0, 1 << 62, (n,), generator=g),
                            torch.zeros(n, dtype=torch.long))
            t0 = time.perf_counter()
            fn(x, t, keys, ctr)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    print(f"{args.model}, vocab {pools[0.1].shape[1]}, {args.threads} threads, "
          f"logits of {len(prompts)} {'TRACE' if args.trace else 'embedded'} prompts' rollouts "
          f"({len(pools[0.1])} positions at T 0.1, {len(pools[1.0])} at T 1.0), "
          f"median of {args.repeats} calls; ms per sampling step\n")
    print("| rows | greedy | T 0.1 full draw | T 0.1 now | T 1.0 full draw | T 1.0 now | "
          "T 0.1 now / greedy | T 1.0 now / greedy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in args.rows.split(",")]:
        greedy = timed(sample, pools[0.1], 0.0, n)
        cells = [timed(fn, pools[t], t, n) for t in (0.1, 1.0) for fn in (full_sample, sample)]
        print(f"| {n} | {greedy:.2f} | " + " | ".join(f"{c:.2f}" for c in cells)
              + f" | {cells[1] / greedy:.1f}x | {cells[3] / greedy:.1f}x |", flush=True)
    print(f"\ncommand: python bench/bench_sampler.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
