"""Command lines: `--preset NAME`, `--set FIELD=VALUE` and a few shortcut flags, read through the declarations.

Every value a user types reaches a config through `settings.with_values`,
which parses and checks it by the field's declaration, so the command line
accepts exactly what the Python API does. Free of TensorFlow, so that
`--help` answers at once.
"""

import argparse
import gc
import os
import sys

from poecaps.errors import PoecapsError
from poecaps.experiments import presets
from poecaps.experiments.settings import parse_assignment, specs, with_values

DEFAULT_RUN_DIR = os.path.join("runs", "default")


def _settings_help(config):
    lines = []
    for name, spec in specs(config).items():
        lines.append(f"  {name} = {getattr(config, name)!r}: {spec.help} ({spec.describe()})")
    return "\n".join(lines)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line, `error: ...`, and exit status 2, as poecaps' own are."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def parser(description, kind=None, default_preset=None, run_dir_default=DEFAULT_RUN_DIR):
    """A parser with `--run-dir` and, for a run `kind`, `--preset` and `--set`; the epilog lists both."""
    epilog = None
    if kind is not None:
        listed = "\n".join(f"  {name}: {line}" for name, line in presets.names(kind).items())
        epilog = (f"presets (--preset):\n{listed}\n\nsettings (--set FIELD=VALUE; the values of "
                  f"--preset {default_preset}):\n{_settings_help(presets.get(kind, default_preset))}")
    p = ArgumentParser(description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default=run_dir_default,
                   help=f"run directory (default: {run_dir_default})")
    if kind is not None:
        p.add_argument("--preset", default=default_preset, choices=list(presets.names(kind)),
                       help=f"named settings (default: {default_preset})")
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="change one setting of the preset (repeatable); listed below")
    return p


def add_shortcuts(p, kind, names):
    """Flags `--name` for the settings of a run `kind` users change most; each is `--set name=VALUE`."""
    declared = specs(presets.get(kind, next(iter(presets.names(kind)))))
    for name in names:
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar="VALUE",
                       help=f"{declared[name].help} (--set {name}=VALUE)")


def config_from_args(kind, args, shortcuts=()):
    """`(config, record)`: the preset with the shortcut flags and `--set` values applied, each checked.

    `record` is what `config.json` keeps of the call: `{"kind", "preset",
    "overrides"}`, the overrides as checked values.
    """
    values = {name: getattr(args, name) for name in shortcuts if getattr(args, name) is not None}
    for text in args.set:
        name, value = parse_assignment(text)
        values[name] = value
    config = with_values(presets.get(kind, args.preset), values)
    return config, {"kind": kind, "preset": args.preset,
                    "overrides": {name: getattr(config, name) for name in values}}


def add_config_flags(p, config_cls, names=None):
    """A flag `--name VALUE` for every field of `config_cls` (or those in `names`), read through its declaration."""
    defaults = config_cls()
    for name, spec in specs(config_cls).items():
        if names is not None and name not in names:
            continue
        default = getattr(defaults, name)
        shown = spec.none_word if default is None else default
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar="VALUE",
                       help=f"{spec.help} (default: {shown})")


def config_from_flags(config_cls, args, **values):
    """A config from flags named after its fields (None: the field's default), then `values`, each checked."""
    given = {name: getattr(args, name) for name in specs(config_cls) if getattr(args, name, None) is not None}
    return with_values(config_cls(), {**given, **values})


def run_main(main, argv=None):
    """Run a command's `main(argv)`; print expected errors as one line (exit 2) unless POECAPS_DEBUG is set.

    Errors poecaps raises on purpose (`poecaps.errors`), bad values
    (`ValueError`) and missing files carry messages written for the user; a
    stack trace would only hide them.
    """
    try:
        return main(argv)
    except (PoecapsError, ValueError, OSError) as error:
        if os.environ.get("POECAPS_DEBUG"):
            raise
        message = " ".join(str(error).split())          # one line, whatever the message
    # Out of the except block the error's frames are gone: a training loop it interrupted (its data
    # iterators) is finalised now, while the interpreter can still do it quietly.
    gc.collect()
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
