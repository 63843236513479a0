"""train.py --wandb DIR, offline (WANDB_MODE=offline): the run file W&B writes into DIR, read back with W&B's own
record format (wandb.proto), holds every step's numbers as train.py's log has them; without the package the flag is
one line before any work."""
import glob
import json
import os
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import forkserver
from tiny import make_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def wandb_history(run_file: str) -> list[dict]:
    """The history records of a .wandb file: W&B's log format (a 7-byte header, then 32 KiB blocks of records, each
    a 7-byte header: crc32, length, type full / first / middle / last) of wandb.proto Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, block, records, part = Path(run_file).read_bytes(), 7, 32 * 1024, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            records.append(part)
    out = []
    for d in records:
        r = pb.Record()
        r.ParseFromString(d)
        if r.WhichOneof("record_type") == "history":
            out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_env(tmp_path_factory.mktemp("wandb"))


def train(env, out, *extra, **env_extra):
    e = dict(env["env"], WANDB_MODE="offline", **env_extra)
    return forkserver.run([sys.executable, str(REPO / "train.py"), "--model", str(env["base"]), "--data",
                           str(env["data"] / "FOMC" / "train.json"), "--out", str(out), "--epochs", "2",
                           "--global-batch", "2", "--quiet", *map(str, extra)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=600)


def test_offline_run_holds_every_step(env, tmp_path):
    pytest.importorskip("wandb")
    r = train(env, tmp_path / "ck", "--wandb", tmp_path / "wb")
    assert r.returncode == 0, r.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "ck" / "train_log.jsonl").read_text().splitlines()]
    files = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    history = wandb_history(files[0])
    assert [h["_step"] for h in history] == [rec["step"] for rec in log] == [1, 2, 3, 4]
    for h, rec in zip(history, log):
        assert h["train/loss"] == rec["loss"] and h["train/lr"] == rec["lr"] and h["train/tokens"] == rec["tokens"]


def test_without_the_package_it_is_one_line(env, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")  # import wandb fails
    r = train(env, tmp_path / "ck", "--wandb", tmp_path / "wb", PYTHONPATH=str(hide))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "pip install wandb" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "ck").exists() and not (tmp_path / "wb").exists()


def test_run_py_logs_each_stage_to_its_own_run(env, tmp_path):
    """run.py --wandb: one offline W&B run per training stage, under RUN/wandb/<step>, each holding that stage's
    steps as its train_log.jsonl has them; the step keys are those of a run without the flag."""
    pytest.importorskip("wandb")
    from tiny import run_args
    e = dict(env["env"], WANDB_MODE="offline")
    cmd = [sys.executable, str(REPO / "run.py"), *map(str, run_args(env, tmp_path)), "--wandb"]
    r = forkserver.run(cmd, cwd=REPO, env=e, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "run"
    trains = sorted(d.name for d in (out / "steps").iterdir() if "-train-" in d.name)
    assert trains and sorted(d.name for d in (out / "wandb").iterdir()) == trains
    for key in trains:
        log = [json.loads(line) for line in (out / "steps" / key / "ckpt" / "train_log.jsonl").read_text().splitlines()]
        files = glob.glob(str(out / "wandb" / key / "wandb" / "offline-run-*" / "run-*.wandb"))
        assert len(files) == 1 and [h["train/loss"] for h in wandb_history(files[0])] == [x["loss"] for x in log]
    again = forkserver.run([sys.executable, str(REPO / "run.py"), *map(str, run_args(env, tmp_path)), "--dry-run"],
                           cwd=REPO, env=e, capture_output=True, text=True, timeout=900)  # without --wandb
    n = len(json.loads((out / "manifest.json").read_text()))
    assert again.returncode == 0 and f"{n} steps ({n} already done)" in again.stdout, again.stdout[-2000:]
