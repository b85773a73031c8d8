"""Adversarial review of the metrics (tiered_kv/metrics.py and what feeds it)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_fake_manager, sample


def test_flush_without_lower_tier_leaves_registry_exact(kv):
    """docs/architecture.md: after any poll()/wait()/flush()/close() returns, the registry is exact."""
    reg = CollectorRegistry()
    mgr, mover = make_fake_manager(make_config(8), kv, reg)
    try:
        assert mgr.lookup([b"a", b"b", b"c"]) == 0
        assert mgr.flush() is True
        assert sample(reg, "tiered_kv_lookup_keys_total") == 3
    finally:
        mgr.close()


def test_disk_io_process_error_kinds_exported_at_zero_from_the_start(tmp_path):
    """metrics.py ERROR_KINDS: label values known in advance are exported at 0 from the start, so that
    ``increase(tiered_kv_errors_total{tier="disk"}[5m]) > 0`` (TieredKVDiskErrors) sees the first one.
    The disk I/O process's own kinds (docs/observability.md lists them) are not: a series that first
    appears at 1 has no increase, so the critical alert misses the first death of the I/O process."""
    from fakes import fake_disk_manager
    mgr, mover, kv = fake_disk_manager(tmp_path / "lmdb")
    try:
        assert type(mgr.disk).__name__ == "ProcessDiskStore"
        reg = mgr.metrics.registry
        missing = [e for e in ("io_process_died", "io_process_restart_failed")
                   if reg.get_sample_value("tiered_kv_errors_total", {"tier": "disk", "error": e}) is None]
        assert missing == []
    finally:
        mgr.close()


def test_a_closed_managers_metrics_say_so_and_can_be_taken_off_for_the_next_manager(kv):
    """A host that re-creates the manager on its own registry (reconfiguration, an in-process restart):
    the closed manager's final counts stay readable, its health gauges say 0 (not the 1 of a running
    one), a new manager on that registry is refused with a ConfigError saying why, and once the old
    metrics are taken off (``metrics.close()``) it registers."""
    from tiered_kv.errors import ConfigError
    reg = CollectorRegistry()
    m1, mover = make_fake_manager(make_config(8), kv, reg)
    assert m1.lookup([b"a"]) == 0
    m1.close()
    assert sample(reg, "tiered_kv_lookup_keys_total") == 1
    assert sample(reg, "tiered_kv_healthy", tier="host") == 0 and sample(reg, "tiered_kv_healthy", tier="device") == 0
    with pytest.raises(ConfigError, match="registry"):
        make_fake_manager(make_config(8), kv, reg)
    m1.metrics.close()
    assert list(reg.collect()) == []
    m2, _ = make_fake_manager(make_config(8), kv, reg)
    assert sample(reg, "tiered_kv_healthy", tier="host") == 1
    m2.close()


def test_store_part_cancelled_then_copy_failed_is_counted_stale(kv):
    """A store of one key whose row was freed counts its report stale (source_reused) whether the copy
    succeeded or failed (drop_store); a store of several keys counts the freed row's part only when the
    copy succeeded (publish_store): on a failed report the discarded part is never counted."""
    reg = CollectorRegistry()
    mgr, mover = make_fake_manager(make_config(8), kv, reg)
    try:
        for i, k in enumerate((b"a", b"b", b"c")):
            fill_row(kv, i, k)
        job = mgr.store_many([b"a", b"b", b"c"], [0, 1, 2])
        assert mgr.free_block(0)
        mover.fail(job)
        mgr.poll()
        assert sample(reg, "tiered_kv_stale_callbacks_total", kind="store", reason="source_reused") == 1
    finally:
        mgr.close()


def test_store_cancelled_part_by_part_counts_each_part_with_its_reason(kv):
    """docs/architecture.md: 'A store of several keys counts each cancelled part with its own reason'.
    With 3 keys and 2 parts cancelled, 2 stale counts (one per reason); with 2 keys and both cancelled,
    only 1, under the last part's reason: the first part's reason (source_reused) is lost."""
    reg = CollectorRegistry()
    mgr, mover = make_fake_manager(make_config(8), kv, reg)
    try:
        for i, k in enumerate((b"a", b"b")):
            fill_row(kv, i, k)
        job = mgr.store_many([b"a", b"b"], [0, 1])
        assert mgr.free_block(0)          # part 0: source_reused
        mgr.invalidate(b"b")              # part 1: superseded -> the whole job is cancelled
        mover.complete(job)
        mgr.poll()
        got = {r: sample(reg, "tiered_kv_stale_callbacks_total", kind="store", reason=r)
               for r in ("source_reused", "superseded")}
        assert got == {"source_reused": 1, "superseded": 1}
    finally:
        mgr.close()


def test_transfer_seconds_observed_per_block_for_store_many(kv):
    """tiered_kv_transfer_seconds is 'Duration of one block copy per link' and spill/put/fetch jobs are
    observed once per block at their share of the time (Metrics.moved n=...); a store_many of 4 blocks
    is observed once, at the whole job's time (TierManager._ok): the latency panels mix units."""
    reg = CollectorRegistry()
    mgr, mover = make_fake_manager(make_config(8), kv, reg)
    try:
        keys = [b"k%d" % i for i in range(4)]
        for i, k in enumerate(keys):
            fill_row(kv, i, k)
        job = mgr.store_many(keys, [0, 1, 2, 3])
        mover.complete(job)               # reports nbytes=4 rows, seconds=1e-4 for the job
        mgr.poll()
        assert sample(reg, "tiered_kv_transfer_bytes_total", src="device", dst="host") == 4 * 128
        assert sample(reg, "tiered_kv_transfer_seconds_count", src="device", dst="host") == 4
        assert sample(reg, "tiered_kv_transfer_seconds_sum", src="device", dst="host") == pytest.approx(1e-4)
    finally:
        mgr.close()


def test_registry_collision_in_constructor_leaks_nothing(tmp_path, kv):
    """A TierManager whose metrics cannot be registered (a registry already holding tiered_kv's, e.g. a
    second manager or one re-created after close()) raises; it must not leak the shared host slab's file
    descriptor it opened first (manager.py: Metrics(...) runs after make_shared_rows, outside the
    try/except that closes it)."""
    import os
    from fakes import ROW_BYTES
    reg = CollectorRegistry()
    m1, _ = make_fake_manager(make_config(8), kv, reg)
    try:
        cfg = make_config(4, disk_path=str(tmp_path / "lmdb"), disk_capacity_bytes=64 * ROW_BYTES,
                          disk_io="process")
        def fds():   # the listing's own directory fd is gone once listdir returns: lexists drops it
            return {fd for fd in os.listdir("/proc/self/fd") if os.path.lexists(f"/proc/self/fd/{fd}")}
        before = fds()
        with pytest.raises(ValueError):
            make_fake_manager(cfg, kv, reg)
        leaked = fds() - before
        assert not leaked, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in leaked}
    finally:
        m1.close()
