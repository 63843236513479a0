"""model/transformer.py against transformers: logits parity, packed documents and their loss, compiled blocks, the
few-row product. Its checkpoints: test_checkpoint.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.objectives import nll  # noqa: E402
from tiny import hf_logits  # noqa: E402

TOL = 1e-4


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 97, (2, 40))
    pos = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        got = ours(ids, pos)
    assert (got - hf_logits(hf, ids)).abs().max() <= TOL


def test_packed_documents_equal_separate_runs(pair):
    hf, ours, _ = pair
    a, b = torch.randint(0, 97, (1, 23)), torch.randint(0, 97, (1, 17))
    ids = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(23), torch.arange(17)])[None]
    cu = torch.tensor([0, 23, 40], dtype=torch.int32)
    with torch.no_grad():
        packed = ours(ids, pos, cu_seqlens=cu, max_seqlen=23)
    ref = torch.cat([hf_logits(hf, a), hf_logits(hf, b)], 1)
    assert (packed - ref).abs().max() <= TOL


def test_packed_loss_equals_sum_of_token_nll(pair):
    _, ours, _ = pair
    ids = torch.randint(0, 97, (1, 30))
    pos = torch.cat([torch.arange(12), torch.arange(18)])[None]
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    labels = torch.randint(0, 97, (1, 30))
    labels[0, :5] = -100
    with torch.no_grad():
        logits = ours(ids, pos, cu_seqlens=cu, max_seqlen=18)
        loss = ours(ids, pos, cu_seqlens=cu, max_seqlen=18, loss=nll(labels))
    ref = torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="sum", ignore_index=-100)
    assert torch.allclose(loss, ref, rtol=1e-5)


def test_blocks_compile_whole_and_match_eager(pair):
    """train.py --compile: every block of each architecture (biases, q/k norms, GQA) is one graph in the packed
    (varlen) and the dense mode, no graph break (dynamo's explain), and the compiled model's packed loss and
    gradients equal the eager ones to 1e-5 (inductor, dynamic token count: two lengths, one graph)."""
    _, ours, _ = pair
    model = type(ours)(ours.cfg)
    model.load_state_dict(ours.state_dict())
    model.tie_weights()
    block, x = model.model.layers[0], torch.randn(1, 40, 64)
    cos, sin = torch.randn(1, 40, ours.cfg.head_dim), torch.randn(1, 40, ours.cfg.head_dim)
    for extra in ((torch.tensor([0, 23, 40], dtype=torch.int32), 23), ()):
        explained = torch._dynamo.explain(block)(x, cos, sin, *extra)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons

    def loss_and_grads(m, n):
        ids = torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(n))
        pos = torch.cat([torch.arange(n // 3), torch.arange(n - n // 3)])[None]
        cu = torch.tensor([0, n // 3, n], dtype=torch.int32)
        loss = m(ids, pos, cu_seqlens=cu, max_seqlen=n - n // 3, loss=nll(ids))
        grads = torch.autograd.grad(loss, list(m.parameters()))
        return loss, grads

    eager = [loss_and_grads(model, n) for n in (30, 41)]
    torch._dynamo.reset()
    for b in model.model.layers:
        b.compile(fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):  # both lengths through one graph per block
        compiled = [loss_and_grads(model, n) for n in (30, 41)]
    for (l0, g0), (l1, g1) in zip(eager, compiled):
        assert abs(l1.item() - l0.item()) <= 1e-5 * l0.item()
        for a, b in zip(g1, g0):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@pytest.mark.parametrize("rows, bias", [(1, False), (3, True), (4, False), (5, False), (37, True), (64, True),
                                        (512, False), (513, True)])
def test_linear_few_rows_without_autograd_is_the_split_bmm(rows, bias):
    """model.transformer.Linear: with autograd (training) exactly F.linear; without it, at most SPLIT_MAX_ROWS rows
    times a large enough weight are one bmm over the weight's two row halves (bit for bit that formula, within fp32
    rounding of F.linear), and so are up to SPLIT_MAX_ROWS_LARGE rows times a large weight, padded with zero rows to a
    multiple of SPLIT_ROW_MULTIPLE; more rows, or a small weight, F.linear again."""
    import torch.nn.functional as F

    from model.transformer import (SPLIT_LARGE_WEIGHT, SPLIT_MAX_ROWS, SPLIT_MAX_ROWS_LARGE, SPLIT_MIN_WEIGHT,
                                   SPLIT_ROW_MULTIPLE, Linear)
    torch.manual_seed(0)
    layer = Linear(256, 384, bias=bias)
    x = torch.randn(1, rows, 256)
    ref = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(layer(x), ref)  # autograd on: training numerics untouched
    with torch.no_grad():
        y = layer(x)
        w = layer.weight
        split = torch.bmm(w.view(2, 192, 256), x[0].t().expand(2, 256, rows)).view(384, rows).t()
        if bias:
            split = split + layer.bias
        if rows <= SPLIT_MAX_ROWS:
            assert torch.equal(y, split[None]) and torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(y, ref)
        small = Linear(64, 64, bias=bias)
        assert small.weight.numel() < SPLIT_MIN_WEIGHT
        assert torch.equal(small(x[..., :64]), F.linear(x[..., :64], small.weight, small.bias))
        large = Linear(256, 4096, bias=bias)  # >= SPLIT_LARGE_WEIGHT elements: split up to SPLIT_MAX_ROWS_LARGE rows
        assert large.weight.numel() >= SPLIT_LARGE_WEIGHT
        m = rows if rows <= SPLIT_MAX_ROWS else -(-rows // SPLIT_ROW_MULTIPLE) * SPLIT_ROW_MULTIPLE
        padded = torch.cat([x[0], x.new_zeros(m - rows, 256)])
        want = torch.bmm(large.weight.view(2, 2048, 256), padded.t().expand(2, 256, m)).view(4096, m).t()[:rows]
        want = want + large.bias if bias else want
        ref = F.linear(x, large.weight, large.bias)
        if rows <= SPLIT_MAX_ROWS_LARGE:
            assert torch.equal(large(x), want[None]) and torch.allclose(want[None], ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(large(x), ref)


def test_packed_products_at_bucketed_row_counts():
    """model.transformer.Packed pads the rows up to row_bucket(m) (multiples of 8 to 64, then of an eighth of m's
    power of two): each row's result is F.linear's within fp32 rounding, and the padding never shows."""
    import torch.nn.functional as F

    from model.transformer import Packed, row_bucket
    assert [row_bucket(m) for m in (0, 1, 8, 9, 64, 65, 127, 128, 129, 1000, 4097)] == \
        [0, 8, 8, 16, 64, 72, 128, 128, 144, 1024, 4608]
    assert all(m <= row_bucket(m) <= max(8, m * 9 // 8 + 8) for m in range(1, 5000))
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    packed = Packed(w)
    for m in (1, 7, 9, 63, 65, 100, 129, 1000):
        x = torch.randn(1, m, 64)
        y = packed(x, b)
        assert y.shape == (1, m, 96)
        torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_packed_products_nest_and_restore():
    """An inner packed_products adds to the outer one and gives it back on exit; with gradients on nothing is fused
    (the C elementwise has no backward)."""
    from model import transformer
    from model.transformer import Linear, Packed, packed_products
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN")
    a, b = Linear(8, 8), Linear(8, 8)
    with torch.no_grad(), packed_products({a: Packed(a.weight)}):
        outer = transformer._FUSED
        with packed_products({b: Packed(b.weight)}):
            assert set(transformer._PACKED) == {a, b}
        assert set(transformer._PACKED) == {a} and transformer._FUSED == outer
    assert not transformer._PACKED and not transformer._FUSED
    with packed_products({a: Packed(a.weight)}):
        assert not transformer._FUSED  # autograd on
