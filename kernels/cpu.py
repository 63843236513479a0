"""The generation engine's CPU kernels in C (kernels/cpu.c), built on first use with the system's C
compiler and loaded through ctypes: attention of each token over its own slot's cache columns
(cache_attention), the sampler's candidates in one pass per row (far_candidates), and the decoder
block's elementwise work, one pass each (rms_norm, rope, silu_mul: model/transformer.py calls them
inside packed_products). Where no compiler is found, or OPR_CPU_KERNELS=0, the engine takes its
pure-torch paths: the same sampled tokens, floats rounded otherwise (backend() says which, and
run.py keys its steps by it).

The library is built once per machine and source into ~/.cache/opr/kernels (XDG_CACHE_HOME), named
by a hash of the source, the flags and the compiler's version; a build takes under a second."""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kernels.cpuinfo import cpu_flags

SOURCE = Path(__file__).with_name("cpu.c")
# -ffp-contract=off: a multiply and an add stay two roundings, as written, on every CPU and
# compiler (an FMA would round once where the CPU has one). -mavx2 only makes the same
# lane-wise operations faster.
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
# (after the source: a linker keeps only the libraries that what precedes them needs)
LIBS = ["-lm"]
_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _flags() -> list[str]:
    return FLAGS + (["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else [])


@functools.lru_cache(maxsize=1)
def _library():
    """(the built library, "built"), or (None, why): said once per process on stderr
    but where asked for."""
    lib, why = _build()
    if lib is None and os.environ.get("OPR_CPU_KERNELS", "1") != "0":
        print(f"kernels/cpu.py: the engine's C kernels are not built ({why}); pure torch instead",
              file=sys.stderr)
    return lib, why


def _build():
    if os.environ.get("OPR_CPU_KERNELS", "1") == "0":
        return None, "OPR_CPU_KERNELS=0"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc, gcc or $CC)"
    flags = _flags()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"{cc} --version failed: {e}"
    digest = hashlib.sha256(
        "\0".join([SOURCE.read_text(), *flags, *LIBS, version]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "opr" / "kernels"
    path, private = cache / f"cpu-{digest}.so", None
    if not path.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cache)  # built aside, then renamed: processes may race
        except OSError as e:  # a read-only cache: this process builds its own copy
                              # (the same library, floats)
            print(f"kernels/cpu.py: cannot write {cache} ({e.strerror}); building the C kernels "
                  f"for this process only", file=sys.stderr)
            private = tmp = tempfile.mkdtemp()
            path = Path(tmp) / path.name
        try:
            out = Path(tmp) / f"build-{path.name}"
            done = subprocess.run([cc, *flags, "-o", str(out), str(SOURCE), *LIBS],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                return (None, f"{cc} could not build {SOURCE.name}: "
                              f"{done.stderr.strip().splitlines()[-1:]}")
            os.replace(out, path)
        finally:
            if not private:
                shutil.rmtree(tmp, ignore_errors=True)
    try:
        lib = ctypes.CDLL(str(path))
    finally:
        if private:  # loaded (or not): the file can go, the mapping stays
            shutil.rmtree(private, ignore_errors=True)
    lib.cache_attention.argtypes = [_ptr] * 5 + [_i64] * 5 + [_f32, _ptr, ctypes.c_int]
    lib.cache_attention.restype = ctypes.c_int
    lib.far_candidates.argtypes = [_ptr, _ptr, _ptr, ctypes.c_double, ctypes.c_double,
                                   ctypes.c_uint32, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64,
                                   ctypes.c_int]
    lib.far_candidates.restype = _i64
    lib.rms_norm.argtypes = [_ptr, _ptr, _i64, _i64, _f32, _ptr, ctypes.c_int]
    lib.rope.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]
    lib.silu_mul.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int]
    for f in (lib.rms_norm, lib.rope, lib.silu_mul):
        f.restype = None
    return lib, "built"


def backend() -> str:
    """"c" when the kernels run in this process, else "torch" (the engine's pure-torch paths)."""
    return "torch" if _library()[0] is None else "c"


def runs_attention(device, dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether cache_attention takes a model of these in this process (fp32 on the CPU, head_dim
    a multiple of 8)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and head_dim % 8 == 0
            and heads % kv_heads == 0 and _library()[0] is not None)


@torch.library.custom_op("opr::cache_attention", mutates_args=())
def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    pos: torch.Tensor) -> torch.Tensor:
    """Token i (q[i] [Hq, D]) attends over columns 0..pos[i] of cache slot slots[i]
    (k, v [slots, Hkv, cols, D], one layer's cache, contiguous), query head h reading kv head
    h // (Hq // Hkv), softmax scale D^-0.5 -> [n, Hq * D]. An operator of its own: torch.compile
    sees it whole (the decode step compiles with no graph break)."""
    n, hq, d = q.shape
    q, slots, pos = q.contiguous(), slots.contiguous(), pos.contiguous()
    assert k.is_contiguous() and v.is_contiguous() and k.shape == v.shape
    out = torch.empty(n, hq * d, dtype=q.dtype)
    err = _library()[0].cache_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(),
                                        pos.data_ptr(), n, hq, k.shape[1], d, k.shape[2], d ** -0.5,
                                        out.data_ptr(), torch.get_num_threads())
    if err:
        raise MemoryError("cache_attention: no memory for its scratch")
    return out


@cache_attention.register_fake
def _(q, k, v, slots, pos):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def far_candidates(logits, row_hash, floor: int, near=None, temperature: float = 1.0,
                   far_d: float = 0.0):
    """(rows, ids) of the tokens with hash32(row_hash[r] ^ id) >= floor (unsigned) or
    logits[r, id] >= near[r], in row-major order (nonzero's), or None when they are more than an
    eighth of logits [n, V] (fp32, CPU). near None: each row's own, far_d below its largest
    logit's drawn score at `temperature` (kernels/cpu.c)."""
    n, vocab = logits.shape
    logits = logits.contiguous()
    near = None if near is None else near.float().contiguous()
    row_hash = row_hash.to(torch.int32).contiguous()  # (the low 32 bits)
    room = n * vocab // 8
    scratch, count = torch.empty(n, vocab, dtype=torch.int32), torch.empty(n, dtype=torch.int64)
    r, j = torch.empty(room, dtype=torch.int64), torch.empty(room, dtype=torch.int64)
    total = _library()[0].far_candidates(
        logits.data_ptr(), row_hash.data_ptr(), None if near is None else near.data_ptr(),
        temperature, far_d, floor, n, vocab, scratch.data_ptr(), count.data_ptr(), r.data_ptr(),
        j.data_ptr(), room, torch.get_num_threads())
    return None if total > room else (r[:total], j[:total])


# ---- the decoder block's elementwise work (model/transformer.py calls these inside
#      packed_products, eagerly) ----

def fuses(x) -> bool:
    """Whether rms_norm, rope and silu_mul take x (fp32, on the CPU, in this process)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and _library()[0] is not None


def rms_norm(x, w, eps: float):
    """RMSNorm of x's last dimension (a multiple of 8) with weight w, in one pass per
    row (kernels/cpu.c)."""
    h = x.shape[-1]
    assert x.dtype == w.dtype == torch.float32 and h % 8 == 0 and w.shape == (h,)
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty_like(x)
    _library()[0].rms_norm(x.data_ptr(), w.data_ptr(), x.numel() // h, h, eps, out.data_ptr(),
                           torch.get_num_threads())
    return out


def rope(x, cos, sin):
    """x [1, T, H, D] (each token's heads contiguous, tokens at any stride: a view of the fused
    q/k/v product), cos, sin [1, T, D] -> x * cos + rotate_half(x) * sin [1, T, H, D], bit for bit
    as model/transformer.py's apply_rope."""
    _, n, heads, d = x.shape
    assert (x.stride(3) == 1 and x.stride(2) == d and d % 16 == 0
            and x.dtype == cos.dtype == sin.dtype == torch.float32)
    assert cos.shape == sin.shape == (1, n, d) and cos.is_contiguous() and sin.is_contiguous()
    out = x.new_empty(x.shape)
    _library()[0].rope(x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), n, heads, d,
                       out.data_ptr(), torch.get_num_threads())
    return out


def silu_mul(gu):
    """silu(g) * u of gu = [g | u] along the last dimension (each half a multiple of 8)."""
    gu = gu.contiguous()
    m = gu.shape[-1] // 2
    assert gu.dtype == torch.float32 and gu.shape[-1] == 2 * m and m % 8 == 0
    out = gu.new_empty(*gu.shape[:-1], m)
    _library()[0].silu_mul(gu.data_ptr(), gu.numel() // (2 * m), m, out.data_ptr(),
                           torch.get_num_threads())
    return out
