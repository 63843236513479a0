"""Thin vLLM wrapper with the native sampler's contract (see model/generate.py). vLLM is imported lazily.

What we pin, and why (checked against vLLM's source/docs):
- `LLM(generation_config="vllm")`: the default "auto" merges the checkpoint's generation_config.json (e.g. a
  top_k/top_p/repetition_penalty shipped with an instruct model) into the sampling defaults; "vllm" loads none.
  Versions before that option existed (default None) loaded none anyway, so we only pass it when the default is
  not None.
- `LLM(logprobs_mode="raw_logprobs")` (vllm.config.ModelConfig, v0.10+; raw = before temperature and any logit
  processor). Passed only when the installed EngineArgs has the field. Without it what comes back depends on the
  engine: the V1 engine (the default from vLLM 0.8) returns raw log-probs, the V0 engine (the default below 0.8)
  returns them after temperature ("processed"), which at T 0.1 is not the model's log-prob of the token. So below
  vLLM 0.8 (or with V0 forced) OPR-SC would rank by the wrong numbers, and rollout.py's --check-logprobs, which
  compares them with the trainer's forward pass, warns.
- `SamplingParams(top_k=<disabled>)`: vLLM changed the "disabled" value from -1 (which made 0 an error) to 0
  (which still accepts -1); the installed default is the disabled value, so we read it from `SamplingParams()`.
- `logprobs=0`: vLLM always adds the sampled token's entry, so each step's dict holds the sampled token and possibly
  others; we index it by the SAMPLED token id, never take the first entry.
- Prompts go in as token ids ({"prompt_token_ids": ids}, i.e. vllm.inputs.TokensPrompt), so vLLM never re-renders or
  re-tokenizes them.
"""
import dataclasses


def _engine_fields(vllm) -> dict:
    """name -> default of every EngineArgs field of the installed vLLM ({} when it cannot be introspected)."""
    engine_args = getattr(vllm, "EngineArgs", None)
    if engine_args is None or not dataclasses.is_dataclass(engine_args):
        return {}
    return {f.name: f.default for f in dataclasses.fields(engine_args)}


# vLLM's CPU backend reads gpu_memory_utilization as the share of the NUMA node's memory to reserve (0.92 by default:
# refused at start-up whenever other processes hold 8 % of it); an explicit KV-cache size skips that reservation
CPU_KV_CACHE_GIB = 2


def cpu_threads_env(threads: int) -> dict:
    """Environment for vLLM's CPU backend on `threads` cores: no core held back for its own front end (it reserves one
    by default, a half of a 2-core machine) and its OpenMP threads bound to cores 0..threads-1."""
    return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}


def llm_kwargs(vllm, ckpt_dir, *, tp: int, seed: int, cpu: bool = False) -> dict:
    """Keyword arguments for vllm.LLM, with the version-dependent options only where supported. cpu: the CPU backend
    (fp32, as the native engine samples there; a fixed KV-cache size instead of a share of the machine's memory)."""
    fields = _engine_fields(vllm)
    kw = {"model": str(ckpt_dir), "tensor_parallel_size": tp, "seed": seed}
    if cpu:
        kw.update(dtype="float32", kv_cache_memory_bytes=CPU_KV_CACHE_GIB << 30)
    if "generation_config" in fields and fields["generation_config"] is not None:
        kw["generation_config"] = "vllm"
    if "logprobs_mode" in fields:
        kw["logprobs_mode"] = "raw_logprobs"
    return kw


def sampling_params(vllm, *, temperature: float, max_new_tokens: int, stop_ids):
    top_k_disabled = vllm.SamplingParams().top_k  # -1 on old vLLM, 0 on new
    return vllm.SamplingParams(temperature=temperature, top_p=1.0, top_k=top_k_disabled, min_p=0.0,
                               repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                               max_tokens=max_new_tokens, logprobs=0, stop_token_ids=sorted(stop_ids),
                               skip_special_tokens=True)


def sampled_logprobs(completion) -> list[float]:
    """The log-prob of each sampled token from a CompletionOutput (logprobs: list[dict[token_id, Logprob]])."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although SamplingParams(logprobs=0) asked for them")
    if len(completion.logprobs) != len(completion.token_ids):
        raise RuntimeError(f"vLLM returned {len(completion.logprobs)} logprob entries for "
                           f"{len(completion.token_ids)} tokens")
    out = []
    for t, (token, step) in enumerate(zip(completion.token_ids, completion.logprobs)):
        if token not in step:
            raise RuntimeError(f"vLLM logprobs at step {t} lack the sampled token {token} (has {list(step)[:5]})")
        out.append(float(step[token].logprob))
    return out


def generate(ckpt_dir, prompts: list[list[int]], *, temperature: float, max_new_tokens, stop_ids, seed: int,
             tp: int = 1, progress: bool = True) -> list[dict]:
    """One response per prompt (token id lists) in input order: {"token_ids", "logprobs", "finish_reason"}.
    max_new_tokens: one cap, or one per prompt (LLM.generate takes one SamplingParams per prompt)."""
    import vllm

    import os

    import torch
    cpu = not torch.cuda.is_available()
    if cpu:  # this process's threads (the step's pinned count), unless the caller set vLLM's own variables
        for k, v in cpu_threads_env(torch.get_num_threads()).items():
            os.environ.setdefault(k, v)
    llm = vllm.LLM(**llm_kwargs(vllm, ckpt_dir, tp=tp, seed=seed, cpu=cpu))
    if not isinstance(max_new_tokens, int) and len(set(max_new_tokens)) == 1:
        max_new_tokens = max_new_tokens[0]  # one cap for all: one SamplingParams, as before per-prompt caps
    if isinstance(max_new_tokens, int):
        params = sampling_params(vllm, temperature=temperature, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    else:
        params = [sampling_params(vllm, temperature=temperature, max_new_tokens=m, stop_ids=stop_ids)
                  for m in max_new_tokens]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=progress)
    results = []
    for out in outputs:
        c = out.outputs[0]
        reason = c.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with finish_reason={reason!r} (expected stop or length)")
        results.append({"token_ids": list(c.token_ids), "logprobs": sampled_logprobs(c), "finish_reason": reason})
    return results
