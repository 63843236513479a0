"""Per-token KL between the student's softmax(h @ W.T) and a teacher's softmax(h_t @ W_t.T), chunk
by chunk: neither side's [tokens x vocab] logits ever exist whole, and the student's chunk is
recomputed in backward."""
import torch
from torch.utils.checkpoint import checkpoint


def _chunk_kl(h, w, t_h, t_w, reverse: bool):
    s = torch.log_softmax((h @ w.T).float(), dim=-1)
    with torch.no_grad():
        t = torch.log_softmax((t_h @ t_w.T).float(), dim=-1)
    if reverse:  # KL(student || teacher)
        return (s.exp() * (s - t)).sum()
    return (t.exp() * (t - s)).sum()  # KL(teacher || student)


def chunked_kl(hidden, weight, teacher_hidden, teacher_weight, direction: str = "reverse",
               chunk: int = 1024):
    """hidden [M,H] student states at the M training positions, weight [V,H] the student's lm_head;
    teacher_hidden [M,H] and teacher_weight [V,H] the same for the (frozen) teacher.
    Returns the SUM over positions of KL (fp32 scalar); direction 'reverse' = KL(student||teacher),
    'forward' = KL(teacher||student). Gradients flow to the student only.
    M may be 0 (a rank's empty micro-batch): the result is still a zero connected to `weight`
    and `hidden`, so every rank's backward reaches the same parameters (FSDP reduce-scatters the
    same set everywhere)."""
    if direction not in ("reverse", "forward"):
        raise ValueError(f"KL direction must be 'reverse' or 'forward', got {direction!r}")
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, max(hidden.shape[0], 1), chunk):
        total = total + checkpoint(_chunk_kl, hidden[i:i + chunk], weight,
                                   teacher_hidden[i:i + chunk], teacher_weight,
                                   direction == "reverse", use_reentrant=False)
    return total
