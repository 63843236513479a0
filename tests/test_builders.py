"""pipeline/builders.py: the step builders put into a step's spec (its key) every setting that changes its numbers,
and pass those settings on to the script the step runs. (The keys of a whole run: tests/test_run_keys.py.)"""
from dataclasses import asdict, replace
from types import SimpleNamespace

import drift
from pipeline.builders import Steps
from run import PRESETS


def test_a_train_steps_key_holds_its_settings_and_they_reach_train_py(tmp_path):
    """A train step's spec (its key) holds every setting that changes its weights, the default ones too (the
    schedule, the warmup, the task's own fields), and the schedule reaches train.py."""

    class Pipe:
        run_dir = tmp_path
        specs = []

        def add(self, kind, name, spec, deps, build, reads=()):
            self.specs.append((spec, build))
            return name

    inputs = SimpleNamespace(base=tmp_path / "base", data_root=tmp_path, task_spec=None, tasks=["FOMC"],
                             epochs={"FOMC": 3}, train_sets={"FOMC": []}, layout=SimpleNamespace(dp=1, tp=1))
    args = SimpleNamespace(gpus=0, launcher=None, save_every=50, task_spec=None, wandb=False)
    for schedule in ("cosine", "linear"):
        cfg = asdict(replace(PRESETS["tiny"], lr_schedule=schedule))
        steps = Steps(Pipe(), cfg, inputs, args, "native", drift.TEMPERATURE)
        steps.train(None, 1, ["FOMC"], None, 0)
        spec, build = Pipe.specs[-1]
        want = dict(tasks=["FOMC"], seed=0, lr=cfg["lr"], gb=cfg["global_batch"], extra=[], ep=3,
                    max_len=cfg["max_len"], mt=cfg["micro_tokens"], max_train=cfg["max_train"], warmup=cfg["warmup"],
                    lr_schedule=schedule, task_fields={"FOMC": {"system": None, "held_out": 0.1}})
        assert asdict(spec) == want
        (tmp_path / "s1-train.tmp").mkdir(exist_ok=True)
        cmd = build(tmp_path / "s1-train.tmp", {})
        assert cmd[cmd.index("--lr-schedule") + 1] == schedule
