"""Command-line options made from settings: each flag's parser, help and default come from the
table in neuron.config, so flags and environment variables take the same values and `--help`
shows each default once.

An option left off the command line parses to None; the configs then take the setting
(its NEURON_* variable, else the table's default).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

from neuron.config import SETTINGS, Setting


def describe(s: Setting) -> str:
    """Help text: what the setting does, its default, and the variable that sets it too."""
    env = f"{s.env}=1" if s.kind is bool else s.env
    return f"{s.help} (default: {s.shown()}; {env})".replace("%", "%%")


def _parser(s: Setting):
    def parse(text: str) -> Any:
        try:
            return s.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = s.name  # argparse names the type in some of its messages
    return parse


def add_model(ap: argparse.ArgumentParser) -> None:
    """The optional positional MODEL."""
    ap.add_argument("model", nargs="?", default=None, metavar="MODEL", help=describe(SETTINGS["model"]))


def add_options(ap: argparse.ArgumentParser, names: Iterable[str]) -> None:
    for name in names:
        s = SETTINGS[name]
        if s.kind is bool:
            ap.add_argument(s.flag, dest=name, action="store_true", default=None, help=describe(s))
        else:
            ap.add_argument(s.flag, dest=name, type=_parser(s), default=None, metavar=_metavar(s), help=describe(s))


def _metavar(s: Setting) -> str:
    if s.choices:
        return "{" + ",".join(s.choices) + "}"
    if s.kind == "bytes":
        return "BYTES"
    if s.name.endswith("_s"):
        return "SECONDS"
    return {int: "N", float: "X"}.get(s.kind, s.name.upper())


def given(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The options set on the command line that are fields of the dataclass `config`."""
    values: Mapping[str, Any] = vars(args)
    return {f.name: values[f.name] for f in fields(config) if values.get(f.name) is not None}
