"""Engine vs trainer log-probs in bf16: the gap with a bf16 and with an fp32 LM head (the RL
frameworks' known source of engine/trainer mismatch), and what each head costs.

    python bench/bench_logprob_gap.py [--ckpt DIR] [--device cuda] [--prompts 64]
        [--max-new-tokens 32]

The model (default: the tiny base, model.base; it has learned the embedded tasks, so its
distributions are peaked as a real model's are) is loaded in bf16 (the GPU's sampling dtype) and in
fp32. The engine samples --prompts training prompts of the eight embedded tasks at temperature 0.1
with each head; every sampled token's raw log-prob is then compared with (a) the trainer's
teacher-forced pass, model.logprobs.response_stats on the bf16 model (bf16 hidden states, fp32
logits: what rollout.py --check-logprobs and OPR-SC's buffer statistics use), and (b) the exact fp32
model. Prints mean and max |diff| per token and the engine's wall time with each head.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.embedded import generate_task  # noqa: E402
from data.tasks import TASK_ORDER  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from engine.engine import Engine  # noqa: E402
from model.logprobs import response_stats  # noqa: E402
from model.tokenizer import ChatTokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", help="checkpoint directory (default: the tiny base)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    if args.ckpt:
        ckpt = Path(args.ckpt)
    else:
        from model.base import ensure_base
        ckpt = ensure_base("tiny")
    tok = ChatTokenizer.from_dir(ckpt)
    per_task = -(-args.prompts // len(TASK_ORDER))
    exs = [ex for t in TASK_ORDER for ex in generate_task(t, per_task, seed=0)][:args.prompts]
    prompts = [tok.prompt_ids(ex["prompt"]) for ex in exs]
    bf16 = load_model(ckpt, device=args.device, dtype=torch.bfloat16)
    fp32 = load_model(ckpt, device=args.device, dtype=torch.float32)
    print(f"{ckpt.name}, {args.device}, {len(prompts)} prompts, temperature 0.1, "
          f"<= {args.max_new_tokens} new tokens\n")
    print("| LM head | engine time | tokens | vs trainer (bf16 states, fp32 logits): "
          "mean / max abs diff | vs fp32 model: mean / max |")
    print("|---|---:|---:|---|---|")
    for head_fp32 in (False, True):
        engine = Engine(bf16, max_seqs=64, lm_head_fp32=head_fp32)
        # every prompt, so that the warm-up captures the CUDA graph of each batch bucket
        # the timed call meets
        engine.run(prompts, temperature=0.1, max_new_tokens=4, stop_ids=tok.stop_ids,
                   progress=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = engine.run(prompts, temperature=0.1, max_new_tokens=args.max_new_tokens,
                          stop_ids=tok.stop_ids, seed=0, progress=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        seqs = [(p, o["token_ids"]) for p, o in zip(prompts, outs)]
        got = torch.tensor([x for o in outs for x in o["logprobs"]])
        cells = []
        for ref in (bf16, fp32):
            want = torch.tensor([x for s in response_stats(ref, seqs, packed=False)
                                 for x in s["logprobs"]])
            d = (got - want).abs()
            cells.append(f"{d.mean().item():.2e} / {d.max().item():.2e}")
        print(f"| {'fp32' if head_fp32 else 'bf16'} | {seconds:.2f} s | {len(got)} | {cells[0]} | "
              f"{cells[1]} |")
    print(f"\ncommand: python bench/bench_logprob_gap.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
