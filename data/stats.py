"""Statistics for the report: spread over seeds.

    mean_std(xs)   {"mean", "std"}: the mean and the population std of a list of numbers (std None for one value)
"""
import statistics


def mean_std(xs) -> dict:
    """{"mean", "std"} of a list of numbers; std is the population std, None for a single value."""
    return {"mean": statistics.fmean(xs), "std": statistics.pstdev(xs) if len(xs) > 1 else None}
