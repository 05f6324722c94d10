"""Discrete-event simulation of a Plan on a machine model (see events.py)."""

from __future__ import annotations

from .events import (
    Interval,
    Machine,
    QuickTimes,
    SimResult,
    load_machine,
    preset_names,
    quick_times,
    simulate,
)

__all__ = [
    "Machine",
    "Interval",
    "SimResult",
    "simulate",
    "QuickTimes",
    "quick_times",
    "load_machine",
    "preset_names",
]
