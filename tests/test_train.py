"""train.py end to end on tiny checkpoints: packed loss = unpacked loss (values and gradients), world size 2 = world
size 1 (untied and tied embeddings), SIGKILL + --resume = an uninterrupted run (eager and compiled), over-long
examples dropped and counted, bad data and NaN losses fail loudly without writing --out, the output loads in ours and
transformers, sft-kl (on-policy SDFT: test_sdft.py); --out replaces only train.py's own checkpoint, --resume of a
final checkpoint says so, SIGTERM during the final save leaves no temporary.

Every training run is a process of its own (`python train.py`, forked by tests/forkserver.py; 2 gloo ranks with
torchrun's variables, forkserver.run_ranks; one 2-rank run and the 3-rank load under torchrun itself) with
OMP_NUM_THREADS=1:
tiny-tensor ops with 2 threads on a busy 2-core machine are many times slower than with one.
"""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from common.outputs import write_jsonl  # noqa: E402
from data.packing import collate, pack, plan_steps, tokenize_sft  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model import schedules  # noqa: E402
from model.objectives import nll  # noqa: E402
from model.tokenizer import ChatTokenizer  # noqa: E402
import forkserver
from tiny import (MAX_LEN, N_STEPS, REPO, WORDS, assert_close_rel, assert_same_weights, foreign_dir, foreign_file,  # noqa: E402
                  free_port, kill_once_state_is_saved, log, tiny_train, train, train_cmd, train_env, weights)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Reference runs, shared by several tests (each subprocess costs seconds of imports).
@pytest.fixture(scope="module")
def ref(train_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "ref"
    train(train_ckpt, out)
    return out


@pytest.fixture(scope="module")
def ref_tied(train_ckpt_tied, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "ref_tied"
    train(train_ckpt_tied, out)
    return out


# --- packing is exact ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["train_ckpt", "train_ckpt_tied"])
def test_packed_loss_and_grads_equal_one_by_one(which, request):
    path = request.getfixturevalue(which)
    model = load_model(path).train().requires_grad_(True)
    tok = ChatTokenizer.from_dir(path)
    records = [json.loads(line) for line in (path / "data.jsonl").read_text().splitlines()]
    examples, _ = tokenize_sft(records, tok, MAX_LEN)
    examples = examples[:12]
    lengths = [len(e.ids) for e in examples]
    n_targets = sum(e.n_targets for e in examples)
    micro = pack(list(range(len(examples))), lengths, 96, 1)[0]
    assert len(micro) > 1 and any(len(mb) > 1 for mb in micro)  # several micro-batches, several docs in one

    def grads():
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return g

    packed_loss = 0.0
    for mb in micro:
        ids, pos, tgt, cu, max_len = collate([examples[i] for i in mb])
        loss = model(ids, pos, loss=nll(tgt), cu_seqlens=cu, max_seqlen=max_len) / n_targets
        loss.backward()
        packed_loss += loss.item()
    packed = grads()

    single_loss = 0.0
    for e in examples:  # one forward per example, dense causal attention, no cu_seqlens
        ids, tgt = torch.tensor([e.ids]), torch.tensor([e.targets])
        loss = model(ids, torch.arange(len(e.ids))[None], loss=nll(tgt)) / n_targets
        loss.backward()
        single_loss += loss.item()
    single = grads()

    assert abs(packed_loss - single_loss) <= 1e-5 * abs(single_loss)
    for n in single:
        assert single[n].abs().max() > 0, n
        assert_close_rel(packed[n], single[n], 1e-5, f"grad of {n}")


# --- the training script ---------------------------------------------------------------------------------------------

def first_step_loss(path: Path) -> float:
    """Step 1's loss computed here, unsharded: catches any FSDP build/load mistake (a broken weight tie, rows
    loaded into the wrong shard)."""
    model = load_model(path)
    examples, _ = tokenize_sft([json.loads(line) for line in (path / "data.jsonl").read_text().splitlines()],
                               ChatTokenizer.from_dir(path), MAX_LEN)
    batch = plan_steps(len(examples), 8, 3, 0)[0]
    with torch.no_grad():
        total = sum(model(ids, pos, loss=nll(tgt)) for ids, pos, tgt, _, _ in (collate([examples[i]]) for i in batch))
    return (total / sum(examples[i].n_targets for i in batch)).item()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_two_ranks_equal_one_process(which, request, tmp_path):
    path = request.getfixturevalue("train_ckpt" if which == "untied" else "train_ckpt_tied")
    one = request.getfixturevalue("ref" if which == "untied" else "ref_tied")
    # the plan really splits steps unevenly across 2 ranks: some rank runs an empty (all-ignored) micro-batch
    examples, _ = tokenize_sft([json.loads(line) for line in (path / "data.jsonl").read_text().splitlines()],
                               ChatTokenizer.from_dir(path), MAX_LEN)
    lengths = [len(e.ids) for e in examples]
    plan = plan_steps(len(examples), 8, 3, 0)
    assert any([] in rank for step in plan for rank in pack(step, lengths, 96, 2))

    two = tmp_path / "two"
    r = train(path, two, world=2, torchrun=which == "untied")  # as users launch it, once; forked ranks elsewhere
    assert "on 2 rank(s)" in r.stdout
    log1, log2 = log(one), log(two)
    assert [x["step"] for x in log1] == [x["step"] for x in log2] == list(range(1, N_STEPS + 1))
    for a, b in zip(log1, log2):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
        assert a["target_tokens"] == b["target_tokens"]
    assert abs(log1[0]["loss"] - first_step_loss(path)) <= 1e-5 * log1[0]["loss"]
    w1, w2 = weights(one), weights(two)
    assert ("lm_head.weight" in w1) == (which == "untied")  # a tied checkpoint stores the embeddings once
    assert_same_weights(w1, w2, 1e-5)
    w0 = load_file(path / "model.safetensors")
    assert any(not torch.allclose(w0[k], w1[k]) for k in w1), "training did not change the weights"


def test_each_rank_loads_its_rows_of_the_fused_projections(train_ckpt, tmp_path):
    """load_into on 3 FSDP2 ranks: the shard boundaries of the fused q/k/v (64 rows -> 22, 22, 20) and gate/up (128
    -> 43, 43, 42) fall inside HF tensors, so a rank reads parts of two of them; the gathered weights must be the
    checkpoint's, bit for bit."""
    script = ("import sys, torch, torch.distributed as dist, train\n"
              "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict\n"
              "from model.checkpoint import load_model\n"
              "from model.transformer import to_hf\n"
              "dist.init_process_group('gloo')\n"
              "m = train.build_model(sys.argv[1], torch.device('cpu'), torch.float32, shard=True)\n"
              "full = get_model_state_dict(m, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
              "if dist.get_rank() == 0:\n"
              "    ref = load_model(sys.argv[1]).state_dict()\n"
              "    assert full.keys() == ref.keys() and all(torch.equal(full[k], ref[k]) for k in ref)\n"
              "    assert to_hf(full, m.cfg).keys() >= {'model.layers.1.self_attn.k_proj.weight'}\n"
              "    print('same weights')\n"
              "dist.destroy_process_group()\n")
    (tmp_path / "load.py").write_text(f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + script)
    cmd = forkserver.torchrun(3, [sys.executable, str(tmp_path / "load.py"), str(train_ckpt)], free_port())
    r = forkserver.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "same weights" in r.stdout, r.stderr[-3000:]


def test_world_of_one_unwrapped_equals_fsdp(train_ckpt_tied, ref_tied, tmp_path):
    """One rank in fp32 trains the plain module (no FSDP2 wrapping, build_model's shortcut): the same bytes as the
    same run with every block and the root fully_shard'ed, tied embeddings included."""
    out = tmp_path / "fsdp"
    wrapper = ("import sys, train; build = train.build_model; "
               "train.build_model = lambda *a, **k: build(*a, **{**k, 'shard': True}); train.main(sys.argv[1:])")
    cmd = train_cmd(train_ckpt_tied, out)
    r = forkserver.run([cmd[0], "-c", wrapper, *cmd[2:]], cwd=REPO, env=train_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "on 1 rank(s) (FSDP2)" in r.stdout
    assert "on 1 rank(s) (unsharded" in train(train_ckpt_tied, tmp_path / "plain", "--max-steps", "1").stdout
    assert [x["loss"] for x in log(out)] == [x["loss"] for x in log(ref_tied)]
    assert [x["grad_norm"] for x in log(out)] == [x["grad_norm"] for x in log(ref_tied)]
    assert_same_weights(weights(out), weights(ref_tied), 0.0)


def test_activation_checkpointing_changes_no_number(train_ckpt, ref, tmp_path):
    """run.py turns it on for the paper's setting on GPUs: it may only save memory, never change the run."""
    out = tmp_path / "ac"
    train(train_ckpt, out, "--activation-checkpointing")
    assert [r["loss"] for r in log(out)] == [r["loss"] for r in log(ref)]
    assert_same_weights(weights(out), weights(ref), 0.0)


@pytest.mark.parametrize("flags, reference, tol", [([], "ref", 1e-6), (["--compile"], "ref_compiled", 0.0)],
                         ids=["eager", "compiled"])
def test_sigkill_then_resume_equals_uninterrupted_run(train_ckpt, request, tmp_path, flags, reference, tol):
    """Compiled: one graph serves every micro-batch length (dynamic=True), so the resumed process runs the kernels
    the uninterrupted one ran at the same steps: the same bytes (tol 0)."""
    ref = request.getfixturevalue(reference)
    out = tmp_path / "killed"
    alive, output, state = kill_once_state_is_saved(train_ckpt, out, *flags)
    assert alive, f"train.py ended before it could be killed:\n{output[-3000:]}"
    assert not out.exists()
    saved = torch.load(state, weights_only=False)["step"]
    assert saved >= 2 and saved % 2 == 0 and saved < N_STEPS
    with open(tmp_path / "killed.partial" / "train_log.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.')  # what a kill in the middle of a log write leaves

    r = train(train_ckpt, out, *flags, "--resume")
    assert not (tmp_path / "killed.partial").exists()
    resumed, full = log(out), log(ref)
    assert [x["step"] for x in resumed] == list(range(1, N_STEPS + 1)), "each step logged exactly once"
    for a, b in zip(resumed, full):
        assert abs(a["loss"] - b["loss"]) <= tol * abs(b["loss"]), (a, b)
    assert_same_weights(weights(out), weights(ref), tol)
    assert json.loads((out / "train_summary.json").read_text())["trained_tokens_this_run"] == \
        sum(x["tokens"] for x in full[saved:]), r.stdout


def test_max_steps_keeps_the_whole_plans_schedule(train_ckpt, ref, tmp_path):
    out = tmp_path / "stopped"
    train(train_ckpt, out, "--max-steps", "3")
    assert [x["lr"] for x in log(out)] == [x["lr"] for x in log(ref)[:3]]


def test_warmup_schedule_hand_checked():
    # 8 steps, warmup 0.25: 2 warmup steps at 1/3 and 2/3 of the peak, then cosine over the remaining 6
    got = [schedules.cosine(s, 8, 0.25) for s in range(9)]
    want = [1 / 3, 2 / 3] + [0.5 * (1 + math.cos(math.pi * k / 6)) for k in range(7)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[2] == 1.0 and got[8] == pytest.approx(0.0, abs=1e-12)
    no_warmup = [schedules.cosine(s, 8, 0.0) for s in range(9)]
    assert [schedules.cosine(s, 8) for s in range(9)] == no_warmup


def test_linear_schedule_hand_checked():
    # 8 steps, warmup 0.25: the warmup of cosine (1/3, 2/3), then from the peak at step 2 down by 1/6 a step to 0
    got = [schedules.linear(s, 8, 0.25) for s in range(9)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0], abs=1e-12)
    assert [schedules.linear(s, 4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    # without warmup, HF's get_linear_schedule_with_warmup (the official OPR code's ms-swift `linear`)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    hf = transformers.get_linear_schedule_with_warmup(opt, 0, 10)
    assert [schedules.linear(s, 10) for s in range(10)] == pytest.approx(
        [hf.lr_lambdas[0](s) for s in range(10)], abs=1e-12)


def test_linear_schedule_reaches_the_logged_lr(train_ckpt, ref, tmp_path):
    out = tmp_path / "linear"
    train(train_ckpt, out, "--max-steps", "3", "--lr-schedule", "linear")
    peak = log(ref)[0]["lr"]  # ref: cosine without warmup, its step 0 is at the peak
    assert [x["lr"] for x in log(out)] == pytest.approx([peak * (N_STEPS - s) / N_STEPS for s in range(3)], rel=1e-6)


def test_warmup_reaches_the_logged_lr(train_ckpt, ref, tmp_path):
    out = tmp_path / "warm"
    train(train_ckpt, out, "--max-steps", "3", "--warmup", "0.5")
    lrs, peak = [x["lr"] for x in log(out)], log(ref)[0]["lr"]  # ref: no warmup, its step 0 is at the peak
    total = len(log(ref))
    n = round(0.5 * total)
    assert lrs == pytest.approx([peak * (s + 1) / (n + 1) for s in range(3)], rel=1e-6)


def test_a_state_removed_half_way_is_gone_whole(tmp_path, monkeypatch):
    """train.py removes its resumable state when the final checkpoint is written; a kill in the middle of that must
    not leave progress.pt beside missing shards (a re-run would resume from it and fail on a missing file)."""
    import shutil
    from model import checkpoint
    state = tmp_path / "train_ckpt.partial" / "state"
    state.mkdir(parents=True)
    for name in ("__0_0.distcp", ".metadata", "progress.pt"):
        (state / name).write_bytes(b"x")

    def killed_half_way(path, ignore_errors=False):
        (Path(path) / "state" / "__0_0.distcp").unlink()
        raise KeyboardInterrupt  # stands for the SIGKILL: nothing after this line runs
    monkeypatch.setattr(shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.remove_dir(tmp_path / "train_ckpt.partial")
    assert not (tmp_path / "train_ckpt.partial").exists()
    checkpoint.remove_dir(tmp_path / "absent")  # nothing to remove is no error


def test_resume_refuses_a_state_saved_for_another_plan(train_ckpt, tmp_path):
    out = tmp_path / "k"
    _, _, progress = kill_once_state_is_saved(train_ckpt, out)
    assert progress.exists()
    r = train(train_ckpt, out, "--resume", "--seed", "7", ok=False)  # another data order: another plan
    assert r.returncode != 0 and "different run" in r.stdout + r.stderr
    assert not out.exists() and progress.exists()


def test_resume_refuses_a_state_whose_data_changed_to_the_same_lengths(train_ckpt, tmp_path):
    """Issue 64, class 2: a state is keyed by what its data holds (and the tokens it trained on), not their lengths:
    one record's response edited to another word of the same token length, between the save and the --resume, is
    refused."""
    data = tmp_path / "data.jsonl"
    records = [json.loads(line) for line in (train_ckpt / "data.jsonl").read_text().splitlines()]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "k"
    state = out.with_name("k.partial") / "state" / "progress.pt"
    p = subprocess.Popen(train_cmd(train_ckpt, out, data=data), cwd=REPO, env=train_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not state.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        p.send_signal(signal.SIGKILL)
    finally:
        p.communicate()
    assert state.exists()
    tok = ChatTokenizer.from_dir(train_ckpt)
    r0 = records[0]
    n = lambda response: len(tok.encode_sft(r0["prompt"], response)[0])  # noqa: E731
    first, *rest = r0["response"].split()
    swap = next(w for w in WORDS if w != first and n(" ".join([w, *rest])) == n(r0["response"]))
    records[0] = {**r0, "response": " ".join([swap, *rest])}
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    r = train(train_ckpt, out, "--resume", data=data, ok=False)
    assert r.returncode != 0 and "different run (--data holds other content than it did)" in r.stderr, r.stderr[-2000:]
    assert not out.exists() and state.exists()


def test_a_state_moved_with_its_run_directory_resumes_and_other_content_there_is_refused(train_ckpt, tmp_path):
    """Issue 64, class 2: a state is keyed by what --model and --data hold, not by their paths: the run directory
    moved (checkpoint, data, OUT.partial together) resumes; other weights under the same path are refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(train_ckpt, a / "model")
    _, _, progress = kill_once_state_is_saved(a / "model", a / "k")
    assert progress.exists()
    os.rename(a, b)
    other = tmp_path / "other"
    shutil.copytree(b / "model", other)
    r = train(b / "model", b / "k", "--resume")
    assert "train.py: resumed at step" in r.stdout and (b / "k" / "model.safetensors").exists()
    _, _, progress = kill_once_state_is_saved(b / "model", b / "k2")
    from safetensors.torch import load_file, save_file
    weights = load_file(b / "model" / "model.safetensors")
    save_file({k: v + 1e-3 for k, v in weights.items()}, b / "model" / "model.safetensors")  # the same shapes
    r = train(b / "model", b / "k2", "--resume", ok=False)
    assert r.returncode == 2 and "different run (--model holds other content than it did)" in r.stderr, r.stderr[-2000:]
    assert progress.exists()


def test_resume_refuses_any_flag_that_changes_the_weights(train_ckpt, tmp_path):
    out = tmp_path / "k"
    _, _, progress = kill_once_state_is_saved(train_ckpt, out)
    for flag, value in [("--weight-decay", ["0.1"]), ("--grad-clip", ["0.5"]), ("--betas", ["0.8", "0.99"]),
                        ("--lr-schedule", ["linear"]),
                        ("--compile", [])]:  # compiled kernels round differently
        r = train(train_ckpt, out, "--resume", flag, *value, ok=False)
        assert r.returncode == 2 and f"{flag} was" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not out.exists() and progress.exists()


def test_overlong_examples_are_dropped_and_reported(train_ckpt, ref):
    tok = ChatTokenizer.from_dir(train_ckpt)
    records = [json.loads(line) for line in (train_ckpt / "data.jsonl").read_text().splitlines()]
    expected = sum(len(tok.encode_sft(r["prompt"], r["response"])[0]) > MAX_LEN for r in records)
    assert expected == 4
    summary = json.loads((ref / "train_summary.json").read_text())
    assert summary["dropped_overlong"] == expected and summary["examples"] == len(records) - expected
    assert summary["steps"] == N_STEPS


def test_output_loads_in_ours_and_transformers(train_ckpt, train_ckpt_tied, ref, ref_tied):
    for out in (ref, ref_tied):
        ours = load_model(out)
        ids = torch.randint(0, ours.cfg.vocab_size, (2, 20))
        pos = torch.arange(20).expand(2, 20)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            a, b = ours(ids, pos), hf(input_ids=ids, position_ids=pos).logits
        assert_close_rel(a, b, 1e-5, f"logits of {out.name}")
        assert ChatTokenizer.from_dir(out).vocab_size == ChatTokenizer.from_dir(train_ckpt).vocab_size


@pytest.mark.parametrize("content,where", [("", "file is empty"), ("bad", "line 3")])
def test_bad_data_fails_naming_file_and_line(train_ckpt, tmp_path, content, where):
    data = tmp_path / "data.jsonl"
    if content:
        good = json.dumps({"prompt": "the cat", "response": "sat"})
        content = f"{good}\n{good}\n{{\"prompt\": \"the cat\", \"response\n{good}\n"
    data.write_text(content)
    out = tmp_path / "out"
    r = train(train_ckpt, out, data=str(data), ok=False)
    assert r.returncode != 0
    assert str(data) in r.stderr and where in r.stderr, r.stderr[-2000:]
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def chat(prompt, answer) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def test_chat_and_alpaca_files_train_to_the_weights_of_their_prompt_response_file(train_ckpt, ref, tmp_path):
    """train.py --data reads the record formats of a task manifest through its converter: a chat JSONL file and an
    alpaca JSON list holding ref's records train to ref's weights and losses, bit for bit."""
    records = [json.loads(line) for line in (train_ckpt / "data.jsonl").read_text().splitlines()]
    write_jsonl(tmp_path / "chat.jsonl", [chat(r["prompt"], r["response"]) for r in records])
    (tmp_path / "alpaca.json").write_text(json.dumps(
        [{"instruction": r["prompt"], "input": "", "output": r["response"]} for r in records], indent=1))
    for name in ("chat.jsonl", "alpaca.json"):
        out = tmp_path / name.split(".")[0]
        train(train_ckpt, out, data=tmp_path / name)
        a, b = weights(out), weights(ref)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        assert [x["loss"] for x in log(out)] == [x["loss"] for x in log(ref)], name


@pytest.mark.parametrize("how", ["nan_weight", "huge_lr"])
def test_nan_loss_stops_without_a_checkpoint(train_ckpt, tmp_path, how):
    extra = []
    if how == "nan_weight":
        bad = tmp_path / "bad"
        bad.mkdir()
        for f in train_ckpt.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        w = load_file(train_ckpt / "model.safetensors")
        w["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
        save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
        src = bad
    else:
        src, extra = train_ckpt, ["--lr", "1e30"]
    out = tmp_path / "out"
    r = train(src, out, *extra, ok=False)
    assert r.returncode != 0
    if how == "nan_weight":  # refused at load, naming the tensor, before a step runs
        assert "'model.layers.1.mlp.up_proj.weight' holds NaN" in r.stderr, r.stderr[-2000:]
    else:
        assert "non-finite loss" in r.stderr, r.stderr[-2000:]
    assert not out.exists()


def test_sft_kl_runs_and_kl_starts_at_zero(train_ckpt, ref, tmp_path):
    out = tmp_path / "sft-kl"
    train(train_ckpt, out, "--objective", "sft-kl", "--sft-kl-beta", "0.5", "--sft-kl-ema", "0.5")
    records = log(out)
    assert all("kl" in x for x in records) and "kl" not in log(ref)[0]
    assert abs(records[0]["kl"]) <= 1e-6, "teacher == student at step 1"
    assert all(x["kl"] > 1e-6 for x in records[1:]), "the EMA teacher lags the student after step 1"
    assert abs(records[0]["loss"] - log(ref)[0]["loss"]) <= 1e-6 * records[0]["loss"]  # loss logs the NLL
    w, w0 = weights(out), weights(ref)
    assert any(not torch.allclose(w[k], w0[k]) for k in w), "beta > 0 must change the result"


def test_loss_per_source_adds_up_and_changes_nothing_else(train_ckpt, ref, tmp_path):
    """Records with a "source" are replay: the log splits each step's NLL into task and replay parts that add up to
    the loss, step 1's parts equal a direct per-source computation, and the run's losses and weights are those of
    the same data without the marks (the split is bookkeeping, not a different objective)."""
    records = [json.loads(line) for line in (train_ckpt / "data.jsonl").read_text().splitlines()]
    marked = [dict(r, source="gold") if i % 3 == 0 else r for i, r in enumerate(records)]
    write_jsonl(tmp_path / "mix.jsonl", marked)
    out = tmp_path / "mix"
    train(train_ckpt, out, data=tmp_path / "mix.jsonl")
    got, plain = log(out), log(ref)
    assert len(got) == len(plain) == N_STEPS
    for a, b in zip(got, plain):
        n, nr = a["target_tokens"], a["target_tokens_replay"]
        assert 0 < nr < n or a["loss_task"] is None or a["loss_replay"] is None
        parts = (a["loss_task"] or 0) * (n - nr) + (a["loss_replay"] or 0) * nr
        assert abs(parts - a["loss"] * n) <= 1e-5 * a["loss"] * n, a
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"] and "loss_task" not in b
    assert_same_weights(weights(out), weights(ref), 1e-5)

    # step 1 by hand: its batch really mixes both sources inside one micro-batch, and each part is that source's
    # NLL per token under the initial weights
    tok = ChatTokenizer.from_dir(train_ckpt)
    examples, _ = tokenize_sft([dict(r, replay="source" in r) for r in marked], tok, MAX_LEN)
    batch = plan_steps(len(examples), 8, 3, 0)[0]
    micro = pack(batch, [len(e.ids) for e in examples], 96, 1)[0]
    assert any(len({examples[i].replay for i in mb}) == 2 for mb in micro)
    model = load_model(train_ckpt)
    with torch.no_grad():
        for flag, key in ((False, "loss_task"), (True, "loss_replay")):
            mine = [examples[i] for i in batch if examples[i].replay == flag]
            want = sum(model(*collate([e])[:2], loss=nll(collate([e])[2])) for e in mine) / sum(e.n_targets for e in mine)
            assert abs(got[0][key] - want.item()) <= 1e-5 * want.item(), key
    assert got[0]["target_tokens_replay"] == sum(examples[i].n_targets for i in batch if examples[i].replay)


# --- compiled blocks (--compile) ---------------------------------------------------------------------------------
# Each transformer block through torch.compile(fullgraph=True, dynamic=True), before FSDP2 wraps it: a graph break
# anywhere in a block (the varlen attention's document loop included) fails the run. The compiled run must track the
# eager one per step, on 1 and 2 ranks, resume to the same bytes (test_sigkill_then_resume_equals_uninterrupted_run),
# and train the KL objectives.

@pytest.fixture(scope="module")
def ref_compiled(train_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "compiled"
    assert "compiled blocks" in train(train_ckpt, out, "--compile").stdout
    return out


def assert_tracks(a: list[dict], b: list[dict], keys=("loss", "grad_norm"), tol=1e-5):
    """Two runs' logs agree to `tol` relative at every step (fp32 on the CPU: compiled kernels only reorder sums)."""
    assert [x["step"] for x in a] == [x["step"] for x in b]
    for x, y in zip(a, b):
        for k in keys:
            assert abs(x[k] - y[k]) <= tol * abs(y[k]), (k, x, y)


def test_compiled_training_tracks_eager_per_step(ref_compiled, ref):
    assert_tracks(log(ref_compiled), log(ref))
    assert log(ref_compiled) != log(ref)  # it did run other kernels (else the comparison above proves nothing)
    # after 15 AdamW steps at lr 1e-3, weights to 5e-4 of each tensor's largest entry: AdamW divides each gradient
    # entry by its own running RMS, so entries whose gradient is at fp32 noise level move by a fraction of lr
    assert_same_weights(weights(ref_compiled), weights(ref), 5e-4)


def test_compiled_two_ranks_equal_one_process(train_ckpt, ref_compiled, tmp_path):
    two = tmp_path / "two"
    r = train(train_ckpt, two, "--compile", world=2)
    assert "on 2 rank(s) (FSDP2)" in r.stdout and "compiled blocks" in r.stdout
    assert_tracks(log(two), log(ref_compiled))
    assert_same_weights(weights(two), weights(ref_compiled), 1e-5)


def test_compiled_sft_kl_tracks_eager(train_ckpt, tmp_path):
    flags = ["--objective", "sft-kl", "--sft-kl-beta", "0.5", "--sft-kl-ema", "0.5", "--max-steps", "4"]
    train(train_ckpt, tmp_path / "eager", *flags)
    train(train_ckpt, tmp_path / "compiled", *flags, "--compile")
    compiled, eager = log(tmp_path / "compiled"), log(tmp_path / "eager")
    assert_tracks(compiled, eager)  # the NLL and the gradient of NLL + beta KL
    # the KL itself (~6e-5 after one EMA step: a difference of nearly equal log-probs) to 1e-3 of itself
    assert_tracks(compiled[1:], eager[1:], ("kl",), tol=1e-3)


# --- as a user meets it, on tiny_env's checkpoint (a real subprocess each) ------------------------------------------
# data loss: --out never replaces what train.py did not write itself, unless --overwrite
def test_train_replaces_only_its_own_checkpoint(tiny_env, tmp_path):
    mine = foreign_dir(tmp_path)
    r = tiny_train(tiny_env, mine)
    assert r.returncode == 2 and (mine / "notes.txt").read_text() == "my notes"
    assert not (tmp_path / "mine.partial").exists()
    r = tiny_train(tiny_env, mine, "--overwrite")  # an explicit yes
    assert r.returncode == 0, r.stderr[-3000:]
    assert (mine / "train_summary.json").is_file() and not (mine / "notes.txt").exists()
    first = (mine / "model.safetensors").stat().st_ino
    r = tiny_train(tiny_env, mine, "--seed", "1")  # its own checkpoint: replaced without asking
    assert r.returncode == 0, r.stderr[-3000:]
    assert (mine / "model.safetensors").stat().st_ino != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no .old / .tmp left around

    afile = foreign_file(tmp_path)
    r = tiny_train(tiny_env, afile, "--overwrite")  # a file replaced by a checkpoint: nothing hidden left behind
    assert r.returncode == 0 and (afile / "config.json").is_file(), r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "mine.jsonl"]


def test_work_is_bounded_by_the_data_not_by_a_flags_value(tiny_env, tmp_path):
    """A huge --epochs streams its steps (it used to build them all first, past 1 GB); a budget below one example's
    length packs each example alone, and the efficiency counts that micro-batch at its own length (was 5137.5 %)."""
    out = tmp_path / "ck"
    t = time.monotonic()
    r = tiny_train(tiny_env, out, "--epochs", "1000000000", "--max-steps", "2", "--micro-tokens", "1")
    assert r.returncode == 0 and time.monotonic() - t < 120, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["packing_efficiency"] == 1.0 and "efficiency 100.0%" in r.stdout


# ---- resume after the final checkpoint ------------------------------------------------------------------------------
def test_resume_of_a_final_checkpoint_says_so(tiny_env, tmp_path):
    out = tmp_path / "ck"
    assert tiny_train(tiny_env, out).returncode == 0
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    r = tiny_train(tiny_env, out, "--resume")
    assert r.returncode == 0 and "already the final checkpoint" in r.stdout, r.stdout + r.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp and not (tmp_path / "ck.partial").exists()
    r = tiny_train(tiny_env, out, "--resume", "--seed", "3")  # another run's settings: not silently retrained
    assert r.returncode == 2 and "--seed" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


# ---- signals and what a killed process left behind ------------------------------------------------------------------
SLOW_SAVE = """
import sys, time
import model.checkpoint as c
real = c.save_file
def slow(*a, **kw):  # the weights are half on disk: SIGTERM lands inside the final save
    real(*a, **kw)
    print("SAVING", flush=True)
    time.sleep(120)
c.save_file = slow
import train
from common.cli import main_cli
sys.argv = ["train.py", *sys.argv[1:]]
main_cli(train.main, "train.py")
"""


def test_sigterm_during_the_final_save_leaves_no_temporary(tiny_env, tmp_path):
    out = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "--model", tiny_env["base"], "--data",
                          tiny_env["data"] / "C-STANCE" / "train.json", "--out", out, "--epochs", "1", "--global-batch",
                          "2", "--max-len", "128", "--quiet"], cwd=REPO, env=tiny_env["env"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        for line in p.stdout:
            if line.startswith("SAVING"):
                break
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert any(n.name.startswith(".ck.tmp-") for n in tmp_path.iterdir())  # the save is under way
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 143 and "Traceback" not in err and "train.py: stopped by SIGTERM" in err, err[-3000:]
    assert sorted(n.name for n in tmp_path.iterdir()) == ["ck.partial"], "a hidden temporary was left behind"


def test_a_second_train_py_on_the_same_out_is_refused_in_one_line(train_ckpt, ref, tmp_path):
    """Issue 64, class 1: one writer per --out. A second train.py started while the first trains is refused before
    it writes there; the first finishes with the weights it would have had alone."""
    out = tmp_path / "busy"
    first = subprocess.Popen(train_cmd(train_ckpt, out), cwd=REPO, env=train_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out.with_name("busy.partial") / "train_log.jsonl").exists() and first.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        first.send_signal(signal.SIGSTOP)  # paused mid-run (holding its lock), however fast the machine is
        assert first.poll() is None, "the first train.py ended before the second started"
        second = train(train_ckpt, out, ok=False)
    finally:
        first.send_signal(signal.SIGCONT)
        output = first.communicate(timeout=600)[0]
    assert second.returncode != 0 and "another train.py is writing it" in second.stderr, second.stderr[-2000:]
    assert len(second.stderr.strip().splitlines()) == 1
    assert first.returncode == 0, output[-3000:]
    assert_same_weights(weights(out), weights(ref), 0.0)
