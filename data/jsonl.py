"""Reading and writing record files: JSON Lines, or a JSON list (TRACE's release format). Errors name file,
record, line and field.

Every file the pipeline writes goes through `write_jsonl` (temporary file, then rename), so a killed run never
leaves a half-written file under the final name.
"""
import json
import os
import tempfile
from pathlib import Path


def _locate_bad_record(text: str, path: Path) -> str:
    """json.loads failed on a list file: decode it record by record to say which record is broken."""
    dec = json.JSONDecoder()
    n = len(text)

    def skip_ws(p):
        while p < n and text[p] in " \t\r\n":
            p += 1
        return p

    def line_of(p):
        return text.count("\n", 0, p) + 1

    pos = skip_ws(0)
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


def read_records(path, required=("prompt",), types=None, any_of=(), locate=False) -> list:
    """Records of a JSON list file or a JSON Lines file (whichever the text is: a list starts with '[').

    Each record must be an object holding every `required` field as a string (or the type in `types`), and at
    least one of the `any_of` fields as a string when given. Every problem raises ValueError naming the file,
    the record number (0-based; blank JSONL lines are skipped), the line for JSON Lines, and the field.
    With locate=True, returns (where, record) pairs, where = "<file>: record i[ (line n)]", for later errors.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    text = path.read_text(encoding="utf-8")
    if text.startswith("\ufeff"):  # tolerate a UTF-8 byte-order mark
        text = text[1:]
    if not text.strip():
        raise ValueError(f"{path}: file is empty (expected a JSON list or JSON Lines of records)")
    located = []  # (record number, " (line n)" or "", record)
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(_locate_bad_record(text, path)) from None
        located = [(i, "", r) for i, r in enumerate(rows)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                located.append((len(located), f" (line {lineno})", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: malformed JSON in record {len(located)} (line {lineno}, column "
                                 f"{e.colno}): {e.msg}") from None
    if not located:
        raise ValueError(f"{path}: file holds no records")
    types = types or {}
    for i, where, r in located:
        if not isinstance(r, dict):
            raise ValueError(f"{path}: record {i}{where}: expected an object with "
                             f"{', '.join(map(repr, required))}, got {type(r).__name__}")
        for field in required:
            if field not in r:
                raise ValueError(f"{path}: record {i}{where}: missing field {field!r}")
            want = types.get(field, str)
            if not isinstance(r[field], want):
                name = "string" if want is str else getattr(want, "__name__", str(want))
                raise ValueError(f"{path}: record {i}{where}: field {field!r} must be a {name}, "
                                 f"got {type(r[field]).__name__}")
        if any_of and not any(isinstance(r.get(f), str) for f in any_of):
            raise ValueError(f"{path}: record {i}{where}: needs a string field {' or '.join(map(repr, any_of))}")
    if locate:
        return [(f"{path}: record {i}{where}", r) for i, where, r in located]
    return [r for _, _, r in located]


def write_text_atomic(path, text: str) -> Path:
    """Write text to path atomically (temp file in the same directory, then os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def write_jsonl(path, records) -> Path:
    """Write records as JSON Lines atomically."""
    return write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_json(path, obj) -> Path:
    """Write obj as indented JSON atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")
