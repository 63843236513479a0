"""pipeline/digest.py and a step's key: the numerics (thread count, CPU model or --portable's pins) and the content of
every file a step reads are part of the key; file digests are cached by size and mtime, directories by their files."""
import os
import shutil

import pytest


def test_key_covers_numerics_and_file_content(tmp_path):
    from pipeline.steps import Pipeline
    f = tmp_path / "x.json"
    f.write_text("[1]")

    def key(threads, **kw):
        pipe = Pipeline(tmp_path / "run", 1, {}, True, dict(threads=threads, torch="t"))
        return pipe.add("eval", "s1-eval", dict(a=1), [], lambda *_: None, **kw)

    assert key(1, reads=[f]) == key(1, reads=[f])
    assert key(1, reads=[f]) != key(2, reads=[f])
    k = key(1, reads=[f])
    f.write_text("[2]")
    assert key(1, reads=[f]) != k
    assert key(1) != key(1, reads=[f])


def test_digest_cache_and_directories(tmp_path):
    from pipeline.digest import Digests, file_sha256
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "a.bin").write_bytes(b"a")
    (d / "sub").mkdir()
    (d / "sub" / "b.bin").write_bytes(b"b")
    dig = Digests(tmp_path / "digests.json")
    first = dig.path(d)
    assert dig.path(d) == first
    dig.save()
    again = Digests(tmp_path / "digests.json")  # cache reloaded: size+mtime unchanged -> cached digest
    assert again.cache[str((d / "a.bin").resolve())][2] == file_sha256(d / "a.bin")
    assert again.path(d) == first
    (d / "sub" / "b.bin").write_bytes(b"c")  # a nested file's content changes the directory's digest
    assert again.path(d) != first
    # an in-place edit of the same size with its mtime set back (touch -r, cp -p) is hashed again (ctime moved)
    f, st = d / "a.bin", (d / "a.bin").stat()
    before = again.path(d)
    f.write_bytes(b"z")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_mtime_ns == st.st_mtime_ns and again.path(d) != before
    shutil.copytree(d, tmp_path / "moved")
    assert again.path(tmp_path / "moved") == again.path(d)  # paths are not part of the digest
    with pytest.raises(FileNotFoundError, match="missing"):
        again.path(tmp_path / "missing")
