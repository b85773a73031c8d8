"""The disk bench's raw baselines fsync once per write batch of the library's writer, and its engine loops
keep at most the writer's queue in flight: both come from the library's own rule
(``core.disk_tier.writer_limits``), now that the config's defaults for them are None (derived per block
size).  The sections themselves run in ``tests/test_bench_cli.py``'s smoke run."""

from __future__ import annotations

import pytest

import tiered_kv.bench.disk as bench_disk

KIB, MIB = 1024, 1 << 20


@pytest.mark.parametrize("block, batch, queue", [
    (2 * MIB, 32, 256),      # the bench's two block sizes: 64 MiB of 2 MiB blocks a batch
    (256 * KIB, 64, 256),
    (4 * KIB, 512, 2048),    # small blocks: large batches (one fdatasync each)
])
def test_the_bench_uses_the_writers_own_batch_and_queue(block, batch, queue):
    assert bench_disk._nominal_batch(block) == batch
    assert bench_disk._default_queue(block) == queue
