"""Evaluate one checkpoint on the TRACE test splits: one row of the accuracy matrix.

    python evaluate.py --ckpt runs/stage3 --data /path/to/TRACE --tasks C-STANCE,FOMC,MeetingBank \
                       --out runs/stage3/eval

For each task (in order):
  1. load its TEST split and drop the over-long examples with training's length rule (chat-templated
     prompt + gold answer > --max-len tokens); the counts are printed and recorded
  2. render each prompt with the checkpoint's own chat template as a single user turn
     (+ generation prompt)
Then, for all tasks at once:
  3. sample --repeats responses per prompt in ONE generate call (temperature 0.1, top-p 1, <= 512
     new tokens, stop at end-of-turn/EOS); the K copies of a prompt are independent draws from the
     one seeded sampler of the call
  4. score every response against its gold answer with the task's metric
     (data.conventions.score, 0..100) under the --scoring convention: lenient (default: reads
     the answer a small model means), paper (the official OPR code's tools/eval.py) or trace
     (TRACE's metrics.py); see data/metrics.py
  5. per task: the mean score over examples and repeats, and the population std of the K
     per-repeat means

Its files, engine, data default: README, "evaluate.py — one row of the accuracy matrix".
"""
import statistics
import time
from pathlib import Path

from common.cli import BATCH_SIZE_HELP, ENGINE_HELP, Parser, float_in, int_at_least, main_cli
from common.errors import InputError, UserError
from data.manifest import add_task_spec, data_root, use_manifest_from_argv
from data.tasks import task_names

# ---- defaults: the paper's evaluation setup (each has a flag below) ------------------------------
TEMPERATURE = 0.1      # as for rollouts: near-greedy
REPEATS = 1            # samples per test prompt; scores average over them (the official code:
                       # 8; run.py passes it)
SCORING = "lenient"    # metric convention: lenient | paper (official OPR tools/eval.py) |
                       # trace (TRACE metrics.py)
MAX_NEW_TOKENS = 512   # response length cap
MAX_LEN = 2048         # over-long filter on prompt+gold answer (chat-templated
                       # tokens), as in training
SEED = 0               # sampling seed
ENGINE = "auto"        # vllm when CUDA + vllm are present, else native
TP = 1                 # vLLM tensor-parallel size
BATCH_SIZE = None      # native engine: sequences alive at once (KV-cache rows); None: what the
                       # memory holds, <= 64 on CPU, <= 256 on GPU
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True,
                   help="checkpoint directory (HF layout, with tokenizer + chat template)")
    p.add_argument("--data", default=None,
                   help="TRACE root with <Task>/test.json (default: the embedded benchmark, "
                        "generated into a cache)")
    p.add_argument("--tasks", type=task_names, default=None,
                   help="comma-separated tasks (default: every task with a test split under "
                        "--data, in TRACE order)")
    p.add_argument("--out", default=None,
                   help="output directory for predictions.jsonl and scores.json (default: "
                        "<ckpt>/eval); an earlier evaluation there is replaced, a directory with "
                        "other files is refused")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out even if it holds other files")
    p.add_argument("--engine", default=ENGINE, choices=["auto", "native", "vllm"], help=ENGINE_HELP)
    p.add_argument("--tp", type=int_at_least(1), default=TP,
                   help="vLLM tensor-parallel size (default: %(default)s)")
    p.add_argument("--temperature", type=float_in(0), default=TEMPERATURE,
                   help="sampling temperature, 0 = greedy (default: %(default)s)")
    p.add_argument("--repeats", type=int_at_least(1), default=REPEATS,
                   help="sampled responses per test prompt; scores average over them (default: "
                        "%(default)s)")
    p.add_argument("--scoring", default=SCORING, choices=["lenient", "paper", "trace"],
                   help="metric convention: lenient reads the meant answer ('Answer: B' -> B); "
                        "paper = the official OPR code's tools/eval.py; trace = TRACE's metrics.py "
                        "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=MAX_NEW_TOKENS,
                   help="response length cap (default: %(default)s)")
    p.add_argument("--max-len", type=int_at_least(2), default=MAX_LEN,
                   help="drop test examples whose chat-templated prompt+answer is longer, as "
                        "training does (default: %(default)s)")
    p.add_argument("--seed", type=int, default=SEED, help="sampling seed (default: %(default)s)")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="at most this many test "
                   "examples per task (smoke tests)")
    p.add_argument("--batch-size", type=int_at_least(1), default=BATCH_SIZE,
                   help=BATCH_SIZE_HELP)
    add_task_spec(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    use_manifest_from_argv(argv)  # the manifest's task names are what --tasks checks against
    return p.parse_args(argv)


def score_all(jobs, outs, tok, root, args) -> list[dict]:
    """predictions.jsonl's records: each response decoded and scored by its task's metric
    (--scoring); a scorer that fails on one names its test file and record."""
    from tqdm import tqdm
    from data.conventions import score
    from data.trace import task_file
    records = []
    for (ex, k), o in tqdm(list(zip(jobs, outs)), desc="score", unit="response",
                           disable=args.quiet):
        ids = o["token_ids"]
        pred = tok.decode_response(ids)
        try:
            s = float(score(ex.task, pred, ex.answer, ex.prompt, scoring=args.scoring,
                            record=ex.record))
        except InputError as e:  # a user scorer failing on this prediction, a prompt --scoring
                                 # cannot score: which one
            raise InputError(f"{task_file(root, ex.task, 'test')}: record {ex.idx}: {e}") from None
        records.append({"task": ex.task, "idx": ex.idx, "repeat": k, "prompt": ex.prompt,
                        "prediction": pred, "gold": ex.answer, "score": s,
                        "finish_reason": o["finish_reason"], "num_tokens": len(ids)})
    return records


def print_table(summary: dict, records: list):
    """scores.json's per-task numbers, with the responses' lengths and how many hit the
    cap, as markdown."""
    print("| task | n | dropped | score | std over repeats | mean tokens | hit max tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in summary["scores"]:
        rs = [r for r in records if r["task"] == t]
        print(f"| {t} | {summary['n'][t]} | {summary['dropped_overlong'][t]} | "
              f"{summary['scores'][t]:.2f} | {summary['std_over_repeats'][t]:.2f} | "
              f"{sum(r['num_tokens'] for r in rs) / len(rs):.1f} | "
              f"{sum(r['finish_reason'] == 'length' for r in rs)}/{len(rs)} |")


def check_inputs(args):
    """The checkpoint, its tokenizer, the data root, the tasks and the output directory, each
    checked before any work starts: an unusable checkpoint, a missing tokenizer, no test tasks or a
    refused --out fail here."""
    from common.outputs import check_output
    from data.tasks import parse_tasks
    from data.trace import tasks_in
    from model.checkpoint import load_config, weight_files
    from model.hub import default_output, resolve_model
    from model.tokenizer import ChatTokenizer
    ckpt = resolve_model(args.ckpt)  # a directory, or a model id found in the Hugging Face cache
    load_config(ckpt)  # fail before any work when the checkpoint is unusable
    weight_files(ckpt)  # (reads the safetensors headers only)
    tok = ChatTokenizer.from_dir(ckpt)  # InputError naming the directory when
                                        # tokenizer.json is missing
    root = data_root(args)
    tasks = parse_tasks(args.tasks) if args.tasks else tasks_in(root, "test")
    if not tasks:
        raise UserError(f"{root}: no task directories with a test.json (--data must be a "
                        f"TRACE root)")
    out_dir = check_output(Path(args.out) if args.out else default_output(args.ckpt, ckpt, "eval"),
                           "eval", args.overwrite)
    return ckpt, tok, root, tasks, out_dir


def summarize(records, examples, tasks, dropped, ckpt, root, engine, args) -> dict:
    """scores.json: per task the mean score over examples and repeats, the spread of the per-repeat
    means, the counts, and the settings the scores were made under."""
    K = args.repeats

    def task_mean(task, k=None):
        xs = [r["score"] for r in records if r["task"] == task and (k is None or r["repeat"] == k)]
        return sum(xs) / len(xs)

    return {
        "ckpt": str(ckpt),
        "scores": {t: task_mean(t) for t in tasks},
        "std_over_repeats": {t: statistics.pstdev([task_mean(t, k) for k in range(K)])
                             for t in tasks},
        "n": {t: sum(ex.task == t for ex in examples) for t in tasks},
        "dropped_overlong": dropped, "scoring": args.scoring,
        "temperature": args.temperature, "repeats": K, "seed": args.seed,
        "max_new_tokens": args.max_new_tokens, "max_len": args.max_len, "engine": engine,
        "data": str(root),
    }


def write_outputs(out_dir: Path, records: list, summary: dict):
    """Both files at once (common.outputs.written_aside): no reader sees new predictions
    beside old scores."""
    from common.outputs import write_json, write_jsonl, written_aside
    with written_aside(out_dir, "eval") as tmp:
        write_jsonl(tmp / "predictions.jsonl", records)
        write_json(tmp / "scores.json", summary)


def main(argv=None):
    args = parse_args(argv)
    from kernels import retain_freed_memory
    retain_freed_memory()  # large tensors reuse freed memory, not fresh pages every step
    from data.trace import load_filtered
    from data.manifest import sampling_settings
    from engine import workers
    from engine.sampling import generate_per_prompt, resolve_engine

    ckpt, tok, root, tasks, out_dir = check_inputs(args)
    engine = resolve_engine(args.engine)
    K = args.repeats

    # 1-2. test examples that fit the length limit, rendered with this checkpoint's chat template
    with tok.remembering_prompts():  # the filter's tokenizing gives the prompts' ids too
        examples, dropped = load_filtered(root, tasks, "test", tok.sft_length, args.max_len,
                                          limit=args.limit)
        prompts = [tok.prompt_ids(ex.prompt) for ex in examples]
    # the K copies of a prompt sit next to each other: jobs[i] = (example, repeat)
    jobs = [(ex, k) for ex in examples for k in range(K)]
    print(f"evaluate: {len(examples)} test prompts x {K} repeats from {len(tasks)} tasks, "
          f"scoring={args.scoring}, engine={engine}, "
          f"T={args.temperature}, max_new_tokens={args.max_new_tokens}, seed={args.seed}")

    # 3. all generations in one call (one model load, full batches)
    t0 = time.perf_counter()
    temps, caps = sampling_settings([ex.task for ex, _ in jobs], args.temperature,
                                    args.max_new_tokens, evaluation=True)  # a task's own T and cap
    outs = generate_per_prompt(ckpt, [p for p in prompts for _ in range(K)], temps, caps,
                               seed=args.seed, engine=engine, tp=args.tp,
                               batch_size=args.batch_size, stop_ids=tok.stop_ids,
                               progress=not args.quiet)
    wall = time.perf_counter() - t0
    if not workers.is_main():  # a data-parallel worker (engine/workers.py):
                               # rank 0 scores and writes
        return out_dir

    # 4. per-example scores
    records = score_all(jobs, outs, tok, root, args)
    summary = summarize(records, examples, tasks, dropped, ckpt, root, engine, args)

    # 5. outputs: predictions first, scores.json last (its presence marks a finished evaluation)
    write_outputs(out_dir, records, summary)

    n_tok = sum(r["num_tokens"] for r in records)
    print_table(summary, records)
    print(f"wrote {len(records)} predictions and scores.json to {out_dir} ({n_tok} tokens "
          f"generated in {wall:.1f}s, {n_tok / max(wall, 1e-9):.1f} tok/s)")
    return out_dir


if __name__ == "__main__":
    main_cli(main, "evaluate.py")
