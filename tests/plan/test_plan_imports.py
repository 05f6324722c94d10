"""The plan package imports one way, imports no torch, and has one registry of schedules.

Each module of ``rp_engine/plan`` may import only modules earlier in ``CHAIN`` (and, of the rest
of rp_engine, only the host room's constants, ``HOST_CONSTANTS``: standard library only), the order the
package declares in ``_SUBMODULES`` (parsed with ast, so a function-level or ``TYPE_CHECKING``
import that dodges a cycle fails as well); the only exceptions are a ``if __name__ ==
"__main__":`` block and a subpackage's ``__main__.py`` (``python -m rp_engine.plan.simulate``),
which run only as scripts. A subpackage (``simulate/``) is one member of the chain: its modules
import each other freely (tests/unit/test_layering.py finds circles among them). Every schedule
is reachable by name from ``schedules.SCHEDULES``, and the config, the planner, the engine's
optimizer mode and both command lines read that registry.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from rp_engine import config as rp_config
from rp_engine import plan as plan_pkg
from rp_engine.plan import cli as plan_cli
from rp_engine.plan import schedules
from rp_engine.plan.actions import Op, Plan
from rp_engine.plan.schedules import SCHEDULES, ScheduleSpec
from rp_engine.runtime.planning import ModelShape, Planner
from rp_engine.train import cli as train_cli

PLAN_DIR = Path(__file__).resolve().parents[2] / "rp_engine" / "plan"
# the import order the package declares: a module may import only modules before it
CHAIN: tuple[str, ...] = plan_pkg._SUBMODULES
# all the plan package may import of rp_engine outside itself (pure Python, nothing of ours)
HOST_CONSTANTS = ("rp_engine.host.units", "rp_engine.host.defaults")


def _is_main_guard(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _imports(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) of every import outside a ``__main__`` guard;
    ``from . import x`` is reported as ``.x``. Module level excludes function bodies and any
    ``if`` block (``TYPE_CHECKING`` included)."""
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        if isinstance(node, ast.stmt) and _is_main_guard(node):
            return
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno, top) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            if node.level and node.module is None:
                out.extend(
                    ("." * node.level + alias.name, node.lineno, top) for alias in node.names
                )
            else:
                out.append((base, node.lineno, top))
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.If
            )
            visit(child, inner)

    for stmt in tree.body:
        visit(stmt, True)
    return out


def _absolute(name: str, package: str) -> str:
    """``name`` as an absolute module name; relative ones (``.costs``, ``..actions``) are
    resolved from ``package``, the importing module's package."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    rest = name[level:]
    return ".".join(base + ([rest] if rest else []))


def _package_module(name: str) -> str | None:
    """The chain member (plan module or subpackage) an absolute import names, else None."""
    if name.startswith("rp_engine.plan."):
        return name.split(".")[2]
    return None


def _files(member: str) -> list[tuple[Path, str]]:
    """(file, its package) of a chain member: a module, or every module of a subpackage."""
    path = PLAN_DIR / f"{member}.py"
    if path.is_file():
        return [(path, "rp_engine.plan")]
    return [(p, f"rp_engine.plan.{member}") for p in sorted((PLAN_DIR / member).glob("*.py"))]


def test_the_chain_lists_every_module() -> None:
    # __main__.py (``python -m rp_engine.plan``) runs only as a script: outside the chain
    modules = {p.stem for p in PLAN_DIR.glob("*.py")} - {"__init__", "__main__"}
    packages = {p.parent.name for p in PLAN_DIR.glob("*/__init__.py")}
    assert modules | packages == set(CHAIN), (
        "add a new plan module to rp_engine/plan/__init__.py _SUBMODULES, in its import order"
    )


@pytest.mark.parametrize("module", CHAIN)
def test_plan_modules_import_only_earlier_modules(module: str) -> None:
    earlier = set(CHAIN[: CHAIN.index(module)])
    for path, package in _files(module):
        if path.name == "__main__.py":
            continue  # runs only as ``python -m``: above every module, like a __main__ guard
        where = path.relative_to(PLAN_DIR)
        for raw, line, top in _imports(ast.parse(path.read_text())):
            name = _absolute(raw, package)
            target = _package_module(name)
            if target is None and name in HOST_CONSTANTS:
                assert top, f"plan/{where}:{line} imports {name}: import it at module level"
                continue
            if target is None:
                assert not name.startswith("rp_engine"), (
                    f"plan/{where}:{line} imports {name}: the plan package imports nothing of "
                    f"rp_engine outside itself but {HOST_CONSTANTS}"
                )
                root = name.split(".")[0]
                assert not top or root in sys.stdlib_module_names or root == "__future__", (
                    f"plan/{where}:{line} imports {name} at module level: standard library only"
                )
                continue
            assert top, (
                f"plan/{where}:{line} imports {name} inside a function or an if block: "
                "import it at module level (a module earlier in the chain)"
            )
            assert target in earlier or target == module, (
                f"plan/{where}:{line} imports {name}, which is not before {module} in "
                f"{CHAIN}: the plan package imports one way"
            )


def test_relative_imports_resolve_from_the_importing_package() -> None:
    assert _absolute(".costs", "rp_engine.plan") == "rp_engine.plan.costs"
    assert _absolute("..actions", "rp_engine.plan.simulate") == "rp_engine.plan.actions"
    assert _absolute(".", "rp_engine.plan.simulate") == "rp_engine.plan.simulate"
    assert _package_module(_absolute("..cli", "rp_engine.plan.simulate")) == "cli"


def test_import_walker_catches_dodges() -> None:
    """The check above fails for the dodges it exists to forbid (so it can fail at all)."""
    code = (
        "from typing import TYPE_CHECKING\n"
        "from . import schedules\n"
        "if TYPE_CHECKING:\n    from .partition import LayerCosts\n"
        "def f():\n    from .actions import _compute_groups\n"
        "if __name__ == '__main__':\n    from .cli import main\n"
    )
    found = {(name, top) for name, _, top in _imports(ast.parse(code))}
    assert found == {
        ("typing", True),
        (".schedules", True),
        (".partition", False),
        (".actions", False),
    }


def test_importing_the_plan_package_imports_no_torch() -> None:
    code = (
        "import sys, importlib, rp_engine.plan as p\n"
        "for name in p._SUBMODULES: importlib.import_module('rp_engine.plan.' + name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
        "ours = sorted(m for m in sys.modules if m.startswith('rp_engine.') "
        "and not m.startswith('rp_engine.plan'))\n"
        "print(bad, ours)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == f"[] {sorted({'rp_engine.host', *HOST_CONSTANTS})}"


# ---- the one registry ---------------------------------------------------------------------------
def _build_one(spec: ScheduleSpec) -> Plan:
    kwargs: dict[str, object] = {"num_devices": 2, "num_microbatches": 4}
    if spec.cuts == "fwd_bwd":
        kwargs.update(fwd_cuts=(2, 2), bwd_cuts=(1, 3))
    elif spec.cuts == "blocks":
        kwargs["fwd_cuts"] = (2, 2)
    else:
        kwargs["stage_layers"] = (2, 2) * spec.stages_per_device
    return schedules.build(spec.name, num_iterations=2, **kwargs)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_is_reachable_by_name_and_carries_its_properties(name: str) -> None:
    spec = schedules.get_schedule(name)
    plan = _build_one(spec)
    assert plan.schedule == name and len(plan.iterations) == 2
    assert (plan.offloaded, plan.bound) == (spec.offloaded, spec.bound)
    schedules.validate(plan)
    lowered = schedules.lower(plan)  # keyed on plan.offloaded, not on the name
    assert lowered.offloaded == spec.offloaded
    assert any(a.op is Op.UPLOAD for a in lowered.actions) == spec.offloaded
    schedules.validate(lowered)
    assert Plan.from_text(lowered.to_text()) == lowered


def test_unknown_schedule_names_the_registry() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; choose from"):
        schedules.get_schedule("zigzag")


def test_every_reader_takes_its_names_from_the_registry() -> None:
    engine_names = tuple(n for n, s in SCHEDULES.items() if s.offloaded)
    assert schedules.ENGINE_SCHEDULES == engine_names
    field = rp_config.RoundPipeConfig.__dataclass_fields__["schedule"]
    assert tuple(field.metadata["choices"]) == engine_names
    cli_names = plan_cli.schedule_choices()
    for name, spec in SCHEDULES.items():  # each by name, or as <name>-sync / <name>-async
        assert name in cli_names or {f"{name}-sync", f"{name}-async"} <= set(cli_names)
        assert (spec.offloaded and not spec.sync_only) == (f"{name}-async" in cli_names)


def test_the_rp_train_command_line_offers_the_engine_schedules() -> None:
    action = next(a for a in train_cli._parser()._actions if a.dest == "schedule")
    assert tuple(action.choices or ()) == schedules.ENGINE_SCHEDULES


def test_the_simulator_command_line_keeps_its_names() -> None:
    assert plan_cli.schedule_choices() == [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "mobius",
        "roundpipe-sync",
        "roundpipe-async",
    ]


def test_python_dash_m_simulate_still_runs(tmp_path: Path) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text('{"num_layers": 4, "fwd_ms": 1.0, "bwd_ms": 2.0}')
    args = ["--costs", str(costs), "--schedule", "gpipe", "--devices", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "rp_engine.plan.simulate", *args, "--microbatches", "4", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert '"schedule": "gpipe"' in out


def test_the_planner_runs_only_offloaded_schedules() -> None:
    shape = ModelShape(4, False, (1000,) * 4, 3000, 0)
    for name, spec in SCHEDULES.items():
        if spec.offloaded:
            assert Planner(shape, num_devices=2, num_microbatches=2, schedule=name).spec is spec
        else:
            with pytest.raises(ValueError, match=rf"roundpipe\.schedule '{name}' is not"):
                Planner(shape, num_devices=2, num_microbatches=2, schedule=name)
