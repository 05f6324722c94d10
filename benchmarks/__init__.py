"""Benchmarks of rp_engine: ``python -m benchmarks.head_to_head``, ``python -m benchmarks.projection``."""
