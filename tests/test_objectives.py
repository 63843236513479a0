"""model/objectives.py: the losses train.py's model computes inside its forward (nll, kl, nll_kl) against naive
full-vocabulary math, a micro-batch's split by source, and sdft's per-example sampling seeds. The objectives run
whole (sft, sft-kl, sdft): test_train.py and test_sdft.py."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from data.packing import IGNORE, Example
from model.objectives import kl, nll, nll_kl, replay_split, sample_seed

T, H, V = 23, 8, 37


def inputs(seed=0):
    """Hidden states [1, T] x H, a weight [V, H], shifted labels [1, T] with a prompt and a gap ignored, a teacher's
    hidden states at the labelled positions and its weight (fp64; the kernels sum in fp32)."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (1, T), generator=g)
    labels[0, :5] = IGNORE
    labels[0, 12:14] = IGNORE
    n = int((labels != IGNORE).sum())
    th, tw = torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    return h, w, labels, th, tw


def naive_kl(h, w, labels, th, tw, direction):
    s = torch.log_softmax(h[labels.flatten() != IGNORE] @ w.T, -1)
    t = torch.log_softmax(th @ tw.T, -1)
    return (s.exp() * (s - t)).sum() if direction == "reverse" else (t.exp() * (t - s)).sum()


def test_nll_is_the_summed_response_token_nll_and_splits_by_source():
    h, w, labels, _, _ = inputs()
    ref = F.cross_entropy(h @ w.T, labels.flatten(), ignore_index=IGNORE, reduction="sum")
    assert nll(labels)(h, w).item() == pytest.approx(ref.item(), rel=1e-6)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, 14:] = True  # the last document is a replayed one
    task, replay = nll(labels, mask)(h, w)
    y = labels.flatten().clone()
    y[mask.flatten()] = IGNORE
    assert task.item() == pytest.approx(F.cross_entropy(h @ w.T, y, ignore_index=IGNORE, reduction="sum").item(),
                                        rel=1e-6)
    assert (task + replay).item() == pytest.approx(ref.item(), rel=1e-6) and replay.item() > 0


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_kl_is_the_full_vocabulary_kl_at_the_labelled_positions(direction):
    h, w, labels, th, tw = inputs(1)
    got = kl(labels, th, tw, direction)(h, w)
    assert got.item() == pytest.approx(naive_kl(h, w, labels, th, tw, direction).item(), rel=1e-6)
    # reverse and forward differ on distinct distributions; each is 0 against the model itself
    other = kl(labels, th, tw, "forward" if direction == "reverse" else "reverse")(h, w)
    assert abs(got.item() - other.item()) > 1e-3
    own = h[labels.flatten() != IGNORE]
    assert kl(labels, own, w, direction)(h, w).item() == pytest.approx(0.0, abs=1e-5)


def test_nll_kl_is_nll_and_kl_from_one_forward():
    h, w, labels, th, tw = inputs(2)
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, :10] = True
    n, k = nll_kl(labels, th, tw, "reverse", mask)(h, w)
    assert torch.equal(n, nll(labels, mask)(h, w)) and torch.equal(k, kl(labels, th, tw, "reverse")(h, w))


def test_replay_split_marks_replayed_tokens_only_in_mixed_micro_batches():
    task, replay = Example([1, 2, 3], [2, 3, IGNORE]), Example([4, 5], [5, IGNORE], replay=True)
    assert replay_split([task, task], "cpu") == (None, 0)
    assert replay_split([replay], "cpu") == (None, 1)
    assert replay_split([], "cpu") == (None, 0)
    mask, slot = replay_split([task, replay, task], "cpu")
    assert slot is None and mask.tolist() == [[False] * 3 + [True] * 2 + [False] * 3]


def test_sample_seed_depends_on_the_example_alone():
    """sdft's seed of example idx at step `step`: the same in every process and rank (no RNG state), distinct for
    distinct (seed, step, idx), and not symmetric in its arguments."""
    grid = list(itertools.product(range(6), range(6), range(6)))
    seeds = [sample_seed(*g) for g in grid]
    assert len(set(seeds)) == len(grid) and all(0 <= s < 2**60 for s in seeds)
    assert seeds == [sample_seed(*g) for g in grid]
    assert sample_seed(1, 2, 3) != sample_seed(3, 2, 1) and sample_seed(0, 1, 0) != sample_seed(0, 0, 1)
