"""The engine's first call in a fresh process (what every generating step of run.py pays: each is a
process of its own) and its later calls, with this tree's CPU paths switched off one at a time:
bucketed row counts for the packed products (transformer.row_bucket), the elementwise work in C
(packed_products' _FUSED), packed products at all. Each mode runs in a new process, the modes
alternated, --runs rounds; seconds per engine call, median over rounds.

    python bench/bench_first_call.py --ckpt STEP/ckpt --data EMBEDDED_ROOT --prompts 128 \
        --max-new-tokens 32
    python bench/bench_first_call.py --ckpt ~/.cache/opr/smollm2-135m-instruct \
        --data ../shared/trace \\
        --tasks FOMC,NumGLUE-cm,NumGLUE-ds --prompts 48 --max-new-tokens 48 --calls 2
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("tree", "no-bucket", "no-fuse", "plain")
TASKS = "C-STANCE,FOMC,MeetingBank,Py150,ScienceQA,NumGLUE-cm,NumGLUE-ds,20Minuten"


def child(args):
    """One process: `mode`'s engine over the prompts, --calls times; prints JSON (seconds,
    tokens, log-prob sum)."""
    import contextlib
    import io
    import time

    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    from data.trace import load_filtered
    from model import transformer
    from engine.engine import Engine
    from engine.sampling import load_native
    from model.tokenizer import ChatTokenizer
    if args.mode == "no-bucket":
        transformer.row_bucket = lambda m: m
    if args.mode == "no-fuse":
        enter = transformer.packed_products.__enter__

        def no_fuse(self):
            enter(self)
            transformer._FUSED = False
        transformer.packed_products.__enter__ = no_fuse
    tok = ChatTokenizer.from_dir(args.ckpt)
    with contextlib.redirect_stdout(io.StringIO()):
        exs, _ = load_filtered(Path(args.data), args.tasks.split(","), "test", tok.sft_length, 512,
                               limit=args.prompts)
    prompts = [tok.prompt_ids(e.prompt) for e in exs]
    model = load_native(args.ckpt)
    secs = []
    for _ in range(args.calls):
        t = time.perf_counter()
        engine = Engine(model, max_seqs=64, pack=args.mode != "plain")
        outs = engine.run(prompts, temperature=0.1, max_new_tokens=args.max_new_tokens,
                          stop_ids=tok.stop_ids, progress=False)
        secs.append(time.perf_counter() - t)
    print(json.dumps({"seconds": secs, "tokens": sum(len(o["token_ids"]) for o in outs),
                      "logprob_sum": sum(sum(o["logprobs"]) for o in outs),
                      "responses": [o["token_ids"] for o in outs]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data", required=True, help="a TRACE-layout root with <Task>/test.json")
    ap.add_argument("--tasks", default=TASKS)
    ap.add_argument("--prompts", type=int, default=128, help="test prompts per task")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--calls", type=int, default=3,
                    help="engine calls per process (the first is the step's)")
    ap.add_argument("--runs", type=int, default=2, help="rounds of every mode, alternated")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (run.py's steps: 1)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    modes = args.modes.split(",")
    got = {m: [] for m in modes}
    for _ in range(args.runs):
        for m in modes:
            cmd = [sys.executable, __file__, "--mode", m] + [a for a in sys.argv[1:]]
            got[m].append(json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                    text=True).stdout))
    ref = got[modes[0]][0]
    print(f"{args.ckpt}: {args.prompts} prompts per task, <= {args.max_new_tokens} new "
          f"tokens, T 0.1, {args.threads} thread(s); median of {args.runs} processes per mode\n")
    print("| mode | first call, s | later calls, s | tokens | responses as the first mode's | "
          "log-prob sum |")
    print("|---|---:|---:|---:|---:|---:|")
    for m in modes:
        first = statistics.median(r["seconds"][0] for r in got[m])
        later = (statistics.median(s for r in got[m] for s in r["seconds"][1:])
                 if args.calls > 1 else float("nan"))
        same = sum(a == b for a, b in zip(got[m][0]["responses"], ref["responses"]))
        print(f"| {m} | {first:.3f} | {later:.3f} | {got[m][0]['tokens']} | "
              f"{same}/{len(ref['responses'])} | {got[m][0]['logprob_sum']:.6f} |")


if __name__ == "__main__":
    main()
