"""train.py's model on its ranks: the process group, and the model built on `meta`, sharded, loaded.

    rank, world, device = setup_distributed()  # torchrun's env://, or a world of one in-process
    model = build_model(ckpt_dir, device, torch.bfloat16)

build_model follows torchtitan's order: build on `meta` (LoRA adapters attached there), compile
each block, fully_shard each transformer block and then the root with
MixedPrecisionPolicy(param_dtype=the compute dtype, reduce_dtype=fp32), to_empty, load the
weights (each rank reads only its own rows). One CPU process in fp32 skips the sharding: nothing
to shard. train.py's docstring, step 2, is the algorithm this serves.
"""
import os

import torch
import torch.distributed as dist

from model.checkpoint import load_config, load_into
from model.lora import attach_lora, init_lora, read_adapter, set_adapters
from model.objectives import fsdp_units
from model.transformer import Transformer


def setup_distributed():
    """One code path for every launch: under torchrun its env:// rendezvous; as a plain process, a
    world of one with an in-process store (no TCP port, so parallel single-process runs can never
    join each other). -> (rank, world size, this rank's device)."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        local_rank = int(os.environ["LOCAL_RANK"])
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        local_rank = 0
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def build_model(ckpt_dir, device, compute_dtype, activation_checkpointing=False, shard=None,
                compile=False, lora=None, lora_init=None, seed=0, old_rank=0, frozen_dtype=None):
    """meta -> LoRA adapters -> compile(each block) -> fully_shard(each block) -> fully_shard(root)
    -> materialise -> load (-> the adapters' values: --lora-init's, or new ones seeded by `seed`).
    lm_head and the final norm stay in the root unit, where forward computes the loss. With `lora`
    (a LoraConfig) only the adapters are trainable; they live inside their block, so FSDP2 shards
    them with it; the frozen base is kept in the compute dtype (frozen_dtype: another), what FSDP2
    would cast an fp32 copy to for every forward, so the same numbers in bf16 in half the bytes;
    the adapters stay fp32. old_rank > 0: --lora-init's adapters (of that rank) are a frozen stack
    under a new trained adapter (O-LoRA), not its start.

    compile: each block's forward through torch.compile(fullgraph=True), before fully_shard as
    torchtitan orders it (FSDP2's hooks run outside the compiled region); the token dimension is
    dynamic (dynamic=True), so packed micro-batches of any length share one graph (one more for a
    1-token micro-batch, which dynamo specialises): no recompilation per length, and on the CPU a
    resumed run computes what an uninterrupted one does (tested; on a GPU inductor may tune kernels
    to the first length it sees). The loss and embeddings stay eager.

    A world of one on CPU that computes in fp32 (the parameters' own dtype) is not wrapped: FSDP2
    would have nothing to shard, gather or cast there, only its hooks and DTensor dispatch on every
    op, a large share of a tiny model's CPU step (BENCHMARKS.md, "The levers, each measured on its
    own"; GPU runs keep FSDP2 whatever their size).
    The rest of the loop is the same code for both; fsdp_units() is empty for a plain model.
    shard=True forces the FSDP2 wrapping (benchmarks and tests compare the two)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Transformer(load_config(ckpt_dir))
        if lora is not None:
            attach_lora(model, lora, old_rank)
            # the frozen base is only read in the compute dtype: kept in it, bf16 takes half the
            # bytes (FSDP2 wants one dtype among the trained parameters only)
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(frozen_dtype or compute_dtype)
    model.activation_checkpointing = activation_checkpointing
    if compile:
        for block in model.model.layers:
            block.compile(fullgraph=True, dynamic=True)
    world = dist.get_world_size()
    wrap = world > 1 or compute_dtype != torch.float32 or device.type != "cpu"
    if shard if shard is not None else wrap:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for block in model.model.layers:
            # one rank: nothing to free after a block's forward
            fully_shard(block, mp_policy=mp, reshard_after_forward=world > 1)
        fully_shard(model, mp_policy=mp)
        # Gradients are summed across ranks (our loss is already divided by the global token
        # count); gloo has no PREMUL_SUM, so force a plain sum everywhere.
        for m in fsdp_units(model):
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
    model.to_empty(device=device)
    if not fsdp_units(model):
        # to_empty gives every parameter new storage, a tied pair two (FSDP2 keeps the pair one)
        model.tie_weights()
    load_into(model, ckpt_dir)
    if lora is not None:
        init_lora(model, seed + old_rank)  # (a stacked stage's new adapter: a draw of its own)
        if lora_init:
            set_adapters(model, read_adapter(lora_init, model))
    return model
