"""The package's import graph: layers that only import downwards, and no cycles between modules.

Every `import` of a megatron_rl module is counted, also those made inside functions (a lazy import is a
dependency all the same; it only moves the failure to run time). `from megatron_rl.x import y` depends on
the submodule `x.y` when there is one, else on `x`. The layers, lowest first:

    config, ports | algo | data, metrics, scaling | models, rewards | rollout | generator, trainer | convert, plan
    | orchestration | cli

A package may import one of a lower layer, never one of its own layer or above (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_rl

ROOT = Path(megatron_rl.__file__).parent

LAYERS = [
    {"config", "ports"},
    {"algo"},
    {"data", "metrics", "scaling"},
    {"models", "rewards"},
    {"rollout"},
    {"generator", "trainer"},
    {"convert", "plan"},
    {"orchestration"},
    {"cli"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in ROOT.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """megatron_rl module -> the megatron_rl modules it imports (at module level or in a function)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names if alias.name.split(".")[0] == "megatron_rl")
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] != "megatron_rl":
                    continue
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; the package uses absolute imports")
        unknown = {e for e in edges if e not in modules}
        assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"
        graph[name] = edges - {name}
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer() -> None:
    packages = {_package(m) for m in _modules()} - {""}
    assert packages == set(RANK), f"unlayered: {sorted(packages - set(RANK))}; gone: {sorted(set(RANK) - packages)}"


def test_packages_import_only_lower_layers() -> None:
    upward = []
    for module, edges in import_graph().items():
        for target in edges:
            a, b = _package(module), _package(target)
            if a and b and a != b and RANK[a] <= RANK[b]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go down a layer:\n" + "\n".join(sorted(upward))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components of more than one module (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles() -> None:
    cycles = strongly_connected(import_graph())
    assert not cycles, "modules that import each other (directly or through others): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The graph walk is not vacuous: a known cycle is found, and the real graph has downward edges."""
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph()
    assert "megatron_rl.models" in graph["megatron_rl.trainer.weights"]  # the weight sync's names
    assert "megatron_rl.data.code_tests" in graph["megatron_rl.data.datasets"]
    assert any(t.startswith("megatron_rl.trainer") for t in graph["megatron_rl.convert.hf_import"])
