"""data/replay.py on hand-checked cases: the replay budget, its allocation over prior tasks, and the selection
within a task."""
import math

import pytest

from data.replay import allocate, buffer_size, replay_budget, replay_counts, select


def test_budget_from_rho_and_n():
    assert buffer_size(0.01, 5000) == 50
    assert buffer_size(0.1, 30) == 3  # 0.1 * 30 = 3.0000000000000004 in floats
    assert buffer_size(0.02, 5000) == 100 and buffer_size(0.0, 5000) == 0
    assert buffer_size(0.01, 250) == 3  # 2.5 rounds half up
    with pytest.raises(ValueError):
        buffer_size(-0.01, 5000)


def test_allocate_equal_split_remainder_to_earliest():
    assert allocate(50, {"C-STANCE": 5000, "FOMC": 5000, "MeetingBank": 5000}) == \
        {"C-STANCE": 17, "FOMC": 17, "MeetingBank": 16}
    assert allocate(50, {"C-STANCE": 5000}) == {"C-STANCE": 50}
    assert allocate(50, {f"t{i}": 100 for i in range(7)}) == {"t0": 8, **{f"t{i}": 7 for i in range(1, 7)}}
    assert list(allocate(10, {"b": 9, "a": 9})) == ["b", "a"]  # keeps the given task order
    assert allocate(10, {"b": 9, "a": 9}) == {"b": 5, "a": 5}
    assert allocate(0, {"a": 3}) == {"a": 0}


def test_allocate_shortfall_moves_to_others():
    # C-STANCE has only 5: its 12 missing go 6/6 to the others
    assert allocate(50, {"C-STANCE": 5, "FOMC": 5000, "MeetingBank": 5000}) == \
        {"C-STANCE": 5, "FOMC": 23, "MeetingBank": 22}
    # a second round can exhaust another task: 40 over (2, 10, 100) -> 2, 10, 28
    assert allocate(40, {"a": 2, "b": 10, "c": 100}) == {"a": 2, "b": 10, "c": 28}
    # not enough rollouts in total: everything is taken
    assert allocate(50, {"a": 3, "b": 0, "c": 4}) == {"a": 3, "b": 0, "c": 4}
    with pytest.raises(ValueError):
        allocate(-1, {"a": 3})


def test_replay_budget_total_and_per_task():
    # TRACE-like sizes: 5,000 subsampled per task (before the over-long filter); after the filter fewer remain
    sizes = {"C-STANCE": 5000, "FOMC": 5000, "MeetingBank": 5000, "Py150": 5000}
    after_filter = {"C-STANCE": 4990, "FOMC": 5000, "MeetingBank": 12}
    prior = ["C-STANCE", "FOMC", "MeetingBank"]
    # total: b = 0.01 * 5000 = 50 of the NEXT task's subsample (not of what survives the filter), split 17/17/16;
    # MeetingBank has only 12 left after the filter, its shortfall of 4 moves to the others
    total = replay_budget("total", 0.01, prior, sizes, "Py150")
    assert total == {"total": 50}
    assert replay_counts(total, after_filter) == {"C-STANCE": 19, "FOMC": 19, "MeetingBank": 12}
    # per-task: 0.01 of EACH prior task's 5,000 = 50 each (150 in all); each capped by what it has, nothing moves
    per_task = replay_budget("per-task", 0.01, prior, sizes, "Py150")
    assert per_task == {"per_task": {"C-STANCE": 50, "FOMC": 50, "MeetingBank": 50}}
    assert replay_counts(per_task, after_filter) == {"C-STANCE": 50, "FOMC": 50, "MeetingBank": 12}
    # sizes that differ per task: total follows the next task, per-task each prior task's own
    small = {"C-STANCE": 300, "FOMC": 800, "Py150": 1000}
    assert replay_budget("total", 0.1, ["C-STANCE", "FOMC"], small, "Py150") == {"total": 100}
    assert replay_budget("per-task", 0.1, ["C-STANCE", "FOMC"], small, "Py150") == \
        {"per_task": {"C-STANCE": 30, "FOMC": 80}}
    with pytest.raises(ValueError, match="unknown replay budget 'each'"):
        replay_budget("each", 0.1, prior, sizes, "Py150")


def test_select_top_low_random():
    items = list("abcdefgh")
    scores = [5, 1, 9, 3, 7, -math.inf, 2, 8]
    assert select(items, scores, 3, "top", seed=0) == ["c", "h", "e"]
    assert select(items, scores, 3, "low", seed=0) == ["f", "b", "g"]
    r = select(items, scores, 4, "random", seed=1)
    assert len(set(r)) == 4 and set(r) <= set(items)
    assert r == select(items, scores, 4, "random", seed=1)
    assert any(select(items, scores, 4, "random", seed=s) != r for s in range(2, 6))
    assert select(items, scores, 0, "top") == []
    with pytest.raises(ValueError, match="k=9"):
        select(items, scores, 9)
    with pytest.raises(ValueError, match="NaN"):
        select(items, [math.nan] * 8, 1)
    with pytest.raises(ValueError, match="unknown mode"):
        select(items, scores, 1, "best")


def test_select_ties_broken_by_seeded_shuffle_not_file_order():
    items = list(range(20))
    scores = [100.0] * 10 + [0.0] * 10  # ten tied winners
    picks = {tuple(select(items, scores, 4, "top", seed=s)) for s in range(10)}
    for p in picks:
        assert set(p) <= set(range(10))  # never a lower score while a tied higher one is left
    assert len(picks) > 1  # which tied winners depends on the seed ...
    assert picks != {(0, 1, 2, 3)}  # ... and is not simply the first ones in the file
    assert select(items, scores, 4, "top", seed=3) == select(items, scores, 4, "top", seed=3)
    low = select(items, scores, 12, "low", seed=0)
    assert set(low[:10]) == set(range(10, 20)) and set(low[10:]) <= set(range(10))
