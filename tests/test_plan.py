"""plan.py and run.py --dry-run: the plan lists exactly the steps a real run executes, with the trainer's own token
counts, and writes nothing (the cost model's own tests: tests/test_costs.py).

One small real run (2 tasks x 8 examples, sft + replay + opr-ru, the setup of tests/test_run.py) is compared step by
step with the dry run of the same command: the same step keys and kinds; every train step's planned tokens equal
its train_summary.json "tokens" (exactly where the buffer is known in advance, bounded above after an OPR buffer);
rollout and eval steps generate for exactly the planned prompts, within the planned max of new tokens.
"""
import json
import os
import sys
from pathlib import Path

import pytest

import plan
from model.costs import PREFILL_FACTOR, Profile, StepCost, price, train_tok_s
import forkserver

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
    p = forkserver.run(cmd, cwd=REPO, env=env["env"], capture_output=True, text=True, timeout=1200)
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
    c = StepCost("s", "train", [], train_tokens=10**6, train_tokens_max=10**6, mean_doc=300, sdft=True)
    profile = Profile(overhead_s=0)
    from model.checkpoint import load_config
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-0.5b")
    price(c, cfg, profile)
    base = c.gpu_hours
    c.prompt_tokens, c.new_tokens_est, c.new_tokens_max = 3 * 10**5, 10**6, 2 * 10**6
    price(c, cfg, profile)
    tps = train_tok_s(cfg, 300, profile)
    assert c.gpu_hours - base == pytest.approx((3 * 10**5 / (PREFILL_FACTOR * tps) + 10**6 / profile.gen_tok_s)
                                               / 3600)
    assert c.gpu_hours_max - c.gpu_hours == pytest.approx(10**6 / profile.gen_tok_s / 3600)


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
    r = forkserver.run([sys.executable, str(REPO / "plan.py"), *(a.format(tmp=tmp_path) for a in argv)], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("plan.py: error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert named.format(tmp=tmp_path) in r.stderr and r.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_run_dry_run_checks_the_planner_flags(env, tmp_path):
    r = forkserver.run([sys.executable, str(REPO / "run.py"), "--model", str(env["base"]), *FLAGS, "--out",
                        str(tmp_path / "run"), "--dry-run", "--plan-gpus", "0"], cwd=REPO, env=env["env"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--plan-gpus" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_wall_time_on_nodes_by_hand():
    """Two chains, A (1 h) -> B (2 h) and C (1 h) -> D (1 h): one node runs them one after another (5 h); two nodes
    run A and C together, then B and D (3 h, the critical path A -> B); a step starts only after its inputs."""
    costs = [StepCost("A", "train", [], wall_hours=1), StepCost("B", "train", ["A"], wall_hours=2),
             StepCost("C", "eval", [], wall_hours=1), StepCost("D", "eval", ["C"], wall_hours=1)]
    assert plan.wall_on_nodes(costs, 1) == 5
    assert plan.wall_on_nodes(costs, 2) == 3
    assert plan.wall_on_nodes(costs, None) == 3
    chain = [StepCost("A", "train", [], wall_hours=1), StepCost("B", "train", ["A"], wall_hours=2)]
    assert plan.wall_on_nodes(chain, 4) == 3  # a chain gains nothing from nodes
    line = plan.format_nodes(costs, 2, 8)
    assert "1 node 5.00 h, 2 nodes 3.00 h (1.67x); the step graph's critical path 3.00 h" in line


def test_method_memory_prices_a_teacher_on_lora_as_a_bf16_base_and_a_state_as_the_adapters():
    """The per-method lines beside the memory table: a full model copy for sft-kl (fp32, 4 bytes a parameter); on
    LoRA, ilora's slow learner is the frozen base again in bf16 (train.py keeps it so) with its adapters, and EWC's
    F and theta* span the adapters only."""
    import re

    from model.checkpoint import load_config
    from model.costs import lora_params
    cfg = load_config(REPO / "bench" / "configs" / "qwen2.5-7b")
    run_cfg = {"lora_rank": 8, "lora_targets": "q_proj,v_proj"}
    P, n = cfg.num_params(embeddings=True), lora_params(cfg, 8, ["q_proj", "v_proj"])
    text = plan.method_memory(["sft-kl", "ilora", "ewc+lora"], cfg, 2, 16384, run_cfg)
    got = {m: float(x) for m, x in re.findall(r"  (\S+): \+([\d.]+) GB per GPU", text)}
    assert got == {"sft-kl": round(4 * P / 2 / 1e9, 1), "ilora": round((2 * P + 4 * n) / 2 / 1e9, 1),
                   "ewc+lora": round(8 * n / 2 / 1e9, 1)}
    assert "its base bf16" in text and "of the adapters" in text
