"""Command-line options that mirror the fields of a config dataclass.

An option whose argparse `dest` is a field's name (`--max-length` -> `max_length`) takes its type and
default from the field (`add_field_options`), and a parsed namespace fills every such field of a new
config (`dataclass_from_args`): the dataclass stays the one place that names and defaults a setting.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

ConfigT = TypeVar("ConfigT")


def add_field_options(
    parser: argparse.ArgumentParser,
    config_class: type,
    helps: dict[str, str | None],
    field_names: dict[str, str] | None = None,
) -> None:
    """One option per `helps` entry (flag -> help text), in order, for the field of `config_class` the
    flag names (`--max-length` -> `max_length`; `field_names` maps a flag whose field is named otherwise).

    The field's default is the option's default and, for an int or float, its type; a bool field that
    defaults to False becomes a switch. So the command line and code that builds the config directly
    get the same defaults. The option's `dest` follows the flag, as with any other option.
    """
    defaults = {field.name: field.default for field in dataclasses.fields(config_class)}
    for flag, help_text in helps.items():
        field_name = (field_names or {}).get(flag, flag.removeprefix("--").replace("-", "_"))
        default = defaults[field_name]
        if default is False:
            parser.add_argument(flag, action="store_true", help=help_text)
        elif type(default) in (int, float):
            parser.add_argument(flag, type=type(default), default=default, help=help_text)
        else:
            raise TypeError(f"{config_class.__name__}.{field_name} has no int, float or False default")


def dataclass_from_args(config_class: type[ConfigT], args: argparse.Namespace, **computed: Any) -> ConfigT:
    """A `config_class` whose fields are the parsed arguments of the same name (argparse `dest`).

    `computed` gives the fields the command line does not hold as they are (parsed, checked, loaded
    or renamed values) and wins over an argument of the same name; fields with neither keep their
    defaults.
    """
    from_args = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(config_class)
        if field.init and field.name not in computed and hasattr(args, field.name)
    }
    return config_class(**from_args, **computed)
