"""Causal attention over packed variable-length documents (flash-attn "varlen" layout).

Several documents are concatenated into one [T, ...] sequence; cu_seqlens marks where each starts.
A token attends to earlier tokens of its own document only.

Backends, in order of preference (chosen once, at import; the first that can run is the default):
  "flash"        flash_attn.flash_attn_varlen_func -- when CUDA is available and flash_attn imports.
  "torch_varlen" torch.nn.attention.varlen.varlen_attn, PyTorch's own varlen flash kernel: no extra
                 install. First shipped in torch 2.10 as varlen_attn(q, k, v, cu_q, cu_k, max_q,
                 max_k, is_causal=...); torch 2.11 replaced is_causal by window_size=(-1, 0) for
                 causal; enable_gqa (kv heads shared by groups of q heads) arrived in 2.12. We read
                 the installed signature once and, without enable_gqa, repeat the kv heads
                 ourselves. Needs CUDA and an Ampere-or-newer GPU (sm80+).
  "sdpa"         torch SDPA looped over documents with is_causal=True -- always available. On the
                 CPU the loop is one custom operator (opr::cpu_varlen_attention, with its
                 backward) calling SDPA's CPU flash kernel per document: the same bytes as SDPA,
                 without the view/slice nodes per document and layer that an autograd loop
                 records, and opaque to torch.compile (no graph break). A loop rather than one
                 SDPA call with a [T, T] block-diagonal mask, which is slower on the CPU. Each
                 document goes in as a 4-D [1, H, L, D] tensor with enable_gqa: that takes the CPU
                 flash kernel, GQA included (3-D inputs take the slower math path). BENCHMARKS.md,
                 "The levers, each measured on its own".
As defaults, "flash" and "torch_varlen" apply to fp16/bf16 CUDA tensors only (both are fp16/bf16
CUDA kernels); anything else (CPU, fp32 on CUDA) takes the SDPA loop.
Force one with the env var KERNELS_ATTN_BACKEND=flash|torch_varlen|sdpa (read at import) or
set_backend(name); a forced backend is used for every call, whatever the device (tests use this
with a stand-in).
describe() says which backend is in use and for what; train.py prints it.
"""

import inspect
import os

import torch
import torch.nn.functional as F


def _flash(q, k, v, cu_seqlens, max_seqlen):
    # Thin wrapper. flash-attn handles GQA itself (q head h reads kv head h // (Hq // Hkv)) and
    # defaults softmax_scale to 1/sqrt(D), the same as SDPA.
    return flash_attn_varlen_func(
        q, k, v,
        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        causal=True,
    )


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen):
    kw = {}
    if "enable_gqa" in _VARLEN_PARAMS:  # torch >= 2.12: the kernel shares kv heads itself
        kw["enable_gqa"] = q.shape[1] != k.shape[1]
    elif q.shape[1] != k.shape[1]:  # older: same head grouping as flash-attn,
                                    # q head h uses kv head h // n_rep
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    if "window_size" in _VARLEN_PARAMS:  # torch >= 2.11: (-1, 0) = everything to the left,
                                         # nothing to the right
        kw["window_size"] = (-1, 0)
    else:  # torch 2.10
        kw["is_causal"] = True
    # scale defaults to 1/sqrt(D) in every version, as in SDPA and flash-attn
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kw)


def _sdpa(q, k, v, cu_seqlens, max_seqlen):
    if q.is_cpu and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        return cpu_varlen_attention(q, k, v, cu_seqlens)[0]
    return _sdpa_loop(q, k, v, cu_seqlens.tolist())


def _sdpa_loop(q, k, v, bounds):
    """SDPA per document under autograd (off the CPU; on it, cpu_varlen_attention gives the
    same bytes faster)."""
    # SDPA's grouping is flash-attn's: q head h uses kv head h // (Hq // Hkv)
    gqa = q.shape[1] != k.shape[1]
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [L, H, D] -> [1, H, L, D]: 4-D inputs take the CPU flash kernel, GQA included (3-D ones,
        # or kv heads repeated by hand, take the slower math path)
        qd, kd, vd = (_doc(x, start, end) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                  enable_gqa=gqa)[0].transpose(0, 1))
    return torch.cat(out, dim=0)


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _doc(x, start, end):
    """Rows start:end of a packed [T, H, ...] tensor as the [1, H, L, ...] view the CPU
    flash kernel reads."""
    return x[None, start:end].transpose(1, 2)


def _docs(cu_seqlens):
    """(start, end) of each non-empty document."""
    bounds = cu_seqlens.tolist()
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]


def _unit_stride(*xs):
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _lse_like(q):
    """The kernel's log-sum-exp [T, H]: fp32, fp64 for fp64 inputs."""
    return q.new_empty(q.shape[:2],
                       dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)


# The SDPA loop on the CPU as one custom operator: the same CPU flash kernel per document, forward
# and backward (the kernel SDPA picks there, so outputs and gradients are bit-identical to the
# loop), without the ~12 view, slice and transpose nodes per document and layer that autograd
# otherwise records and walks back. Being an operator, it is opaque to torch.compile: the
# per-document loop (which reads cu_seqlens on the host) is no graph break, so a transformer block
# compiles with fullgraph=True. GQA: the kernel shares kv heads itself.
@torch.library.custom_op("opr::cpu_varlen_attention", mutates_args=())
def cpu_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T,Hq,D], k/v [T,Hkv,D], cu_seqlens int32 -> (out [T,Hq,D], logsumexp [T,Hq] in the
    kernel's fp32/fp64)."""
    q, k, v = _unit_stride(q, k, v)
    out, lse = q.new_empty(q.shape), _lse_like(q)
    for start, end in _docs(cu_seqlens):
        o, l = _CPU_FLASH(_doc(q, start, end), _doc(k, start, end), _doc(v, start, end), 0.0, True)
        _doc(out, start, end).copy_(o)
        _doc(lse, start, end).copy_(l)
    return out, lse


@cpu_varlen_attention.register_fake
def _(q, k, v, cu_seqlens):
    return q.new_empty(q.shape), _lse_like(q)


@torch.library.custom_op("opr::cpu_varlen_attention_backward", mutates_args=())
def cpu_varlen_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                  cu_seqlens: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, grad = _unit_stride(q, k, v, grad)
    # the documents cover every row
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    for start, end in _docs(cu_seqlens):
        grads = _CPU_FLASH_BACKWARD(_doc(grad, start, end), _doc(q, start, end),
                                    _doc(k, start, end), _doc(v, start, end), _doc(out, start, end),
                                    _doc(lse, start, end), 0.0, True)
        for acc, d in zip((dq, dk, dv), grads):
            _doc(acc, start, end).copy_(d)
    return dq, dk, dv


@cpu_varlen_attention_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)


def _backward(ctx, grad, _grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    return *cpu_varlen_attention_backward(grad, q, k, v, out, lse, cu_seqlens), None


cpu_varlen_attention.register_autograd(_backward, setup_context=_setup_context)


BACKENDS = ("flash", "torch_varlen", "sdpa")
_KERNELS = {"flash": _flash, "torch_varlen": _torch_varlen, "sdpa": _sdpa}


def available(name: str) -> str | None:
    """None when backend `name` can run here (CUDA tensors for the GPU backends), else the
    reason it cannot."""
    if name == "sdpa":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    if name == "flash" and flash_attn_varlen_func is None:
        return "flash_attn does not import"
    if name == "torch_varlen" and varlen_attn is None:
        return (f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                f"(first in torch 2.10)")
    if torch.cuda.get_device_capability() < (8, 0):
        return (f"GPU {torch.cuda.get_device_name()} is older than sm80 "
                f"(flash kernels need Ampere or newer)")
    return None


def set_backend(name: str, forced: bool = True) -> None:
    """Use `name` (one of BACKENDS) for all later calls (forced=False: the GPU backends for
    fp16/bf16 CUDA tensors only, the SDPA loop for the rest)."""
    global _BACKEND, _FORCED
    if name not in BACKENDS:
        raise ValueError(f"kernels/attention.py: unknown backend {name!r}; expected one of "
                         f"{', '.join(BACKENDS)}")
    if name == "flash" and flash_attn_varlen_func is None:
        raise RuntimeError(
            "kernels/attention.py: backend 'flash' requested but flash_attn does not import")
    if name == "torch_varlen" and varlen_attn is None:
        raise RuntimeError(f"kernels/attention.py: backend 'torch_varlen' requested but torch "
                           f"{torch.__version__} has no torch.nn.attention.varlen.varlen_attn "
                           f"(first in torch 2.10)")
    _BACKEND, _FORCED = name, forced


def get_backend() -> str:
    return _BACKEND


def describe() -> str:
    """One line for logs: the backend and which calls it serves."""
    if _BACKEND == "sdpa" or _FORCED:
        return f"{_BACKEND}{' (forced)' if _FORCED and _BACKEND != 'sdpa' else ''}"
    return f"{_BACKEND} for fp16/bf16 CUDA tensors, sdpa otherwise"


def varlen_attention(q, k, v, cu_seqlens, max_seqlen):
    """Causal self-attention within each packed document, never across documents.

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (GQA)
    cu_seqlens: int32 [n_docs + 1], cumulative document lengths, cu_seqlens[0] == 0,
                cu_seqlens[-1] == T
    max_seqlen: int, longest document (flash-attn sizes its launch grid with it)
    returns: [T, Hq, D], scaled by 1/sqrt(D)
    """
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"kernels/attention.py: expected q [T,Hq,D], k/v [T,Hkv,D] with Hq % Hkv == 0; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"kernels/attention.py: cu_seqlens must be int32 (flash-attn layout), got "
                         f"{cu_seqlens.dtype}")
    # the flash kernels are fp16/bf16 only:
    # fp32 CUDA tensors (train.py --dtype fp32) take the SDPA path
    if _FORCED or (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return _KERNELS[_BACKEND](q, k, v, cu_seqlens, max_seqlen)
    return _sdpa(q, k, v, cu_seqlens, max_seqlen)


flash_attn_varlen_func, varlen_attn, _VARLEN_PARAMS = None, None, frozenset()
# the GPU kernels are imported only where they can run (or are forced): torch.nn.attention.varlen
# imports torch._dynamo, which would add seconds to every CPU process's start
if torch.cuda.is_available() or os.environ.get("KERNELS_ATTN_BACKEND") in ("flash", "torch_varlen"):
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a CUDA/ABI mismatch raising at import
        flash_attn_varlen_func = None
    try:
        from torch.nn.attention.varlen import varlen_attn
        _VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters)
    except Exception:  # torch < 2.10
        varlen_attn, _VARLEN_PARAMS = None, frozenset()

_BACKEND, _FORCED = None, False
if os.environ.get("KERNELS_ATTN_BACKEND"):
    set_backend(os.environ["KERNELS_ATTN_BACKEND"])
else:
    set_backend(next(b for b in BACKENDS if available(b) is None), forced=False)
