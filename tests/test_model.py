"""Model core against transformers: logits parity, packing, KV cache, checkpoint round trips, bad input."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model, save_checkpoint  # noqa: E402
from model.objectives import nll  # noqa: E402

TOL = 1e-4

ARCHS = {
    # Llama-3.1 style: llama3 rope scaling (short original context so every frequency band is exercised),
    # GQA, q/k/v/o and MLP biases
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=True, mlp_bias=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16})),
    # Qwen2.5 small sizes: q/k/v biases, tied embeddings
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    # Qwen3: q/k RMSNorm, head_dim (24) unrelated to hidden/heads (16)
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24)),
}


def make_hf(arch, path):
    torch.manual_seed(0)
    hf = ARCHS[arch]().float().eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them so they are tested
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf(request.param, path)
    return hf, load_model(path), path


def hf_logits(hf, ids, pos=None):
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=pos).logits


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


@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 40_000])
def test_save_load_round_trip_is_bit_exact_and_loads_in_transformers(pair, tmp_path, shard_bytes):
    hf, ours, src = pair
    out = save_checkpoint(ours.state_dict(), src, tmp_path / "ckpt", max_shard_bytes=shard_bytes)
    sharded = (out / "model.safetensors.index.json").exists()
    assert sharded == (shard_bytes < 2**20)
    again = load_model(out)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.randint(0, 97, (1, 20))
    with torch.no_grad():
        assert (hf_logits(hf2, ids) - ours(ids, torch.arange(20)[None])).abs().max() <= TOL
    assert not list(tmp_path.glob(".ckpt.tmp-*")), "temporary directory left behind"


def test_unknown_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"config\.json.*model_type 'gpt2'"):
        load_model(tmp_path)


def test_missing_and_misshaped_weights_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    make_hf("llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(state)
    bad[name] = torch.zeros(3, 3)
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.1\.mlp\.up_proj\.weight.*\(3, 3\)"):
        load_model(tmp_path)
    del bad[name]
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight.*missing"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(tmp_path)


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
