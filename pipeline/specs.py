"""Step specs: for each kind of step, every setting its output depends on besides the files and steps it reads. run.py
builds them, pipeline.steps hashes their fields into the step's key, and plan.py prices the step from the same
fields, so a setting the planner reads is one the key holds.

The step's kind is Pipeline.add's first argument, named as the class is (BufferNll: "buffer-nll").
Every spec but BufferNll holds `task_fields`: the settings of its tasks that it depends on (data.manifest.STEP_FIELDS;
a manifest's, or TRACE's own). `gen`: the generation settings shared by rollout and evaluation (engine, temperature,
max_new_tokens, max_len).
"""
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Train:
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


@dataclass(frozen=True)
class Eval:
    tasks: list
    seed: int
    gen: dict
    repeats: int         # sampled responses per test prompt
    scoring: str
    rules: int           # data.metrics.RULES
    limit: int | None    # test prompts per task (None: all)
    task_fields: dict


@dataclass(frozen=True)
class Rollout:
    prior: list          # the tasks whose training prompts it answers
    seed: int
    gen: dict
    max_train: int
    task_fields: dict


@dataclass(frozen=True)
class Score:
    scorer: str          # ru: the task metric, sc: mean log-prob
    mode: str            # top, low, random
    budget: dict         # data.replay.replay_budget
    seed: str            # "seed:stage": ties drawn anew at every stage
    scoring: str
    rules: int
    max_len: int
    task_fields: dict


@dataclass(frozen=True)
class Replay:
    prior: list
    seed: int
    budget: dict
    max_len: int
    max_train: int
    task_fields: dict


@dataclass(frozen=True)
class Drift:
    prior: list          # the tasks whose test prompts it probes
    seed: int
    limit: int           # test prompts per prior task
    temperature: float
    max_new_tokens: int
    max_len: int
    engine: list
    task_fields: dict


@dataclass(frozen=True)
class BufferNll:
    max_len: int


@dataclass(frozen=True)
class Synth:
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


@dataclass(frozen=True)
class Ssr:
    prior: list          # the tasks whose synthetic inputs it selects and answers
    seed: int
    budget: dict         # data.replay.replay_budget
    clusters: int
    gen: dict
    task_fields: dict


def fields_of(spec) -> dict:
    """A spec's fields as the key hashes them (a plain dict passes as it is: the tests' stand-in steps)."""
    return spec if isinstance(spec, dict) else asdict(spec)
