"""TensorBoard event files, for `tensorboard --logdir RUN_DIR`: train.py's per-step numbers, run.py's scores.

    w = writer(path, purge_step=start + 1)  # a resumed or restarted stage drops the events after its restart point
    add(w, "train", {"loss": 0.7, "lr": 1e-5, "task": "C-STANCE"}, step)   # numbers only; None and text skipped
"""
import math
from pathlib import Path

from data.errors import UserError


def writer(path: Path, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise UserError(f"--tensorboard {path}: needs the tensorboard package ({e}); pip install tensorboard") from None
    return SummaryWriter(str(path), purge_step=purge_step, flush_secs=10)


def add(w, prefix: str, numbers: dict, step: int):
    for k, v in numbers.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            w.add_scalar(f"{prefix}/{k}", v, step)
