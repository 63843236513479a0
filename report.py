"""report.py — the paper-style report of a continual-learning run: tables
(Markdown) and figures (PNG).

    python report.py runs/tiny   # rebuilds runs/tiny/report.md and figures from its results.json

run.py calls write_report() and format_table() at the end of every run; this script redoes that step
alone, e.g. after a change to the report or on a results.json copied from another machine. Nothing
is recomputed but the report: the numbers come from results.json only.

What results.json holds, the report's parts: README, "Layout" (reporting/).
"""
import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common.cli import Parser, main_cli
from common.errors import UserError
from reporting.figures import (FIGURES, MECHANISM_FIGURES, mean_loss_curves, plot_bwt_acc,
                               plot_delta, plot_drift, plot_drift_vs_forgetting, plot_forgetting,
                               plot_loss, plot_loss_sources, plot_matrices, plot_trajectories)
from reporting.numbers import drift_numbers, summarize, uncertainty
from reporting.schema import REFERENCE
from reporting.tables import format_table, markdown_report, warning_lines


def write_report(results, out_dir, summary=None, unc=None) -> Path:
    """Write out_dir/report.md and its figures (see FIGURES). Everything is rendered in a temporary
    directory first and then moved into place, so a failure leaves the previous report untouched. A
    figure without data (no 'replay' method, no loss curves, no method with two stages) is skipped
    and any stale copy removed. Returns report.md.
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
    if any(any(r.get("loss_sources") or []) for e in results["methods"].values()
           for r in e["seeds"].values()):
        plots["fig_loss_sources.png"] = lambda p: plot_loss_sources(tasks, results, p)

    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir))
    try:
        for name, plot in plots.items():
            with _naming(out_dir / name):
                plot(tmp / name)
        with _naming(out_dir / "report.md"):
            (tmp / "report.md").write_text(markdown_report(results, summary, list(plots), unc),
                                           encoding="utf-8")
        for name in [*FIGURES, *MECHANISM_FIGURES]:
            if name not in plots and (out_dir / name).exists():
                (out_dir / name).unlink()
        for name in [*plots, "report.md"]:  # report.md last: it only ever links
                                            # figures already in place
            os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir / "report.md"


@contextlib.contextmanager
def _naming(path: Path):
    """A write error (a full disk, a quota) names no file: it names the one being written."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e


# --------------------------------------------------------------------------------------------------
# Command line


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="run directory holding results.json (run.py --out); report.md "
                                   "and the figures are written next to it")
    args = p.parse_args(argv)
    path = Path(args.run_dir) / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found (is {args.run_dir} a run.py --out "
                        f"directory?)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None
    if isinstance(results, dict) and results.get("partial"):  # run.py writes it so
                                                              # after every evaluation
        raise UserError(f"{path}: partial results of a run that has not finished (its matrices so "
                        f"far, without the metrics); the report is written when run.py --out "
                        f"{args.run_dir} finishes")
    try:
        summary = summarize(results)
        unc = uncertainty(results, summary)
        # before anything is written
        text, warnings = format_table(results, summary, unc), warning_lines(results)
        md = write_report(results, args.run_dir, summary, unc)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    except (TypeError, KeyError, AttributeError, IndexError) as e:
        # check_results checks what every report needs; the optional parts (drift, buffer_stats,
        # diagnostics, meta, ...) are read as run.py writes them, so one of another shape fails
        # here: the file's fault, not a traceback (--debug shows where)
        raise UserError(f"{path}: a field is missing or has the wrong type ({type(e).__name__}: "
                        f"{e}); restore the file run.py wrote, or re-run run.py --out "
                        f"{args.run_dir} to write it again") from None
    print(text)
    for line in warnings:
        print(line)
    print(f"report.py: wrote {md}", file=sys.stderr)
    return md


if __name__ == "__main__":
    main_cli(main, "report.py")  # one line and exit 2 for what the user can fix,
                                 # as every script does
