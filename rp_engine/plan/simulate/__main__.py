"""``python -m rp_engine.plan.simulate``: the simulator's command line (plan/cli.py).

The entry point lives here, above the simulator, so that the simulator never imports the
command line that imports it.
"""

from __future__ import annotations

from ..cli import main

if __name__ == "__main__":
    raise SystemExit(main())
