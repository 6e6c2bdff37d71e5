"""The package's imports point one way: no circle between modules, and no layer imports one above it.

Every import counts, also one inside a function (it runs too); only `if TYPE_CHECKING:` blocks are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vitrain"

# Lowest first. A module may import its own layer's modules and lower layers' (the ground floor imports none).
LAYERS = [
    [
        "vitrain.errors",
        "vitrain.device",
        "vitrain.files",
        "vitrain.registry",
        "vitrain.trust",
        "vitrain.shard_names",
        "vitrain.presets",
        "vitrain.metrics",
    ],
    ["vitrain.config"],
    ["vitrain.models", "vitrain.data", "vitrain.weights", "vitrain.onnx_export"],
    ["vitrain.precision", "vitrain.optim", "vitrain.parallel", "vitrain.checkpoint"],
    ["vitrain.tasks"],
    ["vitrain.engine"],
    ["vitrain.bench", "vitrain.plot"],
    ["vitrain.api", "vitrain.cli", "vitrain.__main__", "vitrain"],
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The vitrain modules `name` imports, each import statement resolved to the module it loads."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for block in ast.walk(tree) if _type_checking_only(block) for n in ast.walk(block)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in known else base)
    edges = set()
    for target in targets:
        if not target.startswith("vitrain"):
            continue
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        # Importing a.b.c runs the package a.b first, unless the importer is inside a.b already.
        parts = target.split(".")
        for i in range(2, len(parts) + 1):
            ancestor = ".".join(parts[:i])
            if ancestor in known and ancestor != name and not name.startswith(ancestor + "."):
                edges.add(ancestor)
    return edges - {name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def layer_of(name: str) -> int:
    best, level = -1, None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{name} is in no layer of tests/test_layers.py: add it to LAYERS"
    return level


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_no_layer_imports_a_higher_one():
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_the_check_finds_a_circle_and_an_upward_import():
    graph = {"vitrain.config": {"vitrain.engine.step"}, "vitrain.engine.step": {"vitrain.config"}}
    assert circles(graph) == [["vitrain.config", "vitrain.engine.step"]]
    assert layer_of("vitrain.engine.step") > layer_of("vitrain.config")
