"""Fused linear + cross-entropy: the loss of softmax(hidden @ weight.T) without the [N, V] logits.

At vocab 151,936 and 8,192 tokens the fp32 logits alone are 5 GB, and autograd keeps two or three
tensors of that size alive (log-softmax output, its gradient, the logits gradient). Both backends
below only ever hold a few rows of logits at a time.

Backends (chosen once, at import):
  "liger"   liger-kernel's fused linear CE (Triton) -- default when CUDA is available and
            liger_kernel imports; as a default it applies to CUDA tensors only.
            Called with reduction="sum", accum_dtype=torch.float32.
  "chunked" our own torch.autograd.Function below -- the default everywhere else.
Force one with the env var KERNELS_CE_BACKEND=liger|chunked (read at import) or set_backend(name);
a forced backend is used for every call, whatever the device (tests run liger on CPU tensors under
TRITON_INTERPRET=1 this way).
"""

import os

import torch

# Rows of logits per chunk are picked so that one chunk of fp32 logits is about this many bytes
# (220 rows at V=151,936). Why 128 MiB: every chunk re-reads and re-writes the whole [V, H] fp32
# grad_weight accumulator (545 MB at V=151,936, H=896), so chunks of a few dozen rows make the
# loss slower than the naive one on CPU; 128 MiB keeps the matmuls efficient while the peak stays
# a small fraction of the naive [N, V] logits (BENCHMARKS.md, "The levers, each measured on its
# own": "Fused linear cross-entropy: memory").
_CHUNK_BYTES = 128 * 2**20


def _chunk_rows(vocab_size: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * vocab_size))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """SUM of token NLL, computed `chunk` tokens at a time. Gradients are computed in forward.

    Why gradients in forward (as liger does) instead of recomputing logits in backward: the loss is
    the last op of the graph, so the gradients are needed right after anyway, and it costs 3 matmuls
    per chunk (logits, grad_hidden, grad_weight) instead of 4. Peak memory is the same either way:
    one chunk of logits plus the [V, H] fp32 grad_weight accumulator that backward needs regardless.
    Under no_grad (evaluation) no gradient is computed.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk, grad_hidden_needed,
                grad_weight_needed):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        # fp32 accumulation (fp64 stays fp64)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        # A no-op for fp32 weights; for bf16 weights a one-off fp32 copy of [V, H].
        weight_acc = weight.to(acc)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = (torch.zeros(hidden.shape, dtype=acc, device=hidden.device)
                       if grad_hidden_needed else None)
        grad_weight = torch.zeros_like(weight_acc) if grad_weight_needed else None
        # One logits buffer reused by every chunk: a fresh multi-MB tensor per chunk is a fresh mmap
        # on CPU, and page-faulting it in slows the logits matmul.
        buf = torch.empty(min(chunk, n_tokens), vocab, dtype=acc, device=hidden.device)
        for start in range(0, n_tokens, chunk):
            end = min(start + chunk, n_tokens)
            labels_c = labels[start:end]
            valid = labels_c != ignore_index
            rows = valid.nonzero().squeeze(1)  # the chunk's rows with a target
            n = rows.numel()
            if n == 0:
                continue  # all-ignored chunk: contributes neither loss nor gradient
            # Logits, softmax and grad_hidden for the target rows only: in SFT most tokens are the
            # prompt's, and computing their logits only to zero them out would be most of this
            # function's time (BENCHMARKS.md, "The levers, each measured on its own": "Logits for
            # the target rows only").
            h_c = hidden[start:end].to(acc)
            every = n == end - start  # no ignored row: nothing to select or scatter
            h_t = h_c if every else h_c.index_select(0, rows)
            labels_t = labels_c if every else labels_c.index_select(0, rows)
            logits = torch.mm(h_t, weight_acc.T, out=buf[:n])  # [n, V]
            # Stable log-sum-exp, in place: logits -> logits - max -> exp(logits - max).
            logits.sub_(logits.amax(dim=1, keepdim=True))
            target_logit = logits.gather(1, labels_t[:, None]).squeeze(1)
            probs = logits.exp_()
            sum_exp = probs.sum(dim=1)
            loss += (sum_exp.log() - target_logit).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(lse - logit_y)/d logits = softmax - onehot(y)
            grad_logits = probs.div_(sum_exp[:, None])
            grad_logits[torch.arange(n, device=hidden.device), labels_t] -= 1
            if grad_hidden is not None:
                if every:
                    torch.mm(grad_logits, weight_acc, out=grad_hidden[start:end])
                else:
                    grad_hidden[start:end].index_copy_(0, rows, torch.mm(grad_logits, weight_acc))
            if grad_weight is None:
                continue
            grad_weight.addmm_(grad_logits.T, h_t)  # over the target rows only
        ctx.save_for_backward(
            grad_hidden.to(hidden.dtype) if grad_hidden is not None else None,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
        )
        return loss.float()

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Skip the [V, H] multiply when the loss sum is backpropagated as is (grad_loss == 1).
        if not bool(grad_loss == 1):
            grad_hidden = (grad_hidden * grad_loss.to(grad_hidden.dtype)
                           if grad_hidden is not None else None)
            grad_weight = (grad_weight * grad_loss.to(grad_weight.dtype)
                           if grad_weight is not None else None)
        return grad_hidden, grad_weight, None, None, None, None, None


def _chunked(hidden, weight, labels, ignore_index):
    grad_on = torch.is_grad_enabled()
    return ChunkedLinearCrossEntropy.apply(
        hidden, weight, labels, ignore_index, _chunk_rows(weight.shape[0]),
        grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
    )


def _liger(hidden, weight, labels, ignore_index):
    # Keep this a thin wrapper: the argument names below are liger-kernel 0.8.5's
    # liger_kernel.transformers.functional.liger_fused_linear_cross_entropy.
    # Note liger computes grad_weight only when hidden.requires_grad (always true in training).
    return _LIGER_FN(
        hidden, weight, labels, ignore_index=ignore_index, reduction="sum",
        accum_dtype=torch.float32,
    ).float()


def _load_liger():
    """liger's functional fused linear CE, or None. Imported only when it may be used: on a CPU-only
    machine importing liger costs seconds and pulls in transformers."""
    global _LIGER_FN
    if _LIGER_FN is None:
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
            _LIGER_FN = liger_fused_linear_cross_entropy
        except Exception:  # ImportError, or triton failing to initialise
            return None
    return _LIGER_FN


def set_backend(name: str, forced: bool = True) -> None:
    """Use backend "liger" or "chunked" for all later calls (forced=False: "liger" only
    for CUDA tensors)."""
    global _BACKEND, _FORCED
    if name not in ("liger", "chunked"):
        raise ValueError(f"kernels/cross_entropy.py: unknown backend {name!r}; "
                         f"expected 'liger' or 'chunked'")
    if name == "liger" and _load_liger() is None:
        raise RuntimeError("kernels/cross_entropy.py: backend 'liger' requested but liger_kernel "
                           "does not import")
    _BACKEND, _FORCED = name, forced


def get_backend() -> str:
    return _BACKEND


def fused_linear_cross_entropy(hidden, weight, labels, ignore_index=-100):
    """SUM over non-ignored tokens of -log softmax(hidden @ weight.T)[label],
    never materialising it.

    hidden: [N, H] float (fp32 or bf16; may be non-contiguous)
    weight: [V, H] same dtype as hidden (the lm_head / tied embedding)
    labels: [N] long, already shifted; `ignore_index` entries contribute nothing
    returns: fp32 scalar; the caller divides by its token count. Gradients flow to hidden and
             weight in their own dtypes (accumulated in fp32).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"kernels/cross_entropy.py: expected hidden [N,H], weight [V,H], labels [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[0] != labels.shape[0] or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"kernels/cross_entropy.py: shape mismatch hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)}"
        )
    if _BACKEND == "liger" and (hidden.is_cuda or _FORCED):
        return _liger(hidden, weight, labels, ignore_index)
    return _chunked(hidden, weight, labels, ignore_index)


_LIGER_FN = None
_BACKEND, _FORCED = None, False
if os.environ.get("KERNELS_CE_BACKEND"):
    set_backend(os.environ["KERNELS_CE_BACKEND"])
else:
    set_backend("liger" if torch.cuda.is_available() and _load_liger() is not None else "chunked",
                forced=False)
