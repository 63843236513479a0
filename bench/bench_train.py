"""Training throughput on CPU: train.py (packed micro-batches; one CPU process runs its model
unwrapped, and --with-fsdp adds a run with it FSDP2-wrapped) vs Hugging Face `Trainer` in its two
stock setups — padded micro-batches (DataCollatorForSeq2Seq) and padding-free packing
(DataCollatorWithFlattening: one row per micro-batch, position ids restarting per document, which
transformers' SDPA path turns into a block-diagonal causal mask) — on the same model, records,
sequence-length limit and hyperparameters (fp32, AdamW lr 1e-5 betas (0.9, 0.999), no weight decay,
cosine, grad clip 1.0, same global batch). The step-1 training loss of each is printed too: the two
HF setups draw the same batches and must agree to float noise (a check that the padding-free path
computes the padded loss); train.py draws its own sample order, so its loss is close, not equal.

    python bench/bench_train.py                   # tiny base config + SmolLM2-135M, 1 thread
    python bench/bench_train.py --models tiny --threads 2 --repeats 5
    python bench/bench_train.py --threads 2 --repeats 3 \
        --with-compile --no-hf                    # compiled vs eager blocks
    python bench/bench_train.py --models smollm2 --threads 2 --repeats 3 \
        --with-lora --no-hf                       # LoRA vs full

--with-lora adds train.py --lora-rank 8 (TRACE's LoRA: alpha 32, dropout 0.1, q_proj and v_proj;
lr 1e-4); every train.py run also reports its process's peak resident memory (ru_maxrss: weights,
optimizer state, activations and the Python runtime).

All run as fresh subprocesses with OMP_NUM_THREADS=--threads, alternating, so a busy shared machine
slows both alike; we report medians over --repeats. Startup (imports, model load, tokenization) is
excluded: tokens/s is steady state, the tokens of optimizer steps 2..N over their wall time (ours:
per-step times from train.py's train_log.jsonl; HF: a callback's timestamps at each step end).
Tokens are real (non-padding) tokens, so HF's padding is work that does not count. MFU is model
FLOPs (6 x non-embedding params + 6 x lm_head + causal attention, per real token) over a large fp32
sgemm's GFLOP/s measured here with the same thread count.

Data: SmolLM2 trains on TRACE's FOMC + NumGLUE-cm + NumGLUE-ds training records from ../shared/trace
when present (lengths vary), else on the embedded benchmark's eight tasks; the tiny model (whose
tokenizer was trained on the embedded benchmark) always on the embedded eight tasks.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make the project importable
TRACE = REPO.parent / "shared" / "trace"

# Per model: optimizer steps (step 1 is warm-up, not timed), global batch (sequences), HF per-device
# micro-batch (gradient accumulation = global / micro), length limit, repeats. SmolLM2 steps take
# ~half a minute at 1 thread.
CONFIGS = {
    "tiny": dict(steps=12, global_batch=16, hf_micro_batch=8, max_len=512, repeats=3),
    "smollm2": dict(steps=4, global_batch=16, hf_micro_batch=8, max_len=512, repeats=1),
}
HP = dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, grad_clip=1.0)


def records(n: int, real: bool):
    """n {prompt, response} records, interleaving tasks so every global batch mixes lengths; real
    TRACE data when `real` and present."""
    from common.jsonl import read_records
    if real and all((TRACE / t / "train.json").is_file()
                    for t in ("FOMC", "NumGLUE-cm", "NumGLUE-ds")):
        per = [read_records(TRACE / t / "train.json", required=("prompt", "answer"))
               for t in ("FOMC", "NumGLUE-cm", "NumGLUE-ds")]
        source = "TRACE FOMC+NumGLUE-cm+NumGLUE-ds"
    else:
        from data.embedded import generate_task
        from data.tasks import TASK_ORDER
        per = [generate_task(t, n, 0) for t in TASK_ORDER]
        source = "embedded 8-task mixture"
    mixed = [r for group in zip(*per) for r in group][:n]
    return [{"prompt": r["prompt"], "response": r["answer"]} for r in mixed], source


def model_dir(name: str, work: Path) -> Path:
    if name == "smollm2":
        from model.import_gguf import ensure_smollm2
        return Path(ensure_smollm2())
    # the tiny base's config and tokenizer; weights do not matter here
    from model.base import write_random_tiny
    out = work / "tiny"
    if not (out / "config.json").exists():
        write_random_tiny(out)
    return out


def flops_per_token(ckpt: Path, mean_len: float) -> float:
    """Same model-FLOPs estimate as train.py's MFU."""
    from model.checkpoint import load_config
    c = load_config(ckpt)
    return (6 * c.num_params(embeddings=False) + 6 * c.vocab_size * c.hidden_size
            + 6 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * mean_len)


# --- children (each runs in its own process) ------------------------------------------------------

def sgemm_flops(repeats: int = 5) -> float:
    """fp32 sgemm FLOP/s at torch's thread count: median of `repeats` timings of 3 2048^3 products
    (after a warm-up)."""
    import torch
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(3):
            a @ b
        rates.append(3 * 2 * 2048**3 / (time.perf_counter() - t))
    return statistics.median(rates)


def child_peak():
    import torch
    print(json.dumps({"flops": sgemm_flops(), "threads": torch.get_num_threads()}))


def child_hf(ckpt: str, data: str, cfg: dict, work: str, flat: bool):
    """Hugging Face Trainer on the same records, padded or (flat) padding-free; prints per-step (end
    time, real tokens, padded tokens) and the step losses."""
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq,
                              DataCollatorWithFlattening, Trainer, TrainerCallback,
                              TrainingArguments)

    from common.jsonl import read_records
    from data.packing import tokenize_sft
    from model.tokenizer import ChatTokenizer

    tok = ChatTokenizer.from_dir(ckpt)
    # the same tokens and loss mask as train.py (labels unshifted: the model shifts them)
    examples, _ = tokenize_sft(read_records(data, required=("prompt", "response")), tok,
                               cfg["max_len"])
    rows = [{"input_ids": e.ids, "labels": [-100] + e.targets[:-1]} for e in examples]
    hf_tok = AutoTokenizer.from_pretrained(ckpt)
    if hf_tok.pad_token is None:
        hf_tok.pad_token = hf_tok.eos_token
    # every label of a document's first token is already -100, so the separator changes nothing
    if flat:
        base = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    else:
        base = DataCollatorForSeq2Seq(hf_tok, padding=True, label_pad_token_id=-100)
    counts = {"real": 0, "padded": 0}

    def collate(batch):
        out = base(batch)
        real = out["input_ids"].numel() if flat else int(out["attention_mask"].sum())
        counts["real"] += real
        counts["padded"] += out["input_ids"].numel()
        return out

    steps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append((time.perf_counter(), counts["real"], counts["padded"]))
            counts["real"] = counts["padded"] = 0

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=work, per_device_train_batch_size=cfg["hf_micro_batch"],
        gradient_accumulation_steps=cfg["global_batch"] // cfg["hf_micro_batch"],
        max_steps=cfg["steps"], learning_rate=HP["lr"], adam_beta1=HP["betas"][0],
        adam_beta2=HP["betas"][1], weight_decay=HP["weight_decay"], max_grad_norm=HP["grad_clip"],
        lr_scheduler_type="cosine", warmup_steps=0, optim="adamw_torch", logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=0, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate,
                      callbacks=[Clock()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"steps": steps, "losses": losses}))


# --- parent ---------------------------------------------------------------------------------------

def run_child(argv, threads):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))} failed:\n"
                           f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def peak(threads) -> float:
    out = run_child([sys.executable, __file__, "--child", "peak"], threads)
    return json.loads(out.strip().splitlines()[-1])["flops"]


# train.py with its model FSDP2-wrapped as for several ranks (what one CPU process trained
# before it skipped the wrap)
FSDP_WRAPPER = ["-c", "import sys, train; build = train.build_model; "
                      "train.build_model = lambda *a, **k: build(*a, **{**k, 'shard': True}); "
                      "train.main(sys.argv[1:])"]


# train.py, printing its peak resident set size at exit (Linux: ru_maxrss in KiB)
RSS_WRAPPER = ["-c", "import atexit, resource, runpy, sys; "
                     "atexit.register(lambda: print('PEAK_RSS_KIB', "
                     "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)); "
                     "sys.argv = ['train.py', *sys.argv[1:]]; "
                     "runpy.run_path('train.py', run_name='__main__')"]
LORA = ["--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.1",
        "--lora-targets", "q_proj,v_proj", "--lr", "1e-4"]


def run_ours(ckpt, data, cfg, work: Path, threads, fsdp=False, compile=False, lora=False) -> dict:
    out = work / "ours-out"
    script = FSDP_WRAPPER if fsdp else RSS_WRAPPER
    stdout = run_child([
        sys.executable, *script, "--model", str(ckpt), "--data", str(data), "--out", str(out),
        "--epochs", "1", "--max-steps", str(cfg["steps"]),
        "--global-batch", str(cfg["global_batch"]), "--max-len", str(cfg["max_len"]),
        "--micro-tokens", "16384", "--lr", str(HP["lr"]), "--betas", *map(str, HP["betas"]),
        "--weight-decay", str(HP["weight_decay"]), "--grad-clip", str(HP["grad_clip"]),
        "--save-every", "0", "--dtype", "fp32", "--quiet", "--peak-tflops", "1",
        "--compile" if compile else "--no-compile", *(LORA if lora else [])], threads)
    rss = [int(line.split()[1]) * 1024 for line in stdout.splitlines()
           if line.startswith("PEAK_RSS_KIB")]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    timed = log[1:]  # drop warm-up (and, compiled, the compilation)
    tokens = sum(x["tokens"] for x in timed)
    seconds = sum(x["tokens"] / x["tokens_per_s"] for x in timed)
    # step 1's excess over a steady step of its size: the compilation (compiled) or the
    # first-call costs (eager)
    first = log[0]["tokens"] / log[0]["tokens_per_s"] - log[0]["tokens"] * seconds / tokens
    return {"tokens_per_s": tokens / seconds, "padding": 0.0, "loss1": log[0]["loss"],
            "first_step_extra_s": first, "peak_rss": rss[0] if rss else None}


def run_hf(ckpt, data, cfg, work: Path, threads, flat: bool) -> dict:
    out = run_child([sys.executable, __file__, "--child", "hf-flat" if flat else "hf",
                     "--ckpt", str(ckpt), "--data", str(data), "--cfg", json.dumps(cfg),
                     "--work", str(work / "hf-out")], threads)
    res = json.loads(out.strip().splitlines()[-1])
    steps = res["steps"]
    (t_prev, _, _), timed = steps[0], steps[1:]  # step 1 is warm-up
    real, padded = sum(s[1] for s in timed), sum(s[2] for s in timed)
    return {"tokens_per_s": real / (timed[-1][0] - t_prev), "padding": 1 - real / padded,
            "loss1": res["losses"][0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2",
                    help="comma-separated: tiny, smollm2 (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS for every run (default: %(default)s)")
    ap.add_argument("--repeats", type=int, help="override the per-model repeat count")
    ap.add_argument("--steps", type=int, help="override the per-model optimizer steps (>= 2)")
    ap.add_argument("--with-fsdp", action="store_true",
                    help="also run train.py with its model FSDP2-wrapped (as one process was "
                         "before it skipped it)")
    ap.add_argument("--with-compile", action="store_true",
                    help="also run train.py --compile (each block compiled; step 1's extra "
                         "seconds: the compilation)")
    ap.add_argument("--with-lora", action="store_true",
                    help="also run train.py on LoRA adapters (r 8 on q, v)")
    ap.add_argument("--no-hf", action="store_true",
                    help="leave out the two Hugging Face Trainer runs")
    ap.add_argument("--child", choices=["peak", "hf", "hf-flat"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "peak":
        return child_peak()
    if args.child in ("hf", "hf-flat"):
        return child_hf(args.ckpt, args.data, json.loads(args.cfg), args.work,
                        flat=args.child == "hf-flat")

    from common.outputs import write_jsonl
    from data.packing import tokenize_sft
    from model.tokenizer import ChatTokenizer

    command = " ".join(["python", "bench/bench_train.py", *sys.argv[1:]])
    rows, peaks = [], [peak(args.threads)]
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            cfg = dict(CONFIGS[name])
            cfg["steps"] = args.steps or cfg["steps"]
            repeats = cfg.pop("repeats")
            repeats = args.repeats or repeats
            ckpt = model_dir(name, work)
            recs, source = records(cfg["steps"] * cfg["global_batch"], real=name != "tiny")
            data = write_jsonl(work / f"{name}.jsonl", recs)
            examples, dropped = tokenize_sft(recs, ChatTokenizer.from_dir(ckpt), cfg["max_len"])
            assert not dropped, f"{dropped} records longer than {cfg['max_len']} tokens"
            mean_len = statistics.mean(len(e.ids) for e in examples)
            fpt = flops_per_token(ckpt, mean_len)
            res = ({"ours": []} | ({} if args.no_hf else {"hf": [], "hf-flat": []})
                   | ({"ours-fsdp": []} if args.with_fsdp else {})
                   | ({"ours-compiled": []} if args.with_compile else {})
                   | ({"ours-lora": []} if args.with_lora else {}))
            for _ in range(repeats):  # alternate so load on a shared machine hits all alike
                res["ours"].append(run_ours(ckpt, data, cfg, work, args.threads))
                if args.with_fsdp:
                    res["ours-fsdp"].append(run_ours(ckpt, data, cfg, work, args.threads,
                                                     fsdp=True))
                if args.with_compile:
                    res["ours-compiled"].append(run_ours(ckpt, data, cfg, work, args.threads,
                                                         compile=True))
                if args.with_lora:
                    res["ours-lora"].append(run_ours(ckpt, data, cfg, work, args.threads,
                                                     lora=True))
                if not args.no_hf:
                    res["hf"].append(run_hf(ckpt, data, cfg, work, args.threads, flat=False))
                    res["hf-flat"].append(run_hf(ckpt, data, cfg, work, args.threads, flat=True))
                peaks.append(peak(args.threads))
                print(f"{name}: "
                      + ", ".join(f"{k} {v[-1]['tokens_per_s']:.0f} tok/s" for k, v in res.items()),
                      file=sys.stderr, flush=True)
            rows.append((name, cfg, repeats, mean_len, fpt, source, res))

    pk = statistics.median(peaks)
    print(f"\n`{command}` — {args.threads} thread(s), fp32 sgemm peak {pk / 1e9:.1f} GFLOP/s "
          f"(median of {len(peaks)}: {', '.join(f'{p / 1e9:.0f}' for p in peaks)})\n")
    label = {"ours": "train.py", "hf": "HF padded", "hf-flat": "HF padding-free",
             "ours-fsdp": "train.py FSDP2-wrapped", "ours-compiled": "train.py --compile",
             "ours-lora": "train.py LoRA r 8 (q, v)"}
    print("| model | data | steps x seqs (timed) | mean len | trainer | tok/s | train.py / it | "
          "MFU | padding | step-1 loss | step-1 extra s | peak RSS GB |")
    print("|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, cfg, repeats, mean_len, fpt, source, res in rows:
        tps = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in res.items()}
        for k, v in res.items():
            print(f"| {name} | {source} | {cfg['steps']} x {cfg['global_batch']} "
                  f"({cfg['steps'] - 1}), median of {repeats} | {mean_len:.0f} | {label[k]} | "
                  f"{tps[k]:.0f} | {tps['ours'] / tps[k]:.2f}x | {tps[k] * fpt / pk:.1%} | "
                  f"{statistics.median(r['padding'] for r in v):.0%} | {v[0]['loss1']:.5f} | "
                  + (f"{statistics.median(r['first_step_extra_s'] for r in v):.1f} |"
                     if "first_step_extra_s" in v[0] else "|")
                  + (f" {statistics.median(r['peak_rss'] for r in v) / 1e9:.2f} |"
                     if v[0].get("peak_rss") else " |"))


if __name__ == "__main__":
    main()
