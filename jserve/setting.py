"""Settings declared once: a dataclass field carries its default, type and help, and its command-line flag is
made from it (named as the field, with dashes). Python keywords, flags and config-file keys (which
config_file reads off the flags) therefore cannot drift apart."""

from __future__ import annotations

import argparse
import difflib
import json
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """The command-line side of a setting, kept in its field's metadata."""

    help: str
    choices: Sequence[str] | None = None
    aliases: tuple[str, ...] = ()  # more names for the flag, such as vLLM's spelling of it


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field that is also a flag (typed `Any` as `dataclasses.field` is, so the annotation rules)."""
    return field(default=default, metadata={"flag": Flag(help, choices, aliases)})


def add_flags(parser: argparse.ArgumentParser, cls: type, positional: Sequence[str] = ()) -> None:
    """A flag for each field of `cls`, in their order; a field named in `positional` is an optional positional
    argument instead (serve's MODEL)."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        flag: Flag = f.metadata["flag"]
        options: dict[str, Any] = {"default": f.default, "help": flag.help, **_parsing(hints[f.name])}
        if flag.choices is not None:  # only when set: BooleanOptionalAction deprecates `choices`
            options["choices"] = flag.choices
        if f.name in positional:
            parser.add_argument(f.name, nargs="?", **options)
        else:
            parser.add_argument("--" + f.name.replace("_", "-"), *flag.aliases, **options)


def from_namespace(cls: type[T], args: argparse.Namespace) -> T:
    """The `cls` that parsed flags (from `add_flags`) describe."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def build(cls: type[T], **values: Any) -> T:
    """`cls(**values)`, where a name that is no field of `cls` is a TypeError suggesting the closest one."""
    names = [f.name for f in fields(cls)]
    for name in values:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{cls.__name__} has no setting {name!r}{hint}")
    return cls(**values)


def _parsing(hint: Any) -> dict[str, Any]:
    """How argparse reads a field annotated `hint` (`int | None` as int): bools as --flag / --no-flag,
    numbers by their type, lists as one or more values, anything else (text, paths) as the string given."""
    kinds = set(typing.get_args(hint) or [hint]) - {type(None)}
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction}
    if kinds in ({int}, {float}):
        return {"type": kinds.pop()}
    if any(typing.get_origin(kind) is list for kind in kinds):
        return {"nargs": "+"}
    return {}


def json_object(value: dict | str, name: str) -> dict:
    """A setting given as a dict or as its JSON text (a flag's value), as a dict; a ValueError naming the
    setting says what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value
