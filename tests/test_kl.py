"""kernels/kl.py: the chunked KL against naive KL."""

import pytest
import torch


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
