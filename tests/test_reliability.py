"""Failure behaviour of the five scripts, as a user meets it: every case is a real subprocess.

- bad input (a table of cases across train/rollout/score/evaluate/run): non-zero exit, one error line that names
  the offending file or flag, no Python traceback, and the working directory exactly as it was (no output, no
  temp file, no empty run directory, a foreign file or directory untouched)
- a write that fails (a full disk, a read-only location) names the file and leaves nothing; --debug shows the
  traceback; --help works for every script
Validation failures are reached before any model loads, so the table costs about a Python start-up per case.
The world they run in (a random tiny Llama, a 2-task data root, a rollout file): tiny.make_env, fixture tiny_env.
Elsewhere: train.py's output, resume and SIGTERM cases in test_train.py; run.py's failed steps and killed or
concurrent drivers in test_run.py; strict JSON and stale temporaries in test_outputs.py; a bad prediction record
read back in test_collect.py.
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

import forkserver
from tiny import REPO, foreign_dir, foreign_file, run, run_args, score_args


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
    # --- issue 64, classes 3 and 5: the user's input overwritten; inputs accepted that cannot be right -------------
    ("train-out-is-model", "train", lambda env, tmp: (
        train_args(env, tmp, model=copy_ckpt(env, tmp))[:-3] + ["--out", tmp / "ck", "--quiet"],
        f"--out {tmp / 'ck'}: is --model's checkpoint")),
    ("score-positive-logprob", "score", lambda env, tmp: (score_args(env, tmp, "--scorer", "sc", rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "prompt": "p", "response": "A", "logprobs": [-1, 0.5]}\n')),
        str(tmp / "r.jsonl") + ": record 0 (line 1): field 'logprobs' holds 0.5; log-probs must be finite numbers <= 0")),
    ("score-token-logprob-lengths", "score", lambda env, tmp: (score_args(env, tmp, "--scorer", "sc", rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "prompt": "p", "response": "A", "token_ids": [5, 6, 7], '
                        '"logprobs": [-1, -2]}\n')),
        str(tmp / "r.jsonl") + ": record 0 (line 1): 3 token_ids but 2 logprobs")),
    ("score-duplicate-idx", "score", lambda env, tmp: (score_args(env, tmp, "--scorer", "sc", rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "prompt": "p", "response": "A", "logprobs": [-1]}\n' * 2)),
        str(tmp / "r.jsonl") + ": record 1 (line 2): task 'FOMC' idx 0 again (first at ")),
    ("score-duplicate-json-key", "score", lambda env, tmp: (score_args(env, tmp, "--scorer", "sc", rollouts=write(
        tmp, "r.jsonl", '{"task": "FOMC", "idx": 0, "idx": 1, "prompt": "p", "response": "A", "logprobs": [-1]}\n')),
        str(tmp / "r.jsonl") + ": record 0 (line 1): key 'idx' appears twice in one object")),
    ("run-config-duplicate-key", "run", lambda env, tmp: (
        run_args(env, tmp, "--config", write(tmp, "exp.yaml", "lr: 1.0e-4\nlr: 2.0e-4\n")),
        f"--config {tmp / 'exp.yaml'}: not valid YAML: key 'lr' appears twice")),
    ("run-config-two-spellings", "run", lambda env, tmp: (
        run_args(env, tmp, "--config", write(tmp, "exp.yaml", "lr-schedule: linear\nlr_schedule: cosine\n")),
        f"{tmp / 'exp.yaml'}: 'lr_schedule' and 'lr-schedule' are the same setting; keep one")),
    ("train-data-fifo", "train", lambda env, tmp: (
        train_args(env, tmp, data=(os.mkfifo(tmp / "d.jsonl"), tmp / "d.jsonl")[1]),
        f"{tmp / 'd.jsonl'}: is a named pipe (FIFO or process substitution), not a regular file")),
    # --- drift.py follows the same rules ---------------------------------------------------------------------------
    flag("drift", drift_args, "--limit", "-1"),
    flag("drift", drift_args, "--max-new-tokens", "0"),
    flag("drift", drift_args, "--tasks", "NoSuchTask"),
    ("drift-missing-ckpt", "drift", lambda env, tmp: (drift_args(env, tmp, ckpt=tmp / "nope"), str(tmp / "nope"))),
    ("drift-out-foreign-dir", "drift", lambda env, tmp: (
        drift_args(env, tmp)[:-3] + ["--out", foreign_dir(tmp), "--quiet"], str(tmp / "mine"))),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_in_one_line_and_leaves_nothing(tiny_env, tmp_path, case):
    _, script, make = case
    work = tmp_path / "w"
    work.mkdir()
    argv, named = make(tiny_env, work)
    before = snapshot(work)
    r = run(T[script], argv, tiny_env)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and named in errors[0], r.stderr[-3000:]
    assert snapshot(work) == before, "the failed run changed or left files behind"


def test_gpus_without_cuda_devices_is_refused(tiny_env, tmp_path):
    """--gpus 2 where no CUDA device is visible (hidden here, so that any machine sees none) is one line naming the
    count: torchrun would otherwise train 2 CPU ranks without a word. A dry run prices the GPUs all the same."""
    hidden = dict(tiny_env, env=dict(tiny_env["env"], CUDA_VISIBLE_DEVICES=""))
    r = run("run.py", run_args(tiny_env, tmp_path, "--gpus", "2"), hidden)
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and "run.py: error: --gpus 2: needs 2 CUDA devices, 0 visible" in errors[0], r.stderr
    assert not (tmp_path / "run").exists()
    r = run("run.py", run_args(tiny_env, tmp_path, "--gpus", "2", "--dry-run"), hidden)
    assert r.returncode == 0 and not (tmp_path / "run").exists(), r.stderr[-3000:]


def test_debug_shows_the_traceback(tiny_env, tmp_path):
    r = run("score.py", ["--rollouts", tmp_path / "nope.jsonl", "--debug"], tiny_env)
    assert r.returncode != 0 and "Traceback" in r.stderr and str(tmp_path / "nope.jsonl") in r.stderr


def test_write_errors_name_the_file(tiny_env, tmp_path):
    """Disk full stands in as the file-size limit (EFBIG on write, like ENOSPC a write error without a file name);
    the atomic write leaves no temp file."""
    out = tmp_path / "buffer.jsonl"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    r = subprocess.run([sys.executable, str(REPO / "score.py"), *map(str, score_args(tiny_env, tmp_path)[:-1]),
                        out], cwd=REPO, env=tiny_env["env"], capture_output=True, text=True, preexec_fn=limit,
                       timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"score.py: error: {out}: File too large" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_while_saving_a_checkpoint_names_the_file(tiny_env, tmp_path):
    """The weights (3.6 MB) hit the file-size limit (EFBIG: like ENOSPC, a write error safetensors reported as an
    'unreadable safetensors file' naming no path); the logs before them fit."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, train_args(tiny_env, tmp_path)),
                        "--epochs", "1", "--global-batch", "2", "--max-len", "128"], cwd=REPO, env=tiny_env["env"],
                       capture_output=True, text=True, preexec_fn=limit, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line, = [l for l in r.stderr.splitlines() if "error" in l]
    assert "model.safetensors: File too large" in line and f"{tmp_path}/.out.tmp-" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.partial"]


def test_a_full_disk_while_saving_the_resumable_state_is_one_line_and_keeps_no_half(tiny_env, tmp_path):
    """Issue 64, class 4: the state (dcp shards, then progress.pt) hits the file-size limit at its first save: torch
    reports a short write as 'unexpected pos' inside a CheckpointException, no path. One line naming the state and
    what to do; no half-written state.tmp left for a --resume to trip on."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 19, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, train_args(tiny_env, tmp_path)),
                        "--epochs", "1", "--global-batch", "2", "--max-len", "128", "--save-every", "1"], cwd=REPO,
                       env=tiny_env["env"], capture_output=True, text=True, preexec_fn=limit, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"train.py: error: {tmp_path / 'out.partial' / 'state.tmp'}: cannot write the training "
                           f"state (") and line.endswith("make room and re-run with --resume"), line
    assert not (tmp_path / "out.partial" / "state.tmp").exists() and not (tmp_path / "out").exists()


def test_a_damaged_saved_state_is_one_line_on_resume(tiny_env, tmp_path):
    """Issue 64, class 4: a shard of the saved state truncated (or progress.pt) since the save: --resume says which
    state cannot be read and what to do, not a traceback."""
    args = [*map(str, train_args(tiny_env, tmp_path)), "--epochs", "1", "--global-batch", "2", "--max-len", "128",
            "--save-every", "1", "--resume"]
    progress = tmp_path / "out.partial" / "state" / "progress.pt"
    p = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=tiny_env["env"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not progress.exists() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    p.kill()
    p.wait()
    assert progress.exists()
    state = tmp_path / "out.partial" / "state"
    for victim in (sorted(state.glob("*.distcp"))[0], state / "progress.pt"):
        victim.write_bytes(victim.read_bytes()[:100])
        r = forkserver.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO,
                           env=tiny_env["env"], capture_output=True, text=True, timeout=600)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        line = r.stderr.strip().splitlines()[-1]
        assert "the saved training state cannot be read (" in line and line.endswith(
            "drop --resume to start over (or restore the state)"), line


def test_a_report_that_cannot_be_written_names_the_file(tmp_path):
    """Issue 64, class 4: matplotlib's and Python's write errors on a full disk name no file; report.py names the
    figure or report.md it was writing, and leaves the earlier report and no temporary behind."""
    from report import write_report
    results = {"tasks": ["A", "B"], "methods": {m: {"seeds": {"0": {"matrix": [[50.0], [40.0, 60.0]]}}}
                                                for m in ("sft", "replay")}, "meta": {}}
    write_report(results, tmp_path)
    before = (tmp_path / "report.md").read_text()

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    (tmp_path / "results.json").write_text(json.dumps(results))
    r = subprocess.run([sys.executable, str(REPO / "report.py"), str(tmp_path)], cwd=REPO, capture_output=True,
                       text=True, preexec_fn=limit, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().startswith(f"report.py: error: {tmp_path}/fig_") and r.stderr.strip(
        ).endswith(".png: File too large"), r.stderr[-2000:]
    assert (tmp_path / "report.md").read_text() == before and not list(tmp_path.glob(".report-*"))


def test_run_py_on_a_full_disk_names_the_lock_and_leaves_nothing(tiny_env, tmp_path):
    def limit():  # not a byte may be written: the first write is run.lock's pid
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    r = subprocess.run([sys.executable, str(REPO / "run.py"), *map(str, run_args(tiny_env, tmp_path))], cwd=REPO,
                       env=tiny_env["env"], capture_output=True, text=True, preexec_fn=limit, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"run.py: error: {tmp_path / 'run' / 'run.lock'}: File too large" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_full_cache_disk_names_the_file_and_leaves_nothing(tiny_env, tmp_path):
    """The embedded benchmark built into a cache that fills up: one line naming the file (the write error itself
    names none), no hidden folder left to fail every retry, and a retry with room builds it."""
    cache = tmp_path / "cache"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    cmd = [sys.executable, str(REPO / "run.py"), "--model", tiny_env["base"], "--quiet", "--dry-run", "--out",
           tmp_path / "run"]
    e = dict(tiny_env["env"], OPR_CACHE=str(cache))
    r = subprocess.run(list(map(str, cmd)), cwd=REPO, env=e, capture_output=True, text=True, preexec_fn=limit,
                       timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"run.py: error: {cache}/.embedded-" in r.stderr and ".json: File too large" in r.stderr, r.stderr
    assert list(cache.iterdir()) == []
    r = forkserver.run(list(map(str, cmd)), cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and [p.name for p in cache.iterdir()][0].startswith("embedded-"), r.stderr[-3000:]


@pytest.mark.skipif(not Path("/sys").is_dir(), reason="needs a /sys to stand in for a read-only location")
def test_unwritable_output_is_one_line(tiny_env):
    out = Path("/sys/opr-reliability-test/buffer.jsonl")
    r = run("score.py", score_args(tiny_env, Path("/unused"))[:-1] + [out], tiny_env)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "/sys/opr-reliability-test" in r.stderr, r.stderr


@pytest.mark.parametrize("script", ["run.py", "train.py", "rollout.py", "score.py", "evaluate.py", "drift.py",
                                    "buffer_nll.py", "report.py", "plan.py"])
def test_help_works(script):
    """--help is the first thing a new user runs: it must print the usage and exit 0 (a '%' in a help string once
    made run.py --help a traceback)."""
    r = forkserver.run([sys.executable, str(REPO / script), "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage:") and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_opr_cache_naming_a_file_is_one_line(tiny_env, tmp_path):
    """$OPR_CACHE names the cache directory: a file there is said to be one (it was "File exists")."""
    (tmp_path / "cache").write_text("")
    r = run(T["run"], ["--dry-run", "--out", tmp_path / "run"], dict(tiny_env, env={**tiny_env["env"],
                                                                                  "OPR_CACHE": str(tmp_path / "cache")}))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (f"run.py: error: $OPR_CACHE={tmp_path / 'cache'}: is a file, not a directory: the "
                                f"cache of generated data and base models needs a directory (set OPR_CACHE to one)")


def test_run_py_says_which_test_prompts_the_evaluations_left_out(tmp_path, capsys):
    """evaluate.py drops test prompts over --max-len (training's rule) and says so in its step's log; run.py says it
    on the terminal, from row 0's scores.json (row 0 evaluates every task)."""
    import run

    class Pipe:
        def dir(self, key):
            return tmp_path / key
    (tmp_path / "s0-eval" / "eval").mkdir(parents=True)
    (tmp_path / "s0-eval" / "eval" / "scores.json").write_text(json.dumps(
        {"dropped_overlong": {"FOMC": 0, "MeetingBank": 7, "Py150": 2}}))
    run.dropped_line(Pipe(), {0: "s0-eval"}, 512)
    assert capsys.readouterr().out == ("run.py: test prompts over --max-len 512 tokens (with their gold answer) are "
                                       "left out of every evaluation: MeetingBank 7, Py150 2\n")
    (tmp_path / "s0-eval" / "eval" / "scores.json").write_text(json.dumps({"dropped_overlong": {"FOMC": 0}}))
    run.dropped_line(Pipe(), {0: "s0-eval"}, 512)
    assert capsys.readouterr().out == ""


def test_a_symlink_loop_as_manifest_or_data_root_is_one_line(tiny_env, tmp_path):
    """Issue 64, class 6: pathlib's resolve() raised RuntimeError on a loop (a traceback); a looping ROOT/tasks.json
    was taken for no manifest (TRACE's tasks, then 'file not found')."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "tasks.json").symlink_to(tmp_path / "a")
    for flags, line in [(["--task-spec", tmp_path / "a"], f"{tmp_path / 'a'}: a symlink loop (the link leads back "
                                                           f"to itself): fix or remove it"),
                        (["--data", tmp_path / "a"], f"{tmp_path / 'a'}: a symlink loop"),
                        (["--data", tmp_path / "root"], f"{tmp_path / 'root' / 'tasks.json'}: a symlink to nothing "
                                                        f"(a loop, or its target is gone)")]:
        r = run("run.py", ["--model", tiny_env["base"], *flags, "--dry-run"], tiny_env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].startswith(f"run.py: error: {line}"), r.stderr[-500:]
