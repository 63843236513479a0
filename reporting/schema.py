"""results.json, the file every report is made from: its shape, and the check that a file has it.

results.json (written by run.py's collect; JSON):

    {"tasks": ["C-STANCE", "FOMC", ...],    # stage order
     "methods": {label: {"seeds": {seed: run}}},
                                            # label: a method, or "method@rho" in a rho sweep;
                                            # seed: the seed as a string ("0", "1", ...)
     "test_idx": {task: [idx, ...]},        # optional: the test examples evaluated, in the order
                                            # of every "example_scores" list (record numbers)
     "claims": [...],                       # optional: reporting/claims.py's verdicts (run.py
                                            # writes them; the report recomputes them)
     "meta": {...}}                         # settings, printed as-is at the top of the report;
                                            # optional "seed_noise": {"seeds": n, "measured": where,
                                            # "std": {m: {"acc", "bwt"}}, "delta_std": {ref: {m:
                                            # {"acc", "bwt"}}}}: the run's preset's seed noise

    run = {"matrix": [[a00], [a10, a11], ...],
                                            # matrix[i][j]: score (0..100) of task j after stage i,
                                            # j <= i (ragged rows)
           "row0": [a(0, j) for every task],
                                            # optional: the base model before stage 1
           "next_task": [a(i, i+1) for i < N-1],
                                            # optional: task i+1 after stage i, before training it
           "cl_metrics": {...},             # optional: data.metrics.cl_metrics (recomputed here)
           "loss_curves": [[loss per step of stage 0], ...],  # optional
           "example_scores": [[[s, ...]], [[...], [...]], ...],
                                            # optional, ragged like matrix: per test example
                                            # (order of test_idx) its score averaged over eval
                                            # repeats; the mean of a list is the matrix entry
                                            # (to EXAMPLE_MEAN_TOL, checked)
           "diagnostics": [{task: diag}, ...],
                                            # optional, per stage: reporting.diagnostics.diagnose of
                                            # that evaluation's predictions (label distribution,
                                            # collapse flag, off-format answers, empty /
                                            # length-capped rates)
           # optional, run.py's mechanism probes (drift.py, score.py / buffer_nll.py, rollout.py,
           # train.py):
           "drift": [{"stage": i, "tasks": {task: {"n", "mean_seq_kl", "median_seq_kl",
                      "kl_per_token", "mean_tokens", "gold_nll_cur", "gold_nll_ref"}},
                      "all": {same}}],      # stages i >= 2: KL of
                                            # stage i vs i-1 on the test prompts of tasks 1..i-1
           "buffer_stats": [{"stage": i, "scorer", "select", "spearman_ru_sc", "tasks": {...},
                             "all": {"selected": {"n", "nll_mean", "nll_max", "token_nll_max"},
                             "rejected": {same} or null}}],
                                            # the buffer built after stage i: per-token NLL under
                                            # the checkpoint that built it
           "rollout_checks": [{"stage": i, "k", "tokens", "mean_abs_dlogp", "max_abs_dlogp",
                               "k3_kl", "warned"}],
           "loss_sources": [{"task": [per step], "replay": [per step]} or null per stage]}

Methods that are acc_only (mtl: Method.acc_only) show their ACC, OP and accuracy matrix only: each
row of their matrix is a separate joint run from the base, so BWT, FWT and forgetting, which compare
rows, measure nothing. summarize() leaves those fields undefined for them (results.json keeps its
cl_metrics unchanged); the tables print "—" there, and the BWT and forgetting figures, the paired
ΔBWT and the forgetting-vs-drift points leave them out.
"""
import math
import statistics

REFERENCE = "replay"              # the baseline of the "delta vs replay" figure
REFERENCES = ("replay", "sft")    # paired-difference tables, in this order, for
                                  # those present in the run
NOISE_MIN_SEEDS = 3               # "where the seed noise comes from" for methods with at
                                  # least this many seeds
EXAMPLE_MEAN_TOL = 1e-3           # per-example scores must average to their matrix entry (run.py
                                  # rounds them to 1e-4)


def acc_only(label: str) -> bool:
    """True for a method (label "method" or "method@rho") whose BWT, FWT and forgetting mean
    nothing: the method says so (methods/: Method.acc_only, mtl's)."""
    from methods import METHODS  # (imports torch: only when a report is made)
    method = METHODS.get(label.split("@")[0])
    return method is not None and method.acc_only


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_results(results) -> None:
    """Raise ValueError naming the offending path (e.g.
    results['methods']['opr']['seeds']['0']['matrix'][2])."""
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
    # examples per task: every example_scores list must agree
    sizes = {t: len(v) for t, v in test_idx.items()}
    for m, entry in methods.items():
        seeds = entry.get("seeds") if isinstance(entry, dict) else None
        if not isinstance(seeds, dict) or not seeds:
            raise ValueError(f"results['methods'][{m!r}]['seeds']: expected a non-empty dict "
                             f"{{seed: run}}")
        n_stages = set()
        for s, run in seeds.items():
            n_stages.add(_check_run(f"results['methods'][{m!r}]['seeds'][{s!r}]",
                                    run, tasks, sizes))
        if len(n_stages) > 1:
            raise ValueError(f"results['methods'][{m!r}]: seeds have different numbers of stages "
                             f"{sorted(n_stages)}")


def _check_run(where: str, run, tasks: list, sizes: dict) -> int:
    """check_results for one seed's run at `where`: its matrix, optional fields and per-example
    scores (sizes: task -> examples seen so far, filled in). Returns its number of stages."""
    matrix = run.get("matrix") if isinstance(run, dict) else None
    if not isinstance(matrix, list) or not matrix:
        raise ValueError(f"{where}['matrix']: expected a non-empty list of rows")
    if len(matrix) > len(tasks):
        raise ValueError(f"{where}['matrix']: {len(matrix)} stages but only {len(tasks)} tasks")
    for i, row in enumerate(matrix):
        if (not isinstance(row, list) or len(row) < i + 1
                or not all(_is_number(v) for v in row[:i + 1])):
            raise ValueError(f"{where}['matrix'][{i}]: expected at least {i + 1} finite numbers, "
                             f"got {row!r}")
    # next_task: a(i, i+1) after every finished stage that has a next task (run.py
    # writes exactly these)
    for key, want in (("row0", len(tasks)), ("next_task", min(len(matrix), len(tasks) - 1))):
        vals = run.get(key)
        if vals is not None and (not isinstance(vals, list) or len(vals) < want or
                                 not all(_is_number(v) for v in vals)):
            raise ValueError(f"{where}[{key!r}]: expected at least {want} finite numbers, got "
                             f"{vals!r}")
    # optional lists
    for key in ("loss_curves", "drift", "buffer_stats", "rollout_checks", "loss_sources"):
        if not isinstance(run.get(key) or [], list):
            raise ValueError(f"{where}[{key!r}]: expected a list, got {type(run[key]).__name__}")
    for i, curve in enumerate(run.get("loss_curves") or []):
        if not isinstance(curve, list) or not all(_is_number(v) for v in curve):
            raise ValueError(f"{where}['loss_curves'][{i}]: expected a list of finite numbers")
    _check_example_scores(where, run.get("example_scores"), matrix, tasks, sizes)
    diags = run.get("diagnostics")
    if diags is not None and (not isinstance(diags, list) or len(diags) != len(matrix)
                              or not all(isinstance(d, dict) for d in diags)):
        raise ValueError(f"{where}['diagnostics']: expected one dict "
                         f"{{task: diagnostics}} per stage")
    return len(matrix)


def _check_example_scores(where: str, examples, matrix: list, tasks: list, sizes: dict) -> None:
    """A run's optional "example_scores": ragged like the matrix, each cell a non-empty list of
    finite numbers of one size per task (sizes, filled in) whose mean is the matrix entry (to
    EXAMPLE_MEAN_TOL)."""
    if examples is None:
        return
    if not isinstance(examples, list) or len(examples) != len(matrix):
        raise ValueError(f"{where}['example_scores']: expected one row per stage ({len(matrix)})")
    for i, row in enumerate(examples):
        if not isinstance(row, list) or len(row) < i + 1:
            raise ValueError(f"{where}['example_scores'][{i}]: expected at least {i + 1} lists")
        for j in range(i + 1):
            cell = row[j]
            if not isinstance(cell, list) or not cell or not all(_is_number(v) for v in cell):
                raise ValueError(f"{where}['example_scores'][{i}][{j}]: expected a non-empty "
                                 f"list of finite numbers")
            if sizes.setdefault(tasks[j], len(cell)) != len(cell):
                raise ValueError(f"{where}['example_scores'][{i}][{j}]: {len(cell)} examples of "
                                 f"{tasks[j]}, elsewhere {sizes[tasks[j]]}")
            mean = statistics.fmean(cell)
            if abs(mean - matrix[i][j]) > EXAMPLE_MEAN_TOL:
                raise ValueError(f"{where}['example_scores'][{i}][{j}]: the examples' mean "
                                 f"{mean:.4f} is not matrix[{i}][{j}] = {matrix[i][j]:.4f}")
