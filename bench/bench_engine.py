"""The native engine on a rollout mix, against the engine of another checkout and Hugging Face `generate`.

    python bench/bench_engine.py --model smollm2 --threads 2 [--before DIR] [--prompts 256] [--batch-size 32]
        [--before-batch-size N] [--max-new-tokens 64] [--repeats 3] [--fixed] [--no-hf]

The mix: training prompts of all eight embedded tasks in turn (data/embedded.py; short letter answers next to
summaries, code and simplifications, as TRACE mixes them), chat-templated, greedy, stop at end-of-turn, at most
--max-new-tokens each. --fixed instead: the first --batch-size prompts, exactly --max-new-tokens tokens each, no stop
(the batch-32 row of bench_generate.py). Each engine runs in a process of its own (the model loaded, one warm-up on
4 prompts, then the timed call), the engines alternating, median of --repeats: this checkout's engine, --before's
(e.g. a `git worktree` of an earlier commit: its model.generate.generate is imported from there), and HF `generate`
(batches of --batch-size prompts sorted by length, left-padded; a batch runs until its last row stops). Reports new
tokens/s and the time to drain, and how many greedy responses equal --before's (log-prob max |diff| over those).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def checkpoint(name: str) -> Path:
    sys.path.insert(0, str(REPO))
    if name == "tiny":
        from model.base import ensure_base
        return ensure_base("tiny")
    from model.import_gguf import ensure_smollm2
    return ensure_smollm2()


def mix_prompts(ckpt: Path, n: int) -> tuple[list, list]:
    from data.embedded import generate_task
    from data.tasks import TASK_ORDER
    from model.tokenizer import ChatTokenizer
    tok = ChatTokenizer.from_dir(ckpt)
    per_task = [generate_task(t, -(-n // len(TASK_ORDER)), seed=0) for t in TASK_ORDER]
    exs = [per_task[i % len(TASK_ORDER)][i // len(TASK_ORDER)] for i in range(n)]
    return [tok.prompt_ids(ex["prompt"]) for ex in exs], sorted(tok.stop_ids)


def worker(args):
    """One engine, one process: load, warm up, time one call; results as JSON on stdout."""
    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.root))
    job = json.loads(Path(args.job).read_text())
    prompts, stop, n_new, bs = job["prompts"], job["stop_ids"], job["max_new_tokens"], job["batch_size"]
    from kernels import retain_freed_memory
    retain_freed_memory()
    if args.worker == "hf":
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.float32).eval()

        def run(ps):
            out = []
            order = sorted(range(len(ps)), key=lambda i: -len(ps[i]))
            res = {}
            for s in range(0, len(order), bs):
                idx = order[s:s + bs]
                P = max(len(ps[i]) for i in idx)
                ids = torch.zeros(len(idx), P, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, i in enumerate(idx):
                    ids[r, P - len(ps[i]):] = torch.tensor(ps[i])
                    mask[r, P - len(ps[i]):] = 1
                kw = dict(min_new_tokens=n_new) if job["fixed"] else dict(eos_token_id=stop)
                with torch.inference_mode():
                    gen = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                                      pad_token_id=0, **kw)[:, P:].tolist()
                for i, g in zip(idx, gen):
                    cut = next((j + 1 for j, t in enumerate(g) if t in stop), len(g)) if not job["fixed"] else len(g)
                    res[i] = {"token_ids": g[:cut], "logprobs": []}
            out = [res[i] for i in range(len(ps))]
            return out
    else:
        from model.checkpoint import load_model
        from model.generate import generate
        model = load_model(job["ckpt"])

        def run(ps):
            return generate(model, ps, temperature=0.0, max_new_tokens=n_new, stop_ids=() if job["fixed"] else stop,
                            batch_size=bs, progress=False)
    run(prompts[:4])
    t0 = time.perf_counter()
    outs = run(prompts)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "outs": [{"token_ids": o["token_ids"], "logprobs": o["logprobs"]}
                                                   for o in outs]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--before", type=Path, help="another checkout whose engine to compare with (e.g. a worktree)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--before-batch-size", type=int, help="--before's batch size (default: --batch-size), e.g. each "
                                                         "engine at its own default")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fixed", action="store_true", help="fixed lengths: --batch-size prompts, no stop")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    ckpt = checkpoint(args.model)
    prompts, stop = mix_prompts(ckpt, args.batch_size if args.fixed else args.prompts)
    job = Path(tempfile.mkdtemp()) / "job.json"
    job.write_text(json.dumps(dict(ckpt=str(ckpt), prompts=prompts, stop_ids=stop, max_new_tokens=args.max_new_tokens,
                                   batch_size=args.batch_size, fixed=args.fixed)))
    engines = [("after", "native", REPO)] + ([("before", "native", args.before.resolve())] if args.before else []) \
        + ([] if args.no_hf else [("HF generate", "hf", REPO)])
    results = {name: [] for name, _, _ in engines}
    before_job = job
    if args.before and args.before_batch_size:
        before_job = job.with_name("before.json")
        before_job.write_text(json.dumps({**json.loads(job.read_text()), "batch_size": args.before_batch_size}))
    for r in range(args.repeats):
        for name, kind, root in engines:
            cmd = [sys.executable, __file__, "--worker", kind, "--root", str(root), "--job",
                   str(before_job if name == "before" else job),
                   "--threads", str(args.threads)]
            res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root).stdout
                             .strip().splitlines()[-1])
            results[name].append(res)
            n_tok = sum(len(o["token_ids"]) for o in res["outs"])
            print(f"repeat {r}: {name}: {res['seconds']:.2f} s, {n_tok} new tokens", flush=True)

    print(f"\n{args.model}, fp32, {args.threads} threads, {len(prompts)} prompts ("
          f"{'fixed: ' + str(args.max_new_tokens) + ' new tokens each, no stop' if args.fixed else 'rollout mix of the eight embedded tasks, greedy, stop at end-of-turn, <= ' + str(args.max_new_tokens) + ' new tokens'}), "
          f"batch size {args.batch_size}"
          + (f" (before: {args.before_batch_size})" if args.before and args.before_batch_size else "")
          + f", median of {args.repeats} alternated runs\n")
    print("| engine | time to drain | new tokens | new tokens/s | vs after |")
    print("|---|---:|---:|---:|---:|")
    t_after = statistics.median(x["seconds"] for x in results["after"])
    for name, _, _ in engines:
        t = statistics.median(x["seconds"] for x in results[name])
        n_tok = sum(len(o["token_ids"]) for o in results[name][0]["outs"])
        print(f"| {name} | {t:.2f} s | {n_tok} | {n_tok / t:.1f} | {t / t_after:.2f}x the time |")
    if args.before:
        a, b = results["after"][0]["outs"], results["before"][0]["outs"]
        same = [i for i in range(len(a)) if a[i]["token_ids"] == b[i]["token_ids"]]
        diff = max((abs(x - y) for i in same for x, y in zip(a[i]["logprobs"], b[i]["logprobs"])), default=0.0)
        print(f"\ngreedy responses equal to before's: {len(same)}/{len(a)}; log-prob max |diff| over them {diff:.2e}")
    if "HF generate" in results:
        a, h = results["after"][0]["outs"], results["HF generate"][0]["outs"]
        print(f"greedy responses equal to HF generate's: {sum(x['token_ids'] == y['token_ids'] for x, y in zip(a, h))}"
              f"/{len(a)}")
    print(f"\ncommand: python bench/bench_engine.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
