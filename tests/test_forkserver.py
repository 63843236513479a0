"""tests/forkserver.py: a forked `python ...` gives what subprocess.run gives -- exit code, stdout, stderr -- for
scripts, -m and -c, exits of every kind, environment, working directory and argv; timeouts and check behave as
subprocess's; the one difference is that forkserver.PRELOAD (torch and third-party modules) is already imported."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import forkserver

REPO = forkserver.REPO

SCRIPT = textwrap.dedent("""\
    import atexit, os, sys, threading, time
    print("argv", sys.argv, "path0", sys.path[0], "name", __name__, "cwd", os.getcwd())
    print("env", os.environ.get("FORK_TEST"), "threads", os.environ.get("OMP_NUM_THREADS"))
    sys.stderr.write("progress 1\\rprogress 2\\r\\n")
    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done"))).start()
    how = sys.argv[1] if len(sys.argv) > 1 else ""
    if how == "code":
        sys.exit(3)
    if how == "message":
        sys.exit("script.py: error: one line")
    if how == "raise":
        def inner():
            raise ValueError("boom")
        inner()
    if how == "stdin":
        print("stdin", repr(sys.stdin.read()))
    if how == "open":  # a file left open (and unflushed) in the script's globals: the exit closes it
        left = open(sys.argv[2], "w")
        left.write("kept")
    """)

@pytest.fixture(autouse=True)
def forking(monkeypatch):
    monkeypatch.delenv("OPR_TEST_FORK", raising=False)  # these tests are of the fork, even where the suite's is off


CASES = {
    "script ok": ["script.py", "a b"],
    "script exit 3": ["script.py", "code"],
    "script exit message": ["script.py", "message"],
    "script raises": ["script.py", "raise"],
    "script reads stdin": ["script.py", "stdin"],
    "module": ["-m", "script", "x"],
    "-c": ["-c", "import sys; print(sys.argv, repr(sys.path[0]), __name__); sys.exit(sys.argv[1])", "bye"],
    "-c raises": ["-c", "x = 1\nraise KeyError(x)"],
    "-c KeyboardInterrupt": ["-c", "raise KeyboardInterrupt"],
    # a pool's idle workers are non-daemon threads that only threading's exit hook ends
    "-c thread pool left open": ["-c", "from concurrent.futures import ThreadPoolExecutor\n"
                                       "pool = ThreadPoolExecutor(2)\nprint(pool.submit(int, '7').result())"],
    "-c torch threads": ["-c", "import torch; print(torch.get_num_threads(), torch.randn(3, generator="
                               "torch.Generator().manual_seed(0)).tolist())"],
}


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("case", CASES)
def test_fork_matches_subprocess(tmp_path, case, threads):
    (tmp_path / "script.py").write_text(SCRIPT)
    cmd = [sys.executable, *CASES[case]]
    env = dict(os.environ, FORK_TEST="here", OMP_NUM_THREADS=threads)
    if case == "script reads stdin":  # subprocess passes on this process's stdin, the fork gets /dev/null
        kw = dict(stdin=subprocess.DEVNULL)
    else:
        kw = {}
    ref = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, **kw)
    got = forkserver.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert (got.returncode, got.stdout, got.stderr) == (ref.returncode, ref.stdout, ref.stderr)
    assert got.args == cmd


def test_a_file_left_open_is_written_at_exit(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    for how, name in ((subprocess.run, "ref.txt"), (forkserver.run, "got.txt")):
        r = how([sys.executable, "script.py", "open", name], cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "ref.txt").read_text() == (tmp_path / "got.txt").read_text() == "kept"


def test_only_the_preloaded_third_party_modules_are_already_imported(tmp_path):
    """PRELOAD and what they import, nothing of the project's but the server's own loop (pipeline.zygote and
    common.procs, stdlib only; the rest reads the environment when imported) and no thread but the main one running
    Python (a fork copies no other thread)."""
    names = (*forkserver.PRELOAD, "transformers", "rouge_score", "model", "data", "kernels", "engine", "common.cli")
    code = (f"import sys, threading; print(sorted(m for m in {names!r} if m in sys.modules), "
            f"threading.active_count())")
    got = forkserver.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    ref = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert ref.stdout == "[] 1\n" and got.stdout == f"{sorted(forkserver.PRELOAD)} 1\n", got.stdout + got.stderr


def test_bytes_check_and_timeout(tmp_path):
    got = forkserver.run([sys.executable, "-c", "print('é')"], capture_output=True)
    assert got.stdout == "é\n".encode()
    with pytest.raises(subprocess.CalledProcessError) as e:
        forkserver.run([sys.executable, "-c", "import sys; print('out'); sys.exit(4)"], capture_output=True,
                       text=True, check=True)
    assert e.value.returncode == 4 and e.value.stdout == "out\n"
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('started', flush=True); " \
           "time.sleep(60)"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3)
    assert e.value.stdout == b"started\n"  # bytes, as subprocess.run gives them on a timeout
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped by the server
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired) as ref:
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3)
    assert ref.value.stdout == e.value.stdout


def test_what_it_does_not_fork_goes_to_subprocess(tmp_path):
    # stdin input, another interpreter option: subprocess.run as it is (a fresh interpreter: no torch imported)
    code = "import sys; print('torch' in sys.modules, sys.stdin.read())"
    r = forkserver.run([sys.executable, "-c", code], capture_output=True, text=True, input="fed")
    assert r.stdout == "False fed\n"
    r = forkserver.run([sys.executable, "-X", "utf8", "-c", code], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    assert r.stdout == "False \n"


def test_ranks_get_torchruns_variables_and_a_failing_rank_ends_its_siblings():
    """run_ranks: each rank sees what torchrun gives a worker (the env:// rendezvous's variables), the outputs come
    back in rank order, and a rank that fails ends the others (rank 0 would otherwise sleep for ten minutes)."""
    code = ("import os, time; r = int(os.environ['RANK']); "
            "print('rank', r, *(os.environ[k] for k in ('LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', "
            "'MASTER_ADDR', 'MASTER_PORT')), flush=True); time.sleep(600 if r == 0 else 0.5); exit(3 if r else 0)")
    p = forkserver.run_ranks(2, [sys.executable, "-c", code], text=True, timeout=120, port=29999)
    assert p.returncode == 3
    assert p.stdout == "rank 0 0 2 2 127.0.0.1 29999\nrank 1 1 2 2 127.0.0.1 29999\n"
    # a real rendezvous: the ranks' all_reduce over gloo
    code = ("import torch, torch.distributed as dist; dist.init_process_group('gloo'); "
            "t = torch.tensor([dist.get_rank() + 1.0]); dist.all_reduce(t); print(dist.get_rank(), t.item())")
    from tiny import free_port
    p = forkserver.run_ranks(2, [sys.executable, "-c", code], text=True, timeout=120, port=free_port())
    assert (p.returncode, p.stdout) == (0, "0 3.0\n1 3.0\n"), p.stderr


def test_another_interpreter_forks_from_a_server_of_its_own_when_given_a_preload(tmp_path):
    """preload (the vLLM venv's interpreter: vLLM): that interpreter's server imports it, once; without a preload
    another interpreter starts as subprocess.run would."""
    other = tmp_path / "python"
    other.symlink_to(sys.executable)
    code = "import sys; print(sys.executable, 'colorsys' in sys.modules, 'torch' in sys.modules)"
    p = forkserver.run([str(other), "-c", code], capture_output=True, text=True, preload=("colorsys",))
    assert p.stdout.split() == [str(other), "True", "True"], p.stderr
    p = forkserver.run([str(other), "-c", code], capture_output=True, text=True)
    assert p.stdout.split() == [str(other), "False", "False"], p.stderr


def test_a_driver_forks_its_zygote_and_the_steps_write_what_a_started_zygote_s_write(train_ckpt, tmp_path):
    """A run.py driver forked from the server forks its pipeline zygote (its imports done) instead of starting
    `python -m pipeline.zygote`; a training step forked by either zygote writes the same weights, bit for bit."""
    from tiny import ARGS, train_env
    step = ["--model", str(train_ckpt), "--data", str(train_ckpt / "data.jsonl"), *ARGS]
    code = ("import os, sys; from pathlib import Path; from pipeline.zygote import Zygote; "
            "env = dict(os.environ, CUDA_VISIBLE_DEVICES='', MKL_NUM_THREADS='1'); "  # as run.py gives its CPU steps
            "z = Zygote(env); out = Path(sys.argv[1]); "
            f"rc = z.run('train', {step!r} + ['--out', str(out / 'ckpt')], out / 'log.txt', env); z.close(); "
            "print(type(z.proc).__name__, rc, z.proc.returncode)")
    env = train_env()
    forked, started = tmp_path / "forked", tmp_path / "started"
    for out in (forked, started):
        out.mkdir()
    p = forkserver.run([sys.executable, "-c", code, str(forked)], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.stdout.split() == ["_ForkedZygote", "0", "0"], p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-c", code, str(started)], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.stdout.split() == ["Popen", "0", "0"], p.stderr[-3000:]
    assert (forked / "ckpt" / "model.safetensors").read_bytes() == (started / "ckpt" / "model.safetensors").read_bytes()
    from tiny import log
    assert [(r["loss"], r["grad_norm"]) for r in log(forked / "ckpt")] == \
        [(r["loss"], r["grad_norm"]) for r in log(started / "ckpt")]


def test_started_is_popen_for_a_script_signalled_while_it_runs(tmp_path):
    """forkserver.Started, the driver handle of test_run's signal tests: pid of a child leading its own session, poll
    and wait(timeout) while it runs, the exit a signal gives and the output, as subprocess.Popen's."""
    code = "import pathlib, signal\nprint('up', flush=True)\npathlib.Path('up').touch()\nsignal.pause()"
    results = []
    for start in (lambda cmd: subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, start_new_session=True),
                  lambda cmd: forkserver.Started(cmd, cwd=tmp_path)):
        (tmp_path / "up").unlink(missing_ok=True)
        p = start([sys.executable, "-c", code])
        while not (tmp_path / "up").exists():
            time.sleep(0.01)
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(timeout=0.1)
        assert p.poll() is None and os.getsid(p.pid) == p.pid
        os.kill(p.pid, signal.SIGTERM)
        results.append((p.wait(timeout=60), *p.communicate()))
    assert results[0] == results[1] == (-signal.SIGTERM, "up\n", "")
