"""ewc — Elastic Weight Consolidation (Kirkpatrick et al. 2017, PNAS 114(13):3521), in its
online form (Schwarz et al. 2018, "Progress & Compress", section 4: one running Fisher, anchored
at the latest weights):

    after stage i, at its final weights theta_i, the diagonal empirical Fisher of task i
        F_i = 1/n * sum over n sampled training examples x of g(x)^2,
              g(x) = grad of x's mean response-token NLL
    kept with the checkpoint, accumulated  F <- gamma * F_{i-1} + F_i
        (gamma 1: the sum of the tasks' Fishers)
    stage i+1 minimises  NLL + 1/2 * lambda * sum_k F_k * (theta_k - theta*_k)^2,
        theta* = theta_i (its start)

The penalty's gradient lambda * F * (theta - theta*) is added to the step's gradient before
clipping, on each rank's own shard of F, theta and theta* (under FSDP2 they are sharded like the
parameters: no unsharded copy per rank). g(x) is per example: every rank computes the same example
(its loss divided by the world size, so the summed gradient is g(x) exactly), n forward-backward
passes in all whatever the world size.

Defaults: EasyCL's (src/llamafactory/hparams/finetuning_args.py: ewc_lambda 10000,
ewc_num_samples 100; its README says 0.5). The Fisher of a mean token NLL is small per weight
(1e-8..1e-4 on the tiny base), so lambda is large. The peers' faults this avoids: a penalty
computed from param.data (no gradient: EasyCL), a "Fisher" summed over the training trajectory's
batch gradients and never normalised (TRACE).
"""
import random
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from data.packing import collate
from methods.base import Method, Objective
from model.checkpoint import local_rows
from model.objectives import local, nll, trained

LAMBDA = 1e4        # EasyCL finetuning_args.ewc_lambda
SAMPLES = 100       # EasyCL finetuning_args.ewc_num_samples: training examples per Fisher
GAMMA = 1.0         # online EWC's decay of the earlier tasks' Fisher
                    # (1: Kirkpatrick's sum over tasks)
FISHER = "ewc/fisher.safetensors"  # in the checkpoint directory (a subdirectory:
                                   # loaders glob *.safetensors)


class Ewc(Method):
    name = objective = "ewc"
    flags = ("ewc_lambda", "ewc_samples", "ewc_gamma")


def penalty(params, fisher, star, lam: float):
    """1/2 * lam * sum F * (theta - theta*)^2 over lists of (local) tensors:
    differentiable in params."""
    return 0.5 * lam * sum((f * (p - s) ** 2).sum() for p, f, s in zip(params, fisher, star))


def add_penalty_grad(params, fisher, star, lam: float):
    """Adds penalty()'s gradient, lam * F * (theta - theta*), to each parameter's
    gradient (local shards)."""
    with torch.no_grad():
        for p, f, s in zip(params, fisher, star):
            local(p.grad).add_(lam * f * (local(p) - s))


def empirical_fisher(model, examples, device, world: int):
    """The mean over `examples` of each parameter's squared gradient of the example's mean
    response-token NLL -> a list of local tensors in the order of the trained parameters. Gradients
    are zeroed before and after."""
    params = [p for _, p in trained(model)]
    fisher = [torch.zeros_like(local(p), dtype=torch.float32) for p in params]
    for e in examples:
        model.zero_grad(set_to_none=True)
        ids, pos, tgt, cu, max_len = collate([e], device)
        loss = model(ids, pos, loss=nll(tgt), cu_seqlens=cu, max_seqlen=max_len)
        (loss / (e.n_targets * world)).backward()  # every rank the same example: the
                                                   # reduced gradient is g(x)
        with torch.no_grad():
            for f, p in zip(fisher, params):
                f.add_(local(p.grad).float() ** 2)
    model.zero_grad(set_to_none=True)
    return [f / max(len(examples), 1) for f in fisher]


def read_fisher(ckpt_dir, model) -> list | None:
    """The Fisher a checkpoint carries (FISHER), each rank reading its own rows; None
    when it has none."""
    from safetensors import safe_open
    path = Path(ckpt_dir) / FISHER
    if not path.is_file():
        return None
    out = []
    with safe_open(path, framework="pt") as f:
        for name, p in trained(model):
            sl, (mine, start) = f.get_slice(name), local_rows(p)
            rows = sl[start:start + mine.shape[0]] if mine.shape[0] else torch.zeros(0)
            out.append(torch.as_tensor(rows, dtype=torch.float32).reshape(mine.shape)
                       .to(mine.device))
    return out


def full_tensors(model, tensors) -> dict:
    """{parameter name: the whole tensor} of local shards laid out like the model's parameters
    (collective)."""
    out = {}
    for (name, p), t in zip(trained(model), tensors):
        if isinstance(p, DTensor):
            t = DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride()).full_tensor()
        out[name] = t.detach().cpu().contiguous()
    return out


class EwcObjective(Objective):
    name = "ewc"
    prefixes = ("ewc_",)
    state_bytes, state_what = 8, "F and theta*, fp32"

    def extra_tokens(self, flags, mean_doc):
        """The Fisher: --ewc-samples examples, each forward-backward on every GPU."""
        n = int(flags[flags.index("--ewc-samples") + 1]) if "--ewc-samples" in flags else SAMPLES
        return n * mean_doc

    def add_flags(self, p):
        from common.cli import float_in, int_at_least
        p.add_argument("--ewc-lambda", type=float_in(0), default=LAMBDA,
                       help="ewc: penalty weight lambda in 1/2*lambda*sum F*(theta-theta*)^2 "
                            "(default: %(default)s, EasyCL's; 0: sft's weights exactly)")
        p.add_argument("--ewc-samples", type=int_at_least(1), default=SAMPLES,
                       help="ewc: training examples of this stage's Fisher, a seeded draw "
                            "(default: %(default)s, EasyCL's)")
        p.add_argument("--ewc-gamma", type=float_in(0, 1), default=GAMMA,
                       help="ewc: online decay of the earlier Fisher, F <- gamma*F_prev + F_new "
                            "(default: %(default)s: the sum over tasks)")

    def describe(self, args):
        return f" (lambda {args.ewc_lambda:g}, Fisher of {args.ewc_samples} examples)"

    def setup(self, args, model, kept):
        """theta* = the weights the stage starts from (--model, before a resumed state replaces
        them) and the Fisher the previous stage's checkpoint carries (none at the chain's first
        stage: no penalty)."""
        kept["star"] = [local(p).detach().clone() for _, p in trained(model)]
        # the previous stage's checkpoint: --model, or on LoRA (methods/lora.py) the one whose
        # adapter --lora-init is
        prev = Path(args.lora_init).parent if args.lora_init else args.model
        kept["fisher"] = read_fisher(prev, model)

    def after_backward(self, stage, step):
        fisher, star = stage.kept["fisher"], stage.kept["star"]
        if fisher is None:
            return {"ewc_penalty": 0.0}
        params = [p for _, p in trained(stage.model)]
        with torch.no_grad():
            value = penalty([local(p) for p in params], fisher, star,
                            stage.args.ewc_lambda).reshape(1)
        if dist.is_initialized():
            dist.all_reduce(value)  # each rank summed its own shards
        add_penalty_grad(params, fisher, star, stage.args.ewc_lambda)
        return {"ewc_penalty": value.item()}

    def after_training(self, stage):
        """This task's Fisher at the final weights, accumulated onto --model's, written
        for the next stage."""
        args = stage.args
        picked = sorted(random.Random(args.seed).sample(range(len(stage.examples)),
                                                        min(args.ewc_samples, len(stage.examples))))
        fisher = empirical_fisher(stage.model, [stage.examples[i] for i in picked], stage.device,
                                  stage.world)
        if stage.kept["fisher"] is not None:
            fisher = [args.ewc_gamma * old + new for old, new in zip(stage.kept["fisher"], fisher)]
        full = full_tensors(stage.model, fisher)
        if stage.rank != 0:
            return []
        from safetensors.torch import save_file
        path = stage.workdir / FISHER
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(full, path, metadata={"samples": str(len(picked)), "gamma": str(args.ewc_gamma)})
        return [path.parent]


METHOD = Ewc()
OBJECTIVE = EwcObjective()
