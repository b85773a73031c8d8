"""The disk tier as the core sees it: the store's handle and the index of what it holds.

:class:`DiskTier` opens the store (sizing the writer's batches against the
capacity), exports what recovery found, rebuilds the LRU index from the
entries that survived, and turns the core's decisions into store requests:
start a spill, start a promote, apply their reports, forget an evicted or
invalidated entry (token-matched on disk, so never a newer write).  Owner
thread only; the store's own threads never see this object.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Optional, Union

from ..config import TieredKVConfig
from ..disk import NOT_READ, DiskOptions, DiskStore
from ..disk import lock as path_lock
from ..disk.proc import ProcessDiskStore, ProcessStartError, SharedHost
from ..disk.store import take_path
from ..errors import DiskInUseError, DiskTierError
from ..jobs import JobKind
from ..metrics import Metrics
from ..movers import CompletionQueue, Report
from .index import Entry, TierIndex
from .policy import make_admission, make_policy

__all__ = ["DiskTier", "DiskErrors", "writer_limits", "indexed_blocks", "capacity_for"]

log = logging.getLogger(__name__)

_SMALL_TIER_BLOCKS = 32
"""Below this many blocks a disk tier is a test or a toy: its writer headroom comes on top of the capacity."""
_BATCH_FRACTION = 16
"""A writer batch is at most this fraction of the capacity, so that the headroom it needs stays small."""
BATCH_TARGET_BYTES = 16 << 20
"""A derived write batch (``writer_batch_blocks=None``) holds about this many bytes of blocks ..."""
BATCH_MIN_BLOCKS, BATCH_MAX_BLOCKS = 64, 512
"""... and at least / at most this many blocks."""
QUEUE_BATCHES, QUEUE_MIN_BLOCKS = 4, 256
"""A derived writer queue (``writer_queue_blocks=None``) holds this many write batches, at least this many blocks."""


def _absolute(disk_dir: "os.PathLike[str]") -> Path:
    """``disk_dir`` resolved once, at the open: every later start of a store (a disk I/O process replaced,
    ``close()``'s reconciling start) opens it under that name whatever the working directory or a link in the
    path names by then.  LMDB opens UTF-8 names only (the name given was checked): where the resolved name is not
    UTF-8 (a link to a directory so named), the name made absolute as it is (no link resolved, no ``..``
    removed), else as given.  What a name names may still change after the open (the directory replaced or
    mounted over, or a link it keeps repointed): each store given a share of the tier's lock checks that the
    name still names the locked directory (``DiskStore._check_lock``) and refuses to open another."""
    name = os.fspath(disk_dir)
    # the fallback is not normalized: "link/../x" is the kernel's to resolve (through the link), not abspath's
    for p in (os.path.realpath(name), name if os.path.isabs(name) else os.path.join(os.getcwd(), name)):
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            continue
        return Path(p)
    return Path(disk_dir)


def writer_limits(cfg: TieredKVConfig, row_bytes: int, disk_blocks: int) -> tuple[int, int]:
    """The disk writer's blocks per write batch and its queue bound, for a tier of ``disk_blocks``
    blocks of ``row_bytes``: the configured values, or where they are None, derived from the block size.

    Every commit makes its blocks durable with one ``fdatasync`` of the slot file (milliseconds on a
    cloud disk), so the writer keeps up with the engine's stores of small blocks only in large
    batches (docs/benchmarks.md, "A realistic engine step").  From 256 KiB blocks up a derived batch is
    64 blocks or what ``writer_batch_bytes`` allows, and a derived queue 256 blocks.  A derived queue
    holds four batches, so that one commits while the next fill.  A batch is at most a sixteenth
    of the tier (``_BATCH_FRACTION``: the headroom the slot file keeps for it stays small).
    """
    batch = cfg.writer_batch_blocks
    if batch is None:
        batch = min(BATCH_MAX_BLOCKS, max(BATCH_MIN_BLOCKS, BATCH_TARGET_BYTES // row_bytes))
    batch = max(1, min(batch, cfg.writer_batch_bytes // row_bytes, disk_blocks // _BATCH_FRACTION))
    queue = cfg.writer_queue_blocks
    if queue is None:
        queue = max(QUEUE_MIN_BLOCKS, QUEUE_BATCHES * batch)
    return batch, queue


def indexed_blocks(cfg: TieredKVConfig, row_bytes: int, disk_blocks: int) -> int:
    """The blocks a disk tier of ``disk_blocks`` holds.  A slot is reused only once the commit that dropped its
    entry is durable (one commit later with durability="batch"), and a batch's deletes and spills share a
    commit: the slot file needs the index's entries plus two write batches, counted inside the capacity
    (on top of it for a toy tier below ``_SMALL_TIER_BLOCKS``)."""
    if disk_blocks < _SMALL_TIER_BLOCKS:
        return disk_blocks
    return disk_blocks - 2 * writer_limits(cfg, row_bytes, disk_blocks)[0]


def capacity_for(cfg: TieredKVConfig, row_bytes: int, blocks: int) -> int:
    """``disk_capacity_bytes`` for a disk tier that holds exactly ``blocks`` blocks of ``row_bytes`` under
    ``cfg``'s writer settings (its two write batches on top: see :func:`indexed_blocks`)."""
    if blocks < 1:
        raise ValueError(f"a disk tier holds at least one block, asked for {blocks}")
    total = blocks
    for _ in range(64):   # the batch grows with the tier (a sixteenth of it at most): a few rounds settle it
        if indexed_blocks(cfg, row_bytes, total) == blocks:
            return total * row_bytes
        total = blocks + 2 * writer_limits(cfg, row_bytes, total)[0] if total >= _SMALL_TIER_BLOCKS else total + 1
    raise ValueError(f"no disk capacity holds exactly {blocks} blocks of {row_bytes} bytes")  # pragma: no cover


RESTART_BACKOFF_MIN_S, RESTART_BACKOFF_MAX_S = 1.0, 60.0
RESTART_CLOSE_WAIT_S = 30.0   # restart(force=True), the owner closing: how long it waits for a start in flight
"""A disk I/O process that cannot be restarted is tried again after this long, doubling."""


class DiskErrors:
    """The disk store's error callback: counts every fault, logs each kind once (any thread); and its
    corruption callback (:meth:`corrupt`): counts every block that failed verification, logs each reason once."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def _first(self, what: str) -> bool:
        with self._lock:
            first = what not in self._logged
            self._logged.add(what)
        return first

    def __call__(self, kind: str, msg: str) -> None:
        self._metrics.error("disk", kind)
        if self._first(kind):
            log.error("disk tier error (%s): %s; further %s errors are counted, not logged", kind, msg, kind)

    def corrupt(self, reason: str) -> None:
        self._metrics.corrupt_blocks.labels(reason=reason).inc()
        if self._first("corrupt:" + reason):
            log.warning("disk tier: a block failed verification (corrupt: %s); it was served as a miss and its "
                        "entry removed; further corrupt blocks (%s) are counted in tiered_kv_corrupt_blocks_total, "
                        "not logged", reason, reason)


class DiskTier:
    """An open disk tier: ``store`` (the I/O threads) and ``index`` (capacity, leases, LRU).

    ``usable`` turns False once the writer is gone: reads go on, spills are shed.  With the
    disk I/O process (``disk_io="process"``) a writer that is gone is a child that died, and
    :meth:`restart` starts a new one (``usable`` again); a writer thread that died stays gone.
    ``lock_share``: with the disk I/O process, the tier's own share of the path's lock, held from the open
    to :meth:`leave_path` (each store has another): the path stays locked while a dead child is replaced,
    and through the back-off after a start that failed.
    """

    def __init__(self, store: Union[DiskStore, ProcessDiskStore], index: TierIndex, metrics: Metrics,
                 reopen: Optional[Callable[[], Union[DiskStore, ProcessDiskStore]]] = None,
                 on_error: Callable[[str, str], None] = lambda kind, msg: None,
                 lock_share: Optional[path_lock.LockFd] = None) -> None:
        self.store = store
        self._path_lock = lock_share
        self.index = index
        self.usable = True
        self._metrics = metrics
        self._reopen = reopen
        self._on_error = on_error
        self._backoff = 0.0
        self._reads_seen: tuple[object, int, int] = (None, 0, 0)   # the page-cache reads counted so far
        self._retry_at = 0.0
        self._started_at = time.monotonic()
        self._seen_death: object = None   # the dead store restart() has looked at (a back-off is decided once per death)
        self.restarts = 0
        # a READY entry dropped from the index other than by eviction (its read found it bad or gone, or a
        # restarted I/O process did not find it): the core's eviction hook (a front end reporting keys gone hears)
        self.on_gone: Callable[[Entry], None] = lambda d: None
        # a new disk I/O process being started off the owner's thread: the starter thread, the new store or
        # the start's exception once it ended (restart() adopts it at a later pass), and its abandon()
        self._starting: Optional[tuple[threading.Thread, list[object], Callable[[], bool]]] = None
        # a new store taken from its start and not yet reconciled with the index (an interrupt broke the
        # adoption off): the tier is down until restart() finishes it
        self._adopting: Union[DiskStore, ProcessDiskStore, None] = None
        self._exported: object = None   # the store whose recovery report was exported (once each)
        self.abandoned = False            # a start at close took too long and was abandoned (a hung disk)

    @classmethod
    def open(cls, cfg: TieredKVConfig, row_bytes: int, completions: CompletionQueue, metrics: Metrics,
             on_evict: Callable[[Entry], None], host: Optional[SharedHost] = None) -> Optional["DiskTier"]:
        """The tier, recovered; ``None`` when it could not open (counted, logged, host-only service).

        :class:`DiskInUseError` (another owner holds the path) is raised: that is a
        configuration mistake, not a fault to serve around.  ``on_evict(entry)`` is
        called for each disk entry the index evicts (after the store was told), and for each
        one dropped otherwise (:attr:`on_gone`).  With
        ``cfg.disk_io == "process"`` and a shareable host slab (``host``) the store runs in
        its own process (:class:`ProcessDiskStore`); otherwise as threads of this one.
        """
        disk_blocks = cfg.disk_capacity_bytes // row_bytes
        batch_blocks, queue_blocks = writer_limits(cfg, row_bytes, disk_blocks)
        index_blocks = indexed_blocks(cfg, row_bytes, disk_blocks)
        slots = max(disk_blocks, index_blocks + 2 * batch_blocks)
        m = metrics
        m.capacity["disk"].set(index_blocks * row_bytes)
        on_error = DiskErrors(metrics)
        try:
            path = _absolute(cfg.disk_dir)   # type: ignore[arg-type]
        except OSError as exc:   # no working directory any more, under a relative path
            on_error("open_failed", f"disk_path {str(cfg.disk_dir)!r} cannot be resolved: {exc}")
            m.enable_disk_health(False)
            return None
        opts = DiskOptions(path=path, namespace=cfg.namespace, block_bytes=row_bytes,
                           capacity_bytes=disk_blocks * row_bytes, durability=cfg.durability, slots=slots,
                           map_size_bytes=cfg.disk_map_size_bytes, queue_blocks=queue_blocks,
                           batch_blocks=batch_blocks, batch_bytes=batch_blocks * row_bytes,
                           batch_seconds=cfg.writer_batch_seconds)
        on_corrupt = on_error.corrupt
        if cfg.disk_io == "process" and host is None:
            log.info("disk_io='process' needs a shareable host slab; this front end gave none: disk I/O on threads")
        held: list[path_lock.LockFd] = []   # the tier's share of the path lock (disk I/O process only)

        def make() -> Union[DiskStore, ProcessDiskStore]:
            if held:   # each store of the disk I/O process uses a share of the tier's lock (never unlocked)
                assert host is not None
                try:
                    share = path_lock.share(held[0])
                except OSError as exc:   # out of descriptors, or the tier closed (a start abandoned at close)
                    raise DiskTierError(f"disk_path {str(cfg.disk_dir)!r}: no share of its lock for a disk I/O "
                                        f"process: {exc}") from exc
                try:
                    return ProcessDiskStore(opts, completions, host, on_error=on_error,
                                            on_prevented=m.orphaned_prevented.inc, on_corrupt=on_corrupt,
                                            lock_fd=share)
                except BaseException:   # whatever it raised, before or after it took the share: left here
                    path_lock.leave(share)   # (identity-checked: a share the store left already is not closed twice)
                    raise
            return DiskStore(opts, completions, on_error=on_error, on_prevented=m.orphaned_prevented.inc,
                             on_corrupt=on_corrupt)

        try:
            try:
                if cfg.disk_io == "process" and host is not None:
                    held.append(take_path(path))
                store = make()
            except ProcessStartError as exc:   # this Python cannot run the child: the same store, as threads
                log.warning("disk tier %s: %s; its I/O runs as threads of this process instead", cfg.disk_dir, exc)
                on_error("io_process_start_failed", str(exc))
                # the threads' store takes the lock itself: the tier's share is closed, never unlocked (a killed
                # child that did not exit keeps the path until it does)
                path_lock.leave_all(held.pop())
                store = DiskStore(opts, completions, on_error=on_error, on_prevented=m.orphaned_prevented.inc,
                                  on_corrupt=on_corrupt)
        except DiskInUseError:
            if held:   # (closed, never unlocked: a killed child that did not exit keeps the path until it does)
                path_lock.leave_all(held.pop())
            raise
        except DiskTierError as exc:
            if held:
                path_lock.leave_all(held.pop())
            on_error("open_failed", str(exc))
            m.enable_disk_health(False)
            return None
        except BaseException:
            if held:
                path_lock.leave_all(held.pop())
            raise
        try:
            index = TierIndex(index_blocks, policy=make_policy(cfg.disk_policy, index_blocks),
                              admission=None if cfg.disk_admission == "all"
                              else make_admission(cfg.disk_admission, index_blocks))
            tier = cls(store, index, metrics, make if held else None, on_error, held[0] if held else None)
            tier.index._on_evict = lambda d: tier._evicted(d, on_evict)
            tier.on_gone = on_evict
            tier._replay_recovered()
        except BaseException:   # (an interrupt in the replay, the longest part of a start): nothing left open
            store.close()
            if held:
                path_lock.leave(held[0])
            raise
        log.info("tiered_kv disk tier at %s: %d blocks recovered in %.1f ms", cfg.disk_dir, len(tier.index),
                 store.recovery.seconds * 1e3)
        return tier

    def _replay_recovered(self) -> None:
        """Export what recovery found and rebuild the LRU index (oldest first, so LRU order survives)."""
        self._export_recovery()
        index = self.index
        for e in self.store.entries:   # distinct keys, oldest first: past capacity, the oldest are evicted
            d = index.reserve(e.key, e.token)
            if d is not None:          # None only if no entry were evictable; every one here is READY
                d.where = e.where
                index.publish(d)
        self._metrics.enable_disk_health(True)

    def _export_recovery(self) -> None:
        """The store's recovery report: its gauges set (again, by an adoption run again: harmless), its counts
        added once per store (marked first: an interrupt may lose them, never add them twice)."""
        store = self.store
        m, rep = self._metrics, store.recovery
        m.recovery_seconds.set(rep.seconds)
        m.recovery_purged.set(rep.purged)
        if self._exported is store:
            return
        self._exported = store
        m.orphaned_purged.inc(rep.purged)
        if rep.corrupt:
            m.corrupt_blocks.labels(reason="recovery").inc(rep.corrupt)
        if rep.foreign:
            m.corrupt_blocks.labels(reason="foreign").inc(rep.foreign)

    # ------------------------------------------------------------------ the I/O process's restart
    @property
    def down(self) -> bool:
        """The disk I/O process died and every op it had was answered: time for :meth:`restart`."""
        return self._reopen is not None and (self._adopting is not None or getattr(self.store, "down", False))

    @property
    def died(self) -> bool:
        """The disk I/O process died (on its own: not killed by a close it outlasted), and no new one was
        adopted yet, or the start of one is under way: a close then starts (or finishes) one more, to
        reconcile (:meth:`restart`)."""
        return self._reopen is not None and (self.restarting or getattr(self.store, "died", False))

    @property
    def restarting(self) -> bool:
        """A start of a new disk I/O process, or its adoption, is under way (one an interrupt broke off)."""
        return self._starting is not None or self._adopting is not None

    def leave_path(self) -> None:
        """The tier's share of the path lock goes (its final close, after its store's): the path is free once
        no share is left -- none of a store, nor of a child that did not exit (it stays held until that child
        is gone).  Once: a second call does nothing."""
        fd = self._path_lock
        if fd is not None:
            path_lock.leave(fd)   # (run again after an interrupt here: does nothing)
            self._path_lock = None

    @property
    def dead(self) -> bool:
        """The disk I/O process died (its answers may still be on their way), and no new one was adopted yet:
        a read started now fails at once."""
        return getattr(self.store, "dead", False)

    def restart(self, now: Optional[float] = None, force: bool = False) -> bool:
        """Start a new disk I/O process after the last one died; True once it runs.

        Call only once the dead process's answers were applied (its spills aborted, its
        promotes failed): the index then holds only READY entries, with no lease from the dead
        process.  The new process is started, and its open (its recovery scan) awaited, on a
        starter thread: the engine's thread never waits for it (the tier stays down meanwhile);
        each later call looks whether it is done, and the first that finds it done adopts it.  With
        ``force`` (the owner closing) it waits for the start, up to ``RESTART_CLOSE_WAIT_S``; a start
        still in flight then is abandoned (the store it makes is closed at once, the path released).
        What the new process recovered is reconciled with the index: an entry the index
        holds under the same writer token stays; one it holds but the disk lost leaves the index;
        one on disk that the index no longer holds (invalidated, evicted, or deleted by an op the
        dead process never committed) is deleted, token-matched -- nothing the owner dropped comes
        back.  A failed start is counted and tried again after a back-off (1 s, doubling to 60 s),
        with the tier down (spills shed as ``disk_down``, reads missing) meanwhile; so is a
        restarted process that dies again within 60 s of its start (a crash loop costs a recovery
        scan per restart, not one per engine step).  A process that ran longer is restarted at once;
        so is any with ``force`` (the owner closing: the last chance to delete what it dropped)."""
        assert self._reopen is not None
        now = time.monotonic() if now is None else now
        if self._adopting is not None:   # an adoption an interrupt broke off: finished first
            self._adopt(self._adopting, now)
            return True
        if self._seen_death is not self.store:   # the first look at this death
            self._seen_death = self.store
            if self.restarts and now - self._started_at < RESTART_BACKOFF_MAX_S:
                self._backoff = min(RESTART_BACKOFF_MAX_S, max(RESTART_BACKOFF_MIN_S, 2 * self._backoff))
                self._retry_at = now + self._backoff
            else:
                self._backoff = self._retry_at = 0.0
        self.usable = False
        if self._starting is not None:
            starter, outcome, abandon = self._starting
            # an interrupt before its thread ran (never made, or made and not yet run): given up -- a thread that
            # runs later finds it abandoned and starts nothing --, and started again below
            if not outcome and not starter.is_alive() and starter.ident is None and abandon():
                self._starting = None
        if self._starting is None:
            if now < self._retry_at and not force:
                return False
            self.store.close()   # the dead child's pipes and its share of the path lock
            if not self._start():
                self._failed_start(now, "cannot start a thread to start the disk I/O process")
                return False
        starter, outcome, abandon = self._starting   # type: ignore[misc]
        if force:
            starter.join(RESTART_CLOSE_WAIT_S)
            if starter.is_alive() and abandon():   # a new child stuck in its open (a hung disk): not waited for
                self._starting = None
                self.abandoned = True
                self._on_error("io_process_restart_failed", f"the disk I/O process's start took longer than "
                                                            f"{RESTART_CLOSE_WAIT_S:.0f} s at close: abandoned")
                return False
        if not outcome:   # (written under the start's lock: an outcome there is adopted, its thread ending or not)
            if starter.is_alive():
                return False
            outcome.append(RuntimeError("the disk I/O process's starter ended without an outcome"))
        got = outcome[0]
        if isinstance(got, (DiskTierError, DiskInUseError)):
            self._starting = None
            self._failed_start(now, str(got))
            return False
        if isinstance(got, BaseException):   # a bug: raised where the synchronous start raised it, in the pass
            self._starting = None
            raise got
        self.count_page_cache_reads()   # the old store's last reads, before its counts are out of sight
        # one step (no call between the stores): the new store and its share of the path lock are this tier's
        # from here, adopted by _adopt or, after an interrupt, by the next restart()
        self._starting, self._adopting = None, got   # type: ignore[assignment]
        self._adopt(got, now)   # type: ignore[arg-type]
        return True

    def _adopt(self, store: Union[DiskStore, ProcessDiskStore], now: float) -> None:
        """Make ``store`` the tier's, its recovered entries reconciled with the index (see :meth:`restart`).
        Each part can run again: an adoption an interrupt broke off is run again whole by the next
        :meth:`restart` (the tier is :attr:`down` until it ends), its deletes sent twice at most (token-matched:
        the second finds nothing) and a key lost with the last process told gone twice at most."""
        self.store = store
        self._export_recovery()
        kept = {e.key: e.token for e in store.entries}
        index = self.index
        lost = 0
        for d in index.entries():
            if kept.get(d.key) == d.writer:
                del kept[d.key]
            else:   # (told first: an adoption run again may tell a key twice, never lose one)
                self.on_gone(d)
                index.remove(d)
                lost += 1
        for key, token in kept.items():
            store.submit_delete(token, key)
        store.kick()
        # one step: the tier serves again once the adoption is done, not before
        self._started_at = now
        self.usable = True
        self.restarts += 1
        self._adopting = None
        log.warning("disk tier %s: disk I/O process restarted (pid %d); %d entr%s lost with the last one, "
                    "%d on disk no longer wanted deleted", store.opts.path, store.pid, lost,
                    "y" if lost == 1 else "ies", len(kept))

    def _start(self) -> bool:
        """Start a new store (:attr:`_reopen`) on a starter thread; False when that thread cannot start."""
        assert self._reopen is not None
        reopen = self._reopen
        outcome: list[object] = []
        lock = threading.Lock()
        abandoned = [False]

        def start() -> None:
            with lock:
                if abandoned[0]:   # given up before this thread ran (restart()): it starts nothing
                    return
            got: object
            try:
                got = reopen()
            except BaseException as exc:   # noqa: BLE001 - handed to the owner's next restart() call
                got = exc
            with lock:
                if not abandoned[0]:
                    outcome.append(got)
                    return
            if not isinstance(got, BaseException):   # nobody will adopt it: its child and path go
                got.close()   # type: ignore[attr-defined]

        def abandon() -> bool:
            """The owner gives up on the start (False: it has just ended, adopt it)."""
            with lock:
                abandoned[0] = not outcome
                return abandoned[0]

        starter = threading.Thread(target=start, name="tiered-kv-disk-restart", daemon=True)
        # recorded first: an interrupt as start() returns (or in its wait for the thread) leaves a thread that runs,
        # which restart() adopts or abandons; one that never started is started again (restart())
        self._starting = (starter, outcome, abandon)
        try:
            starter.start()
        except RuntimeError:   # can't start new thread
            self._starting = None
            return False
        return True

    def _failed_start(self, now: float, why: str) -> None:
        """A start that failed: counted, tried again after the back-off."""
        self._backoff = min(RESTART_BACKOFF_MAX_S, max(RESTART_BACKOFF_MIN_S, 2 * self._backoff))
        self._retry_at = now + self._backoff
        self._on_error("io_process_restart_failed", why)

    # ------------------------------------------------------------------ spills
    def start_spills(self, entries: list[Entry], hindex: TierIndex, make_token: Callable[[], uuid.UUID],
                     view: Callable[[int], memoryview]) -> tuple[list[Entry], list[Entry], list[tuple[Entry, str]]]:
        """Queue the writes of READY host ``entries`` (host slot ``s``'s bytes are ``view(s)``) as one
        store request, each under a new token.

        Returns the host entries written, their new disk entries (the host slots pinned for the
        writes until their report is applied), and each entry shed with why (``"disk_down"``,
        ``"disk_full"``, ``"backpressure"``), nothing left held for those.  A key on disk
        already is neither.  The writer queue's room is asked first: reserving a disk entry may
        evict one, and a spill that is then shed must not have cost the tier a block.  While the
        writer's commits fail (the store is not ``healthy``) a spill takes a free slot only: one that
        would evict a readable block for a write that will likely fail too is shed (``"disk_down"``);
        the writer's next commit (the kept delete of an eviction, a tomb, a touch, a spill in a free
        slot, or the probe an idle unhealthy writer commits, ``Writer._probe``) makes it healthy again.
        """
        index, store = self.index, self.store
        hosts: list[Entry] = []
        disks: list[Entry] = []
        shed: list[tuple[Entry, str]] = []
        usable = self.usable and store.writer_alive()   # a writer (or I/O process) that died this step: down
        room = store.spill_room() if usable else 0
        over = "backpressure" if usable else "disk_down"   # why a spill past ``room`` is shed
        if usable and not store.healthy:
            free = index.num_slots - index.used_slots
            if free < room:
                room, over = free, "disk_down"
        keys = [e.key for e in entries]
        n = len(keys)
        if (usable and index.admission is None and index.plain_lru and n > 1 and index.none_of(keys)
                and len(set(keys)) == n):
            # the step's new blocks (write-through): reserved together, the outcome of the loop below (the
            # default policy: past a key without a slot, the loop finds none and changes nothing)
            take = keys[:max(0, room)]
            disks = index.reserve_each(take, [make_token() for _ in take])
            hosts = entries[:len(disks)]
            why = "disk_full" if len(disks) < len(take) else over   # past a failed reservation all fail
            shed = [(e, why) for e in entries[len(disks):]]
        else:
            hosts, disks, shed = self._reserve_one_by_one(entries, over, room, make_token)
        if not hosts:
            return hosts, disks, shed
        hindex.pin_all(hosts)   # a copy to disk is no use: each stays where it is in the eviction order
        if not store.submit_spills([d.writer for d in disks], [e.key for e in hosts], [e.slot for e in hosts], view):
            for e, d in zip(hosts, disks):
                hindex.release(e)
                index.writer_done(d)
                index.abort(d)
                shed.append((e, "backpressure"))
            return [], [], shed
        return hosts, disks, shed

    def _reserve_one_by_one(self, entries: list[Entry], over: str, room: int, make_token: Callable[[], uuid.UUID]
                            ) -> tuple[list[Entry], list[Entry], list[tuple[Entry, str]]]:
        """:meth:`start_spills`' reservations key by key: a key on disk already passed over, the writer
        queue's room asked first (past it a spill is shed as ``over``), then the admission filter, then a slot."""
        index = self.index
        hosts: list[Entry] = []
        disks: list[Entry] = []
        shed: list[tuple[Entry, str]] = []
        for e in entries:
            if e.key in index:
                continue
            if room <= 0:
                shed.append((e, over))
                continue
            if not index.admits(e.key):
                continue   # not written (SSD wear): counted in index.refused, not shed
            d = index.reserve(e.key, make_token())
            if d is None:
                shed.append((e, "disk_full"))
                continue
            hosts.append(e)
            disks.append(d)
            room -= 1
        return hosts, disks, shed

    # ------------------------------------------------------------------ promotes
    def promote_reported(self, hindex: TierIndex, entry: Entry, d: Optional[Entry], r: Report) -> None:
        """A live promote's report, its state; safe to run again: the host entry is published, or dropped with
        the disk entry ``d`` forgotten when the read failed (``d`` None: let go already, by a pass before).  A
        read that never reached the disk (its I/O process died, or its read transaction could not begin) keeps
        the disk entry: the block is still there."""
        if r.ok:
            hindex.publish(entry)
            return
        hindex.writer_done(entry)
        hindex.abort(entry)
        # gone, superseded or bad on disk (the reader already queued the removal of a corrupt entry); told first,
        # as in _adopt: a pass run again may tell a key twice, never lose one
        if d is not None and d.live and not (r.error or "").startswith(NOT_READ):
            self.on_gone(d)
            self.index.remove(d)

    def promote_applied(self, key: bytes, r: Report) -> None:
        """A live promote's report, once: counted, and the disk entry's recency kept."""
        m = self._metrics
        if r.ok:
            m.moved(JobKind.PROMOTE, ("disk", "host"), r.nbytes, r.seconds)
            self.store.submit_touch(key)
        else:
            m.count(m.job_outcome[(JobKind.PROMOTE, "failed")])

    # ------------------------------------------------------------------ removal
    def forget(self, d: Entry) -> None:
        """Drop ``d`` from the index and tombstone its write (the key was invalidated)."""
        self.index.remove(d)
        self.store.cancel(d.writer, d.key)

    def _evicted(self, d: Entry, then: Callable[[Entry], None]) -> None:
        m = self._metrics
        m.count(m.evicted["disk"])
        self.store.submit_delete(d.writer, d.key)
        then(d)

    # ------------------------------------------------------------------ health and gauges
    def check_writer(self, closing: bool) -> None:
        """Stop accepting spills once the writer is gone (reads still work); not for a dead I/O process,
        which :meth:`restart` replaces once its answers are in."""
        if self.usable and not closing and not getattr(self.store, "dead", False) and not self.store.writer_alive():
            log.error("disk writer is gone; the disk tier no longer accepts spills")
            self.usable = False

    def count_page_cache_reads(self) -> None:
        """Add the owner's page-cache reads (``disk/cached.py``) since the last call to
        ``tiered_kv_disk_page_cache_reads_total`` (once per step; a restarted store counts from zero)."""
        c = getattr(self.store, "cached", None)   # (test doubles of a store may have none)
        if c is None:
            return
        was, served, passed = self._reads_seen
        if was is not c:
            served = passed = 0
        if c.served != served or c.passed != passed:
            m = self._metrics
            m.count(m.page_cache["served"], c.served - served)
            m.count(m.page_cache["handed_on"], c.passed - passed)
        self._reads_seen = (c, c.served, c.passed)

    def levels(self, row_bytes: int) -> tuple[int, int, int, int, int, int]:
        """The gauge values for :meth:`Metrics.publish_levels`."""
        s = self.store
        return (self.index.used_slots * row_bytes, len(self.index), s.queue_depth, s.tombstones, s.map_size,
                1 if s.healthy and self.usable else 0)
