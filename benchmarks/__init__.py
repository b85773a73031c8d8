"""Benchmarks of tiered_kv (not timed tests: nothing here asserts a timing).

``benchmarks.bench_core`` measures the core (control path, ``store()`` latency,
host-tier throughput), each figure beside a baseline measured in the same run.
Every ``bench_*`` function returns a JSON-ready dict so that a ``tiered-kv
bench`` command can import and aggregate them.
"""
