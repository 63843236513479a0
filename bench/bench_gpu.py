"""GPU benchmark: train.py's step (FSDP2, packed, bf16) tokens/s per GPU, MFU and peak memory for
model shapes given as HF config.json files (random init: no weights needed), and the native
engine's rollout tokens/s.

    python bench/bench_gpu.py                     # every config in bench/configs, every GPU
    python bench/bench_gpu.py --configs qwen2.5-7b,llama-3.1-8b --mixes trace --ac on
    python bench/bench_gpu.py --device cpu --configs tiny --steps 2 \
        --rollout-new-tokens 8                    # CPU smoke test

Training grid: config x length mix x activation checkpointing (off/on) x compiled blocks (train.py
--compile, off/on) x attention backend x cross-entropy backend (only the backends that can run here;
compiled rows only with a varlen kernel, as train.py requires). --micro-tokens auto takes train.py's
default on a GPU: the most that fit its memory. Each variant runs in a fresh process -- torchrun
with one rank per GPU -- so kernel backends are chosen at import (KERNELS_ATTN_BACKEND /
KERNELS_CE_BACKEND) and peak memory is the variant's own. The worker builds the model exactly as
train.py does (train.build_model: meta -> compiled blocks, when the row is compiled -> fully_shard
-> materialise), with random weights instead of a checkpoint, and times train.py's step:
--global-batch documents packed into --micro-tokens micro-batches (data.packing.pack/collate), loss
inside forward, backward, clip, AdamW.
  tokens/s per GPU  document tokens of the timed steps / seconds / world size (after --warmup steps)
  MFU               tokens/s per GPU x FLOPs per token (model.costs.flops_per_token,
                    train.py's count: recomputation under activation checkpointing is not
                    model FLOPs) / --peak-tflops
  peak memory       torch.cuda.max_memory_allocated (CPU: the process's max RSS)
  warm-up seconds   the --warmup steps' wall time: compiled, the compilation's cost per
                    process (keep --warmup >= 1 for compiled rows, or the compilation
                    lands in the timed steps)
Length mixes ("TRACE-like"): document lengths drawn around pipeline.paper.PAPER_TASKS' per-task means
(+-50 %), weighted by what each task contributes to training (examples x epochs): "trace" all
eight tasks, "short" the classification and arithmetic tasks, "long" MeetingBank and 20Minuten
(capped at --max-len).
Rollouts: the native engine (engine/engine.py) on one GPU, random weights (so no row stops by
itself): prompts of the "trace" mix's prompt lengths with --rollout-new-tokens new tokens each at
batch 1 / 32 / 256, and the rollout mix (--rollout-mix-prompts prompts whose answer lengths also
follow the mix: short letters next to long summaries), with the engine's CUDA graphs on, off or
both (--rollout-graphs); new tokens/s, time to drain, and with --profile the GPU's busy share.
Results: one JSON line per variant in --out, and a markdown table on stdout.
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ---- defaults ------------------------------------------------------------------------------------
CONFIGS = "qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b,llama-3.1-8b"  # directories under bench/configs
                                                               # ("tiny": model.base)
MIXES = "trace,short,long"
GLOBAL_BATCH = 128       # documents per optimizer step (train.py's default)
MICRO_TOKENS = 16384     # train.py's default on the CPU (on a GPU: --micro-tokens auto)
MAX_LEN = 2048
STEPS = 6                # timed optimizer steps per variant
WARMUP = 2               # untimed steps first (allocator, autotuning)
ROLLOUT_BATCHES = "1,32,256"
ROLLOUT_NEW_TOKENS = 256
ROLLOUT_MIX_PROMPTS = 1024  # the rollout mix: TRACE-like prompt and answer lengths (answers
                            # capped at the above)
PEAK_TFLOPS = 989.0      # H100 SXM bf16 dense
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke test (fp32, one process)")
    p.add_argument("--configs", default=CONFIGS,
                   help="comma list of bench/configs names, 'tiny', or directories holding a "
                        "config.json (default: %(default)s)")
    p.add_argument("--mixes", default=MIXES,
                   help="length mixes: trace, short, long (default: %(default)s)")
    p.add_argument("--ac", choices=["off", "on", "both"], default="both",
                   help="activation checkpointing")
    p.add_argument("--attn", default="all",
                   help="attention backends (comma list, or all that can run here)")
    p.add_argument("--ce", default="all",
                   help="cross-entropy backends (comma list, or all that can run here)")
    p.add_argument("--gpus", type=int,
                   help="ranks per training variant (default: every visible GPU)")
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="(default: %(default)s)")
    p.add_argument("--micro-tokens", default=str(MICRO_TOKENS),
                   type=lambda v: v if v == "auto" else str(int(v)),
                   help="tokens per micro-batch, or auto: train.py's rule (default: %(default)s)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="both",
                   help="train.py --compile: each block compiled (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=MAX_LEN, help="(default: %(default)s)")
    p.add_argument("--steps", type=int, default=STEPS,
                   help="timed steps per variant (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=WARMUP,
                   help="untimed steps first (default: %(default)s)")
    p.add_argument("--rollout-batches", default=ROLLOUT_BATCHES,
                   help="(default: %(default)s); '' skips rollouts")
    p.add_argument("--rollout-new-tokens", type=int, default=ROLLOUT_NEW_TOKENS,
                   help="(default: %(default)s)")
    p.add_argument("--rollout-mix-prompts", type=int, default=ROLLOUT_MIX_PROMPTS,
                   help="prompts of the rollout-mix row, 0 = no such row (default: %(default)s)")
    p.add_argument("--rollout-graphs", choices=["on", "off", "both"], default="on",
                   help="the engine's CUDA graphs for the rollout rows "
                        "(off: OPR_ENGINE_GRAPHS=0; default: on)")
    p.add_argument("--profile", action="store_true",
                   help="rollout rows on a GPU: a third, profiled call for the busy share "
                        "(after the timed one)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                   help="for MFU (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_gpu.jsonl",
                   help="JSON lines, one per variant (default: %(default)s)")
    p.add_argument("--timeout", type=int, default=1800,
                   help="seconds per variant before it is recorded as failed")
    p.add_argument("--worker", choices=["train", "rollout"], help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--mix", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ac-on", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile-on", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_dir(name: str, tmp: Path) -> Path:
    """A directory holding config.json: bench/configs/<name>, 'tiny' (model.base.TINY, written
    to tmp), or a path."""
    if name == "tiny":
        from model.base import TINY
        d = tmp / "tiny"
        d.mkdir(exist_ok=True)
        cfg = {"model_type": "llama", "hidden_act": "silu",
               "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"], **TINY}
        (d / "config.json").write_text(json.dumps(cfg))
        return d
    d = REPO / "bench" / "configs" / name
    d = d if d.is_dir() else Path(name)
    if not (d / "config.json").is_file():
        raise SystemExit(f"bench_gpu.py: --configs: no config.json for {name!r} (looked in {d})")
    return d


def mix_lengths(mix: str, n: int, max_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """n (document length, answer length) pairs of a TRACE-like mix (see the module docstring)."""
    from data.tasks import get_task
    from model.costs import TEMPLATE_ANSWER
    from pipeline.paper import PAPER_TASKS
    tasks = {"trace": list(PAPER_TASKS), "long": ["MeetingBank", "20Minuten"],
             "short": ["C-STANCE", "FOMC", "ScienceQA", "NumGLUE-cm", "NumGLUE-ds"]}.get(mix)
    if tasks is None:
        raise SystemExit(f"bench_gpu.py: unknown --mixes entry {mix!r} (known: trace, short, long)")
    rng = random.Random(seed)
    weights = [PAPER_TASKS[t][0] * get_task(t).epochs for t in tasks]
    out = []
    for t in rng.choices(tasks, weights, k=n):
        _, prompt, answer, _ = PAPER_TASKS[t]
        p = max(8, round(prompt * rng.uniform(0.5, 1.5)))
        a = max(1, round(answer * rng.uniform(0.5, 1.5))) + TEMPLATE_ANSWER
        out.append((min(p + a, max_len), min(a, max_len - 1)))
    return out


# ------------------------------------------------------------------------------------------ workers

def random_init(model, ckpt_dir):
    """Stands in for model.checkpoint.load_into in build_model (model/fsdp.py): N(0, 0.02)
    matrices, unit norms, zero biases."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    model.tie_weights()


def train_worker(args):
    import torch
    import torch.distributed as dist
    import train
    from data.packing import IGNORE, Example, collate, pack
    from kernels import attention, cross_entropy
    from model import fsdp
    from model.objectives import nll
    from model.costs import flops_per_token

    rank, world, device = train.setup_distributed()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fsdp.load_into = random_init  # train.build_model, with random weights, not a checkpoint's
    opts = argparse.Namespace(
        compile=args.compile_on, model=args.config, activation_checkpointing=args.ac_on,
        max_len=args.max_len,
        micro_tokens=None if args.micro_tokens == "auto" else int(args.micro_tokens))
    # --micro-tokens auto: train.py's rule
    train.device_defaults(opts, device, rank, world, dtype, {})
    args.micro_tokens = opts.micro_tokens
    model = train.build_model(args.config, device, dtype, args.ac_on, compile=args.compile_on)
    cfg = model.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    n_steps = args.warmup + args.steps
    docs = mix_lengths(args.mix, n_steps * args.global_batch, args.max_len)
    g = torch.Generator().manual_seed(0)
    examples = []
    for length, answer in docs:
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
        examples.append(Example(ids, [IGNORE] * (length - answer) + ids[length - answer + 1:]
                                + [IGNORE]))
    lengths = [len(e.ids) for e in examples]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = tokens = 0
    t_warm, warmup_seconds = time.perf_counter(), 0.0
    for step in range(n_steps):
        if step == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0, tokens = time.perf_counter(), 0
            warmup_seconds = t0 - t_warm
        batch = list(range(step * args.global_batch, (step + 1) * args.global_batch))
        n_targets = sum(examples[i].n_targets for i in batch)
        for mb in pack(batch, lengths, args.micro_tokens, world)[rank]:
            ids, pos, tgt, cu, max_len = collate([examples[i] for i in mb], device)
            (model(ids, pos, loss=nll(tgt), cu_seqlens=cu,
                   max_seqlen=max_len) / n_targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += sum(lengths[i] for i in batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = torch.tensor(float(torch.cuda.max_memory_allocated() if device.type == "cuda"
                              else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    mean_doc = sum(lengths) / len(lengths)
    tok_s_gpu = tokens / seconds / world
    if rank == 0:
        print("RESULT " + json.dumps({
            "kind": "train", "world": world,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "attention": attention.describe(),
            "cross_entropy": cross_entropy.get_backend(), "mean_doc": round(mean_doc, 1),
            "tokens_per_s_per_gpu": round(tok_s_gpu, 1),
            "mfu": tok_s_gpu * flops_per_token(cfg, mean_doc) / (args.peak_tflops * 1e12),
            "peak_memory_gb": round(peak.item() / 1e9, 2), "timed_steps": args.steps,
            "seconds": round(seconds, 2), "compiled": args.compile_on,
            "micro_tokens": args.micro_tokens, "warmup_seconds": round(warmup_seconds, 1)}),
            flush=True)
    dist.destroy_process_group()


def rollout_worker(args):
    """The engine on one device, random weights (no row stops by itself): --batch prompts of the
    "trace" mix's prompt lengths with --rollout-new-tokens each, or with --batch 0 the rollout mix:
    --rollout-mix-prompts prompts whose prompt AND answer lengths follow the mix (each prompt capped
    at its own answer length, as a stop token would end it). Reports new tokens/s and the time to
    drain of a second call over the same engine (the first one allocates the KV cache and captures
    the CUDA graphs; its time is reported beside) and, with --profile on a GPU, the busy share: CUDA
    kernel time over wall time in a profiled third call."""
    import torch
    from model.checkpoint import load_config
    from model.transformer import Transformer

    cuda = args.device == "cuda"
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    with torch.device("meta"):
        model = Transformer(load_config(args.config))
    model.to_empty(device=device)
    random_init(model, None)
    model.to(dtype).eval().requires_grad_(False)
    if args.batch:
        lengths = [(p - a, args.rollout_new_tokens)
                   for p, a in mix_lengths("trace", args.batch, args.max_len, seed=1)]
        batch = args.batch
    else:
        lengths = [(p - a, min(a, args.rollout_new_tokens)) for p, a in
                   mix_lengths("trace", args.rollout_mix_prompts, args.max_len, seed=1)]
        batch = None  # the engine's default: the machine's
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
               for n, _ in lengths]
    caps = [a for _, a in lengths]
    from engine.engine import Engine
    from engine.native import default_batch_size
    engine = Engine(model,
                    max_seqs=min(batch or default_batch_size(model, max(n + a for n, a in lengths)),
                                 len(prompts)))
    kw = dict(temperature=0.1, max_new_tokens=caps, progress=False)

    def timed():
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = engine.run(prompts, **kw)
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t
    # the first call allocates the KV cache and captures the CUDA graphs (once per batch bucket and
    # span); the engine keeps both, so the second call, the one reported, measures the steady state
    _, first = timed()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    outs, seconds = timed()
    new = sum(len(o["token_ids"]) for o in outs)
    result = {
        "kind": "rollout", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "batch": args.batch or "mix",
        "prompts": len(prompts), "graphs": engine.graphs, "new_tokens": new,
        "mean_prompt": round(sum(n for n, _ in lengths) / len(lengths), 1),
        "seconds": round(seconds, 2), "first_call_seconds": round(first, 2),
        "new_tokens_per_s": round(new / seconds, 1), "busy_share": None,
        "peak_memory_gb": round((torch.cuda.max_memory_allocated() if cuda
                                 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
                                / 1e9, 2)}
    # before any profiling: a profiler hang cannot lose it
    print("RESULT " + json.dumps(result), flush=True)
    # a third call under the profiler: the kernels' time against the wall time
    if cuda and args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _, wall = timed()
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        print("RESULT " + json.dumps(dict(result, busy_share=round(kernel_us / 1e6 / wall, 3))),
              flush=True)


# ------------------------------------------------------------------------------------------- driver

def backends(kind: str, wanted: str, device: str) -> list[str]:
    """The backends of `kind` (attn, ce) to run: every one that can run here, or the
    requested ones, each of which must be able to (a requested backend that cannot run is an
    error, not an empty table)."""
    if device == "cpu":  # the CPU path: the pure-torch kernels only
        return ["sdpa"] if kind == "attn" else ["chunked"]
    code = ("from kernels import attention as a; "
            "print(','.join(b for b in a.BACKENDS if a.available(b) is None))"
            if kind == "attn" else
            "from kernels import cross_entropy as c; "
            "print('liger,chunked' if c._load_liger() else 'chunked')")
    runnable = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip().split(",")
    if wanted == "all":
        return runnable
    missing = [b for b in wanted.split(",") if b not in runnable]
    if missing:
        raise SystemExit(f"bench_gpu.py: --{kind}: {','.join(missing)} cannot run here "
                         f"(runnable: {','.join(runnable)})")
    return wanted.split(",")


def run_variant(cmd: list[str], env: dict, timeout: int) -> dict:
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    # a result printed before the hang (e.g. in a profiled call) still counts
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        return (json.loads(lines[-1][len("RESULT "):]) if lines
                else {"error": f"timed out after {timeout}s"})
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": ("out of memory" if "out of memory" in p.stderr.lower()
                          else tail[0])[:300]}
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None):
    args = parse_args(argv)
    if args.worker == "train":
        return train_worker(args)
    if args.worker == "rollout":
        return rollout_worker(args)
    import torch
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device; use --device cpu for the smoke test")
    gpus = 1 if args.device == "cpu" else (args.gpus or torch.cuda.device_count())
    tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # rollout rows only: no kernel probes (two processes) to pay for
    training = any(args.mixes.split(","))
    attn, ce = ((backends("attn", args.attn, args.device), backends("ce", args.ce, args.device))
                if training else ([], []))
    switch = {"off": [False], "on": [True], "both": [False, True]}
    acs, compiles = switch[args.ac], switch[args.compile]
    launcher = [sys.executable] if gpus == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                   "--standalone", f"--nproc_per_node={gpus}"]
    common = (["--global-batch", str(args.global_batch), "--micro-tokens", str(args.micro_tokens),
               "--max-len", str(args.max_len), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--peak-tflops", str(args.peak_tflops),
               "--device", args.device, "--rollout-new-tokens", str(args.rollout_new_tokens)]
              + (["--profile"] if args.profile else []))
    results = []
    with open(out, "a") as f:
        def record(r):
            results.append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()
            print(json.dumps(r), flush=True)

        for name in args.configs.split(","):
            cdir = config_dir(name, tmp)
            for mix in [m for m in args.mixes.split(",") if m]:  # '' : rollout rows only
                mix_lengths(mix, 1, args.max_len)  # an unknown mix fails here, before any run
                for ac in acs:
                    for comp in compiles:
                        for a in attn:
                            if comp and args.device == "cuda" and a == "sdpa":
                                continue  # train.py compiles on CUDA only with a varlen kernel
                            for c in ce:
                                cmd = (launcher
                                       + [str(Path(__file__).resolve()), "--worker", "train",
                                          "--config", str(cdir), "--mix", mix, *common]
                                       + (["--ac-on"] if ac else [])
                                       + (["--compile-on"] if comp else []))
                                r = run_variant(cmd, dict(env, KERNELS_ATTN_BACKEND=a,
                                                          KERNELS_CE_BACKEND=c), args.timeout)
                                record({"config": name, "mix": mix, "ac": ac, "compiled": comp,
                                        "attn": a, "ce": c, "gpus": gpus, **r})
            rows = ([int(x) for x in args.rollout_batches.split(",") if x]
                    + ([0] if args.rollout_mix_prompts else []))
            for graphs in reversed(switch[args.rollout_graphs]):  # on first
                for b in rows:
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "rollout",
                           "--config", str(cdir), "--batch", str(b),
                           "--rollout-mix-prompts", str(args.rollout_mix_prompts), *common]
                    r = run_variant(cmd, dict(env, OPR_ENGINE_GRAPHS=str(int(graphs))),
                                    args.timeout)
                    record({"config": name, "batch": b or "mix", "graphs": graphs, **r})

    print("\n| config | mix | AC | compiled | attention | CE | GPUs | micro-tokens | "
          "tok/s per GPU | MFU | peak mem (GB) | warm-up s |")
    print("|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if "mix" in r:
            cells = (f"{r['micro_tokens']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | "
                     f"{r['peak_memory_gb']:.1f} | {r['warmup_seconds']}" if "error" not in r
                     else f"| {r['error']} | | | ")
            print(f"| {r['config']} | {r['mix']} | {'on' if r['ac'] else 'off'} | "
                  f"{'on' if r['compiled'] else 'off'} | {r['attn']} | {r['ce']} | {r['gpus']} | "
                  f"{cells} |")
    print("\n| config | rollout batch | CUDA graphs | new tokens | time to drain | new tok/s | "
          "busy share | peak mem (GB) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "batch" in r:
            cells = (f"{r['new_tokens']} | {r['seconds']:.2f} s | {r['new_tokens_per_s']:,.1f} | "
                     f"{r['busy_share'] if r['busy_share'] is not None else '-'} | "
                     f"{r['peak_memory_gb']:.1f}"
                     if "error" not in r else f"{r['error']} | | | | |")
            print(f"| {r['config']} | {r['batch']} | {'on' if r['graphs'] else 'off'} | {cells} |")
    if any("error" in r for r in results):
        print(f"bench_gpu.py: {sum('error' in r for r in results)} variant(s) failed (see {out})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
