"""How a generating step (rollout, evaluation, drift) uses the node's GPUs:
DP workers of TP GPUs each (run.py --tp).

run.py launches the layout and the cost planner (plan.py, model.costs) prices its generating steps
on it: generation_layout picks it from --gpus and --tp (default_tp: the smallest of TP_SIZES whose
share of the bf16 weights fits WEIGHT_SHARE of a GPU), and check_tp refuses, in one line, a TP the
run cannot launch: one that does not divide the GPUs, that the model's attention heads cannot take
(heads_refusal, vLLM's rule), or above 1 on an engine without tensor parallelism.
"""
from common.errors import UserError
# the node's GPU memory and the layout's shape are the cost model's: it prices steps on a
# layout without importing the pipeline
from model.costs import GPU_MEMORY_GB, Layout

TP_SIZES = (1, 2, 4, 8)  # run.py's default --tp: the smallest of these whose share of
                         # the weights fits a GPU
WEIGHT_SHARE = 0.5       # of a GPU's memory the weights may take in a generation worker
                         # (the rest: KV cache, graphs)


def heads_refusal(cfg, tp: int) -> str | None:
    """Why vLLM cannot split cfg's attention over tp GPUs, or None. vLLM's rule, from its
    source: ModelConfig.
    verify_with_parallel_config (vllm/config/model.py) refuses num_attention_heads % tp != 0
    ("Total number of attention heads (28) must be divisible by tensor parallel size (8)",
    vllm issue 11797: Qwen2-7B on 8 GPUs);
    QKVParallelLinear (vllm/model_executor/layers/linear.py) splits the key-value heads with
    divide(num_key_value_heads, tp) when tp < num_key_value_heads and else replicates them with
    divide(tp, num_key_value_heads), where divide() asserts an exact division."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    if heads % tp:
        return f"{heads} attention heads do not divide by {tp}"
    if (kv % tp if tp < kv else tp % kv):
        return f"{kv} key-value heads {'do not divide by' if tp < kv else 'do not divide'} {tp}"
    return None


def tp_choices(cfg, gpus: int) -> list[int]:
    """Every --tp run.py accepts for vLLM on `gpus` GPUs: the divisors of gpus
    that the heads take."""
    return [t for t in range(1, gpus + 1) if gpus % t == 0 and heads_refusal(cfg, t) is None]


def default_tp(cfg, gpus: int) -> tuple[int, str]:
    """(run.py's --tp when not given on vLLM, why): the smallest of TP_SIZES that divides gpus, that
    the heads take, and whose share of the bf16 weights fits WEIGHT_SHARE of a GPU: the most workers
    (DP = gpus / TP), each holding the model with room for its KV cache.
    (Qwen2.5-7B on 8 H100s: TP 1, 8 workers; the paper ran TP 4.)"""
    weights_gb = 2 * cfg.num_params(embeddings=True) / 1e9
    allowed = [t for t in TP_SIZES if t in tp_choices(cfg, gpus)]
    fits = [t for t in allowed if weights_gb / t <= WEIGHT_SHARE * GPU_MEMORY_GB]
    if not fits:
        return allowed[-1], (f"default: the largest TP the heads and GPUs allow "
                             f"({weights_gb:.0f} GB of weights fit no smaller one)")
    return fits[0], (f"default: the smallest TP that holds {weights_gb:.0f} GB of weights "
                     f"with room for the KV cache")


def or_list(values) -> str:
    """The values as a sentence lists them: '1, 2 or 4'."""
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def check_tp(cfg, name: str, gpus: int, tp: int, engine: str, gpus_flag: str = "--gpus"):
    """A --tp the run cannot launch, refused in one line: one that does not divide the GPUs into
    workers, that the model's heads cannot take (heads_refusal), or above 1 on an engine without
    tensor parallelism."""
    problems = [f"{'more than' if tp > gpus else 'does not divide'} {gpus_flag} {gpus} "
                f"(TP GPUs per generation worker)"] if gpus % tp else []
    heads = heads_refusal(cfg, tp)
    if heads:
        problems.append(f"{name}'s {heads}")
    if problems:
        raise UserError(f"--tp {tp}: {'; '.join(problems)}; use {or_list(tp_choices(cfg, gpus))}")
    if tp > 1 and engine != "vllm":
        raise UserError(f"--tp {tp}: the {engine} engine has no tensor parallelism (each of its "
                        f"workers holds the whole model; --engine auto picks vLLM only where CUDA "
                        f"and vLLM are): pass --engine vllm, or --tp 1")


def generation_layout(gpus: int, tp: int | None = None, cfg=None, name: str = "",
                      engine: str = "vllm", gpus_flag: str = "--gpus",
                      cpu_workers: int = 1) -> Layout:
    """The layout run.py launches and the planner prices, from --gpus (gpus_flag: the flag that gave
    it) and --tp (None: the default) for the model of cfg (`name` names it in a refusal):
    DP = gpus / TP workers. A CPU run (gpus 0) has cpu_workers workers (run.py --gen-workers), each
    with its share of the step's threads."""
    if not gpus:
        if tp not in (None, 1):
            raise UserError(f"--tp {tp}: a CPU run (--gpus 0) has no tensor parallelism: "
                            f"--tp must be 1 (or absent)")
        return Layout(0, 1, cpu_workers, "the CPU")
    if cpu_workers != 1:
        raise UserError(f"--gen-workers {cpu_workers}: on GPUs the workers are {gpus_flag} / --tp; "
                        f"drop --gen-workers")
    if tp is not None:
        check_tp(cfg, name, gpus, tp, engine, gpus_flag)
        return Layout(gpus, tp, gpus // tp, f"--tp {tp}")
    if engine != "vllm":
        return Layout(gpus, 1, gpus,
                      f"the {engine} engine: no tensor parallelism, a worker per GPU")
    tp, why = default_tp(cfg, gpus)
    return Layout(gpus, tp, gpus // tp, why)
