"""Replay buffer: how many examples each prior task gets (`allocate`) and which ones
(`select`). Pure functions.

Used by score.py for On-Policy Replay (selecting model rollouts by score) and by run.py for Vanilla
Replay (gold examples). The paper's budget is b = rho * n_next: rho = 0.01 of the next stage's
n_next = 5,000 examples -> 50.

    b = buffer_size(0.01, 5000)                            # 50
    allocate(50, {"C-STANCE": 900, "FOMC": 900,
                  "MeetingBank": 900})                     # 17/17/16: remainder to the earliest
    allocate(50, {"C-STANCE": 5, "FOMC": 900, "MeetingBank": 900})    # 5/23/22: shortfall moves on
    chosen = select(range(len(scores)), scores, k=17, mode="top", seed=0)

Two budget rules (`replay_budget`): "total" (the paper's equal-budget comparison: b = rho * n_next,
with n_next the next task's training subsample size before the over-long filter, as the official
code's int(5000 * rho), split by `allocate`) and "per-task" (a rho fraction of each prior task's own
training set, TRACE's past_task_ratio).
"""
import math
import random

SELECT_MODES = ("top", "low", "random")
REPLAY_BUDGETS = ("total", "per-task")


def buffer_size(rho: float, n: int) -> int:
    """b = rho * n rounded half up (rho=0.01, n=5000 -> 50). A tiny epsilon absorbs float
    error (0.1*30 -> 3)."""
    if not (0 <= rho < math.inf and n >= 0):  # a NaN or an infinity fails too
        raise ValueError(f"replay budget needs rho >= 0 and n >= 0, got rho={rho}, n={n}")
    return int(math.floor(rho * n + 0.5 + 1e-9))


def allocate(budget: int, available: dict[str, int]) -> dict[str, int]:
    """Split `budget` over the tasks in `available` (task -> number of candidates, in task
    order, earliest first).

    Equal shares; the remainder of the division goes one each to the earliest tasks. A task never
    gets more than it has; what it cannot take is split again over the tasks that still have room
    (repeated until the budget is spent or every task is exhausted). Returns task -> count in the
    same order; sum = min(budget, sum(available)).
    """
    if not budget >= 0:  # a NaN fails too
        raise ValueError(f"replay budget must be >= 0, got {budget}")
    for task, n in available.items():
        if not n >= 0:
            raise ValueError(f"task {task!r}: available count must be >= 0, got {n}")
    alloc = {task: 0 for task in available}
    remaining = budget
    open_tasks = [t for t in available if available[t] > 0]
    while remaining > 0 and open_tasks:
        share, extra = divmod(remaining, len(open_tasks))
        for i, task in enumerate(open_tasks):
            take = min(share + (1 if i < extra else 0), available[task] - alloc[task])
            alloc[task] += take
            remaining -= take
        open_tasks = [t for t in open_tasks if alloc[t] < available[t]]
    return alloc


def select(items, scores, k: int, mode: str = "top", seed: int | str = 0) -> list:
    """Pick k of `items` by their `scores` (same length). Returns the picked items,
    best first for "top".

    top:    the k highest scores; ties are broken by a seeded shuffle, not by the items' order
    low:    the k lowest scores (ties likewise)
    random: a seeded uniform sample of k, scores ignored
    Scores may be -inf (e.g. empty responses) but not NaN. The same (items, scores, k, mode, seed)
    gives the same result; `seed` may be an int or a string (e.g. f"{seed}:{task}" for a per-task
    stream).
    """
    items = list(items)
    scores = [float(s) for s in scores]
    if len(items) != len(scores):
        raise ValueError(f"select: {len(items)} items but {len(scores)} scores")
    if mode not in SELECT_MODES:
        raise ValueError(f"select: unknown mode {mode!r}; choose one of {', '.join(SELECT_MODES)}")
    if not 0 <= k <= len(items):
        raise ValueError(f"select: k={k} outside [0, {len(items)}]")
    if any(math.isnan(s) for s in scores):
        raise ValueError("select: scores contain NaN")
    rng = random.Random(seed)
    if mode == "random":
        return [items[i] for i in rng.sample(range(len(items)), k)]
    order = list(range(len(items)))
    rng.shuffle(order)  # the stable sort below keeps this shuffled order among equal scores
    order.sort(key=lambda i: scores[i], reverse=(mode == "top"))
    return [items[i] for i in order[:k]]


def replay_budget(mode: str, rho: float, prior: list, sizes: dict, next_task: str) -> dict:
    """The replay budget after the stage that trained prior[-1], before stage `next_task`.

    sizes: task -> training subsample size (before the over-long filter: 5,000 per TRACE task).
    total:    {"total": buffer_size(rho, sizes[next_task])}, to be split over `prior` by `allocate`
    per-task: {"per_task": {t: buffer_size(rho, sizes[t]) for t in prior}}, each capped later by
              what t has
    """
    if mode == "total":
        return {"total": buffer_size(rho, sizes[next_task])}
    if mode == "per-task":
        return {"per_task": {t: buffer_size(rho, sizes[t]) for t in prior}}
    raise ValueError(f"unknown replay budget {mode!r}; choose one of {', '.join(REPLAY_BUDGETS)}")


def replay_counts(budget: dict, available: dict) -> dict:
    """Examples per prior task from a `replay_budget` and the candidates each task has
    (task -> count, in order)."""
    if "per_task" in budget:
        return {t: min(budget["per_task"][t], n) for t, n in available.items()}
    return allocate(budget["total"], available)


def gold_draw(train_sets: dict, prior: list, budget: dict, seed: int) -> list:
    """Gold replay's buffer after the stage that trained prior[-1]: a seeded uniform draw of the
    budget's examples from each prior task's training examples, as (task, example) in task
    order. run.py writes it and plan.py prices it, so the two cannot disagree about which
    examples it holds."""
    counts = replay_counts(budget, {t: len(train_sets[t]) for t in prior})
    stage = len(prior)
    return [(t, e) for t in prior
            for e in select(train_sets[t], [0.0] * len(train_sets[t]), counts[t], "random",
                             f"{seed}:{stage}:{t}")]
