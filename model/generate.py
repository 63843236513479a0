"""Native sampling entry point: one call, one response per prompt, on the model in this process (model/engine.py).

    outs = generate(model, prompts, temperature=0.1, max_new_tokens=512, stop_ids={2}, seed=0, batch_size=32)
    outs[i] = {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}

- A row that samples a stop id (kept in `token_ids`, like vLLM) or reaches `max_new_tokens` ends; its place in the
  batch goes to the next waiting prompt (continuous batching), so `batch_size` is the number of sequences alive at
  once, i.e. the KV cache's rows: a memory budget, not a partition of the prompts.
- `logprobs[t]` is the RAW model log-prob of the sampled token: log_softmax of the logits before temperature, so it
  does not depend on the sampling temperature (vLLM's logprobs_mode="raw_logprobs").
- Sampling is exact softmax(logits / temperature) sampling with counter-based noise keyed per prompt: (prompts,
  seed) fixes the output, and a prompt's response does not depend on which other prompts share its batch, on
  batch_size or on the device's schedule. With `seeds=` (one per prompt) the key is the prompt's own seed (train.py's
  SDFT: a response is a function of its example and step, whichever rank samples it). temperature 0 is greedy.
  No top-k, no top-p, no repetition penalty.
"""
import torch

from model.engine import Engine
from model.transformer import Transformer


def default_batch_size(device) -> int:
    """Live sequences when --batch-size is not given: 64 on the CPU (SmolLM2's decode step at 2 threads: 211 tokens/s
    at 32 rows, 279 at 64, 329 at 128; the KV cache grows with it), 256 on a GPU (vLLM's default max_num_seqs)."""
    return 256 if torch.device(device).type == "cuda" else 64


def generate(model: Transformer, prompts: list[list[int]], *, temperature: float = 0.1,
             max_new_tokens: int | list[int] = 512,
             stop_ids=(), seed: int = 0, seeds: list[int] | None = None, batch_size: int | None = None,
             progress: bool = True, fuse: bool | None = None) -> list[dict]:
    """One response per prompt (token id lists), returned in the input order. See the module docstring.
    max_new_tokens: one cap, or one per prompt. seeds: one seed per prompt (then `seed` is unused). fuse: see
    model.engine.Engine (default: when the model has no trainable parameters, i.e. it was loaded for sampling)."""
    if batch_size is None:
        batch_size = default_batch_size(model.lm_head.weight.device)
    engine = Engine(model, max_seqs=max(1, min(batch_size, len(prompts))), fuse=fuse)
    return engine.generate(prompts, temperature=temperature, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                           seed=seed, seeds=seeds, progress=progress)
