"""SmolLM2 GGUF import against transformers' own GGUF loader: weights, config, tokenizer on a few hundred strings,
logits of our Transformer, and a greedy answer that mentions Paris."""
import json
import random
import re

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, pre_tokenizers

from model.import_gguf import SMOLLM2_DIR_NAME, ensure_smollm2, find_smollm2_gguf, import_gguf
from model.tokenizer import ChatTokenizer

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache_dir(gguf_path, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    ensure_smollm2(cache)  # the one import of this file (~10 s)
    return cache


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return cache_dir / SMOLLM2_DIR_NAME


@pytest.fixture(scope="module")
def hf_gguf_model(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def ours(ckpt):
    checkpoint = pytest.importorskip("model.checkpoint")
    return checkpoint.load_model(ckpt)


def _strings() -> list[str]:
    """A few hundred strings that stress byte-level BPE: digits, unicode, code, chat markup, whitespace runs."""
    fixed = [
        "", " ", "a", "Hello world", " Hello world", "Hello  world", "hello\nworld", "\n\n\n", "\t\tx", "   \n  \n",
        "1", "12", "123", "1234567890", " 42", "3.14159", "1,000,000", "2024-07-26", "x1y22z333", "0x1F", "1e-5",
        "١٢٣ ٤٥٦", "½ ² ³ Ⅻ", "don't can't I'm we'll they've she's it'd", "DON'T", "ÀÉÎÕÜ àéîõü ß ñ ç",
        "日本語のテキストです。", "中文字符测试", "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم", "שלום עולם",
        "🙂👍🏽🇫🇷 👨‍👩‍👧", "e\u0301 a\u0308", "\u200b\u200d\ufeff", "naïve café résumé",
        "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] += 1; }", "x = {'a': [1, 2, 3]}",
        "<html><body>&amp;&lt;</body></html>", "SELECT * FROM t WHERE id = 7;", "$ ls -la | grep .py",
        "<|im_start|>user\nHi<|im_end|>\n", "<|im_start|>assistant\n", "<|endoftext|>", "<|im_end|><|im_end|>",
        "<repo_name>x<file_sep>y", "<|im_start|", "im_start", "<think>\n\n</think>",
        "a" * 50, "ab" * 40, " " * 17 + "x", "x" + " " * 17, "\n" * 9 + "y", "-" * 30, "=" * 8 + ">",
        "What is the capital of France?", "The capital of France is Paris.", "@user #tag http://example.com/a?b=c",
        "   leading", "trailing   ", "mixed \t whitespace \r\n line", "\r\n\r\n", "!!!???...", "«quotes» “curly” ‘single’",
    ]
    rng = random.Random(0)
    pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r",
             ".,;:!?'\"()[]{}<>-_+=*/\\|@#$%^&~`", "àéîõüßñçÀÉÎØÆœ", "日本語中文字한국어", "😀🙂👍🏽🎉🇫🇷", "αβγδεΔΩ", "Привет"]
    generated = []
    for i in range(260):
        usable = pools if i % 3 == 0 else [p for p in pools if p != "0123456789"]  # keep most strings digit-free
        generated.append("".join(rng.choice(rng.choice(usable)) for _ in range(rng.randint(1, 40))))
    words = ["the", " the", "The", "Paris", " 2024", "  ", "\n", "code", "()", "<|im_end|>", "ünï", "42", "'s"]
    for _ in range(60):
        generated.append("".join(rng.choice(words) for _ in range(rng.randint(1, 12))))
    return fixed + generated


def test_ensure_smollm2_reuses_the_import(cache_dir, ckpt, capsys):
    mtime = (ckpt / "model.safetensors").stat().st_mtime_ns
    assert ensure_smollm2(cache_dir) == ckpt
    assert (ckpt / "model.safetensors").stat().st_mtime_ns == mtime
    assert "imported" not in capsys.readouterr().out
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_refuses_to_overwrite_without_flag(gguf_path, ckpt):
    with pytest.raises(FileExistsError, match=re.escape(str(ckpt))):
        import_gguf(gguf_path, ckpt)


def test_config_matches_transformers_gguf_config(ckpt, hf_gguf_model):
    ours = json.loads((ckpt / "config.json").read_text())
    ref = hf_gguf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "bos_token_id",
                "eos_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours["model_type"] == "llama" and ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["tie_word_embeddings"] is True and ours["rope_theta"] == 100000.0


def test_weights_equal_transformers_dequantization(ckpt, hf_gguf_model):
    ref = hf_gguf_model.state_dict()
    with safe_open(ckpt / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert names == {k for k in ref if k != "lm_head.weight"}  # tied: lm_head is not stored
        worst = 0.0
        for k in names:
            w = f.get_tensor(k)
            assert w.dtype == torch.float32, k
            worst = max(worst, (w - ref[k]).abs().max().item())
    print(f"max |Δweight| vs transformers GGUF dequantization = {worst:.3g}")
    assert worst <= 1e-6  # q/k un-permuted exactly like transformers


def test_tokenizer_matches_transformers(gguf_path, ckpt):
    """Same ids as transformers' tokenizer for our tokenizer.json, and as transformers' GGUF tokenizer. The one known
    difference: for pre-tokenizer "smollm" llama.cpp (and SmolLM2's original tokenizer.json) split every \\p{N} char
    off before the GPT-2 regex; transformers' GGUF builder skips that split. It changes ids only around numerals (a
    whitespace run before a digit, non-ASCII numerals), so strings with numerals are checked against transformers'
    GGUF tokenizer with that split restored, all others against it unmodified."""
    ours = ChatTokenizer.from_dir(ckpt)
    hf_gguf = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    hf_ours = transformers.AutoTokenizer.from_pretrained(ckpt)
    llama_cpp_split = Tokenizer.from_str(hf_gguf.backend_tokenizer.to_str())
    llama_cpp_split.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                             hf_gguf.backend_tokenizer.pre_tokenizer])
    strings = _strings()
    assert len(strings) >= 300
    n_numeral = 0
    for s in strings:
        ids = ours.encode(s)
        assert ids == hf_ours.encode(s, add_special_tokens=False), s
        assert ids == llama_cpp_split.encode(s, add_special_tokens=False).ids, s
        if any(c.isnumeric() for c in s):
            n_numeral += 1
        else:
            assert ids == hf_gguf.encode(s, add_special_tokens=False), s
        assert ours.decode(ids, skip_special_tokens=False) == s
    print(f"{len(strings)} strings identical ({n_numeral} with numerals compared with the digit split restored)")
    assert ours.vocab_size == len(hf_gguf) == 49152
    assert (ours.eos_id, ours.pad_id) == (hf_gguf.eos_token_id, hf_gguf.pad_token_id) == (2, 2)
    assert ours.stop_ids == {0, 2}  # <|im_end|> (eos) and <|endoftext|>
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == \
        hf_gguf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_logits_match_transformers_gguf(ckpt, ours, hf_gguf_model):
    tok = ChatTokenizer.from_dir(ckpt)
    prompt = tok.prompt_ids("What is the capital of France? Answer in one word.")
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.tensor(prompt), torch.randint(0, 49152, (len(prompt),), generator=g)])
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        got = ours(ids, pos)
        ref = hf_gguf_model(input_ids=ids, position_ids=pos).logits
    diff = (got - ref).abs().max().item()
    print(f"max |Δlogit| vs transformers GGUF = {diff:.3g} over {tuple(ref.shape)}")
    assert diff <= LOGIT_TOL


def test_greedy_answer_mentions_paris(ckpt, ours):
    tok = ChatTokenizer.from_dir(ckpt)
    ids = tok.prompt_ids("What is the capital of France?")
    new = []
    with torch.no_grad():
        for _ in range(14):
            x = torch.tensor([ids + new])
            hidden = ours(x, torch.arange(x.shape[1])[None], return_hidden=True)
            nxt = int(ours.lm_head(hidden[0, -1]).argmax())  # only the last position's logits are needed
            if nxt in tok.stop_ids:
                break
            new.append(nxt)
    answer = tok.decode(new)
    print(f"greedy answer: {answer!r}")
    assert "Paris" in answer
