"""The GPU suite: the CUDA paths that the CPU suite can only check by contract, run for real.

    python -m pytest -m gpu tests        # the install check on a GPU machine (README, "GPU setup")

Every test here is marked `gpu` and skipped without CUDA (the CPU suite collects and skips them). What each checks:
  - train.py in bf16 on CUDA on a small random-init model follows the fp32 CPU run's loss curve (within 2 % per step),
    compiled (its default there) and eager alike
  - every attention backend that can run here (flash-attn, torch varlen, the SDPA loop) equals the fp32 SDPA loop,
    forward and backward, on packed bf16 documents with GQA
  - liger's fused linear cross-entropy equals our chunked one on CUDA, loss and gradients, fp32 and bf16
  - the native sampler's raw log-probs on CUDA equal a teacher-forced forward pass of the sampled tokens
  - the sampler's int32 hash and its high-temperature draw give the CPU's words and tokens on CUDA
  - FSDP2 on NCCL with every visible GPU (torchrun) equals the one-process fp32 CPU run, step by step
  - vLLM's raw log-probs equal the trainer's model on the same tokens (only where vLLM is installed)
Tolerances are stated at each assertion, with the reason.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (the gpu suite: python -m pytest -m gpu tests)")]


# ---------------------------------------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    return {**e, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random-init tiny Llama (GQA 4/2 heads, tied embeddings) and 64 examples of the embedded C-STANCE task."""
    from data.embedded import ensure_embedded
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("gpu")
    write_random_tiny(root / "base")
    data = ensure_embedded(root / "data", n_train=64, n_eval=8, n_test=8) / "C-STANCE" / "train.json"
    return dict(root=root, base=root / "base", data=data)


def run_train(setup, out: Path, *extra, gpus: int = 0, env=None) -> tuple[list[dict], str]:
    """train.py on the CPU (gpus=0: CUDA hidden), one GPU (gpus=1) or torchrun over `gpus` GPUs; returns its log."""
    launcher = [sys.executable]
    if gpus > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(gpus), "--master_port", str(free_port())]
    cmd = launcher + [str(REPO / "train.py"), "--model", str(setup["base"]), "--data", str(setup["data"]),
                      "--out", str(out), "--epochs", "2", "--global-batch", "8", "--micro-tokens", "512",
                      "--max-len", "512", "--lr", "1e-3", "--save-every", "0", "--quiet", *extra]
    e = clean_env(**(env or {}))
    if gpus == 0:
        e["CUDA_VISIBLE_DEVICES"] = ""
    p = subprocess.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"train.py failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()], p.stdout


@pytest.fixture(scope="module")
def cpu_fp32_log(setup):
    log, stdout = run_train(setup, setup["root"] / "cpu-fp32")
    assert "cpu, float32" in stdout
    return log


# ---------------------------------------------------------------------------------------------- train.py

def test_bf16_training_follows_the_fp32_cpu_loss_curve(setup, cpu_fp32_log):
    from kernels import attention
    log, stdout = run_train(setup, setup["root"] / "cuda-bf16", "--dtype", "bf16", gpus=1)
    assert "cuda, bfloat16" in stdout
    # the log names the attention backend the defaults pick here (flash-attn, else torch varlen, else SDPA)
    default = next(b for b in attention.BACKENDS if attention.available(b) is None)
    assert f"kernels: attention {default}" in stdout, stdout
    assert [r["step"] for r in log] == [r["step"] for r in cpu_fp32_log]
    # bf16 keeps ~3 significant digits in the activations (fp32 master weights and reductions): over 16 steps
    # at lr 1e-3 the curves may drift apart by rounding, not by a wrong kernel; a wrong mask or loss scale moves
    # the loss by far more than 2 %
    for a, b in zip(cpu_fp32_log, log):
        assert abs(a["loss"] - b["loss"]) <= 0.02 * a["loss"], (a, b)
        assert a["target_tokens"] == b["target_tokens"]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"]  # it learns


def test_compiled_bf16_training_tracks_eager_bf16(setup):
    """train.py compiles its blocks by default on CUDA in bf16 (fullgraph: a graph break fails the run); it must
    follow the eager bf16 run: kernels that fuse differently round bf16 activations differently, so 2 % per step,
    as against the CPU; a wrong kernel moves it by far more."""
    compiled, stdout = run_train(setup, setup["root"] / "cuda-compiled", "--dtype", "bf16", gpus=1)
    assert "compiled blocks" in stdout, stdout
    eager, stdout = run_train(setup, setup["root"] / "cuda-eager", "--dtype", "bf16", "--no-compile", gpus=1)
    assert "compiled blocks" not in stdout
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 0.02 * a["loss"], (a, b)
        assert a["target_tokens"] == b["target_tokens"]


def test_fsdp2_on_nccl_with_every_gpu_equals_the_cpu_process(setup, cpu_fp32_log):
    """torchrun with one rank per visible GPU, fp32: same plan, same losses and grad norms as one CPU process
    (gradients summed over ranks, loss divided by the global token count). fp32 on both sides (TF32 is off for
    matmuls by default), so only summation order differs: 1e-4 relative."""
    n = torch.cuda.device_count()
    log, stdout = run_train(setup, setup["root"] / f"nccl-{n}", "--dtype", "fp32", gpus=n)
    assert f"on {n} rank(s) (FSDP2), cuda, float32" in stdout, stdout
    for a, b in zip(cpu_fp32_log, log, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * a["loss"], (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * a["grad_norm"], (a, b)


# ---------------------------------------------------------------------------------------------- kernels

def cu_seqlens_of(lengths, device):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)


@pytest.mark.parametrize("backend", ["flash", "torch_varlen", "sdpa"])
def test_attention_backend_matches_sdpa_forward_and_backward(backend, monkeypatch):
    from kernels import attention
    reason = attention.available(backend)
    if reason is not None:
        pytest.skip(f"attention backend {backend!r} cannot run here: {reason}")
    monkeypatch.setattr(attention, "_BACKEND", attention._BACKEND)
    monkeypatch.setattr(attention, "_FORCED", attention._FORCED)
    torch.manual_seed(0)
    lengths = [1, 7, 128, 300, 33, 2]  # a 1-token document, one longer than a 128 tile, ragged ends
    cu = cu_seqlens_of(lengths, "cuda")
    T, Hq, Hkv, D = sum(lengths), 8, 2, 64
    q, k, v = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (Hq, Hkv, Hkv))
    g = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)

    attention.set_backend(backend)
    out = attention.varlen_attention(q, k, v, cu, max(lengths))
    grads = torch.autograd.grad((out.float() * g.float()).sum(), (q, k, v))
    assert out.dtype == torch.bfloat16 and out.shape == (T, Hq, D)

    attention.set_backend("sdpa")  # the reference: the SDPA loop in fp32 on the same (bf16-rounded) inputs
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = attention.varlen_attention(q32, k32, v32, cu, max(lengths))
    ref_grads = torch.autograd.grad((ref * g.float()).sum(), (q32, k32, v32))

    def rel(a, b):
        return ((a.float() - b).norm() / b.norm()).item()
    # bf16 output rounding (2^-8 relative) plus bf16 P@V inside the kernel: 1 % relative is a wide margin for a
    # correct kernel and far below what a wrong mask (a document seeing its neighbour) produces
    assert rel(out, ref) <= 1e-2, rel(out, ref)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert rel(a, b) <= 2e-2, (name, rel(a, b))
    if backend != "sdpa":  # as a default (not forced) a GPU backend leaves fp32 tensors to the SDPA loop
        attention.set_backend(backend, forced=False)
        torch.testing.assert_close(attention.varlen_attention(q32, k32, v32, cu, max(lengths)), ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_matches_chunked_cross_entropy_loss_and_grads(dtype, monkeypatch):
    pytest.importorskip("liger_kernel")
    from kernels import cross_entropy
    monkeypatch.setattr(cross_entropy, "_BACKEND", cross_entropy._BACKEND)
    monkeypatch.setattr(cross_entropy, "_FORCED", cross_entropy._FORCED)
    torch.manual_seed(0)
    N, H, V = 1000, 256, 32000
    hidden = torch.randn(N, H, device="cuda").to(dtype).requires_grad_()
    weight = (0.05 * torch.randn(V, H, device="cuda")).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda")
    labels[::7] = -100

    results = {}
    for name in ("liger", "chunked"):
        cross_entropy.set_backend(name)
        hidden.grad = weight.grad = None
        loss = cross_entropy.fused_linear_cross_entropy(hidden, weight, labels)
        loss.backward()
        results[name] = (loss.item(), hidden.grad.float().clone(), weight.grad.float().clone())
    (l1, gh1, gw1), (l2, gh2, gw2) = results["liger"], results["chunked"]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    # both accumulate in fp32; bf16 only rounds the inputs (the same for both) and the returned gradients
    tol_loss, tol_grad = (1e-5, 1e-4) if dtype == torch.float32 else (1e-3, 1e-2)
    assert abs(l1 - l2) <= tol_loss * abs(l2), (l1, l2)
    assert rel(gh1, gh2) <= tol_grad and rel(gw1, gw2) <= tol_grad, (rel(gh1, gh2), rel(gw1, gw2))


# ---------------------------------------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def cuda_models(setup):
    from model.checkpoint import load_model
    return {dtype: load_model(setup["base"], device="cuda", dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}


PROMPTS = [[5, 17, 33, 2, 9, 41, 12, 7], [88, 3], [120, 6, 200, 14, 99], [42, 42, 42, 11, 250, 8, 19, 60, 4, 77, 31]]


def teacher_forced(model, prompt, response):
    ids = torch.tensor(prompt + response, device="cuda")[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, torch.arange(ids.shape[1], device="cuda")[None])[0].float(), -1)
    return logp[len(prompt) - 1:-1].gather(-1, torch.tensor(response, device="cuda")[:, None]).squeeze(-1).cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sampler_logprobs_equal_teacher_forced_on_cuda(cuda_models, dtype):
    from engine.native import sample
    model = cuda_models[dtype]
    outs = sample(model, PROMPTS, temperature=1.0, max_new_tokens=24, seed=0, batch_size=4, progress=False)
    # fp32: only summation order differs (batched, left-padded, KV-cached vs one unpadded pass);
    # bf16: both passes round activations to bf16 at different points, so a token's log-prob may move by a few
    # hundredths; the mean stays small
    tol_max, tol_mean = (1e-3, 1e-4) if dtype == torch.float32 else (0.15, 0.03)
    diffs = []
    for p, o in zip(PROMPTS, outs):
        assert len(o["token_ids"]) == len(o["logprobs"]) == 24
        diffs.append((teacher_forced(model, p, o["token_ids"]) - torch.tensor(o["logprobs"])).abs())
    diffs = torch.cat(diffs)
    assert diffs.max() <= tol_max and diffs.mean() <= tol_mean, (diffs.max().item(), diffs.mean().item())


def test_vllm_raw_logprobs_equal_the_trainers_model(setup, cuda_models):
    pytest.importorskip("vllm")
    from engine.sampling import generate
    outs = generate(setup["base"], PROMPTS, temperature=1.0, max_new_tokens=24, seed=0, engine="vllm",
                    stop_ids=(), progress=False)
    # vLLM runs this fp32 checkpoint in its own default dtype (bf16 or fp16 on most versions): compare with our
    # bf16 model at the bf16 tolerance above; raw log-probs (before temperature), so temperature 1 vs 0.1 is moot
    diffs = torch.cat([(teacher_forced(cuda_models[torch.bfloat16], p, o["token_ids"]) -
                        torch.tensor(o["logprobs"])).abs() for p, o in zip(PROMPTS, outs)])
    assert diffs.max() <= 0.15 and diffs.mean() <= 0.03, (diffs.max().item(), diffs.mean().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_cuda_graphs_give_the_eager_steps_tokens(setup, dtype):
    """The captured decode step (CUDA graphs per batch bucket and span, pad rows in free slots) against the same
    engine run eagerly: continuous batching through 6 slots, 40 prompts of 2-300 tokens (spans 256 and 512), repeats
    and a shared 40-token instruction (prefix copies on CUDA), stops, two calls over one engine (the second replays
    the first's graphs). fp32: only GEMM shapes differ (a bucket pads rows), so tokens agree and log-probs within
    fp32 rounding; bf16: the same kernels round alike in both, tokens may part after a near-tie, log-probs close."""
    from model.checkpoint import load_model
    from engine.engine import Engine
    model = load_model(setup["base"], device="cuda", dtype=dtype)
    g = torch.Generator().manual_seed(0)
    instruction = torch.randint(3, 250, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 250, (int(torch.randint(2, 300, (1,), generator=g)),), generator=g).tolist()
               for _ in range(30)]
    prompts += [instruction + [5 + i, 9] for i in range(6)] + [prompts[3]] * 4
    runs = {}
    for graphs in (True, False):
        eng = Engine(model, max_seqs=6, graphs=graphs)
        for call in range(2):
            runs[graphs, call] = eng.run(prompts, temperature=1.0, max_new_tokens=100, stop_ids={7, 11}, seed=1,
                                         progress=False)
        assert len(eng._graphs) > 1 if graphs else not eng._graphs
    ref = runs[False, 0]
    for key, outs in runs.items():
        same = [o["token_ids"] == r["token_ids"] for o, r in zip(outs, ref)]
        diffs = [abs(a - b) for o, r, eq in zip(outs, ref, same) if eq for a, b in zip(o["logprobs"], r["logprobs"])]
        if dtype == torch.float32:
            assert all(same) and max(diffs) <= 1e-4, (key, max(diffs))
        else:
            assert sum(same) >= 0.8 * len(same) and sorted(diffs)[len(diffs) // 2] <= 0.02, (key, sum(same))
    assert any(o["finish_reason"] == "stop" for o in ref) and any(o["finish_reason"] == "length" for o in ref)


def test_engine_per_prompt_seeds_do_not_depend_on_the_batch_on_cuda(cuda_models):
    """The keyed noise is the same integer hash on the GPU: a prompt's sampled tokens with its own seed do not
    depend on its neighbours (fp32: the logits do not move across batch compositions beyond rounding)."""
    from engine.native import sample
    model = cuda_models[torch.float32]
    seeds = [11, 12, 13, 14]
    together = sample(model, PROMPTS, temperature=1.0, max_new_tokens=16, seeds=seeds, progress=False)
    alone = [sample(model, [p], temperature=1.0, max_new_tokens=16, seeds=[s], progress=False)[0]
             for p, s in zip(PROMPTS, seeds)]
    assert [o["token_ids"] for o in together] == [o["token_ids"] for o in alone]


def test_the_samplers_hash_and_high_temperature_draw_are_the_cpus_on_cuda():
    """The int32 hash wraps its products on CUDA as on the CPU (the same words), and the high-temperature draw on
    CUDA picks the full draw's tokens, which are the CPU's: a prompt's tokens do not depend on the device."""
    from engine.sampler import _full_draw, _sample_thresholded, hash32
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randint(0, 1 << 32, (1 << 20,), generator=g), torch.tensor([0, (1 << 31) - 1, 1 << 31,
                                                                                      (1 << 32) - 1])])
    assert torch.equal(hash32(x.cuda()).cpu(), hash32(x))
    logits = torch.randn(64, 49152, generator=g) * 4
    keys, counters = torch.randint(0, 1 << 62, (64,), generator=g), torch.randint(0, 512, (64,), generator=g)
    cpu = _full_draw(logits, 1.0, keys, counters)
    assert torch.equal(_sample_thresholded(logits.cuda(), 1.0, keys.cuda(), counters.cuda()).cpu(), cpu)
    assert torch.equal(_full_draw(logits.cuda(), 1.0, keys.cuda(), counters.cuda()).cpu(), cpu)
