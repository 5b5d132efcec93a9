"""Command-line flags from frozen config dataclasses (every field becomes a flag)."""

import argparse
import dataclasses
import inspect
import os
import re
import typing

# `name: type = default   # help text` in a config dataclass's source.
_FIELD_COMMENT = re.compile(r"^\s+(\w+)\s*:[^=#]+=[^#]*#\s*(.+?)\s*$")


def _parse_bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def field_help(config_cls):
    """Each field's help: `metadata["help"]` or the comment after its declaration.

    Comments are read from the source of `config_cls` and of the dataclasses it
    derives from, so a field is documented once, where it is declared.
    """
    comments = {}
    for cls in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(cls):
            for line in inspect.getsource(cls).splitlines():
                match = _FIELD_COMMENT.match(line)
                if match:
                    comments[match.group(1)] = match.group(2)
    return {f.name: f.metadata.get("help", comments.get(f.name, ""))
            for f in dataclasses.fields(config_cls)}


def add_config_flags(parser, config_cls):
    """Add `--field-name` for every field of `config_cls`, with its default, type and help."""
    hints = typing.get_type_hints(config_cls)
    helps = field_help(config_cls)
    for field in dataclasses.fields(config_cls):
        kind = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=_parse_bool if kind is bool else kind, default=field.default,
                            help=helps[field.name])


def config_from_args(config_cls, args):
    return config_cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls)})


def parser(description, config_cls=None, run_dir_required=False):
    """A parser with the common flags and, if given, one flag per config field."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run-dir", required=run_dir_required,
                   default=None if run_dir_required else os.path.join("runs", "default"),
                   help="run directory (config, checkpoints, models, figures)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    if config_cls is not None:
        add_config_flags(p, config_cls)
    return p


def run_main(main):
    """Run a script's `main()`; print expected errors as one line (exit 2) unless POECAPS_DEBUG is set.

    Errors poecaps raises on purpose (`poecaps.errors`), bad values
    (`ValueError`) and missing files carry messages written for the user; a
    stack trace would only hide them.
    """
    import sys

    from poecaps.errors import PoecapsError

    try:
        return main()
    except (PoecapsError, ValueError, FileNotFoundError) as error:
        if os.environ.get("POECAPS_DEBUG"):
            raise
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
