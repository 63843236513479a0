"""plan.py — the cost planner: what a run.py command will train and generate, in GPU-hours, before it runs.

    python run.py --model DIR --data TRACE --gpus 8 --dry-run     # the plan of that exact command; runs nothing
    python plan.py --paper [--trace ../shared/trace]              # the paper's grid on Qwen2.5-7B shapes

For every step the pipeline would run (the same keys as run.py's Pipeline), from the real data:
  train    tokens = epochs x sum of the chat-templated lengths of its mixture (the task's examples that pass the
           over-long filter + the previous stage's buffer): exactly train.py's train_summary.json "tokens" when the
           buffer is known before the run (none, or gold replay); for an OPR buffer (model answers, unknown until
           the rollout) the gold answers' mean length stands in, and an upper bound takes every answer at
           max_new_tokens
  rollout  prompts = every prior task's filtered training prompts; prompt tokens; new tokens: an upper bound
  eval     (prompts x max_new_tokens) and an estimate (the gold answer's length, + end-of-turn)
  replay / score   CPU only: no GPU time
GPU-hours, for a throughput profile (flags below, defaults in the block underneath):
  train    tokens / train tok/s per GPU (+ a fixed start/load/save overhead per step on every GPU); the default
           train tok/s is MFU x peak / FLOPs per token, with train.py's own FLOPs count (6 N + 6 V H + attention at
           the mixture's mean document length), SDFT x 4/3 (the teacher's extra forward)
  generate new tokens / gen tok/s per GPU + prompt tokens / prefill tok/s per GPU, spread over the generating GPUs
           of the layout (+ the overhead per step): DP workers of TP GPUs each (run.py --tp; DP = GPUs / TP), every
           worker sampling its share of the step's prompts at once; the node's GPUs are held for the step's wall time
FSDP2 memory per GPU at --plan-gpus ranks, as train.py holds it: fp32 master weights, fp32 gradients and AdamW's
two fp32 moments, all sharded; the bf16 compute copies all-gathered per unit (the root unit -- embeddings, final
norm, lm_head -- for the whole step, two blocks at a time: current + prefetch) with their bf16 gradients before the
reduce-scatter; the loss kernel's fp32 [V, H] weight-gradient accumulator and one chunk of logits; activations at
--micro-tokens tokens with and without activation checkpointing (the tensors autograd keeps per token and layer,
listed in activation_bytes_per_token_layer).
"""
import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from data.errors import UserError
from pipeline.cli import Parser, float_in, int_at_least, main_cli
from pipeline import keep

# ---- defaults: the throughput profile (BENCHMARKS.md "Anchors"; nothing here was measured on a GPU) --------------
PEAK_TFLOPS = 989.0      # H100 SXM, bf16 dense
TRAIN_MFU = 0.36         # within torchtitan's published range for Llama-3.1-8B, FSDP2 bf16 on 8xH100 ("Anchors")
GEN_TOK_S = 4000.0       # generated tokens/s per GPU (vLLM, 7-8B bf16, large batches): an assumption, not an anchor
PREFILL_FACTOR = 3.0     # prompt tokens cost a forward only: prefill tok/s = 3 x train tok/s (same MFU, 2N vs 6N)
STEP_OVERHEAD_S = 120.0  # per GPU step: process start, loading the checkpoint (and saving one) or the engine start-up
GPUS = 8
GPU_MEMORY_GB = 80.0     # H100 80 GB
MEMORY_SHARE = 0.9       # of a GPU's memory that train.py's --micro-tokens rule plans for (the rest: the CUDA
                         # context, NCCL's buffers, the allocator's fragmentation)
PAPER_GPU_HOURS = 32.0   # the paper: one model's 8 stages
TP_SIZES = (1, 2, 4, 8)  # run.py's default --tp: the smallest of these whose share of the weights fits a GPU
WEIGHT_SHARE = 0.5       # of a GPU's memory the weights may take in a generation worker (the rest: KV cache, graphs)
# -------------------------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser):
    """The planner's flags (run.py --dry-run and plan.py share them)."""
    g = p.add_argument_group("cost planner (--dry-run)")
    g.add_argument("--plan-train-tok-s", type=float_in(0, lo_open=True), help=f"train.py tokens/s per GPU (default: {TRAIN_MFU * 100:.0f}%% MFU "
                                                          f"of {PEAK_TFLOPS:g} TFLOP/s over the model's FLOPs per token)")
    g.add_argument("--plan-gen-tok-s", type=float_in(0, lo_open=True), default=GEN_TOK_S,
                   help="generated tokens/s per GPU for rollouts and evaluation (default: %(default)s)")
    g.add_argument("--plan-gpus", type=int_at_least(1),
                   help=f"GPUs to price the run on (default: run.py's --gpus, or {GPUS} for a CPU run's plan)")
    g.add_argument("--plan-overhead-s", type=float_in(0), default=STEP_OVERHEAD_S,
                   help="fixed seconds per GPU step: start, load, save (default: %(default)s)")
    g.add_argument("--plan-mfu", type=float_in(0, 1, lo_open=True), default=TRAIN_MFU, help="training MFU (default: %(default)s)")
    g.add_argument("--plan-peak-tflops", type=float_in(0, lo_open=True), default=PEAK_TFLOPS,
                   help="peak TFLOP/s per GPU (default: %(default)s, H100 bf16 dense)")


@dataclass(frozen=True)
class Layout:
    """How a generating step (rollout, evaluation, drift) uses the node: `dp` data-parallel workers of `tp` GPUs
    each (vLLM's tensor parallelism inside a worker), every worker sampling its share of the step's prompts, out of
    the `gpus` the step holds. `why`: how tp was chosen, printed with the plan."""
    gpus: int
    tp: int
    dp: int
    why: str = ""

    def __str__(self):
        return f"DP {self.dp} x TP {self.tp} on {self.gpus} GPU{'s' if self.gpus != 1 else ''}"


@dataclass
class Profile:
    train_tok_s: float | None = None  # None: from MFU x peak / FLOPs per token
    gen_tok_s: float = GEN_TOK_S
    gpus: int = GPUS
    overhead_s: float = STEP_OVERHEAD_S
    mfu: float = TRAIN_MFU
    peak_tflops: float = PEAK_TFLOPS
    micro_tokens: int = 16384  # train.py --micro-tokens: activations, and whether checkpointing is needed
    layout: Layout | None = None  # None: every GPU a worker of TP 1

    def __post_init__(self):
        if self.layout is None:
            self.layout = Layout(self.gpus, 1, self.gpus, "every GPU a worker")
        if self.layout.gpus != self.gpus or self.layout.dp * self.layout.tp > self.gpus:
            raise ValueError(f"layout {self.layout} does not fit the profile's {self.gpus} GPUs")

    @classmethod
    def from_args(cls, args, micro_tokens: int, layout: Layout) -> "Profile":
        return cls(args.plan_train_tok_s, args.plan_gen_tok_s, layout.gpus, args.plan_overhead_s, args.plan_mfu,
                   args.plan_peak_tflops, micro_tokens, layout)


# ---------------------------------------------------------------------------------------------- generation layout

def heads_refusal(cfg, tp: int) -> str | None:
    """Why vLLM cannot split cfg's attention over tp GPUs, or None. vLLM's rule, from its source: ModelConfig.
    verify_with_parallel_config (vllm/config/model.py) refuses num_attention_heads % tp != 0 ("Total number of
    attention heads (28) must be divisible by tensor parallel size (8)", vllm issue 11797: Qwen2-7B on 8 GPUs);
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
    """Every --tp run.py accepts for vLLM on `gpus` GPUs: the divisors of gpus that the heads take."""
    return [t for t in range(1, gpus + 1) if gpus % t == 0 and heads_refusal(cfg, t) is None]


def default_tp(cfg, gpus: int) -> tuple[int, str]:
    """(run.py's --tp when not given on vLLM, why): the smallest of TP_SIZES that divides gpus, that the heads take,
    and whose share of the bf16 weights fits WEIGHT_SHARE of a GPU: the most workers (DP = gpus / TP), each holding
    the model with room for its KV cache. (Qwen2.5-7B on 8 H100s: TP 1, 8 workers; the paper ran TP 4.)"""
    weights_gb = 2 * cfg.num_params(embeddings=True) / 1e9
    allowed = [t for t in TP_SIZES if t in tp_choices(cfg, gpus)]
    fits = [t for t in allowed if weights_gb / t <= WEIGHT_SHARE * GPU_MEMORY_GB]
    if not fits:
        return allowed[-1], (f"default: the largest TP the heads and GPUs allow ({weights_gb:.0f} GB of weights "
                             f"fit no smaller one)")
    return fits[0], f"default: the smallest TP that holds {weights_gb:.0f} GB of weights with room for the KV cache"


def or_list(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"


def check_tp(cfg, name: str, gpus: int, tp: int, engine: str, gpus_flag: str = "--gpus"):
    """A --tp the run cannot launch, refused in one line: one that does not divide the GPUs into workers, that the
    model's heads cannot take (heads_refusal), or above 1 on an engine without tensor parallelism."""
    problems = [f"{'more than' if tp > gpus else 'does not divide'} {gpus_flag} {gpus} (TP GPUs per generation "
                f"worker)"] if gpus % tp else []
    heads = heads_refusal(cfg, tp)
    if heads:
        problems.append(f"{name}'s {heads}")
    if problems:
        raise UserError(f"--tp {tp}: {'; '.join(problems)}; use {or_list(tp_choices(cfg, gpus))}")
    if tp > 1 and engine != "vllm":
        raise UserError(f"--tp {tp}: the {engine} engine has no tensor parallelism (each of its workers holds the "
                        f"whole model; --engine auto picks vLLM only where CUDA and vLLM are): pass --engine vllm, "
                        f"or --tp 1")


def generation_layout(gpus: int, tp: int | None = None, cfg=None, name: str = "", engine: str = "vllm",
                      gpus_flag: str = "--gpus", cpu_workers: int = 1) -> Layout:
    """The layout run.py launches and the planner prices, from --gpus (gpus_flag: the flag that gave it) and --tp
    (None: the default) for the model of cfg (`name` names it in a refusal): DP = gpus / TP workers. A CPU run
    (gpus 0) has cpu_workers workers (run.py --gen-workers), each with its share of the step's threads."""
    if not gpus:
        if tp not in (None, 1):
            raise UserError(f"--tp {tp}: a CPU run (--gpus 0) has no tensor parallelism: --tp must be 1 (or absent)")
        return Layout(0, 1, cpu_workers, "the CPU")
    if cpu_workers != 1:
        raise UserError(f"--gen-workers {cpu_workers}: on GPUs the workers are {gpus_flag} / --tp; drop --gen-workers")
    if tp is not None:
        check_tp(cfg, name, gpus, tp, engine, gpus_flag)
        return Layout(gpus, tp, gpus // tp, f"--tp {tp}")
    if engine != "vllm":
        return Layout(gpus, 1, gpus, f"the {engine} engine: no tensor parallelism, a worker per GPU")
    tp, why = default_tp(cfg, gpus)
    return Layout(gpus, tp, gpus // tp, why)


# ---------------------------------------------------------------------------------------------- arithmetic

def flops_per_token(cfg, mean_doc: float) -> float:
    """Training FLOPs per token, train.py's MFU count: 6 x (non-embedding parameters) + 6 V H (lm_head) + causal
    attention 6 L Hq D x mean document length."""
    return (6 * cfg.num_params(embeddings=False) + 6 * cfg.vocab_size * cfg.hidden_size
            + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * mean_doc)


def train_tok_s(cfg, mean_doc: float, profile: Profile) -> float:
    if profile.train_tok_s:
        return profile.train_tok_s
    return profile.mfu * profile.peak_tflops * 1e12 / flops_per_token(cfg, mean_doc)


def activation_bytes_per_token_layer(cfg) -> int:
    """Bytes autograd keeps per token and block in bf16 training with a flash-type attention kernel (no [T, T]
    scores; tests/test_plan.py counts them on a real block): each RMSNorm its fp32 input (4 H), fp32 1/rms (4),
    the bf16 normalised input of the weight multiply (2 H) and its output (2 H, the next projections' input); RoPE only the shared cos/sin; the attention kernel
    the rotated q and k, v, its output (also o_proj's input) and an fp32 log-sum-exp per head; the MLP the gate
    and up outputs, silu(gate) and their product (down_proj's input): 4 x I."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    norms = 2 * (4 * H + 4 + 2 * H + 2 * H)
    attn = 2 * (q + 2 * kv) + 2 * q + 4 * cfg.num_attention_heads
    mlp = 2 * 4 * I
    return norms + attn + mlp


def memory_per_gpu(cfg, gpus: int, micro_tokens: int) -> dict:
    """Bytes per GPU of train.py's FSDP2 bf16 training (see the module docstring). Keys: each component, and
    'total' / 'total_checkpointed' (with --activation-checkpointing)."""
    P = cfg.num_params(embeddings=True)
    V, H, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    root = V * H * (1 if cfg.tie_word_embeddings else 2) + H  # embeddings (+ lm_head) + final norm
    block = (P - root) / L
    act_layer = activation_bytes_per_token_layer(cfg) * micro_tokens
    chunk_rows = max(1, 128 * 2**20 // (4 * V))  # kernels/cross_entropy.py's chunk (liger's is similar)
    m = {
        "master weights fp32 (sharded)": 4 * P / gpus,
        "gradients fp32 (sharded)": 4 * P / gpus,
        "AdamW moments fp32 (sharded)": 8 * P / gpus,
        "bf16 root unit, all-gathered": 2 * root,
        "bf16 blocks in flight (2) + their grads": 2 * 2 * block * 2,
        "loss: fp32 lm_head grad + logits chunk": 4 * V * H + 4 * chunk_rows * V,
        "activations": L * act_layer + 2 * H * micro_tokens,
        "activations, checkpointed": L * 2 * H * micro_tokens + act_layer + 2 * H * micro_tokens,
    }
    fixed = sum(v for k, v in m.items() if not k.startswith("activations"))
    m["total"] = fixed + m["activations"]
    m["total_checkpointed"] = fixed + m["activations, checkpointed"]
    return m


def micro_tokens_that_fit(cfg, gpus: int, budget_bytes: float, checkpointing: bool) -> int:
    """train.py's --micro-tokens when not given on a GPU (and plan.py's): the most tokens per micro-batch, in
    multiples of 1024, whose memory_per_gpu total (with or without activation checkpointing) stays within
    budget_bytes; 0 when not even 1024 fit."""
    key = "total_checkpointed" if checkpointing else "total"
    fixed, per_1024 = memory_per_gpu(cfg, gpus, 0)[key], memory_per_gpu(cfg, gpus, 1024)[key]
    per_1024 -= fixed  # memory is affine in the micro-batch's tokens
    return max(0, int((budget_bytes - fixed) // per_1024)) * 1024


@dataclass
class StepCost:
    key: str
    kind: str
    deps: list
    train_tokens: int = 0        # what train.py will count (estimate when `exact` is False)
    train_tokens_max: int = 0
    exact: bool = True
    mean_doc: float = 0.0
    sdft: bool = False
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens_max: int = 0
    new_tokens_est: int = 0
    gpu_hours: float = 0.0
    gpu_hours_max: float = 0.0
    wall_hours: float = 0.0      # the node's hours for the step (estimate): GPU-hours over the GPUs it holds
    methods: list = field(default_factory=list)


def needs_checkpointing(cfg, profile: Profile) -> bool:
    """True when train.py's memory without activation checkpointing exceeds GPU_MEMORY_GB."""
    return memory_per_gpu(cfg, profile.gpus, profile.micro_tokens)["total"] > GPU_MEMORY_GB * 1e9


def recomputes(cfg, profile: Profile, checkpointing: bool) -> bool:
    """Training pays activation checkpointing's second forward: the command turns it on, or only it fits."""
    return checkpointing or needs_checkpointing(cfg, profile)


def generation_hours(profile: Profile, gpu_seconds: float) -> tuple[float, float]:
    """(wall hours, GPU-hours) of a generating step whose work takes gpu_seconds on one GPU: the layout's DP x TP
    GPUs share it (each worker its share of the prompts, all at once; a GPU's tok/s taken as the same at any TP),
    after the per-step start-up that every worker pays at once; the node's GPUs are held for the wall time, also
    those the layout leaves idle."""
    wall = (profile.overhead_s + gpu_seconds / (profile.layout.dp * profile.layout.tp)) / 3600
    return wall, wall * profile.gpus


def price(c: StepCost, cfg, profile: Profile, checkpointing: bool = False):
    """Fill in c.gpu_hours (estimate), c.gpu_hours_max (upper bound) and c.wall_hours. Training with activation
    checkpointing (`checkpointing`: the command turns it on; or it only fits with it) pays a second forward
    (x 4/3); SDFT's teacher forward another 1/3, and its student's sampling its prompts' prefill and its new tokens
    at the generation rate (train.py samples on the training GPUs). Generation steps run on profile.layout
    (generation_hours)."""
    over = profile.overhead_s * profile.gpus / 3600
    tps = train_tok_s(cfg, c.mean_doc or 512, profile)
    if c.kind in ("eval", "rollout", "drift"):
        prefill = c.prompt_tokens / (PREFILL_FACTOR * tps)
        if c.kind == "drift":  # + two models teacher-forced on the samples and on the gold answers
            prefill += 4 * (c.prompt_tokens + c.new_tokens_est) / (PREFILL_FACTOR * tps)
        c.wall_hours, c.gpu_hours = generation_hours(profile, c.new_tokens_est / profile.gen_tok_s + prefill)
        c.gpu_hours_max = generation_hours(profile, c.new_tokens_max / profile.gen_tok_s + prefill)[1]
        return
    if c.kind == "train":
        f = 1 + c.sdft / 3  # (a train tok/s given by the user gets no recomputation factor)
        if not profile.train_tok_s:
            f += recomputes(cfg, profile, checkpointing) / 3
        # sdft's sampling: every rank its share of the step's prompts, at the generation rate of a GPU
        sample = c.prompt_tokens / (PREFILL_FACTOR * tps) if c.sdft else 0.0
        c.gpu_hours = over + (f * c.train_tokens / tps + sample + c.new_tokens_est / profile.gen_tok_s) / 3600
        c.gpu_hours_max = over + (f * c.train_tokens_max / tps + sample + c.new_tokens_max / profile.gen_tok_s) / 3600
    elif c.kind == "buffer-nll":
        c.gpu_hours = c.gpu_hours_max = over + c.prompt_tokens / (PREFILL_FACTOR * tps) / 3600
    c.wall_hours = c.gpu_hours / profile.gpus  # priced as work that every GPU of the node shares


# ---------------------------------------------------------------------------------------------- run.py's plan

class Lengths:
    """Chat-templated token counts, each computed once: sft(ex) is the length train.py and the over-long filter
    use; prompt(ex) the prompt with the generation header, as rollout.py and evaluate.py feed it."""

    def __init__(self, tok):
        self.tok, self._sft, self._prompt, self._empty = tok, {}, {}, {}

    def sft(self, ex) -> int:
        k = (ex.task, ex.idx, prompt_key(ex.prompt))
        if k not in self._sft:
            self._sft[k] = self.tok.sft_length(ex.prompt, ex.answer)
        return self._sft[k]

    def prompt(self, ex) -> int:
        k = prompt_key(ex.prompt)
        if k not in self._prompt:
            self._prompt[k] = len(self.tok.prompt_ids(ex.prompt))
        return self._prompt[k]

    def sft_empty(self, ex) -> int:
        """The conversation with an empty answer: prompt + header + end-of-turn (a response adds its tokens)."""
        k = prompt_key(ex.prompt)
        if k not in self._empty:
            self._empty[k] = self.tok.sft_length(ex.prompt, "")
        return self._empty[k]


def prompt_key(prompt) -> str:
    """A prompt as a dict key: a manifest's chat prompt is a list of messages (data/manifest.py)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class EstimatedTokenizer:
    """Token counts for a model directory without a tokenizer (run.py --dry-run from config.json alone): the paper
    grid's assumptions, CHARS_PER_TOKEN characters per token plus TEMPLATE_PROMPT tokens of chat template around a
    prompt and TEMPLATE_ANSWER after an answer. Lengths only: what it "encodes" has the right length and no ids."""

    @staticmethod
    def _tokens(text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def prompt_ids(self, prompt) -> range:
        turns = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        return range(TEMPLATE_PROMPT + sum(self._tokens(t) for t in turns))

    def sft_length(self, prompt, response: str) -> int:
        return len(self.prompt_ids(prompt)) + self._tokens(response) + TEMPLATE_ANSWER


class StepCounts:
    """What each of run.py's steps reads and generates, counted from the data: the examples and token counts of a
    step's spec (train sets, test sets, buffers drawn or estimated), filled into its StepCost."""

    def __init__(self, steps: dict, cfg_run: dict, train_sets: dict, tok, data_root):
        self.steps, self.cfg, self.train_sets, self.tok, self.data_root = steps, cfg_run, train_sets, tok, data_root
        self.L, self.max_new, self.tests = Lengths(tok), cfg_run["max_new_tokens"], {}

    def test_set(self, task, limit=None):
        """The test examples that fit max_len, the first `limit` of them (evaluate.py: --eval-limit; drift.py:
        --drift-limit, which --eval-limit does not cap)."""
        from data.trace import filter_overlong, load_task
        if task not in self.tests:
            self.tests[task] = filter_overlong(load_task(self.data_root, task, "test"), self.tok.sft_length,
                                               self.cfg["max_len"])[0]
        limit = self.cfg["eval_limit"] if limit is None else limit
        return self.tests[task][:limit] if limit else self.tests[task]

    def generation(self, c: StepCost, examples, repeats=1):
        from data.tasks import get_task
        L, max_new = self.L, self.max_new
        c.prompts = repeats * len(examples)  # evaluate.py --repeats: K responses per prompt, one generate call
        c.prompt_tokens = repeats * sum(L.prompt(e) for e in examples)
        c.new_tokens_max = repeats * sum(get_task(e.task).max_new_tokens or max_new for e in examples)  # per-task cap
        # the gold answer (+ end-of-turn) as the expected response length, capped at the budget
        c.new_tokens_est = repeats * sum(min(max_new, L.sft(e) - L.prompt(e)) for e in examples)

    def buffer_lengths(self, key) -> tuple[list[int], list[int], bool]:
        """(estimated lengths, upper-bound lengths, exact?) of the examples of the buffer step `key`."""
        from data.replay import gold_draw, replay_counts
        s, L, train_sets = self.steps[key], self.L, self.train_sets
        spec = s["spec"]
        if s["kind"] == "replay":  # gold replay: the draw run.py writes, so exact
            lens = [L.sft(e) for _, e in gold_draw(train_sets, spec.prior, spec.budget, spec.seed)]
            return lens, lens, True
        prior = self.steps[s["deps"][0]]["spec"].prior  # score <- rollout of the prior tasks
        counts = replay_counts(spec.budget, {t: len(train_sets[t]) for t in prior})  # one rollout per example
        est, hi = [], []
        for t in prior:
            mean = sum(L.sft(e) for e in train_sets[t]) / len(train_sets[t])
            est += [round(mean)] * counts[t]
            hi += sorted((L.sft_empty(e) + self.max_new for e in train_sets[t]), reverse=True)[:counts[t]]
        return est, hi, False

    def train(self, c: StepCost, spec, deps):
        """The tokens train.py will count: its tasks' examples and the buffer it reads, times the epochs; sdft's
        student samples one response per example and epoch on the training ranks besides."""
        L, train_sets = self.L, self.train_sets
        task_lens = [L.sft(e) for t in spec.tasks for e in train_sets[t]]
        est, hi = list(task_lens), list(task_lens)
        for d in deps:
            if self.steps[d]["kind"] in ("replay", "score"):
                b_est, b_hi, exact = self.buffer_lengths(d)
                est, hi, c.exact = est + b_est, hi + b_hi, c.exact and exact
        c.train_tokens, c.train_tokens_max = spec.ep * sum(est), spec.ep * sum(hi)
        c.mean_doc = sum(est) / max(len(est), 1)
        c.sdft = "sdft" in spec.extra  # --objective sdft (sft-kl's teacher pass is not priced)
        if c.sdft:
            cap = int(spec.extra[spec.extra.index("--sdft-max-new-tokens") + 1])  # the step's own cap
            exs = [e for t in spec.tasks for e in train_sets[t]]
            c.prompts = spec.ep * len(exs)
            c.prompt_tokens = spec.ep * sum(L.prompt(e) for e in exs)
            c.new_tokens_est = spec.ep * sum(min(cap, L.sft(e) - L.prompt(e)) for e in exs)  # the demo's length
            c.new_tokens_max = spec.ep * len(exs) * cap

    def count(self, key: str) -> StepCost:
        s = self.steps[key]
        spec, kind = s["spec"], s["kind"]
        c = StepCost(key, kind, list(s["deps"]))
        if kind == "train":
            self.train(c, spec, s["deps"])
        elif kind == "rollout":
            self.generation(c, [e for t in spec.prior for e in self.train_sets[t]])
        elif kind == "eval":
            self.generation(c, [e for t in spec.tasks for e in self.test_set(t)], spec.repeats)
        elif kind == "drift":  # drift.py: sample the first `limit` test prompts of each prior task, then both models
            # teacher-force the samples and the gold answers (priced as prefill in price())
            self.generation(c, [e for t in spec.prior for e in self.test_set(t, limit=spec.limit)])
        elif kind == "buffer-nll":  # buffer_nll.py: one teacher-forced forward over the gold buffer
            b_est, _, _ = self.buffer_lengths(s["deps"][1])
            c.prompts, c.prompt_tokens = len(b_est), sum(b_est)
        return c


def plan_run(steps: dict, runs: dict, cfg_run: dict, train_sets: dict, tok, data_root, model_cfg,
             profile: Profile, checkpointing: bool = False) -> list[StepCost]:
    """One StepCost per step of run.py's Pipeline (steps: key -> {kind, deps, spec: a pipeline.specs type}), in its
    order, counted (StepCounts), priced (price) and given the methods whose chains use it. checkpointing: the
    command trains with --activation-checkpointing (run.py: the preset says so and it runs on GPUs)."""
    counts = StepCounts(steps, cfg_run, train_sets, tok, data_root)
    costs = {}
    for key in steps:
        costs[key] = c = counts.count(key)
        price(c, model_cfg, profile, checkpointing)
    for label, by_seed in runs.items():  # which methods use each step (shared steps: several)
        keys = set()
        todo = [k for chain in by_seed.values() for pair in chain for k in pair]
        while todo:
            k = todo.pop()
            if k not in keys:
                keys.add(k)
                todo += steps[k]["deps"]
        for k in keys:
            costs[k].methods.append(label)
    for key, c in costs.items():  # steps outside every chain: a probe serves the methods of all the steps it reads
        deps = steps[key]["deps"]  # (drift: this stage's and the last stage's checkpoints); row 0 (no deps): all
        c.methods = c.methods or [m for m in runs if all(m in costs[d].methods for d in deps)]
    return list(costs.values())


# ---------------------------------------------------------------------------------------------- the report

def gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e9 else f"{x / 1e6:.1f} MB"


def format_memory(model_cfg, gpus: int, micro_tokens: int) -> str:
    m = memory_per_gpu(model_cfg, gpus, micro_tokens)
    lines = [f"FSDP2 memory per GPU ({gpus} GPUs, {micro_tokens} tokens per micro-batch, bf16 compute, fp32 master):"]
    for k, v in m.items():
        if not k.startswith("total"):
            lines.append(f"  {k:<42} {gb(v):>10}")
    for k, label in (("total", "without"), ("total_checkpointed", "with")):
        fits = "fits" if m[k] <= GPU_MEMORY_GB * 1e9 else "does NOT fit"
        lines.append(f"  total {label} activation checkpointing{'':<{11 - len(label)}} {gb(m[k]):>10}  "
                     f"({fits} in {GPU_MEMORY_GB:g} GB)")
    return "\n".join(lines)


def format_layout(layout: Layout) -> str:
    gpus = f"{layout.tp} GPU{'s' if layout.tp > 1 else ''}"
    share = (f"{layout.dp} workers of {gpus} each, every one sampling 1/{layout.dp} of a step's prompts at once"
             if layout.dp > 1 else f"one worker of {gpus} samples every prompt")
    return f"generation: {layout} ({layout.why}): {share}"


def format_plan(costs: list[StepCost], model_cfg, profile: Profile, micro_tokens: int, title: str,
                methods: list[str], checkpointing: bool = False) -> str:
    """The printed plan: one line per step, GPU-hours per method and in total, memory per GPU."""
    lines = [title, "",
             f"{'step':<44} {'kind':<8} {'train_tok':>11} {'train_max':>11} {'prompts':>8} {'prompt_tok':>11} "
             f"{'new_est':>10} {'new_max':>11} {'gpu_h':>7} {'gpu_h_max':>9}  after"]
    for c in costs:
        lines.append(f"{c.key:<44} {c.kind:<8} {c.train_tokens:>11} {c.train_tokens_max:>11} {c.prompts:>8} "
                     f"{c.prompt_tokens:>11} {c.new_tokens_est:>10} {c.new_tokens_max:>11} {c.gpu_hours:>7.2f} "
                     f"{c.gpu_hours_max:>9.2f}  {','.join(c.deps) or '-'}")
    lines.append("")
    lines.append(f"{'GPU-hours':<28} {'train':>8} {'rollout':>8} {'eval':>8} {'probes':>8} {'total':>8} "
                 f"{'total_max':>10} {'wall_h':>8}")
    for label, subset in [(m, [c for c in costs if m in c.methods]) for m in methods] + [("ALL (each step once)",
                                                                                        costs)]:
        by = {k: sum(c.gpu_hours for c in subset if c.kind == k) for k in ("train", "rollout", "eval")}
        probes = sum(c.gpu_hours for c in subset if c.kind in ("drift", "buffer-nll"))  # run.py's mechanism probes
        lines.append(f"{label:<28} {by['train']:>8.2f} {by['rollout']:>8.2f} {by['eval']:>8.2f} {probes:>8.2f} "
                     f"{sum(c.gpu_hours for c in subset):>8.2f} {sum(c.gpu_hours_max for c in subset):>10.2f} "
                     f"{sum(c.wall_hours for c in subset):>8.2f}")
    train = [c for c in costs if c.kind == "train"]
    mean_doc = sum(c.mean_doc * c.train_tokens for c in train) / max(sum(c.train_tokens for c in train), 1)
    tps = train_tok_s(model_cfg, mean_doc or 512, profile)
    ac = recomputes(model_cfg, profile, checkpointing) and not profile.train_tok_s
    lines += ["", f"profile: train {tps:,.0f} tok/s per GPU{' before the x 4/3 of activation checkpointing' if ac else ''}"
                  f"{' (given)' if profile.train_tok_s else f' ({profile.mfu:.0%} MFU of {profile.peak_tflops:g} TFLOP/s, mean document {mean_doc:.0f} tokens)'}"
                  f", generation {profile.gen_tok_s:,.0f} new tok/s per GPU, prefill {PREFILL_FACTOR:g}x train tok/s, "
                  f"{profile.overhead_s:g} s overhead per step on each of {profile.gpus} GPUs",
              format_layout(profile.layout),
              "train_tok: exact (train.py's count) except after an OPR buffer (model answers: gold-length estimate; "
              "train_max: every answer at max_new_tokens); new_max: every response at max_new_tokens; wall_h: the "
              "node's hours, one step after another; an sdft train step's prompts and new tokens: its student's "
              "samples, one per example and epoch, priced at the generation rate", "",
              format_memory(model_cfg, profile.gpus, micro_tokens)]
    return "\n".join(lines)


def parse_plan(text: str) -> dict:
    """The step table of a printed plan back as {key: {kind, train_tokens, ..., deps}} (tests, scripts)."""
    out = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step ")) + 1
    for line in lines[start:]:
        if not line.strip():
            break
        f = line.split()
        out[f[0]] = dict(kind=f[1], train_tokens=int(f[2]), train_tokens_max=int(f[3]), prompts=int(f[4]),
                         prompt_tokens=int(f[5]), new_tokens_est=int(f[6]), new_tokens_max=int(f[7]),
                         gpu_hours=float(f[8]), gpu_hours_max=float(f[9]), deps=[] if f[10] == "-" else f[10].split(","))
    return out


def plan_layout(model_cfg, name: str, layout: Layout, plan_gpus: int | None) -> Layout:
    """The layout run.py --dry-run prices: the run's own on GPUs (which --plan-gpus may only repeat); a CPU run's
    plan prices the same steps on --plan-gpus GPUs (default GPUS) at vLLM's default layout."""
    if not layout.gpus:
        return generation_layout(plan_gpus or GPUS, None, model_cfg, name)
    if plan_gpus not in (None, layout.gpus):
        raise UserError(f"--plan-gpus {plan_gpus}: this run uses --gpus {layout.gpus}, and its plan prices those GPUs "
                        f"at its own layout; drop --plan-gpus (or plan a CPU run's command on other GPUs)")
    return layout


def print_plan(steps, runs, cfg_run, train_sets, tok, data_root, base, args, layout: Layout):
    """run.py --dry-run: plan every step of the DAG run.py built and print it. layout: the run's generation
    layout (plan_layout)."""
    from model.checkpoint import load_config
    model_cfg = load_config(base)
    profile = Profile.from_args(args, cfg_run["micro_tokens"], plan_layout(model_cfg, Path(base).name, layout,
                                                                           args.plan_gpus))
    checkpointing = bool(cfg_run["activation_checkpointing"] and args.gpus)  # as run.py passes the flag
    costs = plan_run(steps, runs, cfg_run, train_sets, tok, data_root, model_cfg, profile, checkpointing)
    if needs_checkpointing(model_cfg, profile):
        print("plan.py: WARNING: at --micro-tokens "
              f"{profile.micro_tokens} train.py needs --activation-checkpointing to fit {GPU_MEMORY_GB:g} GB per GPU "
              "(see the memory table); the GPU-hours assume it")
    print(format_plan(costs, model_cfg, profile, cfg_run["micro_tokens"],
                      f"plan (dry run: nothing ran, nothing was written): {len(costs)} steps, model {base}", list(runs),
                      checkpointing))
    policy = getattr(args, "keep_checkpoints", "all")
    chains = [[t for t, _ in chain] for by_seed in runs.values() for chain in by_seed.values()]
    kept = None if policy == "all" else keep.simulate(policy, chains, {k: s["deps"] for k, s in steps.items()})
    print(format_disk(costs, model_cfg, gpus=bool(args.gpus), policy=policy, kept=kept))
    return costs


def format_disk(costs, model_cfg, gpus: bool, policy: str = "all", kept: tuple | None = None) -> str:
    """The disk the run's stage checkpoints take in steps/, in train.py's compute dtype (bf16 on GPUs, fp32 on the
    CPU), under run.py --keep-checkpoints `policy`: all keeps every one (a later stage, a re-run and a new method
    read them); last and final keep kept = (most at once, left at the end) of them (pipeline.keep.simulate); plus a
    running stage's resumable state (fp32 weights and AdamW's two moments, 12 bytes per parameter) until it ends."""
    n = sum(c.kind == "train" for c in costs)
    params = model_cfg.num_params(embeddings=True)
    ckpt, state = params * (2 if gpus else 4), params * 12
    plus = f"plus {gb(state)} of resumable state per stage while it trains"
    if policy == "all":
        return f"disk: {n} stage checkpoints of {gb(ckpt)} each kept in steps/ = {gb(n * ckpt)}, {plus}"
    peak, end = kept
    while_running = (f"all {peak} while the run runs = {gb(peak * ckpt)}" if policy == "final" else
                     f"at most {peak} at once = {gb(peak * ckpt)} (one step at a time; each step run beside it can "
                     f"add one)")
    return (f"disk: {n} stage checkpoints of {gb(ckpt)} each; --keep-checkpoints {policy} keeps {while_running}, "
            f"and {end} at the end (each method and seed's final stage) = {gb(end * ckpt)}; {plus}")


# ---------------------------------------------------------------------------------------------- the paper's grid
# Per-task sizes for the paper's grid when the TRACE files are not at hand (Qwen2.5 chat template: ~29 tokens of
# system prompt and headers around the prompt, ~2 after the answer). n_train after the over-long filter (2,048),
# mean prompt tokens (templated), mean answer tokens, test examples. ASSUMPTIONS, except where `--trace` finds the
# task's files (FOMC and NumGLUE-cm/-ds in ../shared/trace): then counts and lengths come from them, at
# CHARS_PER_TOKEN (no Qwen tokenizer here).
CHARS_PER_TOKEN = 4.0
TEMPLATE_PROMPT, TEMPLATE_ANSWER = 29, 2
PAPER_TASKS = {  # task: (n_train kept, mean prompt tokens, mean answer tokens, n_test)
    "C-STANCE": (5000, 150, 1, 2000),      # Chinese stance texts, a letter answer
    "FOMC": (5000, 112, 1, 496),           # from shared/trace's files: mean chars / CHARS_PER_TOKEN + template
    "MeetingBank": (4000, 1300, 80, 1000),  # long transcripts: ~1/5 over 2,048 tokens dropped; summaries
    "Py150": (5000, 600, 12, 1000),        # code context, the next line
    "ScienceQA": (5000, 180, 1, 2000),     # question + choices, a letter
    "NumGLUE-cm": (5000, 81, 1, 81),       # from shared/trace's files, as FOMC
    "NumGLUE-ds": (5000, 64, 1, 325),      # from shared/trace's files, as FOMC
    "20Minuten": (5000, 700, 90, 1000),    # German news articles, simplified summaries
}


def paper_tasks(trace_dir=None) -> dict:
    """PAPER_TASKS, with the rows of the tasks whose files are under trace_dir measured from them."""
    from data.trace import load_task
    table = dict(PAPER_TASKS)
    for task in table:
        if trace_dir is None or not (Path(trace_dir) / task / "train.json").is_file():
            continue
        train, test = load_task(trace_dir, task, "train"), load_task(trace_dir, task, "test")
        prompt = sum(len(e.prompt) for e in train) / len(train) / CHARS_PER_TOKEN + TEMPLATE_PROMPT
        answer = sum(len(e.answer) for e in train) / len(train) / CHARS_PER_TOKEN
        table[task] = (len(train), round(prompt), max(1, round(answer)), len(test))
    return table


def paper_grid(model_cfg, profile: Profile, trace_dir=None, rho: float = 0.01, max_new: int = 512,
               repeats: int = 8, checkpointing: bool = True) -> list[StepCost]:
    """One model's 8 stages of an OPR method, as run.py plans them: row 0 evaluates the base on every task; stage i
    trains on task i (+ the buffer of rho x 5000 model answers from tasks < i) for the task's epochs, evaluates
    tasks 1..i+1 (`repeats` samples per test prompt, the paper preset's 8), and (i < 8) rolls out every training
    prompt of tasks 1..i once, <= max_new new tokens. Training recomputes activations (the paper preset's
    --activation-checkpointing) unless checkpointing=False."""
    from data.tasks import TASK_ORDER, get_task
    table = paper_tasks(trace_dir)
    doc = {t: table[t][1] + table[t][2] + TEMPLATE_ANSWER for t in TASK_ORDER}  # one SFT example's tokens

    def evaluation(key, deps, seen):
        e = StepCost(key, "eval", deps)
        e.prompts = repeats * sum(table[t][3] for t in seen)
        e.prompt_tokens = repeats * sum(table[t][3] * table[t][1] for t in seen)
        e.new_tokens_est = repeats * sum(table[t][3] * min(max_new, table[t][2] + 1) for t in seen)
        e.new_tokens_max = e.prompts * max_new
        return e

    costs, prev = [evaluation("s0-eval", [], TASK_ORDER)], None
    for i, task in enumerate(TASK_ORDER):
        n, ep, prior = table[task][0], get_task(task).epochs, TASK_ORDER[:i]
        c = StepCost(f"s{i + 1}-train-{task}", "train", [prev] if prev else [])
        n_buf = round(rho * n) if prior else 0
        buf = n_buf * sum(doc[t] for t in prior) / max(len(prior), 1)
        buf_max = n_buf * (sum(table[t][1] for t in prior) / max(len(prior), 1) + max_new + TEMPLATE_ANSWER)
        c.train_tokens, c.train_tokens_max = round(ep * (n * doc[task] + buf)), round(ep * (n * doc[task] + buf_max))
        c.mean_doc, c.exact = doc[task], not prior
        costs.append(c)
        seen = TASK_ORDER[:i + 1]
        costs.append(evaluation(f"s{i + 1}-eval", [c.key], TASK_ORDER[:i + 2]))  # + task i+1, for FWT
        if i + 1 < len(TASK_ORDER):
            r = StepCost(f"s{i + 1}-rollout", "rollout", [c.key])
            r.prompts = sum(table[t][0] for t in seen)
            r.prompt_tokens = sum(table[t][0] * table[t][1] for t in seen)
            r.new_tokens_est = sum(table[t][0] * min(max_new, table[t][2] + 1) for t in seen)
            r.new_tokens_max = r.prompts * max_new
            costs.append(r)
        prev = c.key
    for c in costs:
        price(c, model_cfg, profile, checkpointing)
        c.methods = ["opr"]
    return costs


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", required=True,
                   help="plan the paper's grid (one OPR model, 8 TRACE stages) on --config's shapes")
    p.add_argument("--config", default=str(Path(__file__).resolve().parent / "bench" / "configs" / "qwen2.5-7b"),
                   help="model directory with an HF config.json (default: %(default)s)")
    p.add_argument("--trace", help="TRACE root: tasks found there are measured instead of assumed")
    p.add_argument("--micro-tokens", type=int_at_least(1),
                   help="tokens per micro-batch (default: train.py's rule on a GPU, the most that fit in "
                        f"{GPU_MEMORY_GB:g} GB x {MEMORY_SHARE:g} with activation checkpointing)")
    p.add_argument("--eval-repeats", type=int_at_least(1), default=8, help="samples per test prompt (default: %(default)s, the "
                                                               "paper preset's)")
    p.add_argument("--tp", type=int_at_least(1), help="vLLM tensor-parallel size of the generating steps (default: "
                                                      "run.py's rule, see its --help; the paper's rollouts ran at 4)")
    add_arguments(p)
    if not (sys.argv[1:] if argv is None else argv):
        p.error("nothing to plan: pass --paper for the paper's grid (a run.py command: add --dry-run to it)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from model.checkpoint import load_config
    cfg = load_config(args.config)
    if args.trace is not None and not any((Path(args.trace) / t / "train.json").is_file() for t in PAPER_TASKS):
        # a mistyped path must not silently plan on the assumed sizes
        raise UserError(f"--trace {args.trace}: " + ("no such directory" if not Path(args.trace).is_dir() else
                        "holds none of the paper's tasks (<task>/train.json)") + "; drop --trace to use the assumed "
                        "sizes")
    layout = generation_layout(args.plan_gpus or GPUS, args.tp, cfg, Path(args.config).name, gpus_flag="--plan-gpus")
    if args.micro_tokens is None:  # the paper's grid is planned with activation checkpointing (format_plan below)
        args.micro_tokens = micro_tokens_that_fit(cfg, layout.gpus, MEMORY_SHARE * GPU_MEMORY_GB * 1e9, True)
        if not args.micro_tokens:
            raise UserError(f"{args.config} does not fit {MEMORY_SHARE:g} x {GPU_MEMORY_GB:g} GB per GPU on "
                            f"{layout.gpus} GPUs (--plan-gpus)")
        print(f"plan.py: --micro-tokens {args.micro_tokens}: the most that fit {MEMORY_SHARE:g} x {GPU_MEMORY_GB:g} "
              f"GB per GPU with activation checkpointing (train.py's rule)")
    profile = Profile.from_args(args, args.micro_tokens, layout)
    table = paper_tasks(args.trace)
    print(f"{'task':<12} {'n_train':>7} {'prompt_tok':>10} {'answer_tok':>10} {'n_test':>6}  source")
    for t, (n, pr, an, nt) in table.items():
        measured = table[t] != PAPER_TASKS[t] or (args.trace and (Path(args.trace) / t / "train.json").is_file())
        print(f"{t:<12} {n:>7} {pr:>10} {an:>10} {nt:>6}  {'measured (' + args.trace + ')' if measured else 'assumed'}")
    costs = paper_grid(cfg, profile, args.trace, repeats=args.eval_repeats)
    print(format_plan(costs, cfg, profile, args.micro_tokens, f"\nplan of the paper's grid on {args.config}", ["opr"],
                      checkpointing=True))
    total = sum(c.gpu_hours for c in costs)
    print(f"\npaper: {PAPER_GPU_HOURS:g} GPU-hours for one model's 8 stages; this plan: {total:.1f} "
          f"({total / PAPER_GPU_HOURS:.2f}x), upper bound {sum(c.gpu_hours_max for c in costs):.1f}")
    return costs


if __name__ == "__main__":
    main_cli(main, "plan.py")
