"""SFT examples -> packed micro-batches with no padding.

A step's global batch (e.g. 128 sequences) is packed into micro-batches by a token budget (first-fit
decreasing), the micro-batches are dealt to ranks so every rank runs the same number of
forward/backward passes, and each micro-batch is one row of concatenated documents whose positions
restart at 0, with `cu_seqlens` telling attention where documents start. Targets are shifted per
document, so no document ever predicts the first token of the next.
"""
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass
class Example:
    ids: list[int]
    targets: list[int]  # targets[t] = ids[t+1] on response tokens,
                        # IGNORE elsewhere (already shifted)
    replay: bool = False  # a replayed example (its record has a "source"),
                          # logged apart from the task's own

    @property
    def n_targets(self) -> int:
        return sum(t != IGNORE for t in self.targets)


def sft_example(ids: list[int], labels: list[int], replay: bool = False) -> Example:
    """From unshifted labels (labels[t] = ids[t] on the response, IGNORE elsewhere)
    to shifted targets."""
    return Example(ids, labels[1:] + [IGNORE], replay)


def tokenize_sft(records, tok, max_len: int):
    """Chat-template each {"prompt","response"} record. Examples longer than max_len are dropped,
    never truncated. A record's truthy "replay" field marks its example as replay. Returns
    (examples, n_dropped)."""
    examples, dropped = [], 0
    for r in records:
        ids, labels = tok.encode_sft(r["prompt"], r["response"])
        if len(ids) > max_len:
            dropped += 1
            continue
        examples.append(sft_example(ids, labels, bool(r.get("replay"))))
    return examples, dropped


class StepPlan(Sequence):
    """Example indices of every optimizer step of the run: each epoch a seeded shuffle cut into
    global batches (the last one of an epoch may be smaller). Deterministic in (n, global_batch,
    epochs, seed). Computed per step, one epoch's order at a time, so a huge --epochs costs nothing
    up front; a prefix slice (plan[:k]) is a plan too."""

    def __init__(self, n: int, global_batch: int, epochs: int, seed: int, limit: int | None = None):
        self.n, self.global_batch, self.epochs, self.seed = n, global_batch, epochs, seed
        self.per_epoch = -(-n // global_batch)
        self.length = (epochs * self.per_epoch if limit is None
                       else min(limit, epochs * self.per_epoch))
        self._epoch, self._order = None, None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, stride = i.indices(self.length)
            if start == 0 and stride == 1:
                return StepPlan(self.n, self.global_batch, self.epochs, self.seed, limit=stop)
            return [self[j] for j in range(start, stop, stride)]
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"step {i} of a plan of {self.length}")
        epoch, k = divmod(i, self.per_epoch)
        if epoch != self._epoch:
            order = list(range(self.n))
            random.Random(self.seed * 1000003 + epoch).shuffle(order)
            self._epoch, self._order = epoch, order
        return self._order[k * self.global_batch:(k + 1) * self.global_batch]

    def __eq__(self, other):
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __repr__(self):
        return (f"StepPlan(n={self.n}, global_batch={self.global_batch}, epochs={self.epochs}, "
                f"seed={self.seed}, steps={self.length})")


def plan_steps(n: int, global_batch: int, epochs: int, seed: int) -> StepPlan:
    """The run's steps (see StepPlan)."""
    return StepPlan(n, global_batch, epochs, seed)


def pack(indices: list[int], lengths: list[int], token_budget: int,
         world: int) -> list[list[list[int]]]:
    """First-fit-decreasing packing of one global batch into micro-batches of at most
    token_budget tokens (a single longer example gets a micro-batch of its own), dealt
    round-robin to `world` ranks.

    Returns per-rank lists of micro-batches (lists of example indices); every rank gets the
    same number of micro-batches, some possibly empty, because FSDP needs every rank in
    every collective."""
    bins, room = [], []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - lengths[i])
    while len(bins) % world:
        bins.append([])
    return [bins[r::world] for r in range(world)]


def collate(examples: list[Example], device="cpu"):
    """One packed row:
    (input_ids [1,T], position_ids [1,T], targets [1,T], cu_seqlens int32, max_seqlen).
    An empty micro-batch becomes a single ignored token, so the rank still runs
    forward/backward."""
    if not examples:
        examples = [Example([0], [IGNORE])]
    ids = [t for e in examples for t in e.ids]
    pos = [p for e in examples for p in range(len(e.ids))]
    tgt = [t for e in examples for t in e.targets]
    lens = [len(e.ids) for e in examples]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    as_row = lambda x: torch.tensor(x, dtype=torch.long, device=device)[None]  # noqa: E731
    return as_row(ids), as_row(pos), as_row(tgt), cu.to(device), max(lens)
