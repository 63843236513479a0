"""On-Policy Replay, step 1: the newest checkpoint answers every historical training prompt once.

    python rollout.py --ckpt runs/stage2 --data /path/to/TRACE --tasks C-STANCE,FOMC \
                      --out runs/stage2/rollouts.jsonl

For each task (in order):
  1. load its training split with the SAME seeded 5,000-example subsample and the SAME over-long
     filter (chat-templated prompt + gold answer <= 2,048 tokens) that training used; the gold
     answers are then discarded
  2. render each prompt with the checkpoint's own chat template as a single user turn
     (+ generation prompt)
Then, for all prompts at once:
  3. sample ONE response per prompt: temperature 0.1, top-p 1, no top-k, no repetition penalty, <=
     512 new tokens, stopping at end-of-turn/EOS, seeded; keep each sampled token's RAW log-prob
     (log_softmax before temperature)
  4. write one JSONL line per rollout: its prompt's task and record number, the response, its
     token ids and their raw log-probs
  5. log-prob agreement (--check-logprobs K, on by default): re-score K random rollouts with the
     training model's own teacher-forced forward pass (our Transformer, in train.py's compute dtype)
     and compare its log-prob of every sampled token with the engine's: mean and max |d| per token
     and a k3 estimate mean(exp(d) - 1 - d), d = logp_trainer - logp_engine (>= 0, 0 iff they agree;
     Schulman's estimator of KL(engine || trainer) for tokens drawn at temperature 1); a warning is
     printed when the mean |d| exceeds LOGPROB_TOL_MEAN or the max exceeds LOGPROB_TOL_MAX
  6. write <out stem>_summary.json: per-task counts, tokens, mean log-prob, and
     the numbers of step 5
score.py then ranks the rollouts and builds the replay buffer for the next stage.

Why step 5, its files' fields, engine, data default: README, "rollout.py — on-policy responses".
"""
import argparse
import math
import sys
import time
from pathlib import Path

from common.cli import BATCH_SIZE_HELP, ENGINE_HELP, Parser, float_in, int_at_least, main_cli
from common.errors import UserError
from data.manifest import add_task_spec, data_root, use_manifest_from_argv
from data.tasks import task_names

# ---- defaults: the paper's rollout setup (each has a flag below) ---------------------------------
TEMPERATURE = 0.1      # near-greedy, so a rollout is the model's own most likely answer
MAX_NEW_TOKENS = 512   # response length cap
MAX_LEN = 2048         # over-long filter on prompt+gold answer (chat-templated
                       # tokens), as in training
MAX_TRAIN = 5000       # per-task training subsample (seeded), as in training
DATA_SEED = 0          # seed of that subsample: must equal training's
SEED = 0               # sampling seed
ENGINE = "auto"        # vllm when CUDA + vllm are present, else native
TP = 1                 # vLLM tensor-parallel size
BATCH_SIZE = None      # native engine: sequences alive at once (KV-cache rows); None: what the
                       # memory holds, <= 64 on CPU, <= 256 on GPU
CHECK_LOGPROBS = 8     # rollouts re-scored by the trainer's forward pass (0 = no check)
LOGPROB_TOL_MEAN = 0.01  # nats per token: warn above this mean |engine - trainer| (an SC score
                         # moves by at most it)
LOGPROB_TOL_MAX = 0.5    # nats: warn when one token's log-prob is off by more (its
                         # probability by a factor 1.65)
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True,
                   help="checkpoint directory (HF layout, with tokenizer + chat template)")
    p.add_argument("--data", default=None,
                   help="TRACE root <root>/<Task>/train.json (default: the embedded benchmark, "
                        "generated into a cache)")
    p.add_argument("--tasks", type=task_names, default=None,
                   help="comma-separated prior tasks (default: every task under --data)")
    p.add_argument("--out", default=None, help="output JSONL (default: <ckpt>/rollouts.jsonl); an "
                                               "earlier rollout file is replaced, any other file "
                                               "is refused")
    p.add_argument("--overwrite", action="store_true", help="replace the file at --out even if "
                                                           "rollout.py did not write it")
    p.add_argument("--engine", default=ENGINE, choices=["auto", "native", "vllm"], help=ENGINE_HELP)
    p.add_argument("--tp", type=int_at_least(1), default=TP, help="vLLM tensor-parallel size")
    p.add_argument("--temperature", type=float_in(0), default=TEMPERATURE,
                   help="sampling temperature (0 = greedy)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=MAX_NEW_TOKENS,
                   help="response length cap")
    p.add_argument("--seed", type=int, default=SEED, help="sampling seed")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="at most this many prompts per task (smoke tests)")
    p.add_argument("--max-len", type=int_at_least(2), default=MAX_LEN,
                   help="drop examples whose templated length exceeds this")
    p.add_argument("--max-train", type=int_at_least(1), default=MAX_TRAIN,
                   help="per-task training subsample size")
    p.add_argument("--data-seed", type=int, default=DATA_SEED,
                   help="seed of the training subsample")
    p.add_argument("--batch-size", type=int_at_least(1), default=BATCH_SIZE,
                   help=BATCH_SIZE_HELP)
    p.add_argument("--check-logprobs", type=int_at_least(0), default=CHECK_LOGPROBS, metavar="K",
                   help="re-score K random rollouts with the trainer's forward pass and compare "
                        "log-probs (0 = off)")
    add_task_spec(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    use_manifest_from_argv(argv)  # the manifest's task names are what --tasks checks against
    return p.parse_args(argv)


def summary_path(rollouts_path: Path) -> Path:
    """rollouts.jsonl -> rollouts_summary.json"""
    return rollouts_path.with_name(rollouts_path.stem + "_summary.json")


def logprob_check(ckpt, prompts, outs, k: int, seed: int) -> dict:
    """Step 5: the engine's log-probs of K random rollouts (seeded) against a teacher-forced forward
    pass of the training model on the same tokens. Returns the numbers that go into the summary."""
    import random

    import torch

    from model.checkpoint import load_model
    from model.logprobs import response_stats
    picked = sorted(random.Random(seed).sample(range(len(outs)), min(k, len(outs))))
    cuda = torch.cuda.is_available()
    model = load_model(ckpt, "cuda" if cuda else "cpu",
                       torch.bfloat16 if cuda else torch.float32)  # train.py's dtype
    trainer = response_stats(model, [(prompts[i], outs[i]["token_ids"]) for i in picked],
                             packed=False)
    d = [t - e for i, s in zip(picked, trainer) for t, e in zip(s["logprobs"], outs[i]["logprobs"])]
    n = max(len(d), 1)
    res = {"k": len(picked), "tokens": len(d), "mean_abs_dlogp": sum(abs(x) for x in d) / n,
           "max_abs_dlogp": max((abs(x) for x in d), default=0.0),
           "k3_kl": sum(math.expm1(x) - x for x in d) / n, "tol_mean": LOGPROB_TOL_MEAN,
           "tol_max": LOGPROB_TOL_MAX, "checked": picked}
    res["warned"] = (res["mean_abs_dlogp"] > LOGPROB_TOL_MEAN
                     or res["max_abs_dlogp"] > LOGPROB_TOL_MAX)
    return res


def rollout_records(examples, outs, tok) -> list[dict]:
    """rollouts.jsonl's records: each response's text, token ids, raw log-probs and their mean
    (OPR-SC's score)."""
    records = []
    for ex, o in zip(examples, outs):
        ids, lps = o["token_ids"], o["logprobs"]
        records.append({"task": ex.task, "idx": ex.idx, "prompt": ex.prompt,
                        "response": tok.decode_response(ids), "token_ids": ids, "logprobs": lps,
                        "mean_logprob": sum(lps) / len(lps) if lps else None,
                        "num_tokens": len(ids), "finish_reason": o["finish_reason"]})
    return records


def task_summaries(records: list, tasks: list) -> dict:
    """Per task: rollouts, mean length, how many stopped, mean of the mean log-probs."""
    out = {}
    for task in tasks:
        rs = [r for r in records if r["task"] == task]
        lps = [r["mean_logprob"] for r in rs if r["mean_logprob"] is not None]
        out[task] = {"n": len(rs),
                     "mean_tokens": sum(r["num_tokens"] for r in rs) / max(len(rs), 1),
                     "stopped": sum(r["finish_reason"] == "stop" for r in rs),
                     "mean_logprob": sum(lps) / len(lps) if lps else None}
    return out


def print_table(summary: dict, engine: str):
    """The summary per task, and the log-prob check's numbers (a warning when they
    exceed the tolerance)."""
    print(f"{'task':<12} {'rollouts':>8} {'mean tokens':>11} {'stopped':>8} {'mean logprob':>12}")
    for task, t in summary["tasks"].items():
        if t["n"]:
            lp = "-" if t["mean_logprob"] is None else f"{t['mean_logprob']:.3f}"
            print(f"{task:<12} {t['n']:>8} {t['mean_tokens']:>11.1f} {t['stopped']:>8} {lp:>12}")
    check = summary["logprob_check"]
    if check is not None:
        print(f"log-prob check ({check['k']} rollouts, {check['tokens']} tokens, engine {engine} "
              f"vs trainer): mean |d| {check['mean_abs_dlogp']:.2e}, max |d| "
              f"{check['max_abs_dlogp']:.2e}, k3 KL {check['k3_kl']:.2e}")
        if check["warned"]:
            print(f"rollout.py: WARNING: the {engine} engine's log-probs disagree with the "
                  f"trainer's forward pass (mean |d| {check['mean_abs_dlogp']:.3g} > "
                  f"{LOGPROB_TOL_MEAN} or max |d| {check['max_abs_dlogp']:.3g} > {LOGPROB_TOL_MAX} "
                  f"nats); OPR-SC scores built on them are off by as much", file=sys.stderr)


def check_inputs(args):
    """The checkpoint, its tokenizer, the data root, the tasks and the output path (and its
    summary's), each checked before any work starts: an unusable checkpoint, a missing tokenizer, no
    tasks or a refused --out fail here."""
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
    tasks = parse_tasks(args.tasks) if args.tasks else tasks_in(root)
    if not tasks:
        raise UserError(f"{root}: no task directories with a train.json (--data must be a "
                        f"TRACE root)")
    out_path = check_output(Path(args.out) if args.out
                            else default_output(args.ckpt, ckpt, "rollouts.jsonl"),
                            "rollouts", args.overwrite)
    check_output(summary_path(out_path), "rollout-summary", args.overwrite, "--out's _summary.json")
    return ckpt, tok, root, tasks, out_path


def main(argv=None):
    args = parse_args(argv)
    from kernels import retain_freed_memory
    retain_freed_memory()  # large tensors reuse freed memory, not fresh pages every step
    from common.outputs import write_json, write_jsonl
    from data.trace import load_filtered
    from data.manifest import sampling_settings
    from engine import workers
    from engine.sampling import generate_per_prompt, resolve_engine

    ckpt, tok, root, tasks, out_path = check_inputs(args)
    engine = resolve_engine(args.engine)

    # 1-2. the training prompts each task trained on, rendered with this checkpoint's chat template
    with tok.remembering_prompts():  # the filter's tokenizing gives the prompts' ids too
        examples, _ = load_filtered(root, tasks, "train", tok.sft_length, args.max_len,
                                    limit=args.limit, max_train=args.max_train, seed=args.data_seed)
        prompts = [tok.prompt_ids(ex.prompt) for ex in examples]
    print(f"rollout: {len(prompts)} prompts from {len(tasks)} tasks, engine={engine}, "
          f"T={args.temperature}, max_new_tokens={args.max_new_tokens}, seed={args.seed}")

    # 3. one sampled response per prompt, with raw log-probs
    t0 = time.perf_counter()
    temps, caps = sampling_settings([ex.task for ex in examples], args.temperature,
                                    args.max_new_tokens, evaluation=False)  # a task's own cap
    outs = generate_per_prompt(ckpt, prompts, temps, caps, seed=args.seed, engine=engine,
                               tp=args.tp, batch_size=args.batch_size, stop_ids=tok.stop_ids,
                               progress=not args.quiet)
    wall = time.perf_counter() - t0
    if not workers.is_main():  # a data-parallel worker (engine/workers.py): rank 0 writes
        return out_path

    # 4. rollout records
    records = rollout_records(examples, outs, tok)
    # 5. engine vs trainer log-probs
    check = (logprob_check(ckpt, prompts, outs, args.check_logprobs, args.seed)
             if args.check_logprobs > 0 else None)

    # 6. outputs: rollouts, then the summary
    n_tok = sum(r["num_tokens"] for r in records)
    summary = {"ckpt": str(ckpt), "engine": engine, "temperature": args.temperature,
               "max_new_tokens": args.max_new_tokens, "seed": args.seed, "n": len(records),
               "tokens": n_tok, "seconds": wall, "workers": workers.world()[1],
               "tasks": task_summaries(records, tasks), "logprob_check": check}
    # the summary is written last and marks a finished pair: an earlier one goes first, so no
    # reader sees new rollouts beside an old summary (a failure in between leaves rollouts
    # without one: unfinished)
    summary_path(out_path).unlink(missing_ok=True)
    write_jsonl(out_path, records, kind="rollouts")
    write_json(summary_path(out_path), summary, kind="rollout-summary")

    print_table(summary, engine)
    print(f"wrote {len(records)} rollouts to {out_path} ({n_tok} tokens in {wall:.1f}s, "
          f"{n_tok / max(wall, 1e-9):.1f} tok/s, {len(records) / max(wall, 1e-9):.2f} prompts/s)")
    return out_path


if __name__ == "__main__":
    main_cli(main, "rollout.py")
