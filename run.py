"""run.py — the whole continual-learning pipeline, every method, a paper-style report.

    python run.py                                         # embedded default: tiny base, 8 synthetic tasks, CPU
    python run.py --base smollm2                          # SmolLM2-135M-Instruct, budgets sized for CPU
    python run.py --model DIR --data TRACE_ROOT --gpus 8  # the paper's setting (bf16, flash-attn, liger, vLLM)

Row 0 = evaluate.py(base) on the test split of every task (once per base and seed, shared by all methods).
For each method and seed, stage i = 1..N:
    mixture_i = train split of task i  (+ the replay buffer built after stage i-1)
    ckpt_i    = train.py(ckpt_{i-1}, mixture_i)                       [torchrun when --gpus > 1]
    row i     = evaluate.py(ckpt_i) on the test split of tasks 1..i   -> accuracy matrix a(i, j)
                (and of task i+1, not yet trained on: a(i, i+1) for FWT)
    buffer    = replay: b gold examples of tasks 1..i
                opr-*:  rollout.py(ckpt_i) on the training prompts of tasks 1..i, then
                        score.py keeps the top (opr-ru: task metric, opr-sc: mean log-prob), the lowest
                        (opr-low) or a random subset (opr-random) of b
    b         = --replay-budget total (default): rho * n_{i+1} (rounded half up) split evenly over tasks 1..i,
                n_{i+1} = task i+1's training subsample size (5,000 on TRACE) BEFORE the over-long filter, as the
                official code's int(5000 * rho); per-task: rho * n_j of each prior task j (TRACE's
                past_task_ratio), each capped by what the task has
Baselines: sft (no replay), mtl (stage i trains the base on tasks 1..i jointly: the upper bound), sdft (SFT +
beta * KL to an EMA teacher).

Every step runs as a subprocess writing into a temporary directory that is renamed into runs/NAME/steps/ and
recorded in manifest.json when it succeeds. A step's key hashes everything that changes its numbers: its settings,
the keys of the steps it reads, the content of the files it reads (data files, the base checkpoint; digests cached
by size and mtime) and the numerics (CPU threads per step, torch version). Identical work (e.g. stage 1 of every
method) runs once, re-running the same command continues where it stopped (killing it anywhere loses at most the
steps in progress), and an edited data file re-runs exactly the steps that read it.

Determinism: results are a function of the command, its inputs and its seeds. Every CPU step runs with the same
pinned thread count (THREADS below, or --threads, or the caller's explicit OMP_NUM_THREADS), whatever --jobs or
the machine's core count, and the tiny base is always built single-threaded.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

import rollout
import train

from data.diagnostics import diagnose
from data.digest import Digests
from data.jsonl import read_records, write_json, write_jsonl
from data.replay import replay_budget, replay_counts, select
from data.tasks import get_task, parse_tasks
from data.trace import filter_overlong, load_task, task_file
from model.tokenizer import ChatTokenizer

HERE = Path(__file__).resolve().parent
METHODS = ("sft", "replay", "opr-ru", "opr-sc", "opr-low", "opr-random", "mtl", "sdft")
# CPU threads per step: float results depend on the thread count, so it is pinned (and part of every step's key)
# rather than derived from the core count; 1 is also the fastest for the tiny model's small ops. Overridden by
# --threads, or by an OMP_NUM_THREADS the caller set explicitly.
THREADS = 1

# ---- presets: the paper's setting and two CPU-sized ones --------------------------------------------------------
# the paper's setting is the scripts' own defaults (train.py, rollout.py), not a second copy of them
PAPER = dict(methods="sft,replay,opr-ru,opr-sc", rho=0.01, lr=train.LR, global_batch=train.GLOBAL_BATCH,
             max_len=train.MAX_LEN, micro_tokens=train.MICRO_TOKENS, max_new_tokens=rollout.MAX_NEW_TOKENS,
             temperature=rollout.TEMPERATURE, max_train=rollout.MAX_TRAIN, eval_limit=None,
             eval_repeats=8,           # the official tools/eval.py: 8 samples per test prompt, scores averaged
             scoring="paper",          # the official tools/eval.py rules (data/metrics.py); CPU presets: lenient
             replay_budget="total",    # the equal-budget comparison of the paper's budget table
             sdft_beta=0.5, epochs=None,  # epochs None: the task table's [5,3,7,5,3,5,5,7]
             n_train=128, n_test=32)      # sizes of the embedded benchmark when no --data is given
PRESETS = {
    # tiny Llama on the embedded benchmark: 8 stages x 4 methods in minutes on 2 CPU cores
    "tiny": dict(PAPER, rho=0.2, lr=5e-4, global_batch=4, max_len=512, micro_tokens=4096, max_new_tokens=40,
                 epochs="8", eval_repeats=1, scoring="lenient"),
    # SmolLM2-135M-Instruct on the embedded benchmark, sized for CPU
    "smollm2": dict(PAPER, rho=0.2, lr=5e-5, global_batch=16, max_len=512, micro_tokens=4096, max_new_tokens=40,
                    n_train=48, n_test=16, epochs="2", eval_repeats=1, scoring="lenient"),
    "paper": PAPER,
}
# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", help=f"comma-separated, from {', '.join(METHODS)} (default: sft,replay,opr-ru,opr-sc)")
    p.add_argument("--rho", help="replay ratio(s): b = rho * n_next; a comma list sweeps (e.g. 0.01,0.02,0.05,0.1)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; results are averaged (default: 0)")
    p.add_argument("--tasks", help="comma-separated task order (default: all tasks in TRACE order)")
    p.add_argument("--base", choices=["tiny", "smollm2"], help="named base model (default: tiny)")
    p.add_argument("--model", help="base checkpoint directory (HF layout); selects the paper preset")
    p.add_argument("--data", help="TRACE root <root>/<Task>/{train,eval,test}.json (default: the embedded benchmark)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per node for train.py (torchrun) and vLLM (default: 0, CPU)")
    p.add_argument("--launcher", help="command prefix that starts train.py on several nodes, e.g. "
                                      "'srun -N2 torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d "
                                      "--rdzv-endpoint HOST:29400' (default: torchrun on this node when --gpus > 1)")
    p.add_argument("--engine", default="auto", choices=["auto", "native", "vllm"], help="rollout/eval engine")
    p.add_argument("--epochs", help="epochs per stage: one int, or a comma list per task (default: task table)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: per preset; paper 1e-5)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: per preset; paper 128)")
    p.add_argument("--max-new-tokens", type=int, help="generation budget (default: per preset; paper 512)")
    p.add_argument("--n-train", type=int, help="embedded benchmark only: training examples per task it generates "
                                                "(with --data use --max-train)")
    p.add_argument("--n-test", type=int, help="embedded benchmark only: test examples per task it generates "
                                               "(with --data use --eval-limit)")
    p.add_argument("--max-train", type=int, help="per-task training subsample of a TRACE root (seeded; default "
                                                  "5000 as in TRACE); also the n of the budget rule")
    p.add_argument("--eval-limit", type=int, help="evaluate at most this many test prompts per task (the first ones "
                                                  "that fit --max-len; TRACE's test splits hold up to 2,000)")
    p.add_argument("--eval-repeats", type=int, help="sampled responses per test prompt, averaged (default: per "
                                                    "preset; paper 8, CPU presets 1)")
    p.add_argument("--scoring", choices=["lenient", "paper", "trace"],
                   help="metric convention for evaluation and OPR-RU: lenient reads the meant answer, paper = the "
                        "official OPR code's tools/eval.py, trace = TRACE's metrics.py (default: per preset; paper "
                        "preset: paper, CPU presets: lenient)")
    p.add_argument("--replay-budget", choices=["total", "per-task"],
                   help="total: b = rho * n_next split over the prior tasks (the equal-budget comparison, "
                        "default); per-task: rho times each prior task's own training-set size (TRACE's "
                        "past_task_ratio), for replay and the OPR methods alike")
    p.add_argument("--sdft-beta", type=float, help="SDFT KL weight (default 0.5)")
    p.add_argument("--jobs", type=int, help="steps run in parallel on CPU (default: cores // threads; always 1 with "
                                            "GPUs); never changes results")
    p.add_argument("--threads", type=int, help=f"CPU threads per step (default: $OMP_NUM_THREADS if set, else "
                                               f"{THREADS}); part of every step's key, since it changes float results")
    p.add_argument("--out", help="run directory (default: runs/<preset>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def stable_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


class Pipeline:
    """A DAG of subprocess steps, executed with `jobs` in parallel, each committed atomically to the manifest."""

    def __init__(self, run_dir: Path, jobs: int, env: dict, quiet: bool, numerics: dict):
        self.run_dir, self.jobs, self.env, self.quiet, self.numerics = run_dir, jobs, env, quiet, numerics
        self.steps = {}  # key -> dict(kind, name, deps, build)
        self.digests = Digests(run_dir / "digests.json")
        self.manifest_path = run_dir / "manifest.json"
        self.manifest = json.loads(self.manifest_path.read_text()) if self.manifest_path.exists() else {}
        self.lock = threading.Lock()

    def add(self, kind: str, name: str, spec: dict, deps: list[str], build, reads=()) -> str:
        """Register a step; `build(tmp_dir, dep_dirs) -> argv` writes its inputs and returns the command that
        fills tmp_dir (or None when build itself produced the output). `spec` holds every setting that changes the
        step's numbers, `deps` the steps whose outputs it reads, `reads` the other files and directories it reads
        (their content goes into the key). Returns the step key (identical inputs -> identical keys -> run once)."""
        key = f"{name}-{stable_hash([kind, spec, deps, self.numerics, self.digests.of(reads)])}"
        self.steps.setdefault(key, dict(kind=kind, deps=deps, build=build))
        return key

    def dir(self, key: str) -> Path:
        return self.run_dir / "steps" / key

    def done(self, key: str) -> bool:
        return key in self.manifest and self.dir(key).is_dir()

    def run_step(self, key: str):
        step, final = self.steps[key], self.dir(key)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # a partial output is never reused
        tmp.mkdir(parents=True)
        t0 = time.time()
        argv = step["build"](tmp, {d: self.dir(d) for d in step["deps"]})
        with open(tmp / "log.txt", "w") as log:
            rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=HERE) if argv else 0
        if rc != 0:
            tail = (tmp / "log.txt").read_text()[-3000:]
            raise RuntimeError(f"step {key} failed (exit {rc}): {' '.join(map(str, argv))}\n--- log tail ---\n{tail}")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        with self.lock:
            self.manifest[key] = {"kind": step["kind"], "seconds": round(time.time() - t0, 2)}
            write_json(self.manifest_path, self.manifest)

    def execute(self):
        todo = [k for k in self.steps if not self.done(k)]
        bar = tqdm(total=len(self.steps), initial=len(self.steps) - len(todo), desc="pipeline", unit="step",
                   disable=self.quiet)
        running = {}
        with ThreadPoolExecutor(self.jobs) as pool:
            while todo or running:
                for key in [k for k in todo if all(self.done(d) for d in self.steps[k]["deps"])]:
                    if len(running) >= self.jobs:
                        break
                    todo.remove(key)
                    running[pool.submit(self.run_step, key)] = key
                if not running:
                    raise RuntimeError(f"pipeline stuck: {todo[:3]} wait on steps that cannot run")
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    key = running.pop(fut)
                    fut.result()  # re-raises a failed step
                    bar.set_postfix_str(key[:40])
                    bar.update()
        bar.close()


def main(argv=None):
    args = parse_args(argv)
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"run.py: --threads must be >= 1, got {args.threads}")
    preset = "paper" if args.model else (args.base or "tiny")
    cfg = dict(PRESETS[preset])
    for k in ("methods", "rho", "lr", "global_batch", "max_new_tokens", "n_train", "n_test", "eval_limit", "sdft_beta",
              "epochs", "max_train", "eval_repeats", "scoring", "replay_budget"):
        if getattr(args, k, None) is not None:
            cfg[k] = getattr(args, k)
    methods = [m.strip() for m in str(cfg["methods"]).split(",")]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"run.py: unknown method {m!r} (known: {', '.join(METHODS)})")
    rhos = [float(r) for r in str(cfg["rho"]).split(",")]
    if args.data and (args.n_train is not None or args.n_test is not None):
        raise SystemExit("run.py: --n-train/--n-test size the embedded benchmark; with --data use --max-train "
                         "(training subsample per task) and --eval-limit (test prompts per task)")
    for k in ("max_train", "eval_repeats"):
        if cfg[k] is not None and cfg[k] < 1:
            raise SystemExit(f"run.py: --{k.replace('_', '-')} must be >= 1, got {cfg[k]}")
    seeds = [int(s) for s in args.seeds.split(",")]
    run_dir = Path(args.out or f"runs/{preset}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    # the base model and the data, built once before anything runs in parallel
    from data.embedded import ensure_embedded
    from model.base import ensure_base
    base = Path(args.model).resolve() if args.model else ensure_base(preset)
    data_root = Path(args.data).resolve() if args.data else ensure_embedded(
        n_train=cfg["n_train"], n_test=cfg["n_test"])
    tasks = parse_tasks(args.tasks)
    epochs = epochs_per_task(cfg["epochs"], tasks)
    # the training examples that fit max_len, as train.py and rollout.py see them: gold replay draws from these.
    # The budget rule counts the subsample BEFORE that filter (5,000 per TRACE task), as the official code does
    tok = ChatTokenizer.from_dir(base)
    subsamples = {t: load_task(data_root, t, "train", max_train=cfg["max_train"]) for t in tasks}
    train_sizes = {t: len(exs) for t, exs in subsamples.items()}
    train_sets = {t: filter_overlong(exs, tok.sft_length, cfg["max_len"])[0] for t, exs in subsamples.items()}

    gpus = args.gpus
    threads = args.threads or pinned_threads(os.environ.get("OMP_NUM_THREADS"))
    jobs = 1 if gpus else (args.jobs or max(1, (os.cpu_count() or 2) // threads))  # GPU steps share the devices
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    import torch
    # everything besides the settings that changes float results: part of every step's key and of results.json
    numerics = dict(threads=threads, torch=torch.__version__, gpus=gpus,
                    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    pipe = Pipeline(run_dir, jobs, env, args.quiet, numerics)
    base_files = [base]  # the base checkpoint: every chain starts from it, and gold replay uses its tokenizer

    def files(split, task_list):
        return [task_file(data_root, t, split) for t in task_list]
    engine = ["--engine", args.engine, "--tp", str(max(gpus, 1))]
    py = [sys.executable]
    trainer = args.launcher.split() if args.launcher else py if gpus <= 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    gen = ["--temperature", str(cfg["temperature"]), "--max-new-tokens", str(cfg["max_new_tokens"]), "--quiet"]
    common_data = ["--data", str(data_root), "--max-len", str(cfg["max_len"])]
    # what generation depends on (keys eval/rollout steps): not the method list or rho, so adding a method or a rho
    # to a run re-uses the evaluations and rollouts of the checkpoints it shares
    gen_spec = dict(engine=engine, **{k: cfg[k] for k in (
        "temperature", "max_new_tokens", "max_len", "max_train", "eval_limit")})

    def train_step(prev, stage, task_list, buffer_key, seed, extra=(), n_epochs=None):
        name = f"s{stage}-train-{task_list[-1] if len(task_list) == 1 else 'joint'}"
        spec = dict(tasks=task_list, seed=seed, lr=cfg["lr"], gb=cfg["global_batch"], extra=list(extra),
                    ep=n_epochs or epochs[task_list[-1]], max_len=cfg["max_len"], mt=cfg["micro_tokens"],
                    max_train=cfg["max_train"])

        def build(tmp, dirs):
            records = [{"prompt": e.prompt, "response": e.answer, "task": e.task, "idx": e.idx}
                       for t in task_list for e in train_sets[t]]
            if buffer_key:
                records += read_records(dirs[buffer_key] / "buffer.jsonl", required=("prompt", "response"))
            write_jsonl(tmp / "mixture.jsonl", records)
            model = dirs[prev] / "ckpt" if prev else base
            return trainer + [str(HERE / "train.py"), "--model", str(model), "--data", str(tmp / "mixture.jsonl"),
                              "--out", str(tmp / "ckpt"), "--epochs", str(spec["ep"]), "--lr", str(cfg["lr"]),
                              "--global-batch", str(cfg["global_batch"]), "--max-len", str(cfg["max_len"]),
                              "--micro-tokens", str(cfg["micro_tokens"]), "--seed", str(seed), "--save-every", "0",
                              "--quiet", *extra]
        return pipe.add("train", name, spec, [d for d in (prev, buffer_key) if d], build,
                        reads=files("train", task_list) + ([] if prev else base_files))

    def eval_step(train_key, stage, task_list, seed):
        """Row `stage` of the matrix: the checkpoint of `train_key` (None: the base model, row 0) on `task_list`."""
        def build(tmp, dirs):
            limit = ["--limit", str(cfg["eval_limit"])] if cfg["eval_limit"] else []
            ckpt = dirs[train_key] / "ckpt" if train_key else base
            return py + [str(HERE / "evaluate.py"), "--ckpt", str(ckpt), *common_data,
                         "--tasks", ",".join(task_list), "--out", str(tmp / "eval"), "--seed", str(seed),
                         "--repeats", str(cfg["eval_repeats"]), "--scoring", cfg["scoring"], *gen, *engine, *limit]
        spec = dict(tasks=task_list, seed=seed, gen=gen_spec, repeats=cfg["eval_repeats"], scoring=cfg["scoring"])
        return pipe.add("eval", f"s{stage}-eval", spec, [train_key] if train_key else [], build,
                        reads=files("test", task_list) + ([] if train_key else base_files))

    def budget_args(prior, next_task, rho):
        """(score.py flags, the budget) of the replay buffer built after the stage that trained prior[-1]."""
        budget = replay_budget(cfg["replay_budget"], rho, prior, train_sizes, next_task)
        if "per_task" in budget:
            return ["--task-budgets", ",".join(f"{t}={k}" for t, k in budget["per_task"].items())], budget
        return ["--budget", str(budget["total"])], budget

    def opr_buffer(train_key, stage, prior, scorer, mode, seed, next_task, rho):
        def build_rollout(tmp, dirs):
            return py + [str(HERE / "rollout.py"), "--ckpt", str(dirs[train_key] / "ckpt"), *common_data,
                         "--tasks", ",".join(prior), "--out", str(tmp / "rollouts.jsonl"), "--seed", str(seed),
                         "--max-train", str(cfg["max_train"]), *gen, *engine]
        r_key = pipe.add("rollout", f"s{stage}-rollout", dict(prior=prior, seed=seed, gen=gen_spec), [train_key],
                         build_rollout, reads=files("train", prior))

        flags, budget = budget_args(prior, next_task, rho)
        scoring = ["--scoring", cfg["scoring"]]  # ru's metric (sc: only the RU-SC correlation in the stats)

        def build_score(tmp, dirs):
            return py + [str(HERE / "score.py"), "--rollouts", str(dirs[r_key] / "rollouts.jsonl"), "--data",
                         str(data_root), "--scorer", scorer, "--select", mode, *flags, *scoring,
                         "--tasks", ",".join(prior), "--seed", str(seed), "--out", str(tmp / "buffer.jsonl")]
        return pipe.add("score", f"s{stage}-{scorer}-{mode}", dict(scorer=scorer, mode=mode, budget=budget,
                                                                  seed=seed, scoring=cfg["scoring"]), [r_key],
                        build_score, reads=files("train", prior))

    def gold_buffer(stage, prior, seed, next_task, rho):
        _, budget = budget_args(prior, next_task, rho)

        def build(tmp, dirs):
            counts = replay_counts(budget, {t: len(train_sets[t]) for t in prior})
            picked = [{"prompt": e.prompt, "response": e.answer, "task": t, "idx": e.idx, "source": "gold"}
                      for t in prior for e in select(train_sets[t], [0.0] * len(train_sets[t]), counts[t],
                                                     "random", f"{seed}:{stage}:{t}")]
            write_jsonl(tmp / "buffer.jsonl", picked)
            return None
        spec = dict(prior=prior, seed=seed, budget=budget, max_len=cfg["max_len"], max_train=cfg["max_train"])
        return pipe.add("replay", f"s{stage}-gold", spec, [], build, reads=files("train", prior) + base_files)

    # plan every (rho, method, seed) chain
    runs = {}  # label -> seed -> list of (train_key, eval_key)
    row0 = {seed: eval_step(None, 0, tasks, seed) for seed in seeds}  # the base on every task, shared by all methods
    for rho in rhos:
        for method in methods:
            label = method if len(rhos) == 1 or method in ("sft", "mtl", "sdft") else f"{method}@{rho:g}"
            if label in runs:
                continue
            runs[label] = {}
            for seed in seeds:
                chain = []
                if method == "mtl":  # row i: the base trained jointly on tasks 1..i (the upper bound so far)
                    for i in range(len(tasks)):
                        seen = tasks[:i + 1]
                        n_ep = round(sum(epochs[t] for t in seen) / len(seen))
                        t_key = train_step(None, i + 1, seen, None, seed, n_epochs=n_ep)
                        chain.append((t_key, eval_step(t_key, i + 1, tasks[:i + 2], seed)))
                    runs[label][seed] = chain
                    continue
                extra = ["--sdft-beta", str(cfg["sdft_beta"])] if method == "sdft" else []
                prev, buffer_key = None, None
                for i, task in enumerate(tasks):
                    t_key = train_step(prev, i + 1, [task], buffer_key, seed, extra)
                    chain.append((t_key, eval_step(t_key, i + 1, tasks[:i + 2], seed)))  # + task i+1, for FWT
                    prev, buffer_key = t_key, None
                    if i + 1 < len(tasks):
                        next_task, prior = tasks[i + 1], tasks[:i + 1]
                        if method == "replay":
                            buffer_key = gold_buffer(i + 1, prior, seed, next_task, rho)
                        elif method.startswith("opr-"):
                            scorer, mode = {"opr-ru": ("ru", "top"), "opr-sc": ("sc", "top"),
                                            "opr-low": ("ru", "low"), "opr-random": ("ru", "random")}[method]
                            buffer_key = opr_buffer(t_key, i + 1, prior, scorer, mode, seed, next_task, rho)
                runs[label][seed] = chain

    print(f"run.py: preset {preset}, base {base}, data {data_root}, tasks {','.join(tasks)}, methods "
          f"{','.join(runs)}, seeds {seeds}; {len(pipe.steps)} steps ({sum(pipe.done(k) for k in pipe.steps)} "
          f"already done) in {run_dir}", flush=True)
    pipe.digests.save()
    t0 = time.time()
    pipe.execute()

    results = collect(pipe, runs, row0, tasks, dict(preset=preset, base=str(base), data=str(data_root), cfg=cfg,
                                                    numerics=numerics, train_sizes=train_sizes))
    write_json(run_dir / "results.json", results)
    import report
    summary = report.summarize(results)
    unc = report.uncertainty(results, summary)
    report.write_report(results, run_dir, summary, unc)
    print(report.format_table(results, summary, unc))
    for line in report.warning_lines(results):
        print(line)
    print(f"run.py: done in {time.time() - t0:.0f}s; report: {run_dir / 'report.md'}")


def pinned_threads(omp_env) -> int:
    """THREADS, or the caller's explicit OMP_NUM_THREADS."""
    if not omp_env:
        return THREADS
    if not omp_env.strip().isdigit() or int(omp_env) < 1:
        raise SystemExit(f"run.py: OMP_NUM_THREADS={omp_env!r} is not a positive integer; unset it or pass --threads N")
    return int(omp_env)


def epochs_per_task(spec, tasks) -> dict:
    if spec is None:
        return {t: get_task(t).epochs for t in tasks}
    values = [int(e) for e in str(spec).split(",")]
    if len(values) == 1:
        return {t: values[0] for t in tasks}
    if len(values) != len(tasks):
        raise SystemExit(f"run.py: --epochs has {len(values)} values for {len(tasks)} tasks")
    return dict(zip(tasks, values))


def collect(pipe: Pipeline, runs: dict, row0: dict, tasks: list, meta: dict) -> dict:
    """results.json (its schema: report.py's docstring): per method and seed, the accuracy matrix (row i: tasks 1..i
    after stage i), row 0 (the base on every task), next_task (a(i, i+1): task i+1 after stage i, before training on
    it), the continual-learning metrics of data.metrics.cl_metrics, the per-step training loss of every stage, and
    from each evaluation's predictions.jsonl, for the cells of the matrix, the per-example scores (averaged over eval
    repeats, in test_idx order: the test-set bootstrap) and the degenerate-answer diagnostics (data.diagnostics).
    Every evaluation must have scored the same test examples of a task."""
    from data.metrics import cl_metrics
    evals, test_idx = {}, {}

    def eval_of(key):  # eval steps are shared between methods: read each once
        if key not in evals:
            evals[key] = read_eval(pipe.dir(key) / "eval", test_idx)
        return evals[key]

    methods = {}
    for label, by_seed in runs.items():
        methods[label] = {"seeds": {}}
        for seed, chain in by_seed.items():
            matrix, next_task, losses, examples, diagnostics = [], [], [], [], []
            for i, (t_key, e_key) in enumerate(chain):
                scores, per_example, diag = eval_of(e_key)
                matrix.append([scores[t] for t in tasks[:i + 1]])
                examples.append([per_example[t] for t in tasks[:i + 1]])
                diagnostics.append({t: diag[t] for t in tasks[:i + 1]})
                if i + 1 < len(tasks):
                    next_task.append(scores[tasks[i + 1]])
                log = pipe.dir(t_key) / "ckpt" / "train_log.jsonl"
                losses.append([json.loads(line)["loss"] for line in log.read_text().splitlines()])
            base_row = [eval_of(row0[seed])[0][t] for t in tasks]
            methods[label]["seeds"][str(seed)] = {"matrix": matrix, "row0": base_row, "next_task": next_task,
                                                  "cl_metrics": cl_metrics(matrix, base_row, next_task),
                                                  "loss_curves": losses, "example_scores": examples,
                                                  "diagnostics": diagnostics}
    return {"tasks": tasks, "methods": methods, "test_idx": {t: test_idx[t] for t in tasks if t in test_idx},
            "meta": meta}


def read_eval(eval_dir: Path, test_idx: dict):
    """(scores, per_example, diagnostics) of one evaluate.py output: scores.json's per-task means; per task the
    per-example scores averaged over repeats, ordered by idx (rounded to 1e-4); data.diagnostics.diagnose per task.
    test_idx ({task: [idx]}) is filled by the first evaluation and checked against by the others."""
    scores = json.loads((eval_dir / "scores.json").read_text())["scores"]
    by_task = {}
    for r in read_records(eval_dir / "predictions.jsonl", required=("task", "prediction", "gold", "finish_reason")):
        by_task.setdefault(r["task"], []).append(r)
    per_example, diagnostics = {}, {}
    for t in scores:
        by_idx = {}
        for r in by_task.get(t, []):
            by_idx.setdefault(r["idx"], []).append(r["score"])
        idx = sorted(by_idx)
        if test_idx.setdefault(t, idx) != idx:
            raise SystemExit(f"run.py: {eval_dir / 'predictions.jsonl'}: task {t} was evaluated on other test "
                             f"examples than another evaluation of this run ({len(idx)} vs {len(test_idx[t])})")
        per_example[t] = [round(sum(v) / len(v), 4) for v in (by_idx[i] for i in idx)]
        diagnostics[t] = diagnose(t, by_task[t])
    return scores, per_example, diagnostics


if __name__ == "__main__":
    main()
