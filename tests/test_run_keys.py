"""run.py's step keys: a table is a function of the command, its inputs and its seeds.

- Determinism: the same command with --jobs 1 on one core, every step its own `python script.py` (OPR_NO_ZYGOTE=1),
  and with --jobs 2 on two cores, every step forked from run.py's zygote (pipeline/zygote.py), with a caller with no
  thread setting, writes a byte-identical results.json.
- Content keys: editing one answer of a data file in place (same path) re-runs exactly the steps that read it and
  the steps downstream of them; nothing else.
- New scoring rules re-score exactly the steps that score; every setting is in the keys of the steps it changes; a
  preset's measured seed noise goes only with the preset unchanged.
(At unit level: the numerics and file contents in a key, tests/test_digest.py; stale readers and durable commits,
tests/test_steps.py; the tiny base's pins, tests/test_base.py.)

The end-to-end runs use a tiny untrained Llama, 2 tasks x 8 training examples, methods replay and opr-ru (between
them every kind of step a native run has but the other methods' own; sft's chain is replay's without the buffer).
"""
import json
from dataclasses import asdict
import os
import shutil
import sys
from pathlib import Path

import pytest
import forkserver

REPO = Path(__file__).resolve().parents[1]
TASKS = ["C-STANCE", "Py150"]
METHODS = "replay,opr-ru"


def command(base: Path, data: Path, out: Path, jobs: int) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), "--model", str(base), "--data", str(data), "--tasks",
            ",".join(TASKS), "--methods", METHODS, "--eval-limit", "4", "--epochs", "1", "--global-batch", "4",
            "--lr", "1e-4", "--max-new-tokens", "6", "--rho", "0.5", "--jobs", str(jobs), "--quiet",
            "--out", str(out)]


def run(cmd, env, cores=None):
    if cores is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", cores] + cmd
    p = forkserver.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from data.embedded import write_benchmark
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("keys")
    write_random_tiny(root / "base")
    write_benchmark(root / "data", n_train=8, n_eval=2, n_test=8, tasks=TASKS)
    from kernels import CPU_PINS  # a caller with no thread or CPU setting
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", *CPU_PINS)}
    env["OPR_CACHE"] = str(root / "cache")
    return dict(root=root, base=root / "base", data=root / "data", env=env)


@pytest.fixture(scope="module")
def run_one_core(setup):
    out = setup["root"] / "run_jobs1"
    run(command(setup["base"], setup["data"], out, jobs=1), dict(setup["env"], OPR_NO_ZYGOTE="1"), cores="0")
    return out


def test_results_identical_across_jobs_and_cores(setup, run_one_core):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores")
    out = setup["root"] / "run_jobs2"
    run(command(setup["base"], setup["data"], out, jobs=2), setup["env"], cores="0,1")
    a, b = (run_one_core / "results.json").read_bytes(), (out / "results.json").read_bytes()
    assert a == b
    assert sorted(manifest(run_one_core)) == sorted(manifest(out))  # the same steps, the same keys
    meta = json.loads(a)["meta"]
    assert meta["numerics"]["threads"] == 1  # the pinned default, not cores // jobs
    from kernels import NUMERICS
    assert meta["numerics"]["code"] == NUMERICS  # a kernel change that moves float results is a new key
    from kernels import cpu_model
    import torch  # another CPU model or instruction set rounds differently (no --portable here)
    assert meta["numerics"]["cpu"] == dict(pins={}, model=cpu_model(), isa=torch.backends.cpu.get_cpu_capability())
    # the kernels the steps use (defaults follow what is installed; KERNELS_*_BACKEND forces one): on a CPU, these
    from kernels import cpu  # (C where a compiler is found, else torch)
    assert meta["numerics"]["kernels"] == {"attention": ["sdpa", False], "cross_entropy": ["chunked", False],
                                            "engine_cpu": [cpu.backend(), False]}


def test_edited_answer_reruns_exactly_the_dependent_steps(setup, run_one_core):
    # a copy of the data and the run, so the other tests keep theirs
    data, out = setup["root"] / "data_edit", setup["root"] / "run_edit"
    shutil.copytree(setup["data"], data)
    shutil.copytree(run_one_core, out)
    cmd = command(setup["base"], data, out, jobs=2)
    p = run(cmd, setup["env"])
    before = manifest(out)
    assert "(%d already done)" % len(before) in p.stdout  # a moved copy of the data: nothing re-runs

    def edit(split, task):
        path = data / task / f"{split}.json"
        records = json.loads(path.read_text())
        records[0]["answer"] = records[0]["answer"] + " edited"
        path.write_text(json.dumps(records))  # same path, new content

    def new_steps():
        nonlocal before
        run(cmd, setup["env"])
        after = manifest(out)
        new = sorted(k.split("-")[0] + "-" + after[k]["kind"] for k in set(after) - set(before))
        before = after
        return new

    # the second task's test answers feed only its evaluations: the base's row 0 (every task), stage 1's (which
    # scores the next task too, for FWT) and stage 2's, one per method
    edit("test", TASKS[1])
    assert new_steps() == ["s0-eval", "s1-eval"] + ["s2-eval"] * 2
    # its training answers feed stage 2's training (every method) and so stage 2's evaluations and drift
    # measurements (stage 2 vs stage 1 on task 1's test prompts); stage 1, the stage-1 rollouts and the buffers
    # (built from task 1) are untouched
    edit("train", TASKS[1])
    assert new_steps() == ["s2-drift"] * 2 + ["s2-eval"] * 2 + ["s2-train"] * 2
    # the first task's training answers feed everything: stage 1, the gold buffer, the OPR scores (gold answers
    # are the RU reference), and everything downstream; the rollout reads only its prompts, yet its key follows
    # the file (and its stage-1 checkpoint changes anyway)
    edit("train", TASKS[0])
    kinds = new_steps()
    assert kinds.count("s1-train") == 1 and kinds.count("s1-rollout") == 1 and kinds.count("s1-score") == 1
    assert kinds.count("s1-replay") == 1 and kinds.count("s2-train") == 2


def test_new_scoring_rules_rescore_exactly_the_dependent_steps(setup, run_one_core):
    """data.metrics.RULES (bumped when a metric's rule changes) keys the steps that score: every evaluation and the
    OPR-RU buffer, and what follows from that buffer (opr-ru's stage-2 training, its drift and evaluation)."""
    out = setup["root"] / "run_rules"
    shutil.copytree(run_one_core, out)
    before = manifest(out)
    argv = command(setup["base"], setup["data"], out, jobs=2)[1:]
    patched = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); import data.metrics as m; m.RULES += 1; "
               f"sys.argv = {argv!r}; runpy.run_path({argv[0]!r}, run_name='__main__')")
    run([sys.executable, "-c", patched], setup["env"])
    after = manifest(out)
    new = sorted(k.split("-")[0] + "-" + after[k]["kind"] for k in set(after) - set(before))
    assert new == ["s0-eval", "s1-eval", "s1-score", "s2-drift", "s2-eval", "s2-eval", "s2-train"]


def test_keys_follow_what_a_setting_changes(setup):
    """From the dry run's step keys: --engine auto is resolved before keying (on a CPU it is the native engine, so
    the two commands are one run); --eval-limit changes the evaluations and nothing else (training, rollouts,
    buffers and drift read no test answers beyond their own flags)."""
    import plan

    def keys(*extra, base=setup["base"], env=setup["env"]):
        cmd = command(base, setup["data"], setup["root"] / "dry", jobs=1) + ["--dry-run", *extra]
        steps = plan.parse_plan(run(cmd, env).stdout)
        assert not (setup["root"] / "dry").exists()
        return {k: s["kind"] for k, s in steps.items()}

    auto = keys("--engine", "auto")
    assert keys("--engine", "native") == auto
    other = keys("--eval-limit", "3")  # command() passes 4
    assert len(other) == len(auto)
    changed = [kind for k, kind in auto.items() if k not in other]
    assert changed and set(changed) == {"eval"} and len(changed) == sum(kind == "eval" for kind in auto.values())
    # --lr-schedule: its default is no new key; linear changes every training step (and what follows one), not the
    # base's evaluation (row 0)
    assert keys("--lr-schedule", "cosine") == auto
    linear = keys("--lr-schedule", "linear")
    assert len(linear) == len(auto) and not [k for k, kind in auto.items() if kind == "train" and k in linear]
    assert sum(k.startswith("s0-eval") for k in set(auto) & set(linear)) == 1
    # --model as a model id of the Hugging Face cache: its snapshot (files linked into blobs) keys as the directory
    snap = setup["root"] / "hub" / "models--Org--Base" / "snapshots" / ("a" * 40)
    if not snap.exists():
        blobs = snap.parent.parent / "blobs"
        blobs.mkdir(parents=True)
        snap.mkdir(parents=True)
        for f in setup["base"].iterdir():
            shutil.copyfile(f, blobs / f.name)
            (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / f.name)
    assert keys(base="Org/Base", env={**setup["env"], "HF_HUB_CACHE": str(setup["root"] / "hub")}) == auto
    import kernels
    if {"avx2", "fma"} <= kernels.cpu_flags():  # --portable: other numerics (the CPU pins), so every key is new
        portable = keys("--portable")
        assert len(portable) == len(auto) and not set(portable) & set(auto)


@pytest.fixture
def dry_run(setup, capsys, monkeypatch):
    """run.py --dry-run on the setup's command as run.main in this process: (*extra flags) -> the planner's StepCost
    list (the keys, kinds and deps the printed plan formats)."""
    import run
    monkeypatch.setenv("OPR_CACHE", setup["env"]["OPR_CACHE"])
    monkeypatch.setattr(run.faulthandler, "register", lambda *a, **k: None)  # (pytest's captured stderr has no fd)

    def go(*extra):
        argv = [str(a) for a in command(setup["base"], setup["data"], setup["root"] / "dry", jobs=1)[2:]]
        costs = run.main([*argv, "--dry-run", *extra])
        capsys.readouterr()
        return costs
    return go


def test_a_methods_settings_key_its_own_train_steps_only(setup, dry_run):
    """Each method's settings (methods/: Method.flags) reach train.py and its train steps' keys, and no other
    method's; agem's stage 2 reads replay's gold buffer as its memory (one step, shared with replay). The dry
    runs are run.main in this process (the plan's keys as run.py prints them: test_keys_follow_what_a_setting_changes
    and tests/test_plan.py read them from the printed plan)."""
    def steps(*extra):
        costs = dry_run(*extra)
        assert not (setup["root"] / "dry").exists()
        return {c.key: dict(kind=c.kind, deps=list(c.deps)) for c in costs}

    def trains(s, method_free):  # train keys of stage 2 (those after a buffer or a prior stage)
        return {k for k, x in s.items() if x["kind"] == "train"} - method_free

    base = steps("--methods", "sft")
    sft_trains = {k for k, x in base.items() if x["kind"] == "train"}
    for method, flag, value in (("ewc", "--ewc-lambda", "5"), ("ewc", "--ewc-samples", "7"),
                                ("ewc", "--ewc-gamma", "0.5"), ("lwf", "--lwf-alpha", "0.25"),
                                ("lwf", "--lwf-temperature", "3"), ("sft-kl", "--sft-kl-beta", "0.1")):
        a, b = steps("--methods", f"sft,{method}"), steps("--methods", f"sft,{method}", flag, value)
        assert sft_trains <= set(a) and sft_trains <= set(b), (method, flag)  # sft untouched
        own_a, own_b = trains(a, sft_trains), trains(b, sft_trains)
        assert len(own_a) == len(TASKS) and own_a.isdisjoint(own_b), (method, flag)
    both = steps("--methods", "replay,agem")
    gold = [k for k, x in both.items() if x["kind"] == "replay"]
    assert len(gold) == 1  # one gold draw: replay's buffer is agem's memory
    readers = [k for k, x in both.items() if x["kind"] == "train" and gold[0] in x["deps"]]
    assert len(readers) == 2  # replay's stage 2 and agem's


# every setting of run.Settings with a flag, and another value for it; n_train / n_test size the embedded benchmark
# (refused with --data: their effect is the data files' content, which every key hashes: the edited-answer test)
OTHER_VALUE = {"methods": None, "rho": "0.25", "lr": "3e-4", "warmup": "0.1", "lr_schedule": "linear",
               "global_batch": "2", "max_new_tokens": "5", "max_train": "6", "eval_limit": "3", "eval_repeats": "2",
               "scoring": "trace", "replay_budget": "per-task", "sft_kl_beta": "0.25", "sdft_teacher": "base",
               "sdft_max_new_tokens": "7", "epochs": "2", "drift_limit": "2", "n_train": None, "n_test": None,
               "ewc_lambda": "3.0", "ewc_samples": "7", "ewc_gamma": "0.5", "lwf_alpha": "0.25",
               "lwf_temperature": "3.0", "ssr_demos": "5", "ssr_prompts": "9", "ssr_samples": "2",
               "ssr_temperature": "0.7", "ssr_template": "chat", "ssr_clusters": "4", "lora_rank": "4",
               "lora_alpha": "16.0", "lora_dropout": "0.05", "lora_targets": "k_proj,q_proj", "lora_lr": "2e-4",
               "olora_lambda1": "0.25", "olora_lambda2": "0.1", "ilora_lambda": "0.5", "ilora_gamma": "0.5"}
ALL_METHODS = ("sft,replay,opr-ru,opr-sc,opr-low,opr-random,mtl,sdft,sft-kl,ewc,lwf,agem,ssr,lora-seqft,opr-ru+lora,"
               "olora,ilora")


def test_every_setting_changes_the_keys_of_the_steps_it_changes(dry_run):
    """Issue 59's flag-key rule at run.py's level: a setting that reaches a step's command but not its key would let
    a run reuse another run's cached steps. For every flagged setting of run.Settings, the dry run's step keys with
    another value differ from the default's (every method in the run, so each method's settings act)."""
    import dataclasses

    import run
    flagged = {f.name for f in dataclasses.fields(run.Settings) if f.metadata.get("help")}
    assert flagged == set(OTHER_VALUE), "a new setting gets a value in OTHER_VALUE"

    def keys(*extra):
        return {c.key for c in dry_run("--methods", ALL_METHODS, *extra)}

    base = keys()
    for name, value in OTHER_VALUE.items():
        if value is None:
            continue
        assert keys(f"--{name.replace('_', '-')}", value) != base, f"--{name} {value} changed no step key"


def test_the_presets_seed_noise_goes_with_the_preset_unchanged_only(monkeypatch):
    """results.json carries the preset's measured seed noise (report.py's one-seed intervals) only for a run that
    is the one measured: other methods or the drift probe do not matter; any other setting, the device, GPUs, the
    engine, the thread count, the benchmark version or the scoring rules do."""
    from run import PRESETS
    from reporting.noise import SEED_NOISE, preset_seed_noise
    tiny = asdict(PRESETS["tiny"])
    from kernels import NUMERICS
    measured_code = SEED_NOISE["tiny"]["setting"]["code"]
    cpu = dict(device="cpu", gpus=0, threads=1, torch="t", code=measured_code)

    measured_base = SEED_NOISE["tiny"]["setting"]["base"]

    def noise(cfg=tiny, rhos=(0.5,), custom=False, engine="native", base_sha=measured_base, **numerics):
        return preset_seed_noise("tiny", PRESETS["tiny"], cfg, list(rhos), custom, dict(cpu, **numerics), engine,
                                 base_sha)

    assert noise() is SEED_NOISE["tiny"]
    assert noise(dict(tiny, methods="sft,opr-ru", drift_limit=0)) is SEED_NOISE["tiny"]
    for k, v in (("lr", 1e-3), ("epochs", "3"), ("n_test", 64), ("eval_repeats", 2), ("scoring", "paper")):
        assert noise(dict(tiny, **{k: v})) is None, k
    assert noise(rhos=(0.2,)) is None and noise(rhos=(0.5, 0.2)) is None
    assert noise(custom=True) is None  # --data, --model or --tasks
    assert noise(threads=2) is None and noise(device="NVIDIA H100", gpus=1) is None and noise(engine="vllm") is None
    assert noise(code=measured_code - 1) is None  # other kernels or another base build: measured on neither
    assert measured_code == NUMERICS or noise(code=NUMERICS) is None  # this code's runs: not before re-measuring
    import data.metrics
    monkeypatch.setattr(data.metrics, "RULES", data.metrics.RULES + 1)
    assert noise() is None  # other scoring rules: other scores, other OPR-RU buffers
    monkeypatch.undo()
    assert noise(base_sha="0" * 64) is None and noise(base_sha=None) is None  # another base: another testbed
    assert noise(cpu=dict(pins={}, model="another CPU")) is SEED_NOISE["tiny"]  # its rounding: like another seed
    assert preset_seed_noise("smollm2", PRESETS["smollm2"], asdict(PRESETS["smollm2"]), [0.2], False, cpu,
                             "native", measured_base) is None  # not measured
    import data.embedded
    assert SEED_NOISE["tiny"]["setting"]["benchmark"] == data.embedded.VERSION  # re-measure when the data changes
    assert SEED_NOISE["tiny"]["setting"]["rules"] == data.metrics.RULES  # ... or the scoring rules
    # the table covers the default's methods, and every paired difference the report draws for them
    assert set(SEED_NOISE["tiny"]["std"]) == set(PRESETS["tiny"].methods.split(","))
    for ref in ("replay", "sft"):
        assert set(SEED_NOISE["tiny"]["delta_std"][ref]) == set(SEED_NOISE["tiny"]["std"]) - {ref}


