"""run.py's inputs: the base model and the data every step reads, loaded once before anything runs
in parallel and checked up front (a missing split, an example that cannot fit, a GPU count this node
lacks: one line, before any step)."""
import os
from dataclasses import dataclass
from pathlib import Path

from common.errors import InputError, UserError
from data.manifest import check_scorer, held_out, manifest_path
from data.tasks import get_task, parse_tasks
from data.trace import filter_overlong, load_task
from model.tokenizer import ChatTokenizer
from model.costs import CHARS_PER_TOKEN, TEMPLATE_PROMPT, EstimatedTokenizer, Layout
from pipeline.layout import generation_layout


@dataclass
class Inputs:
    """The base model and the data every step reads, loaded and checked by load_inputs."""
    base: Path                # the base checkpoint directory
    data_root: Path
    task_spec: Path | None    # the task manifest, if any (data/manifest.py)
    tasks: list               # the task order
    epochs: dict              # task -> epochs of its stage
    held: dict                # task -> how its test split was held out of its train records
                              # (a manifest's)
    tok: ChatTokenizer        # the base's
                              # (a dry run of a directory without one: EstimatedTokenizer)
    train_sizes: dict         # task -> training subsample size before the over-long filter
                              # (the budget rule's n)
    train_sets: dict          # task -> the training examples that fit max_len
    layout: Layout            # how the generating steps use the GPUs
                              # (pipeline.layout.generation_layout)


def load_inputs(args, preset: str, cfg: dict, methods: list, engine: str) -> Inputs:
    """The base model and the data (the embedded ones built if need be), with everything a step will
    read checked up front."""
    from data.embedded import ensure_embedded
    from model.base import ensure_base
    from model.checkpoint import load_config
    from model.hub import resolve_model
    # before a base
    layout = None if args.gpus else generation_layout(0, args.tp, cpu_workers=args.gen_workers)
    # a directory, or a model id found in the local Hugging Face cache
    base = resolve_model(args.model).resolve() if args.model else ensure_base(preset)
    if layout is None:  # on GPUs the model's heads and size decide it
        layout = generation_layout(args.gpus, args.tp, load_config(base), base.name, engine,
                                   cpu_workers=args.gen_workers)
        check_gpus(args.gpus, args.dry_run)
    if args.data or args.task_spec:
        data_root = Path(args.data or Path(args.task_spec).parent).resolve()
    else:
        data_root = ensure_embedded(n_train=cfg["n_train"], n_test=cfg["n_test"])
    task_spec = manifest_path(data_root, args.task_spec)  # loaded and made active
                                                          # by parse_args already
    tasks = parse_tasks(args.tasks)
    # a manifest's epochs are the user's: a preset's per-task epochs are TRACE's
    epochs = epochs_per_task(None if task_spec and args.epochs is None else cfg["epochs"], tasks)
    # the CPU presets: see their comments
    if cfg["first_epochs"] and args.epochs is None and not task_spec:
        epochs[tasks[0]] = cfg["first_epochs"]
    held = {t: info for t in tasks if task_spec and (info := held_out(get_task(t)))}
    for t, info in held.items():
        print(f"run.py: {t} has no test split: {info['n_test']} of its train records held out as "
              f"its test split (seed {info['seed']}); recorded in results.json", flush=True)
    # the training examples that fit max_len, as train.py and rollout.py see them: gold replay draws
    # from these. The budget rule counts the subsample BEFORE that filter (5,000 per TRACE task), as
    # the official code does
    tok = base_tokenizer(base, args.dry_run)
    subsamples = {t: load_task(data_root, t, "train", max_train=cfg["max_train"]) for t in tasks}
    train_sizes = {t: len(exs) for t, exs in subsamples.items()}
    train_sets = {t: filter_overlong(exs, tok.sft_length, cfg["max_len"])[0]
                  for t, exs in subsamples.items()}
    # before any step runs
    check_inputs(base, data_root, tasks, train_sets, tok, cfg["max_len"], args.dry_run)
    for t in tasks:
        check_scorer(get_task(t), train_sets[t][0])
    from methods import METHODS, OBJECTIVES
    on_policy = [m for m in methods if OBJECTIVES[METHODS[m].objective].on_policy]
    if on_policy and any(not isinstance(e.prompt, str) for t in tasks for e in train_sets[t]):
        raise UserError(f"{task_spec or data_root}: {on_policy[0]} puts a prompt into its "
                        f"teacher's user turn: it needs single-turn prompts, without a system "
                        f"prompt or earlier turns")
    return Inputs(base, data_root, task_spec, tasks, epochs, held, tok, train_sizes,
                  train_sets, layout)


def check_gpus(gpus: int, dry_run: bool):
    """--gpus N needs N CUDA devices here: without them torchrun would start N CPU ranks without a
    word. A dry run prices the GPUs without having them. (Several CPU ranks, as the tests use them:
    torchrun train.py directly.)"""
    import torch
    visible = torch.cuda.device_count()  # 0 without CUDA, or with CUDA_VISIBLE_DEVICES=""
    if not dry_run and visible < gpus:
        raise UserError(f"--gpus {gpus}: needs {gpus} CUDA devices, {visible} visible "
                        f"(CUDA_VISIBLE_DEVICES="
                        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                        f"use --gpus {visible} or run on a node with {gpus} GPUs "
                        f"(--dry-run prices them without)")


def base_tokenizer(base: Path, dry_run: bool):
    """The base's tokenizer. A dry run prices a model directory without one (config.json is enough)
    with model.costs.EstimatedTokenizer's counts, and says so."""
    if dry_run and not (base / "tokenizer.json").exists():
        print(f"run.py: {base} holds no tokenizer.json: the plan counts tokens at "
              f"{CHARS_PER_TOKEN:g} characters per token plus {TEMPLATE_PROMPT} of chat template "
              f"(model.costs.EstimatedTokenizer); a real run needs the tokenizer", flush=True)
        return EstimatedTokenizer()
    return ChatTokenizer.from_dir(base)


def check_inputs(base: Path, data_root: Path, tasks, train_sets: dict, tok, max_len: int,
                 dry_run: bool = False):
    """Everything a step will read, checked up front so no step fails late on a missing or broken
    input: the base checkpoint's config and weights (the tokenizer was loaded already), each task's
    train split (loaded already) and test split, each with at least one example within max_len. A
    dry run needs no weights: a directory that holds none (config.json alone) is priced all the
    same, and said so."""
    from model.checkpoint import load_config, weight_files
    load_config(base)
    if dry_run and not any((base / f).exists()
                           for f in ("model.safetensors", "model.safetensors.index.json")):
        print(f"run.py: {base} holds no weights: planned all the same; a real run needs them",
              flush=True)
    else:
        weight_files(base)
    for t in tasks:
        if not train_sets[t]:
            raise InputError(f"{data_root / t}/train.json: no example fits --max-len {max_len}")
        if not filter_overlong(load_task(data_root, t, "test"), tok.sft_length, max_len)[0]:
            raise InputError(f"{data_root / t}/test.json: no example fits --max-len {max_len}")


def epochs_per_task(spec, tasks) -> dict:
    """Epochs of each task's stage: spec None is the task table's (a manifest's task without
    epochs: an InputError, as --epochs was not given); a dict {task: epochs} (a preset's) names
    them, the task table filling in the rest; else --epochs' comma list: one value for all, or one
    per task in order."""
    if spec is None or isinstance(spec, dict):
        epochs = {t: (spec or {}).get(t, get_task(t).epochs) for t in tasks}
        for t in (t for t, e in epochs.items() if e is None):  # a manifest's task without
                                                               # epochs, and no --epochs
            raise InputError(f"{get_task(t).manifest}: task {t!r}, field 'epochs': missing, and no "
                             f"--epochs to fall back on; give the task its epochs or pass "
                             f"run.py --epochs N")
        return epochs
    values = [int(e) for e in str(spec).split(",")]
    if len(values) == 1:
        return {t: values[0] for t in tasks}
    if len(values) != len(tasks):
        raise UserError(f"--epochs has {len(values)} values for {len(tasks)} tasks "
                        f"(give one, or one per task)")
    return dict(zip(tasks, values))
