"""model/costs.py, the cost model: a step's price (activation checkpointing's second forward), the activation
memory it counts against what autograd really keeps in a block, FSDP2 memory per GPU, and the --micro-tokens rule
train.py takes from it.
"""
from pathlib import Path

import pytest
import torch

from model.costs import (Profile, StepCost, activation_bytes_per_token_layer, memory_per_gpu, micro_tokens_that_fit,
                         needs_checkpointing, price)

REPO = Path(__file__).resolve().parents[1]


def test_activation_checkpointing_is_priced_when_the_command_turns_it_on():
    """Qwen2.5-0.5B fits 80 GB without recomputation, but the paper preset passes --activation-checkpointing on GPUs
    anyway: its training then costs 4/3 of the tokens' time (the per-step overhead aside)."""
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-0.5b")
    profile = Profile(overhead_s=0)
    assert not needs_checkpointing(cfg, profile)
    hours = []
    for on in (False, True):
        c = StepCost("s1-train-FOMC", "train", [], train_tokens=10**9, train_tokens_max=10**9, mean_doc=300)
        price(c, cfg, profile, checkpointing=on)
        hours.append(c.gpu_hours)
    assert hours[1] == pytest.approx(hours[0] * 4 / 3)


def test_activation_model_counts_what_autograd_keeps_in_a_block():
    """Run one real block in bf16 with a flash-type attention stand-in (it saves what flash-attn saves: q, k, v,
    output, fp32 log-sum-exp) and sum the bytes of every tensor saved for backward: equal to the formula."""
    from kernels import attention
    from model.config import ModelConfig
    from model.transformer import Transformer, rope_cos_sin, rope_inv_freq
    import model.transformer as mt

    class FlashLike(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu, max_len):
            with torch.no_grad():
                attention.set_backend("sdpa")
                out = attention.varlen_attention(q, k, v, cu, max_len)
            lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

    cfg = ModelConfig.from_hf(dict(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=160,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    torch.manual_seed(0)
    model = Transformer(cfg).to(torch.bfloat16)
    lengths = [40, 24, 64]
    T = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    x = model.model.embed_tokens(torch.randint(0, 512, (1, T))).detach().requires_grad_()
    cos, sin = rope_cos_sin(rope_inv_freq(cfg, "cpu"), pos, x.dtype)
    known = {t.untyped_storage().data_ptr() for t in [*model.parameters(), x, cos, sin]}
    saved = {}

    def keep(t):
        if t.untyped_storage().data_ptr() not in known:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    orig = mt.varlen_attention
    mt.varlen_attention = lambda q, k, v, cu, m: FlashLike.apply(q, k, v, cu, m)
    try:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            model.model.layers[0](x, cos, sin, cu, max(lengths))
    finally:
        mt.varlen_attention = orig
    assert sum(saved.values()) == activation_bytes_per_token_layer(cfg) * T


def test_memory_model_for_qwen25_7b_on_8_gpus():
    """Hand-checked: 7.615 B parameters -> 16 bytes each of sharded fp32 state (weights, grads, two AdamW moments)
    over 8 GPUs = 15.2 GB; without checkpointing 16,384 tokens of activations do not fit 80 GB, with it they do."""
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-7b")
    assert cfg.num_params() == 7_615_487_488  # the published 7.61 B
    m = memory_per_gpu(cfg, 8, 16384)
    state = sum(v for k, v in m.items() if "sharded" in k)
    assert state == pytest.approx(16 * 7_615_487_488 / 8)
    assert m["total"] > 80e9 > m["total_checkpointed"]


def test_micro_tokens_rule_is_the_most_that_fit_and_train_py_uses_it(monkeypatch):
    """micro_tokens_that_fit: the largest multiple of 1024 whose modelled memory fits the budget, with and
    without activation checkpointing; train.py takes it on a GPU when --micro-tokens is not given (free memory faked),
    16384 on the CPU, and refuses a budget below --max-len in one line."""
    import argparse
    import train
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-7b")
    budget = 72e9
    for ac, key in ((False, "total"), (True, "total_checkpointed")):
        mt = micro_tokens_that_fit(cfg, 8, budget, ac)
        assert mt % 1024 == 0 and mt > 0
        assert memory_per_gpu(cfg, 8, mt)[key] <= budget < memory_per_gpu(cfg, 8, mt + 1024)[key]
    assert micro_tokens_that_fit(cfg, 8, budget, True) > micro_tokens_that_fit(cfg, 8, budget, False)
    assert micro_tokens_that_fit(cfg, 1, budget, False) == 0  # 7B's states alone need > 72 GB on one GPU

    def args(**kw):
        return argparse.Namespace(**{**dict(compile=None, micro_tokens=None, model=str(
            REPO / "bench" / "configs" / "qwen2.5-7b"), activation_checkpointing=True,
            max_len=2048, resume=False, lora_rank=0, lora_targets="q_proj,v_proj"), **kw})

    a = args()
    train.device_defaults(a, torch.device("cpu"), 0, 1, torch.float32, {})
    assert (a.compile, a.micro_tokens) == (False, train.MICRO_TOKENS)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79e9, 80e9))
    from kernels import attention
    monkeypatch.setattr(attention, "_BACKEND", "torch_varlen")  # what a GPU picks (compiles whole)
    a = args()
    train.device_defaults(a, torch.device("cuda"), 0, 8, torch.bfloat16, {})
    assert a.compile is True and a.micro_tokens == micro_tokens_that_fit(cfg, 8, 0.9 * 80e9, True)
    a = args(lora_rank=8)  # a LoRA stage on one GPU: LoRA's memory model (full fine-tuning would not fit)
    train.device_defaults(a, torch.device("cuda"), 0, 1, torch.bfloat16, {})
    from model.costs import lora_params
    assert a.micro_tokens == micro_tokens_that_fit(cfg, 1, 0.9 * 80e9, True, lora_params(cfg, 8, ["q_proj", "v_proj"]))
    assert a.micro_tokens >= 16384 and micro_tokens_that_fit(cfg, 1, 0.9 * 80e9, True) == 0
    a = args(compile=None, micro_tokens=4096)
    train.device_defaults(a, torch.device("cuda"), 0, 8, torch.float32, {})  # fp32 on CUDA: the SDPA loop
    assert a.compile is False
    with pytest.raises(train.UserError, match="--compile on CUDA needs --dtype bf16"):
        train.device_defaults(args(compile=True), torch.device("cuda"), 0, 8, torch.float32, {})
    a = args(resume=True)  # a resumed run keeps the budget its state was saved with
    train.device_defaults(a, torch.device("cuda"), 0, 8, torch.bfloat16, {"micro_tokens": 8192})
    assert a.micro_tokens == 8192
    a = args(micro_tokens=4096, compile=False)  # given: kept
    train.device_defaults(a, torch.device("cuda"), 0, 8, torch.bfloat16, {})
    assert (a.compile, a.micro_tokens) == (False, 4096)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20e9, 80e9))  # another process holds 60 GB
    with pytest.raises(train.UserError, match="fit 20.0 GB per GPU on 8 GPU.*--max-len 2048"):
        train.device_defaults(args(), torch.device("cuda"), 0, 8, torch.bfloat16, {})


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj")])
def test_lora_memory_and_flops_on_one_gpu(targets):
    """lora_params counts the adapters model/lora.py attaches (Qwen2.5-7B on meta); a LoRA stage's memory keeps the
    fp32 base (sharded, frozen) and gradients and AdamW for the adapters only, so 7B trains on one 80 GB GPU with
    activation checkpointing, where full fine-tuning needs more than one; its FLOPs drop the frozen weights'
    gradient products (4 per weight, not 6)."""
    from model.checkpoint import load_config
    from model.lora import LoraConfig, attach_lora
    from model.transformer import Transformer
    from model.costs import flops_per_token, lora_params
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-7b")
    with torch.device("meta"):
        model = Transformer(cfg)
    n = lora_params(cfg, 8, targets)
    assert n == sum(p.numel() for p in attach_lora(model, LoraConfig(rank=8, alpha=32, targets=targets)))
    P = cfg.num_params(embeddings=True)
    lora, full = memory_per_gpu(cfg, 1, 16384, n), memory_per_gpu(cfg, 1, 16384)
    assert lora["frozen bf16 base + fp32 adapters (sharded)"] == 2 * P + 4 * n  # train.py keeps the base in bf16
    assert lora["gradients fp32 (sharded)"] == 4 * n and lora["AdamW moments fp32 (sharded)"] == 8 * n
    assert lora["total_checkpointed"] < 0.9 * 80e9 < full["total_checkpointed"]
    assert micro_tokens_that_fit(cfg, 1, 0.9 * 80e9, True, n) >= 16384 > micro_tokens_that_fit(cfg, 1, 0.9 * 80e9, True)
    attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 300
    assert flops_per_token(cfg, 300, n) - attention == pytest.approx(
        (flops_per_token(cfg, 300) - attention) * 4 / 6 + 6 * n)
