"""The engine's C kernels (kernels/cpu.py, kernels/cpu.c): attention over each token's own cache span against naive
fp64 math and against the engine's batched torch path; the sampler's candidates equal to the eager torch ones, bit for
bit; the engine the same with and without them; a machine without a compiler falls back to torch."""
import pytest
import torch

from kernels import cpu
from engine import sampler

pytestmark = pytest.mark.skipif(cpu.backend() != "c", reason="no C compiler: the kernels are not built")


def naive(q, k, v, slots, pos):
    """fp64 softmax(q k^T / sqrt(D)) v over columns 0..pos[i] of slot slots[i], query head h on kv head h // G."""
    n, hq, d = q.shape
    g = hq // k.shape[1]
    out = []
    for i in range(n):
        ks = k[slots[i], :, :pos[i] + 1].double().repeat_interleave(g, 0)
        vs = v[slots[i], :, :pos[i] + 1].double().repeat_interleave(g, 0)
        s = q[i].double()[:, None, :] @ ks.transpose(1, 2) * d ** -0.5
        out.append((s.softmax(-1) @ vs).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("hkv,g,d", [(1, 1, 8), (2, 2, 8), (3, 3, 64), (4, 7, 128), (2, 1, 16), (2, 2, 96), (1, 2, 256)])
def test_cache_attention_equals_naive_math(hkv, g, d):
    torch.manual_seed(hkv * 100 + g * 10 + d)
    slots_n, cols, n = 9, 70, 13
    k, v = torch.randn(slots_n, hkv, cols, d), torch.randn(slots_n, hkv, cols, d)
    q = torch.randn(n, hkv * g, d) * 3  # peaked rows too
    slots = torch.randint(0, slots_n, (n,))
    pos = torch.randint(0, cols, (n,))
    pos[:3] = torch.tensor([0, 1, cols - 1])  # one column, two, all of them
    out = cpu.cache_attention(q, k, v, slots, pos)
    assert out.shape == (n, hkv * g * d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive(q, k, v, slots, pos), atol=2e-6, rtol=2e-6)
    assert torch.equal(out[0].view(hkv * g, d), v[slots[0], :, 0].repeat_interleave(g, 0))  # one column: its value


def test_cache_attention_underflow_and_threads():
    """Scores hundreds apart (exp underflows to 0 for all but one column) and any thread count: the same bytes."""
    torch.manual_seed(0)
    k, v = torch.randn(4, 2, 40, 16), torch.randn(4, 2, 40, 16)
    k[1, :, 7] *= 100
    q = torch.randn(6, 4, 16) * 10
    slots, pos = torch.tensor([1, 1, 0, 3, 2, 1]), torch.tensor([39, 7, 20, 5, 33, 6])
    out = cpu.cache_attention(q, k, v, slots, pos)
    torch.testing.assert_close(out.double(), naive(q, k, v, slots, pos), atol=2e-6, rtol=2e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.cache_attention(q, k, v, slots, pos), out)
    finally:
        torch.set_num_threads(threads)


def test_cache_attention_matches_the_batched_products():
    """The engine's torch path for decode rows (a masked batched product over the longest row's span) and the C
    kernel agree to float rounding."""
    from engine.engine import _row_mask
    torch.manual_seed(1)
    n, hkv, g, d, cols = 16, 2, 3, 32, 50
    k, v, q = torch.randn(n, hkv, cols, d), torch.randn(n, hkv, cols, d), torch.randn(n, hkv * g, d)
    pos = torch.randint(0, cols, (n,))
    span = int(pos.max()) + 1
    scores = torch.baddbmm(_row_mask(pos, span, hkv), q.view(n, hkv, g, d).flatten(0, 1),
                           k[:, :, :span].flatten(0, 1).transpose(1, 2), alpha=d ** -0.5)
    batched = torch.bmm(torch.softmax(scores, -1), v[:, :, :span].flatten(0, 1)).view(n, -1)
    torch.testing.assert_close(cpu.cache_attention(q, k, v, torch.arange(n), pos), batched, atol=2e-6, rtol=2e-6)


def test_rms_norm_equals_the_formula_and_the_module():
    """One pass per row: within float rounding of fp64 math and of transformer.RMSNorm's torch ops; the same bytes at
    any thread count."""
    from model.transformer import RMSNorm
    torch.manual_seed(2)
    x, w = torch.randn(1, 33, 128) * 5, torch.randn(128)
    x[0, 0] = 0  # a row of zeros: eps keeps it finite
    out = cpu.rms_norm(x, w, 1e-5)
    exact = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), exact, atol=1e-6, rtol=1e-6)
    norm = RMSNorm(128, 1e-5)
    norm.weight.data = w
    torch.testing.assert_close(out, norm(x), atol=1e-6, rtol=1e-6)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.rms_norm(x, w, 1e-5), out)
    finally:
        torch.set_num_threads(threads)


def test_rope_is_apply_rope_bit_for_bit_on_views_of_the_fused_product():
    from model import transformer
    torch.manual_seed(3)
    qkv = torch.randn(1, 21, 4 * 32 + 2 * 2 * 32)
    q, k = qkv[..., :128].view(1, 21, 4, 32), qkv[..., 128:192].view(1, 21, 2, 32)  # tokens 256 floats apart
    cos, sin = torch.randn(1, 21, 32), torch.randn(1, 21, 32)
    for x in (q, k):
        assert torch.equal(cpu.rope(x, cos, sin), transformer.apply_rope(x, cos, sin))


def test_silu_mul_within_ulps_of_fp64():
    torch.manual_seed(4)
    gu = torch.randn(40, 2 * 48) * 6
    gu[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, float("nan")])
    out = cpu.silu_mul(gu)
    g, u = gu[:, :48].double(), gu[:, 48:].double()
    exact = g * torch.sigmoid(g) * u
    assert torch.isnan(out[0, 5]) and out.shape == (40, 48)
    ok = ~torch.isnan(exact)
    torch.testing.assert_close(out.double()[ok], exact[ok], atol=1e-30, rtol=5e-7)


def test_the_fused_elementwise_forward_is_the_plain_one(tmp_path, monkeypatch):
    """model/logprobs.py's forward inside packed_products (packed products, the C elementwise) against the plain
    training forward: the same log-probs within 2e-5, and the C calls made."""
    pytest.importorskip("transformers")
    from model import transformer
    from model.logprobs import response_stats
    from tiny import tiny_llama
    model = tiny_llama(tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert transformer.packs(model)
    calls = []
    for name in ("rms_norm", "rope", "silu_mul"):
        monkeypatch.setattr(cpu, name, lambda *a, f=getattr(cpu, name), n=name: calls.append(n) or f(*a))
    seqs = [([5, 17, 33, 2, 9], [4, 8, 15]), ([88, 3], [16, 23, 42, 7]), ([60, 6, 20], [1])]
    fused = response_stats(model, seqs, model)
    plain = response_stats(model, seqs, model, packed=False)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=2e-5, rtol=0)
    assert {"rms_norm", "rope", "silu_mul"} == set(calls)


def eager_candidates(logits, row, near, floor):
    h = sampler.hash32_i32(row.to(torch.int32)[:, None] ^ torch.arange(logits.shape[1], dtype=torch.int32))
    h ^= sampler._i32(1 << 31)
    can = h >= sampler._i32(floor ^ (1 << 31))
    can |= logits >= near[:, None]
    return can.nonzero(as_tuple=True)


@pytest.mark.parametrize("vocab", [97, 4099, 49152])
def test_far_candidates_equal_the_eager_ones(vocab):
    """The same (row, id) pairs, in the same order, as the eager hash and compares: peaked rows, a NaN row, a row
    of ties, hashes above 2^31, a vocabulary not a multiple of 8; None when more than an eighth can win."""
    torch.manual_seed(vocab)
    n = 12
    logits = torch.randn(n, vocab) * 2
    logits[:, :5] += 20
    logits[3] = float("nan")
    logits[4] = 1.0
    keys, counters = torch.randint(0, 2**62, (n,)), torch.randint(0, 600, (n,))
    row = sampler._row_hash(keys, counters)
    assert (row >= 2**31).any()
    near = sampler._logit_floor(sampler._top_score(logits, 1.0, row), sampler.FAR_D, 1.0)
    near[4] = 2.0  # no tie reaches it: only hashes
    for floor in (sampler.FAR_FLOOR, 2**32 - 1, 0xF0000000):
        want = eager_candidates(logits, row, near, floor)
        got = cpu.far_candidates(logits, row, floor, near)
        if want[0].numel() * 8 > logits.numel():
            assert got is None
        else:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cpu.far_candidates(logits, row, sampler.FAR_FLOOR, near - 100) is None  # every token near the top
    # each row's own near, computed in C from its largest logit (the NaN row: none, as torch's argmax makes it)
    for t in (0.7, 1.0, 2.0):
        near = sampler._logit_floor(sampler._top_score(logits, t, row), sampler.FAR_D, t)
        want = eager_candidates(logits, row, near, sampler.FAR_FLOOR)
        got = cpu.far_candidates(logits, row, sampler.FAR_FLOOR, temperature=t, far_d=sampler.FAR_D)
        assert torch.isnan(near[3])
        if want[0].numel() * 8 > logits.numel():
            assert got is None
        else:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_engine_and_sampler_without_the_c_kernels(tmp_path, monkeypatch):
    """The pure-torch paths (no compiler): the same tokens, log-probs within 1e-5, at T 0, 0.1 and 1."""
    pytest.importorskip("transformers")
    from engine.engine import Engine
    from tiny import tiny_llama
    model = tiny_llama(tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    prompts = [[5, 17, 33, 2, 9], [88, 3], [60, 6, 20, 14, 9, 1, 2, 3], [5, 17, 33, 2, 9, 40]]
    runs = {}
    for backend in ("c", "torch"):
        if backend == "torch":
            monkeypatch.setattr(cpu, "_library", lambda: (None, "test"))
        engine = Engine(model, max_seqs=3)
        assert engine.c_attention == (backend == "c") and cpu.backend() == backend
        runs[backend] = [engine.run(prompts, temperature=t, max_new_tokens=12, seed=4, progress=False) for t in (0, 0.1, 1)]
    for c_out, t_out in zip(*runs.values()):
        assert [o["token_ids"] for o in c_out] == [o["token_ids"] for o in t_out]
        assert max(abs(a - b) for o, p in zip(c_out, t_out) for a, b in zip(o["logprobs"], p["logprobs"])) <= 1e-5


def test_a_failed_build_falls_back(monkeypatch, capsys):
    monkeypatch.setenv("CC", "false")  # a "compiler" whose --version fails
    lib, why = cpu._build()
    assert lib is None and "false" in why
    monkeypatch.setenv("OPR_CPU_KERNELS", "0")
    assert cpu._build() == (None, "OPR_CPU_KERNELS=0")
