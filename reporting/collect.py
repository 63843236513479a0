"""results.json from a run's committed steps (its schema: reporting/schema.py): each evaluation's
predictions, the training logs, the mechanism probes, gathered per method and seed along the step
chains run.py planned. `pipe` is run.py's pipeline (pipeline/steps.py): only its dir(key), where a
step's files are, is read.

    evals = Evals(pipe)
    results = collect(pipe, runs, row0, tasks, meta, probes, evals=evals)  # the finished run
    write_partial(collect(..., done=committed, evals=evals), run_dir)      # while it runs

and the run directory's other files: index.md (which step holds what) and timing.json.
"""
import json
from pathlib import Path

from common.errors import InputError
from common.jsonl import jsonl_lines, read_records
from common.outputs import write_json, write_text_atomic
from reporting.diagnostics import diagnose


# collect_probes' fields of a seed entry
PROBE_FIELDS = ("drift", "buffer_stats", "rollout_checks", "loss_sources")


def write_partial(results: dict, run_dir: Path) -> None:
    """results.json while the run runs: rewritten whenever an evaluation commits, from
    collect(..., done=committed): every method's stages whose training and evaluation are done;
    "partial": true at the top and on each unfinished seed's entry, its "stages" done, and no
    continual-learning metrics (they need the whole matrix) or probes. The finished run
    overwrites it."""
    methods = {label: {"seeds": {seed: {k: v for k, v in r.items() if k not in PROBE_FIELDS}
                                 for seed, r in entry["seeds"].items()}}
               for label, entry in results["methods"].items()}
    write_json(run_dir / "results.json", {**results, "methods": methods, "partial": True})


class Evals:
    """read_eval of each evaluation step, read once per run (a committed step does not change while
    the run runs), with the test examples every evaluation must share (test_idx)."""

    def __init__(self, pipe):
        self.pipe, self.read, self.test_idx = pipe, {}, {}

    def __call__(self, key: str):
        if key not in self.read:
            self.read[key] = read_eval(self.pipe.dir(key) / "eval", self.test_idx)
        return self.read[key]


def collect(pipe, runs: dict, row0: dict, tasks: list, meta: dict, probes: dict | None = None,
            done: set | None = None, evals: Evals | None = None) -> dict:
    """results.json (its schema: reporting/schema.py): per method and seed, the accuracy matrix
    (row i: tasks 1..i after stage i), row 0 (the base on every task), next_task (a(i, i+1): task
    i+1 after stage i, before training on it), the continual-learning metrics of
    data.metrics.cl_metrics, the per-step training loss of every stage, from each evaluation's
    predictions.jsonl, for the cells of the matrix, the per-example scores (averaged over eval
    repeats, in test_idx order: the test-set bootstrap) and the degenerate-answer diagnostics
    (reporting.diagnostics), and the mechanism probes (collect_probes). Every evaluation must
    have scored the same test examples of a task. done: the committed steps, for a partial
    collection (write_partial); evals: the run's Evals, so that an evaluation is read once
    however often this is called."""
    from data.metrics import cl_metrics
    eval_of = evals or Evals(pipe)  # eval steps are shared between methods: read each once
    test_idx = eval_of.test_idx

    methods = {}
    for label, by_seed in runs.items():
        methods[label] = {"seeds": {}}
        for seed, chain in by_seed.items():
            if done is not None and row0[seed] not in done:  # (a partial collection: write_partial)
                continue
            matrix, next_task, losses, sources, examples, diagnostics = [], [], [], [], [], []
            for i, (t_key, e_key) in enumerate(chain):
                if done is not None and (t_key not in done or e_key not in done):
                    break
                scores, per_example, diag = eval_of(e_key)
                matrix.append([scores[t] for t in tasks[:i + 1]])
                examples.append([per_example[t] for t in tasks[:i + 1]])
                diagnostics.append({t: diag[t] for t in tasks[:i + 1]})
                if i + 1 < len(tasks):
                    next_task.append(scores[tasks[i + 1]])
                log_path = pipe.dir(t_key) / "ckpt" / "train_log.jsonl"
                log = [json.loads(line) for line in jsonl_lines(log_path.read_text()) if line]
                losses.append([x["loss"] for x in log])
                sources.append({"task": [x["loss_task"] for x in log],
                                "replay": [x["loss_replay"] for x in log]}
                               if log and "loss_replay" in log[0] else None)
            base_row = [eval_of(row0[seed])[0][t] for t in tasks]
            partial = done is not None and len(matrix) < len(chain)
            methods[label]["seeds"][str(seed)] = {
                "matrix": matrix, "row0": base_row, "next_task": next_task,
                "cl_metrics": None if partial else cl_metrics(matrix, base_row, next_task),
                "loss_curves": losses, "example_scores": examples, "diagnostics": diagnostics}
            if partial:
                methods[label]["seeds"][str(seed)].update(partial=True, stages=len(matrix))
            if probes:
                methods[label]["seeds"][str(seed)].update(
                    collect_probes(pipe, probes[label][seed], sources, done))
    return {"tasks": tasks, "methods": methods,
            "test_idx": {t: test_idx[t] for t in tasks if t in test_idx}, "meta": meta}


def read_eval(eval_dir: Path, test_idx: dict):
    """(scores, per_example, diagnostics) of one evaluate.py output: scores.json's per-task means;
    per task the per-example scores averaged over repeats, ordered by idx (rounded to 1e-4);
    reporting.diagnostics.diagnose per task. test_idx ({task: [idx]}) is filled by the first
    evaluation and checked against by the others."""
    scores = json.loads((eval_dir / "scores.json").read_text())["scores"]
    by_task = {}
    for r in read_records(eval_dir / "predictions.jsonl",
                          required=("task", "idx", "prediction", "gold", "finish_reason",
                                    "num_tokens", "score"),
                          types={"idx": int, "num_tokens": int, "score": (int, float)}):
        by_task.setdefault(r["task"], []).append(r)
    per_example, diagnostics = {}, {}
    for t in scores:
        by_idx = {}
        for r in by_task.get(t, []):
            by_idx.setdefault(r["idx"], []).append(r["score"])
        idx = sorted(by_idx)
        if test_idx.setdefault(t, idx) != idx:
            raise InputError(f"{eval_dir / 'predictions.jsonl'}: task {t} was evaluated on other "
                             f"test examples than another evaluation of this run "
                             f"({len(idx)} vs {len(test_idx[t])})")
        per_example[t] = [round(sum(v) / len(v), 4) for v in (by_idx[i] for i in idx)]
        diagnostics[t] = diagnose(t, by_task[t])
    return scores, per_example, diagnostics


def collect_probes(pipe, found: dict, loss_sources: list, done: set | None = None) -> dict:
    """Per seed: "drift" = [{"stage" i, "tasks": {task: drift.py's per-task numbers}, "all"}] for
    every stage i >= 2 (KL(pi_i || pi_i-1) on tasks 1..i-1); "buffer_stats" = [{"stage" i,
    score.py's / buffer_nll.py's buffer_stats.json}] for the buffer built after stage i;
    "rollout_checks" = [{"stage" i, rollout.py's logprob_check}]; "loss_sources" as collect read
    them from the train logs: per stage, {"task": [per step], "replay": [per step]} (train.py's
    loss_task and loss_replay), or None for a stage trained without replay.
    done: the committed steps; each list then holds its stages up to the first one not committed."""
    if done is not None:
        found = {what: prefix_done(entries, done) for what, entries in found.items()}
    out = {"drift": [], "buffer_stats": [], "rollout_checks": [], "loss_sources": loss_sources}
    for stage, key in found["drift"]:
        d = json.loads((pipe.dir(key) / "drift" / "drift.json").read_text())
        out["drift"].append({"stage": stage, "tasks": d["tasks"], "all": d["all"]})
    for stage, key in found["buffers"]:
        out["buffer_stats"].append(
            {"stage": stage, **json.loads((pipe.dir(key) / "buffer_stats.json").read_text())})
    for stage, key in found["rollouts"]:
        path = pipe.dir(key) / "rollouts_summary.json"
        if path.exists():
            out["rollout_checks"].append({"stage": stage,
                                          **(json.loads(path.read_text())["logprob_check"] or {})})
    return out


def prefix_done(entries: list, done: set) -> list:
    """[(stage, key)] up to the first entry whose step is not in `done`."""
    out = []
    for stage, key in entries:
        if key not in done:
            break
        out.append((stage, key))
    return out


def write_index(pipe, runs: dict, row0: dict, path: Path):
    """index.md: which step directory holds what, by method, seed and stage (step keys name only
    stage and kind, and the early steps are shared by methods). Written before the steps run, so a
    running stage's live training log is found from it."""
    lines = ["# Steps of this run", "",
             "A step's output is `steps/KEY/` once done; while it runs it is `steps/KEY.tmp/` (a "
             "training stage's live log: `steps/KEY.tmp/ckpt.partial/train_log.jsonl`, and "
             "`tb/train/KEY/` for `tensorboard --logdir`). The checkpoint of a stage: "
             "`steps/KEY/ckpt` (with --keep-checkpoints last or final its weights may be pruned: "
             "manifest.json's entry of KEY says \"pruned\").", "",
             "| method | seed | stage | train | eval | buffer it trained with | "
             "rollouts scored into it |",
             "|---|---|---|---|---|---|---|"]
    for seed, key in row0.items():
        lines.append(f"| (base) | {seed} | 0 | - | {key} | - | - |")
    for label, by_seed in runs.items():
        for seed, chain in by_seed.items():
            prev = None
            for i, (t_key, e_key) in enumerate(chain, 1):
                buffer = next((d for d in pipe.steps[t_key]["deps"] if d != prev), None)
                rollout = next(iter(pipe.steps[buffer]["deps"]), None) if buffer else None
                lines.append(f"| {label} | {seed} | {i} | {t_key} | {e_key} | {buffer or '-'} | "
                             f"{rollout or '-'} |")
                prev = t_key
    write_text_atomic(path, "\n".join(lines) + "\n")


def write_timing(pipe, run_dir: Path):
    """What each kind of step cost (summed step seconds, a step counted in the run that executed
    it): timing.json, kept out of results.json so that the results stay a function of the command,
    its inputs and its seeds."""
    timing = {}
    for key, step in pipe.steps.items():
        t = timing.setdefault(step["kind"], {"steps": 0, "seconds": 0.0})
        t["steps"] += 1
        t["seconds"] = round(t["seconds"] + pipe.manifest[key]["seconds"], 2)
    write_json(run_dir / "timing.json", timing)
    print("run.py: step seconds by kind: " + ", ".join(f"{k} {v['seconds']:.0f} s ({v['steps']})"
                                                       for k, v in timing.items()))
