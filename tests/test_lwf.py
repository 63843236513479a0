"""methods/lwf.py: the loss against naive fp64 math, (1 - alpha) * CE + alpha * T^2 * KL(teacher_T || student_T)
over response tokens, with each example's own teacher distribution whatever the order; train.py --objective lwf end
to end: alpha 0 is sft bit for bit, 2 ranks equal 1, a killed and resumed stage equals an uninterrupted one."""
import argparse

import pytest
import torch
import torch.nn.functional as F

from tiny import MAX_LEN, assert_same_weights, kill_once_state_is_saved, log, train, weights

from data.mixture import tokenize_mixture
from methods import lwf
from model.checkpoint import load_model
from model.tokenizer import ChatTokenizer

STEPS = 4
LWF = ["--objective", "lwf", "--max-steps", str(STEPS)]


def naive(student, teacher, e, alpha, t):
    """One example, unpacked: (1 - alpha) * summed CE + alpha * T^2 * summed KL(teacher_T || student_T)."""
    ids, pos = torch.tensor([e.ids]), torch.arange(len(e.ids))[None]
    tgt = torch.tensor(e.targets)
    zs, zt = student(ids, pos)[0].double(), teacher(ids, pos)[0].double()
    ce = F.cross_entropy(zs, tgt, ignore_index=-100, reduction="sum")
    m = tgt != -100
    ls, lt = torch.log_softmax(zs[m] / t, -1), torch.log_softmax(zt[m] / t, -1)
    return (1 - alpha) * ce + alpha * t * t * (lt.exp() * (lt - ls)).sum()


@pytest.fixture(scope="module")
def models(train_ckpt):
    """The student, and a teacher whose weights differ from it (a frozen copy would make the KL 0)."""
    student, teacher = load_model(train_ckpt).requires_grad_(True), load_model(train_ckpt)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    examples = tokenize_mixture([str(train_ckpt / "data.jsonl")], ChatTokenizer.from_dir(train_ckpt), MAX_LEN)[0]
    return student, teacher, examples[:5]


@pytest.mark.parametrize("alpha,t", [(0.5, 2.0), (0.3, 1.0), (0.9, 4.0)])
def test_lwf_loss_equals_naive_kl_teacher_to_student_with_t_squared(models, alpha, t):
    student, teacher, examples = models
    args = argparse.Namespace(lwf_alpha=alpha, lwf_temperature=t)
    loss_fn = lwf.OBJECTIVE.loss_fn(args, student, teacher, False, torch.device("cpu"))
    got, parts = loss_fn(examples)
    ref = sum(naive(student, teacher, e, alpha, t) for e in examples)
    assert got.item() == pytest.approx(ref.item(), rel=2e-5)
    # the logged KL is the unweighted KL(teacher || student) sum, not KL(student || teacher)
    kl_ref = (ref - (1 - alpha) * parts[0].double()) / (alpha * t * t)
    assert parts[1].item() == pytest.approx(kl_ref.item(), rel=1e-3)


def test_each_example_is_distilled_from_its_own_teacher_logits_in_any_order(models):
    """A shuffled micro-batch gives the same per-example terms: the teacher reads the example it scores (TRACE's
    LwF looked cached logits up by step index, another example's under a shuffled sampler)."""
    student, teacher, examples = models
    args = argparse.Namespace(lwf_alpha=0.5, lwf_temperature=2.0)
    loss_fn = lwf.OBJECTIVE.loss_fn(args, student, teacher, False, torch.device("cpu"))
    alone = [loss_fn([e])[0].item() for e in examples]
    order = [3, 0, 4, 1, 2]
    mixed = loss_fn([examples[i] for i in order])[0].item()
    assert mixed == pytest.approx(sum(alone), rel=1e-5)
    assert loss_fn(examples[::-1])[0].item() == pytest.approx(sum(alone), rel=1e-5)


@pytest.fixture(scope="module")
def runs(train_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("lwf")
    out = {name: root / name for name in ("sft", "zero", "half")}
    train(train_ckpt, out["sft"], "--max-steps", str(STEPS))
    train(train_ckpt, out["zero"], *LWF, "--lwf-alpha", "0")
    train(train_ckpt, out["half"], *LWF)
    return out


def test_alpha_zero_is_sft_bit_for_bit_and_alpha_half_is_not(runs):
    sft, zero, half = (weights(runs[k]) for k in ("sft", "zero", "half"))
    for k in sft:
        assert torch.equal(zero[k], sft[k]), k
    assert any(not torch.equal(half[k], sft[k]) for k in sft)
    # at step 1 the teacher is the student itself: KL 0; after it the two part
    kls = [x["kl"] for x in log(runs["half"])]
    assert kls[0] == pytest.approx(0, abs=1e-6) and all(k > 0 for k in kls[1:]), kls


def test_lwf_two_ranks_equal_one_process(train_ckpt, runs, tmp_path):
    two = tmp_path / "two"
    assert "on 2 rank(s)" in train(train_ckpt, two, *LWF, world=2).stdout
    for a, b in zip(log(runs["half"]), log(two)):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"], (a, b)
    assert_same_weights(weights(runs["half"]), weights(two), 1e-4)


def test_lwf_sigkill_then_resume_equals_uninterrupted_run(train_ckpt, runs, tmp_path):
    out = tmp_path / "killed"
    alive, output, _ = kill_once_state_is_saved(train_ckpt, out, *LWF)
    assert alive, f"train.py ended before it could be killed:\n{output[-3000:]}"
    train(train_ckpt, out, *LWF, "--resume")
    full = weights(runs["half"])
    for k, v in weights(out).items():
        assert torch.equal(v, full[k]), k
