"""One-off studies: each answered one question once (an issue, a design choice); kept to rerun.

benchmarks/README.md lists them with their commands and what each found.
"""
