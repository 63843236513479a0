"""Writing outputs: atomically and durably, and only over what this project wrote.

Every file the pipeline writes goes through write_text_atomic (temporary file, fsync, rename,
fsync of the directory), so neither a killed run nor a power loss leaves a half-written file
under the final name.

What a script may replace (check_output, before any work): nothing at the path, an empty directory,
an empty file, or an output this project wrote, of the same kind. Every output carries a mark that
says so, written before the output itself: a directory output holds MARK, a file output has a hidden
`.<name>` + MARK beside it (write_jsonl / write_json with kind=, claim_dir). Anything else --
someone's results.json, a directory of their files, a file that only looks like ours -- is refused
in one line naming the path, unless the script's --overwrite.
"""
import contextlib
import hashlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from common.jsonl import dumps_strict
from common.errors import UserError

MARK = ".opr-output"  # {"kind": ...}: inside a directory output, or beside a file output
                      # as .<name>.opr-output


def fsync_dir(path):
    """Make a directory's entries (a rename into it, a new file) durable. File systems that
    cannot fsync a directory (some FUSE and network mounts: EINVAL, ENOTSUP, EBADF) are let be,
    as git and SQLite do."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root):
    """fsync every file and directory under root (and root): before a rename publishes the tree,
    so that a power loss cannot leave it listed with truncated files (the rename alone orders
    nothing on ext4/xfs)."""
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            if not stat.S_ISREG(os.lstat(p).st_mode):  # links are not followed; a FIFO
                                                       # would block the open
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def sibling_tag(path: Path) -> str:
    """path's name as its hidden siblings (temporaries, a moved-aside old copy) carry it: the name
    itself, or for a long one its first 100 bytes and a digest of the rest, so that a name the
    filesystem takes (up to 255 bytes) has siblings it takes too."""
    name = Path(path).name
    if len(name.encode()) <= 150:
        return name
    return (f"{name.encode()[:100].decode(errors='ignore')}~"
            f"{hashlib.sha256(name.encode()).hexdigest()[:16]}")


def temp_prefix(path: Path) -> str:
    """The name prefix of a temporary sibling of path: it carries our pid, so that a later run
    can tell the temporaries of a killed process (SIGKILL, power loss: no cleanup ran) from
    those of a live one."""
    return f".{sibling_tag(path)}.tmp-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(path: Path):
    """Remove what a killed writer of path left beside it: its temporaries (temp_prefix), and a
    moved-aside old copy (model.checkpoint.replace_dir) once path itself is in place, when the pid
    in their name is no running process."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(sibling_tag(path))}\.(tmp|old)-(\d+)(-.*)?")
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


def write_text_atomic(path, text: str, kind: str | None = None) -> Path:
    """Write text to path atomically and durably (temp file in the same directory, fsync,
    os.replace, fsync of the directory); kind as in write_jsonl: the mark goes first, so that a
    crash between the two leaves a marked old file, never an unmarked new one; a failed write leaves
    no new mark behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    mark = mark_path(path, is_dir=False) if kind is not None else None
    new_mark = mark is not None and not mark.exists()
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if mark is not None:
                _mark(mark, kind)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if new_mark:
            mark.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # disk full, quota, ...: a
                                                           # write error names no file
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    fsync_dir(path.parent)  # after the try: the file is in place, a failure here must not
                            # unlink its temp name
    return path


# characters that JSON allows raw in a string but that line splitters (str.splitlines, JavaScript
# before ES2019, some editors) take for line ends: escaped, a JSON Lines file has one record per
# line for every reader
LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\u0085\u2028\u2029"})


def write_jsonl(path, records, kind: str | None = None) -> Path:
    """Write records as JSON Lines atomically (strict JSON: a NaN or infinity is an error naming the
    record), one record per line for any line splitter (LINE_BREAKS). kind: an output of that kind
    (OUTPUT_KINDS), marked as this project's before it is written."""
    return write_text_atomic(
        path, "".join(dumps_strict(r, f"{path}: record {i}", ensure_ascii=False)
                      .translate(LINE_BREAKS) + "\n" for i, r in enumerate(records)), kind)


def write_json(path, obj, kind: str | None = None) -> Path:
    """Write obj as indented JSON atomically (strict JSON: a NaN or infinity is an error naming the
    field); kind as in write_jsonl."""
    return write_text_atomic(
        path, dumps_strict(obj, path, indent=1, ensure_ascii=False) + "\n", kind)




# ---- what a script may replace -------------------------------------------------------------------
# kind -> (is a directory, what it is)
OUTPUT_KINDS = {
    "checkpoint": (True, "a checkpoint written by train.py"),
    "train-state": (True, "train.py's training state"),
    "eval": (True, "an evaluation written by evaluate.py"),
    "run": (True, "a run directory of run.py"),
    "drift": (True, "a drift measurement written by drift.py"),
    "rollouts": (False, "a rollout file written by rollout.py"),
    "rollout-summary": (False, "a rollout summary written by rollout.py"),
    "buffer": (False, "a replay buffer written by score.py"),
    "buffer-stats": (False, "buffer statistics written by score.py or buffer_nll.py"),
    "synth": (True, "synthetic inputs written by synthesize.py"),
}


def mark_path(path: Path, is_dir: bool) -> Path:
    path = Path(path)
    return path / MARK if is_dir else path.with_name(f".{sibling_tag(path)}{MARK}")


def _mark(where: Path, kind: str):
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"unknown output kind {kind!r}")
    if _marked_kind(where) == kind:  # marked already: no write
        return
    write_text_atomic(where, json.dumps({"kind": kind}) + "\n")


def _marked_kind(where: Path):
    try:
        obj = json.loads(where.read_text(encoding="utf-8"))
        return obj.get("kind") if isinstance(obj, dict) else None
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def claim_dir(path, kind: str) -> Path:
    """Create directory output `path` (checked by check_output) and mark it as this project's
    output of `kind`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _mark(mark_path(path, is_dir=True), kind)
    return path


def is_ours(path, kind: str) -> bool:
    """Whether `path` carries this project's mark for an output of `kind` (or is one of the outputs
    written before marks existed that cannot be anyone else's: legacy)."""
    path = Path(path)
    is_dir = OUTPUT_KINDS[kind][0]
    return _marked_kind(mark_path(path, is_dir)) == kind or _legacy(path, kind)


def _legacy(path: Path, kind: str) -> bool:
    """Outputs of earlier versions, unmarked, that a re-run must still continue: a run directory
    whose manifest.json lists steps as run.py writes them (or that holds only the run.lock of a
    driver stopped before it marked the directory), train.py's resumable state."""
    if kind == "run":
        if {p.name for p in path.iterdir()} == {"run.lock"}:
            return True
        try:
            manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return False
        return isinstance(manifest, dict) and all(isinstance(v, dict) and {"kind", "id"} <= set(v)
                                                  for v in manifest.values())
    if kind == "train-state":
        return (path / "state" / "progress.pt").is_file()
    return False


def _empty(path: Path) -> bool:
    """Nothing to lose: an empty directory, or a file of nothing but whitespace (read no
    further than needed)."""
    if path.is_dir():
        return not any(path.iterdir())
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return False
        return True
    except OSError:
        return False


def check_output(path, kind: str, overwrite: bool = False, flag: str = "--out") -> Path:
    """Refuse, before any work, to replace anything at `path` that this project's script did not
    write itself (see the module docstring): raises UserError naming the path, unless
    `overwrite` (the script's --overwrite flag). A directory where a file goes is always
    refused. Returns the path."""
    path = Path(path)
    is_dir, what = OUTPUT_KINDS[kind]
    if not os.path.lexists(path):
        return path
    if path.is_dir() and not is_dir:
        raise UserError(f"{path}: is a directory; {flag} must name a file")
    if path.is_dir() == is_dir and (_empty(path) or is_ours(path, kind)):
        return path
    if overwrite:
        return path
    found = "a directory" if path.is_dir() else "a file"
    raise UserError(f"{path} ({flag}) is {found} that is not {what} "
                    f"(it carries no mark of this project's); "
                    f"refusing to replace it (choose another {flag}, or pass --overwrite)")


def replace_dir(tmp: Path, out_dir: Path):
    """Move tmp to out_dir, durably (its files are fsynced before the rename, the parent after); an
    existing out_dir is moved aside first and removed only after the swap. Callers check first that
    out_dir is theirs to replace (check_output)."""
    fsync_tree(tmp)
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{sibling_tag(out_dir)}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is None:
        return
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:  # a file or a link (only with the script's --overwrite; see check_output)
        old.unlink(missing_ok=True)


@contextlib.contextmanager
def written_aside(out_dir: Path, kind: str):
    """A directory output written whole: yields a temporary sibling, marked as `kind`, for the
    caller to fill; it replaces out_dir (an earlier output's directory whole) when the block ends,
    and is removed if the block fails, so no reader sees files of two runs side by side."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    try:
        claim_dir(tmp, kind)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out_dir)
