"""TensorBoard event files, for `tensorboard --logdir RUN_DIR`: train.py's per-step numbers,
run.py's scores.

    w = writer(path, purge_step=start + 1)  # a resumed or restarted stage drops the later events
    add(w, "train", {"loss": 0.7, "lr": 1e-5, "task": "C-STANCE"}, step)  # finite numbers only

    board = Board(run_dir / "tb" / "results")  # emptied: each run writes it anew
    board.update(results_scalars(results))  # as often as results grow: each scalar is written once
    board.close()
"""
import math
import shutil
from pathlib import Path

from common.errors import UserError


def writer(path: Path, purge_step: int | None = None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise UserError(f"--tensorboard {path}: needs the tensorboard package ({e}); "
                        f"pip install tensorboard") from None
    return SummaryWriter(str(path), purge_step=purge_step, flush_secs=10)


def add(w, prefix: str, numbers: dict, step: int):
    for k, v in numbers.items():
        if is_number(v):
            w.add_scalar(f"{prefix}/{k}", v, step)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Board:
    """Scalars of several TensorBoard runs (sub-directories of root), each (run, tag, step) written
    once however often update() sees it, and flushed at every update, so that `tensorboard --logdir`
    shows them as they come. root is emptied first: its events are a function of the numbers given
    to it in this process."""

    def __init__(self, root: Path):
        self.root, self.writers, self.written = Path(root), {}, set()
        shutil.rmtree(self.root, ignore_errors=True)

    def update(self, scalars: dict):
        """scalars: {run: [(tag, step, value)]}; values that are not finite numbers
        (None) are left out."""
        touched = set()
        for run, items in scalars.items():
            for tag, step, value in items:
                if (run, tag, step) in self.written or not is_number(value):
                    continue
                if run not in self.writers:
                    self.writers[run] = writer(self.root / run)
                self.writers[run].add_scalar(tag, value, step)
                self.written.add((run, tag, step))
                touched.add(run)
        for run in touched:
            self.writers[run].flush()

    def close(self):
        for w in self.writers.values():
            w.close()
        self.writers = {}


def results_scalars(results: dict) -> dict:
    """{"<method>-seed<k>": [(tag, step, value)]} of a results.json (whole, or partial as the run
    goes: each list grows stage by stage). Step i is stage i: a/<task> each cell of row i of the
    accuracy matrix, stage/acc_so_far the row's mean (ACC after stage i); drift/kl_per_token and
    drift/mean_seq_kl of KL(pi_i || pi_i-1) over every prior task's prompts (i >= 2); buffer/* the
    buffer built after stage i (per-token NLL under the checkpoint that built it, of the selected
    records and of the rejected ones where scoring ranked them, and the RU-SC rank correlation);
    final/* the continual-learning metrics at the last stage, once the matrix is whole."""
    tasks, out = results["tasks"], {}
    for label, entry in results["methods"].items():
        for seed, r in entry["seeds"].items():
            items = out.setdefault(f"{label}-seed{seed}", [])
            for i, row in enumerate(r["matrix"], 1):
                items += [(f"a/{t}", i, v) for t, v in zip(tasks, row)]
                items.append(("stage/acc_so_far", i, sum(row) / len(row)))
            for d in r.get("drift") or []:
                items += [(f"drift/{k}", d["stage"], d["all"].get(k))
                          for k in ("kl_per_token", "mean_seq_kl")]
            for b in r.get("buffer_stats") or []:
                selected, rejected = b["all"]["selected"], b["all"].get("rejected") or {}
                items += [("buffer/selected_nll_mean", b["stage"], selected.get("nll_mean")),
                          ("buffer/selected_nll_max", b["stage"], selected.get("nll_max")),
                          ("buffer/rejected_nll_mean", b["stage"], rejected.get("nll_mean")),
                          ("buffer/spearman_ru_sc", b["stage"], b.get("spearman_ru_sc"))]
            if r.get("cl_metrics"):
                items += [(f"final/{k}", len(r["matrix"]), v) for k, v in r["cl_metrics"].items()]
    return out
