"""Failure behaviour of the five scripts, as a user meets it: every case is a real subprocess.

- bad input (a table of cases across train/rollout/score/evaluate/run): non-zero exit, one error line that names
  the offending file or flag, no Python traceback, and the working directory exactly as it was (no output, no
  temp file, no empty run directory, a foreign file or directory untouched)
- data loss: --out never replaces what the script did not write itself, unless --overwrite
- resume after the final checkpoint: train.py --resume says so instead of retraining
- run.py: a failed step is reported in one line with its log; killing only the driver (SIGKILL, SIGTERM, SIGINT,
  SIGHUP) kills its steps too, and it exits 128 + the signal; a second driver on a directory in use is refused
Validation failures are reached before any model loads, so the table costs about a Python start-up per case.
"""
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.outputs import write_jsonl

REPO = Path(__file__).resolve().parents[1]
TASKS = ("C-STANCE", "FOMC")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("rel"))


def make_env(root: Path) -> dict:
    """A random tiny Llama and a 2-task TRACE-layout data root (4 train / 4 test examples per task) under root,
    a rollout file, and the environment the scripts run with."""
    from model.base import write_random_tiny
    write_random_tiny(root / "base")
    for t in TASKS:
        for split in ("train", "test"):
            recs = [{"prompt": f"{t} statement {i}: the cat sat. Answer A or B.", "answer": "AB"[i % 2]}
                    for i in range(4)]
            (root / "data" / t).mkdir(parents=True, exist_ok=True)
            (root / "data" / t / f"{split}.json").write_text(json.dumps(recs))
    rollouts = [{"task": "FOMC", "idx": i, "prompt": f"FOMC statement {i}: the cat sat. Answer A or B.",
                 "response": "A", "token_ids": [5, 6], "logprobs": [-0.5, -0.1], "finish_reason": "stop"}
                for i in range(4)]
    write_jsonl(root / "rollouts.jsonl", rollouts)
    e = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"))
    e.pop("OPR_DEBUG", None)
    return dict(base=root / "base", data=root / "data", rollouts=root / "rollouts.jsonl", env=e)


def run(script: str, args, env, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd, env=env["env"],
                          capture_output=True, text=True, timeout=600, **kw)


def snapshot(d: Path) -> dict:
    """Every path under d with its content digest (directories: None)."""
    return {str(p.relative_to(d)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


def copy_ckpt(env, tmp: Path) -> Path:
    ck = tmp / "ck"
    shutil.copytree(env["base"], ck)
    return ck


def copy_data(env, tmp: Path) -> Path:
    d = tmp / "trace"
    shutil.copytree(env["data"], d)
    return d


def foreign_dir(tmp: Path) -> Path:
    d = tmp / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("my notes")
    return d


def foreign_file(tmp: Path) -> Path:
    f = tmp / "mine.jsonl"
    f.write_text('{"prompt": "mine", "answer": "mine"}\n')
    return f


def write(tmp: Path, name: str, data: bytes | str) -> Path:
    p = tmp / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def truncated_ckpt(env, tmp: Path) -> Path:
    ck = copy_ckpt(env, tmp)
    w = ck / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    return ck


def edited_config(env, tmp: Path, **changes) -> Path:
    ck = copy_ckpt(env, tmp)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(changes)
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def nan_ckpt(env, tmp: Path, value=float("nan")) -> Path:
    from safetensors.torch import load_file, save_file
    ck = copy_ckpt(env, tmp)
    w = load_file(ck / "model.safetensors")
    w["model.layers.0.mlp.up_proj.weight"][0, 0] = value
    save_file(w, ck / "model.safetensors", metadata={"format": "pt"})
    return ck


def symlink_loop(tmp: Path) -> Path:
    (tmp / "loop").symlink_to(tmp / "loop2")
    (tmp / "loop2").symlink_to(tmp / "loop")
    return tmp / "loop"


def no_file(env, tmp, path_in_ckpt) -> Path:
    ck = copy_ckpt(env, tmp)
    (ck / path_in_ckpt).unlink()
    return ck


def beside(d: Path, src: str, dst: str) -> Path:
    """d with a copy of its file src at dst too (test.json and test.jsonl side by side)."""
    recs = json.loads((d / src).read_text())
    (d / dst).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def empty_answer(d: Path, file: str, i: int) -> Path:
    """d with record i of its JSON list file emptied of its answer."""
    recs = json.loads((d / file).read_text())
    recs[i]["answer"] = ""
    (d / file).write_text(json.dumps(recs))
    return d


# Each case: (id, script, args(env, tmp) -> (argv, named)) where `named` must appear in stderr (a path or a flag).
B, D, R = "base", "data", "rollouts"
T = dict(train="train.py", rollout="rollout.py", score="score.py", evaluate="evaluate.py", run="run.py",
         drift="drift.py")


def train_args(env, tmp, *extra, data=None, model=None):
    return ["--model", model or env["base"], "--data", data or env["data"] / "C-STANCE" / "train.json",
            "--out", tmp / "out", "--quiet", *extra]


def gen_args(env, tmp, *extra, ckpt=None, data=None):
    return ["--ckpt", ckpt or env["base"], "--data", data or env["data"], "--out", tmp / "out", "--quiet", *extra]


def drift_args(env, tmp, *extra, ckpt=None):
    return ["--ckpt", ckpt or env["base"], "--ref", env["base"], "--data", env["data"], "--out", tmp / "out",
            "--quiet", *extra]


def score_args(env, tmp, *extra, rollouts=None):
    return ["--rollouts", rollouts or env["rollouts"], "--data", env["data"], "--budget", "2", "--out",
            tmp / "out.jsonl", *extra]


def run_args(env, tmp, *extra, model=None, data=None):
    return ["--model", model or env["base"], "--data", data or env["data"], "--tasks", ",".join(TASKS),
            "--methods", "sft", "--epochs", "1", "--global-batch", "2", "--max-new-tokens", "2", "--quiet",
            "--out", tmp / "run", *extra]


def flag(script, fn, f, value):
    return (f"{script}{f}={value}", script, lambda env, tmp: (fn(env, tmp, f, value), f))


def bad_data_file(name, content, expect):
    def make(env, tmp):
        p = write(tmp, name, content)
        return train_args(env, tmp, data=p), str(p) + expect
    return make


CASES = [
    # --- flags out of range or of the wrong type: argparse names the flag -----------------------------------------
    flag("train", train_args, "--epochs", "0"),
    flag("train", train_args, "--global-batch", "0"),
    flag("train", train_args, "--global-batch", "x"),
    flag("train", train_args, "--lr", "-1"),
    flag("train", train_args, "--lr", "nan"),
    flag("train", train_args, "--micro-tokens", "0"),
    flag("train", train_args, "--max-len", "0"),
    flag("train", train_args, "--sft-kl-ema", "2"),
    flag("train", train_args, "--max-steps", "0"),
    flag("rollout", gen_args, "--limit", "0"),
    flag("rollout", gen_args, "--max-new-tokens", "0"),
    flag("rollout", gen_args, "--temperature", "-1"),
    flag("rollout", gen_args, "--batch-size", "0"),
    flag("rollout", gen_args, "--tasks", "FOMC,Nope"),
    flag("evaluate", gen_args, "--limit", "0"),
    flag("evaluate", gen_args, "--repeats", "0"),
    flag("evaluate", gen_args, "--tp", "0"),
    flag("score", score_args, "--rho", "5"),
    flag("score", score_args, "--rho", "0"),
    flag("score", score_args, "--n", "0"),
    flag("score", score_args, "--budget", "-1"),
    ("score--task-budgets-twice", "score", lambda env, tmp: (
        [a for a in score_args(env, tmp) if a not in ("--budget", "2")] + ["--task-budgets", "FOMC=1,FOMC=2"],
        "--task-budgets: task 'FOMC' appears twice")),
    flag("run", run_args, "--global-batch", "0"),
    flag("run", run_args, "--max-new-tokens", "0"),
    flag("run", run_args, "--rho", "5"),
    flag("run", run_args, "--rho", "0.1,x"),
    flag("run", run_args, "--epochs", "0"),
    flag("run", run_args, "--seeds", "a"),
    flag("run", run_args, "--jobs", "0"),
    flag("run", run_args, "--eval-limit", "0"),
    flag("run", run_args, "--seeds", "0,0"),
    flag("run", run_args, "--rho", "0.1,0.10"),
    ("run--methods-twice", "run", lambda env, tmp: (run_args(env, tmp) + ["--methods", "sft,sft"], "--methods")),
    ("run--methods", "run", lambda env, tmp: (run_args(env, tmp) + ["--methods", "sft,nope"], "--methods")),
    ("run--epochs-count", "run", lambda env, tmp: (run_args(env, tmp) + ["--epochs", "1,2,3"], "--epochs")),
    # --- bad input files: the file (and record / field) is named -------------------------------------------------
    ("train-missing-data", "train", lambda env, tmp: (train_args(env, tmp, data=tmp / "nope.jsonl"),
                                                      str(tmp / "nope.jsonl"))),
    ("train-non-utf8", "train", bad_data_file("d.jsonl", b'{"prompt": "\xff\xfe", "response": "x"}\n', ": not UTF-8")),
    ("train-json-object", "train", bad_data_file("d.json", '{"prompt": "a", "answer": "b"}', ": holds a single")),
    ("train-missing-field", "train", bad_data_file("d.jsonl", '{"prompt": "a"}\n', ": record 0 (line 1)")),
    ("train-not-objects", "train", bad_data_file("d.json", '["a", "b"]', ": record 0")),
    ("train-empty-file", "train", bad_data_file("d.jsonl", "", ": file is empty")),
    ("train-bad-json", "train", bad_data_file("d.json", '[{"prompt": "a", "answer": "b"},', ": malformed JSON")),
    ("train-no-config", "train", lambda env, tmp: (train_args(env, tmp, model=no_file(env, tmp, "config.json")),
                                                   str(tmp / "ck" / "config.json"))),
    ("train-truncated-weights", "train", lambda env, tmp: (train_args(env, tmp, model=truncated_ckpt(env, tmp)),
                                                           str(tmp / "ck" / "model.safetensors"))),
    ("train-unsupported-model", "train", lambda env, tmp: (
        train_args(env, tmp, model=edited_config(env, tmp, model_type="gpt2")), str(tmp / "ck" / "config.json"))),
    ("train-config-non-utf8", "train", lambda env, tmp: (
        train_args(env, tmp, model=(lambda ck: (write(ck, "config.json", b"\xff{}"), ck)[1])(copy_ckpt(env, tmp))),
        str(tmp / "ck" / "config.json"))),
    ("train-config-wrong-type", "train", lambda env, tmp: (
        train_args(env, tmp, model=edited_config(env, tmp, hidden_size="abc")),
        str(tmp / "ck" / "config.json") + ": hidden_size must be a positive integer")),
    ("rollout-config-negative", "rollout", lambda env, tmp: (
        gen_args(env, tmp, ckpt=edited_config(env, tmp, num_hidden_layers=-1)),
        str(tmp / "ck" / "config.json") + ": num_hidden_layers")),
    ("evaluate-config-heads-do-not-divide", "evaluate", lambda env, tmp: (
        gen_args(env, tmp, ckpt=edited_config(env, tmp, num_attention_heads=3, num_key_value_heads=3, head_dim=None)),
        str(tmp / "ck" / "config.json") + ": hidden_size 128 is not a multiple of num_attention_heads 3")),
    ("drift-config-nan-eps", "drift", lambda env, tmp: (
        drift_args(env, tmp, ckpt=edited_config(env, tmp, rms_norm_eps=float("nan"))), "rms_norm_eps")),
    ("train-config-vs-weights", "train", lambda env, tmp: (
        train_args(env, tmp, model=edited_config(env, tmp, intermediate_size=100)),
        "'model.layers.0.mlp.gate_proj.weight' has shape (384, 128), expected (100, 128)")),
    ("rollout-tokenizer-beyond-vocab", "rollout", lambda env, tmp: (
        gen_args(env, tmp, ckpt=edited_config(env, tmp, vocab_size=100)),
        str(tmp / "ck" / "tokenizer.json") + ": token ids reach")),
    ("train-template-fails", "train", lambda env, tmp: (
        train_args(env, tmp, model=(lambda ck: (write(ck, "chat_template.jinja", "{{ raise_exception('no') }}"),
                                                ck)[1])(copy_ckpt(env, tmp))),
        str(tmp / "ck" / "chat_template.jinja") + ": the chat template fails on a probe")),
    ("rollout-no-tokenizer", "rollout", lambda env, tmp: (gen_args(env, tmp, ckpt=no_file(env, tmp, "tokenizer.json")),
                                                          "tokenizer.json")),
    ("rollout-truncated-weights", "rollout", lambda env, tmp: (gen_args(env, tmp, ckpt=truncated_ckpt(env, tmp)),
                                                               str(tmp / "ck" / "model.safetensors"))),
    ("rollout-ckpt-is-a-file", "rollout", lambda env, tmp: (
        gen_args(env, tmp, ckpt=write(tmp, "some_file.json", "{}")), str(tmp / "some_file.json") + ": is a file")),
    ("rollout-ckpt-symlink-loop", "rollout", lambda env, tmp: (
        gen_args(env, tmp, ckpt=symlink_loop(tmp)), "Too many levels of symbolic links")),
    ("train-data-symlink-loop", "train", lambda env, tmp: (
        train_args(env, tmp, data=symlink_loop(tmp)), str(tmp / "loop") + ": Too many levels of symbolic links")),
    ("rollout-missing-ckpt", "rollout", lambda env, tmp: (gen_args(env, tmp, ckpt=tmp / "nope"), str(tmp / "nope"))),
    ("rollout-not-a-trace-root", "rollout", lambda env, tmp: (gen_args(env, tmp, data=tmp), str(tmp))),
    ("rollout-bad-train-json", "rollout", lambda env, tmp: (
        gen_args(env, tmp, data=(lambda d: (write(d / "FOMC", "train.json", "[{]"), d)[1])(copy_data(env, tmp))),
        str(tmp / "trace" / "FOMC" / "train.json"))),
    ("evaluate-non-utf8-test", "evaluate", lambda env, tmp: (
        gen_args(env, tmp, data=(lambda d: (write(d / "FOMC", "test.json", b"[\xff]"), d)[1])(copy_data(env, tmp))),
        str(tmp / "trace" / "FOMC" / "test.json"))),
    ("evaluate-truncated-weights", "evaluate", lambda env, tmp: (gen_args(env, tmp, ckpt=truncated_ckpt(env, tmp)),
                                                                 str(tmp / "ck" / "model.safetensors"))),
    ("score-missing-rollouts", "score", lambda env, tmp: (score_args(env, tmp, rollouts=tmp / "r.jsonl"),
                                                          str(tmp / "r.jsonl"))),
    ("score-json-object", "score", lambda env, tmp: (
        score_args(env, tmp, rollouts=write(tmp, "r.json", '{"task": "FOMC"}')), str(tmp / "r.json"))),
    ("score-bad-logprobs", "score", lambda env, tmp: (score_args(env, tmp, rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "prompt": "p", "response": "A", "logprobs": ["x"]}\n')),
        str(tmp / "r.jsonl") + ": record 0 (line 1): field 'logprobs'")),
    ("score-inf-logprob", "score", lambda env, tmp: (score_args(env, tmp, "--scorer", "sc", rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "prompt": "p", "response": "A", "logprobs": [Infinity]}\n')),
        str(tmp / "r.jsonl") + ": record 0 (line 1): field 'logprobs[0]': Infinity is not a number")),
    ("score-nan-logprob", "score", lambda env, tmp: (score_args(env, tmp, "--scorer", "sc", rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "prompt": "p", "response": "A", "logprobs": [-1, NaN]}\n')),
        str(tmp / "r.jsonl") + ": record 0 (line 1): field 'logprobs[1]': NaN is not a number")),
    ("rollout-nan-weights", "rollout", lambda env, tmp: (gen_args(env, tmp, ckpt=nan_ckpt(env, tmp)),
                                                         "'model.layers.0.mlp.up_proj.weight' holds NaN")),
    ("evaluate-inf-weights", "evaluate", lambda env, tmp: (
        gen_args(env, tmp, ckpt=nan_ckpt(env, tmp, float("inf"))), "'model.layers.0.mlp.up_proj.weight' holds inf")),
    ("train-nan-weights", "train", lambda env, tmp: (train_args(env, tmp, model=nan_ckpt(env, tmp)),
                                                     str(tmp / "ck" / "model.safetensors") + ": weight")),
    ("score-unknown-task", "score", lambda env, tmp: (score_args(env, tmp, rollouts=write(
        tmp, "r.jsonl", '{"task": "Nope", "idx": 0, "prompt": "p", "response": "A", "logprobs": []}\n')),
        str(tmp / "r.jsonl"))),
    ("run-missing-test-json", "run", lambda env, tmp: (
        run_args(env, tmp, data=(lambda d: ((d / "FOMC" / "test.json").unlink(), d)[1])(copy_data(env, tmp))),
        str(tmp / "trace" / "FOMC" / "test.json"))),
    ("run-truncated-weights", "run", lambda env, tmp: (run_args(env, tmp, model=truncated_ckpt(env, tmp)),
                                                       str(tmp / "ck" / "model.safetensors"))),
    ("run-no-tokenizer", "run", lambda env, tmp: (run_args(env, tmp, model=no_file(env, tmp, "tokenizer.json")),
                                                  "tokenizer.json")),
    # --- issue 50, class 7: what was silent or unclear --------------------------------------------------------------
    ("run--n-train-beyond-the-embedded-benchmark", "run", lambda env, tmp: (
        ["--model", env["base"], "--n-train", "5000", "--quiet", "--out", tmp / "run"], "--n-train 5000, --n-test ")),
    ("run-test-json-and-jsonl", "run", lambda env, tmp: (  # which one was read depended on nothing the user chose
        run_args(env, tmp, data=beside(copy_data(env, tmp), "FOMC/test.json", "FOMC/test.jsonl")),
        f"{tmp / 'trace' / 'FOMC' / 'test.json'} and {tmp / 'trace' / 'FOMC' / 'test.jsonl'}: 2 files hold the test")),
    ("train-blank-answer", "train", bad_data_file("d.jsonl", '{"prompt": "a", "answer": " \\n"}\n',
                                                  ": record 0 (line 1): field 'answer' is only whitespace")),
    ("evaluate-empty-gold-answer", "evaluate", lambda env, tmp: (
        gen_args(env, tmp, data=empty_answer(copy_data(env, tmp), "FOMC/test.json", 2)),
        f"{tmp / 'trace' / 'FOMC' / 'test.json'}: record 2: field 'answer' is empty")),
    ("run-empty-gold-answer", "run", lambda env, tmp: (
        run_args(env, tmp, data=empty_answer(copy_data(env, tmp), "C-STANCE/train.json", 0)),
        f"{tmp / 'trace' / 'C-STANCE' / 'train.json'}: record 0: field 'answer' is empty")),
    # --- outputs that are not the script's own: refused, left as they were -------------------------------------
    ("train-out-foreign-dir", "train", lambda env, tmp: (
        train_args(env, tmp)[:-3] + ["--out", foreign_dir(tmp), "--quiet"], str(tmp / "mine"))),
    ("train-out-foreign-file", "train", lambda env, tmp: (
        train_args(env, tmp)[:-3] + ["--out", foreign_file(tmp), "--quiet"], str(tmp / "mine.jsonl"))),
    ("rollout-out-foreign-file", "rollout", lambda env, tmp: (
        gen_args(env, tmp)[:-3] + ["--out", foreign_file(tmp)], str(tmp / "mine.jsonl"))),
    ("rollout-out-is-dir", "rollout", lambda env, tmp: (
        gen_args(env, tmp)[:-3] + ["--out", foreign_dir(tmp)], str(tmp / "mine"))),
    ("evaluate-out-foreign-dir", "evaluate", lambda env, tmp: (
        gen_args(env, tmp)[:-3] + ["--out", foreign_dir(tmp)], str(tmp / "mine"))),
    ("score-out-foreign-file", "score", lambda env, tmp: (
        score_args(env, tmp)[:-1] + [foreign_file(tmp)], str(tmp / "mine.jsonl"))),
    ("run-out-foreign-dir", "run", lambda env, tmp: (run_args(env, tmp)[:-1] + [foreign_dir(tmp)], str(tmp / "mine"))),
    # --- drift.py follows the same rules ---------------------------------------------------------------------------
    flag("drift", drift_args, "--limit", "-1"),
    flag("drift", drift_args, "--max-new-tokens", "0"),
    flag("drift", drift_args, "--tasks", "NoSuchTask"),
    ("drift-missing-ckpt", "drift", lambda env, tmp: (drift_args(env, tmp, ckpt=tmp / "nope"), str(tmp / "nope"))),
    ("drift-out-foreign-dir", "drift", lambda env, tmp: (
        drift_args(env, tmp)[:-3] + ["--out", foreign_dir(tmp), "--quiet"], str(tmp / "mine"))),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_and_leaves_nothing(env, tmp_path, case):
    _, script, make = case
    work = tmp_path / "w"
    work.mkdir()
    argv, named = make(env, work)
    before = snapshot(work)
    r = run(T[script], argv, env)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and named in errors[0], r.stderr[-3000:]
    assert snapshot(work) == before, "the failed run changed or left files behind"


def test_gpus_without_cuda_devices_is_refused(env, tmp_path):
    """--gpus 2 where no CUDA device is visible (hidden here, so that any machine sees none) is one line naming the
    count: torchrun would otherwise train 2 CPU ranks without a word. A dry run prices the GPUs all the same."""
    hidden = dict(env, env=dict(env["env"], CUDA_VISIBLE_DEVICES=""))
    r = run("run.py", run_args(env, tmp_path, "--gpus", "2"), hidden)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and "run.py: error: --gpus 2: needs 2 CUDA devices, 0 visible" in errors[0], r.stderr
    assert not (tmp_path / "run").exists()
    r = run("run.py", run_args(env, tmp_path, "--gpus", "2", "--dry-run"), hidden)
    assert r.returncode == 0 and not (tmp_path / "run").exists(), r.stderr[-3000:]


def test_debug_shows_the_traceback(env, tmp_path):
    r = run("score.py", ["--rollouts", tmp_path / "nope.jsonl", "--debug"], env)
    assert r.returncode != 0 and "Traceback" in r.stderr and str(tmp_path / "nope.jsonl") in r.stderr


def test_write_errors_name_the_file(env, tmp_path):
    """Disk full stands in as the file-size limit (EFBIG on write, like ENOSPC a write error without a file name);
    the atomic write leaves no temp file."""
    out = tmp_path / "buffer.jsonl"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    r = subprocess.run([sys.executable, str(REPO / "score.py"), *map(str, score_args(env, tmp_path)[:-1]), out],
                       cwd=REPO, env=env["env"], capture_output=True, text=True, preexec_fn=limit, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"score.py: error: {out}: File too large" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_json_outputs_are_strict_json(tmp_path):
    from data.outputs import write_json
    from data.errors import InputError
    with pytest.raises(InputError, match=r"s.json: refusing to write a non-finite number \(all.kl\[1\] is nan\)"):
        write_json(tmp_path / "s.json", {"all": {"kl": [0.5, float("nan")]}})
    with pytest.raises(InputError, match=r"b.jsonl: record 1: refusing .* \(score is -inf\)"):
        write_jsonl(tmp_path / "b.jsonl", [{"score": 1.0}, {"score": float("-inf")}])
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_saving_a_checkpoint_names_the_file(env, tmp_path):
    """The weights (3.6 MB) hit the file-size limit (EFBIG: like ENOSPC, a write error safetensors reported as an
    'unreadable safetensors file' naming no path); the logs before them fit."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, train_args(env, tmp_path)), "--epochs", "1",
                        "--global-batch", "2", "--max-len", "128"], cwd=REPO, env=env["env"], capture_output=True,
                       text=True, preexec_fn=limit, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line, = [l for l in r.stderr.splitlines() if "error" in l]
    assert "model.safetensors: File too large" in line and f"{tmp_path}/.out.tmp-" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.partial"]


def test_run_py_on_a_full_disk_names_the_lock_and_leaves_nothing(env, tmp_path):
    def limit():  # not a byte may be written: the first write is run.lock's pid
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    r = subprocess.run([sys.executable, str(REPO / "run.py"), *map(str, run_args(env, tmp_path))], cwd=REPO,
                       env=env["env"], capture_output=True, text=True, preexec_fn=limit, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"run.py: error: {tmp_path / 'run' / 'run.lock'}: File too large" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_cache_disk_names_the_file_and_leaves_nothing(env, tmp_path):
    """The embedded benchmark built into a cache that fills up: one line naming the file (the write error itself
    names none), no hidden folder left to fail every retry, and a retry with room builds it."""
    cache = tmp_path / "cache"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cmd = [sys.executable, str(REPO / "run.py"), "--model", env["base"], "--quiet", "--dry-run", "--out",
           tmp_path / "run"]
    e = dict(env["env"], OPR_CACHE=str(cache))
    r = subprocess.run(list(map(str, cmd)), cwd=REPO, env=e, capture_output=True, text=True, preexec_fn=limit,
                       timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"run.py: error: {cache}/.embedded-" in r.stderr and ".json: File too large" in r.stderr, r.stderr
    assert list(cache.iterdir()) == []
    r = subprocess.run(list(map(str, cmd)), cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and [p.name for p in cache.iterdir()][0].startswith("embedded-"), r.stderr[-3000:]


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs a /sys to stand in for a read-only location")
def test_unwritable_output_is_one_line(env):
    out = Path("/sys/opr-reliability-test/buffer.jsonl")
    r = run("score.py", score_args(env, Path("/unused"))[:-1] + [out], env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "/sys/opr-reliability-test" in r.stderr, r.stderr


# ---- data loss -------------------------------------------------------------------------------------------------------
def tiny_train(env, out, *extra):
    return run("train.py", ["--model", env["base"], "--data", env["data"] / "C-STANCE" / "train.json", "--out", out,
                            "--epochs", "1", "--global-batch", "2", "--max-len", "128", "--quiet", *extra], env)


def test_train_replaces_only_its_own_checkpoint(env, tmp_path):
    mine = foreign_dir(tmp_path)
    r = tiny_train(env, mine)
    assert r.returncode == 2 and (mine / "notes.txt").read_text() == "my notes"
    assert not (tmp_path / "mine.partial").exists()
    r = tiny_train(env, mine, "--overwrite")  # an explicit yes
    assert r.returncode == 0, r.stderr[-3000:]
    assert (mine / "train_summary.json").is_file() and not (mine / "notes.txt").exists()
    first = (mine / "model.safetensors").stat().st_ino
    r = tiny_train(env, mine, "--seed", "1")  # its own checkpoint: replaced without asking
    assert r.returncode == 0, r.stderr[-3000:]
    assert (mine / "model.safetensors").stat().st_ino != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no .old / .tmp left around

    afile = foreign_file(tmp_path)
    r = tiny_train(env, afile, "--overwrite")  # a file replaced by a checkpoint: nothing hidden left behind
    assert r.returncode == 0 and (afile / "config.json").is_file(), r.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "mine.jsonl"]


def test_work_is_bounded_by_the_data_not_by_a_flags_value(env, tmp_path):
    """A huge --epochs streams its steps (it used to build them all first, past 1 GB); a budget below one example's
    length packs each example alone, and the efficiency counts that micro-batch at its own length (was 5137.5 %)."""
    out = tmp_path / "ck"
    t = time.monotonic()
    r = tiny_train(env, out, "--epochs", "1000000000", "--max-steps", "2", "--micro-tokens", "1")
    assert r.returncode == 0 and time.monotonic() - t < 120, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["packing_efficiency"] == 1.0 and "efficiency 100.0%" in r.stdout


# ---- resume after the final checkpoint ------------------------------------------------------------------------------
def test_resume_of_a_final_checkpoint_says_so(env, tmp_path):
    out = tmp_path / "ck"
    assert tiny_train(env, out).returncode == 0
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    r = tiny_train(env, out, "--resume")
    assert r.returncode == 0 and "already the final checkpoint" in r.stdout, r.stdout + r.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp and not (tmp_path / "ck.partial").exists()
    r = tiny_train(env, out, "--resume", "--seed", "3")  # another run's settings: not silently retrained
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
from pipeline.cli import main_cli
sys.argv = ["train.py", *sys.argv[1:]]
main_cli(train.main, "train.py")
"""


def test_sigterm_during_the_final_save_leaves_no_temporary(env, tmp_path):
    out = tmp_path / "ck"
    p = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, "--model", env["base"], "--data",
                          env["data"] / "C-STANCE" / "train.json", "--out", out, "--epochs", "1", "--global-batch",
                          "2", "--max-len", "128", "--quiet"], cwd=REPO, env=env["env"], stdout=subprocess.PIPE,
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


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    from data.outputs import write_json
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = os.getppid()
    stale = [tmp_path / f".s.json.tmp-{dead}-x1.tmp", tmp_path / f".ck.tmp-{dead}-x2"]
    kept = [tmp_path / f".s.json.tmp-{live}-x3.tmp", tmp_path / f".ck.old-{dead}"]  # live; old copy, no ck yet
    for p in stale + kept:
        p.mkdir() if not p.name.endswith(".tmp") else p.write_text("half")
    write_json(tmp_path / "s.json", {})
    assert not stale[0].exists() and all(p.exists() for p in kept)
    from data.outputs import remove_stale_temporaries
    (tmp_path / "ck").mkdir()  # the swap finished: the moved-aside old copy goes too
    remove_stale_temporaries(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", "s.json", kept[0].name])


# ---- run.py: failed steps, killed drivers, concurrent drivers ------------------------------------------------------
def test_failed_step_is_one_line_with_its_log(env, tmp_path):
    r = run("run.py", run_args(env, tmp_path) + ["--launcher", f"{sys.executable} {tmp_path / 'missing.py'}"], env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line, = [l for l in r.stderr.splitlines() if "error" in l]
    assert "step s1-train-C-STANCE" in line and "missing.py" in line and len(line) < 600
    log = Path(line.rsplit("full log: ", 1)[1])
    assert log.is_file() and "missing.py" in log.read_text()


def long_run(env, out: Path, ignore=()) -> subprocess.Popen:
    """A driver whose first training step lasts minutes (the test kills it long before). It starts as a terminal's
    foreground job would, SIGINT and SIGHUP at their defaults (a pytest started with `&` by a non-interactive shell
    ignores SIGINT, and its children would inherit that: the cause of this file's SIGINT test failing in background
    runs), except the signals in `ignore` (as nohup ignores SIGHUP)."""
    argv = run_args(env, out.parent)[:-1] + [out, "--epochs", "100000"]

    def dispositions():
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)
    return subprocess.Popen([sys.executable, str(REPO / "run.py"), *map(str, argv)], cwd=REPO, env=env["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=dispositions)


def child_of(pid: int, name: str, timeout: float = 120) -> int:
    """The pid of the step running script `name` under driver `pid`: its child (`python train.py ...`, started with
    OPR_NO_ZYGOTE=1) or its grandchild through the zygote (a fork named `train.py`, pipeline/zygote.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parents, found = {}, []
        for p in Path("/proc").iterdir():
            try:
                if not p.name.isdigit():
                    continue
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if name in (p / "cmdline").read_bytes().decode(errors="replace") or \
                        (p / "comm").read_text().strip() == name:
                    found.append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
        for c in found:
            if parents.get(c) == pid or parents.get(parents.get(c)) == pid:
                return c
        time.sleep(0.1)
    raise AssertionError(f"no {name} step under {pid} appeared")


def gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, waiting to be reaped by init
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_killing_the_driver_kills_its_steps(env, tmp_path, sig):
    out = tmp_path / "run"
    driver = long_run(env, out)
    try:
        child = child_of(driver.pid, "train.py")
        time.sleep(0.5)
        os.kill(driver.pid, sig)  # the driver alone, not its process group
        try:
            driver.wait(120)  # stopping takes <= 20 s (SIGTERM, SIGKILL after 10 s); the rest is slack for load
        except subprocess.TimeoutExpired:  # say where it hangs: every thread's stack (SIGUSR1) and the processes
            os.kill(driver.pid, signal.SIGUSR1)
            time.sleep(3)
            ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,args"], capture_output=True, text=True)
            os.killpg(driver.pid, signal.SIGKILL)
            raise AssertionError(f"run.py still running 120 s after {sig.name}; its stacks:\n"
                                 f"{driver.communicate()[1][-6000:]}\nprocesses:\n{ps.stdout[-4000:]}") from None
        assert gone(child), f"train.py (pid {child}) outlived run.py killed by {sig.name}"
        err = driver.stderr.read()
        assert "Traceback" not in err, err[-3000:]
        if sig != signal.SIGKILL:  # 128 + the signal, as shells report it: not 1, a failed step's code
            assert driver.returncode == 128 + sig and len([l for l in err.splitlines() if l.strip()]) == 1, err
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux")
def test_a_driver_started_under_nohup_survives_sighup(env, tmp_path):
    driver = long_run(env, tmp_path / "run", ignore=(signal.SIGHUP,))
    try:
        child = child_of(driver.pid, "train.py")
        os.kill(driver.pid, signal.SIGHUP)
        time.sleep(3)
        assert driver.poll() is None and not gone(child, timeout=0.1)  # nohup's promise kept: both still at work
        os.kill(driver.pid, signal.SIGTERM)
        driver.wait(120)
        assert gone(child) and "stopped by SIGTERM" in driver.stderr.read() and driver.returncode == 143
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 is POSIX")
def test_sigusr1_prints_the_drivers_stacks_and_the_run_goes_on(env, tmp_path):
    driver = long_run(env, tmp_path / "run")
    try:
        child = child_of(driver.pid, "train.py")
        os.kill(driver.pid, signal.SIGUSR1)
        time.sleep(2)
        assert driver.poll() is None and not gone(child, timeout=0.1)  # both still at work
        os.kill(driver.pid, signal.SIGTERM)
        driver.wait(120)
        err = driver.stderr.read()
        assert "most recent call first" in err and "run.py" in err and "in execute" in err, err[-3000:]
        assert gone(child)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()


@pytest.mark.parametrize("zygote", [False, True])
def test_a_step_that_starts_after_the_stop_is_killed(tmp_path, zygote):
    """Ctrl-C can land while a pool thread is between picking a step and its process existing: stop_children's list
    misses that step, so it is killed the moment it appears (else the driver waits on it forever; once seen as a
    60 s timeout of the SIGINT test above under the full suite's load)."""
    sys.path.insert(0, str(REPO))
    from pipeline.zygote import Zygote
    from pipeline.steps import Pipeline
    pipe = Pipeline(tmp_path / "run", 1, dict(os.environ, OMP_NUM_THREADS="1"), True, {})
    pipe.lock_run_dir()
    if zygote:
        pipe.zygote = Zygote(pipe.env, pass_fds=(pipe.lock_fd,))
    try:
        pipe.stop_children()  # nothing runs yet: from here on, every step that appears is killed
        t = time.monotonic()
        argv = [sys.executable, str(REPO / "train.py")]  # no flags: the embedded default, minutes of work
        assert pipe.call(argv, tmp_path / "log.txt") == -signal.SIGKILL
        assert time.monotonic() - t < 30 and not pipe.procs
    finally:
        if pipe.zygote is not None:
            pipe.zygote.close()


def test_a_second_driver_on_a_directory_in_use_is_refused(env, tmp_path):
    out = tmp_path / "run"
    first = long_run(env, out)
    try:
        child_of(first.pid, "train.py")
        r = run("run.py", run_args(env, tmp_path)[:-1] + [out, "--epochs", "100000"], env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"{out}: in use by another run.py (pid {first.pid})" in r.stderr
        # the first run was not disturbed: still running, still holding its lock
        assert first.poll() is None and (out / "run.lock").read_text().strip() == str(first.pid)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()


@pytest.mark.parametrize("script", ["run.py", "train.py", "rollout.py", "score.py", "evaluate.py", "drift.py",
                                    "buffer_nll.py", "report.py", "plan.py"])
def test_help_works(script):
    """--help is the first thing a new user runs: it must print the usage and exit 0 (a '%' in a help string once
    made run.py --help a traceback)."""
    r = subprocess.run([sys.executable, str(REPO / script), "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_read_eval_names_the_bad_prediction_record(tmp_path):
    """reporting.collect.read_eval reads idx, score and num_tokens of every prediction: a record without one, or with a
    string idx, is one line naming file, record and field (it was a KeyError in collect); a good file gives
    per-example scores ordered by idx, averaged over repeats."""
    from reporting.collect import read_eval
    (tmp_path / "scores.json").write_text(json.dumps({"scores": {"FOMC": 50.0}}))
    good = [{"task": "FOMC", "idx": i, "prediction": p, "gold": "A", "finish_reason": "stop", "num_tokens": 1,
             "score": s} for i, p, s in [(3, "A", 100.0), (1, "B", 0.0), (3, "B", 0)]]
    write_jsonl(tmp_path / "predictions.jsonl", good)
    scores, per_example, diag = read_eval(tmp_path, {})
    assert scores == {"FOMC": 50.0} and per_example == {"FOMC": [0.0, 50.0]} and diag["FOMC"]["n"] == 3
    for bad, field, want in [({"score": None}, "score", "missing field 'score'"),
                             ({"idx": "1"}, "idx", "field 'idx' must be int, got str")]:
        rec = {**good[1], **bad}
        if bad[field] is None:
            del rec[field]
        write_jsonl(tmp_path / "predictions.jsonl", [good[0], rec])
        with pytest.raises(ValueError) as e:
            read_eval(tmp_path, {})
        assert str(e.value) == f"{tmp_path / 'predictions.jsonl'}: record 1 (line 2): {want}"
