"""kernels/attention.py: the varlen attention backends against naive attention, and the GPU libraries' wrappers'
contracts."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import attention, varlen_attention
import forkserver

REPO = Path(__file__).resolve().parents[1]


def cu_seqlens_of(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def naive_varlen_attention(q, k, v, cu_seqlens):
    """fp64, one [T, T] softmax with an explicit block-diagonal causal mask."""
    q, k, v = q.double(), k.double(), v.double()
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    T = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), (cu_seqlens[1:] - cu_seqlens[:-1]).long())
    pos = torch.arange(T)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [Tq, Tk]
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


@pytest.fixture
def sdpa_backend(monkeypatch):
    monkeypatch.setattr(attention, "_BACKEND", "sdpa")
    monkeypatch.setattr(attention, "_FORCED", True)


@pytest.mark.parametrize("n_heads_q, n_heads_kv", [(4, 2), (4, 4)])
def test_varlen_sdpa_matches_naive_forward_and_backward(sdpa_backend, n_heads_q, n_heads_kv):
    torch.manual_seed(0)
    lengths = [5, 1, 17, 2, 1, 9]
    cu = cu_seqlens_of(lengths)
    T, D = sum(lengths), 8
    q = torch.randn(T, n_heads_q, D, requires_grad=True)
    k = torch.randn(T, n_heads_kv, D, requires_grad=True)
    v = torch.randn(T, n_heads_kv, D, requires_grad=True)
    grad_out = torch.randn(T, n_heads_q, D)

    out = varlen_attention(q, k, v, cu, max(lengths))
    assert out.shape == (T, n_heads_q, D) and out.dtype == q.dtype
    grads = torch.autograd.grad((out * grad_out).sum(), (q, k, v))

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = naive_varlen_attention(q64, k64, v64, cu)
    ref_grads = torch.autograd.grad((ref * grad_out.double()).sum(), (q64, k64, v64))

    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), r, rtol=0, atol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_attention_node_is_bit_identical_to_the_sdpa_loop(sdpa_backend, dtype):
    """On the CPU the document loop runs as one autograd node calling the flash kernel directly; its output and
    gradients must be the bytes of SDPA called per document under autograd (what the loop did before, and what the
    tiny base and the default's tables were built with)."""
    torch.manual_seed(2)
    lengths = [5, 1, 17, 2, 33, 9]
    cu = cu_seqlens_of(lengths)
    T, D = sum(lengths), 16

    def leaves():
        g = torch.Generator().manual_seed(3)
        return [torch.randn(T, h, D, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2)]

    q, k, v = leaves()
    out = varlen_attention(q, k, v, cu, max(lengths))
    assert "opr_cpu_varlen_attention" in type(out.grad_fn).__name__  # the operator under test, not the loop
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    rq, rk, rv = leaves()
    bounds = cu.tolist()
    ref = torch.cat([F.scaled_dot_product_attention(*(x[None, s:e].transpose(1, 2) for x in (rq, rk, rv)),
                                                    is_causal=True, enable_gqa=True)[0].transpose(0, 1)
                     for s, e in zip(bounds[:-1], bounds[1:])])
    ref_grads = torch.autograd.grad(ref, (rq, rk, rv), grad_out)
    assert torch.equal(out, ref)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.equal(g, r), f"grad of {name}"
    with torch.no_grad():  # evaluation: the same output, no graph
        assert torch.equal(varlen_attention(q, k, v, cu, max(lengths)), ref)


def test_varlen_attention_never_crosses_documents(sdpa_backend):
    torch.manual_seed(1)
    lengths = [6, 7, 4]
    cu = cu_seqlens_of(lengths)
    T = sum(lengths)
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    out = varlen_attention(q, k, v, cu, max(lengths))
    k2, v2 = k.clone(), v.clone()
    doc2 = slice(int(cu[1]), int(cu[2]))
    k2[doc2] += 10 * torch.randn_like(k2[doc2])
    v2[doc2] += 10 * torch.randn_like(v2[doc2])
    out2 = varlen_attention(q, k2, v2, cu, max(lengths))
    assert torch.equal(out[: cu[1]], out2[: cu[1]]), "doc 1 changed when doc 2's k/v changed"
    assert torch.equal(out[cu[2]:], out2[cu[2]:]), "doc 3 changed when doc 2's k/v changed"
    assert not torch.allclose(out[doc2], out2[doc2])


def test_varlen_attention_flash_wrapper_contract(monkeypatch):
    """The CUDA path is a thin wrapper: check it calls flash_attn_varlen_func with the documented
    keyword names, shapes and dtypes, using a stand-in that computes the naive reference."""
    calls = []

    def fake_flash_attn_varlen_func(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, v.shape, kwargs))
        return naive_varlen_attention(q, k, v, kwargs["cu_seqlens_q"]).to(q.dtype)

    monkeypatch.setattr(attention, "flash_attn_varlen_func", fake_flash_attn_varlen_func)
    monkeypatch.setattr(attention, "_BACKEND", attention._BACKEND)
    monkeypatch.setattr(attention, "_FORCED", attention._FORCED)
    attention.set_backend("flash")

    lengths = [3, 1, 5]
    cu = cu_seqlens_of(lengths)
    T = sum(lengths)
    q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
    out = varlen_attention(q, k, v, cu, max(lengths))

    assert len(calls) == 1
    q_shape, k_shape, v_shape, kwargs = calls[0]
    assert (q_shape, k_shape, v_shape) == ((T, 4, 8), (T, 2, 8), (T, 2, 8))  # GQA passed through unexpanded
    assert set(kwargs) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "causal"}
    assert kwargs["causal"] is True
    assert kwargs["cu_seqlens_q"] is cu and kwargs["cu_seqlens_k"] is cu and cu.dtype == torch.int32
    assert kwargs["max_seqlen_q"] == kwargs["max_seqlen_k"] == 5
    attention.set_backend("sdpa")
    torch.testing.assert_close(out, varlen_attention(q, k, v, cu, max(lengths)), rtol=0, atol=1e-5)


# The torch varlen signatures by release (torch/nn/attention/varlen.py): 2.10 is_causal; 2.11 window_size instead;
# 2.12+ window_size and enable_gqa. Stand-ins with each signature compute the naive reference, refusing what
# the real kernel of that release would refuse (unequal head counts without enable_gqa).
def varlen_210(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert is_causal is True
    return _fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, gqa=False)


def varlen_211(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):
    assert tuple(window_size) == (-1, 0)  # causal
    return _fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, gqa=False)


def varlen_212(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert tuple(window_size) == (-1, 0)
    return _fake_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, gqa=enable_gqa)


VARLEN_CALLS = []


def _fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, gqa):
    VARLEN_CALLS.append((tuple(q.shape), tuple(k.shape), gqa))
    if not gqa and q.shape[1] != k.shape[1]:
        raise ValueError("Expect query and key/value to have the same number of heads")
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    return naive_varlen_attention(q, k, v, cu_q).to(q.dtype)


@pytest.mark.parametrize("fake, kv_repeated", [(varlen_210, True), (varlen_211, True), (varlen_212, False)])
@pytest.mark.parametrize("n_heads_q, n_heads_kv", [(4, 2), (4, 4)])
def test_torch_varlen_wrapper_matches_sdpa_for_each_torch_signature(monkeypatch, fake, kv_repeated, n_heads_q,
                                                                    n_heads_kv):
    """The CUDA kernel cannot run here; the wrapper's job is the call: causal the way the installed release spells
    it, and GQA either passed through (enable_gqa) or expanded first. Forward and backward equal the SDPA loop."""
    import inspect
    monkeypatch.setattr(attention, "varlen_attn", fake)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", frozenset(inspect.signature(fake).parameters))
    monkeypatch.setattr(attention, "_BACKEND", attention._BACKEND)
    monkeypatch.setattr(attention, "_FORCED", attention._FORCED)
    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    cu = cu_seqlens_of(lengths)
    T, D = sum(lengths), 8
    q = torch.randn(T, n_heads_q, D, requires_grad=True)
    k = torch.randn(T, n_heads_kv, D, requires_grad=True)
    v = torch.randn(T, n_heads_kv, D, requires_grad=True)
    g = torch.randn(T, n_heads_q, D)

    VARLEN_CALLS.clear()
    attention.set_backend("torch_varlen")
    assert attention.describe() == "torch_varlen (forced)"
    out = varlen_attention(q, k, v, cu, max(lengths))
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    assert len(VARLEN_CALLS) == 1
    q_shape, k_shape, gqa = VARLEN_CALLS[0]
    expanded = kv_repeated and n_heads_q != n_heads_kv
    assert k_shape == (T, n_heads_q if expanded else n_heads_kv, D)
    assert gqa == (not kv_repeated and n_heads_q != n_heads_kv)

    attention.set_backend("sdpa")
    ref = varlen_attention(q, k, v, cu, max(lengths))
    ref_grads = torch.autograd.grad((ref * g).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"grad of {name}")  # kv grads summed over the group


def test_default_attention_backend_is_the_first_that_can_run(monkeypatch):
    """flash -> torch_varlen -> sdpa; on this machine the reasons name what is missing."""
    reasons = {b: attention.available(b) for b in attention.BACKENDS}
    assert reasons["sdpa"] is None
    default = next(b for b in attention.BACKENDS if reasons[b] is None)
    if "KERNELS_ATTN_BACKEND" not in os.environ:
        assert attention.get_backend() == default, reasons
    if not torch.cuda.is_available():
        assert reasons["torch_varlen"] in ("no CUDA device",) or "first in torch 2.10" in reasons["torch_varlen"]
        # defaults never send CPU or fp32 tensors to a GPU kernel
        monkeypatch.setattr(attention, "_BACKEND", "torch_varlen")
        monkeypatch.setattr(attention, "_FORCED", False)
        monkeypatch.setattr(attention, "varlen_attn", None)  # would raise TypeError if called
        q = torch.randn(6, 2, 8)
        varlen_attention(q, q, q, cu_seqlens_of([2, 4]), 4)
    with pytest.raises(ValueError, match="torch_varlen"):
        attention.set_backend("bogus")


def test_attention_backend_forced_by_env_var_and_reported_by_train(tmp_path):
    """KERNELS_ATTN_BACKEND is read at import (a bad value fails naming it); train.py's log names the backends."""
    from common.outputs import write_jsonl
    from model.base import write_random_tiny
    write_random_tiny(tmp_path / "base")
    write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"say {i}", "response": f"{i}"} for i in range(4)])
    cmd = [sys.executable, str(REPO / "train.py"), "--model", str(tmp_path / "base"), "--data",
           str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "out"), "--epochs", "1", "--global-batch", "2",
           "--max-steps", "1", "--save-every", "0", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    p = forkserver.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(env, KERNELS_ATTN_BACKEND="sdpa",
                                                                                 KERNELS_CE_BACKEND="chunked"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "train.py: kernels: attention sdpa; cross-entropy chunked" in p.stdout, p.stdout
    p = forkserver.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(env, KERNELS_ATTN_BACKEND="nope"))
    assert p.returncode != 0 and "unknown backend 'nope'" in p.stderr


def test_varlen_attention_rejects_bad_cu_seqlens(sdpa_backend):
    q, k = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, k, torch.tensor([0, 4]), 4)
