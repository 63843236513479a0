"""Issue 59's flag-key rule at the level of the step scripts: a flag that reaches a step's command
but not its key would let a run reuse cached steps computed with another value. Every flag of
every script a step runs (pipeline/specs.py: a spec's SCRIPT) is exactly one of
  keyed    written from a field of the step's spec (its FLAGS), so the key holds its value;
  NEUTRAL  passed outside the key, with why (outputs, logs, inputs keyed through what it reads);
  DEFAULT  never passed, with why (every step runs at the script's own default).
A flag added to a script, or passed by a builder, without a declaration fails here naming both.
(run.py's own flags: test_run_keys.py's test_every_setting_changes_the_keys_of_the_steps_it_...)
"""
import argparse
import importlib
import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from pipeline import specs

TASKS = ["C-STANCE", "FOMC"]
ALL_METHODS = ("sft,replay,opr-ru,opr-sc,opr-low,opr-random,mtl,sdft,sft-kl,ewc,lwf,agem,ssr,"
               "lora-seqft,opr-ru+lora,olora,ilora")
SPECS = [c for c in specs.Spec.__subclasses__() if c.SCRIPT]


class Parsed(Exception):
    pass


def parser_of(script: str, monkeypatch) -> argparse.ArgumentParser:
    """The script's parser, as its parse_args builds it, stopped before it parses anything."""
    def stop(self, *a, **k):
        raise Parsed(self)
    module = importlib.import_module(script.removesuffix(".py"))
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", stop)
        with pytest.raises(Parsed) as got:
            module.parse_args([])
    return got.value.args[0]


def options(parser) -> dict:
    """option string -> its flag's name (its first option string: --compile for --no-compile),
    --help left out."""
    return {o: a.option_strings[0] for a in parser._actions for o in a.option_strings
            if not isinstance(a, argparse._HelpAction)}


def flags_in(argv: list, parser, script: str) -> list:
    """[(flag, its values)] of a command's arguments, read as the script's parser reads them."""
    acts = {o: a for a in parser._actions for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        assert argv[i] in acts, f"{script}: {argv[i]!r} in a step's command is not one of its flags"
        a = acts[argv[i]]
        n = 1 if a.nargs is None else a.nargs
        assert isinstance(n, int), f"{script} {argv[i]}: nargs {a.nargs!r} (read it here)"
        out.append((a.option_strings[0], tuple(argv[i + 1:i + 1 + n])))
        i += 1 + n
    return out


def values_of(passed: list) -> dict:
    """flag -> its values, each time it is passed, in order ([(flag, values)] of flags_in)."""
    out = {}
    for flag, values in passed:
        out.setdefault(flag, []).append(values)
    return out


def keyed_flags(spec_cls, planned) -> set:
    """The flags its FLAGS write: a "--flag" field's, and whatever a function field wrote in the
    planned steps (the engine's, a budget's, the methods' train.py flags: all of methods/)."""
    def static(how):
        return ({how} if isinstance(how, str) else
                set().union(*map(static, how.values())) if isinstance(how, dict) else set())
    out = set().union(*map(static, spec_cls.FLAGS.values()))
    out |= {t for s in planned for t in s.argv() if t.startswith("--")}
    if spec_cls is specs.Train:
        from methods import METHODS
        from run import PRESETS
        cfg = asdict(PRESETS["tiny"])
        out |= {t for m in METHODS.values() for t in m.train_flags(cfg) if t.startswith("--")}
    return out


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    """{spec class: [(spec, the argv after the script, kind)]} of every step of three dry runs:
    every method; replay budgets per task; a task manifest (--task-spec)."""
    import plan as planner
    import run
    from data.embedded import write_benchmark
    from data.tasks import use_tasks
    from model.base import write_random_tiny
    root = tmp_path_factory.mktemp("flags")
    write_random_tiny(root / "base")
    write_benchmark(root / "data", n_train=8, n_eval=2, n_test=8, tasks=TASKS)
    manifest = {"tasks": [{"name": f"My{t}", "dir": f"data/{t}", "metric": "letter_accuracy",
                           "epochs": 1} for t in TASKS]}
    (root / "tasks.json").write_text(json.dumps(manifest))
    common = ["--model", str(root / "base"), "--data", str(root / "data"), "--rho", "0.5",
              "--epochs", "1", "--eval-limit", "4", "--out", str(root / "dry"), "--dry-run"]
    runs = [["--tasks", ",".join(TASKS), "--methods", ALL_METHODS, "--wandb"],
            ["--tasks", ",".join(TASKS), "--methods", "replay,opr-ru,ssr", "--replay-budget",
             "per-task"],
            ["--task-spec", str(root / "tasks.json"), "--methods", "sft,opr-ru,ssr",
             "--gpus", "1"]]  # (on GPUs: --activation-checkpointing)
    mp = pytest.MonkeyPatch()
    mp.setenv("OPR_CACHE", str(root / "cache"))
    mp.setattr(run.faulthandler, "register", lambda *a, **k: None)
    steps = {}
    mp.setattr(planner, "print_plan", lambda s, *a, **k: steps.update(s) or [])
    try:
        for extra in runs:
            run.main(common + extra)
    finally:
        use_tasks(None)  # the manifest's tasks must not leak into another test
        mp.undo()
    out = {c: [] for c in SPECS}
    for key, s in steps.items():
        if not type(s["spec"]).SCRIPT:
            continue  # (gold replay: its builder writes the buffer itself)
        dirs = {d: root / "steps" / d for d in s["deps"]}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
            (d / "buffer.jsonl").touch()
        tmp = root / "steps" / f"{key}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        argv = [str(a) for a in s["build"](tmp, dirs)]
        script = next(i for i, a in enumerate(argv) if Path(a).name == type(s["spec"]).SCRIPT)
        out[type(s["spec"])].append((s["spec"], argv[script + 1:], s["kind"]))
    return out


def test_every_flag_of_every_step_script_is_keyed_neutral_or_default(plan, monkeypatch):
    """Each flag of each script in exactly one of: keyed, NEUTRAL, DEFAULT; nothing declared that
    the script does not have."""
    assert all(plan[c] for c in SPECS), "every kind of step is planned (one dry run has them all)"
    bad = []
    for cls in SPECS:
        script, parser = cls.SCRIPT, parser_of(cls.SCRIPT, monkeypatch)
        have = set(options(parser).values())
        groups = {"keyed": keyed_flags(cls, [s for s, _, _ in plan[cls]]),
                  "NEUTRAL": set(cls.NEUTRAL), "DEFAULT": set(cls.DEFAULT)}
        for flag in sorted(have):
            where = [g for g, flags in groups.items() if flag in flags]
            if len(where) != 1:
                bad.append(f"{script} {flag}: " + (
                    " and ".join(where) if where else
                    f"declared nowhere: map a field of specs.{cls.__name__} to it in FLAGS "
                    f"(keyed), or give why it needs no key in its NEUTRAL (passed) or DEFAULT "
                    f"(never passed)"))
        for g, flags in groups.items():
            bad += [f"{script} {flag}: in {cls.__name__}'s {g}, not a flag of {script}"
                    for flag in sorted(flags - have)]
    assert not bad, "\n".join(bad)


def test_every_command_passes_its_keyed_flags_from_the_key_and_others_declared(plan, monkeypatch):
    """In every planned step's command: each keyed flag says what its spec says (the same flags
    and values as spec.argv()), every other flag is NEUTRAL, and no DEFAULT one is passed."""
    bad = set()
    for cls in SPECS:
        script, parser = cls.SCRIPT, parser_of(cls.SCRIPT, monkeypatch)
        keyed = keyed_flags(cls, [s for s, _, _ in plan[cls]])
        for spec, argv, kind in plan[cls]:
            passed = flags_in(argv, parser, script)
            for flag, _ in passed:
                if flag in cls.DEFAULT:
                    bad.add(f"{script} {flag}: passed by {kind} steps, yet declared DEFAULT")
                elif flag not in keyed and flag not in cls.NEUTRAL:
                    bad.add(f"{script} {flag}: passed by {kind} steps outside their key (not in "
                            f"specs.{cls.__name__}'s FLAGS, nor declared NEUTRAL)")
            got, want = values_of(passed), values_of(flags_in(spec.argv(), parser, script))
            for flag in sorted(set(want) | set(got) & keyed):
                if got.get(flag) != want.get(flag):
                    bad.add(f"{script} {flag}: a '{kind}' step passes {got.get(flag)}, its spec "
                            f"(its key) says {want.get(flag)}")
    assert not bad, "\n".join(sorted(bad))


def other(value):
    """Another value of a field (what it is does not matter to a key)."""
    if isinstance(value, dict):
        return {k: other(v) for k, v in value.items()}
    if isinstance(value, list):
        return value + value[-1:]
    return 1 if value is None else value + ("0" if isinstance(value, str) else 1)


def variants(spec):
    """(flag, the spec with that flag's value changed) for every keyed flag of the spec."""
    for name, how in spec.FLAGS.items():
        value = getattr(spec, name)
        for key, h in how.items() if isinstance(how, dict) else [(None, how)]:
            v = value if key is None else value[key]
            if h is specs.verbatim:  # argv already: each flag's value in turn
                changes = [(t, v[:i + 1] + [v[i + 1] + "0"] + v[i + 2:])
                           for i, t in enumerate(v[:-1])
                           if t.startswith("--") and not v[i + 1].startswith("--")]
            else:
                changes = [(specs.render(h, other(v))[0], other(v))]
            for flag, new in changes:
                yield flag, replace(spec, **{name: new if key is None else {**value, key: new}})


def test_changing_a_keyed_flags_field_changes_the_command_and_the_step_key(plan, tmp_path,
                                                                           monkeypatch):
    """For every keyed flag: the spec with that field changed writes another value of the flag
    and is another step key (Pipeline.add's own hashing)."""
    from pipeline.steps import Pipeline
    pipe = Pipeline(tmp_path, 1, {}, True, {})
    for cls in SPECS:
        script, parser = cls.SCRIPT, parser_of(cls.SCRIPT, monkeypatch)
        covered = set()
        for spec, _, kind in plan[cls]:
            key = pipe.add(kind, "x", spec, [], None)
            for flag, changed in variants(spec):
                covered.add(flag)
                values = [[v for f, v in flags_in(s.argv(), parser, script) if f == flag]
                          for s in (spec, changed)]
                assert values[0] != values[1], f"{script} {flag}: the changed field writes the same"
                assert pipe.add(kind, "x", changed, [], None) != key, (
                    f"{script} {flag}: changed in specs.{cls.__name__}, the step key is the same")
        assert covered == keyed_flags(cls, [s for s, _, _ in plan[cls]]), script
