"""What the CPU pins (kernels.CPU_PINS) change and cost: ATen's AVX2 kernels instead of the CPU's
own (ATEN_CPU_CAPABILITY=avx2) and MKL's reproducible COMPATIBLE branch instead of its fastest code
for this CPU (MKL_CBWR=COMPATIBLE), each alone and both, against the CPU's own kernels.

    python bench/bench_cpu_pins.py [--threads 1] [--repeats 5]

Each configuration runs in a fresh process (both settings are read once per process). Per
configuration: a digest of the results of the tiny model's and SmolLM2's projections (F.linear:
MKL's sgemm) and one of ATen's own kernels (softmax, RMS norm, SiLU, and SDPA forward and backward:
a configuration that changes a digest changes how those ops round), and microseconds per call, the
median of --repeats timings of 50 calls each.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


CHILD = r"""
import hashlib, json, statistics, sys, time
import torch
import torch.nn.functional as F
repeats = int(sys.argv[1])
torch.manual_seed(0)
gemms = {"tiny gate/up, 864 rows": (torch.randn(864, 128), torch.randn(384, 128)),
         "tiny down, 864 rows": (torch.randn(864, 384), torch.randn(128, 384)),
         "SmolLM2 gate/up, 512 rows": (torch.randn(512, 576), torch.randn(1536, 576))}
x = torch.randn(64, 1024)
q = torch.randn(1, 4, 51, 32, requires_grad=True)


def aten():
    q.grad = None
    o = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    o.sum().backward()
    return [x.softmax(-1), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), F.silu(x), o.detach(), q.grad]


def median_us(f):
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(50):
            f()
        times.append((time.perf_counter() - t) / 50 * 1e6)
    return statistics.median(times)


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()[:10]


out = {"isa": torch.backends.cpu.get_cpu_capability(),
       "gemm digest": digest(F.linear(a, w) for a, w in gemms.values()), "aten digest": digest(aten())}
out.update({name: median_us(lambda a=a, w=w: F.linear(a, w)) for name, (a, w) in gemms.items()})
out["ATen ops"] = median_us(aten)
print(json.dumps(out))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="CPU threads (run.py's steps: 1)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from kernels import CPU_PINS, cpu_model
    one = {k: CPU_PINS[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    configs = {"the CPU's own": {},
               "ATen AVX2": {"ATEN_CPU_CAPABILITY": one["ATEN_CPU_CAPABILITY"]},
               "MKL COMPATIBLE": {"MKL_CBWR": one["MKL_CBWR"]}, "both (CPU_PINS)": CPU_PINS}
    base = {k: v for k, v in os.environ.items() if k not in CPU_PINS}
    base.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    rows = {}
    for name, extra in configs.items():
        child = subprocess.run([sys.executable, "-c", CHILD, str(args.repeats)],
                               env=dict(base, **extra), capture_output=True, text=True, check=True)
        rows[name] = json.loads(child.stdout)
    print(f"{cpu_model()}, {args.threads} thread(s), median of {args.repeats} x 50 calls")
    cols = [c for c in rows["the CPU's own"] if c not in ("isa",)]
    print("| configuration | ATen ISA | " + " | ".join(cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    own = rows["the CPU's own"]
    for name, r in rows.items():
        cells = [r[c] if "digest" in c else f"{r[c]:.0f} µs ({r[c] / own[c]:.2f}x)" for c in cols]
        print(f"| {name} | {r['isa']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
