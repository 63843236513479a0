"""A run's settings as one typed definition: run.py's `Settings` dataclass declares each setting
once (its name, the paper's value, the flag that sets it and that flag's help), and everything else
derives from it: the presets are `dataclasses.replace` of the paper's, the flags and their --help
(with every preset's value) come from the fields, an experiment file names the same flags
(pipeline/config.py), and a run's settings are the preset with the given flags put in their place
(`apply`), which is what the step keys and results.json read.
"""
import argparse
import dataclasses


def setting(default, help: str | None = None, type=None, choices=None):
    """A field of a settings dataclass: the paper's value, and the flag's help, type and choices
    (no help: a setting of the presets that has no flag)."""
    return dataclasses.field(default=default, metadata=dict(help=help, type=type, choices=choices))


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(v) -> str:
    if isinstance(v, dict):
        return "per task"
    return "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def add_flags(parser: argparse.ArgumentParser, cls, presets: dict):
    """A flag for each field of cls that has help, defaulting to None (the preset's value); its help
    ends with every preset's value, so --help shows what each preset sets."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("help"):
            continue
        values = {name: _shown(getattr(p, f.name)) for name, p in presets.items()}
        shown = ("; ".join(f"{n} {v}" for n, v in values.items()) if len(set(values.values())) > 1
                 else next(iter(values.values())))
        parser.add_argument(flag(f.name), type=meta["type"], choices=meta["choices"],
                            help=f"{meta['help']} (default: {shown})".replace("%", "%%"))


def apply(preset, args: argparse.Namespace):
    """The preset with every flag that was given in its place."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(preset)
             if f.metadata.get("help") and getattr(args, f.name, None) is not None}
    return dataclasses.replace(preset, **given)
