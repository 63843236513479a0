"""pipeline/zygote.py: a forked step behaves like `python script.py ARGS` -- its exit code, its one-line error in its
own log, its environment -- and the zygote refuses what is not a pipeline script. (That run.py's results are
byte-identical with and without the zygote is tests/test_run_keys.py; that killing the driver kills forked steps
is tests/test_reliability.py.)"""
import os
import subprocess
import sys
from pathlib import Path

from pipeline.zygote import Zygote, script_of

REPO = Path(__file__).resolve().parents[1]


def test_forked_step_matches_a_subprocess(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    zygote = Zygote(env)
    try:
        pids = []
        log = tmp_path / "zygote.log"
        rc = zygote.run("evaluate", ["--ckpt", str(tmp_path / "nope"), "--limit", "0"], log, env,
                        on_start=pids.append)
        direct = subprocess.run([sys.executable, str(REPO / "evaluate.py"), "--ckpt", str(tmp_path / "nope"),
                                 "--limit", "0"], cwd=REPO, env=env, capture_output=True, text=True)
        assert rc == direct.returncode == 2
        assert log.read_text() == direct.stderr + direct.stdout  # the same one line, no traceback
        assert "evaluate.py: error: argument --limit" in log.read_text() and "Traceback" not in log.read_text()
        assert len(pids) == 1 and pids[0] not in (os.getpid(), zygote.proc.pid)

        # a script outside the pipeline is refused without forking
        assert zygote.run("os", [], tmp_path / "x.log", env) == 2 and not (tmp_path / "x.log").exists()

        # the child runs with the environment it is given, and reads its argv like a script
        out = tmp_path / "ckpt"
        rc = zygote.run("score", ["--rollouts", str(tmp_path / "missing.jsonl"), "--out", str(out)],
                        tmp_path / "score.log", dict(env, OPR_DEBUG="1"))
        assert rc == 1 and "Traceback" in (tmp_path / "score.log").read_text()  # OPR_DEBUG: the traceback is back
    finally:
        zygote.close()
    assert zygote.proc.returncode == 0


def test_zygote_dies_with_stdin_closed_and_reports_children(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    zygote = Zygote(env)
    codes = [zygote.run("rollout", ["--max-new-tokens", "0"], tmp_path / f"{i}.log", env) for i in range(3)]
    zygote.close()
    assert codes == [2, 2, 2] and zygote.proc.returncode == 0
    assert all("rollout.py: error: argument --max-new-tokens" in (tmp_path / f"{i}.log").read_text() for i in range(3))


def test_close_kills_a_zygote_that_does_not_exit_and_its_children_die_with_it(tmp_path):
    """close() is bounded: a zygote whose child still runs after `timeout` is SIGKILLed, the child with it
    (PR_SET_PDEATHSIG), and the waiting run() returns -9 -- a driver never hangs in its cleanup."""
    import threading
    import time
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(tmp_path / "cache"))
    zygote = Zygote(env)
    pids, codes = [], []
    t = threading.Thread(target=lambda: codes.append(zygote.run("train", [], tmp_path / "t.log", env,
                                                                 on_start=pids.append)))
    t.start()  # train.py with no flags: the embedded default, minutes of work
    deadline = time.monotonic() + 60
    while not pids and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids, "the child never started"
    zygote.close(timeout=1)
    t.join(30)
    assert zygote.proc.returncode == -9 and codes == [-9]
    assert gone(pids[0]), "the child outlived its zygote"
    # and so does what the child started (train.py with no flags builds the tiny base with a train.py of its own,
    # in the child's process group): nothing is left to run on after the driver is gone
    deadline = time.monotonic() + 20
    while (left := group(pids[0])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the killed child's group outlived it: {left}"


def group(pgid: int) -> list[str]:
    """The live processes of process group pgid (their command lines)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit():
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return out


def gone(pid: int, timeout: float = 20) -> bool:
    """pid has exited (or is a zombie waiting to be reaped) within timeout seconds."""
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_what_the_zygote_forks():
    """A pipeline script under this interpreter, unless it samples with vLLM (whose engine, threads and GPU processes
    start in a process of its own); everything else starts as its own process."""
    py, ev = sys.executable, str(REPO / "evaluate.py")
    assert script_of([py, ev, "--ckpt", "c"]) == "evaluate"
    assert script_of([py, ev, "--engine", "native", "--tp", "1"]) == "evaluate"
    assert script_of([py, str(REPO / "train.py"), "--data", "vllm"]) == "train"  # a value, not the engine's
    assert script_of([py, ev, "--engine", "vllm", "--tp", "1"]) is None
    assert script_of([py, "-m", "torch.distributed.run", ev]) is None  # torchrun's workers
    assert script_of(["/other/python", ev]) is None
    assert script_of([py, str(REPO / "run.py")]) is None  # not a step script
    assert script_of([py, "/elsewhere/evaluate.py"]) is None
    assert script_of([py]) is None
    assert script_of([py, ev, "--engine"]) == "evaluate"  # (argparse refuses it in the step itself)
    # every script a step runs (a spec's SCRIPT), as the driver's argv names it, forks
    from pipeline import specs
    scripts = {c.SCRIPT for c in specs.Spec.__subclasses__() if c.SCRIPT}
    assert {s for s in scripts if script_of([py, str(REPO / s)])} == scripts
