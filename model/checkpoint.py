"""Checkpoint I/O in the Hugging Face layout (config.json + model.safetensors or
sharded with an index).

Loading builds the model on the `meta` device and assigns the file's tensors (no second full copy
in memory). Saving writes a directory that transformers and vLLM load unmodified, atomically
(temp dir, then rename).
"""
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import InputError, MissingFileError, MissingWeightError
from common.jsonl import dumps_strict, loads_strict, read_text
from common.outputs import (claim_dir, fsync_dir, fsync_tree,  # noqa: F401
                            remove_stale_temporaries,
                            replace_dir,  # (replace_dir: its callers import it from here too)
                            temp_prefix)
from model.config import ModelConfig
from model.transformer import Transformer, hf_parts, is_adapter, to_hf

# Everything besides the weights that makes a directory loadable as a model with its tokenizer.
SIDECAR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def load_config(ckpt_dir) -> ModelConfig:
    path = Path(ckpt_dir) / "config.json"
    if Path(ckpt_dir).is_file():
        raise InputError(f"{ckpt_dir}: is a file, not a checkpoint directory (a directory holding "
                         f"config.json and model.safetensors)")
    if not Path(ckpt_dir).exists() and not Path(ckpt_dir).is_symlink():
        raise MissingFileError(f"{ckpt_dir}: no such checkpoint directory")
    try:
        # a symlink loop or a denied directory raises its own error, naming the path
        text = read_text(path)
    except FileNotFoundError:
        raise MissingFileError(
            f"{path}: no config.json in checkpoint directory {ckpt_dir}") from None
    try:
        d = loads_strict(text, path)  # a NaN here would be written back on save, which refuses it
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return ModelConfig.from_hf(d, source=str(path))


def _open_safetensors(path: Path):
    """safe_open, with a truncated or corrupt file reported by name (safetensors' own error
    does not say which)."""
    from safetensors import SafetensorError
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise InputError(f"{path}: unreadable safetensors file ({e}); "
                         f"it is truncated or corrupt") from None


def weight_files(ckpt_dir) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = loads_strict(read_text(index), index)["weight_map"]
            files = {name: ckpt_dir / fname for name, fname in weight_map.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError(f"{index}: not a safetensors index (expected JSON with a "
                             f"'weight_map' object)") from None
        for path in dict.fromkeys(files.values()):
            if not path.is_file():
                raise MissingFileError(f"{path}: listed in {index.name} but missing")
        return files
    single = ckpt_dir / "model.safetensors"
    if not single.is_file():
        raise MissingFileError(f"{ckpt_dir}: neither model.safetensors nor "
                               f"model.safetensors.index.json found")
    with _open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def expected_state(model: Transformer) -> dict:
    """HF name -> shape of every tensor the checkpoint must provide (tied lm_head is not stored)."""
    # by arithmetic, not by slicing: load_into calls this on FSDP2 models, whose DTensors
    # are sharded on dim 0
    shapes = {hf: torch.Size([(t.shape[0] if b is None else b) - a, *t.shape[1:]])
              for name, t in model.state_dict().items() if not is_adapter(name)
              for hf, a, b in hf_parts(model.cfg, name)}
    if model.cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def check_finite(t: torch.Tensor, path, name: str):
    """A NaN or infinite weight (a diverged run, a corrupt file) fails at load naming the tensor,
    not later as a sampler's 'probability tensor contains inf/nan' or a NaN score."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "infinite"
        raise InputError(f"{path}: weight {name!r} holds {bad} values; the checkpoint is unusable "
                         f"(a diverged training run or a corrupt file)")


# safetensors' names of the dtypes a checkpoint's weights may have
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def _located_slices(model: Transformer, ckpt_dir):
    """Yield (path, HF name, lazy safetensors slice) for every tensor `model` needs, after checking
    the checkpoint holds exactly those, with the right shapes: an unexpected, missing or mis-shaped
    weight is an error naming file and key, never silently dropped or randomly initialised."""
    shapes = expected_state(model)
    where = weight_files(ckpt_dir)
    unexpected = {k for k in set(where) - set(shapes) - {"lm_head.weight"}
                  if not k.endswith("rotary_emb.inv_freq")}
    if unexpected:
        raise InputError(f"{ckpt_dir}: unexpected weights for model_type {model.cfg.model_type!r}: "
                         f"{sorted(unexpected)[:5]}")
    missing = [n for n in shapes if n not in where]
    if missing:
        raise MissingWeightError(f"{ckpt_dir}: weight {missing[0]!r} is missing from the "
                       f"checkpoint (refusing to initialise it randomly)")
    by_file = {}
    for name in shapes:
        by_file.setdefault(where[name], []).append(name)
    for path, names in by_file.items():
        with _open_safetensors(path) as f:
            for name in names:
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != tuple(shapes[name]):
                    raise InputError(f"{path}: weight {name!r} has shape {tuple(sl.get_shape())}, "
                                     f"expected {tuple(shapes[name])}")
                # integers or booleans would load as numbers all the same
                if sl.get_dtype() not in FLOAT_DTYPES:
                    raise InputError(f"{path}: weight {name!r} is stored as {sl.get_dtype()}: "
                                     f"a model's weights are floating point "
                                     f"({', '.join(FLOAT_DTYPES)})")
                yield path, name, sl


def load_model(ckpt_dir, device="cpu", dtype=torch.float32) -> Transformer:
    """Build the Transformer described by ckpt_dir/config.json and load its weights. Returns it in
    eval mode and without gradients (a model loaded for sampling or scoring)."""
    cfg = load_config(ckpt_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    # each of our tensors allocated once, the file's tensors copied into their rows
    # (a fused q/k/v is 3 of them)
    # (a tied lm_head is not among them: tie_weights() below points it at the embeddings)
    state = {name: torch.empty(t.shape, device=device, dtype=dtype)
             for name, t in model.state_dict().items()
             if not (cfg.tie_word_embeddings and name == "lm_head.weight")}
    views = to_hf(state, cfg)
    for path, name, sl in _located_slices(model, ckpt_dir):
        views[name].copy_(sl[:])
        check_finite(views[name], path, name)
    model.load_state_dict(state, strict=not cfg.tie_word_embeddings, assign=True)
    model.tie_weights()
    return model.eval().requires_grad_(False)


def local_rows(t) -> tuple:
    """(this rank's rows of t, the index of its first row): a DTensor that fully_shard split on
    dim 0 like torch.chunk, or a plain tensor (all of it, from row 0)."""
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.to_local(), t.device_mesh.get_local_rank() * -(-t.shape[0] // t.device_mesh.size())
    return t, 0


def load_into(model: Transformer, ckpt_dir):
    """Copy checkpoint weights into a materialised model, possibly FSDP-sharded (parameters are
    DTensors sharded on dim 0): each rank reads only its own rows of each tensor."""
    targets = {hf: (t, a) for name, t in model.state_dict().items()
               for hf, a, _ in hf_parts(model.cfg, name)}
    with torch.no_grad():
        for path, name, sl in _located_slices(model, ckpt_dir):
            # this HF tensor is rows offset.. of our (possibly fused) tensor t
            t, offset = targets[name]
            local, start = local_rows(t)
            # the rows of the HF tensor this rank holds, in the HF tensor's numbering
            lo, hi = max(start - offset, 0), min(start + local.shape[0] - offset, sl.get_shape()[0])
            if hi > lo:
                dst = local[lo + offset - start:hi + offset - start]
                dst.copy_(sl[lo:hi])
                # each rank its own rows: the first to see one says so
                check_finite(dst, path, name)


def _save_file(tensors: dict, path: Path, metadata: dict):
    """safetensors' save_file, with a write failure (disk full, quota, ...) raised as the OSError it
    is, naming the file: safetensors reports it as a SafetensorError without the path."""
    try:
        save_file(tensors, path, metadata=metadata)
    except Exception as e:
        code = (re.search(r"\(os error (\d+)\)", str(e))
                if type(e).__name__ == "SafetensorError" else None)
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from e


def save_checkpoint(state_dict: dict, src_dir, out_dir, max_shard_bytes: int = 5 * 2**30,
                    dtype=None, extra_files=()):
    """Write `state_dict` (our names or HF's: fused tensors are split) to out_dir in the HF layout,
    with config and tokenizer files copied from src_dir.

    Shards with a model.safetensors.index.json when the weights exceed max_shard_bytes. Atomic:
    written to a temporary sibling directory, then renamed over out_dir. `extra_files` (paths of
    files or directories) are copied in too (logs, a method's stage artefacts).
    """
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    cfg = load_config(src_dir)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous()
             for k, v in to_hf(state_dict, cfg).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    try:
        shards, size = [[]], 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        meta = {"format": "pt"}
        if len(shards) == 1:
            _save_file(state, tmp / "model.safetensors", meta)
        else:
            weight_map = {}
            for i, names in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _save_file({n: state[n] for n in names}, tmp / fname, meta)
                weight_map.update({n: fname for n in names})
            total = sum(t.numel() * t.element_size() for t in state.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                           indent=2, allow_nan=False))
        for fname in SIDECAR_FILES:
            if (src_dir / fname).is_file():
                shutil.copy2(src_dir / fname, tmp / fname)
        for path in extra_files:  # a file, or a directory of them (a method's stage artefacts)
            (shutil.copytree if Path(path).is_dir() else shutil.copy2)(path, tmp / Path(path).name)
        saved_dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        hf = json.loads((tmp / "config.json").read_text())
        hf["torch_dtype" if "torch_dtype" in hf else "dtype"] = saved_dtype
        (tmp / "config.json").write_text(dumps_strict(hf, src_dir / "config.json", indent=2) + "\n")
        claim_dir(tmp, "checkpoint")  # this project's: a later train.py --out may replace it
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def remove_dir(path: Path):
    """Remove a directory so that it is either whole or gone: renamed aside first (atomic), then
    deleted. A plain rmtree stopped half-way (a SIGKILL) leaves a directory that looks intact by its
    marker file but lacks others."""
    if not path.exists():
        return
    aside = path.with_name(f".{path.name}.removed-{os.getpid()}")
    os.replace(path, aside)
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)
