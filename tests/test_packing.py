"""data/packing.py: step plans, token-budget packing across ranks, collation of packed rows, SFT targets."""
import random
from collections import Counter

import pytest
import torch

from data.packing import IGNORE, Example, collate, pack, plan_steps, sft_example, tokenize_sft


def random_lengths(n, seed, lo=1, hi=300):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


# --- plan_steps --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,gb,epochs", [(37, 8, 3), (8, 8, 2), (5, 16, 2), (100, 7, 1)])
def test_plan_steps_covers_each_example_once_per_epoch(n, gb, epochs):
    steps = plan_steps(n, gb, epochs, seed=3)
    per_epoch = -(-n // gb)
    assert len(steps) == per_epoch * epochs
    assert all(0 < len(s) <= gb for s in steps)
    for e in range(epochs):
        epoch = [i for s in steps[e * per_epoch:(e + 1) * per_epoch] for i in s]
        assert sorted(epoch) == list(range(n))  # every example exactly once, nothing else
    # only the last step of an epoch may be short
    assert all(len(s) == gb for e in range(epochs) for s in steps[e * per_epoch:(e + 1) * per_epoch - 1])


def test_plan_steps_is_deterministic_and_seeded():
    a = plan_steps(50, 8, 3, seed=1)
    assert a == plan_steps(50, 8, 3, seed=1)
    assert a != plan_steps(50, 8, 3, seed=2)
    flat = lambda steps: [i for s in steps for i in s]  # noqa: E731
    per_epoch = len(a) // 3
    assert flat(a[:per_epoch]) != flat(a[per_epoch:2 * per_epoch])  # reshuffled every epoch
    # a shorter run is a prefix of a longer one (so --epochs does not change the first epochs' order)
    assert plan_steps(50, 8, 2, seed=1) == a[:2 * per_epoch]


def listed_plan(n, gb, epochs, seed):
    """plan_steps as it was when it built the whole list: the lazy plan must give the very same batches."""
    steps = []
    for epoch in range(epochs):
        order = list(range(n))
        random.Random(seed * 1000003 + epoch).shuffle(order)
        steps += [order[i:i + gb] for i in range(0, n, gb)]
    return steps


@pytest.mark.parametrize("n,gb,epochs,seed", [(37, 8, 3, 0), (8, 8, 2, 1), (5, 16, 2, 7), (100, 7, 4, 3), (1, 1, 5, 0)])
def test_lazy_plan_is_the_listed_plan(n, gb, epochs, seed):
    want, plan = listed_plan(n, gb, epochs, seed), plan_steps(n, gb, epochs, seed)
    assert len(plan) == len(want) and [plan[i] for i in range(len(plan))] == want and list(plan) == want
    assert [plan[-i] for i in range(1, len(want) + 1)] == [want[-i] for i in range(1, len(want) + 1)]
    k = len(want) // 2 + 1
    assert list(plan[:k]) == want[:k] and len(plan[:k]) == k and plan[1:k:2] == want[1:k:2]
    with pytest.raises(IndexError):
        plan[len(want)]


def test_a_huge_plan_costs_nothing_up_front():
    plan = plan_steps(4, 2, 10**12, 0)
    order = list(range(4))
    random.Random(10**12 - 1).shuffle(order)  # the last epoch's order
    assert len(plan) == 2 * 10**12 and plan[-2:] == [order[:2], order[2:]] and len(plan[:5]) == 5


# --- pack --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", range(5))
def test_pack_respects_budget_and_balances_ranks(world, seed):
    n, budget = 64, 512
    lengths = random_lengths(n, seed, hi=600)  # some examples are longer than the budget
    batch = random.Random(seed).sample(range(n), 40)
    per_rank = pack(batch, lengths, budget, world)
    assert len(per_rank) == world
    assert len({len(r) for r in per_rank}) == 1, "every rank must run the same number of micro-batches"
    placed = Counter(i for r in per_rank for mb in r for i in mb)
    assert placed == Counter(batch), "each example of the batch exactly once, on exactly one rank"
    for r in per_rank:
        for mb in r:
            total = sum(lengths[i] for i in mb)
            assert total <= budget or len(mb) == 1, f"micro-batch {mb} over the budget ({total} > {budget})"
    assert pack(batch, lengths, budget, world) == per_rank  # deterministic
    # the same bins whatever the order the batch is given in (it is sorted by length, then index)
    assert pack(sorted(batch), lengths, budget, world) == per_rank


def test_pack_is_tight_on_an_easy_case():
    # four 250-token examples fit two per 512-token bin; with world 4 two ranks get an empty micro-batch
    lengths = [250] * 4
    assert sorted(map(sorted, (mb for r in pack([0, 1, 2, 3], lengths, 512, 1) for mb in r))) == [[0, 1], [2, 3]]
    per_rank = pack([0, 1, 2, 3], lengths, 512, 4)
    assert [len(r) for r in per_rank] == [1, 1, 1, 1]
    assert sum(mb == [] for r in per_rank for mb in r) == 2


def test_pack_over_budget_example_gets_its_own_micro_batch():
    lengths = [1000, 10, 10]
    mbs = [mb for r in pack([0, 1, 2], lengths, 100, 1) for mb in r]
    assert [0] in mbs and sorted(i for mb in mbs for i in mb) == [0, 1, 2]


# --- collate -----------------------------------------------------------------------------------------------------

def test_collate_packs_documents_with_restarting_positions():
    a = Example([5, 6, 7], [6, 7, IGNORE])
    b = Example([8, 9], [IGNORE, IGNORE])
    c = Example([1, 2, 3, 4], [IGNORE, 3, 4, IGNORE])
    ids, pos, tgt, cu, max_len = collate([a, b, c])
    assert ids.shape == pos.shape == tgt.shape == (1, 9) and ids.dtype == pos.dtype == tgt.dtype == torch.long
    assert ids[0].tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4]
    assert pos[0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert tgt[0].tolist() == [6, 7, IGNORE, IGNORE, IGNORE, IGNORE, 3, 4, IGNORE]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 9]
    assert max_len == 4


def test_collate_empty_micro_batch_is_one_ignored_token():
    ids, pos, tgt, cu, max_len = collate([])
    assert ids.shape == (1, 1) and pos.tolist() == [[0]] and tgt.tolist() == [[IGNORE]]
    assert cu.tolist() == [0, 1] and max_len == 1


def test_targets_never_cross_document_boundaries():
    rng = random.Random(0)
    exs = []
    for _ in range(20):
        n = rng.randint(1, 30)
        ids = [rng.randrange(1, 500) for _ in range(n)]
        start = rng.randint(0, n)  # response = ids[start:], the rest is prompt
        exs.append(sft_example(ids, [IGNORE] * start + ids[start:]))
    ids, pos, tgt, cu, _ = collate(exs)
    ids, tgt, bounds = ids[0].tolist(), tgt[0].tolist(), cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        assert tgt[e - 1] == IGNORE, "a document's last position must not predict the next document's first token"
        for t in range(s, e - 1):
            assert tgt[t] in (IGNORE, ids[t + 1])  # a target is always the next token of the same document


# --- SFT targets -------------------------------------------------------------------------------------------------

def test_sft_example_shifts_labels():
    # labels (unshifted) mark ids 3..5 as the response (+ end-of-turn); targets[t] = the label of t+1
    ex = sft_example([10, 11, 12, 13, 14, 15], [IGNORE, IGNORE, IGNORE, 13, 14, 15])
    assert ex.targets == [IGNORE, IGNORE, 13, 14, 15, IGNORE]
    assert ex.n_targets == 3


class StubTokenizer:
    """encode_sft: prompt/response words -> ids; response words (and a final end-of-turn 2) are labelled."""

    def encode_sft(self, prompt, response):
        p = [100 + len(w) for w in prompt.split()]
        r = [200 + len(w) for w in response.split()] + [2]
        return [1] + p + r, [IGNORE] * (1 + len(p)) + r


def test_tokenize_sft_drops_overlong_and_never_truncates():
    records = [{"prompt": "a " * k, "response": "b " * (k % 3 + 1)} for k in range(1, 12)]
    tok = StubTokenizer()
    full = [tok.encode_sft(r["prompt"], r["response"]) for r in records]
    max_len = 9
    examples, dropped = tokenize_sft(records, tok, max_len)
    assert dropped == sum(len(ids) > max_len for ids, _ in full) > 0
    kept = [(ids, labels) for ids, labels in full if len(ids) <= max_len]
    assert [e.ids for e in examples] == [ids for ids, _ in kept]  # untouched, in order
    assert all(e.n_targets == sum(t != IGNORE for t in labels) for e, (_, labels) in zip(examples, kept))
