"""model/hub.py: a --model / --ckpt that is not a directory is a model id looked up in the local Hugging Face cache
(a fake cache tree here: refs/main, snapshots whose files are symlinks into blobs), never on the network; a model
the cache lacks is one line naming where it looked; a directory stays exactly what was given."""
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from model.checkpoint import load_config
from model.hub import resolve_model
from model.tokenizer import ChatTokenizer
from common.errors import MissingFileError, UserError
import forkserver

REPO = Path(__file__).resolve().parents[1]
CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def snapshot(cache: Path, repo_id: str, commit: str, src: Path, mtime: float | None = None) -> Path:
    """src's files as huggingface_hub caches them: blobs named by content, a snapshot of symlinks into ../../blobs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    if mtime is not None:
        os.utime(snap, (mtime, mtime))
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def test_a_model_id_is_its_refs_main_snapshot_else_the_newest(cache, tiny_ckpt):
    main = snapshot(cache, "Org/Tiny", "a" * 40, tiny_ckpt, mtime=1_000)
    newer = snapshot(cache, "Org/Tiny", "b" * 40, tiny_ckpt, mtime=2_000)
    refs = cache / "models--Org--Tiny" / "refs"
    refs.mkdir()
    (refs / "main").write_text("a" * 40)  # as huggingface_hub writes it: the commit, no newline
    assert resolve_model("Org/Tiny") == main
    # the files are symlinks into the blobs, and the loaders read through them
    assert (main / "config.json").is_symlink()
    assert load_config(main) == load_config(tiny_ckpt)
    assert ChatTokenizer.from_dir(main).vocab_size == ChatTokenizer.from_dir(tiny_ckpt).vocab_size
    (refs / "main").write_text("c" * 40 + "\n")  # refs/main of a snapshot that is not there: the newest one
    assert resolve_model("Org/Tiny") == newer
    (refs / "main").unlink()
    assert resolve_model("Org/Tiny") == newer
    os.utime(main, (3_000, 3_000))
    assert resolve_model("Org/Tiny") == main
    snapshot(cache, "gpt2", "d" * 40, tiny_ckpt)  # an id without an organisation: models--gpt2
    assert resolve_model("gpt2") == cache / "models--gpt2" / "snapshots" / ("d" * 40)


def test_a_directory_is_taken_as_given(cache, tiny_ckpt, tmp_path, monkeypatch):
    snapshot(cache, "Org/Tiny", "a" * 40, tiny_ckpt)
    monkeypatch.chdir(tiny_ckpt.parent)
    for given in (str(tiny_ckpt), "tiny", "./tiny/"):  # also where its name could be a model id
        assert resolve_model(given) == Path(given)
    (tmp_path / "Org" / "Tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("Org/Tiny") == Path("Org/Tiny")  # a local directory comes before the cache
    assert resolve_model(tmp_path / "missing") == tmp_path / "missing"  # a path: the loader's own error names it


@pytest.mark.parametrize("where", ["HF_HUB_CACHE", "HF_HOME", "home"])
def test_a_model_the_cache_lacks_is_one_line_naming_where_it_looked(tmp_path, monkeypatch, where):
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    if where == "HF_HUB_CACHE":
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        looked = tmp_path / "hub"
    elif where == "HF_HOME":
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        looked = tmp_path / "hf" / "hub"
    else:
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        looked = tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MissingFileError) as e:
        resolve_model("Org/Missing")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("Org/Missing: no such checkpoint directory")
    assert f"({tmp_path / 'Org' / 'Missing'})" in msg and f"({looked / 'models--Org--Missing' / 'snapshots'};" in msg


def test_scripts_take_a_model_id_from_the_cache(cache, tiny_ckpt, tmp_path):
    """evaluate.py --ckpt Org/Tiny evaluates the cached snapshot, as --ckpt DIR does; its default output would go
    into the cache, so it wants --out; train.py --model of a model the cache lacks is one line, no traceback."""
    import evaluate
    from data.embedded import write_benchmark
    snap = snapshot(cache, "Org/Tiny", "a" * 40, tiny_ckpt)
    data = tmp_path / "data"
    write_benchmark(data, n_train=2, n_eval=1, n_test=3, tasks="FOMC")
    common = ["--data", str(data), "--tasks", "FOMC", "--max-new-tokens", "4", "--engine", "native", "--quiet"]
    for name, model in (("dir", tiny_ckpt), ("id", "Org/Tiny")):
        evaluate.main(["--ckpt", str(model), "--out", str(tmp_path / name), *common])
    assert (tmp_path / "id" / "predictions.jsonl").read_bytes() == (tmp_path / "dir" / "predictions.jsonl").read_bytes()
    assert json.loads((tmp_path / "id" / "scores.json").read_text())["ckpt"] == str(snap)
    with pytest.raises(UserError, match="is a model of the Hugging Face cache .*; give --out"):
        evaluate.main(["--ckpt", "Org/Tiny", *common])
    assert not (snap / "eval").exists()

    r = forkserver.run([sys.executable, "train.py", "--model", "Org/Missing", "--data", str(data / "FOMC" / "train.json"),
                        "--out", str(tmp_path / "out"), "--quiet"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"train.py: error: Org/Missing: no such checkpoint directory ({REPO / 'Org' / 'Missing'}), nor a model of "
        f"that name in the Hugging Face cache ({cache / 'models--Org--Missing' / 'snapshots'}; set $HF_HUB_CACHE or "
        f"$HF_HOME to look elsewhere); download it first, e.g. `huggingface-cli download Org/Missing`")
    assert not (tmp_path / "out").exists()
