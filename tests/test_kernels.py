"""kernels/: the pure-torch backends against naive references, and the GPU-library wrappers' contracts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import attention, cross_entropy, fused_linear_cross_entropy, varlen_attention

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- attention

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
    from data.outputs import write_jsonl
    from model.base import write_random_tiny
    write_random_tiny(tmp_path / "base")
    write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"say {i}", "response": f"{i}"} for i in range(4)])
    cmd = [sys.executable, str(REPO / "train.py"), "--model", str(tmp_path / "base"), "--data",
           str(tmp_path / "data.jsonl"), "--out", str(tmp_path / "out"), "--epochs", "1", "--global-batch", "2",
           "--max-steps", "1", "--save-every", "0", "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(env, KERNELS_ATTN_BACKEND="sdpa",
                                                                                 KERNELS_CE_BACKEND="chunked"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "train.py: kernels: attention sdpa; cross-entropy chunked" in p.stdout, p.stdout
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(env, KERNELS_ATTN_BACKEND="nope"))
    assert p.returncode != 0 and "unknown backend 'nope'" in p.stderr


def test_varlen_attention_rejects_bad_cu_seqlens(sdpa_backend):
    q, k = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(q, k, k, torch.tensor([0, 4]), 4)


# ---------------------------------------------------------------- fused linear cross-entropy

@pytest.fixture
def chunked_backend(monkeypatch):
    monkeypatch.setattr(cross_entropy, "_BACKEND", "chunked")
    monkeypatch.setattr(cross_entropy, "_FORCED", True)


def small_chunks(monkeypatch, vocab, rows):
    monkeypatch.setattr(cross_entropy, "_CHUNK_BYTES", 4 * vocab * rows)
    assert cross_entropy._chunk_rows(vocab) == rows


def naive_loss_and_grads(hidden, weight, labels, dtype=torch.float64):
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    loss = F.cross_entropy(h @ w.T, labels, reduction="sum", ignore_index=-100)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_chunked_ce_matches_naive_with_ignored_labels_and_ragged_chunks(chunked_backend, monkeypatch):
    torch.manual_seed(0)
    N, H, V = 37, 16, 50
    small_chunks(monkeypatch, V, rows=8)  # 37 = 4 * 8 + 5: the last chunk is partial
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    labels[::3] = -100
    labels[8:16] = -100  # one whole chunk ignored

    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    ref_loss, ref_gh, ref_gw = naive_loss_and_grads(hidden, weight, labels)

    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert rel_err(hidden.grad, ref_gh) <= 1e-5 and rel_err(weight.grad, ref_gw) <= 1e-5
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert torch.all(hidden.grad[labels == -100] == 0)


def test_chunked_ce_target_rows_only_matches_naive(chunked_backend, monkeypatch):
    # the kernel forms logits for a chunk's target rows only (a few rows take another matmul path than many):
    # chunks with no target, with 3 and with ~15 give the naive loss and gradients, and exact zeros elsewhere
    torch.manual_seed(3)
    N, H, V = 200, 16, 64
    small_chunks(monkeypatch, V, rows=50)
    hidden = torch.randn(N, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    labels[50:100] = -100
    labels[100:150][torch.arange(50) % 17 != 0] = -100
    labels[150:][torch.rand(50) > 0.3] = -100
    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    ref_loss, ref_gh, ref_gw = naive_loss_and_grads(hidden, weight, labels)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert rel_err(hidden.grad, ref_gh) <= 1e-5 and rel_err(weight.grad, ref_gw) <= 1e-5
    assert torch.all(hidden.grad[labels == -100] == 0)


def test_chunked_ce_all_ignored_gives_zero_loss_and_zero_grads(chunked_backend, monkeypatch):
    small_chunks(monkeypatch, 11, rows=4)
    hidden = torch.randn(10, 6, requires_grad=True)
    weight = torch.randn(11, 6, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.full((10,), -100))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_chunked_ce_noncontiguous_hidden_frozen_weight_and_grad_scale(chunked_backend, monkeypatch):
    torch.manual_seed(2)
    N, H, V = 21, 12, 30
    small_chunks(monkeypatch, V, rows=5)
    base = torch.randn(H, N, requires_grad=True)
    hidden = base.T  # non-contiguous [N, H]
    assert not hidden.is_contiguous()
    weight = torch.randn(V, H)  # frozen
    labels = torch.randint(0, V, (N,))
    labels[0] = -100

    (0.5 * fused_linear_cross_entropy(hidden, weight, labels)).backward()
    _, ref_gh, _ = naive_loss_and_grads(hidden, weight, labels)
    assert weight.grad is None
    assert rel_err(base.grad.T, 0.5 * ref_gh) <= 1e-5


def test_chunked_ce_bf16_accumulates_in_fp32(chunked_backend, monkeypatch):
    torch.manual_seed(3)
    N, H, V = 19, 16, 40
    small_chunks(monkeypatch, V, rows=6)
    hidden = torch.randn(N, H).bfloat16().requires_grad_()
    weight = torch.randn(V, H).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,))
    labels[3] = -100

    loss = fused_linear_cross_entropy(hidden, weight, labels)
    loss.backward()
    ref_loss, ref_gh, ref_gw = naive_loss_and_grads(hidden, weight, labels)  # same bf16 values, in fp64

    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())  # fp32 accumulation, not bf16
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert rel_err(hidden.grad, ref_gh) <= 1e-2 and rel_err(weight.grad, ref_gw) <= 1e-2  # bf16 rounding only


def test_chunked_ce_no_grad_matches_naive(chunked_backend):
    torch.manual_seed(4)
    hidden, weight = torch.randn(9, 8, requires_grad=True), torch.randn(13, 8, requires_grad=True)
    labels = torch.randint(0, 13, (9,))
    with torch.no_grad():
        loss = fused_linear_cross_entropy(hidden, weight, labels)
    assert not loss.requires_grad
    ref = F.cross_entropy(hidden @ weight.T, labels, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


LIGER_SCRIPT = r"""
import json, sys
import torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from kernels import cross_entropy, fused_linear_cross_entropy
assert cross_entropy.get_backend() == "liger", cross_entropy.get_backend()
torch.manual_seed(0)
N, H, V = 13, 32, 64
hidden = torch.randn(N, H, requires_grad=True)
weight = torch.randn(V, H, requires_grad=True)
labels = torch.randint(0, V, (N,))
labels[[1, 5]] = -100
loss = fused_linear_cross_entropy(hidden, weight, labels)  # the same call the GPU path makes
loss.backward()
grads = hidden.grad.clone(), weight.grad.clone()
hidden.grad = weight.grad = None
cross_entropy.set_backend("chunked")
ours = fused_linear_cross_entropy(hidden, weight, labels)
ours.backward()
rel = lambda a, b: ((a - b).norm() / b.norm()).item()
print(json.dumps({"loss": loss.item(), "ours": ours.item(), "dtype": str(loss.dtype),
                  "rel_gh": rel(grads[0], hidden.grad), "rel_gw": rel(grads[1], weight.grad)}))
"""


def test_liger_backend_agrees_with_chunked_under_triton_interpreter():
    """liger's Triton kernel has no CPU backend; TRITON_INTERPRET=1 (set before triton imports, hence
    the subprocess) runs it with numpy on CPU tensors, through our wrapper's exact call."""
    pytest.importorskip("triton")
    pytest.importorskip("liger_kernel")
    env = dict(os.environ, TRITON_INTERPRET="1", KERNELS_CE_BACKEND="liger")
    proc = subprocess.run([sys.executable, "-c", LIGER_SCRIPT, str(REPO)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "torch.float32"
    assert abs(result["loss"] - result["ours"]) <= 1e-5 * abs(result["ours"])
    assert result["rel_gh"] <= 1e-5 and result["rel_gw"] <= 1e-5


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_chunked_kl_equals_naive_kl_and_its_gradients(direction):
    from kernels.kl import chunked_kl
    torch.manual_seed(0)
    M, H, V = 37, 16, 50
    h = torch.randn(M, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    th, tw = torch.randn(M, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64)
    s, t = torch.log_softmax(h @ w.T, -1), torch.log_softmax(th @ tw.T, -1)
    ref = (s.exp() * (s - t)).sum() if direction == "reverse" else (t.exp() * (t - s)).sum()
    ref_grads = torch.autograd.grad(ref, (h, w))
    got = chunked_kl(h, w, th, tw, direction, chunk=8)  # 37 rows: a ragged last chunk
    grads = torch.autograd.grad(got, (h, w))
    assert torch.allclose(got.double(), ref, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-5)  # the kernel accumulates in fp32
    assert chunked_kl(th, tw, th, tw, direction).abs() < 1e-9  # a model against itself: 0


# ---- the CPU's part in float results (kernels.cpu_numerics, CPU_PINS) ---------------------------------------------

def test_cpu_numerics_pins_only_where_the_cpu_can_run_them_and_keeps_the_callers_own(monkeypatch):
    import kernels
    for k in kernels.CPU_PINS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "avx2", "fma"})
    env, key = kernels.cpu_numerics(portable=True)
    assert env == kernels.CPU_PINS and env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "COMPATIBLE"
    assert key == {"pins": kernels.CPU_PINS}  # nothing about the CPU itself: any such CPU computes the same bytes
    env, key = kernels.cpu_numerics(portable=False)  # not asked: the CPU's own kernels, so its model is in the key
    assert env == {} and key["pins"] == {} and key["model"] == kernels.cpu_model() and key["isa"]
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"sse2", "avx"})  # no AVX2 (or not x86): cannot be pinned
    env, key = kernels.cpu_numerics(portable=True)
    assert env == {} and "model" in key
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # the caller's own choice stays, and is said; it follows the CPU
    env, key = kernels.cpu_numerics(portable=True)  # (MKL takes AUTO for AVX2 on a non-Intel CPU), so the model too
    assert env == dict(kernels.CPU_PINS, MKL_CBWR="AVX2") and key["pins"] == env and key["model"]
    env, key = kernels.cpu_numerics(portable=False)
    assert env == {"MKL_CBWR": "AVX2"} and key["pins"] == env and key["model"]
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE,STRICT")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # the caller's own settings that no CPU changes either
    env, key = kernels.cpu_numerics(portable=False)
    assert env == {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "default"} and key == {"pins": env}


def test_cpu_pins_reach_the_kernels():
    """A process started with CPU_PINS computes other bytes than one on the CPU's own kernels (the pins are read,
    by ATen and by MKL), and the same bytes every time. That another CPU computes those same bytes is MKL's and
    ATen's contract (one ISA, MKL's COMPATIBLE branch at a fixed thread count); this machine cannot show it."""
    import kernels
    import torch
    if not ({"avx2", "fma"} <= kernels.cpu_flags() and torch.backends.mkl.is_available()):
        pytest.skip("needs an x86-64 CPU with AVX2 and a torch built with MKL")
    code = ("import hashlib, torch; torch.manual_seed(0); a, w = torch.randn(64, 128), torch.randn(384, 128);"
            "x = torch.randn(300, 1000);"
            "print(hashlib.sha256(torch.nn.functional.linear(a, w).numpy().tobytes()).hexdigest(),"
            " hashlib.sha256(x.softmax(-1).numpy().tobytes()).hexdigest())")
    env = {k: v for k, v in os.environ.items() if k not in kernels.CPU_PINS}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")

    def digests(extra):
        p = subprocess.run([sys.executable, "-c", code], env=dict(env, **extra), capture_output=True, text=True,
                           check=True)
        return p.stdout.split()

    native, pinned = digests({}), digests(kernels.CPU_PINS)
    assert pinned == digests(kernels.CPU_PINS)
    if torch.__version__ == "2.13.0+cpu":  # the README's torch: the bytes every x86-64 CPU with AVX2 must compute
        # (measured on an AMD EPYC; a CPU that computes others breaks the pins' promise, and this test says so)
        assert [d[:16] for d in pinned] == ["cc456918247f3dbc", "641556035b530e56"]
    assert native[0] != pinned[0]  # the GEMM: MKL's reproducible COMPATIBLE branch, not this CPU's fastest code
    if torch.backends.cpu.get_cpu_capability() != "AVX2":
        assert native[1] != pinned[1]  # the softmax: ATen's AVX2 kernel, not this CPU's AVX-512 one


RETAIN_CHILD = """
import os, resource, sys
import torch
import kernels
took = kernels.retain_freed_memory() if sys.argv[1] == "retain" else False
def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MiB: above glibc's largest mmap threshold
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
# the first rounds may grow the heap: an aligned block does not fit the freed one until free neighbours merge
rounds = [faults_of_one_round() for _ in range(32)]
print(took, sum(rounds[-8:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
@pytest.mark.parametrize("mode", ["retain", "default", "caller"])
def test_retain_freed_memory_reuses_pages_and_keeps_a_callers_malloc_settings(mode):
    """After retain_freed_memory, a 64 MiB tensor allocated and freed again and again reuses the same pages (no page
    faults once the heap has grown); without it, or when the caller set glibc's malloc in the environment, each one
    gets fresh pages (16,384 faults of 4 KiB)."""
    import kernels
    env = {k: v for k, v in os.environ.items() if k not in (*kernels.MALLOC_ENV, "GLIBC_TUNABLES")}
    env["PYTHONPATH"] = str(REPO)
    if mode == "caller":
        env["MALLOC_TRIM_THRESHOLD_"] = "131072"  # glibc's default: the process keeps its mmaps per block
    out = subprocess.run([sys.executable, "-c", RETAIN_CHILD, "retain" if mode != "default" else "no"], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    took, faults = out[0] == "True", int(out[1])
    assert took == (mode == "retain")
    if took:
        assert faults < 100
    else:
        assert faults >= 8 * 16384 * 0.9
