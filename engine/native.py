"""The native engine on a model in this process: one call, one response per prompt
(engine/engine.py runs it).

    outs = sample(model, prompts, temperature=0.1, max_new_tokens=512, stop_ids={2}, seed=0,
                  batch_size=32)
    outs[i] = {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}

- A row that samples a stop id (kept in `token_ids`, like vLLM) or reaches `max_new_tokens` ends;
  its place in the batch goes to the next waiting prompt (continuous batching), so `batch_size` is
  the number of sequences alive at once, i.e. the KV cache's rows: a memory budget, not a partition
  of the prompts (default: what the memory holds, default_batch_size).
- `logprobs[t]` is the RAW model log-prob of the sampled token: log_softmax of the logits before
  temperature, so it does not depend on the sampling temperature (vLLM's
  logprobs_mode="raw_logprobs").
- Sampling is exact softmax(logits / temperature) sampling with counter-based noise keyed per
  prompt: (prompts, seed) fixes the output, and a prompt's response does not depend on which
  other prompts share its batch, on batch_size or on the device's schedule. With `seeds=` (one
  per prompt) the key is the prompt's own seed (train.py's SDFT: a response is a function of
  its example and step, whichever rank samples it). temperature 0 is greedy. No top-k, no
  top-p, no repetition penalty.
"""
import os

import torch

from engine.engine import Engine
from model.transformer import Transformer


# live sequences at most: on the CPU a decode step's tokens/s grows little past 64 rows while
# its KV cache keeps growing (BENCHMARKS.md, "The continuous-batching engine"); 256 is vLLM's
# default max_num_seqs
MAX_ROWS = {"cpu": 64, "cuda": 256}
KV_SHARE = {"cpu": 0.25, "cuda": 0.6}  # of the memory available now that the KV cache may take


def default_batch_size(model: Transformer, cols: int) -> int:
    """Live sequences when --batch-size is not given: as many as a KV cache of `cols` columns per
    row fits in KV_SHARE of the memory available (the CPU's MemAvailable, the GPU's free memory), at
    most MAX_ROWS. Every row is allocated for the longest prompt plus its cap, so long prompts get
    fewer rows: on a GPU, Llama-3.1-8B at 2,560 columns would need 86 GB for 256 rows."""
    cfg, w = model.cfg, model.lm_head.weight
    per_row = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * cols
               * w.element_size())
    if w.is_cuda:
        kind, available = "cuda", torch.cuda.mem_get_info(w.device)[0]
    else:
        kind, available = "cpu", _mem_available()
    return max(1, min(MAX_ROWS[kind], int(KV_SHARE[kind] * available // per_row)))


def _mem_available() -> int:
    """Bytes of memory available to a new allocation (Linux MemAvailable; elsewhere all
    physical memory)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sample(model: Transformer, prompts: list[list[int]], *, temperature: float = 0.1,
           max_new_tokens: int | list[int] = 512, stop_ids=(), seed: int = 0,
           seeds: list[int] | None = None, batch_size: int | None = None,
           progress: bool = True) -> list[dict]:
    """One response per prompt (token id lists), returned in the input order. See the module
    docstring. max_new_tokens: one cap, or one per prompt. seeds: one seed per prompt (then `seed`
    is unused). A new Engine per call: it packs the model's weights as they are now (sdft's training
    weights change between calls)."""
    if batch_size is None and prompts:
        caps = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
                else max_new_tokens)
        batch_size = default_batch_size(model, max(len(p) + c for p, c in zip(prompts, caps)))
    engine = Engine(model, max_seqs=max(1, min(batch_size or 1, len(prompts))))
    return engine.run(prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                      stop_ids=stop_ids, seed=seed, seeds=seeds, progress=progress)
