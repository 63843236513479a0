"""The learning-rate schedules of train.py --lr-schedule: the peak lr's factor at each step.

    sched = LambdaLR(opt, lambda s: SCHEDULES[args.lr_schedule](s, total_steps, args.warmup))

Both rise linearly over the first round(warmup * total) steps, then decay to 0 at step `total`:
cosine (the paper's text) or linear (the official OPR code's, HF's
get_linear_schedule_with_warmup).
"""
import math


def cosine(step: int, total: int, warmup: float = 0.0) -> float:
    """lr factor of optimizer step `step` (0-based) of `total`: a linear rise over the first
    round(warmup * total) steps (step 0 trains at 1 / (n + 1) of the peak, never at 0), then a
    cosine decay to 0 over the rest."""
    n = round(warmup * total)
    if step < n:
        return (step + 1) / (n + 1)
    return 0.5 * (1 + math.cos(math.pi * min(step - n, total - n) / max(total - n, 1)))


def linear(step: int, total: int, warmup: float = 0.0) -> float:
    """cosine's warmup, then a linear decay to 0 over the rest: (total - step) / (total - n) from
    the peak at step n, HF's get_linear_schedule_with_warmup after the warmup (the official OPR
    code's schedule)."""
    n = round(warmup * total)
    if step < n:
        return (step + 1) / (n + 1)
    return 1 - min(step - n, total - n) / max(total - n, 1)


SCHEDULES = {"cosine": cosine, "linear": linear}  # --lr-schedule
