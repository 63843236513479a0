"""Reading and writing record files: JSON Lines, or a JSON list (TRACE's release format). Errors name file,
record, line and field.

Every file the pipeline writes goes through `write_jsonl` (temporary file, fsync, then rename, then fsync of the
directory), so neither a killed run nor a power loss leaves a half-written file under the final name.
"""
import contextlib
import errno
import json
import math
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from pipeline.cli import InputError, UserError


class NonFiniteError(ValueError):
    """A number in JSON input that is not a finite number (loads_strict)."""


def _refuse_constant(name: str):
    raise NonFiniteError(f"{name} is not a number (JSON has no NaN or infinity); write a finite number")


def _finite_float(s: str) -> float:
    v = float(s)
    if math.isinf(v):
        raise NonFiniteError(f"{s} is too large a number (it reads as infinity); write a finite number")
    return v


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:  # Python converts at most sys.get_int_max_str_digits() digits
        raise NonFiniteError(f"an integer of {len(s)} digits is too large; write a smaller number") from None


# Python's JSON reader takes NaN, Infinity and -Infinity (and 1e999 as an infinity), none of which is JSON; a NaN
# passes every range check written as `x < lo`, so input must refuse them where it is parsed
STRICT = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_int)


def loads_strict(text: str, where) -> object:
    """json.loads for input files: a NaN, an infinity or an overlong integer is an InputError naming `where` (the
    file, or the file's record and line) and the constant. Malformed JSON still raises json.JSONDecodeError, for
    the caller to word."""
    try:
        return STRICT.decode(text)
    except NonFiniteError as e:
        field = _non_finite_field(text)
        raise InputError(f"{where}: {f'field {field!r}: ' if field else ''}{e}") from None


def _non_finite_field(text: str) -> str | None:
    """The path ('a.b[2]') of the first NaN or infinity in JSON text, read leniently, for the error line (None when
    there is none to find, e.g. an overlong integer)."""
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
    """The lines of JSON Lines text: split at '\\n' only (a '\\r' before it dropped). str.splitlines() also splits
    at U+2028, U+2029, U+0085 (which JSON allows raw inside a string), \\x0b, \\x0c and \\x1c-\\x1e, cutting a record
    that holds one in two."""
    return [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]


def _locate_bad_record(text: str, path: Path) -> str:
    """Strict decoding failed on a list file: decode it record by record to say which record is broken."""
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
            return f"{path}: malformed JSON in record {rec} (line {e.lineno}, column {e.colno}): {e.msg}"
        except NonFiniteError as e:
            field = (_non_finite_field(text) or "").removeprefix(f"[{rec}]").lstrip(".")
            return f"{path}: record {rec} (line {line_of(pos)}): {f'field {field!r}: ' if field else ''}{e}"
        pos = skip_ws(end)
        if pos < n and text[pos] == ",":
            pos, rec = skip_ws(pos + 1), rec + 1
            continue
        if pos < n and text[pos] == "]":
            return f"{path}: malformed JSON after record {rec} (line {line_of(pos)}): trailing data after the list"
        return f"{path}: malformed JSON after record {rec} (line {line_of(pos)}): expected ',' or ']'"


def _single_object(text: str) -> bool:
    try:
        return isinstance(STRICT.decode(text), dict)
    except ValueError:  # malformed or non-finite: the line-by-line reading names the record
        return False


def read_text(path) -> str:
    """A UTF-8 text file's contents (a leading byte-order mark dropped); non-UTF-8 bytes raise InputError naming
    the file and the byte offset."""
    path = Path(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); convert the file to UTF-8") from None
    return text[1:] if text.startswith("\ufeff") else text


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_records(path, required=("prompt",), types=None, any_of=(), locate=False, nonblank=(), convert=None) -> list:
    """Records of a JSON list file or a JSON Lines file (whichever the text is: a list starts with '['), or of a
    Parquet file (.parquet, with pyarrow).

    Each record must be an object holding every `required` field as a string (or the type, or tuple of types, in
    `types`), and at least one of the `any_of` fields as a string when given; a `nonblank` field, when a string,
    must hold more than whitespace (a gold answer: an empty one trains nothing and scores as whatever an empty
    prediction scores). Every problem raises ValueError naming the file, the record number (0-based; blank JSONL
    lines are skipped), the line for JSON Lines, and the field.
    With locate=True, returns (where, record) pairs, where = "<file>: record i[ (line n)]", for later errors.
    convert(where, record) -> record, when given, is applied to each record before the checks (e.g.
    data.manifest.as_prompt_record: chat and instruction records as prompt/answer ones).
    """
    path = Path(path)
    if not path.is_file():
        with contextlib.suppress(FileNotFoundError):
            path.stat()  # a symlink loop or a denied directory raises its own error naming the path
        raise InputError(f"{path}: file not found" + (" (it is a directory)" if path.is_dir() else ""))
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
        raise InputError(f"{path}: holds a single JSON object; expected a JSON list of records, or JSON Lines "
                         f"(one object per line) in a .jsonl file")
    else:
        for lineno, line in enumerate(jsonl_lines(text), 1):
            if not line.strip(" \t"):  # JSON's whitespace ('\r' is gone): a line of U+2028 is no blank line
                continue
            try:
                located.append((len(located), f" (line {lineno})",
                                loads_strict(line, f"{path}: record {len(located)} (line {lineno})")))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: malformed JSON in record {len(located)} (line {lineno}, column "
                                 f"{e.colno}): {e.msg}") from None
    if not located:
        raise InputError(f"{path}: file holds no records")
    if convert is not None:
        located = [(i, where, convert(f"{path}: record {i}{where}", r)) for i, where, r in located]
    types = types or {}
    for i, where, r in located:
        if not isinstance(r, dict):
            raise InputError(f"{path}: record {i}{where}: expected an object with "
                             f"{', '.join(map(repr, required))}, got {type(r).__name__}")
        for field in required:
            if field not in r:
                raise InputError(f"{path}: record {i}{where}: missing field {field!r}")
            want = types.get(field, str)
            if not isinstance(r[field], want):
                name = "a string" if want is str else " or ".join(t.__name__ for t in (
                    want if isinstance(want, tuple) else (want,)))
                raise InputError(f"{path}: record {i}{where}: field {field!r} must be {name}, "
                                 f"got {type(r[field]).__name__}")
        if any_of and not any(isinstance(r.get(f), str) for f in any_of):
            raise InputError(f"{path}: record {i}{where}: needs a string field {' or '.join(map(repr, any_of))}")
        for field in nonblank:
            check_answer(f"{path}: record {i}{where}", field, r.get(field))
        if isinstance(r.get("prompt"), list) and not (r["prompt"] and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                and _encodable(m["role"] + m["content"]) for m in r["prompt"])):  # a chat prompt's turns
            raise InputError(f"{path}: record {i}{where}: field 'prompt' must be a string or a non-empty list of "
                             f"{{role, content}} objects of text")
        for field, v in r.items():  # JSON's "\ud800" escapes decode to text no tokenizer (nor UTF-8) can take
            if isinstance(v, str) and not _encodable(v):
                raise InputError(f"{path}: record {i}{where}: field {field!r} holds an unpaired surrogate "
                                 f"(\\ud800-\\udfff escape), which is not text; fix or drop the record")
    if locate:
        return [(f"{path}: record {i}{where}", r) for i, where, r in located]
    return [r for _, _, r in located]


def _parquet_rows(path: Path) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert the file to "
                         f"JSON Lines") from None
    return pq.read_table(path).to_pylist()


def check_answer(where: str, field: str, value):
    """A gold answer holds text: an empty or all-whitespace one (a string) is refused naming where it is."""
    if isinstance(value, str) and not value.strip():
        raise InputError(f"{where}: field {field!r} is {'empty' if not value else 'only whitespace'}: a gold answer "
                         f"needs text; fill it in or drop the record")


def fsync_dir(path):
    """Make a directory's entries (a rename into it, a new file) durable. File systems that cannot fsync a
    directory (some FUSE and network mounts: EINVAL, ENOTSUP, EBADF) are let be, as git and SQLite do."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root):
    """fsync every file and directory under root (and root): before a rename publishes the tree, so that a power
    loss cannot leave it listed with truncated files (the rename alone orders nothing on ext4/xfs)."""
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            if not stat.S_ISREG(os.lstat(p).st_mode):  # links are not followed; a FIFO would block the open
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def temp_prefix(path: Path) -> str:
    """The name prefix of a temporary sibling of path: it carries our pid, so that a later run can tell the
    temporaries of a killed process (SIGKILL, power loss: no cleanup ran) from those of a live one."""
    return f".{path.name}.tmp-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: Path):
    """Remove what a killed writer of path left beside it: its temporaries (temp_prefix), and a moved-aside old copy
    (model.checkpoint.replace_dir) once path itself is in place, when the pid in their name is no running process."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(tmp|old)-(\d+)(-.*)?")
    try:
        entries = list(os.scandir(path.parent))
    except FileNotFoundError:
        return
    for e in entries:
        m = pattern.fullmatch(e.name)
        if not m or (m[1] == "old" and not path.exists()) or _alive(int(m[2])):
            continue
        if e.is_dir(follow_symlinks=False):
            shutil.rmtree(e.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)


def write_text_atomic(path, text: str) -> Path:
    """Write text to path atomically and durably (temp file in the same directory, fsync, os.replace, fsync of
    the directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # disk full, quota, ...: say which file (a write error carries no file name)
        os.unlink(tmp)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(path.parent)  # after the try: the file is in place, a failure here must not unlink its temp name
    return path


def _non_finite(obj, where=""):
    """(location, value) of the first NaN or infinity in obj (location like ".scores[3]"), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if isinstance(k, str) else f"{where}[{k}]")
        if found:
            return found
    return None


def dumps_strict(obj, path, **kw) -> str:
    """json.dumps that refuses NaN and infinities (not JSON: other readers reject them), naming the file and the
    field instead of writing them."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        found = _non_finite(obj)
        if found is None:
            raise
        raise InputError(f"{path}: refusing to write a non-finite number ({found[0].lstrip('.') or 'the value'} is "
                         f"{found[1]}); JSON has no NaN or infinity") from None


# characters that JSON allows raw in a string but that line splitters (str.splitlines, JavaScript before ES2019, some
# editors) take for line ends: escaped, a JSON Lines file has one record per line for every reader
LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\u0085\u2028\u2029"})


def write_jsonl(path, records) -> Path:
    """Write records as JSON Lines atomically (strict JSON: a NaN or infinity is an error naming the record), one
    record per line for any line splitter (LINE_BREAKS)."""
    return write_text_atomic(path, "".join(dumps_strict(r, f"{path}: record {i}", ensure_ascii=False)
                                           .translate(LINE_BREAKS) + "\n" for i, r in enumerate(records)))


def write_json(path, obj) -> Path:
    """Write obj as indented JSON atomically (strict JSON: a NaN or infinity is an error naming the field)."""
    return write_text_atomic(path, dumps_strict(obj, path, indent=1, ensure_ascii=False) + "\n")


# ---- what a script may replace ---------------------------------------------------------------------------------------
def _only(names):
    """A directory holding nothing but these files (and the hidden temporaries of write_text_atomic)."""
    def ours(d: Path) -> bool:
        return all(p.name in names or (p.name.startswith(".") and p.name.endswith(".tmp")) for p in d.iterdir())
    return ours


# kind -> (is a directory, what it is, test that a thing at the path was written by this project's script)
OUTPUT_KINDS = {
    "checkpoint": (True, "a checkpoint written by train.py (with train_summary.json)",
                   lambda d: (d / "train_summary.json").is_file() and (d / "config.json").is_file()),
    "train-state": (True, "train.py's training state (train_log.jsonl, state/)",
                    lambda d: any((d / n).exists() for n in ("train_log.jsonl", "state", "state.tmp",
                                                              "train_summary.json"))),
    "eval": (True, "an evaluation written by evaluate.py (predictions.jsonl, scores.json only)",
             _only({"predictions.jsonl", "scores.json"})),
    "run": (True, "a run directory of run.py (with manifest.json or steps/)",
            lambda d: any((d / n).exists() for n in ("manifest.json", "steps", "run.lock", "results.json"))),
    "rollouts": (False, "a rollout file written by rollout.py", lambda f: _first_record_has(f, ("token_ids", "logprobs",
                                                                                                "finish_reason"))),
    "buffer": (False, "a replay buffer written by score.py", lambda f: _first_record_has(f, ("scorer", "select"))),
    "buffer-stats": (False, "buffer statistics written by score.py or buffer_nll.py",
                     lambda f: _json_object_has(f, ("scorer", "all"))),
    "drift": (True, "a drift measurement written by drift.py (drift.json, drift_samples.jsonl only)",
              _only({"drift.json", "drift_samples.jsonl"})),
}


def _json_object_has(path: Path, fields) -> bool:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        return isinstance(obj, dict) and all(k in obj for k in fields)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def _first_record_has(path: Path, fields) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline()
        return not line.strip() or all(k in json.loads(line) for k in fields)  # empty: nothing to lose
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError):
        return False


def check_output(path, kind: str, overwrite: bool = False, flag: str = "--out") -> Path:
    """Refuse, before any work, to replace anything at `path` that this project's script did not write itself.

    A missing path or an empty directory is fine; so is an earlier output of the same kind (OUTPUT_KINDS:
    a train.py checkpoint, an evaluate.py directory, a run.py run directory, a rollout or buffer file). Anything
    else -- a foreign directory with files, a file where a directory goes, a foreign file -- raises UserError
    naming the path, unless `overwrite` (the script's --overwrite flag). A directory where a file goes is always
    refused. Returns the path.
    """
    path = Path(path)
    is_dir, what, ours = OUTPUT_KINDS[kind]
    if not os.path.lexists(path):
        return path
    if path.is_dir() and not is_dir:
        raise UserError(f"{path}: is a directory; {flag} must name a file")
    if is_dir and path.is_dir() and (not any(path.iterdir()) or ours(path)):
        return path
    if not is_dir and path.is_file() and ours(path):
        return path
    if overwrite:
        return path
    found = "a directory with other files" if path.is_dir() else "a file"
    raise UserError(f"{path} ({flag}) is {found}, not {what}; refusing to replace it "
                    f"(choose another {flag}, or pass --overwrite)")

