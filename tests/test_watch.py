"""Watching a run while it runs: the progress bar's live training loss (pipeline/watch.py) and the TensorBoard board
of scores that grows as steps commit (reporting.tensorboard.Board, results_scalars). The end-to-end checks against a
real run's results.json are in tests/test_run.py."""
import json

import pytest

from pipeline.watch import live_loss, steps_total, train_labels
from reporting import tensorboard


def test_live_loss_reads_the_newest_whole_record(tmp_path):
    log, out = tmp_path / "train_log.jsonl", tmp_path / "log.txt"
    assert live_loss(log, out, "s2 opr-ru seed0") is None  # not started
    log.write_text("")
    assert live_loss(log, out, "s2 opr-ru seed0") is None
    records = [{"step": s, "loss": 1.0 / s, "lr": 1e-5} for s in range(1, 15)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    log.write_text(text + '{"step": 15, "loss": 0.0')  # the writer is half-way through step 15
    assert live_loss(log, out, "s2 opr-ru seed0") == "loss=0.07143 (s2 opr-ru seed0 step 14)"
    out.write_text("train.py: 160 examples (0 longer than 512 dropped), 9000 tokens, 40 steps of <= 4 sequences on "
                   "1 rank(s) (unsharded: one CPU rank, fp32), cpu, float32, 4096 tokens per micro-batch\n")
    assert live_loss(log, out, "s2 opr-ru seed0") == "loss=0.07143 (s2 opr-ru seed0 step 14/40)"
    # only the tail is read: the first line of it is cut, and skipped
    assert live_loss(log, out, "x", tail=len(json.dumps(records[-1])) + 30) == "loss=0.07143 (x step 14/40)"
    out.write_text("train.py: resumed at step 10 of 40 from /r/steps/k.tmp/ckpt.partial/state\n")
    assert steps_total(out) == 40


def test_train_labels_name_stage_method_and_seed():
    runs = {"sft": {0: [("t1", "e1"), ("ts2", "es2")]}, "opr-ru": {0: [("t1", "e1"), ("to2", "eo2")]},
            "replay": {0: [("t1", "e1"), ("tr2", "er2")]}, "mtl": {1: [("m1", "f1")]}}
    assert train_labels(runs) == {"t1": "s1 sft+2 seed0", "ts2": "s2 sft seed0", "to2": "s2 opr-ru seed0",
                                      "tr2": "s2 replay seed0", "m1": "s1 mtl seed1"}


def scalars(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_board_writes_each_scalar_once_as_results_grow(tmp_path):
    """A partial results.json, then the whole one: every scalar appears once, at its stage, in stage order; None
    values (an OPR buffer's rejected NLL of a gold buffer) are left out; the directory starts empty."""
    pytest.importorskip("tensorboard")
    root = tmp_path / "tb" / "results"
    (root / "old-seed0").mkdir(parents=True)
    (root / "old-seed0" / "events.out.tfevents.0").write_bytes(b"stale")
    seed = {"matrix": [[50.0]], "drift": [], "buffer_stats": [
        {"stage": 1, "spearman_ru_sc": None, "all": {"selected": {"nll_mean": 0.5, "nll_max": 2.0}, "rejected": None}}]}
    part = {"tasks": ["A", "B"], "methods": {"replay": {"seeds": {"0": dict(seed, cl_metrics=None)}}}}
    board = tensorboard.Board(root)
    assert not root.exists()
    board.update(tensorboard.results_scalars(part))
    board.update(tensorboard.results_scalars(part))
    got = scalars(root / "replay-seed0")
    assert got == {"a/A": [(1, 50.0)], "stage/acc_so_far": [(1, 50.0)], "buffer/selected_nll_mean": [(1, 0.5)],
                   "buffer/selected_nll_max": [(1, 2.0)]}
    whole = dict(seed, matrix=[[50.0], [25.0, 75.0]], cl_metrics={"acc": 50.0, "bwt": -25.0, "fwt": None,
                                                                     "forgetting": [25.0]},
                 drift=[{"stage": 2, "all": {"kl_per_token": 0.01, "mean_seq_kl": 0.3}}])
    board.update(tensorboard.results_scalars(dict(part, methods={"replay": {"seeds": {"0": whole}}})))
    board.close()
    got = scalars(root / "replay-seed0")
    assert got["a/A"] == [(1, 50.0), (2, 25.0)] and got["a/B"] == [(2, 75.0)]
    assert got["stage/acc_so_far"] == [(1, 50.0), (2, 50.0)]
    assert got["final/acc"] == [(2, 50.0)] and got["final/bwt"] == [(2, -25.0)] and "final/fwt" not in got
    assert got["drift/kl_per_token"] == [(2, pytest.approx(0.01))] and got["drift/mean_seq_kl"][0][0] == 2
    assert sorted(p.name for p in root.iterdir()) == ["replay-seed0"]
