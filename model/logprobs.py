"""Teacher-forced per-token measurements of given responses (no gradients): the log-prob of every
response token under a model and, against a reference model, the exact full-vocabulary
KL(p_model || p_ref) at every response position. Used by drift.py (per-update KL, gold NLL),
rollout.py --check-logprobs and run.py (a buffer's NLL).

    stats = response_stats(model, [(prompt_ids, response_ids), ...], ref=prev_model)
    stats[i] = {"logprobs": [R], "ref_logprobs": [R], "kl": [R]}
               (ref_logprobs and kl only when ref is given)

where R = len(response_ids) and position t is the prediction of response_ids[t] from
prompt + response[:t].

How: sequences are packed into rows of at most `max_tokens` tokens (data.packing: documents never
attend to each other, positions restart per document); each model runs one forward pass per row to
its final hidden states; the logits are then formed `chunk` response positions at a time from
those states, so a [tokens x vocab] tensor never exists whole (at vocab 151,936 and 2,048 tokens
it would be 1.2 GB per model in fp32). Logits, log-softmax and the KL are computed in fp32
whatever the models' dtype.
"""
import torch

from data.packing import IGNORE, Example, collate, pack
from model.transformer import packed_products, packs

CHUNK = 256          # response positions per logits chunk: 256 x 151,936 fp32 = 156 MB per model
MAX_TOKENS = 8192    # tokens per packed forward row


def chunked_token_stats(hidden, weight, targets, ref_hidden=None, ref_weight=None,
                        chunk: int = CHUNK):
    """hidden [M,H] and weight [V,H] of the model at M positions; targets [M] long (the token
    each position predicts); optionally ref_hidden [M,H], ref_weight [V,H] of a reference model
    at the same positions.
    Returns (logprobs [M], ref_logprobs [M] or None, kl [M] or None), fp32, where
    kl[m] = sum_v p(v) (log p(v) - log q(v)) with p = softmax(hidden[m] @ weight.T),
    q the reference's."""
    M = hidden.shape[0]
    w = weight.float()
    rw = ref_weight.float() if ref_hidden is not None else None
    logprobs = torch.empty(M, dtype=torch.float32, device=hidden.device)
    ref_logprobs = torch.empty_like(logprobs) if ref_hidden is not None else None
    kl = torch.empty_like(logprobs) if ref_hidden is not None else None
    for s in range(0, M, chunk):
        e = min(s + chunk, M)
        tgt = targets[s:e, None]
        logp = torch.log_softmax(hidden[s:e].float() @ w.T, dim=-1)  # [c, V]
        logprobs[s:e] = logp.gather(1, tgt).squeeze(1)
        if ref_hidden is not None:
            logq = torch.log_softmax(ref_hidden[s:e].float() @ rw.T, dim=-1)
            ref_logprobs[s:e] = logq.gather(1, tgt).squeeze(1)
            kl[s:e] = (logp.exp() * (logp - logq)).sum(-1)
    return logprobs, ref_logprobs, kl


def _hidden(model, ids, pos, cu, max_len):
    return model(ids, pos, cu_seqlens=cu, max_seqlen=max_len, return_hidden=True)[0]  # [T, H]


@torch.no_grad()
def response_stats(model, seqs, ref=None, *, max_tokens: int = MAX_TOKENS, chunk: int = CHUNK,
                   progress: bool = False, desc: str = "score", packed: bool = True) -> list[dict]:
    """seqs: list of (prompt_ids, response_ids) token-id lists. See the module docstring; results
    come back in input order. A sequence longer than max_tokens gets a row of its own. packed: the
    models' products read weights packed for oneDNN where transformer.packs packs them (the engine's
    products); False: the training model's products (F.linear), as rollout.py --check-logprobs
    compares against."""
    device = model.lm_head.weight.device
    examples, lengths = [], []
    for i, (prompt, response) in enumerate(seqs):
        if not prompt:
            raise ValueError(f"response_stats: sequence {i} has an empty prompt (no position "
                             f"predicts its first response token)")
        ids = list(prompt) + list(response)
        # targets[t] = the token position t predicts, on the positions that predict a response token
        targets = [IGNORE] * (len(prompt) - 1) + list(response) + [IGNORE]
        examples.append(Example(ids, targets))
        lengths.append(len(ids))
    rows = pack(list(range(len(seqs))), lengths, max_tokens, 1)[0]
    out = [None] * len(seqs)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(seqs), unit="seq", desc=desc, dynamic_ncols=True)
    products = ({**packs(model, head=False),
                 **(packs(ref, head=False) if ref is not None else {})}
                if packed else {})
    for row in rows:
        ids, pos, tgt, cu, max_len = collate([examples[i] for i in row], device)
        keep = tgt[0] != IGNORE
        targets = tgt[0][keep]
        with packed_products(products):
            h = _hidden(model, ids, pos, cu, max_len)[keep]
            rh = _hidden(ref, ids, pos, cu, max_len)[keep] if ref is not None else None
        lp, rlp, kl = chunked_token_stats(h, model.lm_head.weight, targets, rh,
                                          ref.lm_head.weight if ref is not None else None, chunk)
        start = 0
        # the kept positions of a row are its documents' response positions, in document order
        for i in row:
            r = len(seqs[i][1])
            out[i] = {"logprobs": lp[start:start + r].tolist()}
            if ref is not None:
                out[i]["ref_logprobs"] = rlp[start:start + r].tolist()
                out[i]["kl"] = kl[start:start + r].tolist()
            start += r
        if bar is not None:
            bar.update(len(row))
    if bar is not None:
        bar.close()
    return out
