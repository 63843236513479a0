"""run.py --executor ray on Ray's own multi-node harness (ray.cluster_utils.Cluster: a head and a second node, 1 CPU
each, every node bound to 127.0.0.1 by RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; nothing reaches another address).

A small run (2 tasks x 2 methods x 2 seeds: 22 steps) under the local executor is the reference. The same command
under --executor ray, with the second node removed while a step runs on it, must finish with the local run's
results and the same bytes in every checkpoint, evaluation and buffer; the manifest records that steps ran on both
nodes, and the lost step was started again. A step larger than every node, a cluster that is not there and Ray
missing are each one line with nothing written; what a node must see (the run directory, the same code) is checked
by the function that runs on each node.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import forkserver

# every node of the harness binds 127.0.0.1: Ray reads this when it is imported, so before the import
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
# files that hold their run directory's path or wall times: compared through results.json / without "source"
PATHS_OR_TIMES = {"log.txt", "scores.json", "drift.json", "rollouts_summary.json", "train_summary.json",
                  "train_log.jsonl", "buffer.jsonl", "mixture.jsonl"}


def command(base: Path, out: Path, *extra) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), "--model", str(base), "--tasks", "C-STANCE,Py150",
            "--methods", "sft,opr-ru", "--seeds", "0,1", "--n-train", "8", "--eval-limit", "4", "--epochs", "1",
            "--global-batch", "4", "--lr", "1e-4", "--max-new-tokens", "6", "--rho", "0.5", "--eval-repeats", "1",
            "--drift-limit", "4", "--quiet", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from model.base import write_random_tiny
    from ray.cluster_utils import Cluster
    root = tmp_path_factory.mktemp("ray")
    write_random_tiny(root / "base")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, object_store_memory=80 << 20))
    second = cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
    cluster.wait_for_nodes()
    yield dict(root=root, base=root / "base", env=env, cluster=cluster, second=second)
    cluster.shutdown()


def run(world, out, *extra):
    return forkserver.run(command(world["base"], out, *extra), cwd=REPO, env=world["env"], capture_output=True,
                          text=True, timeout=900)


def test_a_step_larger_than_every_node_is_refused_before_anything_runs(world):
    out = world["root"] / "too-big"
    p = run(world, out, "--executor", "ray", "--ray-address", world["cluster"].address, "--threads", "2")
    assert p.returncode == 2, p.stderr[-3000:]
    line = p.stderr.strip().splitlines()[-1]
    assert "needs 2 CPU" in line and "the largest: 1 CPU" in line and "--threads" in line, line
    assert not out.exists() and not list(world["root"].glob(".opr-ray-check-*"))


def test_no_cluster_at_the_address_is_one_line(world):
    out = world["root"] / "nowhere"
    p = run(world, out, "--executor", "ray", "--ray-address", "127.0.0.1:1")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith("run.py: error: --ray-address 127.0.0.1:1"), p.stderr[-2000:]
    assert not out.exists()


def test_ray_missing_is_one_line(world, tmp_path):
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    env = dict(world["env"], PYTHONPATH=str(tmp_path))
    p = forkserver.run(command(world["base"], tmp_path / "out", "--executor", "ray"), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == ("run.py: error: --executor ray: needs the ray package; "
                                                 "pip install 'ray==2.60.*'"), p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_what_a_node_must_see(tmp_path):
    """The check each node runs: the run directory through the shared filesystem, the driver's code and Python."""
    from pipeline.ray_executor import _digest, _node_facts
    token = tmp_path / ".opr-ray-check-1"
    token.write_text("abc")
    code = {"run.py": _digest(REPO / "run.py")}
    assert _node_facts(str(token), "abc", code, sys.executable)["problems"] == []
    problems = _node_facts(str(token), "other", {"run.py": "0" * 64}, "/nonexistent/python")["problems"]
    assert len(problems) == 3
    assert problems[0].startswith(f"does not see {tmp_path} (the run directory must be on a filesystem every node")
    assert problems[1].startswith("has other code at") and "(run.py)" in problems[1]
    assert problems[2].startswith("has no /nonexistent/python")


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _step_on(raylet: int) -> str | None:
    """A step process (a forked step is named after its script) that descends from this raylet, or None."""
    for d in os.listdir("/proc"):
        try:
            name = Path(f"/proc/{d}/comm").read_text().strip() if d.isdigit() else ""
        except OSError:
            continue
        if name.endswith(".py"):
            p = int(d)
            while p > 1:
                p = _parent(p)
                if p == raylet:
                    return name
    return None


def _step_files(run_dir: Path) -> dict:
    """{step: {file: sha256}} of the manifest, without the files that hold paths or times."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return {k: {f: h for f, h in r["files"].items() if Path(f).name not in PATHS_OR_TIMES}
            for k, r in manifest.items()}


def _buffers(run_dir: Path) -> dict:
    return {p.parent.name: [{k: v for k, v in json.loads(l).items() if k != "source" or v == "gold"}
                            for l in p.read_text().splitlines()]
            for p in sorted((run_dir / "steps").glob("*/buffer.jsonl"))}


def test_ray_run_with_a_lost_node_equals_the_local_run(world):
    from ray._private import ray_constants
    local, remote = world["root"] / "local", world["root"] / "remote"
    p = run(world, local, "--jobs", "2")
    assert p.returncode == 0, p.stderr[-3000:]

    cluster, second = world["cluster"], world["second"]
    raylet = second.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    # once a step has committed from the second node, remove it while it runs another. Ray may give the second node
    # no step after its first commit before the run ends: that run did not reach the scenario, so it is done again
    # from an empty directory, at most 3 times
    for _ in range(3):
        shutil.rmtree(remote, ignore_errors=True)
        proc = subprocess.Popen(command(world["base"], remote, "--executor", "ray", "--ray-address",
                                        cluster.address),
                                cwd=REPO, env=world["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline, running = time.monotonic() + 300, None
        while running is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            try:
                manifest = json.loads((remote / "manifest.json").read_text())
            except (OSError, ValueError):
                continue
            if any(r.get("node", "").endswith(second.node_id) for r in manifest.values()):
                running = _step_on(raylet)
        if running or proc.poll() is None:
            break
        proc.communicate(timeout=60)
    assert running, "no step ran on the second node"
    cluster.remove_node(second)  # the raylet, its workers and (parent-death signal) the step they started
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "its node was lost (Task failed because the node it was running on is dead or unavailable" in err
    assert "running it again (2 of 4)" in err

    a, b = json.loads((local / "results.json").read_text()), json.loads((remote / "results.json").read_text())
    assert a["methods"] == b["methods"] and a["tasks"] == b["tasks"] and a["test_idx"] == b["test_idx"]
    assert any(v > 0 for m in a["methods"].values() for r in m["seeds"].values() for row in r["matrix"]
               for v in row), "Py150's graded scores: numbers to compare"
    assert _step_files(local) == _step_files(remote)  # every checkpoint, prediction and rollout file, byte for byte
    assert _buffers(local) == _buffers(remote)
    nodes = {r["node"].split()[-1] for r in json.loads((remote / "manifest.json").read_text()).values()
             if "node" in r}
    assert second.node_id in nodes and len(nodes) == 2, nodes  # steps landed on both nodes
    assert all("node" not in r for r in json.loads((local / "manifest.json").read_text()).values())
