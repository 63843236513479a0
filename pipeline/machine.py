"""run.py's machine: the engine its generating steps sample with, and the Pipeline that runs its
steps there (how many at once, in which environment, on which executor).

    engine_name = engine_of(args)                              # "native" or "vllm", in the keys
    pipe = make_pipeline(args, run_dir, THREADS)               # run.py's CPU threads per step

Every CPU step runs with a pinned thread count (--threads, else the caller's explicit
OMP_NUM_THREADS, else run.py's THREADS) and the CPU's numerics (kernels.cpu_numerics; --portable:
the pins). The numerics -- the thread count, torch's version, the GPUs, the device, the CPU's
numerics, the kernels' NUMERICS and backends -- are part of every step's key.
"""
import os
import sys
from pathlib import Path

from common.errors import UserError
from pipeline.builders import PRUNABLE, STEP_OUTPUTS
from pipeline.steps import Pipeline


def engine_of(args) -> str:
    """The generating steps' engine: "auto" resolved here, so the keys say which engine sampled
    (vLLM needs GPUs: a CPU run samples natively). A --dry-run with --gpus plans the GPU machine it
    prices, not the one it runs on: its "auto" is vLLM there (README's GPU setup installs it), so a
    laptop plans the steps and keys the node will run."""
    from engine.sampling import resolve_engine
    if args.engine == "auto" and args.gpus and args.dry_run:
        return "vllm"
    if args.gpus or args.engine != "auto":
        return resolve_engine(args.engine, check=False)
    return "native"


def make_pipeline(args, run_dir: Path, threads_default: int) -> Pipeline:
    """The Pipeline: the steps' environment (pinned threads, the CPU's numerics), how many run
    at once, and the numerics that are part of every step's key. threads_default: CPU threads per
    step without --threads or an explicit OMP_NUM_THREADS (run.py's THREADS)."""
    gpus = args.gpus
    threads = args.threads or pinned_threads(os.environ.get("OMP_NUM_THREADS"), threads_default)
    # GPU steps share the devices; on the CPU a generating step's workers take --threads cores each
    cores = os.cpu_count() or 2
    jobs = 1 if gpus else (args.jobs or max(1, cores // (threads * args.gen_workers)))
    import kernels
    cpu_env, cpu = kernels.cpu_numerics(args.portable)
    if args.portable and "model" in cpu:
        print(f"run.py: --portable: this CPU cannot run the pins ({kernels.cpu_model()}: no AVX2), "
              f"or {'/'.join(kernels.PORTABLE)} are set otherwise; the steps follow this CPU",
              file=sys.stderr)
    step_env = dict(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **cpu_env)
    if not gpus:  # a CPU run: its steps on the CPU also where there is a GPU
        step_env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    if args.debug:
        step_env["OPR_DEBUG"] = "1"  # steps show tracebacks too
    env = dict(os.environ, **step_env)
    import torch
    # everything besides the settings that changes float results: part of every step's key and of
    # results.json
    device = torch.cuda.get_device_name(0) if gpus and torch.cuda.is_available() else "cpu"
    numerics = dict(threads=threads, torch=torch.__version__, gpus=gpus, code=kernels.NUMERICS,
                    device=device, cpu=cpu, kernels=kernels.backends())
    pipe = Pipeline(run_dir, jobs, env, args.quiet, numerics)
    pipe.outputs_of = STEP_OUTPUTS
    pipe.prunable = PRUNABLE
    # CUDA steps start in processes of their own (and so do vLLM's, zygote.script_of)
    pipe.use_zygote &= gpus == 0
    if args.executor == "ray" and not args.dry_run:
        # connected and every node checked, before anything is written
        from pipeline.ray_executor import RayExecutor, demand
        pipe.executor = RayExecutor(args.ray_address, run_dir, step_env, pipe.use_zygote,
                                    numerics["cpu"])
        pipe.demand = lambda kind: demand(kind, threads, args.gen_workers, gpus)
        pipe.retries = args.ray_retries
        # Ray's resources decide how many run at once; a pool thread waits on each
        pipe.jobs = args.jobs or 1024
    return pipe


def pinned_threads(omp_env, default: int) -> int:
    """`default` (run.py's THREADS), or the caller's explicit OMP_NUM_THREADS."""
    if not omp_env:
        return default
    if not omp_env.strip().isdigit() or int(omp_env) < 1:
        raise UserError(f"OMP_NUM_THREADS={omp_env!r} is not a positive integer; unset it or pass "
                        f"--threads N")
    return int(omp_env)
