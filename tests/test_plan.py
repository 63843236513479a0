"""plan.py and run.py --dry-run: the plan lists exactly the steps a real run executes, with the trainer's own token
counts, and writes nothing; the activation-memory model counts what autograd really keeps in a block.

One small real run (2 tasks x 8 examples, sft + replay + opr-ru, the setup of tests/test_run.py) is compared step by
step with the dry run of the same command: the same step keys and kinds; every train step's planned tokens equal
its train_summary.json "tokens" (exactly where the buffer is known in advance, bounded above after an OPR buffer);
rollout and eval steps generate for exactly the planned prompts, within the planned max of new tokens.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plan

REPO = Path(__file__).resolve().parents[1]
TASKS = ["C-STANCE", "Py150"]
FLAGS = ["--tasks", ",".join(TASKS), "--methods", "sft,replay,opr-ru", "--n-train", "8", "--eval-limit", "4",
         "--epochs", "2", "--global-batch", "4", "--lr", "1e-4", "--max-new-tokens", "6", "--rho", "0.5", "--jobs",
         "2", "--quiet"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("plan")
    write_random_tiny(root / "base")
    return dict(root=root, base=root / "base", env=dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache")))


def run_py(env, out, *extra):
    cmd = [sys.executable, str(REPO / "run.py"), "--model", str(env["base"]), *FLAGS, "--out", str(out), *extra]
    p = subprocess.run(cmd, cwd=REPO, env=env["env"], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, f"run.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def real(env):
    out = env["root"] / "real"
    run_py(env, out)
    return out


@pytest.fixture(scope="module")
def dry(env, real):
    out = env["root"] / "dry"
    stdout = run_py(env, out, "--dry-run")
    assert not out.exists(), "--dry-run must write nothing"
    return plan.parse_plan(stdout), stdout


def test_dry_run_lists_exactly_the_steps_a_real_run_executes(real, dry):
    steps, _ = dry
    manifest = json.loads((real / "manifest.json").read_text())
    assert sorted(steps) == sorted(manifest)
    assert {k: s["kind"] for k, s in steps.items()} == {k: v["kind"] for k, v in manifest.items()}
    for k, s in steps.items():  # a step comes after the steps it reads
        order = list(steps)
        assert all(order.index(d) < order.index(k) for d in s["deps"]), k


def test_planned_train_tokens_are_the_trainers_own_counts(real, dry):
    steps, _ = dry
    n_exact = n_bounded = 0
    for key, s in steps.items():
        if s["kind"] != "train":
            continue
        tokens = json.loads((real / "steps" / key / "ckpt" / "train_summary.json").read_text())["tokens"]
        after_opr = any(steps[d]["kind"] == "score" for d in s["deps"])
        if after_opr:  # the buffer holds the model's answers: unknown before the run, bounded by max_new_tokens
            assert tokens <= s["train_tokens_max"], key
            n_bounded += 1
        else:  # no buffer, or gold replay drawn with run.py's seed: exact
            assert tokens == s["train_tokens"] == s["train_tokens_max"], key
            n_exact += 1
    assert n_exact == 3 and n_bounded == 1  # stage 1 (shared by all three), sft s2, replay s2 | opr-ru s2


def test_planned_generation_matches_what_rollout_and_eval_generated(real, dry):
    steps, _ = dry
    for key, s in steps.items():
        if s["kind"] == "rollout":
            records = [json.loads(x) for x in (real / "steps" / key / "rollouts.jsonl").read_text().splitlines()]
        elif s["kind"] == "eval":
            records = [json.loads(x) for x in (real / "steps" / key / "eval" / "predictions.jsonl").read_text()
                       .splitlines()]
        elif s["kind"] == "drift":
            records = [json.loads(x) for x in (real / "steps" / key / "drift" / "drift_samples.jsonl").read_text()
                       .splitlines()]
        elif s["kind"] == "buffer-nll":  # one forward over the gold buffer it reads: no generation
            buffer = real / "steps" / s["deps"][1] / "buffer.jsonl"
            assert s["prompts"] == len(buffer.read_text().splitlines()) > 0 and s["new_tokens_max"] == 0, key
            continue
        else:
            assert s["prompts"] == s["new_tokens_max"] == 0
            continue
        assert len(records) == s["prompts"] > 0, key
        assert s["new_tokens_max"] == 6 * s["prompts"]
        assert sum(r["num_tokens"] for r in records) <= s["new_tokens_max"]
        assert s["prompt_tokens"] > s["prompts"]


def test_gpu_hours_add_up_per_method_and_in_total(dry):
    steps, stdout = dry
    rows = {line[:28].strip(): line[28:].split() for line in stdout.splitlines()
            if line.startswith(("sft ", "replay ", "opr-ru ", "ALL "))}
    total = sum(s["gpu_hours"] for s in steps.values())
    assert float(rows["ALL (each step once)"][4]) == pytest.approx(total, abs=0.01 * len(steps))  # train rollout eval
    # sft uses a subset of replay's steps' kinds: train + eval only, no rollout
    assert float(rows["sft"][1]) == 0.0 and float(rows["opr-ru"][1]) > 0
    # every probe (each method's stage-2 drift, replay's buffer NLL) serves the one method whose steps it reads
    probes = {m: float(rows[m][3]) for m in ("sft", "replay", "opr-ru")}
    assert sum(probes.values()) == pytest.approx(float(rows["ALL (each step once)"][3]), abs=0.02)
    drift = [s["gpu_hours"] for s in steps.values() if s["kind"] == "drift"]
    assert len(drift) == 3 and probes["sft"] == pytest.approx(drift[0], abs=0.01)


def test_sdft_training_prices_its_students_samples(env):
    """An sdft stage samples one response per training example and epoch on the training GPUs before it trains: its
    train steps list those prompts and new tokens (at most --sdft-max-new-tokens each) and cost their generation on
    top of the training; sft's train steps generate nothing."""
    out = run_py(env, env["root"] / "dry-sdft", "--dry-run", "--methods", "sft,sdft", "--sdft-max-new-tokens", "5")
    trains = {k: s for k, s in plan.parse_plan(out).items() if s["kind"] == "train"}
    sdft = [s for s in trains.values() if s["prompts"]]
    assert len(trains) == 4 and len(sdft) == 2  # stage 1 and 2 of each method: sdft's own objective from stage 1
    for s in sdft:
        assert s["prompts"] == 2 * 8 and s["new_tokens_max"] == 5 * s["prompts"] >= s["new_tokens_est"] > 0
        assert s["prompt_tokens"] > s["prompts"]
    c = plan.StepCost("s", "train", [], train_tokens=10**6, train_tokens_max=10**6, mean_doc=300, sdft=True)
    profile = plan.Profile(overhead_s=0)
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-0.5b")
    plan.price(c, cfg, profile)
    base = c.gpu_hours
    c.prompt_tokens, c.new_tokens_est, c.new_tokens_max = 3 * 10**5, 10**6, 2 * 10**6
    plan.price(c, cfg, profile)
    tps = plan.train_tok_s(cfg, 300, profile)
    assert c.gpu_hours - base == pytest.approx((3 * 10**5 / (plan.PREFILL_FACTOR * tps) + 10**6 / profile.gen_tok_s)
                                               / 3600)
    assert c.gpu_hours_max - c.gpu_hours == pytest.approx(10**6 / profile.gen_tok_s / 3600)


def test_activation_checkpointing_is_priced_when_the_command_turns_it_on():
    """Qwen2.5-0.5B fits 80 GB without recomputation, but the paper preset passes --activation-checkpointing on GPUs
    anyway: its training then costs 4/3 of the tokens' time (the per-step overhead aside)."""
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-0.5b")
    profile = plan.Profile(overhead_s=0)
    assert not plan.needs_checkpointing(cfg, profile)
    hours = []
    for on in (False, True):
        c = plan.StepCost("s1-train-FOMC", "train", [], train_tokens=10**9, train_tokens_max=10**9, mean_doc=300)
        plan.price(c, cfg, profile, checkpointing=on)
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
    assert sum(saved.values()) == plan.activation_bytes_per_token_layer(cfg) * T


def test_memory_model_for_qwen25_7b_on_8_gpus():
    """Hand-checked: 7.615 B parameters -> 16 bytes each of sharded fp32 state (weights, grads, two AdamW moments)
    over 8 GPUs = 15.2 GB; without checkpointing 16,384 tokens of activations do not fit 80 GB, with it they do."""
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-7b")
    assert cfg.num_params() == 7_615_487_488  # the published 7.61 B
    m = plan.memory_per_gpu(cfg, 8, 16384)
    state = sum(v for k, v in m.items() if "sharded" in k)
    assert state == pytest.approx(16 * 7_615_487_488 / 8)
    assert m["total"] > 80e9 > m["total_checkpointed"]


# --- plan.py's failures: one line naming the flag or path, exit 2, like every script ----------------------------------
@pytest.mark.parametrize("argv, named", [
    ([], "pass --paper"),
    (["--paper", "--plan-gpus", "0"], "--plan-gpus"),
    (["--paper", "--plan-mfu", "0"], "--plan-mfu"),
    (["--paper", "--plan-mfu", "1.5"], "--plan-mfu"),
    (["--paper", "--plan-gen-tok-s", "-5"], "--plan-gen-tok-s"),
    (["--paper", "--plan-train-tok-s", "0"], "--plan-train-tok-s"),
    (["--paper", "--plan-peak-tflops", "nan"], "--plan-peak-tflops"),
    (["--paper", "--plan-overhead-s", "-1"], "--plan-overhead-s"),
    (["--paper", "--micro-tokens", "0"], "--micro-tokens"),
    (["--paper", "--eval-repeats", "0"], "--eval-repeats"),
    (["--paper", "--tp", "8"], "--tp 8: qwen2.5-7b's 28 attention heads do not divide by 8; use 1, 2 or 4"),
    (["--paper", "--plan-gpus", "2", "--tp", "4"], "--tp 4: more than --plan-gpus 2"),
    (["--paper", "--config", "{tmp}/nope"], "{tmp}/nope: no such checkpoint directory"),
    (["--paper", "--trace", "{tmp}/nope"], "--trace {tmp}/nope: no such directory"),
    (["--paper", "--trace", "{tmp}"], "--trace {tmp}: holds none"),
])
def test_plan_failures_are_one_line(tmp_path, argv, named):
    r = subprocess.run([sys.executable, str(REPO / "plan.py"), *(a.format(tmp=tmp_path) for a in argv)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("plan.py: error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert named.format(tmp=tmp_path) in r.stderr and r.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_run_dry_run_checks_the_planner_flags(env, tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "run.py"), "--model", str(env["base"]), *FLAGS, "--out",
                        str(tmp_path / "run"), "--dry-run", "--plan-gpus", "0"], cwd=REPO, env=env["env"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--plan-gpus" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_micro_tokens_rule_is_the_most_that_fit_and_train_py_uses_it(monkeypatch):
    """plan.micro_tokens_that_fit: the largest multiple of 1024 whose modelled memory fits the budget, with and
    without activation checkpointing; train.py takes it on a GPU when --micro-tokens is not given (free memory faked),
    16384 on the CPU, and refuses a budget below --max-len in one line."""
    import argparse
    import train
    from model.checkpoint import load_config
    cfg = load_config(Path(plan.__file__).parent / "bench" / "configs" / "qwen2.5-7b")
    budget = 72e9
    for ac, key in ((False, "total"), (True, "total_checkpointed")):
        mt = plan.micro_tokens_that_fit(cfg, 8, budget, ac)
        assert mt % 1024 == 0 and mt > 0
        assert plan.memory_per_gpu(cfg, 8, mt)[key] <= budget < plan.memory_per_gpu(cfg, 8, mt + 1024)[key]
    assert plan.micro_tokens_that_fit(cfg, 8, budget, True) > plan.micro_tokens_that_fit(cfg, 8, budget, False)
    assert plan.micro_tokens_that_fit(cfg, 1, budget, False) == 0  # 7B's states alone need > 72 GB on one GPU

    def args(**kw):
        return argparse.Namespace(**{**dict(compile=None, micro_tokens=None, model=str(
            Path(plan.__file__).parent / "bench" / "configs" / "qwen2.5-7b"), activation_checkpointing=True,
            max_len=2048, resume=False), **kw})

    a = args()
    train.device_defaults(a, torch.device("cpu"), 0, 1, torch.float32, {})
    assert (a.compile, a.micro_tokens) == (False, train.MICRO_TOKENS)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79e9, 80e9))
    from kernels import attention
    monkeypatch.setattr(attention, "_BACKEND", "torch_varlen")  # what a GPU picks (compiles whole)
    a = args()
    train.device_defaults(a, torch.device("cuda"), 0, 8, torch.bfloat16, {})
    assert a.compile is True and a.micro_tokens == plan.micro_tokens_that_fit(cfg, 8, 0.9 * 80e9, True)
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
