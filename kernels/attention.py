"""Causal attention over packed variable-length documents (flash-attn "varlen" layout).

Several documents are concatenated into one [T, ...] sequence; cu_seqlens marks where each starts.
A token attends to earlier tokens of its own document only.

Backends (chosen once, at import):
  "flash" flash_attn.flash_attn_varlen_func -- default when CUDA is available and flash_attn imports;
          as a default it applies to CUDA tensors only (flash-attn has no CPU kernel).
  "sdpa"  torch SDPA looped over documents with is_causal=True -- the default everywhere else.
          On CPU this beat one SDPA call with a [T, T] block-diagonal mask (our notes). GQA repeats
          the kv heads: on a quiet CPU its forward was ~1.5-2x faster than SDPA's enable_gqa=True
          (which appears to take the math path); fwd+bwd was within noise on our shared 2-core box
          (bench/bench_loss_memory.py --attention).
Force one with the env var KERNELS_ATTN_BACKEND=flash|sdpa (read at import) or set_backend(name);
a forced backend is used for every call, whatever the device (tests use this with a stand-in).
"""

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


def _sdpa(q, k, v, cu_seqlens, max_seqlen):
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        # Same head grouping as flash-attn: q head h uses kv head h // n_rep.
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    bounds = cu_seqlens.tolist()
    out = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        # [L, H, D] -> [H, L, D]: SDPA wants heads before the sequence dimension.
        qd, kd, vd = (x[start:end].transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).transpose(0, 1))
    return torch.cat(out, dim=0)


def set_backend(name: str, forced: bool = True) -> None:
    """Use backend "flash" or "sdpa" for all later calls (forced=False: "flash" only for CUDA tensors)."""
    global _BACKEND, _FORCED
    if name not in ("flash", "sdpa"):
        raise ValueError(f"kernels/attention.py: unknown backend {name!r}; expected 'flash' or 'sdpa'")
    if name == "flash" and flash_attn_varlen_func is None:
        raise RuntimeError("kernels/attention.py: backend 'flash' requested but flash_attn does not import")
    _BACKEND, _FORCED = name, forced


def get_backend() -> str:
    return _BACKEND


def varlen_attention(q, k, v, cu_seqlens, max_seqlen):
    """Causal self-attention within each packed document, never across documents.

    q: [T, Hq, D]; k, v: [T, Hkv, D] with Hq a multiple of Hkv (GQA)
    cu_seqlens: int32 [n_docs + 1], cumulative document lengths, cu_seqlens[0] == 0, cu_seqlens[-1] == T
    max_seqlen: int, longest document (flash-attn sizes its launch grid with it)
    returns: [T, Hq, D], scaled by 1/sqrt(D)
    """
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"kernels/attention.py: expected q [T,Hq,D], k/v [T,Hkv,D] with Hq % Hkv == 0; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"kernels/attention.py: cu_seqlens must be int32 (flash-attn layout), got {cu_seqlens.dtype}")
    # flash-attn has fp16/bf16 kernels only: fp32 CUDA tensors (train.py --dtype fp32) take the SDPA path
    if _BACKEND == "flash" and (_FORCED or (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16))):
        return _flash(q, k, v, cu_seqlens, max_seqlen)
    return _sdpa(q, k, v, cu_seqlens, max_seqlen)


try:
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a CUDA/ABI mismatch raising at import
    flash_attn_varlen_func = None

_BACKEND, _FORCED = None, False
if os.environ.get("KERNELS_ATTN_BACKEND"):
    set_backend(os.environ["KERNELS_ATTN_BACKEND"])
else:
    set_backend("flash" if torch.cuda.is_available() and flash_attn_varlen_func is not None else "sdpa", forced=False)
