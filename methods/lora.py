"""LoRA variants of the methods: any method with its stages trained on adapters (Hu et al. 2021;
model/lora.py), named <method>+lora; lora-seqft is sft+lora, TRACE's LoRASeqFT row (Wang et al.
2023, TRACE, section 4: sequential fine-tuning of one LoRA adapter through the stream).

Stage i trains adapters on the frozen base; stage i+1 starts from stage i's adapter (train.py
--lora-init) on that same base, so the stream's whole change stays in one rank-r adapter, as TRACE's
LoRASeqFT trains one PEFT model task after task. Each stage's checkpoint is the merged model (what
rollouts, evaluation and drift read) with the adapter beside it in PEFT's layout (OUT/adapter/). A
method's buffer, penalty or teacher is what it is on full fine-tuning (EWC's Fisher and A-GEM's
gradients then span the adapters only).

Defaults: TRACE's LoRA setting (upstream PEFT, r 8, alpha 32, dropout 0.1, lr 1e-4), on PEFT's
default modules for Llama/Qwen (q_proj, v_proj).

train.py's side: its --lora-* flags (add_lora_flags), the stage's adapter settings
(lora_config), the check that --lora-init's adapter is one these flags continue
(check_lora_init); the adapters themselves are model/lora.py's.
"""
import argparse
import copy
from pathlib import Path

from common.cli import float_in, int_at_least
from common.errors import UserError
from model.lora import TARGETS as MODULES, LoraConfig, read_config

RANK = 8                 # the LoRA methods' rank (train.py's own default is 0: full fine-tuning)
ALPHA = 32.0
DROPOUT = 0.1
TARGETS = "q_proj,v_proj"
LR = 1e-4
# run.py settings -> train.py --lora-* flags
FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def on_lora(method, name: str | None = None):
    """The method with its stages on adapters: the same plan, its train.py flags
    plus the LoRA ones."""
    v = copy.copy(method)
    v.name, v.lora = name or f"{method.name}+lora", True
    return v


def add_lora_flags(p, rank: int):
    """train.py's LoRA flags, a group of parser `p`; `rank`: --lora-rank's default (train.py: 0)."""
    g = p.add_argument_group("LoRA (model/lora.py): a frozen --model, adapters trained; OUT holds "
                             "the merged weights and the adapter in PEFT's layout (OUT/adapter/)")
    g.add_argument("--lora-rank", type=int_at_least(0), default=rank,
                   help="adapter rank r; 0 = full fine-tuning (default: %(default)s)")
    g.add_argument("--lora-alpha", type=float_in(0, lo_open=True), default=ALPHA,
                   help="scale alpha / r (default: %(default)s, TRACE's)")
    g.add_argument("--lora-dropout", type=float_in(0, 0.99), default=DROPOUT,
                   help="dropout on the adapters' input (default: %(default)s, TRACE's); its "
                        "masks are seeded by --seed, step and rank, so a resumed run draws the "
                        "same ones")
    g.add_argument("--lora-targets", type=lora_targets, default=TARGETS,
                   help=f"comma-separated modules of every block, from {','.join(MODULES)} "
                        f"(default: %(default)s, PEFT's for Llama/Qwen)")
    g.add_argument("--lora-init", metavar="DIR",
                   help="start from this PEFT adapter (a LoRA stage's OUT/adapter: sequential "
                        "LoRA fine-tuning) instead of a new one; its r, alpha and targets must be "
                        "the flags'")


def lora_targets(text: str) -> str:
    """--lora-targets: one spelling of a set of model/lora.py's TARGETS (sorted, no repeats)."""
    names = sorted({t.strip() for t in text.split(",") if t.strip()})
    bad = [t for t in names if t not in MODULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not a module of a block "
                                         f"({', '.join(MODULES)})")
    return ",".join(names)


def lora_config(args) -> LoraConfig | None:
    """The stage's adapters from train.py's flags; None without --lora-rank (full fine-tuning)."""
    return (LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                       targets=tuple(args.lora_targets.split(","))) if args.lora_rank else None)


def check_lora_init(args, stacks: bool):
    """--lora-init is a PEFT adapter of the flags' rank, alpha and targets or, when the objective
    stacks adapters (`stacks`: olora), a stack of such adapters; else one UserError naming it."""
    if not (Path(args.lora_init) / "adapter_config.json").is_file():
        raise UserError(f"--lora-init {args.lora_init}: not a PEFT adapter directory (no "
                        f"adapter_config.json)")
    try:
        saved = read_config(args.lora_init)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--lora-init {args.lora_init}: {e}") from None
    ours = lora_config(args)
    if stacks:  # a stack of k adapters of rank r: rank k r, alpha k alpha (one scale)
        k = saved.rank // ours.rank
        if saved.rank % ours.rank or saved.alpha != k * ours.alpha:
            raise UserError(f"--lora-init {args.lora_init}: its adapter (rank {saved.rank}, "
                            f"alpha {saved.alpha:g}) is not a stack of adapters of --lora-rank "
                            f"{ours.rank}, --lora-alpha {ours.alpha:g}")
        saved = ours
    for flag, a, b in (("rank", saved.rank, ours.rank), ("alpha", saved.alpha, ours.alpha),
                       ("targets", ",".join(saved.targets), args.lora_targets)):
        if a != b:
            raise UserError(f"--lora-init {args.lora_init}: its adapter has {flag} {a}, "
                            f"--lora-{flag} is {b}")
