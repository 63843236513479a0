"""The sampler (engine/sampler.py): its counter-based noise is lowbias32 bit for bit and a fixed function of (key,
counter, token); every path that skips noise (candidates at low T, the hash floor at high T, the full draw in pieces)
picks the full draw's token bit for bit, ties and the largest noise included; draws follow the softmax; log-probs are
raw (before temperature). Each test runs on both CPU paths (kernels/cpu.c's candidates, and eager torch's)."""
import math

import pytest
import torch

from engine.sampler import (_full_draw, _row_hash, _sample_candidates, _sample_thresholded, gumbel, hash32,
                           hash32_i32, sample)


@pytest.fixture(autouse=True, params=["c", "torch"])
def backend(request, monkeypatch):
    """Every test on both CPU paths: the candidates from kernels/cpu.c's one pass, and the eager torch ones (a
    machine without a C compiler)."""
    from kernels import cpu
    if request.param == "c" and cpu.backend() != "c":
        pytest.skip("no C compiler: the kernels are not built")
    if request.param == "torch":
        monkeypatch.setattr(cpu, "_library", lambda: (None, "test"))
    assert cpu.backend() == request.param


def test_noise_is_a_fixed_function_of_key_counter_and_token():
    x = torch.arange(1 << 16)
    assert len(set(hash32(x).tolist())) == 1 << 16  # a bijection on its domain (here: no collision on 65,536)
    def lowbias32(v):  # the published C, in Python integers
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)
    probe = [0, 1, 12345, 0x7FFFFFFF, 0xFFFFFFFF]
    assert hash32(torch.tensor(probe)).tolist() == [lowbias32(v) for v in probe]
    keys, counters = torch.tensor([1, 2, 1 << 40]), torch.tensor([0, 0, 5])
    g = gumbel(keys, counters, 50)
    assert torch.equal(g[0], gumbel(keys[:1], counters[:1], 50)[0]) and not torch.equal(g[0], g[1])
    u = torch.exp(-torch.exp(-gumbel(torch.arange(2000), torch.zeros(2000, dtype=torch.long), 1)[:, 0]))
    assert abs(u.mean().item() - 0.5) < 0.03  # uniform draws underneath


@pytest.mark.parametrize("vocab", [50, 4099, 49152])
def test_candidate_draw_is_the_full_draw_bit_for_bit(vocab):
    """sample() draws noise only for the tokens that can still win (engine.sampler._sample_candidates at low T,
    _sample_thresholded's distance and hash floor at high T) and the full draw a few rows at a time (_full_draw):
    all pick argmax(logits / T + gumbel) over the whole vocabulary, computed in one piece, on every row -- ties
    included (argmax's first id), rows whose winner is not the top logit, peaked and flat rows, T from 0.05 to 2. Fails when the bound on the noise (G_MAX) is too small or the tie rule differs."""
    g = torch.Generator().manual_seed(vocab)
    n, not_top = 48, 0
    for scale in (0.3, 3.0, 12.0):
        logits = torch.randn(n, vocab, generator=g) * scale
        logits[: n // 2, 1:6] = logits[: n // 2, :1]  # exact ties with the first id
        logits[n // 2:] = logits[n // 2:].round()  # many equal logits
        keys, counters = torch.randint(0, 1 << 62, (n,), generator=g), torch.randint(0, 512, (n,), generator=g)
        for t in (0.05, 0.1, 0.7, 1.0, 2.0):
            full = (logits.double() / t + gumbel(keys, counters, vocab)).argmax(-1)
            assert torch.equal(_sample_candidates(logits, t, keys, counters), full), (scale, t)
            assert torch.equal(_sample_thresholded(logits, t, keys, counters), full), (scale, t)
            assert torch.equal(_sample_thresholded(logits, t, keys, counters, rows=5), full), (scale, t)
            assert torch.equal(_full_draw(logits, t, keys, counters, rows=5), full), (scale, t)
            not_top += (full != logits.argmax(-1)).sum().item()
    assert not_top > 100  # the noise decided many rows, not only the logits


def test_a_token_that_wins_only_by_the_largest_noise_is_a_candidate():
    """The bound is tight: a token whose scaled logit is G_MAX - 1e-3 below the top token's drawn score wins when
    its own noise is the largest there is (u's top value), and the candidate draw must find it. Its key is searched
    for: the vocabulary id whose hash is 0xFFFFFFFF (lowbias32 inverted) must fall inside the vocabulary."""
    def inverse_lowbias32(v):
        inv = lambda c: pow(c, -1, 1 << 32)  # noqa: E731
        v ^= v >> 16
        v = (v * inv(0x846CA68B)) & 0xFFFFFFFF
        v ^= (v >> 15) ^ (v >> 30)
        v = (v * inv(0x7FEB352D)) & 0xFFFFFFFF
        return v ^ (v >> 16)
    assert hash32(torch.tensor([inverse_lowbias32(0xFFFFFFFF)])).item() == 0xFFFFFFFF
    vocab = 4096
    counters = torch.arange(1 << 21)
    ids = _row_hash(torch.full_like(counters, 7), counters) ^ inverse_lowbias32(0xFFFFFFFF)
    hit = (ids < vocab).nonzero()[0].item()
    keys, counters, j = torch.tensor([7]), counters[hit:hit + 1], ids[hit].item()
    top = (j + 1) % vocab
    g = gumbel(keys, counters, vocab)[0]
    largest = -math.log(-math.log((2 ** 32 - 0.5) / 2 ** 32))  # u's top value through -log(-log u)
    assert g[j].item() == pytest.approx(largest, abs=1e-9)
    for t in (1.0, 0.1):
        logits = torch.full((1, vocab), -1e4)
        logits[0, top] = 0.0
        logits[0, j] = (g[top].item() - largest + 1e-3) * t
        assert (logits.double() / t + g).argmax(-1).item() == j  # the largest noise decides
        assert _sample_candidates(logits, t, keys, counters).item() == j
        assert _sample_thresholded(logits, t, keys, counters).item() == j


def test_the_int32_hash_is_lowbias32_bit_for_bit():
    """hash32 runs in int32 with wrapping products; it must give lowbias32's words exactly as the int64 arithmetic
    that never overflows does (the noise, and so every sampled token, is made of them): 4M random words and the
    edges of the signed range, in any shape."""
    def mul32(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF

    def lowbias32(x):
        x = mul32(x ^ (x >> 16), 0x7FEB352D)
        x = mul32(x ^ (x >> 15), 0x846CA68B)
        return x ^ (x >> 16)
    x = torch.cat([torch.randint(0, 1 << 32, (1 << 22,), generator=torch.Generator().manual_seed(0)),
                   torch.tensor([0, 1, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 32) - 2, (1 << 32) - 1])])
    assert torch.equal(hash32(x), lowbias32(x))
    assert torch.equal(hash32(x[:4096].view(64, 64)), lowbias32(x[:4096]).view(64, 64))


def test_the_far_floor_is_below_its_noise_bound_and_tight():
    """FAR_FLOOR: every hash below it gives u < exp(-exp(-FAR_D)) exactly (so a token at distance >= FAR_D with such a
    hash cannot win), and 3 hashes above it one reaches it (so it filters what it can). Checked in 50-digit decimals,
    not in the fp64 that made it."""
    from decimal import Decimal, getcontext
    from engine.sampler import FAR_D, FAR_FLOOR
    getcontext().prec = 50
    bound = (-(Decimal(-FAR_D).exp())).exp()  # exp(-exp(-FAR_D))
    u = lambda x: (Decimal(x) + Decimal("0.5")) / Decimal(2) ** 32  # noqa: E731
    assert u(FAR_FLOOR) < bound <= u(FAR_FLOOR + 3)


def test_sampling_follows_the_softmax():
    """Gumbel-max over the keyed noise draws from softmax(logits / T): frequencies over 4,000 keys."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    tokens, logprobs = sample(logits, 0.5, torch.arange(4000), torch.zeros(4000, dtype=torch.long))
    freq = torch.bincount(tokens, minlength=4).double() / 4000
    assert (freq - torch.softmax(logits[0].double() / 0.5, -1)).abs().max() < 0.02
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0])  # raw, not /T


def test_the_hash_leaves_its_input_as_it_is():
    """hash32_i32 works in place on tensors of its own: the caller's words (here the vocabulary ids a draw reuses)
    must come back unchanged, in any shape."""
    x = torch.arange(-4096, 4096, dtype=torch.int32).view(64, 128)
    before = x.clone()
    h = hash32_i32(x)
    assert torch.equal(x, before) and not torch.equal(h, before)
    assert torch.equal(hash32_i32(x[:1].expand(64, 128)), hash32_i32(x[:1]).expand(64, 128))  # an expanded view


def test_the_top_k_shortcut_falls_back_when_more_than_k_tokens_can_win():
    """At low T the candidates are looked for among each row's TOP_K largest logits first; when more tokens than
    that can win (here TOP_K + 8 tie at the top, far above the rest) the winner is often one topk did not return,
    and the sampler must find it over the whole vocabulary: the full draw's token on every row."""
    from engine.sampler import TOP_K
    n, vocab = 2000, 4099
    g = torch.Generator().manual_seed(1)
    logits = torch.full((n, vocab), -30.0)
    logits[:, torch.randperm(vocab, generator=g)[:TOP_K + 8]] = 5.0
    keys, counters = torch.randint(0, 1 << 62, (n,), generator=g), torch.zeros(n, dtype=torch.long)
    full = (logits.double() / 0.1 + gumbel(keys, counters, vocab)).argmax(-1)
    assert torch.equal(_sample_candidates(logits, 0.1, keys, counters), full)
    assert torch.equal(sample(logits, 0.1, keys, counters)[0], full)
    outside = (full[:, None] != logits.topk(TOP_K, dim=-1).indices).all(-1)
    assert outside.sum() > n // 10  # the winner was not among topk's TOP_K on many rows
