"""report.py on a hand-made run: ACC/BWT and their spread over seeds equal hand-computed values, the tables show
them, and every figure is a real PNG; single seed, no 'replay' method, a run in progress, bad input; the paired
differences and their intervals (seeds, test-set bootstrap), and the degenerate-answer diagnostics and warnings."""
import copy
import json
import math
import re
import statistics

import numpy as np
import pytest

import forkserver
import report
from reporting import figures, numbers, tables
from reporting.diagnostics import diagnose
from data.metrics import letter_accuracy
from reporting.stats import t_quantile
from report import (FIGURES, format_table, markdown_report, mean_loss_curves, summarize, uncertainty,
                    warning_lines, write_report)

TASKS = ["C-STANCE", "FOMC", "MeetingBank"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# Values chosen so every mean below is exact in floating point.
RESULTS = {
    "tasks": TASKS,
    "methods": {
        "replay": {"seeds": {
            "0": {"matrix": [[80], [60, 70], [50, 61, 90]], "loss_curves": [[2.0, 1.0], [3.0, 2.0, 1.0], [2.0, 1.5]]},
            "1": {"matrix": [[84], [62, 74], [54, 66, 93]], "loss_curves": [[4.0, 3.0], [1.0, 2.0], [2.0, 0.5, 9.0]]},
        }},
        "opr-ru": {"seeds": {
            "0": {"matrix": [[80], [75, 70], [78, 68, 91]], "loss_curves": [[2.0], [2.0], [2.0]]},
            "1": {"matrix": [[84], [80, 74], [82, 72, 95]], "loss_curves": [[2.0], [2.0], [2.0]]},
        }},
    },
    "meta": {"model": "tiny", "cfg": {"rho": 0.01, "lr": 2e-05}},
}
# by hand:
# by hand (std = sample std over 2 seeds = |a - b| / sqrt(2)):
#   replay  ACC per seed (50+61+90)/3 = 67, (54+66+93)/3 = 71         -> 69 ± 2.83 (2 sqrt 2)
#           BWT per seed ((50-80)+(61-70))/2 = -19.5, ((54-84)+(66-74))/2 = -19  -> -19.25 ± 0.35 (sqrt 2 / 4)
#           final C-STANCE (50+54)/2 = 52, FOMC (61+66)/2 = 63.5, MeetingBank (90+93)/2 = 91.5
#   opr-ru  ACC 79, 83 -> 81 ± 2.83;  BWT -2, -2 -> -2 ± 0
#   opr-ru - replay per seed: ACC 12, 12; BWT 17.5, 17 -> mean 17.25, t-interval 17.25 -/+ t(0.975, 1) * 0.25
R2 = math.sqrt(2)


def test_summary_equals_hand_computed_values():
    s = summarize(RESULTS)
    assert list(s) == ["replay", "opr-ru"]
    r, o = s["replay"], s["opr-ru"]
    assert r["seeds"] == ["0", "1"] and r["stages"] == 3
    assert r["per_seed"] == {"0": {"acc": 67.0, "bwt": -19.5}, "1": {"acc": 71.0, "bwt": -19.0}}
    assert r["acc"] == {"mean": 69.0, "std": pytest.approx(2 * R2), "n": 2}
    assert r["bwt"] == {"mean": -19.25, "std": pytest.approx(R2 / 4), "n": 2}
    assert r["final"] == {"C-STANCE": {"mean": 52.0, "std": pytest.approx(2 * R2), "n": 2},
                          "FOMC": {"mean": 63.5, "std": pytest.approx(2.5 * R2), "n": 2},
                          "MeetingBank": {"mean": 91.5, "std": pytest.approx(1.5 * R2), "n": 2}}
    assert r["matrix"] == [[82.0], [61.0, 72.0], [52.0, 63.5, 91.5]]
    assert [x for row in r["matrix_std"] for x in row] == pytest.approx([2 * R2, R2, 2 * R2, 2 * R2, 2.5 * R2,
                                                                          1.5 * R2])
    assert o["acc"] == {"mean": 81.0, "std": pytest.approx(2 * R2), "n": 2}
    assert o["bwt"] == {"mean": -2.0, "std": 0.0, "n": 2}
    json.dumps(s)  # the summary is JSON-serialisable (run.py may store it)


def test_tables_show_the_numbers():
    table = format_table(RESULTS)
    lines = table.splitlines()
    assert len(lines) == 4 and len({len(x) for x in lines}) == 1  # header, rule, 2 methods; aligned columns
    assert [c.strip() for c in lines[0].strip("|").split("|")] == ["method", "seeds", "ACC", "BWT", "FWT",
                                                                   "forgetting", *TASKS]
    replay = [c.strip() for c in lines[2].strip("|").split("|")]
    # no row 0 in RESULTS: no FWT; forgetting per seed ((80-50) + (70-61))/2 = 19.5, ((84-54) + (74-66))/2 = 19
    assert replay == ["replay", "2", "69.00 ± 2.83", "-19.25 ± 0.35", "-", "19.25 ± 0.35", "52.00", "63.50", "91.50"]
    opr = [c.strip() for c in lines[3].strip("|").split("|")]
    assert opr[:4] == ["opr-ru", "2", "81.00 ± 2.83", "-2.00 ± 0.00"]

    md = markdown_report(RESULTS)
    assert table in md and "- model: tiny" in md and '- cfg: {"rho": 0.01, "lr": 2e-05}' in md
    assert "| 3: MeetingBank | 52.00 | 63.50 | 91.50 |" in md  # replay's mean matrix, last row
    assert "| 1: C-STANCE | 82.00 | - | - |" in md


def test_mean_loss_curves_cut_each_stage_to_the_shortest_seed():
    runs = list(RESULTS["methods"]["replay"]["seeds"].values())
    assert mean_loss_curves(runs) == [[3.0, 2.0], [2.0, 2.0], [2.0, 1.0]]


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, path
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR
    assert w > 100 and h > 100, (path, w, h)


def test_write_report_writes_all_six_figures(tmp_path):
    md_path = write_report(RESULTS, tmp_path)
    assert md_path == tmp_path / "report.md"
    md = md_path.read_text()
    assert len(FIGURES) == 6
    for name in FIGURES:
        assert_png(tmp_path / name)
        assert f"]({name})" in md
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*FIGURES, "report.md"])  # no temp leftovers


def test_single_seed_has_no_spread():
    one = copy.deepcopy(RESULTS)
    for m in one["methods"].values():
        del m["seeds"]["1"]
    s = summarize(one)
    assert s["replay"]["acc"] == {"mean": 67.0, "std": None, "n": 1}
    assert s["replay"]["bwt"] == {"mean": -19.5, "std": None, "n": 1}
    assert s["replay"]["matrix_std"][2] == [None, None, None]
    table = format_table(one)
    assert "±" not in table and "| 67.00 |" in table and "| -19.50 |" in table


def test_missing_replay_skips_the_delta_figure_and_removes_a_stale_one(tmp_path):
    write_report(RESULTS, tmp_path)
    no_replay = copy.deepcopy(RESULTS)
    del no_replay["methods"]["replay"]
    md = write_report(no_replay, tmp_path).read_text()
    assert not (tmp_path / "fig_delta_vs_replay.png").exists()
    assert "fig_delta_vs_replay.png" not in md and "No 'replay' method" in md
    for name in FIGURES:
        if name != "fig_delta_vs_replay.png":
            assert_png(tmp_path / name)


def test_run_in_progress_and_no_loss_curves(tmp_path):
    """Methods at different stages; no loss curves -> no loss figure; one-stage method has no BWT."""
    partial = {"tasks": TASKS, "methods": {
        "replay": {"seeds": {"0": {"matrix": [[80], [60, 70]]}}},
        "seq": {"seeds": {"0": {"matrix": [[90]]}}},
    }}
    s = summarize(partial)
    assert s["replay"]["acc"]["mean"] == 65.0 and s["replay"]["bwt"]["mean"] == -20.0
    assert s["seq"]["bwt"] == {"mean": None, "std": None, "n": 1}
    assert s["seq"]["final"] == {"C-STANCE": {"mean": 90.0, "std": None, "n": 1}}
    row = [c.strip() for c in format_table(partial).splitlines()[3].strip("|").split("|")]
    assert row == ["seq", "1", "90.00", "-", "-", "-", "90.00", "-", "-"]
    md = write_report(partial, tmp_path).read_text()
    assert "Not all 3 stages finished for: replay (2), seq (1)" in md
    assert not (tmp_path / "fig_loss.png").exists()
    for name in ("fig_matrix.png", "fig_trajectories.png", "fig_delta_vs_replay.png", "fig_bwt_acc.png"):
        assert_png(tmp_path / name)


def test_row0_fwt_forgetting_op_and_protocol_header(tmp_path):
    """A run with row 0 and the next-task scores (data.metrics.cl_metrics' hand-made matrix): FWT, per-task
    forgetting, TRACE's OP and 1/N BWT in the summary, the tables and the figures; the protocol in the header."""
    run = {"matrix": [[50.0], [70.0, 60.0], [40.0, 80.0, 30.0], [45.0, 50.0, 35.0, 90.0]],
           "row0": [10.0, 20.0, 30.0, 40.0], "next_task": [25.0, 35.0, 60.0]}
    four = TASKS + ["Py150"]
    res = {"tasks": four, "methods": {"opr-ru": {"seeds": {"0": run}}},
           "meta": {"cfg": {"scoring": "paper", "eval_repeats": 8, "replay_budget": "per-task", "max_train": 5000}}}
    s = summarize(res)["opr-ru"]
    assert s["fwt"]["mean"] == pytest.approx(10.0) and s["op"]["mean"] == s["acc"]["mean"] == 55.0
    assert s["bwt_trace"]["mean"] == pytest.approx(-2.5) and s["forgetting_mean"]["mean"] == pytest.approx(50 / 3)
    assert {t: v["mean"] for t, v in s["forgetting"].items()} == {"C-STANCE": 25.0, "FOMC": 30.0, "MeetingBank": -5.0}
    assert s["row0"] == run["row0"] and s["next_task"] == run["next_task"]
    row = [c.strip() for c in format_table(res).splitlines()[2].strip("|").split("|")]
    assert row[:6] == ["opr-ru", "1", "55.00", "-3.33", "10.00", "16.67"]
    md = write_report(res, tmp_path).read_text()
    assert md.splitlines()[2] == ("- protocol: scoring paper; 8 sample(s) per test prompt; replay budget per-task; "
                                  "training subsample 5000 per task")
    assert "| opr-ru | 55.00 | -2.50 | 25.00 | 30.00 | -5.00 |" in md  # OP, TRACE's BWT, forgetting per task
    assert "| 0: base | 10.00 | 20.00 | 30.00 | 40.00 |" in md
    assert "| 1: C-STANCE | 50.00 | (25.00) | - | - |" in md
    assert "| 3: MeetingBank | 40.00 | 80.00 | 30.00 | (60.00) |" in md
    for name in ("fig_forgetting.png", "fig_trajectories.png"):
        assert_png(tmp_path / name)


@pytest.mark.parametrize("mutate, where", [
    (lambda r: r["methods"]["replay"]["seeds"]["1"]["matrix"][2].pop(),
     r"results\['methods'\]\['replay'\]\['seeds'\]\['1'\]\['matrix'\]\[2\]"),
    (lambda r: r["methods"]["opr-ru"]["seeds"]["0"]["matrix"].pop(), r"results\['methods'\]\['opr-ru'\]: seeds"),
    (lambda r: r["methods"]["opr-ru"]["seeds"]["0"]["matrix"][1].__setitem__(0, None),
     r"\['opr-ru'\]\['seeds'\]\['0'\]\['matrix'\]\[1\]"),
    (lambda r: r["methods"]["replay"]["seeds"]["0"]["loss_curves"][1].append("x"), r"\['loss_curves'\]\[1\]"),
    (lambda r: r.__setitem__("tasks", []), r"results\['tasks'\]"),
    (lambda r: r["methods"]["replay"]["seeds"]["0"].update(row0=[1.0, None, 3.0], next_task=[1.0, 2.0]),
     r"\['replay'\]\['seeds'\]\['0'\]\['row0'\]"),
    (lambda r: r["methods"]["replay"]["seeds"]["0"].update(row0=[1.0, 2.0, 3.0], next_task=[1.0]),
     r"\['replay'\]\['seeds'\]\['0'\]\['next_task'\]: expected at least 2"),
    # a partial run (2 of 3 stages) still has a next task after its last stage: summarize reads 2 entries
    (lambda r: [run.update(matrix=run["matrix"][:2], loss_curves=run["loss_curves"][:2], row0=[1.0, 2.0, 3.0],
                           next_task=[1.0]) for run in r["methods"]["replay"]["seeds"].values()],
     r"\['replay'\]\['seeds'\]\['0'\]\['next_task'\]: expected at least 2"),
])
def test_bad_results_name_the_field(tmp_path, mutate, where):
    bad = copy.deepcopy(RESULTS)
    mutate(bad)
    with pytest.raises(ValueError, match=where):
        write_report(bad, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_command_line_rebuilds_the_report_from_results_json(tmp_path):
    """`python report.py RUN_DIR` writes what write_report writes; a missing or broken results.json is one line."""
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    p = forkserver.run([sys.executable, str(repo / "report.py"), str(tmp_path)], cwd=repo, capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    assert format_table(RESULTS) in p.stdout
    assert (tmp_path / "report.md").read_text() == markdown_report(RESULTS, figures=list(FIGURES))
    assert p.stdout.count("WARNING") == 0
    for name in FIGURES:
        assert_png(tmp_path / name)
    for content, says in [(None, "results.json: not found"), ("{", "results.json: not valid JSON"),
                          (json.dumps({"tasks": []}), "results['tasks']")]:
        bad = tmp_path / f"bad{len(says)}"
        bad.mkdir()
        if content is not None:
            (bad / "results.json").write_text(content)
        p = forkserver.run([sys.executable, str(repo / "report.py"), str(bad)], cwd=repo, capture_output=True,
                           text=True)
        # README's promise for every script: one line `report.py: error: ...`, exit 2
        assert p.returncode == 2 and "Traceback" not in p.stderr and says in p.stderr, p.stderr
        assert p.stderr.startswith(f"report.py: error: {bad / 'results.json'}: ")
        assert p.stderr.count("\n") == 1 and not (bad / "report.md").exists()


@pytest.mark.filterwarnings("ignore:No artists with labels")  # the bars are not drawn
def test_mtl_shows_only_its_acc(tmp_path, monkeypatch):
    """mtl's rows are separate joint runs from the base, so only its ACC (OP, matrix, final scores) is shown: "—" for
    BWT, FWT and forgetting in every table, no ΔBWT, no BWT noise, no point in the BWT, forgetting and
    forgetting-vs-drift figures. The other methods' numbers do not change, and results.json is only read."""
    res = with_examples(copy.deepcopy(RESULTS))
    for k, run in enumerate([{"matrix": [[85.0], [80.0, 78.0], [79.0, 77.0, 93.0]]},
                             {"matrix": [[87.0], [82.0, 80.0], [81.0, 79.0, 95.0]]},
                             {"matrix": [[86.0], [81.0, 79.0], [80.0, 78.0, 94.0]]}]):
        run["row0"], run["next_task"] = [10.0, 20.0, 30.0], [25.0, 35.0]
        run["example_scores"] = [[[v - 5.0, v + 5.0, v - 5.0, v + 5.0] for v in row] for row in run["matrix"]]
        res["methods"].setdefault("mtl", {"seeds": {}})["seeds"][str(k)] = run
    res["methods"]["replay"]["seeds"]["2"] = copy.deepcopy(res["methods"]["replay"]["seeds"]["1"])
    before = json.dumps(res, sort_keys=True)
    s = summarize(res)
    m = s["mtl"]
    assert m["acc_only"] and not s["replay"]["acc_only"]
    assert m["acc"] == {"mean": 84.0, "std": 1.0, "n": 3}  # seeds 249/3, 255/3, 252/3
    assert m["op"]["mean"] == pytest.approx(m["acc"]["mean"])
    for k in ("bwt", "fwt", "forgetting_mean", "bwt_trace"):
        assert m[k]["mean"] is None and m[k]["std"] is None
    assert m["forgetting"] == {} and all(v["bwt"] is None for v in m["per_seed"].values())
    assert summarize({**res, "methods": {k: v for k, v in res["methods"].items() if k != "mtl"}})["replay"] == \
        s["replay"]
    unc = uncertainty(res, s)
    assert unc["methods"]["mtl"]["bwt_test"] is None and unc["methods"]["mtl"]["acc_test"] is not None
    assert "bwt" not in unc["deltas"]["replay"]["mtl"] and "acc" in unc["deltas"]["replay"]["mtl"]
    nn = numbers.noise_numbers(res, s)
    assert nn["mtl"]["bwt"] is None and nn["mtl − replay"]["bwt"] is None and nn["replay"]["bwt"] is not None

    row = [c.strip() for c in format_table(res, s, unc).splitlines()[4].strip("|").split("|")]
    assert row[0] == "mtl" and row[2] == "84.00 ± 1.00" and row[4:8] == ["—", "—", "—", "—"]
    md = write_report(res, tmp_path, s, unc).read_text()
    assert json.dumps(res, sort_keys=True) == before
    assert "- mtl: ACC only (— for BWT, FWT and forgetting" in md
    delta = next(line for line in md.splitlines() if line.startswith("| mtl ") and "+" in line)
    assert [c.strip() for c in delta.strip("|").split("|")][6:] == ["—"] * 4
    assert "| mtl | 84.00 ± 1.00 | — | — | — |" in md  # TRACE's table: OP only
    noise_row = next(line for line in md.splitlines() if line.startswith("| mtl − replay "))
    assert [c.strip() for c in noise_row.strip("|").split("|")][5:] == ["—"] * 3
    assert "main table's BWT" in md  # which BWT the paper's Table 1 numbers compare with
    for name in ("fig_bwt_acc.png", "fig_forgetting.png"):
        assert_png(tmp_path / name)
    drawn = []  # the methods each figure draws
    figures._plt()
    import matplotlib.axes
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", lambda self, *a, label=None, **k: drawn.append(label))
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, *a, label=None, **k: drawn.append(label))
    figures.plot_bwt_acc(s, tmp_path / "x.png")
    figures.plot_forgetting(TASKS, s, tmp_path / "y.png")
    assert drawn == ["replay", "opr-ru", "replay", "opr-ru"]  # no FWT in the legend: RESULTS has no row 0

    mech = mechanism_results()
    mech["methods"]["mtl"] = copy.deepcopy(mech["methods"]["sft"])
    assert {p["method"] for p in numbers.drift_numbers(mech)["points"]} == {"sft", "opr-ru"}


# --- the mechanism section: drift, forgetting vs drift, buffer loss ------------------------------------------------

def mechanism_results():
    """Two methods, three stages, one seed each, with drift entries (stages 2 and 3), buffers and rollout checks."""
    def drift(stage, kls):
        return {"stage": stage, "tasks": {t: {"n": 4, "mean_seq_kl": k, "kl_per_token": k / 10}
                                          for t, k in zip(["C-STANCE", "FOMC"], kls)},
                "all": {"n": 4 * len(kls), "mean_seq_kl": sum(kls) / len(kls), "kl_per_token": sum(kls) / len(kls) / 10}}

    def buf(stage, scorer, mean, mx, rej=None, rho=None):
        sel = {"n": 2, "nll_mean": mean, "nll_max": mx, "token_nll_max": 2 * mx}
        return {"stage": stage, "scorer": scorer, "spearman_ru_sc": rho,
                "all": {"selected": sel, "rejected": None if rej is None else {"n": 2, "nll_mean": rej,
                                                                                "nll_max": rej, "token_nll_max": rej}}}
    sft = {"matrix": [[90.0], [40.0, 80.0], [10.0, 50.0, 70.0]], "loss_curves": [[1.0], [1.0], [1.0]],
           "drift": [drift(2, [2.0]), drift(3, [4.0, 1.0])], "buffer_stats": [], "rollout_checks": []}
    opr = {"matrix": [[90.0], [85.0, 80.0], [80.0, 75.0, 70.0]], "loss_curves": [[1.0], [1.0], [1.0]],
           "drift": [drift(2, [0.5]), drift(3, [0.25, 0.5])],
           "buffer_stats": [buf(1, "ru", 0.1, 0.2, rej=0.9, rho=0.5), buf(2, "ru", 0.3, 0.6, rej=0.7, rho=0.1)],
           "rollout_checks": [{"stage": 1, "k": 8, "tokens": 40, "mean_abs_dlogp": 1e-7, "max_abs_dlogp": 1e-6,
                               "k3_kl": 1e-13, "warned": False}]}
    return {"tasks": ["C-STANCE", "FOMC", "MeetingBank"],
            "methods": {"sft": {"seeds": {"0": sft}}, "opr-ru": {"seeds": {"0": opr}}}, "meta": {}}


def test_drift_numbers_points_and_correlations():
    results = mechanism_results()
    dn = numbers.drift_numbers(results)
    assert dn["per_stage"]["sft"] == {2: {"seq_kl": 2.0, "kl_per_token": 0.2, "n_seeds": 1},
                                      3: {"seq_kl": 2.5, "kl_per_token": 0.25, "n_seeds": 1}}
    # points: (KL on task j, a(i, j) - a(i-1, j)) for stage 2 task C-STANCE and stage 3 tasks C-STANCE, FOMC
    pts = sorted((p["method"], p["stage"], p["task"], p["kl"], p["forgetting"]) for p in dn["points"])
    assert pts == sorted([("sft", 2, "C-STANCE", 2.0, -50.0), ("sft", 3, "C-STANCE", 4.0, -30.0),
                          ("sft", 3, "FOMC", 1.0, -30.0), ("opr-ru", 2, "C-STANCE", 0.5, -5.0),
                          ("opr-ru", 3, "C-STANCE", 0.25, -5.0), ("opr-ru", 3, "FOMC", 0.5, -5.0)])
    xs, ys = [p[3] for p in pts], [p[4] for p in pts]
    assert dn["pearson"] == pytest.approx(float(np.corrcoef(xs, ys)[0, 1]))
    scipy_stats = pytest.importorskip("scipy.stats")
    assert dn["spearman"] == pytest.approx(scipy_stats.spearmanr(xs, ys).statistic)
    assert dn["pearson"] < 0  # larger drift, larger drop in this hand-made run


def test_buffer_numbers_and_mechanism_section(tmp_path):
    results = mechanism_results()
    bn = numbers.buffer_numbers(results)
    assert list(bn) == ["opr-ru"]
    b = bn["opr-ru"]
    assert b["buffers"] == 2 and b["nll_mean"] == pytest.approx(0.2) and b["nll_max"] == pytest.approx(0.6)
    assert b["rejected_nll_mean"] == pytest.approx(0.8) and b["spearman_ru_sc"] == pytest.approx(0.3)
    assert b["token_nll_max"] == pytest.approx(0.8)
    text = re.sub(" +", " ", "\n".join(tables.mechanism_section(results)))  # tables are padded for the terminal
    assert "| sft | 2 (0.2) | 2.5 (0.25) |" in text
    assert "| opr-ru | ru | 2 | 0.200 | 0.600 | 0.800 | 0.800 | 0.30 |" in text
    assert "opr-ru: 1 rollout sets" in text and "WARNED" not in text
    report.write_report(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "## Mechanism: per-update drift" in md
    for name in ("fig_drift.png", "fig_drift_vs_forgetting.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md
    # a run without probes has no such section and no such figures
    for e in results["methods"].values():
        for run in e["seeds"].values():
            for k in ("drift", "buffer_stats", "rollout_checks"):
                run.pop(k)
    assert tables.mechanism_section(results) == []
    report.write_report(results, tmp_path)
    assert not (tmp_path / "fig_drift.png").exists() and "Mechanism" not in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# Uncertainty: paired differences with intervals over seeds and over test prompts


def with_examples(results, spread=5.0):
    """A copy whose runs carry per-example scores: 4 test examples per task, [v - d, v + d, v - d, v + d] for matrix
    entry v (mean v), the same pattern in every method, stage and seed."""
    out = copy.deepcopy(results)
    for e in out["methods"].values():
        for run in e["seeds"].values():
            run["example_scores"] = [[[v - spread, v + spread, v - spread, v + spread] for v in row]
                                     for row in run["matrix"]]
    out["test_idx"] = {t: [0, 1, 2, 3] for t in out["tasks"]}
    return out


def test_paired_differences_over_seeds_by_hand():
    unc = uncertainty(RESULTS)
    assert unc["bootstrap"] is None and unc["methods"]["replay"] == {"acc_test": None, "bwt_test": None}
    assert list(unc["deltas"]) == ["replay"]  # no sft in this run
    d = unc["deltas"]["replay"]["opr-ru"]
    assert d["acc"]["per_seed"] == {"0": 12.0, "1": 12.0} and d["acc"]["seeds"] == (12.0, 12.0)
    assert d["bwt"]["per_seed"] == {"0": 17.5, "1": 17.0} and d["bwt"]["mean"] == 17.25
    half = t_quantile(1) * 0.25  # sample std of (17.5, 17) = 0.5 / sqrt(2); / sqrt(2) again
    assert d["bwt"]["seeds"] == pytest.approx((17.25 - half, 17.25 + half))
    assert half == pytest.approx(3.17655, abs=1e-4)
    assert d["acc"]["resolved"] and d["bwt"]["resolved"] and d["bwt"]["test"] is None
    md = markdown_report(RESULTS)
    row = next(line for line in md.splitlines() if line.startswith("| opr-ru ") and "17.25" in line)
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "opr-ru", "2", "+12.00", "[+12.00, +12.00]", "-", "yes (seeds only)",
        "+17.25", "[+14.07, +20.43]", "-", "yes (seeds only)"]
    assert "no per-example scores" in md and "## Paired differences vs replay" in md


def test_test_set_bootstrap_is_paired_and_deterministic():
    """opr-ru and replay share every example's deviation from their mean, so every resample gives them the same
    difference: the paired ΔACC interval is exactly [12, 12] and ΔBWT's [17.25, 17.25], while each method's own ACC
    interval is wide (the examples differ by 10 points)."""
    res = with_examples(RESULTS)
    unc = uncertainty(res)
    assert unc["bootstrap"] == {"B": 1000, "seed": 0, "sizes": {t: 4 for t in TASKS}}
    d = unc["deltas"]["replay"]["opr-ru"]
    assert d["acc"]["test"] == pytest.approx((12.0, 12.0)) and d["bwt"]["test"] == pytest.approx((17.25, 17.25))
    lo, hi = unc["methods"]["replay"]["acc_test"]
    assert lo < 69 < hi and hi - lo > 2
    assert uncertainty(res) == unc  # the same results.json gives the same intervals
    table = format_table(res)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header == ["method", "seeds", "ACC", "ACC 95% CI", "BWT", "BWT 95% CI", "FWT", "forgetting", *TASKS]
    replay = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    assert replay[3] == f"[{lo:.2f}, {hi:.2f}]"
    md = markdown_report(res)
    assert "percentile bootstrap over test prompts (1000 resamples" in md and "C-STANCE 4" in md


def test_one_seed_is_resolved_on_the_test_set_only_and_says_so():
    one = with_examples(RESULTS)
    for m in one["methods"].values():
        del m["seeds"]["1"]
    one["methods"]["sft"] = {"seeds": {"0": {"matrix": [[80], [20, 70], [5, 30, 90]],
                                             "example_scores": [[[80] * 4], [[0, 40, 0, 40], [70] * 4],
                                                                [[0, 10, 0, 10], [0, 60, 0, 60], [90] * 4]]}}}
    unc = uncertainty(one)
    assert list(unc["deltas"]) == ["replay", "sft"]
    d = unc["deltas"]["replay"]["opr-ru"]["acc"]
    assert d["n"] == 1 and d["seeds"] is None and d["test"] == pytest.approx((12.0, 12.0)) and d["resolved"]
    md = markdown_report(one)
    assert "yes (test set only; 1 seed)" in md and "One seed: the spread over seeds" in md
    assert "## Paired differences vs sft" in md
    # replay vs sft: C-STANCE differs per example by -5, +5, -5, +5 minus 0, 10, 0, 10 -> not constant: a real
    # interval that, here, still excludes 0 (replay ACC 67 vs sft 41.67)
    r = unc["deltas"]["sft"]["replay"]["acc"]
    assert r["mean"] == pytest.approx(67 - 125 / 3) and r["test"][0] < r["mean"] < r["test"][1]


def test_one_seed_takes_its_seed_interval_from_the_presets_measured_noise():
    """With meta.seed_noise (run.py adds it for a preset used unchanged), a one-seed difference gets the seed
    interval Δ ∓ t(n_ref - 1) × σ from the preset's measured per-seed std of that difference, marked †; a run with
    two seeds keeps its own t-interval; a pair the preset did not measure stays 'test set only'."""
    one = with_examples(RESULTS, spread=0.0)
    for m in one["methods"].values():
        del m["seeds"]["1"]
    one["meta"]["seed_noise"] = {"seeds": 10, "measured": "a hand-made table",
                                 "std": {"replay": {"acc": 1.5, "bwt": 1.0}, "opr-ru": {"acc": 2.0, "bwt": 3.0}},
                                 "delta_std": {"replay": {"opr-ru": {"acc": 6.0, "bwt": 2.0}}}}
    d = uncertainty(one)["deltas"]["replay"]["opr-ru"]
    t9 = t_quantile(9)
    assert t9 == pytest.approx(2.2622, abs=1e-4)
    # ΔACC 12 (per seed 0), σ 6: 12 -/+ 13.57 straddles 0 -> not resolved, although the test set alone says yes
    assert d["acc"]["seeds"] == pytest.approx((12 - t9 * 6, 12 + t9 * 6)) and d["acc"]["seeds_source"] == "preset"
    assert d["acc"]["test"] == pytest.approx((12.0, 12.0)) and not d["acc"]["resolved"]
    # ΔBWT 17.5, σ 2: 17.5 -/+ 4.52 -> resolved on both intervals
    assert d["bwt"]["seeds"] == pytest.approx((17.5 - t9 * 2, 17.5 + t9 * 2)) and d["bwt"]["resolved"]
    md = markdown_report(one)
    row = next(line for line in md.splitlines() if line.startswith("| opr-ru ") and "+12.00" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "[-1.57, +25.57]†" and cells[5] == "no" and cells[9] == "yes (preset's seed std)"
    assert "† one seed: CI seeds is Δ ∓ t(9) × σ" in md and "a hand-made table" in md
    assert "replay 1.50 / 1.00; opr-ru 2.00 / 3.00" in md  # the preset's std next to the one-seed table
    assert "seed_noise" not in md  # not dumped with the other meta fields
    # a method the preset did not measure against replay: no seed interval, as without the table
    one["methods"]["sft"] = copy.deepcopy(one["methods"]["replay"])
    assert uncertainty(one)["deltas"]["replay"]["sft"]["acc"]["seeds"] is None
    # two seeds: the run's own interval, whatever the preset measured
    two = with_examples(RESULTS, spread=0.0)
    two["meta"]["seed_noise"] = one["meta"]["seed_noise"]
    d2 = uncertainty(two)["deltas"]["replay"]["opr-ru"]["bwt"]
    assert d2["seeds_source"] == "run" and d2["seeds"] == pytest.approx((17.25 - t_quantile(1) * 0.25,
                                                                        17.25 + t_quantile(1) * 0.25))


def test_unresolved_difference_is_marked_no():
    res = with_examples(RESULTS, spread=0.0)
    for s, run in res["methods"]["opr-ru"]["seeds"].items():  # ACC +-3 around replay's, different sign per seed
        sign = 1 if s == "0" else -1
        run["matrix"] = copy.deepcopy(res["methods"]["replay"]["seeds"][s]["matrix"])
        run["matrix"][2] = [v + 3 * sign for v in run["matrix"][2]]
        run["example_scores"] = [[[v - 20, v + 20, v, v] for v in row] for row in run["matrix"]]
    d = uncertainty(res)["deltas"]["replay"]["opr-ru"]["acc"]
    assert d["per_seed"] == {"0": 3.0, "1": -3.0} and not d["resolved"]
    row = next(line for line in markdown_report(res).splitlines() if line.startswith("| opr-ru ") and "+0.00" in line)
    assert [c.strip() for c in row.strip("|").split("|")][5] == "no"


# ---------------------------------------------------------------------------------------------------------------
# Degenerate answers


def predictions(preds, golds, finish="stop"):
    return [{"prediction": p, "gold": g, "finish_reason": finish, "num_tokens": 2, "score": letter_accuracy(p, g)}
            for p, g in zip(preds, golds)]


def with_diagnostics(results):
    """Diagnostics for every evaluation; replay's seed-0 stage-2 evaluation answers 'C' to all C-STANCE prompts
    (gold: half A, half B) and hits the length cap on all FOMC prompts; replay's seed-1 stage-3 evaluation answers
    FOMC in German sentences (off-format; the gold-A half scores by the first character); opr-ru's seed-1 stage-3
    evaluation answers nothing to C-STANCE, stopped by the cap."""
    out = copy.deepcopy(results)
    golds = ["A", "B"] * 10
    for m, e in out["methods"].items():
        for s, run in e["seeds"].items():
            run["diagnostics"] = []
            for i, row in enumerate(run["matrix"]):
                stage = {}
                for j in range(i + 1):
                    t = TASKS[j]
                    if (m, s, i, t) == ("replay", "0", 1, "C-STANCE"):
                        stage[t] = diagnose(t, predictions(["C"] * 20, golds))
                    elif (m, s, i, t) == ("replay", "0", 1, "FOMC"):
                        stage[t] = diagnose(t, predictions(golds, golds, finish="length"))
                    elif (m, s, i, t) == ("replay", "1", 2, "FOMC"):
                        stage[t] = diagnose(t, predictions(["Anna sah Bücher in Bern ."] * 20, golds))
                    elif (m, s, i, t) == ("opr-ru", "1", 2, "C-STANCE"):
                        stage[t] = diagnose(t, predictions([""] * 20, golds, finish="length"))
                    else:
                        stage[t] = diagnose(t, predictions(golds, golds))
                run["diagnostics"].append(stage)
    return out


def test_diagnostics_and_warnings_in_the_report(tmp_path):
    res = with_diagnostics(RESULTS)
    lines = warning_lines(res)
    assert lines[:2] == ["WARNING replay, after stage 2 (FOMC), task C-STANCE: seed 0: predictions collapsed to 'C' "
                         "(100% of answers, 0% of the gold answers; gold majority class 50%)",
                         "WARNING replay, after stage 2 (FOMC), task FOMC: seed 0: 100% of responses hit the "
                         "max-new-tokens cap"]
    md = write_report(res, tmp_path).read_text()
    for line in lines:
        assert f"- {line}" in md
    # next to replay's matrix: the answers table; stage 2 row: label shares averaged over the 2 seeds (C: 100%, 0%)
    replay = md[md.index("### replay"):md.index("### opr-ru")]
    assert "| 2: FOMC | C 50% ! | A 50%, capped 50% ! | - |" in replay
    assert "| 1: C-STANCE | A 50% | - | - |" in replay
    assert "Gold labels' majority class: C-STANCE 'A' 50%, FOMC 'A' 50%." in replay
    assert "4 evaluation(s) flagged for degenerate answers" in md
    # stage 3's FOMC pools seed 0 (A 50%, in format) with seed 1 (German: 'A' 100%, all off-format)
    assert "| 3: MeetingBank | A 50% | A 75%, off-format 50% ! | ok |" in replay
    assert lines[2] == ("WARNING replay, after stage 3 (MeetingBank), task FOMC: seed 1: 100% of answers are not a "
                        "letter (most often 'Anna sah Bücher in Bern .'), 50% of answers score by their first "
                        "character alone (chance 50%)")
    # empty answers are not a label: the cell pools seed 0 (A 50%, B 50%) with seed 1 (all empty, all capped)
    opr = md[md.index("### opr-ru"):]
    assert "| 3: MeetingBank | A 25%, empty 50%, capped 50% ! | A 50% | ok |" in opr
    assert opr.count("WARNING") == 1 and lines[3] == (
        "WARNING opr-ru, after stage 3 (MeetingBank), task C-STANCE: seed 1: 100% empty responses, 100% of "
        "responses hit the max-new-tokens cap")
    # MeetingBank is not a classification task: no label, nothing to show but 'ok' (the last cells of both rows above)
    # a results.json written before the chance existed: the hits without it; before the off-format numbers: as it did
    def drop(*keys):  # from every stored diagnosis
        for d in (d for e in res["methods"].values() for run in e["seeds"].values()
                  for stage in run["diagnostics"] for d in stage.values()):
            for k in keys:
                d.pop(k, None)
    drop("off_format_chance")
    mid = write_report(res, tmp_path).read_text()
    assert "50% of answers score by their first character alone\n" in mid and "(chance" not in mid
    drop("off_format", "off_format_hits", "off_format_example")
    old = write_report(res, tmp_path).read_text()
    assert not re.search(r"off-format \d", old) and "are not a letter" not in old
    assert "| 3: MeetingBank | A 50% | A 75% | ok |" in old


def test_where_the_seed_noise_comes_from():
    """Shown for methods with >= 3 seeds, by hand: replay's ACC per seed 67, 71, 69 (var 4); its final rows'
    tasks vary by 4, 6.25 and 2.25 with covariances 5, 3, 3.75, so C-STANCE's share of the variance is (4 + 5 + 3) /
    9 / 4 = 1/3. The per-example scores move with the task (v -/+ 5 on every seed), so the test-prompt part of
    each task's variance is its variance / 4 prompts."""
    r = copy.deepcopy(RESULTS)
    assert "## Where the seed noise comes from" not in markdown_report(r)  # 2 seeds: not shown
    r["methods"]["replay"]["seeds"]["2"] = {"matrix": [[82], [61, 72], [52, 63.5, 91.5]]}
    for run in r["methods"]["replay"]["seeds"].values():
        run.pop("loss_curves", None)
    nn = numbers.noise_numbers(r)
    assert list(nn) == ["replay"]  # opr-ru has 2 seeds
    acc = nn["replay"]["acc"]
    assert acc["n"] == 3 and acc["std"] == pytest.approx(2.0) and acc["prompt"] is None
    assert acc["task_std"] == pytest.approx([2.0, 2.5, 1.5])
    assert acc["share"] == pytest.approx([1 / 3, (5 + 6.25 + 3.75) / 9 / 4, (3 + 3.75 + 2.25) / 9 / 4])
    # BWT per seed -19.5, -19, -19.25: the last task left out, final - own stage per task
    assert nn["replay"]["bwt"]["std"] == pytest.approx(0.25)
    md = markdown_report(r)
    assert "## Where the seed noise comes from" in md
    row = next(line for line in md.splitlines() if line.startswith("| replay ") and "33%" in line)
    assert [c.strip() for c in row.strip("|").split("|")] == ["replay", "2.0 (+33%)", "2.5 (+42%)", "1.5 (+25%)"]

    ex = with_examples(r)
    nn = numbers.noise_numbers(ex)
    acc = nn["replay"]["acc"]
    # every prompt of a task moves with it: prompt part = sum_j var_j / 4 / 3^2 = (4 + 6.25 + 2.25) / 36
    assert acc["prompt"] == pytest.approx((4 + 6.25 + 2.25) / 4 / 9)
    assert acc["floor"] == pytest.approx(math.sqrt(4 - acc["prompt"]))
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in markdown_report(ex).splitlines()
            if line.startswith("| replay ")]
    cells = next(c for c in rows if len(c) == 8)  # the std / test prompts / floor table
    assert cells[:5] == ["replay", "3", "2.00", f"{acc['prompt'] / 4:.0%}", f"{acc['floor']:.2f}"]


def test_noise_of_a_paired_difference_is_the_spread_of_its_seed_interval():
    """With 3 paired seeds the 'opr-ru − replay' row holds the std of the per-seed ΔACC and ΔBWT that the paired
    t-interval uses: half-width = t(2) * std / sqrt(3)."""
    r = with_examples(RESULTS)
    r["methods"]["replay"]["seeds"]["2"] = {"matrix": [[82], [61, 72], [52, 63.5, 91.5]]}
    r["methods"]["opr-ru"]["seeds"]["2"] = {"matrix": [[81], [70, 73], [70, 70, 92]]}
    for e in r["methods"].values():
        e["seeds"]["2"]["example_scores"] = [[[v - 5, v + 5, v - 5, v + 5] for v in row]
                                             for row in e["seeds"]["2"]["matrix"]]
    nn = numbers.noise_numbers(r)
    assert list(nn) == ["replay", "opr-ru", "opr-ru − replay"]
    d = uncertainty(r)["deltas"]["replay"]["opr-ru"]
    for metric in ("acc", "bwt"):
        per_seed = list(d[metric]["per_seed"].values())
        sd = nn["opr-ru − replay"][metric]["std"]
        assert sd == pytest.approx(statistics.stdev(per_seed))
        lo, hi = d[metric]["seeds"]
        assert (hi - lo) / 2 == pytest.approx(t_quantile(2) * sd / math.sqrt(3))
    # both methods' examples sit at -/+ 5 around their cell on every seed: the differences' examples equal the
    # difference of the cells, so each prompt varies as much as its task: prompt part = sum_j var_j / 4 / 3^2
    acc = nn["opr-ru − replay"]["acc"]
    assert acc["prompt"] == pytest.approx(sum(sd ** 2 for sd in acc["task_std"]) / 4 / 9)
    assert acc["prompt"] != pytest.approx(acc["std"] ** 2 / 4)  # the tasks' covariances are not in it


def test_example_scores_must_average_to_their_matrix_entry(tmp_path):
    """The bootstrap and the noise section read per-example scores as the matrix entry's parts: a results.json whose
    examples average elsewhere is refused with the cell named, before anything is written."""
    bad = with_examples(RESULTS)
    bad["methods"]["opr-ru"]["seeds"]["1"]["example_scores"][2][1][0] += 4  # mean 72 -> 73
    with pytest.raises(ValueError, match=r"\['opr-ru'\]\['seeds'\]\['1'\]\['example_scores'\]\[2\]\[1\]: the "
                                         r"examples' mean 73.0000 is not matrix\[2\]\[1\] = 72.0000"):
        write_report(bad, tmp_path)
    assert list(tmp_path.iterdir()) == []
    ok = with_examples(RESULTS)
    ok["methods"]["opr-ru"]["seeds"]["1"]["example_scores"][2][1][0] += 4e-4  # run.py's rounding: accepted
    write_report(ok, tmp_path)
