"""Config files: YAML whose keys are a command's long flag names without the dashes (`max-num-seqs: 64`),
as vLLM's `--config`. A file's values become the command's defaults, so flags on the command line override
them. Keys and values are checked against the parser's own actions: every flag is a key, with no list to
keep in step.
"""

from __future__ import annotations

import argparse
import difflib
import os
from dataclasses import fields
from typing import Any

import yaml

from jserve.command_line import build_parser
from jserve.engine.args import EngineArgs
from jserve.errors import JServeError, short_repr


class ConfigError(JServeError, ValueError):
    """A config file that cannot be read, or a key or value its command does not take."""


def config_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The keys a file may set for `parser`: each long flag without its dashes, and an optional positional
    (serve's `model`) by its name. A boolean flag is `flag: true|false`, so `--no-flag` is not a key."""
    keys = {}
    for action in parser._actions:  # argparse lists a parser's actions nowhere public
        if isinstance(action, argparse._HelpAction) or action.dest == "config":
            continue
        if not action.option_strings and action.nargs == argparse.OPTIONAL:
            keys[action.dest] = action
        negated = isinstance(action, argparse.BooleanOptionalAction)
        for option in action.option_strings:
            if option.startswith("--") and not (negated and option.startswith("--no-")):
                keys[option[2:]] = action
    return keys


def read_config(path: str | os.PathLike, keys: dict[str, argparse.Action], command: str) -> dict[str, Any]:
    """The file's settings as {argparse dest: value}, each converted as its flag's action converts a command
    line's; ConfigError names the file and the key of an unknown key or a bad value. `command`: the
    command(s) the keys are of, for the message."""
    values: dict[str, Any] = {}
    key_of: dict[str, str] = {}
    for key, value in _read_mapping(path).items():
        action = keys.get(key)
        if action is None:
            close = difflib.get_close_matches(str(key).replace("_", "-"), keys, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: {key!r} is not a setting of {command}{hint}")
        if action.dest in values:
            raise ConfigError(f"{path}: {key!r} and {key_of[action.dest]!r} are the same setting")
        try:
            values[action.dest] = _convert(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise ConfigError(f"{path}: {key}: {err}") from None
        key_of[action.dest] = key
    return values


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse argv; when its subcommand was given --config FILE, parse again with the file's values as that
    subcommand's defaults, so that flags on the command line override the file."""
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    command = _subcommand(parser, args)
    try:
        values = read_config(args.config, config_keys(command), command.prog)
    except ConfigError as err:
        command.exit(2, f"{command.prog}: error: {err}\n")  # argparse's error line, without the long usage
    command.set_defaults(**values)
    args = parser.parse_args(argv)
    for action in command._actions:
        if isinstance(action, argparse._AppendAction) and action.dest in values:
            # argparse appends a flag's items to its default: any past the file's are the command line's
            given = getattr(args, action.dest)[len(values[action.dest]) :]
            if given:
                setattr(args, action.dest, given)
    return args


def load_config(path: str | os.PathLike) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from a config file: its engine settings, underscored (`max-num-seqs: 64`
    gives `max_num_seqs=64`). Keys of the server and the command line only (port, host, max-queue,
    temperature...) are valid and left out. An unknown key or a bad value raises ValueError naming it and
    the file."""
    keys: dict[str, argparse.Action] = {}  # the commands' flags are the keys
    for command in _subcommands(build_parser()).values():
        if any(action.dest == "config" for action in command._actions):
            keys |= config_keys(command)
    engine_fields = {f.name for f in fields(EngineArgs)}
    values = read_config(path, keys, "jserve serve, generate or chat")
    return {name: value for name, value in values.items() if name in engine_fields}


def _read_mapping(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            settings = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"config file {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if settings is None:  # empty, or comments only
        return {}
    if not isinstance(settings, dict):
        raise ConfigError(f"config file {path}: expected `key: value` lines, got a {type(settings).__name__}")
    return settings


def _convert(action: argparse.Action, value: Any) -> Any:
    if action.nargs == 0:  # a flag without a value: BooleanOptionalAction, store_true or store_false
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {short_repr(value)}")
        return not value if isinstance(action, argparse._StoreFalseAction) else value
    if isinstance(action, argparse._AppendAction):  # a repeatable flag: a list, or one value
        return [_scalar(action, item) for item in (value if isinstance(value, list) else [value])]
    return _scalar(action, value)


def _scalar(action: argparse.Action, value: Any) -> Any:
    """What argparse makes of `value` written on the command line: its type, checked against its choices."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"expected a single value, got {short_repr(value)}")
    convert = action.type or str
    try:
        converted = convert(str(value))
    except (TypeError, ValueError):
        raise ValueError(f"invalid {getattr(convert, '__name__', 'value')} value {short_repr(value)}") from None
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{short_repr(converted)} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _subcommand(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[getattr(args, action.dest)]
