"""The losses train.py's objectives (methods/) are made of, each a micro-batch -> sums:

    loss, parts = sft_loss(model, has_replay, device, micro_batch)
    # parts: [NLL, KL, task NLL, replay NLL], detached

  sft     the response-token NLL (the paper's fine-tuning, and OPR's)
  sft-kl  NLL + beta * KL(student || EMA teacher) on the gold tokens, both models
          reading the same sequence
  sdft    the KL between the student and a teacher that reads the demonstration in context,
          on the student's own responses (its micro-batches are (student, teacher) example
          pairs: on_policy_batches)

The model computes a loss inside its forward (`model(ids, pos, loss=nll(labels))`, so that under
FSDP lm_head stays in the root unit): nll, nll_kl and kl below are what it is given, functions of
the final-normed hidden states [T, H] and lm_head's weight.
"""
import hashlib
import torch
import torch.distributed as dist

from data.packing import IGNORE, Example, collate, pack
from kernels import fused_linear_cross_entropy
from kernels.kl import chunked_kl


# ---- losses inside the model's forward: (hidden [T, H], lm_head weight [V, H]) -> sums -----------
def nll(labels, replay_mask=None):
    """The summed NLL of labels [B, T] (already shifted; -100 ignored), an fp32 scalar; with
    replay_mask [B, T] bool, a [2] tensor: (the sum where the mask is False, where it is True), each
    token entering the loss kernel once."""
    def loss(h, w):
        y = labels.flatten()
        if replay_mask is None:
            return fused_linear_cross_entropy(h, w, y)
        m = replay_mask.flatten()
        return torch.stack([fused_linear_cross_entropy(h[~m], w, y[~m]),
                            fused_linear_cross_entropy(h[m], w, y[m])])
    return loss


def kl(labels, teacher_hidden, teacher_weight, direction: str, temperature: float = 1.0):
    """The summed KL between the model and a teacher (its hidden states at the non-ignored positions
    of labels, its lm_head weight) over the full vocabulary at those positions
    (kernels.kl.chunked_kl), both softmaxes at `temperature` (logits / T: the hidden states scaled,
    since logits are linear in them)."""
    def loss(h, w):
        h, th = h[labels.flatten() != IGNORE], teacher_hidden
        if temperature != 1.0:
            h, th = h / temperature, th / temperature
        return chunked_kl(h, w, th, teacher_weight, direction)
    return loss


def nll_kl(labels, teacher_hidden, teacher_weight, direction: str, replay_mask=None,
           temperature: float = 1.0):
    """(nll(labels, replay_mask), kl(...)) from one forward."""
    def loss(h, w):
        return (nll(labels, replay_mask)(h, w),
                kl(labels, teacher_hidden, teacher_weight, direction, temperature)(h, w))
    return loss


# ---- the objectives: a micro-batch -> (loss sum to backpropagate,
#      [NLL, KL, task NLL, replay NLL] sums) -------------------------------------------------------
def sft_loss(model, has_replay: bool, device, mb: list, teacher=None, beta: float = 0.0,
             direction: str = "reverse", temperature: float = 1.0, nll_weight: float = 1.0,
             on_hidden=None):
    """sft: mb is a list of examples. With a teacher reading the same sequences (sft-kl, lwf):
    nll_weight * NLL + beta * KL at `temperature`. on_hidden: called with the model's hidden states
    of every layer (ilora; Transformer.forward)."""
    ids, pos, tgt, cu, max_len = collate(mb, device)
    kw = dict(cu_seqlens=cu, max_seqlen=max_len)
    mask, slot = replay_split(mb, device) if has_replay else (None, 0)
    parts = torch.zeros(4, device=device)
    if teacher is None:
        loss = model(ids, pos, loss=nll(tgt, mask), on_hidden=on_hidden, **kw)
    else:  # sft-kl: the teacher reads the same gold sequence
        with torch.no_grad():
            t_hidden = teacher(ids, pos, return_hidden=True, **kw)[tgt != IGNORE]
        loss, kl_sum = model(ids, pos, loss=nll_kl(tgt, t_hidden, teacher.lm_head.weight,
                                                   direction, mask, temperature), **kw)
        parts[1] = kl_sum.detach()
    if mask is None:
        parts[2 + slot] = loss.detach()
    else:  # a micro-batch of both sources: the forward returned (task, replay) sums
        parts[2:] = loss.detach()
        loss = loss.sum()
    parts[0] = loss.detach()
    if teacher is None:
        return loss, parts
    return (loss if nll_weight == 1.0 else nll_weight * loss) + beta * kl_sum, parts


def sdft_loss(model, scorer, direction: str, device, mb: list):
    """sdft: mb is a list of (student, teacher) example pairs. The teacher (no gradient) reads
    prompt + demonstration + y, the student prompt + y, and the student computes both sides'
    full-vocabulary log-probs chunk by chunk. FSDP leaves the root unit (lm_head) unsharded after a
    forward, so the teacher's full lm_head weight is at hand."""
    ids, pos, tgt, cu, max_len = collate([t for _, t in mb], device)
    with torch.no_grad():
        t_hidden = scorer(ids, pos, return_hidden=True, cu_seqlens=cu,
                          max_seqlen=max_len)[tgt != IGNORE]
    ids, pos, tgt, cu, max_len = collate([x for x, _ in mb], device)
    loss = model(ids, pos, loss=kl(tgt, t_hidden, scorer.lm_head.weight.detach(), direction),
                 cu_seqlens=cu, max_seqlen=max_len)
    parts = torch.zeros(4, device=device)
    parts[1] = loss.detach()
    return loss, parts


def replay_split(examples, device):
    """How a micro-batch's NLL splits by source: (None, 0) or (None, 1) when all its examples are
    task (0) or replay (1) examples, else (a [1,T] bool mask of the replay tokens, None), so that
    only mixed micro-batches pay for it."""
    flags = {e.replay for e in examples}
    if len(flags) < 2:
        return None, int(flags.pop()) if flags else 0
    mask = torch.tensor([e.replay for e in examples for _ in e.ids], dtype=torch.bool,
                        device=device)[None]
    return mask, None


# ---- sdft's micro-batches: the student's own responses -------------------------------------------
def sample_seed(seed: int, step: int, idx: int) -> int:
    """The seed of example idx's response at optimizer step `step` (sdft): a function of the
    example, not of the rank that samples it, so any world size (and a resumed run) samples
    the same responses."""
    return int(hashlib.sha256(f"{seed}:{step}:{idx}".encode()).hexdigest()[:15], 16)


def local(t):
    """A parameter's (or its gradient's) own rows on this rank: a DTensor's local shard, a
    plain tensor itself."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def trained(model) -> list:
    """(name, parameter) of the parameters a stage trains: all of them, or a LoRA stage's adapters
    (the base frozen)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def fsdp_units(model) -> list:
    """The FSDP2 units of a model from build_model (model/fsdp.py: blocks, then the root); [] when
    it is not sharded."""
    from torch.distributed.fsdp import FSDPModule
    return [m for m in (*model.model.layers, model) if isinstance(m, FSDPModule)]


def on_policy_batches(mine: list[int], outs: list[dict], prompt_ids, teacher_ids, skip_tokens: int,
                      micro_tokens: int, device):
    """This rank's (student, teacher) example pairs, packed into micro-batches. The student's
    sequence is its prompt + its response y, the teacher's is the prompt with the demonstration +
    the same y; both predict y at the same positions of the response, so their hidden states line up
    token for token. Every rank gets the same number of micro-batches (FSDP needs every rank in
    every collective). Returns (micro-batches, number of loss tokens in the whole step, student
    tokens in the whole step)."""
    pairs = []
    for i, out in zip(mine, outs):
        y = out["token_ids"]
        tgt = [IGNORE] * min(skip_tokens, len(y)) + y[skip_tokens:]
        pairs.append((Example(prompt_ids[i] + y,
                              [IGNORE] * (len(prompt_ids[i]) - 1) + tgt + [IGNORE]),
                      Example(teacher_ids[i] + y,
                              [IGNORE] * (len(teacher_ids[i]) - 1) + tgt + [IGNORE])))
    bins = pack(list(range(len(pairs))), [max(len(s.ids), len(t.ids)) for s, t in pairs],
                micro_tokens, 1)[0]
    n_bins = torch.tensor(len(bins), device=device)
    dist.all_reduce(n_bins, op=dist.ReduceOp.MAX)
    bins += [[] for _ in range(int(n_bins) - len(bins))]
    counts = torch.tensor([sum(s.n_targets for s, _ in pairs), sum(len(s.ids) for s, _ in pairs)],
                          device=device)
    dist.all_reduce(counts)
    return [[pairs[j] for j in b] for b in bins], *counts.tolist()
