"""The import graph of ``src/posttrain``: no cycles between modules, nothing imports upward, and
the heavy optional dependencies stay at the edges (docs/architecture.md, "Layers").

The graph is read with ``ast`` (nothing is imported; only
:func:`test_the_cli_loads_no_heavy_dependency` imports, in a subprocess): module-level and function-level (lazy)
imports count; imports under ``if TYPE_CHECKING:`` do not. ``from pkg import name`` is an edge to
the submodule ``pkg.name`` when that module exists, else to ``pkg`` itself (its ``__init__``), so a
package ``__init__`` that re-exports its submodules makes a cycle only when a submodule imports
names from that ``__init__``, or when the ``__init__`` imports its submodules at module level (eagerly)
and a submodule imports through the half-initialised package (``from pkg import sibling``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "posttrain"

# Lowest first. Modules in one layer may import each other across packages; nothing imports a
# higher layer.
LAYERS: list[set[str]] = [
    {"errors", "paths", "device", "host_memory", "registry", "extras", "version", "files"},
    # the stages of the data flow, and the store: they take plain values and typed options, never the config
    {"algo", "data", "models", "metrics", "reward", "rollout", "tools", "checkpoint", "rundir", "transfer_dock",
     "envs"},
    {"training"},
    {"config"},  # the YAML in, the typed plan out
    {"roles"},
    {"cluster", "loops"},
    {"commands", "cli", "demo", "__main__", "api"},
]
LAYER_OF = {top: i for i, tops in enumerate(LAYERS) for top in tops}

# Heavy dependency -> the only places (module names or package prefixes) that may import it.
EDGE_DEPENDENCIES = {
    "ray": ("posttrain.cluster",),
    "verifiers": ("posttrain.envs",),  # rl_config.env_config (the [envs] extra)
    "transfer_queue": ("posttrain.cluster.transfer_queue",),  # data_strategy: tq; it imports ray
    "tensordict": ("posttrain.cluster.transfer_queue",),
    "vllm": ("posttrain.rollout.vllm_engine", "posttrain.rollout.vllm_probe", "posttrain.rollout.vllm_receiver"),
}


# What ``import posttrain``, ``import posttrain.cli`` and the CLI's argument parsing (``posttrain --help``)
# must not load: the modules they reach import these lazily, where they are used.
CLI_FORBIDDEN = ("torch", "transformers", "datasets", "pyarrow", "matplotlib", "math_verify", "safetensors",
                 "rank_bm25")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((SRC / PKG).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Yield every Import/ImportFrom node, skipping ``if TYPE_CHECKING:`` bodies (not their else)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _module_level_imports(tree: ast.Module):
    """Import nodes that run when the module is imported (not inside a function body)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _scan() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Return (internal edges, external top-level imports): module -> {target: first line}."""
    modules = _modules()
    trees = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in modules.items()}
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    eager = set()  # packages whose __init__ imports its own submodules at import time
    for package in packages:
        for node in _module_level_imports(trees[package]):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [_absolute(node, package, True)] + [f"{_absolute(node, package, True)}.{a.name}"
                                                              for a in node.names])
            if any(n.startswith(package + ".") and n in modules for n in names):
                eager.add(package)
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    external: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, tree in trees.items():
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(node, module, module in packages)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
                if base in eager and module.startswith(base + "."):
                    targets.append(base)  # reads the sibling from the half-initialised package
            for target in targets:
                if target == PKG or target.startswith(PKG + "."):
                    while target not in modules:  # `import posttrain.x.y` of a missing name
                        target = target.rpartition(".")[0]
                    if target != module:
                        edges[module].setdefault(target, node.lineno)
                else:
                    external[module].setdefault(target.split(".")[0], node.lineno)
    return edges, external


def _strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); return the components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def _cycle_in(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    """One concrete cycle through the component's first module, as 'a:line -> b:line -> ... -> a'."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first: the shortest path back to start
        nxt = []
        for node in frontier:
            for child in sorted(edges[node]):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    path.reverse()
                    hops = [f"{a} (line {edges[a][b]})" for a, b in zip(path, path[1:] + [start])]
                    return " -> ".join(hops + [start])
                if child not in parents and child != start:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return " <-> ".join(component)


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.fixture(scope="module")
def graph():
    return _scan()


def test_every_top_level_module_has_a_layer():
    tops = {_top(m) for m in _modules()} - {""}
    missing = sorted(tops - set(LAYER_OF))
    assert not missing, f"give these a layer in LAYERS (and in docs/architecture.md, \"Layers\"): {missing}"


def test_no_import_cycles(graph):
    edges, _ = graph
    cycles = [_cycle_in(c, edges) for c in _strongly_connected(edges)]
    assert not cycles, "import cycles between modules:\n  " + "\n  ".join(cycles)


def test_no_upward_imports(graph):
    edges, _ = graph
    bad = []
    for module, targets in sorted(edges.items()):
        if module == PKG:  # posttrain/__init__ sits above everything it re-exports
            continue
        for target, line in sorted(targets.items()):
            if target == PKG:
                continue
            low, high = _top(module), _top(target)
            if LAYER_OF.get(high, -1) > LAYER_OF.get(low, -1):
                bad.append(f"{module} (line {line}) -> {target}  [{low} is below {high}]")
    assert not bad, "imports from a lower layer into a higher one:\n  " + "\n  ".join(bad)


def test_the_config_is_read_only_by_config_and_commands(graph):
    """The raw ``RunConfig`` (``posttrain.config.run``) stays in ``config/`` and ``commands/``: the
    rest of the code reads the plan's typed options."""
    edges, _ = graph
    allowed = {"config", "commands", "api"}
    bad = [f"{m} (line {line})" for m, targets in sorted(edges.items()) if _top(m) not in allowed
           for t, line in sorted(targets.items()) if t == f"{PKG}.config.run"]
    assert not bad, "posttrain.config.run imported outside config/ and commands/:\n  " + "\n  ".join(bad)


def test_no_package_cycles(graph):
    """No cycle between the top-level packages (modules in one layer may import each other, but
    never both ways)."""
    edges, _ = graph
    packages: dict[str, dict[str, int]] = {}
    for module, targets in edges.items():
        top = _top(module)
        for target, line in targets.items():
            if _top(target) and _top(target) != top and top:
                packages.setdefault(top, {}).setdefault(_top(target), line)
    for top in {_top(m) for m in edges} - {""}:
        packages.setdefault(top, {})
    cycles = [" <-> ".join(c) for c in _strongly_connected(packages)]
    assert not cycles, "package cycles:\n  " + "\n  ".join(cycles)


def test_cluster_never_imports_loops(graph):
    """cluster/ builds roles/ inside Ray workers; the loops in loops/ drive the cluster (docs/architecture.md)."""
    edges, _ = graph
    bad = [f"{m} (line {line}) -> {t}" for m, targets in sorted(edges.items()) if _top(m) == "cluster"
           for t, line in sorted(targets.items()) if _top(t) == "loops"]
    assert not bad, "cluster/ imports loops/ (build what it needs from roles/):\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("dependency", sorted(EDGE_DEPENDENCIES))
def test_heavy_dependencies_stay_at_the_edges(graph, dependency):
    _, external = graph
    allowed = EDGE_DEPENDENCIES[dependency]
    bad = [f"{m} (line {deps[dependency]})" for m, deps in sorted(external.items())
           if dependency in deps and not any(m == a or m.startswith(a + ".") for a in allowed)]
    assert not bad, f"only {allowed} may import {dependency}; also imported by: {bad}"
    assert any(dependency in deps for deps in external.values()), f"nothing imports {dependency}"


def test_the_scanner_sees_lazy_imports_and_skips_type_checking(tmp_path):
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
        "def f():\n    import c\n"
        "class K:\n    def m(self):\n        from d import e\n")
    names = sorted(n.names[0].name if isinstance(n, ast.Import) else n.module for n in _imports(tree))
    assert names == ["b", "c", "d", "typing"]


def test_tarjan_finds_a_cycle_and_reports_it():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert _strongly_connected(edges) == [["a", "b", "c"]]
    assert _cycle_in(["a", "b", "c"], edges) == "a (line 1) -> b (line 2) -> c (line 3) -> a"


def test_the_cli_loads_no_heavy_dependency():
    """``posttrain --help`` stays fast: in a fresh process, importing the package and the CLI and
    building its parser (which imports ``commands/convert.py`` for its arguments) loads none of
    :data:`CLI_FORBIDDEN`. A failure names the module; ``python -X importtime -c "import
    posttrain.cli"`` shows which import brought it in."""
    code = ("import sys, posttrain, posttrain.cli; posttrain.cli.build_parser(); "
            f"print(' '.join(m for m in {CLI_FORBIDDEN!r} if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    loaded = done.stdout.split()
    assert not loaded, (f"import posttrain.cli (and its parser) loaded {loaded}: import them inside the "
                        f"function that needs them")
