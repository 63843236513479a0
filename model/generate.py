"""Native batched sampler (gpt-fast style): left-padded prefill into a preallocated KV cache, then one token per step.

    outs = generate(model, prompts, temperature=0.1, max_new_tokens=512, stop_ids={2}, seed=0, batch_size=32)
    outs[i] = {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}

- Prompts are sorted by length (longest first, so an out-of-memory shows up in the first batch) and cut into batches
  of `batch_size`; within a batch they are left-padded, so every row's next token sits in the last column.
- A row that samples a stop id (kept in `token_ids`, like vLLM) or reaches `max_new_tokens` leaves the batch:
  `KVCache.keep` drops its keys/values, so later steps only pay for live rows.
- `logprobs[t]` is the RAW model log-prob of the sampled token: log_softmax of the logits before temperature, so it
  does not depend on the sampling temperature (vLLM's logprobs_mode="raw_logprobs").
- Sampling is softmax(logits / temperature) + torch.multinomial with one seeded torch.Generator per call; batches
  run in a fixed order, so (prompts, seed, batch_size) fixes the output. temperature 0 is greedy (argmax).
  With `seeds=` (one per prompt) each prompt gets a generator of its own instead, so its response does not depend
  on which other prompts share its batch, nor on which rank of a training job samples it (train.py's SDFT).
  No top-k, no top-p, no repetition penalty.
"""
import time

import torch

from model.transformer import KVCache, Transformer


def sample_next(logits: torch.Tensor, temperature: float, generator):
    """logits [B,V] -> (token ids [B] long, raw log-prob of each sampled token [B] fp32).
    generator: one torch.Generator (or None) for the whole batch, or a list of B generators, one per row."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if isinstance(generator, list):
            tokens = torch.cat([torch.multinomial(probs[r:r + 1], 1, generator=g)[0] for r, g in enumerate(generator)])
        else:
            tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # log_softmax(logits)[tok] without materialising a second [B,V] tensor
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return tokens, logprobs


@torch.inference_mode()
def generate_batch(model: Transformer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                   stop_ids, generator, pad_id: int = 0) -> list[dict]:
    """Sample one response for each prompt in a single left-padded batch. See the module docstring.
    generator: one torch.Generator (or None), or a list with one generator per prompt."""
    per_row = isinstance(generator, list)
    device = model.lm_head.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) == 0:
        raise ValueError("generate: empty prompt (no token ids)")
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p, dtype=torch.long)
    ids = ids.to(device)
    cache = KVCache(model.cfg, B, P + max_new_tokens, device, model.lm_head.weight.dtype)
    cache.valid[:, :P] = torch.arange(P, device=device)[None, :] >= (P - lengths)[:, None]
    position_ids = (cache.valid[:, :P].long().cumsum(1) - 1).clamp(min=0)

    # prefill: only the last position's logits are needed, so skip lm_head on the rest ([B,P,V] would be huge)
    hidden = model(ids, position_ids, cache=cache, return_hidden=True)[:, -1]
    logits = model.lm_head(hidden)

    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    out_tokens = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
    out_logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
    n_new = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)  # final length of each response
    stopped = torch.zeros(B, dtype=torch.bool, device=device)
    rows = torch.arange(B, device=device)  # original row of each live row
    next_pos = lengths.clone()  # position id of the token about to be fed, per live row
    for step in range(max_new_tokens):
        gen = [generator[r] for r in rows.tolist()] if per_row else generator
        tokens, logprobs = sample_next(logits, temperature, gen)
        out_tokens[rows, step] = tokens
        out_logprobs[rows, step] = logprobs
        if step == max_new_tokens - 1:
            break
        done = torch.isin(tokens, stop)
        if done.any():
            n_new[rows[done]] = step + 1
            stopped[rows[done]] = True
            live = (~done).nonzero().squeeze(1)
            if live.numel() == 0:
                break
            cache.keep(live)
            rows, tokens, next_pos = rows[live], tokens[live], next_pos[live]
        cache.valid[:, cache.pos] = True
        logits = model(tokens[:, None], next_pos[:, None], cache=cache)[:, -1]
        next_pos += 1

    n_new, stopped = n_new.tolist(), stopped.tolist()
    out_tokens, out_logprobs = out_tokens.tolist(), out_logprobs.tolist()
    # a row that hits a stop id on its very last allowed token finished by "stop", not by length
    return [{"token_ids": out_tokens[r][:n_new[r]], "logprobs": out_logprobs[r][:n_new[r]],
             "finish_reason": "stop" if stopped[r] or out_tokens[r][n_new[r] - 1] in stop_ids else "length"}
            for r in range(B)]


def generate(model: Transformer, prompts: list[list[int]], *, temperature: float = 0.1, max_new_tokens: int = 512,
             stop_ids=(), seed: int = 0, seeds: list[int] | None = None, batch_size: int = 32, pad_id: int = 0,
             progress: bool = True) -> list[dict]:
    """One response per prompt (token id lists), returned in the input order. See the module docstring.
    seeds: one seed per prompt (then `seed` is unused): each prompt samples from a generator of its own."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stop_ids = set(int(t) for t in stop_ids)
    device = model.lm_head.weight.device
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts")
    generator = torch.Generator(device=device).manual_seed(seed) if seeds is None else None
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results = [None] * len(prompts)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(prompts), unit="prompt", desc="generate", dynamic_ncols=True)
    t0, n_tokens = time.perf_counter(), 0
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        outs = generate_batch(model, [prompts[i] for i in idx], max_new_tokens=max_new_tokens,
                              temperature=temperature, stop_ids=stop_ids, pad_id=pad_id,
                              generator=generator if seeds is None else
                              [torch.Generator(device=device).manual_seed(seeds[i]) for i in idx])
        for i, o in zip(idx, outs):
            results[i] = o
        n_tokens += sum(len(o["token_ids"]) for o in outs)
        if bar is not None:
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - t0):.1f}")
    if bar is not None:
        bar.close()
    return results
