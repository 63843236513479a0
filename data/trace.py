"""Loader for TRACE's release layout: `<root>/<Task>/{train,eval,test}.json`.

Each file is a JSON list of {"prompt": str, "answer": str} records (JSON Lines, one record a line, is accepted
too). Training sets are subsampled to at most 5,000 records with a seeded RNG, keeping each record's position
in its file as `idx` so later stages (replay buffers, rollouts, reports) can point back at the source record.
Every problem raises ValueError naming the file, the record number (0-based), the line for JSON Lines, and
the field.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from data.tasks import get_task

SPLITS = ("train", "eval", "test")
MAX_TRAIN = 5000  # TRACE trains on 5,000 examples per task


@dataclass(frozen=True)
class Example:
    task: str    # TRACE task name
    idx: int     # 0-based record number in the source file
    prompt: str  # full instruction as released (already holds the task instruction)
    answer: str  # gold response


def _locate_bad_record(text: str, path: Path) -> str:
    """json.loads failed on a list file: decode it record by record to say which record is broken."""
    dec = json.JSONDecoder()
    pos, n = 0, len(text)

    def skip_ws(p):
        while p < n and text[p] in " \t\r\n":
            p += 1
        return p

    def line_of(p):
        return text.count("\n", 0, p) + 1

    pos = skip_ws(pos)
    if pos >= n or text[pos] != "[":
        return f"{path}: malformed JSON (line {line_of(pos)}): top level is not a list"
    pos = skip_ws(pos + 1)
    rec = 0
    while True:
        if pos < n and text[pos] == "]" and rec == 0:
            return f"{path}: malformed JSON after the closing bracket (line {line_of(pos)})"
        try:
            _, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return f"{path}: malformed JSON in record {rec} (line {e.lineno}, column {e.colno}): {e.msg}"
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos, rec = skip_ws(pos + 1), rec + 1
            continue
        if pos < n and text[pos] == "]":
            return f"{path}: malformed JSON after record {rec} (line {line_of(pos)}): trailing data after the list"
        return f"{path}: malformed JSON after record {rec} (line {line_of(pos)}): expected ',' or ']'"


def _check_record(rec, path: Path, i: int, where: str) -> tuple[str, str]:
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: record {i}{where}: expected an object with 'prompt' and 'answer', "
                         f"got {type(rec).__name__}")
    out = []
    for field in ("prompt", "answer"):
        if field not in rec:
            raise ValueError(f"{path}: record {i}{where}: missing field '{field}'")
        if not isinstance(rec[field], str):
            raise ValueError(f"{path}: record {i}{where}: field '{field}' must be a string, "
                             f"got {type(rec[field]).__name__}")
        out.append(rec[field])
    return out[0], out[1]


def read_trace_file(path) -> list[tuple[str, str]]:
    """[(prompt, answer), ...] from one TRACE file (JSON list, or JSON Lines when the file does not start with '[')."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    text = path.read_text(encoding="utf-8")
    if text.startswith("\ufeff"):  # tolerate a UTF-8 byte-order mark
        text = text[1:]
    if not text.strip():
        raise ValueError(f"{path}: file is empty (expected a JSON list of {{'prompt', 'answer'}} records)")

    out = []
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(_locate_bad_record(text, path)) from None
        for i, rec in enumerate(records):
            out.append(_check_record(rec, path, i, ""))
    else:  # JSON Lines: blank lines are skipped, record numbers count records, not lines
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            i = len(out)
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: malformed JSON in record {i} (line {lineno}, column {e.colno}): "
                                 f"{e.msg}") from None
            out.append(_check_record(rec, path, i, f" (line {lineno})"))
    if not out:
        raise ValueError(f"{path}: file holds no records")
    return out


def load_task(root, task: str, split: str, *, max_train: int = MAX_TRAIN, seed: int = 0) -> list[Example]:
    """Examples of one task split from `<root>/<task>/<split>.json` (or `.jsonl`).

    The train split is subsampled to `max_train` records (seeded, without replacement; kept in file order);
    eval and test are returned whole. `Example.idx` is always the record's position in the source file.
    """
    get_task(task)  # unknown task name -> ValueError listing the valid ones
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for task {task!r}; valid splits: {', '.join(SPLITS)}")
    path = Path(root) / task / f"{split}.json"
    if not path.is_file() and (path.with_suffix(".jsonl")).is_file():
        path = path.with_suffix(".jsonl")
    records = read_trace_file(path)
    keep = range(len(records))
    if split == "train" and max_train is not None and len(records) > max_train:
        keep = sorted(random.Random(seed).sample(range(len(records)), max_train))
    return [Example(task, i, records[i][0], records[i][1]) for i in keep]


def filter_overlong(examples, length_fn, max_len: int = 2048):
    """Drop examples whose chat-templated length exceeds `max_len` tokens.

    length_fn(prompt, answer) -> int is the token count of the full templated sequence, e.g.
    `lambda p, a: len(tok.encode_sft(p, a)[0])`; use the same function for training, rollout and evaluation
    so all three see the same examples. Returns (kept, n_dropped).
    """
    kept = [ex for ex in examples if length_fn(ex.prompt, ex.answer) <= max_len]
    return kept, len(examples) - len(kept)


def filter_report(task: str, split: str, n_total: int, n_dropped: int, max_len: int = 2048) -> str:
    """One log line, e.g. 'FOMC/train: kept 4990/5000 (dropped 10 over 2048 tokens)'."""
    return f"{task}/{split}: kept {n_total - n_dropped}/{n_total} (dropped {n_dropped} over {max_len} tokens)"
