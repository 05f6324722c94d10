"""Start-up of the tests' child processes (Python imports ``sitecustomize`` from the first folder
of sys.path that has one; the children run with tests/support on PYTHONPATH): the CPU probe that
tests/conftest.py made once per suite, and then the next ``sitecustomize`` on sys.path, if any
(tests/support/avx2_cpu_adam.py's, which must still load in its children).

DeepSpeed asks ``cpuinfo.get_cpu_info()`` three times per process that builds a CPU Adam (its
builder's ``cpu_arch`` and ``simd_width``, the optimizer's constructor); each call starts a
process that sleeps a second to measure the clock while its parent polls it in a busy loop: about
3.3 CPU-seconds per child, most of a small child's run. The answer the test process got
(``RP_TESTS_CPU_INFO``, JSON) is handed out instead: the same dict, from the same CPU. Children
started without the variable (or without tests/support on their path) probe as before.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any


def _answer_the_cpu_probe(info_json: str) -> None:
    try:
        import cpuinfo
    except ImportError:  # DeepSpeed brings it; without it nothing calls it
        return
    info = json.loads(info_json)

    def get_cpu_info() -> dict[str, Any]:
        return dict(info)  # a copy: a caller may edit its dict

    # DeepSpeed imports the function at each call (``from cpuinfo import get_cpu_info``)
    cpuinfo.get_cpu_info = get_cpu_info


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.getcwd())
        path = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_rp_tests_next_sitecustomize", path)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


if os.environ.get("RP_TESTS_CPU_INFO"):
    _answer_the_cpu_probe(os.environ["RP_TESTS_CPU_INFO"])
_run_the_next_sitecustomize()
