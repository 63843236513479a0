"""Reading record files: JSON Lines, or a JSON list (TRACE's release format), strictly (no NaN, no
infinity); errors name file, record, line and field. dumps_strict is the writing side's serializer
(common/outputs.py writes).
"""
import contextlib
import json
import math
from pathlib import Path

from common.errors import InputError


class NonFiniteError(ValueError):
    """A number in JSON input that is not a finite number (loads_strict)."""


def _refuse_constant(name: str):
    raise NonFiniteError(f"{name} is not a number (JSON has no NaN or infinity); "
                         f"write a finite number")


def _finite_float(s: str) -> float:
    v = float(s)
    if math.isinf(v):
        raise NonFiniteError(f"{s} is too large a number (it reads as infinity); "
                             f"write a finite number")
    return v


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:  # Python converts at most sys.get_int_max_str_digits() digits
        raise NonFiniteError(f"an integer of {len(s)} digits is too large; "
                             f"write a smaller number") from None


class DuplicateKeyError(ValueError):
    """A JSON object that names a key twice (loads_strict)."""


def _unique_keys(pairs: list) -> dict:
    """An object's members, refusing a key given twice (Python's reader keeps the last
    one without a word)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"key {k!r} appears twice in one object; keep one")
        out[k] = v
    return out


# Python's JSON reader takes NaN, Infinity and -Infinity (and 1e999 as an infinity), none of
# which is JSON; a NaN passes every range check written as `x < lo`, so input must refuse them
# where it is parsed; and it keeps the last of two equal keys, so a record or a manifest could
# say two things and mean one
STRICT = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float,
                          parse_int=_int, object_pairs_hook=_unique_keys)


def loads_strict(text: str, where) -> object:
    """json.loads for input files: a NaN, an infinity or an overlong integer is an InputError naming
    `where` (the file, or the file's record and line) and the constant. Malformed JSON still raises
    json.JSONDecodeError, for the caller to word."""
    try:
        return STRICT.decode(text)
    except NonFiniteError as e:
        field = _non_finite_field(text)
        raise InputError(f"{where}: {f'field {field!r}: ' if field else ''}{e}") from None
    except DuplicateKeyError as e:
        raise InputError(f"{where}: {e}") from None


def _non_finite_field(text: str) -> str | None:
    """The path ('a.b[2]') of the first NaN or infinity in JSON text, read leniently, for the error
    line (None when there is none to find, e.g. an overlong integer)."""
    def find(x, path):
        if isinstance(x, float) and not math.isfinite(x):
            return path
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            hit = find(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
            if hit is not None:
                return hit
        return None
    try:
        found = find(json.loads(text), "")
    except ValueError:
        return None
    return found.lstrip(".") if found else None  # "": the document itself is the NaN


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines text: split at '\\n' only (a '\\r' before it dropped).
    str.splitlines() also splits at U+2028, U+2029, U+0085 (which JSON allows raw inside a string),
    \\x0b, \\x0c and \\x1c-\\x1e, cutting a record that holds one in two."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _locate_bad_record(text: str, path: Path) -> str:
    """Strict decoding failed on a list file: decode it record by record to say which
    record is broken."""
    dec = STRICT
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
            return (f"{path}: malformed JSON in record {rec} "
                    f"(line {e.lineno}, column {e.colno}): {e.msg}")
        except NonFiniteError as e:
            field = (_non_finite_field(text) or "").removeprefix(f"[{rec}]").lstrip(".")
            return (f"{path}: record {rec} (line {line_of(pos)}): "
                    f"{f'field {field!r}: ' if field else ''}{e}")
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos, rec = skip_ws(pos + 1), rec + 1
            continue
        if pos < n and text[pos] == "]":
            return (f"{path}: malformed JSON after record {rec} (line {line_of(pos)}): "
                    f"trailing data after the list")
        return (f"{path}: malformed JSON after record {rec} (line {line_of(pos)}): "
                f"expected ',' or ']'")


def _single_object(text: str) -> bool:
    try:
        return isinstance(STRICT.decode(text), dict)
    except ValueError:  # malformed or non-finite: the line-by-line reading names the record
        return False


def read_text(path) -> str:
    """A UTF-8 text file's contents (a leading byte-order mark dropped); non-UTF-8 bytes raise
    InputError naming the file and the byte offset."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                         f"convert the file to UTF-8") from None
    return text[1:] if text.startswith("\ufeff") else text


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def what_it_is(path: Path) -> str:
    """Why `path` is no regular file to read, in words: missing, a directory, a named pipe (a
    FIFO, or a shell's process substitution: read once, so it cannot be read as a data file), a
    socket or a device."""
    import stat as st
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "file not found"
    for test, kind in ((st.S_ISDIR, "a directory"),
                       (st.S_ISFIFO, "a named pipe (FIFO or process substitution)"),
                       (st.S_ISSOCK, "a socket"), (st.S_ISCHR, "a character device"),
                       (st.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {kind}, not a regular file: give the data as a file"
    return "not a regular file"


def read_records(path, required=("prompt",), types=None, any_of=(), locate=False, nonblank=(),
                 convert=None) -> list:
    """Records of a JSON list file or a JSON Lines file (whichever the text is: a list starts with
    '['), or of a Parquet file (.parquet, with pyarrow).

    Each record must be an object holding every `required` field as a string (or the type, or tuple
    of types, in `types`), and at least one of the `any_of` fields as a string when given; a
    `nonblank` field, when a string, must hold more than whitespace (a gold answer: an empty one
    trains nothing and scores as whatever an empty prediction scores). Every problem raises
    ValueError naming the file, the record number (0-based; blank JSONL lines are skipped), the line
    for JSON Lines, and the field.
    With locate=True, returns (where, record) pairs, where = "<file>: record i[ (line n)]", for
    later errors. convert(where, record) -> record, when given, is applied to each record before
    the checks (e.g. data.manifest.as_prompt_record: chat and instruction records as
    prompt/answer ones).
    """
    path = Path(path)
    if not path.is_file():
        with contextlib.suppress(FileNotFoundError):
            path.stat()  # a symlink loop or a denied directory raises its own error naming the path
        raise InputError(f"{path}: {what_it_is(path)}")
    located = _parse_records(path)  # (record number, " (line n)" or "", record)
    if not located:
        raise InputError(f"{path}: file holds no records")
    if convert is not None:
        located = [(i, where, convert(f"{path}: record {i}{where}", r)) for i, where, r in located]
    for i, where, r in located:
        _check_record(f"{path}: record {i}{where}", r, required, types or {}, any_of, nonblank)
    if locate:
        return [(f"{path}: record {i}{where}", r) for i, where, r in located]
    return [r for _, _, r in located]


def _parse_records(path: Path) -> list:
    """(record number, " (line n)" or "", record) of every record of a JSON list, JSON Lines or
    Parquet file, before any check of what a record holds."""
    located = []  # (record number, " (line n)" or "", record)
    text = None if path.suffix == ".parquet" else read_text(path)
    if text is None:
        located = [(i, "", r) for i, r in enumerate(_parquet_rows(path))]
    elif not text.strip():
        raise InputError(f"{path}: file is empty (expected a JSON list or JSON Lines of records)")
    elif text.lstrip().startswith("["):
        try:
            rows = STRICT.decode(text)
        except (json.JSONDecodeError, NonFiniteError):
            raise InputError(_locate_bad_record(text, path)) from None
        located = [(i, "", r) for i, r in enumerate(rows)]
    elif text.lstrip().startswith("{") and path.suffix != ".jsonl" and _single_object(text):
        raise InputError(f"{path}: holds a single JSON object; expected a JSON list of records, "
                         f"or JSON Lines (one object per line) in a .jsonl file")
    else:
        for lineno, line in enumerate(jsonl_lines(text), 1):
            if not line.strip(" \t"):  # JSON's whitespace ('\r' is gone): a line of
                                       # U+2028 is no blank line
                continue
            try:
                located.append((len(located), f" (line {lineno})",
                                loads_strict(line, f"{path}: record {len(located)} "
                                                   f"(line {lineno})")))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: malformed JSON in record {len(located)} "
                                 f"(line {lineno}, column {e.colno}): {e.msg}") from None
    return located


def _check_record(where: str, r, required, types: dict, any_of, nonblank):
    """One record's fields, as read_records's docstring says: a problem raises InputError naming
    `where` and the field."""
    if not isinstance(r, dict):
        raise InputError(f"{where}: expected an object with {', '.join(map(repr, required))}, "
                         f"got {type(r).__name__}")
    for field in required:
        if field not in r:
            raise InputError(f"{where}: missing field {field!r}")
        want = types.get(field, str)
        if not isinstance(r[field], want):
            name = "a string" if want is str else " or ".join(t.__name__ for t in (
                want if isinstance(want, tuple) else (want,)))
            raise InputError(f"{where}: field {field!r} must be {name}, "
                             f"got {type(r[field]).__name__}")
    if any_of and not any(isinstance(r.get(f), str) for f in any_of):
        raise InputError(f"{where}: needs a string field {' or '.join(map(repr, any_of))}")
    for field in nonblank:
        check_answer(where, field, r.get(field))
    if isinstance(r.get("prompt"), list) and not (r["prompt"] and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) and _encodable(m["role"] + m["content"])
            for m in r["prompt"])):  # a chat prompt's turns
        raise InputError(f"{where}: field 'prompt' must be a string or a non-empty list of "
                         f"{{role, content}} objects of text")
    for field, v in r.items():  # JSON's "\ud800" escapes decode to text no tokenizer
                                # (nor UTF-8) can take
        if isinstance(v, str) and not _encodable(v):
            raise InputError(f"{where}: field {field!r} holds an unpaired surrogate "
                             f"(\\ud800-\\udfff escape), which is not text; fix or drop the record")


def _parquet_rows(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), "
                         f"or convert the file to JSON Lines") from None
    return pq.read_table(path).to_pylist()


def check_answer(where: str, field: str, value):
    """A gold answer holds text: an empty or all-whitespace one (a string) is refused
    naming where it is."""
    if isinstance(value, str) and not value.strip():
        raise InputError(f"{where}: field {field!r} is "
                         f"{'empty' if not value else 'only whitespace'}: "
                         f"a gold answer needs text; fill it in or drop the record")


def _non_finite(obj, where=""):
    """(location, value) of the first NaN or infinity in obj (location like
    ".scores[3]"), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, obj
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]")
        if found:
            return found
    return None


def dumps_strict(obj, path, **kw) -> str:
    """json.dumps that refuses NaN and infinities (not JSON: other readers reject them), naming the
    file and the field instead of writing them."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        found = _non_finite(obj)
        if found is None:
            raise
        raise InputError(f"{path}: refusing to write a non-finite number "
                         f"({found[0].lstrip('.') or 'the value'} is {found[1]}); "
                         f"JSON has no NaN or infinity") from None

