"""Experiment files: `run.py --config FILE` reads flags by name from a YAML (.yaml, .yml) or TOML
(.toml) file, and the command line overrides them; run.py writes the experiment it ran to
RUN_DIR/config.yaml, which `run.py --config RUN_DIR/config.yaml` runs again with the same step keys.

    # exp.yaml                   # the same names as the flags, - or _; lists for comma-list flags
    methods: [sft, replay, opr-ru]
    rho: 0.1
    lr: 1.0e-5
    quiet: true

A file key is a flag's name and its value goes through the flag's own parser (its type, range and
choices), so a file cannot hold what the command line could not; run.py's setting flags derive from
its Settings class (pipeline/settings.py), so a setting is declared in one place.
"""
import argparse
import math
import sys
from pathlib import Path

from common.errors import InputError

NOT_SAVED = ("help", "config", "dry_run", "overwrite", "debug")  # how to run the command,
                                                                 # not what it runs


def expand(parser: argparse.ArgumentParser, argv: list[str] | None) -> list[str]:
    """argv with --config FILE replaced by the file's flags, placed first so
    that the command line's win."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    if not known.config:
        return argv
    path = Path(known.config)
    flags = {a.dest: a for a in parser._actions if a.option_strings}
    tokens, named = [], {}
    doc = load(path)
    moved_run(path, doc)
    for key, value in doc.items():
        action = flags.get(str(key).replace("-", "_"))
        if action is None or action.dest in NOT_SAVED:
            raise InputError(f"{path}: {key!r} is not a setting of this script "
                             f"(see --help for the flag names)")
        if action.dest in named:  # lr-schedule and lr_schedule: one setting, said twice
            raise InputError(f"{path}: {key!r} and {named[action.dest]!r} "
                             f"are the same setting; keep one")
        named[action.dest] = key
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError(f"{path}: {key}: {value} is not a finite number")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise InputError(f"{path}: {key}: must be true or false, got {value!r}")
            tokens += [flag] if value else []
        elif value is not None:
            if isinstance(value, (bool, dict)) or isinstance(value, list) and any(
                    isinstance(v, (dict, list)) for v in value):
                raise InputError(f"{path}: {key}: {value!r} is not a value {flag} takes")
            tokens += [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return tokens + rest


def moved_run(path: Path, doc: dict):
    """A run directory's own config.yaml (run.py wrote both) names the run directory it was
    written in; moved since, the file belongs to the directory it is in now: its `out`
    becomes that one (said on stderr), so the run continues there instead of starting from
    nothing at the old path."""
    from common.outputs import is_ours
    out = doc.get("out")
    if path.name != "config.yaml" or not isinstance(out, str) or not is_ours(path.parent, "run"):
        return
    here = path.parent.resolve()
    if Path(out).resolve() != here:
        print(f"run.py: --config {path}: written for the run directory {out}, which moved here: "
              f"the run continues in {here}", file=sys.stderr)
        doc["out"] = str(here)


def yaml_unique_keys(text: str):
    """yaml.safe_load, refusing a mapping that names a key twice
    (PyYAML keeps the last without a word)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)


def load(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--config {path}: cannot read it ({e})") from None
    try:
        if path.suffix == ".toml":
            import tomllib
            doc = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            doc = yaml_unique_keys(text)
        else:
            raise InputError(f"--config {path}: name a .yaml, .yml or .toml file")
    except InputError:
        raise
    except Exception as e:  # yaml.YAMLError, tomllib.TOMLDecodeError: the
                            # parser's own line and column
        raise InputError(f"--config {path}: not valid {path.suffix[1:].upper()}: "
                         f"{' '.join(str(e).split())}") from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise InputError(f"--config {path}: must map setting names to values, got "
                         f"{type(doc).__name__}")
    return doc


def resolved(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The settings args holds, by flag name, as an experiment file writes them
    (unset flags left out)."""
    out = {}
    for a in parser._actions:
        if not a.option_strings or a.dest in NOT_SAVED:
            continue
        v = getattr(args, a.dest, None)
        if v is None or v is False:
            continue
        out[a.dest.replace("_", "-")] = v
    return out


def dump(settings: dict, argv: list[str]) -> str:
    import yaml
    head = (f"# written by run.py: the experiment of `run.py {' '.join(argv)}`;\n"
            f"# `run.py --config THIS_FILE` runs it again (flags given beside it override it)\n")
    return head + yaml.safe_dump(settings, sort_keys=False, default_flow_style=None)
