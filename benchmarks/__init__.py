"""Benchmarks of tiered_kv (not timed tests: nothing here asserts a timing).

The measurement code lives in the package, :mod:`tiered_kv.benchmarking`, so
that the installed ``tiered-kv bench`` command can run it.  The scripts here
are thin entry points kept for ``make bench`` and for running one part alone:
``benchmarks/bench_core.py`` (control path, ``store()`` latency, host tier,
CUDA links) and ``benchmarks/bench_disk.py`` (spill, promote, full and
evicting, engine-thread latency).  Raw results are committed under
``benchmarks/results/``; the report is docs/benchmarks.md.
"""
