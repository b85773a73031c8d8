"""A promote's read of its disk entry is no use of the block: it pins the entry where it is (``TierIndex.pin``,
from ``TierCore.start_promote``), so where the block stays in the disk tier's order does not depend on when the
read's report is applied.

It used to lease the entry (``TierIndex.acquire``): the entry left the disk tier's LRU while its read was in
flight and came back as the newest at the report.  A read the waiting thread serves from the page cache
(``disk_read_cached_in_wait``, the default) reports before the step's spills land; one the disk I/O side serves,
after them: the two paths evicted different blocks, and ``tiered-kv replay`` of the shipped Mooncake trace hit
0.1549 of its references with the first and 0.1556 with the second (request 2446 found 45 blocks on disk in
one and none in the other), so its figures depended on what the page cache held.  The lookup that found the
block on disk already counted the use (``ready_run_below``).

Deterministic: the replay answers host copies at once, in order (``ImmediateMover``), and waits for each step's
spills; only the path of the disk reads differs between the two runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv import TieredKVConfig
from tiered_kv.tools.replay import replay
from tiered_kv.tools.tracetools import read_trace

TRACE = Path(__file__).resolve().parent.parent / "benchmarks" / "traces" / "mooncake_synthetic_trace.jsonl"

pytestmark = pytest.mark.timeout(300)


def test_the_disk_tiers_order_does_not_depend_on_which_side_read_a_promote(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = read_trace(TRACE, limit=2460)   # the first request the two paths answered differently: 2446
    replace = TieredKVConfig.replace
    got = {}
    for cached in (True, False):
        def with_reads(self: TieredKVConfig, cached: bool = cached, **kw: object) -> TieredKVConfig:
            kw.setdefault("disk_read_cached_in_wait", cached)
            return replace(self, **kw)   # type: ignore[arg-type]

        monkeypatch.setattr(TieredKVConfig, "replace", with_reads)
        o = replay(reqs, 878, 2196, scratch=str(tmp_path))   # host 2% and disk 5% of the whole trace's blocks
        got[cached] = (o["host_hits"], o["disk_hits"], o["disk_evictions"])
        assert o["spills_shed"] == 0 and o["stores_shed"] == 0
    assert got[True] == got[False], f"page-cache reads {got[True]} != the disk I/O side's {got[False]}"
