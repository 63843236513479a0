"""What the engine runs next (nano-vllm's scheduler, simplified): one Sequence per prompt, a queue
of waiting ones, the live ones in KV-cache slots 0..n-1, and an index of the live prompts' prefixes.

    sched = Scheduler(seqs, max_seqs=32, max_prefill_tokens=4096, mix=True)
    while (batch := sched.schedule()) is not None:
        tokens, logprobs = run(batch)                    # engine/engine.py: one forward
        for src, dst, cols in sched.postprocess(batch, tokens, logprobs, stop):
            copy cache columns [0, cols) of slot src into slot dst

Prompts wait in token order, so that prompts sharing a prefix (a task's instruction, evaluation's
repeats) meet. `schedule` admits waiting prompts into free slots while there are any (a Prefill: at
most `max_prefill_tokens` prompt tokens, one packed forward); with `mix` (the CPU) the live
sequences' next tokens ride in that forward (vLLM's mixed batches: a product of a few rows reads
the whole weight anyway), else a Decode of every live sequence follows. When nothing can be
admitted it returns a Decode. A prompt that shares a prefix with a resident sequence or an earlier
admission copies that prefix's cache columns and prefills only the rest. A finished sequence frees
its slot at once, and the highest live slot moves down into the hole (`postprocess` returns the one
copy that takes), so the live sequences stay in slots 0..n-1 and a decode step reads the cache's
first n rows without a gather.
"""
from collections import deque
from dataclasses import dataclass, field

BLOCK = 16  # prefix sharing looks prompts up by hashes of their first 16, 32, 48, ... tokens


@dataclass
class Sequence:
    index: int                 # its prompt's place in the call's input
    prompt: list[int]
    cap: int                   # max new tokens
    key: int                   # sampling key (engine.sampler.row_keys)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" once done

    @property
    def pos(self) -> int:
        """The position of the token it feeds in next (its last sampled one)."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclass
class Prefill:
    rows: list[Sequence]   # live sequences (slots 0..len(rows)-1) whose decode step
                           # rides in this forward
    take: list[Sequence]   # the admitted prompts, each with a document in `docs`
    docs: list[tuple]      # per admitted prompt (slot, start, end): it prefills prompt[start:end];
                           # start: shared prefix
    copies: list[tuple]    # (src slot, dst slot, columns): shared prefixes, copied
                           # before they are read

    @property
    def seqs(self) -> list[Sequence]:
        return self.rows + self.take


@dataclass
class Decode:
    seqs: list[Sequence]   # every live sequence, in slot order


class Scheduler:
    def __init__(self, seqs: list[Sequence], max_seqs: int, max_prefill_tokens: int, mix: bool):
        self.max_seqs, self.max_prefill_tokens, self.mix = max_seqs, max_prefill_tokens, mix
        self.waiting = deque(sorted(seqs, key=lambda s: (s.prompt, s.index)))
        self.live: list[Sequence] = []  # slot i holds live[i]
        # a prefill without decode rows is followed by a decode of every live sequence
        self.decode_next = False
        # prefix key -> slots; slot -> its keys, its prompt
        self._prefix, self._hashes, self._prompt = {}, {}, {}

    def schedule(self) -> Prefill | Decode | None:
        """The next batch to run, or None when every sequence is done."""
        decode_next, self.decode_next = self.decode_next, False
        if self.live and (decode_next or not (self.waiting and len(self.live) < self.max_seqs)):
            return Decode(list(self.live))
        if not self.waiting:
            return None
        rows = list(self.live) if self.mix else []
        take, docs, copies = self._take(len(self.live))
        self.live += take
        self.decode_next = not rows
        return Prefill(rows, take, docs, copies)

    def postprocess(self, batch, tokens: list[int], logprobs: list[float],
                    stop: set) -> list[tuple]:
        """Append each sequence's new token; free the slots of those that finished. Returns the
        cache copies [(src slot, dst slot, columns)] that keep the live sequences in slots 0..n-1,
        to make in order."""
        for seq, tok, lp in zip(batch.seqs, tokens, logprobs):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            if tok in stop or len(seq.tokens) == seq.cap:
                seq.finish = "stop" if tok in stop else "length"
        moves = []
        for s in sorted((s for s, q in enumerate(self.live) if q.finish is not None), reverse=True):
            last = len(self.live) - 1
            if s != last:  # the last live sequence moves into the hole (its cache columns so far)
                q = self.live[last]
                moves.append((last, s, q.pos))
                self.live[s] = q
                self._index(s, q.prompt)
            self._index(last, None)
            self.live.pop()
        return moves

    def _take(self, first_slot: int):
        """The next waiting prompts for slots first_slot.., at most max_prefill_tokens tokens to
        prefill. A prompt that repeats, or shares a prefix of at least BLOCK tokens with, a resident
        sequence or a prompt taken before it copies that prefix's cache columns and prefills only
        the rest (a repeat: its last token)."""
        take, docs, copies, n_tok = [], [], [], 0
        while self.waiting and first_slot + len(take) < self.max_seqs:
            seq, slot = self.waiting[0], first_slot + len(take)
            donor, shared = self._donor(seq.prompt)
            if take and n_tok + len(seq.prompt) - shared > self.max_prefill_tokens:
                break
            take.append(self.waiting.popleft())
            n_tok += len(seq.prompt) - shared
            docs.append((slot, shared, len(seq.prompt)))
            if donor is not None:
                copies.append((donor, slot, shared))
            self._index(slot, seq.prompt)
        return take, docs, copies

    def _donor(self, prompt) -> tuple:
        """(slot, shared length) of the resident sequence whose prompt shares the longest prefix
        with `prompt` (the whole prompt, or at least BLOCK tokens: found through prefix_keys; at
        most len(prompt) - 1, since the last token is prefilled for its logits), or (None, 0)."""
        for h in reversed(prefix_keys(prompt)):
            slots = self._prefix.get(h)
            if slots:
                slot = min(slots)
                other = self._prompt[slot]
                n = next((i for i, (a, b) in enumerate(zip(prompt, other)) if a != b),
                         min(len(prompt), len(other)))
                n = min(n, len(prompt) - 1)
                return (slot, n) if n > 0 else (None, 0)
        return None, 0

    def _index(self, slot: int, prompt):
        """Make slot's prompt findable as a donor (None: forget it)."""
        for h in self._hashes.pop(slot, ()):
            self._prefix[h].discard(slot)
        self._prompt[slot] = prompt
        if prompt is not None:
            self._hashes[slot] = prefix_keys(prompt)
            for h in self._hashes[slot]:
                self._prefix.setdefault(h, set()).add(slot)


def prefix_keys(prompt) -> list:
    """Keys of the prompt's prefixes, shortest first: chained hashes of its full BLOCK-token
    prefixes (key k identifies prompt[:BLOCK * (k + 1)]), then the whole prompt (a repeat of a short
    prompt shares it too)."""
    out, h = [], 0
    for k in range(len(prompt) // BLOCK):
        h = hash((h, tuple(prompt[k * BLOCK:(k + 1) * BLOCK])))
        out.append(h)
    return out + [("prompt", tuple(prompt))]
