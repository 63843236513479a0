"""A --model or --ckpt that is not a directory, found in the local Hugging Face cache (no network).

    resolve_model("runs/stage2")               -> Path("runs/stage2")   (a directory: as given)
    resolve_model("Qwen/Qwen2.5-7B-Instruct")  -> ~/.cache/huggingface/hub/
                                          models--Qwen--Qwen2.5-7B-Instruct/snapshots/<commit>

The cache is where huggingface_hub puts it: $HF_HUB_CACHE (or its older name
$HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub. A model `Org/Name` lives in `models--Org--Name/`: `refs/main` holds the
commit of the main branch and `snapshots/<commit>/` its files (symlinks into ../../blobs, which
every reader follows). The snapshot of refs/main is used when it is there, else the only
snapshot, else the newest.
"""
import os
import re
from pathlib import Path

from common.errors import MissingFileError, UserError

# what a Hub model id looks like: "Name" or "Org/Name"; anything else (an absolute path,
# "./x", "a/b/c") is a path
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def hub_cache() -> Path:
    """The Hugging Face hub cache directory, as huggingface_hub finds it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "huggingface" / "hub"


def resolve_model(name_or_dir) -> Path:
    """The checkpoint directory of `name_or_dir`: itself when it is a directory (or does not look
    like a Hub id, so the loader's own error names it), else the cached snapshot of the Hub model of
    that id. A Hub id not in the cache is a MissingFileError naming the directory looked in."""
    path = Path(name_or_dir)
    name = str(name_or_dir)
    if path.is_dir() or not REPO_ID.fullmatch(name):
        return path
    repo = hub_cache() / ("models--" + name.replace("/", "--"))
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
    if commit and (snapshots / commit).is_dir():
        return snapshots / commit
    found = (sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
             if snapshots.is_dir() else [])
    if found:
        return found[-1]
    raise MissingFileError(f"{name}: no such checkpoint directory ({path.absolute()}), "
                           f"nor a model of that name in the Hugging Face cache "
                           f"({snapshots}; set $HF_HUB_CACHE or $HF_HOME to look elsewhere); "
                           f"download it first, e.g. `huggingface-cli download {name}`")


def default_output(ckpt_arg, ckpt: Path, name: str) -> Path:
    """ckpt / name, the default output of a script that writes beside its --ckpt; a UserError when
    `ckpt` is a snapshot of the Hugging Face cache that resolve_model found for the id `ckpt_arg`
    (the cache is no place for outputs)."""
    if ckpt != Path(ckpt_arg):
        raise UserError(f"--ckpt {ckpt_arg} is a model of the Hugging Face cache ({ckpt}), where "
                        f"the default output would go; give --out")
    return ckpt / name
