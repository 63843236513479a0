"""Statistics for the report: spread over seeds, paired differences, and two kinds of 95% intervals.

Two sources of noise, two intervals; neither covers the other's:
  seeds     t-interval over seeds (needs >= 2): retraining with another seed changes the data order,
            the replay draws, the rollout and the evaluation sampling, but NOT the test prompts
            (every seed is evaluated on the same test set). Paired: a method and its reference share
            the seed, hence the stage-1 checkpoint and the data order, so the interval is on the
            per-seed difference.
  test set  percentile bootstrap over test prompts (works with one seed): the trained checkpoints
            are held fixed and each task's test examples are resampled with replacement, the SAME
            resampled indices for every method, stage and seed (all are evaluated on the same
            prompts), so differences stay paired.

    mean_std(xs)                          {"mean", "std", "n"}: std = sample std (n-1 denominator),
                                          None when n == 1
    t_quantile(df, level=0.95)            two-sided Student-t quantile, exact for integer df
                                          (t(0.975, 4) = 2.776)
    t_interval(xs, level=0.95)            (lo, hi) of the mean of xs, None when len(xs) < 2
    known_std_interval(xs, std, n_ref)    (lo, hi) of the mean of xs with the seed std measured
                                          elsewhere (std over n_ref seeds): what a run with one seed
                                          can say about seed noise
    paired_differences(a, b)              {seed: a[seed] - b[seed]} over the seeds both have
    bootstrap_indices(sizes, B, seed)     {task: int array [B, n_task]}: the shared
                                          resampled test indices
    bootstrap_acc_bwt(runs, idx)          {"acc": [B], "bwt": [B] or None}: ACC/BWT per resample,
                                          mean over seeds
    percentile_interval(samples, level)   (lo, hi) of bootstrap samples
    excludes_zero(interval)               True when the interval lies strictly on one side of 0
    pearson(xs, ys)                       Pearson correlation (None when a side is constant)
    spearman(xs, ys)                      Spearman rank correlation, ties at their average rank
                                          (score.py: RU vs SC; the report: forgetting vs drift)
    noise_sources(values, examples)       where the seed spread of a mean over tasks (ACC, BWT)
                                          comes from: each task's share of the variance, and the
                                          part that more test prompts remove

BOOTSTRAP_B and BOOTSTRAP_SEED are the defaults the report uses.
"""
import math
import statistics

import numpy as np

BOOTSTRAP_B = 1000     # resamples of the test set
BOOTSTRAP_SEED = 0     # seed of the resampling's numpy Generator: the same results.json
                       # gives the same intervals
LEVEL = 0.95           # every interval in the report


def mean_std(xs) -> dict:
    """{"mean", "std", "n"} of a list of numbers; std is the sample std (n-1 denominator), None for
    a single value."""
    xs = list(xs)
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else None,
            "n": len(xs)}


# --------------------------------------------------------------------------------------------------
# Student-t intervals over seeds


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer df >= 1, in closed form
    (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ... up to cos^(df-3)))
    if df % 2 == 1:
        term, total = 1.0, 0.0
        if df > 1:
            total = 1.0
            for k in range(1, (df - 3) // 2 + 1):
                term *= (2 * k) / (2 * k + 1) * c2
                total += term
        return (2 / math.pi * (theta + s * math.cos(theta) * total) if df > 1
                else 2 / math.pi * theta)
    # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ... up to cos^(df-2))
    term, total = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return s * total


def t_quantile(df: int, level: float = LEVEL) -> float:
    """The t with P(|T| <= t) = level for Student's t with df degrees of freedom (df >= 1, an
    integer): the two-sided quantile, e.g. t_quantile(4) = t(0.975, 4) = 2.7764. Bisection on the
    exact CDF to 1e-12."""
    if int(df) != df or df < 1:
        raise ValueError(f"t_quantile: df must be a positive integer, got {df!r}")
    if not 0 < level < 1:
        raise ValueError(f"t_quantile: level must be in (0, 1), got {level!r}")
    lo, hi = 0.0, 1.0
    while _t_central(hi, int(df)) < level:
        hi *= 2
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_central(mid, int(df)) < level else (lo, mid)
    return (lo + hi) / 2


def t_interval(xs, level: float = LEVEL):
    """(lo, hi) = mean -/+ t(df = n-1) * sample std / sqrt(n); None when there are
    fewer than 2 values."""
    xs = list(xs)
    if len(xs) < 2:
        return None
    half = t_quantile(len(xs) - 1, level) * statistics.stdev(xs) / math.sqrt(len(xs))
    m = statistics.fmean(xs)
    return (m - half, m + half)


def known_std_interval(xs, std: float, n_ref: int, level: float = LEVEL):
    """(lo, hi) = mean -/+ t(df = n_ref-1) * std / sqrt(n), where std is a sample std measured on
    n_ref other seeds of the same setting (a preset's noise table), not on xs: the interval a run
    with too few seeds of its own can give for seed noise. It holds as far as that std holds for
    this run. None when xs is empty."""
    xs = list(xs)
    if not xs:
        return None
    half = t_quantile(n_ref - 1, level) * std / math.sqrt(len(xs))
    m = statistics.fmean(xs)
    return (m - half, m + half)


def paired_differences(a: dict, b: dict) -> dict:
    """{seed: a[seed] - b[seed]} for the seeds present in both (in a's order); None
    values are skipped."""
    return {s: a[s] - b[s] for s in a if s in b and a[s] is not None and b[s] is not None}


def excludes_zero(interval) -> bool:
    return interval is not None and (interval[0] > 0 or interval[1] < 0)


# --------------------------------------------------------------------------------------------------
# Bootstrap over test prompts


def bootstrap_indices(sizes: dict, B: int = BOOTSTRAP_B, seed: int = BOOTSTRAP_SEED) -> dict:
    """{task: int64 array [B, n]} of indices drawn with replacement from range(n), n = sizes[task].
    One numpy Generator seeded with `seed` draws the tasks in the order of `sizes`, so the result is
    a function of (sizes, B, seed) only. Every method, stage and seed is resampled with these same
    rows (paired)."""
    rng = np.random.default_rng(seed)
    return {t: rng.integers(0, n, size=(B, n)) for t, n in sizes.items()}


def bootstrap_acc_bwt(runs: list, tasks: list, idx: dict) -> dict:
    """ACC and BWT for every bootstrap resample, averaged over the seeds in `runs`.

    runs: one entry per seed, each ragged like the accuracy matrix: runs[s][i][j] = the
    per-example scores (a list, ordered like the test set) of task j after stage i. tasks: the
    names of the columns (keys of idx). Returns {"acc": float array [B], "bwt": float array [B] or
    None with one stage}. The identity resample gives the ACC/BWT of data.metrics.acc_bwt on the
    per-example means."""
    accs, bwts = [], []
    for run in runs:
        n = len(run)
        cell = {}  # (i, j) -> [B] resampled means; only the cells ACC/BWT read

        def mean_at(i, j):
            if (i, j) not in cell:
                cell[(i, j)] = np.asarray(run[i][j], dtype=np.float64)[idx[tasks[j]]].mean(axis=1)
            return cell[(i, j)]
        accs.append(np.mean([mean_at(n - 1, j) for j in range(n)], axis=0))
        if n > 1:
            bwts.append(np.mean([mean_at(n - 1, j) - mean_at(j, j) for j in range(n - 1)], axis=0))
    return {"acc": np.mean(accs, axis=0), "bwt": np.mean(bwts, axis=0) if bwts else None}


def percentile_interval(samples, level: float = LEVEL):
    """(lo, hi): the (1-level)/2 and (1+level)/2 quantiles of the bootstrap samples
    (numpy's linear rule)."""
    lo, hi = np.quantile(np.asarray(samples, dtype=np.float64), [(1 - level) / 2, (1 + level) / 2])
    return (float(lo), float(hi))


# --------------------------------------------------------------------------------------------------
# Correlations


def pearson(xs, ys):
    """Pearson correlation of two equal-length lists; None when either is constant or has
    fewer than 2 values."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} vs {len(ys)} values")
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((a - mx) * (b - my) for a, b in zip(xs, ys))
    sxx, syy = sum((a - mx) ** 2 for a in xs), sum((b - my) ** 2 for b in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def ranks(v) -> list:
    """Ranks 0..n-1 of the values of v, ties sharing their average rank (-inf is a
    value like any other)."""
    order = sorted(range(len(v)), key=lambda i: v[i])
    r, i = [0.0] * len(v), 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(xs, ys):
    """Spearman rank correlation: Pearson on average ranks, so ties are handled; None when either
    side is constant or has fewer than 2 values."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} vs {len(ys)} values")
    return pearson(ranks(xs), ranks(ys))


# --------------------------------------------------------------------------------------------------
# Where the spread over seeds comes from


def noise_sources(values, examples=None):
    """Where the spread over seeds of a mean over N tasks comes from (ACC: of the final row; BWT: of
    final minus own-stage score, the last task left out).

    values[s][j]: task j's number on seed s. examples[s][j] (optional): its per-example scores
    on task j's test prompts, the same prompts in the same order on every seed, with
    values[s][j] their mean (to 1e-3). With V the sample variance over seeds (n-1) and C the
    tasks' sample covariance matrix:

      var       V(mean over tasks) = sum(C) / N^2; "std" is its square root
      share[j]  sum_k C[j, k] / N^2 / var: task j's part of var. The shares sum to 1; a negative one
                belongs to a task that moves against the others.
      prompt    sum_j sum_p V(examples[:, j, p]) / P_j^2 / N^2: the part of var made of each
                prompt's own seed-to-seed variation (sampling, which prompts a seed happens to get
                right). With k times as many test prompts drawn the same way it becomes prompt / k.
                The rest is the covariance between one seed's prompts (a seed that learned a task
                better scores higher on all of them): more prompts leave it.
      floor     sqrt(max(var - prompt, 0)): the std that no number of test prompts goes below.

    Returns {"n": seeds, "std", "task_std": [N], "share": [N] or None (var <= 1e-12: no spread
    to share out), "prompt": float or None (no examples), "floor": float or None}, or None with
    fewer than 2 seeds."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 2:
        raise ValueError(f"noise_sources: values must be [seeds][tasks], got shape {v.shape}")
    n_seeds, n_tasks = v.shape
    if n_seeds < 2:
        return None
    c = np.cov(v, rowvar=False, ddof=1).reshape(n_tasks, n_tasks)
    var = float(c.sum()) / n_tasks ** 2
    out = {"n": n_seeds, "std": math.sqrt(max(var, 0.0)), "task_std": np.sqrt(np.diag(c)).tolist(),
           "share": (c.sum(axis=1) / n_tasks ** 2 / var).tolist() if var > 1e-12 else None,
           "prompt": None, "floor": None}
    if examples is not None:
        if len(examples) != n_seeds or any(len(e) != n_tasks for e in examples):
            raise ValueError("noise_sources: examples must be [seeds][tasks][prompts] like values")
        prompt = 0.0
        for j in range(n_tasks):
            # [seeds, prompts]; ragged -> error
            x = np.asarray([e[j] for e in examples], dtype=np.float64)
            if x.ndim != 2 or not np.allclose(x.mean(axis=1), v[:, j], rtol=0, atol=1e-3):
                raise ValueError(f"noise_sources: task {j}'s example scores "
                                 f"do not average to its values")
            prompt += float(x.var(axis=0, ddof=1).sum()) / x.shape[1] ** 2
        out["prompt"] = prompt / n_tasks ** 2
        out["floor"] = math.sqrt(max(var - out["prompt"], 0.0))
    return out

