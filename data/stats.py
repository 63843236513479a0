"""Statistics for the report: spread over seeds.

    mean_std(xs)   {"mean", "std"}: the mean and the population std of a list of numbers (std None for one value)
    pearson(xs, ys)    Pearson correlation (None when a side is constant)
    spearman(xs, ys)   Spearman rank correlation, ties at their average rank (score.py: RU vs SC; the report:
                       forgetting vs drift)
"""
import math
import statistics


def mean_std(xs) -> dict:
    """{"mean", "std"} of a list of numbers; std is the population std, None for a single value."""
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs) if len(xs) > 1 else None}


def pearson(xs, ys):
    """Pearson correlation of two equal-length lists; None when either is constant or has fewer than 2 values."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} vs {len(ys)} values")
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxy = sum((a - mx) * (b - my) for a, b in zip(xs, ys))
    sxx, syy = sum((a - mx) ** 2 for a in xs), sum((b - my) ** 2 for b in ys)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def ranks(v) -> list:
    """Ranks 0..n-1 of the values of v, ties sharing their average rank (-inf is a value like any other)."""
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
    """Spearman rank correlation: Pearson on average ranks, so ties are handled; None when either side is constant
    or has fewer than 2 values."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} vs {len(ys)} values")
    return pearson(ranks(xs), ranks(ys))
