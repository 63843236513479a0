"""agem — Averaged Gradient Episodic Memory (Chaudhry et al. 2019, ICLR, eq. 11): an episodic memory
of gold examples of the prior tasks; at every optimizer step the gradient g_ref of one memory
batch's mean token NLL, and the step's own gradient g, before the optimizer sees it, replaced by
    g - (g . g_ref / g_ref . g_ref) * g_ref    when g . g_ref < 0   (else g unchanged)
so that, to first order, no update raises the memory's loss. The memory is drawn as replay draws its
buffer (the same budget rule and seed: an equal-memory comparison with replay and OPR) and passed to
train.py as --memory, held out of the training mixture. The dot products are reduced over FSDP2
shards, so 2 ranks compute what 1 does; the extra cost is one more forward-backward of --agem-batch
sequences per step and one gradient copy.

The peers' fault this avoids: projecting inside a callback that runs after optimizer.step() (LLMCL),
which leaves the update unprojected.
"""
import random

import torch
import torch.distributed as dist

from data.mixture import tokenize_mixture
from data.packing import collate, pack
from methods.base import Method, Objective
from model.objectives import local, nll, trained


class Agem(Method):
    name = objective = "agem"
    uses_buffer = True

    def plan_train(self, steps, prev, stage, tasks, buffer_key, seed):
        return steps.train(prev, stage, [tasks[stage - 1]], None, seed, self.train_flags(steps.cfg),
                           memory_key=buffer_key)

    def plan_buffer(self, steps, train_key, stage, seen, seed, next_task, rho):
        return steps.gold_buffer(stage, seen, seed, next_task, rho)


def project(g: list, g_ref: list):
    """A-GEM's projection of g (lists of tensors, the same shapes) against g_ref
    -> (new g, g . g_ref, projected?).
    The dot products are summed over the lists and, in a process group, over the ranks' shards."""
    dots = torch.stack([sum((a * b).sum() for a, b in zip(g, g_ref)),
                        sum((b * b).sum() for b in g_ref)]).double()
    if dist.is_initialized():
        dist.all_reduce(dots)
    dot, ref = dots.tolist()
    if dot >= 0 or ref == 0:
        return g, dot, False
    return [a - (dot / ref) * b for a, b in zip(g, g_ref)], dot, True


def memory_batch(seed: int, step: int, n: int, size: int) -> list:
    """The memory examples of optimizer step `step`: a seeded draw of `size` of n, the
    same on every rank."""
    return sorted(random.Random(f"{seed}:{step}").sample(range(n), min(size, n)))


class AgemObjective(Objective):
    name = "agem"
    prefixes = ("agem_",)
    reads_memory = True
    # the memory batch's forward-backward each step (--agem-batch: --global-batch by
    # default), a gradient's copy
    extra_passes, state_bytes, state_what = (1.0, 4,
                                             "the step's gradient while g_ref is computed, fp32")

    def add_flags(self, p):
        from common.cli import int_at_least
        p.add_argument("--agem-batch", type=int_at_least(1),
                       help="agem: memory sequences per reference gradient "
                            "(default: --global-batch)")

    def describe(self, args):
        return (f" (memory {args.memory or 'none'}, "
                f"{args.agem_batch or args.global_batch} per reference gradient)")

    def setup(self, args, model, kept):
        """The memory (--memory), tokenized as the mixture is; none at a chain's first stage
        (nothing to protect)."""
        kept["memory"] = []
        if args.memory:
            from model.tokenizer import ChatTokenizer
            kept["memory"] = tokenize_mixture([args.memory], ChatTokenizer.from_dir(args.model),
                                              args.max_len)[0]
        kept["memory_lengths"] = [len(e.ids) for e in kept["memory"]]

    def after_backward(self, stage, step):
        memory = stage.kept["memory"]
        if not memory:
            return {"agem_projected": 0}
        args, model = stage.args, stage.model
        params = [p for _, p in trained(model)]
        g = [local(p.grad).clone() for p in params]
        batch = memory_batch(args.seed, step, len(memory), args.agem_batch or args.global_batch)
        n_ref = sum(memory[i].n_targets for i in batch)
        model.zero_grad(set_to_none=True)
        for mb in pack(batch, stage.kept["memory_lengths"], args.micro_tokens,
                       stage.world)[stage.rank]:
            ids, pos, tgt, cu, max_len = collate([memory[i] for i in mb], stage.device)
            loss = model(ids, pos, loss=nll(tgt), cu_seqlens=cu, max_seqlen=max_len)
            (loss / max(n_ref, 1)).backward()
        g_ref = [local(p.grad) for p in params]
        new, dot, projected = project(g, g_ref)
        with torch.no_grad():
            for p, x in zip(params, new):
                local(p.grad).copy_(x)
        return {"agem_dot": dot, "agem_projected": int(projected)}


METHOD = Agem()
OBJECTIVE = AgemObjective()
