"""Weights & Biases, optional: train.py --wandb DIR logs each step's numbers to a W&B run kept in
DIR (run.py --wandb: one per training stage under RUN/wandb/). Works offline: WANDB_MODE=offline
writes the run to DIR only, for a later `wandb sync DIR/wandb/offline-run-*`. The project's name
comes from $WANDB_PROJECT (default "opr").

    run = start(Path("runs/x/wandb/s1"), config=vars(args))
    log(run, "train", {"loss": 0.7, "lr": 1e-5}, step)   # numbers only, as tensorboard.add
    run.finish()
"""
import math
import os
from pathlib import Path

from common.errors import UserError


def start(path: Path, config: dict):
    try:
        import wandb
    except ImportError as e:
        raise UserError(f"--wandb {path}: needs the wandb package ({e}); "
                        f"pip install wandb") from None
    path.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")  # its banner would break the progress bar's line
    return wandb.init(project=os.environ.get("WANDB_PROJECT", "opr"), name=path.name, dir=str(path),
                      config={k: v for k, v in config.items()
                              if isinstance(v, (str, int, float, bool, type(None)))})


def log(run, prefix: str, numbers: dict, step: int):
    run.log({f"{prefix}/{k}": v for k, v in numbers.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)},
            step=step)
