"""A zygote for run.py's steps: one process imports torch and the pipeline's scripts once, then
forks a child per step, so a step starts in milliseconds instead of paying for `import torch` (and
the scripts' own imports) again: the default runs over a hundred short steps, and those imports
would be a large share of its wall time (BENCHMARKS.md, "The default `python run.py`: wall time,
and where it goes").

    zygote = Zygote(env, pass_fds=(lock_fd,))      # started by the driver's main thread
    rc = zygote.run("evaluate", ["--ckpt", ...], log_path,
                    on_start=lambda pid: ...)   # from any thread
    zygote.close()

A child behaves like `python <script>.py ARGS` started by subprocess with the same environment (ps
and top show it as `<script>.py`; its /proc/PID/cmdline stays the zygote's): it leads its own
process group (setsid, so the driver can stop it and everything it started), is SIGKILLed by the
kernel when the zygote dies (PR_SET_PDEATHSIG; the zygote dies the same way with the driver), has
stdin on /dev/null and stdout + stderr in its log file, runs the script's main() under
common.cli.main_cli, and exits with the script's exit code (negative signal numbers as subprocess
reports them). Numerics are unchanged: the zygote is started with the steps' environment
(OMP_NUM_THREADS is read when torch is imported) and every child sets torch's thread count again.

Protocol, JSON lines: driver -> zygote {"id", "script", "argv", "log", "env"}; zygote -> driver
{"id", "pid"} when the child is forked and {"id", "rc"} when it has exited. The zygote exits
when its stdin closes.
"""
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

from common.procs import die_with_parent
from pipeline.specs import Spec

HERE = Path(__file__).resolve().parents[1]
# every step's script
SCRIPTS = tuple(c.SCRIPT.removesuffix(".py") for c in Spec.__subclasses__() if c.SCRIPT)
# what the steps import, each once here instead of once per step. torch._dynamo: building a model on
# the meta device imports it (nn.Embedding's normal_ runs through torch's Python reference kernels),
# so every model-loading step would pay for it; rouge_score: every step that scores a ROUGE task
# (BENCHMARKS.md, "The default `python run.py`")
PRELOAD = ("torch", "numpy", "safetensors.torch", "tokenizers", "tqdm", "model.checkpoint",
           "engine.native", "engine.sampling", "model.logprobs", "model.tokenizer", "data.metrics",
           "data.conventions", "data.trace", "data.replay", "kernels.attention",
           "kernels.cross_entropy", "torch.distributed.fsdp", "torch._dynamo",
           "rouge_score.rouge_scorer", "sacrebleu.tokenizers.tokenizer_13a", *SCRIPTS)
_PR_SET_NAME = 15


def script_of(argv: list) -> str | None:
    """The script (one of SCRIPTS) a step's command runs, if the zygote can fork it: `python
    <HERE>/<script>.py ...`, not sampling with vLLM (`--engine vllm`: vLLM builds its engine, its
    threads and on GPUs its processes, in a process of its own). None: the step starts as its own
    process."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    script = Path(argv[1])
    if script.parent != HERE or script.stem not in SCRIPTS:
        return None
    vllm = any(a == "--engine" and b == "vllm" for a, b in zip(argv, argv[1:]))
    return None if vllm else script.stem


def _prctl_name(name: str):
    """The process name that ps, top and /proc/PID/comm show (15 bytes at most): a forked step shows
    its script (its command line stays the zygote's)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15])


# --------------------------------------------------------------------------------------------------
# The driver's side


class Zygote:
    def __init__(self, env: dict, pass_fds=(), server=("-m", "pipeline.zygote"),
                 python=sys.executable):
        self.proc = self._start([python, *server], env, tuple(pass_fds))
        self.lock = threading.Lock()
        self.waiting = {}  # id -> {"started": Event, "done": Event, "pid", "rc"}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _start(argv: list, env: dict, pass_fds: tuple) -> subprocess.Popen:
        """The zygote's process, its stdin and stdout piped to this one (the tests' fork server
        forks it from a driver it started instead: tests/forkserver.py)."""
        parent = os.getpid()  # the zygote dies with the thread that starts it
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                cwd=HERE, pass_fds=pass_fds,
                                preexec_fn=lambda: die_with_parent(parent))

    def run(self, script: str, argv: list, log_path: Path, env: dict, on_start=None,
            **fields) -> int:
        """Run `script` (one of SCRIPTS) with argv in a forked child; on_start(pid) once it exists.
        Returns the exit code; -9 (as if SIGKILLed) when the zygote itself is gone. `fields` go
        into the request as they are (for a server with a child function of its own)."""
        with self.lock:
            i, self.next_id = self.next_id, self.next_id + 1
            w = self.waiting[i] = {"started": threading.Event(), "done": threading.Event(),
                                   "pid": None, "rc": -9}
            try:
                self.proc.stdin.write((json.dumps(
                    {"id": i, "script": script, "argv": [str(a) for a in argv],
                     "log": str(log_path), "env": env, **fields}) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                w["started"].set()
                w["done"].set()
        while not w["started"].wait(0.2):  # timed waits: an interrupt of this thread
                                           # (Ctrl-C, ray.cancel) is seen
            pass
        if w["pid"] is not None and on_start is not None:
            on_start(w["pid"])
        while not w["done"].wait(0.2):
            pass
        with self.lock:
            self.waiting.pop(i, None)
        return w["rc"]

    def _read(self):
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                w = self.waiting.get(msg["id"])
            if w is None:
                continue
            if "pid" in msg:
                w["pid"] = msg["pid"]
                w["started"].set()
            else:
                w["rc"] = msg["rc"]
                w["started"].set()
                w["done"].set()
        with self.lock:  # EOF: the zygote is gone, and with it (PR_SET_PDEATHSIG) every child
            for w in self.waiting.values():
                w["started"].set()
                w["done"].set()

    def close(self, timeout: float = 30):
        """End the zygote: it exits once its stdin closes and its children are gone (the driver
        calls this after every step has ended). A zygote still there after `timeout` s is SIGKILLed,
        its children with it, so a driver never hangs in its own cleanup."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------------------------------
# The zygote's side


def _child(req: dict, zygote: int):
    """In the forked child: become the step (never returns)."""
    code = 1
    try:
        die_with_parent(zygote, new_session=True)
        _prctl_name(f"{req['script']}.py")
        fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(req["env"])
        import importlib

        import torch
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from common.cli import main_cli
        name = req["script"]
        sys.argv = [str(HERE / f"{name}.py"), *req["argv"]]
        module = importlib.import_module(name)
        main_cli(module.main, f"{name}.py")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        flush_and_exit(code)


def flush_and_exit(code: int):
    """A forked child's end: its standard streams flushed, then _exit (the zygote's atexit handlers
    and module teardown are not the child's to run)."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(code)


def serve(preload=PRELOAD, child=_child, scripts=SCRIPTS):
    """The zygote's loop: import `preload`, then fork `child(request, zygote_pid)` (which never
    returns) for each request whose script is in `scripts` (None: any)."""
    import importlib
    for name in preload:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the driver, which
                                                  # stops the steps itself
    out = sys.stdout.buffer
    children, pending = {}, b""  # pid -> request id

    def say(msg):
        out.write((json.dumps(msg) + "\n").encode())
        out.flush()

    # a child's exit wakes the loop through its pidfd (Linux 5.3+), so the driver hears of it at
    # once; without pidfds the loop polls every 50 ms, which was ~30 ms of every step's wall time
    # (BENCHMARKS.md, "The default's generation steps")
    exits = {}  # pid -> its pidfd
    open_ = True
    while open_ or children:
        ready, _, _ = select.select(([0] if open_ else []) + list(exits.values()), [], [], 0.05)
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                open_ = False  # the driver is done (or gone): finish the
                               # running children, then exit
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                req = json.loads(line)
                if scripts is not None and req["script"] not in scripts:
                    say({"id": req["id"], "rc": 2})
                    continue
                zygote = os.getpid()
                pid = os.fork()
                if pid == 0:
                    for fd in exits.values():  # its siblings' pidfds are the zygote's
                        os.close(fd)
                    child(req, zygote)
                children[pid] = req["id"]
                try:
                    exits[pid] = os.pidfd_open(pid)
                except (AttributeError, OSError):  # no pidfds here: the 50 ms poll finds its exit
                    pass
                say({"id": req["id"], "pid": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in exits:
                os.close(exits.pop(pid))
            if pid in children:
                say({"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    serve()
