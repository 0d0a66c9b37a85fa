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


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Module -> the neuron modules it imports (a name imported from a package counts as the
    package's module, a submodule imported by name as that submodule)."""
    modules = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        if path.name == "__main__.py":
            continue
        graph[name] = {m for m in imports(path) if m in modules and m != name and not
                       (m == "neuron" or name.startswith(m + "."))}  # a package's own __init__ is no edge back
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(out)


def test_no_cycle_between_modules():
    assert cycles(module_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---- the joins of issue 33: a configuration resolved once, an engine that is a loop ----


def _defs(path: Path, cls: str) -> list[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_engine_is_a_loop_over_a_resolved_model():
    """LLMEngine schedules, executes, samples and reports; what the model is, and how its files are
    read, it takes resolved (engine/model_config.py)."""
    path = PACKAGE / "engine" / "llm_engine.py"
    assert len(_defs(path, "LLMEngine")) < 30
    below = sorted(n for n in imports(path) if n.split(".")[:2] in (["neuron", "models"], ["neuron", "layers"]))
    assert below == []


def test_the_scheduler_runs_no_model():
    """Speculative decoding's proposers (and any executor) are out of the scheduler's reach."""
    found = imports(PACKAGE / "engine" / "scheduler.py")
    assert not {n for n in found if n.startswith(("neuron.engine.spec_decode", "neuron.executor"))}


def test_sequence_fields_are_typed():
    tree = ast.parse((PACKAGE / "engine" / "sequence.py").read_text())
    seq = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Sequence")
    untyped = [n.target.id for n in seq.body if isinstance(n, ast.AnnAssign) and "object" in ast.unparse(n.annotation)]
    assert untyped == []


def test_a_model_s_description_is_read_in_one_place():
    """config.json, GGUF metadata, quantization_config and generation/preprocessor configs are read
    by engine/model_config.py alone (the loaders read tensors)."""
    readers = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "default_checkpoint.py":  # writes the embedded model's files, reads none
            continue
        text = path.read_text()
        for needle in ('/ "config.json"', "generation_config.json\"", "preprocessor_config.json\"",
                       '.get("quantization_config")', '["quantization_config"]', '.field("', ".field(f\""):
            if needle in text:
                readers.append(f"{path.relative_to(PACKAGE)}: {needle}")
    assert {r.split(":")[0] for r in readers} == {"engine/model_config.py"}, readers
