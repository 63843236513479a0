"""One public function per kernel; each picks a GPU library when present, pure torch otherwise. What float results
depend on besides the code: NUMERICS, the CPU (cpu_numerics). And how a computing process takes its memory
(retain_freed_memory)."""
import ctypes
import functools
import os
import platform
from pathlib import Path

from kernels.attention import varlen_attention
from kernels.cross_entropy import fused_linear_cross_entropy

__all__ = ["varlen_attention", "fused_linear_cross_entropy", "NUMERICS", "backends", "cpu_numerics", "CPU_PINS",
           "retain_freed_memory"]


def backends() -> dict:
    """The kernel each op uses in this process, and whether it was forced (KERNELS_*_BACKEND, set_backend): the
    defaults follow what is installed (flash-attn, liger-kernel), so run.py keys every step by them."""
    from kernels import attention, cross_entropy
    return {"attention": [attention._BACKEND, attention._FORCED],
            "cross_entropy": [cross_entropy._BACKEND, cross_entropy._FORCED]}

# Bumped whenever a change to the model code or a kernel changes float results (not only the speed): run.py puts it
# in every step's key, so a run resumed after such a change recomputes its steps rather than mixing numerics.
# 2: CPU SDPA per document on 4-D tensors with enable_gqa (the flash kernel; was the math path)
# 3: CUDA decode attends over key spans rounded up to 64 slots (the KV cache of the engine before model/engine.py)
# 4: the chunked cross-entropy forms logits for the target rows only (grad_weight still sums over every row, so the
#    tiny base is byte-identical; a matmul over fewer rows can round differently, e.g. at SmolLM2 shapes)
# 5: CPU sampling multiplies inputs of <= 4 rows by a weight's two halves in one bmm (model.transformer.Linear), not
#    through F.linear's small-M path: decode steps of 1-4 live rows round differently (training does not change)
# 6: the chunked cross-entropy's grad_weight sums over the target rows only for weights of >= 2^20 elements
#    (SmolLM2 and larger; kernels/cross_entropy.py GRAD_WEIGHT_TARGETS_MIN): their training rounds differently (the
#    tiny base is unchanged: it builds byte-identical)
# 7: the tiny base is built with CPU_PINS (model/base.py): the same bytes on every x86-64 CPU with AVX2
# 8: the continuous-batching engine (model/engine.py): tokens drawn by Gumbel-max over keyed counter-based noise
#    instead of torch.multinomial (other draws, same distribution), prompts prefilled one per document, fused q/k/v
#    and gate/up products (greedy tokens unchanged, log-probs within 1e-5)
# 9: training runs the fused q/k/v and gate/up products too (model/transformer.py): the input gradient is one matmul
#    over the fused rows instead of a sum of three and two, so every trained weight rounds differently; and
#    model.checkpoint.load_model copies the file's tensors into 64-byte-aligned ones (safetensors' buffers are not
#    aligned, and MKL rounds by alignment): sampled log-probs move in the last bit, tokens do not
# 10: on the CPU the engine runs the live rows' decode step inside each admission's prefill forward, and sampling
#    multiplies weights of >= 2^20 elements by the split bmm at up to 512 rows, padded to a multiple of 8
#    (model.transformer.split_rows): sampled log-probs move in the last bits, and so do other no-grad forwards of
#    such weights (sdft's and sft-kl's teacher, train.py's response statistics); training's updates, and so the tiny
#    base, do not
# 11: the CPU engine multiplies by weights packed once for oneDNN (model.transformer.Packed) instead of F.linear / the split
#    bmm: sampled log-probs move in the last bits (greedy tokens of SmolLM2 on TRACE prompts unchanged); training,
#    and so the tiny base, do not
NUMERICS = 11

# On the CPU, float results depend on the instructions the kernels run, and those follow the CPU: ATen picks its
# AVX2 or AVX-512 code by the CPU's flags, MKL's GEMMs pick code per vendor and model. So the same command on two
# machines (an Intel laptop, an AMD server) rounds differently, and this benchmark's training amplifies any rounding
# into a different checkpoint (BENCHMARKS.md). These pins make both the same on every x86-64 CPU with AVX2 and FMA:
# ATen's AVX2 kernels, and MKL's conditional numerical reproducibility on its COMPATIBLE branch, the one MKL
# documents as giving the same results on Intel and non-Intel CPUs at a fixed thread count (run.py and the base
# build pin that too). Read once per process, so they go into the environment of the processes that compute.
# Cost on the 2-core AMD EPYC here: MKL's GEMMs ~2.3x slower, the tiny base's build 1.65x, run.py --portable 1.48x
# the default's wall time (BENCHMARKS.md). The tiny base is always built with them; --portable runs every step so.
CPU_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "MKL_DYNAMIC": "FALSE", "OMP_DYNAMIC": "FALSE"}
PORTABLE = {"ATEN_CPU_CAPABILITY": ("avx2", "default"), "MKL_CBWR": ("compatible",)}  # (lower case) no CPU changes


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict:
    """The first CPU's fields in /proc/cpuinfo (Linux); empty where there is none."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> set:
    """The CPU's feature flags (empty where /proc/cpuinfo has none)."""
    return set(_cpuinfo().get("flags", "").split())


def cpu_model() -> str:
    """Vendor, model name and numbers of the CPU, as /proc/cpuinfo gives them (else the platform's own words)."""
    keys = ("vendor_id", "model name", "cpu family", "model", "CPU implementer", "CPU part")  # (x86; ARM)
    fields = _cpuinfo()
    return " ".join(f"{k}={fields[k]}" for k in keys if fields.get(k)) or platform.processor() or platform.machine()


def cpu_numerics(portable: bool) -> tuple[dict, dict]:
    """(environment for the processes that compute, what their float results depend on about the CPU).
    portable on an x86-64 CPU with AVX2 and FMA: CPU_PINS, and the results depend on nothing else about the CPU.
    Otherwise (not asked, or a CPU that cannot run the pins) on its model. A caller's own setting of a pin is kept
    and said; the key leaves the CPU out only if the settings are still ones no CPU changes (PORTABLE)."""
    own = {k: os.environ[k] for k in CPU_PINS if os.environ.get(k)}
    env = {**CPU_PINS, **own} if portable and {"avx2", "fma"} <= cpu_flags() else own
    if all(env.get(k, "").split(",")[0].strip().lower() in ok for k, ok in PORTABLE.items()):  # ("COMPATIBLE,STRICT")
        return env, {"pins": env}
    import torch  # the CPU's own kernels (or a caller's setting that still follows the CPU, e.g. MKL_CBWR=AUTO)
    return env, {"pins": env, "model": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability()}


# glibc's malloc gives every block above its mmap threshold (128 KiB, rising to at most 32 MiB) its own mmap and
# unmaps it when freed, so every training step and decode step gets its large tensors (activations, the lm_head's
# and the embedding's gradients, logits) in fresh pages, which the kernel faults in and zeroes 4 KiB at a time
# (~3.4 us a page on this VM; BENCHMARKS.md has what it costs a step). Floats do not change: PyTorch aligns every
# tensor to 64 bytes either way. The price: the heap keeps its peak, plus what aligned blocks fragment (+1-5 % of
# SmolLM2's training peak).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")  # a caller's own settings


def retain_freed_memory() -> bool:
    """A process that computes on the CPU: keep freed memory for the next allocation instead of returning it to the
    OS (glibc: no mmap per large block, no trimming of the heap's top). Its memory stays at its peak until it exits,
    which is what a step does. Not where CUDA is (host memory there is loading and staging, to be given back), nor
    over a caller's own malloc settings in the environment. Returns whether it took effect (False on other C
    libraries)."""
    import torch
    callers = any(k in os.environ for k in MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
    if torch.cuda.is_available() or callers:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
