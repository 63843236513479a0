"""report.py — the paper-style report of a continual-learning run: tables (Markdown) and figures (PNG).

    python report.py runs/tiny            # rebuilds runs/tiny/report.md and its figures from runs/tiny/results.json

run.py calls write_report() and format_table() at the end of every run; this script redoes that step alone, e.g.
after a change to the report or on a results.json copied from another machine. Nothing is recomputed but the
report: the numbers come from results.json only.

results.json (written by run.py's collect; JSON):

    {"tasks": ["C-STANCE", "FOMC", ...],                    # stage order
     "methods": {label: {"seeds": {seed: run}}},            # label: a method, or "method@rho" in a rho sweep;
                                                            # seed: the seed as a string ("0", "1", ...)
     "test_idx": {task: [idx, ...]},                        # optional: the test examples evaluated, in the order
                                                            # of every "example_scores" list (record numbers)
     "meta": {...}}                                         # settings, printed as-is at the top of the report;
                                                            # optional "seed_noise": {"seeds": n, "measured": where,
                                                            # "std": {m: {"acc", "bwt"}}, "delta_std": {ref: {m:
                                                            # {"acc", "bwt"}}}}: the run's preset's seed noise

    run = {"matrix": [[a00], [a10, a11], ...],              # matrix[i][j]: score (0..100) of task j after stage i,
                                                            # j <= i (ragged rows)
           "row0": [a(0, j) for every task],                # optional: the base model before stage 1
           "next_task": [a(i, i+1) for i < N-1],            # optional: task i+1 after stage i, before training it
           "cl_metrics": {...},                             # optional: data.metrics.cl_metrics (recomputed here)
           "loss_curves": [[loss per step of stage 0], ...],  # optional
           "example_scores": [[[s, ...]], [[...], [...]], ...],  # optional, ragged like matrix: per test example
                                                            # (order of test_idx) its score averaged over eval
                                                            # repeats; the mean of a list is the matrix entry
                                                            # (to EXAMPLE_MEAN_TOL, checked)
           "diagnostics": [{task: diag}, ...],              # optional, per stage: reporting.diagnostics.diagnose of
                                                            # that evaluation's predictions (label distribution,
                                                            # collapse flag, off-format answers, empty /
                                                            # length-capped rates)
           # optional, run.py's mechanism probes (drift.py, score.py / buffer_nll.py, rollout.py, train.py):
           "drift": [{"stage": i, "tasks": {task: {"n", "mean_seq_kl", "median_seq_kl", "kl_per_token",
                      "mean_tokens", "gold_nll_cur", "gold_nll_ref"}}, "all": {same}}],  # stages i >= 2: KL of
                                                            # stage i vs i-1 on the test prompts of tasks 1..i-1
           "buffer_stats": [{"stage": i, "scorer", "select", "spearman_ru_sc", "tasks": {...}, "all": {"selected":
                             {"n", "nll_mean", "nll_max", "token_nll_max"}, "rejected": {same} or null}}],
                                                            # the buffer built after stage i: per-token NLL under
                                                            # the checkpoint that built it
           "rollout_checks": [{"stage": i, "k", "tokens", "mean_abs_dlogp", "max_abs_dlogp", "k3_kl", "warned"}],
           "loss_sources": [{"task": [per step], "replay": [per step]} or null per stage]}

Sections of the report and the functions that make them:

    summarize(results)        numbers: mean/std over seeds of ACC, BWT, FWT, forgetting, TRACE's OP and 1/N BWT
                              and the final per-task scores; the mean matrix with row 0 and next-task scores
    uncertainty(results)      95% intervals: per method (test-set bootstrap) and paired differences vs REFERENCES
                              per seed (t-interval over seeds, test-set bootstrap), with a "resolved" verdict
    noise_numbers(results)    where the seed spread of ACC and BWT comes from: each task's share, and the part more
                              test prompts would remove (reporting.stats.noise_sources); noise_tables(...) shows it
    format_table(results)     the main table (Markdown; readable in a terminal), printed by run.py at the end
    delta_table(...)          paired differences against one reference method
    diagnostics_table(...)    degenerate answers next to each accuracy matrix; warning_lines(...) flags them
    markdown_report(results)  the whole report.md text
    write_report(results, out_dir) -> out_dir/report.md, plus the figures next to it

ACC and BWT come from data.metrics.acc_bwt, FWT / per-task forgetting / TRACE's OP and 1/N BWT from
data.metrics.cl_metrics (FWT needs row0 and next_task), once per seed; statistics and intervals come from reporting.stats
(its docstring says which noise each interval covers). "std" is the sample std over seeds (n-1). A method may have
fewer stages than there are tasks (a run in progress): its ACC/BWT then cover the stages it has, and the tasks it
has not reached show as "-".

Methods in ACC_ONLY (mtl) show their ACC, OP and accuracy matrix only: each row of their matrix is a separate joint
run from the base, so BWT, FWT and forgetting, which compare rows, measure nothing. summarize() leaves those fields
undefined for them (results.json keeps its cl_metrics unchanged); the tables print "—" there, and the BWT and
forgetting figures, the paired ΔBWT and the forgetting-vs-drift points leave them out.

The file is organised in sections (checks, numbers, tables and report text, figures and writing, command line): a
new part of the report adds its numbers, its table and its figure to the matching sections and its fields to the
schema above.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from reporting.diagnostics import warnings as diagnostic_warnings
from data.metrics import acc_bwt, cl_metrics
from pipeline.cli import Parser, UserError, main_cli
from reporting.stats import (BOOTSTRAP_B, BOOTSTRAP_SEED, LEVEL, bootstrap_acc_bwt, bootstrap_indices, excludes_zero,
                        known_std_interval, mean_std, noise_sources, paired_differences, pearson,
                        percentile_interval, spearman, t_interval)

REFERENCE = "replay"              # the baseline of the "delta vs replay" figure
REFERENCES = ("replay", "sft")    # paired-difference tables, in this order, for those present in the run
NOISE_MIN_SEEDS = 3               # "where the seed noise comes from" for methods with at least this many seeds
ACC_ONLY = ("mtl",)               # rows are independent joint runs: only ACC (and the matrix) is shown
EXAMPLE_MEAN_TOL = 1e-3           # per-example scores must average to their matrix entry (run.py rounds them to 1e-4)
FIGURES = {  # file name -> what it shows (paper figure)
    "fig_matrix.png": "accuracy matrices: score of each task (column) after each stage (row)",
    "fig_trajectories.png": "per-task score across stages, from the stage that trains it (paper Fig. 3); dotted: "
                            "before it is trained (stage 0 = the base model)",
    "fig_loss.png": "training loss per step, each stage stretched to unit width (paper Fig. 4)",
    "fig_delta_vs_replay.png": f"final per-task score minus the '{REFERENCE}' method's (paper Fig. 5)",
    "fig_bwt_acc.png": "BWT vs ACC, one point per method (paper Fig. 1, right); mtl left out: its rows are separate "
                       "runs",
    "fig_forgetting.png": "per-task forgetting (best earlier score - final score) per method; FWT in the legend; mtl "
                          "left out",
}
MECHANISM_FIGURES = {  # drawn when results.json holds run.py's mechanism probes
    "fig_drift.png": "per-update KL(pi_i || pi_i-1) on the prior tasks' held-out prompts, per stage (paper Eq. 1's "
                     "quantity)",
    "fig_drift_vs_forgetting.png": "per-task forgetting a(i, j) - a(i-1, j) against the KL on task j's prompts",
    "fig_loss_sources.png": "training loss per step on the stage's own examples (solid) and on replayed ones (dashed)",
}


def acc_only(label: str) -> bool:
    """True for a method (label "method" or "method@rho") whose BWT, FWT and forgetting mean nothing (ACC_ONLY)."""
    return label.split("@")[0] in ACC_ONLY


# ---------------------------------------------------------------------------------------------------------------
# Checks


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_results(results) -> None:
    """Raise ValueError naming the offending path (e.g. results['methods']['opr']['seeds']['0']['matrix'][2])."""
    if not isinstance(results, dict):
        raise ValueError(f"results: expected a dict, got {type(results).__name__}")
    tasks = results.get("tasks")
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
        raise ValueError("results['tasks']: expected a non-empty list of task names")
    methods = results.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise ValueError("results['methods']: expected a non-empty dict {method: {'seeds': ...}}")
    test_idx = results.get("test_idx") or {}
    if not isinstance(test_idx, dict) or not all(isinstance(v, list) for v in test_idx.values()):
        raise ValueError("results['test_idx']: expected a dict {task: [idx, ...]}")
    if not isinstance(results.get("meta") or {}, dict):
        raise ValueError("results['meta']: expected a dict of settings")
    sizes = {t: len(v) for t, v in test_idx.items()}  # examples per task: every example_scores list must agree
    for m, entry in methods.items():
        seeds = entry.get("seeds") if isinstance(entry, dict) else None
        if not isinstance(seeds, dict) or not seeds:
            raise ValueError(f"results['methods'][{m!r}]['seeds']: expected a non-empty dict {{seed: run}}")
        n_stages = set()
        for s, run in seeds.items():
            where = f"results['methods'][{m!r}]['seeds'][{s!r}]"
            matrix = run.get("matrix") if isinstance(run, dict) else None
            if not isinstance(matrix, list) or not matrix:
                raise ValueError(f"{where}['matrix']: expected a non-empty list of rows")
            if len(matrix) > len(tasks):
                raise ValueError(f"{where}['matrix']: {len(matrix)} stages but only {len(tasks)} tasks")
            for i, row in enumerate(matrix):
                if not isinstance(row, list) or len(row) < i + 1 or not all(_is_number(v) for v in row[:i + 1]):
                    raise ValueError(f"{where}['matrix'][{i}]: expected at least {i + 1} finite numbers, got {row!r}")
            # next_task: a(i, i+1) after every finished stage that has a next task (run.py writes exactly these)
            for key, want in (("row0", len(tasks)), ("next_task", min(len(matrix), len(tasks) - 1))):
                vals = run.get(key)
                if vals is not None and (not isinstance(vals, list) or len(vals) < want or
                                         not all(_is_number(v) for v in vals)):
                    raise ValueError(f"{where}[{key!r}]: expected at least {want} finite numbers, got {vals!r}")
            for key in ("loss_curves", "drift", "buffer_stats", "rollout_checks", "loss_sources"):  # optional lists
                if not isinstance(run.get(key) or [], list):
                    raise ValueError(f"{where}[{key!r}]: expected a list, got {type(run[key]).__name__}")
            for i, curve in enumerate(run.get("loss_curves") or []):
                if not isinstance(curve, list) or not all(_is_number(v) for v in curve):
                    raise ValueError(f"{where}['loss_curves'][{i}]: expected a list of finite numbers")
            examples = run.get("example_scores")
            if examples is not None:
                if not isinstance(examples, list) or len(examples) != len(matrix):
                    raise ValueError(f"{where}['example_scores']: expected one row per stage ({len(matrix)})")
                for i, row in enumerate(examples):
                    if not isinstance(row, list) or len(row) < i + 1:
                        raise ValueError(f"{where}['example_scores'][{i}]: expected at least {i + 1} lists")
                    for j in range(i + 1):
                        cell = row[j]
                        if not isinstance(cell, list) or not cell or not all(_is_number(v) for v in cell):
                            raise ValueError(f"{where}['example_scores'][{i}][{j}]: expected a non-empty list of "
                                             f"finite numbers")
                        if sizes.setdefault(tasks[j], len(cell)) != len(cell):
                            raise ValueError(f"{where}['example_scores'][{i}][{j}]: {len(cell)} examples of "
                                             f"{tasks[j]}, elsewhere {sizes[tasks[j]]}")
                        mean = statistics.fmean(cell)
                        if abs(mean - matrix[i][j]) > EXAMPLE_MEAN_TOL:
                            raise ValueError(f"{where}['example_scores'][{i}][{j}]: the examples' mean {mean:.4f} "
                                             f"is not matrix[{i}][{j}] = {matrix[i][j]:.4f}")
            diags = run.get("diagnostics")
            if diags is not None and (not isinstance(diags, list) or len(diags) != len(matrix)
                                      or not all(isinstance(d, dict) for d in diags)):
                raise ValueError(f"{where}['diagnostics']: expected one dict {{task: diagnostics}} per stage")
            n_stages.add(len(matrix))
        if len(n_stages) > 1:
            raise ValueError(f"results['methods'][{m!r}]: seeds have different numbers of stages {sorted(n_stages)}")


# ---------------------------------------------------------------------------------------------------------------
# Numbers


def summarize(results) -> dict:
    """Per method, in the order of results['methods']:

    {"seeds": [seed, ...], "stages": n,                      # n = stages trained (rows of the matrix)
     "acc": {"mean", "std", "n"}, "bwt": {"mean", "std", "n"},  # std: sample std over seeds, None with one seed;
                                                             # bwt mean/std None when n == 1
     "per_seed": {seed: {"acc", "bwt"}},                   # bwt None for an ACC_ONLY method
     "acc_only": bool,                                     # ACC_ONLY: bwt, fwt, forgetting(_mean), bwt_trace undefined
     "final": {task: {"mean", "std", "n"}},                # last row, for the n tasks trained so far
     "matrix": [[mean]] and "matrix_std": [[std]],    # ragged like the input (row i has i+1 entries)
     "fwt", "forgetting_mean", "op", "bwt_trace": {"mean", "std", "n"},   # mean None where undefined (FWT: no row 0)
     "forgetting": {task: {"mean", "std", "n"}},           # the first n-1 tasks
     "row0": [mean] or None, "next_task": [mean] or None}
    """
    check_results(results)
    tasks, out = results["tasks"], {}
    for m, entry in results["methods"].items():
        seeds = list(entry["seeds"])
        matrices = [[row[:i + 1] for i, row in enumerate(entry["seeds"][s]["matrix"])] for s in seeds]
        n = len(matrices[0])
        per_seed = {s: dict(zip(("acc", "bwt"), acc_bwt(mx))) for s, mx in zip(seeds, matrices)}
        cells = [[mean_std([mx[i][j] for mx in matrices]) for j in range(i + 1)] for i in range(n)]
        runs = [entry["seeds"][s] for s in seeds]
        with_row0 = all(r.get("row0") is not None and r.get("next_task") is not None for r in runs)
        cls = [cl_metrics(mx, r["row0"][:n] if with_row0 else None, r["next_task"][:n - 1] if with_row0 else None)
               for mx, r in zip(matrices, runs)]

        def over_seeds(key):
            vals = [c[key] for c in cls]
            return mean_std(vals) if all(v is not None for v in vals) else {"mean": None, "std": None, "n": len(vals)}
        out[m] = {
            "seeds": seeds, "stages": n,
            "acc": mean_std([r["acc"] for r in per_seed.values()]),
            "bwt": (mean_std([r["bwt"] for r in per_seed.values()]) if n > 1
                    else {"mean": None, "std": None, "n": len(seeds)}),
            "per_seed": per_seed,
            "final": {tasks[j]: cells[n - 1][j] for j in range(n)},
            "matrix": [[c["mean"] for c in row] for row in cells],
            "matrix_std": [[c["std"] for c in row] for row in cells],
            **{k: over_seeds(k) for k in ("fwt", "forgetting_mean", "op", "bwt_trace")},
            "forgetting": {tasks[j]: mean_std([c["forgetting"][j] for c in cls]) for j in range(n - 1)},
            "row0": [statistics.fmean(r["row0"][j] for r in runs) for j in range(len(tasks))] if with_row0 else None,
            "next_task": [statistics.fmean(r["next_task"][i] for r in runs) for i in range(min(n, len(tasks) - 1))]
            if with_row0 else None,
            "acc_only": acc_only(m),
        }
        if acc_only(m):  # each row its own joint run from the base: nothing that compares rows is defined
            for k in ("bwt", "fwt", "forgetting_mean", "bwt_trace"):
                out[m][k] = {"mean": None, "std": None, "n": len(seeds)}
            out[m]["forgetting"] = {}
            out[m]["per_seed"] = {k: {"acc": v["acc"], "bwt": None} for k, v in per_seed.items()}
    return out


def _seed_mean(arrays):
    """Element-wise mean over seeds of bootstrap samples ([B] arrays)."""
    return np.mean(arrays, axis=0)


def _interval(xs):
    return None if xs is None else percentile_interval(xs)


def uncertainty(results, summary=None, B: int = BOOTSTRAP_B, seed: int = BOOTSTRAP_SEED) -> dict:
    """95% intervals for every method and every paired difference (reporting.stats says which noise each covers):

    {"bootstrap": {"B", "seed", "sizes": {task: n}} or None,   # None: results.json has no per-example scores
     "methods": {m: {"acc_test": (lo, hi) | None, "bwt_test": (lo, hi) | None}},
     "deltas": {ref: {m: {"acc": D, "bwt": D}}}}               # ref in REFERENCES present in the run, m != ref with
                                                               # as many stages as ref
    D = {"per_seed": {seed: m - ref}, "n": paired seeds, "mean": mean of per_seed,
         "seeds": t-interval over the paired seeds; with one paired seed, the interval from the per-seed std of
         this difference measured for the run's preset (meta "seed_noise", written by run.py when the run used
         the preset's settings unchanged), else None; "seeds_source": "run", "preset" or None,
         "test": bootstrap interval of the seed-averaged difference, the same resampled test prompts for m and
         ref (None without per-example scores), "resolved": True when every available interval excludes 0}
    """
    summary = summary or summarize(results)
    tasks, methods = results["tasks"], results["methods"]
    have_examples = all(run.get("example_scores") is not None for e in methods.values() for run in e["seeds"].values())
    boot = None
    if have_examples:
        sizes = {}
        for e in methods.values():
            for run in e["seeds"].values():
                for i, row in enumerate(run["example_scores"]):
                    for j in range(i + 1):
                        sizes.setdefault(tasks[j], len(row[j]))
        sizes = {t: sizes[t] for t in tasks if t in sizes}
        idx = bootstrap_indices(sizes, B, seed)
        # per method and seed: ACC/BWT of every resample ([B] arrays), all methods on the same resampled prompts
        per_seed = {m: {s: bootstrap_acc_bwt([[row[:i + 1] for i, row in enumerate(run["example_scores"])]],
                                             tasks, idx)
                        for s, run in e["seeds"].items()} for m, e in methods.items()}
        boot = {"B": B, "seed": seed, "sizes": sizes}

    noise = (results.get("meta") or {}).get("seed_noise") or {}
    out = {"bootstrap": boot, "methods": {}, "deltas": {}}
    for m, s in summary.items():
        acc = bwt = None
        if boot:
            acc = _seed_mean([per_seed[m][k]["acc"] for k in s["seeds"]])
            bwt = (_seed_mean([per_seed[m][k]["bwt"] for k in s["seeds"]])
                   if s["stages"] > 1 and not s["acc_only"] else None)
        out["methods"][m] = {"acc_test": _interval(acc), "bwt_test": _interval(bwt)}

    for ref in [r for r in REFERENCES if r in summary]:
        out["deltas"][ref] = {}
        for m, s in summary.items():
            if m == ref or s["stages"] != summary[ref]["stages"]:
                continue
            entry = {}
            for metric in ("acc", "bwt"):
                if metric == "bwt" and (s["stages"] < 2 or s["acc_only"] or summary[ref]["acc_only"]):
                    continue
                d = paired_differences({k: v[metric] for k, v in s["per_seed"].items()},
                                       {k: v[metric] for k, v in summary[ref]["per_seed"].items()})
                if not d:
                    continue
                test = None
                if boot:
                    test = percentile_interval(_seed_mean(
                        [per_seed[m][k][metric] - per_seed[ref][k][metric] for k in d]))
                seeds_ci, source = t_interval(d.values()), "run"
                sigma = ((noise.get("delta_std") or {}).get(ref) or {}).get(m, {}).get(metric)
                if seeds_ci is None and sigma is not None:  # one seed: the preset's measured seed noise
                    seeds_ci, source = known_std_interval(d.values(), sigma, noise["seeds"]), "preset"
                available = [ci for ci in (seeds_ci, test) if ci is not None]
                entry[metric] = {"per_seed": d, "n": len(d), "mean": statistics.fmean(d.values()), "seeds": seeds_ci,
                                 "seeds_source": source if seeds_ci else None, "test": test,
                                 "resolved": bool(available) and all(map(excludes_zero, available))}
            out["deltas"][ref][m] = entry
    return out


def _noise_parts(run: dict, n: int) -> dict:
    """One seed's inputs to noise_sources: {"acc": (final row [n], its per-example arrays or None), "bwt": (final
    minus own-stage score of tasks 1..n-1, the same per example or None)}."""
    m, e = run["matrix"], run.get("example_scores")
    e = [[np.asarray(x, dtype=np.float64) for x in row] for row in e] if e else None
    return {"acc": (np.asarray(m[n - 1][:n], dtype=np.float64), e[n - 1][:n] if e else None),
            "bwt": (np.asarray([m[n - 1][j] - m[j][j] for j in range(n - 1)], dtype=np.float64),
                    [e[n - 1][j] - e[j][j] for j in range(n - 1)] if e else None)}


def _noise_minus(a: dict, b: dict) -> dict:
    """_noise_parts of the paired difference a - b (per-example parts only when both have them)."""
    return {k: (a[k][0] - b[k][0], None if a[k][1] is None or b[k][1] is None else
                [x - y for x, y in zip(a[k][1], b[k][1])]) for k in a}


def _noise_of(parts: list, n: int, with_bwt: bool = True) -> dict:
    """noise_sources of ACC and BWT (None with one stage or without with_bwt) from one _noise_parts entry per seed;
    the test-prompt part only when every seed has per-example scores."""
    out = {}
    for key in ("acc", "bwt"):
        values, examples = [p[key][0] for p in parts], [p[key][1] for p in parts]
        out[key] = None if key == "bwt" and (n < 2 or not with_bwt) else noise_sources(
            values, None if any(x is None for x in examples) else examples)
    return out


def noise_numbers(results, summary=None) -> dict:
    """Where the seed spread of ACC and BWT comes from (reporting.stats.noise_sources): {label: {"acc": ..., "bwt": ...
    or None}}. One label per method with >= NOISE_MIN_SEEDS seeds, then "m − ref" for each paired difference against
    REFERENCES with as many paired seeds and stages (the spread that sets the width of its seed interval). ACC from
    the final row, BWT from final minus own-stage score of every task but the last, each with its per-example
    scores when every seed has them (then the test-prompt part and the floor are known)."""
    summary = summary or summarize(results)
    parts = {m: {k: _noise_parts(results["methods"][m]["seeds"][k], s["stages"]) for k in s["seeds"]}
             for m, s in summary.items()}
    out = {m: _noise_of(list(parts[m].values()), s["stages"], not s["acc_only"])
           for m, s in summary.items() if len(s["seeds"]) >= NOISE_MIN_SEEDS}
    for ref in [r for r in REFERENCES if r in summary]:
        for m, s in summary.items():
            paired = [k for k in s["seeds"] if k in parts[ref]]
            if (m == ref or s["stages"] != summary[ref]["stages"] or len(paired) < NOISE_MIN_SEEDS
                    or f"{ref} − {m}" in out):  # the same spread as its mirror
                continue
            out[f"{m} − {ref}"] = _noise_of([_noise_minus(parts[m][k], parts[ref][k]) for k in paired], s["stages"],
                                            not (s["acc_only"] or summary[ref]["acc_only"]))
    return out


def diagnostic_flags(results) -> list:
    """[(method, stage (1-based), task, [(seed, [reason, ...]), ...])] for every flagged evaluation, in run order."""
    tasks, out = results["tasks"], []
    for m, entry in results["methods"].items():
        flags = {}
        for s, run in entry["seeds"].items():
            for i, stage in enumerate(run.get("diagnostics") or []):
                for t in tasks:
                    reasons = diagnostic_warnings(stage[t]) if t in stage else []
                    if reasons:
                        flags.setdefault((i + 1, t), []).append((s, reasons))
        for (stage, t), reasons in sorted(flags.items(), key=lambda kv: (kv[0][0], tasks.index(kv[0][1]))):
            out.append((m, stage, t, reasons))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Tables and report text


NOT_SHOWN = "—"  # an ACC_ONLY method's BWT, FWT, forgetting: defined by the formula, meaningless for it


def _fmt(ms: dict, with_std: bool = True, undefined: str = "-") -> str:
    if ms["mean"] is None:
        return undefined
    if with_std and ms["std"] is not None:
        return f"{ms['mean']:.2f} ± {ms['std']:.2f}"
    return f"{ms['mean']:.2f}"


def _ci(interval, signed=False) -> str:
    if interval is None:
        return "-"
    f = "{:+.2f}" if signed else "{:.2f}"
    return "[" + f.format(interval[0]) + ", " + f.format(interval[1]) + "]"


def _markdown(header, rows) -> str:
    """A Markdown table aligned so it also reads as plain text: first column left-aligned, the others right."""
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]

    def line(cells):
        padded = [c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" if k else "-" * (w + 2) for k, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])


def format_table(results, summary=None, unc=None) -> str:
    """The main table: one row per method; ACC and BWT as mean ± sample std over seeds (the std when there are
    several), each with its 95% test-set bootstrap interval when results.json has per-example scores, FWT and mean
    forgetting, then the final score of each task (mean over seeds). Markdown, aligned so it also reads as text."""
    summary = summary or summarize(results)
    unc = unc or uncertainty(results, summary)
    tasks = results["tasks"]
    with_ci = unc["bootstrap"] is not None
    header = (["method", "seeds", "ACC"] + (["ACC 95% CI"] if with_ci else []) + ["BWT"] +
              (["BWT 95% CI"] if with_ci else []) + ["FWT", "forgetting"] + tasks)
    rows = []
    for m, s in summary.items():
        ci, na = unc["methods"][m], NOT_SHOWN if s["acc_only"] else "-"
        rows.append([m, str(len(s["seeds"])), _fmt(s["acc"])] + ([_ci(ci["acc_test"])] if with_ci else []) +
                    [_fmt(s["bwt"], undefined=na)] + ([_ci(ci["bwt_test"]) if not s["acc_only"] else na]
                                                      if with_ci else []) +
                    [_fmt(s["fwt"], undefined=na), _fmt(s["forgetting_mean"], undefined=na)] +
                    [_fmt(s["final"][t], with_std=False) if t in s["final"] else "-" for t in tasks])
    return _markdown(header, rows)


def _verdict(d: dict) -> str:
    if not d["resolved"]:
        return "no"
    if d["seeds"] is None:
        return "yes (test set only; 1 seed)" if d["n"] == 1 else "yes (test set only)"
    if d.get("seeds_source") == "preset":
        return "yes (preset's seed std)"
    return "yes" if d["test"] is not None else "yes (seeds only)"


def delta_table(summary, unc, ref: str) -> str:
    """Paired differences `method - ref` of ACC and BWT: mean over the paired seeds, the t-interval over seeds,
    the test-set bootstrap interval, and whether the difference is resolved (every available interval excludes 0)."""
    header = ["method", "paired seeds", "ΔACC", "CI seeds", "CI test set", "resolved", "ΔBWT", "CI seeds",
              "CI test set", "resolved"]
    rows = []
    for m, entry in unc["deltas"][ref].items():
        row = [m, str(entry["acc"]["n"]) if "acc" in entry else "0"]
        for metric in ("acc", "bwt"):
            d = entry.get(metric)
            na = NOT_SHOWN if metric == "bwt" and summary[m]["acc_only"] else "-"
            row += ([na] * 4 if d is None else
                    [f"{d['mean']:+.2f}", _ci(d["seeds"], True) + ("†" if d.get("seeds_source") == "preset" else ""),
                     _ci(d["test"], True), _verdict(d)])
        rows.append(row)
    return _markdown(header, rows)


def noise_tables(tasks, nn: dict) -> list:
    """Two Markdown tables from noise_numbers: per method (and paired difference) the seed std of ACC and BWT, the
    share of their variance that is test-prompt noise and the floor no test-set size goes below; then each task's
    seed std of its final score (of its difference) with its share of ACC's (ΔACC's) variance. An ACC_ONLY method's
    BWT (and its differences') shows as NOT_SHOWN."""
    def part(ns, label=""):
        if ns is None:
            return [NOT_SHOWN if any(acc_only(x) for x in label.split(" − ")) else "-"] * 3
        if ns["prompt"] is None:
            return [f"{ns['std']:.2f}", "-", "-"]
        share = ns["prompt"] / ns["std"] ** 2 if ns["std"] > 0 else 0.0
        return [f"{ns['std']:.2f}", f"{share:.0%}", f"{ns['floor']:.2f}"]
    rows = [[m, str(v["acc"]["n"]), *part(v["acc"]), *part(v["bwt"], m)] for m, v in nn.items()]
    first = _markdown(["method or Δ", "seeds", "ACC std", "of it test prompts", "ACC floor", "BWT std",
                       "of it test prompts", "BWT floor"], rows)
    n_tasks = max(len(v["acc"]["task_std"]) for v in nn.values())
    rows = []
    for m, v in nn.items():
        a = v["acc"]
        cells = [f"{sd:.1f} ({sh:+.0%})" if a["share"] is not None else f"{sd:.1f}"
                 for sd, sh in zip(a["task_std"], a["share"] or [None] * len(a["task_std"]))]
        rows.append([m] + cells + ["-"] * (n_tasks - len(cells)))
    second = _markdown(["method or Δ"] + list(tasks[:n_tasks]), rows)
    return [first, "", "Per task: the seed std of the final score and (its share of ACC's variance); for a Δ row, of the "
                   "per-seed difference of final scores (its share of ΔACC's variance):", "", second]


def matrix_table(tasks, s: dict) -> str:
    """Markdown accuracy matrix of one method (mean over seeds): row i = after stage i, column j = task j. With row 0
    (the base model) and the next-task scores, row 0 leads and each row also shows task i+1 in parentheses (scored
    before it was trained: the FWT entries)."""
    n = s["stages"]
    nxt = s.get("next_task")
    cols = min(n + 1, len(tasks)) if nxt is not None else n
    lines = ["| after stage | " + " | ".join(tasks[:cols]) + " |", "|---|" + "---:|" * cols]
    if s.get("row0") is not None:
        lines.append("| 0: base | " + " | ".join(f"{v:.2f}" for v in s["row0"][:cols]) + " |")
    for i, row in enumerate(s["matrix"]):
        cells = [f"{v:.2f}" for v in row]
        if nxt is not None and i < len(nxt) and len(cells) < cols:
            cells.append(f"({nxt[i]:.2f})")
        cells += ["-"] * (cols - len(cells))
        lines.append(f"| {i + 1}: {tasks[i]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def transfer_table(tasks, summary) -> str:
    """TRACE's conventions and per-task forgetting: OP (= ACC), BWT averaged over all N tasks (TRACE eq. 2 and the
    official OPR code's show_result.py: (N-1)/N of BWT), and each task's best earlier score minus its final one."""
    forg_tasks = tasks[:max(s["stages"] for s in summary.values()) - 1]
    lines = ["| method | OP (TRACE) | BWT (TRACE, 1/N) | " + " | ".join(f"forgetting {t}" for t in forg_tasks) + " |",
             "|---|---:|---:|" + "---:|" * len(forg_tasks)]
    for m, s in summary.items():
        na = NOT_SHOWN if s["acc_only"] else "-"
        cells = [_fmt(s["op"]), _fmt(s["bwt_trace"], undefined=na)] + [
            _fmt(s["forgetting"][t], with_std=False) if t in s["forgetting"] else na for t in forg_tasks]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def protocol_line(meta: dict) -> str:
    """The settings that decide how a number was made, in words (from results.json meta.cfg)."""
    cfg = (meta or {}).get("cfg") or {}
    parts = [f"scoring {cfg['scoring']}" if cfg.get("scoring") else None,
             f"{cfg['eval_repeats']} sample(s) per test prompt" if cfg.get("eval_repeats") else None,
             f"replay budget {cfg['replay_budget']}" if cfg.get("replay_budget") else None,
             f"training subsample {cfg['max_train']} per task" if cfg.get("max_train") else None,
             f"at most {cfg['eval_limit']} test prompts per task" if cfg.get("eval_limit") else None]
    parts = [x for x in parts if x]
    return "- protocol: " + ("; ".join(parts) if parts else "not recorded")


def _diag_cell(diags: list) -> str:
    """One evaluation's answers, over the seeds that have it: the most frequent predicted label and its share
    (classification tasks; shares averaged over seeds), the off-format (not a letter alone), empty and
    length-capped shares when not 0; '!' when a seed's evaluation is flagged."""
    parts = []
    if "labels" in diags[0]:
        pooled = {}
        for d in diags:
            for k, v in d["labels"].items():
                if k:  # empty answers are counted below
                    pooled[k] = pooled.get(k, 0.0) + v / len(diags)
        if pooled:
            top = min(pooled.items(), key=lambda kv: (-kv[1], kv[0]))
            parts.append(f"{top[0]} {top[1]:.0%}")
    off = statistics.fmean(d.get("off_format", 0.0) for d in diags)  # results.json of earlier code lack it
    if off:
        parts.append(f"off-format {off:.0%}")
    empty = statistics.fmean(d["empty"] for d in diags)
    capped = statistics.fmean(d["length_capped"] for d in diags)
    if empty:
        parts.append(f"empty {empty:.0%}")
    if capped:
        parts.append(f"capped {capped:.0%}")
    flag = " !" if any(diagnostic_warnings(d) for d in diags) else ""
    return (", ".join(parts) or "ok") + flag


def diagnostics_table(tasks, entry: dict, n_stages: int):
    """Markdown table of one method's answers (cells: _diag_cell), shaped like its accuracy matrix, and a line with
    the gold labels' majority class of each classification task; None when results.json has no diagnostics."""
    runs = [r.get("diagnostics") for r in entry["seeds"].values()]
    if any(r is None for r in runs):
        return None
    lines = ["| after stage | " + " | ".join(tasks[:n_stages]) + " |", "|---|" + "---:|" * n_stages]
    gold = {}
    for i in range(n_stages):
        cells = []
        for j in range(i + 1):
            diags = [r[i][tasks[j]] for r in runs if tasks[j] in r[i]]
            cells.append(_diag_cell(diags) if diags else "-")
            if diags and "gold_labels" in diags[0]:
                gold[tasks[j]] = diags[0]
        lines.append(f"| {i + 1}: {tasks[i]} | " + " | ".join(cells + ["-"] * (n_stages - i - 1)) + " |")
    if gold:
        lines += ["", "Gold labels' majority class: " + ", ".join(
            f"{t} {min(d['gold_labels'].items(), key=lambda kv: (-kv[1], kv[0]))[0]!r} {d['gold_majority_rate']:.0%}"
            for t, d in gold.items()) + "."]
    return "\n".join(lines)


def warning_lines(results) -> list:
    """One line per flagged (method, stage, task), naming the seeds and the reasons."""
    lines = []
    for m, stage, t, reasons in diagnostic_flags(results):
        why = "; ".join(f"seed {s}: {', '.join(r)}" for s, r in reasons)
        lines.append(f"WARNING {m}, after stage {stage} ({results['tasks'][stage - 1]}), task {t}: {why}")
    return lines


def markdown_report(results, summary=None, figures=(), unc=None) -> str:
    """report.md: the main table with notes, the paired differences, each method's accuracy matrix with its
    degenerate-answer diagnostics and warnings, and links to `figures` (file names)."""
    summary = summary or summarize(results)
    unc = unc or uncertainty(results, summary)
    tasks = results["tasks"]
    boot = unc["bootstrap"]
    flags = warning_lines(results)
    out = ["# Continual SFT on " + ", ".join(tasks), "", protocol_line(results.get("meta"))]
    for k, v in (results.get("meta") or {}).items():
        if k == "seed_noise":  # shown where it is used (results notes, paired differences)
            continue
        out.append(f"- {k}: {v if isinstance(v, str) else json.dumps(v)}")
    n_seeds = sorted({len(s["seeds"]) for s in summary.values()})
    out += ["", "## Results", "", format_table(results, summary, unc), "",
            "- ACC: mean final score over the tasks trained so far; BWT: mean over all but the last of them of "
            "(final score - score right after training it); negative BWT = forgetting. FWT: mean over tasks 2..N "
            "of (score before training it, after the previous stage - the base model's score); forgetting: mean "
            "over all but the last task of (best earlier score - final score). Scores are 0..100.",
            f"- Seeds per method: {', '.join(map(str, n_seeds))}; 'a ± b' = mean ± sample standard deviation over "
            f"seeds (n-1 denominator; no ± with one seed); per-task columns are means."]
    if boot:
        out.append(f"- 95% CI: percentile bootstrap over test prompts ({boot['B']} resamples of each task's test "
                   f"examples with replacement, numpy seed {boot['seed']}; test examples per task: " +
                   ", ".join(f"{t} {n}" for t, n in boot["sizes"].items()) + "). It covers which test prompts were "
                   "drawn, with the trained checkpoints held fixed; it does not cover training or seed noise.")
    else:
        out.append("- results.json holds no per-example scores: no test-set intervals (re-run run.py to add them).")
    noise = (results.get("meta") or {}).get("seed_noise")
    if max(n_seeds) == 1 and noise:
        out.append(f"- One seed: its spread over seeds is not measured by this run, but it was for this preset with "
                   f"these settings ({noise['seeds']} seeds, {noise['measured']}). Sample std over those seeds, "
                   f"ACC / BWT: " + "; ".join(f"{m} {v['acc']:.2f} / {v['bwt']:.2f}" for m, v in noise["std"].items()
                                               if m in summary) +
                   ". Another seed (or another thread count or CPU model) moves a one-seed number by about that "
                   "much; the test-set bootstrap covers only a small part of it.")
    elif max(n_seeds) == 1:
        out.append("- One seed: the spread over seeds (training order, replay draws, sampling) is not measured; "
                   "the only uncertainty shown is the test-set bootstrap.")
    shown_acc_only = [m for m, s in summary.items() if s["acc_only"]]
    if shown_acc_only:
        out.append(f"- {', '.join(shown_acc_only)}: ACC only ({NOT_SHOWN} for BWT, FWT and forgetting here and below). "
                   f"Row i of its matrix is a separate joint run from the base on tasks 1..i, so differences between "
                   f"rows compare different runs, not one model before and after a stage; its last row is the "
                   f"multi-task reference for ACC.")
    partial = [m for m, s in summary.items() if s["stages"] < len(tasks)]
    if partial:
        out.append(f"- Not all {len(tasks)} stages finished for: " +
                   ", ".join(f"{m} ({summary[m]['stages']})" for m in partial) + "; their ACC/BWT cover those stages.")
    if REFERENCE not in summary:
        out.append(f"- No '{REFERENCE}' method, so no per-task comparison against it.")
    if flags:
        out.append(f"- {len(flags)} evaluation(s) flagged for degenerate answers (collapse to one label, off-format "
                   f"answers, empty or length-capped responses): see 'Accuracy matrices and answers' below.")

    refs = [ref for ref, deltas in unc["deltas"].items() if deltas]
    uses_preset_sigma = any(d.get("seeds_source") == "preset" for ref in refs
                            for entry in unc["deltas"][ref].values() for d in entry.values())
    for ref in refs:
        out += ["", f"## Paired differences vs {ref}", "", delta_table(summary, unc, ref)]
    if refs:
        out += ["", f"- Δ = method - reference ({', '.join(refs)}), computed per seed (same seed = same data order, "
                f"the same stage-1 checkpoint and the same test prompts) and averaged over the paired seeds.",
                f"- CI seeds: {LEVEL:.0%} t-interval of the per-seed differences (df = paired seeds - 1; needs >= 2 "
                f"seeds). Covers seed-to-seed noise (training order, replay draws, rollout and evaluation sampling) "
                f"on the fixed test prompts.",
                f"- CI test set: {LEVEL:.0%} paired percentile bootstrap over test prompts (the same resampled "
                f"prompts for both methods). Covers which test prompts were drawn, with the checkpoints fixed.",
                *([f"- † one seed: CI seeds is Δ ∓ t({noise['seeds'] - 1}) × σ, with σ the per-seed std of this "
                   f"difference measured over {noise['seeds']} seeds of this preset with these settings ("
                   f"{noise['measured']}). It holds as far as this run's seed noise is the preset's; a seed that was one of "
                   f"those {noise['seeds']} (the default's seed 0 is) is not independent of σ, which the interval "
                   f"ignores."] if uses_preset_sigma else []),
                "- resolved: every available interval excludes 0. 'test set only' = one seed, so seed noise, "
                "often the larger, is not covered: a difference resolved only on the test set can still be noise. "
                "Each interval is for one comparison (no multiple-comparison correction): among many rows, about "
                "1 in 20 pure-noise intervals excludes 0."]

    nn = noise_numbers(results, summary)
    if nn:
        out += ["", "## Where the seed noise comes from", "", *noise_tables(tasks, nn), "",
                "- std: sample std over seeds (as in the main table). 'of it test prompts': the share of its variance "
                "that is each test prompt's own seed-to-seed variation (evaluation sampling, which prompts a seed "
                "happens to get right); k times as many test prompts would divide that part by k. The rest is "
                "whole-task movement (one seed learned or kept a task better than another) that more test prompts "
                "do not remove. floor: the std with that part gone, i.e. with unlimited test prompts.",
                "- Per-task shares sum to 100% over the tasks; a negative share is a task moving against the others. "
                f"Estimated from the seeds at hand (methods with >= {NOISE_MIN_SEEDS} seeds): with few seeds these "
                "are rough.",
                "- Δ rows: the same for the per-seed paired difference (method − reference). Its seed std sets the "
                "width of the seed interval in 'Paired differences' (half-width = t × std / √seeds); its floor is "
                "what that std stays at however many test prompts there are."]
    out += ["", "## TRACE's conventions and per-task forgetting", "", transfer_table(tasks, summary), "",
            "- OP = ACC. BWT (TRACE, 1/N) sums the same differences as BWT but divides by all N tasks, the last one's "
            "zero term included (TRACE's eq. 2, the official OPR code's tools/show_result.py): (N-1)/N of BWT. "
            "Compare numbers printed by the official code with it; the OPR paper's Table 1 BWT is the 1/(N-1) "
            "form (its appendix matrices give it), i.e. the main table's BWT. Forgetting per task: best earlier "
            "score minus final score."]
    out += ["", "## Accuracy matrices and answers (mean over seeds)", ""]
    for m, s in summary.items():
        out += [f"### {m}", "", matrix_table(tasks, s), ""]
        diag = diagnostics_table(tasks, results["methods"][m], s["stages"])
        if diag:
            out += ["Answers: most frequent predicted label and its share (classification tasks: the first "
                    "character of the answer, the one the lenient and paper rules compare), share of off-format "
                    "answers (not a letter alone), of empty and of length-capped responses when not 0; "
                    "'!' = flagged.", "", diag, ""]
        out += [f"- {line}" for line in flags if line.startswith(f"WARNING {m}, ")]
        if any(line.startswith(f"WARNING {m}, ") for line in flags):
            out.append("")
    if any(r.get("diagnostics") for e in results["methods"].values() for r in e["seeds"].values()):
        from reporting.diagnostics import COLLAPSE_RATE, EMPTY_WARN, LENGTH_WARN, OFF_FORMAT_WARN
        out += [f"Flags: a classification task's predictions collapsed = one label, answered as a letter alone, is "
                f">= {COLLAPSE_RATE:.0%} of all answers while that label is < {COLLAPSE_RATE:.0%} of the gold answers; "
                f"off-format >= {OFF_FORMAT_WARN:.0%} (non-empty answers such as 'Anna sah ...', 'A bill ...' or 'A5' "
                f"instead of a letter, unless the task's gold answers are themselves a letter and a sentence: a "
                f"first-character rule reads them as the letter they start with, and the warning says how much of the "
                f"score that is, and how much chance would give: the hits expected if those answers' first characters "
                f"were unrelated to their gold labels); empty >= "
                f"{EMPTY_WARN:.0%}; length-capped (stopped at max-new-tokens) >= {LENGTH_WARN:.0%}.", ""]
    out += [*mechanism_section(results), ""]
    if figures:
        out += ["## Figures", ""]
        for f in figures:
            out += [f"![{Path(f).stem}]({f})", "", f"*{({**FIGURES, **MECHANISM_FIGURES})[f]}*", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Figures (matplotlib, Agg backend: no display needed)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_matrices(tasks, summary, path: Path):
    plt = _plt()
    k, n = len(summary), len(tasks)
    fig, axes = plt.subplots(1, k, figsize=(0.9 * n * k + 1.5, 0.8 * n + 1.5), squeeze=False)
    for k, (ax, (m, s)) in enumerate(zip(axes[0], summary.items())):
        grid = np.full((n, n), np.nan)
        for i, row in enumerate(s["matrix"]):
            grid[i, :len(row)] = row
        im = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis")
        for i, row in enumerate(s["matrix"]):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7, color="w" if v < 60 else "k")
        ax.set_title(m)
        ax.set_xticks(range(n), tasks, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(n), [f"{i + 1}" for i in range(n)], fontsize=7)
        ax.set_xlabel("task")
        if k == 0:  # later panels would overlap their left neighbour
            ax.set_ylabel("after stage")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="score")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_trajectories(tasks, summary, path: Path):
    plt = _plt()
    n = len(tasks)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for j, ax in enumerate(axes.flat):
        if j >= n:
            ax.axis("off")
            continue
        for m, s in summary.items():
            stages = list(range(j, s["stages"]))  # task j exists from stage j on
            if not stages:
                continue
            x = [i + 1 for i in stages]
            y = [s["matrix"][i][j] for i in stages]
            (line,) = ax.plot(x, y, marker="o", ms=3, label=m)
            if s.get("row0") is not None:  # before training it: the base (stage 0) and the previous stage
                bx, by = [0], [s["row0"][j]]
                if j > 0 and j - 1 < len(s["next_task"]):
                    bx, by = [0, j], [s["row0"][j], s["next_task"][j - 1]]
                ax.plot(bx + x[:1], by + y[:1], ls=":", marker=".", ms=3, color=line.get_color())
            sd = [s["matrix_std"][i][j] for i in stages]
            if sd[0] is not None:
                ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)],
                                color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(tasks[j], fontsize=9)
        ax.set_xlim(-0.5, n + 0.5)
        ax.set_xticks(range(0, n + 1))
        ax.set_xlabel("after stage", fontsize=8)
        ax.set_ylabel("score", fontsize=8)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def mean_loss_curves(runs: list[dict]) -> list[list[float]]:
    """Per stage, the per-step loss averaged over seeds (cut to the shortest seed's length for that stage)."""
    curves = [r.get("loss_curves") or [] for r in runs]
    out = []
    for i in range(min(len(c) for c in curves)):
        steps = min(len(c[i]) for c in curves)
        out.append([statistics.fmean(c[i][t] for c in curves) for t in range(steps)])
    return out


def plot_loss(tasks, results, path: Path):
    """Each stage occupies [i, i+1) on the x axis, whatever its step count (methods with replay take more steps)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)), 3.2))
    for m, entry in results["methods"].items():
        xs, ys = [], []
        for i, curve in enumerate(mean_loss_curves(list(entry["seeds"].values()))):
            xs += [i + t / len(curve) for t in range(len(curve))]
            ys += curve
        if xs:
            ax.plot(xs, ys, lw=0.8, label=m)
    for i in range(1, len(tasks)):
        ax.axvline(i, color="0.6", ls=":", lw=0.8)
    ax.set_xticks([i + 0.5 for i in range(len(tasks))], tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("train loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_delta(tasks, summary, path: Path):
    plt = _plt()
    ref = summary[REFERENCE]["final"]
    others = [m for m in summary if m != REFERENCE]
    shown = [t for t in tasks if t in ref]
    width = 0.8 / max(1, len(others))
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(shown)), 3.2))
    for k, m in enumerate(others):
        d = [summary[m]["final"][t]["mean"] - ref[t]["mean"] if t in summary[m]["final"] else np.nan for t in shown]
        ax.bar(np.arange(len(shown)) + (k - (len(others) - 1) / 2) * width, d, width, label=m)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(shown)), shown, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"final score - {REFERENCE}")
    if others:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bwt_acc(summary, path: Path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.5, 3.6))
    for m, s in summary.items():
        if s["bwt"]["mean"] is None:  # one stage, or an ACC_ONLY method: no BWT
            continue
        ax.errorbar(s["bwt"]["mean"], s["acc"]["mean"], xerr=s["bwt"]["std"], yerr=s["acc"]["std"], fmt="o",
                    capsize=3, label=m)
        ax.annotate(m, (s["bwt"]["mean"], s["acc"]["mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axvline(0, color="0.6", ls=":", lw=0.8)
    ax.set_xlabel("BWT")
    ax.set_ylabel("ACC")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_forgetting(tasks, summary, path: Path):
    import numpy as np
    plt = _plt()
    summary = {m: s for m, s in summary.items() if not s["acc_only"]}
    shown = tasks[:max(s["stages"] for s in summary.values()) - 1]
    width = 0.8 / max(1, len(summary))
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(shown)), 3.2))
    for k, (m, s) in enumerate(summary.items()):
        d = [s["forgetting"][t]["mean"] if t in s["forgetting"] else np.nan for t in shown]
        fwt = f", FWT {s['fwt']['mean']:.1f}" if s["fwt"]["mean"] is not None else ""
        ax.bar(np.arange(len(shown)) + (k - (len(summary) - 1) / 2) * width, d, width, label=f"{m}{fwt}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(shown)), shown, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("best earlier - final score")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# The paper's mechanism: per-update drift, forgetting vs drift, the buffer's loss bound (run.py's probes)


def drift_numbers(results) -> dict:
    """From the runs' "drift" entries: per method and stage the seed-mean of the mean sequence KL and of the KL per
    token over the prior tasks' prompts, the (KL on task j, a(i, j) - a(i-1, j)) points of every seed, stage i >= 2
    and prior task j (not of ACC_ONLY methods, whose rows are separate runs), and their Pearson and Spearman
    correlations. Empty when no run has drift entries."""
    tasks = results["tasks"]
    per_stage, points = {}, []
    for m, entry in results["methods"].items():
        by_stage = {}
        for run in entry["seeds"].values():
            for d in run.get("drift") or []:
                by_stage.setdefault(d["stage"], []).append(d["all"])
                i = d["stage"] - 1  # matrix row of stage d["stage"]
                if i >= len(run["matrix"]) or acc_only(m):
                    continue
                for j, t in enumerate(tasks[:i]):
                    if t in d["tasks"]:
                        points.append({"method": m, "stage": d["stage"], "task": t, "kl": d["tasks"][t]["mean_seq_kl"],
                                       "forgetting": run["matrix"][i][j] - run["matrix"][i - 1][j]})
        if by_stage:
            per_stage[m] = {s: {"seq_kl": statistics.fmean(a["mean_seq_kl"] for a in v),
                                "kl_per_token": statistics.fmean(a["kl_per_token"] for a in v), "n_seeds": len(v)}
                            for s, v in sorted(by_stage.items())}
    xs, ys = [p["kl"] for p in points], [p["forgetting"] for p in points]
    return {"per_stage": per_stage, "points": points,
            "pearson": pearson(xs, ys) if len(points) > 2 else None,
            "spearman": spearman(xs, ys) if len(points) > 2 else None}


def drift_table(tasks, dn: dict) -> str:
    stages = sorted({s for v in dn["per_stage"].values() for s in v})
    header = ["method", *[f"{s}: {tasks[s - 1]}" for s in stages]]
    rows = [[m, *[f"{v[s]['seq_kl']:.3g} ({v[s]['kl_per_token']:.2g})" if s in v else "-" for s in stages]]
            for m, v in dn["per_stage"].items()]
    return _markdown(header, rows)


def buffer_numbers(results) -> dict:
    """Per method: the seed- and stage-mean of each buffer's l (per-token NLL under the checkpoint that built it:
    selected mean, selected max = l_max, rejected mean) and of the RU/SC Spearman correlation."""
    out = {}
    for m, entry in results["methods"].items():
        stats = [b for run in entry["seeds"].values() for b in run.get("buffer_stats") or []]
        if not stats:
            continue

        def avg(xs):
            xs = [x for x in xs if x is not None]
            return statistics.fmean(xs) if xs else None
        sel = [b["all"]["selected"] for b in stats]
        rej = [b["all"]["rejected"] for b in stats if b["all"].get("rejected")]
        out[m] = {"scorer": stats[0]["scorer"], "buffers": len(stats),
                  "nll_mean": avg(s["nll_mean"] for s in sel), "nll_max": max((s["nll_max"] for s in sel
                                                                               if s["nll_max"] is not None), default=None),
                  "token_nll_max": avg(s["token_nll_max"] for s in sel),
                  "rejected_nll_mean": avg(r["nll_mean"] for r in rej) if rej else None,
                  "spearman_ru_sc": avg(b.get("spearman_ru_sc") for b in stats)}
    return out


def buffer_table(bn: dict) -> str:
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    return _markdown(["method", "buffer", "buffers", "l mean", "l_max", "mean max-token NLL", "rejected l mean",
                      "Spearman(RU, SC)"],
                     [[m, b["scorer"], str(b["buffers"]), f(b["nll_mean"]), f(b["nll_max"]), f(b["token_nll_max"]),
                       f(b["rejected_nll_mean"]), f(b["spearman_ru_sc"], 2)] for m, b in bn.items()])


def rollout_check_lines(results) -> list:
    """One line per method whose rollouts were checked against the trainer's forward pass."""
    out = []
    for m, entry in results["methods"].items():
        checks = [c for run in entry["seeds"].values() for c in run.get("rollout_checks") or [] if c.get("k")]
        if checks:
            warned = sum(bool(c["warned"]) for c in checks)
            out.append(f"{m}: {len(checks)} rollout sets, mean |Δ log p| per token up to "
                       f"{max(c['mean_abs_dlogp'] for c in checks):.2g}, max single token "
                       f"{max(c['max_abs_dlogp'] for c in checks):.2g} nats, k3 KL up to "
                       f"{max(c['k3_kl'] for c in checks):.2g}" + (f"; WARNED {warned} times" if warned else ""))
    return out


def mechanism_section(results, dn=None, bn=None) -> list:
    """report.md lines for the mechanism probes (nothing when the run has none)."""
    dn, bn = dn or drift_numbers(results), bn or buffer_numbers(results)
    checks = rollout_check_lines(results)
    if not (dn["per_stage"] or bn or checks):
        return []
    out = ["", "## Mechanism: per-update drift and the buffer's loss bound", ""]
    if dn["per_stage"]:
        fmt = lambda x: "undefined" if x is None else f"{x:+.2f}"  # noqa: E731
        out += ["Per-update KL(π_i ‖ π_i−1) on held-out prompts of tasks 1..i−1, after stage i (column: stage and the "
                "task it trains): mean over prompts of the summed per-token KL of a response sampled from π_i "
                "(nats per response), KL per token in parentheses; mean over seeds (drift.py).", "",
                drift_table(results["tasks"], dn), "",
                f"- Forgetting vs drift: {len(dn['points'])} points (method, seed, stage i, prior task j) of "
                f"a(i, j) − a(i−1, j) against the KL on task j's prompts; Pearson r = {fmt(dn['pearson'])}, "
                f"Spearman ρ = {fmt(dn['spearman'])}. The paper's bound predicts larger drift, larger drops "
                f"(a negative correlation); a correlation over few points of a small test set is weak evidence "
                f"either way."]
    if bn:
        out += ["", "Each replay buffer's per-token NLL l under the checkpoint that built it (paper Eq. 3: OPR keeps "
                "l <= l_max small; gold and low-score buffers need not): mean over buffers (stages and seeds) of the "
                "selected examples' mean l; l_max = the largest over all of them; the rejected rollouts' mean l; "
                "the rank correlation of task score (RU) and mean log-prob (SC) over all rollouts (the paper's "
                "assumption that correct answers are likely ones).", "", buffer_table(bn)]
    if checks:
        out += ["", "Rollout log-probs, engine vs the trainer's forward pass (rollout.py --check-logprobs):", ""]
        out += [f"- {line}" for line in checks]
    return out


def plot_drift(tasks, dn: dict, path: Path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(tasks)), 3.2))
    for m, v in dn["per_stage"].items():
        ax.plot(list(v), [x["seq_kl"] for x in v.values()], "o-", lw=1, ms=3, label=m)
    ax.set_xticks(range(2, len(tasks) + 1), [f"{s}\n{tasks[s - 1]}" for s in range(2, len(tasks) + 1)], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("KL(π_i ‖ π_i−1), nats / response")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_drift_vs_forgetting(dn: dict, path: Path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    for m in dict.fromkeys(p["method"] for p in dn["points"]):
        pts = [p for p in dn["points"] if p["method"] == m]
        ax.scatter([p["kl"] for p in pts], [p["forgetting"] for p in pts], s=10, alpha=0.7, label=m)
    ax.axhline(0, color="0.6", ls=":", lw=0.8)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(left=0)  # a KL is never negative: no mirrored half-axis
    ax.set_xlabel("KL on task j's prompts after stage i (nats / response)")
    ax.set_ylabel("a(i, j) − a(i−1, j)")
    r = dn["pearson"]
    ax.set_title(f"Pearson r = {r:+.2f}" if r is not None else "", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss_sources(tasks, results, path: Path):
    """Methods that replay: the loss on the stage's own task examples (solid) and on the replayed ones (dashed),
    seed-mean per step, each stage stretched to unit width as in fig_loss.png."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)), 3.2))
    for k, (m, entry) in enumerate(results["methods"].items()):
        runs = [r.get("loss_sources") or [] for r in entry["seeds"].values()]
        if not any(any(s for s in r) for r in runs):
            continue
        color = f"C{k % 10}"
        for src, style in (("task", "-"), ("replay", "--")):
            xs, ys = [], []
            for i in range(min(len(r) for r in runs)):
                curves = [r[i][src] for r in runs if r[i] is not None]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                vals = [[c[t] for c in curves if c[t] is not None] for t in range(n)]
                xs += [i + t / n for t in range(n) if vals[t]]
                ys += [statistics.fmean(v) for v in vals if v]
            if xs:
                ax.plot(xs, ys, style, color=color, lw=0.8, label=f"{m} {src}")
    for i in range(1, len(tasks)):
        ax.axvline(i, color="0.6", ls=":", lw=0.8)
    ax.set_xticks([i + 0.5 for i in range(len(tasks))], tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("train loss per token")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results, out_dir, summary=None, unc=None) -> Path:
    """Write out_dir/report.md and its figures (see FIGURES). Everything is rendered in a temporary directory first and
    then moved into place, so a failure leaves the previous report untouched. A figure without data (no 'replay'
    method, no loss curves, no method with two stages) is skipped and any stale copy removed. Returns report.md.
    summary / unc: summarize() / uncertainty() of results when the caller has them already."""
    summary = summary or summarize(results)
    unc = unc or uncertainty(results, summary)
    tasks = results["tasks"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {
        "fig_matrix.png": lambda p: plot_matrices(tasks, summary, p),
        "fig_trajectories.png": lambda p: plot_trajectories(tasks, summary, p),
    }
    if any(mean_loss_curves(list(e["seeds"].values())) for e in results["methods"].values()):
        plots["fig_loss.png"] = lambda p: plot_loss(tasks, results, p)
    if REFERENCE in summary:
        plots["fig_delta_vs_replay.png"] = lambda p: plot_delta(tasks, summary, p)
    if any(s["bwt"]["mean"] is not None for s in summary.values()):
        plots["fig_bwt_acc.png"] = lambda p: plot_bwt_acc(summary, p)
        plots["fig_forgetting.png"] = lambda p: plot_forgetting(tasks, summary, p)
    dn = drift_numbers(results)
    if dn["per_stage"]:
        plots["fig_drift.png"] = lambda p: plot_drift(tasks, dn, p)
    if dn["points"]:
        plots["fig_drift_vs_forgetting.png"] = lambda p: plot_drift_vs_forgetting(dn, p)
    if any(any(r.get("loss_sources") or []) for e in results["methods"].values() for r in e["seeds"].values()):
        plots["fig_loss_sources.png"] = lambda p: plot_loss_sources(tasks, results, p)

    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir))
    try:
        for name, plot in plots.items():
            plot(tmp / name)
        (tmp / "report.md").write_text(markdown_report(results, summary, list(plots), unc), encoding="utf-8")
        for name in [*FIGURES, *MECHANISM_FIGURES]:
            if name not in plots and (out_dir / name).exists():
                (out_dir / name).unlink()
        for name in [*plots, "report.md"]:  # report.md last: it only ever links figures already in place
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / "report.md"


# ---------------------------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory holding results.json (run.py --out); report.md and the figures "
                                   "are written next to it")
    args = p.parse_args(argv)
    path = Path(args.run_dir) / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found (is {args.run_dir} a run.py --out directory?)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if isinstance(results, dict) and results.get("partial"):  # run.py writes it so after every evaluation
        raise UserError(f"{path}: partial results of a run that has not finished (its matrices so far, without "
                        f"the metrics); the report is written when run.py --out {args.run_dir} finishes")
    try:
        summary = summarize(results)
        unc = uncertainty(results, summary)
        text, warnings = format_table(results, summary, unc), warning_lines(results)  # before anything is written
        md = write_report(results, args.run_dir, summary, unc)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        # check_results checks what every report needs; the optional parts (drift, buffer_stats, diagnostics, meta,
        # ...) are read as run.py writes them, so one of another shape fails here: the file's fault, not a traceback
        # (--debug shows where)
        raise UserError(f"{path}: a field is missing or has the wrong type ({type(e).__name__}: {e}); restore the "
                        f"file run.py wrote, or re-run run.py --out {args.run_dir} to write it again") from None
    print(text)
    for line in warnings:
        print(line)
    print(f"report.py: wrote {md}", file=sys.stderr)
    return md


if __name__ == "__main__":
    main_cli(main, "report.py")  # one line and exit 2 for what the user can fix, as every script does
