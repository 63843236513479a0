"""Reading and writing record files: JSONL, or a JSON list (TRACE's release format). Errors name file and line.

Every file the pipeline writes goes through `write_jsonl` (temporary file, then rename), so a killed run never
leaves a half-written file under the final name.
"""
import json
import os
import tempfile
from pathlib import Path


def read_records(path, required=("prompt",), types=None, any_of=()) -> list[dict]:
    """Records of a JSONL file or a JSON list. Each must be an object holding every `required` field as a string
    (or the type given in `types`), and at least one of the `any_of` fields (as a string) when given.
    Raises ValueError naming the file, line (JSONL) or record (JSON list), and field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"{path}: file is empty")
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        located = [(f"record {i}", r) for i, r in enumerate(rows)]
    else:
        located = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                located.append((f"line {n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not located:
        raise ValueError(f"{path}: no records")
    types = types or {}
    for where, r in located:
        if not isinstance(r, dict):
            raise ValueError(f"{path}: {where}: expected a JSON object, got {type(r).__name__}")
        for field in required:
            if field not in r:
                raise ValueError(f"{path}: {where}: missing field {field!r}")
            want = types.get(field, str)
            if not isinstance(r[field], want):
                raise ValueError(f"{path}: {where}: field {field!r} must be {getattr(want, '__name__', want)}, "
                                 f"got {type(r[field]).__name__}")
        if any_of and not any(isinstance(r.get(f), str) for f in any_of):
            raise ValueError(f"{path}: {where}: needs a string field {' or '.join(map(repr, any_of))}")
    return [r for _, r in located]


def write_jsonl(path, records) -> Path:
    """Write records as JSONL atomically (temp file in the same directory, then os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
