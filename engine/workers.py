"""Data-parallel generation workers: a generating script (rollout.py, evaluate.py, drift.py) started
under torchrun samples with every rank, each rank one worker.

    torchrun --nproc_per_node 4 rollout.py ...     # run.py does this when its layout has dp > 1

Each worker takes a share of the prompts (`shards`: by length, so the shares finish together),
samples it with the keys the prompts would have had in one process (engine.sampler.row_keys of their
place in the whole list; vLLM's per-request seeds are the same keys), and every rank gets all
responses back in input order (`gather`). So N workers give the tokens one worker gives, and the
script's outputs, written by rank 0 only, do not depend on N.

A worker's resources: on a GPU node its `tp` GPUs (rank r holds GPUs r*tp .. r*tp+tp-1), on
the CPU OMP_NUM_THREADS threads placed by the OS, as a single process would have: the same
threads, the same numerics.
"""
import os

import torch


def world() -> tuple[int, int]:
    """(this worker's rank, the number of workers): torchrun's RANK and WORLD_SIZE, (0, 1)
    in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def local() -> tuple[int, int]:
    """(rank on this node, workers on this node)."""
    return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def is_main() -> bool:
    return world()[0] == 0


def start():
    """Join the other workers (a gloo group: it carries only the responses, as Python objects) and,
    on a GPU node, take this worker's GPU. A no-op in a plain process."""
    import torch.distributed as dist
    if world()[1] == 1 or dist.is_initialized():
        return
    dist.init_process_group("gloo")
    if torch.cuda.is_available():
        # the native engine's "cuda" (vLLM's GPUs: vllm_engine.worker_env)
        torch.cuda.set_device(local()[0])


def shards(costs: list[int], n: int) -> list[list[int]]:
    """Prompt indices per worker: longest first, each to the worker with the least work so
    far (ties: the lower rank), each worker's list in input order. costs[i]: prompt i's
    tokens plus its cap."""
    load, out = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        w = min(range(n), key=lambda w: (load[w], w))
        load[w] += costs[i]
        out[w].append(i)
    return [sorted(s) for s in out]


def sharded(fn, costs: list[int]) -> list:
    """fn(indices) -> one result per index, run by every worker on its share of range(len(costs))
    and merged in input order on every rank; fn(all indices) in a plain process."""
    rank, n = world()
    if n == 1:
        return fn(list(range(len(costs))))
    start()
    mine = shards(costs, n)[rank]
    return gather(mine, fn(mine) if mine else [], len(costs))


def gather(mine: list[int], outs: list, n: int) -> list:
    """Every worker's (indices, responses) merged into one list of n responses in input
    order, on every rank."""
    import torch.distributed as dist
    parts = [None] * world()[1]
    dist.all_gather_object(parts, (mine, outs))
    merged = [None] * n
    for ix, os_ in parts:
        for i, o in zip(ix, os_):
            merged[i] = o
    if any(o is None for o in merged):
        raise RuntimeError("generation workers returned fewer responses than prompts")
    return merged
