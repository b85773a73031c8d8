"""The disk writer's batch and queue bounds: derived from the block size when not configured (small
blocks get large batches, since every commit costs one ``fdatasync``), the configured values kept
as given, and what a manager's disk store is opened with."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.core.disk_tier import writer_limits
from tiered_kv.errors import ConfigError

KIB, MIB = 1024, 1 << 20
BIG_TIER = 1 << 20   # blocks: the tier's own cap (a sixteenth of it) does not bind


def _cfg(**kw: object) -> TieredKVConfig:
    return TieredKVConfig(namespace="t", host_capacity_bytes=MIB, **kw)   # type: ignore[arg-type]


@pytest.mark.parametrize("row, batch, queue", [
    (256, 512, 2048),             # small blocks: the most blocks a batch takes, four batches queued
    (32 * KIB, 512, 2048),        # 16 MiB of them is 512 exactly
    (64 * KIB, 256, 1024),        # 16 MiB of blocks
    (128 * KIB, 128, 512),
    (256 * KIB, 64, 256),         # from here up: 64 blocks (or what 64 MiB allows), 256 queued
    (2 * MIB, 32, 256),           # writer_batch_bytes (64 MiB) binds: 32 blocks
    (128 * MIB, 1, 256),          # a block over writer_batch_bytes: one a batch
])
def test_derived_batch_and_queue_follow_the_block_size(row, batch, queue):
    assert writer_limits(_cfg(), row, BIG_TIER) == (batch, queue)


def test_configured_values_are_kept_and_a_derived_queue_holds_four_of_the_batches_taken():
    assert writer_limits(_cfg(writer_batch_blocks=7, writer_queue_blocks=10), 256, BIG_TIER) == (7, 10)
    assert writer_limits(_cfg(writer_batch_blocks=7), 256, BIG_TIER) == (7, 256)
    assert writer_limits(_cfg(writer_batch_blocks=100), 256, BIG_TIER) == (100, 400)
    assert writer_limits(_cfg(writer_queue_blocks=10), 256, BIG_TIER) == (512, 10)


def test_a_batch_stays_within_its_bytes_and_a_sixteenth_of_the_tier():
    assert writer_limits(_cfg(writer_batch_bytes=100 * 256), 256, BIG_TIER) == (100, 400)
    assert writer_limits(_cfg(), 256, 1600) == (100, 400)          # 1600 // 16
    assert writer_limits(_cfg(), 256, 8) == (1, 256)               # a toy tier: one block a batch
    assert writer_limits(_cfg(writer_batch_blocks=1000), 256, 1600) == (100, 400)


@pytest.mark.parametrize("field, bad", [("writer_batch_blocks", 0), ("writer_queue_blocks", 0),
                                        ("writer_batch_blocks", 2.0), ("writer_queue_blocks", "8")])
def test_a_configured_bound_is_still_validated(field, bad):
    with pytest.raises(ConfigError, match=field):
        _cfg(**{field: bad})


def test_a_managers_disk_store_gets_the_derived_bounds(tmp_path):
    """A default config with 4 KiB rows: the store's writer batches 512 blocks and queues 2048."""
    row = 4 * KIB
    cfg = TieredKVConfig(namespace="t", host_capacity_bytes=4096 * row, disk_path=tmp_path / "d",
                         disk_capacity_bytes=65536 * row, disk_io="thread")
    mgr = TierManager(cfg, torch.zeros((8, row), dtype=torch.uint8), registry=CollectorRegistry())
    try:
        disk = mgr._core.disk
        assert disk is not None
        o = disk.store.opts
        assert (o.batch_blocks, o.queue_blocks, o.batch_bytes) == (512, 2048, 512 * row)
        assert disk.store.spill_room() == 2048
    finally:
        mgr.close()
