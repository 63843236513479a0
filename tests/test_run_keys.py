"""run.py's step keys: a table is a function of the command, its inputs and its seeds.

- Determinism: the same command with --jobs 1 on one core, every step its own `python script.py` (OPR_NO_ZYGOTE=1),
  and with --jobs 2 on two cores, every step forked from run.py's zygote (data/zygote.py), with a caller with no
  thread setting, writes a byte-identical results.json.
- Content keys: editing one answer of a data file in place (same path) re-runs exactly the steps that read it and
  the steps downstream of them; nothing else.
- The numerics (thread count) and the content of every file a step reads are part of its key (unit level).

The end-to-end runs use a tiny untrained Llama, 2 tasks x 8 training examples, methods sft, replay and opr-ru
(about half a minute each on 2 CPU cores).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TASKS = ["C-STANCE", "Py150"]
METHODS = "sft,replay,opr-ru"


def command(base: Path, data: Path, out: Path, jobs: int) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), "--model", str(base), "--data", str(data), "--tasks",
            ",".join(TASKS), "--methods", METHODS, "--eval-limit", "4", "--epochs", "1", "--global-batch", "4",
            "--lr", "1e-4", "--max-new-tokens", "6", "--rho", "0.5", "--jobs", str(jobs), "--quiet",
            "--out", str(out)]


def run(cmd, env, cores=None):
    if cores is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", cores] + cmd
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from data.embedded import write_benchmark
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("keys")
    write_random_tiny(root / "base")
    write_benchmark(root / "data", n_train=8, n_eval=2, n_test=8, tasks=TASKS)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OPR_CACHE"] = str(root / "cache")
    return dict(root=root, base=root / "base", data=root / "data", env=env)


@pytest.fixture(scope="module")
def run_one_core(setup):
    out = setup["root"] / "run_jobs1"
    run(command(setup["base"], setup["data"], out, jobs=1), dict(setup["env"], OPR_NO_ZYGOTE="1"), cores="0")
    return out


def test_results_identical_across_jobs_and_cores(setup, run_one_core):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores")
    out = setup["root"] / "run_jobs2"
    run(command(setup["base"], setup["data"], out, jobs=2), setup["env"], cores="0,1")
    a, b = (run_one_core / "results.json").read_bytes(), (out / "results.json").read_bytes()
    assert a == b
    assert sorted(manifest(run_one_core)) == sorted(manifest(out))  # the same steps, the same keys
    meta = json.loads(a)["meta"]
    assert meta["numerics"]["threads"] == 1  # the pinned default, not cores // jobs
    from kernels import NUMERICS
    assert meta["numerics"]["code"] == NUMERICS  # a kernel change that moves float results is a new key
    import torch
    assert meta["numerics"]["cpu"] == torch.backends.cpu.get_cpu_capability()  # another ISA rounds differently
    # the kernels the steps use (defaults follow what is installed; KERNELS_*_BACKEND forces one): on a CPU, these
    assert meta["numerics"]["kernels"] == {"attention": ["sdpa", False], "cross_entropy": ["chunked", False]}


def test_edited_answer_reruns_exactly_the_dependent_steps(setup, run_one_core):
    # a copy of the data and the run, so the other tests keep theirs
    data, out = setup["root"] / "data_edit", setup["root"] / "run_edit"
    shutil.copytree(setup["data"], data)
    shutil.copytree(run_one_core, out)
    cmd = command(setup["base"], data, out, jobs=2)
    p = run(cmd, setup["env"])
    before = manifest(out)
    assert "(%d already done)" % len(before) in p.stdout  # a moved copy of the data: nothing re-runs

    def edit(split, task):
        path = data / task / f"{split}.json"
        records = json.loads(path.read_text())
        records[0]["answer"] = records[0]["answer"] + " edited"
        path.write_text(json.dumps(records))  # same path, new content

    def new_steps():
        nonlocal before
        run(cmd, setup["env"])
        after = manifest(out)
        new = sorted(k.split("-")[0] + "-" + after[k]["kind"] for k in set(after) - set(before))
        before = after
        return new

    # the second task's test answers feed only its evaluations: the base's row 0 (every task), stage 1's (which
    # scores the next task too, for FWT) and stage 2's, one per method
    edit("test", TASKS[1])
    assert new_steps() == ["s0-eval", "s1-eval"] + ["s2-eval"] * 3
    # its training answers feed stage 2's training (every method) and so stage 2's evaluations and drift
    # measurements (stage 2 vs stage 1 on task 1's test prompts); stage 1, the stage-1 rollouts and the buffers
    # (built from task 1) are untouched
    edit("train", TASKS[1])
    assert new_steps() == ["s2-drift"] * 3 + ["s2-eval"] * 3 + ["s2-train"] * 3
    # the first task's training answers feed everything: stage 1, the gold buffer, the OPR scores (gold answers
    # are the RU reference), and everything downstream; the rollout reads only its prompts, yet its key follows
    # the file (and its stage-1 checkpoint changes anyway)
    edit("train", TASKS[0])
    kinds = new_steps()
    assert kinds.count("s1-train") == 1 and kinds.count("s1-rollout") == 1 and kinds.count("s1-score") == 1
    assert kinds.count("s1-replay") == 1 and kinds.count("s2-train") == 3


def test_new_scoring_rules_rescore_exactly_the_dependent_steps(setup, run_one_core):
    """data.metrics.RULES (bumped when a metric's rule changes) keys the steps that score: every evaluation and the
    OPR-RU buffer, and what follows from that buffer (opr-ru's stage-2 training, its drift and evaluation)."""
    out = setup["root"] / "run_rules"
    shutil.copytree(run_one_core, out)
    before = manifest(out)
    argv = command(setup["base"], setup["data"], out, jobs=2)[1:]
    patched = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); import data.metrics as m; m.RULES += 1; "
               f"sys.argv = {argv!r}; runpy.run_path({argv[0]!r}, run_name='__main__')")
    run([sys.executable, "-c", patched], setup["env"])
    after = manifest(out)
    new = sorted(k.split("-")[0] + "-" + after[k]["kind"] for k in set(after) - set(before))
    assert new == ["s0-eval", "s1-eval", "s1-score", "s2-drift", "s2-eval", "s2-eval", "s2-eval", "s2-train"]


def test_key_covers_numerics_and_file_content(tmp_path):
    from run import Pipeline
    f = tmp_path / "x.json"
    f.write_text("[1]")

    def key(threads, **kw):
        pipe = Pipeline(tmp_path / "run", 1, {}, True, dict(threads=threads, torch="t"))
        return pipe.add("eval", "s1-eval", dict(a=1), [], lambda *_: None, **kw)

    assert key(1, reads=[f]) == key(1, reads=[f])
    assert key(1, reads=[f]) != key(2, reads=[f])
    k = key(1, reads=[f])
    f.write_text("[2]")
    assert key(1, reads=[f]) != k
    assert key(1) != key(1, reads=[f])


def test_digest_cache_and_directories(tmp_path):
    from data.digest import Digests, file_sha256
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a")
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(b"b")
    dig = Digests(tmp_path / "digests.json")
    first = dig.path(d)
    assert dig.path(d) == first
    dig.save()
    again = Digests(tmp_path / "digests.json")  # cache reloaded: size+mtime unchanged -> cached digest
    assert again.cache[str((d / "a.bin").resolve())][2] == file_sha256(d / "a.bin")
    assert again.path(d) == first
    (d / "sub" / "b.bin").write_bytes(b"c")  # a nested file's content changes the directory's digest
    assert again.path(d) != first
    # an in-place edit of the same size with its mtime set back (touch -r, cp -p) is hashed again (ctime moved)
    f, st = d / "a.bin", (d / "a.bin").stat()
    before = again.path(d)
    f.write_bytes(b"z")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and again.path(d) != before
    shutil.copytree(d, tmp_path / "moved")
    assert again.path(tmp_path / "moved") == again.path(d)  # paths are not part of the digest
    with pytest.raises(FileNotFoundError, match="missing"):
        again.path(tmp_path / "missing")
