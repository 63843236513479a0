"""Loader for TRACE's release layout: `<root>/<Task>/{train,eval,test}.json`.

Each file is a JSON list of {"prompt": str, "answer": str} records (JSON Lines, one record a line,
and Parquet are accepted too, and so is every record format of a task manifest: chat messages,
instruction/input/output). Training sets are subsampled to at most 5,000 records with a seeded RNG,
keeping each record's position in its file as `idx` so later stages (replay buffers, rollouts,
reports) can point back at the source record. Every problem raises ValueError naming the file, the
record number (0-based), the line for JSON Lines, and the field.
"""

import random
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import InputError
from common.jsonl import read_records
from data import manifest
from data.tasks import active_tasks, get_task

SPLITS = ("train", "eval", "test")
MAX_TRAIN = 5000  # TRACE trains on 5,000 examples per task


@dataclass(frozen=True)
class Example:
    task: str    # TRACE task name
    idx: int     # 0-based record number in the source file
    prompt: str  # full instruction as released (already holds the task instruction); a manifest's
    #              task with a system prompt or earlier turns: the message list before the answer
    answer: str  # gold response
    # a manifest task's source record
    record: dict | None = field(default=None, compare=False, repr=False)


def read_trace_file(path) -> list[tuple[str, str]]:
    """[(prompt, answer), ...] from one TRACE file (JSON list, or JSON Lines when the file does not
    start with '['), its records {"prompt", "answer"} or any other format a manifest's task reads
    (data.manifest.as_prompt_record: chat messages, whose prompt may be a message list,
    instruction/input/output, prompt/completion)."""
    records = read_records(path, required=("prompt", "answer"), types={"prompt": (str, list)},
                           nonblank=("answer",), convert=manifest.as_prompt_record)
    return [(r["prompt"], r["answer"]) for r in records]


def task_file(root, task: str, split: str) -> Path:
    """`<root>/<task>/<split>.json`, `.jsonl` or `.parquet` (two of them: an InputError naming them;
    none: the .json path, which its reader's error then names); a manifest's task: the file its
    split is read from (data.manifest.split_file)."""
    t = active_tasks().get(task)
    if t is not None and t.manifest:
        return manifest.split_file(t, split)
    return manifest.find_split(Path(root) / task, split) or Path(root) / task / f"{split}.json"


def load_task(root, task: str, split: str, *, max_train: int = MAX_TRAIN,
              seed: int = 0) -> list[Example]:
    """Examples of one task split from `<root>/<task>/<split>.json` (or `.jsonl`, `.parquet`).

    The train split is subsampled to `max_train` records (seeded, without replacement; kept in
    file order); eval and test are returned whole. `Example.idx` is always the record's
    position in the source file.
    """
    t = get_task(task)  # unknown task name -> ValueError listing the valid ones
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r} for task {task!r}; "
                         f"valid splits: {', '.join(SPLITS)}")
    if t.manifest:
        rows = manifest.read_split(t, split)
    else:
        path = task_file(root, task, split)
        rows = [(i, prompt, answer, None)
                for i, (prompt, answer) in enumerate(read_trace_file(path))]
    keep = range(len(rows))
    if split == "train" and max_train is not None and len(rows) > max_train:
        keep = sorted(random.Random(seed).sample(range(len(rows)), max_train))
    return [Example(task, *rows[i]) for i in keep]


def tasks_in(root, split: str = "train") -> list[str]:
    """Tasks (canonical TRACE order, or the manifest's) that have
    `<root>/<task>/<split>.json` (or .jsonl)."""
    return [t for t in active_tasks() if task_file(root, t, split).is_file()]


def filter_overlong(examples, length_fn, max_len: int = 2048):
    """Drop examples whose chat-templated length exceeds `max_len` tokens.

    length_fn(prompt, answer) -> int is the token count of the full templated sequence, e.g.
    `tok.sft_length`; use the same function for training, rollout and evaluation
    so all three see the same examples. Returns (kept, n_dropped).
    """
    kept = [ex for ex in examples if length_fn(ex.prompt, ex.answer) <= max_len]
    return kept, len(examples) - len(kept)


def filter_report(task: str, split: str, n_total: int, n_dropped: int, max_len: int = 2048) -> str:
    """One log line, e.g. 'FOMC/train: kept 4990/5000 (dropped 10 over 2048 tokens)'."""
    return (f"{task}/{split}: kept {n_total - n_dropped}/{n_total} "
            f"(dropped {n_dropped} over {max_len} tokens)")


def load_filtered(root, tasks, split: str, length_fn, max_len: int, *, limit=None,
                  max_train: int = MAX_TRAIN, seed: int = 0, count_all: bool = True):
    """The examples of `split` for each task that pass the over-long filter, at most `limit` per
    task (after the filter), with one report line printed per task. Shared by rollout.py and
    evaluate.py so both see exactly what training sees. Returns (examples, {task: n_dropped}); a
    task with no example left is an error. count_all=False: with a limit, examples past the limit-th
    one kept are not tokenized (the same examples; the drops are counted among those read: drift.py
    reads 16 of a task's test examples, and tokenizing is most of the rest of its step)."""
    examples, dropped = [], {}
    for task in tasks:
        exs = load_task(root, task, split, max_train=max_train, seed=seed)
        if count_all or limit is None:
            kept, dropped[task] = filter_overlong(exs, length_fn, max_len)
            print(filter_report(task, split, len(exs), dropped[task], max_len))
        else:
            kept, read = [], 0
            for ex in exs:
                if len(kept) == limit:
                    break
                read += 1
                if length_fn(ex.prompt, ex.answer) <= max_len:
                    kept.append(ex)
            dropped[task] = read - len(kept)
            print(filter_report(task, split, read, dropped[task], max_len)
                  + f", {read} of {len(exs)} read for the limit of {limit}")
        if not kept:
            raise InputError(
                f"{Path(root) / task}/{split}.json: no example fits max length {max_len}")
        examples += kept[:limit] if limit is not None else kept
    return examples, dropped

