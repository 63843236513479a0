"""One public function per kernel; each picks a GPU library when present, pure torch otherwise (the
generation engine's CPU kernels, in C, are kernels/cpu.py's). What float results depend on besides
the code: NUMERICS, the CPU (cpu_numerics). And how a computing process takes its memory
(retain_freed_memory)."""
import ctypes
import functools
import os

from kernels.attention import varlen_attention
# (cpu_flags is looked up here at each call, so a test may replace kernels.cpu_flags)
from kernels.cpuinfo import cpu_flags, cpu_model
from kernels.cross_entropy import fused_linear_cross_entropy

__all__ = ["varlen_attention", "fused_linear_cross_entropy", "NUMERICS", "backends", "cpu_numerics",
           "CPU_PINS", "retain_freed_memory"]


def backends() -> dict:
    """The kernel each op uses in this process, and whether it was forced (KERNELS_*_BACKEND,
    set_backend): the defaults follow what is installed (flash-attn, liger-kernel), so run.py keys
    every step by them."""
    from kernels import attention, cpu, cross_entropy
    return {"attention": [attention._BACKEND, attention._FORCED],
            "cross_entropy": [cross_entropy._BACKEND, cross_entropy._FORCED],
            "engine_cpu": [cpu.backend(), os.environ.get("OPR_CPU_KERNELS") == "0"]}

# Bumped whenever a change to the model code or a kernel changes float results (not only the speed):
# run.py puts it in every step's key, so a run resumed after such a change recomputes its steps
# rather than mixing numerics. What each version changed: BENCHMARKS.md, "Numerics versions".
NUMERICS = 15

# On the CPU, float results depend on the instructions the kernels run, and those follow the CPU:
# ATen picks its AVX2 or AVX-512 code by the CPU's flags, MKL's GEMMs pick code per vendor and
# model. So the same command on two machines (an Intel laptop, an AMD server) rounds differently,
# and this benchmark's training amplifies any rounding into a different checkpoint (BENCHMARKS.md,
# "The seed noise is chaos"). These pins make both the same on every x86-64 CPU with AVX2 and FMA:
# ATen's AVX2 kernels, and MKL's conditional numerical reproducibility on its COMPATIBLE branch, the
# one MKL documents as giving the same results on Intel and non-Intel CPUs at a fixed thread count
# (run.py and the base build pin that too). Read once per process, so they go into the environment
# of the processes that compute.
# They make MKL's GEMMs much slower (BENCHMARKS.md, "The same base on every CPU: the CPU pins"), so
# only the tiny base, which every machine must share, is always built with them; --portable runs
# every step so.
CPU_PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "MKL_DYNAMIC": "FALSE",
            "OMP_DYNAMIC": "FALSE"}
# (lower case) no CPU changes
PORTABLE = {"ATEN_CPU_CAPABILITY": ("avx2", "default"), "MKL_CBWR": ("compatible",)}


def cpu_numerics(portable: bool) -> tuple[dict, dict]:
    """(environment for the processes that compute, what their float results depend on about the
    CPU). portable on an x86-64 CPU with AVX2 and FMA: CPU_PINS, and the results depend on nothing
    else about the CPU. Otherwise (not asked, or a CPU that cannot run the pins) on its model. A
    caller's own setting of a pin is kept and said; the key leaves the CPU out only if the settings
    are still ones no CPU changes (PORTABLE)."""
    own = {k: os.environ[k] for k in CPU_PINS if os.environ.get(k)}
    env = {**CPU_PINS, **own} if portable and {"avx2", "fma"} <= cpu_flags() else own
    if all(env.get(k, "").split(",")[0].strip().lower() in ok  # ("COMPATIBLE,STRICT")
           for k, ok in PORTABLE.items()):
        return env, {"pins": env}
    # the CPU's own kernels (or a caller's setting that still follows the CPU, e.g. MKL_CBWR=AUTO)
    import torch
    return env, {"pins": env, "model": cpu_model(), "isa": torch.backends.cpu.get_cpu_capability()}


# glibc's malloc gives every block above its mmap threshold (128 KiB, rising to at most 32 MiB) its
# own mmap and unmaps it when freed, so every training step and decode step gets its large tensors
# (activations, the lm_head's and the embedding's gradients, logits) in fresh pages, which the
# kernel faults in and zeroes 4 KiB at a time (what that costs a step: BENCHMARKS.md, "The levers,
# each measured on its own"). Floats do not change: PyTorch aligns every tensor to 64 bytes either
# way. The price: the heap keeps its peak, plus what aligned blocks fragment.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# a caller's own settings
MALLOC_ENV = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def retain_freed_memory() -> bool:
    """A process that computes on the CPU: keep freed memory for the next allocation instead of
    returning it to the OS (glibc: no mmap per large block, no trimming of the heap's top). Its
    memory stays at its peak until it exits, which is what a step does. Not where CUDA is (host
    memory there is loading and staging, to be given back), nor over a caller's own malloc settings
    in the environment. Returns whether it took effect (False on other C libraries)."""
    import torch
    callers = (any(k in os.environ for k in MALLOC_ENV)
               or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
    if torch.cuda.is_available() or callers:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
