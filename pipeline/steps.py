"""Pipeline steps: a DAG of subprocess steps, each committed atomically and
durably to a run directory.

    pipe = Pipeline(run_dir, jobs, env, quiet, numerics)
    key = pipe.add(kind, name, spec, deps, build,
                   reads=files)                 # content-keyed: identical work is one step
    pipe.lock_run_dir(); pipe.execute()         # runs what is not committed yet
    pipe.dir(key)                               # a step's output directory

A step's key hashes its settings, the keys of the steps it reads, the content of the files it reads
(pipeline.digest) and the numerics. Each step runs as a process of its own (a fork of the zygote on
CPU, pipeline/zygote.py) writing into `steps/KEY.tmp`, which is fsynced and renamed to `steps/KEY`
and recorded in manifest.json when the step succeeds. Signals: README, "Killing run.py".

A committed step's large files may be pruned (pipe.prune(key), run.py --keep-checkpoints;
pipeline/keep.py says which): they are deleted and their digests moved from the manifest entry's
"files" to its "pruned". The step stays done for the steps that read it already; a step not yet done
that reads it has it run again first, and a re-creation with the same bytes in the pruned files
keeps its execution id, so what read it stays done.
"""
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

from common.outputs import fsync_dir, fsync_tree, write_json
from common.errors import UserError
from common.cli import Terminated
from common.procs import die_with_parent
from pipeline.specs import fields_of
from pipeline.digest import Digests
from pipeline.zygote import Zygote, script_of

HERE = Path(__file__).resolve().parents[1]  # the scripts' directory
PARTIAL_INPUTS = ".inputs.json"  # in a step's KEY.tmp: the executions of its inputs this try
                                 # started on (_fresh_tmp)
STATUS_SECONDS = 2.0  # how often a running pipeline's progress bar asks for its status (execute)


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def read_manifest(path: Path) -> dict:
    """A run directory's manifest.json ({} when there is none):
    {key: {"kind", "seconds", "id", "inputs"}}. A damaged one (truncated, edited, not written by
    run.py) is one line saying what to do, not a traceback."""
    if not path.exists():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # truncated or not JSON (UnicodeDecodeError too)
        manifest, what = None, f"not valid JSON ({e})"
    else:
        what = "not a JSON object of {step: {kind, seconds, id, inputs}} as run.py writes it"
    if not isinstance(manifest, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("inputs", {}), dict)
            and isinstance(r.get("seconds"), (int, float))
            and not isinstance(r.get("seconds"), bool)
            for r in manifest.values()):
        raise UserError(f"{path}: {what}; it lists the steps that are done: restore it, "
                        f"or delete it to re-run every step")
    return manifest


class Pipeline:
    """A DAG of subprocess steps, executed with `jobs` in parallel, each committed
    atomically to the manifest."""

    def __init__(self, run_dir: Path, jobs: int, env: dict, quiet: bool, numerics: dict):
        self.run_dir, self.jobs, self.env, self.quiet, self.numerics = (
            run_dir, jobs, env, quiet, numerics)
        self.steps = {}  # key -> dict(kind, name, deps, build)
        self.digests = Digests(run_dir / "digests.json")
        self.manifest_path = run_dir / "manifest.json"
        self.manifest = read_manifest(self.manifest_path)
        self.lock = threading.Lock()
        self.procs = set()  # running step processes (each the leader of its own process group)
        self.stopping = False  # set by stop_children: a step that starts after it is killed at once
        self.lock_fd = None
        # CPU steps start as forks of one process that has imported torch and the scripts
        # (pipeline/zygote.py); OPR_NO_ZYGOTE=1 starts each as its own `python script.py` instead
        # (slower, same results)
        self.use_zygote = os.environ.get("OPR_NO_ZYGOTE", "") in ("", "0")
        self.zygote = None
        self.warned = set()  # steps whose changed outputs were reported (intact)
        self.outputs_of = {}  # kind -> files a step of that kind must have written to succeed
                              # (run.py's STEP_OUTPUTS; "a|b": either)
        self.prunable = {}  # kind -> glob patterns (relative to a step's directory) of the
                            # files prune() deletes
        # start ready steps that are not trainings before ready trainings, so that what reads a
        # checkpoint runs soon and the checkpoint can be pruned (run.py --keep-checkpoints last);
        # else in the order the steps were added
        self.readers_first = False
        # where step processes run: None = here (local processes, the zygote on CPU); else an object
        # with call(argv, log_path, demand) -> (exit code, node) and cancel()
        # (pipeline/ray_executor.py)
        self.executor = None
        self.demand = lambda kind: {}  # kind -> the resources a step of that kind holds
                                       # (the executor's names)
        self.retries = 0  # fresh starts of a step whose node was lost
                          # (the executor raises NodeLost)

    def add(self, kind: str, name: str, spec, deps: list[str], build, reads=()) -> str:
        """Register a step; `build(tmp_dir, dep_dirs) -> argv` writes its inputs and returns the
        command that fills tmp_dir (or None when build itself produced the output). `spec` holds
        every setting that changes the step's numbers (a pipeline.specs type), `deps` the steps
        whose outputs it reads, `reads` the other files and directories it reads (their content goes
        into the key). Returns the step key (identical inputs -> identical keys -> run once)."""
        read = self.digests.of(reads)
        key = f"{name}-{stable_hash([kind, fields_of(spec), deps, self.numerics, read])}"
        self.steps.setdefault(key, dict(kind=kind, deps=deps, build=build, spec=spec,
                                        reads=list(reads), read=read))
        return key

    def dir(self, key: str) -> Path:
        return self.run_dir / "steps" / key

    def committed(self) -> set:
        """The steps that are done: in the manifest, their directory present, every input done, and
        each input the very execution the step read."""
        memo = {}

        def done(key):
            if key not in memo:
                rec = self.manifest.get(key)
                memo[key] = (rec is not None and self.dir(key).is_dir() and self.intact(key, rec)
                             and all(done(d)
                                     and rec.get("inputs", {}).get(d) == self.manifest[d].get("id")
                                     for d in self.steps[key]["deps"]))
            return memo[key]
        committed = {k for k in self.steps if done(k)}
        # a pruned step stays done for the steps that read it already; one that a step still to run
        # reads runs again first (and so may the pruned steps it reads in turn)
        while need := {d for k in self.steps if k not in committed for d in self.steps[k]["deps"]
                       if d in committed and self.pruned(d)}:
            committed -= need
        return committed

    def pruned(self, key: str) -> bool:
        """Whether a committed step's prunable files were deleted (prune)."""
        return bool(self.manifest.get(key, {}).get("pruned"))

    def prune(self, key: str) -> bool:
        """Delete a committed step's prunable files (self.prunable[kind]: a checkpoint's weights),
        recorded first: their digests move from the manifest entry's "files" to its "pruned", so the
        step still verifies (intact) and a step that needs them again re-runs it (committed). False
        when there was nothing to delete."""
        rec, d = self.manifest[key], self.dir(key)
        paths = sorted({p for pattern in self.prunable.get(rec["kind"], ())
                        for p in d.glob(pattern) if p.is_file()})
        if not paths:
            return False
        with self.lock:  # recorded before the files go: a kill in between leaves files
                         # that intact() accepts
            pruned = dict(rec.get("pruned", {}))
            for p in paths:
                rel = str(p.relative_to(d))
                digest = rec["files"].pop(rel, None) if "files" in rec else None
                pruned[rel] = digest or pruned.get(rel) or self.digests.file(p)
            rec["pruned"] = pruned
            write_json(self.manifest_path, self.manifest)
        for p in paths:
            self.digests.cache.pop(str(p.resolve()), None)
            p.unlink(missing_ok=True)
        fsync_dir(d)
        return True

    def outputs(self, key: str) -> dict:
        """{relative path: sha256} of every file of a step's directory (pipeline.digest's cache:
        a file is read again only when its size, times or inode changed)."""
        d = self.dir(key)
        return {str(p.relative_to(d)): self.digests.file(p)
                for p in sorted(d.rglob("*")) if p.is_file()}

    def intact(self, key: str, rec: dict) -> bool:
        """A committed step's files are the ones it committed (their digests are in its manifest
        entry): one edited, truncated, emptied, removed or added by hand makes the step not done, so
        it runs again (and every step that read it), with one line saying so."""
        try:
            now = self.outputs(key)
        except OSError:
            now = None
        if now is not None and rec.get("pruned"):  # a prune stopped between its
                                                   # record and its delete
            now = {f: h for f, h in now.items() if rec["pruned"].get(f) != h}
        if now is not None and now == rec.get("files"):
            return True
        if key not in self.warned:
            self.warned.add(key)
            now, was = now or {}, rec.get("files")
            changed = sorted(f for f in set(was or {}) | set(now)
                             if (was or {}).get(f) != now.get(f))
            what = (f"{', '.join(changed[:3]) or 'its files'} changed since the step committed"
                    if was is not None else "no record of its files")
            print(f"run.py: {self.dir(key)}: {what}; running it again", file=sys.stderr, flush=True)
        return False

    def run_step(self, key: str):
        step, final = self.steps[key], self.dir(key)
        tmp = final.with_name(final.name + ".tmp")
        t0 = time.time()
        ids = {d: self.manifest[d].get("id") for d in step["deps"]}
        for attempt in range(1, self.retries + 2):
            self._fresh_tmp(step, tmp, ids)
            argv = step["build"](tmp, {d: self.dir(d) for d in step["deps"]})
            try:
                rc, node = self.call(argv, tmp / "log.txt", step["kind"]) if argv else (0, None)
                break
            except NodeLost as e:  # (--executor ray) not a failure of the step: it
                                   # runs again, elsewhere
                if self.stopping:
                    raise StepFailed(f"step {key}: stopped with the run") from None
                try:  # a node that could hold it may have been the one lost: then
                      # it would wait forever
                    self.executor.check_fits({key: self.demand(step["kind"])})
                except UserError as why:
                    raise StepFailed(f"step {key}: its node was lost ({e}), and {why}") from None
                if attempt > self.retries:
                    raise StepFailed(f"step {key}: its node was lost {attempt} times ({e}); "
                                     f"the finished steps are kept, "
                                     f"re-run the same command to continue") from None
                print(f"run.py: step {key}: its node was lost ({e}); running it again "
                      f"({attempt + 1} of {self.retries + 1})", file=sys.stderr, flush=True)
        if rc != 0:
            raise StepFailed(f"step {key} {failure(rc, tmp / 'log.txt')}; "
                             f"full log: {tmp / 'log.txt'}")
        (tmp / PARTIAL_INPUTS).unlink(missing_ok=True)  # the try's bookkeeping, not an output
        self._check_reads(key, step)
        missing = [f for f in self.outputs_of.get(step["kind"], ())
                   if not any((tmp / alt).is_file() for alt in f.split("|"))]
        if missing:  # exit 0 without its outputs (a user scorer that called
                     # sys.exit(0)): never committed
            raise StepFailed(f"step {key} exited 0 without writing "
                             f"{', '.join(f.replace('|', ' or ') for f in missing)}"
                             f"; full log: {tmp / 'log.txt'}")
        fsync_tree(tmp)  # durable before the rename lists it: a power loss cannot leave a
                         # listed step truncated
        # a re-run (its directory was deleted, or it was stale): its old entry goes first, so that
        # a crash before the new one is written cannot leave the new bytes listed under the old
        # execution's id
        with self.lock:
            old = self.manifest.pop(key, None)
            if old is not None:
                write_json(self.manifest_path, self.manifest)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(final.parent)
        with self.lock:
            files = self.outputs(key)  # what a later run checks it against (intact)
            # "id" names this execution of the step, "inputs" the executions of the steps it read: a
            # step whose input was re-run since (deleted by hand, possibly different bytes on a GPU)
            # is stale, not done. A pruned step re-created with the very bytes it pruned is the
            # execution its readers read: it keeps its id
            same = old is not None and old.get("pruned") and all(
                files.get(f) == h for f, h in old["pruned"].items())
            self.manifest[key] = {"kind": step["kind"], "seconds": round(time.time() - t0, 2),
                                  "id": old["id"] if same else os.urandom(8).hex(),
                                  "inputs": {d: self.manifest[d].get("id") for d in step["deps"]},
                                  "files": files, **({"node": node} if node else {})}
            write_json(self.manifest_path, self.manifest)
            self.digests.save()
        # a re-created pruned step with other bytes: the steps that read its old
        # execution are stale now
        return bool(old is not None and old.get("pruned") and not same)

    def _check_reads(self, key: str, step: dict):
        """The files a step read hold, after it ran, the bytes its key was made of: one edited (or
        removed) while it ran would leave results that belong to other bytes than its key says, so
        the step is not committed."""
        for path, before in zip(step["reads"], step["read"]):
            try:
                now = self.digests.path(path)
            except OSError:  # (MissingFileError too)
                now = None
            if now != before:
                raise StepFailed(f"step {key}: {path} {'changed' if now else 'was removed'} while "
                                 f"the step ran (its key holds the bytes it had before); re-run "
                                 f"the same command: the step runs again on what is there now")

    @staticmethod
    def _fresh_tmp(step: dict, tmp: Path, ids: dict):
        """A step's temporary directory as a new try starts it: empty, except a stopped training
        stage's saved state, which train.py --resume continues from (the same step key, so the same
        settings and inputs; train.py checks its plan too) when it was started on the very
        executions of its inputs (ids, PARTIAL_INPUTS): after one of them ran again, the state is of
        another run and goes."""
        state, inputs = tmp / "ckpt.partial" / "state" / "progress.pt", tmp / PARTIAL_INPUTS
        same = inputs.is_file() and inputs.read_text() == json.dumps(ids, sort_keys=True)
        if step["kind"] == "train" and state.is_file() and same:
            for p in tmp.iterdir():
                if p.name not in ("ckpt.partial", PARTIAL_INPUTS):
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # any other partial output is never reused
        tmp.mkdir(parents=True, exist_ok=True)
        inputs.write_text(json.dumps(ids, sort_keys=True))

    def call(self, argv, log_path: Path, kind: str) -> tuple[int, str | None]:
        """Run one step's command, its output to log_path -> (exit code, the node that ran it:
        None when local). With an executor (--executor ray) it runs where the executor places it.
        Locally the child leads its own process group (so the driver can stop it and everything it
        started), is SIGKILLed by the kernel if the driver dies (even by SIGKILL), and holds the run
        directory's lock until it exits."""
        if self.executor is not None:
            return self.executor.call(argv, log_path, self.demand(kind))
        return self._call_local(argv, log_path), None

    def _call_local(self, argv, log_path: Path) -> int:
        script = script_of(argv)
        if self.zygote is not None and script is not None:
            child = ZygoteChild()

            def started(pid):
                child.pid = pid
                with self.lock:
                    self.procs.add(child)
                    self.kill_if_stopping(pid)
            try:
                child.rc = self.zygote.run(script, argv[2:], log_path, self.env,
                                           on_start=started)
                return child.rc
            finally:
                child.done.set()
                with self.lock:
                    self.procs.discard(child)
        with open(log_path, "w") as log:
            # the parent-death signal fires when the forking *thread* ends: a pool thread, which
            # lives until every step is done
            parent = os.getpid()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env=self.env, cwd=HERE,
                                    preexec_fn=lambda: die_with_parent(parent, new_session=True),
                                    pass_fds=(self.lock_fd,))
        with self.lock:
            self.procs.add(proc)
            self.kill_if_stopping(proc.pid)
        try:
            return proc.wait()
        finally:
            with self.lock:
                self.procs.discard(proc)

    def kill_if_stopping(self, pid: int):
        """A step whose process appeared after stop_children took its list (a fork or spawn already
        under way when Ctrl-C came) is SIGKILLed here, under self.lock, so that no step outlives the
        driver. Call with the lock."""
        if self.stopping:
            _signal_step(pid, signal.SIGKILL)

    def stop_children(self):
        """SIGTERM every running step's process group, SIGKILL what is left after 10 s; steps that
        start from now on are killed as they appear (kill_if_stopping)."""
        with self.lock:
            self.stopping = True
            procs = list(self.procs)
        if self.executor is not None:
            self.executor.cancel()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                _signal_step(p.pid, sig)
            deadline = time.monotonic() + 10
            procs = [p for p in procs if not _exited(p, deadline)]

    def lock_run_dir(self):
        """Create the run directory and hold its run.lock (flock) for as long as this driver
        or any step it started lives, so a second run.py on the same directory is refused
        instead of racing them."""
        created = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = self.run_dir / "run.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + 5  # the steps of a driver killed a moment ago
                                         # may still be exiting
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    os.close(fd)
                    raise UserError(f"{self.run_dir}: in use by another run.py (pid {holder}) "
                                    f"or a step it started; "
                                    f"stop it or wait for it, then re-run") from None
                time.sleep(0.2)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk: say where, and leave no empty run.lock
                              # (nor a run directory) behind
            os.close(fd)
            lock.unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    self.run_dir.rmdir()
            raise OSError(e.errno, e.strerror, str(lock)) from None
        self.lock_fd = fd
        self.manifest = read_manifest(self.manifest_path)

    def execute(self, on_commit=None, status=None):
        """Run every step not committed yet; on_commit(key, committed): called (in this thread)
        after step `key` commits, with the set of committed steps;
        status(running keys) -> str or None: the progress bar's postfix, asked every STATUS_SECONDS
        while steps run (None: the last committed step's key)."""
        committed = self.committed()  # grows as steps finish
        todo = [k for k in self.steps if k not in committed]
        if self.use_zygote and todo and self.executor is None:  # started by this (the main) thread:
                                                                # it dies with the driver
            self.zygote = Zygote(self.env, pass_fds=(self.lock_fd,))
        bar = tqdm(total=len(self.steps), initial=len(self.steps) - len(todo), desc="pipeline",
                   unit="step", disable=self.quiet)
        running, failure, last = {}, None, ""
        pool = ThreadPoolExecutor(self.jobs)
        _exit_on_termination_signals()  # SIGTERM/SIGHUP as Ctrl-C: its steps are
                                        # stopped first (see below)
        try:
            while (todo and failure is None) or running:
                if failure is None:  # after a failure the running steps finish, and none start
                    self._start_ready(todo, committed, running, pool)
                if not running:
                    raise RuntimeError(f"pipeline stuck: {todo[:3]} wait on steps that cannot run")
                watch = status is not None and not self.quiet
                finished, _ = wait(running, timeout=STATUS_SECONDS if watch else None,
                                   return_when=FIRST_COMPLETED)
                for fut in finished:
                    key = running.pop(fut)
                    try:
                        changed = fut.result()
                    except StepFailed as e:  # let the running steps finish (their work is
                                             # kept), start no more
                        failure = failure or e
                        if running:
                            print(f"run.py: {e}\nrun.py: waiting for {len(running)} running "
                                  f"step(s) to finish (Ctrl-C stops them)",
                                  file=sys.stderr, flush=True)
                        continue
                    last = key[:40]
                    self._record_commit(key, changed, committed, todo, bar, on_commit)
                if watch:
                    bar.set_postfix_str(status(list(running.values())) or last)
            if failure is not None:
                raise failure
        except BaseException:  # a failure, Ctrl-C, SIGTERM or a bug: no step outlives the driver
            self.stop_children()
            raise
        finally:
            pool.shutdown(wait=True)
            bar.close()
            if self.zygote is not None:
                self.zygote.close()
                self.zygote = None

    def _start_ready(self, todo: list, committed: set, running: dict, pool):
        """execute's scheduling: submit the steps of todo whose inputs are all committed, until
        `jobs` run at once (each moves from todo to running, future -> key); with readers_first,
        trainings after the others."""
        ready = [k for k in todo if all(d in committed for d in self.steps[k]["deps"])]
        if self.readers_first:
            # (stable: the plan's order else)
            ready.sort(key=lambda k: self.steps[k]["kind"] == "train")
        for key in ready:
            if len(running) >= self.jobs:
                break
            todo.remove(key)
            running[pool.submit(self.run_step, key)] = key

    def _record_commit(self, key: str, changed: bool, committed: set, todo: list, bar, on_commit):
        """execute's bookkeeping after step `key` committed (changed: run_step's result): committed
        and todo updated in place, the progress bar advanced, on_commit called."""
        committed.add(key)
        if changed:  # a pruned step re-created with other bytes: what read the old ones runs again
            stale = committed - self.committed()
            committed -= stale
            todo += [k for k in self.steps if k in stale and k not in todo]
            bar.total += len(stale)
        bar.set_postfix_str(key[:40], refresh=False)
        bar.update()
        if on_commit is not None:
            on_commit(key, committed)


class StepFailed(UserError):
    exit_code = 1


class NodeLost(Exception):
    """A step's node died under it (an executor that runs steps elsewhere): not a failure of the
    step, which may run again on another node (Pipeline.retries)."""


def failure(rc: int, log_path: Path) -> str:
    """How a step ended, for its one line: its exit code and its log's error line; a step killed by
    a signal says which (its log's last line is then wherever it was, no error), and an error line
    only if its log has one."""
    if rc >= 0:
        return f"failed (exit {rc}): {last_error(log_path)}"
    name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
    why = (" (the kernel's out-of-memory killer sends it: see dmesg)" if -rc == signal.SIGKILL
           else "")
    error = last_error(log_path, errors_only=True)
    return f"was killed by {name}{why}" + (f"; its log's last error: {error}" if error else "")


def last_error(log_path: Path, errors_only: bool = False) -> str | None:
    """The line of a step's log that says what went wrong: a script's own `x.py: error: ...` line,
    else the last `...Error: ...` line of a traceback, else the last non-empty line."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:  # a step that died before it opened its log
                               # (its zygote gone, a cancelled task)
        text = ""
    lines = [l.strip() for l in re.split(r"[\r\n]+", text) if l.strip()]
    for pattern in (r"^\S+\.py: error: ", r"^[\w.]*(Error|Exception|Interrupt)\b.*"):
        hits = [l for l in lines if re.match(pattern, l)]
        if hits:
            return hits[-1][:400]
    if errors_only:
        return None
    return lines[-1][:400] if lines else "(empty log)"


class ZygoteChild:
    """A step forked by the zygote, as stop_children sees it: a pid (its process group) and
    whether it is done."""

    def __init__(self):
        self.pid, self.rc, self.done = None, None, threading.Event()

    def wait(self, timeout=None):
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired("zygote child", timeout)
        return self.rc


def _signal_step(pid: int, sig):
    """Signal a step's process group; a step forked a moment ago may not lead its group yet
    (it calls setsid first thing, and has started nothing of its own before that), so then
    the process itself."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    except PermissionError:
        pass


def _exited(p, deadline: float) -> bool:
    try:
        p.wait(max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        return False


def _exit_on_termination_signals():
    """SIGTERM/SIGHUP end the driver like Ctrl-C does (_exit_on_signal). A signal the driver
    was started ignoring stays ignored: `nohup python run.py` survives a logout (SIGHUP),
    and so does SIGINT for a job that a non-interactive shell started with `&` (Python
    leaves it ignored too)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _exit_on_signal)


def _exit_on_signal(signum, frame):
    # main_cli exits 128 + signum (143, 129), as shells expect of a process stopped by a signal:
    # not a failed step's 1
    raise Terminated(signum, "; finished steps are kept, re-run the same command to continue")
