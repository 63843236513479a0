"""The cost model of a step: its GPU-hours from its token counts, and train.py's FSDP2 memory per
GPU; token counts without a tokenizer (EstimatedTokenizer).

A throughput profile (Profile: the defaults below, or the planner's --plan-* flags)
prices a StepCost (price):
  train    tokens / train tok/s per GPU (+ a fixed start/load/save overhead per step on every GPU);
           the default train tok/s is MFU x peak / FLOPs per token, with train.py's own FLOPs count
           (6 N + 6 V H + attention at the mixture's mean document length), SDFT x 4/3 (the
           teacher's extra forward), activation checkpointing x 4/3 (its second forward)
  generate new tokens / gen tok/s per GPU + prompt tokens / prefill tok/s per GPU, spread over the
           generating GPUs of the profile's layout (Layout, which pipeline.layout picks; + the
           overhead per step); the node's GPUs are held for the step's wall time
FSDP2 memory per GPU, as train.py holds it (memory_per_gpu): fp32 master weights, fp32 gradients and
AdamW's two fp32 moments, all sharded; the bf16 compute copies all-gathered per unit (the root
unit -- embeddings, final norm, lm_head -- for the whole step, two blocks at a time: current +
prefetch) with their bf16 gradients before the reduce-scatter; the loss kernel's fp32 [V, H]
weight-gradient accumulator and one chunk of logits; activations at the micro-batch's tokens with
and without activation checkpointing (the tensors autograd keeps per token and layer, listed in
activation_bytes_per_token_layer). train.py sizes its micro-batches by it (micro_tokens_that_fit).
A LoRA stage (lora: its adapters' parameter count, lora_params) keeps the base as train.py does
(bf16, sharded, frozen: no fp32 master, no gradient, no AdamW state, no gathered bf16 gradients, no
lm_head gradient) and fp32 weights, gradients and AdamW for the adapters only; its FLOPs per token
drop the frozen weights' gradient products (4 instead of 6 per weight).
The node's GPU memory (GPU_MEMORY_GB) and a generating step's Layout are defined here, below
pipeline.layout, which picks the layout: the cost model imports nothing of pipeline/, so that
train.py can size its micro-batches with it and stay a script of its own.
"""
import math
import time
from dataclasses import dataclass, field

# ---- defaults: the throughput profile (BENCHMARKS.md "Anchors";
#      nothing here was measured on a GPU) ---------------------------------------------------------
PEAK_TFLOPS = 989.0      # H100 SXM, bf16 dense
TRAIN_MFU = 0.36         # within torchtitan's published range for Llama-3.1-8B,
                         # FSDP2 bf16 on 8xH100 ("Anchors")
GEN_TOK_S = 4000.0       # generated tokens/s per GPU (vLLM, 7-8B bf16, large batches):
                         # an assumption, not an anchor
PREFILL_FACTOR = 3.0     # prompt tokens cost a forward only: prefill tok/s = 3 x train tok/s
                         # (same MFU, 2N vs 6N)
STEP_OVERHEAD_S = 120.0  # per GPU step: process start, loading the checkpoint (and saving one)
                         # or the engine start-up
GPUS = 8
GPU_MEMORY_GB = 80.0     # H100 80 GB: what training fits in (and the layout's weight share)
MEMORY_SHARE = 0.9       # of a GPU's memory that train.py's --micro-tokens rule plans for (the
                         # rest: the CUDA context, NCCL's buffers, the allocator's fragmentation)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a generating step (rollout, evaluation, drift) uses the node: `dp` data-parallel
    workers of `tp` GPUs each (vLLM's tensor parallelism inside a worker), every worker sampling
    its share of the step's prompts, out of the `gpus` the step holds. `why`: how tp was chosen,
    printed with the plan."""
    gpus: int
    tp: int
    dp: int
    why: str = ""

    def __str__(self):
        return f"DP {self.dp} x TP {self.tp} on {self.gpus} GPU{'s' if self.gpus != 1 else ''}"


@dataclass
class Profile:
    """The throughput of a node: train and generation tok/s per GPU, the overhead of a step, the
    GPUs and the layout its generating steps run on, train.py's tokens per micro-batch."""
    train_tok_s: float | None = None  # None: from MFU x peak / FLOPs per token
    gen_tok_s: float = GEN_TOK_S
    gpus: int = GPUS
    overhead_s: float = STEP_OVERHEAD_S
    mfu: float = TRAIN_MFU
    peak_tflops: float = PEAK_TFLOPS
    micro_tokens: int = 16384  # train.py --micro-tokens: activations, and whether
                               # checkpointing is needed
    layout: Layout | None = None  # None: every GPU a worker of TP 1

    def __post_init__(self):
        if self.layout is None:
            self.layout = Layout(self.gpus, 1, self.gpus, "every GPU a worker")
        if self.layout.gpus != self.gpus or self.layout.dp * self.layout.tp > self.gpus:
            raise ValueError(f"layout {self.layout} does not fit the profile's {self.gpus} GPUs")

    @classmethod
    def from_args(cls, args, micro_tokens: int, layout: Layout) -> "Profile":
        """From the planner's --plan-* flags (plan.add_arguments)."""
        return cls(args.plan_train_tok_s, args.plan_gen_tok_s, layout.gpus, args.plan_overhead_s,
                   args.plan_mfu, args.plan_peak_tflops, micro_tokens, layout)


def flops_per_token(cfg, mean_doc: float, lora: int = 0) -> float:
    """Training FLOPs per token, train.py's MFU count: 6 x (non-embedding parameters)
    + 6 V H (lm_head) + causal attention 6 L Hq D x mean document length. A LoRA stage (lora: its
    adapters' parameters) computes no gradient of a frozen weight: 4 per weight (forward and the
    input's gradient), 6 per adapter parameter."""
    w = 4 if lora else 6
    return (w * cfg.num_params(embeddings=False) + w * cfg.vocab_size * cfg.hidden_size + 6 * lora
            + 6 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * mean_doc)


def measured_peak_flops(device, dtype) -> float:
    """train.py's peak FLOP/s of `device` for its MFU (without --peak-tflops): on CUDA an H100
    SXM's dense peak in `dtype`, on the CPU the rate of eight fp32 1024 x 1024 matmuls timed after
    one warm-up."""
    import torch  # the one function here that needs it: the rest of the cost model is arithmetic
    if device.type == "cuda":  # H100 SXM dense: bf16 tensor cores, or TF32 for fp32 matmuls
        return 989e12 if dtype == torch.bfloat16 else 495e12
    a = torch.randn(1024, 1024)
    a @ a
    t = time.perf_counter()
    for _ in range(8):
        a @ a
    return 8 * 2 * 1024**3 / (time.perf_counter() - t)


def lora_params(cfg, rank: int, targets) -> int:
    """Parameters of rank-`rank` adapters on `targets` (HF module names) of every block:
    r x (in + out) each."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shape = {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
             "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}
    return cfg.num_hidden_layers * sum(rank * sum(shape[t]) for t in targets)


def train_tok_s(cfg, mean_doc: float, profile: Profile, lora: int = 0) -> float:
    """Training tokens/s per GPU: the profile's own, else MFU x peak over flops_per_token."""
    if profile.train_tok_s:
        return profile.train_tok_s
    return profile.mfu * profile.peak_tflops * 1e12 / flops_per_token(cfg, mean_doc, lora)


def activation_bytes_per_token_layer(cfg) -> int:
    """Bytes autograd keeps per token and block in bf16 training with a flash-type attention kernel
    (no [T, T] scores; tests/test_plan.py counts them on a real block): each RMSNorm its fp32 input
    (4 H), fp32 1/rms (4), the bf16 normalised input of the weight multiply (2 H) and its output
    (2 H, the next projections' input); RoPE only the shared cos/sin; the attention kernel the
    rotated q and k, v, its output (also o_proj's input) and an fp32 log-sum-exp per head; the MLP
    the gate and up outputs, silu(gate) and their product (down_proj's input): 4 x I."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    norms = 2 * (4 * H + 4 + 2 * H + 2 * H)
    attn = 2 * (q + 2 * kv) + 2 * q + 4 * cfg.num_attention_heads
    mlp = 2 * 4 * I
    return norms + attn + mlp


def memory_per_gpu(cfg, gpus: int, micro_tokens: int, lora: int = 0) -> dict:
    """Bytes per GPU of train.py's FSDP2 bf16 training (see the module docstring); lora: a LoRA
    stage's adapter parameters (0: full fine-tuning). Keys: each component, and
    'total' / 'total_checkpointed' (with --activation-checkpointing)."""
    P = cfg.num_params(embeddings=True)
    V, H, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    root = V * H * (1 if cfg.tie_word_embeddings else 2) + H  # embeddings (+ lm_head) + final norm
    block = (P - root) / L
    act_layer = activation_bytes_per_token_layer(cfg) * micro_tokens
    chunk_rows = max(1, 128 * 2**20 // (4 * V))  # kernels/cross_entropy.py's chunk
                                                 # (liger's is similar)
    trained = lora or P  # what has gradients and AdamW moments
    m = {
        **({"frozen bf16 base + fp32 adapters (sharded)": (2 * P + 4 * lora) / gpus} if lora else
           {"master weights fp32 (sharded)": 4 * P / gpus}),
        "gradients fp32 (sharded)": 4 * trained / gpus,
        "AdamW moments fp32 (sharded)": 8 * trained / gpus,
        "bf16 root unit, all-gathered": 2 * root,
        "bf16 blocks in flight (2) + their grads": 2 * 2 * block * (1 if lora else 2),
        "loss: fp32 lm_head grad + logits chunk": (0 if lora else 4 * V * H) + 4 * chunk_rows * V,
        "activations": L * act_layer + 2 * H * micro_tokens,
        "activations, checkpointed": L * 2 * H * micro_tokens + act_layer + 2 * H * micro_tokens,
    }
    fixed = sum(v for k, v in m.items() if not k.startswith("activations"))
    m["total"] = fixed + m["activations"]
    m["total_checkpointed"] = fixed + m["activations, checkpointed"]
    return m


def micro_tokens_that_fit(cfg, gpus: int, budget_bytes: float, checkpointing: bool,
                          lora: int = 0) -> int:
    """train.py's --micro-tokens when not given on a GPU (and plan.py's): the most tokens per
    micro-batch, in multiples of 1024, whose memory_per_gpu total (with or without activation
    checkpointing) stays within budget_bytes; 0 when not even 1024 fit."""
    key = "total_checkpointed" if checkpointing else "total"
    fixed, per_1024 = (memory_per_gpu(cfg, gpus, 0, lora)[key],
                       memory_per_gpu(cfg, gpus, 1024, lora)[key])
    per_1024 -= fixed  # memory is affine in the micro-batch's tokens
    return max(0, int((budget_bytes - fixed) // per_1024)) * 1024


@dataclass
class StepCost:
    """One step's counts (filled by the planner) and its price (filled by price())."""
    key: str
    kind: str
    deps: list
    train_tokens: int = 0        # what train.py will count (estimate when `exact` is False)
    train_tokens_max: int = 0
    exact: bool = True
    mean_doc: float = 0.0
    sdft: bool = False
    extra_passes: float = 0.0    # the objective's passes per trained token
                                 # besides the student's (methods/)
    extra_tokens: float = 0.0    # ... and its once-per-stage work on every GPU (ewc's Fisher)
    lora_rank: int = 0           # a LoRA stage's adapters (0: full fine-tuning) ...
    lora_targets: tuple = ()     # ... on these modules of every block
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens_max: int = 0
    new_tokens_est: int = 0
    gpu_hours: float = 0.0
    gpu_hours_max: float = 0.0
    wall_hours: float = 0.0      # the node's hours for the step (estimate):
                                 # GPU-hours over the GPUs it holds
    methods: list = field(default_factory=list)


def needs_checkpointing(cfg, profile: Profile, lora: int = 0) -> bool:
    """True when train.py's memory without activation checkpointing exceeds GPU_MEMORY_GB."""
    return (memory_per_gpu(cfg, profile.gpus, profile.micro_tokens, lora)["total"]
            > GPU_MEMORY_GB * 1e9)


def recomputes(cfg, profile: Profile, checkpointing: bool, lora: int = 0) -> bool:
    """Training pays activation checkpointing's second forward:
    the command turns it on, or only it fits."""
    return checkpointing or needs_checkpointing(cfg, profile, lora)


def generation_hours(profile: Profile, gpu_seconds: float) -> tuple[float, float]:
    """(wall hours, GPU-hours) of a generating step whose work takes gpu_seconds on one GPU: the
    layout's DP x TP GPUs share it (each worker its share of the prompts, all at once; a GPU's tok/s
    taken as the same at any TP), after the per-step start-up that every worker pays at once; the
    node's GPUs are held for the wall time, also those the layout leaves idle."""
    wall = (profile.overhead_s + gpu_seconds / (profile.layout.dp * profile.layout.tp)) / 3600
    return wall, wall * profile.gpus


def price(c: StepCost, cfg, profile: Profile, checkpointing: bool = False):
    """Fill in c.gpu_hours (estimate), c.gpu_hours_max (upper bound) and c.wall_hours. Training with
    activation checkpointing (`checkpointing`: the command turns it on; or it only fits with it)
    pays a second forward (x 4/3); SDFT's teacher forward another 1/3, and its student's sampling
    its prompts' prefill and its new tokens at the generation rate (train.py samples on the training
    GPUs). Generation steps run on profile.layout (generation_hours)."""
    over = profile.overhead_s * profile.gpus / 3600
    lora = lora_params(cfg, c.lora_rank, c.lora_targets) if c.lora_rank else 0
    tps = train_tok_s(cfg, c.mean_doc or 512, profile, lora)
    if c.kind in ("eval", "rollout", "drift", "synth", "ssr"):
        prefill = c.prompt_tokens / (PREFILL_FACTOR * tps)
        if c.kind == "drift":  # + two models teacher-forced on the samples and on the gold answers
            prefill += 4 * (c.prompt_tokens + c.new_tokens_est) / (PREFILL_FACTOR * tps)
        c.wall_hours, c.gpu_hours = generation_hours(
            profile, c.new_tokens_est / profile.gen_tok_s + prefill)
        c.gpu_hours_max = generation_hours(
            profile, c.new_tokens_max / profile.gen_tok_s + prefill)[1]
        return
    if c.kind == "train":
        f = 1 + c.extra_passes  # (a train tok/s given by the user gets no recomputation factor)
        # the second forward: 2 of the 6 (full) or of the 4 (LoRA) FLOPs per weight
        if not profile.train_tok_s:
            f += recomputes(cfg, profile, checkpointing, lora) * (0.5 if lora else 1 / 3)
        # sdft's sampling: every rank its share of the step's prompts,
        # at the generation rate of a GPU
        sample = c.prompt_tokens / (PREFILL_FACTOR * tps) if c.sdft else 0.0
        once = c.extra_tokens * profile.gpus / tps
        c.gpu_hours = over + (f * c.train_tokens / tps + once + sample
                              + c.new_tokens_est / profile.gen_tok_s) / 3600
        c.gpu_hours_max = over + (f * c.train_tokens_max / tps + once + sample
                                  + c.new_tokens_max / profile.gen_tok_s) / 3600
    elif c.kind == "buffer-nll":
        c.gpu_hours = c.gpu_hours_max = over + c.prompt_tokens / (PREFILL_FACTOR * tps) / 3600
    c.wall_hours = c.gpu_hours / profile.gpus  # priced as work that every GPU of the node shares


# ---- token counts without a tokenizer ------------------------------------------------------------
# The paper grid's assumptions (plan.py --paper, and --dry-run of a model directory with config.json
# alone): ~4 characters per token (no Qwen tokenizer here), and Qwen2.5's chat template's ~29 tokens
# of system prompt and headers around a prompt, ~2 after an answer
CHARS_PER_TOKEN = 4.0
TEMPLATE_PROMPT, TEMPLATE_ANSWER = 29, 2


class EstimatedTokenizer:
    """Token counts for a model directory without a tokenizer (run.py --dry-run from config.json
    alone): the paper grid's assumptions, CHARS_PER_TOKEN characters per token plus TEMPLATE_PROMPT
    tokens of chat template around a prompt and TEMPLATE_ANSWER after an answer. Lengths only: what
    it "encodes" has the right length and no ids."""

    @staticmethod
    def _tokens(text: str) -> int:
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def prompt_ids(self, prompt) -> range:
        turns = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
        return range(TEMPLATE_PROMPT + sum(self._tokens(t) for t in turns))

    def sft_length(self, prompt, response: str) -> int:
        return len(self.prompt_ids(prompt)) + self._tokens(response) + TEMPLATE_ANSWER
