"""run.py — the whole continual-learning pipeline, every method, a paper-style report.

    # the embedded default: tiny base, 8 synthetic tasks, CPU
    python run.py
    # SmolLM2-135M-Instruct, budgets sized for CPU
    python run.py --base smollm2
    # the paper's setting (bf16, flash-attn, liger, vLLM)
    python run.py --model DIR --data TRACE_ROOT --gpus 8
    # your own tasks: ROOT/tasks.json names them, their metrics, epochs and formats
    # (README, "Your own tasks")
    python run.py --data ROOT --tasks Tickets,SQL

Row 0 = evaluate.py(base) on the test split of every task (once per base and seed,
shared by all methods).
For each method and seed, stage i = 1..N:
    mixture_i = train split of task i  (+ the replay buffer built after stage i-1)
    ckpt_i    = train.py(ckpt_{i-1}, mixture_i)                       [torchrun when --gpus > 1]
    row i     = evaluate.py(ckpt_i) on the test split of tasks 1..i   -> accuracy matrix a(i, j)
                (and of task i+1, not yet trained on: a(i, i+1) for FWT)
    buffer    = replay: b gold examples of tasks 1..i
                opr-*:  rollout.py(ckpt_i) on the training prompts of tasks 1..i, then
                        score.py keeps the top (opr-ru: task metric, opr-sc: mean log-prob), the
                        lowest (opr-low) or a random subset (opr-random) of b
    b         = --replay-budget total (default): rho * n_{i+1} (rounded half up) split evenly over
                tasks 1..i, n_{i+1} = task i+1's training subsample size (5,000 on TRACE) BEFORE the
                over-long filter, as the official code's int(5000 * rho); per-task: rho * n_j of
                each prior task j (TRACE's past_task_ratio), each capped by what the task has
Baselines: sft (no replay), mtl (stage i trains the base on tasks 1..i jointly: the upper bound),
sdft (on-policy Self-Distillation Fine-Tuning as Shenfeld et al. 2026 define it: the student
samples, a demonstration-conditioned EMA teacher scores; train.py --objective sdft), sft-kl (SFT +
beta * KL to an EMA teacher on the gold tokens: the OPR paper's one-line description of SDFT).
The paper's mechanism is measured on every chain: after every stage i >= 2, drift.py(ckpt_i,
ckpt_{i-1}) on the test prompts of tasks 1..i-1 (per-update KL, --drift-limit prompts per task),
and every buffer's per-token NLL under the checkpoint that built it (score.py for OPR,
buffer_nll.py for gold replay).

Steps, keys, resuming, determinism: README, "run.py — the pipeline"; stopping: "Killing run.py".
"""
import argparse
import faulthandler
import importlib.util
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import drift
import plan
import rollout
import synthesize
import train
from methods import FULL, METHODS, ewc, ilora, lora, lwf, olora, sdft, sft_kl, ssr

from common.cli import ENGINE_HELP, Parser, comma_list, float_in, int_at_least, main_cli
from common.errors import UserError
from common.outputs import check_output, claim_dir, write_json, write_text_atomic
from data.manifest import use_manifest_from_argv
from data.tasks import task_names
from pipeline import config, keep
from pipeline.builders import Steps
from pipeline.inputs import Inputs, load_inputs
from pipeline.layout import TP_SIZES, WEIGHT_SHARE
from pipeline.machine import engine_of, make_pipeline
from pipeline.settings import add_flags, apply, setting
from pipeline.steps import Pipeline
from pipeline.watch import train_labels, train_status
from reporting import tensorboard
from reporting.claims import claims
from reporting.collect import Evals, collect, write_index, write_partial, write_timing
from reporting.noise import preset_seed_noise

# CPU threads per step: float results depend on the thread count, so it is pinned (and part of every
# step's key) rather than derived from the core count; 1 is also the fastest for the tiny model's
# small ops. Overridden by --threads, or by an OMP_NUM_THREADS the caller set explicitly.
THREADS = 1

# ---- the settings: the paper's values, and two CPU-sized presets ---------------------------------
@dataclass(frozen=True)
class Settings:
    """Every setting that changes what a run computes, declared once: its paper value (the scripts'
    own defaults, train.py and rollout.py, not a second copy of them), and the flag that sets it
    (pipeline/settings.py). A preset replaces some values; a flag, or an experiment file naming it,
    replaces a preset's."""
    methods: str = setting("sft,replay,opr-ru,opr-sc", f"comma-separated, from {', '.join(FULL)}, "
                           f"lora-seqft, olora, ilora; each also on LoRA adapters as NAME+lora "
                           f"(methods/lora.py)")
    rho: float = setting(0.01, "replay ratio(s) in (0, 1]: b = rho * n_next; a comma list "
                               "sweeps (e.g. 0.01,0.02,0.05,0.1)",
                         comma_list(float_in(0, 1, lo_open=True), unique=True))
    lr: float = setting(train.LR, "peak learning rate", float_in(0, lo_open=True))
    warmup: float = setting(train.WARMUP, "fraction of each stage's steps with a linear lr warmup",
                            float_in(0, 1))
    lr_schedule: str = setting(train.LR_SCHEDULE, "each stage's lr decay to 0 after the warmup: "
                               "cosine (the paper's text) or linear (the official OPR code's)",
                               choices=list(train.SCHEDULES))
    global_batch: int = setting(train.GLOBAL_BATCH, "sequences per optimizer step", int_at_least(1))
    max_len: int = setting(train.MAX_LEN)
    # train.py's fixed CPU budget on every device (its GPU default follows free
    # memory: not a step key)
    micro_tokens: int = setting(train.MICRO_TOKENS)
    max_new_tokens: int = setting(rollout.MAX_NEW_TOKENS, "generation budget", int_at_least(1))
    temperature: float = setting(rollout.TEMPERATURE)
    max_train: int = setting(rollout.MAX_TRAIN, "per-task training subsample of a TRACE root "
                             "(seeded, as in TRACE); also the n of the budget rule",
                             int_at_least(1))
    eval_limit: int | None = setting(None, "evaluate at most this many test prompts per task (the "
                                     "first ones that fit the length; TRACE's test splits hold up "
                                     "to 2,000)", int_at_least(1))
    # the official tools/eval.py: 8 samples per test prompt, scores averaged
    eval_repeats: int = setting(8, "sampled responses per test prompt, averaged", int_at_least(1))
    scoring: str = setting("paper", "metric convention for evaluation and OPR-RU: lenient reads "
                           "the meant answer, paper = the official OPR code's tools/eval.py, "
                           "trace = TRACE's metrics.py", choices=["lenient", "paper", "trace"])
    replay_budget: str = setting("total", "total: b = rho * n_next split over the prior tasks (the "
                                 "equal-budget comparison of the paper's budget table); per-task: "
                                 "rho times each prior task's own training-set size (TRACE's "
                                 "past_task_ratio), for replay and the OPR methods alike",
                                 choices=["total", "per-task"])
    sft_kl_beta: float = setting(sft_kl.BETA, "sft-kl: KL weight", float_in(0))
    sdft_teacher: str = setting(sdft.TEACHER,
                                "sdft: the teacher's weights (ema: the paper's Algorithm 1)",
                                choices=["ema", "base", "student"])
    sdft_alpha: float = setting(sdft.ALPHA)
    sdft_kl: str = setting(sdft.KL)
    sdft_temperature: float = setting(sdft.TEMPERATURE)
    sdft_max_new_tokens: int = setting(sdft.MAX_NEW_TOKENS, "sdft: length cap of the student's "
                                       "responses (the paper's: the official SDFT code's)",
                                       int_at_least(1))
    ewc_lambda: float = setting(ewc.LAMBDA, "ewc: penalty weight lambda (EasyCL's default)",
                                float_in(0))
    ewc_samples: int = setting(ewc.SAMPLES,
                               "ewc: training examples per stage's Fisher (EasyCL's default)",
                               int_at_least(1))
    ewc_gamma: float = setting(ewc.GAMMA,
                               "ewc: online decay of the earlier tasks' Fisher (1: their sum)",
                               float_in(0, 1))
    lwf_alpha: float = setting(lwf.ALPHA, "lwf: weight of the distillation term (EasyCL's default)",
                               float_in(0, 1))
    lwf_temperature: float = setting(lwf.TEMPERATURE, "lwf: softmax temperature (EasyCL's default)",
                                     float_in(0, lo_open=True))
    ssr_demos: int = setting(synthesize.DEMOS,
                             "ssr: stored demonstrations per task (the official code's)",
                             int_at_least(2))
    ssr_prompts: int = setting(synthesize.PROMPTS, "ssr: in-context prompts per task (official: "
                               "every ordered pair of 20 demonstrations)", int_at_least(1))
    ssr_samples: int = setting(synthesize.SAMPLES, "ssr: completions per in-context prompt",
                               int_at_least(1))
    ssr_temperature: float = setting(synthesize.TEMPERATURE,
                                     "ssr: the base model's sampling temperature", float_in(0))
    ssr_template: str = setting(synthesize.TEMPLATE, "ssr: in-context prompt as raw text (the "
                                "official code's, for a base model) or in a chat user turn (an "
                                "instruction-tuned model)", choices=["raw", "chat"])
    ssr_clusters: int = setting(ssr.CLUSTERS, "ssr: K-means clusters per task", int_at_least(1))
    lora_rank: int = setting(lora.RANK, "LoRA methods (lora-seqft, NAME+lora): adapter rank "
                             "(TRACE's)", int_at_least(1))
    lora_alpha: float = setting(lora.ALPHA, "LoRA methods: scale alpha / rank (TRACE's)",
                                float_in(0, lo_open=True))
    lora_dropout: float = setting(lora.DROPOUT,
                                  "LoRA methods: dropout on the adapters' input (TRACE's)",
                                  float_in(0, 0.99))
    lora_targets: str = setting(lora.TARGETS,
                                "LoRA methods: modules of every block (PEFT's for Llama/Qwen)",
                                lora.lora_targets)
    lora_lr: float = setting(lora.LR, "LoRA methods: peak learning rate, in place of --lr "
                             "(TRACE's)", float_in(0, lo_open=True))
    olora_lambda1: float = setting(olora.LAMBDA1, "olora: weight of sum |A_old A_new^T| "
                                   "(O-LoRA's code)", float_in(0))
    olora_lambda2: float = setting(olora.LAMBDA2,
                                   "olora: weight of the new adapter's norms (O-LoRA's code)",
                                   float_in(0))
    ilora_lambda: float = setting(ilora.LAMBDA, "ilora: slow <- lambda * slow + (1 - lambda) * "
                                  "fast after every step (the official code's)", float_in(0, 1))
    ilora_gamma: float = setting(ilora.GAMMA, "ilora: weight of the hidden-state MSE on replay "
                                 "examples (the official code's)", float_in(0))
    # None: the task table's [5,3,7,5,3,5,5,7] (or a manifest's); a CPU preset:
    # a dict task -> epochs
    epochs: object = setting(None, "epochs per stage: one int, or a comma list per task (none: the "
                             "task table's, or a manifest's)", comma_list(int_at_least(1)))
    first_epochs: int | None = setting(None)  # epochs of stage 1 when --epochs is not given
                                              # (None: as epochs says)
    # on: a 7-8B model at 16,384 tokens per micro-batch does not fit a GPU without it
    # (plan.py's memory model)
    activation_checkpointing: bool = setting(True)
    drift_limit: int = setting(drift.LIMIT, "test prompts per prior task for drift.py's per-update "
                               "KL after every stage >= 2 (0 = no drift steps)", int_at_least(0))
    n_train: int = setting(128, "embedded benchmark only: training examples per task it generates "
                           "(with --data use --max-train)", int_at_least(1))
    n_test: int = setting(32, "embedded benchmark only: test examples per task it generates (with "
                          "--data use --eval-limit)", int_at_least(1))


PAPER = Settings()
PRESETS = {
    # tiny Llama on the embedded benchmark: 8 stages x 4 methods in minutes on 2 CPU cores
    # (256 distinct training prompts per task, updates of 4; a 128-example buffer (rho 0.5); 128
    # test prompts per task; drift on 16 test prompts per prior task). Epochs: the letter and
    # arithmetic tasks at twice the task table's (stage 1 at 24), so that each is learned on every
    # seed (a new answer format is a jump at an update count that differs per seed: at the task
    # table's epochs a seed could miss one); the generative tasks at 3, short of the
    # seed-dependent jump at which the tiny model starts copying the prompt's words. Why:
    # BENCHMARKS.md, "The default's epochs"; what it did to the seed noise: git show
    # 72fe6d4:BENCHMARKS.md, "The default's epochs"
    "tiny": replace(PAPER, rho=0.5, lr=5e-4, global_batch=4, max_len=512, micro_tokens=4096,
                    max_new_tokens=32, sdft_max_new_tokens=32, n_train=256, n_test=128,
                    first_epochs=24, eval_repeats=1,
                    epochs={"C-STANCE": 10, "FOMC": 6, "MeetingBank": 3, "Py150": 3, "ScienceQA": 6,
                            "NumGLUE-cm": 10, "NumGLUE-ds": 10, "20Minuten": 3},
                    drift_limit=16, scoring="lenient", activation_checkpointing=False,
                    # LoRA methods: TRACE's adapter at 4x the full lr (TRACE: 10x); on stage 1, 1e-3
                    # and 2e-3 learn C-STANCE, 5e-3 and more stall at chance (BENCHMARKS.md, "LoRA
                    # methods on the default")
                    lora_lr=2e-3),
    # SmolLM2-135M-Instruct on the embedded benchmark, sized for CPU (48 training and 32 test
    # prompts per task, 2 epochs of 12 updates of 4). Stage 1 trains 8 epochs: at 12-24 updates (lr
    # 5e-5-2e-4) the first letter task collapsed to one label, at 96 updates of lr 2e-4 it reached
    # 100 and FOMC then learned in 24 (BENCHMARKS.md). No drift probe by default: with SmolLM2 it
    # cost more than training (--drift-limit N turns it on)
    "smollm2": replace(PAPER, rho=0.2, lr=2e-4, global_batch=4, max_len=512, micro_tokens=4096,
                       max_new_tokens=40, sdft_max_new_tokens=40, n_train=48, n_test=32, epochs="2",
                       first_epochs=8, eval_repeats=1, drift_limit=0, scoring="lenient",
                       activation_checkpointing=False),
    "paper": PAPER,
}
# --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p.add_argument_group("settings (class Settings; default: each preset's value, or the "
                                   "one value of all three)"), Settings, PRESETS)
    add_input_flags(p.add_argument_group("the base model, the tasks and the seeds"))
    add_machine_flags(p.add_argument_group("the machine: GPUs, generation engine and workers, "
                                           "CPU threads"))
    add_run_flags(p.add_argument_group("the run directory"))
    plan.add_arguments(p)
    argv = config.expand(p, argv)
    use_manifest_from_argv(argv)  # the manifest's task names are what --tasks checks against
    args = p.parse_args(argv)
    args.settings = config.resolved(p, args)  # the experiment, as RUN_DIR/config.yaml holds it
    return args


def add_input_flags(g):
    g.add_argument("--seeds", default="0", type=comma_list(int_at_least(0), unique=True),
                   help="comma-separated seeds; results are averaged (default: 0)")
    g.add_argument("--tasks", type=task_names, help="comma-separated task order (default: all "
                                                    "tasks in TRACE order, or the manifest's)")
    g.add_argument("--base", choices=["tiny", "smollm2"], help="named base model (default: tiny)")
    g.add_argument("--model", help="base checkpoint directory (HF layout), or a model id "
                                   "(Org/Name) in the local Hugging Face cache; selects the "
                                   "paper preset")
    g.add_argument("--data", help="TRACE root <root>/<Task>/{train,eval,test}.json, or any root "
                                  "with a task manifest tasks.json (default: the embedded "
                                  "benchmark)")
    g.add_argument("--task-spec", help="task manifest file: your own ordered tasks, each with its "
                                       "directory, metric, epochs and optional max_new_tokens, "
                                       "temperature, system prompt, labels (default: "
                                       "<data>/tasks.json when present; README, 'Your own tasks')")


def add_machine_flags(g):
    g.add_argument("--gpus", type=int_at_least(0), default=0,
                   help="GPUs per node for train.py (torchrun) and vLLM; this node must see that "
                        "many CUDA devices (--dry-run excepted) (default: 0, CPU)")
    g.add_argument("--launcher", help="command prefix that starts train.py on several nodes, e.g. "
                                      "'srun -N2 torchrun --nnodes 2 --nproc_per_node 8 "
                                      "--rdzv-backend c10d --rdzv-endpoint HOST:29400' (default: "
                                      "torchrun on this node when --gpus > 1)")
    g.add_argument("--engine", default="auto", choices=["auto", "native", "vllm"], help=ENGINE_HELP)
    g.add_argument("--tp", type=int_at_least(1),
                   help="vLLM tensor-parallel size of the generating steps (rollout, evaluate, "
                        "drift): --gpus / --tp data-parallel workers of --tp GPUs each (torchrun's "
                        "ranks), each sampling its share of a step's prompts. It must divide "
                        "--gpus, and the model's attention heads and its key-value heads must "
                        f"divide by it (vLLM's rule; key-value heads may instead divide it). "
                        f"Default: the smallest of {', '.join(map(str, TP_SIZES))} that does so "
                        f"and holds the weights in {WEIGHT_SHARE:g} of a GPU's memory; 1 with the "
                        f"native engine and on the CPU")
    g.add_argument("--gen-workers", type=int_at_least(1), default=1,
                   help="CPU runs: data-parallel workers per generating step (torchrun's ranks), "
                        "each with --threads threads, so a generating step takes N x --threads "
                        "cores (the default --jobs counts them); the same tokens as one worker. On "
                        "GPUs the workers are --gpus / --tp")
    g.add_argument("--jobs", type=int_at_least(1),
                   help="steps run in parallel on CPU (default: cores // threads; always 1 with "
                        "GPUs); never changes results")
    g.add_argument("--threads", type=int_at_least(1),
                   help=f"CPU threads per step (default: $OMP_NUM_THREADS if set, else {THREADS}); "
                        f"part of every step's key, since it changes float results")
    g.add_argument("--executor", choices=["local", "ray"], default="local",
                   help="where steps run: local = processes on this machine (--jobs at once); "
                        "ray = each step a Ray task on whichever node of a Ray cluster has its "
                        "resources (on the CPU --threads x --gen-workers cores, on GPUs --gpus), "
                        "the run directory on a filesystem every node shares at the same path, "
                        "each step on one node: a training step larger than a node keeps "
                        "--launcher. Never changes results (default: %(default)s)")
    g.add_argument("--ray-address", help="--executor ray: the cluster (ray.init's address, e.g. "
                                         "HEAD:6379) (default: $RAY_ADDRESS, else one started on "
                                         "this machine by `ray start`, else a new one on this "
                                         "machine)")
    g.add_argument("--ray-retries", type=int_at_least(0), default=3,
                   help="--executor ray: fresh starts of a step whose node died (a training stage "
                        "from its last saved state) before the run stops (default: %(default)s)")
    g.add_argument("--portable", action="store_true",
                   help="run every CPU step with ATen's AVX2 kernels and MKL's reproducible branch "
                        "(kernels.CPU_PINS): the same results on every x86-64 CPU with AVX2, Intel "
                        "or AMD, at ~1.5x the wall time; without it a step's results depend on the "
                        "CPU model (part of its key)")


def add_run_flags(g):
    g.add_argument("--out", help="run directory (default: runs/<preset>); an earlier run directory "
                                 "is resumed, any other non-empty directory is refused")
    g.add_argument("--overwrite", action="store_true",
                   help="use --out even if it holds files run.py did not write")
    g.add_argument("--save-every", type=int_at_least(0), default=train.SAVE_EVERY,
                   help="optimizer steps between a training stage's resumable states: a stopped "
                        "run.py resumes a stage from its last one, bit-identically (0 = restart "
                        "the stage) (default: %(default)s)")
    g.add_argument("--keep-checkpoints", choices=list(keep.POLICIES), default="all",
                   help="which stage checkpoints stay in steps/: all; last = per method and seed "
                        "the newest stage's and any that a step still to run reads, pruned as the "
                        "run goes; final = all while the run runs, then each method and seed's "
                        "final one. A pruned checkpoint is trained again when a new step needs it "
                        "(pipeline/keep.py) (default: %(default)s)")
    g.add_argument("--wandb", action="store_true",
                   help="also log each training stage's steps to Weights & Biases, one run per "
                        "stage under RUN/wandb/ (offline with WANDB_MODE=offline, then wandb sync; "
                        "project $WANDB_PROJECT, default opr); needs pip install wandb")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--dry-run", action="store_true", help="print the plan: every step, its tokens, "
                                                          "GPU-hours per method, FSDP2 memory per "
                                                          "GPU (plan.py); run and write nothing")
    g.add_argument("--config", metavar="FILE", help="an experiment file (YAML or TOML) of these "
                                                    "flags by name; flags on the command line "
                                                    "override it. Each run writes its own to "
                                                    "RUN_DIR/config.yaml (pipeline/config.py)")


def main(argv=None):
    args = parse_args(argv)
    if hasattr(signal, "SIGUSR1"):  # kill -USR1 PID: every thread's stack to stderr, then
                                    # on (see the docstring)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    preset, cfg, methods, rhos, seeds = configure(args)
    run_dir = check_output(Path(args.out or f"runs/{preset}").resolve(), "run", args.overwrite)
    engine_name = engine_of(args)
    inputs = load_inputs(args, preset, cfg, methods, engine_name)  # built once before
                                                                   # anything runs in parallel
    pipe = make_pipeline(args, run_dir, THREADS)
    if not args.dry_run:  # the steps' engine, before any runs: a missing vLLM is one
                          # line, not a failed step
        from engine.sampling import resolve_engine
        resolve_engine(engine_name)
        if args.wandb and importlib.util.find_spec("wandb") is None:  # likewise W&B, not a
                                                                      # failed train step
            raise UserError("--wandb: needs the wandb package; pip install wandb")
    steps = Steps(pipe, cfg, inputs, args, engine_name, drift.TEMPERATURE)

    # plan every (rho, method, seed) chain, then the mechanism probes on each
    # the base on every task
    row0 = {seed: steps.evaluate(None, 0, inputs.tasks, seed) for seed in seeds}
    runs = {}  # label -> seed -> list of (train_key, eval_key)
    for rho in rhos:
        for method in methods:  # methods without a replay buffer train the same chain whatever rho
            label = METHODS[method].label(rho, len(rhos))
            if label not in runs:
                runs[label] = {seed: plan_chain(steps, method, seed, rho) for seed in seeds}
    probes = plan_probes(steps, runs)

    print(f"run.py: preset {preset}, base {inputs.base}, data {inputs.data_root}, tasks "
          f"{','.join(inputs.tasks)}, methods {','.join(runs)}, seeds {seeds}; {len(pipe.steps)} "
          f"steps ({len(pipe.committed())} already done) in {run_dir}", flush=True)
    if args.dry_run:  # the cost planner: nothing runs and nothing is written
        return plan.print_plan(pipe.steps, runs, cfg, inputs.train_sets, inputs.tok,
                               inputs.data_root, inputs.base, args, inputs.layout)
    if pipe.executor is not None:  # a step no node can hold is refused before anything runs
        done = pipe.committed()
        pipe.executor.check_fits({k: pipe.demand(s["kind"])
                                  for k, s in pipe.steps.items() if k not in done})
    pipe.lock_run_dir()  # creates the run directory: everything above is checked
    claim_dir(run_dir, "run")  # marked as run.py's (common/outputs.py)
    pipe.digests.save()
    write_text_atomic(run_dir / "config.yaml",
                      config.dump(args.settings, sys.argv[1:] if argv is None else argv))
    write_index(pipe, runs, row0, run_dir / "index.md")
    t0 = time.time()
    results, pruned = execute(pipe, args, runs, row0, probes, inputs.tasks, run_dir,
                              meta=lambda: run_meta(args, preset, cfg, rhos, inputs, pipe,
                                                    engine_name))
    print_report(results, run_dir)
    dropped_line(pipe, row0, cfg["max_len"])
    if pruned:
        print(pruned)
    write_timing(pipe, run_dir)
    print(f"run.py: done in {time.time() - t0:.0f}s; report: {run_dir / 'report.md'}")


def execute(pipe: Pipeline, args, runs: dict, row0: dict, probes: dict, tasks: list, run_dir: Path,
            meta):
    """Runs every step not done yet -> (results.json's content, written to run_dir, with meta() as
    its meta once the steps ran; what --keep-checkpoints pruned, a line for the terminal, or None
    with "all"). After each committed step: the partial results (results.json marked "partial",
    TensorBoard) and the checkpoints the policy lets go."""
    chains = [[t for t, _ in chain] for by_seed in runs.values() for chain in by_seed.values()]
    pipe.readers_first = args.keep_checkpoints == "last"  # a checkpoint's readers run
                                                          # soon, so it can go soon
    evals = Evals(pipe)  # each evaluation read once, by the partial results and the final ones
    board = tensorboard.Board(run_dir / "tb" / "results")  # rebuilt by every run:
                                                           # no event written twice
    pruned = []
    try:
        def watch(key, done):  # after each committed step: the scores so far, and the
                               # checkpoints the policy lets go
            kind = pipe.steps[key]["kind"] if key else None
            if kind in (None, "eval", "drift", "score", "buffer-nll"):
                part = collect(pipe, runs, row0, tasks, {"partial": True}, probes, done=done,
                               evals=evals)
                board.update(tensorboard.results_scalars(part))
                if kind == "eval":
                    write_partial(part, run_dir)
            pruned.extend(keep.prune(pipe, args.keep_checkpoints, chains, done))

        watch(None, pipe.committed())  # what an earlier run committed
        labels = train_labels(runs)
        pipe.execute(on_commit=watch, status=lambda keys: train_status(pipe, labels, keys))
        results = collect(pipe, runs, row0, tasks, meta(), probes, evals=evals)
        results["claims"] = claims(results)  # the paper's claims on this run (reporting/claims.py)
        write_json(run_dir / "results.json", results)
        board.update(tensorboard.results_scalars(results))
    finally:
        board.close()
    # final: the run is complete
    pruned.extend(keep.prune(pipe, args.keep_checkpoints, chains, set(pipe.steps)))
    if args.keep_checkpoints == "all":
        return results, None
    on_disk = sum(not pipe.pruned(k) for k in dict.fromkeys(k for chain in chains for k in chain))
    return results, (f"run.py: --keep-checkpoints {args.keep_checkpoints}: {len(pruned)} stage "
                     f"checkpoint(s) pruned by this run, {on_disk} on disk (manifest.json marks a "
                     f"pruned step's weights \"pruned\"; a step that needs them again trains "
                     f"them again)")


def plan_chain(steps: Steps, method: str, seed: int, rho: float) -> list:
    """One method's chain on one seed, the module docstring's stage loop: [(train_key, eval_key)]
    for stages 1..N. Stage i is trained as the method says (methods/: task i on the last checkpoint
    with the buffer built after it; mtl: the base on tasks 1..i jointly) and evaluated on tasks
    1..i+1; then the method builds the buffer for stage i+1 (replay: gold examples of tasks 1..i;
    opr-*: rollouts of the new checkpoint, scored; others: none)."""
    tasks, m = steps.inputs.tasks, METHODS[method]
    chain, prev, buffer_key = [], None, None
    for i in range(len(tasks)):
        stage = i + 1
        t_key = m.plan_train(steps, prev, stage, tasks, buffer_key, seed)
        # + task i+1, for FWT
        chain.append((t_key, steps.evaluate(t_key, stage, tasks[:i + 2], seed)))
        if stage == len(tasks):
            break
        # the next task's training-set size sets the budget of the buffer it trains with
        prev, buffer_key = t_key, m.plan_buffer(steps, t_key, stage, tasks[:stage], seed,
                                                tasks[i + 1], rho)
    return chain


def plan_probes(steps: Steps, runs: dict) -> dict:
    """The paper's mechanism, measured on every chain: the per-update KL(pi_i || pi_i-1) on the
    prior tasks' held-out prompts after every stage i >= 2 (drift.py; none when cfg's drift_limit is
    0), and each replay buffer's per-token NLL under the checkpoint that built it (score.py records
    it for OPR buffers; buffer_nll.py computes it for gold ones). Returns label -> seed -> {"drift":
    [(stage, key)], "buffers": [(stage, key)], "rollouts": [(stage, key)]}."""
    pipe, tasks = steps.pipe, steps.inputs.tasks
    probes = {}
    for label, by_seed in runs.items():
        for seed, chain in by_seed.items():
            found = probes.setdefault(label, {}).setdefault(seed,
                                                            dict(drift=[], buffers=[], rollouts=[]))
            for i in range(1, len(chain)):  # chain[i] is stage i + 1; its buffer
                                            # was built after stage i
                cur, prev = chain[i][0], chain[i - 1][0]
                if steps.cfg["drift_limit"]:
                    found["drift"].append((i + 1, steps.drift(cur, prev, i + 1, tasks[:i], seed)))
                for dep in pipe.steps[cur]["deps"]:
                    if pipe.steps[dep]["kind"] == "score":  # OPR: score.py wrote buffer_stats.json
                        found["buffers"].append((i, dep))
                        found["rollouts"].append((i, pipe.steps[dep]["deps"][0]))
                    elif pipe.steps[dep]["kind"] == "replay":
                        found["buffers"].append((i, steps.gold_nll(prev, dep, i)))
    return probes


# ---- setup: the settings, the inputs, the pipeline -----------------------------------------------
def configure(args):
    """The run's settings, checked: (preset, cfg, methods, rhos, seeds). The preset is the
    paper's with --model, else --base's (tiny by default); cfg is its settings with the flags
    given in their place."""
    preset = "paper" if args.model else (args.base or "tiny")
    cfg = asdict(apply(PRESETS[preset], args))
    methods = [m.strip() for m in str(cfg["methods"]).split(",")]
    for m in methods:
        if m not in METHODS:
            raise UserError(f"--methods: unknown method {m!r} (known: {', '.join(METHODS)})")
    if len(set(methods)) < len(methods):
        raise UserError(f"--methods: {next(m for m in methods if methods.count(m) > 1)!r} appears "
                        f"twice in {cfg['methods']!r}")
    rhos = [float(r) for r in str(cfg["rho"]).split(",")]
    if args.data and (args.n_train is not None or args.n_test is not None):
        raise UserError("--n-train/--n-test size the embedded benchmark; with --data use "
                        "--max-train (training subsample per task) and --eval-limit (test prompts "
                        "per task)")
    if not (args.data or args.task_spec):  # before the base is built: the benchmark's
                                           # templates bound its sizes
        from data.embedded import check_sizes
        check_sizes(cfg["n_train"], cfg["n_test"],
                    flags=f"--n-train {cfg['n_train']}, --n-test {cfg['n_test']}")
    seeds = [int(s) for s in args.seeds.split(",")]
    return preset, cfg, methods, rhos, seeds


# ---- after the run: results.json's meta (the run's files: reporting/collect.py) ------------------


# settings that change how a run runs, not its numbers: out of results.json, which stays
# byte-identical across them
HOW_IT_RUNS = ("out", "jobs", "quiet", "save-every", "gen-workers", "keep-checkpoints", "wandb",
               "executor", "ray-address", "ray-retries")


def run_meta(args, preset: str, cfg: dict, rhos: list, inputs: Inputs, pipe: Pipeline,
             engine_name: str) -> dict:
    """results.json's meta: the preset, base, data, settings, numerics and training-set sizes;
    the preset's seed noise when the run is the one it was measured on; a manifest's path and
    held-out test splits."""
    numerics, base = pipe.numerics, inputs.base
    meta = dict(preset=preset, base=str(base), data=str(inputs.data_root), cfg=cfg,
                numerics=numerics, train_sizes=inputs.train_sizes,
                settings={k: v for k, v in args.settings.items() if k not in HOW_IT_RUNS})
    weights = base / "model.safetensors"
    noise = preset_seed_noise(preset, PRESETS.get(preset), cfg, rhos,
                              custom=bool(args.data or args.model or args.tasks
                                          or inputs.task_spec),
                              numerics=numerics, engine=engine_name,
                              base_sha=pipe.digests.file(weights) if weights.exists() else None)
    if noise:
        meta["seed_noise"] = noise
    if inputs.task_spec:
        meta.update(task_spec=str(inputs.task_spec), held_out=inputs.held)
    return meta


def print_report(results: dict, run_dir: Path):
    """report.md (and its figures) in the run directory; the table, and a count of flagged
    evaluations, printed."""
    import report
    summary = report.summarize(results)
    unc = report.uncertainty(results, summary)
    report.write_report(results, run_dir, summary, unc)
    print(report.format_table(results, summary, unc))
    flagged = report.warning_lines(results)
    if flagged:  # each one is in report.md next to its matrix; the terminal gets a
                 # count and the first few
        print(f"run.py: {len(flagged)} evaluation(s) flagged for degenerate answers (collapsed to "
              f"one label, off-format, empty or length-capped); all in {run_dir / 'report.md'}, "
              f"the first:")
        for line in flagged[:3]:
            print(f"  {line}")


def dropped_line(pipe: Pipeline, row0: dict, max_len: int):
    """The test prompts the evaluations left out (over --max-len with their gold answer, training's
    rule), said on the terminal and not only in each evaluation step's log; row 0 evaluates every
    task, so it counts them all."""
    scores = pipe.dir(next(iter(row0.values()))) / "eval" / "scores.json"
    dropped = (json.loads(scores.read_text()).get("dropped_overlong") or {} if scores.is_file()
               else {})
    if any(dropped.values()):
        print(f"run.py: test prompts over --max-len {max_len} tokens (with their gold answer) are "
              f"left out of every evaluation: "
              f"{', '.join(f'{t} {n}' for t, n in dropped.items() if n)}")


if __name__ == "__main__":
    main_cli(main, "run.py")
