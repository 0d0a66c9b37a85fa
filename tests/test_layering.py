"""The package's folders are layers: every import points down, so no two folders import each
other. Read from the source (imports inside functions count too), nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import neuron

PACKAGE = Path(neuron.__file__).parent

# Lowest first. A module may import from its own layer or any layer before it. `base` is the
# package's top-level modules (errors, config).
LAYERS = ["base", "utils", "rpc", "distributed", "layers", "multimodal", "models", "worker", "executor",
          "engine", "bench", "entrypoints"]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "neuron" or len(parts) == 1:
        return None
    return parts[1] if (PACKAGE / parts[1]).is_dir() else "base"


def imports(path: Path) -> set[str]:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".")[: -node.level]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names if (PACKAGE.parent / base.replace(".", "/") / a.name).exists()
                      or (PACKAGE.parent / f"{base.replace('.', '/')}/{a.name}.py").exists()}
    return found


def edges() -> set[tuple[str, str, str]]:
    """(importing layer, imported layer, file) for every import that crosses folders."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        src = layer_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if src is None or path.name == "__main__.py":  # the public facades (`import neuron`, `python -m neuron`)
            continue
        for name in imports(path):
            dst = layer_of(name)
            if dst is not None and dst != src:
                out.add((src, dst, str(path.relative_to(PACKAGE.parent))))
    return out


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {"base"}


def test_imports_point_down():
    upward = sorted(f"{file}: {src} imports {dst}" for src, dst, file in edges()
                    if LAYERS.index(dst) > LAYERS.index(src))
    assert upward == []


def test_no_cycle_between_folders():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges():
        graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(a for a in graph if reaches(a, a, {a}))
    assert cycles == []


def test_the_wire_and_the_config_import_no_torch():
    """Mock workers and fuzzers speak the protocol without torch."""
    for path in [*(PACKAGE / "rpc").glob("*.py"), PACKAGE / "config.py", PACKAGE / "errors.py"]:
        assert not {n for n in imports(path) if n.split(".")[0] == "torch"}, path
