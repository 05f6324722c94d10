"""Build DeepSpeed's aio op once into the shared extensions cache (``make install`` runs this).

Exit status 0 when the op is built (or was already), 0 with a message when it cannot be built
here (no libaio-dev): the NVMe tier then uses its built-in engine. Never fails an install.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from rp_engine.storage.io_engine import aio_op_built, load_aio_op

    if aio_op_built():
        print("rp_engine: DeepSpeed's aio op is already built")
        return 0
    print("rp_engine: building DeepSpeed's aio op for the NVMe tier (minutes, once per machine)")
    start = time.monotonic()
    try:
        load_aio_op()
    except Exception as exc:  # never fail an install: the built-in engine does the same job
        print(f"rp_engine: aio op not built ({exc}); the NVMe tier will use built-in threads")
        return 0
    print(f"rp_engine: aio op built in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
