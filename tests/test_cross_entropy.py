"""kernels/cross_entropy.py: the chunked fused linear cross-entropy against naive math, and the liger backend
against the chunked one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cross_entropy, fused_linear_cross_entropy

REPO = Path(__file__).resolve().parents[1]


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
