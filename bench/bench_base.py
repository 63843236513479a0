"""What the tiny base can do: greedy exact match per kind of its instruction mixture, on
held-out mixture prompts.

    python bench/bench_base.py                  # the default base (model/base.py's TINY_TUNE)
    python bench/bench_base.py --n-examples 16000 \
        --out DIR                               # a base tuned on another mixture size, built in DIR

The default base is the one run.py uses ($OPR_CACHE). With --n-examples (or --epochs) another base
is built into --out with the same recipe otherwise (model.base.build_tiny: 1 thread, the CPU pins),
and its build time printed. The prompts come from a mixture stream of their own (seed "bench_base"),
so they are not the training examples (a prompt can still repeat one by chance: the mixture's word
lists are short). Prints one row per kind: n, exact matches, and one wrong answer as an example.
"""
import argparse
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = [("Repeat these words", "repeat"), ("Reverse the order", "reverse"),
         ("Write these words in capital", "upper"), ("How many words", "count"),
         ("What is the last word", "last word"), ("Is the last word", "last-word class"),
         ("Which word is", "which option"), ("What comes after", "what comes after")]


def kind_of(prompt: str) -> str:
    return next(name for prefix, name in KINDS if prompt.startswith(prefix))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-prompts", type=int, default=400,
                   help="held-out mixture prompts (default 400)")
    p.add_argument("--n-examples", type=int,
                   help="build a base tuned on this many mixture examples (default: use "
                        "run.py's base, model/base.py's TINY_TUNE)")
    p.add_argument("--epochs", type=int,
                   help="build a base tuned for this many epochs (default: TINY_TUNE's)")
    p.add_argument("--out",
                   help="where --n-examples/--epochs build their base (required with them)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    from data.embedded import _mixture_example
    from model import base
    from engine.sampling import generate
    from model.tokenizer import ChatTokenizer
    torch.set_num_threads(args.threads)

    if args.n_examples is None and args.epochs is None:
        ckpt = base.ensure_base("tiny")
    else:
        if not args.out:
            p.error("--n-examples/--epochs build a base of their own: give --out DIR")
        ckpt = Path(args.out)
        if not (ckpt / "config.json").exists():
            tune = dict(base.TINY_TUNE, n_examples=args.n_examples or base.TINY_TUNE["n_examples"],
                        epochs=args.epochs or base.TINY_TUNE["epochs"])
            t0 = time.perf_counter()
            base.build_tiny(ckpt, tune)
            print(f"built {ckpt} with {tune} in {time.perf_counter() - t0:.1f} s")
    tok = ChatTokenizer.from_dir(ckpt)
    rng = random.Random("embedded/mixture/bench_base")
    examples = [_mixture_example(rng) for _ in range(args.n_prompts)]
    outs = generate(ckpt, [tok.prompt_ids(ex["prompt"]) for ex in examples], temperature=0.0,
                    max_new_tokens=32, engine="native", batch_size=64, stop_ids=tok.stop_ids,
                    progress=False)
    hits, n, wrong = defaultdict(int), defaultdict(int), {}
    for ex, o in zip(examples, outs):
        k = kind_of(ex["prompt"])
        pred = tok.decode_response(o["token_ids"]).strip()
        n[k] += 1
        hits[k] += pred == ex["answer"]
        if pred != ex["answer"]:
            wrong.setdefault(k, (ex["answer"], pred))
    print(f"base {ckpt}: greedy exact match on {args.n_prompts} held-out mixture prompts")
    print("| kind | n | exact | a wrong answer (gold -> predicted) |")
    print("|---|---:|---:|---|")
    for _, k in KINDS:
        ex = f"{wrong[k][0]!r} -> {wrong[k][1]!r}" if k in wrong else ""
        print(f"| {k} | {n[k]} | {hits[k]} | {ex} |")
    print(f"| all | {sum(n.values())} | {sum(hits.values())} | |")


if __name__ == "__main__":
    main()
