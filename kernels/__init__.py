"""One public function per kernel; each picks a GPU library when present, pure torch otherwise."""

from kernels.attention import varlen_attention
from kernels.cross_entropy import fused_linear_cross_entropy

__all__ = ["varlen_attention", "fused_linear_cross_entropy", "NUMERICS", "backends"]


def backends() -> dict:
    """The kernel each op uses in this process, and whether it was forced (KERNELS_*_BACKEND, set_backend): the
    defaults follow what is installed (flash-attn, liger-kernel), so run.py keys every step by them."""
    from kernels import attention, cross_entropy
    return {"attention": [attention._BACKEND, attention._FORCED],
            "cross_entropy": [cross_entropy._BACKEND, cross_entropy._FORCED]}

# Bumped whenever a change to the model code or a kernel changes float results (not only the speed): run.py puts it
# in every step's key, so a run resumed after such a change recomputes its steps rather than mixing numerics.
# 2: CPU SDPA per document on 4-D tensors with enable_gqa (the flash kernel; was the math path)
# 3: CUDA decode attends over key spans rounded up to 64 slots (model.transformer.KVCache; CPU results unchanged)
# 4: the chunked cross-entropy forms logits for the target rows only (grad_weight still sums over every row, so the
#    tiny base is byte-identical; a matmul over fewer rows can round differently, e.g. at SmolLM2 shapes)
# 5: CPU sampling multiplies inputs of <= 4 rows by a weight's two halves in one bmm (model.transformer.Linear), not
#    through F.linear's small-M path: decode steps of 1-4 live rows round differently (training does not change)
# 6: the chunked cross-entropy's grad_weight sums over the target rows only for weights of >= 2^20 elements
#    (SmolLM2 and larger; kernels/cross_entropy.py GRAD_WEIGHT_TARGETS_MIN): their training rounds differently (the
#    tiny base is unchanged: it builds byte-identical)
NUMERICS = 6
