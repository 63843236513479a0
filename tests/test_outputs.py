"""common/outputs.py: one rule for every output the project writes -- replace nothing but an empty path or this
project's own output of the same kind, proved by its mark (issue 50, class 2). The rule on every kind, then each
script on the cases that used to pass: someone's results.json and report.md, a folder with only steps/, files named
like ours, a first line left blank, an unchecked side file."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from common.outputs import (MARK, OUTPUT_KINDS, check_output, claim_dir, is_ours, mark_path, write_json,  # noqa: E402
                            write_jsonl)
from common.errors import UserError  # noqa: E402
from tiny import REPO, TASKS, run, score_args  # noqa: E402

DIRS = [k for k, (is_dir, _) in OUTPUT_KINDS.items() if is_dir]
FILES = [k for k, (is_dir, _) in OUTPUT_KINDS.items() if not is_dir]


@pytest.mark.parametrize("kind", DIRS)
def test_a_directory_output_is_replaced_only_when_marked_as_that_kind(kind, tmp_path):
    d = tmp_path / "out"
    assert check_output(d, kind) == d  # nothing there
    d.mkdir()
    assert check_output(d, kind) == d  # empty
    (d / "results.json").write_text("{}")  # someone's files, with names this project uses too
    (d / "predictions.jsonl").write_text("")
    with pytest.raises(UserError, match="refusing to replace it"):
        check_output(d, kind)
    assert check_output(d, kind, overwrite=True) == d
    other = next(k for k in DIRS if k != kind)
    claim_dir(d, other)
    with pytest.raises(UserError):  # another kind's mark is no licence
        check_output(d, kind)
    claim_dir(d, kind)
    assert check_output(d, kind) == d and json.loads((d / MARK).read_text()) == {"kind": kind}
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UserError):  # a file where a directory goes
        check_output(f, kind)


@pytest.mark.parametrize("kind", FILES)
def test_a_file_output_is_replaced_only_when_marked(kind, tmp_path):
    f = tmp_path / "x.jsonl"
    assert check_output(f, kind) == f
    f.write_text(" \n\n")  # only whitespace: nothing to lose
    assert check_output(f, kind) == f
    f.write_text('\n{"scorer": "mine", "select": "mine", "token_ids": [], "logprobs": [], "finish_reason": "x", '
                 '"all": {}}\n')  # a first line left blank, and every field the old checks looked for
    with pytest.raises(UserError, match="not " + OUTPUT_KINDS[kind][1]):
        check_output(f, kind)
    write_jsonl(f, [{"a": 1}], kind=kind)
    assert check_output(f, kind) == f and is_ours(f, kind)
    assert json.loads(mark_path(f, is_dir=False).read_text()) == {"kind": kind}
    (tmp_path / "d").mkdir()
    with pytest.raises(UserError, match="is a directory"):  # even with --overwrite
        check_output(tmp_path / "d", kind, overwrite=True)


def test_a_failed_write_leaves_no_mark(tmp_path):
    f = tmp_path / "buffer.jsonl"
    with pytest.raises(Exception):
        write_jsonl(f, [{"x": float("nan")}], kind="buffer")  # refused before anything is written
    with pytest.raises(TypeError):
        write_json(f, {"x": object()}, kind="buffer")
    assert list(tmp_path.iterdir()) == []


def test_legacy_run_directories_continue(tmp_path):
    """A run directory of an earlier version (no mark) is run.py's when its manifest lists steps as run.py writes
    them, or when it holds only the run.lock of a driver stopped before marking it."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "run.lock").write_text("123\n")
    assert check_output(d, "run") == d
    (d / "manifest.json").write_text(json.dumps({"s1-train-x": {"kind": "train", "id": "ab", "seconds": 1}}))
    assert check_output(d, "run") == d
    (d / "manifest.json").write_text(json.dumps({"notes": "mine"}))
    with pytest.raises(UserError):
        check_output(d, "run")


# ---- the scripts -----------------------------------------------------------------------------------------------------
def refused(r, *named):
    assert r.returncode == 2 and "Traceback" not in r.stderr and "refusing to replace it" in r.stderr, r.stderr[-2000:]
    for s in named:
        assert str(s) in r.stderr, (s, r.stderr[-2000:])


def test_run_py_keeps_someones_results_and_a_bare_steps_folder(tiny_env, tmp_path):
    args = ["--model", tiny_env["base"], "--data", tiny_env["data"], "--tasks", ",".join(TASKS), "--methods", "sft",
            "--epochs", "1", "--global-batch", "2", "--max-new-tokens", "2", "--quiet"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text('{"mine": 1}')
    (mine / "report.md").write_text("my report")
    refused(run("run.py", [*args, "--out", mine], tiny_env), mine)
    assert (mine / "results.json").read_text() == '{"mine": 1}' and (mine / "report.md").read_text() == "my report"
    bare = tmp_path / "bare"
    (bare / "steps").mkdir(parents=True)
    refused(run("run.py", [*args, "--out", bare], tiny_env), bare)
    assert [p.name for p in bare.iterdir()] == ["steps"]


def test_evaluate_and_rollout_keep_files_named_like_theirs(tiny_env, tmp_path):
    common = ["--ckpt", tiny_env["base"], "--data", tiny_env["data"], "--tasks", TASKS[0], "--limit", "1",
              "--max-new-tokens", "2"]
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "predictions.jsonl").write_text('{"mine": 1}\n')
    (ev / "scores.json").write_text('{"mine": 1}')
    refused(run("evaluate.py", [*common, "--out", ev], tiny_env), ev)
    assert (ev / "scores.json").read_text() == '{"mine": 1}'

    out = tmp_path / "r.jsonl"
    out.write_text('\n{"token_ids": [1], "logprobs": [0], "finish_reason": "stop", "mine": true}\n')
    refused(run("rollout.py", [*common, "--out", out], tiny_env), out)
    out.unlink()
    side = tmp_path / "r_summary.json"  # the side file used to be written without a check
    side.write_text('{"mine": 1}')
    refused(run("rollout.py", [*common, "--out", out], tiny_env), side)
    assert side.read_text() == '{"mine": 1}' and not out.exists()
    side.unlink()

    r = run("rollout.py", [*common, "--out", out], tiny_env)  # then its own outputs, replaced without asking
    assert r.returncode == 0, r.stderr[-2000:]
    assert is_ours(out, "rollouts") and is_ours(side, "rollout-summary")
    assert run("rollout.py", [*common, "--out", out], tiny_env).returncode == 0
    r = run("evaluate.py", [*common, "--out", tmp_path / "ev2"], tiny_env)
    assert r.returncode == 0 and is_ours(tmp_path / "ev2", "eval"), r.stderr[-2000:]


def test_score_keeps_someones_buffer_stats(tiny_env, tmp_path):
    (tmp_path / "out_stats.json").write_text('{"scorer": "mine", "all": {}}')  # the fields the old check read
    refused(run("score.py", score_args(tiny_env, tmp_path), tiny_env), tmp_path / "out_stats.json")
    assert not (tmp_path / "out.jsonl").exists()
    (tmp_path / "out_stats.json").unlink()
    assert run("score.py", score_args(tiny_env, tmp_path), tiny_env).returncode == 0
    assert is_ours(tmp_path / "out.jsonl", "buffer") and is_ours(tmp_path / "out_stats.json", "buffer-stats")
    assert run("score.py", score_args(tiny_env, tmp_path), tiny_env).returncode == 0  # its own: replaced


# ---- what writing an output leaves: strict JSON, no temporaries of dead processes ------------------------------------
def test_json_outputs_are_strict_json(tmp_path):
    from common.outputs import write_json
    from common.errors import InputError
    with pytest.raises(InputError, match=r"s.json: refusing to write a non-finite number \(all.kl\[1\] is nan\)"):
        write_json(tmp_path / "s.json", {"all": {"kl": [0.5, float("nan")]}})
    with pytest.raises(InputError, match=r"b.jsonl: record 1: refusing .* \(score is -inf\)"):
        write_jsonl(tmp_path / "b.jsonl", [{"score": 1.0}, {"score": float("-inf")}])
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    from common.outputs import write_json
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    live = os.getppid()
    stale = [tmp_path / f".s.json.tmp-{dead}-x1.tmp", tmp_path / f".ck.tmp-{dead}-x2"]
    kept = [tmp_path / f".s.json.tmp-{live}-x3.tmp", tmp_path / f".ck.old-{dead}"]  # live; old copy, no ck yet
    for p in stale + kept:
        p.mkdir() if not p.name.endswith(".tmp") else p.write_text("half")
    write_json(tmp_path / "s.json", {})
    assert not stale[0].exists() and all(p.exists() for p in kept)
    from common.outputs import remove_stale_temporaries
    (tmp_path / "ck").mkdir()  # the swap finished: the moved-aside old copy goes too
    remove_stale_temporaries(tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ck", "s.json", kept[0].name])


def test_a_name_near_the_filesystems_limit_has_siblings_it_takes(tmp_path):
    """A 250-byte name is legal; its temporaries, its mark and train.py's OUT.partial carry a short tag of it (the
    name's first 100 bytes and a digest), not the name plus a suffix, which would pass 255 bytes. Short names keep
    their siblings' names as before."""
    from common.outputs import remove_stale_temporaries, sibling_tag, temp_prefix
    long = tmp_path / ("r" * 245 + ".json")
    write_jsonl(long, [{"a": 1}], kind="rollouts")  # a file output: marked by a hidden sibling
    assert long.read_text() == '{"a": 1}\n' and is_ours(long, "rollouts")
    assert len(list(tmp_path.iterdir())) == 2 and all(len(p.name.encode()) <= 255 for p in tmp_path.iterdir())
    tag = sibling_tag(long)
    assert len(tag.encode()) == 117 and tag.startswith("r" * 100 + "~") and tag != sibling_tag(tmp_path / ("r" * 246))
    assert sibling_tag(tmp_path / "s.json") == "s.json" and temp_prefix(tmp_path / "s.json").startswith(".s.json.tmp-")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".{tag}.tmp-{dead}-x.tmp"
    stale.write_text("half")
    remove_stale_temporaries(long)
    assert not stale.exists()


# ---- an output of several files: a reader never sees two runs' files mixed -----------------------------------------
def _fail_second_write(monkeypatch):
    """common.outputs.write_json raises as a full disk would: the second file of each output below."""
    import errno
    import common.outputs

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(common.outputs, "write_json", full)


@pytest.mark.parametrize("script, first, last", [("evaluate", "predictions.jsonl", "scores.json"),
                                                  ("drift", "drift_samples.jsonl", "drift.json")])
def test_a_directory_output_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch, script, first, last):
    import importlib
    mod = importlib.import_module(script)
    out = tmp_path / "out"
    mod.write_outputs(out, [{"run": "old"}], {"run": "old"})
    _fail_second_write(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        mod.write_outputs(out, [{"run": "new"}], {"run": "new"})
    assert (out / first).read_text() == '{"run": "old"}\n' and json.loads((out / last).read_text()) == {"run": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left
    monkeypatch.undo()
    mod.write_outputs(out, [{"run": "new"}], {"run": "new"})
    assert (out / first).read_text() == '{"run": "new"}\n' and json.loads((out / last).read_text()) == {"run": "new"}


def test_score_failing_before_its_statistics_leaves_no_old_statistics_beside_the_new_buffer(tiny_env, tmp_path,
                                                                                             monkeypatch):
    """buffer + buffer_stats: the statistics are written last and mark a finished pair; the earlier ones are
    removed before the buffer is replaced, so a failure in between leaves a buffer without statistics, never a
    new buffer beside old statistics."""
    import score
    assert run("score.py", score_args(tiny_env, tmp_path, "--scorer", "sc"), tiny_env).returncode == 0
    old = (tmp_path / "out.jsonl").read_text()
    monkeypatch.chdir(REPO)
    _fail_second_write(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        score.main([str(a) for a in score_args(tiny_env, tmp_path, "--scorer", "ru")])
    assert not (tmp_path / "out_stats.json").exists()
    assert (tmp_path / "out.jsonl").read_text() != old  # the new buffer, alone: unfinished, not mixed
