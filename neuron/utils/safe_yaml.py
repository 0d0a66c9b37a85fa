"""YAML (and so JSON) from files a user hands neuron, read within bounds: no aliases (`*name`: a few
lines of them can stand for billions of nodes, the "billion laughs"), no nesting deeper than
`max_nesting` (the composer recurses once per level) and no more than `max_nodes` values, each
refused at the node that breaks the rule, before anything is built; every error one line."""

from __future__ import annotations

from typing import Any

import yaml

from neuron.errors import ConfigError


def load(data: bytes | str, what: str, max_nesting: int = 16, max_nodes: int = 10_000) -> Any:
    """The document in `data`; ConfigError("{what}: ...") in one line when it is not one or breaks
    a bound."""

    class Loader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.nesting = self.nodes = 0

        def compose_node(self, parent, index):
            mark = self.peek_event().start_mark
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted", mark)
            if self.nesting >= max_nesting:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {max_nesting} levels", mark)
            self.nodes += 1
            if self.nodes > max_nodes:
                raise yaml.composer.ComposerError(None, None, f"more than {max_nodes:,} values", mark)
            self.nesting += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.nesting -= 1

    try:
        return yaml.load(data, Loader=Loader)  # noqa: S506 (a SafeLoader, and stricter)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {_one_line(exc)}") from None
    except ValueError as exc:  # a value YAML reads but Python refuses (an integer of 5,000 digits, a 13th month)
        raise ConfigError(f"{what}: {exc}") from None


def _one_line(exc) -> str:
    """A YAML error's problem and where, without the quoted snippet."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"
