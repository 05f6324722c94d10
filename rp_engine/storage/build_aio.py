"""Build DeepSpeed's aio op once into the shared extensions cache: ``make aio`` (and so ``make
test``) runs this, and a run whose NVMe tier finds the op unbuilt starts it in the background
with ``--background`` (storage/io_engine.py; ``RP_ENGINE_AIO_BUILD=0`` turns that off).

Exit status 0 when the op is built (or was already), 0 with a message when it cannot be built
here (no libaio-dev): the NVMe tier then uses its built-in engine. Never fails an install.

``--background``: at the lowest CPU priority (``nice`` 19, the compilers too), progress lines
with times (its output is the build log), and a failure leaves ``async_io_build.failed`` in the
cache so later runs do not start the same failing build again (a successful build by hand
removes it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rp_engine.storage.build_aio")
    parser.add_argument(
        "--background", action="store_true", help="low priority; a failure is remembered"
    )
    args = parser.parse_args(argv)
    if args.background:
        os.nice(19)

    from rp_engine.host.jit_cache import cpu_adam_cache_dir
    from rp_engine.storage.io_engine import BUILD_FAILED, aio_op_built, load_aio_op

    failed = os.path.join(cpu_adam_cache_dir(), BUILD_FAILED)
    if aio_op_built():
        print("rp_engine: DeepSpeed's aio op is already built", flush=True)
        _remove(failed)
        return 0
    print(
        f"rp_engine: building DeepSpeed's aio op for the NVMe tier (minutes, once per machine; "
        f"pid {os.getpid()})",
        flush=True,
    )
    start = time.monotonic()
    try:
        load_aio_op()
    except Exception as exc:  # never fail an install: the built-in engine does the same job
        print(f"rp_engine: aio op not built ({exc}); the NVMe tier will use built-in threads")
        if args.background:
            try:
                with open(failed, "w") as f:
                    f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {str(exc)[:500]}\n")
            except OSError:
                pass
        return 0
    _remove(failed)
    print(f"rp_engine: aio op built in {time.monotonic() - start:.0f} s", flush=True)
    return 0


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


if __name__ == "__main__":
    # the build's progress lines (storage/io_engine.py), with times: in the background build's log
    logging.basicConfig(
        level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s: %(message)s"
    )
    sys.exit(main())
