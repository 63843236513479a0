"""Content digests of the files a pipeline step reads, so a step's key changes when its inputs
change, not only when their paths do.

    digests = Digests(run_dir / "digests.json")  # path -> (size, mtime_ns, sha256, inode, ctime_ns)
    digests.of([data_root / "FOMC" / "train.json", base_dir])  -> ["3f2a...", "9c1e..."]
    digests.save()

A file is hashed once; re-runs reuse the cached digest while its size, modification time, inode and
status-change time are unchanged, so a 7B checkpoint costs one read per run directory, not one per
step. (The status-change time cannot be set back: an in-place edit whose mtime was restored, e.g. by
`touch -r` or `cp -p`, is hashed again.) A directory's digest covers every file under it (relative
path and content), in sorted order. The paths themselves are not part of a digest: moving the data
elsewhere keeps every result.
"""
import hashlib
import json
from pathlib import Path

from common.errors import MissingFileError
from common.outputs import write_json

CHUNK = 1 << 22  # 4 MiB reads


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _entry_ok(v) -> bool:
    return (isinstance(v, list) and len(v) == 5 and isinstance(v[2], str)
            and all(isinstance(x, int) and not isinstance(x, bool)
                    for x in (v[0], v[1], v[3], v[4])))


class Digests:
    def __init__(self, cache_path=None):
        self.cache_path = Path(cache_path) if cache_path else None
        self.cache = {}
        if self.cache_path and self.cache_path.is_file():
            try:
                cache = json.loads(self.cache_path.read_text())
            except ValueError:  # a damaged cache is only a lost speed-up
                cache = {}
            # so is one of another shape (a list, an entry not [size, mtime_ns, sha256, inode,
            # ctime_ns]): those entries are hashed again instead of failing in file()
            self.cache = ({k: v for k, v in cache.items() if _entry_ok(v)}
                          if isinstance(cache, dict) else {})

    def file(self, path: Path) -> str:
        st = path.stat()
        key = str(path.resolve())
        hit = self.cache.get(key)
        if (hit and hit[:2] == [st.st_size, st.st_mtime_ns]
                and hit[3:] == [st.st_ino, st.st_ctime_ns]):
            return hit[2]
        digest = file_sha256(path)
        self.cache[key] = [st.st_size, st.st_mtime_ns, digest, st.st_ino, st.st_ctime_ns]
        return digest

    def path(self, path) -> str:
        """sha256 of a file, or of a directory's (relative path, file digest) list;
        a missing path is an error."""
        path = Path(path)
        if path.is_file():
            return self.file(path)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
            listing = [[str(p.relative_to(path)), self.file(p)] for p in files]
            return hashlib.sha256(json.dumps(listing).encode()).hexdigest()
        raise MissingFileError(f"{path}: not found (a pipeline step reads it)")

    def of(self, paths) -> list[str]:
        return [self.path(p) for p in paths]

    def save(self):
        if self.cache_path:
            write_json(self.cache_path, self.cache)
