"""The eight TRACE tasks: name, metric and default number of training epochs.

TRACE (Wang et al., 2023) trains on the tasks in this order; the epochs follow the paper's setup
(C-STANCE 5, FOMC 3, MeetingBank 7, Py150 5, ScienceQA 3, NumGLUE-cm 5, NumGLUE-ds 5, 20Minuten 7).
The task name is also the directory name in TRACE's release layout
`<root>/<Task>/{train,eval,test}.json`. Metric names index `data.metrics.METRICS`. A task manifest
(data/manifest.py: `ROOT/tasks.json` or --task-spec) replaces this table with the user's own tasks
for the whole process (use_tasks).
"""

import argparse
from dataclasses import dataclass

from common.errors import InputError


@dataclass(frozen=True)
class Task:
    name: str    # TRACE directory name, e.g. "NumGLUE-cm"
    metric: str  # key of data.metrics.METRICS
    epochs: int | None  # default training epochs for this stage
                        # (None: a manifest's task without; run.py's --epochs)
    # set by a task manifest only (data/manifest.py); a TRACE task leaves them at these defaults
    dir: str = ""                     # directory of its split files ("": <root>/<name>)
    max_new_tokens: int | None = None  # generation cap of its evaluations and rollouts
                                       # (None: the run's)
    temperature: float | None = None   # sampling temperature of its evaluations (None: the run's)
    system: str | None = None          # system prompt put before every prompt
    labels: tuple | None = None        # the answers a classification task allows
                                       # (metric label_accuracy)
    held_out: float = 0.1              # share of train held out as test
                                       # when the task has no test split
    manifest: str = ""                 # the manifest that declared it (for error messages)


TASKS = {
    t.name: t
    for t in [
        Task("C-STANCE", "letter_accuracy", 5),
        Task("FOMC", "letter_accuracy", 3),
        Task("MeetingBank", "rouge_l", 7),
        Task("Py150", "code_fuzz", 5),
        Task("ScienceQA", "letter_accuracy", 3),
        Task("NumGLUE-cm", "number_accuracy", 5),
        Task("NumGLUE-ds", "number_accuracy", 5),
        Task("20Minuten", "sari", 7),
    ]
}
TASK_ORDER = list(TASKS)  # canonical TRACE order (dicts keep insertion order)
_active = None  # {name: Task} of the manifest in use (use_tasks), None: TRACE's table


def use_tasks(table: dict | None):
    """Make a manifest's tasks ({name: Task}, in stream order) the ones every lookup sees; None
    restores TRACE's."""
    global _active
    _active = table


def active_tasks() -> dict:
    return TASKS if _active is None else _active


def get_task(name: str) -> Task:
    """Task by exact name; ValueError listing the valid names otherwise."""
    table = active_tasks()
    if name not in table:
        raise InputError(f"unknown task {name!r}; valid tasks: {', '.join(table)}")
    return table[name]


def parse_tasks(spec=None) -> list[str]:
    """Task order from a comma-separated string or a list, e.g. "FOMC,NumGLUE-cm" ->
    ["FOMC", "NumGLUE-cm"].

    None, "" and "all" give the canonical TRACE order. Names match case-insensitively and come back
    in canonical spelling; unknown or repeated names raise ValueError (listing the valid names).
    """
    order = list(active_tasks())
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "all")):
        return order
    names = ([s.strip() for s in spec.split(",")] if isinstance(spec, str)
             else [str(s).strip() for s in spec])
    by_lower = {t.lower(): t for t in order}
    out = []
    for n in names:
        if not n:
            raise InputError(f"empty task name in task list {spec!r}; "
                             f"valid tasks: {', '.join(order)}")
        if n.lower() not in by_lower:
            raise InputError(f"unknown task {n!r} in task list {spec!r}; "
                             f"valid tasks: {', '.join(order)}")
        canon = by_lower[n.lower()]
        if canon in out:
            raise InputError(f"task {canon!r} appears twice in task list {spec!r}")
        out.append(canon)
    return out


def task_names(s: str) -> list:
    """--tasks as an argparse type: comma-separated task names (case-insensitive),
    checked by parse_tasks."""
    try:
        return parse_tasks(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
