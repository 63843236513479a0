"""Experiment files (pipeline/config.py): run.py --config FILE (YAML or TOML) gives flags by name, the command line
overrides them, a file holds nothing the flags could not, and a bad file is one line naming the file and key."""
import pytest

import run
from pipeline import config
from common.errors import InputError


def args_of(tmp_path, text, *cli, name="exp.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return run.parse_args(["--config", str(f), *cli])


def test_a_file_gives_the_flags_and_the_command_line_wins(tmp_path):
    a = args_of(tmp_path, "methods: [sft, opr-ru]\nrho: [0.1, 0.2]\nlr: 1.0e-4\nquiet: true\ngen_workers: 2\n",
                "--lr", "3e-4")
    b = run.parse_args(["--methods", "sft,opr-ru", "--rho", "0.1,0.2", "--lr", "3e-4", "--quiet", "--gen-workers", "2"])
    assert vars(a) == vars(b)
    assert a.lr == 3e-4 and a.rho == "0.1,0.2" and a.quiet is True
    assert a.settings == {"methods": "sft,opr-ru", "rho": "0.1,0.2", "seeds": "0", "gpus": 0, "engine": "auto", "gen-workers": 2,
                          "save-every": 50, "keep-checkpoints": "all", "lr": 3e-4, "quiet": True, "executor": "local",
                          "ray-retries": 3} | {
        k: v for k, v in a.settings.items() if k.startswith("plan-")}


def test_toml_and_yaml_read_the_same(tmp_path):
    y = args_of(tmp_path, "tasks: [C-STANCE, FOMC]\nepochs: 2\nportable: false\n")
    t = args_of(tmp_path, 'tasks = ["C-STANCE", "FOMC"]\nepochs = 2\nportable = false\n', name="exp.toml")
    assert vars(y) == vars(t) and y.tasks == ["C-STANCE", "FOMC"] and y.portable is False


def test_the_saved_experiment_reads_back_to_the_same_settings(tmp_path):
    a = run.parse_args(["--methods", "sft,replay", "--rho", "0.05", "--seeds", "0,1", "--lr", "2e-5", "--quiet"])
    (tmp_path / "config.yaml").write_text(config.dump(a.settings, ["--methods", "sft,replay"]))
    b = run.parse_args(["--config", str(tmp_path / "config.yaml")])
    assert b.settings == a.settings and {k: v for k, v in vars(b).items() if k != "config"} == \
        {k: v for k, v in vars(a).items() if k != "config"}


@pytest.mark.parametrize("text, named", [
    ("bogus: 1\n", "'bogus' is not a setting of this script"),
    ("lr: .nan\n", "lr: nan is not a finite number"),
    ("rho: .inf\n", "rho: inf is not a finite number"),
    ("quiet: 1\n", "quiet: must be true or false"),
    ("tasks: {a: 1}\n", "tasks: {'a': 1} is not a value --tasks takes"),
    ("config: other.yaml\n", "'config' is not a setting"),
    ("- a\n- b\n", "must map setting names to values, got list"),
    ("lr: [1, [2]]\n", "is not a value --lr takes"),
    ("a: b: c\n", "not valid YAML"),
])
def test_a_bad_file_is_one_line_naming_it(tmp_path, text, named):
    with pytest.raises(InputError, match=r"exp\.yaml") as e:
        args_of(tmp_path, text)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_a_value_the_flag_refuses_is_refused_as_the_flag_would(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        args_of(tmp_path, "rho: 5\n")
    assert e.value.code == 2 and "--rho" in capsys.readouterr().err


def test_each_setting_is_declared_once_and_its_flag_help_and_presets_follow(capsys):
    """run.Settings is the one definition: every field with help is a flag whose value replaces the preset's in the
    run's settings, --help shows each preset's value, and the presets differ from the paper's by replace() alone."""
    import dataclasses
    flagged = [f for f in dataclasses.fields(run.Settings) if f.metadata.get("help")]
    assert {f.name for f in flagged} >= {"methods", "rho", "lr", "epochs", "drift_limit", "scoring"}
    given = {"methods": "sft", "rho": "0.3", "lr": "0.001", "warmup": "0.1", "lr_schedule": "linear",
             "global_batch": "2", "max_new_tokens": "7", "max_train": "9", "eval_limit": "5", "eval_repeats": "3",
             "scoring": "trace", "replay_budget": "per-task", "sft_kl_beta": "0.25", "sdft_teacher": "base",
             "sdft_max_new_tokens": "11", "epochs": "2", "drift_limit": "0", "n_train": "64", "n_test": "16",
             "ewc_lambda": "3.0", "ewc_samples": "7", "ewc_gamma": "0.5", "lwf_alpha": "0.25", "lwf_temperature": "3.0",
             "ssr_demos": "5", "ssr_prompts": "9", "ssr_samples": "2", "ssr_temperature": "0.7", "ssr_template": "chat",
             "ssr_clusters": "4", "lora_rank": "4", "lora_alpha": "16.0", "lora_dropout": "0.05",
             "lora_targets": "k_proj,q_proj", "lora_lr": "3e-4", "olora_lambda1": "0.25", "olora_lambda2": "0.1",
             "ilora_lambda": "0.5", "ilora_gamma": "0.5"}
    assert set(given) == {f.name for f in flagged}  # a new flagged setting gets a value here
    argv = [a for k, v in given.items() for a in (f"--{k.replace('_', '-')}", v)]
    _, cfg, *_ = run.configure(run.parse_args(argv))
    for f in flagged:
        parse = f.metadata["type"] or str
        assert cfg[f.name] == parse(given[f.name]) != getattr(run.PRESETS["tiny"], f.name), f.name
    _, tiny, *_ = run.configure(run.parse_args([]))
    assert tiny == dataclasses.asdict(run.PRESETS["tiny"]) and tiny["lr"] == 5e-4 and tiny["global_batch"] == 4
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "peak learning rate (default: tiny 0.0005; smollm2 0.0002; paper 1e-05)" in text
    assert "sequences per optimizer step (default: tiny 4; smollm2 4; paper 128)" in text


def test_a_moved_run_directorys_config_runs_where_it_is_now(tmp_path, capsys):
    """Issue 64, class 2: RUN_DIR/config.yaml names the directory it was written in; moved, `--config` of it
    continues the run where it is now (said on stderr), not from nothing at the old path. The command line's --out
    still wins, and an experiment file that is not a run directory's keeps its own out."""
    from common.outputs import claim_dir
    old, new = tmp_path / "old", tmp_path / "new"
    claim_dir(old, "run")
    (old / "config.yaml").write_text(config.dump({"methods": "sft", "out": str(old)}, ["--out", str(old)]))
    assert run.parse_args(["--config", str(old / "config.yaml")]).out == str(old)
    assert capsys.readouterr().err == ""
    old.rename(new)
    assert run.parse_args(["--config", str(new / "config.yaml")]).out == str(new.resolve())
    assert f"written for the run directory {old}, which moved here" in capsys.readouterr().err
    assert run.parse_args(["--config", str(new / "config.yaml"), "--out", str(tmp_path / "x")]).out == str(
        tmp_path / "x")
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "config.yaml").write_text(f"out: {old}\n")
    assert run.parse_args(["--config", str(tmp_path / "exp" / "config.yaml")]).out == str(old)
