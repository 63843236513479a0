"""Per-update drift on historical tasks: the KL between consecutive policies that bounds
forgetting (paper Sec. 3.2).

    python drift.py --ckpt runs/stage3 --ref runs/stage2 --data /path/to/TRACE \
                    --tasks C-STANCE,FOMC --out DIR

For each given (prior) task:
  1. load its TEST split (held out from every stage's training and replay), drop the over-long
     examples with training's length rule, keep the first --limit
  2. render each prompt with CUR's chat template (CUR and PREV must share one tokenizer)
Then, for all prompts at once:
  3. sample one response per prompt from CUR (temperature 1 by default: the KL is between the
     policies themselves, so the responses are draws from pi_CUR; <= --max-new-tokens, stop at
     end-of-turn/EOS, seeded)
  4. teacher-force CUR and PREV on the same prompt + response tokens and compute, at every
     response position, the exact KL(pi_CUR || pi_PREV) over the full vocabulary
     (model/logprobs.py: logits chunk by chunk, never [tokens x vocab] whole). Summed over a
     response it is an unbiased estimate of the sequence-level KL(pi_CUR(.|x) || pi_PREV(.|x))
     truncated to --max-new-tokens tokens
  5. teacher-force both on the GOLD answers (prompt + answer + end-of-turn, as training sees
     them): per-token NLL
  6. per prompt the sequence KL and the gold NLLs; per task and over all prompts: n, the mean and
     median sequence KL, the KL per token (total KL / total sampled tokens), the mean sampled
     tokens, and the gold NLL under CUR and PREV per gold token (token-weighted over the task)

Its files, engine, data default: README, "drift.py — the per-update KL that bounds forgetting".
"""
import math
import statistics
import time
from pathlib import Path

from common.cli import BATCH_SIZE_HELP, ENGINE_HELP, Parser, float_in, int_at_least, main_cli
from common.errors import InputError
from data.manifest import add_task_spec, data_root, use_manifest_from_argv
from data.tasks import task_names

# ---- defaults (each has a flag below) ------------------------------------------------------------
LIMIT = 32             # test prompts per task: a few dozen keep the step cheap next to training
TEMPERATURE = 1.0      # sample from pi_CUR itself (see step 3)
MAX_NEW_TOKENS = 512   # response length cap, as for rollouts
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
                   help="CUR: the newer checkpoint (HF layout, tokenizer + chat template)")
    p.add_argument("--ref", required=True,
                   help="PREV: the checkpoint before the update (same tokenizer as --ckpt)")
    p.add_argument("--data", default=None,
                   help="TRACE root with <Task>/test.json (default: the embedded benchmark, "
                        "generated into a cache)")
    p.add_argument("--tasks", default=None, type=task_names,
                   help="comma-separated prior tasks (default: every task with a test split "
                        "under --data)")
    p.add_argument("--out", default=None, help="output directory (default: <ckpt>/drift)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if drift.py did not write it")
    p.add_argument("--limit", type=int_at_least(0), default=LIMIT, help="test prompts per task "
                   "(0 = all) (default: %(default)s)")
    p.add_argument("--temperature", type=float_in(0.0, None), default=TEMPERATURE,
                   help="sampling temperature of CUR (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=MAX_NEW_TOKENS,
                   help="response length cap (default: %(default)s)")
    p.add_argument("--max-len", type=int_at_least(1), default=MAX_LEN, help="drop test examples "
                   "whose templated length exceeds this (default: %(default)s)")
    p.add_argument("--seed", type=int, default=SEED, help="sampling seed (default: %(default)s)")
    p.add_argument("--engine", default=ENGINE, choices=["auto", "native", "vllm"], help=ENGINE_HELP)
    p.add_argument("--tp", type=int_at_least(1), default=TP,
                   help="vLLM tensor-parallel size (default: %(default)s)")
    p.add_argument("--batch-size", type=int_at_least(1), default=BATCH_SIZE,
                   help=BATCH_SIZE_HELP)
    add_task_spec(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    use_manifest_from_argv(argv)  # the manifest's task names are what --tasks checks against
    return p.parse_args(argv)


def summarize(rows: list[dict]) -> dict:
    """Per-task (or overall) numbers from per-prompt rows; see the module docstring."""
    seq_kl = [r["seq_kl"] for r in rows]
    n_tok = sum(r["num_tokens"] for r in rows)
    gold_tok = sum(r["gold_tokens"] for r in rows)
    return {"n": len(rows), "mean_seq_kl": statistics.fmean(seq_kl),
            "median_seq_kl": statistics.median(seq_kl), "kl_per_token": sum(seq_kl) / max(n_tok, 1),
            "mean_tokens": n_tok / len(rows),
            "gold_nll_cur": sum(r["gold_nll_cur"] for r in rows) / max(gold_tok, 1),
            "gold_nll_ref": sum(r["gold_nll_ref"] for r in rows) / max(gold_tok, 1)}


def check_one_vocabulary(cur_dir, ref_dir, cur_cfg, ref_cfg):
    """A KL over two different vocabularies is meaningless: the two checkpoints must
    share one tokenizer."""
    if (cur_dir / "tokenizer.json").read_bytes() != (ref_dir / "tokenizer.json").read_bytes() \
            or cur_cfg.vocab_size != ref_cfg.vocab_size:
        raise InputError(f"--ckpt {cur_dir} and --ref {ref_dir} have different tokenizers or "
                         f"vocab sizes; the per-token KL needs one vocabulary")


def gold_sequence(tok, ex) -> tuple[list, list]:
    """(prompt ids, gold answer ids) of a test example, as train.py's chat template splits them."""
    ids, labels = tok.encode_sft(ex.prompt, ex.answer)
    start = next(t for t, lab in enumerate(labels) if lab != -100)
    end = max(t for t, lab in enumerate(labels) if lab != -100) + 1
    return ids[:start], ids[start:end]


def sample_rows(examples, outs, sampled, gold, gold_seqs, models: str) -> list[dict]:
    """drift_samples.jsonl's rows: each sample's KL per token and the gold answer's NLL under
    both models. A non-finite KL or NLL (an overflow in either model) is an error, never a
    NaN in drift.json."""
    rows = []
    for ex, o, s, g, (_, gold_ids) in zip(examples, outs, sampled, gold, gold_seqs):
        rows.append({"task": ex.task, "idx": ex.idx, "token_ids": o["token_ids"],
                     "num_tokens": len(o["token_ids"]), "finish_reason": o["finish_reason"],
                     "seq_kl": sum(s["kl"]), "kl": s["kl"], "gold_tokens": len(gold_ids),
                     "gold_nll_cur": -sum(g["logprobs"]), "gold_nll_ref": -sum(g["ref_logprobs"])})
    bad = next((r for r in rows
                if not all(map(math.isfinite,
                               (r["seq_kl"], r["gold_nll_cur"], r["gold_nll_ref"])))),
               None)
    if bad is not None:
        raise InputError(f"{models}: non-finite KL or NLL on {bad['task']} example "
                         f"{bad['idx']} (seq_kl {bad['seq_kl']}, gold NLL {bad['gold_nll_cur']} / "
                         f"{bad['gold_nll_ref']}); one of the models overflows: nothing written")
    return rows


def print_table(summary: dict):
    """drift.json's per-task summary as a markdown table."""
    print("| task | n | mean seq KL | median seq KL | KL / token | mean tokens | gold NLL PREV | "
          "gold NLL CUR |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for t, s in [*summary["tasks"].items(), ("all", summary["all"])]:
        print(f"| {t} | {s['n']} | {s['mean_seq_kl']:.4f} | {s['median_seq_kl']:.4f} | "
              f"{s['kl_per_token']:.5f} | {s['mean_tokens']:.1f} | {s['gold_nll_ref']:.4f} | "
              f"{s['gold_nll_cur']:.4f} |")


def check_inputs(args):
    """CUR and PREV (one vocabulary), CUR's tokenizer, the data root, the tasks and the output
    directory, each checked before any work starts."""
    from common.outputs import check_output
    from data.trace import tasks_in
    from model.checkpoint import load_config
    from model.hub import default_output, resolve_model
    from model.tokenizer import ChatTokenizer
    cur_dir, ref_dir = resolve_model(args.ckpt), resolve_model(args.ref)  # or model ids in the
                                                                          # Hugging Face cache
    cur_cfg, ref_cfg = load_config(cur_dir), load_config(ref_dir)  # fail before any work on
                                                                   # an unusable checkpoint
    tok = ChatTokenizer.from_dir(cur_dir)
    check_one_vocabulary(cur_dir, ref_dir, cur_cfg, ref_cfg)
    root = data_root(args)
    tasks = args.tasks or tasks_in(root, "test")
    if not tasks:
        raise InputError(f"no task directories with a test.json under {root}")
    out_dir = check_output(Path(args.out) if args.out
                           else default_output(args.ckpt, cur_dir, "drift"), "drift",
                           args.overwrite)
    return cur_dir, ref_dir, tok, root, tasks, out_dir


def teacher_force(cur_dir, ref_dir, tok, examples, prompts, outs, args):
    """Steps 4-5: CUR and PREV teacher-forced on the sampled responses (per-token KL) and on the
    gold answers (NLL), each worker scoring its share. Returns (sampled stats, gold stats, gold
    (prompt, answer) sequences)."""
    import torch

    from model.checkpoint import load_model
    from model.logprobs import response_stats
    from engine import workers
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cur, ref = load_model(cur_dir, device, dtype), load_model(ref_dir, device, dtype)
    # each worker scores its share (engine/workers.py): the costs are the sequences' lengths
    sampled = workers.sharded(
        lambda ix: response_stats(cur, [(prompts[i], outs[i]["token_ids"]) for i in ix], ref,
                                  progress=not args.quiet and workers.is_main(), desc="kl"),
        [len(p) + len(o["token_ids"]) for p, o in zip(prompts, outs)])
    gold_seqs = [gold_sequence(tok, ex) for ex in examples]
    gold = workers.sharded(lambda ix: response_stats(cur, [gold_seqs[i] for i in ix], ref,
                                                     desc="gold nll",
                                                     progress=not args.quiet and workers.is_main()),
                           [len(p) + len(a) for p, a in gold_seqs])
    return sampled, gold, gold_seqs


def write_outputs(out_dir: Path, rows: list, summary: dict):
    """Both files at once (common.outputs.written_aside): no reader sees new samples
    beside an old summary."""
    from common.outputs import write_json, write_jsonl, written_aside
    with written_aside(out_dir, "drift") as tmp:
        write_jsonl(tmp / "drift_samples.jsonl", rows)
        write_json(tmp / "drift.json", summary)


def main(argv=None):
    args = parse_args(argv)
    from kernels import retain_freed_memory
    retain_freed_memory()  # large tensors reuse freed memory, not fresh pages every step
    from data.trace import load_filtered
    from engine import workers
    from engine.sampling import check_context, generate, resolve_engine

    cur_dir, ref_dir, tok, root, tasks, out_dir = check_inputs(args)
    engine = resolve_engine(args.engine)

    # 1-2. held-out prompts of the prior tasks
    with tok.remembering_prompts():  # the filter's tokenizing gives the prompts' ids too
        examples, _ = load_filtered(root, tasks, "test", tok.sft_length, args.max_len,
                                    limit=args.limit or None, count_all=False)
        prompts = [tok.prompt_ids(ex.prompt) for ex in examples]
    print(f"drift: {len(examples)} test prompts from {len(tasks)} tasks, CUR={cur_dir}, "
          f"PREV={ref_dir}, engine={engine}, T={args.temperature}, "
          f"max_new_tokens={args.max_new_tokens}, seed={args.seed}")

    # 3. one response per prompt, sampled from CUR
    check_context(cur_dir, prompts, args.max_new_tokens)  # before the engine sizes
                                                          # its cache by the cap
    t0 = time.perf_counter()
    outs = generate(cur_dir, prompts, temperature=args.temperature,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, engine=engine, tp=args.tp,
                    batch_size=args.batch_size, stop_ids=tok.stop_ids, progress=not args.quiet)
    t_gen = time.perf_counter() - t0

    # 4-5. both models teacher-forced on the sampled responses and on the gold answers
    sampled, gold, gold_seqs = teacher_force(cur_dir, ref_dir, tok, examples, prompts, outs, args)
    if not workers.is_main():  # rank 0 writes
        return out_dir
    t_all = time.perf_counter() - t0

    rows = sample_rows(examples, outs, sampled, gold, gold_seqs,
                       f"--ckpt {cur_dir} / --ref {ref_dir}")
    summary = {"tasks": {t: summarize([r for r in rows if r["task"] == t]) for t in tasks},
               "all": summarize(rows), "ckpt": str(cur_dir), "ref": str(ref_dir),
               "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
               "seed": args.seed, "limit": args.limit, "max_len": args.max_len, "engine": engine,
               "data": str(root), "seconds": {"generate": t_gen, "total": t_all}}

    # 6. outputs: samples first, drift.json last (its presence marks a finished measurement)
    write_outputs(out_dir, rows, summary)

    print_table(summary)
    print(f"wrote drift.json and {len(rows)} samples to {out_dir} ({t_all:.1f}s, of which sampling "
          f"{t_gen:.1f}s)")
    return out_dir


if __name__ == "__main__":
    main_cli(main, "drift.py")
