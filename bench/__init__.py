"""Benchmarks, the soak and the load driver: tools that measure the service, not part of it.

They report figures and never assert timings (``docs/benchmarks.md`` records them with their commands). Run from a
checkout: ``python -m bench --help``.
"""
