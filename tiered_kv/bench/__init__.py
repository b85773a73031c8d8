"""Benchmarks of tiered_kv, each figure beside a baseline measured in the same process.

Behind ``tiered-kv bench``; nothing here asserts a timing.

* :mod:`.core` -- control-path lifecycles (vs the unsafe plain-dict original), ``store()`` latency,
  host tier GB/s (vs raw ``torch`` ``copy_``), and with CUDA the device<->host links (vs torch's copy);
* :mod:`.disk` -- spill/promote GB/s (vs raw write+fsync / read and python-diskcache), the tier full
  and evicting (file size / capacity), engine-thread latency with the writer saturated;
* :mod:`.e2e` -- the demo workload with no offload, host only, host+disk;
* :mod:`.report` -- figures (value, baseline, ratio, target, met) and tables;
* :mod:`.plots` -- PNGs (matplotlib, optional);  :mod:`.cli` -- the subcommand and ``run_bench``.

python-diskcache and matplotlib are the optional ``bench`` extra and are imported only when used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_bench", "collect_figures"]


def run_bench(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """See :func:`tiered_kv.bench.cli.run_bench`."""
    from .cli import run_bench as _run

    return _run(*args, **kwargs)


def collect_figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """See :func:`tiered_kv.bench.report.collect_figures`."""
    from .report import collect_figures as _collect

    return _collect(result)
