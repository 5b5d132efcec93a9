"""Declared settings: each field of a config is declared once, with its type, range or choices and help.

A config is a frozen dataclass whose fields are made by `setting(...)`. The
declaration is the only place a field's rules live: `check_fields` validates
a config against it (the Python API, presets and resumed runs all construct
configs, so all are checked), `parse` turns command-line text (`--set
FIELD=VALUE`, flags) into a value, and `describe` writes the help. Free of
TensorFlow, so that `--help` answers at once.
"""

import dataclasses
import difflib
import numbers

import numpy as np

from poecaps.errors import InputError
from poecaps.validation import check_number, choice_list, number_bounds

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class SettingError(InputError):
    """A setting's value is not what its declaration allows; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """The rules of one setting.

    Args:
        kind: `bool`, `int`, `float` or `str`.
        help: one line for `--help`.
        minimum, maximum: inclusive bounds of a number (None: unbounded).
        above, below: exclusive bounds of a number (None: unbounded).
        choices: the allowed strings.
        optional: whether None is allowed (its meaning is in `help`).
        none_word: the word that stands for None ("none", or e.g. "auto"
            where None means "chosen for you"): on the command line, where
            "none" and "null" also do, and in Python for a number or flag.
    """

    kind: type
    help: str
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple | None = None
    optional: bool = False
    none_word: str = "none"

    def __post_init__(self):
        if self.kind not in (bool, int, float, str):
            raise TypeError(f"kind must be bool, int, float or str. Received: kind={self.kind!r}")
        bounded = (self.minimum, self.maximum, self.above, self.below) != (None,) * 4
        if self.kind in (int, float) and not bounded:
            raise TypeError("a numeric setting needs a range (minimum, maximum, above or below)")
        if self.kind is str and self.choices is None and not self.optional:
            raise TypeError("a text setting needs choices (or optional=True for a free path)")

    def describe(self):
        """What the setting accepts, in words, as the library's checks word it: 'an integer >= 1',
        'a finite number > 0', 'one of ...', 'true or false'."""
        if self.kind is bool:
            text = "true or false"
        elif self.kind is str:
            text = f"one of {choice_list(self.choices)}" if self.choices else "a path"
        else:
            text = "an integer" if self.kind is int else "a finite number"
            text += " " + number_bounds(self.minimum, self.maximum, self.above, self.below)
        return text + (f", or {self.none_word}" if self.optional else "")

    def check(self, name, value):
        """`value` if it obeys the rules (ints accepted for floats, as floats; NumPy numbers and bools as
        Python ones); else `SettingError`.

        An optional number or flag also takes `none_word` for None (`l1="auto"`); for a text
        setting the word is text (a folder may be called "none"). A refusal shows the value as given
        (`-3`, not the `-3.0` it reads as).
        """
        return self._check(name, value, typed=None)

    def _check(self, name, value, typed):
        """`check`, whose refusal shows `typed` (command-line text) if given, else the value as given."""
        given = value
        names_none = isinstance(value, str) and self.kind is not str and value == self.none_word
        if self.optional and (value is None or names_none):
            return None
        if value is None:
            self._fail(name, given, typed)
        if self.kind is bool:
            if not isinstance(value, (bool, np.bool_)):
                self._fail(name, given, typed)
            return bool(value)
        if self.kind is str:
            if not isinstance(value, str) or (self.choices and value not in self.choices) or not value:
                self._fail(name, given, typed)
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Real):    # NumPy numbers too
            self._fail(name, given, typed)
        if self.kind is int:
            if not isinstance(value, numbers.Integral):
                self._fail(name, given, typed)
            value = int(value)
        if self.kind is float:
            try:
                value = check_number(value, name)       # a finite Python float (NaN, inf, huge ints refused)
            except InputError:
                self._fail(name, given, typed)
        if ((self.minimum is not None and value < self.minimum)
                or (self.maximum is not None and value > self.maximum)
                or (self.above is not None and value <= self.above)
                or (self.below is not None and value >= self.below)):
            self._fail(name, given, typed)
        return value

    def parse(self, name, text):
        """The value that command-line `text` stands for, checked; a refusal shows the text as typed (1e400,
        not the inf it reads as)."""
        if not isinstance(text, str):
            return self.check(name, text)
        stripped = text.strip()
        if self.optional and stripped.lower() in ("none", "null", self.none_word):
            return None
        if self.kind is bool:
            if stripped.lower() not in _TRUE + _FALSE:
                self._fail(name, text)
            return stripped.lower() in _TRUE
        if self.kind is str:
            return self.check(name, stripped)
        try:
            value = int(stripped) if self.kind is int else float(stripped)
        except ValueError:
            self._fail(name, text)
        return self._check(name, value, typed=stripped)

    def _fail(self, name, value, typed=None):
        """Refuse `value`, showing `typed` (text as typed, unquoted) if given, else the value's repr, cut
        short past 80 characters (an int of 400 digits)."""
        shown = typed if typed is not None else repr(value)
        if len(shown) > 80:
            shown = f"{shown[:40]}... ({len(shown)} characters)"
        raise SettingError(f"{name} must be {self.describe()}. Received: {name}={shown}")


def setting(default, help, kind=None, **rules):
    """A dataclass field declared with its rules (`Spec`); `kind` defaults to the default's type."""
    spec = Spec(kind or type(default), help, optional=rules.pop("optional", default is None), **rules)
    spec.check("default", default)
    return dataclasses.field(default=default, metadata={"spec": spec})


def specs(config_cls):
    """`{field name: Spec}` of a config class (or instance), in declaration order."""
    found = {}
    for field in dataclasses.fields(config_cls):
        if "spec" not in field.metadata:
            raise TypeError(f"{getattr(config_cls, '__name__', type(config_cls).__name__)}.{field.name} "
                            "is not declared with poecaps.experiments.settings.setting")
        found[field.name] = field.metadata["spec"]
    return found


def check_fields(config):
    """Check every field of a frozen config against its declaration, normalising numbers in place."""
    for name, spec in specs(config).items():
        object.__setattr__(config, name, spec.check(name, getattr(config, name)))


def unknown_field_error(config_cls, name, *more_classes):
    """A `SettingError` for a field neither `config_cls` nor `more_classes` has, naming the close matches."""
    classes = (config_cls, *more_classes)
    names = list(dict.fromkeys(field for cls in classes for field in specs(cls)))
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else f" Known fields: {', '.join(names)}."
    if more_classes:
        owners = ", ".join(cls.__name__ for cls in classes[:-1])
        return SettingError(f"Neither {owners} nor {classes[-1].__name__} has a setting {name!r}.{hint}")
    return SettingError(f"{config_cls.__name__} has no setting {name!r}.{hint}")


def config_or_default(config, config_cls):
    """`config` if it is a `config_cls`, `config_cls()` if None, else a `SettingError` naming both."""
    if config is None:
        return config_cls()
    if not isinstance(config, config_cls):
        article = "an" if config_cls.__name__[0] in "AEIOU" else "a"
        raise SettingError(f"config must be {article} {config_cls.__name__} (or None for its defaults). "
                           f"Received: {type(config).__name__}")
    return config


def with_values(config, values):
    """A copy of `config` with `values` (`{name: value or command-line text}`) set, each checked."""
    declared = specs(config)
    parsed = {}
    for name, value in values.items():
        if name not in declared:
            raise unknown_field_error(type(config), name)
        parsed[name] = declared[name].parse(name, value)
    return dataclasses.replace(config, **parsed)


def parse_assignment(text):
    """`'field=value'` -> `('field', 'value')`; dashes in the field name read as underscores."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise SettingError(f"--set takes FIELD=VALUE. Received: {text!r}")
    return name.strip().replace("-", "_"), value
