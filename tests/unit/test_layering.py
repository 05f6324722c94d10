"""rp_engine imports one way: every module sits in a layer (``LAYERS``, bottom first) and imports
only modules of its own layer or below, and no modules import each other in a circle.

Counted: every ``import`` / ``from ... import`` statement in a module, parsed with ast, wherever
it is: at module level, inside functions and methods, under ``if TYPE_CHECKING:`` and in
``if __name__ == "__main__":`` blocks (a function-level import still needs its target at run
time, and an import that dodges a circle by hiding in a function is still a circle).
``from package import name`` counts as importing the submodule ``package.name`` when there is
one, else the package. Not counted: the parent packages an import initialises on the way
(importing ``rp_engine.engine.api`` runs ``rp_engine/engine/__init__.py``; each ``__init__`` is
checked as a module of its own instead) and ``importlib.import_module`` strings (the plan
package's lazy attributes).

The host room (``rp_engine/host``: units, pool defaults, the JIT cache, core placement) is the
bottom layer and imports nothing of ours; the plan package and the config may import its
constants (``HOST_CONSTANTS``) and nothing else of it. The plan package's own order (actions ->
costs -> ... -> cli) is held by tests/plan/test_plan_imports.py; here plan is one layer. Above the package: nothing in
rp_engine imports ``benchmarks``, ``tests`` or ``launch``, and the benchmarks import each other
without circles.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Bottom first. A module belongs to the layer of the longest prefix that names it (the module
# itself or a package above it); "rp_engine" names the package's __init__ only, so a new module
# at the root must be given a layer here.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the host's plumbing: units, pool defaults, the JIT cache, core placement; nothing of ours
    ("host", ("rp_engine.host",)),
    ("plan", ("rp_engine.plan",)),  # plans are data: pure Python, only the host's constants
    ("config", ("rp_engine.config",)),  # ds_config -> dataclasses; reads the schedule registry
    ("device", ("rp_engine.device",)),  # the only place that knows CUDA; only torch
    ("model", ("rp_engine.model",)),  # layer sequences, the host store (weights, grads)
    ("transfer", ("rp_engine.transfer",)),  # uploads/downloads on copy streams
    ("distributed", ("rp_engine.distributed",)),  # data parallel over the host store
    ("optim", ("rp_engine.optim",)),  # CPU Adam, the stepper (which reduces across ranks)
    ("storage", ("rp_engine.storage",)),  # the NVMe tier (shares CPU Adam's extension cache)
    ("engine services", ("rp_engine.monitor", "rp_engine.data")),  # W&B/CSV/TB, data loader
    ("runtime", ("rp_engine.runtime",)),  # where plans meet devices: planner, executor
    ("checkpoint", ("rp_engine.checkpoint",)),  # DeepSpeed's files; reads the engine duck-typed
    # host memory, before any allocation; the advisor's answer to DeepSpeed's autotuning block
    ("initialize checks", ("rp_engine.host_preflight", "rp_engine.autotune")),
    ("engine", ("rp_engine.engine",)),  # RoundPipeEngine: wires the parts
    (
        "doors",
        ("rp_engine", "rp_engine.train", "rp_engine.integrations"),
    ),  # initialize, rp-train, HF
)

# DESIGN.md's stricter rules: what a layer may import from outside itself, by module name.
HOST_CONSTANTS = frozenset({"rp_engine.host.units", "rp_engine.host.defaults"})  # stdlib only
ONLY: Mapping[str, frozenset[str]] = {
    "host": frozenset(),
    # and the host's memory limit (stdlib only): the advisor's --host-ram-gb here
    "plan": HOST_CONSTANTS | {"rp_engine.host.memory_limit"},
    "config": frozenset({"rp_engine.plan.schedules"}) | HOST_CONSTANTS,
    "device": frozenset(),
}

# Nothing in rp_engine imports these; among them, benchmarks import rp_engine and each other.
ABOVE = ("benchmarks", "tests", "launch")
# benchmarks that reuse the test suite's helpers (module -> why); nothing else imports tests/
BENCHMARKS_IMPORTING_TESTS: Mapping[str, str] = {
    "benchmarks.studies.reliability": (
        "its fault scenarios build engines from tests/support's tiny models"
    ),
}

Edge = tuple[str, str, int]  # (importer, imported, line)


# ---- the checker: pure functions over {module name: source} ------------------------------------
def module_sources(root: Path, package: str) -> dict[str, str]:
    """{dotted module name: source} of every .py file under ``root / package``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path.read_text()
    return out


def imports_of(module: str, source: str, known: set[str], packages: set[str]) -> list[Edge]:
    """Every import statement of ``module`` (anywhere in it) as (module, target, line), relative
    imports resolved; ``from X import name`` targets ``X.name`` when that is a known module."""
    package = module if module in packages else module.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            edges.extend((module, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                edges.append((module, sub if sub in known else target, node.lineno))
    return list(dict.fromkeys(edges))  # one per (target, line): `from X import a, b` is one


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the longest prefix naming ``module`` (None: in no layer)."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p == "rp_engine"
            if module == p or (not exact_only and module.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), index)
    return None if best is None else best[1]


def layer_violations(edges: Iterable[Edge]) -> list[str]:
    """Imports of a module in a higher layer, and imports outside what ONLY allows."""
    out = []
    for a, b, line in edges:
        if not b.startswith("rp_engine"):
            continue
        la, lb = layer_of(a), layer_of(b)
        if la is None or lb is None:
            continue  # reported by test_every_module_has_a_layer
        name_a, name_b = LAYERS[la][0], LAYERS[lb][0]
        if lb > la:
            out.append(
                f"{a}:{line} imports {b}: layer {name_a!r} may not import {name_b!r} above it"
            )
        elif name_a in ONLY and lb != la and b not in ONLY[name_a]:
            allowed = sorted(ONLY[name_a]) or "nothing"
            out.append(f"{a}:{line} imports {b}: layer {name_a!r} imports only {allowed} of ours")
    return out


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module, or a module that
    imports itself (Tarjan's algorithm; each group sorted)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is the import chain's length: small
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def all_edges(sources: Mapping[str, str], packages: set[str]) -> list[Edge]:
    known = set(sources)
    return [e for m, src in sources.items() for e in imports_of(m, src, known, packages)]


def _packages(root: Path, sources: Mapping[str, str]) -> set[str]:
    return {m for m in sources if (root / m.replace(".", "/") / "__init__.py").is_file()}


# ---- the repository ----------------------------------------------------------------------------
SOURCES = module_sources(ROOT, "rp_engine")
EDGES = all_edges(SOURCES, _packages(ROOT, SOURCES))


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in SOURCES if layer_of(m) is None)
    assert not missing, (
        f"give these modules a layer in LAYERS (tests/unit/test_layering.py): {missing}"
    )


def test_every_import_of_ours_names_a_module_that_exists() -> None:
    unknown = [
        (a, b, line) for a, b, line in EDGES if b.startswith("rp_engine.") and b not in SOURCES
    ]
    assert not unknown


def test_modules_import_only_their_layer_and_below() -> None:
    assert layer_violations(EDGES) == []


def test_no_import_circles_in_rp_engine() -> None:
    assert cycles(EDGES) == []


def test_nothing_in_rp_engine_imports_benchmarks_tests_or_launch() -> None:
    bad = [f"{a}:{line} imports {b}" for a, b, line in EDGES if b.split(".")[0] in ABOVE]
    assert not bad


def test_benchmarks_import_without_circles_and_reach_tests_only_where_listed() -> None:
    sources = module_sources(ROOT, "benchmarks")
    edges = all_edges(sources, _packages(ROOT, sources))
    assert cycles(edges) == []
    into_tests = {a for a, b, _ in edges if b.split(".")[0] == "tests"}
    assert into_tests <= set(BENCHMARKS_IMPORTING_TESTS), into_tests - set(
        BENCHMARKS_IMPORTING_TESTS
    )


# ---- the checker fails where it should (each rule on a deliberate violation) ----------------------
def _fake(sources: Mapping[str, str], packages: Iterable[str] = ()) -> list[Edge]:
    return all_edges(sources, set(packages))


def test_an_upward_import_inside_a_function_is_a_violation() -> None:
    edges = _fake(
        {
            "rp_engine.model.base": "def f():\n    from rp_engine.engine import core\n",
            "rp_engine.engine": "",
            "rp_engine.engine.core": "",
        },
        packages=["rp_engine.engine"],
    )
    assert edges == [("rp_engine.model.base", "rp_engine.engine.core", 2)]
    (message,) = layer_violations(edges)
    assert "layer 'model' may not import 'engine' above it" in message


def test_a_type_checking_circle_is_a_circle() -> None:
    edges = _fake(
        {
            "rp_engine.optim.a": "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from rp_engine.optim import b\n",
            "rp_engine.optim.b": "from . import c\n",
            "rp_engine.optim.c": "import rp_engine.optim.a\n",
            "rp_engine.optim": "",
        },
        packages=["rp_engine.optim"],
    )
    assert layer_violations(edges) == []  # one layer: the direction rule alone cannot see it
    assert cycles(edges) == [["rp_engine.optim.a", "rp_engine.optim.b", "rp_engine.optim.c"]]


def test_main_guards_and_relative_imports_count() -> None:
    edges = _fake(
        {
            "rp_engine.plan.simulate": "from .run import simulate\n",
            "rp_engine.plan.simulate.run": "from ..actions import Op\n"
            "if __name__ == '__main__':\n    from ..cli import main\n",
            "rp_engine.plan.actions": "",
            "rp_engine.plan.cli": "from .simulate import simulate\n",
        },
        packages=["rp_engine.plan", "rp_engine.plan.simulate"],
    )
    targets = {(a, b) for a, b, _ in edges}
    assert ("rp_engine.plan.simulate.run", "rp_engine.plan.actions") in targets
    assert ("rp_engine.plan.simulate.run", "rp_engine.plan.cli") in targets
    assert cycles(edges) == [
        ["rp_engine.plan.cli", "rp_engine.plan.simulate", "rp_engine.plan.simulate.run"]
    ]


@pytest.mark.parametrize(
    ("module", "source", "rule"),
    [
        ("rp_engine.config.parse", "import rp_engine.plan.partition\n", "imports only"),
        ("rp_engine.device.cpu", "from rp_engine.model.base import State\n", "above it"),
        ("rp_engine.plan.costs", "from rp_engine.config import DSConfig\n", "above it"),
        ("rp_engine.plan.costs", "from rp_engine.host import jit_cache\n", "imports only"),
        ("rp_engine.host.units", "from rp_engine.plan import actions\n", "above it"),
        (
            "rp_engine.host.jit_cache",
            "def f():\n    import rp_engine.optim.optimizer\n",
            "above it",
        ),
    ],
    ids=[
        "config-only-the-registry",
        "device-only-torch",
        "plan-nothing-of-ours",
        "plan-only-the-host-constants",
        "host-nothing-of-ours",
        "host-nothing-of-ours-in-a-function",
    ],
)
def test_design_rules_of_the_bottom_layers(module: str, source: str, rule: str) -> None:
    (message,) = layer_violations(_fake({module: source}))
    assert rule in message


def test_layers_name_modules_by_longest_prefix() -> None:
    names = [name for name, _ in LAYERS]
    assert names[layer_of("rp_engine") or 0] == "doors"
    assert names[layer_of("rp_engine.train.preflight") or 0] == "doors"
    assert names[layer_of("rp_engine.checkpoint.safe_load") or 0] == "checkpoint"
    assert layer_of("rp_engine.host.jit_cache") == names.index("host")
    assert layer_of("rp_engine.host_preflight") == names.index("initialize checks")
    assert layer_of("rp_engine.new_module_at_the_root") is None
