"""Opening a disk tier for an owner of bookkeeping (no engine, no tensors).

Both owners -- :class:`~tiered_kv.manager.TierManager` (one process) and the
vLLM adapter's :class:`~tiered_kv.integrations.offload.SlabTiers` (scheduler
process) -- open their LMDB tier the same way: size the writer's batches
against the capacity, open (and recover) the store, export what recovery found,
and rebuild the LRU index from the entries that survived.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
import uuid
from typing import Any, Optional, Union

from .config import TieredKVConfig
from .disk import SPILL_PREVENTED, DiskOptions, DiskStore, writable_view
from .errors import DiskInUseError, DiskTierError
from .host import HostEntry, TierIndex
from .jobs import JobKind
from .metrics import Metrics
from .movers import CompletionQueue, Report

__all__ = ["open_disk_tier", "replay_recovered", "disk_levels", "check_writer", "DiskErrors", "start_spill",
           "forget_failed_read", "finish_spill", "finish_promote", "evict_from_disk", "SlotViews", "TierViews"]

log = logging.getLogger(__name__)


class DiskErrors:
    """The disk store's error callback: counts every fault, logs each kind once (any thread)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, kind: str, msg: str) -> None:
        self._metrics.error("disk", kind)
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            log.error("disk tier error (%s): %s; further %s errors are counted, not logged", kind, msg, kind)


def open_disk_tier(cfg: TieredKVConfig, row_bytes: int, disk_blocks: int, completions: CompletionQueue,
                   metrics: Metrics,
                   on_evict: Callable[[HostEntry], None]) -> tuple[Optional[DiskStore], Optional[TierIndex]]:
    """The store and an empty index, or ``(None, None)`` when the tier could not open (counted, logged).

    The owner keeps both, then calls :func:`replay_recovered` (which may
    already evict, through ``on_evict``, when the capacity shrank since the
    last run).  :class:`DiskInUseError` (another owner holds the path) is
    raised: that is a configuration mistake, not a fault to serve around.
    """
    m = metrics
    on_error = DiskErrors(metrics)
    # A slot is reused only once the commit that dropped its entry is durable (one commit later
    # with durability="batch"), and a batch's deletes and spills share a commit: the slot file
    # needs the index's entries plus two batches.  Keep batches small against the capacity (at
    # most 1/16 of it) and count that headroom inside disk_capacity_bytes.
    batch_blocks = max(1, min(cfg.writer_batch_blocks, cfg.writer_batch_bytes // row_bytes, disk_blocks // 16))
    # (a tier of fewer than 32 blocks is a test or toy: its headroom comes on top)
    index_blocks = disk_blocks - 2 * batch_blocks if disk_blocks >= 32 else disk_blocks
    slots = max(disk_blocks, index_blocks + 2 * batch_blocks)
    opts = DiskOptions(path=cfg.disk_dir, namespace=cfg.namespace, block_bytes=row_bytes,  # type: ignore[arg-type]
                       capacity_bytes=disk_blocks * row_bytes, durability=cfg.durability, slots=slots,
                       map_size_bytes=cfg.disk_map_size_bytes, queue_blocks=cfg.writer_queue_blocks,
                       batch_blocks=batch_blocks, batch_bytes=batch_blocks * row_bytes,
                       batch_seconds=cfg.writer_batch_seconds)
    m.capacity["disk"].set(index_blocks * row_bytes)
    try:
        disk = DiskStore(opts, completions, on_error=on_error, on_prevented=m.orphaned_prevented.inc,
                         on_corrupt=lambda reason: m.corrupt_blocks.labels(reason=reason).inc())
    except DiskInUseError:
        raise
    except DiskTierError as exc:
        # the host tier keeps serving; the fault is counted, logged and visible
        on_error("open_failed", str(exc))
        m.enable_disk_health(False)
        return None, None
    return disk, TierIndex(index_blocks, on_evict=on_evict)


def replay_recovered(disk: DiskStore, index: TierIndex, metrics: Metrics) -> None:
    """Export what recovery found and rebuild the LRU index from the surviving entries."""
    m = metrics
    rep = disk.recovery
    m.recovery_seconds.set(rep.seconds)
    m.recovery_purged.set(rep.purged)
    m.orphaned_purged.inc(rep.purged)
    if rep.corrupt:
        m.corrupt_blocks.labels(reason="recovery").inc(rep.corrupt)
    if rep.foreign:
        m.corrupt_blocks.labels(reason="foreign").inc(rep.foreign)
    for e in disk.entries:  # oldest first, so LRU order survives the restart
        d = index.get(e.key) or index.reserve(e.key, e.token)
        if d is not None and d.writing:
            index.publish(d)
    m.enable_disk_health(True)


def check_writer(disk: DiskStore, usable: bool, closing: bool = False) -> bool:
    """Whether the tier still accepts spills: not once its writer thread is gone (reads still work)."""
    if usable and not closing and not disk.writer_alive():
        log.error("disk writer is gone; the disk tier no longer accepts spills")
        return False
    return usable


def disk_levels(disk: Optional[DiskStore], index: Optional[TierIndex], row_bytes: int,
                usable: bool) -> Optional[tuple[int, int, int, int, int, int]]:
    """The disk tier's gauge values for :meth:`Metrics.publish_levels` (None without a tier)."""
    if disk is None or index is None:
        return None
    return (index.used_slots * row_bytes, len(index), disk.queue_depth, disk.tombstones, disk.map_size,
            1 if disk.healthy and usable else 0)


def start_spill(disk: DiskStore, dindex: TierIndex, hindex: TierIndex, entry: HostEntry, token: uuid.UUID,
                src: memoryview) -> Union[HostEntry, str, None]:
    """Queue the write of READY host ``entry`` (its slot's bytes ``src``) under ``token``.

    Returns the new disk entry, with ``entry``'s slot leased to the write
    until the owner applies its report; ``None`` when the key is on disk
    already; or the shed reason (``"disk_full"``, ``"backpressure"``), with
    nothing left held.  The writer queue is asked first: reserving a disk
    entry may evict one, and a spill that is then shed must not have cost
    the tier a block.
    """
    if entry.key in dindex:
        return None
    if not disk.spill_room():
        return "backpressure"
    d = dindex.reserve(entry.key, token)
    if d is None:
        return "disk_full"
    hindex.acquire(entry)
    if not disk.submit_spill(token, entry.key, src):
        hindex.release(entry)
        dindex.writer_done(d)
        dindex.abort(d)
        return "backpressure"
    return d


def forget_failed_read(dindex: TierIndex, d: HostEntry) -> None:
    """A read-back of ``d`` failed: the entry is gone, superseded or bad on disk, so the index
    forgets it (the store's reader already queued the removal of a corrupt or unreadable entry)."""
    if d.live:
        dindex.remove(d)


def finish_spill(dindex: TierIndex, metrics: Metrics, d: HostEntry, r: Report) -> bool:
    """A live spill's report: the disk entry is published, or dropped when the write failed; counted.

    Returns True when the write failed by a fault (not stopped by a tomb): the owners count these,
    so that a ``flush()`` that applies one answers False."""
    if r.ok:
        dindex.publish(d)
        metrics.moved(JobKind.SPILL, ("host", "disk"), r.nbytes, r.seconds)
        return False
    dindex.writer_done(d)
    dindex.abort(d)
    metrics.count(metrics.job_outcome[(JobKind.SPILL, "failed")])
    return r.error != SPILL_PREVENTED


def finish_promote(disk: DiskStore, hindex: TierIndex, dindex: TierIndex, metrics: Metrics, entry: HostEntry,
                   d: HostEntry, r: Report) -> None:
    """A live promote's report: the host entry is published (and the disk entry's recency kept), or
    dropped with the disk entry forgotten when the read failed; counted."""
    if r.ok:
        hindex.publish(entry)
        metrics.moved(JobKind.PROMOTE, ("disk", "host"), r.nbytes, r.seconds)
        disk.submit_touch(entry.key)
    else:
        hindex.writer_done(entry)
        hindex.abort(entry)
        metrics.count(metrics.job_outcome[(JobKind.PROMOTE, "failed")])
        forget_failed_read(dindex, d)


def evict_from_disk(disk: DiskStore, metrics: Metrics, d: HostEntry) -> None:
    """The disk index evicted ``d``: remove its write (token-matched, so never a newer one)."""
    metrics.evicted["disk"].inc()
    disk.submit_delete(d.writer, d.key)


class TierViews:
    """Read-only sizes both owners expose (tests, tools); needs ``_index``, ``_dindex`` and ``_disk``."""

    _index: TierIndex
    _dindex: Optional[TierIndex]
    _disk: Optional[DiskStore]

    @property
    def host_blocks(self) -> int:
        return len(self._index)

    @property
    def disk_blocks(self) -> int:
        return 0 if self._dindex is None else len(self._dindex)

    @property
    def disk(self) -> Optional[DiskStore]:
        """The disk tier's store (None without one or when it failed to open)."""
        return self._disk


class SlotViews:
    """Writable byte views of a host slab's slots, as the disk store reads and writes them.

    One view over the whole (contiguous) slab, sliced per slot: nothing to
    cache per slot.  ``release()`` before the slab's memory goes away.
    """

    def __init__(self, rows: Any) -> None:
        if not rows.is_contiguous() or rows.dim() != 2:
            raise ValueError(f"a slab must be a contiguous [slots, bytes] tensor, got {tuple(rows.shape)}")
        self._bytes = int(rows.shape[1]) * rows.element_size()
        self._all: Optional[memoryview] = writable_view(rows)

    def __getitem__(self, slot: int) -> memoryview:
        assert self._all is not None, "slot views used after release()"
        return self._all[slot * self._bytes:(slot + 1) * self._bytes]

    def release(self) -> None:
        self._all = None

