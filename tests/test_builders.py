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


def test_a_lora_methods_stage_trains_the_base_from_the_previous_stages_adapter(tmp_path):
    """methods/lora.py's chain: every stage of a +lora method trains adapters on the base (never on the previous
    stage's merged checkpoint), stage i+1 starting from stage i's adapter; its LoRA settings and lr reach train.py
    and its key."""
    from methods import METHODS

    class Pipe:
        run_dir = tmp_path
        added = {}

        def add(self, kind, name, spec, deps, build, reads=()):
            self.added[name] = (spec, deps, build, reads)
            return name

    inputs = SimpleNamespace(base=tmp_path / "base", data_root=tmp_path, task_spec=None, tasks=["FOMC", "C-STANCE"],
                             epochs={"FOMC": 3, "C-STANCE": 2}, train_sets={"FOMC": [], "C-STANCE": []},
                             layout=SimpleNamespace(dp=1, tp=1))
    args = SimpleNamespace(gpus=0, launcher=None, save_every=50, task_spec=None, wandb=False)
    cfg = asdict(PRESETS["tiny"])
    steps = Steps(Pipe(), cfg, inputs, args, "native", drift.TEMPERATURE)
    steps.files = lambda kind, tasks: []
    steps.base_files = ["base-files"]
    m = METHODS["lora-seqft"]
    first = m.plan_train(steps, None, 1, inputs.tasks, None, 0)
    second = m.plan_train(steps, first, 2, inputs.tasks, None, 0)
    spec, deps, build, reads = Pipe.added[second]
    assert deps == [first] and reads == ["base-files"]  # the base is read again, and its key says so
    assert spec.extra == ["--lr", str(cfg["lora_lr"]), "--lora-rank", "8", "--lora-alpha", "32.0",
                          "--lora-dropout", "0.1", "--lora-targets", "q_proj,v_proj"]
    (tmp_path / "s2.tmp").mkdir()
    cmd = build(tmp_path / "s2.tmp", {first: tmp_path / "s1"})
    assert cmd[cmd.index("--model") + 1] == str(inputs.base)
    assert cmd[cmd.index("--lora-init") + 1] == str(tmp_path / "s1" / "ckpt" / "adapter")
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--lr") + 1] == str(cfg["lora_lr"])  # the last --lr wins
    cmd1 = Pipe.added[first][2](tmp_path / "s2.tmp", {})
    assert "--lora-init" not in cmd1 and cmd1[cmd1.index("--model") + 1] == str(inputs.base)
    il = METHODS["ilora"]  # on adapters, with replay's gold buffer, its own objective's flags
    third = il.plan_train(steps, first, 2, inputs.tasks, "gold-1", 0)
    spec, deps, build, _ = Pipe.added[third]
    assert deps == [first, "gold-1"] and il.uses_buffer and spec.extra[:6] == [
        "--objective", "ilora", "--ilora-lambda", str(cfg["ilora_lambda"]), "--ilora-gamma", str(cfg["ilora_gamma"])]
    joint = METHODS["mtl+lora"].plan_train(steps, None, 2, inputs.tasks, None, 0)  # its own plan, on adapters too
    assert "--lora-rank" in Pipe.added[joint][0].extra and Pipe.added[joint][1] == []
    full = METHODS["sft"].plan_train(steps, first, 2, inputs.tasks, None, 0)  # full fine-tuning: the last checkpoint
    cmd = Pipe.added[full][2](tmp_path / "s2.tmp", {first: tmp_path / "s1"})
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "s1" / "ckpt") and "--lora-init" not in cmd
