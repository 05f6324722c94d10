"""Benchmarks of rp_engine: benchmarks/README.md lists them, RESULTS.md has the figures."""
