"""Per-token KL and teacher-forced log-probs (model/logprobs.py) and drift.py, against a naive full-vocabulary
computation with transformers' own Llama: identical checkpoints give 0, a perturbed one gives the naive value,
chunking and packing change nothing, bad input writes nothing."""
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from data.embedded import write_benchmark  # noqa: E402
from data.trace import load_task  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model.logprobs import chunked_token_stats, response_stats  # noqa: E402
from model.tokenizer import ChatTokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
torch.set_num_threads(1)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_checkpoint(path: Path, seed: int = 0):
    """A tiny random Llama (fp32, untied lm_head) saved by transformers, with a byte-level BPE and ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["What is the monetary policy stance? A. dovish B. hawkish C. neutral. "
                             "How many apples does Anna have now? The answer is 12."] * 10, trainer)
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
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


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    write_checkpoint(base / "prev")
    perturbed_copy(base / "prev", base / "cur")
    shutil.copytree(base / "prev", base / "same")
    return base


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace")
    write_benchmark(root, n_train=2, n_eval=1, n_test=5, tasks="FOMC,NumGLUE-cm")
    return root


def naive(hf_cur, hf_ref, prompt, response):
    """Full [T, V] logits of both models from transformers: per-token log-probs of `response` and KL(cur || ref)."""
    ids = torch.tensor(prompt + response)[None]
    with torch.no_grad():
        lp = torch.log_softmax(hf_cur(ids).logits[0].double(), -1)[len(prompt) - 1:-1]
        lq = torch.log_softmax(hf_ref(ids).logits[0].double(), -1)[len(prompt) - 1:-1]
    tgt = torch.tensor(response)[:, None]
    return lp.gather(1, tgt).squeeze(1), lq.gather(1, tgt).squeeze(1), (lp.exp() * (lp - lq)).sum(-1)


def hf(path):
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# --- the chunked kernel ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_chunked_token_stats_equal_full_vocabulary_math(chunk):
    g = torch.Generator().manual_seed(0)
    M, H, V = 11, 8, 50
    h, w = torch.randn(M, H, generator=g), torch.randn(V, H, generator=g)
    rh, rw = torch.randn(M, H, generator=g), torch.randn(V, H, generator=g)
    tgt = torch.randint(0, V, (M,), generator=g)
    lp, rlp, kl = chunked_token_stats(h, w, tgt, rh, rw, chunk=chunk)
    p, q = torch.log_softmax((h @ w.T).double(), -1), torch.log_softmax((rh @ rw.T).double(), -1)
    assert torch.allclose(lp.double(), p.gather(1, tgt[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(rlp.double(), q.gather(1, tgt[:, None]).squeeze(1), atol=1e-5)
    assert torch.allclose(kl.double(), torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1),
                          atol=1e-5)
    assert (kl > 0).all()
    # without a reference only the log-probs; against itself the KL is exactly 0
    lp2, none1, none2 = chunked_token_stats(h, w, tgt, chunk=chunk)
    assert torch.equal(lp2, lp) and none1 is None and none2 is None
    assert torch.equal(chunked_token_stats(h, w, tgt, h, w, chunk=chunk)[2], torch.zeros(M))


# --- response_stats on a real model -------------------------------------------------------------------------------

SEQS = [([5, 17, 33, 2, 9, 41], [12, 7, 88, 3]), ([88, 3], [120, 6, 200]), ([42], [11]),
        ([42, 42, 42, 11, 250, 8, 19, 60], [4, 77, 31, 9, 9, 9, 100]), ([7, 8], [])]


def test_response_stats_equals_transformers_and_ignores_packing_and_chunking(ckpts):
    cur, ref = load_model(ckpts / "cur"), load_model(ckpts / "prev")
    hf_cur, hf_ref = hf(ckpts / "cur"), hf(ckpts / "prev")
    # one row holding every sequence vs one row each; 1-position chunks vs one chunk
    a = response_stats(cur, SEQS, ref, max_tokens=10_000, chunk=1000)
    b = response_stats(cur, SEQS, ref, max_tokens=1, chunk=1)
    c = response_stats(cur, SEQS, ref, max_tokens=12, chunk=2)
    for (prompt, response), x, y, z in zip(SEQS, a, b, c):
        assert len(x["logprobs"]) == len(x["kl"]) == len(response)
        for key in ("logprobs", "ref_logprobs", "kl"):
            assert x[key] == pytest.approx(y[key], abs=1e-5) and x[key] == pytest.approx(z[key], abs=1e-5)
        if response:
            lp, lq, kl = naive(hf_cur, hf_ref, prompt, response)
            assert x["logprobs"] == pytest.approx(lp.tolist(), abs=1e-4)
            assert x["ref_logprobs"] == pytest.approx(lq.tolist(), abs=1e-4)
            assert x["kl"] == pytest.approx(kl.tolist(), abs=1e-5, rel=1e-3)
    assert sum(sum(x["kl"]) for x in a) > 0.01  # the perturbation is visible: the comparison above is not 0 == 0
    only = response_stats(cur, SEQS)
    assert [set(x) for x in only] == [{"logprobs"}] * len(SEQS)
    assert only[0]["logprobs"] == pytest.approx(a[0]["logprobs"], abs=1e-5)
    with pytest.raises(ValueError, match="sequence 1 has an empty prompt"):
        response_stats(cur, [([1], [2]), ([], [3])])


# --- drift.py ------------------------------------------------------------------------------------------------------

def run_drift(*args):
    return subprocess.run([sys.executable, "drift.py", *map(str, args), "--engine", "native", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=ENV)


def read_rows(out):
    return [json.loads(line) for line in (out / "drift_samples.jsonl").read_text().splitlines()]


def test_drift_identical_checkpoints_is_zero(ckpts, data_root, tmp_path):
    r = run_drift("--ckpt", ckpts / "same", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                  "FOMC,NumGLUE-cm", "--max-new-tokens", "6", "--out", tmp_path / "d")
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "d" / "drift.json").read_text())
    assert list(summary["tasks"]) == ["FOMC", "NumGLUE-cm"]
    for s in [*summary["tasks"].values(), summary["all"]]:
        assert s["mean_seq_kl"] == s["median_seq_kl"] == s["kl_per_token"] == 0.0
        assert s["gold_nll_cur"] == s["gold_nll_ref"] > 0
    assert summary["tasks"]["FOMC"]["n"] == 5 and summary["all"]["n"] == 10
    assert all(r["kl"] == [0.0] * r["num_tokens"] for r in read_rows(tmp_path / "d"))


def test_drift_equals_naive_kl_on_a_perturbed_checkpoint(ckpts, data_root, tmp_path):
    out = tmp_path / "d"
    r = run_drift("--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                  "NumGLUE-cm,FOMC", "--max-new-tokens", "8", "--limit", "3", "--out", out)
    assert r.returncode == 0, r.stderr
    summary, rows = json.loads((out / "drift.json").read_text()), read_rows(out)
    assert [(x["task"], x["idx"]) for x in rows] == [("NumGLUE-cm", i) for i in range(3)] + \
        [("FOMC", i) for i in range(3)]
    tok = ChatTokenizer.from_dir(ckpts / "cur")
    hf_cur, hf_ref = hf(ckpts / "cur"), hf(ckpts / "prev")
    test = {t: {ex.idx: ex for ex in load_task(data_root, t, "test")} for t in ("FOMC", "NumGLUE-cm")}
    for x in rows:
        ex = test[x["task"]][x["idx"]]
        prompt = tok.prompt_ids(ex.prompt)
        _, _, kl = naive(hf_cur, hf_ref, prompt, x["token_ids"])
        assert x["kl"] == pytest.approx(kl.tolist(), abs=1e-5, rel=1e-3)
        assert x["seq_kl"] == pytest.approx(kl.sum().item(), rel=1e-4)
        # gold NLL: the response tokens of training's encoding (answer + end-of-turn), under each model
        ids, labels = tok.encode_sft(ex.prompt, ex.answer)
        start = next(t for t, lab in enumerate(labels) if lab != -100)
        gold = [t for t in labels if t != -100]
        assert ids[:start] == prompt and x["gold_tokens"] == len(gold)
        lp, lq, _ = naive(hf_cur, hf_ref, prompt, gold)
        assert x["gold_nll_cur"] == pytest.approx(-lp.sum().item(), rel=1e-4)
        assert x["gold_nll_ref"] == pytest.approx(-lq.sum().item(), rel=1e-4)
    # the summary is the documented aggregate of the rows
    for task in ("NumGLUE-cm", "FOMC"):
        rs, s = [x for x in rows if x["task"] == task], summary["tasks"][task]
        assert s["n"] == 3 and s["mean_seq_kl"] == pytest.approx(statistics.fmean(x["seq_kl"] for x in rs))
        assert s["median_seq_kl"] == pytest.approx(statistics.median(x["seq_kl"] for x in rs))
        assert s["kl_per_token"] == pytest.approx(sum(x["seq_kl"] for x in rs) / sum(x["num_tokens"] for x in rs))
        assert s["gold_nll_cur"] == pytest.approx(sum(x["gold_nll_cur"] for x in rs) /
                                                  sum(x["gold_tokens"] for x in rs))
        assert s["mean_seq_kl"] > 0.01
    assert summary["temperature"] == 1.0 and summary["limit"] == 3 and summary["ref"] == str(ckpts / "prev")
    assert "| NumGLUE-cm | 3 |" in r.stdout


def test_drift_refuses_checkpoints_with_different_tokenizers(ckpts, data_root, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpts / "prev", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["added_tokens"][0]["content"] = "<|pad|>"
    (other / "tokenizer.json").write_text(json.dumps(spec))
    r = run_drift("--ckpt", ckpts / "cur", "--ref", other, "--data", data_root, "--out", tmp_path / "d")
    assert r.returncode != 0 and "different tokenizers" in r.stderr
    assert not (tmp_path / "d").exists()
    r = run_drift("--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks", "FOMC,Nope",
                  "--out", tmp_path / "d")
    assert r.returncode != 0 and "unknown task 'Nope'" in r.stderr
    assert not (tmp_path / "d").exists()


def test_drift_refuses_a_length_cap_past_the_model_context_before_loading(ckpts, data_root, tmp_path, monkeypatch):
    """--max-new-tokens 10**9 would size the KV cache for 10**9 columns: one line naming the flag and the model's
    context, before any weights load."""
    import drift
    import model.checkpoint
    import model.sampling
    from data.errors import InputError

    def never(*a, **kw):
        raise AssertionError("the weights were loaded or sampling started")
    monkeypatch.setattr(model.sampling, "generate", never)
    monkeypatch.setattr(model.checkpoint, "load_model", never)
    with pytest.raises(InputError, match=r"^--max-new-tokens: 1000000000 new tokens "
                                         r"is more than the model's context \(max_position_embeddings 4096 in "):
        drift.main([str(a) for a in ["--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                                     "FOMC", "--max-new-tokens", 10**9, "--limit", "1", "--engine", "native", "--quiet",
                                     "--out", tmp_path / "d"]])
    assert not (tmp_path / "d").exists()


def test_drift_refuses_a_non_finite_kl_and_writes_nothing(ckpts, data_root, tmp_path, monkeypatch):
    import drift
    import model.logprobs
    from data.errors import InputError
    real = model.logprobs.response_stats

    def overflowing(*a, **kw):  # what an overflow in either model gives
        rows = real(*a, **kw)
        rows[0]["kl"] = rows[0]["kl"] + [float("nan")]
        return rows
    monkeypatch.setattr(model.logprobs, "response_stats", overflowing)
    with pytest.raises(InputError, match="non-finite KL or NLL on FOMC example 0"):
        drift.main([str(a) for a in ["--ckpt", ckpts / "cur", "--ref", ckpts / "prev", "--data", data_root, "--tasks",
                                     "FOMC", "--max-new-tokens", "2", "--limit", "1", "--engine", "native", "--quiet",
                                     "--out", tmp_path / "d"]])
    assert not (tmp_path / "d").exists()


# --- buffer_nll.py --------------------------------------------------------------------------------------------------

def test_buffer_nll_equals_transformers_per_token_nll(ckpts, tmp_path):
    import buffer_nll
    recs = [{"prompt": "What is the stance?", "response": "A", "task": "FOMC", "source": "gold"},
            {"prompt": "Policy is fine.", "response": "C. neutral", "task": "FOMC", "source": "gold"},
            {"prompt": "How many apples?", "response": "The answer is 12.", "task": "NumGLUE-cm", "source": "gold"},
            {"prompt": "apples " * 40, "response": "1", "task": "NumGLUE-cm", "source": "gold"}]
    path = tmp_path / "buffer.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = buffer_nll.main(["--ckpt", str(ckpts / "prev"), "--buffer", str(path), "--max-len", "60", "--quiet"])
    assert out == tmp_path / "buffer_stats.json"
    stats = json.loads(out.read_text())
    tok = ChatTokenizer.from_dir(ckpts / "prev")
    model = hf(ckpts / "prev")
    per, tok_max = {}, {}
    for r in recs[:3]:
        ids, labels = tok.encode_sft(r["prompt"], r["response"])
        assert len(ids) <= 60
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
        tgt = torch.tensor(labels[1:])
        nll = torch.nn.functional.cross_entropy(logits[tgt != -100], tgt[tgt != -100], reduction="none")
        per.setdefault(r["task"], []).append(nll.mean().item())
        tok_max[r["task"]] = max(tok_max.get(r["task"], 0.0), nll.max().item())
    assert stats["dropped_overlong"] == 1 and stats["budget"] == 4 and stats["scorer"] == "gold"
    for task in ("FOMC", "NumGLUE-cm"):
        s = stats["tasks"][task]["selected"]
        assert s["n"] == len(per[task]) and stats["tasks"][task]["rejected"] is None
        assert s["nll_mean"] == pytest.approx(statistics.fmean(per[task]), rel=1e-4)
        assert s["nll_max"] == pytest.approx(max(per[task]), rel=1e-4)
        assert s["token_nll_max"] == pytest.approx(tok_max[task], rel=1e-4)
    assert stats["all"]["selected"]["nll_max"] == pytest.approx(max(max(v) for v in per.values()), rel=1e-4)
