"""Where a CPU training step of train.py's model spends its time: torch.profiler over steady-state
steps of one micro-batch each (forward with the fused loss, backward, clip, fused AdamW: train.py's
SFT step), on the tiny base's shape (random weights, the embedded mixture) or on SmolLM2-135M (TRACE
records when ../shared/trace has them).

    python bench/profile_train.py           # tiny, 16 documents a step, 2 threads
    python bench/profile_train.py --model smollm2 --steps 3 --threads 2

Prints the median step time and tokens/s without the profiler, then each group's share of the
profiled self CPU time: the matmuls (mm, addmm, bmm), the attention kernels (CPU flash, forward and
backward), the optimizer, and the rest (norms, RoPE, activations, their backwards, autograd's
bookkeeping, Python). The last line is Amdahl's bound: how much faster a step could be if the rest
took no time at all, with the matmuls and attention kernels as they are.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ---- defaults ------------------------------------------------------------------------------------
MODEL = "tiny"
DOCS = 16        # documents per step (bench_train's global batch; one micro-batch)
STEPS = 12       # distinct micro-batches, each timed REPEATS times
REPEATS = 3
THREADS = 2      # the setting; run.py's CPU steps use 1
ROWS = 20
# --------------------------------------------------------------------------------------------------

GROUPS = {"matmuls": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"),
          "attention kernels": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
          "optimizer": ("aten::_fused_adamw_",)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default=MODEL,
                   help="(default: %(default)s)")
    p.add_argument("--docs", type=int, default=DOCS,
                   help="documents per step (default: %(default)s)")
    p.add_argument("--steps", type=int, default=STEPS,
                   help="distinct micro-batches (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help="timed passes over them (default: %(default)s)")
    p.add_argument("--threads", type=int, default=THREADS,
                   help="torch CPU threads (default: %(default)s)")
    p.add_argument("--rows", type=int, default=ROWS,
                   help="rows of the op table (default: %(default)s)")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import kernels
    from bench.bench_train import model_dir, records
    from data.packing import IGNORE, collate, tokenize_sft
    from model.tokenizer import ChatTokenizer
    from model.objectives import nll
    from train import build_model

    kernels.retain_freed_memory()  # as train.py does
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # build_model asks for the world size
    ckpt = model_dir(args.model, Path(tempfile.mkdtemp(prefix="profile-train-")))
    recs, source = records(args.docs * args.steps, real=args.model != "tiny")
    examples, _ = tokenize_sft(recs, ChatTokenizer.from_dir(ckpt), 512)
    batches = [collate(examples[i * args.docs:(i + 1) * args.docs]) for i in range(args.steps)]
    model = build_model(ckpt, torch.device("cpu"), torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(batch):
        ids, pos, tgt, cu, max_len = batch
        total = model(ids, pos, loss=nll(tgt), cu_seqlens=cu, max_seqlen=max_len)
        (total / max(int((tgt != IGNORE).sum()), 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(batches[0])  # warm-up
    times, tokens = [], sum(b[0].numel() for b in batches) / len(batches)
    for _ in range(args.repeats):
        for b in batches:
            t = time.perf_counter()
            step(b)
            times.append(time.perf_counter() - t)
    ms = 1e3 * statistics.median(times)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches:
            step(b)
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    share = {g: sum(e.self_cpu_time_total for e in ev if e.key in names) / total
             for g, names in GROUPS.items()}
    share["rest"] = 1 - sum(share.values())

    print(f"{args.model} ({source}), {args.docs} documents a step ({tokens:.0f} tokens), "
          f"{args.threads} thread(s)")
    print(f"step {ms:.1f} ms (median of {len(times)}), {tokens / ms * 1e3:.0f} tokens/s")
    print("self CPU time under the profiler: "
          + ", ".join(f"{g} {s:.0%}" for g, s in share.items()))
    kept = share["matmuls"] + share["attention kernels"]
    print(f"Amdahl: with the matmuls and attention kernels as they are and everything else free, "
          f"a step would be at most {1 / kept:.2f}x faster")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
