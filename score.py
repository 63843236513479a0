"""On-Policy Replay, step 2: score the rollouts, keep the best b of them as the next
stage's replay buffer.

    python score.py --rollouts runs/stage2/rollouts.jsonl --data /path/to/TRACE --scorer ru \
                    --budget 50 --out runs/stage2/buffer.jsonl

  1. read the rollouts written by rollout.py (one per historical training prompt)
  2. score each one; with --max-len and --tokenizer, a rollout whose chat-templated prompt +
     response is longer than --max-len tokens is no candidate (train.py would drop it, leaving the
     buffer short of b): counted as over-long
       ru (OPR-RU): the task's own metric (data.conventions.score, 0..100) of the response against
                    the gold answer of the same training record (looked up by task + idx in
                    <data>/<task>/train.json), under --scoring: lenient (default), paper (the
                    official code's generate_opr_ru.py rules) or trace (TRACE's)
       sc (OPR-SC): self-confidence = mean raw log-prob of the sampled tokens
     An empty (all-whitespace) response gets the lowest score: 0 for ru (the metric's minimum;
     TRACE's metrics score empty predictions 0 too; under --scoring paper/trace the metric alone
     decides, as in those sources), -inf for sc
  3. budget b = --budget, or round(rho * n) with --rho/--n (0.01 * 5000 = 50); split equally over
     the prior tasks, remainder to the earliest tasks (in --tasks' order when given, else in the
     order of first appearance in the rollout file), each capped by its rollouts, shortfall moved
     to the others (data.replay.allocate). --task-budgets T=K,... instead gives each task its own
     count (run.py --replay-budget per-task: rho times that task's own training-set size), capped by
     its rollouts, no shortfall moved
  4. per task keep the b_task highest-scoring rollouts (ties broken by a shuffle seeded
     with --seed and the task); --select low / random pick the lowest / a seeded random
     sample instead (ablations)
  5. the buffer's loss bound (paper Eq. 3): per task, the per-token NLL l = -mean(logprobs) of each
     rollout under the checkpoint that produced it (= -SC score; the sampled end-of-turn token
     counts, as training's loss does), its mean and max (l_max) over the selected and over the
     rejected rollouts, and the Spearman rank correlation of the RU and SC scores (the paper's
     assumption that task-correct rollouts are high-likelihood; RU needs the gold answers, so with
     --scorer sc it is computed only when --data is given)
  6. write the buffer as SFT examples {"prompt", "response"} (what train.py reads), and the numbers
     of step 5 as <buffer stem>_stats.json

The files' fields, the printed summary, bad rollouts: README, "score.py — the replay buffer".
"""
import argparse
import math
import statistics
from pathlib import Path

from common.cli import Parser, float_in, int_at_least, main_cli
from common.errors import InputError
from data.manifest import add_task_spec, use_manifest_from_argv
from data.tasks import task_names

# ---- defaults: the paper's replay setup (each has a flag below) ----------------------------------
SCORER = "ru"      # ru = task metric against gold, sc = mean log-prob
RHO = 0.01         # buffer ratio: b = rho * n_next
N_NEXT = 5000      # size of the next stage's training set
SELECT = "top"     # keep the highest-scoring rollouts
SCORING = "lenient"  # ru's metric convention: lenient | paper (official OPR code) | trace
                     # (TRACE's metrics.py)
SEED = 0           # tie-breaking / random selection
# --------------------------------------------------------------------------------------------------

ROLLOUT_FIELDS = ("task", "idx", "prompt", "response", "logprobs")


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rollouts", required=True, help="rollout JSONL written by rollout.py")
    p.add_argument("--data", default=None,
                   help="TRACE root with <Task>/train.json, for the gold answers of --scorer ru "
                        "(default: the embedded benchmark, as in rollout.py)")
    p.add_argument("--scorer", default=SCORER, choices=["ru", "sc"],
                   help="ru = task metric against the gold answer, sc = mean raw log-prob")
    p.add_argument("--scoring", default=SCORING, choices=["lenient", "paper", "trace"],
                   help="metric convention for ru: lenient reads the meant answer; paper = the "
                        "official OPR code's rules; trace = TRACE's metrics.py (see "
                        "data/metrics.py)")
    p.add_argument("--budget", type=int_at_least(0), default=None,
                   help="total buffer size b (overrides --rho/--n)")
    p.add_argument("--task-budgets", default=None,
                   help="per-task counts 'TASK=K,TASK=K' instead of one split budget (each capped "
                        "by its rollouts)")
    p.add_argument("--rho", type=float_in(0, 1, lo_open=True), default=None,
                   help=f"buffer ratio in (0, 1] (default {RHO}); b = rho * n")
    p.add_argument("--n", type=int_at_least(1), default=None,
                   help=f"next stage's training-set size (default {N_NEXT})")
    p.add_argument("--tasks", type=task_names, default=None,
                   help="comma-separated prior tasks in order (default: as in the file)")
    p.add_argument("--select", default=SELECT, choices=["top", "low", "random"],
                   help="keep the highest / lowest scores, or a random sample (ablation)")
    p.add_argument("--seed", default=str(SEED), help="seed for tie-breaking and --select random: "
                                                     "an integer or any string (run.py passes "
                                                     "SEED:STAGE, so every stage draws anew)")
    p.add_argument("--max-len", type=int_at_least(2), default=None,
                   help="with --tokenizer: rollouts longer than this (chat-templated prompt + "
                        "response, the length train.py's --max-len drops) are no candidates "
                        "(default: no length check)")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint directory whose tokenizer measures --max-len")
    p.add_argument("--out", default=None, help="buffer JSONL (default: buffer.jsonl next to "
                                               "--rollouts); an earlier buffer is replaced, any "
                                               "other file is refused")
    p.add_argument("--overwrite", action="store_true", help="replace the file at --out even if "
                                                           "score.py did not write it")
    add_task_spec(p)
    use_manifest_from_argv(argv)  # the manifest's task names are what --tasks checks against
    args = p.parse_args(argv)
    if args.budget is not None and (args.rho is not None or args.n is not None):
        p.error("give either --budget or --rho/--n, not both")
    if (args.max_len is None) != (args.tokenizer is None):
        p.error("give --max-len and --tokenizer together")
    if args.task_budgets is not None:
        if args.budget is not None or args.rho is not None or args.n is not None:
            p.error("give either --task-budgets or --budget / --rho/--n, not both")
        args.task_budgets = parse_task_budgets(args.task_budgets, p.error)
    return args


def parse_task_budgets(spec: str, error) -> dict:
    """'C-STANCE=40,FOMC=25' -> {"C-STANCE": 40, "FOMC": 25}; a bad item ->
    error(message naming it)."""
    from data.tasks import get_task
    out = {}
    for item in spec.split(","):
        name, _, count = item.partition("=")
        try:
            get_task(name.strip())
            k = int(count)
            if k < 0:
                raise ValueError(f"count must be >= 0, got {k}")
        except ValueError as e:
            error(f"--task-budgets: bad item {item!r} (want TASK=COUNT): {e}")
        if name.strip() in out:  # the later count would silently win
            error(f"--task-budgets: task {name.strip()!r} appears twice in {spec!r}")
        out[name.strip()] = k
    return out


def stats_path(buffer_path: Path) -> Path:
    """Where the buffer's loss-bound summary goes: buffer.jsonl -> buffer_stats.json."""
    return buffer_path.with_name(buffer_path.stem + "_stats.json")


def read_rollouts(path: Path) -> list[dict]:
    """Rollout records, validated; each gets a "_where" ("<file>: record i (line n)") for
    later error messages."""
    from common.jsonl import read_records
    from data.tasks import get_task
    located = read_records(path, required=ROLLOUT_FIELDS,
                           types={"idx": int, "logprobs": list, "prompt": (str, list)}, locate=True)
    records = [r for _, r in located]
    for where, r in located:
        r["_where"] = where
        try:
            get_task(r["task"])
        except ValueError as e:
            raise InputError(f"{r['_where']}: {e}") from None
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in r["logprobs"]):
            raise InputError(f"{r['_where']}: field 'logprobs' must be a list of numbers")
        # a NaN or infinite log-prob (Python's JSON reads NaN/Infinity) would rank
        # first or poison the stats
        bad = next((x for x in r["logprobs"] if not math.isfinite(x) or x > 0), None)
        if bad is not None:
            raise InputError(f"{r['_where']}: field 'logprobs' holds {bad}; log-probs must be "
                             f"finite numbers <= 0 (re-run rollout.py for this file)")
        if "token_ids" in r and (not isinstance(r["token_ids"], list)
                                 or len(r["token_ids"]) != len(r["logprobs"])):
            n = (len(r["token_ids"]) if isinstance(r["token_ids"], list)
                 else type(r["token_ids"]).__name__)
            raise InputError(f"{r['_where']}: {n} token_ids but {len(r['logprobs'])} logprobs; "
                             f"each sampled token has one log-prob (re-run rollout.py for "
                             f"this file)")
    first = {}
    for r in records:  # one rollout per training prompt: a second would be
                       # scored and replayed twice
        key = (r["task"], r["idx"])
        if key in first:
            raise InputError(f"{r['_where']}: task {r['task']!r} idx {r['idx']} again (first at "
                             f"{first[key]}); a rollout file holds one rollout per training prompt")
        first[key] = r["_where"]
    return records


def is_empty(response: str) -> bool:
    return not response.strip()


def sc_score(r: dict) -> float:
    """Mean raw log-prob of the sampled tokens; -inf for an empty response."""
    if is_empty(r["response"]) or not r["logprobs"]:
        return -math.inf
    return sum(r["logprobs"]) / len(r["logprobs"])


def ru_scores(records: list[dict], root: Path, scoring: str = SCORING) -> list[float]:
    """Task metric (0..100, convention `scoring`) of each response against the gold answer of
    its training record; 0 for an empty response under lenient scoring (paper / trace: whatever
    their metric gives)."""
    from data.conventions import score
    from data.trace import load_task
    gold = {}
    for task in dict.fromkeys(r["task"] for r in records):
        gold[task] = {ex.idx: ex for ex in load_task(root, task, "train", max_train=None)}
    out = []
    for r in records:
        ex = gold[r["task"]].get(r["idx"])
        if ex is None:
            raise InputError(f"{r['_where']}: idx {r['idx']} is not a record of "
                             f"{root / r['task']}/train.json ({len(gold[r['task']])} records)")
        if ex.prompt != r["prompt"]:
            raise InputError(f"{r['_where']}: prompt differs from {root / r['task']}/train.json "
                             f"record {r['idx']} (rollouts from another data root?)")
        if scoring == "lenient" and is_empty(r["response"]):
            out.append(0.0)
        else:
            try:
                out.append(float(score(r["task"], r["response"], ex.answer, ex.prompt,
                                       scoring=scoring, record=ex.record)))
            except InputError as e:  # a user scorer failing on this response, a prompt
                                     # `scoring` cannot score
                raise InputError(f"{r['_where']} (train record {r['idx']} of "
                                 f"{r['task']}): {e}") from None
    return out


def nll_stats(records: list[dict]) -> dict:
    """Per-token NLL under the producing checkpoint: l = -mean(logprobs) per rollout; its
    mean and max over the records, and the largest single-token NLL. Records without
    log-probs are skipped."""
    rs = [r for r in records if r["logprobs"]]
    if not rs:
        return {"n": len(records), "nll_mean": None, "nll_max": None, "token_nll_max": None}
    per = [-sum(r["logprobs"]) / len(r["logprobs"]) for r in rs]
    return {"n": len(records), "nll_mean": sum(per) / len(per), "nll_max": max(per),
            "token_nll_max": max(-x for r in rs for x in r["logprobs"])}


def task_rollouts(path: Path, tasks_flag) -> tuple[list, list]:
    """The rollouts of --tasks (all in the file without it) and the task order:
    --tasks's, else the file's."""
    from data.tasks import parse_tasks
    records = read_rollouts(path)
    if not tasks_flag:
        return records, list(dict.fromkeys(r["task"] for r in records))
    tasks = parse_tasks(tasks_flag)
    missing = [t for t in tasks if not any(r["task"] == t for r in records)]
    if missing:
        raise InputError(f"{path}: no rollouts for task(s) {', '.join(missing)} given in --tasks")
    return [r for r in records if r["task"] in tasks], tasks


def split_budget(args, available: dict, path: Path) -> tuple[int, dict]:
    """(the buffer's budget, task -> examples): --task-budgets's own counts, else the budget
    (--budget, or the rule rho * n) split over the tasks; each capped by the candidates a task
    has (`available`)."""
    from data.replay import allocate, buffer_size
    if args.task_budgets is not None:
        if (any(t not in available for t in args.task_budgets)
                or len(args.task_budgets) != len(available)):
            raise InputError(f"--task-budgets names {', '.join(args.task_budgets)} but {path} "
                             f"(with --tasks) holds rollouts of {', '.join(available)}")
        return sum(args.task_budgets.values()), {t: min(args.task_budgets[t], n)
                                                 for t, n in available.items()}
    budget = args.budget if args.budget is not None else buffer_size(
        RHO if args.rho is None else args.rho, N_NEXT if args.n is None else args.n)
    return budget, allocate(budget, available)


def print_summary(args, budget: int, rows: list, stats: dict, stats_file: Path):
    """One markdown row per task: candidates, selection, score range and the NLL bound
    of what was kept."""
    passed_rule = "score == 100" if args.scorer == "ru" else "score > task median"
    print(f"scorer={args.scorer} select={args.select} budget={budget}"
          f"{' (per task)' if args.task_budgets is not None else ''}"
          f"{f' scoring={args.scoring}' if args.scorer == 'ru' else ''} (passed: {passed_rule})")
    print("| task | available | over-long | selected | min | median | max | passed | empty | "
          "NLL/token selected mean | selected max | rejected mean | Spearman RU-SC |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for t, n, n_long, k, lo, med, hi, passed, empty in rows:
        st = stats["tasks"][t]
        print(f"| {t} | {n} | {n_long} | {k} | {fmt(lo)} | {fmt(med)} | {fmt(hi)} | {passed} | "
              f"{empty} | {fmt(st['selected']['nll_mean'])} | {fmt(st['selected']['nll_max'])} | "
              f"{fmt(st['rejected']['nll_mean'])} | {fmt(st['spearman_ru_sc'])} |")
    print(f"Spearman(RU, SC) over all rollouts: {fmt(stats['spearman_ru_sc'])}; buffer stats: "
          f"{stats_file}")


def score_rollouts(records: list[dict], args) -> tuple[list, list | None, list]:
    """(SC scores, RU scores or None, the scores --scorer ranks by). RU is computed whenever the
    gold answers are at hand (--scorer ru, or --data given): step 5 correlates it with SC."""
    sc = [sc_score(r) for r in records]
    ru = None
    if args.scorer == "ru" or args.data is not None:
        from data.embedded import ensure_embedded
        ru = ru_scores(records, Path(args.data) if args.data is not None else ensure_embedded(),
                       args.scoring)
    return sc, ru, (ru if args.scorer == "ru" else sc)


def candidates(records: list[dict], tasks: list, args) -> tuple[list, dict, dict]:
    """(whether each rollout fits --max-len, task -> indices of its candidates, task -> over-long
    count); without --max-len every rollout fits."""
    fits = [True] * len(records)
    if args.max_len is not None:  # what train.py could not train on is no candidate
        from model.tokenizer import ChatTokenizer
        tok = ChatTokenizer.from_dir(Path(args.tokenizer))
        fits = [tok.sft_length(r["prompt"], r["response"]) <= args.max_len for r in records]
    by_task = {t: [i for i, r in enumerate(records) if r["task"] == t] for t in tasks}
    overlong = {t: sum(not fits[i] for i in ix) for t, ix in by_task.items()}
    by_task = {t: [i for i in ix if fits[i]] for t, ix in by_task.items()}  # the candidates
    return fits, by_task, overlong


def buffer_example(r: dict, s: float, args, rollout_path: Path) -> dict:
    """A selected rollout as a replay example: the SFT pair train.py reads, plus its task, idx,
    score (None for -inf) and how and from where it was chosen."""
    return {"prompt": r["prompt"], "response": r["response"], "task": r["task"], "idx": r["idx"],
            "score": s if math.isfinite(s) else None, "scorer": args.scorer, "select": args.select,
            "scoring": args.scoring if args.scorer == "ru" else None,
            "source": str(rollout_path)}


def main(argv=None):
    args = parse_args(argv)
    from common.outputs import check_output, write_json, write_jsonl
    from reporting.stats import spearman
    from data.replay import select

    rollout_path = Path(args.rollouts)
    out_path = check_output(Path(args.out) if args.out else rollout_path.with_name("buffer.jsonl"),
                            "buffer", args.overwrite)
    check_output(stats_path(out_path), "buffer-stats", args.overwrite, "--out's buffer_stats.json")

    # 1. rollouts, grouped by task in task order
    records, tasks = task_rollouts(rollout_path, args.tasks)

    # 2. scores (both, when the gold answers are at hand: step 5 correlates them), and which
    #    rollouts are candidates
    sc, ru, scores = score_rollouts(records, args)
    fits, by_task, overlong = candidates(records, tasks, args)

    # 3. budget and its split over the prior tasks (or each task's own count)
    budget, alloc = split_budget(args, {t: len(ix) for t, ix in by_task.items()}, rollout_path)

    # 4. selection within each task
    buffer, rows, task_stats, picked = [], [], {}, set()
    for t in tasks:
        ix = by_task[t]
        task_scores = [scores[i] for i in ix]
        chosen = select(ix, task_scores, alloc[t], args.select, seed=f"{args.seed}:{t}")
        buffer += [buffer_example(records[i], scores[i], args, rollout_path) for i in chosen]
        picked.update(chosen)
        task_stats[t] = {"n": len(ix), "overlong": overlong[t],
                         "spearman_ru_sc": None if ru is None
                         else spearman([ru[i] for i in ix], [sc[i] for i in ix]),
                         "selected": nll_stats([records[i] for i in chosen]),
                         "rejected": nll_stats([records[i] for i in ix if i not in picked])}
        med = statistics.median(task_scores) if ix else None  # (none: every rollout of
                                                              # the task is over-long)
        passed = sum((s == 100.0) if args.scorer == "ru" else (s > med) for s in task_scores)
        rows.append((t, len(ix), overlong[t], len(chosen), min(task_scores, default=None), med,
                     max(task_scores, default=None), passed,
                     sum(not records[i]["response"].strip() for i in ix)))

    # 5. the buffer's loss bound
    stats = {"scorer": args.scorer, "select": args.select, "budget": budget,
             "spearman_ru_sc": spearman(ru, sc) if ru is not None else None, "tasks": task_stats,
             "all": {"selected": nll_stats([r for i, r in enumerate(records) if i in picked]),
                     "rejected": nll_stats([r for i, r in enumerate(records)
                                            if fits[i] and i not in picked])}}

    # 6. write (atomic), then report
    # the statistics are written last and mark a finished pair: earlier ones go first, so no
    # reader sees a new buffer beside old statistics (a failure in between leaves a buffer
    # without them: unfinished)
    stats_path(out_path).unlink(missing_ok=True)
    write_jsonl(out_path, buffer, kind="buffer")
    write_json(stats_path(out_path), stats, kind="buffer-stats")
    print_summary(args, budget, rows, stats, stats_path(out_path))
    print(f"wrote {len(buffer)} replay examples to {out_path}")
    return out_path


if __name__ == "__main__":
    main_cli(main, "score.py")
