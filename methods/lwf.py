"""lwf — Learning without Forgetting (Li & Hoiem 2016, TPAMI 40(12), eq. 2-3), as LLM
continual-learning papers use it: the frozen previous-stage checkpoint (the stage's --model) is the
teacher, read on the current task's own examples, and the stage minimises, per response token,
    (1 - alpha) * NLL + alpha * T^2 * KL(teacher_T || student_T)
where _T is the softmax of logits / T over the full vocabulary (Hinton et al.'s T^2 keeps the soft
term's gradient scale independent of T). The teacher reads the same packed sequence as the student,
so each token's target distribution is that example's own, whatever the data order.

Defaults: EasyCL's (alpha 0.5, T 2). The peers' faults this avoids: kl_div's arguments swapped and
cached teacher logits looked up by step index under a shuffled sampler (TRACE LwF.py), a CE on
unshifted logits (EasyCL).
"""
from functools import partial

from methods.base import Method, Objective
from model.objectives import sft_loss

ALPHA = 0.5         # EasyCL: weight of the distillation term
TEMPERATURE = 2.0   # EasyCL: softmax temperature of both models


class Lwf(Method):
    name = objective = "lwf"
    flags = ("lwf_alpha", "lwf_temperature")


class LwfObjective(Objective):
    name = "lwf"
    prefixes = ("lwf_",)
    logs_kl = True
    extra_passes, state_bytes, state_what = 1 / 3, 4, "the frozen teacher, fp32"
    copies_model = True

    def add_flags(self, p):
        from common.cli import float_in
        p.add_argument("--lwf-alpha", type=float_in(0, 1), default=ALPHA,
                       help="lwf: weight of the distillation term, (1-alpha)*NLL + alpha*T^2*KL "
                            "(default: %(default)s, EasyCL's; 0: sft's weights exactly)")
        p.add_argument("--lwf-temperature", type=float_in(0, lo_open=True), default=TEMPERATURE,
                       help="lwf: softmax temperature T of teacher and student "
                            "(default: %(default)s, EasyCL's)")

    def describe(self, args):
        return (f" (alpha {args.lwf_alpha:g}, T {args.lwf_temperature:g}, "
                f"teacher: the frozen --model)")

    def teacher(self, args):
        return True, None  # the stage's starting weights, frozen

    def loss_fn(self, args, model, teacher, has_replay, device):
        t = args.lwf_temperature
        return partial(sft_loss, model, has_replay, device, teacher=teacher,
                       beta=args.lwf_alpha * t * t, direction="forward", temperature=t,
                       nll_weight=1 - args.lwf_alpha)


METHOD = Lwf()
OBJECTIVE = LwfObjective()
