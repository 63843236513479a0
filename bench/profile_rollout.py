"""Where one rollout of the native engine spends its time, by part: the weight products, the decode
rows' attention over the cache, the prefill's attention, the sampler, the cache's allocation, and
the rest (norms, rotary, SiLU, cache writes, the scheduler, Python).

    python bench/profile_rollout.py --trace ../shared/trace --prompts 144 --max-new-tokens 96 \
        --temperature 0.1

The prompts and settings are bench_engine.py's (SmolLM2-135M-Instruct or the tiny base, fp32, batch
64, a 4-prompt warm-up, then the timed call). Each part is timed by wrapping the functions that do
it with a clock (no profiler: its per-op overhead would change the split); the CPU's ops are
synchronous, so a wrapper's time is the part's.
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


def timed(owner, name: str, part: str, clock: dict):
    """Replace owner.name by a wrapper that adds its seconds to clock[part] (calls inside another
    timed part are not counted twice)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if clock["_in"]:
            return fn(*args, **kwargs)
        clock["_in"] = True
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock[part] += time.perf_counter() - t0
            clock["_in"] = False
    setattr(owner, name, wrapper)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--ckpt", type=Path,
                    help="a checkpoint instead of --model's (e.g. a trained stage's)")
    ap.add_argument("--trace", type=Path, help="a TRACE root (default: the embedded mix)")
    ap.add_argument("--prompts", type=int, default=144)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from kernels import retain_freed_memory
    retain_freed_memory()
    from bench_engine import checkpoint, mix_prompts
    import engine.engine as engine
    from model.checkpoint import load_model
    import model.transformer as transformer
    ckpt = args.ckpt or checkpoint(args.model)
    prompts, stop = mix_prompts(ckpt, args.prompts, args.trace)
    eng = engine.Engine(load_model(ckpt), max_seqs=args.batch_size)
    kw = dict(temperature=args.temperature, max_new_tokens=args.max_new_tokens, stop_ids=stop,
              progress=False)
    eng.run(prompts[:4], **kw)

    clock = defaultdict(float, _in=False)
    timed(transformer.Packed, "__call__", "weight products", clock)
    timed(transformer, "linear", "weight products", clock)
    timed(engine.Engine, "_attend_rows", "decode rows' attention", clock)  # (the torch path)
    # decode rows, prefixed prompts
    timed(engine.cpu, "cache_attention", "attention over the cache (C)", clock)
    timed(engine, "varlen_attention", "prefill attention", clock)
    timed(engine, "sample", "sampler", clock)
    timed(engine.Engine, "allocate", "cache allocation", clock)
    steps = defaultdict(float, _in=False)  # the same seconds by kind of forward
    timed(engine.Engine, "_forward", "admissions (a prefill, the live rows riding along)", steps)
    timed(engine.Engine, "_decode", "decode steps", steps)
    t0 = time.perf_counter()
    outs = eng.run(prompts, **kw)
    wall = time.perf_counter() - t0
    del clock["_in"], steps["_in"]
    clock["the rest"] = wall - sum(clock.values())
    n_new = sum(len(o["token_ids"]) for o in outs)
    print(f"T {args.temperature}: {wall:.2f} s, {n_new} new tokens, {n_new / wall:.1f} tok/s")
    for part, s in sorted(clock.items(), key=lambda kv: -kv[1]):
        print(f"  {part:24s} {s:6.2f} s  {100 * s / wall:5.1f} %")
    for kind, s in steps.items():
        print(f"  of which in {kind}: {s:.2f} s")


if __name__ == "__main__":
    main()
