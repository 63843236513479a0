"""The native engine on a rollout mix, against the engine of another checkout, Hugging Face
`generate` and vLLM.

    python bench/bench_engine.py --model smollm2 [--ckpt DIR] --threads 2 [--before DIR]
        [--prompts 256] [--batch-size 32] [--before-batch-size N] [--max-new-tokens 64]
        [--repeats 3] [--fixed] [--no-hf] [--temperature T] [--trace DIR] [--vllm PYTHON]

The mix: training prompts of all eight embedded tasks in turn (data/embedded.py; short letter
answers next to summaries, code and simplifications, as TRACE mixes them), or with --trace the real
TRACE tasks found under DIR (e.g. ../shared/trace: FOMC, NumGLUE-cm, NumGLUE-ds) in turn,
chat-templated, stop at end-of-turn, at most --max-new-tokens each, greedy or at --temperature (OPR
samples at 0.1, SDFT at 1.0; the native engines with seed 0, so two native engines that draw alike
give the same tokens). --fixed instead: the first --batch-size prompts, exactly --max-new-tokens
tokens each, no stop (the batch-32 row of bench_generate.py). Each engine runs in a process of its
own (the model loaded, one warm-up on 4 prompts, then the timed call), the engines alternating,
median of --repeats: this checkout's engine, --before's (e.g. a `git worktree` of an earlier commit:
its engine.native.sample, or model.generate.generate before the rename, is imported from there), HF
`generate` (batches of --batch-size prompts sorted by length, left-padded; a batch runs until its
last row stops) and, with --vllm, vLLM run by that interpreter (engine.vllm_engine's settings on the
CPU backend: fp32, eager, its threads bound to the same cores). Reports the timed call's time to
drain and new tokens/s (sampled answers differ in length between engines: compare the rates), the
whole process's wall time (start-up, load, warm-up and the timed call), and how many responses equal
--before's (log-prob max |diff| over those).
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
    if name == "tiny":
        from model.base import ensure_base
        return ensure_base("tiny")
    from model.import_gguf import ensure_smollm2
    return ensure_smollm2()


def mix_prompts(ckpt: Path, n: int, trace: Path | None = None) -> tuple[list, list]:
    from model.tokenizer import ChatTokenizer
    tok = ChatTokenizer.from_dir(ckpt)
    if trace:
        from data.trace import read_trace_file
        per_task = [[{"prompt": q} for q, _ in read_trace_file(d / "train.json")]
                    for d in sorted(trace.iterdir()) if (d / "train.json").is_file()]
    else:
        from data.embedded import generate_task
        from data.tasks import TASK_ORDER
        per_task = [generate_task(t, -(-n // len(TASK_ORDER)), seed=0) for t in TASK_ORDER]
    exs = [per_task[i % len(per_task)][i // len(per_task)] for i in range(n)]
    return [tok.prompt_ids(ex["prompt"]) for ex in exs], sorted(tok.stop_ids)


def worker(args):
    """One engine, one process: load, warm up, time one call; results as JSON on stdout."""
    import torch
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.root))
    job = json.loads(Path(args.job).read_text())
    prompts, stop, n_new, bs = (job["prompts"], job["stop_ids"], job["max_new_tokens"],
                                job["batch_size"])
    if args.worker != "vllm":
        from kernels import retain_freed_memory
        retain_freed_memory()
    # run by --vllm's interpreter: the project's wrapper settings, on the CPU backend
    if args.worker == "vllm":
        import os
        # the engine process's threads (worker_env: not bound)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        from engine.sampler import row_keys
        from engine.vllm_engine import engine_env, llm_kwargs, sampling_params, worker_env
        import vllm
        t_start = time.perf_counter()
        with engine_env(worker_env(1, cpu=True)):
            llm = vllm.LLM(**llm_kwargs(vllm, job["ckpt"], tp=1, seed=0, cpu=True))
        startup = time.perf_counter() - t_start

        def run(ps):
            params = [sampling_params(vllm, temperature=job["temperature"], max_new_tokens=n_new,
                                      stop_ids=() if job["fixed"] else stop, seed=k)
                      for k in row_keys(len(ps), 0)]
            for sp in params if job["fixed"] else ():
                sp.min_tokens = n_new
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in ps], params, use_tqdm=False)
            return [{"token_ids": list(o.outputs[0].token_ids), "logprobs": [
                float(step[t].logprob)
                for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
                for o in outs]
    elif args.worker == "hf":
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            job["ckpt"], dtype=torch.float32).eval()

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
                if job["temperature"]:
                    kw.update(do_sample=True, temperature=job["temperature"], top_k=0)
                with torch.inference_mode():
                    gen = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                      pad_token_id=0, **{"do_sample": False, **kw})[:, P:].tolist()
                for i, g in zip(idx, gen):
                    cut = (next((j + 1 for j, t in enumerate(g) if t in stop), len(g))
                           if not job["fixed"] else len(g))
                    res[i] = {"token_ids": g[:cut], "logprobs": []}
            out = [res[i] for i in range(len(ps))]
            return out
    else:
        from model.checkpoint import load_model
        try:
            from engine.native import sample
        except ImportError:  # a --before checkout from before the rename
            from model.generate import generate as sample
        model = load_model(job["ckpt"])

        def run(ps):
            return sample(model, ps, temperature=job["temperature"], max_new_tokens=n_new, seed=0,
                          stop_ids=() if job["fixed"] else stop, batch_size=bs, progress=False)
    run(prompts[:4])
    t0 = time.perf_counter()
    outs = run(prompts)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds,
                      "outs": [{"token_ids": o["token_ids"], "logprobs": o["logprobs"]}
                               for o in outs]}))


def fp64_errors(ckpt, prompts, outs: dict) -> str:
    """|raw log-prob - fp64's| over every sampled token, per engine: the model in fp64, one
    forward per response."""
    import torch
    from model.checkpoint import load_model
    model = load_model(ckpt).double()
    lines = ["", "| engine | tokens | log-prob error vs fp64: median | p99 | max |",
             "|---|---:|---:|---:|---:|"]
    with torch.inference_mode():
        for name, o in outs.items():
            errs = []
            for p, r in zip(prompts, o):
                ids = list(p) + r["token_ids"]
                logits = model(torch.tensor(ids)[None],
                               torch.arange(len(ids))[None])[0, len(p) - 1:-1]
                exact = logits.log_softmax(-1).gather(
                    -1, torch.tensor(r["token_ids"])[:, None]).squeeze(1)
                errs.append((exact - torch.tensor(r["logprobs"], dtype=torch.float64)).abs())
            e = torch.cat(errs)
            lines.append(f"| {name} | {e.numel()} | {e.median():.2e} | {e.quantile(0.99):.2e} | "
                         f"{e.max():.2e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    ap.add_argument("--ckpt", type=Path,
                    help="a checkpoint instead of --model's, e.g. a trained stage's (the tiny "
                         "base itself answers the embedded tasks in a token or two)")
    ap.add_argument("--before", type=Path,
                    help="another checkout whose engine to compare with (e.g. a worktree)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--before-batch-size", type=int,
                    help="--before's batch size (default: --batch-size), "
                         "e.g. each engine at its own default")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fixed", action="store_true",
                    help="fixed lengths: --batch-size prompts, no stop")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate")
    ap.add_argument("--vllm",
                    help="a Python interpreter with vLLM (e.g. a venv's bin/python): vLLM as a "
                         "peer, on the CPU backend with the project's wrapper settings, eager")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--trace", type=Path,
                    help="a TRACE root: its tasks' training prompts instead of the embedded mix")
    ap.add_argument("--fp64", action="store_true",
                    help="each engine's raw log-probs against the model's own in fp64, "
                         "teacher-forced on that engine's responses (first repeat)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(REPO))
    ckpt = args.ckpt.resolve() if args.ckpt else checkpoint(args.model)
    prompts, stop = mix_prompts(ckpt, args.batch_size if args.fixed else args.prompts, args.trace)
    job = Path(tempfile.mkdtemp()) / "job.json"
    job.write_text(json.dumps(dict(ckpt=str(ckpt), prompts=prompts, stop_ids=stop,
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                   fixed=args.fixed, temperature=args.temperature)))
    engines = ([("after", "native", REPO)]
               + ([("before", "native", args.before.resolve())] if args.before else [])
               + ([] if args.no_hf else [("HF generate", "hf", REPO)])
               + ([("vLLM", "vllm", REPO)] if args.vllm else []))
    results = {name: [] for name, _, _ in engines}
    before_job = job
    if args.before and args.before_batch_size:
        before_job = job.with_name("before.json")
        before_job.write_text(json.dumps({**json.loads(job.read_text()),
                                          "batch_size": args.before_batch_size}))
    for r in range(args.repeats):
        for name, kind, root in engines:
            cmd = [args.vllm if kind == "vllm" else sys.executable, __file__, "--worker", kind,
                   "--root", str(root), "--job", str(before_job if name == "before" else job),
                   "--threads", str(args.threads)]
            t0 = time.perf_counter()
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root).stdout
            res = json.loads([line for line in out.splitlines()
                              if line.startswith('{"seconds"')][-1])  # vLLM logs after
            # start-up, load, warm-up and the timed call
            res["process_seconds"] = time.perf_counter() - t0
            results[name].append(res)
            n_tok = sum(len(o["token_ids"]) for o in res["outs"])
            print(f"repeat {r}: {name}: {res['seconds']:.2f} s, {n_tok} new tokens; whole process "
                  f"{res['process_seconds']:.1f} s", flush=True)

    print(f"\n{args.ckpt or args.model}, fp32, {args.threads} threads, {len(prompts)} prompts ("
          f"""{'fixed: ' + str(args.max_new_tokens) + ' new tokens each, no stop' if args.fixed
               else 'rollout mix of '
               + (str(args.trace) if args.trace else 'the eight embedded tasks')
               + (f', T {args.temperature}' if args.temperature else ', greedy')
               + ', stop at end-of-turn, <= ' + str(args.max_new_tokens) + ' new tokens'}), """
          f"batch size {args.batch_size}"
          + (f" (before: {args.before_batch_size})" if args.before and args.before_batch_size
             else "")
          + f", median of {args.repeats} alternated runs\n")
    print("| engine | time to drain | new tokens | new tokens/s | after's tokens/s over its | "
          "whole process | vs after |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    # sampled answers differ in length between engines: compare rates
    rate = {name: statistics.median(sum(len(o["token_ids"]) for o in x["outs"]) / x["seconds"]
                                    for x in results[name])
            for name, _, _ in engines}
    p_after = statistics.median(x["process_seconds"] for x in results["after"])
    for name, _, _ in engines:
        t = statistics.median(x["seconds"] for x in results[name])
        p = statistics.median(x["process_seconds"] for x in results[name])
        n_tok = sum(len(o["token_ids"]) for o in results[name][0]["outs"])
        print(f"| {name} | {t:.2f} s | {n_tok} | {rate[name]:.1f} | "
              f"{rate['after'] / rate[name]:.2f}x | {p:.1f} s | {p / p_after:.2f}x the time |")
    if args.before:
        a, b = results["after"][0]["outs"], results["before"][0]["outs"]
        same = [i for i in range(len(a)) if a[i]["token_ids"] == b[i]["token_ids"]]
        diff = max((abs(x - y) for i in same for x, y in zip(a[i]["logprobs"], b[i]["logprobs"])),
                   default=0.0)
        print(f"\nresponses equal to before's: {len(same)}/{len(a)}; "
              f"log-prob max |diff| over them {diff:.2e}")
    if args.fp64:
        print(fp64_errors(ckpt, prompts, {name: x[0]["outs"] for name, x in results.items()
                                          if name != "HF generate"}))
    if "HF generate" in results and not args.temperature:
        a, h = results["after"][0]["outs"], results["HF generate"][0]["outs"]
        print(f"greedy responses equal to HF generate's: "
              f"{sum(x['token_ids'] == y['token_ids'] for x, y in zip(a, h))}/{len(a)}")
    print(f"\ncommand: python bench/bench_engine.py {' '.join(sys.argv[1:])}")


if __name__ == "__main__":
    main()
