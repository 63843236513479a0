"""A replay buffer's loss under a checkpoint: the per-token NLL of each replayed
answer (paper Eq. 3's l).

    python buffer_nll.py --ckpt runs/stage2 --buffer runs/stage2/buffer.jsonl \
                         --out runs/stage2/buffer_stats.json

score.py records l for OPR buffers from the rollouts' own log-probs (the checkpoint that produced
them). A gold buffer (Vanilla Replay) has no log-probs, so this script computes them:
  1. read the buffer (JSONL of {"prompt", "response", "task"}, as run.py and score.py write it)
  2. encode each pair as training does (chat template; the response tokens + end-of-turn are the
     targets; pairs longer than --max-len are dropped and counted, as train.py drops them)
  3. teacher-force --ckpt on them (model/logprobs.py): l = mean NLL per target token of each record
  4. per task and over all records: l's mean and max and the largest single-token NLL, in
     score.py's _stats.json layout (scorer "gold", every record "selected"), so the report
     compares l across buffers

The file's fields: README, "drift.py — the per-update KL that bounds forgetting".
"""
from pathlib import Path

from common.cli import Parser, int_at_least, main_cli

# ---- defaults (each has a flag below) ------------------------------------------------------------
MAX_LEN = 2048   # pairs longer than this are dropped, as in training
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True,
                   help="checkpoint directory (HF layout, with tokenizer + chat template)")
    p.add_argument("--buffer", required=True,
                   help="replay buffer JSONL with prompt, response and task per record")
    p.add_argument("--out", default=None,
                   help="output JSON (default: <buffer stem>_stats.json next to --buffer)")
    p.add_argument("--max-len", type=int_at_least(1), default=MAX_LEN, help="drop longer pairs, as "
                   "train.py (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if buffer_nll.py did not write it")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from kernels import retain_freed_memory
    retain_freed_memory()  # large tensors reuse freed memory, not fresh pages every step
    import torch

    from common.jsonl import read_records
    from common.outputs import check_output, write_json
    from model.checkpoint import load_model
    from model.logprobs import response_stats
    from model.tokenizer import ChatTokenizer
    from score import nll_stats, stats_path

    ckpt, buffer_path = Path(args.ckpt), Path(args.buffer)
    tok = ChatTokenizer.from_dir(ckpt)
    records = read_records(buffer_path, required=("prompt", "response", "task"),
                           types={"prompt": (str, list)})  # a list: a chat prompt's
                                                           # turns (data/manifest.py)
    out_path = check_output(Path(args.out) if args.out else stats_path(buffer_path), "buffer-stats",
                            args.overwrite, "--out")

    # 1-2. the pairs as training sees them
    seqs, kept, dropped = [], [], 0
    for r in records:
        ids, labels = tok.encode_sft(r["prompt"], r["response"])
        if len(ids) > args.max_len:
            dropped += 1
            continue
        targets = [t for t, lab in enumerate(labels) if lab != -100]
        seqs.append((ids[:targets[0]], ids[targets[0]:targets[-1] + 1]))
        kept.append(r)

    # 3. teacher-forced log-probs under the checkpoint
    cuda = torch.cuda.is_available()
    model = load_model(ckpt, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    stats = response_stats(model, seqs, progress=not args.quiet, desc="buffer nll")
    scored = [{"task": r["task"], "logprobs": s["logprobs"]} for r, s in zip(kept, stats)]

    # 4. score.py's layout
    tasks = list(dict.fromkeys(r["task"] for r in scored))
    summary = {"scorer": "gold", "select": None, "budget": len(records), "spearman_ru_sc": None,
               "dropped_overlong": dropped,
               "tasks": {t: {"n": sum(r["task"] == t for r in scored), "spearman_ru_sc": None,
                             "selected": nll_stats([r for r in scored if r["task"] == t]),
                             "rejected": None}
                         for t in tasks},
               "all": {"selected": nll_stats(scored), "rejected": None}}
    write_json(out_path, summary, kind="buffer-stats")
    print("| task | n | NLL/token mean | max | max single token |")
    print("|---|---:|---:|---:|---:|")
    for t, s in [*((t, summary["tasks"][t]["selected"]) for t in tasks),
                 ("all", summary["all"]["selected"])]:
        fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
        print(f"| {t} | {s['n']} | {fmt(s['nll_mean'])} | {fmt(s['nll_max'])} | "
              f"{fmt(s['token_nll_max'])} |")
    print(f"wrote {out_path} ({len(kept)} records, {dropped} over {args.max_len} tokens dropped)")
    return out_path


if __name__ == "__main__":
    main_cli(main, "buffer_nll.py")
