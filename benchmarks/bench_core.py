"""Benchmark of the tiered_kv core -- a runnable entry point; the code is ``tiered_kv.benchmarking.core``.

    python benchmarks/bench_core.py [--quick] [--json PATH] [--seed N] [--sections LIST] [--profile]

``tiered-kv bench`` runs this together with the disk tier, the CUDA links and
the end-to-end workload; see docs/benchmarks.md.  Importing this module gives
the same names as before (``run_all``, ``bench_lifecycles``, ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_kv.benchmarking.core import *  # noqa: E402,F401,F403
from tiered_kv.benchmarking.core import __all__, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
