"""report.py — the paper-style report of a continual-learning run: tables (Markdown) and figures (PNG).

    python report.py runs/tiny            # rebuilds runs/tiny/report.md and its figures from runs/tiny/results.json

run.py calls write_report() and format_table() at the end of every run; this script redoes that step alone, e.g.
after a change to the report or on a results.json copied from another machine. Nothing is recomputed but the
report: the numbers come from results.json only.

results.json (written by run.py's collect; JSON):

    {"tasks": ["C-STANCE", "FOMC", ...],                    # stage order
     "methods": {label: {"seeds": {seed: run}}},            # label: a method, or "method@rho" in a rho sweep;
                                                            # seed: the seed as a string ("0", "1", ...)
     "meta": {...}}                                         # settings, printed as-is at the top of the report

    run = {"matrix": [[a00], [a10, a11], ...],              # matrix[i][j]: score (0..100) of task j after stage i,
                                                            # j <= i (ragged rows)
           "row0": [a(0, j) for every task],                # optional: the base model before stage 1
           "next_task": [a(i, i+1) for i < N-1],            # optional: task i+1 after stage i, before training it
           "cl_metrics": {...},                             # optional: data.metrics.cl_metrics (recomputed here)
           "loss_curves": [[loss per step of stage 0], ...],  # optional
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

    summarize(results)        numbers: mean/std over seeds of ACC, BWT, FWT, forgetting, TRACE's OP and 1/N BWT
                              and the final per-task scores; the mean matrix with row 0 and next-task scores
    format_table(results)     the main table (Markdown; readable in a terminal), printed by run.py at the end
    markdown_report(results)  the whole report.md text
    write_report(results, out_dir) -> out_dir/report.md, plus the figures next to it

ACC and BWT come from data.metrics.acc_bwt, FWT / per-task forgetting / TRACE's OP and 1/N BWT from
data.metrics.cl_metrics (FWT needs row0 and next_task), once per seed; statistics over seeds come from data.stats.
A method may have fewer stages than there are tasks (a run in progress): its ACC/BWT then cover the stages it has,
and the tasks it has not reached show as "-".

The file is organised in sections (numbers, tables and report text, figures and writing, command line): a new part
of the report adds its numbers, its table and its figure to the matching sections and its fields to the schema
above.
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

from data.metrics import acc_bwt, cl_metrics
from data.stats import mean_std, pearson, spearman

REFERENCE = "replay"  # the baseline of the "delta vs replay" figure
FIGURES = {  # file name -> what it shows (paper figure)
    "fig_matrix.png": "accuracy matrices: score of each task (column) after each stage (row)",
    "fig_trajectories.png": "per-task score across stages, from the stage that trains it (paper Fig. 3); dotted: "
                            "before it is trained (stage 0 = the base model)",
    "fig_loss.png": "training loss per step, each stage stretched to unit width (paper Fig. 4)",
    "fig_delta_vs_replay.png": f"final per-task score minus the '{REFERENCE}' method's (paper Fig. 5)",
    "fig_bwt_acc.png": "BWT vs ACC, one point per method (paper Fig. 1, right)",
    "fig_forgetting.png": "per-task forgetting (best earlier score - final score) per method; FWT in the legend",
}
MECHANISM_FIGURES = {  # drawn when results.json holds run.py's mechanism probes
    "fig_drift.png": "per-update KL(pi_i || pi_i-1) on the prior tasks' held-out prompts, per stage (paper Eq. 1's "
                     "quantity)",
    "fig_drift_vs_forgetting.png": "per-task forgetting a(i, j) - a(i-1, j) against the KL on task j's prompts",
    "fig_loss_sources.png": "training loss per step on the stage's own examples (solid) and on replayed ones (dashed)",
}


# ---------------------------------------------------------------------------------------------------------------
# Numbers


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
            for key, want in (("row0", len(tasks)), ("next_task", len(matrix) - 1)):
                vals = run.get(key)
                if vals is not None and (not isinstance(vals, list) or len(vals) < want or
                                         not all(_is_number(v) for v in vals)):
                    raise ValueError(f"{where}[{key!r}]: expected at least {want} finite numbers, got {vals!r}")
            for i, curve in enumerate(run.get("loss_curves") or []):
                if not isinstance(curve, list) or not all(_is_number(v) for v in curve):
                    raise ValueError(f"{where}['loss_curves'][{i}]: expected a list of finite numbers")
            n_stages.add(len(matrix))
        if len(n_stages) > 1:
            raise ValueError(f"results['methods'][{m!r}]: seeds have different numbers of stages {sorted(n_stages)}")


def summarize(results) -> dict:
    """Per method, in the order of results['methods']:

    {"seeds": [seed, ...], "stages": n,               # n = stages trained (rows of the matrix)
     "acc": {"mean", "std"}, "bwt": {"mean", "std"},  # bwt mean/std None when n == 1
     "per_seed": {seed: {"acc", "bwt"}},
     "final": {task: {"mean", "std"}},                # last row, for the n tasks trained so far
     "matrix": [[mean]] and "matrix_std": [[std]],    # ragged like the input (row i has i+1 entries)
     "fwt", "forgetting_mean", "op", "bwt_trace": {"mean", "std"},   # mean None where undefined (FWT: no row 0)
     "forgetting": {task: {"mean", "std"}},           # the first n-1 tasks
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
            return mean_std(vals) if all(v is not None for v in vals) else {"mean": None, "std": None}
        out[m] = {
            "seeds": seeds, "stages": n,
            "acc": mean_std([r["acc"] for r in per_seed.values()]),
            "bwt": mean_std([r["bwt"] for r in per_seed.values()]) if n > 1 else {"mean": None, "std": None},
            "per_seed": per_seed,
            "final": {tasks[j]: cells[n - 1][j] for j in range(n)},
            "matrix": [[c["mean"] for c in row] for row in cells],
            "matrix_std": [[c["std"] for c in row] for row in cells],
            **{k: over_seeds(k) for k in ("fwt", "forgetting_mean", "op", "bwt_trace")},
            "forgetting": {tasks[j]: mean_std([c["forgetting"][j] for c in cls]) for j in range(n - 1)},
            "row0": [statistics.fmean(r["row0"][j] for r in runs) for j in range(len(tasks))] if with_row0 else None,
            "next_task": [statistics.fmean(r["next_task"][i] for r in runs) for i in range(min(n, len(tasks) - 1))]
            if with_row0 else None,
        }
    return out


# ---------------------------------------------------------------------------------------------------------------
# Tables


def _fmt(ms: dict, with_std: bool = True) -> str:
    if ms["mean"] is None:
        return "-"
    if with_std and ms["std"] is not None:
        return f"{ms['mean']:.2f} ± {ms['std']:.2f}"
    return f"{ms['mean']:.2f}"


def format_table(results, summary=None) -> str:
    """The main table: one row per method; ACC, BWT, FWT and mean forgetting (mean ± std over seeds when there are
    several), then the final score of each task (mean over seeds). Markdown, aligned so it also reads as plain text."""
    summary = summary or summarize(results)
    tasks = results["tasks"]
    header = ["method", "seeds", "ACC", "BWT", "FWT", "forgetting"] + tasks
    rows = []
    for m, s in summary.items():
        rows.append([m, str(len(s["seeds"])), _fmt(s["acc"]), _fmt(s["bwt"]), _fmt(s["fwt"]),
                     _fmt(s["forgetting_mean"])] +
                    [_fmt(s["final"][t], with_std=False) if t in s["final"] else "-" for t in tasks])
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]

    def line(cells):  # method name left-aligned, numbers right-aligned
        padded = [c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" if k else "-" * (w + 2) for k, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])


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
        cells = [_fmt(s["op"]), _fmt(s["bwt_trace"])] + [_fmt(s["forgetting"][t], with_std=False)
                                                         if t in s["forgetting"] else "-" for t in forg_tasks]
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


def markdown_report(results, summary=None, figures=()) -> str:
    """report.md: the main table with notes, each method's accuracy matrix, and links to `figures` (file names)."""
    summary = summary or summarize(results)
    tasks = results["tasks"]
    out = ["# Continual SFT on " + ", ".join(tasks), "", protocol_line(results.get("meta"))]
    for k, v in (results.get("meta") or {}).items():
        out.append(f"- {k}: {v if isinstance(v, str) else json.dumps(v)}")
    n_seeds = sorted({len(s["seeds"]) for s in summary.values()})
    out += ["", "## Results", "", format_table(results, summary), "",
            "- ACC: mean final score over the tasks trained so far; BWT: mean over all but the last of them of "
            "(final score - score right after training it); negative BWT = forgetting. FWT: mean over tasks 2..N "
            "of (score before training it, after the previous stage - the base model's score); forgetting: mean "
            "over all but the last task of (best earlier score - final score). Scores are 0..100.",
            f"- Seeds per method: {', '.join(map(str, n_seeds))}; 'a ± b' = mean ± population std over seeds; "
            f"per-task columns are means."]
    partial = [m for m, s in summary.items() if s["stages"] < len(tasks)]
    if partial:
        out.append(f"- Not all {len(tasks)} stages finished for: " +
                   ", ".join(f"{m} ({summary[m]['stages']})" for m in partial) + "; their ACC/BWT cover those stages.")
    if REFERENCE not in summary:
        out.append(f"- No '{REFERENCE}' method, so no per-task comparison against it.")
    out += ["", "## TRACE's conventions and per-task forgetting", "", transfer_table(tasks, summary)]
    out += ["", "## Accuracy matrices (mean over seeds)", ""]
    for m, s in summary.items():
        out += [f"### {m}", "", matrix_table(tasks, s), ""]
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
    import numpy as np
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
    import numpy as np
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
        if s["bwt"]["mean"] is None:  # one stage: BWT undefined
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
    and prior task j, and their Pearson and Spearman correlations. Empty when no run has drift entries."""
    tasks = results["tasks"]
    per_stage, points = {}, []
    for m, entry in results["methods"].items():
        by_stage = {}
        for run in entry["seeds"].values():
            for d in run.get("drift") or []:
                by_stage.setdefault(d["stage"], []).append(d["all"])
                i = d["stage"] - 1  # matrix row of stage d["stage"]
                if i >= len(run["matrix"]):
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
    return _md_table(header, rows)


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
    return _md_table(["method", "buffer", "buffers", "l mean", "l_max", "mean max-token NLL", "rejected l mean",
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

def _md_table(header, rows) -> str:
    """A plain Markdown table: first column left-aligned, the others right-aligned."""
    return "\n".join(["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)] +
                      ["| " + " | ".join(r) + " |" for r in rows])


def write_report(results, out_dir) -> Path:
    """Write out_dir/report.md and its figures (see FIGURES). Everything is rendered in a temporary directory first and
    then moved into place, so a failure leaves the previous report untouched. A figure without data (no 'replay'
    method, no loss curves, no method with two stages) is skipped and any stale copy removed. Returns report.md."""
    summary = summarize(results)
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
        (tmp / "report.md").write_text(markdown_report(results, summary, figures=list(plots)), encoding="utf-8")
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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory holding results.json (run.py --out); report.md and the figures "
                                   "are written next to it")
    args = p.parse_args(argv)
    path = Path(args.run_dir) / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SystemExit(f"report.py: {path}: not found (is {args.run_dir} a run.py --out directory?)")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"report.py: {path}: not valid JSON ({e})")
    try:
        md = write_report(results, args.run_dir)
    except ValueError as e:
        raise SystemExit(f"report.py: {path}: {e}")
    print(format_table(results))
    print(f"report.py: wrote {md}", file=sys.stderr)
    return md


if __name__ == "__main__":
    main()
