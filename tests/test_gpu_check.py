"""bench/gpu_check.sh's CPU rehearsal (REHEARSAL=1): the lent GPU's one call, its control flow run here at tiny shapes
so that a change to the script is checked before a lease, not during one. The parts, their order and caps, the budget
arithmetic, what a cut part still reports, the files that come back (at most 8, flat: the device tool's limit), and
the one-line aborts before any part runs."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FILES = {"gpu_check.txt", "train.txt", "engine.txt", "run.txt", "tests.txt", "gap.txt", "bench.jsonl", "report.md"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("gpu_check")
    write_random_tiny(root / "base")
    return root


def check(base: Path, out: Path, *parts, **env) -> subprocess.CompletedProcess:
    e = {**os.environ, "REHEARSAL": "1", "BASE": str(base / "base"), "OPR_CACHE": str(base / "cache"),
         "OMP_NUM_THREADS": "1", "RUN_DIR": str(out.parent / (out.name + "-run")), **env}
    return subprocess.run(["bash", "bench/gpu_check.sh", str(out), *parts], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=600)


def test_rehearsal_runs_every_part_in_order_and_brings_back_eight_flat_files(base):
    out = base / "full"
    p = check(base, out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert {f.name for f in out.iterdir()} == FILES and all(f.is_file() for f in out.iterdir())
    log = (out / "gpu_check.txt").read_text()
    started = re.findall(r"gpu_check.sh: (\w+) \(at most (\d+)s\)", log)
    assert [name for name, _ in started] == ["train", "engine", "run", "tests", "gap"]
    caps = dict(started)
    assert (caps["train"], caps["engine"], caps["run"], caps["tests"]) == ("150", "100", "80", "100")
    elapsed = int(re.search(r"tests exit 0 after (\d+)s in all", log).group(1))
    assert 450 - elapsed - 1 <= int(caps["gap"]) <= 450 - elapsed  # the last part gets what is left of BUDGET
    assert all(f"{name} exit 0" in log for name, _ in started)
    rows = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [r.get("compiled") for r in rows if r.get("kind") == "train"] == [False, False]  # rehearsal: eager twice
    assert [(r["batch"], r["new_tokens"] > 0) for r in rows if r.get("kind") == "rollout"] == [
        ("mix", True), (1, True), (3, True)]
    run = (out / "run.txt").read_text()
    steps = int(re.search(r"; (\d+) steps \(", run).group(1))
    assert steps <= 12  # the run part's plan fits its 80 s on a GPU
    assert "== results.json" in run and "run.py: done" in run and (out / "report.md").stat().st_size > 0
    tests = (out / "tests.txt").read_text()  # the GPU suite collects and skips here: nothing ran, nothing failed
    assert re.search(r"= (\d+) skipped in ", tests) and "passed" not in tests and "failed" not in tests
    assert "| fp32 |" in (out / "gap.txt").read_text()


def test_a_cut_part_says_so_keeps_its_output_and_the_rest_go_on(base):
    out = base / "cut"
    p = check(base, out, "run,gap", CAP_run="2")  # run.py cannot start a pipeline in 2 s
    assert p.returncode == 1
    log = (out / "gpu_check.txt").read_text()
    assert "run (at most 2s)" in log and "run exit 124" in log and "gap exit 0" in log
    assert "gpu_check.sh: run cut off after 2s" in (out / "run.txt").read_text()
    assert {f.name for f in out.iterdir()} <= FILES


def test_parts_without_budget_are_skipped(base):
    out = base / "skip"
    p = check(base, out, "train,engine", BUDGET="15")
    assert p.returncode == 1
    for name in ("train", "engine"):
        assert re.fullmatch(rf"gpu_check.sh: {name} skipped, -?\d+s of the budget left\n", (out / f"{name}.txt").read_text())
    assert not (out / "bench.jsonl").exists()


@pytest.mark.parametrize("case", ["no-cuda", "no-base", "incomplete-base", "missing-wheel"])
def test_preconditions_abort_in_one_line_before_any_part(base, tmp_path, case):
    env = {}
    if case == "no-cuda":
        env = {"REHEARSAL": ""}
    elif case == "no-base":
        env = {"BASE": str(tmp_path / "nowhere")}
    elif case == "incomplete-base":
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "config.json").write_text("{}")
        env = {"BASE": str(tmp_path / "b")}
    else:  # a wheel that did not travel: rapidfuzz, which data.metrics imports
        (tmp_path / "rapidfuzz").mkdir()
        (tmp_path / "rapidfuzz" / "__init__.py").write_text("raise ImportError(\"No module named 'rapidfuzz'\")\n")
        env = {"PYTHONPATH": str(tmp_path)}
    out = tmp_path / "out"
    p = check(base, out, **env)
    assert p.returncode == 2
    aborts = [line for line in p.stdout.splitlines() if line.startswith("gpu_check.sh: abort: ")]
    assert len(aborts) == 1, p.stdout
    want = {"no-cuda": "no CUDA device visible", "no-base": "has no config.json",
            "incomplete-base": "has no model.safetensors", "missing-wheel": "No module named 'rapidfuzz'"}[case]
    assert want in aborts[0]
    assert {f.name for f in out.iterdir()} == {"gpu_check.txt"}  # no part ran
