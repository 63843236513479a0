"""train.py --lora-rank end to end on the tiny transformers-built checkpoint: only the adapters train, the merged
checkpoint and the PEFT adapter it writes compute the same logits in ours and in transformers + PEFT, 2 ranks equal
1, a SIGKILL + --resume equals an unbroken run (dropout on: its masks are seeded per step), the resumable state
holds no copy of the frozen base, --lora-init continues an adapter and refuses one of another shape."""
import json
import sys

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model  # noqa: E402
import forkserver
from tiny import (N_STEPS, REPO, assert_same_weights, kill_once_state_is_saved, log, train, train_env,  # noqa: E402
                  weights)

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj"]
NO_DROPOUT = ["--lora-dropout", "0"]


@pytest.fixture(scope="module")
def lora_ref(train_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "ref"
    train(train_ckpt, out, *LORA)
    return out


def adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def test_only_the_targets_change_and_peft_loads_the_adapter_with_our_logits(train_ckpt, lora_ref):
    peft = pytest.importorskip("peft")
    base, merged = load_file(train_ckpt / "model.safetensors"), weights(lora_ref)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(2)
                       for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    cfg = json.loads((lora_ref / "adapter" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (4, 8.0, str(train_ckpt))
    assert len(adapter(lora_ref)) == 2 * 2 * 3  # A and B of 3 modules in 2 blocks

    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(train_ckpt),
                                        lora_ref / "adapter").eval()
    ours = load_model(lora_ref)  # the merged checkpoint: what every later step of a chain reads
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        mine = ours(ids, torch.arange(23)[None])
    assert (theirs - mine).abs().max().item() <= 1e-4
    assert (mine - load_model(train_ckpt)(ids, torch.arange(23)[None])).abs().max().item() > 1e-3  # it learned


def test_two_ranks_equal_one_process(train_ckpt, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(train_ckpt, one, *LORA, *NO_DROPOUT)
    assert "on 2 rank(s) (FSDP2)" in train(train_ckpt, two, *LORA, *NO_DROPOUT, world=2).stdout
    for a, b in zip(log(one), log(two), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    assert_same_weights(adapter(one), adapter(two), 1e-5)
    assert_same_weights(weights(one), weights(two), 1e-5)


def test_sigkill_then_resume_equals_the_unbroken_run_with_dropout(train_ckpt, lora_ref, tmp_path):
    out = tmp_path / "killed"
    alive, output, state = kill_once_state_is_saved(train_ckpt, out, *LORA)
    assert alive, output[-3000:]
    # the state holds the adapters and their AdamW moments, not the frozen base (--model has it)
    meta = torch.distributed.checkpoint.FileSystemReader(str(state.parent)).read_metadata().state_dict_metadata
    tensors = [k for k in meta if not k.startswith("optim.param_groups.")]
    assert tensors and all(".lora." in k for k in tensors), sorted(tensors)[:3]
    train(train_ckpt, out, *LORA, "--resume")
    assert [x["step"] for x in log(out)] == list(range(1, N_STEPS + 1))
    for a, b in zip(log(out), log(lora_ref), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a, b)
    assert_same_weights(adapter(out), adapter(lora_ref), 1e-6)
    nodrop = tmp_path / "nodrop"  # and the masks do act: without them the run is another one (from step 2 on:
    train(train_ckpt, nodrop, *LORA, *NO_DROPOUT, "--max-steps", "2")  # B is zero at step 1)
    assert log(nodrop)[0]["loss"] == log(lora_ref)[0]["loss"] and log(nodrop)[1]["loss"] != log(lora_ref)[1]["loss"]


def test_lora_init_continues_the_adapter_and_refuses_another_shape(train_ckpt, lora_ref, tmp_path):
    # an lr too small to move a weight: the stage ends where it started, the given adapter on the same base
    out = tmp_path / "next"
    r = train(train_ckpt, out, *LORA, "--lora-init", str(lora_ref / "adapter"), "--lr", "1e-30", "--max-steps", "1")
    assert "from " + str(lora_ref / "adapter") in r.stdout
    assert_same_weights(adapter(out), adapter(lora_ref), 0.0)
    assert_same_weights(weights(out), weights(lora_ref), 0.0)
    bad = train(train_ckpt, tmp_path / "bad", "--lora-rank", "2", "--lora-alpha", "8", "--lora-targets",
                "q_proj,v_proj,down_proj", "--lora-init", str(lora_ref / "adapter"), ok=False)
    assert bad.returncode != 0 and "its adapter has rank 4, --lora-rank is 2" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
    missing = train(train_ckpt, tmp_path / "bad", *LORA, "--lora-init", str(tmp_path), ok=False)
    assert "not a PEFT adapter directory" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_ewc_on_lora_anchors_the_adapters_on_the_previous_stages_fisher(train_ckpt, tmp_path):
    """ewc+lora: the Fisher spans the adapters only, and stage 2 (the base again, --lora-init stage 1's adapter)
    reads it from stage 1's checkpoint, beside the adapter: the penalty acts from its second step on."""
    one, two = tmp_path / "one", tmp_path / "two"
    train(train_ckpt, one, *LORA, "--objective", "ewc", "--ewc-samples", "4", "--max-steps", "2")
    fisher = load_file(one / "ewc" / "fisher.safetensors")
    assert fisher and all(".lora." in k for k in fisher) and any(t.abs().sum() > 0 for t in fisher.values())
    train(train_ckpt, two, *LORA, "--objective", "ewc", "--ewc-samples", "4", "--max-steps", "2",
          "--lora-init", str(one / "adapter"))
    assert [x["ewc_penalty"] == 0 for x in log(two)] == [True, False]


def test_the_frozen_base_is_kept_in_bf16_and_computes_what_an_fp32_copy_does(train_ckpt, tmp_path):
    """--dtype bf16 (a GPU's default) with LoRA: the frozen base is stored in bf16, the adapters in fp32, and the
    adapters' gradients equal, bit for bit, those of a model that keeps an fp32 base and lets FSDP2 cast it."""
    script = ("import sys, torch, torch.distributed as dist, train\n"
              "from data.mixture import tokenize_mixture\n"
              "from data.packing import collate\n"
              "from model.lora import LoraConfig\n"
              "from model.objectives import nll, trained\n"
              "from model.tokenizer import ChatTokenizer\n"
              "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
              "ckpt, bf16 = sys.argv[1], torch.bfloat16\n"
              "cfg = LoraConfig(rank=4, alpha=8, targets=('q_proj', 'v_proj', 'down_proj'))\n"
              "ex = tokenize_mixture([ckpt + '/data.jsonl'], ChatTokenizer.from_dir(ckpt), 48, None)[0][:6]\n"
              "ids, pos, tgt, cu, mx = collate(ex, 'cpu')\n"
              "grads, sizes = [], []\n"
              "for frozen in (None, torch.float32):\n"
              "    m = train.build_model(ckpt, torch.device('cpu'), bf16, lora=cfg, frozen_dtype=frozen)\n"
              "    base = [p for p in m.parameters() if not p.requires_grad]\n"
              "    assert {p.dtype for _, p in trained(m)} == {torch.float32}\n"
              "    assert {p.dtype for p in base} == {frozen or bf16}\n"
              "    sizes.append(sum(p.numel() * p.element_size() for p in base))\n"
              "    m(ids, pos, loss=nll(tgt), cu_seqlens=cu, max_seqlen=mx).backward()\n"
              "    grads.append([p.grad.full_tensor() for _, p in trained(m)])\n"
              "assert all(torch.equal(a, b) for a, b in zip(*grads)) and any(g.abs().sum() > 0 for g in grads[0])\n"
              "assert 2 * sizes[0] == sizes[1]\n"
              "print('same gradients')\n")
    (tmp_path / "bf16.py").write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + script)
    r = forkserver.run([sys.executable, str(tmp_path / "bf16.py"), str(train_ckpt)], cwd=REPO, env=train_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "same gradients" in r.stdout, r.stderr[-3000:]
