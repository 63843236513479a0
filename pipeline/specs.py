"""Step specs: for each kind of step, every setting its output depends on besides the files and
steps it reads. run.py builds them, pipeline.steps hashes their fields into the step's key, and
plan.py prices the step from the same fields, so a setting the planner reads is one the key holds.

The step's kind is Pipeline.add's first argument, named as the class is (BufferNll: "buffer-nll").
Every spec but BufferNll holds `task_fields`: the settings of its tasks that it depends on
(data.manifest.STEP_FIELDS; a manifest's, or TRACE's own). `gen`: the generation settings shared by
rollout and evaluation (engine, temperature, max_new_tokens, max_len).

A spec also says how its step's script (SCRIPT) is told these settings: FLAGS maps a field to
the flag that carries it, and the builders write those flags from the spec's values (Spec.argv),
so a keyed flag cannot say another value than the key. Every other flag of the script is declared
once, with why it is not in the key: NEUTRAL, those the builders pass (outputs, logs, inputs
keyed through the files and steps the step reads); DEFAULT, those no step passes (every step runs
at the script's own default). tests/test_flag_keys.py holds each flag of each script to exactly
one of the three.
"""
from dataclasses import asdict, dataclass


def verbatim(tokens: list) -> list:
    """A field that is argv already: a method's train.py flags (Method.train_flags), the
    engine's (Steps.engine)."""
    return list(tokens)


def budget_argv(budget: dict) -> list:
    """data.replay.replay_budget's budget as score.py and ssr_buffer.py take it."""
    if "per_task" in budget:
        return ["--task-budgets", ",".join(f"{t}={k}" for t, k in budget["per_task"].items())]
    return ["--budget", str(budget["total"])]


def render(how, value) -> list:
    """One field's flags: `how` is "--flag" (then its value; a list comma-joined; None: left out,
    the script's default), a function value -> argv, or for a dict field {key: one of those}."""
    if isinstance(how, dict):
        return [a for k, h in how.items() for a in render(h, value[k])]
    if callable(how):
        return how(value)
    if value is None:
        return []
    return [how, ",".join(map(str, value)) if isinstance(value, list) else str(value)]


class Spec:
    """What every spec declares besides its fields (see the module's docstring)."""
    SCRIPT = None  # None: the builder writes the step's output itself
    FLAGS = {}     # field -> how it is passed (render)
    NEUTRAL = {}   # flag -> why the builders pass it outside the key
    DEFAULT = {}   # flag -> why no step passes it

    def argv(self, *names) -> list:
        """The flags of fields `names` from this spec's values, in that order ("gen.max_len": one
        key of dict field gen; no name: every field of FLAGS)."""
        out = []
        for name in names or self.FLAGS:
            field, _, key = name.partition(".")
            how, value = self.FLAGS[field], getattr(self, field)
            out += render(how[key], value[key]) if key else render(how, value)
        return out


# flags that several scripts take, and why they are not in a key
OUTPUT = {"--out": "where the step writes: its own KEY.tmp directory",
          "--quiet": "no progress bars"}
UNPASSED = {"--overwrite": "a step writes into a fresh KEY.tmp (Pipeline._fresh_tmp)",
            "--debug": "a full traceback on an error, no number changes"}
DATA = {"--data": "the files the step reads from it are in its key (their content)",
        "--task-spec": "the manifest's settings the step depends on are its task_fields; its "
                       "tasks' files and scorers are in the key (their content)"}
BATCH = {"--batch-size": "the native engine's rows at once, which no token depends on "
                         "(tests/test_engine.py)"}
READ_CKPT = "the checkpoint of the step it reads"
# the generation settings of evaluation and rollout (their field `gen`, Steps.gen_spec)
GEN = {"max_len": "--max-len", "temperature": "--temperature",
       "max_new_tokens": "--max-new-tokens", "engine": verbatim}


@dataclass(frozen=True)
class Train(Spec):
    tasks: list          # the tasks whose train splits it trains on (mtl: all so far)
    seed: int
    lr: float
    gb: int              # sequences per optimizer step
    extra: list          # train.py's flags of the objective
    ep: int              # epochs
    max_len: int
    mt: int              # tokens per micro-batch
    max_train: int       # per-task training subsample
    warmup: float
    lr_schedule: str
    task_fields: dict
    SCRIPT = "train.py"
    # (a LoRA method's --lr, in extra, comes after the run's: the last one wins)
    FLAGS = {"ep": "--epochs", "lr": "--lr", "gb": "--global-batch", "max_len": "--max-len",
             "mt": "--micro-tokens", "seed": "--seed", "warmup": "--warmup",
             "lr_schedule": "--lr-schedule", "extra": verbatim}
    NEUTRAL = {"--model": READ_CKPT + ", or the base (its files are in the key)",
               "--data": "the mixture it writes from the train files and the buffer step it reads",
               "--memory": "agem's memory: the buffer step it reads",
               "--lora-init": "the previous stage's adapter: the step it reads",
               "--save-every": "resumable states; a resumed stage gives the numbers of one never "
                               "stopped (tests/test_train.py)",
               "--resume": "likewise",
               "--activation-checkpointing": "recomputes blocks in backward: the same numbers "
                                             "(tests/test_train.py)",
               "--tensorboard": "a copy of the train log", "--wandb": "a copy of the train log",
               **OUTPUT}
    DEFAULT = {"--weight-decay": "the pipeline trains at train.py's WEIGHT_DECAY",
               "--betas": "... and its BETAS", "--grad-clip": "... and its GRAD_CLIP",
               "--compile": "train.py's default per device (on CUDA in bf16 with a varlen "
                            "kernel); the device and kernels are in every key's numerics",
               "--dtype": "auto: bf16 on CUDA, fp32 on the CPU; the device is in every key's "
                          "numerics",
               "--peak-tflops": "the MFU estimate in the log only",
               "--max-steps": "smoke tests only",
               "--sft-kl-ema": "sft-kl's teacher at methods/sft_kl.py's EMA",
               "--sft-kl-direction": "... and its DIRECTION",
               "--sdft-skip-tokens": "sdft at methods/sdft.py's SKIP_TOKENS",
               "--sdft-template": "... and its TEMPLATE",
               "--agem-batch": "agem's memory batch at its default, the global batch", **UNPASSED}


@dataclass(frozen=True)
class Eval(Spec):
    tasks: list
    seed: int
    gen: dict
    repeats: int         # sampled responses per test prompt
    scoring: str
    rules: int           # data.metrics.RULES
    limit: int | None    # test prompts per task (None: all)
    task_fields: dict
    SCRIPT = "evaluate.py"
    FLAGS = {"tasks": "--tasks", "seed": "--seed", "repeats": "--repeats",
             "scoring": "--scoring", "gen": GEN, "limit": "--limit"}
    NEUTRAL = {"--ckpt": READ_CKPT + ", or the base (its files are in the key)",
               **DATA, **OUTPUT}
    DEFAULT = {**BATCH, **UNPASSED}


@dataclass(frozen=True)
class Rollout(Spec):
    prior: list          # the tasks whose training prompts it answers
    seed: int
    gen: dict
    max_train: int
    task_fields: dict
    SCRIPT = "rollout.py"
    FLAGS = {"prior": "--tasks", "seed": "--seed", "max_train": "--max-train", "gen": GEN}
    NEUTRAL = {"--ckpt": READ_CKPT, **DATA, **OUTPUT}
    DEFAULT = {"--limit": "every training prompt is answered",
               "--data-seed": "rollout.py's DATA_SEED, the subsample's seed of every step",
               "--check-logprobs": "a check of the engine's log-probs against the trainer's, in "
                                   "the summary only: the rollouts are the same",
               **BATCH, **UNPASSED}


@dataclass(frozen=True)
class Score(Spec):
    scorer: str          # ru: the task metric, sc: mean log-prob
    mode: str            # top, low, random
    budget: dict         # data.replay.replay_budget
    seed: str            # "seed:stage": ties drawn anew at every stage
    scoring: str
    rules: int
    max_len: int
    task_fields: dict
    SCRIPT = "score.py"
    FLAGS = {"scorer": "--scorer", "mode": "--select", "budget": budget_argv,
             "scoring": "--scoring", "max_len": "--max-len", "seed": "--seed"}
    NEUTRAL = {"--rollouts": "the rollout step it reads",
               "--tasks": "the tasks of the rollout step it reads (its prior), in that order",
               "--tokenizer": "the base's, whose files are in the key of its chain's first step",
               "--data": DATA["--data"], "--task-spec": DATA["--task-spec"],
               "--out": OUTPUT["--out"]}
    DEFAULT = {"--rho": "the budget is passed instead (--budget, --task-budgets)",
               "--n": "likewise", **UNPASSED}


@dataclass(frozen=True)
class Replay(Spec):
    prior: list
    seed: int
    budget: dict
    max_len: int
    max_train: int
    task_fields: dict


@dataclass(frozen=True)
class Drift(Spec):
    prior: list          # the tasks whose test prompts it probes
    seed: int
    limit: int           # test prompts per prior task
    temperature: float
    max_new_tokens: int
    max_len: int
    engine: list
    task_fields: dict
    SCRIPT = "drift.py"
    FLAGS = {"max_len": "--max-len", "prior": "--tasks", "seed": "--seed", "limit": "--limit",
             "max_new_tokens": "--max-new-tokens", "engine": verbatim}
    NEUTRAL = {"--ckpt": "the checkpoints of the two steps it reads", "--ref": "likewise",
               **DATA, **OUTPUT}
    DEFAULT = {"--temperature": "drift.py's TEMPERATURE, which the key holds (temperature)",
               **BATCH, **UNPASSED}


@dataclass(frozen=True)
class BufferNll(Spec):
    max_len: int
    SCRIPT = "buffer_nll.py"
    FLAGS = {"max_len": "--max-len"}
    NEUTRAL = {"--ckpt": READ_CKPT, "--buffer": "the buffer step it reads", **OUTPUT}
    DEFAULT = UNPASSED


@dataclass(frozen=True)
class Synth(Spec):
    task: str            # the task whose inputs the base model synthesizes (ssr)
    seed: int
    demos: int           # stored demonstrations
    prompts: int         # in-context prompts
    samples: int         # completions per prompt
    temperature: float
    template: str        # raw | chat
    max_new_tokens: int
    max_len: int
    max_train: int
    engine: list
    task_fields: dict
    SCRIPT = "synthesize.py"
    FLAGS = {"max_len": "--max-len", "task": "--tasks", "seed": "--seed", "demos": "--demos",
             "prompts": "--prompts", "samples": "--samples", "temperature": "--temperature",
             "template": "--template", "max_new_tokens": "--max-new-tokens",
             "max_train": "--max-train", "engine": verbatim}
    NEUTRAL = {"--ckpt": "the base, whose files are in the key", **DATA, **OUTPUT}
    DEFAULT = {"--shots": "synthesize.py's SHOTS", "--debug": UNPASSED["--debug"]}


@dataclass(frozen=True)
class Ssr(Spec):
    prior: list          # the tasks whose synthetic inputs it selects and answers
    seed: int
    budget: dict         # data.replay.replay_budget
    clusters: int
    gen: dict
    task_fields: dict
    SCRIPT = "ssr_buffer.py"
    # its answers are greedy, whatever gen's temperature (a key finer than it need be)
    FLAGS = {"budget": budget_argv, "clusters": "--clusters", "seed": "--seed",
             "gen": {k: h for k, h in GEN.items() if k != "temperature"}}
    NEUTRAL = {"--ckpt": READ_CKPT, "--synth": "the synth steps it reads", **OUTPUT}
    DEFAULT = {"--temperature": "greedy answers, ssr_buffer.py's default (SSR's)",
               "--debug": UNPASSED["--debug"]}


def fields_of(spec) -> dict:
    """A spec's fields as the key hashes them
    (a plain dict passes as it is: the tests' stand-in steps)."""
    return spec if isinstance(spec, dict) else asdict(spec)
