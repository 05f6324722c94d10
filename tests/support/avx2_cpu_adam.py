"""Run tests as on an AVX2 machine (no AVX-512), also on a machine that has AVX-512.

Issue 24: on an AMD EPYC with AVX2 and no AVX-512, seven weight comparisons with plain PyTorch
failed that pass on AVX-512 machines. Two things differ on such a machine:

- DeepSpeed builds CPU Adam for the CPU it is built on (``-D__AVX512__`` or ``-D__AVX256__``,
  ``-march=native``);
- torch dispatches its own CPU kernels to the widest ISA the CPU has (ATen, oneDNN, MKL).

This script builds the AVX2 variant of CPU Adam into its own extensions directory (the default
AVX-512 build is never touched) and runs pytest with it and with torch's kernels capped at AVX2::

    python tests/support/avx2_cpu_adam.py tests/engine/test_async_optimizer.py -k staleness
    python tests/support/avx2_cpu_adam.py --adam-only tests/engine/test_iteration_overlap.py

Arguments other than the options below go to pytest. Measured on an AVX-512 EPYC: the AVX2 CPU
Adam alone changes nothing in those seven tests (its SIMD loop is exact elementwise maths at
either width); torch's AVX2 kernels alone (``ATEN_CPU_CAPABILITY=avx2``) reproduce all seven:
the engine's forward and backward then differ from plain PyTorch's in the last bits, which
Adam turns into visible steps on elements whose gradients are near zero.

How: a ``sitecustomize`` on PYTHONPATH patches DeepSpeed's ``OpBuilder.simd_width`` and
``cpu_arch`` as ``deepspeed.ops.op_builder.builder`` is imported (nothing else is imported at
start-up). Every process that loads CPU Adam from that directory must carry the patch: one that
does not (a test that *replaces* PYTHONPATH for a child) makes ninja rebuild it there with the
native flags. The directory's flags are therefore checked after the run, and a clobbered build
fails the run loudly (the next run rebuilds it as AVX2).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

SIMD = "-D__AVX256__"
# The AVX2 + FMA level of every AVX2 x86 CPU (Haswell, Zen 1-3), without AVX-512: the ISA the
# kernel's scalar tails are compiled for on such a machine, whatever -march=native names it.
ARCH = "-march=x86-64-v3"
# Beside the native build's cache (``<TORCH_EXTENSIONS_DIR>_avx2``): a run with its own cache
# (a from-scratch timing of `make test`) builds its own AVX2 variant too.
_NATIVE_DIR = Path(
    os.environ.get("TORCH_EXTENSIONS_DIR")
    or Path.home() / ".cache" / "rp_engine" / "torch_extensions"
)
DEFAULT_DIR = _NATIVE_DIR.with_name(_NATIVE_DIR.name + "_avx2")
_TARGET = "deepspeed.ops.op_builder.builder"
# What an AVX2 machine's torch runs: ATen's CPU dispatch, oneDNN and MKL capped at AVX2.
TORCH_AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def _patch(module: ModuleType) -> None:
    """Make DeepSpeed's op builders compile for AVX2 (``-D__AVX256__``, no AVX-512 code)."""
    builder: Any = module.OpBuilder
    builder.simd_width = lambda self: SIMD
    builder.cpu_arch = lambda self: ARCH


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's builder module with the other finders, then patches it once executed:
    the patch costs nothing in processes that never import DeepSpeed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Called by the generated sitecustomize at interpreter start-up."""
    if _TARGET in sys.modules:  # pragma: no cover - sitecustomize runs before any user import
        _patch(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _PatchOnImport())


def _site_dir(ext_dir: Path) -> Path:
    """A directory holding only a sitecustomize that loads this file and calls ``install``."""
    site = ext_dir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('_rp_avx2_cpu_adam', {str(Path(__file__).resolve())!r})\n"
        "_mod = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_mod)\n"
        "_mod.install()\n"
    )
    return site


def avx2_env(ext_dir: Path = DEFAULT_DIR, *, torch_avx2: bool = True) -> dict[str, str]:
    """The environment in which Python processes build and load the AVX2 CPU Adam (and, with
    ``torch_avx2``, run torch's kernels at AVX2)."""
    root = Path(__file__).resolve().parents[2]
    paths = [str(_site_dir(ext_dir)), str(root)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    # the build probe's ninja: the environment's own, as the tests' (tests/conftest.py), or
    # every switch between this script run bare and under `make` rebuilds the op
    from rp_engine.host.jit_cache import with_own_ninja

    env["PATH"] = with_own_ninja(env.get("PATH", ""))
    if torch_avx2:
        env.update(TORCH_AVX2_ENV)
    return env


_PROBE = """
from deepspeed.ops.op_builder import CPUAdamBuilder
b = CPUAdamBuilder()
assert b.simd_width() == {simd!r}, b.simd_width()
b.load(verbose=False)
"""


def build(env: dict[str, str]) -> None:
    """Build (or find built) the AVX2 CPU Adam; about 2 minutes the first time."""
    print(f"building/loading the AVX2 CPU Adam in {env['TORCH_EXTENSIONS_DIR']}", flush=True)
    subprocess.run([sys.executable, "-c", _PROBE.format(simd=SIMD)], env=env, check=True)
    check_build(Path(env["TORCH_EXTENSIONS_DIR"]))


def check_build(ext_dir: Path) -> None:
    """Raise unless the directory's CPU Adam was built with the AVX2 flags and holds no
    AVX-512 code (no zmm register in its disassembly)."""
    ninja = (ext_dir / "cpu_adam" / "build.ninja").read_text()
    if SIMD not in ninja or ARCH not in ninja or "__AVX512__" in ninja:
        raise SystemExit(
            f"{ext_dir}/cpu_adam was rebuilt without the AVX2 flags (a process without the "
            "sitecustomize loaded it): its results are not AVX2's; rerun to rebuild"
        )
    so = ext_dir / "cpu_adam" / "cpu_adam.so"
    dump = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True)
    if dump.returncode == 0 and "%zmm" in dump.stdout:
        raise SystemExit(f"{so} contains AVX-512 instructions")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="extensions directory")
    parser.add_argument(
        "--adam-only", action="store_true", help="leave torch's kernels at the CPU's widest ISA"
    )
    parser.add_argument("--build-only", action="store_true")
    args, pytest_args = parser.parse_known_args(argv)
    env = avx2_env(args.dir, torch_avx2=not args.adam_only)
    build(env)
    if args.build_only:
        return 0
    rc = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], env=env).returncode
    check_build(args.dir)
    return rc


if __name__ == "__main__":
    sys.exit(main())
