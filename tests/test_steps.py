"""pipeline/steps.py: a step re-run makes everything that read it stale, a manifest entry without its files' digests
runs again, a step is durable before it is listed, and a crash while committing leaves its readers stale.
(The keys of whole runs: tests/test_run_keys.py.)"""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest


def _dag(run_dir: Path) -> tuple:
    """a -> b -> c and a -> d; each step writes fresh random bytes followed by what it read (a step that is not
    deterministic, as a GPU training may be)."""
    from pipeline.steps import Pipeline
    pipe = Pipeline(run_dir, 1, dict(os.environ, OPR_NO_ZYGOTE="1"), True, {})
    pipe.use_zygote = False

    def step(deps):
        def build(tmp, dirs):
            reads = [str(dirs[d] / "out.txt") for d in deps]
            code = ("import os, sys; parts = [os.urandom(4).hex()] + [open(p).read() for p in sys.argv[2:]]; "
                    "open(sys.argv[1], 'w').write('|'.join(parts))")
            return [sys.executable, "-c", code, str(tmp / "out.txt"), *reads]
        return build

    a = pipe.add("train", "a", {}, [], step([]))
    b = pipe.add("train", "b", {}, [a], step([a]))
    c = pipe.add("eval", "c", {}, [b], step([b]))
    d = pipe.add("eval", "d", {}, [a], step([a]))
    return pipe, (a, b, c, d)


def _execute(run_dir: Path) -> tuple:
    pipe, keys = _dag(run_dir)
    pipe.lock_run_dir()
    try:
        pipe.execute()
    finally:
        os.close(pipe.lock_fd)
    out = {k: (run_dir / "steps" / k / "out.txt").read_text() for k in keys}
    return keys, out, json.loads((run_dir / "manifest.json").read_text())


def test_a_rerun_step_makes_everything_that_read_it_stale(tmp_path):
    """A step re-run after its directory was deleted gets the same key, but its bytes may differ (a GPU run): the
    steps that read the old execution must re-run too, or the table would mix two checkpoints. Steps record which
    execution of each input they read (manifest 'id' / 'inputs')."""
    run_dir = tmp_path / "run"
    (a, b, c, d), first, m1 = _execute(run_dir)
    assert first[b].split("|", 1)[1] == first[a] and first[c].split("|", 1)[1] == first[b]
    assert m1[c]["inputs"] == {b: m1[b]["id"]} and m1[b]["inputs"] == {a: m1[a]["id"]}

    _, again, m2 = _execute(run_dir)  # nothing missing: nothing runs
    assert again == first and m2 == m1

    shutil.rmtree(run_dir / "steps" / b)  # a middle step: it and its reader re-run, a and d are kept
    _, out, m3 = _execute(run_dir)
    assert out[a] == first[a] and out[d] == first[d] and m3[a] == m1[a] and m3[d] == m1[d]
    assert out[b] != first[b] and out[c] != first[c]
    assert out[c].split("|", 1)[1] == out[b]  # c read the new b

    shutil.rmtree(run_dir / "steps" / a)  # the root: everything below it re-runs, even steps still on disk
    _, out2, m4 = _execute(run_dir)
    assert all(out2[k] != out[k] for k in (a, b, c, d))
    assert out2[b].split("|", 1)[1] == out2[a] and out2[d].split("|", 1)[1] == out2[a]
    assert out2[c].split("|", 1)[1] == out2[b]


def test_an_entry_without_its_files_digests_runs_again(tmp_path, capsys):
    """A manifest entry that does not say what its step wrote cannot show the files intact: the step runs again (and
    its dependents), with one line naming it, and its new entry records them."""
    run_dir = tmp_path / "run"
    keys, first, m1 = _execute(run_dir)
    capsys.readouterr()
    old = {k: {"kind": v["kind"], "seconds": v["seconds"]} for k, v in m1.items()}
    (run_dir / "manifest.json").write_text(json.dumps(old))
    _, again, m2 = _execute(run_dir)
    assert all(again[k] != first[k] and set(m2[k]["files"]) == set(m1[k]["files"]) for k in keys)
    err = capsys.readouterr().err
    assert all(f"{k}: no record of its files" in err for k in keys)


def test_a_step_is_durable_before_it_is_listed(tmp_path, monkeypatch):
    """Every file of a step's output is fsynced under its temporary name before the rename publishes it, and the
    manifest that lists it after: a power loss cannot leave a listed step with truncated files."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", str(src), str(dst))),
                                                         real_replace(src, dst))[1])
    run_dir = tmp_path / "run"
    keys, _, _ = _execute(run_dir)
    steps = str(run_dir / "steps")
    for k in keys:
        tmp, final = f"{steps}/{k}.tmp", f"{steps}/{k}"
        at = events.index(("replace", tmp, final))
        synced = {e[1] for e in events[:at] if e[0] == "fsync"}
        assert {f"{tmp}/out.txt", f"{tmp}/log.txt", tmp} <= synced, k
        assert ("fsync", steps) in events[at:]  # the rename itself
        listed = next(i for i, e in enumerate(events[at:], at) if e[0] == "replace" and e[2].endswith("manifest.json"))
        assert events[listed - 1][0] == "fsync" and "manifest.json" in events[listed - 1][1]  # its content
        assert events[listed + 1] == ("fsync", str(run_dir))  # its name


def test_a_crash_while_a_rerun_step_is_committed_leaves_its_readers_stale(tmp_path, monkeypatch):
    """Between the rename of a re-run step's new output and the manifest entry that lists it, a killed driver must
    not leave the new bytes under the old execution's id (its readers would look current)."""
    import pipeline.steps as run
    run_dir = tmp_path / "run"
    (a, b, c, d), first, _ = _execute(run_dir)
    shutil.rmtree(run_dir / "steps" / b)
    real = run.write_json
    calls = []

    def dies_at_the_commit(path, obj):  # the first write (dropping b's old entry) goes through, the second dies
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, obj)

    monkeypatch.setattr(run, "write_json", dies_at_the_commit)
    with pytest.raises(KeyboardInterrupt):
        _execute(run_dir)
    monkeypatch.setattr(run, "write_json", real)
    assert b not in json.loads((run_dir / "manifest.json").read_text())
    _, out, _ = _execute(run_dir)
    assert out[c].split("|", 1)[1] == out[b]  # c re-ran on the b that is on disk


def test_a_directory_fsync_the_file_system_refuses_is_let_be(tmp_path, monkeypatch):
    """Some FUSE / network mounts reject fsync on a directory (EINVAL): writes still succeed. Any other error is
    raised as itself, after the file is in place (not masked by removing a temporary that was already renamed)."""
    import errno
    import stat as stat_mod
    from common.outputs import fsync_tree, write_json
    real = os.fsync
    refuse = {"errno": errno.EINVAL}

    def fsync(fd):
        if stat_mod.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(refuse["errno"], os.strerror(refuse["errno"]))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_json(tmp_path / "a.json", {"x": 1})
    (tmp_path / "sub").mkdir()
    os.mkfifo(tmp_path / "sub" / "fifo")  # not a regular file: skipped, not opened (an open would block)
    fsync_tree(tmp_path)
    refuse["errno"] = errno.EIO
    with pytest.raises(OSError) as e:
        write_json(tmp_path / "b.json", {"x": 2})
    assert e.value.errno == errno.EIO and json.loads((tmp_path / "b.json").read_text()) == {"x": 2}


@pytest.mark.parametrize("code, says", [
    # killed mid-step (the OOM killer's SIGKILL): its log's last line is progress, not an error
    ("import os, signal; print('step 3/10 loss 1.23', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
     r"step s-[0-9a-f]+ was killed by SIGKILL \(the kernel's out-of-memory killer sends it: see dmesg\); full log: "),
    ("import os, signal; print('ValueError: bad row', flush=True); os.kill(os.getpid(), signal.SIGTERM)",
     r"was killed by SIGTERM; its log's last error: ValueError: bad row; full log: "),
    ("import sys; print('loss 1.0'); sys.exit(3)", r"failed \(exit 3\): loss 1.0; full log: "),
])
def test_a_failed_steps_line_says_how_it_ended(tmp_path, code, says):
    from pipeline.steps import Pipeline, StepFailed
    pipe = Pipeline(tmp_path / "run", 1, dict(os.environ), True, {})
    pipe.use_zygote = False
    pipe.add("eval", "s", {}, [], lambda tmp, dirs: [sys.executable, "-c", code])
    pipe.lock_run_dir()
    try:
        with pytest.raises(StepFailed, match=says) as e:
            pipe.execute()
    finally:
        os.close(pipe.lock_fd)
    assert "loss 1.23" not in str(e.value) and "\n" not in str(e.value)


def test_a_file_edited_while_its_step_runs_is_not_committed(tmp_path):
    """Issue 64, class 2: the step's key holds the bytes its inputs had when it was planned; edited while it runs,
    its results may belong to other bytes, so it is not committed (one line naming the file); a re-run plans it
    again on the new bytes (another key) and commits it."""
    from pipeline.steps import Pipeline, StepFailed
    data = tmp_path / "data.txt"
    data.write_text("v1")
    edit = ("import sys; open(sys.argv[1], 'a').write('+'); open(sys.argv[2], 'w').write('out')")

    def plan(code):
        pipe = Pipeline(tmp_path / "run", 1, dict(os.environ), True, {})
        pipe.use_zygote = False
        key = pipe.add("eval", "s", {}, [], lambda tmp, dirs: [sys.executable, "-c", code, str(data),
                                                                str(tmp / "out.txt")], reads=[data])
        pipe.lock_run_dir()
        return pipe, key
    pipe, key = plan(edit)
    try:
        with pytest.raises(StepFailed, match=rf"step {key}: {data} changed while the step ran"):
            pipe.execute()
    finally:
        os.close(pipe.lock_fd)
    manifest = tmp_path / "run" / "manifest.json"
    assert not manifest.exists() or key not in json.loads(manifest.read_text())
    pipe2, key2 = plan("import sys; open(sys.argv[2], 'w').write('out')")
    try:
        pipe2.execute()
    finally:
        os.close(pipe2.lock_fd)
    assert key2 != key and key2 in json.loads((tmp_path / "run" / "manifest.json").read_text())
