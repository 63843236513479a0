"""The sampling engine: one response per prompt, with the raw log-prob of each sampled token.

    from engine.sampling import generate
    outs = generate(ckpt_dir, prompts, temperature=0.1, max_new_tokens=512, seed=0)  # vLLM/native

sampling.py is the scripts' entry (the engine chosen once, the prompts shared among data-parallel
workers: workers.py); vllm_engine.py wraps vLLM; native.py runs the native engine on a model loaded
in this process. The native engine is nano-vllm's engine room, a page per part: engine.py (the
step: KV cache, forward, decode step, CUDA graphs), scheduler.py (continuous batching, shared
prefixes), sampler.py (Gumbel-max over counter-based noise, raw log-probs). It runs model/'s
transformer, tokenizer and checkpoints with kernels/' kernels; model/ never imports it. It reads
no task table: a task's own length cap or temperature comes as numbers per prompt
(sampling.generate_per_prompt; the scripts read them with data.manifest.sampling_settings).
"""
