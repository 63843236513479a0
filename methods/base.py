"""What a continual-learning method is to this project: two objects, asked at named
moments, never branched on.

    Method     run.py's side: how stage i of a chain is trained and what replay buffer follows it
               (none, gold examples, OPR's scored rollouts), train.py's flags of its objective,
               its label in the report
    Objective  train.py's side: the loss of a micro-batch, the models it needs besides the student
               (a teacher), and hooks at the loop's moments (after the gradients, after the
               optimizer step, after training)

A method's file (methods/<name>.py) holds both, its defaults and its paper.
"""


class Method:
    """run.py's view of a method (the defaults: plain sequential fine-tuning, no buffer)."""
    name = "sft"
    objective = "sft"    # train.py --objective of its stages
    flags = ()           # run.py settings passed to train.py as --<flag> (Settings field
                         # names, in this order)
    acc_only = False     # each row of its matrix is a separate run: BWT, FWT and
                         # forgetting mean nothing
    uses_buffer = False  # builds a replay buffer of b = rho * n after each
                         # stage: one chain per --rho
    lora = False         # its stages train LoRA adapters on the frozen base
                         # (methods/lora.py: <name>+lora)

    def label(self, rho: float, n_rhos: int) -> str:
        """The method's name in the report: with "@rho" when a sweep over --rho gives
        it several chains."""
        return f"{self.name}@{rho:g}" if self.uses_buffer and n_rhos > 1 else self.name

    def train_flags(self, cfg: dict) -> list:
        """train.py's flags of this method's objective, from the run's settings (part of the
        train step's key)."""
        out = ["--objective", self.objective] if self.objective != "sft" else []
        for f in self.flags:
            out += ["--" + f.replace("_", "-"), str(cfg[f])]
        if self.lora:  # (Steps.train then starts stage i+1 from stage i's adapter on the base)
            from methods.lora import FLAGS
            out += ["--lr", str(cfg["lora_lr"])]
            for f in FLAGS:
                out += ["--" + f.replace("_", "-"), str(cfg[f])]
        return out

    def plan_train(self, steps, prev, stage: int, tasks: list, buffer_key, seed: int):
        """Stage `stage`'s train step: task tasks[stage-1] on the checkpoint of `prev` with the
        buffer of `buffer_key` (both None at stage 1 / without replay)."""
        return steps.train(prev, stage, [tasks[stage - 1]], buffer_key, seed,
                           self.train_flags(steps.cfg))

    def plan_buffer(self, steps, train_key, stage: int, seen: list, seed: int, next_task: str,
                    rho: float):
        """The step that builds the replay buffer stage + 1 trains with (None: no buffer)."""
        return None


class Objective:
    """train.py's view of a method's objective (the defaults: sft's response-token NLL, no
    teacher, no hooks)."""
    name = "sft"
    prefixes = ()        # its flags' prefixes: a training state ignores the other objectives' flags
    logs_kl = False      # train_log.jsonl has a "kl" field
    on_policy = False    # trains on the student's own samples: micro-batches come from
                         # sample_micro_batches
    reads_memory = False  # reads train.py's --memory (records held out of the mixture)
    stacks = False       # LoRA: --lora-init's adapters are frozen under a new one each stage
                         # (olora), not continued
    # its cost for the planner (plan.py): forward-backward passes per trained token besides the
    # student's own (a teacher's forward ~1/3), and bytes per parameter it keeps besides the weights
    # and AdamW, sharded over the GPUs
    extra_passes = 0.0
    state_bytes = 0
    state_what = ""
    copies_model = False  # its state is a second model (a teacher): on LoRA the
                          # frozen base again, in bf16

    def extra_tokens(self, flags: list, mean_doc: float) -> float:
        """Tokens of forward-backward work that every GPU of a stage with train.py flags `flags`
        does once, besides its steps' share."""
        return 0.0

    def add_flags(self, p):
        """Its own flags on train.py's parser."""

    def describe(self, args) -> str:
        """A suffix to train.py's one-line summary of the stage."""
        return ""

    def teacher(self, args):
        """(a second model is needed: bool, its EMA rate after each step or None
        for a frozen one)."""
        return False, None

    def teacher_init(self, args):
        """The PEFT adapter a LoRA stage's teacher starts from (None: a new one, as the
        student's at stage 1)."""
        return args.lora_init

    def template(self, args):
        """The teacher's demonstration template, when it reads one (sdft), else None."""
        return None

    def loss_fn(self, args, model, teacher, has_replay: bool, device):
        """A micro-batch -> (loss sum to backpropagate, [NLL, KL, task NLL, replay NLL] sums,
        detached)."""
        from functools import partial
        from model.objectives import sft_loss
        return partial(sft_loss, model, has_replay, device)

    def setup(self, args, model, kept: dict):
        """After the model is built, before a resumed state is loaded: what the objective keeps
        from earlier stages (and from the weights the stage starts from), into `kept`
        (train.py's Stage.kept)."""

    def before_step(self, stage, step: int):
        """Before optimizer step `step`'s micro-batches (every rank; ilora: the step's
        replay token count)."""

    def after_backward(self, stage, step: int) -> dict:
        """After optimizer step `step`'s gradients are accumulated, before clipping and the
        optimizer: extra gradient terms, a projection; -> numbers for the step's log record."""
        return {}

    def after_step(self, stage):
        """After the optimizer step (an EMA teacher follows the student)."""
        if stage.ema_teacher is None:
            return
        import torch
        from model.objectives import fsdp_units
        # a forward with no backward can leave the teacher's units (always the root:
        # embeddings, norm, lm_head) unsharded, as plain tensors: reshard so the EMA below
        # updates the sharded parameters
        for unit in fsdp_units(stage.teacher):
            unit.reshard()
        with torch.no_grad():  # phi <- rate * theta + (1 - rate) * phi
            for t_p, s_p in zip(stage.teacher.parameters(), stage.model.parameters()):
                if s_p.requires_grad:  # (a LoRA stage's frozen base is the same in both:
                                       # lerp would leave it)
                    t_p.lerp_(s_p, stage.ema_rate)

    def after_training(self, stage) -> list:
        """After the last step, before the final save (every rank): -> files (rank 0) to put
        in the checkpoint."""
        return []
