"""olora — O-LoRA (Wang et al. 2023, "Orthogonal Subspace Learning for Language Model Continual
Learning", Findings of EMNLP 2023): every task trains a new rank-r LoRA adapter while the earlier
tasks' adapters stay, frozen, and keep acting (one stack, model/lora.py's A0/B0); the new adapter's
A is pushed out of the stack's row space:

    loss = NLL + lambda1 * sum over adapted modules of sum_jk |(A_old A_new^T)_jk|
           + lambda2 * sum over the new A and B of ||P||_F

as the official code computes it (cmnfriend/O-LoRA 07117e1, src/uie_trainer_lora.py): the absolute
value, not the square the paper's equation writes, and Frobenius norms, not squared. Defaults:
theirs (run_uie_lora.py and scripts/order_*.sh: lambda1 0.5, lambda2 0; r 8, alpha 32, dropout 0.1,
q and v: run.py's lora settings). The penalty's gradient is added once per optimizer step, after the
step's NLL gradients and before clipping, computed on the whole (gathered) A matrices: exact under
any sharding. (The official code adds the penalty to every micro-batch's loss without dividing by
the accumulation steps, so its weight there grows with them.) Its size against the NLL:
train_log.jsonl's olora_orth (the sum, before lambda1).

Saved as one standard PEFT adapter: the stack of t adapters of rank r is one LoRA of rank t r with
lora_alpha t alpha, so every sub-adapter keeps alpha / r, the official code's scaling; stock PEFT
and vLLM load it (the official code's r_sum / loranew keys need its vendored PEFT). Stage 1 has no
stack: it is lora-seqft's stage exactly.
"""
import torch
from torch.distributed.tensor import DTensor

from methods.base import Method, Objective
from model.checkpoint import local_rows

LAMBDA1 = 0.5  # O-LoRA run_uie_lora.py lamda_1
LAMBDA2 = 0.0  # ... lamda_2


class OLora(Method):
    name = objective = "olora"
    lora = True
    flags = ("olora_lambda1", "olora_lambda2")


def whole(t):
    """A parameter's full value (gathered when FSDP2 shards it: a collective, every rank
    in the same order)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def add_rows(p, grad):
    """p.grad += grad (a full-size tensor): each rank adds its own rows."""
    mine, start = local_rows(p.grad)
    mine.add_(grad[start:start + mine.shape[0]].to(mine.dtype))


def orthogonality(A_old, A_new, lam: float):
    """(sum |A_old A_new^T|, its gradient in A_new times lam)."""
    G = A_old @ A_new.T
    return G.abs().sum(), lam * torch.sign(G).T @ A_old


def penalty_grads(model, lam1: float, lam2: float) -> dict:
    """Adds O-LoRA's penalty gradients to the new adapters' gradients; -> its two sums
    for the step's log."""
    from model.lora import LoraSlices
    orth, l2 = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for lora in (m for m in model.modules() if isinstance(m, LoraSlices)):
            for m in lora.A:
                if "A0" in lora._modules:
                    value, grad = orthogonality(whole(lora.A0[m]).double(),
                                                whole(lora.A[m]).double(), lam1)
                    orth += value
                    add_rows(lora.A[m], grad)
                if lam2:
                    for p in (lora.A[m], lora.B[m]):
                        P = whole(p).double()
                        n = P.norm()
                        l2 += n
                        if n > 0:  # (the norm's gradient P / ||P||;
                                   # at 0, where B starts, a subgradient: 0)
                            add_rows(p, lam2 * P / n)
    return {"olora_orth": orth.item(), "olora_l2": l2.item()}


class OLoraObjective(Objective):
    name = "olora"
    prefixes = ("olora_",)
    stacks = True

    def add_flags(self, p):
        from common.cli import float_in
        p.add_argument("--olora-lambda1", type=float_in(0), default=LAMBDA1,
                       help="olora: weight of sum |A_old A_new^T| "
                            "(default: %(default)s, O-LoRA's code)")
        p.add_argument("--olora-lambda2", type=float_in(0), default=LAMBDA2,
                       help="olora: weight of the new adapter's Frobenius norms "
                            "(default: %(default)s, O-LoRA's)")

    def describe(self, args):
        return f" (lambda1 {args.olora_lambda1:g}, lambda2 {args.olora_lambda2:g})"

    def after_backward(self, stage, step):
        if not stage.args.lora_rank:
            from common.errors import UserError
            raise UserError("--objective olora: trains LoRA adapters; give --lora-rank")
        return penalty_grads(stage.model, stage.args.olora_lambda1, stage.args.olora_lambda2)


METHOD = OLora()
OBJECTIVE = OLoraObjective()
