"""engine/scheduler.py on hand-checked cases: which batch comes next, which slots, which cache copies. The engine's
tokens against a reference sampler are tests/test_engine.py's."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from engine.scheduler import Decode, Prefill, Scheduler, Sequence  # noqa: E402


def seqs(*prompts, cap=3):
    return [Sequence(i, list(p), cap, key=i) for i, p in enumerate(prompts)]


def test_prefill_then_decode_and_the_last_sequence_fills_a_hole():
    """Without mixing (a GPU): admit into free slots, then decode every live sequence; a finished sequence's slot
    is taken by the highest live one (one copy of its columns so far), so the live ones stay in slots 0..n-1."""
    a, b, c = seqs([5, 6], [1, 2, 3], [9])
    s = Scheduler([a, b, c], max_seqs=3, max_prefill_tokens=100, mix=False)
    batch = s.schedule()
    assert isinstance(batch, Prefill) and batch.rows == [] and batch.take == [b, a, c]  # token order
    assert batch.docs == [(0, 0, 3), (1, 0, 2), (2, 0, 1)] and batch.copies == []
    assert s.postprocess(batch, [7, 7, 7], [-1.0, -1.0, -1.0], stop={0}) == []
    batch = s.schedule()
    assert isinstance(batch, Decode) and batch.seqs == [b, a, c]
    moves = s.postprocess(batch, [0, 8, 8], [-0.5, -0.5, -0.5], stop={0})  # b stops in slot 0
    assert b.finish == "stop" and b.tokens == [7, 0] and b.logprobs == [-1.0, -0.5]
    assert moves == [(2, 0, c.pos)] and c.pos == 1 + 2 - 1 and s.live == [c, a]
    batch = s.schedule()
    assert batch.seqs == [c, a]
    assert s.postprocess(batch, [8, 8], [0.0, 0.0], stop={0}) == [] and a.finish == c.finish == "length"
    assert s.schedule() is None


def test_mixed_prefill_carries_the_live_rows_and_waits_for_a_free_slot():
    """With mixing (the CPU) a prefill carries the live sequences' decode rows; with every slot taken a prompt waits
    until one frees, then is admitted into it."""
    a, b, c = seqs([1], [2], [3], cap=2)
    s = Scheduler([a, b, c], max_seqs=2, max_prefill_tokens=100, mix=True)
    first = s.schedule()
    assert first.rows == [] and first.take == [a, b]
    s.postprocess(first, [5, 5], [0.0, 0.0], stop=set())
    assert isinstance(s.schedule(), Decode)  # a prefill without decode rows is followed by a decode
    s.postprocess(Decode([a, b]), [0, 5], [0.0, 0.0], stop={0})  # a stops; b (cap 2) is done too
    assert s.live == [] and s.schedule().take == [c]


def test_shared_prefixes_are_copied_not_prefilled():
    """A prompt sharing at least a BLOCK-token prefix with a resident or an earlier admission prefills the rest
    only; a repeat prefills its last token (its logits)."""
    base = list(range(100, 120))                   # 20 tokens
    a, b, c = seqs(base + [1, 2], base + [3], base + [1, 2])
    s = Scheduler([a, b, c], max_seqs=4, max_prefill_tokens=100, mix=True)
    batch = s.schedule()
    assert batch.take == [a, c, b]                 # token order: the repeat next to its twin
    assert batch.docs == [(0, 0, 22), (1, 21, 22), (2, 20, 21)]
    assert batch.copies == [(0, 1, 21), (0, 2, 20)]


def test_admission_stops_at_the_prefill_token_budget():
    a, b, c = seqs([1] * 6, [2] * 6, [3] * 6)
    s = Scheduler([a, b, c], max_seqs=8, max_prefill_tokens=13, mix=True)
    assert s.schedule().take == [a, b]  # 12 tokens; a third would make 18
    big = seqs([4] * 50)
    assert Scheduler(big, 8, 13, True).schedule().take == big  # one prompt always goes, whatever its length
