"""The report's figures (matplotlib, Agg backend: no display needed), one function per file of
FIGURES and MECHANISM_FIGURES."""
import statistics
from pathlib import Path

import numpy as np

from reporting.schema import REFERENCE

FIGURES = {  # file name -> what it shows (paper figure)
    "fig_matrix.png": "accuracy matrices: score of each task (column) after each stage (row)",
    "fig_trajectories.png": "per-task score across stages, from the stage that trains it (paper "
                            "Fig. 3); dotted: before it is trained (stage 0 = the base model)",
    "fig_loss.png": "training loss per step, each stage stretched to unit width (paper Fig. 4)",
    "fig_delta_vs_replay.png": f"final per-task score minus the '{REFERENCE}' method's "
                               f"(paper Fig. 5)",
    "fig_bwt_acc.png": "BWT vs ACC, one point per method (paper Fig. 1, right); mtl left out: its "
                       "rows are separate runs",
    "fig_forgetting.png": "per-task forgetting (best earlier score - final score) per method; FWT "
                          "in the legend; mtl left out",
}
MECHANISM_FIGURES = {  # drawn when results.json holds run.py's mechanism probes
    "fig_drift.png": "per-update KL(pi_i || pi_i-1) on the prior tasks' held-out prompts, per "
                     "stage (paper Eq. 1's quantity)",
    "fig_drift_vs_forgetting.png": "per-task forgetting a(i, j) - a(i-1, j) against the KL on task "
                                   "j's prompts",
    "fig_loss_sources.png": "training loss per step on the stage's own examples (solid) and on "
                            "replayed ones (dashed)",
}


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
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=7,
                        color="w" if v < 60 else "k")
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
            # before training it: the base (stage 0) and the previous stage
            if s.get("row0") is not None:
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
    """Per stage, the per-step loss averaged over seeds (cut to the shortest seed's
    length for that stage)."""
    curves = [r.get("loss_curves") or [] for r in runs]
    out = []
    for i in range(min(len(c) for c in curves)):
        steps = min(len(c[i]) for c in curves)
        out.append([statistics.fmean(c[i][t] for c in curves) for t in range(steps)])
    return out


def plot_loss(tasks, results, path: Path):
    """Each stage occupies [i, i+1) on the x axis, whatever its step count (methods with replay
    take more steps)."""
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
        d = [summary[m]["final"][t]["mean"] - ref[t]["mean"] if t in summary[m]["final"] else np.nan
             for t in shown]
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
        if s["bwt"]["mean"] is None:  # one stage, or an acc_only method: no BWT
            continue
        ax.errorbar(s["bwt"]["mean"], s["acc"]["mean"], xerr=s["bwt"]["std"], yerr=s["acc"]["std"],
                    fmt="o", capsize=3, label=m)
        ax.annotate(m, (s["bwt"]["mean"], s["acc"]["mean"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=8)
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
        ax.bar(np.arange(len(shown)) + (k - (len(summary) - 1) / 2) * width, d, width,
               label=f"{m}{fwt}")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(shown)), shown, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("best earlier - final score")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# The paper's mechanism


def plot_drift(tasks, dn: dict, path: Path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(tasks)), 3.2))
    for m, v in dn["per_stage"].items():
        ax.plot(list(v), [x["seq_kl"] for x in v.values()], "o-", lw=1, ms=3, label=m)
    ax.set_xticks(range(2, len(tasks) + 1),
                  [f"{s}\n{tasks[s - 1]}" for s in range(2, len(tasks) + 1)], fontsize=7)
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
    """Methods that replay: the loss on the stage's own task examples (solid) and on the replayed
    ones (dashed), seed-mean per step, each stage stretched to unit width as in fig_loss.png."""
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


