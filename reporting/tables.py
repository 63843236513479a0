"""The report's text: Markdown tables, printed by run.py at the end of a run, and report.md.

    format_table(results)     the main table (readable in a terminal)
    delta_table(...)          paired differences against one reference method
    diagnostics_table(...)    degenerate answers next to each accuracy matrix;
                              warning_lines(...) flags them
    mechanism_section(...)    drift, the buffer's loss bound, rollout checks
    markdown_report(results)  the whole report.md text
"""
import json
import statistics
from pathlib import Path

from reporting.claims import claims, claims_section
from reporting.diagnostics import warnings as diagnostic_warnings
from reporting.figures import FIGURES, MECHANISM_FIGURES
from reporting.numbers import (buffer_numbers, diagnostic_flags, drift_numbers, noise_numbers,
                               summarize, uncertainty)
from reporting.schema import NOISE_MIN_SEEDS, REFERENCE, acc_only
from reporting.stats import LEVEL


NOT_SHOWN = "—"  # an acc_only method's BWT, FWT, forgetting: defined by the
                 # formula, meaningless for it


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
    """A Markdown table aligned so it also reads as plain text: first column left-aligned,
    the others right."""
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]

    def line(cells):
        padded = [c.ljust(w) if k == 0 else c.rjust(w)
                  for k, (c, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" if k else "-" * (w + 2)
                          for k, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])


def format_table(results, summary=None, unc=None) -> str:
    """The main table: one row per method; ACC and BWT as mean ± sample std over seeds (the std when
    there are several), each with its 95% test-set bootstrap interval when results.json has
    per-example scores, FWT and mean forgetting, then the final score of each task (mean over
    seeds). Markdown, aligned so it also reads as text."""
    summary = summary or summarize(results)
    unc = unc or uncertainty(results, summary)
    tasks = results["tasks"]
    with_ci = unc["bootstrap"] is not None
    header = (["method", "seeds", "ACC"] + (["ACC 95% CI"] if with_ci else []) + ["BWT"] +
              (["BWT 95% CI"] if with_ci else []) + ["FWT", "forgetting"] + tasks)
    rows = []
    for m, s in summary.items():
        ci, na = unc["methods"][m], NOT_SHOWN if s["acc_only"] else "-"
        rows.append([m, str(len(s["seeds"])), _fmt(s["acc"])] +
                    ([_ci(ci["acc_test"])] if with_ci else []) +
                    [_fmt(s["bwt"], undefined=na)] +
                    ([_ci(ci["bwt_test"]) if not s["acc_only"] else na] if with_ci else []) +
                    [_fmt(s["fwt"], undefined=na), _fmt(s["forgetting_mean"], undefined=na)] +
                    [_fmt(s["final"][t], with_std=False) if t in s["final"] else "-"
                     for t in tasks])
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
    """Paired differences `method - ref` of ACC and BWT: mean over the paired seeds, the t-interval
    over seeds, the test-set bootstrap interval, and whether the difference is resolved (every
    available interval excludes 0)."""
    header = ["method", "paired seeds", "ΔACC", "CI seeds", "CI test set", "resolved", "ΔBWT",
              "CI seeds", "CI test set", "resolved"]
    rows = []
    for m, entry in unc["deltas"][ref].items():
        row = [m, str(entry["acc"]["n"]) if "acc" in entry else "0"]
        for metric in ("acc", "bwt"):
            d = entry.get(metric)
            na = NOT_SHOWN if metric == "bwt" and summary[m]["acc_only"] else "-"
            row += ([na] * 4 if d is None else
                    [f"{d['mean']:+.2f}",
                     _ci(d["seeds"], True) + ("†" if d.get("seeds_source") == "preset" else ""),
                     _ci(d["test"], True), _verdict(d)])
        rows.append(row)
    return _markdown(header, rows)


def noise_tables(tasks, nn: dict) -> list:
    """Two Markdown tables from noise_numbers: per method (and paired difference) the seed std
    of ACC and BWT, the share of their variance that is test-prompt noise and the floor no
    test-set size goes below; then each task's seed std of its final score (of its difference)
    with its share of ACC's (ΔACC's) variance. An acc_only method's BWT (and its differences')
    shows as NOT_SHOWN."""
    def part(ns, label=""):
        if ns is None:
            return [NOT_SHOWN if any(acc_only(x) for x in label.split(" − ")) else "-"] * 3
        if ns["prompt"] is None:
            return [f"{ns['std']:.2f}", "-", "-"]
        share = ns["prompt"] / ns["std"] ** 2 if ns["std"] > 0 else 0.0
        return [f"{ns['std']:.2f}", f"{share:.0%}", f"{ns['floor']:.2f}"]
    rows = [[m, str(v["acc"]["n"]), *part(v["acc"]), *part(v["bwt"], m)] for m, v in nn.items()]
    first = _markdown(["method or Δ", "seeds", "ACC std", "of it test prompts", "ACC floor",
                       "BWT std", "of it test prompts", "BWT floor"], rows)
    n_tasks = max(len(v["acc"]["task_std"]) for v in nn.values())
    rows = []
    for m, v in nn.items():
        a = v["acc"]
        cells = [f"{sd:.1f} ({sh:+.0%})" if a["share"] is not None else f"{sd:.1f}"
                 for sd, sh in zip(a["task_std"], a["share"] or [None] * len(a["task_std"]))]
        rows.append([m] + cells + ["-"] * (n_tasks - len(cells)))
    second = _markdown(["method or Δ"] + list(tasks[:n_tasks]), rows)
    return [first, "",
            "Per task: the seed std of the final score and (its share of ACC's variance); "
            "for a Δ row, of the per-seed difference of final scores "
            "(its share of ΔACC's variance):", "", second]


def matrix_table(tasks, s: dict) -> str:
    """Markdown accuracy matrix of one method (mean over seeds): row i = after stage i,
    column j = task j. With row 0 (the base model) and the next-task scores, row 0 leads and each
    row also shows task i+1 in parentheses (scored before it was trained: the FWT entries)."""
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
    """TRACE's conventions and per-task forgetting: OP (= ACC), BWT averaged over all N tasks (TRACE
    eq. 2 and the official OPR code's show_result.py: (N-1)/N of BWT), and each task's best earlier
    score minus its final one."""
    forg_tasks = tasks[:max(s["stages"] for s in summary.values()) - 1]
    lines = ["| method | OP (TRACE) | BWT (TRACE, 1/N) | " +
             " | ".join(f"forgetting {t}" for t in forg_tasks) + " |",
             "|---|---:|---:|" + "---:|" * len(forg_tasks)]
    for m, s in summary.items():
        na = NOT_SHOWN if s["acc_only"] else "-"
        cells = [_fmt(s["op"]), _fmt(s["bwt_trace"], undefined=na)] + [
            _fmt(s["forgetting"][t], with_std=False) if t in s["forgetting"] else na
            for t in forg_tasks]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def protocol_line(meta: dict) -> str:
    """The settings that decide how a number was made, in words (from results.json meta.cfg)."""
    cfg = (meta or {}).get("cfg") or {}
    parts = [f"scoring {cfg['scoring']}" if cfg.get("scoring") else None,
             (f"{cfg['eval_repeats']} sample(s) per test prompt" if cfg.get("eval_repeats")
              else None),
             f"replay budget {cfg['replay_budget']}" if cfg.get("replay_budget") else None,
             f"training subsample {cfg['max_train']} per task" if cfg.get("max_train") else None,
             (f"at most {cfg['eval_limit']} test prompts per task" if cfg.get("eval_limit")
              else None)]
    parts = [x for x in parts if x]
    return "- protocol: " + ("; ".join(parts) if parts else "not recorded")


def _diag_cell(diags: list) -> str:
    """One evaluation's answers, over the seeds that have it: the most frequent predicted label and
    its share (classification tasks; shares averaged over seeds), the off-format (not a letter
    alone), empty and length-capped shares when not 0; '!' when a seed's evaluation is flagged."""
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
    # results.json of earlier code lack it
    off = statistics.fmean(d.get("off_format", 0.0) for d in diags)
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
    """Markdown table of one method's answers (cells: _diag_cell), shaped like its accuracy matrix,
    and a line with the gold labels' majority class of each classification task; None when
    results.json has no diagnostics."""
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
        lines.append(f"| {i + 1}: {tasks[i]} | " +
                     " | ".join(cells + ["-"] * (n_stages - i - 1)) + " |")
    if gold:
        lines += ["", "Gold labels' majority class: " + ", ".join(
            f"{t} {min(d['gold_labels'].items(), key=lambda kv: (-kv[1], kv[0]))[0]!r} "
            f"{d['gold_majority_rate']:.0%}"
            for t, d in gold.items()) + "."]
    return "\n".join(lines)


def warning_lines(results) -> list:
    """One line per flagged (method, stage, task), naming the seeds and the reasons."""
    lines = []
    for m, stage, t, reasons in diagnostic_flags(results):
        why = "; ".join(f"seed {s}: {', '.join(r)}" for s, r in reasons)
        lines.append(f"WARNING {m}, after stage {stage} ({results['tasks'][stage - 1]}), "
                     f"task {t}: {why}")
    return lines


def markdown_report(results, summary=None, figures=(), unc=None) -> str:
    """report.md: the main table with notes, the paired differences, each method's accuracy matrix
    with its degenerate-answer diagnostics and warnings, and links to `figures` (file names)."""
    summary = summary or summarize(results)
    unc = unc or uncertainty(results, summary)
    tasks = results["tasks"]
    flags = warning_lines(results)
    noise = (results.get("meta") or {}).get("seed_noise")
    out = [*_header(results), *_results_section(results, summary, unc, flags, noise),
           *_paired_section(summary, unc, noise), *claims_section(claims(results, summary)),
           *_noise_section(results, summary),
           *_trace_section(tasks, summary), *_matrices_section(results, summary, flags),
           *mechanism_section(results), "", *_figures_section(figures)]
    return "\n".join(out).rstrip() + "\n"


def _header(results) -> list:
    """The title, the protocol line and the run's settings."""
    tasks = results["tasks"]
    out = ["# Continual SFT on " + ", ".join(tasks), "", protocol_line(results.get("meta"))]
    for k, v in (results.get("meta") or {}).items():
        if k == "seed_noise":  # shown where it is used (results notes, paired differences)
            continue
        out.append(f"- {k}: {v if isinstance(v, str) else json.dumps(v)}")
    return out


def _results_section(results, summary, unc, flags, noise) -> list:
    """The main table and its notes: the metrics, the seeds, the intervals, what is
    missing or flagged."""
    tasks, boot = results["tasks"], unc["bootstrap"]
    n_seeds = sorted({len(s["seeds"]) for s in summary.values()})
    out = ["", "## Results", "", format_table(results, summary, unc), "",
           "- ACC: mean final score over the tasks trained so far; BWT: mean over all but the last "
           "of them of (final score - score right after training it); negative BWT = forgetting. "
           "FWT: mean over tasks 2..N of (score before training it, after the previous stage - the "
           "base model's score); forgetting: mean over all but the last task of (best earlier "
           "score - final score). Scores are 0..100.",
           f"- Seeds per method: {', '.join(map(str, n_seeds))}; 'a ± b' = mean ± sample "
           f"standard deviation over seeds (n-1 denominator; no ± with one seed); per-task "
           f"columns are means."]
    if boot:
        out.append(f"- 95% CI: percentile bootstrap over test prompts ({boot['B']} resamples of "
                   f"each task's test examples with replacement, numpy seed {boot['seed']}; test "
                   f"examples per task: " +
                   ", ".join(f"{t} {n}" for t, n in boot["sizes"].items()) +
                   "). It covers which test prompts were drawn, with the trained checkpoints held "
                   "fixed; it does not cover training or seed noise.")
    else:
        out.append("- results.json holds no per-example scores: no test-set intervals "
                   "(re-run run.py to add them).")
    if max(n_seeds) == 1 and noise:
        out.append(f"- One seed: its spread over seeds is not measured by this run, but it was for "
                   f"this preset with these settings ({noise['seeds']} seeds, "
                   f"{noise['measured']}). Sample std over those seeds, ACC / BWT: " +
                   "; ".join(f"{m} {v['acc']:.2f} / {v['bwt']:.2f}"
                             for m, v in noise["std"].items() if m in summary) +
                   ". Another seed (or another thread count or CPU model) moves a one-seed number "
                   "by about that much; the test-set bootstrap covers only a small part of it.")
    elif max(n_seeds) == 1:
        out.append("- One seed: the spread over seeds (training order, replay draws, sampling) is "
                   "not measured; the only uncertainty shown is the test-set bootstrap.")
    shown_acc_only = [m for m, s in summary.items() if s["acc_only"]]
    if shown_acc_only:
        out.append(f"- {', '.join(shown_acc_only)}: ACC only ({NOT_SHOWN} for BWT, FWT and "
                   f"forgetting here and below). Row i of its matrix is a separate joint run from "
                   f"the base on tasks 1..i, so differences between rows compare different runs, "
                   f"not one model before and after a stage; its last row is the multi-task "
                   f"reference for ACC.")
    partial = [m for m, s in summary.items() if s["stages"] < len(tasks)]
    if partial:
        out.append(f"- Not all {len(tasks)} stages finished for: " +
                   ", ".join(f"{m} ({summary[m]['stages']})" for m in partial) +
                   "; their ACC/BWT cover those stages.")
    if REFERENCE not in summary:
        out.append(f"- No '{REFERENCE}' method, so no per-task comparison against it.")
    if flags:
        out.append(f"- {len(flags)} evaluation(s) flagged for degenerate answers (collapse to one "
                   f"label, off-format answers, empty or length-capped responses): "
                   f"see 'Accuracy matrices and answers' below.")

    return out


def _paired_section(summary, unc, noise) -> list:
    """Each reference's paired-difference table, and how its intervals are made."""
    refs = [ref for ref, deltas in unc["deltas"].items() if deltas]
    uses_preset_sigma = any(d.get("seeds_source") == "preset" for ref in refs
                            for entry in unc["deltas"][ref].values() for d in entry.values())
    out = []
    for ref in refs:
        out += ["", f"## Paired differences vs {ref}", "", delta_table(summary, unc, ref)]
    if refs:
        out += ["", f"- Δ = method - reference ({', '.join(refs)}), computed per seed "
                f"(same seed = same data order, the same stage-1 checkpoint and the same test "
                f"prompts) and averaged over the paired seeds.",
                f"- CI seeds: {LEVEL:.0%} t-interval of the per-seed differences "
                f"(df = paired seeds - 1; needs >= 2 seeds). Covers seed-to-seed noise (training "
                f"order, replay draws, rollout and evaluation sampling) on the fixed test prompts.",
                f"- CI test set: {LEVEL:.0%} paired percentile bootstrap over test prompts (the "
                f"same resampled prompts for both methods). Covers which test prompts were drawn, "
                f"with the checkpoints fixed.",
                *([f"- † one seed: CI seeds is Δ ∓ t({noise['seeds'] - 1}) × σ, with σ the "
                   f"per-seed std of this difference measured over {noise['seeds']} seeds of this "
                   f"preset with these settings ({noise['measured']}). It holds as far as this "
                   f"run's seed noise is the preset's; a seed that was one of those "
                   f"{noise['seeds']} (the default's seed 0 is) is not independent of σ, which the "
                   f"interval ignores."] if uses_preset_sigma else []),
                "- resolved: every available interval excludes 0. 'test set only' = one seed, so "
                "seed noise, often the larger, is not covered: a difference resolved only on the "
                "test set can still be noise. Each interval is for one comparison (no "
                "multiple-comparison correction): among many rows, about 1 in 20 pure-noise "
                "intervals excludes 0."]

    return out


def _noise_section(results, summary) -> list:
    """Where the seed noise of ACC and BWT comes from (methods with enough seeds)."""
    tasks = results["tasks"]
    nn = noise_numbers(results, summary)
    if not nn:
        return []
    out = ["", "## Where the seed noise comes from", "", *noise_tables(tasks, nn), "",
           "- std: sample std over seeds (as in the main table). 'of it test prompts': the share "
           "of its variance that is each test prompt's own seed-to-seed variation (evaluation "
           "sampling, which prompts a seed happens to get right); k times as many test prompts "
           "would divide that part by k. The rest is whole-task movement (one seed learned or kept "
           "a task better than another) that more test prompts do not remove. floor: the std with "
           "that part gone, i.e. with unlimited test prompts.",
           "- Per-task shares sum to 100% over the tasks; a negative share is a task moving "
           f"against the others. Estimated from the seeds at hand (methods with >= "
           f"{NOISE_MIN_SEEDS} seeds): with few seeds these are rough.",
           "- Δ rows: the same for the per-seed paired difference (method − reference). Its seed "
           "std sets the width of the seed interval in 'Paired differences' "
           "(half-width = t × std / √seeds); its floor is what that std stays at however many "
           "test prompts there are."]
    return out


def _trace_section(tasks, summary) -> list:
    """TRACE's conventions (OP, BWT over N) and per-task forgetting."""
    out = ["", "## TRACE's conventions and per-task forgetting", "",
           transfer_table(tasks, summary), "",
           "- OP = ACC. BWT (TRACE, 1/N) sums the same differences as BWT but divides by all N "
           "tasks, the last one's zero term included (TRACE's eq. 2, the official OPR code's "
           "tools/show_result.py): (N-1)/N of BWT. Compare numbers printed by the official code "
           "with it; the OPR paper's Table 1 BWT is the 1/(N-1) form (its appendix matrices give "
           "it), i.e. the main table's BWT. Forgetting per task: best earlier score minus final "
           "score."]
    return out


def _matrices_section(results, summary, flags) -> list:
    """Each method's mean accuracy matrix with its answer diagnostics, warnings and
    the flags' rules."""
    tasks = results["tasks"]
    out = ["", "## Accuracy matrices and answers (mean over seeds)", ""]
    for m, s in summary.items():
        out += [f"### {m}", "", matrix_table(tasks, s), ""]
        diag = diagnostics_table(tasks, results["methods"][m], s["stages"])
        if diag:
            out += ["Answers: most frequent predicted label and its share (classification tasks: "
                    "the first character of the answer, the one the lenient and paper rules "
                    "compare), share of off-format answers (not a letter alone), of empty and of "
                    "length-capped responses when not 0; '!' = flagged.", "", diag, ""]
        out += [f"- {line}" for line in flags if line.startswith(f"WARNING {m}, ")]
        if any(line.startswith(f"WARNING {m}, ") for line in flags):
            out.append("")
    if any(r.get("diagnostics") for e in results["methods"].values() for r in e["seeds"].values()):
        from reporting.diagnostics import COLLAPSE_RATE, EMPTY_WARN, LENGTH_WARN, OFF_FORMAT_WARN
        out += [f"Flags: a classification task's predictions collapsed = one label, answered as a "
                f"letter alone, is >= {COLLAPSE_RATE:.0%} of all answers while that label is < "
                f"{COLLAPSE_RATE:.0%} of the gold answers; off-format >= {OFF_FORMAT_WARN:.0%} "
                f"(non-empty answers such as 'Anna sah ...', 'A bill ...' or 'A5' instead of a "
                f"letter, unless the task's gold answers are themselves a letter and a sentence: a "
                f"first-character rule reads them as the letter they start with, and the warning "
                f"says how much of the score that is, and how much chance would give: the hits "
                f"expected if those answers' first characters were unrelated to their gold "
                f"labels); empty >= {EMPTY_WARN:.0%}; length-capped (stopped at max-new-tokens) >= "
                f"{LENGTH_WARN:.0%}.", ""]
    return out


def _figures_section(figures) -> list:
    """Links to the figures, each with what it shows."""
    out = ["## Figures", ""] if figures else []
    for f in figures:
        out += [f"![{Path(f).stem}]({f})", "", f"*{({**FIGURES, **MECHANISM_FIGURES})[f]}*", ""]
    return out


# --------------------------------------------------------------------------------------------------
# The paper's mechanism


def drift_table(tasks, dn: dict) -> str:
    stages = sorted({s for v in dn["per_stage"].values() for s in v})
    header = ["method", *[f"{s}: {tasks[s - 1]}" for s in stages]]
    rows = [[m, *[f"{v[s]['seq_kl']:.3g} ({v[s]['kl_per_token']:.2g})" if s in v else "-"
                  for s in stages]]
            for m, v in dn["per_stage"].items()]
    return _markdown(header, rows)


def buffer_table(bn: dict) -> str:
    f = lambda x, p=3: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    return _markdown(["method", "buffer", "buffers", "l mean", "l_max", "mean max-token NLL",
                      "rejected l mean", "Spearman(RU, SC)"],
                     [[m, b["scorer"], str(b["buffers"]), f(b["nll_mean"]), f(b["nll_max"]),
                       f(b["token_nll_max"]), f(b["rejected_nll_mean"]), f(b["spearman_ru_sc"], 2)]
                      for m, b in bn.items()])


def rollout_check_lines(results) -> list:
    """One line per method whose rollouts were checked against the trainer's forward pass."""
    out = []
    for m, entry in results["methods"].items():
        checks = [c for run in entry["seeds"].values()
                  for c in run.get("rollout_checks") or [] if c.get("k")]
        if checks:
            warned = sum(bool(c["warned"]) for c in checks)
            out.append(f"{m}: {len(checks)} rollout sets, mean |Δ log p| per token up to "
                       f"{max(c['mean_abs_dlogp'] for c in checks):.2g}, max single token "
                       f"{max(c['max_abs_dlogp'] for c in checks):.2g} nats, k3 KL up to "
                       f"{max(c['k3_kl'] for c in checks):.2g}" +
                       (f"; WARNED {warned} times" if warned else ""))
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
        out += ["Per-update KL(π_i ‖ π_i−1) on held-out prompts of tasks 1..i−1, after stage i "
                "(column: stage and the task it trains): mean over prompts of the summed per-token "
                "KL of a response sampled from π_i (nats per response), KL per token in "
                "parentheses; mean over seeds (drift.py).", "",
                drift_table(results["tasks"], dn), "",
                f"- Forgetting vs drift: {len(dn['points'])} points (method, seed, stage i, prior "
                f"task j) of a(i, j) − a(i−1, j) against the KL on task j's prompts; "
                f"Pearson r = {fmt(dn['pearson'])}, Spearman ρ = {fmt(dn['spearman'])}. The "
                f"paper's bound predicts larger drift, larger drops (a negative correlation); a "
                f"correlation over few points of a small test set is weak evidence either way."]
    if bn:
        out += ["", "Each replay buffer's per-token NLL l under the checkpoint that built it "
                "(paper Eq. 3: OPR keeps l <= l_max small; gold and low-score buffers need not): "
                "mean over buffers (stages and seeds) of the selected examples' mean l; l_max = "
                "the largest over all of them; the rejected rollouts' mean l; the rank correlation "
                "of task score (RU) and mean log-prob (SC) over all rollouts (the paper's "
                "assumption that correct answers are likely ones).", "", buffer_table(bn)]
    if checks:
        out += ["", "Rollout log-probs, engine vs the trainer's forward pass "
                "(rollout.py --check-logprobs):", ""]
        out += [f"- {line}" for line in checks]
    return out


