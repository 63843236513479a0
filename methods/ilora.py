"""ilora — I-LoRA, interpolation-based LoRA (Ren et al. 2024, "Analyzing and Reducing Catastrophic
Forgetting in Parameter Efficient Tuning", arXiv 2402.18865): a dual-memory experience replay on
adapters. A fast adapter theta_w trains on the current task plus a replay buffer; a slow adapter
theta_s follows it by interpolation after every optimizer step,
    theta_s <- lambda * theta_s + (1 - lambda) * theta_w
and the fast learner is pulled towards the slow one's hidden states on the replayed examples:
    loss = NLL(current + replay) + gamma * MSE(h_w, h_s),   the MSE's mean over every replay token
           (prompt and response), every layer's hidden states (transformers'
           output_hidden_states: the embeddings, each block's output, the final-normed last) and
           every dimension; h_s detached
The buffer is replay's (gold examples of the prior tasks, data/replay.py's draw at --rho): an
equal-memory comparison with replay and OPR. Each stage's checkpoint is the fast learner (merged
weights and adapter/, what evaluation reads, as both peers evaluate) with the slow adapter
beside it in PEFT's layout (ema/, the official code's name); the next stage continues both. The
slow adapter starts as the fast one's initialisation at stage 1 (or from --lora-init when no
ema/ lies beside it).

Defaults: the official code's (which47/LLMCL a9dae12, method/ILORA.py: ema_alpha 0.25 in slow <-
alpha * slow + (1 - alpha) * fast, reg_weight 1.0, all hidden states). The peers disagree and none
runs as written: there the EMA matches no parameter (the slow adapter never leaves its
initialisation), the MSE's target is max(fast, slow) element by element, the replay CE is averaged
with the task's, and `load_ema_model` (undefined) ends the run after task 1; EasyCL (cbc5bea,
cl/ilora) weights fast by 0.25 instead, on the last 3 layers of the whole batch, and its EMA also
matches no parameter.
"""
from pathlib import Path

import torch
import torch.distributed as dist

from data.packing import collate
from methods.base import Method, Objective
from model.objectives import sft_loss

LAMBDA = 0.25  # LLMCL ILORA.py ema_alpha: slow <- 0.25 * slow + 0.75 * fast
GAMMA = 1.0    # LLMCL ILORA.py reg_weight: weight of the consistency MSE
SLOW = "ema"   # the slow adapter's directory in a stage's checkpoint (LLMCL's save_model)


class ILora(Method):
    name = objective = "ilora"
    lora = True
    uses_buffer = True
    flags = ("ilora_lambda", "ilora_gamma")

    def plan_buffer(self, steps, train_key, stage, seen, seed, next_task, rho):
        return steps.gold_buffer(stage, seen, seed, next_task, rho)


def consistency(states: list, slow: list, mask) -> torch.Tensor:
    """sum over the tokens of `mask` of the mean over layers and dimensions of (h_fast - h_slow)^2,
    in fp32 at least (bf16 states on a GPU)."""
    dt = torch.promote_types(states[0].dtype, torch.float32)
    per_layer = [((h[0][mask].to(dt) - t[0][mask].to(dt)) ** 2).sum()
                 for h, t in zip(states, slow, strict=True)]
    return torch.stack(per_layer).sum() / (len(states) * states[0].shape[-1])


def ilora_loss(model, teacher, gamma: float, step: dict, has_replay: bool, device, mb: list):
    """sft's NLL + gamma * the consistency term, scaled so that after train.py's division by the
    step's response tokens it is gamma times the MSE over the whole step's replay tokens (any world
    size, packing or split)."""
    # every rank runs the teacher on each micro-batch of a step with replay tokens anywhere in it,
    # its own or not: under FSDP2 a forward is a collective
    states = [] if gamma and step["replay"] else None
    loss, parts = sft_loss(model, has_replay, device, mb,
                           on_hidden=None if states is None else states.append)
    if states is None:
        return loss, parts
    replay = torch.tensor([e.replay for e in mb for _ in e.ids], dtype=torch.bool, device=device)
    ids, pos, _, cu, max_len = collate(mb, device)
    with torch.no_grad():
        slow = []
        teacher(ids, pos, return_hidden=True, on_hidden=slow.append, cu_seqlens=cu,
                max_seqlen=max_len)
    term = consistency(states, slow, replay)
    step["sum"] += term.detach()
    return loss + gamma * step["scale"] * term, parts


class ILoraObjective(Objective):
    name = "ilora"
    prefixes = ("ilora_",)
    # a teacher forward on the micro-batches that hold replay examples; the slow learner is a second
    # model (the frozen base again, and its adapters)
    extra_passes, state_bytes, state_what = 1 / 3, 4, "the slow learner: a second model, fp32"
    copies_model = True

    def add_flags(self, p):
        from common.cli import float_in
        p.add_argument("--ilora-lambda", type=float_in(0, 1), default=LAMBDA,
                       help="ilora: slow <- lambda * slow + (1 - lambda) * fast after every step "
                            "(default: %(default)s, the official code's ema_alpha)")
        p.add_argument("--ilora-gamma", type=float_in(0), default=GAMMA,
                       help="ilora: weight of the hidden-state MSE on replay examples "
                            "(default: %(default)s, the official code's reg_weight; "
                            "0: the fast learner trains as sft on the same data)")

    def describe(self, args):
        slow = self.teacher_init(args)
        return (f" (lambda {args.ilora_lambda:g}, gamma {args.ilora_gamma:g}, slow adapter from "
                f"{slow or 'the fast one'})")

    def teacher(self, args):
        if not args.lora_rank:
            from common.errors import UserError
            raise UserError("--objective ilora: trains LoRA adapters; give --lora-rank")
        return True, 1 - args.ilora_lambda

    def teacher_init(self, args):
        if not args.lora_init:
            return None
        slow = Path(args.lora_init).parent / SLOW
        return str(slow) if (slow / "adapter_config.json").is_file() else args.lora_init

    def loss_fn(self, args, model, teacher, has_replay, device):
        from functools import partial
        self.step = {"scale": 0.0, "replay": 0, "sum": torch.zeros((), device=device)}
        return partial(ilora_loss, model, teacher, args.ilora_gamma, self.step, has_replay, device)

    def before_step(self, stage, step):
        batch = stage.steps[step]  # every rank plans the whole step: the counts are global
        targets = sum(stage.examples[i].n_targets for i in batch)
        replay = sum(stage.lengths[i] for i in batch if stage.examples[i].replay)
        self.step["scale"] = targets / replay if replay else 0.0
        self.step["replay"] = replay
        self.step["sum"].zero_()

    def after_backward(self, stage, step):
        total = self.step["sum"].clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        return {"ilora_mse": total.item() / self.step["replay"] if self.step["replay"] else 0.0}

    def after_training(self, stage):
        """The slow adapter (gathered: a collective), written by rank 0 as a PEFT adapter
        beside the fast one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from model.lora import LoraConfig, adapter_state, save_adapter
        full = get_model_state_dict(
            stage.teacher, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if stage.rank != 0:
            return []
        a = stage.args
        cfg = LoraConfig(rank=a.lora_rank, alpha=a.lora_alpha, dropout=a.lora_dropout,
                         targets=tuple(a.lora_targets.split(",")))
        save_adapter(None, cfg, stage.workdir / SLOW, base=a.model,
                     state=adapter_state(stage.teacher, full))
        return [stage.workdir / SLOW]


METHOD = ILora()
OBJECTIVE = ILoraObjective()
