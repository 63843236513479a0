"""End-to-end test of run.py: the whole continual-learning pipeline (train / evaluate / rollout / score steps) on a
tiny untrained Llama, 3 tasks x 8 training examples, for sft, replay, opr-ru and opr-sc.

One uninterrupted run (module fixture) is checked artefact by artefact: the accuracy matrices and loss curves, the
replay buffers (sizes per task from data.replay.allocate; gold answers for replay, the checkpoint's own rollouts
ranked by the method's score for OPR), each stage's training mixture (task data + the previous stage's buffer), the
content-keyed dedupe (stage 1 trained once for all four methods; a subset of methods re-run on a copy runs nothing),
ACC/BWT in report.md against data.metrics.acc_bwt, row 0 (the base on every task, one step shared by all methods)
with the next-task scores and FWT / forgetting / OP, and the PNG figures. The paper preset (--model) scores with
the official code's rules (--scoring paper); --eval-repeats 1 keeps the evaluation cheap. A per-task replay budget
re-run (on a copy) checks the buffer sizes of --replay-budget per-task and that --eval-repeats reaches evaluate.py.
A second run of the same command is SIGKILLed mid-pipeline (driver and every child), resumed, and must reproduce the first run exactly (results and
every step's output) while keeping the steps finished before the kill. The pipeline runs twice in total (about a
minute each on 2 CPU cores). lr 1e-4 keeps the model babbling (non-empty rollouts to rank) rather than collapsing to
empty answers.
"""
import fcntl
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from reporting.diagnostics import diagnose
from data.metrics import acc_bwt, cl_metrics
from data.conventions import score as metric
from data.replay import allocate, buffer_size, select
from report import FIGURES, format_table, summarize, warning_lines
from data.trace import load_task
import forkserver
from tiny import run, run_args

REPO = Path(__file__).resolve().parents[1]
TASKS = ["C-STANCE", "Py150", "NumGLUE-cm"]  # Py150 (code_fuzz) gives graded, non-zero scores
METHODS = ["sft", "replay", "opr-ru", "opr-sc"]
N_TRAIN, RHO, GLOBAL_BATCH = 8, 0.5, 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# steps of the plan: train 1+4+4 (stage 1 shared), eval 1+1+4+4 (row 0 and stage 1 shared), gold buffers 2
# (replay), rollouts 1+2 (stage 1 shared by opr-ru and opr-sc), score 2+2
N_STEPS = {"train": 9, "eval": 10, "replay": 2, "rollout": 3, "score": 4, "drift": 8, "buffer-nll": 2}
# drift after stages 2 and 3 of each method (8), the gold buffers' NLL under the checkpoint that built them (2)


def command(base: Path, out: Path, methods=",".join(METHODS), *extra) -> list[str]:
    return [sys.executable, str(REPO / "run.py"), "--model", str(base), "--tasks", ",".join(TASKS),
            "--methods", methods, "--n-train", str(N_TRAIN), "--eval-limit", "4", "--epochs", "1",
            "--global-batch", str(GLOBAL_BATCH), "--lr", "1e-4", "--max-new-tokens", "6", "--rho", str(RHO),
            "--eval-repeats", "1", "--drift-limit", "4", "--jobs", "2", "--quiet", "--out", str(out), *extra]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def portable(path: Path) -> list[dict]:
    """Records of a buffer / mixture file without the OPR "source" field (the path of its run's rollout file)."""
    return [{k: v for k, v in r.items() if k != "source" or v == "gold"} for r in read_jsonl(path)]


def step_dirs(run: Path, pattern: str) -> list[Path]:
    return sorted(p for p in (run / "steps").glob(pattern) if p.is_dir() and not p.name.endswith(".tmp"))


def example_key(r: dict) -> tuple:
    return (r["task"], r["idx"], r["prompt"], r["response"])


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("e2e")
    write_random_tiny(root / "base")
    e = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"))
    return dict(root=root, base=root / "base", env=e)


@pytest.fixture(scope="module")
def run_a(env):
    """The uninterrupted run, shared by the artefact checks and the kill/resume comparison."""
    out = env["root"] / "run_a"
    p = forkserver.run(command(env["base"], out), cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return out


@pytest.fixture(scope="module")
def train_sets(env, run_a):
    data_root = Path(json.loads((run_a / "results.json").read_text())["meta"]["data"])
    assert data_root.is_relative_to(env["root"] / "cache"), "the embedded benchmark must be generated in $OPR_CACHE"
    return {t: load_task(data_root, t, "train") for t in TASKS}


def test_unknown_method_fails_before_running_anything(env):
    out = env["root"] / "bad"
    p = forkserver.run(command(env["base"], out, methods="sft,opr-bogus"), cwd=REPO, env=env["env"],
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "unknown method 'opr-bogus'" in p.stderr and "opr-ru" in p.stderr  # names the culprit and the choices
    assert not out.exists()  # nothing planned, nothing run


def test_zero_replay_budget_fails_before_running_anything(env):
    """rho x 8 training examples rounds to an empty buffer: a replay method would silently train as sft does (it
    used to crash at stage 2 on the empty buffer file instead)."""
    out = env["root"] / "zero"
    cmd = command(env["base"], out, "replay") + ["--rho", "0.01"]
    p = forkserver.run(cmd, cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode != 0
    assert "--rho 0.01: the replay buffer after stage 1 would hold 0 examples" in p.stderr
    assert not out.exists()


def test_results_matrices_and_loss_curves(run_a):
    results = json.loads((run_a / "results.json").read_text())
    assert results["tasks"] == TASKS
    assert list(results["methods"]) == METHODS
    for m in METHODS:
        assert list(results["methods"][m]["seeds"]) == ["0"]
        run = results["methods"][m]["seeds"]["0"]
        assert [len(row) for row in run["matrix"]] == [1, 2, 3], m
        assert all(0 <= v <= 100 for row in run["matrix"] for v in row), m
        # one loss per optimizer step: ceil(examples / global batch); stages 2-3 of the replay methods train on
        # 8 task examples + a buffer of 4
        n_examples = [N_TRAIN] + [N_TRAIN + (0 if m == "sft" else buffer_size(RHO, N_TRAIN))] * 2
        assert [len(c) for c in run["loss_curves"]] == [-(-n // GLOBAL_BATCH) for n in n_examples], m
    # stage 1 is the same step for every method: the same matrix row and the same loss curve
    first = [(r["seeds"]["0"]["matrix"][0], r["seeds"]["0"]["loss_curves"][0]) for r in results["methods"].values()]
    assert all(f == first[0] for f in first)
    # the paper preset's protocol, recorded: the official code's scoring, the budget rule, our repeats override
    cfg = results["meta"]["cfg"]
    assert (cfg["scoring"], cfg["replay_budget"], cfg["eval_repeats"]) == ("paper", "total", 1)
    assert results["meta"]["train_sizes"] == {t: N_TRAIN for t in TASKS}


def test_row0_next_task_and_cl_metrics(run_a):
    """Row 0 is one evaluation of the base on every task, shared by all methods; stage i also scores task i+1
    (before training on it); FWT / forgetting / OP in results.json are data.metrics.cl_metrics of those."""
    results = json.loads((run_a / "results.json").read_text())
    (row0_dir,) = step_dirs(run_a, "s0-eval-*")
    base_scores = json.loads((row0_dir / "eval" / "scores.json").read_text())
    assert list(base_scores["scores"]) == TASKS and base_scores["scoring"] == "paper"
    for m in METHODS:
        run = results["methods"][m]["seeds"]["0"]
        assert run["row0"] == [base_scores["scores"][t] for t in TASKS]
        assert len(run["next_task"]) == len(TASKS) - 1
        assert run["cl_metrics"] == cl_metrics(run["matrix"], run["row0"], run["next_task"])
        assert run["cl_metrics"]["fwt"] is not None and len(run["cl_metrics"]["forgetting"]) == 2
    # stage 1 (shared) scored task 2 once for everyone
    assert len({tuple(results["methods"][m]["seeds"]["0"]["next_task"][:1]) for m in METHODS}) == 1
    for d in step_dirs(run_a, "s2-eval-*"):
        assert list(json.loads((d / "eval" / "scores.json").read_text())["scores"]) == TASKS


def test_manifest_and_stage1_trained_once(run_a):
    manifest = json.loads((run_a / "manifest.json").read_text())
    assert Counter(v["kind"] for v in manifest.values()) == Counter(N_STEPS)
    assert sorted(manifest) == sorted(p.name for p in (run_a / "steps").iterdir())  # every step committed, no .tmp
    assert len(step_dirs(run_a, "s1-train-*")) == 1  # content-keyed: stage 1 of all four methods ran once
    assert len(step_dirs(run_a, "s1-eval-*")) == 1
    assert len(step_dirs(run_a, "s1-rollout-*")) == 1  # opr-ru and opr-sc roll out the same stage-1 checkpoint
    assert len(step_dirs(run_a, "s2-train-*")) == len(step_dirs(run_a, "s3-train-*")) == 4


def test_replay_buffers_sizes_and_contents(run_a, train_sets):
    gold = {(e.task, e.idx): e for t in TASKS for e in train_sets[t]}
    n_model_text = 0
    for stage in (1, 2):  # buffers built after stages 1 and 2, for stages 2 and 3
        prior = TASKS[:stage]
        want = allocate(buffer_size(RHO, N_TRAIN), {t: N_TRAIN for t in prior})
        assert sum(want.values()) == 4 and all(want.values())

        buffers = {name: step_dirs(run_a, f"s{stage}-{name}-*") for name in ("gold", "ru-top", "sc-top")}
        assert all(len(b) == 1 for b in buffers.values()), buffers
        for name, (d,) in buffers.items():
            buf = read_jsonl(d / "buffer.jsonl")
            assert Counter(r["task"] for r in buf) == Counter(want), (name, stage)
            assert len({(r["task"], r["idx"]) for r in buf}) == len(buf), "an example picked twice"
            for r in buf:
                assert r["prompt"] == gold[(r["task"], r["idx"])].prompt
            if name == "gold":  # vanilla replay: the dataset's own answers
                assert all(r["response"] == gold[(r["task"], r["idx"])].answer and r["source"] == "gold" for r in buf)
                continue
            # on-policy replay: the stage's checkpoint's own sampled responses to every prior training prompt, the
            # best b_task of each task by the method's score (ru: task metric vs gold, 0 if empty; sc: mean log-prob
            # of the sampled tokens, -inf if empty, written as null)
            rollouts = {(r["task"], r["idx"]): r for r in read_jsonl(Path(buf[0]["source"]))}
            assert Path(buf[0]["source"]).parent.name.startswith(f"s{stage}-rollout-")
            assert sorted(rollouts) == sorted((t, i) for t in prior for i in range(N_TRAIN))

            def expected(r):
                g = gold[(r["task"], r["idx"])]
                if name == "ru-top":  # the paper preset: the official code's rules, empty responses included
                    return metric(r["task"], r["response"], g.answer, g.prompt, scoring="paper")
                return sum(r["logprobs"]) / len(r["logprobs"]) if r["response"].strip() else -math.inf

            for t in prior:
                picked = {r["idx"]: r for r in buf if r["task"] == t}
                for i, r in picked.items():
                    assert r["response"] == rollouts[(t, i)]["response"] and r["scorer"] == name[:2]
                    s = -math.inf if r["score"] is None else r["score"]
                    assert s == pytest.approx(expected(rollouts[(t, i)])), (name, t, i)
                worst_picked = min(expected(rollouts[(t, i)]) for i in picked)
                best_left = max(expected(rollouts[(t, i)]) for i in range(N_TRAIN) if i not in picked)
                assert worst_picked >= best_left, (name, stage, t)
                # ties drawn with the stage in the seed, as gold replay draws ("seed:stage:task")
                order = [r["idx"] for r in read_jsonl(Path(buf[0]["source"])) if r["task"] == t]
                draw = select(order, [expected(rollouts[(t, i)]) for i in order], want[t], "top", f"0:{stage}:{t}")
                assert set(draw) == set(picked), (name, stage, t)
            n_model_text += sum(1 for r in buf if r["response"].strip())
    # the tiny model at lr 1e-4 still babbles, so the OPR buffers hold real (wrong) generations, not only empty ones
    assert n_model_text > 0


def test_each_stage_trains_on_task_data_plus_previous_buffer(run_a, train_sets):
    for stage in (1, 2, 3):
        task = TASKS[stage - 1]
        task_part = [(task, e.idx, e.prompt, e.answer) for e in train_sets[task]]
        tails = []
        for d in step_dirs(run_a, f"s{stage}-train-{task}-*"):
            mixture = [example_key(r) for r in read_jsonl(d / "mixture.jsonl")]
            assert mixture[:N_TRAIN] == task_part, d.name
            tails.append(tuple(sorted(mixture[N_TRAIN:])))
        # sft trains on the task alone; replay / opr-ru / opr-sc each add the buffer built after the previous stage
        buffers = [tuple(sorted(example_key(r) for r in read_jsonl(d / "buffer.jsonl")))
                   for name in ("gold", "ru-top", "sc-top") for d in step_dirs(run_a, f"s{stage - 1}-{name}-*")]
        assert Counter(tails) == Counter([()] + buffers if stage > 1 else [()]), stage
        assert all(len(b) == buffer_size(RHO, N_TRAIN) for b in buffers)


def test_report_acc_bwt_and_figures(run_a):
    results = json.loads((run_a / "results.json").read_text())
    summary = summarize(results)
    report = (run_a / "report.md").read_text()
    assert format_table(results, summary) in report
    for m in METHODS:
        acc, bwt = acc_bwt(results["methods"][m]["seeds"]["0"]["matrix"])
        assert summary[m]["acc"]["mean"] == pytest.approx(acc) and summary[m]["bwt"]["mean"] == pytest.approx(bwt)
        row = next(line for line in report.splitlines() if line.startswith(f"| {m} "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        # one seed: no std, but a test-set bootstrap interval next to ACC and BWT
        cl = results["methods"][m]["seeds"]["0"]["cl_metrics"]
        assert cells[:3] == [m, "1", f"{acc:.2f}"] and cells[4] == f"{bwt:.2f}", row
        assert cells[6:8] == [f"{cl['fwt']:.2f}", f"{cl['forgetting_mean']:.2f}"], row
        for value, ci in ((acc, cells[3]), (bwt, cells[5])):
            lo, hi = map(float, ci.strip("[]").split(","))
            assert lo - 0.01 <= value <= hi + 0.01, row
        final = results["methods"][m]["seeds"]["0"]["matrix"][-1]
        assert cells[8:] == [f"{v:.2f}" for v in final], row
    assert "- protocol: scoring paper; 1 sample(s) per test prompt; replay budget total" in report
    for ref in ("replay", "sft"):
        assert f"## Paired differences vs {ref}" in report
    assert "One seed: the spread over seeds" in report
    for line in warning_lines(results):  # every flagged evaluation has its warning line next to its matrix
        assert f"- {line}" in report
    for name in FIGURES:  # all six apply: a replay method, loss curves, three stages
        assert (run_a / name).read_bytes()[:8] == PNG_MAGIC, name
        assert f"]({name})" in report


def test_per_example_scores_and_diagnostics_come_from_the_predictions(run_a):
    """results.json carries, per evaluation, the per-example scores (their mean is the matrix entry) in test_idx order
    and reporting.diagnostics.diagnose of its predictions.jsonl, for the bootstrap and the degenerate-answer checks."""
    results = json.loads((run_a / "results.json").read_text())
    evals = {}  # stage -> list of (per-example scores, diagnostics) of each evaluation of that stage
    for stage in (1, 2, 3):
        for d in step_dirs(run_a, f"s{stage}-eval-*"):
            records = read_jsonl(d / "eval" / "predictions.jsonl")
            per_example, diags = [], {}
            for t in TASKS[:stage]:
                rs = sorted((r for r in records if r["task"] == t), key=lambda r: r["idx"])
                assert [r["idx"] for r in rs] == results["test_idx"][t] and len(rs) == 4  # --eval-limit 4
                per_example.append([round(r["score"], 4) for r in rs])  # one repeat
                diags[t] = diagnose(t, rs)
            evals.setdefault(stage, []).append((per_example, diags))
    assert list(results["test_idx"]) == TASKS
    for m in METHODS:
        run = results["methods"][m]["seeds"]["0"]
        for i, (row, ex, diags) in enumerate(zip(run["matrix"], run["example_scores"], run["diagnostics"])):
            assert (ex, diags) in evals[i + 1], (m, i)
            assert [sum(c) / len(c) for c in ex] == pytest.approx(row, abs=1e-3), (m, i)
            assert set(diags) == set(TASKS[:i + 1]) and "labels" in diags["C-STANCE"]  # a classification task
            assert i == 0 or "labels" not in diags["Py150"]


def test_a_subset_of_methods_reuses_every_step(env, run_a):
    """Steps are keyed by content, not by the command line: re-running with fewer methods (on a copy of the run) finds
    all 23 of their steps done (replay: 3 train, 3 eval, 2 gold, 2 gold NLL, 2 drift; opr-sc: 2 more train and
    eval, 2 rollouts, 2 score, 2 drift; row 0) and only re-collects the results."""
    out = env["root"] / "run_subset"
    shutil.copytree(run_a, out)
    p = forkserver.run(command(env["base"], out, methods="replay,opr-sc"), cwd=REPO, env=env["env"],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert re.search(r"; 23 steps \(23 already done\)", p.stdout), p.stdout[:2000]
    assert (out / "manifest.json").read_text() == (run_a / "manifest.json").read_text()  # nothing ran
    a = json.loads((run_a / "results.json").read_text())["methods"]
    b = json.loads((out / "results.json").read_text())["methods"]
    assert b == {m: a[m] for m in ("replay", "opr-sc")}


def scalars(event_dir: Path) -> dict:
    """{tag: [(step, value)]} as TensorBoard's own reader loads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_hold_the_training_logs_and_the_matrices(run_a):
    """tb/train/<step key>: every train step's per-step loss, lr, grad norm and tokens/s (and the task and replay
    losses where it mixes a buffer), equal to its train_log.jsonl; tb/results/<method>-seed0 (written as the steps
    committed, each scalar once): every cell of the accuracy matrix and its row's mean by stage, the drift KL and the
    buffer's NLL by stage, and the final metrics, equal to results.json."""
    pytest.importorskip("tensorboard")
    trains = step_dirs(run_a, "*-train-*")
    assert sorted(p.name for p in (run_a / "tb" / "train").iterdir()) == sorted(d.name for d in trains)
    replay_seen = False
    for d in trains:
        log = read_jsonl(d / "ckpt" / "train_log.jsonl")
        got = scalars(run_a / "tb" / "train" / d.name)
        for k in ("loss", "lr", "grad_norm", "tokens_per_s"):
            assert got[f"train/{k}"] == [(r["step"], pytest.approx(r[k], rel=1e-6)) for r in log], (d.name, k)
        if log[0].get("loss_replay") is not None:
            replay_seen = True
            assert [v for _, v in got["train/loss_replay"]] == pytest.approx([r["loss_replay"] for r in log])
    assert replay_seen
    res = json.loads((run_a / "results.json").read_text())
    for m in METHODS:
        r = res["methods"][m]["seeds"]["0"]
        got = scalars(run_a / "tb" / "results" / f"{m}-seed0")
        for j, t in enumerate(TASKS):
            assert got[f"a/{t}"] == [(i + 1, pytest.approx(row[j])) for i, row in enumerate(r["matrix"])
                                     if j < len(row)]
        assert got["final/acc"] == [(3, pytest.approx(r["cl_metrics"]["acc"]))]
        assert got["final/bwt"] == [(3, pytest.approx(r["cl_metrics"]["bwt"]))]
        assert {t.removeprefix("final/") for t in got if t.startswith("final/")} == {
            k for k, v in r["cl_metrics"].items() if isinstance(v, (int, float))}
        assert got["stage/acc_so_far"] == [(i, pytest.approx(sum(row) / len(row))) for i, row in
                                           enumerate(r["matrix"], 1)]
        for k in ("kl_per_token", "mean_seq_kl"):
            assert got[f"drift/{k}"] == [(d["stage"], pytest.approx(d["all"][k])) for d in r["drift"]]
        assert [(d["stage"]) for d in r["drift"]] == [2, 3]
        buffers = r["buffer_stats"]
        assert got.get("buffer/selected_nll_mean", []) == [(b["stage"], pytest.approx(b["all"]["selected"]["nll_mean"]))
                                                           for b in buffers]
        rejected = [(b["stage"], pytest.approx(b["all"]["rejected"]["nll_mean"])) for b in buffers
                    if b["all"]["rejected"] and b["all"]["rejected"]["nll_mean"] is not None]
        assert got.get("buffer/rejected_nll_mean", []) == rejected and bool(rejected) == m.startswith("opr")


def test_index_names_every_stages_steps(run_a):
    """index.md: for each method, seed and stage the train, eval, buffer and rollout step directories, all of them
    steps of the manifest, and the chain's own (opr-ru's buffer was scored from the rollout of the stage before)."""
    rows = [line.strip("|").split(" | ") for line in (run_a / "index.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| method")]
    manifest = json.loads((run_a / "manifest.json").read_text())
    cells = {(r[0].strip(), int(r[1]), int(r[2])): [c.strip() for c in r[3:]] for r in rows}
    assert len(cells) == 1 + len(METHODS) * len(TASKS)
    for (method, _, stage), keys in cells.items():
        assert all(k == "-" or k in manifest for k in keys), keys
        train, ev, buffer, rollout = keys
        assert ev.startswith(f"s{stage}-eval-")
        if method == "opr-ru" and stage > 1:
            assert manifest[train]["kind"] == "train" and manifest[buffer]["kind"] == "score"
            assert manifest[rollout]["kind"] == "rollout" and rollout.startswith(f"s{stage - 1}-rollout-")
        if method == "sft" or stage == 1:
            assert buffer == rollout == "-"
        if method == "replay" and stage > 1:
            assert manifest[buffer]["kind"] == "replay" and rollout == "-"


def test_the_saved_experiment_reruns_the_same_steps(env, run_a):
    """run_a wrote config.yaml; `run.py --config run_a/config.yaml` plans the same steps (all done, the same keys)
    and results.json's meta holds the same settings (those that change numbers)."""
    import yaml
    saved = yaml.safe_load((run_a / "config.yaml").read_text())
    assert saved["methods"] == ",".join(METHODS) and saved["out"] == str(run_a) and saved["tasks"] == TASKS
    p = forkserver.run([sys.executable, str(REPO / "run.py"), "--config", str(run_a / "config.yaml"), "--dry-run"],
                       cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    n = sum(N_STEPS.values())
    assert f"; {n} steps ({n} already done)" in p.stdout
    meta = json.loads((run_a / "results.json").read_text())["meta"]
    assert meta["settings"] == {k: v for k, v in saved.items() if k not in (
        "out", "jobs", "quiet", "save-every", "gen-workers", "keep-checkpoints", "executor", "ray-retries")}


def test_a_committed_step_edited_by_hand_runs_again(env, run_a):
    """Each step's files are checked against the digests recorded when it committed: an evaluation whose scores were
    edited and a rollout file emptied are redone (one line each), with the steps that read the rollouts; results.json
    is the uninterrupted run's again."""
    out = env["root"] / "run_edited"
    shutil.copytree(run_a, out)
    ev = step_dirs(out, "s3-eval-*")[0]
    preds = ev / "eval" / "predictions.jsonl"
    preds.write_text(preds.read_text().replace('"score": 0.0', '"score": 100.0'))
    (ev / "eval" / "scores.json").write_text((ev / "eval" / "scores.json").read_text().replace("0.0", "100.0"))
    rollout = step_dirs(out, "s2-rollout-*")[0]
    (rollout / "rollouts.jsonl").write_text("")
    p = forkserver.run(command(env["base"], out), cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert f"{ev}: eval/predictions.jsonl, eval/scores.json changed since the step committed" in p.stderr
    assert f"{rollout}: rollouts.jsonl changed since the step committed" in p.stderr
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (run_a, out))
    redone = {k for k in a if a[k]["id"] != b[k]["id"]}
    assert ev.name in redone and rollout.name in redone
    assert any(b[k]["kind"] == "score" for k in redone)  # the buffer scored from the emptied rollouts, and so on
    assert json.loads((out / "results.json").read_text())["methods"] == \
        json.loads((run_a / "results.json").read_text())["methods"]


def test_generation_workers_give_the_same_results(env, run_a):
    """run.py --gen-workers 2: the last stage's evaluation and drift probe, re-run as two torchrun workers each (on a
    copy of the run, their step directories deleted), have the same keys and write the same predictions; every
    other step is reused (the flag is in no key); results.json's sft entry is the one-process run's (drift's KLs
    within the engine's batch-composition tolerance). One step of each kind: the others run the same code."""
    out = env["root"] / "run_workers"
    shutil.copytree(run_a, out)
    regenerated = [d.name for d in step_dirs(out, "s3-eval-*") + step_dirs(out, "s3-drift-*")]
    for name in regenerated:
        shutil.rmtree(out / "steps" / name)
    p = forkserver.run(command(env["base"], out, "sft", "--gen-workers", "2", "--jobs", "1"), cwd=REPO,
                       env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    ran = [d for d in regenerated if (out / "steps" / d).is_dir()]
    assert sum("-eval-" in d for d in ran) == 1 and sum("-drift-" in d for d in ran) == 1  # sft's, same keys
    assert {d.name for d in step_dirs(out, "*")} <= {d.name for d in step_dirs(run_a, "*")}  # no step of a new key
    for d in ran:  # each worker announces its step: "evaluate: N test prompts ..." / "drift: N test prompts ..."
        assert (out / "steps" / d / "log.txt").read_text().count(" test prompts ") == 2, d
        if "-eval-" in d:
            f = "eval/predictions.jsonl"
            assert (out / "steps" / d / f).read_bytes() == (run_a / "steps" / d / f).read_bytes(), d
    a = json.loads((run_a / "results.json").read_text())["methods"]["sft"]
    b = json.loads((out / "results.json").read_text())["methods"]["sft"]
    assert _close(a, b)


def _close(a, b, tol=1e-4):
    """Equal structures, numbers within tol."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(a))
    return a == b


def test_per_task_replay_budget_and_eval_repeats(env, run_a):
    """--replay-budget per-task: after stage i each prior task contributes rho * its own size (4 of 8 here), so
    stage 3's buffer holds 8, where the total budget held 4 split 2/2. Stage 1 training is re-used; evaluation
    re-runs with --eval-repeats 2 (in the step key), which reaches evaluate.py."""
    out = env["root"] / "run_per_task"
    shutil.copytree(run_a, out)
    p = forkserver.run(command(env["base"], out, "replay", "--replay-budget", "per-task", "--eval-repeats", "2"),
                       cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    # s1-train re-used; 4 evals, 3 trainings, 2 gold buffers, 2 drift steps, 2 gold-buffer NLL steps are new
    assert re.search(r"; 13 steps \(1 already done\)", p.stdout), p.stdout[:2000]
    new = set(json.loads((out / "manifest.json").read_text())) - set(json.loads((run_a / "manifest.json").read_text()))
    bufs = sorted((k for k in new if "-gold-" in k), key=lambda k: k[:2])
    assert [Counter(r["task"] for r in read_jsonl(out / "steps" / k / "buffer.jsonl")) for k in bufs] == \
        [{"C-STANCE": 4}, {"C-STANCE": 4, "Py150": 4}]
    evals = [k for k in new if "-eval-" in k]
    assert len(evals) == 4  # row 0 and stages 1-3
    for k in evals:
        assert json.loads((out / "steps" / k / "eval" / "scores.json").read_text())["repeats"] == 2
        rows = read_jsonl(out / "steps" / k / "eval" / "predictions.jsonl")
        assert sorted({r["repeat"] for r in rows}) == [0, 1]
    cfg = json.loads((out / "results.json").read_text())["meta"]["cfg"]
    assert (cfg["replay_budget"], cfg["eval_repeats"]) == ("per-task", 2)


def test_kill_and_resume_reproduces_the_uninterrupted_run(env, run_a):
    out = env["root"] / "run_b"
    cmd = command(env["base"], out)
    driver = subprocess.Popen(cmd, cwd=REPO, env=env["env"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)  # its own process group: the kill reaches every child
    manifest_path = out / "manifest.json"
    try:
        while True:  # wait until a train step is committed and another step is in progress
            assert driver.poll() is None, f"run.py ended before it could be killed:\n{driver.stderr.read()[-3000:]}"
            manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
            in_progress = list((out / "steps").glob("*.tmp")) if manifest else []
            if any(v["kind"] == "train" for v in manifest.values()) and in_progress:
                break
            time.sleep(0.05)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:  # it already ended (the assert above says why)
            pass
        driver.wait()
        driver.stderr.close()

    killed = json.loads(manifest_path.read_text())  # written atomically: never half a file
    assert 0 < len(killed) < sum(N_STEPS.values())
    # results.json so far (written after every evaluation): the stages each chain finished, marked partial, each a
    # prefix of the uninterrupted run's matrix; report.py refuses it in one line
    if (out / "results.json").exists():
        part, full = (json.loads((d / "results.json").read_text()) for d in (out, run_a))
        assert part["partial"] is True
        for m, entry in part["methods"].items():
            for seed, r in entry["seeds"].items():
                whole = full["methods"][m]["seeds"][seed]["matrix"]
                assert r["matrix"] == whole[:len(r["matrix"])]
                assert r.get("partial") == (len(r["matrix"]) < len(whole)) and (r["cl_metrics"] is None) == r.get(
                    "partial", False)
        rep = forkserver.run([sys.executable, str(REPO / "report.py"), str(out)], cwd=REPO, capture_output=True,
                             text=True)
        assert rep.returncode == 2 and "partial results of a run that has not finished" in rep.stderr
    assert all((out / "steps" / k).is_dir() for k in killed)  # a recorded step is always complete
    assert list((out / "steps").glob("*.tmp")), "the kill should have interrupted a step in progress"
    stamps = {k: (out / "steps" / k).stat().st_ino for k in killed}

    p = forkserver.run(cmd, cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"resumed run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert f"({len(killed)} already done)" in p.stdout

    manifest = json.loads(manifest_path.read_text())
    assert sorted(manifest) == sorted(json.loads((run_a / "manifest.json").read_text()))  # same content keys
    assert sorted(manifest) == sorted(p.name for p in (out / "steps").iterdir())  # complete, no *.tmp left
    assert {k: manifest[k] for k in killed} == killed  # steps done before the kill were kept, not redone
    assert {k: (out / "steps" / k).stat().st_ino for k in killed} == stamps

    a = json.loads((run_a / "results.json").read_text())
    b = json.loads((out / "results.json").read_text())
    assert b["methods"] == a["methods"]  # matrices and loss curves, exactly
    # and every step's output, bit for bit although the steps ran in another interleaving: trained weights, sampled
    # tokens with their log-probs, predictions, buffers and mixtures ("source" names the run's own rollout file)
    for key in manifest:
        da, db = run_a / "steps" / key, out / "steps" / key
        for rel in ("ckpt/model.safetensors", "eval/predictions.jsonl", "rollouts.jsonl"):
            if (da / rel).exists():
                assert (db / rel).read_bytes() == (da / rel).read_bytes(), f"{key}/{rel} differs"
        for rel in ("buffer.jsonl", "mixture.jsonl"):
            if (da / rel).exists():
                assert portable(db / rel) == portable(da / rel), f"{key}/{rel} differs"
    for name in ["report.md", *FIGURES]:
        assert (out / name).is_file()


def kill_when(cmd, env, ready, poll: float = 0.005):
    """Start run.py, SIGKILL it and everything it started as soon as ready() holds (it must not end before), and
    return once every step it started is gone too: the steps lead process groups of their own and die of the
    driver's death (a parent-death signal) a moment later, so a step could still write after the driver's kill --
    finish its stage, remove the state ready() saw. Every step holds the run's run.lock until it exits."""
    driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        while not ready():
            assert driver.poll() is None, f"run.py ended before it could be killed:\n{driver.stderr.read()[-3000:]}"
            time.sleep(poll)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        driver.wait()
        driver.stderr.close()
    lock = Path(cmd[cmd.index("--out") + 1]) / "run.lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "a step outlived the killed driver by a minute"
                time.sleep(0.05)
    finally:
        os.close(fd)  # the flock goes with it


def test_a_stage_stopped_mid_training_resumes_from_its_saved_state(env, run_a):
    """run.py --save-every 1, SIGKILLed while a training step runs after it saved a state: the re-run continues that
    stage from the state (train.py says so in the step's log) and ends with run_a's weights, bit for bit."""
    out = env["root"] / "run_midstage"
    cmd = command(env["base"], out, "sft", "--save-every", "1")
    saved = lambda: [p.parent.parent.parent.name.removesuffix(".tmp")
                     for p in (out / "steps").glob("*-train-*.tmp/ckpt.partial/state/progress.pt")]
    for _ in range(3):  # the kill must land between the save and the stage's end: a loaded machine can miss that
        shutil.rmtree(out, ignore_errors=True)  # window, and then the state is gone whole (never half: train.py)
        kill_when(cmd, env["env"], lambda: saved())
        stopped = saved()
        if stopped:
            break
    assert len(stopped) == 1
    p = forkserver.run(cmd, cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"resumed run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    log = (out / "steps" / stopped[0] / "log.txt").read_text()
    assert "train.py: resumed at step 1 of 2 from " in log, log[-2000:]
    assert not (out / "steps" / stopped[0] / "ckpt.partial").exists()
    for d in step_dirs(out, "*-train-*"):
        rel = "ckpt/model.safetensors"
        assert (d / rel).read_bytes() == (run_a / "steps" / d.name / rel).read_bytes(), d.name


def test_a_run_stopped_after_stage_k_has_its_matrix_so_far(env, run_a):
    """results.json is rewritten after every evaluation: run.py --methods sft SIGKILLed once stage 2's evaluation is
    committed and results.json rewritten (the driver does that a few ms after the manifest lists the step: a kill
    between the two finds stage 1's) leaves the rows of stages 1..k (k >= 2), equal to the uninterrupted run's,
    marked partial; TensorBoard's events, written before results.json, hold at least as many."""
    out = env["root"] / "run_partial"
    manifest_path, results_path = out / "manifest.json", out / "results.json"

    def stage2_written():
        if not any(k.startswith("s2-eval-") for k in (json.loads(manifest_path.read_text())
                                                       if manifest_path.exists() else {})):
            return False
        return len(json.loads(results_path.read_text())["methods"]["sft"]["seeds"]["0"]["matrix"]) >= 2
    kill_when(command(env["base"], out, "sft", "--jobs", "1"), env["env"], stage2_written, poll=0.01)
    part = json.loads((out / "results.json").read_text())
    r = part["methods"]["sft"]["seeds"]["0"]
    whole = json.loads((run_a / "results.json").read_text())["methods"]["sft"]["seeds"]["0"]
    assert part["partial"] is True and 2 <= len(r["matrix"]) <= 3
    assert r["matrix"] == whole["matrix"][:len(r["matrix"])] and r["row0"] == whole["row0"]
    assert r["loss_curves"] == whole["loss_curves"][:len(r["matrix"])]
    if len(r["matrix"]) < 3:
        assert r["partial"] is True and r["stages"] == len(r["matrix"]) and r["cl_metrics"] is None
    # TensorBoard has the rows as they committed (written before results.json), as the uninterrupted run has them
    pytest.importorskip("tensorboard")
    got = scalars(out / "tb" / "results" / "sft-seed0")
    rows = len(got["stage/acc_so_far"])
    assert len(r["matrix"]) <= rows <= 3
    for j, t in enumerate(TASKS):
        assert got.get(f"a/{t}", []) == [(i + 1, pytest.approx(row[j])) for i, row in
                                         enumerate(whole["matrix"][:rows]) if j < len(row)]


def test_sdft_and_sft_kl_rows(env):
    """Both SDFT rows exist: sdft trains on-policy (train.py --objective sdft with the preset's Algorithm 1 settings),
    sft-kl is SFT + KL to an EMA teacher; every stage of each is its own training step."""
    out = env["root"] / "sdft"
    p = forkserver.run(command(env["base"], out, methods="sdft,sft-kl") + ["--sdft-max-new-tokens", "6"], cwd=REPO,
                       env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["sdft", "sft-kl"]
    for m in results["methods"].values():
        assert [len(row) for row in m["seeds"]["0"]["matrix"]] == [1, 2, 3]
    objectives = Counter()
    for d in step_dirs(out, "s*-train-*"):
        summary = json.loads((d / "ckpt" / "train_summary.json").read_text())["args"]
        objectives[summary["objective"]] += 1
        log = read_jsonl(d / "ckpt" / "train_log.jsonl")
        assert all("kl" in r for r in log)
        if summary["objective"] == "sdft":
            assert (summary["sdft_teacher"], summary["sdft_alpha"], summary["sdft_max_new_tokens"]) == ("ema", 0.01, 6)
            assert all(0 < r["target_tokens"] <= 6 * GLOBAL_BATCH and "gen_seconds" in r for r in log)
        else:
            assert summary["sft_kl_beta"] == 0.5
    assert objectives == {"sdft": 3, "sft-kl": 3}


def test_mechanism_probes_in_results(run_a):
    """drift after every stage >= 2 (KL of stage i vs i-1 on tasks 1..i-1), each buffer's NLL bound, the rollout
    log-prob check and the per-source training loss, as the step outputs hold them."""
    results = json.loads((run_a / "results.json").read_text())
    for m in METHODS:
        run = results["methods"][m]["seeds"]["0"]
        assert [d["stage"] for d in run["drift"]] == [2, 3], m
        for d in run["drift"]:
            assert list(d["tasks"]) == TASKS[:d["stage"] - 1]
            assert all(v["n"] == 4 and v["mean_seq_kl"] > 0 and v["kl_per_token"] > 0 for v in d["tasks"].values())
            (step,) = [p for p in step_dirs(run_a, f"s{d['stage']}-drift-*")
                       if json.loads((p / "drift" / "drift.json").read_text())["all"] == d["all"]]
        stages = [b["stage"] for b in run["buffer_stats"]]
        want_scorer = {"sft": None, "replay": "gold", "opr-ru": "ru", "opr-sc": "sc"}[m]
        assert stages == ([] if m == "sft" else [1, 2]), m
        for b in run["buffer_stats"]:
            assert b["scorer"] == want_scorer and b["all"]["selected"]["n"] == buffer_size(RHO, N_TRAIN)
            assert b["all"]["selected"]["nll_mean"] > 0
        checks = run["rollout_checks"]
        assert [c["stage"] for c in checks] == ([1, 2] if m.startswith("opr") else []), m
        assert all(c["max_abs_dlogp"] <= 1e-4 and not c["warned"] for c in checks)  # the native engine agrees
        srcs = run["loss_sources"]
        assert srcs[0] is None and all((s is None) == (m == "sft") for s in srcs[1:]), m
        for s, total in zip(srcs[1:], run["loss_curves"][1:]):
            if s is not None:
                assert len(s["task"]) == len(s["replay"]) == len(total)
    timing = json.loads((run_a / "timing.json").read_text())
    assert timing["drift"]["steps"] == 4 * 2 and timing["drift"]["seconds"] > 0 and "step_seconds" not in results["meta"]
    report = (run_a / "report.md").read_text()
    assert "## Mechanism: per-update drift" in report and "Forgetting vs drift: 12 points" in report  # 4 x (1 + 2)
    for name in ("fig_drift.png", "fig_drift_vs_forgetting.png", "fig_loss_sources.png"):
        assert (run_a / name).read_bytes()[:8] == PNG_MAGIC and f"]({name})" in report, name


def weights_on_disk(run: Path) -> set:
    return {d.name for d in step_dirs(run, "*-train-*") if (d / "ckpt" / "model.safetensors").exists()}


def final_trains(run: Path, methods) -> set:
    """The train step of the last stage of each method (index.md's rows)."""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in (run / "index.md").read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| method")]
    return {r[3] for r in rows if r[0] in methods and r[2] == str(len(TASKS))}


def test_keep_checkpoints_last(env, run_a):
    """--keep-checkpoints last: the run prunes as it goes and ends with each method's final checkpoint only, the
    others recorded as pruned (their logs kept); its results are run_a's. The same command again runs nothing and
    prunes nothing. Adding a method whose stage 2 trains on the pruned stage 1 trains stage 1 again, to the same
    bytes, so none of the steps that read it runs again; the new method's results are run_a's too."""
    out = env["root"] / "run_last"
    methods = ["sft", "replay"]
    cmd = lambda ms: command(env["base"], out, ",".join(ms), "--keep-checkpoints", "last")  # noqa: E731
    p = forkserver.run(cmd(methods), cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    manifest = json.loads((out / "manifest.json").read_text())
    trains = [k for k, v in manifest.items() if v["kind"] == "train"]
    assert len(trains) == 5 and weights_on_disk(out) == final_trains(out, methods)
    for k in trains:
        pruned = k not in final_trains(out, methods)
        assert ("pruned" in manifest[k]) == pruned and ("ckpt/model.safetensors" in manifest[k]["files"]) != pruned
        assert (out / "steps" / k / "ckpt" / "train_log.jsonl").is_file()
    a = json.loads((run_a / "results.json").read_text())
    b = json.loads((out / "results.json").read_text())
    assert b["methods"] == {m: a["methods"][m] for m in methods} and b["test_idx"] == a["test_idx"]
    assert "--keep-checkpoints last: 3 stage checkpoint(s) pruned by this run, 2 on disk" in p.stdout

    p = forkserver.run(cmd(methods), cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0 and "; 19 steps (19 already done)" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text()) == manifest

    (stage1,) = [k for k in trains if k.startswith("s1-")]
    log = out / "steps" / stage1 / "ckpt" / "train_log.jsonl"
    first = log.stat().st_ino  # a step that runs again is a new directory, renamed into place
    p = forkserver.run(cmd(methods + ["opr-ru"]), cwd=REPO, env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    assert "already done" in p.stdout and "changed since the step committed" not in p.stderr
    after = json.loads((out / "manifest.json").read_text())
    assert after[stage1]["id"] == manifest[stage1]["id"] and log.stat().st_ino != first  # trained again, same bytes
    assert {k: v for k, v in after.items() if k in manifest and k != stage1} == \
        {k: v for k, v in manifest.items() if k != stage1}  # nothing that read stage 1 ran again
    assert "pruned" in after[stage1]  # and it went again, once opr-ru's stage 2, rollout and drift had read it
    assert weights_on_disk(out) == final_trains(out, methods + ["opr-ru"])
    for k in weights_on_disk(out):
        rel = "ckpt/model.safetensors"
        assert (out / "steps" / k / rel).read_bytes() == (run_a / "steps" / k / rel).read_bytes(), k
    b = json.loads((out / "results.json").read_text())
    assert b["methods"] == {m: a["methods"][m] for m in methods + ["opr-ru"]}


def test_keep_checkpoints_final_on_a_finished_run_and_its_plan(env, run_a):
    """--keep-checkpoints final on a copy of the finished run_a: nothing runs, every checkpoint but each method's
    final one is pruned, results.json stays byte for byte. The dry run prices the policy's disk."""
    out = env["root"] / "run_final"
    shutil.copytree(run_a, out)
    p = forkserver.run(command(env["base"], out, ",".join(METHODS), "--keep-checkpoints", "final"), cwd=REPO,
                       env=env["env"], capture_output=True, text=True)
    assert p.returncode == 0, f"run.py failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    n = sum(N_STEPS.values())
    assert f"; {n} steps ({n} already done)" in p.stdout
    assert weights_on_disk(out) == final_trains(out, METHODS) and len(final_trains(out, METHODS)) == 4
    assert (out / "results.json").read_bytes() == (run_a / "results.json").read_bytes()
    plans = {}
    for policy in ("all", "last", "final"):
        p = forkserver.run(command(env["base"], out, ",".join(METHODS), "--keep-checkpoints", policy, "--dry-run"),
                           cwd=REPO, env=env["env"], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        (plans[policy],) = [line for line in p.stdout.splitlines() if line.startswith("disk: ")]
    assert plans["all"].startswith("disk: 9 stage checkpoints of ") and " each kept in steps/ = " in plans["all"]
    assert "--keep-checkpoints final keeps all 9 while the run runs" in plans["final"]
    assert "and 4 at the end (each method and seed's final stage)" in plans["final"]
    peak = int(re.search(r"--keep-checkpoints last keeps at most (\d+) at once", plans["last"]).group(1))
    assert 4 <= peak < 9 and "and 4 at the end" in plans["last"]


# ---- failed steps, killed drivers, concurrent drivers, on tiny_env (2 tasks, sft) ----------------------------------
def test_failed_step_is_one_line_with_its_log(tiny_env, tmp_path):
    r = run("run.py", run_args(tiny_env, tmp_path) + ["--launcher", f"{sys.executable} {tmp_path / 'missing.py'}"],
            tiny_env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line, = [l for l in r.stderr.splitlines() if "error" in l]
    assert "step s1-train-C-STANCE" in line and "missing.py" in line and len(line) < 600
    log = Path(line.rsplit("full log: ", 1)[1])
    assert log.is_file() and "missing.py" in log.read_text()


def long_run(env, out: Path, ignore=()) -> "subprocess.Popen | forkserver.Started":
    """A driver whose first training step lasts minutes (the test kills it long before). It starts as a terminal's
    foreground job would, SIGINT and SIGHUP at their defaults (a pytest started with `&` by a non-interactive shell
    ignores SIGINT, and its children would inherit that: the cause of this file's SIGINT test failing in background
    runs), except the signals in `ignore` (as nohup ignores SIGHUP). Without those, a fork of the tests' server
    (forkserver.Started: a fresh interpreter's dispositions, its zygote forked too); with them, a process of its own."""
    argv = run_args(env, out.parent)[:-1] + [out, "--epochs", "100000"]
    cmd = [sys.executable, str(REPO / "run.py"), *map(str, argv)]
    if not ignore and os.environ.get("OPR_TEST_FORK") != "0":
        return forkserver.Started(cmd, cwd=REPO, env=env["env"])

    def dispositions():
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in ignore else signal.SIG_DFL)
    return subprocess.Popen(cmd, cwd=REPO, env=env["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=dispositions)


def child_of(pid: int, name: str, timeout: float = 120) -> int:
    """The pid of the step running script `name` under driver `pid`: its child (`python train.py ...`, started with
    OPR_NO_ZYGOTE=1) or its grandchild through the zygote (a fork named `train.py`, pipeline/zygote.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parents, found = {}, []
        for p in Path("/proc").iterdir():
            try:
                if not p.name.isdigit():
                    continue
                parents[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if name in (p / "cmdline").read_bytes().decode(errors="replace") or \
                        (p / "comm").read_text().strip() == name:
                    found.append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
        for c in found:
            if parents.get(c) == pid or parents.get(parents.get(c)) == pid:
                return c
        time.sleep(0.1)
    raise AssertionError(f"no {name} step under {pid} appeared")


def gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, waiting to be reaped by init
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_killing_the_driver_kills_its_steps(tiny_env, tmp_path, sig):
    out = tmp_path / "run"
    driver = long_run(tiny_env, out)
    try:
        child = child_of(driver.pid, "train.py")
        time.sleep(0.5)
        os.kill(driver.pid, sig)  # the driver alone, not its process group
        try:
            driver.wait(120)  # stopping takes <= 20 s (SIGTERM, SIGKILL after 10 s); the rest is slack for load
        except subprocess.TimeoutExpired:  # say where it hangs: every thread's stack (SIGUSR1) and the processes
            os.kill(driver.pid, signal.SIGUSR1)
            time.sleep(3)
            ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,stat,etime,args"], capture_output=True, text=True)
            os.killpg(driver.pid, signal.SIGKILL)
            raise AssertionError(f"run.py still running 120 s after {sig.name}; its stacks:\n"
                                 f"{driver.communicate()[1][-6000:]}\nprocesses:\n{ps.stdout[-4000:]}") from None
        assert gone(child), f"train.py (pid {child}) outlived run.py killed by {sig.name}"
        err = driver.stderr.read()
        assert "Traceback" not in err, err[-3000:]
        if sig != signal.SIGKILL:  # 128 + the signal, as shells report it: not 1, a failed step's code
            assert driver.returncode == 128 + sig and len([l for l in err.splitlines() if l.strip()]) == 1, err
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux")
def test_a_driver_started_under_nohup_survives_sighup(tiny_env, tmp_path):
    driver = long_run(tiny_env, tmp_path / "run", ignore=(signal.SIGHUP,))
    try:
        child = child_of(driver.pid, "train.py")
        os.kill(driver.pid, signal.SIGHUP)
        time.sleep(3)
        assert driver.poll() is None and not gone(child, timeout=0.1)  # nohup's promise kept: both still at work
        os.kill(driver.pid, signal.SIGTERM)
        driver.wait(120)
        assert gone(child) and "stopped by SIGTERM" in driver.stderr.read() and driver.returncode == 143
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="SIGUSR1 is POSIX")
def test_sigusr1_prints_the_drivers_stacks_and_the_run_goes_on(tiny_env, tmp_path):
    driver = long_run(tiny_env, tmp_path / "run")
    try:
        child = child_of(driver.pid, "train.py")
        os.kill(driver.pid, signal.SIGUSR1)
        time.sleep(2)
        assert driver.poll() is None and not gone(child, timeout=0.1)  # both still at work
        os.kill(driver.pid, signal.SIGTERM)
        driver.wait(120)
        err = driver.stderr.read()
        assert "most recent call first" in err and "run.py" in err and "in execute" in err, err[-3000:]
        assert gone(child)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
        driver.communicate()


@pytest.mark.parametrize("zygote", [False, True])
def test_a_step_that_starts_after_the_stop_is_killed(tmp_path, zygote):
    """Ctrl-C can land while a pool thread is between picking a step and its process existing: stop_children's list
    misses that step, so it is killed the moment it appears (else the driver waits on it forever; once seen as a
    60 s timeout of the SIGINT test above under the full suite's load)."""
    sys.path.insert(0, str(REPO))
    from pipeline.zygote import Zygote
    from pipeline.steps import Pipeline
    pipe = Pipeline(tmp_path / "run", 1, dict(os.environ, OMP_NUM_THREADS="1"), True, {})
    pipe.lock_run_dir()
    if zygote:
        pipe.zygote = Zygote(pipe.env, pass_fds=(pipe.lock_fd,))
    try:
        pipe.stop_children()  # nothing runs yet: from here on, every step that appears is killed
        t = time.monotonic()
        argv = [sys.executable, str(REPO / "train.py")]  # no flags: the embedded default, minutes of work
        assert pipe.call(argv, tmp_path / "log.txt", "train") == (-signal.SIGKILL, None)
        assert time.monotonic() - t < 30 and not pipe.procs
    finally:
        if pipe.zygote is not None:
            pipe.zygote.close()


def test_a_second_driver_on_a_directory_in_use_is_refused(tiny_env, tmp_path):
    out = tmp_path / "run"
    first = long_run(tiny_env, out)
    try:
        child_of(first.pid, "train.py")
        r = run("run.py", run_args(tiny_env, tmp_path)[:-1] + [out, "--epochs", "100000"], tiny_env)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert f"{out}: in use by another run.py (pid {first.pid})" in r.stderr
        # the first run was not disturbed: still running, still holding its lock
        assert first.poll() is None and (out / "run.lock").read_text().strip() == str(first.pid)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
