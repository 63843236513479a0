"""Per-token KL between the student's softmax(h @ W.T) and fixed teacher log-probs, without keeping the
student's [tokens x vocab] logits alive for backward (each chunk is recomputed in backward)."""
import torch
from torch.utils.checkpoint import checkpoint


def _chunk_kl(h, w, teacher_logprobs, reverse: bool):
    s = torch.log_softmax((h @ w.T).float(), dim=-1)
    if reverse:  # KL(student || teacher)
        return (s.exp() * (s - teacher_logprobs)).sum()
    return (teacher_logprobs.exp() * (teacher_logprobs - s)).sum()  # KL(teacher || student)


def chunked_kl(hidden, weight, teacher_logprobs, direction: str = "reverse", chunk: int = 1024):
    """hidden [M,H] student states at the M training positions, weight [V,H], teacher_logprobs [M,V] fp32.
    Returns the SUM over positions of KL (fp32 scalar); direction 'reverse' = KL(student||teacher),
    'forward' = KL(teacher||student)."""
    if direction not in ("reverse", "forward"):
        raise ValueError(f"KL direction must be 'reverse' or 'forward', got {direction!r}")
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(_chunk_kl, hidden[i:i + chunk], weight, teacher_logprobs[i:i + chunk],
                                   direction == "reverse", use_reentrant=False)
    return total
