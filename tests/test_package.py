"""Package structure: the moe_core import graph has no cycle and runs only down the layers, no module but the
roles module tests parameter names, and the public names import from their packages."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import torch

from moe_core.config import TransformerConfig
from moe_core.models.gpt import GPTModel
from moe_core.models.param_roles import param_roles

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


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Edges ``importer -> imported`` between the modules of ``sources`` (name -> source text). Importing
    ``a.b.c`` also runs the packages ``a`` and ``a.b`` unless they enclose the importer (then they are already
    initialising)."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        enclosing = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
        edges = set()
        for imported in _imported_names(ast.parse(source)):
            parts = imported.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in sources and target not in enclosing:
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


def package_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_moe_core_has_no_import_cycle():
    graph = import_graph(package_sources())
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


# moe_core's layers, lowest first: a module imports from its own layer and the layers below only. The first holds
# the shared low-level modules; the package itself (its __init__, the public face) sits above them all.
LAYERS = (
    ("moe_core._C", "moe_core.config", "moe_core.activations", "moe_core.recompute", "moe_core.mlp"),
    ("moe_core.ops",),
    ("moe_core.parallel",),
    ("moe_core.moe",),
    ("moe_core.models",),
    ("moe_core.training",),
    ("moe_core.interop",),
    ("moe_core",),
)


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``module``: its own entry or its package's.

    Raises:
        ValueError: a module no layer holds (a new top-level module takes its place in ``LAYERS``).
    """
    for i in range(len(LAYERS) - 1):
        if any(module == entry or module.startswith(f"{entry}.") for entry in LAYERS[i]):
            return i
    if module == "moe_core":
        return len(LAYERS) - 1
    raise ValueError(f"{module}: in no layer of LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` from a lower layer to a higher one, as ``importer -> imported``."""
    return [f"{importer} -> {imported}" for importer, imports in sorted(graph.items()) for imported in sorted(imports)
            if layer_of(imported) > layer_of(importer)]


def test_upward_imports_catch_a_synthetic_violation():
    # Negative control: a module of parallel/ importing moe's classes.
    sources = {"moe_core.parallel": "", "moe_core.parallel.plan": "from moe_core.moe.experts import GroupedMLP\n",
               "moe_core.moe": "", "moe_core.moe.experts": "from moe_core.parallel.plan import x\n"}
    assert upward_imports(import_graph(sources)) == ["moe_core.parallel.plan -> moe_core.moe",
                                                     "moe_core.parallel.plan -> moe_core.moe.experts"]
    with pytest.raises(ValueError, match="moe_core.extra: in no layer"):
        layer_of("moe_core.extra")


def test_moe_core_imports_only_down_its_layers():
    graph = import_graph(package_sources())
    assert graph["moe_core.models.tp_plan"] >= {"moe_core.parallel.tensor_parallel", "moe_core.moe.moe_layer"}
    assert upward_imports(graph) == []


# The roles module owns every decision by parameter name; elsewhere a string that names a part of the model may be
# built (a mapping's keys) but never tested against a name. The exceptions test another framework's keys, by string.
ROLES_MODULE = "moe_core.models.param_roles"
FOREIGN_KEY_TESTS = {  # Megatron's SequentialMLP checkpoint keys, read into TEGroupedMLP's layout
    "moe_core.interop.megatron_experts": {r"(.*)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias|_extra_state)",
                                          "local_experts."},
}
_NAME_TESTS = {"endswith", "startswith", "removeprefix", "removesuffix", "split", "rsplit", "partition", "rpartition",
               "replace", "find", "rfind", "index", "count", "compile", "match", "fullmatch", "search", "sub", "subn",
               "findall", "finditer"}


def model_name_parts() -> set[str]:
    """Every part of a parameter name of GPTModels with every optional parameter (grouped and sequential experts),
    current and former names."""
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=16, vocab_size=32, seq_length=8, qk_layernorm=True, add_bias_linear=True,
                               num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8, moe_layer_freq=[0, 1],
                               moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True)
    parts: set[str] = set()
    with torch.device("meta"):
        for grouped in (True, False):
            for role in param_roles(GPTModel(dataclasses.replace(config, moe_grouped_gemm=grouped))).values():
                parts.update(p for name in (role.name, role.former_name or "") for p in name.split(".") if p and
                             not p.isdigit())
    return parts


def _strings(node: ast.AST):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        for value in node.values:
            yield from _strings(value)
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for element in node.elts:
            yield from _strings(element)
    elif isinstance(node, ast.BinOp):
        yield from _strings(node.left)
        yield from _strings(node.right)


def name_tests(source: str, parts: set[str]) -> list[tuple[int, str]]:
    """``(line, string)`` of each string naming one of ``parts`` that ``source`` compares (``==``, ``in``, ...)
    or passes to a string test or regex (``endswith``, ``split``, ``re.compile``, ...)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _NAME_TESTS:
            operands = list(node.args)
        for operand in operands:
            found += [(node.lineno, s) for s in _strings(operand) if parts & set(re.findall(r"[A-Za-z_]\w*", s))]
    return found


def test_name_tests_catch_synthetic_violations():
    # Negative control: the tests the roles module replaced, and what stays allowed.
    parts = model_name_parts()
    assert {"local_experts", "experts", "linear_fc1", "fc1", "fc2", "bias", "layers"} <= parts
    violating = ('def stacked(name, module_name):\n'
                 '    if name.endswith("experts.fc1.weight") or ".local_experts." not in name:\n'
                 '        return re.compile(r"(\\.local_experts\\.)(\\d+)").sub("", name)\n'
                 '    return name.rsplit(".", 1)[-1] == "bias" or module_name in ("layers",) or \\\n'
                 '        name.startswith(prefix + "mlp.experts.")\n')
    assert set(name_tests(violating, parts)) == {(2, "experts.fc1.weight"), (2, ".local_experts."),
                                                 (3, r"(\.local_experts\.)(\d+)"), (4, "bias"), (4, "layers"),
                                                 (5, "mlp.experts.")}
    allowed = ('rules = {f"{prefix}.linear_fc1.weight": std}\n'
               'index = path.endswith(".index.json") or key.startswith("model.")\n')
    assert name_tests(allowed, parts) == []


def test_only_the_roles_module_tests_parameter_names():
    parts = model_name_parts()
    found = {}
    for name, source in package_sources().items():
        hits = [hit for hit in name_tests(source, parts) if hit[1] not in FOREIGN_KEY_TESTS.get(name, set())]
        if hits and name != ROLES_MODULE:
            found[name] = hits
    assert found == {}
