"""Package structure: the moe_core import graph has no cycle, and the public names import from their packages."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_core"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(tree: ast.AST) -> list[str]:
    """Modules named by every import statement, at any depth (a function-level import is an edge too), except
    those under ``if TYPE_CHECKING:``; ``from pkg import sub`` names ``pkg.sub``."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges ``importer -> imported`` between moe_core modules. Importing ``a.b.c`` also runs the packages
    ``a`` and ``a.b`` unless they enclose the importer (then they are already initialising)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        enclosing = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
        edges = set()
        for imported in _imported_names(ast.parse(path.read_text())):
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and target not in enclosing:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_detects_a_function_level_import():
    # Negative control: the shape of the former token_dispatcher <-> token_dispatcher_alltoall cycle, where the
    # factory imported a subclass inside a function.
    base = ast.parse("def build():\n    from pkg.sub import Sub\n")
    assert _imported_names(base) == ["pkg.sub", "pkg.sub.Sub"]
    graph = {"pkg": set(), "pkg.base": {"pkg.sub"}, "pkg.sub": {"pkg.base"}}
    assert find_cycle(graph) == ["pkg.base", "pkg.sub", "pkg.base"]
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import Sub\n")
    assert _imported_names(guarded) == ["typing", "typing.TYPE_CHECKING"]


def test_moe_core_has_no_import_cycle():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = import_graph(modules)
    assert graph["moe_core.moe.moe_layer"] >= {"moe_core.moe.dispatcher_factory", "moe_core.moe.router"}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


@pytest.mark.parametrize("package,names", [
    ("moe_core.moe", ["MoELayer", "TopKRouter", "GroupedMLP", "SequentialMLP", "SharedExpertMLP",
                      "MoETokenDispatcher", "MoELocalTokenDispatcher", "MoEAlltoAllTokenDispatcher",
                      "MoEAllGatherTokenDispatcher", "build_token_dispatcher"]),
    ("moe_core.parallel", ["ModelParts", "apply_fsdp2", "apply_ddp", "clip_grad_norm_", "ProcessGroupCollection",
                           "check_ep_size"]),
])
def test_public_names(package, names):
    module = importlib.import_module(package)
    assert set(names) <= set(module.__all__)
    for name in module.__all__:
        obj = getattr(module, name)
        # Each name is the object of the module that defines it, not a copy.
        assert getattr(importlib.import_module(obj.__module__), name) is obj


def test_capacity_helpers_have_one_import_path():
    moe_utils = importlib.import_module("moe_core.moe.moe_utils")
    assert not hasattr(moe_utils, "get_capacity") and not hasattr(moe_utils, "apply_token_dropping")
    assert importlib.import_module("moe_core.moe.capacity").get_capacity(10, 4, 1.0) == 3
