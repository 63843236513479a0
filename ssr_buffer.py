"""Self-Synthesized Rehearsal, steps 2-3 (Huang et al. 2024, sections 3.2-3.3): the rehearsal buffer
after a stage, from the prior tasks' synthetic inputs (synthesize.py) and the latest checkpoint.

    python ssr_buffer.py --ckpt runs/stage2 --synth synth/C-STANCE,synth/FOMC --budget 50 \
                         --out buffer.jsonl

  1. read each prior task's synthetic inputs and their embeddings
  2. per task, its share of the budget (--budget split evenly, as replay's; or --task-budgets
     T=K,...), chosen by K-means over the L2-normalised embeddings (methods/ssr.py: each cluster its
     share, closest to the centroid)
  3. the latest checkpoint answers the chosen inputs with its chat template, greedily (the
     official refinement)
  4. write them as SFT examples (source "ssr"); an answer that makes the example longer than
     --max-len is dropped (train.py would drop it), and said

The buffer's fields: README, "Methods (`methods/`)", SSR's paragraph.
"""
import argparse
import json
from pathlib import Path

from common.cli import ENGINE_HELP, Parser, float_in, int_at_least, main_cli

CLUSTERS = 20
MAX_NEW_TOKENS = 512
MAX_LEN = 2048


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True,
                   help="the latest checkpoint: it answers the chosen inputs")
    p.add_argument("--synth", required=True, help="comma-separated synthesize.py output "
                                                  "directories, one per task")
    p.add_argument("--budget", type=int_at_least(0),
                   help="total buffer size, split evenly over the tasks")
    p.add_argument("--task-budgets", help="TASK=K,... instead: each task's own count")
    p.add_argument("--clusters", type=int_at_least(1), default=CLUSTERS,
                   help="K-means clusters per task")
    p.add_argument("--temperature", type=float_in(0), default=0.0,
                   help="answering temperature (0: greedy)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=MAX_NEW_TOKENS)
    p.add_argument("--max-len", type=int_at_least(2), default=MAX_LEN,
                   help="drop longer examples, as training")
    p.add_argument("--seed", type=int, default=0, help="K-means start and sampling seed")
    p.add_argument("--engine", default="auto", choices=["auto", "native", "vllm"], help=ENGINE_HELP)
    p.add_argument("--tp", type=int_at_least(1), default=1, help="vLLM tensor-parallel size")
    p.add_argument("--out", required=True, help="the buffer (JSONL)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if (args.budget is None) == (args.task_budgets is None):
        p.error("give one of --budget and --task-budgets")
    return args


def budgets(args, available: dict) -> dict:
    """Task -> examples to keep (replay's rule: data.replay.replay_counts)."""
    from common.errors import UserError
    from data.replay import replay_counts
    if args.budget is not None:
        return replay_counts({"total": args.budget}, available)
    from score import parse_task_budgets

    def refuse(message):
        raise UserError(message)
    per = parse_task_budgets(args.task_budgets, refuse)
    unknown = sorted(set(per) - set(available))
    if unknown:
        raise UserError(f"--task-budgets: {', '.join(unknown)} has no synthetic inputs in --synth")
    return replay_counts({"per_task": {t: per.get(t, 0) for t in available}}, available)


def main(argv=None):
    args = parse_args(argv)
    from safetensors.torch import load_file
    from common.errors import InputError
    from common.jsonl import loads_strict, read_records, read_text
    from common.outputs import check_output, write_jsonl
    from methods.ssr import cluster_select
    from engine.sampling import generate, resolve_engine
    from model.tokenizer import ChatTokenizer

    out = check_output(Path(args.out), "buffer", False)
    tok = ChatTokenizer.from_dir(args.ckpt)
    # 1. each task's synthetic inputs and embeddings
    synth = {}
    for d in map(Path, args.synth.split(",")):
        info = loads_strict(read_text(d / "info.json"), d / "info.json")
        records = (read_records(d / "synth.jsonl", required=("task", "idx", "prompt"),
                                types={"idx": int})
                   if info["kept"] else [])
        emb = load_file(d / "embeddings.safetensors")["embeddings"]
        if emb.shape[0] != len(records):
            raise InputError(f"{d}: {len(records)} synthetic inputs but {emb.shape[0]} embeddings")
        synth[info["task"]] = (records, emb)
    # 2. the budget per task, chosen by clusters
    counts = budgets(args, {t: len(r) for t, (r, _) in synth.items()})
    chosen = [synth[t][0][i] for t, (r, emb) in synth.items()
              for i in cluster_select(emb, counts[t], args.clusters, args.seed)]
    # 3. the latest checkpoint answers them
    engine = resolve_engine(args.engine)
    outs = generate(args.ckpt, [tok.prompt_ids(r["prompt"]) for r in chosen],
                    temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    seed=args.seed, engine=engine, tp=args.tp, stop_ids=tok.stop_ids,
                    progress=not args.quiet)
    from engine import workers
    if not workers.is_main():  # a data-parallel worker (engine/workers.py): rank 0 writes
        return out
    # 4. the buffer
    buffer, dropped = [], 0
    for r, o in zip(chosen, outs):
        response = tok.decode_response(o["token_ids"])
        if tok.sft_length(r["prompt"], response) > args.max_len:
            dropped += 1
            continue
        buffer.append({"task": r["task"], "idx": r["idx"], "prompt": r["prompt"],
                       "response": response, "source": "ssr"})
    write_jsonl(out, buffer, kind="buffer")
    print(f"ssr_buffer: {len(buffer)} examples ({json.dumps(counts)}; {dropped} over --max-len "
          f"dropped) -> {out}")
    return out


if __name__ == "__main__":
    main_cli(main, "ssr_buffer.py")
