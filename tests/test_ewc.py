"""methods/ewc.py: the penalty and its gradient against naive fp64 math, the Fisher against naive per-example
gradients (not the squared batch gradient TRACE's trajectory sum amounts to), and train.py --objective ewc end to
end: the Fisher written with the checkpoint, lambda 0 is sft bit for bit, a large lambda holds the weights near
theta*, 2 ranks equal 1, a killed and resumed stage equals an uninterrupted one."""
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tiny import MAX_LEN, assert_same_weights, kill_once_state_is_saved, log, train, weights

from data.mixture import tokenize_mixture
from methods import ewc
from model.checkpoint import load_model
from model.tokenizer import ChatTokenizer

STEPS = 4
EWC = ["--objective", "ewc", "--ewc-samples", "6", "--max-steps", str(STEPS)]


def test_penalty_and_its_gradient_equal_naive_math():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 3)]
    params = [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]
    fisher = [torch.rand(s, generator=g, dtype=torch.float64) for s in shapes]
    star = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    lam = 7.5
    naive = 0.0
    for p, f, s in zip(params, fisher, star):
        for pi, fi, si in zip(p.detach().flatten().tolist(), f.flatten().tolist(), s.flatten().tolist()):
            naive += 0.5 * lam * fi * (pi - si) ** 2
    value = ewc.penalty(params, fisher, star, lam)
    assert value.item() == pytest.approx(naive, rel=1e-12)
    value.backward()  # the penalty carries a gradient (EasyCL's, from param.data, has none)
    for p, f, s in zip(params, fisher, star):
        assert torch.allclose(p.grad, lam * f * (p.detach() - s), rtol=1e-12, atol=0)
    # what train.py adds to the step's gradient is that same gradient
    added = [torch.zeros_like(p) for p in params]
    for p, a in zip(params, added):
        p.grad = a
    ewc.add_penalty_grad(params, fisher, star, lam)
    for p, f, s in zip(params, fisher, star):
        assert torch.allclose(p.grad, lam * f * (p.detach() - s), rtol=1e-12, atol=0)


def test_fisher_is_the_mean_of_squared_per_example_gradients(train_ckpt):
    model = load_model(train_ckpt).double().requires_grad_(True)
    tok = ChatTokenizer.from_dir(train_ckpt)
    examples = tokenize_mixture([str(train_ckpt / "data.jsonl")], tok, MAX_LEN)[0][:4]
    got = ewc.empirical_fisher(model, examples, torch.device("cpu"), world=1)
    params = list(model.parameters())
    grads = []
    for e in examples:  # unpacked, logits and cross-entropy written out: one example at a time
        logits = model(torch.tensor([e.ids]), torch.arange(len(e.ids))[None])[0]
        nll = F.cross_entropy(logits, torch.tensor(e.targets), ignore_index=-100, reduction="mean")
        grads.append(torch.autograd.grad(nll, params))
    for k, p in enumerate(params):
        naive = sum(g[k] ** 2 for g in grads) / len(grads)
        assert torch.allclose(got[k].double(), naive, rtol=1e-5, atol=1e-12), k
    # not the square of the mean gradient (a Fisher built from batch gradients)
    k = next(k for k, p in enumerate(params) if p.ndim == 2)
    batch = (sum(g[k] for g in grads) / len(grads)) ** 2
    assert not torch.allclose(got[k].double(), batch, rtol=1e-2)


@pytest.fixture(scope="module")
def stages(train_ckpt, tmp_path_factory):
    """Stage 1 under ewc (no Fisher yet: sft's weights, then its Fisher), and stage 2 from it at lambda 0 and 1e6,
    beside sft from the same stage-1 checkpoint."""
    root = tmp_path_factory.mktemp("ewc")
    out = {"s1": root / "s1", "sft1": root / "sft1"}
    train(train_ckpt, out["s1"], *EWC)
    train(train_ckpt, out["sft1"], "--max-steps", str(STEPS))
    shutil.copy(train_ckpt / "data.jsonl", out["s1"])  # stage 2 trains on the same task (train() reads it there)
    for name, extra in (("sft2", ["--max-steps", str(STEPS)]), ("zero", [*EWC, "--ewc-lambda", "0"]),
                        ("strong", [*EWC, "--ewc-lambda", "1e6"])):
        out[name] = root / name
        train(out["s1"], out[name], *extra)
    return out


def test_stage_writes_the_fisher_of_its_final_weights(stages, train_ckpt):
    s1 = stages["s1"]
    for k, v in weights(s1).items():  # no Fisher to hold it at stage 1: sft's weights exactly
        assert torch.equal(v, weights(stages["sft1"])[k]), k
    saved = load_file(s1 / ewc.FISHER)
    model = load_model(s1).requires_grad_(True)
    tok = ChatTokenizer.from_dir(s1)
    examples = tokenize_mixture([str(train_ckpt / "data.jsonl")], tok, MAX_LEN)[0]
    picked = sorted(random.Random(0).sample(range(len(examples)), 6))
    ref = ewc.empirical_fisher(model, [examples[i] for i in picked], torch.device("cpu"), world=1)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(saved) == sorted(names)
    for name, r in zip(names, ref):
        assert torch.allclose(saved[name], r, rtol=1e-5, atol=1e-12), name
    assert all(float(v.min()) >= 0 for v in saved.values()) and any(float(v.max()) > 0 for v in saved.values())


def test_lambda_zero_is_sft_bit_for_bit_and_a_large_lambda_holds_theta_star(stages):
    zero, sft2, strong, s1 = (weights(stages[k]) for k in ("zero", "sft2", "strong", "s1"))
    for k in sft2:
        assert torch.equal(zero[k], sft2[k]), k
    fisher = load_file(stages["s1"] / ewc.FISHER)
    # the F-weighted distance to theta* (stage 1's weights), summed: lower under the penalty
    def dist(w):
        return sum(float((fisher[k] * (w[k] - s1[k]) ** 2).sum()) for k in fisher if k in w)
    assert dist(strong) < 0.5 * dist(sft2), (dist(strong), dist(sft2))
    penalties = [x["ewc_penalty"] for x in log(stages["strong"])]
    assert penalties[0] == 0 and all(p > 0 for p in penalties[1:]), penalties
    assert all(x["ewc_penalty"] == 0 for x in log(stages["zero"]))


def test_ewc_two_ranks_equal_one_process(stages, tmp_path):
    two = tmp_path / "two"
    r = train(stages["s1"], two, *EWC, "--ewc-lambda", "1e6", world=2)
    assert "on 2 rank(s)" in r.stdout
    for a, b in zip(log(stages["strong"]), log(two)):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
        assert abs(a["ewc_penalty"] - b["ewc_penalty"]) <= 1e-5 * max(a["ewc_penalty"], 1e-12), (a, b)
    assert_same_weights(weights(stages["strong"]), weights(two), 1e-4)
    f1, f2 = load_file(stages["strong"] / ewc.FISHER), load_file(two / ewc.FISHER)
    assert f1.keys() == f2.keys()
    for k in f1:
        assert torch.allclose(f1[k], f2[k], rtol=1e-3, atol=1e-9 * float(f1[k].abs().max())), k


def test_ewc_sigkill_then_resume_equals_uninterrupted_run(stages, tmp_path):
    """theta* and the Fisher come from --model, not from the resumed state's weights."""
    out = tmp_path / "killed"
    args = [*EWC, "--ewc-lambda", "1e6"]
    alive, output, state = kill_once_state_is_saved(stages["s1"], out, *args)
    assert alive, f"train.py ended before it could be killed:\n{output[-3000:]}"
    train(stages["s1"], out, *args, "--resume")
    assert [x["step"] for x in log(out)] == list(range(1, STEPS + 1))
    full = weights(stages["strong"])
    for k, v in weights(out).items():
        assert torch.equal(v, full[k]), k
    assert load_file(out / ewc.FISHER).keys() == load_file(stages["strong"] / ewc.FISHER).keys()
