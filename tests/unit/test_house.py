"""No class in rp_engine declares an instance member that another class provides.

A bare class-level annotation (``stepper: OptimizerStepper``, no value) says "instances have
this"; the class that says so must also assign it, in one of its own methods, so that a reader
following ``self.stepper`` from any method of the class finds where it comes from in that class
(its ``__init__``, or a method it calls). A mixin that declares members its host class sets, or
a base class whose subclasses set what it declared, is what this keeps out: the engine's
accessors get their parts as one typed object (engine/api.py ``EngineParts``), the NVMe tiers
hand their engine, file and pool to ``PooledTier.__init__``, a device its ``torch_device`` to
``ThreadedDevice.__init__``.

Counted as assigned: ``self.name = ...`` (plain, annotated, augmented, in a tuple target) or
``setattr(self, "name", ...)`` / ``object.__setattr__(self, "name", ...)`` in any method of the
class, and in ``__new__`` ``obj.name = ...`` on the object it makes (a tensor subclass has no
``__init__``). Excepted: dataclasses, NamedTuples, Protocols, TypedDicts and Enums (their
annotations are fields or interfaces, not members someone else sets) and ``ClassVar``s.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rp_engine"

# Bases whose subclasses' annotations are fields or an interface, not members to assign.
_DECLARATIVE_BASES = frozenset({"NamedTuple", "Protocol", "TypedDict", "Enum", "IntEnum"})


def _name(node: ast.expr) -> str:
    """``Foo`` for ``Foo``, ``mod.Foo``, ``Foo[...]``, ``dataclass(...)``; else ''."""
    if isinstance(node, ast.Subscript | ast.Call):
        return _name(node.value if isinstance(node, ast.Subscript) else node.func)
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _declarative(cls: ast.ClassDef) -> bool:
    """A dataclass, NamedTuple, Protocol, TypedDict or Enum: annotations declare fields."""
    if any(_name(d) == "dataclass" for d in cls.decorator_list):
        return True
    return any(_name(b) in _DECLARATIVE_BASES for b in cls.bases)


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment statement writes, tuple targets flattened."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        t = found.pop()
        if isinstance(t, ast.Tuple | ast.List):
            found.extend(t.elts)
        else:
            flat.append(t.value if isinstance(t, ast.Starred) else t)
    return flat


def _assigned(cls: ast.ClassDef) -> set[str]:
    """Instance members the class's own methods assign (module docstring: what counts)."""
    names: set[str] = set()
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        on_any = method.name == "__new__"  # the object __new__ makes is not called self
        for node in ast.walk(method):
            for t in _targets(node):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                    if on_any or t.value.id == "self":
                        names.add(t.attr)
            if isinstance(node, ast.Call) and _name(node.func) in ("setattr", "__setattr__"):
                args = node.args
                if len(args) >= 2 and _name(args[0]) == "self":
                    if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                        names.add(args[1].value)
    return names


def undeclared_members(source: str, where: str = "<source>") -> list[str]:
    """``where:line Class.member`` for each bare annotation in ``source`` no own method assigns."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not isinstance(cls, ast.ClassDef) or _declarative(cls):
            continue
        assigned = _assigned(cls)
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and stmt.value is None):
                continue
            if not isinstance(stmt.target, ast.Name) or _name(stmt.annotation) == "ClassVar":
                continue
            if stmt.target.id not in assigned:
                found.append(f"{where}:{stmt.lineno} {cls.name}.{stmt.target.id}")
    return found


def test_no_class_in_rp_engine_declares_a_member_another_class_provides() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += undeclared_members(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == [], (
        "these classes declare instance members that none of their own methods assigns (another "
        "class provides them): give the class the value explicitly (its __init__ takes it, or "
        "it holds a typed parts object), as engine/api.py's EngineParts does:\n" + "\n".join(found)
    )


def test_the_rule_catches_a_mixin_and_a_base_whose_subclass_provides() -> None:
    source = textwrap.dedent(
        """
        class Mixin:
            stepper: object  # the host class sets it: caught
            def lr(self): return self.stepper.lr

        class Base:
            pool: object  # only the subclass sets it: caught
            count: int
            def __init__(self): self.count = 0

        class Sub(Base):
            def __init__(self): super().__init__(); self.pool = []
        """
    )
    assert undeclared_members(source) == ["<source>:3 Mixin.stepper", "<source>:7 Base.pool"]


def test_the_rule_accepts_members_the_class_assigns_and_declarative_classes() -> None:
    source = textwrap.dedent(
        """
        from dataclasses import dataclass
        from typing import ClassVar, NamedTuple, Protocol

        class Owns:
            a: int
            b: int
            c: int
            d: int
            limit: ClassVar[int]
            def __init__(self): self.a, (self.b, *rest) = 1, (2, 3)
            def later(self): self.c += 1; object.__setattr__(self, "d", 4)

        class Tensorish:
            thunk: object
            def __new__(cls, thunk): out = object.__new__(cls); out.thunk = thunk; return out

        @dataclass
        class Fields:
            x: int

        class Pair(NamedTuple):
            x: int

        class Reads(Protocol):
            y: int
        """
    )
    assert undeclared_members(source) == []
