"""Self-Synthesized Rehearsal, step 1 (Huang et al. 2024, ACL, section 3.1): the base model writes
synthetic inputs of one task by in-context learning from a few of its stored demonstrations; no
other training prompt is read.

    # run.py runs it once per task and seed
    python synthesize.py --ckpt BASE --data ROOT --tasks FOMC --out synth/

  1. load the task's training split with training's subsample and over-long filter, and draw --demos
     of its examples (seeded): the only prompts of this task that SSR ever stores
  2. an in-context prompt per ordered pair of distinct demonstrations (at most --prompts of
     them); --template raw (the official code's "vanilla" template, for base models): raw
     text, no chat template,
         Input: {x1}\nOutput: {y1}\n\nInput: {x2}\nOutput: {y2}\n\nInput:
     --template chat (for instruction-tuned models, which end a raw text at once): the same pairs
     in a user turn after CHAT_HEADER, the assistant's answer expected as "Input: ...\nOutput:
     ..." (EasyCL's form)
  3. --samples completions of each at --temperature (each with a seed of its
     own), <= --max-new-tokens; no top-p, no repetition penalty (the official code's 0.6 and 1.2:
     the engines sample at a temperature alone)
  4. parse each completion into (input, output) pairs (split on "Input:", then "Output:");
     keep pairs with both parts non-empty, whose chat-templated input + output fit --max-len,
     whose input is no demonstration's, the first of each distinct input; a pair cut by the
     length cap is dropped
  5. embed each kept input: the base model's final-normed hidden states, averaged over its
     chat-templated prompt tokens (the paper clusters SimCSE embeddings; the model's own are the
     substitute, no second model)
  6. write the kept inputs, their embeddings and the demonstrations' record numbers
ssr_buffer.py then selects and answers these inputs with the latest checkpoint.

Its defaults and files: README, "Methods (`methods/`)", SSR's paragraph.
"""
import argparse
import itertools
import random
import shutil
from pathlib import Path

from common.cli import ENGINE_HELP, Parser, float_in, int_at_least, main_cli
from data.manifest import add_task_spec, data_root, use_manifest_from_argv
from data.tasks import task_names

DEMOS = 20          # stored demonstrations per task (official: 1% of 2,000)
SHOTS = 2           # demonstrations per in-context prompt (official --n_shots 2)
PROMPTS = 380       # in-context prompts per task (official: every ordered pair
                    # of 20 demonstrations)
SAMPLES = 3         # completions per prompt (official: 3)
TEMPERATURE = 0.9   # official
TEMPLATE = "raw"    # official: raw text for a base model; chat: in a user turn (an
                    # instruction-tuned model)
CHAT_HEADER = ("Create a new example of the task shown below: its Input, then its Output, in the "
               "same format.")
MAX_NEW_TOKENS = 512
MAX_LEN = 2048
MAX_TRAIN = 5000


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", required=True, help="the base model (HF checkpoint directory)")
    p.add_argument("--data", help="TRACE root (default: the embedded benchmark)")
    p.add_argument("--tasks", required=True, type=task_names,
                   help="the one task whose inputs to synthesize")
    p.add_argument("--out", required=True,
                   help="output directory (synth.jsonl, embeddings.safetensors)")
    p.add_argument("--demos", type=int_at_least(2), default=DEMOS,
                   help="stored demonstrations of the task")
    p.add_argument("--shots", type=int_at_least(1), default=SHOTS,
                   help="demonstrations per in-context prompt")
    p.add_argument("--prompts", type=int_at_least(1), default=PROMPTS,
                   help="in-context prompts (at most)")
    p.add_argument("--samples", type=int_at_least(1), default=SAMPLES,
                   help="completions per prompt")
    p.add_argument("--temperature", type=float_in(0), default=TEMPERATURE)
    p.add_argument("--template", choices=["raw", "chat"], default=TEMPLATE,
                   help="raw text (a base model's continuation) or a chat user turn (an "
                        "instruction-tuned model)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=MAX_NEW_TOKENS)
    p.add_argument("--max-len", type=int_at_least(2), default=MAX_LEN,
                   help="over-long filter, as in training")
    p.add_argument("--max-train", type=int_at_least(1), default=MAX_TRAIN,
                   help="per-task training subsample")
    p.add_argument("--seed", type=int, default=0, help="demonstrations' draw and sampling seed")
    p.add_argument("--engine", default="auto", choices=["auto", "native", "vllm"], help=ENGINE_HELP)
    p.add_argument("--tp", type=int_at_least(1), default=1, help="vLLM tensor-parallel size")
    add_task_spec(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    use_manifest_from_argv(argv)
    args = p.parse_args(argv)
    if len(args.tasks) != 1:
        p.error(f"--tasks: one task per call (got {','.join(args.tasks)}): each task's inputs are "
                f"a step of their own")
    args.task = args.tasks[0]
    return args


def icl_prompt(demos, template: str = "raw") -> str:
    """Step 2's text: each demonstration as an Input/Output pair, then (raw) an open Input, or
    (chat) the instruction first, for a user turn."""
    pairs = "".join(f"Input: {d.prompt}\nOutput: {d.answer}\n\n" for d in demos)
    return pairs + "Input:" if template == "raw" else f"{CHAT_HEADER}\n\n{pairs.rstrip()}"


def parse_pairs(text: str, truncated: bool) -> list[tuple[str, str]]:
    """Step 4's parse of a completion (the text after the prompt's last "Input:") -> [(input,
    output)]: the pieces between "Input:" markers, each split at its first "Output:"; the last piece
    is dropped when the length cap cut it."""
    pieces = text.split("Input:")
    if truncated:
        pieces = pieces[:-1]
    pairs = []
    for piece in pieces:
        x, sep, y = piece.partition("Output:")
        x, y = x.strip(), y.strip()
        if sep and x and y:
            pairs.append((x, y))
    return pairs


def embed(model, seqs: list[list[int]]):
    """Mean of the final-normed hidden states over each sequence's tokens -> [N, H] fp32."""
    import torch
    out = []
    with torch.no_grad():
        for ids in seqs:
            h = model(torch.tensor([ids]), torch.arange(len(ids))[None], return_hidden=True)[0]
            out.append(h.float().mean(0))
    return torch.stack(out) if out else torch.zeros(0, model.cfg.hidden_size)


def main(argv=None):
    args = parse_args(argv)
    from common.outputs import check_output, claim_dir, write_json, write_jsonl
    from data.trace import load_filtered
    from model.checkpoint import load_model, replace_dir
    from engine.sampling import generate, resolve_engine
    from model.tokenizer import ChatTokenizer
    from safetensors.torch import save_file

    out = check_output(Path(args.out), "synth", False)
    tok = ChatTokenizer.from_dir(args.ckpt)
    engine = resolve_engine(args.engine)

    # 1. the stored demonstrations
    examples, _ = load_filtered(data_root(args), [args.task], "train", tok.sft_length, args.max_len,
                                max_train=args.max_train)
    demos = random.Random(args.seed).sample(examples, min(args.demos, len(examples)))
    # 2. in-context prompts over ordered tuples of distinct demonstrations, the
    #    first --prompts of them
    tuples = list(itertools.islice(itertools.permutations(range(len(demos)), args.shots),
                                   args.prompts))
    texts = [icl_prompt([demos[i] for i in t], args.template) for t in tuples]
    encode = tok.encode if args.template == "raw" else tok.prompt_ids
    prompts = [encode(t) for t in texts for _ in range(args.samples)]
    print(f"synthesize: {args.task}: {len(demos)} demonstrations, {len(tuples)} prompts x "
          f"{args.samples} samples, engine={engine}, T={args.temperature}")
    # 3. the completions
    outs = generate(args.ckpt, prompts, temperature=args.temperature,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, engine=engine, tp=args.tp,
                    stop_ids=tok.stop_ids, progress=not args.quiet)
    from engine import workers
    if not workers.is_main():  # a data-parallel worker (engine/workers.py): rank 0 writes
        return out
    # 4. parse and filter
    seen = {d.prompt for d in demos}
    records = []
    for o in outs:
        for x, y in parse_pairs(tok.decode_response(o["token_ids"]),
                                o["finish_reason"] == "length"):
            if x not in seen and tok.sft_length(x, y) <= args.max_len:
                seen.add(x)
                records.append({"task": args.task, "idx": len(records), "prompt": x,
                                "icl_output": y})
    # 5. embeddings of the inputs, by the same base model
    import torch
    model = load_model(args.ckpt, "cuda" if torch.cuda.is_available() else "cpu")
    emb = embed(model, [tok.prompt_ids(r["prompt"]) for r in records]).cpu().contiguous()
    # 6. both files at once
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    claim_dir(tmp, "synth")
    write_jsonl(tmp / "synth.jsonl", records)
    save_file({"embeddings": emb}, tmp / "embeddings.safetensors")
    write_json(tmp / "info.json",
               {"task": args.task, "demos": sorted(d.idx for d in demos), "prompts": len(tuples),
                "completions": len(outs), "kept": len(records)})
    replace_dir(tmp, out)
    print(f"synthesize: {args.task}: {len(records)} synthetic inputs from {len(outs)} completions "
          f"-> {out}")
    return out


if __name__ == "__main__":
    main_cli(main, "synthesize.py")
