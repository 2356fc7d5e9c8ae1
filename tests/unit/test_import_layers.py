"""The layers of services/, read from the source with ``ast`` (every import statement, the
ones inside functions and under TYPE_CHECKING too): no import cycle between packages, only
the parts that run a model (the workers, bench) import the engine, and services/api (the
cluster's messages) and services/model depend on nothing they should not."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
Graph = dict[str, dict[str, list[str]]]  # node -> node it imports -> "module -> import" lines


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[str]:
    """Every ``services...`` module or name ``path`` imports, relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        yield from (n for n in names if n == "services" or n.startswith("services."))


def _sources() -> list[Path]:
    return sorted(p for p in SERVICES.rglob("*.py") if "gen" not in p.relative_to(SERVICES).parts)


def _top_node(module: str) -> str | None:
    """The top-level package under services/ (or top-level module, e.g. ``cli``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _engine_node(module: str) -> str | None:
    """A package directly under services/engine/, or "engine" for the engine's own modules."""
    parts = module.split(".")
    if parts[:2] != ["services", "engine"]:
        return None
    if len(parts) > 2 and (SERVICES / "engine" / parts[2] / "__init__.py").is_file():
        return f"engine.{parts[2]}"
    return "engine"


def _graph(node_of: Callable[[str], str | None]) -> Graph:
    graph: Graph = defaultdict(lambda: defaultdict(list))
    for path in _sources():
        module = _module_name(path)
        src = node_of(module)
        if src is None:
            continue
        for name in _imports(path):
            dst = node_of(name)
            if dst is not None and dst != src:
                graph[src][dst].append(f"{module} -> {name}")
    return graph


def _cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(graph: Graph, cycle: list[str]) -> str:
    """Each edge inside the cycle with one import that makes it."""
    lines = [" <-> ".join(cycle)]
    for a in cycle:
        for b in cycle:
            if b in graph.get(a, {}):
                lines.append(f"  {a} -> {b}: {graph[a][b][0]}")
    return "\n".join(lines)


def _importers_of(prefix: str, package: str) -> list[str]:
    return [f"{_module_name(p)} -> {n}"
            for p in _sources() if _top_node(_module_name(p)) == package
            for n in _imports(p) if n == prefix or n.startswith(prefix + ".")]


def test_the_graph_sees_the_packages() -> None:
    # NOTE: guards the walk itself: an empty graph would pass every check below.
    graph = _graph(_top_node)
    assert {"api", "engine", "processor", "router", "frontend"} <= set(graph)
    assert "api" in graph["engine"]


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = _graph(_top_node)
    cycles = _cycles(graph)
    assert not cycles, "import cycles between packages under services/:\n" + "\n".join(
        _describe(graph, c) for c in cycles)


def test_no_import_cycle_between_the_engines_packages() -> None:
    # NOTE: the engine's own top-level modules (batch, request, sequence, sampler, model,
    # engine, factory, ...) are left out: they are both the base every subpackage builds on
    # and the assembly that composes them. Between the subpackages (runner, tp, parallel,
    # cpu_kernels, quant, layers, weights, grammar, multimodal) imports go one way.
    graph = _graph(lambda m: None if _engine_node(m) == "engine" else _engine_node(m))
    assert {"engine.runner", "engine.tp", "engine.quant"} <= set(graph)
    cycles = _cycles(graph)
    assert not cycles, "import cycles between the engine's packages:\n" + "\n".join(
        _describe(graph, c) for c in cycles)


@pytest.mark.parametrize("package", ["frontend", "processor", "router", "api", "model", "common",
                                     "disagg", "launcher", "steptime"])
def test_parts_that_run_no_model_never_import_the_engine(package: str) -> None:
    assert _importers_of("services.engine", package) == []


def test_api_depends_on_nothing_in_services_but_the_generated_protobufs() -> None:
    bad = [line for line in _importers_of("services", "api")
           if not line.split(" -> ")[1].startswith(("services.api", "services.gen"))]
    assert bad == []


def test_model_depends_only_on_api_and_common() -> None:
    allowed = ("services.model", "services.api", "services.common")
    bad = [line for line in _importers_of("services", "model")
           if not line.split(" -> ")[1].startswith(allowed)]
    assert bad == []


def test_a_cycle_is_reported_with_the_import_that_makes_it() -> None:
    graph: Graph = {"a": {"b": ["services.a.x -> services.b.y"]},
                    "b": {"c": ["services.b.y -> services.c"]},
                    "c": {"a": ["services.c -> services.a"]}, "d": {"a": ["services.d -> services.a"]}}
    cycles = _cycles(graph)
    assert cycles == [["a", "b", "c"]]
    assert "a -> b: services.a.x -> services.b.y" in _describe(graph, cycles[0])
