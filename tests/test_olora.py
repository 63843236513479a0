"""methods/olora.py: O-LoRA's penalty gradient equals autograd of its naive loss (fp64, every module of a stacked
model); end to end on the tiny transformers-built checkpoint: stage 1 is lora-seqft's stage exactly, stage 2 keeps
stage 1's adapter frozen under a new one and saves the stack as one PEFT adapter (rank 2r, alpha 2 alpha) that PEFT
loads with our logits, and 2 ranks equal 1 with the penalty acting."""
import json

import pytest
import torch
from safetensors.torch import load_file

from methods.olora import penalty_grads
from model.lora import LoraConfig, LoraSlices, attach_lora
from tiny import assert_same_weights, log, tiny_llama, train, weights

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj", "--lora-dropout", "0"]


def test_penalty_gradient_equals_autograd_of_the_naive_loss(tmp_path):
    model = tiny_llama(tmp_path / "m").double()
    attach_lora(model, LoraConfig(rank=3, alpha=6, targets=("q_proj", "k_proj", "down_proj")), old_rank=5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora." in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    new = [p for p in model.parameters() if p.requires_grad]
    lam1, lam2 = 0.7, 0.3
    mods = [m for m in model.modules() if isinstance(m, LoraSlices)]
    naive = sum(lam1 * (m.A0[k] @ m.A[k].T).abs().sum() + lam2 * (m.A[k].norm() + m.B[k].norm())
                for m in mods for k in m.A)
    want = torch.autograd.grad(naive, new)
    for p in new:
        p.grad = torch.zeros_like(p)
    got = penalty_grads(model, lam1, lam2)
    for p, w in zip(new, want, strict=True):
        assert torch.allclose(p.grad, w, rtol=1e-12, atol=1e-12)
    assert got["olora_orth"] == pytest.approx(sum((m.A0[k] @ m.A[k].T).abs().sum().item() for m in mods for k in m.A))
    assert len(mods) == 4 and all(not m.A0[k].requires_grad for m in mods for k in m.A0)


@pytest.fixture(scope="module")
def stages(train_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("olora")
    train(train_ckpt, root / "s1", *LORA, "--objective", "olora")
    train(train_ckpt, root / "s2", *LORA, "--objective", "olora", "--lora-init", str(root / "s1" / "adapter"))
    return root


def test_stage_1_is_lora_seqfts_stage(train_ckpt, stages, tmp_path):
    train(train_ckpt, tmp_path / "seq", *LORA)
    assert_same_weights(weights(stages / "s1"), weights(tmp_path / "seq"), 0.0)
    assert all(x["olora_orth"] == 0 for x in log(stages / "s1"))


def test_stage_2_stacks_the_frozen_adapter_and_peft_loads_the_stack(train_ckpt, stages):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    cfg = json.loads((stages / "s2" / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"]) == (8, 16.0)  # alpha / r unchanged: each sub-adapter at the same scale
    one, two = (load_file(stages / s / "adapter" / "adapter_model.safetensors") for s in ("s1", "s2"))
    for k, t in one.items():  # stage 1's adapter is the stack's first block, unchanged
        assert torch.equal(two[k][:4] if "lora_A" in k else two[k][:, :4], t), k
    orth = [x["olora_orth"] for x in log(stages / "s2")]
    assert orth[0] > 0
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(train_ckpt),
                                        stages / "s2" / "adapter").eval()
    from model.checkpoint import load_model
    ours = load_model(stages / "s2")
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids, torch.arange(19)[None])).abs().max().item() <= 1e-4


def test_stage_2_on_two_ranks_equals_one(train_ckpt, stages, tmp_path):
    two = tmp_path / "two"
    train(train_ckpt, two, *LORA, "--objective", "olora", "--lora-init", str(stages / "s1" / "adapter"), world=2)
    for a, b in zip(log(stages / "s2"), log(two), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and a["olora_orth"] == pytest.approx(
            b["olora_orth"], rel=1e-5), (a, b)
    assert_same_weights(weights(stages / "s2"), weights(two), 1e-5)


def test_a_stack_of_another_shape_is_refused_in_one_line(train_ckpt, stages, tmp_path):
    r = train(train_ckpt, tmp_path / "bad", "--lora-rank", "3", "--lora-alpha", "8", "--lora-targets",
              "q_proj,v_proj,down_proj", "--objective", "olora", "--lora-init", str(stages / "s2" / "adapter"),
              ok=False)
    assert r.returncode != 0 and "is not a stack of adapters of --lora-rank 3" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
