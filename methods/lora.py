"""LoRA variants of the methods: any method with its stages trained on adapters (Hu et al. 2021; model/lora.py),
named <method>+lora; lora-seqft is sft+lora, TRACE's LoRASeqFT row (Wang et al. 2023, TRACE, section 4: sequential
fine-tuning of one LoRA adapter through the stream).

Stage i trains adapters on the frozen base; stage i+1 starts from stage i's adapter (train.py --lora-init) on that
same base, so the stream's whole change stays in one rank-r adapter, as TRACE's LoRASeqFT trains one PEFT model
task after task. Each stage's checkpoint is the merged model (what rollouts, evaluation and drift read) with the
adapter beside it in PEFT's layout (OUT/adapter/). A method's buffer, penalty or teacher is what it is on full
fine-tuning (EWC's Fisher and A-GEM's gradients then span the adapters only).

Defaults: TRACE's LoRA setting (upstream PEFT, r 8, alpha 32, dropout 0.1, lr 1e-4), on PEFT's default modules for
Llama/Qwen (q_proj, v_proj).
"""
import copy

RANK = 8                 # the LoRA methods' rank (train.py's own default is 0: full fine-tuning)
ALPHA = 32.0
DROPOUT = 0.1
TARGETS = "q_proj,v_proj"
LR = 1e-4
FLAGS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")  # run.py settings -> train.py --lora-* flags


def on_lora(method, name: str | None = None):
    """The method with its stages on adapters: the same plan, its train.py flags plus the LoRA ones."""
    v = copy.copy(method)
    v.name, v.lora = name or f"{method.name}+lora", True
    return v
