"""The OPR paper's claims, tested on whatever a results.json holds: each with the paper's number,
this run's number with its 95 % intervals, and a verdict.

    claims(results)  -> [{"claim", "where", "paper", "statistic", "value", "seeds", "test",
                          "verdict", "why"}]

A claim is a decision about a statistic (its sign, or for "matches" its distance from 0). Intervals:
"seeds", a t-interval over the paired seeds (two seeds at least; None with one), and "test", the
percentile interval over test prompts resampled the same way for every method (reporting.stats; None
without per-example scores). The verdict:
- holds: every available interval lies on the claim's side of the decision;
- contradicted: every available interval lies on the other side;
- unresolved: an interval spans the decision, or there is none (one seed, no per-example scores);
- not testable: the run lacks what the claim compares ("why" names the methods, budgets or tasks
  it would need), or what it measures does not happen in this run (replay that does not forget
  has no |BWT| to cut).
The paper's numbers are its Table/Figure values as the issue quotes them
(OPR paper, TRACE, 7-8B models).
"""
import math
import re
import statistics

import numpy as np

from reporting.numbers import _bootstrap, drift_numbers, summarize
from reporting.stats import (BOOTSTRAP_B, BOOTSTRAP_SEED, paired_differences, percentile_interval,
                             t_interval, t_quantile)

MATCH_PP = 2.0  # "matches" / "near zero": within +-2 points (ACC, BWT, a task's score); a choice,
                # stated in the report
LARGE_SHIFT = "MeetingBank"  # C5's task: the paper's largest SDFT deficit against replay
PAPER = {
    "C1": "OPR-RU cuts |BWT| against replay by 42-46 % at rho 0.01, 46-60 % at every budget",
    "C2": "OPR-RU's ACC is flat across budgets (range 0.47 pp) while replay's swings (3.51 pp)",
    "C3": "low-score replay forgets more than OPR-RU and gold replay "
          "(rho 0.10: BWT -3.47 vs -0.65, -1.37)",
    "C4": "OPR-SC matches OPR-RU (ACC 65.11 vs 65.45, BWT -2.08 vs -2.29)",
    "C5": "SDFT's deficit concentrates on MeetingBank (-23 to -32 pp vs replay); "
          "OPR's per-task deltas stay near 0",
    "C6": "per-update KL on old prompts is lower for OPR-RU than for replay, "
          "and forgetting grows with it",
}


def claims(results, summary=None) -> list[dict]:
    summary = summary or summarize(results)
    _, boot = _bootstrap(results, BOOTSTRAP_B, BOOTSTRAP_SEED)
    budgets = _budgets(results)
    rows = []
    for claim in (_c1, _c2, _c3, _c4, _c5, _c6):
        rows += claim(results, summary, boot, budgets)
    return [{k: _finite(v) for k, v in r.items()} for r in rows]


def _finite(v):
    """A statistic as results.json may hold it: a non-finite number (an interval of a
    degenerate spread) is None."""
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v] if isinstance(v, list) else (
            None if any(x is None or not math.isfinite(x) for x in v)
            else tuple(float(x) for x in v))
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# ---- the claims ----------------------------------------------------------------------------------

def _c1(results, summary, boot, budgets):
    rows = []
    for rho, at in budgets.items():
        if not {"opr-ru", "replay"} <= set(at):
            continue
        opr, rep = at["opr-ru"], at["replay"]
        where = _where(rho)
        if summary[rep]["stages"] < 2 or summary[opr]["stages"] != summary[rep]["stages"]:
            rows.append(_untestable("C1", where, "needs opr-ru and replay with 2 stages or more"))
            continue
        if summary[rep]["bwt"]["mean"] >= 0:
            rows.append(_untestable("C1", where, f"replay does not forget here "
                                                  f"(BWT {summary[rep]['bwt']['mean']:+.2f}): "
                                                  f"there is no |BWT| to cut"))
            continue
        a, b = _paired_values(summary, opr, rep, "bwt")
        value, seeds = percent_cut(a, b)
        if not a:
            rows.append(_untestable("C1", where, "opr-ru and replay share no seed"))
            continue
        test = None
        if boot is not None:
            cuts = percent_cut_samples([boot[opr][s]["bwt"] for s in a],
                                       [boot[rep][s]["bwt"] for s in a])
            test = None if cuts is None else percentile_interval(cuts)
        rows.append(_row("C1", where, "|BWT| cut by opr-ru vs replay, %", value, seeds, test,
                         side=+1))
    return rows or [_untestable("C1", "", "needs opr-ru and replay")]


def _c2(results, summary, boot, budgets):
    rhos = [r for r, at in budgets.items() if r is not None and {"opr-ru", "replay"} <= set(at)]
    if len(rhos) < 2:
        return [_untestable("C2", "", f"needs opr-ru and replay at 2 budgets or more "
                                      f"(--rho a,b,...; this run: {len(rhos)})")]
    labels = {m: [budgets[r][m] for r in rhos] for m in ("opr-ru", "replay")}
    seeds = [s for s in summary[labels["opr-ru"][0]]["seeds"]
             if all(s in summary[l]["per_seed"] for ls in labels.values() for l in ls)]

    def spread(m, s):
        accs = [summary[l]["per_seed"][s]["acc"] for l in labels[m]]
        return max(accs) - min(accs)
    if not seeds:
        return [_untestable("C2", "", "opr-ru and replay share no seed at every budget")]
    d = [spread("opr-ru", s) - spread("replay", s) for s in seeds]
    test = None
    if boot is not None and seeds:
        def spread_b(m, s):
            accs = np.stack([boot[l][s]["acc"] for l in labels[m]])
            return accs.max(axis=0) - accs.min(axis=0)
        test = percentile_interval(np.mean([spread_b("opr-ru", s) - spread_b("replay", s)
                                            for s in seeds], axis=0))
    where = "rho " + ", ".join(f"{r:g}" for r in rhos)
    return [_row("C2", where, "ACC range over budgets, opr-ru - replay, pp (per seed)",
                 statistics.fmean(d), t_interval(d), test, side=-1)]


def _c3(results, summary, boot, budgets):
    rows = []
    for rho, at in budgets.items():
        if not {"opr-low", "opr-ru", "replay"} <= set(at):
            continue
        parts = [_delta(summary, boot, at["opr-low"], at[ref], "bwt")
                 for ref in ("opr-ru", "replay")]
        verdicts = [_verdict(p["seeds"], p["test"], side=-1) for p in parts]
        verdict = ("contradicted" if "contradicted" in verdicts else
                   "holds" if all(v == "holds" for v in verdicts) else "unresolved")
        rows.append(dict(claim="C3", where=_where(rho), paper=PAPER["C3"],
                         statistic="BWT, opr-low - opr-ru; opr-low - replay",
                         value=[p["value"] for p in parts], seeds=[p["seeds"] for p in parts],
                         test=[p["test"] for p in parts], verdict=verdict,
                         why="both differences below 0" if verdict == "holds" else ""))
    return rows or [_untestable("C3", "", "needs opr-low, opr-ru and replay at one budget")]


def _c4(results, summary, boot, budgets):
    rows = []
    for rho, at in budgets.items():
        if not {"opr-sc", "opr-ru"} <= set(at):
            continue
        metrics = ["acc"] + (["bwt"] if summary[at["opr-ru"]]["stages"] > 1 else [])
        parts = [_delta(summary, boot, at["opr-sc"], at["opr-ru"], m) for m in metrics]
        verdicts = [_match(p["seeds"], p["test"]) for p in parts]
        verdict = ("contradicted" if "contradicted" in verdicts else
                   "holds" if all(v == "holds" for v in verdicts) else "unresolved")
        rows.append(dict(claim="C4", where=_where(rho), paper=PAPER["C4"],
                         statistic=f"opr-sc - opr-ru, {' and '.join(m.upper() for m in metrics)} "
                                   f"(match: within +-{MATCH_PP:g})",
                         value=[p["value"] for p in parts], seeds=[p["seeds"] for p in parts],
                         test=[p["test"] for p in parts], verdict=verdict, why=""))
    return rows or [_untestable("C4", "", "needs opr-sc and opr-ru at one budget")]


def _c5(results, summary, boot, budgets):
    tasks = results["tasks"]
    if LARGE_SHIFT not in tasks or len(tasks) < 2:
        return [_untestable("C5", "", f"needs the task {LARGE_SHIFT} "
                                      f"(the paper's large-shift task) and another")]
    rows = []
    j = tasks.index(LARGE_SHIFT)
    for rho, at in budgets.items():
        if not {"sdft", "replay"} <= set(at):
            continue
        sd, rep = at["sdft"], at["replay"]
        if min(summary[sd]["stages"], summary[rep]["stages"]) <= j:
            continue
        finals = {m: _finals(results, m) for m in (sd, rep, at.get("opr-ru"))}
        seeds = [s for s in finals[sd]
                 if s in finals[rep] and len(finals[sd][s]) == len(finals[rep][s])]
        conc = [(finals[sd][s][j] - finals[rep][s][j])
                - statistics.fmean(finals[sd][s][k] - finals[rep][s][k]
                                   for k in range(len(finals[sd][s])) if k != j)
                for s in seeds]
        verdict = _verdict(t_interval(conc), None, side=-1) if conc else "unresolved"
        why = ""
        if "opr-ru" in at and verdict == "holds":
            opr = [finals[at["opr-ru"]][s][j] - finals[rep][s][j]
                   for s in seeds if s in finals[at["opr-ru"]]]
            near = _match(t_interval(opr), None)
            verdict = near if near != "holds" else verdict
            why = f"opr-ru - replay on {LARGE_SHIFT}: {statistics.fmean(opr):+.2f}"
        elif "opr-ru" not in at:
            why = "the OPR half needs opr-ru at this budget"
        rows.append(dict(claim="C5", where=_where(rho), paper=PAPER["C5"],
                         statistic=f"(sdft - replay) on {LARGE_SHIFT} "
                                   f"minus its mean on the other tasks, final row",
                         value=statistics.fmean(conc) if conc else None, seeds=t_interval(conc),
                         test=None, verdict=verdict, why=why))
    return rows or [_untestable("C5", "", f"needs sdft and replay trained through {LARGE_SHIFT}")]


def _c6(results, summary, boot, budgets):
    dn = drift_numbers(results)
    rows = []
    for rho, at in budgets.items():
        if not {"opr-ru", "replay"} <= set(at):
            continue
        kl = {m: _seed_kl(results, at[m]) for m in ("opr-ru", "replay")}
        d = paired_differences(kl["opr-ru"], kl["replay"])
        if not d:
            rows.append(_untestable("C6", _where(rho), "needs drift probes of opr-ru and replay "
                                                        "(--drift-limit > 0, 2 stages or more)"))
            continue
        verdict = _verdict(t_interval(d.values()), None, side=-1)
        r = dn["spearman"]
        if verdict == "holds" and (r is None or r >= 0):
            verdict = "unresolved"  # the KL is lower, but forgetting does not grow with it here
        rows.append(dict(claim="C6", where=_where(rho), paper=PAPER["C6"],
                         statistic="mean per-update KL on old prompts, opr-ru - replay (nats)",
                         value=statistics.fmean(d.values()), seeds=t_interval(d.values()),
                         test=None, verdict=verdict,
                         why=f"Spearman(KL, score change) over every method's stages: "
                             f"{'n/a' if r is None else f'{r:+.2f}'} "
                             f"(forgetting grows with KL: < 0)"))
    return rows or [_untestable("C6", "", "needs opr-ru and replay with drift probes")]


# ---- the statistics ------------------------------------------------------------------------------

def percent_cut(a: dict, b: dict) -> tuple:
    """(100 (1 - R), its 95 % interval over seeds) with R = mean|a| / mean|b| over the paired
    seeds: the ratio estimator's t-interval, R +- t(n-1) sd(|a_s| - R |b_s|) / (sqrt(n) mean|b|)
    (None with one seed)."""
    x, y = [abs(a[s]) for s in a], [abs(b[s]) for s in a]
    n, my = len(x), statistics.fmean(y)
    r = statistics.fmean(x) / my
    if n < 2:
        return 100 * (1 - r), None
    half = (t_quantile(n - 1) * statistics.stdev(xi - r * yi for xi, yi in zip(x, y))
            / (math.sqrt(n) * my))
    return 100 * (1 - r), (100 * (1 - r - half), 100 * (1 - r + half))


def percent_cut_samples(a: list, b: list) -> np.ndarray | None:
    """The cut of every test-prompt resample: a, b: per seed, [B] arrays of BWT (the same resamples
    for both). None when some resample leaves replay no |BWT| (every resampled prompt unchanged):
    the cut is undefined there, so is the interval."""
    den = np.mean(np.abs(b), axis=0)
    if not np.all(den > 0):
        return None
    return 100 * (1 - np.mean(np.abs(a), axis=0) / den)


def _budgets(results) -> dict:
    """{rho: {method: label}}: the labels of each budget; methods without a buffer (one label for
    every budget) appear at every budget. rho is None when the run names none."""
    cfg = (results.get("meta") or {}).get("cfg") or {}
    try:
        single = [float(r) for r in str(cfg.get("rho", "")).split(",") if r.strip()]
    except ValueError:  # (not run.py's: a hand-made meta)
        single = []
    out, shared = {}, {}
    for label in results["methods"]:
        m = re.fullmatch(r"(.+)@([0-9.eE+-]+)", label)
        if m:
            out.setdefault(float(m.group(2)), {})[m.group(1)] = label
        else:
            shared[label] = label
    if not out:
        out = {single[0] if len(single) == 1 else None: {}}
    for at in out.values():
        for name, label in shared.items():
            at.setdefault(name, label)
    return out


def _paired_values(summary, m, ref, metric) -> tuple:
    a = {s: v[metric] for s, v in summary[m]["per_seed"].items() if v[metric] is not None}
    b = {s: v[metric] for s, v in summary[ref]["per_seed"].items() if v[metric] is not None}
    seeds = [s for s in a if s in b]
    return {s: a[s] for s in seeds}, {s: b[s] for s in seeds}


def _delta(summary, boot, m, ref, metric) -> dict:
    a, b = _paired_values(summary, m, ref, metric)
    d = [a[s] - b[s] for s in a]
    test = (percentile_interval(np.mean([boot[m][s][metric] - boot[ref][s][metric]
                                         for s in a], axis=0))
            if boot is not None and d else None)
    return {"value": statistics.fmean(d) if d else None, "seeds": t_interval(d), "test": test}


def _finals(results, label) -> dict:
    return ({s: run["matrix"][-1] for s, run in results["methods"][label]["seeds"].items()}
            if label else {})


def _seed_kl(results, label) -> dict:
    out = {}
    for s, run in results["methods"][label]["seeds"].items():
        kls = [d["all"]["mean_seq_kl"] for d in run.get("drift") or []]
        if kls:
            out[s] = statistics.fmean(kls)
    return out


def _verdict(seeds, test, side: int) -> str:
    """side +1: the claim holds above 0; -1: below 0."""
    cis = [c for c in (seeds, test) if c is not None]
    if not cis:
        return "unresolved"
    if all(min(c) * side > 0 and max(c) * side > 0 for c in cis):
        return "holds"
    if all(min(c) * side < 0 and max(c) * side < 0 for c in cis):
        return "contradicted"
    return "unresolved"


def _match(seeds, test) -> str:
    cis = [c for c in (seeds, test) if c is not None]
    if not cis:
        return "unresolved"
    if all(-MATCH_PP <= c[0] and c[1] <= MATCH_PP for c in cis):
        return "holds"
    if all(c[0] > MATCH_PP or c[1] < -MATCH_PP for c in cis):
        return "contradicted"
    return "unresolved"


def _row(claim, where, statistic, value, seeds, test, side) -> dict:
    return dict(claim=claim, where=where, paper=PAPER[claim], statistic=statistic, value=value,
                seeds=seeds, test=test, verdict=_verdict(seeds, test, side), why="")


def _untestable(claim, where, why) -> dict:
    return dict(claim=claim, where=where, paper=PAPER[claim], statistic="", value=None, seeds=None,
                test=None, verdict="not testable", why=why)


def _where(rho) -> str:
    return "" if rho is None else f"rho {rho:g}"


# ---- the report's section ------------------------------------------------------------------------

def claims_section(rows: list) -> list:
    """report.md's lines: one row per claim and budget."""
    out = ["", "## The paper's claims", "",
           f"Verdicts from this run's intervals (95 %, over paired seeds and over test prompts): "
           f"holds / contradicted when every interval is on one side of the decision, unresolved "
           f"when one spans it; \"matches\" means within ±{MATCH_PP:g} points. "
           f"reporting/claims.py defines each statistic.", "",
           "| claim | where | the paper | this run | verdict |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r["claim"], r["where"] or "—", r["paper"], _this_run(r),
                 f"**{r['verdict']}**" + (f": {r['why']}" if r["why"] else "")]
        # |BWT| inside a cell
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return out


def _this_run(r) -> str:
    if r["value"] is None:
        return "—"
    values = r["value"] if isinstance(r["value"], list) else [r["value"]]
    seeds = r["seeds"] if isinstance(r["value"], list) else [r["seeds"]]
    tests = r["test"] if isinstance(r["value"], list) else [r["test"]]
    parts = [f"{v:+.2f}" + (f" seeds [{s[0]:+.2f}, {s[1]:+.2f}]" if s else "") +
             (f" prompts [{t[0]:+.2f}, {t[1]:+.2f}]" if t else "")
             for v, s, t in zip(values, seeds, tests)
             if v is not None]
    return f"{r['statistic']}: " + "; ".join(parts)
