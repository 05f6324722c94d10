"""The host's plumbing, below every other room: it imports nothing of rp_engine.

- ``units``: byte sizes and their formatting (``ALIGN``, ``format_bytes``...), shared by the
  planner, the preflight and the NVMe tier.
- ``defaults``: the NVMe pools' default buffer counts, shared by the config schema, the
  host-RAM model, the preflight, the advisor and the tier builders.
- ``jit_cache``: where JIT-built native ops live, the lock guard around loading them, and the
  generic ``every`` timer.
- ``affinity``: how the host's cores are split between the optimizer and the pipeline threads.
- ``memory_limit``: the host memory limit that binds this process (cgroup v1/v2, RLIMIT_AS, a
  configured budget, MemAvailable), read by the preflight and the advisor.

Only the standard library: the plan package (pure Python) and the config read ``units`` and
``defaults`` (and the advisor's command line ``memory_limit``). This ``__init__`` imports none of its modules, so importing one stays cheap.
"""
