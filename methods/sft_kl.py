"""sft-kl — SFT plus a per-token KL to an EMA teacher on the gold tokens, both models reading the
same sequence:
    loss = NLL + beta * KL(student || teacher),
    teacher <- ema * teacher + (1 - ema) * student after each step
(the OPR paper's one-line description of SDFT; the faithful SDFT is methods/sdft.py)."""
from functools import partial

from methods.base import Method, Objective
from model.objectives import sft_loss

BETA = 0.5
EMA = 0.99              # teacher <- ema * teacher + (1 - ema) * student after each step
DIRECTION = "reverse"   # KL(student || teacher); "forward" = KL(teacher || student)


class SftKl(Method):
    name = objective = "sft-kl"
    flags = ("sft_kl_beta",)


class SftKlObjective(Objective):
    name = "sft-kl"
    prefixes = ("sft_kl_",)
    logs_kl = True
    extra_passes, state_bytes, state_what = 1 / 3, 4, "the EMA teacher, fp32"
    copies_model = True

    def add_flags(self, p):
        from common.cli import float_in
        p.add_argument("--sft-kl-beta", type=float_in(0), default=BETA,
                       help="sft-kl: KL weight (default: %(default)s)")
        p.add_argument("--sft-kl-ema", type=float_in(0, 1), default=EMA,
                       help="sft-kl: EMA decay of the teacher (default: %(default)s)")
        p.add_argument("--sft-kl-direction", choices=["reverse", "forward"], default=DIRECTION,
                       help="sft-kl: KL direction (default: %(default)s)")

    def teacher(self, args):
        return True, 1 - args.sft_kl_ema

    def loss_fn(self, args, model, teacher, has_replay, device):
        return partial(sft_loss, model, has_replay, device, teacher=teacher, beta=args.sft_kl_beta,
                       direction=args.sft_kl_direction)


METHOD = SftKl()
OBJECTIVE = SftKlObjective()
