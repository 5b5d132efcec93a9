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
from poecaps.experiments.runs import config_to_resume
from poecaps.experiments.settings import SettingError, parse_assignment, specs, with_values

DEFAULT_RUN_DIR = os.path.join("runs", "default")


def _settings_help(*configs):
    lines = {}
    for config in configs:
        for name, spec in specs(config).items():
            value = getattr(config, name)
            shown = spec.none_word if value is None else repr(value)
            lines.setdefault(name, f"  {name} = {shown}: {spec.help} ({spec.describe()})")
    return "\n".join(lines.values())


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
        p.add_argument("--preset", default=None, choices=list(presets.names(kind)),
                       help=f"named settings (default: {default_preset}; resumed: the run's)")
        p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="change one setting of the preset (repeatable); listed below")
    return p


def shortcut_specs(kind, names):
    """`{name: Spec}` of the settings `names` of a run `kind`, in the order given."""
    declared = specs(presets.get(kind, next(iter(presets.names(kind)))))
    return {name: declared[name] for name in names}


def add_shortcuts(p, kind, names):
    """Flags `--name` for the settings of a run `kind` users change most; each is `--set name=VALUE`."""
    for name, spec in shortcut_specs(kind, names).items():
        _add_flag(p, name, spec, f"{spec.help} (--set {name}=VALUE)")


def config_from_args(kind, args, shortcuts=()):
    """`(config, record)`: the preset with the shortcut flags and `--set` values applied, each checked.

    `record` is what `config.json` keeps of the call: `{"kind", "preset",
    "overrides"}`, the overrides as checked values. With `--resume` the
    run's own settings take the preset's place (`runs.config_to_resume`).
    """
    values = flag_values(args, shortcut_specs(kind, shortcuts))
    if getattr(args, "resume", False):
        return config_to_resume(args.run_dir, kind, args.preset, values)
    return presets.configured(kind, args.preset, values)


def add_config_flags(p, config_cls, names=None):
    """A flag `--name VALUE` for every field of `config_cls` (or those in `names`), read through its declaration."""
    defaults = config_cls()
    for name, spec in specs(config_cls).items():
        if names is not None and name not in names:
            continue
        shown = _default_shown(getattr(defaults, name), spec)
        _add_flag(p, name, spec, spec.help + ("" if shown is None else f" (default: {shown})"))


def _add_flag(p, name, spec, help):
    """`--name VALUE` for the setting `name`; a true-or-false setting's flag alone means true (`--name false` too)."""
    form = {"nargs": "?", "const": "true", "metavar": "true|false"} if spec.kind is bool else {"metavar": "VALUE"}
    p.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=help, **form)


def _default_shown(default, spec):
    """The default a flag's help shows: the value, or None's own word ("auto"); a plain None's meaning is in the help."""
    if isinstance(default, bool):
        return "true" if default else "false"
    if default is not None:
        return default
    return None if spec.none_word == "none" else spec.none_word


def add_set_flag(p, *config_classes):
    """`--set FIELD=VALUE` (repeatable) for every field of `config_classes`; the epilog lists them, with defaults."""
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change any setting listed below (repeatable)")
    p.epilog = (f"settings (--set FIELD=VALUE; the defaults):\n"
                f"{_settings_help(*(cls() for cls in config_classes))}")


def flag_values(args, declared):
    """`{field: text}` of the given flags among `declared` (`{field: Spec}`), then of each `--set FIELD=VALUE`.

    `--set` given twice for one field takes the last, as the line reads. A field given both by its flag and by
    `--set` with two values (`--seed 3 --set seed=4`) is a `SettingError` naming both: the flag is read before
    every `--set` wherever it stands on the line, so which would win is not what the line says. The same value
    twice passes, "same" as the setting reads the text (`--persistent` and `--set persistent=True`, `--seed 3`
    and `--set seed=03`).
    """
    flags = {name: getattr(args, name) for name in declared if getattr(args, name, None) is not None}
    values = dict(flags)
    for text in getattr(args, "set", None) or ():
        name, value = parse_assignment(text)
        if name in flags and not _same_value(declared[name], name, flags[name], value):
            raise SettingError(f"{name} is given twice, as --{name.replace('_', '-')} {flags[name]} and --set "
                               f"{text}; give it once.")
        values[name] = value
    return values


def _same_value(spec, name, first, second):
    """Whether two texts give setting `name` one value, as `spec` parses them."""
    if first == second:
        return True
    try:
        return spec.parse(name, first) == spec.parse(name, second)
    except SettingError:                 # one of them is no value of the setting: not the same
        return False


def config_from_flags(config_cls, args, **values):
    """A config from flags named after its fields and `--set` (None: the field's default), then `values`, checked."""
    return with_values(config_cls(), {**flag_values(args, specs(config_cls)), **values})


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
