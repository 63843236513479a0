"""The generation layout (run.py --tp, pipeline.layout.generation_layout): DP = GPUs / TP workers of TP GPUs each.

The default TP is valid for the shipped model configs (bench/configs) on 8 GPUs and the smallest that holds the
weights, so every GPU generates; a
TP that vLLM's head rule, the GPU count or the engine cannot take is refused in one line before anything is
written; the planner's generation hours follow the layout; and run.py --dry-run prices a run from a model's
config.json alone.
"""
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import plan
from model.checkpoint import load_config
from model.costs import (GEN_TOK_S, GPU_MEMORY_GB, PREFILL_FACTOR, STEP_OVERHEAD_S, Layout, Profile, StepCost,
                         price, train_tok_s)
from pipeline.layout import TP_SIZES, WEIGHT_SHARE, generation_layout, heads_refusal
from model.config import ModelConfig
from common.errors import UserError
import forkserver

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "bench" / "configs"
SMALL = ["--tasks", "C-STANCE,Py150", "--methods", "sft,opr-ru", "--n-train", "8", "--n-test", "4", "--rho", "0.5"]


@pytest.fixture(scope="module")
def qwen7b():
    return load_config(CONFIGS / "qwen2.5-7b")


@pytest.fixture
def config_only(tmp_path):
    """A model directory holding only Qwen2.5-7B's config.json: no weights, no tokenizer."""
    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    shutil.copy(CONFIGS / "qwen2.5-7b" / "config.json", model / "config.json")
    return model


def run_py(tmp_path, model, *extra):
    cmd = [sys.executable, str(REPO / "run.py"), "--model", str(model), *SMALL, "--out", str(tmp_path / "run"),
           *extra]
    env = {**os.environ, "OPR_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    return forkserver.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


# ---- the rule -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads, kv, tp, ok", [
    (28, 4, 8, False),   # Qwen2.5-7B on 8: 28 % 8 (vllm issue 11797)
    (28, 4, 4, True), (28, 4, 2, True), (28, 4, 1, True),
    (28, 4, 14, False),  # the attention heads divide, but 14 GPUs cannot each replicate one of 4 key-value heads
    (32, 8, 16, True),   # 8 key-value heads replicated twice over 16 GPUs
    (32, 8, 4, True),    # 2 key-value heads per GPU
    (24, 6, 4, False),   # 24 attention heads divide by 4, 6 key-value heads do not
    (9, 3, 3, True),     # SmolLM2-135M
    (9, 3, 2, False),
])
def test_heads_rule_is_vllms(heads, kv, tp, ok):
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv)
    assert (heads_refusal(cfg, tp) is None) == ok


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.iterdir()))
def test_default_layout_on_8_gpus_is_valid_and_uses_every_gpu(name):
    """Every GPU generates (DP x TP = 8), at the smallest TP the heads take that holds the weights in WEIGHT_SHARE of
    a GPU."""
    cfg = load_config(CONFIGS / name)
    layout = generation_layout(8, None, cfg, name)
    assert layout.tp in TP_SIZES and layout.dp * layout.tp == 8
    assert heads_refusal(cfg, layout.tp) is None
    weights_gb = 2 * cfg.num_params(embeddings=True) / 1e9
    assert weights_gb / layout.tp <= WEIGHT_SHARE * GPU_MEMORY_GB
    assert all(heads_refusal(cfg, t) is not None or weights_gb / t > WEIGHT_SHARE * GPU_MEMORY_GB
               for t in TP_SIZES if t < layout.tp)


def test_qwen7b_defaults_to_a_worker_per_gpu(qwen7b):
    """vllm issue 11797: Qwen2.5-7B's 28 heads refuse TP 8; its 15 GB of bf16 weights fit one H100, so 8 workers of
    TP 1 (the paper ran TP 4: --tp 4 gives 2 workers)."""
    layout = generation_layout(8, None, qwen7b, "q")
    assert str(layout) == "DP 8 x TP 1 on 8 GPUs" and "smallest TP" in layout.why
    assert str(generation_layout(8, 4, qwen7b, "q")) == "DP 2 x TP 4 on 8 GPUs"
    assert str(generation_layout(4, 2, qwen7b, "q")) == "DP 2 x TP 2 on 4 GPUs"


def test_a_model_too_big_for_one_gpu_gets_the_tp_that_holds_it():
    """A 70B-class config (140 GB of bf16 weights): TP 4 is the smallest that leaves half of each 80 GB GPU free."""
    cfg = ModelConfig(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128)
    layout = generation_layout(8, None, cfg, "big")
    assert (layout.dp, layout.tp) == (2, 4)


def test_cpu_and_native_layouts(qwen7b):
    """A CPU run has --gen-workers workers at --tp 1 (its step keys pass --tp 1, as before the flag); the native
    engine has no tensor parallelism: a worker per GPU."""
    assert generation_layout(0) == Layout(0, 1, 1, "the CPU")
    assert generation_layout(0, 1, cpu_workers=2) == Layout(0, 1, 2, "the CPU")
    native = generation_layout(8, None, qwen7b, "q", engine="native")
    assert (native.dp, native.tp) == (8, 1)
    with pytest.raises(UserError, match=r"^--tp 2: a CPU run \(--gpus 0\)"):
        generation_layout(0, 2)
    with pytest.raises(UserError, match="^--tp 4: the native engine has no tensor parallelism"):
        generation_layout(8, 4, qwen7b, "q", engine="native")
    with pytest.raises(UserError, match=r"^--tp 4: does not divide --gpus 6 .*; use 1 or 2$"):
        generation_layout(6, 4, qwen7b, "q")
    with pytest.raises(UserError, match=r"^--gen-workers 2: on GPUs the workers are --gpus / --tp"):
        generation_layout(8, None, qwen7b, "q", cpu_workers=2)


def test_help_states_the_default_rule(capsys):
    import run
    with pytest.raises(SystemExit) as e:
        run.parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("Default: the smallest of 1, 2, 4, 8 that does so and holds the weights in 0.5 of a GPU's memory; 1 "
            "with the native engine and on the CPU") in text


# ---- run.py's refusals: one line, before anything is written -------------------------------------------------------
@pytest.mark.parametrize("extra, named", [
    (["--gpus", "8", "--tp", "8"], "--tp 8: Qwen2.5-7B-Instruct's 28 attention heads do not divide by 8; use 1, 2 or 4"),
    (["--gpus", "8", "--tp", "3", "--engine", "vllm"], "--tp 3: does not divide --gpus 8"),
    (["--gpus", "8", "--tp", "16", "--engine", "vllm"], "--tp 16: more than --gpus 8"),
    (["--gpus", "0", "--tp", "2"], "--tp 2: a CPU run (--gpus 0) has no tensor parallelism"),
    (["--gpus", "8", "--gen-workers", "2"], "--gen-workers 2: on GPUs the workers are --gpus / --tp"),
    (["--gpus", "8", "--tp", "4", "--engine", "native"], "--tp 4: the native engine has no tensor parallelism"),
])
def test_a_tp_the_run_cannot_launch_is_refused_in_one_line(tmp_path, config_only, extra, named):
    for dry in ([], ["--dry-run"]):
        r = run_py(tmp_path, config_only, *extra, *dry)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"run.py: error: {named}") and len(r.stderr.splitlines()) == 1, r.stderr
        assert r.stdout == ""
        # nothing written: no run directory, not even the embedded benchmark's cache, the model directory as it was
        assert sorted(p.name for p in tmp_path.iterdir()) == ["Qwen2.5-7B-Instruct"]
        assert [p.name for p in config_only.iterdir()] == ["config.json"]


# ---- the planner follows the layout -------------------------------------------------------------------------------
def rollout_cost(cfg, layout: Layout, overhead_s: float = 120.0) -> StepCost:
    c = StepCost("s1-rollout", "rollout", [], prompts=10**4, prompt_tokens=10**7, new_tokens_est=10**8,
                      new_tokens_max=5 * 10**8)
    price(c, cfg, Profile(gpus=layout.gpus, overhead_s=overhead_s, layout=layout))
    return c


def test_generation_hours_follow_the_layout(qwen7b):
    """The same rollout on DP 1, 2 and 4 workers of TP 4: its work's wall time falls as 1/DP while its GPU-hours stay
    (each worker its share, all at once; the start-up is paid once per step in wall time, on every GPU held); a node
    on which one worker generates while the other GPUs wait pays twice the GPU-hours
    of DP 2 for the same wall time as DP 1 (what run.py launches today: one worker). With every GPU generating, the price is the one the planner gave before
    layouts: start-up on every GPU + the work's GPU-seconds."""
    start = 120.0 / 3600
    dp = {n: rollout_cost(qwen7b, Layout(4 * n, 4, n)) for n in (1, 2, 4)}
    work = {n: c.wall_hours - start for n, c in dp.items()}
    assert work[1] > 1 and work[2] == pytest.approx(work[1] / 2) and work[4] == pytest.approx(work[1] / 4)
    gpu_work = {n: c.gpu_hours - 4 * n * start for n, c in dp.items()}
    assert gpu_work[2] == pytest.approx(gpu_work[1]) and gpu_work[4] == pytest.approx(gpu_work[1])
    assert all(c.gpu_hours == pytest.approx(c.wall_hours * 4 * n) for n, c in dp.items())

    idle = rollout_cost(qwen7b, Layout(8, 4, 1))
    assert idle.wall_hours == pytest.approx(dp[1].wall_hours)
    assert idle.gpu_hours == pytest.approx(2 * dp[1].gpu_hours)
    assert idle.gpu_hours - 8 * start == pytest.approx(2 * (dp[2].gpu_hours - 8 * start))

    tps = train_tok_s(qwen7b, 512, Profile())
    before = 8 * start + (10**8 / GEN_TOK_S + 10**7 / (PREFILL_FACTOR * tps)) / 3600
    for layout in (Layout(8, 1, 8), Layout(8, 4, 2)):
        assert rollout_cost(qwen7b, layout).gpu_hours == pytest.approx(before)
    assert rollout_cost(qwen7b, Layout(8, 4, 2)).gpu_hours_max > before


def test_dry_run_from_config_json_alone_prices_the_layout(tmp_path, config_only):
    """run.py --gpus 8 --dry-run on a directory holding only config.json: a valid layout, printed; token counts
    estimated (said so); nothing written. A generating step on 2 workers of TP 4 costs what one worker of TP 4 on 4
    GPUs costs, plus the start-up on the 4 more GPUs it holds (its work is shared, not repeated)."""
    out = {}
    for gpus, tp in ((8, None), (8, 4), (4, 4)):
        r = run_py(tmp_path, config_only, "--gpus", str(gpus), "--engine", "vllm", "--dry-run",
                   *(["--tp", str(tp)] if tp else []))
        assert r.returncode == 0, r.stderr
        assert "holds no tokenizer.json" in r.stdout and "holds no weights" in r.stdout
        out[gpus, tp] = r.stdout
    assert not (tmp_path / "run").exists() and [p.name for p in config_only.iterdir()] == ["config.json"]

    assert "generation: DP 8 x TP 1 on 8 GPUs (default: the smallest TP" in out[8, None]
    # the disk the kept checkpoints take: 3 train steps (stage 1 shared, stage 2 of sft and of opr-ru), bf16
    from plan import gb
    params = load_config(config_only).num_params(embeddings=True)
    assert f"disk: 3 stage checkpoints of {gb(2 * params)} each kept in steps/ = {gb(6 * params)}, plus " \
           f"{gb(12 * params)} of resumable state per stage while it trains" in out[8, None]
    assert "generation: DP 2 x TP 4 on 8 GPUs (--tp 4)" in out[8, 4]
    assert "generation: DP 1 x TP 4 on 4 GPUs (--tp 4)" in out[4, 4]

    on8, on4 = (list(plan.parse_plan(out[key]).values()) for key in ((8, 4), (4, 4)))
    assert [s["kind"] for s in on8] == [s["kind"] for s in on4]
    generating = [(a, b) for a, b in zip(on8, on4) if a["kind"] in ("eval", "rollout", "drift")]
    assert {a["kind"] for a, _ in generating} == {"eval", "rollout", "drift"}
    for a, b in generating:  # (printed to 0.01)
        assert a["gpu_hours"] == pytest.approx(b["gpu_hours"] + 4 * STEP_OVERHEAD_S / 3600, abs=0.021)


def test_dry_run_with_gpus_plans_the_gpu_machines_engine(tmp_path, config_only):
    """--engine auto in a --dry-run with --gpus is what the GPU machine would pick (vLLM), not this CPU machine's
    native engine: --tp 4 plans, where a real run here is refused (no CUDA, no vLLM)."""
    r = run_py(tmp_path, config_only, "--gpus", "8", "--tp", "4", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "generation: DP 2 x TP 4 on 8 GPUs (--tp 4)" in r.stdout
    assert run_py(tmp_path, config_only, "--gpus", "8", "--tp", "4", "--engine", "native", "--dry-run").returncode == 2
