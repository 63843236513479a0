"""Fixtures several test files share (the functions behind them: tests/tiny.py).

- tiny_ckpt: the project's random tiny Llama (model.base.write_random_tiny) at <tmp>/tiny, one per test file: some
  files write beside it or into it (evaluate.py's default output is <ckpt>/eval)
- tiny_env: tiny.make_env's world (that checkpoint, a 2-task TRACE-layout data root, a rollout file, the scripts'
  environment), one per test file
- pair: (transformers' model, ours loaded from its checkpoint, the checkpoint) for each of tiny.HF_ARCHS, one per
  test file (test_transformer.py, test_checkpoint.py); the tests only read them
- ckpts: drift's world, a directory with prev (tiny.write_checkpoint), cur (a perturbed copy) and same (an identical
  copy), one per test file; the tests only read them
- train_ckpt, train_ckpt_tied: train.py's tiny checkpoints (transformers-built, untied and tied embeddings, with an
  SFT file), built once per session; the tests only read them
"""
import os
import shutil

import pytest

import tiny

# vLLM's engine processes (test_vllm_engine.py, started by the scripts the tests run) bind and advertise this
# address: loopback only, never the machine's other addresses
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from model.base import write_random_tiny
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_random_tiny(path)
    return path


@pytest.fixture(scope="module")
def tiny_env(tmp_path_factory):
    return tiny.make_env(tmp_path_factory.mktemp("env"))


@pytest.fixture(scope="session")
def train_ckpt(tmp_path_factory):
    return tiny.make_checkpoint(tmp_path_factory.mktemp("ckpt") / "untied", tied=False)


@pytest.fixture(scope="session")
def train_ckpt_tied(tmp_path_factory):
    return tiny.make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tied", tied=True)


@pytest.fixture(scope="module", params=tiny.HF_ARCHS)
def pair(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from model.checkpoint import load_model
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny.make_hf(request.param, path)
    return hf, load_model(path), path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpts")
    pytest.importorskip("transformers")
    tiny.write_checkpoint(base / "prev")
    tiny.perturbed_copy(base / "prev", base / "cur")
    shutil.copytree(base / "prev", base / "same")
    return base
