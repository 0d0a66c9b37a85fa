"""The README's settings table, made from the table in neuron/config.py.

    python scripts/settings_table.py            # print it
    python scripts/settings_table.py --write    # replace it in README.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from neuron.config import SETTINGS
from neuron.entrypoints import generate, serve

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- settings table: made by scripts/settings_table.py from neuron/config.py -->"
END = "<!-- end of settings table -->"


def _flag(name: str) -> str:
    if name == "model":
        return "`MODEL` *"
    if name not in serve.OPTIONS:
        return ""
    return f"`{SETTINGS[name].flag}`" + (" *" if name in generate.OPTIONS else "")


def render() -> str:
    rows = ["| variable | `neuron serve` flag | default | meaning |", "|---|---|---|---|"]
    for name, s in SETTINGS.items():
        rows.append(f"| `{s.env}` | {_flag(name)} | {s.shown()} | {s.help} |")
    return "\n".join([BEGIN, *rows, END])


def readme_table(text: str) -> str:
    """The generated block as README.md has it now."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        text = README.read_text()
        README.write_text(text.replace(readme_table(text), render()))
    else:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
