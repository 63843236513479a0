"""methods/agem.py: the projection against naive fp64 math; the gradient the optimizer receives equals the naive
projection of the step's gradient against the memory batch's (computed unpacked, one example at a time); train.py
--objective agem end to end: no memory is sft bit for bit, a conflicting memory changes the update, 2 ranks equal 1,
a killed and resumed stage equals an uninterrupted one."""
import json
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tiny import MAX_LEN, assert_same_weights, kill_once_state_is_saved, log, train, weights

from data.mixture import tokenize_mixture
from methods import agem
from model.checkpoint import load_model
from model.tokenizer import ChatTokenizer

STEPS = 4
AGEM = ["--objective", "agem", "--max-steps", str(STEPS)]


def test_projection_equals_naive_math():
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (7,)]
    grad = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    ref = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    flat_g, flat_r = torch.cat([x.flatten() for x in grad]), torch.cat([x.flatten() for x in ref])
    if flat_g @ flat_r > 0:  # make them conflict
        ref = [-x for x in ref]
        flat_r = -flat_r
    new, dot, projected = agem.project(grad, ref)
    want = flat_g - (flat_g @ flat_r) / (flat_r @ flat_r) * flat_r
    assert projected and dot == pytest.approx(float(flat_g @ flat_r), rel=1e-12)
    assert torch.allclose(torch.cat([x.flatten() for x in new]), want, rtol=1e-12, atol=1e-14)
    assert abs(float(torch.cat([x.flatten() for x in new]) @ flat_r)) < 1e-10  # orthogonal to g_ref after
    same, _, projected = agem.project(grad, [-x for x in ref])  # agreeing: g unchanged
    assert not projected and all(a is b for a, b in zip(same, grad))


def naive_grad(model, examples):
    """The gradient of the summed response-token NLL over `examples` / their token count, one example at a time."""
    params = list(model.parameters())
    n = sum(e.n_targets for e in examples)
    total = [torch.zeros_like(p) for p in params]
    for e in examples:
        logits = model(torch.tensor([e.ids]), torch.arange(len(e.ids))[None])[0]
        loss = F.cross_entropy(logits, torch.tensor(e.targets), ignore_index=-100, reduction="sum") / n
        for t, gr in zip(total, torch.autograd.grad(loss, params)):
            t += gr
    return total


def conflicting_memory(ckpt, path):
    """The training prompts answered in words the task never uses (byte tokens outside the tokenizer's merges): a
    memory whose gradient pulls the output distribution away from the task's."""
    records = [json.loads(x) for x in (ckpt / "data.jsonl").read_text().splitlines()]
    rng = random.Random(1)
    path.write_text("".join(json.dumps({"prompt": r["prompt"],
                                        "response": " ".join(rng.choice(["zq", "xv", "jk", "wq"]) for _ in range(6))})
                            + "\n" for r in records))
    return path


def test_gradient_given_to_the_optimizer_is_the_naive_projection(train_ckpt, tmp_path):
    model = load_model(train_ckpt).double().requires_grad_(True)
    tok = ChatTokenizer.from_dir(train_ckpt)
    examples = tokenize_mixture([str(train_ckpt / "data.jsonl")], tok, MAX_LEN)[0]
    mem_path = conflicting_memory(train_ckpt, tmp_path / "memory.jsonl")
    memory = tokenize_mixture([str(mem_path)], tok, MAX_LEN)[0]
    step_batch = [examples[i] for i in range(8)]
    g = naive_grad(model, step_batch)
    batch = agem.memory_batch(0, 5, len(memory), 8)
    g_ref = naive_grad(model, [memory[i] for i in batch])
    if sum(float((a * b).sum()) for a, b in zip(g, g_ref)) > 0:
        g = [-x for x in g]  # the step's gradient the hook finds: one that conflicts, then one that agrees
    args = SimpleNamespace(seed=0, agem_batch=8, global_batch=8, micro_tokens=96)
    kept = {"memory": memory, "memory_lengths": [len(e.ids) for e in memory]}  # as the objective's setup keeps
    stage = SimpleNamespace(args=args, model=model, kept=kept, world=1, rank=0, device=torch.device("cpu"))
    for step_grad, conflicts in ((g, True), ([-x for x in g], False)):
        for p, x in zip(model.parameters(), step_grad):
            p.grad = x.clone()
        numbers = agem.OBJECTIVE.after_backward(stage, 5)
        want, dot, projected = agem.project(step_grad, g_ref)
        assert numbers["agem_projected"] == int(projected) == int(conflicts)
        assert numbers["agem_dot"] == pytest.approx(dot, rel=1e-5)
        for p, w in zip(model.parameters(), want):
            err = float((p.grad - w).abs().max() / w.abs().max())
            assert err < 1e-5, err


@pytest.fixture(scope="module")
def runs(train_ckpt, tmp_path_factory):
    """From a checkpoint that has learned the task (at random weights every gradient of these tiny tasks agrees with
    every other: the shared end-of-turn token and output scale dominate), sft, agem without a memory and agem with
    a conflicting one."""
    root = tmp_path_factory.mktemp("agem")
    start = root / "start"
    train(train_ckpt, start, "--epochs", "6")
    shutil.copy(train_ckpt / "data.jsonl", start)  # the later stages train on it (train() reads it there)
    out = {name: root / name for name in ("sft", "none", "conflict")}
    out["start"], out["memory"] = start, conflicting_memory(train_ckpt, root / "memory.jsonl")
    train(start, out["sft"], "--max-steps", str(STEPS))
    train(start, out["none"], *AGEM)
    train(start, out["conflict"], *AGEM, "--memory", str(out["memory"]))
    return out


def test_no_memory_is_sft_bit_for_bit_and_a_conflicting_memory_changes_the_step(runs):
    sft, none, conflict = (weights(runs[k]) for k in ("sft", "none", "conflict"))
    for k in sft:
        assert torch.equal(none[k], sft[k]), k
    projected = [x["agem_projected"] for x in log(runs["conflict"])]
    assert any(projected), projected
    assert any(not torch.equal(conflict[k], sft[k]) for k in sft)


def test_agem_two_ranks_equal_one_process(runs, tmp_path):
    two = tmp_path / "two"
    assert "on 2 rank(s)" in train(runs["start"], two, *AGEM, "--memory", str(runs["memory"]), world=2).stdout
    for a, b in zip(log(runs["conflict"]), log(two)):
        assert a["agem_projected"] == b["agem_projected"], (a, b)
        assert abs(a["agem_dot"] - b["agem_dot"]) <= 1e-4 * abs(a["agem_dot"]), (a, b)
    assert_same_weights(weights(runs["conflict"]), weights(two), 1e-4)


def test_agem_sigkill_then_resume_equals_uninterrupted_run(runs, tmp_path):
    out = tmp_path / "killed"
    args = [*AGEM, "--memory", str(runs["memory"])]
    alive, output, _ = kill_once_state_is_saved(runs["start"], out, *args)
    assert alive, f"train.py ended before it could be killed:\n{output[-3000:]}"
    train(runs["start"], out, *args, "--resume")
    full = weights(runs["conflict"])
    for k, v in weights(out).items():
        assert torch.equal(v, full[k]), k
