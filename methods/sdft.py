"""sdft — on-policy Self-Distillation Fine-Tuning (Shenfeld et al. 2026, arXiv 2601.19897,
Algorithm 1): per step the student samples y ~ pi_theta(.|x) for each prompt x of the batch
(generation on the training model, each prompt with a seed of its own); the teacher pi_phi reads x
with the gold demonstration in context (--sdft-template) and scores the same y; the loss is
    sum over sampled tokens of KL(pi_theta(.|x, y<t) || pi_phi(.|x+demo, y<t)), full vocabulary,
    divided by the number of sampled tokens in the whole step
with no cross-entropy on the gold answer; after each optimizer step
phi <- alpha*theta + (1-alpha)*phi (--sdft-teacher ema; or a frozen copy of the initial weights, or
the current student itself).
Defaults: the official code's settings (idanshen/Self-Distillation main.py)."""
import time
from functools import partial

import torch.distributed as dist

from methods.base import Method, Objective
from model.objectives import fsdp_units, on_policy_batches, sample_seed, sdft_loss

TEACHER = "ema"     # ema (Algorithm 1) | base (frozen initial weights: TRL's default) |
                    # student (current weights)
ALPHA = 0.01        # EMA rate: phi <- alpha*theta + (1-alpha)*phi after every step
                    # (official: ref_model_mixup_alpha)
KL = "reverse"      # Algorithm 1's KL(student || teacher);
                    # "forward" = KL(teacher || student) is the official code's default,
                    # which its README says produced the paper's numbers
TEMPERATURE = 1.0   # sampling temperature of the student's responses (official and TRL: 1.0)
MAX_NEW_TOKENS = 1024  # response cap (official: max_completion_length 1024)
SKIP_TOKENS = 0     # leading response tokens left out of the loss
                    # (official main.py: 3; Algorithm 1: 0)
# official main.py
TEMPLATE = ("\n{prompt}\n\nThis is an example for a response to the question:\n{demo}\n\n"
            "Now answer with a response of your own, including the thinking process.\n")
GEN_BATCH = 32      # prompts per generation batch


def sample_responses(model, prompts: list[list[int]], seeds: list[int], temperature: float,
                     max_new_tokens: int, stop_ids, batch_size: int) -> list[dict]:
    """One response per prompt from the training model itself, by the native engine. Under FSDP
    each unit is gathered once and kept whole while the engine runs, so its many small forwards
    need no collective and ranks may sample different numbers of tokens; afterwards the blocks are
    sharded again as build_model left them."""
    from engine.native import sample
    units = fsdp_units(model)
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)  # the root's own already is False
    try:
        return sample(model, prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                      stop_ids=stop_ids, seeds=seeds, batch_size=batch_size, progress=False)
    finally:
        for unit in units[:-1]:  # the blocks
            unit.set_reshard_after_forward(dist.get_world_size() > 1, recurse=False)
        for unit in units:
            unit.reshard()


class Sdft(Method):
    name = objective = "sdft"
    flags = ("sdft_teacher", "sdft_alpha", "sdft_kl", "sdft_temperature", "sdft_max_new_tokens")


class SdftObjective(Objective):
    name = "sdft"
    prefixes = ("sdft_",)
    logs_kl = True
    on_policy = True
    # (its sampling: plan.py prices it)
    extra_passes, state_bytes, state_what = 1 / 3, 4, "the teacher, fp32"
    copies_model = True

    def add_flags(self, p):
        from common.cli import float_in, int_at_least
        p.add_argument("--sdft-teacher", choices=["ema", "base", "student"], default=TEACHER,
                       help="sdft: the teacher's weights: an EMA of the student (Algorithm 1), "
                            "the frozen initial weights, or the current student "
                            "(default: %(default)s)")
        p.add_argument("--sdft-alpha", type=float_in(0, 1), default=ALPHA,
                       help="sdft: EMA rate, phi <- alpha*theta + (1-alpha)*phi "
                            "(default: %(default)s)")
        p.add_argument("--sdft-kl", choices=["reverse", "forward"], default=KL,
                       help="sdft: reverse = KL(student || teacher) (default: %(default)s)")
        p.add_argument("--sdft-temperature", type=float_in(0), default=TEMPERATURE,
                       help="sdft: sampling temperature (default: %(default)s)")
        p.add_argument("--sdft-max-new-tokens", type=int_at_least(1), default=MAX_NEW_TOKENS,
                       help="sdft: response length cap (default: %(default)s)")
        p.add_argument("--sdft-skip-tokens", type=int_at_least(0), default=SKIP_TOKENS,
                       help="sdft: leading response tokens left out of the loss "
                            "(default: %(default)s)")
        p.add_argument("--sdft-template", default=TEMPLATE,
                       help="sdft: the teacher's user turn, with {prompt} and {demo} "
                            "(the gold answer); default: the official code's")

    def describe(self, args):
        return f" (teacher {args.sdft_teacher}, KL {args.sdft_kl})"

    def teacher(self, args):
        return (args.sdft_teacher != "student",
                args.sdft_alpha if args.sdft_teacher == "ema" else None)

    def template(self, args):
        return args.sdft_template

    def loss_fn(self, args, model, teacher, has_replay, device):
        return partial(sdft_loss, model, teacher if teacher is not None else model,
                       args.sdft_kl, device)

    def sample_micro_batches(self, s, step: int, micro: list):
        """The student first answers this rank's prompts of step `step`, and its responses replace
        the gold answers as training tokens -> (micro-batches of (student, teacher) pairs, loss
        tokens of the whole step, tokens of the whole step, seconds spent sampling)."""
        args = s.args
        mine = [i for mb in micro for i in mb]
        t_gen = time.perf_counter()
        seeds = [sample_seed(args.seed, step, i) for i in mine]
        outs = sample_responses(s.model, [s.prompt_ids[i] for i in mine], seeds,
                                args.sdft_temperature, args.sdft_max_new_tokens, s.stop_ids,
                                GEN_BATCH)
        gen_seconds = time.perf_counter() - t_gen
        micro, n_targets, step_tokens = on_policy_batches(mine, outs, s.prompt_ids, s.teacher_ids,
                                                          args.sdft_skip_tokens, args.micro_tokens,
                                                          s.device)
        return micro, n_targets, step_tokens, gen_seconds


METHOD = Sdft()
OBJECTIVE = SdftObjective()
