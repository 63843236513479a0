"""plan.py — the cost planner: what a run.py command will train and generate, in
GPU-hours, before it runs.

    python run.py --model DIR --data TRACE --gpus 8 --dry-run   # that command's plan; runs nothing
    python plan.py --paper                          # the paper's grid on Qwen2.5-7B shapes
    python plan.py --paper --trace ../shared/trace  # the same, the tasks found there measured

For every step the pipeline would run (the same keys as run.py's Pipeline), from the real data:
  train    tokens = epochs x sum of the chat-templated lengths of its mixture (the task's examples
           that pass the over-long filter + the previous stage's buffer): exactly train.py's
           train_summary.json "tokens" when the buffer is known before the run (none, or gold
           replay); for an OPR buffer (model answers, unknown until the rollout) the gold answers'
           mean length stands in, and an upper bound takes every answer at max_new_tokens
  rollout  prompts = every prior task's filtered training prompts; prompt tokens; new
           tokens: an upper bound
  eval     (prompts x max_new_tokens) and an estimate (the gold answer's length, + end-of-turn)
  replay / score   CPU only: no GPU time
GPU-hours, for a throughput profile (flags below, defaults in the block underneath):
  train    tokens / train tok/s per GPU (+ a fixed start/load/save overhead per step on every GPU);
           the default train tok/s is MFU x peak / FLOPs per token, with train.py's own FLOPs count
           (6 N + 6 V H + attention at the mixture's mean document length), SDFT x 4/3 (the
           teacher's extra forward)
  generate new tokens / gen tok/s per GPU + prompt tokens / prefill tok/s per GPU, spread over the
           generating GPUs of the layout (+ the overhead per step): DP workers of TP GPUs each
           (run.py --tp; DP = GPUs / TP), every worker sampling its share of the step's prompts at
           once; the node's GPUs are held for the step's wall time
FSDP2 memory per GPU at --plan-gpus ranks, as train.py holds it: fp32 master weights, fp32 gradients
and AdamW's two fp32 moments, all sharded; the bf16 compute copies all-gathered per unit (the root
unit -- embeddings, final norm, lm_head -- for the whole step, two blocks at a time: current +
prefetch) with their bf16 gradients before the reduce-scatter; the loss kernel's fp32 [V, H]
weight-gradient accumulator and one chunk of logits; activations at --micro-tokens tokens with and
without activation checkpointing (the tensors autograd keeps per token and layer, listed in
activation_bytes_per_token_layer).
"""
import argparse
import json
import sys
from pathlib import Path

from common.errors import UserError
from common.cli import Parser, float_in, int_at_least, main_cli
from pipeline import keep
from model.costs import (GEN_TOK_S, GPU_MEMORY_GB, GPUS, MEMORY_SHARE, PEAK_TFLOPS, PREFILL_FACTOR,
                         STEP_OVERHEAD_S, TRAIN_MFU, Layout, Profile, StepCost, lora_params,
                         memory_per_gpu, micro_tokens_that_fit, needs_checkpointing, price,
                         recomputes, train_tok_s)
from pipeline.layout import generation_layout
from pipeline.paper import PAPER_GPU_HOURS, PAPER_TASKS, paper_grid, paper_tasks
from methods import OBJECTIVES


def add_arguments(p: argparse.ArgumentParser):
    """The planner's flags (run.py --dry-run and plan.py share them)."""
    g = p.add_argument_group("cost planner (--dry-run)")
    g.add_argument("--plan-train-tok-s", type=float_in(0, lo_open=True),
                   help=f"train.py tokens/s per GPU (default: {TRAIN_MFU * 100:.0f}%% MFU "
                        f"of {PEAK_TFLOPS:g} TFLOP/s over the model's FLOPs per token)")
    g.add_argument("--plan-gen-tok-s", type=float_in(0, lo_open=True), default=GEN_TOK_S,
                   help="generated tokens/s per GPU for rollouts and evaluation (default: "
                        "%(default)s)")
    g.add_argument("--plan-gpus", type=int_at_least(1),
                   help=f"GPUs to price the run on (default: run.py's --gpus, or {GPUS} for a CPU "
                        f"run's plan)")
    g.add_argument("--plan-nodes", type=int_at_least(1), default=1,
                   help="nodes of --plan-gpus GPUs to price the wall time on (run.py --executor "
                        "ray): each step holds one node, and a step starts once its inputs are "
                        "done and a node is free (default: %(default)s)")
    g.add_argument("--plan-overhead-s", type=float_in(0), default=STEP_OVERHEAD_S,
                   help="fixed seconds per GPU step: start, load, save (default: %(default)s)")
    g.add_argument("--plan-mfu", type=float_in(0, 1, lo_open=True), default=TRAIN_MFU,
                   help="training MFU (default: %(default)s)")
    g.add_argument("--plan-peak-tflops", type=float_in(0, lo_open=True), default=PEAK_TFLOPS,
                   help="peak TFLOP/s per GPU (default: %(default)s, H100 bf16 dense)")


# ------------------------------------------------------------------------------------ run.py's plan

class Lengths:
    """Chat-templated token counts, each computed once: sft(ex) is the length train.py and the
    over-long filter use; prompt(ex) the prompt with the generation header, as rollout.py and
    evaluate.py feed it."""

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
        """The conversation with an empty answer: prompt + header + end-of-turn (a response
        adds its tokens)."""
        k = prompt_key(ex.prompt)
        if k not in self._empty:
            self._empty[k] = self.tok.sft_length(ex.prompt, "")
        return self._empty[k]


def prompt_key(prompt) -> str:
    """A prompt as a dict key: a manifest's chat prompt is a list of messages (data/manifest.py)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


class StepCounts:
    """What each of run.py's steps reads and generates, counted from the data: the examples and
    token counts of a step's spec (train sets, test sets, buffers drawn or estimated), filled
    into its StepCost."""

    def __init__(self, steps: dict, cfg_run: dict, train_sets: dict, tok, data_root):
        self.steps, self.cfg, self.train_sets, self.tok, self.data_root = (
            steps, cfg_run, train_sets, tok, data_root)
        self.L, self.max_new, self.tests = Lengths(tok), cfg_run["max_new_tokens"], {}

    def test_set(self, task, limit=None):
        """The test examples that fit max_len, the first `limit` of them (evaluate.py: --eval-limit;
        drift.py: --drift-limit, which --eval-limit does not cap)."""
        from data.trace import filter_overlong, load_task
        if task not in self.tests:
            self.tests[task] = filter_overlong(load_task(self.data_root, task, "test"),
                                               self.tok.sft_length, self.cfg["max_len"])[0]
        limit = self.cfg["eval_limit"] if limit is None else limit
        return self.tests[task][:limit] if limit else self.tests[task]

    def generation(self, c: StepCost, examples, repeats=1):
        from data.tasks import get_task
        L, max_new = self.L, self.max_new
        c.prompts = repeats * len(examples)  # evaluate.py --repeats: K responses per
                                             # prompt, one generate call
        c.prompt_tokens = repeats * sum(L.prompt(e) for e in examples)
        c.new_tokens_max = repeats * sum(get_task(e.task).max_new_tokens or max_new
                                         for e in examples)  # per-task cap
        # the gold answer (+ end-of-turn) as the expected response length, capped at the budget
        c.new_tokens_est = repeats * sum(min(max_new, L.sft(e) - L.prompt(e)) for e in examples)

    def buffer_lengths(self, key) -> tuple[list[int], list[int], bool]:
        """(estimated lengths, upper-bound lengths, exact?) of the examples of the
        buffer step `key`."""
        from data.replay import gold_draw, replay_counts
        s, L, train_sets = self.steps[key], self.L, self.train_sets
        spec = s["spec"]
        if s["kind"] == "replay":  # gold replay: the draw run.py writes, so exact
            lens = [L.sft(e) for _, e in gold_draw(train_sets, spec.prior, spec.budget, spec.seed)]
            return lens, lens, True
        # score <- rollout of the prior tasks; ssr: its own (synthetic inputs, priced as the
        # tasks' own examples)
        prior = spec.prior if s["kind"] == "ssr" else self.steps[s["deps"][0]]["spec"].prior
        # one rollout per example
        counts = replay_counts(spec.budget, {t: len(train_sets[t]) for t in prior})
        est, hi = [], []
        for t in prior:
            mean = sum(L.sft(e) for e in train_sets[t]) / len(train_sets[t])
            est += [round(mean)] * counts[t]
            hi += sorted((L.sft_empty(e) + self.max_new for e in train_sets[t]),
                         reverse=True)[:counts[t]]
        return est, hi, False

    def train(self, c: StepCost, spec, deps):
        """The tokens train.py will count: its tasks' examples and the buffer it reads,
        times the epochs; sdft's student samples one response per example and epoch on the
        training ranks besides."""
        L, train_sets = self.L, self.train_sets
        task_lens = [L.sft(e) for t in spec.tasks for e in train_sets[t]]
        est, hi = list(task_lens), list(task_lens)
        for d in deps:
            if self.steps[d]["kind"] in ("replay", "score", "ssr"):
                b_est, b_hi, exact = self.buffer_lengths(d)
                est, hi, c.exact = est + b_est, hi + b_hi, c.exact and exact
        c.train_tokens, c.train_tokens_max = spec.ep * sum(est), spec.ep * sum(hi)
        c.mean_doc = sum(est) / max(len(est), 1)
        obj = OBJECTIVES[spec.extra[spec.extra.index("--objective") + 1]
                         if "--objective" in spec.extra else "sft"]
        c.extra_passes, c.extra_tokens = obj.extra_passes, obj.extra_tokens(spec.extra, c.mean_doc)
        if "--lora-rank" in spec.extra:  # a LoRA method's stage (methods/lora.py)
            c.lora_rank = int(spec.extra[spec.extra.index("--lora-rank") + 1])
            c.lora_targets = tuple(spec.extra[spec.extra.index("--lora-targets") + 1].split(","))
        c.sdft = obj.on_policy  # the student samples on the training GPUs
        if c.sdft:
            # the step's own cap
            cap = int(spec.extra[spec.extra.index("--sdft-max-new-tokens") + 1])
            exs = [e for t in spec.tasks for e in train_sets[t]]
            c.prompts = spec.ep * len(exs)
            c.prompt_tokens = spec.ep * sum(L.prompt(e) for e in exs)
            # the demo's length
            c.new_tokens_est = spec.ep * sum(min(cap, L.sft(e) - L.prompt(e)) for e in exs)
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
        elif kind == "drift":  # drift.py: sample the first `limit` test prompts of each prior
            # task, then both models teacher-force the samples and the gold answers (priced as
            # prefill in price())
            self.generation(c, [e for t in spec.prior for e in self.test_set(t, limit=spec.limit)])
        elif kind == "synth":  # synthesize.py: --samples completions of each in-context prompt of
            # two demonstrations, each at most max_new_tokens (a continuation writes several
            # Input/Output pairs), estimated as two
            exs = self.train_sets[spec.task]
            n = min(spec.prompts, spec.demos * (spec.demos - 1)) * spec.samples
            mean = sum(self.L.sft(e) for e in exs) / max(len(exs), 1)
            c.prompts, c.prompt_tokens = n, round(n * 2 * mean)
            c.new_tokens_max, c.new_tokens_est = (n * spec.max_new_tokens,
                                                  round(n * min(2 * mean, spec.max_new_tokens)))
        elif kind == "ssr":  # ssr_buffer.py: the latest checkpoint answers the
                             # budget's synthetic inputs
            from data.replay import replay_counts
            counts = replay_counts(spec.budget, {t: len(self.train_sets[t]) for t in spec.prior})
            self.generation(c, [e for t in spec.prior for e in self.train_sets[t][:counts[t]]])
        elif kind == "buffer-nll":  # buffer_nll.py: one teacher-forced forward over the gold buffer
            b_est, _, _ = self.buffer_lengths(s["deps"][1])
            c.prompts, c.prompt_tokens = len(b_est), sum(b_est)
        return c


def plan_run(steps: dict, runs: dict, cfg_run: dict, train_sets: dict, tok, data_root, model_cfg,
             profile: Profile, checkpointing: bool = False) -> list[StepCost]:
    """One StepCost per step of run.py's Pipeline (steps: key -> {kind, deps, spec: a pipeline.specs
    type}), in its order, counted (StepCounts), priced (price) and given the methods whose chains
    use it. checkpointing: the command trains with --activation-checkpointing (run.py: the preset
    says so and it runs on GPUs)."""
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
    for key, c in costs.items():  # steps outside every chain: a probe serves the methods of
                                  # all the steps it reads
        deps = steps[key]["deps"]  # (drift: this stage's and the last stage's checkpoints);
                                   # row 0 (no deps): all
        c.methods = c.methods or [m for m in runs if all(m in costs[d].methods for d in deps)]
    return list(costs.values())


def wall_on_nodes(costs: list[StepCost], nodes: int | None) -> float:
    """The command's wall hours on `nodes` nodes (None: as many as help: the step graph's
    critical path): each step holds one node for its wall_hours, and starts, in plan order, as
    soon as its inputs are done and a node is free (list scheduling, as run.py --executor ray
    starts ready steps)."""
    done_at, free, t = {}, [0.0] * (nodes or len(costs) or 1), 0.0
    todo, running = list(costs), []  # running: (end, key)
    while todo or running:
        for c in [c for c in todo if all(d in done_at for d in c.deps)]:
            i = min(range(len(free)), key=free.__getitem__)
            if free[i] > t:
                break
            free[i] = t + c.wall_hours
            running.append((free[i], c.key))
            todo.remove(c)
        if not running:
            raise ValueError(f"steps wait on steps that are not in the plan: "
                             f"{[c.key for c in todo][:3]}")
        running.sort()
        t, key = running.pop(0)
        done_at[key] = t
    return max(done_at.values(), default=0.0)


def format_nodes(costs: list[StepCost], nodes: int, gpus: int) -> str:
    one, many, path = (wall_on_nodes(costs, 1), wall_on_nodes(costs, nodes),
                       wall_on_nodes(costs, None))
    return (f"wall time on nodes of {gpus} GPUs (each step on one node, started when its inputs "
            f"are done): 1 node {one:.2f} h, {nodes} node{'s' if nodes > 1 else ''} {many:.2f} h "
            f"({one / max(many, 1e-12):.2f}x); the step graph's critical path {path:.2f} h (no "
            f"more nodes go below it)")


# --------------------------------------------------------------------------------------- the report

def gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if x >= 1e9 else f"{x / 1e6:.1f} MB"


def format_memory(model_cfg, gpus: int, micro_tokens: int) -> str:
    m = memory_per_gpu(model_cfg, gpus, micro_tokens)
    lines = [f"FSDP2 memory per GPU ({gpus} GPUs, {micro_tokens} tokens per micro-batch, bf16 "
             f"compute, fp32 master):"]
    for k, v in m.items():
        if not k.startswith("total"):
            lines.append(f"  {k:<42} {gb(v):>10}")
    for k, label in (("total", "without"), ("total_checkpointed", "with")):
        fits = "fits" if m[k] <= GPU_MEMORY_GB * 1e9 else "does NOT fit"
        lines.append(f"  total {label} activation checkpointing{'':<{11 - len(label)}} "
                     f"{gb(m[k]):>10}  ({fits} in {GPU_MEMORY_GB:g} GB)")
    return "\n".join(lines)


def format_layout(layout: Layout) -> str:
    gpus = f"{layout.tp} GPU{'s' if layout.tp > 1 else ''}"
    share = (f"{layout.dp} workers of {gpus} each, every one sampling 1/{layout.dp} of a step's "
             f"prompts at once"
             if layout.dp > 1 else f"one worker of {gpus} samples every prompt")
    return f"generation: {layout} ({layout.why}): {share}"


def format_plan(costs: list[StepCost], model_cfg, profile: Profile, micro_tokens: int, title: str,
                methods: list[str], checkpointing: bool = False) -> str:
    """The printed plan: one line per step, GPU-hours per method and in total, memory per GPU."""
    lines = [title, "",
             f"{'step':<44} {'kind':<8} {'train_tok':>11} {'train_max':>11} {'prompts':>8} "
             f"{'prompt_tok':>11} {'new_est':>10} {'new_max':>11} {'gpu_h':>7} "
             f"{'gpu_h_max':>9}  after"]
    for c in costs:
        lines.append(f"{c.key:<44} {c.kind:<8} {c.train_tokens:>11} {c.train_tokens_max:>11} "
                     f"{c.prompts:>8} {c.prompt_tokens:>11} {c.new_tokens_est:>10} "
                     f"{c.new_tokens_max:>11} {c.gpu_hours:>7.2f} {c.gpu_hours_max:>9.2f}  "
                     f"{','.join(c.deps) or '-'}")
    lines.append("")
    lines.append(f"{'GPU-hours':<28} {'train':>8} {'rollout':>8} {'eval':>8} {'probes':>8} "
                 f"{'total':>8} {'total_max':>10} {'wall_h':>8}")
    for label, subset in ([(m, [c for c in costs if m in c.methods]) for m in methods]
                          + [("ALL (each step once)", costs)]):
        by = {k: sum(c.gpu_hours for c in subset if c.kind == k) for k in ("train", "eval")}
        # the buffers' generation: OPR's rollouts, SSR's synthesis and its answers
        by["rollout"] = sum(c.gpu_hours for c in subset if c.kind in ("rollout", "synth", "ssr"))
        # run.py's mechanism probes
        probes = sum(c.gpu_hours for c in subset if c.kind in ("drift", "buffer-nll"))
        lines.append(f"{label:<28} {by['train']:>8.2f} {by['rollout']:>8.2f} {by['eval']:>8.2f} "
                     f"{probes:>8.2f} {sum(c.gpu_hours for c in subset):>8.2f} "
                     f"{sum(c.gpu_hours_max for c in subset):>10.2f} "
                     f"{sum(c.wall_hours for c in subset):>8.2f}")
    train = [c for c in costs if c.kind == "train"]
    mean_doc = (sum(c.mean_doc * c.train_tokens for c in train)
                / max(sum(c.train_tokens for c in train), 1))
    tps = train_tok_s(model_cfg, mean_doc or 512, profile)
    ac = recomputes(model_cfg, profile, checkpointing) and not profile.train_tok_s
    lines += ["", f"profile: train {tps:,.0f} tok/s per GPU"
                  f"{' before the x 4/3 of activation checkpointing' if ac else ''}"
                  + (" (given)" if profile.train_tok_s else
                     f" ({profile.mfu:.0%} MFU of {profile.peak_tflops:g} TFLOP/s, mean document "
                     f"{mean_doc:.0f} tokens)")
                  + f", generation {profile.gen_tok_s:,.0f} new tok/s per GPU, prefill "
                  f"{PREFILL_FACTOR:g}x train tok/s, {profile.overhead_s:g} s overhead per step on "
                  f"each of {profile.gpus} GPUs", format_layout(profile.layout),
              "train_tok: exact (train.py's count) except after an OPR buffer (model answers: "
              "gold-length estimate; train_max: every answer at max_new_tokens); new_max: every "
              "response at max_new_tokens; wall_h: the node's hours, one step after another; an "
              "sdft train step's prompts and new tokens: its student's samples, one per example "
              "and epoch, priced at the generation rate", "",
              format_memory(model_cfg, profile.gpus, micro_tokens)]
    return "\n".join(lines)


def parse_plan(text: str) -> dict:
    """The step table of a printed plan back as {key: {kind, train_tokens, ..., deps}}
    (tests, scripts)."""
    out = {}
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("step ")) + 1
    for line in lines[start:]:
        if not line.strip():
            break
        f = line.split()
        out[f[0]] = dict(kind=f[1], train_tokens=int(f[2]), train_tokens_max=int(f[3]),
                         prompts=int(f[4]), prompt_tokens=int(f[5]), new_tokens_est=int(f[6]),
                         new_tokens_max=int(f[7]), gpu_hours=float(f[8]), gpu_hours_max=float(f[9]),
                         deps=[] if f[10] == "-" else f[10].split(","))
    return out


def plan_layout(model_cfg, name: str, layout: Layout, plan_gpus: int | None) -> Layout:
    """The layout run.py --dry-run prices: the run's own on GPUs (which --plan-gpus may only
    repeat); a CPU run's plan prices the same steps on --plan-gpus GPUs (default GPUS) at
    vLLM's default layout."""
    if not layout.gpus:
        return generation_layout(plan_gpus or GPUS, None, model_cfg, name)
    if plan_gpus not in (None, layout.gpus):
        raise UserError(f"--plan-gpus {plan_gpus}: this run uses --gpus {layout.gpus}, and its "
                        f"plan prices those GPUs at its own layout; drop --plan-gpus (or plan a "
                        f"CPU run's command on other GPUs)")
    return layout


def print_plan(steps, runs, cfg_run, train_sets, tok, data_root, base, args, layout: Layout):
    """run.py --dry-run: plan every step of the DAG run.py built and print it. layout: the run's
    generation layout (plan_layout)."""
    from model.checkpoint import load_config
    model_cfg = load_config(base)
    profile = Profile.from_args(args, cfg_run["micro_tokens"],
                                plan_layout(model_cfg, Path(base).name, layout, args.plan_gpus))
    # as run.py passes the flag
    checkpointing = bool(cfg_run["activation_checkpointing"] and args.gpus)
    costs = plan_run(steps, runs, cfg_run, train_sets, tok, data_root, model_cfg, profile,
                     checkpointing)
    if needs_checkpointing(model_cfg, profile):
        print("plan.py: WARNING: at --micro-tokens "
              f"{profile.micro_tokens} train.py needs --activation-checkpointing to fit "
              f"{GPU_MEMORY_GB:g} GB per GPU (see the memory table); the GPU-hours assume it")
    print(format_plan(costs, model_cfg, profile, cfg_run["micro_tokens"],
                      f"plan (dry run: nothing ran, nothing was written): {len(costs)} steps, "
                      f"model {base}", list(runs), checkpointing))
    print(format_nodes(costs, args.plan_nodes, profile.gpus))
    policy = getattr(args, "keep_checkpoints", "all")
    chains = [[t for t, _ in chain] for by_seed in runs.values() for chain in by_seed.values()]
    kept = (None if policy == "all"
            else keep.simulate(policy, chains, {k: s["deps"] for k, s in steps.items()}))
    print(format_disk(costs, model_cfg, gpus=bool(args.gpus), policy=policy, kept=kept))
    extras = method_memory(runs, model_cfg, profile.gpus, cfg_run["micro_tokens"], cfg_run)
    if extras:
        print(extras)
    return costs


def method_memory(runs, model_cfg, gpus: int, micro_tokens: int = 0,
                  cfg_run: dict | None = None) -> str:
    """What each method's train steps hold per GPU besides the memory table's (methods/:
    Objective.state_bytes), and a LoRA method's own total (the table is full fine-tuning's)."""
    from methods import METHODS
    lines = []
    for label in runs:
        m = METHODS[label.split("@")[0]]
        obj = OBJECTIVES[m.objective]
        n = (lora_params(model_cfg, cfg_run["lora_rank"], cfg_run["lora_targets"].split(","))
             if m.lora else 0)
        if obj.state_bytes:
            P, what = model_cfg.num_params(embeddings=True), obj.state_what
            if m.lora:  # a teacher: the frozen base again (bf16, as train.py keeps it) and its
                # adapters; else the objective's state spans the adapters only
                size, what = ((2 * P + 4 * n, what.replace("fp32", "its base bf16"))
                              if obj.copies_model else
                              (obj.state_bytes * n, what + ", of the adapters"))
            else:
                size = obj.state_bytes * P
            lines.append(f"  {label}: +{size / gpus / 1e9:.1f} GB per GPU ({what}, sharded over "
                         f"{gpus} GPUs)")
        if m.lora and cfg_run:
            mem = memory_per_gpu(model_cfg, gpus, micro_tokens, n)
            fits = (lambda k: "fits" if mem[k] <= GPU_MEMORY_GB * 1e9  # noqa: E731
                    else "does NOT fit")
            lines.append(f"  {label}: LoRA r {cfg_run['lora_rank']} on {cfg_run['lora_targets']} "
                         f"({n / 1e6:.1f}M parameters): {mem['total'] / 1e9:.1f} GB per GPU "
                         f"without activation checkpointing ({fits('total')}), "
                         f"{mem['total_checkpointed'] / 1e9:.1f} GB with "
                         f"({fits('total_checkpointed')} in {GPU_MEMORY_GB:g} GB)")
    return "\n".join(["memory per GPU besides the table, by method:", *lines]) if lines else ""


def format_disk(costs, model_cfg, gpus: bool, policy: str = "all",
                kept: tuple | None = None) -> str:
    """The disk the run's stage checkpoints take in steps/, in train.py's compute dtype (bf16 on
    GPUs, fp32 on the CPU), under run.py --keep-checkpoints `policy`: all keeps every one (a later
    stage, a re-run and a new method read them); last and final keep kept = (most at once, left at
    the end) of them (pipeline.keep.simulate); plus a running stage's resumable state (fp32 weights
    and AdamW's two moments, 12 bytes per parameter) until it ends."""
    n = sum(c.kind == "train" for c in costs)
    params = model_cfg.num_params(embeddings=True)
    ckpt, state = params * (2 if gpus else 4), params * 12
    plus = f"plus {gb(state)} of resumable state per stage while it trains"
    if policy == "all":
        return (f"disk: {n} stage checkpoints of {gb(ckpt)} each kept in steps/ = {gb(n * ckpt)}, "
                f"{plus}")
    peak, end = kept
    while_running = (f"all {peak} while the run runs = {gb(peak * ckpt)}" if policy == "final" else
                     f"at most {peak} at once = {gb(peak * ckpt)} (one step at a time; each step "
                     f"run beside it can add one)")
    return (f"disk: {n} stage checkpoints of {gb(ckpt)} each; --keep-checkpoints {policy} keeps "
            f"{while_running}, and {end} at the end (each method and seed's final stage) = "
            f"{gb(end * ckpt)}; {plus}")


def parse_args(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--paper", action="store_true", required=True,
                   help="plan the paper's grid (one OPR model, 8 TRACE stages) on "
                        "--config's shapes")
    p.add_argument("--config",
                   default=str(Path(__file__).resolve().parent / "bench" / "configs"
                               / "qwen2.5-7b"),
                   help="model directory with an HF config.json (default: %(default)s)")
    p.add_argument("--trace", help="TRACE root: tasks found there are measured instead of assumed")
    p.add_argument("--micro-tokens", type=int_at_least(1),
                   help="tokens per micro-batch (default: train.py's rule on a GPU, the most "
                        f"that fit in {GPU_MEMORY_GB:g} GB x {MEMORY_SHARE:g} with activation "
                        f"checkpointing)")
    p.add_argument("--eval-repeats", type=int_at_least(1), default=8,
                   help="samples per test prompt (default: %(default)s, the "
                                                               "paper preset's)")
    p.add_argument("--tp", type=int_at_least(1), help="vLLM tensor-parallel size of the generating "
                                                      "steps (default: run.py's rule, see its "
                                                      "--help; the paper's rollouts ran at 4)")
    add_arguments(p)
    if not (sys.argv[1:] if argv is None else argv):
        p.error("nothing to plan: pass --paper for the paper's grid (a run.py command: add "
                "--dry-run to it)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from model.checkpoint import load_config
    cfg = load_config(args.config)
    if args.trace is not None and not any((Path(args.trace) / t / "train.json").is_file()
                                          for t in PAPER_TASKS):
        # a mistyped path must not silently plan on the assumed sizes
        raise UserError(f"--trace {args.trace}: "
                        + ("no such directory" if not Path(args.trace).is_dir() else
                           "holds none of the paper's tasks (<task>/train.json)")
                        + "; drop --trace to use the assumed sizes")
    layout = generation_layout(args.plan_gpus or GPUS, args.tp, cfg, Path(args.config).name,
                               gpus_flag="--plan-gpus")
    if args.micro_tokens is None:  # the paper's grid is planned with activation
                                   # checkpointing (format_plan below)
        args.micro_tokens = micro_tokens_that_fit(cfg, layout.gpus,
                                                  MEMORY_SHARE * GPU_MEMORY_GB * 1e9, True)
        if not args.micro_tokens:
            raise UserError(f"{args.config} does not fit {MEMORY_SHARE:g} x {GPU_MEMORY_GB:g} GB "
                            f"per GPU on {layout.gpus} GPUs (--plan-gpus)")
        print(f"plan.py: --micro-tokens {args.micro_tokens}: the most that fit {MEMORY_SHARE:g} x "
              f"{GPU_MEMORY_GB:g} GB per GPU with activation checkpointing (train.py's rule)")
    profile = Profile.from_args(args, args.micro_tokens, layout)
    table = paper_tasks(args.trace)
    print(f"{'task':<12} {'n_train':>7} {'prompt_tok':>10} {'answer_tok':>10} "
          f"{'n_test':>6}  source")
    for t, (n, pr, an, nt) in table.items():
        measured = (table[t] != PAPER_TASKS[t]
                    or (args.trace and (Path(args.trace) / t / "train.json").is_file()))
        print(f"{t:<12} {n:>7} {pr:>10} {an:>10} {nt:>6}  "
              f"{'measured (' + args.trace + ')' if measured else 'assumed'}")
    costs = paper_grid(cfg, profile, args.trace, repeats=args.eval_repeats)
    print(format_plan(costs, cfg, profile, args.micro_tokens,
                      f"\nplan of the paper's grid on {args.config}", ["opr"], checkpointing=True))
    print(format_nodes(costs, args.plan_nodes, layout.gpus))
    total = sum(c.gpu_hours for c in costs)
    print(f"\npaper: {PAPER_GPU_HOURS:g} GPU-hours for one model's 8 stages; this plan: "
          f"{total:.1f} ({total / PAPER_GPU_HOURS:.2f}x), upper bound "
          f"{sum(c.gpu_hours_max for c in costs):.1f}")
    return costs


if __name__ == "__main__":
    main_cli(main, "plan.py")
