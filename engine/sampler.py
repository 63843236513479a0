"""The sampler and its random numbers.

The raw log-prob of each sampled token is log_softmax(logits)[token] in fp32, before temperature
(vLLM's raw_logprobs). The token is drawn by the Gumbel-max trick, argmax(logits / T + g), with
g = -log(-log u) and u a counter-based hash of (the row's key, the token's index in its response,
the vocabulary id): exact sampling from softmax(logits / T), and a prompt's draws depend on its own
key only, never on its neighbours in a batch, the batch size, the schedule or the device. Keys:
`seeds[i]` when given (train.py's SDFT: one per example and step), else a function of (seed, i).
temperature 0 is greedy. The noise is bounded (u has 32 bits), so only tokens whose scaled logit
lies within that bound of the top token's drawn score can win: outside a CUDA graph the sampler
draws noise for those alone (at T 0.1 a handful, found among each row's largest logits; at high T,
where most tokens lie within it, for those near the top and the few whose hash is large enough), the
same tokens bit for bit as the draw over the whole vocabulary. On the CPU the candidates come from
one pass in C over each row (kernels/cpu.c), else from eager torch ops.
"""
import math

import torch

from kernels import cpu

M32 = 0xFFFFFFFF


# ---- counter-based random numbers: the same bits on every device and for every batch -------------
def _i32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


def hash32_i32(x):
    """lowbias32 (C. Wellons' integer hash) on int32 tensors holding 32-bit words (two's
    complement): products wrap mod 2^32 as the hash wants, and shifts are made logical by a mask.
    Half the bytes and ops of int64 arithmetic. `x` is left as it is: one new tensor and one
    scratch, every other op in place (eleven [rows, vocab] temporaries would each be allocated and
    streamed through memory)."""
    s = x >> 16
    s &= 0xFFFF
    x = x ^ s
    x *= _i32(0x7FEB352D)
    torch.bitwise_right_shift(x, 15, out=s)
    s &= 0x1FFFF
    x ^= s
    x *= _i32(0x846CA68B)
    torch.bitwise_right_shift(x, 16, out=s)
    s &= 0xFFFF
    x ^= s
    return x


def hash32(x):
    """lowbias32, a bijection of [0, 2^32), on int64 tensors of values in that range."""
    h = hash32_i32(x.to(torch.int32)).long()
    h &= M32
    return h


def _row_hash(keys, counters):
    """Each row's 32-bit stream id from its int64 key [n] (any non-negative value < 2^63)
    and counter [n]."""
    # not symmetric in the halves: (s, i) != (i, s)
    row = hash32(hash32(keys & M32) ^ ((keys >> 32) & M32))
    return hash32(row ^ (counters & M32))


def _noise(row, ids):
    """The Gumbel noise (fp64) of vocabulary ids under row hashes `row` (broadcast together)."""
    u = hash32(row ^ ids).double()
    u += 0.5
    u *= 2.0 ** -32  # in (0, 1)
    return u.log_().neg_().log_().neg_()  # -log(-log(u)), in place


def gumbel(keys, counters, vocab: int):
    """Gumbel noise [n, vocab] (fp64) for rows with int64 keys [n] drawing their counters[n]-th
    token: a function of (key, counter, vocabulary id) only."""
    return _noise(_row_hash(keys, counters)[:, None], torch.arange(vocab, device=keys.device))


# The largest noise any token can draw (u's largest value, (2^32 - 0.5) / 2^32). A token whose
# scaled logit plus it falls short of some token's drawn score cannot win the argmax, so its noise
# need never be drawn.
G_MAX = -torch.log(-torch.log(torch.tensor((2.0 ** 32 - 0.5) * 2.0 ** -32,
                                           dtype=torch.float64))).item()
# The candidates at low T are first looked for among each row's TOP_K largest logits (a
# partial sort), which spares the whole-vocabulary compare and nonzero when, as at T 0.1,
# only a handful can win
TOP_K = 16
# Above this temperature the tokens within T * G_MAX logits of the top are most of a language
# model's vocabulary, and looking for them costs more than it saves; below it, a few (both ways
# give the same tokens)
CANDIDATE_MAX_T = 0.5
# A token whose scaled logit lies d below the top token's drawn score wins only if its noise reaches
# d, i.e. its u >= exp(-exp(-d)). At d >= FAR_D = 8 that is u in the top 0.034 % of its range:
# FAR_FLOOR is a hash value below which u falls short of it (a 2-hash margin for the fp64 rounding),
# so a token at least FAR_D below whose hash is under it cannot win, and telling so costs its hash
# and a compare, not the noise's two fp64 logs.
FAR_D = 8
FAR_FLOOR = int(math.floor(math.exp(-math.exp(-FAR_D)) * 2.0 ** 32 - 0.5)) - 2


def sample(logits, temperature: float, keys, counters):
    """logits [n, V] -> (token ids [n], raw fp32 log-prob of each [n]); see the module docstring."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
    elif ((logits.is_cuda and torch.cuda.is_current_stream_capturing())
          or torch.compiler.is_compiling()):
        tokens = _full_draw(logits, temperature, keys, counters)  # static shapes
    elif temperature > CANDIDATE_MAX_T:
        tokens = _sample_thresholded(logits, temperature, keys, counters)
    else:
        tokens = _sample_candidates(logits, temperature, keys, counters)
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs


def _chunk(logits) -> int:
    """Rows per piece of a whole-vocabulary draw: on the CPU 2^21 elements per temporary (the
    piece size that measured fastest: git show 2a0ae35:BENCHMARKS.md, "The hash in place"); on a
    GPU all rows at once."""
    n, vocab = logits.shape
    return n if logits.is_cuda else max(1, (1 << 21) // vocab)


def _full_draw(logits, temperature: float, keys, counters, rows: int | None = None):
    """argmax(logits / T + gumbel) over the whole vocabulary, `rows` rows at a time (_chunk)."""
    n, vocab = logits.shape
    rows = rows or _chunk(logits)
    return torch.cat([gumbel(keys[i:i + rows], counters[i:i + rows], vocab)
                      .add_(logits[i:i + rows].double() / temperature).argmax(-1)
                      for i in range(0, n, rows)])


def _top_score(logits, temperature: float, row):
    """Each row's top token's drawn score, logit / T + noise, in fp64 as the full
    draw computes it."""
    top = logits.argmax(-1)
    return logits.gather(-1, top[:, None]).squeeze(-1).double() / temperature + _noise(row, top)


def _logit_floor(best, d: float, temperature: float):
    """The fp32 logit above which a token lies within d of `best` once scaled, lowered by fp32's
    rounding so that the tokens above it are a superset of the exact ones."""
    floor = ((best - d) * temperature).float()
    return floor - (floor.abs() * 1e-6 + 1e-6)


def _argmax_among(logits, temperature: float, row, r, j):
    """_full_draw's tokens when only the (row r, id j) pairs can win (in any order): their scores by
    the full draw's ops, element for element, and argmax's rule among equal maxima, the first id."""
    n, vocab = logits.shape
    score = logits[r, j].double() / temperature + _noise(row[r], j)
    row_max = torch.full((n,), -torch.inf, dtype=score.dtype,
                         device=score.device).scatter_reduce(0, r, score, "amax")
    won = score == row_max[r]
    return torch.full((n,), vocab, device=r.device).scatter_reduce(0, r[won], j[won], "amin")


def _sample_candidates(logits, temperature: float, keys, counters):
    """_full_draw's tokens, bit for bit, with noise drawn only for the tokens that can win: those
    whose scaled logit plus G_MAX reaches some token's drawn score (a lower bound on the winner's):
    at T 0.1 a handful (the noise's range, ~26, is 2.6 logits there). They are looked for among each
    row's TOP_K largest logits first (when the K-th lies below the bound, every token that can win
    is among them), else by a compare over the whole vocabulary. On the CPU one C pass finds them
    (kernels/cpu.c: the largest logit, then the compare, per row). Its shapes depend on the data:
    not under a CUDA graph's capture or torch.compile."""
    n, vocab = logits.shape
    row = _row_hash(keys, counters)
    # within G_MAX; no hash floor (M32 lets only a hash of 2^32 - 1 through: a harmless
    # extra candidate)
    if not logits.is_cuda and cpu.backend() == "c":
        return _c_draw(logits, temperature, keys, counters, row, G_MAX, M32)
    top, ids = logits.topk(min(TOP_K, vocab), dim=-1)
    floor = _logit_floor(top[:, 0].double() / temperature + _noise(row, ids[:, 0]),
                         G_MAX, temperature)
    # (false for a NaN row: the whole-vocabulary path decides it as before)
    if bool((top[:, -1] < floor).all()):
        can_win = top >= floor[:, None]
        return _argmax_among(logits, temperature, row,
                             torch.arange(n, device=logits.device)[:, None]
                             .expand_as(ids)[can_win], ids[can_win])
    r, j = (logits >= floor[:, None]).nonzero(as_tuple=True)
    if r.numel() * 8 > logits.numel():  # a flat distribution: most tokens can win
        return _full_draw(logits, temperature, keys, counters)
    return _argmax_among(logits, temperature, row, r, j)


def _c_draw(logits, temperature: float, keys, counters, row, far_d: float, hash_floor: int):
    """_full_draw's tokens through kernels/cpu.c's one pass per row: the tokens within far_d of the
    row's top token's drawn score or whose hash reaches hash_floor, then their scores by
    _argmax_among (the full draw when they are more than an eighth of the logits)."""
    found = cpu.far_candidates(logits, row, hash_floor, temperature=temperature, far_d=far_d)
    if found is None:
        return _full_draw(logits, temperature, keys, counters)
    return _argmax_among(logits, temperature, row, *found)


def _sample_thresholded(logits, temperature: float, keys, counters, rows: int | None = None):
    """_full_draw's tokens, bit for bit, for high temperatures, where most of the vocabulary lies
    within G_MAX of the top: every token's hash is computed, but the noise (two fp64 logs) only for
    the tokens within FAR_D of the top token's drawn score and the few further ones whose hash
    clears FAR_FLOOR, at T 1 a few dozen per row. On the CPU the hashes and compares run in one C
    pass (kernels/cpu.c: the same candidates); else `rows` at a time (_chunk), eager."""
    n, vocab = logits.shape
    if not logits.is_cuda and cpu.backend() == "c":
        return _c_draw(logits, temperature, keys, counters, _row_hash(keys, counters),
                       FAR_D, FAR_FLOOR)
    rows = rows or _chunk(logits)
    if n > rows:
        return torch.cat([_sample_thresholded(logits[i:i + rows], temperature, keys[i:i + rows],
                                              counters[i:i + rows], rows)
                          for i in range(0, n, rows)])
    row = _row_hash(keys, counters)
    near = _logit_floor(_top_score(logits, temperature, row), FAR_D, temperature)
    h = hash32_i32(row.to(torch.int32)[:, None]
                   ^ torch.arange(vocab, dtype=torch.int32, device=logits.device))
    # unsigned h >= FAR_FLOOR, as int32s: flipping the sign bit of both keeps their unsigned order
    h ^= _i32(1 << 31)
    can_win = h >= _i32(FAR_FLOOR ^ (1 << 31))
    can_win |= logits >= near[:, None]
    r, j = can_win.nonzero(as_tuple=True)
    # flat rows (a logit spread under FAR_D * T): most tokens can win
    if r.numel() * 8 > logits.numel():
        return _full_draw(logits, temperature, keys, counters, rows)
    return _argmax_among(logits, temperature, row, r, j)


def row_keys(n: int, seed: int, seeds=None) -> list[int]:
    """One sampling key per prompt: seeds[i], or (seed, i) packed into 63 bits."""
    if seeds is not None:
        return [int(s) & ((1 << 63) - 1) for s in seeds]
    return [((seed & 0x7FFFFFFF) << 32) | i for i in range(n)]
