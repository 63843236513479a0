"""model/lora.py: an adapted forward equals the merged dense model (fp64); a new adapter (B zero) is the base; the
adapter written in PEFT's layout loads into transformers through PEFT (tests only: the project never imports it)
with logits equal to ours; saved and loaded back, the same adapters; bad configurations refused."""
import json

import pytest
import torch

from tiny import HF_ARCHS, hf_logits, make_hf

from model.checkpoint import load_model
from model.lora import LoraConfig, add_lora, adapter_state, load_adapter, merge_lora, save_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nonzero_b(model, seed=1):
    """B is zero at the start (the adapted model is the base): give it values so the adapters act."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k, t in adapter_state(model).items():
            if "lora_B" in k:
                t.copy_(0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf("llama", path)
    return path


def ids_pos(vocab, n=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g), torch.arange(n)[None]


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ALL, ("k_proj", "up_proj")])
def test_adapted_forward_equals_the_merged_dense_model(hf_dir, targets):
    model = load_model(hf_dir).double()
    ids, pos = ids_pos(model.cfg.vocab_size)
    base = model(ids, pos)
    params = add_lora(model, LoraConfig(rank=4, alpha=16, targets=targets))
    assert params and all(p.requires_grad for p in params)
    assert sum(p.requires_grad for p in model.parameters()) == len(params)  # the base is frozen
    assert torch.equal(model(ids, pos), base)  # B zero: the base exactly
    nonzero_b(model)
    adapted = model(ids, pos)
    assert (adapted - base).abs().max() > 1e-3
    merged = merge_lora(model)(ids, pos)
    assert torch.allclose(adapted, merged, rtol=0, atol=1e-10)
    assert not adapter_state(model)


def test_untargeted_rows_of_a_fused_layer_get_nothing(hf_dir):
    model = load_model(hf_dir).double()
    w = {n: p.clone() for n, p in model.named_parameters()}
    add_lora(model, LoraConfig(rank=2, alpha=2, targets=("k_proj",)))
    nonzero_b(model)
    merge_lora(model)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    q, kv = model.cfg.num_attention_heads * model.cfg.head_dim, model.cfg.num_key_value_heads * model.cfg.head_dim
    new = dict(model.named_parameters())[qkv]
    assert torch.equal(new[:q], w[qkv][:q]) and torch.equal(new[q + kv:], w[qkv][q + kv:])  # q and v untouched
    assert not torch.equal(new[q:q + kv], w[qkv][q:q + kv])
    assert torch.equal(dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"],
                       w["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_loads_our_adapter_with_the_same_logits(hf_dir, tmp_path, rslora):
    peft = pytest.importorskip("peft")
    import transformers
    ours = load_model(hf_dir)
    cfg = LoraConfig(rank=8, alpha=32, dropout=0.1, targets=ALL, use_rslora=rslora)
    add_lora(ours, cfg, seed=3)
    nonzero_b(ours)
    save_adapter(ours, cfg, tmp_path / "adapter", base=str(hf_dir))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["lora_alpha"] == 32 and saved["target_modules"] == sorted(ALL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids, pos = ids_pos(ours.cfg.vocab_size)
    ours.eval()
    with torch.no_grad():
        mine = ours(ids, pos)
    theirs = hf_logits(with_adapter, ids, pos)
    assert (mine - theirs).abs().max() <= 1e-4, (mine - theirs).abs().max()
    plain = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32), ids, pos)
    assert (theirs - plain).abs().max() > 1e-3  # the adapter acted


def test_save_then_load_gives_the_same_adapters(hf_dir, tmp_path):
    a = load_model(hf_dir)
    cfg = LoraConfig(rank=3, alpha=6, targets=("q_proj", "down_proj"))
    add_lora(a, cfg, seed=5)
    nonzero_b(a)
    save_adapter(a, cfg, tmp_path / "ad", base="x")
    b = load_model(hf_dir)
    assert load_adapter(b, tmp_path / "ad") == cfg
    sa, sb = adapter_state(a), adapter_state(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert len(sa) == 2 * 2 * a.cfg.num_hidden_layers  # q and down, A and B, every block


def test_bad_configurations_are_refused(hf_dir, tmp_path):
    model = load_model(hf_dir)
    with pytest.raises(ValueError, match="lm_head"):
        add_lora(model, LoraConfig(rank=2, alpha=2, targets=("lm_head",)))
    with pytest.raises(ValueError, match="rank 0"):
        add_lora(model, LoraConfig(rank=0, alpha=2))
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 8}}))
    with pytest.raises(ValueError, match="rank or alpha patterns"):
        load_adapter(model, tmp_path / "ad")


def test_every_architecture_names_its_adapters_as_peft_does(tmp_path):
    """Llama, Qwen2 and Qwen3 blocks: the keys PEFT writes for the same targets are ours."""
    peft = pytest.importorskip("peft")
    for arch in HF_ARCHS:
        hf = make_hf(arch, tmp_path / arch)
        peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(ALL)))
        theirs = {k.replace(".default", "") for k in peft_model.state_dict() if "lora_" in k}
        ours = load_model(tmp_path / arch)
        add_lora(ours, LoraConfig(rank=2, alpha=4, targets=ALL))
        assert set(adapter_state(ours)) == theirs, arch
