"""A report's numbers, from results.json alone (reporting/schema.py).

The numbers and the functions that compute them:

    summarize(results)        numbers: mean/std over seeds of ACC, BWT, FWT, forgetting, TRACE's OP
                              and 1/N BWT and the final per-task scores; the mean matrix with row 0
                              and next-task scores
    uncertainty(results)      95% intervals: per method (test-set bootstrap) and paired differences
                              vs REFERENCES per seed (t-interval over seeds, test-set bootstrap),
                              with a "resolved" verdict
    noise_numbers(results)    where the seed spread of ACC and BWT comes from: each task's share,
                              and the part more test prompts would remove
                              (reporting.stats.noise_sources); noise_tables(...) shows it
    drift_numbers(results)    per-update drift against forgetting (drift.py's probes)
    buffer_numbers(results)   the replay buffer's per-token NLL, selected against rejected

ACC and BWT come from data.metrics.acc_bwt, FWT / per-task forgetting / TRACE's OP and 1/N BWT from
data.metrics.cl_metrics (FWT needs row0 and next_task), once per seed; statistics and intervals come
from reporting.stats (its docstring says which noise each interval covers). "std" is the sample std
over seeds (n-1). A method may have fewer stages than there are tasks (a run in progress): its
ACC/BWT then cover the stages it has, and the tasks it has not reached show as "-".
"""
import statistics

import numpy as np

from data.metrics import acc_bwt, cl_metrics
from reporting.diagnostics import warnings as diagnostic_warnings
from reporting.stats import (BOOTSTRAP_B, BOOTSTRAP_SEED, bootstrap_acc_bwt, bootstrap_indices,
                             excludes_zero, known_std_interval, mean_std, noise_sources,
                             paired_differences, pearson, percentile_interval, spearman, t_interval)
from reporting.schema import NOISE_MIN_SEEDS, REFERENCES, acc_only, check_results


def summarize(results) -> dict:
    """Per method, in the order of results['methods']:

    {"seeds": [seed, ...], "stages": n,            # n = stages trained (rows of the matrix)
     "acc": {"mean", "std", "n"}, "bwt": {"mean", "std", "n"},
                                                   # std: sample std over seeds, None with one seed;
                                                   # bwt mean/std None when n == 1
     "per_seed": {seed: {"acc", "bwt"}},           # bwt None for an acc_only method
     "acc_only": bool,  # acc_only: bwt, fwt, forgetting(_mean), bwt_trace undefined
     "final": {task: {"mean", "std", "n"}},        # last row, for the n tasks trained so far
     "matrix": [[mean]] and "matrix_std": [[std]],
                                                   # ragged like the input (row i has i+1 entries)
     "fwt", "forgetting_mean", "op", "bwt_trace": {"mean", "std", "n"},
                                                   # mean None where undefined (FWT: no row 0)
     "forgetting": {task: {"mean", "std", "n"}},   # the first n-1 tasks
     "row0": [mean] or None, "next_task": [mean] or None}
    """
    check_results(results)
    tasks, out = results["tasks"], {}
    for m, entry in results["methods"].items():
        seeds = list(entry["seeds"])
        matrices = [[row[:i + 1] for i, row in enumerate(entry["seeds"][s]["matrix"])]
                    for s in seeds]
        n = len(matrices[0])
        per_seed = {s: dict(zip(("acc", "bwt"), acc_bwt(mx))) for s, mx in zip(seeds, matrices)}
        cells = [[mean_std([mx[i][j] for mx in matrices]) for j in range(i + 1)] for i in range(n)]
        runs = [entry["seeds"][s] for s in seeds]
        with_row0 = all(r.get("row0") is not None and r.get("next_task") is not None for r in runs)
        cls = [cl_metrics(mx, r["row0"][:n] if with_row0 else None,
                          r["next_task"][:n - 1] if with_row0 else None)
               for mx, r in zip(matrices, runs)]

        def over_seeds(key):
            vals = [c[key] for c in cls]
            return (mean_std(vals) if all(v is not None for v in vals)
                    else {"mean": None, "std": None, "n": len(vals)})
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
            "forgetting": {tasks[j]: mean_std([c["forgetting"][j] for c in cls])
                           for j in range(n - 1)},
            "row0": [statistics.fmean(r["row0"][j] for r in runs) for j in range(len(tasks))]
            if with_row0 else None,
            "next_task": [statistics.fmean(r["next_task"][i] for r in runs)
                          for i in range(min(n, len(tasks) - 1))]
            if with_row0 else None,
            "acc_only": acc_only(m),
        }
        # each row its own joint run from the base: nothing that compares rows is defined
        if acc_only(m):
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
    """95% intervals for every method and every paired difference
    (reporting.stats says which noise each covers):

    {"bootstrap": {"B", "seed", "sizes": {task: n}} or None,
                                              # None: results.json has no per-example scores
     "methods": {m: {"acc_test": (lo, hi) | None, "bwt_test": (lo, hi) | None}},
     "deltas": {ref: {m: {"acc": D, "bwt": D}}}}
                                              # ref in REFERENCES present in the run, m != ref with
                                              # as many stages as ref
    D = {"per_seed": {seed: m - ref}, "n": paired seeds, "mean": mean of per_seed,
         "seeds": t-interval over the paired seeds; with one paired seed, the interval from the
         per-seed std of this difference measured for the run's preset (meta "seed_noise", written
         by run.py when the run used the preset's settings unchanged), else None;
         "seeds_source": "run", "preset" or None,
         "test": bootstrap interval of the seed-averaged difference, the same resampled test
         prompts for m and ref (None without per-example scores), "resolved": True when every
         available interval excludes 0}
    """
    summary = summary or summarize(results)
    boot, per_seed = _bootstrap(results, B, seed)

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
                if metric == "bwt" and (s["stages"] < 2 or s["acc_only"]
                                        or summary[ref]["acc_only"]):
                    continue
                delta = _paired_delta(summary, m, ref, metric, per_seed, noise)
                if delta is not None:
                    entry[metric] = delta
            out["deltas"][ref][m] = entry
    return out


def _bootstrap(results, B: int, seed: int) -> tuple:
    """uncertainty's test-set bootstrap: ({"B", "seed", "sizes": {task: n}}, {method: {seed: ACC/BWT
    of every resample}}), or (None, None) when some run has no per-example scores."""
    tasks, methods = results["tasks"], results["methods"]
    if not all(run.get("example_scores") is not None
               for e in methods.values() for run in e["seeds"].values()):
        return None, None
    sizes = {}
    for e in methods.values():
        for run in e["seeds"].values():
            for i, row in enumerate(run["example_scores"]):
                for j in range(i + 1):
                    sizes.setdefault(tasks[j], len(row[j]))
    sizes = {t: sizes[t] for t in tasks if t in sizes}
    idx = bootstrap_indices(sizes, B, seed)
    # per method and seed: ACC/BWT of every resample ([B] arrays), all methods on the
    # same resampled prompts
    per_seed = {m: {s: bootstrap_acc_bwt([[row[:i + 1]
                                           for i, row in enumerate(run["example_scores"])]],
                                         tasks, idx)
                    for s, run in e["seeds"].items()} for m, e in methods.items()}
    return {"B": B, "seed": seed, "sizes": sizes}, per_seed


def _paired_delta(summary: dict, m: str, ref: str, metric: str, per_seed, noise: dict):
    """uncertainty's D for `metric` of m - ref, or None when they share no seed.
    per_seed: _bootstrap's resamples (None: no test interval); noise: the run's meta
    "seed_noise" ({} without)."""
    d = paired_differences({k: v[metric] for k, v in summary[m]["per_seed"].items()},
                           {k: v[metric] for k, v in summary[ref]["per_seed"].items()})
    if not d:
        return None
    test = None
    if per_seed is not None:
        test = percentile_interval(_seed_mean(
            [per_seed[m][k][metric] - per_seed[ref][k][metric] for k in d]))
    seeds_ci, source = t_interval(d.values()), "run"
    sigma = ((noise.get("delta_std") or {}).get(ref) or {}).get(m, {}).get(metric)
    if seeds_ci is None and sigma is not None:  # one seed: the preset's measured seed noise
        seeds_ci, source = known_std_interval(d.values(), sigma, noise["seeds"]), "preset"
    available = [ci for ci in (seeds_ci, test) if ci is not None]
    return {"per_seed": d, "n": len(d), "mean": statistics.fmean(d.values()), "seeds": seeds_ci,
            "seeds_source": source if seeds_ci else None, "test": test,
            "resolved": bool(available) and all(map(excludes_zero, available))}


def _noise_parts(run: dict, n: int) -> dict:
    """One seed's inputs to noise_sources: {"acc": (final row [n], its per-example arrays or None),
    "bwt": (final minus own-stage score of tasks 1..n-1, the same per example or None)}."""
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
    """noise_sources of ACC and BWT (None with one stage or without with_bwt) from one _noise_parts
    entry per seed; the test-prompt part only when every seed has per-example scores."""
    out = {}
    for key in ("acc", "bwt"):
        values, examples = [p[key][0] for p in parts], [p[key][1] for p in parts]
        out[key] = None if key == "bwt" and (n < 2 or not with_bwt) else noise_sources(
            values, None if any(x is None for x in examples) else examples)
    return out


def noise_numbers(results, summary=None) -> dict:
    """Where the seed spread of ACC and BWT comes from (reporting.stats.noise_sources):
    {label: {"acc": ..., "bwt": ... or None}}. One label per method with >= NOISE_MIN_SEEDS seeds,
    then "m − ref" for each paired difference against REFERENCES with as many paired seeds and
    stages (the spread that sets the width of its seed interval). ACC from the final row, BWT from
    final minus own-stage score of every task but the last, each with its per-example scores when
    every seed has them (then the test-prompt part and the floor are known)."""
    summary = summary or summarize(results)
    parts = {m: {k: _noise_parts(results["methods"][m]["seeds"][k], s["stages"])
                 for k in s["seeds"]}
             for m, s in summary.items()}
    out = {m: _noise_of(list(parts[m].values()), s["stages"], not s["acc_only"])
           for m, s in summary.items() if len(s["seeds"]) >= NOISE_MIN_SEEDS}
    for ref in [r for r in REFERENCES if r in summary]:
        for m, s in summary.items():
            paired = [k for k in s["seeds"] if k in parts[ref]]
            if (m == ref or s["stages"] != summary[ref]["stages"] or len(paired) < NOISE_MIN_SEEDS
                    or f"{ref} − {m}" in out):  # the same spread as its mirror
                continue
            out[f"{m} − {ref}"] = _noise_of(
                [_noise_minus(parts[m][k], parts[ref][k]) for k in paired], s["stages"],
                not (s["acc_only"] or summary[ref]["acc_only"]))
    return out


def diagnostic_flags(results) -> list:
    """[(method, stage (1-based), task, [(seed, [reason, ...]), ...])] for every flagged
    evaluation, in run order."""
    tasks, out = results["tasks"], []
    for m, entry in results["methods"].items():
        flags = {}
        for s, run in entry["seeds"].items():
            for i, stage in enumerate(run.get("diagnostics") or []):
                for t in tasks:
                    reasons = diagnostic_warnings(stage[t]) if t in stage else []
                    if reasons:
                        flags.setdefault((i + 1, t), []).append((s, reasons))
        for (stage, t), reasons in sorted(flags.items(),
                                          key=lambda kv: (kv[0][0], tasks.index(kv[0][1]))):
            out.append((m, stage, t, reasons))
    return out


# --------------------------------------------------------------------------------------------------
# The paper's mechanism: per-update drift, the replay buffer's loss bound (run.py's probes)


def drift_numbers(results) -> dict:
    """From the runs' "drift" entries: per method and stage the seed-mean of the mean
    sequence KL and of the KL per token over the prior tasks' prompts, the (KL on task j,
    a(i, j) - a(i-1, j)) points of every seed, stage i >= 2 and prior task j (not of acc_only
    methods, whose rows are separate runs), and their Pearson and Spearman correlations.
    Empty when no run has drift entries."""
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
                        points.append({"method": m, "stage": d["stage"], "task": t,
                                       "kl": d["tasks"][t]["mean_seq_kl"],
                                       "forgetting": run["matrix"][i][j] - run["matrix"][i - 1][j]})
        if by_stage:
            per_stage[m] = {s: {"seq_kl": statistics.fmean(a["mean_seq_kl"] for a in v),
                                "kl_per_token": statistics.fmean(a["kl_per_token"] for a in v),
                                "n_seeds": len(v)}
                            for s, v in sorted(by_stage.items())}
    xs, ys = [p["kl"] for p in points], [p["forgetting"] for p in points]
    return {"per_stage": per_stage, "points": points,
            "pearson": pearson(xs, ys) if len(points) > 2 else None,
            "spearman": spearman(xs, ys) if len(points) > 2 else None}


def buffer_numbers(results) -> dict:
    """Per method: the seed- and stage-mean of each buffer's l (per-token NLL under the
    checkpoint that built it: selected mean, selected max = l_max, rejected mean) and of the
    RU/SC Spearman correlation."""
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
                  "nll_mean": avg(s["nll_mean"] for s in sel),
                  "nll_max": max((s["nll_max"] for s in sel if s["nll_max"] is not None),
                                 default=None),
                  "token_nll_max": avg(s["token_nll_max"] for s in sel),
                  "rejected_nll_mean": avg(r["nll_mean"] for r in rej) if rej else None,
                  "spearman_ru_sc": avg(b.get("spearman_ru_sc") for b in stats)}
    return out


