"""The import layers of `decoders/` (docs/design/architecture.md): no module imports one of a higher layer, and no
import, lazy ones inside functions included, closes a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# lowest first; a module belongs to the longest prefix that names it
LAYERS = [
    ["decoders.models"],
    ["decoders.options", "decoders.registry", "decoders.base", "decoders.capabilities"],
    ["decoders.decoding"],
    ["decoders.drafting"],
    ["decoders.proposers"],
    ["decoders.strategies"],
    ["decoders.width"],
    ["decoders.batch"],
    ["decoders.driver"],
    ["decoders.hf_arguments", "decoders.hf", "decoders"],
]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / "decoders").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The `decoders` modules `name` imports anywhere in its file, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parents, base] if base else parents)
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    return {module for module in found if module in modules and module != name}


def _layer(module: str) -> int:
    matches = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer: place it in LAYERS (and the picture in docs/design/architecture.md)"
    return max(matches)[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_module_imports_a_higher_layer():
    graph = _graph()
    upward = [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps) if _layer(d) > _layer(m)]
    assert not upward, upward


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle in `graph` (its modules in order, the first again at the end), or None."""
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> list[str] | None:  # depth first; meeting a module on the path closes it
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph[module]):
            if found := walk(imported, [*path, module]):
                return found
        done.add(module)
        return None

    return next((found for module in sorted(graph) if (found := walk(module, []))), None)


def test_no_import_circle():
    assert _circle(_graph()) is None


def test_the_checks_see_imports_circles_and_layers():
    graph = _graph()
    assert "decoders.models.lm" in graph["decoders.base"]
    assert "decoders.models.zoo" in graph["decoders.models.kernel"]  # inside a function counts too
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None
    assert _layer("decoders.batch") > _layer("decoders.strategies.auto") > _layer("decoders.base")
    assert _layer("decoders.models.lm") == 0 and _layer("decoders") == len(LAYERS) - 1
