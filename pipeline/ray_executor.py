"""run.py --executor ray: each step's command runs as a Ray task on whichever node has
the resources it needs.

    ex = RayExecutor(address, run_dir, env, use_zygote) # connects; every node checked (check_nodes)
    ex.check_fits(demands) # a step no node can hold: one line, before anything runs
    rc, node = ex.call(argv, log_path, demand) # from a pool thread; NodeLost if its node died

The driver stays what it is (pipeline.steps.Pipeline): it plans, writes each step's inputs, commits
each step by rename and keeps the manifest. Only the step's process moves: started on the node Ray
places it on, exactly as the local executor starts it (`python script.py ...`, or a fork of a zygote
that this Ray worker keeps, on CPU), writing into the same `steps/KEY.tmp` on a filesystem every
node shares. A step whose node dies is not retried by Ray (max_retries 0): Ray would run the command
again over the half-written directory. The driver starts it again from scratch instead
(Pipeline.run_step, --ray-retries), a training stage from its last saved state, as a re-run does.

A step's environment is its node's (what `ray start` was given there) plus run.py's step settings
(threads, CPU pins, OPR_* variables); GPUs are the ones Ray assigns it (CUDA_VISIBLE_DEVICES).
"""
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from common.errors import UserError
from common.procs import die_with_parent
from pipeline.steps import NodeLost
from pipeline.zygote import HERE, Zygote, script_of

RETRIES = 3  # run.py --ray-retries: fresh starts of a step whose node died
GEN_KINDS = ("eval", "rollout", "synth", "ssr", "drift")  # the steps that run --gen-workers
                                                          # processes on the CPU
INSTALL = "pip install 'ray==2.60.*'"


def demand(kind: str, threads: int, gen_workers: int, gpus: int) -> dict:
    """What one step of `kind` holds while it runs, in Ray's resource names: on GPUs the node's
    --gpus (the local executor gives every step the whole node too); on the CPU its threads, times
    the workers of a generating step."""
    if gpus:
        return {"CPU": 1, "GPU": gpus}
    return {"CPU": threads * (gen_workers if kind in GEN_KINDS else 1)}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _node_facts(token_path: str, token: str, code: dict, python: str) -> dict:
    """Runs on each node (check_nodes): what this node sees of the run directory, the code and the
    interpreter, and what its CPU steps' floats depend on. Problems come back as text; the driver
    refuses with them."""
    import kernels
    problems = []
    try:
        seen = Path(token_path).read_text()
    except OSError:
        seen = None
    if seen != token:
        problems.append(f"does not see {Path(token_path).parent} (the run directory must be on a "
                        f"filesystem every node shares, at the same path)")
    changed = [name for name, d in code.items()
               if not (HERE / name).is_file() or _digest(HERE / name) != d]
    if changed:
        problems.append(f"has other code at {HERE} ({', '.join(changed)}): "
                        f"every node must run the same checkout")
    if not Path(python).is_file():
        problems.append(f"has no {python}: every node must have the driver's Python "
                        f"at the same path")
    import torch
    return dict(host=socket.gethostname(), problems=problems,
                cpu=dict(model=kernels.cpu_model(), isa=torch.backends.cpu.get_cpu_capability()))


def _run(argv: list, log_path: str, env_extra: dict, use_zygote: bool):
    """The Ray task: one step's command on this node, its output to log_path
    -> (exit code, node id, host). Cancelled (the driver is stopping), it stops the step's process
    group as the local executor does."""
    import ray
    env = {**os.environ, **env_extra}
    pid = {}
    script = script_of(argv)
    proc = None
    try:
        if use_zygote and script is not None:
            rc = _zygote(env).run(script, argv[2:], Path(log_path), env,
                                  on_start=lambda p: pid.update(p=p))
        else:
            with open(log_path, "w") as log:
                parent = os.getpid()
                proc = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE,
                    preexec_fn=lambda: die_with_parent(parent, new_session=True))
            pid["p"] = proc.pid
            while (rc := proc.poll()) is None:  # a wait in C would not see ray.cancel's interrupt
                time.sleep(0.2)
    except BaseException:  # ray.cancel: SIGTERM to the step's group, SIGKILL after 10 s
        if "p" in pid:
            gone = ((lambda: proc.poll() is not None) if proc is not None
                    else (lambda: not _alive(pid["p"])))
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(pid["p"], sig)
                except (ProcessLookupError, PermissionError):
                    break
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not gone():
                    time.sleep(0.1)
        raise
    return rc, ray.get_runtime_context().get_node_id(), socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


_ZYGOTES = {}  # this Ray worker's zygote per step environment: CPU steps start as its
               # forks, as on the driver


def _zygote(env: dict) -> Zygote:
    key = tuple(sorted(env.items()))
    if key not in _ZYGOTES or _ZYGOTES[key].proc.poll() is not None:
        _ZYGOTES[key] = Zygote(env)
    return _ZYGOTES[key]


class RayExecutor:
    def __init__(self, address: str | None, run_dir: Path, env_extra: dict, use_zygote: bool,
                 cpu: dict):
        try:
            import ray
        except ImportError:
            raise UserError(f"--executor ray: needs the ray package; {INSTALL}") from None
        self.ray = ray
        self.env_extra = {**{k: v for k, v in os.environ.items() if k.startswith("OPR_")},
                          **env_extra}
        self.use_zygote = use_zygote
        _reachable(address)
        try:  # the scripts' directory on every worker's path, for this module's tasks
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     logging_level="ERROR", runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}})
        except ConnectionError as e:
            raise UserError(f"--ray-address {address}: no Ray cluster there ({e})") from None
        self.task = ray.remote(max_retries=0)(_run)
        self.refs, self.lock, self.stopping = set(), threading.Lock(), False
        self.check_nodes(run_dir, cpu)

    def nodes(self) -> list[dict]:
        return [n for n in self.ray.nodes() if n.get("Alive")]

    def check_nodes(self, run_dir: Path, cpu: dict):
        """Every node sees the run directory and the same code and Python, and its CPU rounds as the
        driver's does (cpu: the run's numerics["cpu"]; the CPU model is part of every step's key
        unless --portable's pins make it not matter): else one line naming the node, before anything
        runs. The probe file goes where the run directory is, or will be (its nearest existing
        ancestor), so a refused run writes nothing."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        where = next(p for p in (run_dir, *run_dir.parents) if p.is_dir())
        token_path = where / f".opr-ray-check-{os.getpid()}"
        token = os.urandom(8).hex()
        token_path.write_text(token)
        code = {name: _digest(HERE / name)
                for name in ("run.py", "train.py", "pipeline/ray_executor.py")}
        nodes = self.nodes()
        try:
            facts = self.ray.get([
                self.ray.remote(num_cpus=0, max_retries=0)(_node_facts).options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
                ).remote(str(token_path), token, code, sys.executable) for n in nodes])
        finally:
            token_path.unlink(missing_ok=True)
        for n, f in zip(nodes, facts):
            where = (f"--executor ray: node {f['host']} ({n['NodeManagerAddress']}, "
                     f"{n['NodeID'][:12]})")
            if f["problems"]:
                raise UserError(f"{where} {'; '.join(f['problems'])}")
            if "model" in cpu and f["cpu"] != {k: cpu[k] for k in ("model", "isa")}:
                raise UserError(f"{where} has another CPU ({f['cpu'].get('model')}, "
                                f"driver: {cpu.get('model')}): its steps would round differently; "
                                f"use --portable, or nodes of one CPU model")

    def check_fits(self, demands: dict):
        """demands: step key -> demand(). A step that no node of the cluster can hold would wait
        forever: refused in one line, before anything runs."""
        sizes = [n["Resources"] for n in self.nodes()]
        for key, need in demands.items():
            if not any(all(size.get(r, 0) >= v for r, v in need.items()) for size in sizes):
                have = max(sizes, key=lambda s: (s.get("GPU", 0), s.get("CPU", 0)), default={})
                raise UserError(f"--executor ray: step {key} needs {_res(need)}, "
                                f"and no node of the cluster has that (the largest: {_res(have)}); "
                                f"lower --threads / --gen-workers / --gpus, or add a larger node")

    def call(self, argv, log_path: Path, need: dict) -> tuple[int, str | None]:
        """Run one step's command on a node with `need` free -> (exit code, "host node-id");
        NodeLost when its node died under it. Once cancel() began, nothing more starts
        (an exit code as of SIGTERM)."""
        with self.lock:  # a step submitted after cancel() took its list would run on, unseen
            if self.stopping:
                return -signal.SIGTERM, None
            ref = self.task.options(num_cpus=need.get("CPU", 1),
                                    num_gpus=need.get("GPU", 0)).remote(
                [str(a) for a in argv], str(log_path), self.env_extra, self.use_zygote)
            self.refs.add(ref)
        try:
            rc, node, host = self.ray.get(ref)
        except self.ray.exceptions.TaskCancelledError:
            return -signal.SIGTERM, None
        except (self.ray.exceptions.NodeDiedError, self.ray.exceptions.WorkerCrashedError,
                self.ray.exceptions.LocalRayletDiedError) as e:
            if self.stopping:  # cancel(force=True) ends a worker so: the driver's own
                               # stop, not a lost node
                return -signal.SIGKILL, None
            raise NodeLost(str(e).strip().splitlines()[0].split(". ")[0][:200]) from None
        finally:
            with self.lock:
                self.refs.discard(ref)
        return rc, f"{host} {node}"

    def cancel(self):
        """Stop every running step (the driver is stopping) and start no more: cancelled, their
        tasks stop the steps' process groups (SIGTERM, SIGKILL after 10 s); what is left after that
        goes with its worker."""
        with self.lock:
            self.stopping = True
            refs = list(self.refs)
        for ref in refs:
            self.ray.cancel(ref)
        deadline = time.monotonic() + 25
        while self.refs and time.monotonic() < deadline:
            time.sleep(0.1)
        with self.lock:
            refs = list(self.refs)
        for ref in refs:
            self.ray.cancel(ref, force=True)

    def close(self):
        self.ray.shutdown()


def _reachable(address: str | None):
    """A HOST:PORT that takes no connection is one line at once
    (ray.init would retry it for minutes)."""
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except (OSError, ValueError) as e:
        raise UserError(f"--ray-address {address}: no Ray cluster there ({e})") from None


def _res(r: dict) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(r.items()) if k in ("CPU", "GPU")) or "nothing"
