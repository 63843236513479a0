"""Watching a run while it runs: the progress bar's postfix, each running training stage's newest
loss read from its live train_log.jsonl and its step count from the step's log
("loss=0.712 (s2 opr-ru seed0 step 14/40)")."""
import json
import os
import re
from pathlib import Path

from pipeline.steps import Pipeline


def train_labels(runs: dict) -> dict:
    """{train key: "s2 opr-ru seed0"}: the stage, the method (a step shared by several: the first
    and how many more, "s1 sft+3 seed0") and the seed, for the progress bar."""
    owners = {}
    for label, by_seed in runs.items():
        for seed, chain in by_seed.items():
            for i, (t_key, _) in enumerate(chain, 1):
                owners.setdefault(t_key, (i, [], seed))[1].append(label)
    return {k: f"s{i} {names[0]}{f'+{len(names) - 1}' if len(names) > 1 else ''} seed{seed}"
            for k, (i, names, seed) in owners.items()}


def train_status(pipe: Pipeline, labels: dict, running: list) -> str | None:
    """The progress bar's postfix while training stages run: each one's newest loss,
    "loss=0.712 (s2 opr-ru seed0 step 14/40)", from its live log (None when no training stage
    has logged a step yet)."""
    parts = []
    for key in running:
        if pipe.steps[key]["kind"] == "train":
            tmp = pipe.dir(key).with_name(key + ".tmp")
            part = live_loss(tmp / "ckpt.partial" / "train_log.jsonl", tmp / "log.txt",
                             labels.get(key, key))
            if part:
                parts.append(part)
    return ", ".join(parts) or None


def live_loss(log_path: Path, stdout_path: Path, label: str, tail: int = 8192) -> str | None:
    """"loss=0.712 (LABEL step 14/40)" from the last whole record of a training stage's
    train_log.jsonl (read from its last `tail` bytes: a line cut by the writer or by the tail is
    skipped) and the stage's step count, which train.py prints at its start to the step's log
    (stdout_path; "step 14" until it has). None before the first record."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().split(b"\n")
    except OSError:  # not started yet, or between its rename and the step's end
        return None
    record = None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (isinstance(record, dict) and isinstance(record.get("loss"), (int, float))
                and "step" in record):
            break
        record = None
    if record is None:
        return None
    total = steps_total(stdout_path)
    return (f"loss={record['loss']:.4g} ({label} step {record['step']}"
            f"{f'/{total}' if total else ''})")


def steps_total(stdout_path: Path, head: int = 1 << 16) -> int | None:
    """The step count train.py prints to a step's log when it starts
    ("..., 40 steps of <= 128 sequences ..." or "resumed at step 14 of 40"), read from the log's
    first `head` bytes; None until it is there."""
    try:
        with open(stdout_path, "rb") as f:
            text = f.read(head).decode(errors="replace")
    except OSError:
        return None
    m = re.search(r", (\d+) steps of <= |resumed at step \d+ of (\d+) ", text)
    return int(m.group(1) or m.group(2)) if m else None
