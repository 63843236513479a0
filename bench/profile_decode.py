"""Where a decode step of the native sampler (engine/native.py) spends its time: torch.profiler over
one sample() call on a random-init model of a given shape, on CUDA (bf16) or the CPU (fp32).

    python bench/profile_decode.py --config qwen2.5-1.5b --batch 1  # on a GPU machine
    python bench/profile_decode.py --config tiny --device cpu --batch 4 --new-tokens 16

Prints: wall ms per decode step (prefill excluded: it is timed apart) on its first run ("cold":
every key length is new to the process, as in a real rollout) and on a repeat ("warm": kernels and
plans cached per shape), the ops with the most self CPU time and the most self device time, and how
many host<->device synchronisations a step makes (cudaStreamSynchronize, cudaMemcpyAsync
device->host, cudaDeviceSynchronize). A step whose wall time is far above its device time is bound
by the host (Python and kernel launches), not by the GPU.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_gpu import config_dir, random_init  # noqa: E402

# ---- defaults ------------------------------------------------------------------------------------
CONFIG = "qwen2.5-1.5b"
BATCH = 1
PROMPT_LEN = 150
NEW_TOKENS = 64
ROWS = 25
# --------------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG,
                   help="bench/configs name, 'tiny', or a directory (default: %(default)s)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--batch", type=int, default=BATCH, help="(default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="(default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="(default: %(default)s)")
    p.add_argument("--sdpa", choices=["default", "no-cudnn"], default="default",
                   help="SDPA backends for the decode steps: PyTorch's choice, "
                        "or every one but cuDNN")
    p.add_argument("--rows", type=int, default=ROWS,
                   help="rows per profiler table (default: %(default)s)")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from model.checkpoint import load_config
    from engine.native import sample
    from model.transformer import Transformer

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("profile_decode.py: no CUDA device; use --device cpu")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    with torch.device("meta"):
        model = Transformer(load_config(config_dir(args.config, Path(tempfile.mkdtemp()))))
    model.to_empty(device=device)
    random_init(model, None)
    # frozen, as a loaded checkpoint is: the engine packs it
    model.to(dtype).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.batch)]

    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [b for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                            SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
                if args.sdpa == "default" or b != SDPBackend.CUDNN_ATTENTION]

    def timed(n_new):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        with sdpa_kernel(backends):
            sample(model, prompts, temperature=0.1, max_new_tokens=n_new, batch_size=args.batch,
                   progress=False)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(2)  # warm-up: kernels, allocator, handles
    one = min(timed(1) for _ in range(3))  # prefill + one sample
    # key lengths never seen before
    cold_ms = 1e3 * (timed(args.new_tokens) - one) / (args.new_tokens - 1)
    full = min(timed(args.new_tokens) for _ in range(3))
    step_ms = 1e3 * (full - one) / (args.new_tokens - 1)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:  # warm
        timed(args.new_tokens)
    ev = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in ev) if cuda else 0.0
    syncs = {name: sum(e.count for e in ev if e.key == name)
             for name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                          "aten::item", "aten::_local_scalar_dense", "cudaLaunchKernel")}
    print(f"config {args.config}, {device} {str(dtype).removeprefix('torch.')}, "
          f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"SDPA {args.sdpa}")
    print(f"prefill + first sample {1e3 * one:.1f} ms; decode step cold {cold_ms:.2f} ms "
          f"({args.batch * 1e3 / cold_ms:.1f} new tokens/s), warm {step_ms:.2f} ms "
          f"({args.batch * 1e3 / step_ms:.1f} new tokens/s)")
    if cuda:
        print(f"device time under the profiler: {device_us / 1e3 / args.new_tokens:.2f} ms "
              f"per step ({100 * device_us / 1e3 / args.new_tokens / step_ms:.0f} % "
              f"of the wall step time)")
    print("calls per step: "
          + ", ".join(f"{k} {v / args.new_tokens:.1f}" for k, v in syncs.items()))
    print(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50))
    if cuda:
        print(ev.table(sort_by="self_device_time_total", row_limit=args.rows,
                       max_name_column_width=50))


if __name__ == "__main__":
    main()
