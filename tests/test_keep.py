"""run.py --keep-checkpoints: which checkpoints each policy keeps (pipeline/keep.py), and what the pipeline does with a
pruned step (pipeline/steps.py): it stays done for what read it, it verifies by its recorded digests, and a new step
that reads it has it run again first, keeping its execution id when the bytes come back the same (what read it stays
done) and making what read it run again when they do not (a GPU's training). Small DAGs of python -c steps; the
end-to-end run is in tests/test_run.py."""
import json
import os
import sys
from pathlib import Path

from pipeline import keep
from pipeline.steps import Pipeline


# ---- the policies --------------------------------------------------------------------------------------------------
# two chains sharing stage 1 (t1); each stage is evaluated (e*); chain B's stage 2 reads a buffer scored from the
# rollouts of t1 (r1 -> s1); drift of stage 2 reads both stages' checkpoints
DEPS = {"t1": [], "e1": ["t1"], "r1": ["t1"], "s1": ["r1"],
        "tA2": ["t1"], "eA2": ["tA2"], "dA2": ["tA2", "t1"],
        "tB2": ["t1", "s1"], "eB2": ["tB2"], "dB2": ["tB2", "t1"]}
CHAINS = [["t1", "tA2"], ["t1", "tB2"]]


def test_last_keeps_the_newest_stage_and_what_pending_steps_read():
    done = {"t1", "e1", "r1", "tA2", "eA2", "dA2"}  # chain B's stage 2 not trained yet: t1 stays for it
    assert keep.kept("last", CHAINS, DEPS, done) & done == {"t1", "tA2"}
    done |= {"s1", "tB2", "eB2"}  # dB2 still reads t1
    assert keep.kept("last", CHAINS, DEPS, done) == {"t1", "tA2", "tB2"}
    assert keep.kept("last", CHAINS, DEPS, set(DEPS)) == {"tA2", "tB2"}


def test_final_keeps_everything_until_the_run_is_complete():
    almost = set(DEPS) - {"dB2"}
    assert keep.kept("final", CHAINS, DEPS, almost) == keep.kept("all", CHAINS, DEPS, almost) == {"t1", "tA2", "tB2"}
    assert keep.kept("final", CHAINS, DEPS, set(DEPS)) == {"tA2", "tB2"}


def test_simulated_disk():
    """all: every checkpoint; final: every one while running, the finals at the end; last: t1 and the stage being
    trained beside the newest, here all three at once (t1 is read by dB2, the last step)."""
    assert keep.simulate("final", CHAINS, DEPS) == (3, 2)
    assert keep.simulate("last", CHAINS, DEPS) == (3, 2)
    deps = {"t1": [], "t2": ["t1"], "t3": ["t2"], "t4": ["t3"]}  # one chain: the previous stage and the one training
    assert keep.simulate("last", [["t1", "t2", "t3", "t4"]], deps) == (2, 1)
    assert keep.simulate("final", [["t1", "t2", "t3", "t4"]], deps) == (4, 1)


# ---- the pipeline with a pruned step --------------------------------------------------------------------------------
def _pipe(run_dir: Path, random_train: bool, extra: bool = False):
    """a (train) -> b (train) -> c (eval), a -> d (eval), and with `extra` a new step e (eval) that reads a. A train
    step writes w.bin (what is pruned: its name and what it read, plus random bytes when random_train)."""
    pipe = Pipeline(run_dir, 1, dict(os.environ, OPR_NO_ZYGOTE="1"), True, {})
    pipe.use_zygote = False
    pipe.prunable = {"train": ["w.bin"]}

    def step(name, deps, train):
        def build(tmp, dirs):
            reads = [str(dirs[d] / "w.bin") for d in deps]
            noise = "os.urandom(4).hex()" if train and random_train else "''"
            code = (f"import os, sys; parts = [{name!r}, {noise}] + [open(p).read() for p in sys.argv[2:]]; "
                    f"open(sys.argv[1], 'w').write('|'.join(parts))")
            return [sys.executable, "-c", code, str(tmp / ("w.bin" if train else "out.txt")), *reads]
        return build

    a = pipe.add("train", "a", {}, [], step("a", [], True))
    b = pipe.add("train", "b", {}, [a], step("b", [a], True))
    c = pipe.add("eval", "c", {}, [b], step("c", [b], False))
    d = pipe.add("eval", "d", {}, [a], step("d", [a], False))
    keys = [a, b, c, d]
    if extra:
        keys.append(pipe.add("eval", "e", {}, [a], step("e", [a], False)))
    return pipe, keys


def _run(run_dir, random_train=False, extra=False, prune=()):
    pipe, keys = _pipe(run_dir, random_train, extra)
    pipe.lock_run_dir()
    try:
        pipe.execute()
        for k in prune:
            assert pipe.prune(keys[k])
    finally:
        os.close(pipe.lock_fd)
    return keys, json.loads((run_dir / "manifest.json").read_text())


def test_a_pruned_step_stays_done_and_comes_back_when_a_new_step_reads_it(tmp_path):
    run_dir = tmp_path / "run"
    (a, b, c, d), m1 = _run(run_dir, prune=[0])
    assert not (run_dir / "steps" / a / "w.bin").exists() and (run_dir / "steps" / a / "log.txt").exists()
    assert set(m1[a]["pruned"]) == {"w.bin"} and set(m1[a]["files"]) == {"log.txt"}  # (the step's output)

    _, m2 = _run(run_dir)  # nothing reads a anew: nothing runs, a stays pruned
    assert m2 == m1

    (a, b, c, d, e), m3 = _run(run_dir, extra=True)  # e reads a: a is trained again, to the same bytes
    assert (run_dir / "steps" / a / "w.bin").read_text() == "a|"
    assert "pruned" not in m3[a] and "w.bin" in m3[a]["files"] and m3[a]["id"] == m1[a]["id"]
    assert {k: m3[k] for k in (b, c, d)} == {k: m1[k] for k in (b, c, d)}  # what read a is still its reading
    assert m3[e]["inputs"] == {a: m1[a]["id"]}


def test_a_pruned_step_that_comes_back_other_makes_its_readers_run_again(tmp_path):
    """A training that is not bit-reproducible (a GPU's): a's second execution has other bytes, so b and d (which
    read the first) run again in the same execution, and c after b; the new step e reads the new a."""
    run_dir = tmp_path / "run"
    (a, b, c, d), m1 = _run(run_dir, random_train=True, prune=[0, 1])
    (a, b, c, d, e), m2 = _run(run_dir, random_train=True, extra=True)
    assert all(m2[k]["id"] != m1[k]["id"] for k in (a, b, c, d))
    assert m2[b]["inputs"] == m2[d]["inputs"] == m2[e]["inputs"] == {a: m2[a]["id"]}
    assert m2[c]["inputs"] == {b: m2[b]["id"]}
    w = lambda k: (run_dir / "steps" / k / "w.bin").read_text()  # noqa: E731
    assert w(b).split("|", 2)[2] == w(a)
    _, m3 = _run(run_dir, random_train=True, extra=True)
    assert m3 == m2  # and then it is done


def test_pruned_steps_come_back_in_order(tmp_path):
    """b pruned and a pruned, a new step reads b: b needs a's weights to train again, so both run (same bytes, same
    ids); c and d stay done."""
    run_dir = tmp_path / "run"
    (a, b, c, d), m1 = _run(run_dir, prune=[0, 1])
    pipe, keys = _pipe(run_dir, False)
    f = pipe.add("eval", "f", {}, [b], lambda tmp, dirs: [sys.executable, "-c", "import sys; open(sys.argv[1], 'w')"
                                                          ".write(open(sys.argv[2]).read())", str(tmp / "out.txt"),
                                                          str(dirs[b] / "w.bin")])
    pipe.lock_run_dir()
    try:
        assert pipe.committed() == {c, d}
        pipe.execute()
    finally:
        os.close(pipe.lock_fd)
    m2 = json.loads((run_dir / "manifest.json").read_text())
    assert (run_dir / "steps" / f / "out.txt").read_text() == "b||a|"
    assert {k: m2[k]["id"] for k in (a, b, c, d)} == {k: m1[k]["id"] for k in (a, b, c, d)}
    assert {k: m2[k] for k in (c, d)} == {k: m1[k] for k in (c, d)}


def test_a_prune_stopped_before_its_delete_verifies_and_finishes(tmp_path):
    """The manifest records the prune before the file goes: a kill in between leaves the file, which still verifies
    (its digest is the pruned one) and goes at the next prune; a pruned file edited by hand does not verify."""
    run_dir = tmp_path / "run"
    (a, b, c, d), m1 = _run(run_dir)
    weights = run_dir / "steps" / a / "w.bin"
    rec = dict(m1[a], files=dict(m1[a]["files"]))
    rec["pruned"] = {"w.bin": rec["files"].pop("w.bin")}
    (run_dir / "manifest.json").write_text(json.dumps({**m1, a: rec}))
    pipe, _ = _pipe(run_dir, False)
    assert pipe.committed() == {a, b, c, d}  # nothing new reads a
    assert pipe.prune(a) and not weights.exists()
    assert json.loads((run_dir / "manifest.json").read_text())[a]["pruned"] == rec["pruned"]

    (run_dir / "manifest.json").write_text(json.dumps({**m1, a: rec}))
    weights.write_text("edited")
    pipe, _ = _pipe(run_dir, False)
    assert a not in pipe.committed()
