"""One public function per kernel; each picks a GPU library when present, pure torch otherwise."""

from kernels.attention import varlen_attention
from kernels.cross_entropy import fused_linear_cross_entropy

__all__ = ["varlen_attention", "fused_linear_cross_entropy"]
