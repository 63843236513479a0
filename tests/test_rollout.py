"""Rollout engines and rollout.py: raw log-probs equal a teacher-forced forward pass, batching and seeding, the vLLM
wrapper against a stand-in `vllm` module, bad input, and rollout.py -> score.py end to end as subprocesses."""
import dataclasses
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model.checkpoint import load_model  # noqa: E402
from engine.native import sample as native_sample  # noqa: E402
from engine import sampling  # noqa: E402
import forkserver
from tiny import write_bpe_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny random Llama (fp32) with a tokenizer and chat template: a complete checkpoint directory."""
    path = tmp_path_factory.mktemp("ckpt")
    vocab = write_bpe_tokenizer(path, 300)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=2, bos_token_id=1))
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt)


PROMPTS = [[5, 17, 33, 2, 9, 41, 12, 7], [88, 3], [120, 6, 200, 14, 99], [42, 42, 42, 11, 250, 8, 19, 60, 4, 77, 31]]


def teacher_forced_logprobs(model, prompt, response):
    ids = torch.tensor(prompt + response)[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, torch.arange(ids.shape[1])[None])[0].float(), -1)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def greedy(model, prompts, n=12, batch_size=8, stop_ids=()):
    return native_sample(model, prompts, temperature=0.0, max_new_tokens=n, stop_ids=stop_ids,
                         batch_size=batch_size, progress=False)


# --- native engine ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.1, 1.0])
def test_native_logprobs_equal_teacher_forced_forward(model, temperature):
    # a stop id that row 0 hits early makes rows of one batch finish at different steps (KVCache.keep path)
    stop = greedy(model, PROMPTS[:1])[0]["token_ids"][2]
    outs = native_sample(model, PROMPTS, temperature=temperature, max_new_tokens=12, stop_ids={stop}, seed=3,
                         batch_size=4, progress=False)
    for p, o in zip(PROMPTS, outs):
        assert len(o["token_ids"]) == len(o["logprobs"]) >= 1
        ref = teacher_forced_logprobs(model, p, o["token_ids"])
        assert (ref - torch.tensor(o["logprobs"])).abs().max() <= TOL
        if o["finish_reason"] == "stop":
            assert o["token_ids"][-1] == stop and stop not in o["token_ids"][:-1]
        else:
            assert len(o["token_ids"]) == 12 and stop not in o["token_ids"]


def test_native_greedy_batched_equals_one_by_one(model):
    stop = greedy(model, PROMPTS[2:3])[0]["token_ids"][4]
    batched = greedy(model, PROMPTS, batch_size=4, stop_ids={stop})
    single = [greedy(model, [p], batch_size=1, stop_ids={stop})[0] for p in PROMPTS]
    assert [o["token_ids"] for o in batched] == [o["token_ids"] for o in single]
    assert [o["finish_reason"] for o in batched] == [o["finish_reason"] for o in single]
    assert batched[2]["finish_reason"] == "stop" and len(batched[2]["token_ids"]) <= 5
    for a, b in zip(batched, single):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= TOL


def test_native_seed_reproduces_and_differs(model):
    def run(seed, batch_size=2):
        return [o["token_ids"] for o in native_sample(model, PROMPTS, temperature=1.0, max_new_tokens=10,
                                                      seed=seed, batch_size=batch_size, progress=False)]
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_native_per_prompt_seeds_do_not_depend_on_the_batch(model):
    """seeds= (train.py's SDFT): a prompt's response is a function of its own seed, whatever prompts share its batch
    or whichever rank samples it; rows that stop early drop out of the batch without shifting the others' draws."""
    stop = native_sample(model, PROMPTS[:1], temperature=1.0, max_new_tokens=10, seeds=[7],
                         progress=False)[0]["token_ids"][3]

    def run(prompts, seeds, batch_size=4):
        return [o["token_ids"] for o in native_sample(model, prompts, temperature=1.0, max_new_tokens=10,
                                                      stop_ids={stop}, seeds=seeds, batch_size=batch_size,
                                                      progress=False)]
    together = run(PROMPTS, [7, 8, 9, 10])
    assert len(together[0]) == 4  # row 0 stops first: the KVCache.keep path runs
    assert [run([p], [s])[0] for p, s in zip(PROMPTS, [7, 8, 9, 10])] == together
    assert run(PROMPTS[::-1], [10, 9, 8, 7], batch_size=3)[::-1] == together
    assert run(PROMPTS, [7, 8, 9, 11])[:3] == together[:3] and run(PROMPTS, [7, 8, 9, 11])[3] != together[3]
    with pytest.raises(ValueError, match="2 seeds for 4 prompts"):
        run(PROMPTS, [1, 2])


def test_sampling_entry_point_native(ckpt, model):
    outs = sampling.generate(ckpt, PROMPTS, temperature=0.0, max_new_tokens=6, engine="native", progress=False)
    ref = greedy(model, PROMPTS, n=6, stop_ids={2})  # stop ids read from the checkpoint's tokenizer: <|im_end|> = 2
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in ref]
    assert set(outs[0]) == {"token_ids", "logprobs", "finish_reason"}
    with pytest.raises(ValueError, match="unknown engine"):
        sampling.generate(ckpt, PROMPTS, engine="hf")


# --- vLLM wrapper, contract-tested against a stand-in module -------------------------------------------------------

def fake_vllm(new_api: bool):
    """Stand-in for vllm with its documented shapes: LLM(**engine_args).generate(prompts, SamplingParams) ->
    [RequestOutput(outputs=[CompletionOutput(token_ids, logprobs=[{token_id: Logprob}], finish_reason)])].
    new_api: EngineArgs has logprobs_mode and generation_config="auto", SamplingParams().top_k == 0; else the old
    API (no logprobs_mode, generation_config=None, top_k disabled = -1)."""
    mod = types.ModuleType("vllm")
    calls = {}

    @dataclasses.dataclass
    class Logprob:
        logprob: float
        rank: int | None = None
        decoded_token: str | None = None

    @dataclasses.dataclass
    class CompletionOutput:
        index: int
        text: str
        token_ids: list
        cumulative_logprob: float | None
        logprobs: list | None
        finish_reason: str | None = None

    @dataclasses.dataclass
    class RequestOutput:
        request_id: str
        prompt: str | None
        prompt_token_ids: list
        outputs: list
        finished: bool = True

    fields = {"model": "", "tensor_parallel_size": 1, "seed": 0,
              "generation_config": "auto" if new_api else None}
    if new_api:
        fields["logprobs_mode"] = "raw_logprobs"
    mod.EngineArgs = dataclasses.make_dataclass("EngineArgs", [(k, object, dataclasses.field(default=v))
                                                               for k, v in fields.items()])

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw
            self.top_k = kw.get("top_k", 0 if new_api else -1)
            if not new_api and self.top_k == 0:
                raise ValueError("top_k must be -1 (disable), or at least 1, got 0.")

    class LLM:
        def __init__(self, **kw):
            calls["llm"] = kw

        def generate(self, prompts, sampling_params, use_tqdm=True):
            each = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
            calls["prompts"], calls["params"], calls["each"] = prompts, each[0].kw, [sp.kw for sp in each]
            outs = []
            for i, p in enumerate(prompts):
                ids = p["prompt_token_ids"]
                tokens = [ids[0] + 1, ids[-1] + 2] + ([7] if i % 2 == 0 else [11])
                # each step's dict lists a DIFFERENT (decoy) token first with a higher log-prob, then the sampled one
                steps = [{900 + t: Logprob(-0.01, rank=1), tok: Logprob(-1.0 - 0.5 * t - i, rank=2)}
                         for t, tok in enumerate(tokens)]
                reason = "stop" if i % 2 == 0 else "length"
                outs.append(RequestOutput(str(i), None, ids, [CompletionOutput(0, "", tokens, None, steps, reason)]))
            return outs

    mod.LLM, mod.SamplingParams, mod.Logprob = LLM, SamplingParams, Logprob
    return mod, calls


@pytest.mark.parametrize("new_api", [True, False])
def test_vllm_wrapper_contract(monkeypatch, new_api):
    mod, calls = fake_vllm(new_api)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    prompts = [[5, 6, 7], [10, 11], [3]]
    outs = sampling.generate("/ckpt/dir", prompts, temperature=0.1, max_new_tokens=512, seed=7, engine="vllm", tp=4,
                             stop_ids={7, 2}, progress=False)
    # the sampled token's log-prob, never the first (decoy) entry of the dict
    for i, o in enumerate(outs):
        assert o["logprobs"] == [-1.0 - i, -1.5 - i, -2.0 - i]
        assert o["token_ids"][:2] == [prompts[i][0] + 1, prompts[i][-1] + 2]
    assert [o["finish_reason"] for o in outs] == ["stop", "length", "stop"]
    assert calls["prompts"] == [{"prompt_token_ids": p} for p in prompts]
    params = calls["params"]
    assert params["temperature"] == 0.1 and params["top_p"] == 1.0 and params["max_tokens"] == 512
    assert params["logprobs"] == 0 and params["stop_token_ids"] == [2, 7]
    assert params["top_k"] == (0 if new_api else -1) and params["repetition_penalty"] == 1.0
    # each request its own seed: its prompt's key in the native engine, so no other request (nor which worker
    # samples it) changes its tokens
    from engine.sampler import row_keys
    assert [kw["seed"] for kw in calls["each"]] == row_keys(3, 7) and len(set(row_keys(3, 7))) == 3
    llm = calls["llm"]
    assert llm["model"] == "/ckpt/dir" and llm["tensor_parallel_size"] == 4 and llm["seed"] == 7
    if new_api:
        assert llm["generation_config"] == "vllm" and llm["logprobs_mode"] == "raw_logprobs"
    else:
        assert "generation_config" not in llm and "logprobs_mode" not in llm
    # the CPU backend (this machine): fp32 as the native engine, a KV cache of its own size rather than a share of the
    # machine's memory (0.92 by default: refused whenever other processes hold more than 8 %)
    assert llm["dtype"] == "float32" and llm["kv_cache_memory_bytes"] == 2 << 30 and llm["enforce_eager"]


def test_vllm_wrapper_rejects_missing_sampled_token(monkeypatch):
    mod, _ = fake_vllm(True)
    orig = mod.LLM.generate

    def broken(self, prompts, params, use_tqdm=True):
        outs = orig(self, prompts, params, use_tqdm)
        c = outs[0].outputs[0]
        c.logprobs[1] = {123456: c.logprobs[1][next(iter(c.logprobs[1]))]}
        return outs
    mod.LLM.generate = broken
    monkeypatch.setitem(sys.modules, "vllm", mod)
    with pytest.raises(RuntimeError, match="step 1 lack the sampled token"):
        sampling.generate("/ckpt", [[1, 2]], engine="vllm", stop_ids={2}, progress=False)


# --- rollout.py ----------------------------------------------------------------------------------------------------

FOMC_PROMPT = ("What is the monetary policy stance for the following text? A. dovish, B. hawkish, C. neutral. "
               "Choose one from A, B and C.\nText:\n{}\nStance:")
NUMGLUE_PROMPT = "Solve the problem: Anna has {} apples and buys {} more. How many apples now?\nAnswer:"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    """TRACE layout by hand: FOMC with 6 train records (one over 2,048 tokens), NumGLUE-cm with 4."""
    root = tmp_path_factory.mktemp("trace")
    fomc = [{"prompt": FOMC_PROMPT.format(t), "answer": a} for t, a in
            [("Inflation is too high.", "B"), ("Growth is weak.", "A"), ("Policy is fine.", "C"),
             ("Rates should rise.", "B"), ("x " * 3000, "C"), ("We can wait.", "A")]]
    numglue = [{"prompt": NUMGLUE_PROMPT.format(a, b), "answer": str(a + b)} for a, b in
               [(3, 4), (10, 2), (7, 7), (1, 9)]]
    for task, recs in (("FOMC", fomc), ("NumGLUE-cm", numglue)):
        (root / task).mkdir()
        (root / task / "train.json").write_text(json.dumps(recs, indent=1))
    return root


def run_script(*args, cwd=REPO):
    return forkserver.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_rollout_then_score_end_to_end(ckpt, data_root, tmp_path):
    r = run_script("rollout.py", "--ckpt", ckpt, "--data", data_root, "--tasks", "FOMC,NumGLUE-cm",
                   "--out", tmp_path / "rollouts.jsonl", "--max-new-tokens", "6", "--engine", "native", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "FOMC/train: kept 5/6" in r.stdout  # the over-long record is filtered out, as in training
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [(x["task"], x["idx"]) for x in rows] == [("FOMC", i) for i in (0, 1, 2, 3, 5)] + \
        [("NumGLUE-cm", i) for i in range(4)]
    src = json.loads((data_root / "FOMC" / "train.json").read_text())
    from model.tokenizer import ChatTokenizer
    tok = ChatTokenizer.from_dir(ckpt)
    for x in rows:
        assert set(x) == {"task", "idx", "prompt", "response", "token_ids", "logprobs", "mean_logprob",
                          "num_tokens", "finish_reason"}
        if x["task"] == "FOMC":
            assert x["prompt"] == src[x["idx"]]["prompt"]
        assert x["num_tokens"] == len(x["token_ids"]) == len(x["logprobs"]) <= 6
        assert math.isclose(x["mean_logprob"], sum(x["logprobs"]) / len(x["logprobs"]), rel_tol=1e-9)
        assert all(lp <= 0 for lp in x["logprobs"]) and x["finish_reason"] in ("stop", "length")
        body = x["token_ids"][:-1] if x["finish_reason"] == "stop" else x["token_ids"]
        assert x["response"] == tok.decode(body)

    # rollouts are reproducible and the default output is <ckpt>/rollouts.jsonl
    r = run_script("rollout.py", "--ckpt", ckpt, "--data", data_root, "--max-new-tokens", "6", "--quiet")
    assert r.returncode == 0, r.stderr
    assert (ckpt / "rollouts.jsonl").read_text() == (tmp_path / "rollouts.jsonl").read_text()

    # RU: budget 5 over FOMC (5 rollouts) and NumGLUE-cm (4) -> 3 + 2
    r = run_script("score.py", "--rollouts", tmp_path / "rollouts.jsonl", "--data", data_root, "--scorer", "ru",
                   "--budget", "5", "--out", tmp_path / "buffer_ru.jsonl")
    assert r.returncode == 0, r.stderr
    buf = [json.loads(line) for line in (tmp_path / "buffer_ru.jsonl").read_text().splitlines()]
    assert [b["task"] for b in buf] == ["FOMC"] * 3 + ["NumGLUE-cm"] * 2
    for b in buf:
        assert {"prompt", "response", "task", "idx", "score", "scorer", "source"} <= set(b)
        assert b["scorer"] == "ru" and b["source"] == str(tmp_path / "rollouts.jsonl") and 0 <= b["score"] <= 100
    assert "| FOMC | 5 | 0 | 3 |" in r.stdout and "| NumGLUE-cm | 4 | 0 | 2 |" in r.stdout

    # SC with b = rho * n = 0.01 * 700 = 7 -> 4 + 3, highest mean log-prob first within each task
    r = run_script("score.py", "--rollouts", tmp_path / "rollouts.jsonl", "--scorer", "sc", "--rho", "0.01",
                   "--n", "700", "--out", tmp_path / "buffer_sc.jsonl")
    assert r.returncode == 0, r.stderr
    buf = [json.loads(line) for line in (tmp_path / "buffer_sc.jsonl").read_text().splitlines()]
    assert [b["task"] for b in buf] == ["FOMC"] * 4 + ["NumGLUE-cm"] * 3
    by_key = {(x["task"], x["idx"]): x for x in rows}

    def sc(x):
        return -math.inf if not x["response"].strip() else x["mean_logprob"]
    for task, k in (("FOMC", 4), ("NumGLUE-cm", 3)):
        want = sorted((sc(x) for x in rows if x["task"] == task), reverse=True)[:k]
        got = [-math.inf if b["score"] is None else b["score"] for b in buf if b["task"] == task]
        assert got == pytest.approx(want)
    for b in buf:
        assert b["response"] == by_key[(b["task"], b["idx"])]["response"] and b["scorer"] == "sc"


def test_rollout_checkpoint_without_tokenizer_fails_naming_it(ckpt, data_root, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((ckpt / f).read_bytes())
    out = tmp_path / "r.jsonl"
    r = run_script("rollout.py", "--ckpt", bare, "--data", data_root, "--out", out, "--quiet")
    assert r.returncode != 0
    assert str(bare) in r.stderr and "tokenizer.json" in r.stderr
    assert not out.exists()


def test_rollout_unknown_task_fails(ckpt, data_root, tmp_path, capsys):
    import rollout
    with pytest.raises(SystemExit) as e:  # a flag error: argparse's exit 2 with the flag named
        rollout.main(["--ckpt", str(ckpt), "--data", str(data_root), "--tasks", "FOMC,NotATask",
                      "--out", str(tmp_path / "r.jsonl"), "--quiet"])
    assert e.value.code == 2 and "argument --tasks: unknown task 'NotATask'" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()


def test_rollout_with_vllm_stand_in(monkeypatch, ckpt, data_root, tmp_path):
    """rollout.py over the vLLM path: chat-templated token-id prompts in, decoded responses + sampled log-probs out."""
    import rollout
    mod, calls = fake_vllm(True)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    out = rollout.main(["--ckpt", str(ckpt), "--data", str(data_root), "--tasks", "NumGLUE-cm", "--engine", "vllm",
                        "--out", str(tmp_path / "r.jsonl"), "--quiet"])
    from model.tokenizer import ChatTokenizer
    tok = ChatTokenizer.from_dir(ckpt)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [p["prompt_token_ids"] for p in calls["prompts"]] == [tok.prompt_ids(x["prompt"]) for x in rows]
    assert calls["params"]["temperature"] == 0.1 and calls["params"]["max_tokens"] == 512
    for i, x in enumerate(rows):
        assert x["logprobs"] == [-1.0 - i, -1.5 - i, -2.0 - i]
        assert x["response"] == tok.decode(x["token_ids"][:-1] if x["token_ids"][-1] in tok.stop_ids
                                           else x["token_ids"])


def test_rollout_refuses_a_length_cap_past_the_model_context_before_loading(ckpt, data_root, tmp_path, monkeypatch):
    """--max-new-tokens 10**9 would size the KV cache for 10**9 columns: one line naming the flag and the model's
    context, before the weights load or the engine allocates anything."""
    import rollout
    from common.errors import InputError

    def never(*a, **kw):
        raise AssertionError("the weights were loaded or sampling started")
    monkeypatch.setattr(sampling, "load_native", never)
    monkeypatch.setattr(sampling, "generate", never)
    with pytest.raises(InputError, match=r"^--max-new-tokens: 1000000000 new tokens "
                                         r"is more than the model's context \(max_position_embeddings 4096 in "):
        rollout.main(["--ckpt", str(ckpt), "--data", str(data_root), "--max-new-tokens", str(10**9), "--engine",
                      "native", "--out", str(tmp_path / "r.jsonl"), "--quiet"])
    assert not (tmp_path / "r.jsonl").exists()


# --- rollout.py --check-logprobs: engine vs trainer ----------------------------------------------------------------

def test_check_logprobs_native_engine_agrees(ckpt, data_root, tmp_path, capsys):
    import rollout
    out = rollout.main(["--ckpt", str(ckpt), "--data", str(data_root), "--max-new-tokens", "6", "--engine", "native",
                        "--temperature", "1.0", "--check-logprobs", "4", "--out", str(tmp_path / "r.jsonl"),
                        "--quiet"])
    summary = json.loads(rollout.summary_path(out).read_text())
    check = summary["logprob_check"]
    assert check["k"] == 4 and len(set(check["checked"])) == 4 and check["tokens"] >= 4
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert check["tokens"] == sum(rows[i]["num_tokens"] for i in check["checked"])
    assert check["max_abs_dlogp"] <= 1e-4 and check["mean_abs_dlogp"] <= 1e-4 and abs(check["k3_kl"]) <= 1e-8
    assert not check["warned"] and "WARNING" not in capsys.readouterr().err
    assert summary["n"] == len(rows) == 9 and summary["tasks"]["FOMC"]["n"] == 5
    # off: no check, no model load
    out = rollout.main(["--ckpt", str(ckpt), "--data", str(data_root), "--max-new-tokens", "2", "--engine", "native",
                        "--check-logprobs", "0", "--out", str(tmp_path / "r0.jsonl"), "--quiet"])
    assert json.loads(rollout.summary_path(out).read_text())["logprob_check"] is None


def test_check_logprobs_reports_and_warns_on_a_stand_in_engine_with_planted_errors(monkeypatch, ckpt, data_root,
                                                                                  tmp_path, capsys):
    """The stand-in is the native engine whose reported log-prob of every rollout's first token is 0.4 too high."""
    import rollout
    real = sampling.generate

    def planted(*a, **kw):
        outs = real(*a, **kw)
        for o in outs:
            o["logprobs"][0] += 0.4
        return outs
    monkeypatch.setattr(sampling, "generate", planted)
    out = rollout.main(["--ckpt", str(ckpt), "--data", str(data_root), "--max-new-tokens", "5", "--engine", "native",
                        "--temperature", "1.0", "--check-logprobs", "6", "--seed", "2", "--out",
                        str(tmp_path / "r.jsonl"), "--quiet"])
    check = json.loads(rollout.summary_path(out).read_text())["logprob_check"]
    n = check["tokens"]
    assert check["k"] == 6 and n > 6  # some rollouts have more than the one planted token
    assert check["max_abs_dlogp"] == pytest.approx(0.4, abs=1e-4)
    assert check["mean_abs_dlogp"] == pytest.approx(6 * 0.4 / n, abs=1e-4)
    assert check["k3_kl"] == pytest.approx(6 * (math.exp(-0.4) - 1 + 0.4) / n, abs=1e-4)
    assert check["warned"]  # mean 2.4 / n > 0.01 for any n this small
    err = capsys.readouterr().err
    assert "WARNING" in err and "disagree with the trainer" in err
