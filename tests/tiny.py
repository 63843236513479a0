"""The tiny world several test files share, as plain functions (conftest.py wraps the expensive ones in fixtures):

- the scripts' world: a random tiny Llama (model.base.write_random_tiny), a 2-task TRACE-layout data root, a rollout
  file and the environment the scripts run with (`make_env`), and the subprocess helpers that run a script on it
- train.py's world: a tiny random Llama saved by transformers with an SFT file (`make_checkpoint`), and the helpers
  that run train.py on it and compare its outputs (test_train.py, test_sdft.py)
- drift's world: a tiny random Llama with a ChatML tokenizer and a perturbed copy of it (`write_checkpoint`,
  `perturbed_copy`: test_drift.py, test_logprobs.py, test_buffer_nll.py), and the naive full-vocabulary math they are
  checked against
- transformers' small models of three architectures, our model's reference (`make_hf`: test_transformer.py,
  test_checkpoint.py)

A test file imports these from here, never from another test file.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

import forkserver
from common.outputs import write_jsonl

REPO = Path(__file__).resolve().parents[1]

# ---- the scripts' world ----------------------------------------------------------------------------------------------
TASKS = ("C-STANCE", "FOMC")


def write_statements(data: Path, tasks=TASKS, n: int = 4):
    """A TRACE-layout root at `data`: each task's train.json and test.json hold the same n 2-label records."""
    for t in tasks:
        for split in ("train", "test"):
            recs = [{"prompt": f"{t} statement {i}: the cat sat. Answer A or B.", "answer": "AB"[i % 2]}
                    for i in range(n)]
            (data / t).mkdir(parents=True, exist_ok=True)
            (data / t / f"{split}.json").write_text(json.dumps(recs))


def make_env(root: Path) -> dict:
    """A random tiny Llama and a 2-task TRACE-layout data root (4 train / 4 test examples per task) under root,
    a rollout file, and the environment the scripts run with."""
    from model.base import write_random_tiny
    write_random_tiny(root / "base")
    write_statements(root / "data")
    rollouts = [{"task": "FOMC", "idx": i, "prompt": f"FOMC statement {i}: the cat sat. Answer A or B.",
                 "response": "A", "token_ids": [5, 6], "logprobs": [-0.5, -0.1], "finish_reason": "stop"}
                for i in range(4)]
    write_jsonl(root / "rollouts.jsonl", rollouts)
    e = dict(os.environ, OMP_NUM_THREADS="1", OPR_CACHE=str(root / "cache"))
    e.pop("OPR_DEBUG", None)
    return dict(base=root / "base", data=root / "data", rollouts=root / "rollouts.jsonl", env=e)


def run(script: str, args, env, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    """`python <script> args` in make_env's environment `env`."""
    return forkserver.run([sys.executable, str(REPO / script), *map(str, args)], cwd=cwd, env=env["env"],
                          capture_output=True, text=True, timeout=600, **kw)


def score_args(env, tmp, *extra, rollouts=None):
    return ["--rollouts", rollouts or env["rollouts"], "--data", env["data"], "--budget", "2", "--out",
            tmp / "out.jsonl", *extra]


def run_args(env, tmp, *extra, model=None, data=None):
    """run.py on make_env's world: 2 tasks, sft, 1 epoch, 2 new tokens, into tmp/run."""
    return ["--model", model or env["base"], "--data", data or env["data"], "--tasks", ",".join(TASKS),
            "--methods", "sft", "--epochs", "1", "--global-batch", "2", "--max-new-tokens", "2", "--quiet",
            "--out", tmp / "run", *extra]


def tiny_train(env, out, *extra):
    """train.py on make_env's C-STANCE train split: 1 epoch of 2 steps."""
    return run("train.py", ["--model", env["base"], "--data", env["data"] / "C-STANCE" / "train.json", "--out", out,
                            "--epochs", "1", "--global-batch", "2", "--max-len", "128", "--quiet", *extra], env)


def foreign_dir(tmp: Path) -> Path:
    """A directory of the user's, not this project's output."""
    d = tmp / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("my notes")
    return d


def foreign_file(tmp: Path) -> Path:
    f = tmp / "mine.jsonl"
    f.write_text('{"prompt": "mine", "answer": "mine"}\n')
    return f


# ---- train.py's world ------------------------------------------------------------------------------------------------
MAX_LEN = 48
# 36 short records + 4 whose prompt alone is longer than MAX_LEN tokens -> 36 examples -> 5 steps/epoch of <= 8
ARGS = ["--epochs", "3", "--global-batch", "8", "--micro-tokens", "96", "--max-len", str(MAX_LEN), "--lr", "1e-3",
        "--seed", "0", "--save-every", "2", "--quiet"]
N_STEPS = 15
WORDS = "the cat sat on a mat and dog ran to park with red blue green ball one two three four five".split()


def make_checkpoint(path: Path, tied: bool) -> Path:
    """A tiny random Llama (2 layers, GQA 4/2 heads) saved by transformers, with a byte-level BPE + ChatML tokenizer
    and an SFT file data.jsonl (40 records, 4 of them longer than MAX_LEN tokens)."""
    import random

    import transformers
    from model.base import CHATML, train_tiny_tokenizer
    rng = random.Random(0)
    say = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    path.mkdir(parents=True)
    tok = train_tiny_tokenizer([say(5, 20) for _ in range(200)], 320)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>"}))
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied,
        eos_token_id=tok.token_to_id("<|im_end|>"), pad_token_id=tok.token_to_id("<|endoftext|>"))
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # HF initialises norms to 1: randomise them so they are exercised
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    hf.save_pretrained(path)
    records = [{"prompt": say(1, 12), "response": say(1, 10)} for _ in range(36)]
    for i in (3, 11, 20, 30):
        records.insert(i, {"prompt": say(60, 70), "response": say(1, 3)})
    write_jsonl(path / "data.jsonl", records)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_cmd(ckpt: Path, out: Path, *extra, data=None) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), "--model", str(ckpt), "--data", str(data or ckpt / "data.jsonl"),
            "--out", str(out), *ARGS, *extra]


def train_env() -> dict:
    """This process's environment without a torchrun rank's variables, one thread per process."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**e, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train(ckpt, out, *extra, world=1, data=None, ok=True, torchrun=False) -> subprocess.CompletedProcess:
    """train.py on `world` ranks: forked with torchrun's variables (tests/forkserver.run_ranks), or under torchrun."""
    cmd = train_cmd(ckpt, out, *extra, data=data)
    if world > 1 and not torchrun:
        r = forkserver.run_ranks(world, cmd, cwd=REPO, env=train_env(), text=True, timeout=600, port=free_port())
    else:
        if world > 1:
            cmd = forkserver.torchrun(world, cmd, free_port())
        r = forkserver.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    if ok and r.returncode != 0:
        raise AssertionError(f"train.py failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict:
    return load_file(out / "model.safetensors")


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, tol: float, what: str):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    assert err <= tol, f"{what}: max relative difference {err:.3g} > {tol}"


def assert_same_weights(a: dict, b: dict, tol: float):
    assert a.keys() == b.keys()
    for k in a:
        assert_close_rel(a[k], b[k], tol, k)


def kill_once_state_is_saved(ckpt, out: Path, *extra) -> tuple[bool, str, Path]:
    """Start train.py (with `extra` flags), SIGKILL it as soon as a training state exists. Returns (was it still
    running, its output, the state's progress.pt)."""
    state = out.with_name(out.name + ".partial") / "state" / "progress.pt"
    p = subprocess.Popen(train_cmd(ckpt, out, *extra), cwd=REPO, env=train_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not state.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        alive = p.poll() is None
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        output = p.communicate()[0]
    return alive, output, state


# ---- transformers' small models of each architecture -------------------------------------------------------------
HF_ARCHS = ("llama", "qwen2", "qwen3")


def tiny_llama(path, seed=0, **overrides):
    """A random transformers Llama (width 32, 2 layers, GQA 4/2 heads, vocabulary 97) saved to `path`, loaded as ours
    (test_engine.py, test_native.py)."""
    import transformers
    from model.checkpoint import load_model
    cfg = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=4096)
    cfg.update(overrides)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(path)
    return load_model(path)


def hf_model(arch: str):
    """A random transformers model of `arch`, small, with every feature of its family our model reads."""
    import transformers
    if arch == "llama":  # Llama-3.1 style: llama3 rope scaling (short original context so every frequency band is
        # exercised), GQA, q/k/v/o and MLP biases
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attention_bias=True, mlp_bias=True, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}))
    if arch == "qwen2":  # Qwen2.5 small sizes: q/k/v biases, tied embeddings
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0))
    # Qwen3: q/k RMSNorm, head_dim (24) unrelated to hidden/heads (16)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24))


def make_hf(arch: str, path: Path):
    """hf_model(arch) with seed 0, its norms and biases randomised too, saved to `path`."""
    torch.manual_seed(0)
    hf = hf_model(arch).float().eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0: randomise them so they are tested
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    hf.save_pretrained(path)
    return hf


def hf_logits(hf, ids, pos=None):
    with torch.no_grad():
        return hf(input_ids=ids, position_ids=pos).logits


# ---- drift's world ----------------------------------------------------------------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_bpe_tokenizer(path: Path, vocab_size: int) -> int:
    """A byte-level BPE (any text encodes, decode round-trips) with ChatML's specials and template, trained on two
    task-like sentences, saved into the directory `path`; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["What is the monetary policy stance? A. dovish B. hawkish C. neutral. "
                             "How many apples does Anna have now? The answer is 12."] * 10, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    return tok.get_vocab_size()


def write_checkpoint(path: Path, seed: int = 0):
    """A tiny random Llama (fp32, untied lm_head) saved by transformers, with a byte-level BPE and ChatML."""
    import transformers
    path.mkdir(parents=True)
    vocab = write_bpe_tokenizer(path, 320)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=2, bos_token_id=1,
        tie_word_embeddings=False))
    with torch.no_grad():  # larger weights than the default init: peaked, distinct distributions
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    hf.save_pretrained(path)


def perturbed_copy(src: Path, dst: Path, scale: float = 0.05, seed: int = 1):
    """A copy of src whose weights are shifted by seeded Gaussian noise (every tensor, incl. lm_head)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    state = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()}
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})


def naive(hf_cur, hf_ref, prompt, response):
    """Full [T, V] logits of both models from transformers: per-token log-probs of `response` and KL(cur || ref)."""
    ids = torch.tensor(prompt + response)[None]
    with torch.no_grad():
        lp = torch.log_softmax(hf_cur(ids).logits[0].double(), -1)[len(prompt) - 1:-1]
        lq = torch.log_softmax(hf_ref(ids).logits[0].double(), -1)[len(prompt) - 1:-1]
    tgt = torch.tensor(response)[:, None]
    return lp.gather(1, tgt).squeeze(1), lq.gather(1, tgt).squeeze(1), (lp.exp() * (lp - lq)).sum(-1)


def hf(path):
    import transformers
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
