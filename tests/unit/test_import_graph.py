"""Imports go one way: the graph of ``automodel``'s imports (module level and inside functions), read
from the source, has no cycle, no import from a lower layer to a higher one, and no import by string."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import automodel

PACKAGE = Path(automodel.__file__).parent

# Lowest first: a module imports only from its own layer or lower ones.
LAYERS = (
    ("automodel", "automodel.errors", "automodel.config", "automodel.console", "automodel.te_support",
     "automodel.loss", "automodel.assets", "automodel.host_memory"),
    ("automodel.distributed",),
    ("automodel.data",),
    ("automodel.attention",),
    ("automodel.models", "automodel.logprobs"),
    ("automodel.training",),
    ("automodel.cli", "automodel.__main__", "automodel.benchmarks"),
)  # fmt: skip


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(source: str, modules: set[str]) -> set[str]:
    """The project modules ``source`` imports anywhere (functions included): ``from a.b import c`` is
    module ``a.b.c`` when that is one, else ``a.b`` (its ``__init__``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
    return found


def string_imports(source: str) -> list[str]:
    """``importlib.import_module(...)`` / ``__import__(...)`` calls on a project module or on a name
    computed at run time (external modules named by a literal are allowed: optional dependencies)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name in ("import_module", "__import__"):
                argument = node.args[0] if node.args else None
                literal = isinstance(argument, ast.Constant) and isinstance(argument.value, str)
                if not literal or argument.value.split(".")[0] in ("automodel", "benchmarks"):
                    found.append(ast.unparse(node))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(path.read_text(), set(modules)) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> int:
    """The layer of the longest prefix of ``module`` listed in :data:`LAYERS`."""
    best, best_length = None, -1
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = level, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: place it")
    return best


def test_the_cycle_finder_on_a_graph_worked_by_hand():
    # a -> b -> c -> a is one cycle; d -> e -> d another; f imports into the first but nothing returns
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_of_reads_function_level_and_from_imports():
    source = "import automodel.loss\ndef f():\n    from automodel.data import collate, LoaderEnv\n"
    modules = {"automodel.loss", "automodel.data", "automodel.data.collate"}
    assert imports_of(source, modules) == modules


def test_string_imports_are_found_and_literal_optional_dependencies_are_not():
    source = (
        "import importlib\nimportlib.import_module('transformer_engine.pytorch')\n"
        "importlib.import_module(f'benchmarks.{name}')\n__import__('automodel.loss')\n"
    )
    assert string_imports(source) == [
        "importlib.import_module(f'benchmarks.{name}')",
        "__import__('automodel.loss')",
    ]


def test_no_import_cycle_among_automodel_modules():
    assert cycles(import_graph()) == []


def test_no_module_imports_a_higher_layer():
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]
    assert upward == []


# The one import by a computed name: a recipe's `_target_` components (Hydra's dotted paths, which
# `check_target` admits only under automodel.* or in ALLOWED_TARGETS before anything is imported).
RECIPE_COMPONENTS = {"automodel.config": ["importlib.import_module(module_name)"]}


@pytest.mark.parametrize("module", sorted(module_names()))
def test_no_import_by_string(module):
    assert string_imports(module_names()[module].read_text()) == RECIPE_COMPONENTS.get(module, [])


def test_every_test_module_has_its_own_basename():
    """pytest imports test modules by basename (``tests`` has no packages): two files of one name, in
    tests/unit and tests/functional, stop collection with an import-file-mismatch error."""
    tests = Path(__file__).resolve().parents[1]
    seen: dict[str, list[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
