"""train.py — one continual-learning stage: supervised fine-tuning of a
checkpoint on a data mixture.

    torchrun --nproc_per_node 8 train.py --model DIR --data task.jsonl,buffer.jsonl --out DIR
    python train.py --model DIR --data task.jsonl,buffer.jsonl --out DIR  # one process
    torchrun --nproc_per_node 8 train.py  # no flags: the embedded benchmark's first task, tiny base

The algorithm, top to bottom:
  1. tokenize the mixture with the model's chat template; loss only on the response (+ end-of-turn
     token); examples longer than --max-len are dropped and counted, never truncated
  2. build the model on `meta` (on a GPU each block compiled whole: --compile), FSDP2-shard each
     block and then the root, materialise, load the weights (each rank reads only its own rows); one
     CPU process in fp32 skips the sharding (nothing to shard)
  3. each optimizer step takes --global-batch sequences (seeded shuffle per epoch), packs them into
     micro-batches of at most --micro-tokens tokens with no padding, and accumulates gradients of
         sum of response-token NLL / number of response tokens in the whole step (all ranks)
     so gradients do not depend on world size, micro-batch split or packing
  4. AdamW, linear warmup over the first --warmup fraction of steps (none by default), cosine decay
     to 0 (--lr-schedule linear: a linear decay to 0, as the official OPR code and HF's
     get_linear_schedule_with_warmup), grad-norm clip
  5. periodic resumable training state; final weights as a Hugging Face checkpoint directory (--out)

--objective picks what step 3 minimises: a method's Objective (methods/), asked by the loop at named
moments, never by name: sft (the response-token NLL above: the paper's fine-tuning, and OPR's),
sft-kl (NLL + beta * KL to an EMA teacher), sdft (on-policy self-distillation: the student
samples, a demonstration-conditioned teacher scores), ewc (NLL + 1/2 * lambda * sum F * (theta -
theta*)^2, its Fisher written with the checkpoint). Each method's file says what it computes and
where its defaults come from.

Outputs, the log's per-source losses, --resume: README, "train.py — one continual-learning stage".
"""
import argparse
import hashlib
import importlib.util
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

# common.cli before torch: from its import on, a Ctrl-C while torch loads is one line, no traceback
from common.cli import Parser, float_in, int_at_least, main_cli
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from common.errors import UserError
from common.jsonl import dumps_strict
from data.mixture import tokenize_mixture
from common.outputs import sibling_tag
from data.packing import pack, plan_steps
import kernels
from kernels import attention, cross_entropy
from model.checkpoint import load_config, remove_dir, save_checkpoint
from model.fsdp import build_model, setup_distributed
from model.hub import resolve_model
from model.lora import LoraConfig, merge_state, read_config, save_adapter
from methods import OBJECTIVES
from methods.lora import add_lora_flags, check_lora_init, lora_config
from model.objectives import fsdp_units, trained
from model.schedules import SCHEDULES
from model.tokenizer import ChatTokenizer
from model import costs
from model.train_state import (already_final, hold, plan_digest, resume, save_state,
                               saved_settings, state_settings)
from reporting import tensorboard, wandb_run

# ---- defaults: the paper's hyperparameters (7-8B models, 8xH100) ---------------------------------
LR = 1e-5                # AdamW, cosine to 0
LR_SCHEDULE = "cosine"   # decay after the warmup: cosine (the paper's text) | linear (the
                         # official OPR code's)
WARMUP = 0.0             # fraction of the steps with a linear warmup to LR (the
                         # paper's setting: none)
WEIGHT_DECAY = 0.0
BETAS = (0.9, 0.999)
GRAD_CLIP = 1.0
GLOBAL_BATCH = 128       # sequences per optimizer step
MAX_LEN = 2048           # longer examples are dropped
EPOCHS = 5               # per stage; TRACE order uses [5, 3, 7, 5, 3, 5, 5, 7]
MICRO_TOKENS = 16384     # tokens per packed micro-batch (per rank) on the CPU; on a GPU: the most
                         # that fit its memory (model.costs.micro_tokens_that_fit: 90 % of it,
                         # with/without --activation-checkpointing)
SAVE_EVERY = 50          # optimizer steps between resumable training states (0: never)
OBJECTIVE = "sft"        # a name in methods.OBJECTIVES (see the docstring)
LORA_RANK = 0            # LoRA off: the paper fine-tunes every weight (the other LoRA
                         # defaults: methods/lora.py's)
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="input checkpoint: an HF directory, or a model id (Org/Name) in "
                                   "the local Hugging Face cache; default: the tiny embedded "
                                   "base model")
    p.add_argument("--data", help="comma-separated JSONL/JSON/Parquet files of {prompt, response} "
                                  "(or TRACE's {prompt, answer}, chat {messages}, {instruction, "
                                  "input, output}); default: the embedded benchmark's first task")
    p.add_argument("--out", default="runs/train-default", help="output checkpoint directory "
                   "(default: %(default)s); an earlier checkpoint of train.py there is replaced, "
                   "anything else is refused")
    p.add_argument("--overwrite", action="store_true", help="replace whatever is at --out, even if "
                                                           "train.py did not write it")
    p.add_argument("--epochs", type=int_at_least(1), default=EPOCHS,
                   help="epochs over the mixture (default: %(default)s)")
    p.add_argument("--lr", type=float_in(0, lo_open=True), default=LR,
                   help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=float_in(0, 1), default=WARMUP,
                   help="fraction of the steps over which the lr rises linearly from 0 (default: "
                        "%(default)s)")
    p.add_argument("--lr-schedule", choices=list(SCHEDULES), default=LR_SCHEDULE,
                   help="the lr's decay to 0 after the warmup (default: %(default)s)")
    p.add_argument("--weight-decay", type=float_in(0), default=WEIGHT_DECAY,
                   help="(default: %(default)s)")
    p.add_argument("--betas", type=float_in(0, 1), nargs=2, default=BETAS,
                   help="AdamW betas (default: %(default)s)")
    p.add_argument("--grad-clip", type=float_in(0, lo_open=True), default=GRAD_CLIP,
                   help="max grad norm (default: %(default)s)")
    p.add_argument("--global-batch", type=int_at_least(1), default=GLOBAL_BATCH,
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--max-len", type=int_at_least(2), default=MAX_LEN,
                   help="drop longer examples (default: %(default)s)")
    p.add_argument("--micro-tokens", type=int_at_least(1),
                   help=f"token budget of one packed micro-batch (default: {MICRO_TOKENS} on the "
                        f"CPU; on a GPU the most that fit its memory, printed at the start; a "
                        f"--resume keeps the saved state's)")
    p.add_argument("--seed", type=int, default=0, help="data order seed (default: %(default)s)")
    p.add_argument("--save-every", type=int_at_least(0), default=SAVE_EVERY,
                   help="steps between resumable training states, 0 = never (default: %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from the last training state in "
                   "OUT.partial/; when OUT is already the final checkpoint of the same settings, "
                   "say so and exit 0")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute blocks in backward")
    p.add_argument("--tensorboard", metavar="DIR", help="also write each step's numbers (loss, the "
                                                        "task and replay losses, lr, grad norm, "
                                                        "tokens/s, ...) as TensorBoard events into "
                                                        "DIR (rank 0)")
    p.add_argument("--wandb", metavar="DIR", help="also log each step's numbers to a Weights & "
                                                  "Biases run kept in DIR (rank 0; offline with "
                                                  "WANDB_MODE=offline; project $WANDB_PROJECT, "
                                                  "default opr); needs pip install wandb")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="compile each transformer block with torch.compile(fullgraph=True) "
                        "(default: on CUDA in bf16 with a varlen attention kernel; off on the CPU, "
                        "where it does not pay: BENCHMARKS.md, 'Compiled blocks')")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="compute dtype: auto = bf16 on CUDA (fp32 master weights), fp32 on CPU")
    p.add_argument("--memory", help="records held out of the training mixture, in --data's "
                                    "formats, for an objective that reads them (agem: its "
                                    "episodic memory)")
    add_objective_flags(p)
    add_lora_flags(p, LORA_RANK)
    p.add_argument("--peak-tflops", type=float_in(0, lo_open=True),
                   help="device peak for the MFU estimate (default: H100 bf16 dense on CUDA, a "
                        "measured fp32 matmul on CPU)")
    p.add_argument("--max-steps", type=int_at_least(1),
                   help="stop after this many optimizer steps (for smoke tests)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.memory and not OBJECTIVES[args.objective].reads_memory:
        p.error(f"--memory: --objective {args.objective} does not read a memory (agem does)")
    if args.lora_init and not args.lora_rank:
        p.error("--lora-init: needs --lora-rank (the adapter's rank)")
    if args.wandb and importlib.util.find_spec("wandb") is None:  # before any work, not
                                                                  # after the model is built
        p.error("--wandb: needs the wandb package; pip install wandb")
    return args


def add_objective_flags(p):
    """--objective and each objective's own flags (a run reads only its objective's: the others' are
    left out of a training state's settings, model.train_state.state_settings)."""
    p.add_argument("--objective", choices=list(OBJECTIVES), default=OBJECTIVE,
                   help="what a step minimises; see above (default: %(default)s)")
    for o in OBJECTIVES.values():
        o.add_flags(p)


def stacked_rank(args) -> int:
    """The rank of the frozen stack under a new adapter: --lora-init's, when the objective
    stacks (olora), else 0."""
    return (read_config(args.lora_init).rank if args.lora_init and OBJECTIVES[args.objective].stacks
            else 0)


def main(argv=None):
    args = parse_args(argv)
    kernels.retain_freed_memory()  # large tensors reuse freed memory, not fresh pages every step
    rank, world, device = setup_distributed()
    stage = setup(args, rank, world, device)  # 1-3: the data, the model, the optimizer
    if stage is None:  # --resume found the final checkpoint of these settings
        dist.destroy_process_group()
        return 0
    # 4. the loop
    bar = tqdm(total=len(stage.steps), initial=stage.start, disable=rank != 0 or args.quiet,
               desc="train", unit="step")
    t_start = time.perf_counter()
    for step in range(stage.start, len(stage.steps)):
        t0 = time.perf_counter()
        numbers = train_step(stage, step)
        log_and_save(stage, step, numbers, time.perf_counter() - t0, bar)
    bar.close()
    if stage.tb is not None:
        stage.tb.close()
    if stage.wb is not None:
        stage.wb.finish()
    save_final(stage, t_start)  # 5. the final weights
    if stage.lock is not None:
        os.close(stage.lock)
    dist.destroy_process_group()


@dataclass
class Stage:
    """What setup() prepared for the loop, and the loop's running totals."""
    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    compute_dtype: torch.dtype
    out: Path                  # the final checkpoint
    workdir: Path              # OUT.partial: training state and logs until the checkpoint is final
    log_path: Path             # workdir/train_log.jsonl: one record per step
    examples: list             # the tokenized mixture (data.packing.Example)
    dropped: int               # examples longer than --max-len
    lengths: list              # tokens of each example
    prompt_ids: list | None    # sdft: the student's prompts x
    teacher_ids: list | None   # sdft: the teacher's, x with the demonstration in context
    stop_ids: set              # the tokenizer's end-of-turn ids (sdft's sampling)
    has_replay: bool           # the mixture has task and replay examples: their
                               # losses are logged apart
    objective: object          # --objective's methods.base.Objective, asked at the loop's moments
    loss_fn: object            # its loss: a micro-batch -> (loss, [NLL, KL, task
                               # NLL, replay NLL] sums)
    steps: list                # the optimizer steps (lists of example indices), cut at --max-steps
    settings: dict             # state_settings(args)
    plan_id: str               # what a resumable training state must have been saved for
    model: torch.nn.Module
    teacher: torch.nn.Module | None  # sft-kl / sdft's teacher (None: sdft's "student" teacher
                                     # is the model itself)
    ema_rate: float | None     # the teacher's EMA rate (None: a frozen teacher, or none)
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    start: int                 # the first step to run (0, or where a resumed state stopped)
    peak: float                # the device's peak FLOP/s, for the MFU
    flops_per_token: float
    tb: object = None          # rank 0's TensorBoard writer (--tensorboard), else None
    wb: object = None          # rank 0's W&B run (--wandb), else None
    tokens_seen: int = 0       # tokens trained on in this run
    packed_tokens: int = 0     # tokens in micro-batches ...
    packed_slots: int = 0      # ... of the budget's capacity: the packing efficiency
    kept: dict = field(default_factory=dict)  # what the objective keeps from earlier
                                              # stages (ewc: F, theta*)
    lock: int | None = None    # rank 0: the fd of OUT.partial's flock (model.train_state.hold)

    @property
    def ema_teacher(self):
        """The teacher when it is an EMA of the student: part of the resumable state."""
        return self.teacher if self.ema_rate is not None else None


def device_defaults(args, device, rank: int, world: int, compute_dtype, saved: dict):
    """--compile and --micro-tokens when not given: compiled blocks on a GPU (bf16), eager on the
    CPU; on a GPU the most tokens per micro-batch that fit MEMORY_SHARE of its memory (or what is
    free, if less), by plan.py's memory model of this very loop (so plan.py and train.py agree),
    MICRO_TOKENS on the CPU. saved: the settings of the training state a --resume continues ({}
    otherwise): its --micro-tokens is kept."""
    # on CUDA the blocks compile whole with a varlen kernel (flash-attn, torch's varlen_attn: custom
    # operators) in bf16/fp16; the SDPA loop there (fp32) reads document bounds on the host, which
    # would break the graph
    gpu_varlen = (device.type == "cuda" and compute_dtype != torch.float32
                  and attention.get_backend() != "sdpa")
    if args.compile is None:
        args.compile = gpu_varlen
    elif args.compile and device.type == "cuda" and not gpu_varlen:
        raise UserError("--compile on CUDA needs --dtype bf16 and a varlen attention kernel "
                        "(flash-attn or torch's varlen_attn): the SDPA loop used otherwise reads "
                        "document bounds on the host; use --no-compile")
    if args.micro_tokens is not None:
        return
    if device.type != "cuda":
        args.micro_tokens = MICRO_TOKENS
        return
    if saved.get("micro_tokens"):  # a resumed run packs as it did, whatever is free now
        args.micro_tokens = saved["micro_tokens"]
        return
    free, total = torch.cuda.mem_get_info(device)
    budget = min(free, costs.MEMORY_SHARE * total)
    cfg = load_config(args.model)
    lora = (costs.lora_params(cfg, args.lora_rank, args.lora_targets.split(",")) if args.lora_rank
            else 0)
    fit = costs.micro_tokens_that_fit(cfg, world, budget, args.activation_checkpointing, lora)
    if compute_dtype == torch.float32:  # the memory model is bf16 training's: fp32 activations
        fit = fit // 2048 * 1024          # (and gathered weights, within the headroom) take twice
                                          # the bytes
    if dist.is_initialized():  # every rank packs with the same budget (FSDP's collectives)
        fit_t = torch.tensor(fit, device=device)
        dist.all_reduce(fit_t, op=dist.ReduceOp.MIN)
        fit = int(fit_t.item())
    if fit < args.max_len:
        raise UserError(f"train.py: at most {fit} tokens per micro-batch fit {budget / 1e9:.1f} GB "
                        f"per GPU on {world} GPU(s), fewer than --max-len {args.max_len}: add "
                        f"--activation-checkpointing or GPUs, or give --micro-tokens")
    args.micro_tokens = fit
    if rank == 0:
        print(f"train.py: --micro-tokens {fit}: the most that fit {budget / 1e9:.1f} GB per GPU"
              f"{' with activation checkpointing' if args.activation_checkpointing else ''} "
              f"(plan.py's memory model)", flush=True)


def setup(args, rank: int, world: int, device) -> Stage | None:
    """Steps 1-3 of the docstring: the mixture tokenized and its steps planned, the model (and
    teacher) built, the optimizer and schedule, a resumed training state loaded; None when --resume
    finds OUT already the final checkpoint of these settings (nothing to do)."""
    compute_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    resolve_inputs(args, rank)
    out = Path(args.out)
    workdir = out.with_name(sibling_tag(out) + ".partial")  # training state and logs until
                                                            # the checkpoint is final
    device_defaults(args, device, rank, world, compute_dtype,
                    saved_settings(workdir) if args.resume else {})
    log_path = workdir / "train_log.jsonl"
    if already_final(args, rank, out, workdir):
        return None

    # 1. data: every rank tokenizes the same mixture and plans the same steps
    tok = ChatTokenizer.from_dir(args.model)
    obj = OBJECTIVES[args.objective]
    examples, dropped, prompt_ids, teacher_ids = tokenize_mixture(args.data.split(","), tok,
                                                                  args.max_len, obj.template(args))
    lengths = [len(e.ids) for e in examples]
    # log the loss per source (an on-policy objective trains on the student's own
    # responses, not the records')
    has_replay = not obj.on_policy and 0 < sum(e.replay for e in examples) < len(examples)
    steps = plan_steps(len(examples), args.global_batch, args.epochs, args.seed)
    total_steps = len(steps)  # the schedule always spans the whole plan, also when
                              # --max-steps stops early
    if args.max_steps is not None:
        steps = steps[:args.max_steps]
    settings = state_settings(args)
    plan_id = plan_digest(settings, examples)

    # 2. model, and the objective's teacher (sft-kl, sdft) and what it keeps from
    #    earlier stages (ewc)
    model, teacher, ema_rate = build_models(args, device, compute_dtype, obj)
    ema_teacher = teacher if ema_rate is not None else None  # part of the resumable state
    kept = {}
    obj.setup(args, model, kept)  # before a resumed state replaces the starting weights

    # 3. optimizer and schedule, and where a resumed run starts
    # fused: one kernel over all tensors; with foreach=True FSDP2's DTensors dispatch each op
    # separately, a large share of a tiny model's CPU step (BENCHMARKS.md, "The default `python
    # run.py`", fused AdamW)
    opt = torch.optim.AdamW([p for _, p in trained(model)], lr=args.lr, betas=tuple(args.betas),
                            weight_decay=args.weight_decay, fused=True)
    schedule = SCHEDULES[args.lr_schedule]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, total_steps, args.warmup))
    # one writer per --out: a second train.py there is refused before it writes (nothing is made
    # before this line: bad inputs leave no OUT.partial behind)
    lock = hold(workdir, rank, device)
    start = resume(args, rank, model, opt, sched, workdir, plan_id, ema_teacher, settings,
                   total_steps)

    peak = (args.peak_tflops * 1e12 if args.peak_tflops
            else costs.measured_peak_flops(device, compute_dtype))
    # (DTensors: their global size)
    lora = sum(p.numel() for _, p in trained(model)) if args.lora_rank else 0
    flops_per_token = costs.flops_per_token(model.cfg, sum(lengths) / len(lengths), lora)
    stage = Stage(args=args, rank=rank, world=world, device=device, compute_dtype=compute_dtype,
                  out=out, workdir=workdir, log_path=log_path, examples=examples, dropped=dropped,
                  lengths=lengths, prompt_ids=prompt_ids, teacher_ids=teacher_ids,
                  stop_ids=tok.stop_ids, has_replay=has_replay, objective=obj,
                  loss_fn=obj.loss_fn(args, model, teacher, has_replay, device), steps=steps,
                  settings=settings, plan_id=plan_id, model=model, teacher=teacher,
                  ema_rate=ema_rate, opt=opt, sched=sched, start=start, peak=peak,
                  flops_per_token=flops_per_token, kept=kept, lock=lock)
    if rank == 0:
        print_stage(stage)
        stage.tb = (tensorboard.writer(Path(args.tensorboard), start + 1) if args.tensorboard
                    else None)
        stage.wb = wandb_run.start(Path(args.wandb), vars(args)) if args.wandb else None
    return stage


def print_stage(s: Stage):
    """The stage's one-line summary (data, steps, sharding, device, dtype,
    objective) and its kernels."""
    args, lengths = s.args, s.lengths
    print(f"train.py: {len(s.examples)} examples ({s.dropped} longer than {args.max_len} dropped), "
          f"{sum(lengths)} tokens, {len(s.steps)} steps of <= {args.global_batch} sequences on "
          f"{s.world} rank(s) "
          f"({'FSDP2' if fsdp_units(s.model) else 'unsharded: one CPU rank, fp32'}), "
          f"{s.device.type}, {str(s.compute_dtype).removeprefix('torch.')}"
          f"{', compiled blocks' if args.compile else ''}, {args.micro_tokens} tokens per "
          f"micro-batch, objective {args.objective}{s.objective.describe(args)}", flush=True)
    if args.lora_rank:
        n = sum(p.numel() for _, p in trained(s.model))
        print(f"train.py: LoRA r {args.lora_rank}, alpha {args.lora_alpha:g}, dropout "
              f"{args.lora_dropout:g} on {args.lora_targets}: {n:,} trainable parameters of "
              f"{sum(p.numel() for p in s.model.parameters()):,}"
              f"{', from ' + args.lora_init if args.lora_init else ''}", flush=True)
    print(f"train.py: kernels: attention {attention.describe()}; cross-entropy "
          f"{cross_entropy.get_backend()}", flush=True)


def resolve_inputs(args, rank: int):
    """--model and --data: the embedded benchmark's first task on the tiny base when not given
    (built once by rank 0, cached), a model id looked up in the local Hugging Face cache;
    --lora-init checked against the --lora-* flags."""
    if args.model is None or args.data is None:
        from data.embedded import ensure_embedded
        from model.base import ensure_base
        if rank == 0:  # built once, cached; the other ranks wait
            args.model = args.model or str(ensure_base("tiny"))
            args.data = args.data or str(ensure_embedded() / "C-STANCE" / "train.json")
        dist.barrier()
        args.model = args.model or str(ensure_base("tiny"))
        args.data = args.data or str(ensure_embedded() / "C-STANCE" / "train.json")
    if not Path(args.model).is_dir():  # a model id: its snapshot in the local Hugging Face cache
        args.model = str(resolve_model(args.model))
    if args.lora_init:
        check_lora_init(args, OBJECTIVES[args.objective].stacks)


def build_models(args, device, compute_dtype, obj):
    """Step 2: the model, and the teacher the objective asks for: a copy of the initial weights (an
    EMA from there on, or frozen; sdft's "student" teacher is the training model itself, no copy).
    -> (model, teacher or None, EMA rate or None)."""
    lora = dict(lora=lora_config(args), lora_init=args.lora_init, seed=args.seed,
                old_rank=stacked_rank(args))
    model = build_model(args.model, device, compute_dtype, args.activation_checkpointing,
                        compile=args.compile, **lora)
    wants_teacher, ema_rate = obj.teacher(args)
    teacher = None
    if wants_teacher:  # the student's starting point: with LoRA, the same base and adapters
                       # (no dropout: eval mode)
        teacher = build_model(args.model, device, compute_dtype, compile=args.compile,
                              **{**lora,
                                 "lora_init": obj.teacher_init(args)})  # (ilora: its slow adapter)
        teacher.requires_grad_(False).eval()
    return model, teacher, ema_rate


def train_step(s: Stage, step: int) -> dict:
    """Step 4 of the docstring, optimizer step `step` (0-based): its sequences packed into
    this rank's micro-batches (sdft: the student's responses sampled first), gradients
    accumulated, clipped, AdamW and the schedule stepped, an EMA teacher updated. Returns the
    step's numbers for the log: loss, kl, the per-source NLLs, grad_norm, lr, tokens,
    target_tokens and (sdft) gen_seconds."""
    args, model = s.args, s.model
    micro, n_targets, step_tokens, gen_seconds = micro_batches(s, step)
    # the step's random draws (LoRA's dropout masks) from its own seed: a resumed run draws what
    # an unbroken one does
    torch.manual_seed(
        int.from_bytes(hashlib.sha256(f"{args.seed}/{step}/{s.rank}".encode()).digest()[:8],
                       "little"))
    sums = torch.zeros(4, device=s.device)  # NLL, KL, task NLL, replay NLL
    s.objective.before_step(s, step)
    for mb in micro:
        loss, parts = s.loss_fn(mb)
        (loss / max(n_targets, 1)).backward()  # the mean over the response tokens of the
                                               # whole step, all ranks
        sums += parts
    dist.all_reduce(sums)
    train_loss, kl_mean, task_nll, replay_nll = (sums / max(n_targets, 1)).tolist()
    if s.objective.on_policy:
        train_loss = kl_mean  # the whole objective: there is no NLL term
    if not math.isfinite(train_loss):
        raise UserError(f"non-finite loss {train_loss} at step {step + 1}; stopping. The last good "
                         f"training state (if any) is intact in {s.workdir / 'state'}")
    extra = s.objective.after_backward(s, step)  # (ewc: its penalty's gradient;
                                                 # agem: the projection)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
    lr = s.sched.get_last_lr()[0]
    s.opt.step()
    s.sched.step()
    s.opt.zero_grad(set_to_none=True)
    s.objective.after_step(s)  # (an EMA teacher follows the student)
    return dict(loss=train_loss, kl=kl_mean, task_nll=task_nll, replay_nll=replay_nll,
                grad_norm=grad_norm, lr=lr, tokens=step_tokens, target_tokens=n_targets,
                gen_seconds=gen_seconds, extra=extra)


def micro_batches(s: Stage, step: int):
    """Optimizer step `step`'s micro-batches on this rank -> (micro-batches, response tokens of the
    whole step, tokens of the whole step, seconds spent sampling). Lists of the mixture's examples;
    an on-policy objective's (sdft) student first answers this rank's prompts, and its responses
    replace the gold answers."""
    args, examples, lengths = s.args, s.examples, s.lengths
    batch = s.steps[step]
    micro = pack(batch, lengths, args.micro_tokens, s.world)[s.rank]
    if not s.objective.on_policy:
        micro = [[examples[i] for i in mb] for mb in micro]
        n_targets = sum(examples[i].n_targets for i in batch)  # the global token count:
                                                               # every rank plans it
        step_tokens, gen_seconds = sum(lengths[i] for i in batch), None
        sizes = [sum(len(e.ids) for e in mb) for mb in micro]
    else:
        micro, n_targets, step_tokens, gen_seconds = s.objective.sample_micro_batches(
            s, step, micro)
        sizes = [sum(len(x.ids) for x, _ in mb) for mb in micro]
    s.packed_tokens += sum(sizes)
    # an example longer than --micro-tokens fills a micro-batch of its own length, not of the budget
    s.packed_slots += sum(max(args.micro_tokens, x) for x in sizes)
    return micro, n_targets, step_tokens, gen_seconds


def log_and_save(s: Stage, step: int, numbers: dict, dt: float, bar):
    """Step `step`'s record in train_log.jsonl (rank 0) and on the progress bar; the resumable
    training state every --save-every steps (the last step's is the final checkpoint instead)."""
    args, examples = s.args, s.examples
    step_tokens, n_targets, train_loss = (numbers["tokens"], numbers["target_tokens"],
                                          numbers["loss"])
    s.tokens_seen += step_tokens
    record = {"step": step + 1, "loss": train_loss, "grad_norm": numbers["grad_norm"],
              "lr": numbers["lr"], "tokens": step_tokens, "target_tokens": n_targets,
              "tokens_per_s": step_tokens / dt,
              "mfu": step_tokens * s.flops_per_token / dt / s.peak / s.world}
    if s.objective.logs_kl:
        record["kl"] = numbers["kl"]
    if s.has_replay:  # per source: that source's NLL per response token of that source
        n_replay = sum(examples[i].n_targets for i in s.steps[step] if examples[i].replay)
        record["loss_task"] = (numbers["task_nll"] * n_targets / (n_targets - n_replay)
                               if n_targets > n_replay else None)
        record["loss_replay"] = numbers["replay_nll"] * n_targets / n_replay if n_replay else None
        record["target_tokens_replay"] = n_replay
    if s.objective.on_policy:
        record["gen_seconds"] = numbers["gen_seconds"]
    record.update(numbers["extra"])
    if s.rank == 0:
        with open(s.log_path, "a") as f:
            f.write(dumps_strict(record, s.log_path) + "\n")
        bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{numbers['lr']:.2e}",
                        tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update()
        if s.tb is not None:
            tensorboard.add(s.tb, "train", record, step + 1)
        if s.wb is not None:
            wandb_run.log(s.wb, "train", record, step + 1)
    if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < len(s.steps):
        save_state(s.model, s.opt, s.sched, step + 1, s.workdir, s.rank, s.plan_id, s.ema_teacher,
                   s.settings)


def save_final(s: Stage, t_start: float):
    """Step 5 of the docstring: the full state dict gathered to rank 0, written as a Hugging
    Face checkpoint directory with the train log and train_summary.json; every rank learns
    whether that worked."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    args, steps, workdir = s.args, s.steps, s.workdir
    kept_files = s.objective.after_training(s)  # what the next stage reads (ewc: the Fisher)
    full = get_model_state_dict(s.model,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elapsed = time.perf_counter() - t_start
    # rank 0 writes; every rank learns whether that worked, so none waits forever on a failed rank 0
    error = None
    if s.rank == 0:
        try:
            summary = {"steps": len(steps), "examples": len(s.examples),
                       "dropped_overlong": s.dropped,
                       "tokens": sum(s.lengths[i] for batch in steps for i in batch),
                       "trained_tokens_this_run": s.tokens_seen, "seconds": elapsed,
                       "tokens_per_s": s.tokens_seen / max(elapsed, 1e-9),
                       "packing_efficiency": s.packed_tokens / max(s.packed_slots, 1),
                       "world_size": s.world, "args": vars(args)}
            (workdir / "train_summary.json").write_text(
                dumps_strict(summary, workdir / "train_summary.json", indent=2) + "\n")
            save_dtype = torch.bfloat16 if s.compute_dtype == torch.bfloat16 else torch.float32
            lora = lora_config(args)
            if lora is not None:  # the merged weights for every reader of a checkpoint, the
                                  # adapter for PEFT and vLLM
                full, adapter = merge_state(full, s.model)
                k = 1 + stacked_rank(args) // lora.rank  # a stack of k: one adapter of rank
                                                         # k r at the same scale
                lora = LoraConfig(rank=k * lora.rank, alpha=k * lora.alpha, dropout=lora.dropout,
                                  targets=lora.targets)
                save_adapter(None, lora, workdir / "adapter", base=args.model, state=adapter)
                kept_files = [*kept_files, workdir / "adapter"]
            save_checkpoint(full, args.model, s.out, dtype=save_dtype,
                            extra_files=[s.log_path, workdir / "train_summary.json", *kept_files])
            remove_dir(workdir)  # whole or gone: a kill mid-way must not leave a state
                                 # that looks resumable
            print(f"train.py: {len(steps)} steps, {s.tokens_seen} tokens in {elapsed:.1f}s "
                  f"({summary['tokens_per_s']:.0f} tok/s), dropped {s.dropped} over-long, packing "
                  f"efficiency {summary['packing_efficiency']:.1%} -> {s.out}", flush=True)
        except Exception as e:  # re-raised below, after the other ranks heard of it
            error = e
    ok = torch.tensor(float(error is None), device=s.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise UserError("rank 0 failed to write the final checkpoint (its error is above)")


if __name__ == "__main__":
    main_cli(main, "train.py")
