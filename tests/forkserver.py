"""`python ...` for the tests, forked from a server that has imported torch once.

The suite starts Python processes by the dozen (the scripts, run.py, `-c` children), and each paid
`import torch` and numpy again, seconds each on CI's 2 cores. `run` is subprocess.run for them: the same
exit code, stdout and stderr (text with universal newlines, as subprocess gives them), timeout and check;
the child is a fork of a server (pipeline.zygote's loop) that imported torch and the third-party modules the
scripts import (PRELOAD) before.

    from forkserver import run
    p = run([sys.executable, "train.py", ...], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

What makes the fork behave as `python ...` does:
- the child takes the request's environment, working directory and argv; sys.path[0] is the script's folder
  (the working directory for -m, '' for -c); the code runs in a fresh __main__ (-m through runpy's entry
  point, as the interpreter runs it; tracebacks without this file's frames) and the child exits as the
  interpreter does: SystemExit's code (a message goes to stderr, exit 1), an uncaught exception's traceback
  through sys.excepthook (exit 1), KeyboardInterrupt as SIGINT, then non-daemon threads and atexit handlers
  (the modules are not torn down: `_exit`);
- what is read once, when the interpreter starts or torch is imported (PYTHON*, OMP_*, MKL_*, LD_*, TORCH*,
  ...: STARTUP), comes from the server's own environment, so there is one server per value of those;
- nothing but PRELOAD is imported in the server: the project's modules read the environment when imported
  (OPR_CACHE, KERNELS_*), so each child imports them itself, under its own environment; a caller's `preload`
  (vLLM for the vLLM venv's interpreter) adds to PRELOAD in a server of its own;
- stdin is /dev/null, and the child leads a process group of its own (a timeout kills the group);
- a run.py driver run here forks its pipeline zygote from itself (_ForkedZygote) rather than starting one (and
  where it has vLLM imported, forks its vLLM steps from that zygote too, not as processes of their own);
  run_ranks gives torchrun's ranks as forks too, and Started a Popen-like handle on a fork (a driver that a test
  signals while it runs).
Anything else -- stdin input, preexec_fn, no capture, another interpreter without a preload, an interpreter
option, a caller off the main thread (a server dies with the thread that started it) -- goes to subprocess.run
as it is, and OPR_TEST_FORK=0 sends everything there.
"""
import atexit
import builtins
import gc
import io
import locale
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(1, str(REPO))  # the server runs as `python tests/forkserver.py`
from common.procs import die_with_parent  # noqa: E402
import pipeline.zygote  # noqa: E402
from pipeline.zygote import Zygote, flush_and_exit, serve  # noqa: E402

STARTUP = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "NPY_", "LD_", "MALLOC", "TORCH", "PYTORCH",
           "ATEN_", "CUDA", "LC_", "LANG")
_SERVERS = {}  # (interpreter, preload, *STARTUP items) -> Zygote
# third-party modules only, whose import reads nothing but STARTUP's variables (dynamo's and inductor's settings are
# TORCH*) and starts no thread (rouge_score's import does: left to the children, as forking after it is not safe)
PRELOAD = ("numpy", "torch", "torch.distributed.fsdp", "torch._dynamo", "safetensors.torch", "tokenizers", "tqdm")
# what the import of a run()'s `preload` (vLLM: transformers and its own settings) may read too: one server per value
STARTUP_MORE = ("VLLM_", "HF_", "TRANSFORMERS", "TOKENIZERS")


def run(cmd, *, cwd=None, env=None, capture_output=False, text=False, timeout=None, check=False, on_start=None,
        preload=None, **rest):
    """subprocess.run(cmd, ...) as a fork of the server; on_start(pid): called once a forked child exists.
    preload: modules the server imports after PRELOAD (their import reads STARTUP_MORE's variables too); with it
    (even empty), another interpreter than this one (cmd[0]) forks too, from a server of its own."""
    cmd = [os.fspath(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    other = preload is None and cmd[0] != sys.executable  # another interpreter, not asked for
    mode = cmd[1] if len(cmd) > 1 else "-"
    if (rest or not capture_output or other or os.environ.get("OPR_TEST_FORK") == "0"
            or (mode.startswith("-") and mode not in ("-c", "-m")) or len(cmd) < 2 + (mode in ("-c", "-m"))
            or (_key(cmd[0], env, preload) not in _SERVERS
                and threading.current_thread() is not threading.main_thread())):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=capture_output, text=text, timeout=timeout,
                              check=check, **rest)
    server = _server(cmd[0], env, preload)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        timer, killed = None, []

        def started(pid):
            nonlocal timer
            if on_start is not None:
                on_start(pid)
            if timeout is not None:
                timer = threading.Timer(timeout, lambda: killed.append(_killpg(pid)))
                timer.start()

        rc = server.run(mode, cmd[2:], out, env, on_start=started, err=str(err),
                        cwd=os.path.abspath(cwd or os.getcwd()))
        if timer is not None:
            timer.cancel()
        stdout, stderr = (p.read_bytes() if p.exists() else b"" for p in (out, err))
    if killed:  # as subprocess.run's: the output so far, in bytes even with text=True
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    if text:
        stdout, stderr = _text(stdout), _text(stderr)
    if check and rc:
        raise subprocess.CalledProcessError(rc, cmd, stdout, stderr)
    return subprocess.CompletedProcess(cmd, rc, stdout, stderr)


class Started:
    """subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True, start_new_session=True) for a script that a test
    signals while it runs, as run()'s fork: `pid` once the child exists (it leads its own session, as run()'s
    children do); wait, poll and communicate as Popen's; `stdout` and `stderr` readable once it has ended."""

    def __init__(self, cmd, *, cwd=None, env=None):
        cmd = [os.fspath(c) for c in cmd]
        if cmd[0] != sys.executable or os.environ.get("OPR_TEST_FORK") == "0":  # run() would not fork it
            raise ValueError(f"Started forks this interpreter's scripts, with OPR_TEST_FORK unset: {cmd[:2]}")
        env = dict(os.environ if env is None else env)
        _server(sys.executable, env, None)  # by this (the main) thread: the run below forks from another
        self.args, self.returncode, self.pid, self._result = cmd, None, None, None
        forked = threading.Event()

        def started(pid):
            self.pid = pid
            forked.set()

        def wait_for_it():
            try:
                self._result = run(cmd, cwd=cwd, env=env, capture_output=True, text=True, on_start=started)
            except BaseException as e:  # raised again by wait()
                self._result = e
            finally:
                forked.set()
        self._thread = threading.Thread(target=wait_for_it, daemon=True)
        self._thread.start()
        forked.wait()
        if self.pid is None:
            self.wait()
            raise RuntimeError(f"{cmd[:2]} did not start")

    def wait(self, timeout=None):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        if isinstance(self._result, BaseException):
            raise self._result
        if self.returncode is None:
            self.returncode = self._result.returncode
            self.stdout, self.stderr = io.StringIO(self._result.stdout), io.StringIO(self._result.stderr)
        return self.returncode

    def poll(self):
        return None if self._thread.is_alive() else self.wait()

    def communicate(self, timeout=None):
        self.wait(timeout)
        return self.stdout.read(), self.stderr.read()


def _key(python: str, env: dict, preload) -> tuple:
    startup = STARTUP if preload is None else STARTUP + STARTUP_MORE
    return (python, tuple(preload or ()), *sorted((k, v) for k, v in env.items() if k.startswith(startup)))


def _server(python: str, env: dict, preload) -> Zygote:
    """The server for this interpreter, preload and STARTUP values: started here (by the main thread) if none is."""
    key = _key(python, env, preload)
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[key] = Zygote(env, server=(__file__, *(preload or ())), python=python)
    return server


def run_ranks(world: int, cmd, *, cwd=None, env=None, timeout=None, text=False, port: int,
              preload=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node WORLD --master_port PORT cmd[1:]` for the tests, without torchrun's agent and its
    fresh interpreters: each rank is run()'s fork, given the variables that torch.distributed's env:// rendezvous
    and the project read (MASTER_ADDR and MASTER_PORT: rank 0 hosts the store, as it does without torchrun's agent;
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE). As under torchrun, a failing rank's siblings are killed (a
    collective would otherwise wait on it for gloo's half hour). stdout and stderr: each rank's in rank order; the
    exit code: the first rank to fail. Real torchrun stays tested where a test launches it itself."""
    cmd = [os.fspath(c) for c in cmd]
    env = dict(os.environ if env is None else env)
    if os.environ.get("OPR_TEST_FORK") == "0" or (cmd[0] != sys.executable and preload is None):
        return subprocess.run(torchrun(world, cmd, port), cwd=cwd, env=env, capture_output=True, text=text,
                              timeout=timeout)
    _server(cmd[0], env, preload)  # by this (the main) thread: the ranks' threads then fork from it
    pids, results, failed = [], [None] * world, []
    lock = threading.Lock()

    def started(pid):
        with lock:
            pids.append(pid)

    def rank(r):
        rank_env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        try:
            results[r] = run(cmd, cwd=cwd, env=rank_env, capture_output=True, timeout=timeout, preload=preload,
                             on_start=started)
        except subprocess.TimeoutExpired as e:
            results[r] = subprocess.CompletedProcess(cmd, -signal.SIGKILL, e.stdout or b"", e.stderr or b"")
        if results[r].returncode != 0:
            with lock:
                failed.append(results[r].returncode)
                for pid in pids:
                    _killpg(pid)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out, err = (b"".join(getattr(p, f) for p in results) for f in ("stdout", "stderr"))
    if text:
        out, err = _text(out), _text(err)
    return subprocess.CompletedProcess(cmd, failed[0] if failed else 0, out, err)


def torchrun(world: int, cmd: list, port: int) -> list:
    """`torchrun --nproc_per_node WORLD --master_port PORT cmd[1:]` under cmd[0]'s interpreter, as an argv."""
    return [cmd[0], "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port),
            *cmd[1:]]


def _killpg(pid: int) -> bool:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def _text(data: bytes) -> str:
    """What subprocess.run(text=True) gives: the locale's encoding, universal newlines (tqdm's \r too)."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


def _child(req: dict, server: int):
    """In the forked child: become `python <mode> <argv>` (never returns)."""
    die_with_parent(server, new_session=True)
    for fd, path in ((1, req["log"]), (2, req["err"]), (0, os.devnull)):
        f = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    _as_started(req["env"], req["cwd"])
    Zygote._start = staticmethod(_ForkedZygote.start)  # a driver run here forks its zygote (below)
    pipeline.zygote.script_of = _ForkedZygote.script_of  # before the driver imports it (pipeline.steps)
    mode, argv = req["script"], req["argv"]
    code = 0
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # a fresh one, not the server's
    main.__builtins__ = builtins
    try:
        if mode == "-m":  # as the interpreter runs -m: runpy's own entry point (its frames in tracebacks)
            import runpy
            sys.argv, sys.path[:2] = ["-m", *argv[1:]], [req["cwd"]]
            runpy._run_module_as_main(argv[0])
        else:  # a script or -c: its code in __main__, its file name absolute as the interpreter's
            if mode == "-c":
                sys.argv, sys.path[:2], name, source = ["-c", *argv[1:]], [""], "<string>", argv[0]
            else:
                name = main.__file__ = os.path.abspath(mode)
                sys.argv, sys.path[:2] = [mode, *argv], [os.path.dirname(os.path.realpath(mode))]
                source = Path(name).read_bytes()
            exec(compile(source, name, "exec"), main.__dict__)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        tb = e.__traceback__  # without this file's frames, which a plain interpreter does not have
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        code = 1
        if isinstance(e, KeyboardInterrupt):  # as the interpreter ends on an uncaught Ctrl-C
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    _exit(code)


class _ForkedZygote:
    """run.py's zygote (pipeline/zygote.py) for a driver that is a child of this server: forked from the driver,
    which has PRELOAD imported already, instead of `python -m pipeline.zygote` importing torch again (~4 s of CPU in
    each of the suite's ~30 runs). It starts as the zygote would -- the steps' environment, the repository as working
    directory and sys.path[0], its stdin and stdout the driver's pipes, no other file descriptor but pass_fds, the
    default signal handlers, a parent-death signal -- with every project module imported afresh (they read the
    environment when imported). Only where that is the whole difference: the driver on one thread (a fork copies no
    other) and the steps' STARTUP variables the driver's own; else Zygote's own start. The drivers the tests start
    with subprocess (kill and resume, nohup, test_run_keys' pinned runs, the GPU-check rehearsal) start theirs that
    way."""
    spawn = staticmethod(Zygote._start)
    own_script_of = staticmethod(pipeline.zygote.script_of)
    vllm = False  # this driver's zygote was forked with vLLM imported

    @staticmethod
    def script_of(argv: list):
        """pipeline.zygote.script_of, but where this driver's zygote was forked with vLLM imported (a driver of the
        vLLM venv's server, test_vllm_engine.py), a `--engine vllm` step forks from it too: the product starts those
        as processes of their own, which here would import vLLM again (~11 s of CPU each, idle)."""
        return _ForkedZygote.own_script_of(argv[:2] if _ForkedZygote.vllm else argv)

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout, self.returncode = pid, stdin, stdout, None

    @staticmethod
    def start(argv: list, env: dict, pass_fds: tuple):
        if (argv != [sys.executable, "-m", "pipeline.zygote"] or len(os.listdir("/proc/self/task")) > 1
                or _ForkedZygote.startup(env) != _ForkedZygote.startup(os.environ)):
            return _ForkedZygote.spawn(argv, env, pass_fds)
        (r_in, w_in), (r_out, w_out) = os.pipe(), os.pipe()
        for f in (sys.stdout, sys.stderr):  # what the driver printed, printed once (the fork copies its buffers)
            f.flush()
        parent = os.getpid()
        _ForkedZygote.vllm = "vllm" in sys.modules
        pid = os.fork()
        if pid == 0:
            _ForkedZygote._become(env, parent, r_in, w_out, pass_fds)
        os.close(r_in)
        os.close(w_out)
        return _ForkedZygote(pid, os.fdopen(w_in, "wb"), os.fdopen(r_out, "rb"))

    @staticmethod
    def _become(env: dict, parent: int, r_in: int, w_out: int, pass_fds: tuple):
        """In the forked child: `python -m pipeline.zygote` with stdin r_in and stdout w_out (never returns)."""
        code = 1
        try:
            die_with_parent(parent)
            os.dup2(r_in, 0)
            os.dup2(w_out, 1)
            for fd in [int(fd) for fd in os.listdir("/proc/self/fd")]:  # close_fds, as subprocess does
                if fd > 2 and fd not in pass_fds:
                    try:
                        os.close(fd)
                    except OSError:  # the listing's own descriptor, gone with it
                        pass
            import faulthandler  # the driver's (run.py registers its stacks on SIGUSR1)
            faulthandler.disable()
            faulthandler.unregister(signal.SIGUSR1)
            _as_started(env, REPO)
            for name, module in list(sys.modules.items()):
                path = getattr(module, "__file__", None) or ""
                if path.startswith(str(REPO) + os.sep) and "site-packages" not in path:  # not a venv's
                    del sys.modules[name]
            sys.path[0] = str(REPO)
            import runpy
            runpy.run_module("pipeline.zygote", run_name="__main__", alter_sys=True)
            code = 0
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            flush_and_exit(code)

    @staticmethod
    def startup(env: dict) -> list:
        """env's STARTUP items that would make a fresh zygote differ from this process: not the two that run.py gives
        its CPU steps and that matter only before they are used -- MKL_NUM_THREADS equal to OMP_NUM_THREADS (each
        step sets torch's threads, MKL's with them) and CUDA_VISIBLE_DEVICES where there is no CUDA device."""
        import torch
        same = {"MKL_NUM_THREADS": env.get("OMP_NUM_THREADS"),
                "CUDA_VISIBLE_DEVICES": None if torch.cuda.is_available() else env.get("CUDA_VISIBLE_DEVICES")}
        return sorted((k, v) for k, v in env.items() if k.startswith(STARTUP) and same.get(k, ...) != v)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("pipeline.zygote", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _as_started(env: dict, cwd):
    """In a forked child: the signal handlers a fresh interpreter has, its environment and working directory."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _exit(code):
    """End as the interpreter does -- SystemExit's code, non-daemon threads joined, atexit handlers run, the
    standard streams flushed -- but without tearing down the modules: in a fork that frees every object the
    server imported, copying each page it touches, which made it most of a short child's time."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # the interpreter's own calls at exit (neither has a public one): threading's exit hooks, which end the idle
    # workers of a thread pool left open (concurrent.futures'), then the non-daemon threads joined; then the atexit
    # handlers. (Joining the threads alone waited for such workers forever.)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.modules["__main__"].__dict__.clear()  # what the code left open is closed (and flushed) as at teardown
    gc.collect()
    flush_and_exit(code)


if __name__ == "__main__":
    import importlib
    for name in (*PRELOAD, *sys.argv[1:]):  # run()'s preload after PRELOAD
        importlib.import_module(name)
    # each vLLM engine compiles its sampler's log-prob gather, and a process's first compile checks the CPU's vector
    # ISAs in ten processes of its own (seconds): checked once here, the children inherit the answer
    if "vllm" in sys.modules:
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
        valid_vec_isa_list()
    gc.freeze()  # what the server imported, out of the children's collections (whose passes would copy its pages)
    serve(preload=(), child=_child, scripts=None)
