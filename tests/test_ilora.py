"""methods/ilora.py: the hidden states it compares are transformers' output_hidden_states; its consistency term equals
the naive MSE over the step's replay tokens (unpacked, one example at a time); the slow adapter is the interpolation
of the fast one; end to end on the tiny transformers-built checkpoint: stage 1 (no replay) is lora-seqft's stage
exactly, gamma 0 is sft+lora on the same mixture exactly, stage 2's slow learner starts from stage 1's ema/ and PEFT
loads it, 2 ranks equal 1 and a killed, resumed stage equals an uninterrupted one."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tiny import MAX_LEN, assert_same_weights, kill_once_state_is_saved, log, train, weights

from data.mixture import tokenize_mixture
from methods import ilora
from model.checkpoint import load_model
from model.lora import LoraConfig, add_lora
from model.objectives import sft_loss
from model.tokenizer import ChatTokenizer

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj,down_proj", "--lora-dropout", "0"]
ILORA = [*LORA, "--objective", "ilora", "--max-steps", "4"]


def adapter(out, name="adapter"):
    return load_file(out / name / "adapter_model.safetensors")


def test_states_are_transformers_hidden_states(train_ckpt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(train_ckpt).eval()
    ours = load_model(train_ckpt)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    states = []
    with torch.no_grad():
        ours(ids, torch.arange(11)[None], on_hidden=states.append)
        want = hf(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(states) == len(want) == ours.cfg.num_hidden_layers + 1
    for a, b in zip(states, want):
        assert (a - b).abs().max().item() <= 1e-5


def test_consistency_term_equals_the_naive_mse(train_ckpt):
    """A packed micro-batch of task and replay examples: loss - NLL = gamma * (targets / replay tokens) * the sum of
    per-token MSEs, so that divided by the step's targets it is gamma * MSE over every replay token, layer and
    dimension, computed here one example at a time."""
    tok = ChatTokenizer.from_dir(train_ckpt)
    records = [json.loads(x) for x in (train_ckpt / "data.jsonl").read_text().splitlines()][:8]
    records = [dict(r, source="gold") if i % 3 == 1 else r for i, r in enumerate(records)]
    path = train_ckpt.parent / "ilora-mix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    examples = tokenize_mixture([str(path)], tok, MAX_LEN, None)[0]
    assert 0 < sum(e.replay for e in examples) < len(examples)
    fast, slow = load_model(train_ckpt).double(), load_model(train_ckpt).double()
    cfg = LoraConfig(rank=3, alpha=6, targets=("q_proj", "v_proj", "down_proj"))
    add_lora(fast, cfg, seed=0), add_lora(slow, cfg, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B nonzero in both, so that the two learners differ
        for m in (fast, slow):
            for n, p in m.named_parameters():
                if ".lora.B." in n:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    gamma, targets = 0.7, sum(e.n_targets for e in examples)
    replay_tokens = sum(len(e.ids) for e in examples if e.replay)
    step = {"scale": targets / replay_tokens, "replay": replay_tokens, "sum": torch.zeros((), dtype=torch.float64)}
    loss, _ = ilora.ilora_loss(fast, slow, gamma, step, True, "cpu", examples)
    nll, _ = sft_loss(fast, True, "cpu", examples)
    sq, count = 0.0, 0
    with torch.no_grad():
        for e in (e for e in examples if e.replay):
            a, b = [], []
            ids, pos = torch.tensor([e.ids]), torch.arange(len(e.ids))[None]
            fast(ids, pos, on_hidden=a.append), slow(ids, pos, on_hidden=b.append)
            diff = torch.stack(a) - torch.stack(b)  # [L + 1, 1, T, H]
            sq += (diff ** 2).mean(dim=(0, 3)).sum().item()  # per token: the mean over layers and dimensions
            count += len(e.ids)
    naive_mse = sq / count
    assert (loss - nll).item() / targets == pytest.approx(gamma * naive_mse, rel=1e-9)
    assert step["sum"].item() / replay_tokens == pytest.approx(naive_mse, rel=1e-9)
    assert naive_mse > 0


@pytest.fixture(scope="module")
def stages(train_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("ilora")
    records = [json.loads(x) for x in (train_ckpt / "data.jsonl").read_text().splitlines()]
    (root / "replay.jsonl").write_text("".join(json.dumps(dict(r, source="gold")) + "\n" for r in records[::4]))
    mix = f"{train_ckpt / 'data.jsonl'},{root / 'replay.jsonl'}"
    train(train_ckpt, root / "s1", *ILORA)
    s2 = [*ILORA, "--lora-init", str(root / "s1" / "adapter")]
    train(train_ckpt, root / "s2", *s2, data=mix)
    return dict(root=root, mix=mix, s2=s2)


def test_stage_1_is_lora_seqfts_stage_and_the_slow_adapter_interpolates(train_ckpt, stages, tmp_path):
    s1 = stages["root"] / "s1"
    train(train_ckpt, tmp_path / "seq", *LORA, "--max-steps", "4")
    assert_same_weights(weights(s1), weights(tmp_path / "seq"), 0.0)
    assert all(x["ilora_mse"] == 0 for x in log(s1))  # no replay example at stage 1
    # one step: slow = lambda * init + (1 - lambda) * fast; with lambda 1 the slow adapter is the initial one
    one = [*LORA, "--objective", "ilora", "--max-steps", "1"]
    train(train_ckpt, tmp_path / "keep", *one, "--ilora-lambda", "1")
    train(train_ckpt, tmp_path / "mix", *one, "--ilora-lambda", "0.25")
    init, fast = adapter(tmp_path / "keep", "ema"), adapter(tmp_path / "mix")
    assert torch.equal(fast["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                       adapter(tmp_path / "keep")["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    slow = adapter(tmp_path / "mix", "ema")
    assert set(slow) == set(fast)
    for k in fast:
        assert torch.allclose(slow[k], 0.25 * init[k] + 0.75 * fast[k], rtol=1e-6, atol=1e-8), k
    assert any(not torch.equal(fast[k], init[k]) for k in fast)


def test_gamma_0_is_sft_on_the_same_data_and_gamma_acts(train_ckpt, stages, tmp_path):
    root, mix = stages["root"], stages["mix"]
    train(train_ckpt, tmp_path / "g0", *stages["s2"], "--ilora-gamma", "0", data=mix)
    train(train_ckpt, tmp_path / "sft", *LORA, "--max-steps", "4", "--lora-init", str(root / "s1" / "adapter"),
          data=mix)
    assert_same_weights(weights(tmp_path / "g0"), weights(tmp_path / "sft"), 0.0)
    mse = [x["ilora_mse"] for x in log(root / "s2")]
    assert all(m > 0 for m in mse), mse  # every step of 8 holds a replay example (9 of 36 are)
    a, b = weights(root / "s2"), weights(tmp_path / "g0")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_stage_2s_slow_learner_starts_from_stage_1s_and_peft_loads_it(train_ckpt, stages, tmp_path):
    root = stages["root"]
    train(train_ckpt, tmp_path / "keep", *stages["s2"], "--ilora-lambda", "1", data=stages["mix"])
    before, after = adapter(root / "s1", "ema"), adapter(tmp_path / "keep", "ema")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(train_ckpt),
                                        root / "s2" / "ema").eval()
    ours = load_model(train_ckpt)
    add_lora(ours, LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj")))
    from model.lora import read_adapter, set_adapters
    set_adapters(ours, read_adapter(root / "s2" / "ema", ours))
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids, torch.arange(19)[None])).abs().max().item() <= 1e-4


def test_two_ranks_equal_one(train_ckpt, stages, tmp_path):
    two = tmp_path / "two"
    train(train_ckpt, two, *stages["s2"], world=2, data=stages["mix"])
    for a, b in zip(log(stages["root"] / "s2"), log(two), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert a["ilora_mse"] == pytest.approx(b["ilora_mse"], rel=1e-4), (a, b)
    assert_same_weights(weights(stages["root"] / "s2"), weights(two), 1e-5)
    one, other = adapter(stages["root"] / "s2", "ema"), adapter(two, "ema")
    for k in one:
        assert torch.allclose(one[k], other[k], rtol=1e-4, atol=1e-7), k


def test_sigkill_then_resume_equals_uninterrupted_run(train_ckpt, stages, tmp_path):
    out = tmp_path / "killed"
    args = [*stages["s2"], "--data", stages["mix"], "--save-every", "1"]
    alive, output, _ = kill_once_state_is_saved(train_ckpt, out, *args)
    assert alive, f"train.py ended before it could be killed:\n{output[-3000:]}"
    train(train_ckpt, out, *args, "--resume")
    full = weights(stages["root"] / "s2")
    for k, v in weights(out).items():
        assert torch.equal(v, full[k]), k
    slow, want = adapter(out, "ema"), adapter(stages["root"] / "s2", "ema")
    assert all(torch.equal(slow[k], want[k]) for k in want)


def test_without_lora_it_is_one_line(train_ckpt, tmp_path):
    r = train(train_ckpt, tmp_path / "bad", "--objective", "ilora", "--max-steps", "1", ok=False)
    assert r.returncode != 0 and "--objective ilora: trains LoRA adapters; give --lora-rank" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "bad").exists()
