"""The disk tier's I/O side: a slot file and its LMDB index, one writer thread, reader threads.

:class:`DiskStore` owns every LMDB transaction of its path; the manager owns
the policy (which keys live on disk, leases, LRU, capacity) and talks to the
store only through messages, exactly like the copy movers:

* ``submit_spill`` / ``submit_tomb`` / ``submit_delete`` / ``submit_touch`` /
  ``submit_flush`` queue an op for the writer thread and never block.  Spill
  ops are bounded (``writer_queue_blocks``): a full queue sheds the spill.
* ``submit_promote`` queues a read for a reader thread; ``queue_promote``
  holds it in the caller's thread until ``start_reads`` hands everything held
  over as batches (the manager's ``load()`` holds, its ``poll()`` hands over:
  no reader is woken inside the engine's call, and a reader sees the step's
  reads at once).  A reader takes the
  reads queued behind the first (up to ``read_batch_bytes``), looks them up
  in one read transaction and reads them in file order, runs of neighbouring
  slots by one ``preadv``: the kernel's readahead then sees a stream.  A read that finds
  the entry corrupt, or fails with an I/O error, also queues its removal
  (re-verified, resp. token-matched, by the writer): the owner only forgets
  the key.
* Each op is answered by one :class:`~tiered_kv.movers.Report` (spills,
  promotes) or :class:`FlushDone` on the manager's completion queue.

Layout: payloads live in fixed-size slots of one preallocated data file
(``slots.tkv``, grown in chunks up to the capacity); LMDB holds, per key, the
entry header (namespace, key, token, length, checksum) and the slot number
(:mod:`tiered_kv.diskformat`).  A batch is written in three steps: payloads
into free slots (``pwritev`` straight from the host slots, no staging copy),
``fdatasync`` of the data file, then one LMDB transaction publishing the
index records.  A crash before the commit leaves bytes in free slots that
nothing references.

Slot invariants:

* a slot is referenced by at most one committed entry; it is handed to a new
  write only after the transaction that dropped its old entry is durable
  (``durability="batch"``: one commit later, like LMDB's own page reuse), so
  after a crash no committed entry points at bytes of another write;
* a slot whose write was cancelled or failed before publication is free at
  once (nothing committed ever referenced it);
* a reader that finds a slot's bytes changed under it (the entry was dropped
  and the slot reused meanwhile) reports a miss, not corruption: it re-reads
  the index before blaming the bytes.

Writer invariants:

* Before each ``put`` the writer checks, inside the same write transaction,
  that the spill's token is neither cancelled in memory nor tombstoned in the
  ``tombs`` sub-database; a cancelled write is never published.
* A tomb op deletes the committed entry of its key only if the stored writer
  token matches (never a newer write of the same key); if the guarded write
  has not been processed yet, the tomb is made durable in ``tombs`` and is
  garbage-collected when that write is prevented.
* On open, recovery purges every entry written under a tombstoned token and
  drops tombs whose write can no longer arrive, before the first read.

LMDB rules followed (py-lmdb): the map is grown only with no transaction
active in this process (readers hold a shared lock, the writer an exclusive
one); ``writemap`` is never used, so a full disk is an error and not SIGBUS;
a data file shorter than the environment's last page is refused at open.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import errno
import fcntl
import heapq
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import lmdb

from .diskformat import (FORMAT_VERSION, HEADER_SIZE, SLOTS_NAME, CorruptEntry, EntryHeader, lmdb_key,
                         pack_slot_entry, parse_header, slot_bytes_for, verify_entry)
from .errors import DiskInUseError, DiskTierError
from .jobs import JobKind
from .movers import CompletionQueue, Report

__all__ = ["DiskStore", "DiskOptions", "FlushDone", "RecoveryReport", "StoredEntry", "writable_view",
           "init_meta", "LOCK_NAME", "SUBDBS", "MAX_DBS", "MIN_MAP"]

log = logging.getLogger(__name__)

LOCK_NAME = "tiered_kv.lock"
SUBDBS = ("meta", "blocks", "tombs", "touch")  # the named sub-databases of an environment
MAX_DBS = len(SUBDBS)
MIN_MAP = 64 << 20
_WRITEBACK_CHUNK = 2 << 20   # bytes written between two sync_file_range(WRITE) calls (2 MiB blocks: each)
_U64 = struct.Struct("<Q")
_IDLE_WAKE_S = 1.0      # an idle writer looks for queued touches (which wake no one) this often
_READ_BATCH_MAX = 256   # reads a disk reader takes at once, at most
_CORRUPT, _READ_FAILED = "miss: corrupt", "miss: read failed"   # promote report errors the reader acts on
SPILL_PREVENTED = "cancelled before publish"   # a spill report's error: stopped by a tomb, not a fault
_CLOSE_RETRIES = 3  # attempts left to the kept ops of a failed batch once close() has begun


@dataclass(frozen=True)
class DiskOptions:
    path: Path
    namespace: str
    block_bytes: int
    capacity_bytes: int
    durability: str = "batch"
    map_size_bytes: int = 0
    queue_blocks: int = 256
    batch_blocks: int = 64
    batch_bytes: int = 64 << 20
    batch_seconds: float = 0.005
    num_readers: int = 2
    slots: int = 0             # slots in the data file (0: capacity_bytes // block_bytes)
    hash_offload_bytes: int = 1 << 20  # a batch with this many payload bytes is checksummed on a helper thread
    read_batch_bytes: int = 64 << 20   # a reader takes queued reads up to this many bytes (256 reads), in file order
    read_run_bytes: int = 4 << 20      # neighbouring slots read by one preadv, at most
    read_first_run_slots: int = 1      # a batch's first run, in slots (0: as long as any run); see _read_many


@dataclass(frozen=True)
class FlushDone:
    token: uuid.UUID
    ok: bool
    error: Optional[str] = None


@dataclass(frozen=True)
class StoredEntry:
    key: bytes
    token: uuid.UUID
    length: int
    seq: int


@dataclass
class RecoveryReport:
    seconds: float = 0.0
    entries: int = 0
    purged: int = 0            # entries written under a tombstoned token
    corrupt: int = 0           # unparsable headers, slots past the file's end, a slot claimed twice (removed)
    foreign: int = 0           # entries of another namespace/length (removed)
    slots_free: int = 0        # free slots of the data file after recovery
    tombs_dropped: int = 0     # tombstones garbage-collected
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def writable_view(t: Any) -> memoryview:
    """A writable byte memoryview over a contiguous CPU tensor's storage (no numpy needed)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class SlotsExhausted(Exception):
    """No free slot in the data file (the owner's accounting should make this impossible)."""


def init_meta(txn: Any, meta_db: Any, namespace: bytes, block_bytes: int) -> None:
    """The meta records of a fresh environment (DiskStore and ``tiered-kv import`` alike)."""
    txn.put(b"format_version", str(FORMAT_VERSION).encode(), db=meta_db)
    txn.put(b"namespace", namespace, db=meta_db)
    txn.put(b"block_bytes", str(block_bytes).encode(), db=meta_db)
    txn.put(b"created", str(time.time()).encode(), db=meta_db)


class _RWLock:
    """Many readers or one exclusive holder (the writer growing the map)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._readers += 1

    def release_shared(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._cond:
            self._waiting += 1
            while self._exclusive or self._readers:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()


# ---- ops -------------------------------------------------------------------
@dataclass
class _Spill:
    token: uuid.UUID
    key: bytes
    src: memoryview
    nbytes: int
    slot: int = -1         # the data-file slot holding the payload (writer thread)
    seq: int = 0           # the entry's sequence number (writer thread)
    entry: bytes = b""     # the index record to publish


@dataclass
class _Tomb:
    token: uuid.UUID
    key: bytes


@dataclass
class _Delete:
    token: uuid.UUID
    key: bytes
    unparseable_too: bool = False   # a reader's removal of a corrupt read: a record with no header is dropped


@dataclass
class _Touch:
    key: bytes


@dataclass
class _Flush:
    token: uuid.UUID
    failures_before: int = 0


@dataclass
class _Promote:
    token: uuid.UUID
    key: bytes
    expect: uuid.UUID
    dst: memoryview


class DiskStore:
    """One LMDB environment per path, held exclusively by one store (file lock)."""

    def __init__(self, opts: DiskOptions, completions: CompletionQueue,
                 on_error: Callable[[str, str], None] = lambda kind, msg: None,
                 on_prevented: Callable[[], None] = lambda: None,
                 on_corrupt: Callable[[str], None] = lambda reason: None) -> None:
        self.opts = opts
        self._out = completions
        self._on_error = on_error
        self._on_prevented = on_prevented
        self._on_corrupt = on_corrupt
        self._ns = opts.namespace.encode()
        self._lock_fd = -1
        self._env: Optional[lmdb.Environment] = None
        self._closed = False
        self._accepting = True
        self.healthy = True
        self._rw = _RWLock()
        self._cond = threading.Condition(threading.Lock())
        self._ops: collections.deque[Any] = collections.deque()
        self._spills_queued = 0
        self._filling = False   # the writer holds a partial batch and sleeps until its deadline (under _cond)
        self._fill = [0, 0]     # ... of this many ops and spill bytes
        self._cancelled: set[uuid.UUID] = set()
        self._unsettled: set[uuid.UUID] = set()  # spills queued and not yet committed, prevented or failed
        self._cancel_lock = threading.Lock()
        self._reads: "queue.SimpleQueue[Union[_Promote, list[_Promote], None]]" = queue.SimpleQueue()
        self._held_reads: list[_Promote] = []   # queue_promote(): handed to the readers by start_reads()
        self._seq = 0
        self.tombstones = 0
        self.map_size = 0
        self.recovery = RecoveryReport()
        self.entries: list[StoredEntry] = []
        self.writer_error: Optional[BaseException] = None
        self._batch: list[Any] = []
        self._dirty = False
        self._slot_bytes = slot_bytes_for(opts.block_bytes)
        self._sfd = -1                             # the slot file
        self._slot_lock = threading.Lock()
        self._free_slots: list[int] = []           # heap: lowest first, so a fresh file fills front to back
        self._slots_len = 0                        # slots the file holds (allocated on disk)
        self._slots_max = 0                        # the file grows up to this many
        self._freed_unsynced: list[tuple[int, int]] = []  # (txn id, slot) dropped by a commit not yet durable
        self._start_writeback = _libc_sync_file_range() or (lambda fd, off, n: None)
        self._wb_lo, self._wb_hi, self._wb_bytes = 1 << 62, 0, 0   # written, writeback not started yet
        self._hash_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # see _hasher()
        self._failures = 0        # failed batches so far (a flush after one answers False)
        self._close_failures = 0  # failed batches since close() began
        self._sync_failed = False
        self._backoff = 0.0
        self.fault_hook: Optional[Callable[[str], None]] = None  # tests: raise inside the writer at a named point
        self._open()
        self._writer = threading.Thread(target=self._writer_main, name="tiered-kv-disk-writer", daemon=True)
        self._writer.start()
        self._readers = [threading.Thread(target=self._reader_main, name="tiered-kv-disk-reader", daemon=True)
                         for _ in range(opts.num_readers)]
        for t in self._readers:
            t.start()

    # ------------------------------------------------------------ open
    def _open(self) -> None:
        o = self.opts
        try:
            o.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DiskTierError(f"disk_path {str(o.path)!r} cannot be created: {exc}") from exc
        if not os.access(o.path, os.W_OK):
            raise DiskTierError(f"disk_path {str(o.path)!r} is not writable")
        try:
            fd = os.open(o.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DiskTierError(f"disk_path {str(o.path)!r}: cannot open lock file: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DiskInUseError(f"disk_path {str(o.path)!r} is in use by another TierManager (pid {holder}); "
                                f"one manager per path") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        try:
            self._open_env()
            self._open_slots()
            self._recover()
        except lmdb.Error as exc:
            self._release_env()
            raise DiskTierError(f"disk_path {str(o.path)!r} is damaged: {exc}") from exc
        except BaseException:
            self._release_env()
            raise

    def _open_env(self) -> None:
        o = self.opts
        data = o.path / "data.mdb"
        existing = data.exists()
        # the map holds only index records (the payloads are in the slot file) and imported inline entries
        want = o.map_size_bytes or max(MIN_MAP, 4096 * self._target_slots())
        if existing:
            size = data.stat().st_size
            if size == 0:
                raise DiskTierError(f"disk_path {str(o.path)!r}: data.mdb is empty (truncated); "
                                    f"remove the directory to start afresh")
            want = max(want, size)
        sync = o.durability != "none"
        metasync = o.durability == "sync"
        try:
            env = lmdb.open(str(o.path), map_size=want, subdir=True, max_dbs=MAX_DBS, sync=sync, metasync=metasync,
                            writemap=False, map_async=False, readahead=True, meminit=False,
                            max_readers=max(126, 4 * o.num_readers + 8), lock=True)
        except lmdb.Error as exc:
            raise DiskTierError(f"disk_path {str(o.path)!r} is not a usable LMDB environment: {exc}") from exc
        self._env = env
        self._reader_check()
        info, stat = env.info(), env.stat()
        need = (info["last_pgno"] + 1) * stat["psize"]
        if existing and data.stat().st_size < need:
            raise DiskTierError(f"disk_path {str(o.path)!r}: data.mdb is truncated "
                                f"({data.stat().st_size} bytes < {need} in use)")
        self.map_size = info["map_size"]
        self._meta = env.open_db(b"meta")
        self._blocks = env.open_db(b"blocks")
        self._tombs = env.open_db(b"tombs")
        self._touch = env.open_db(b"touch")
        with env.begin(write=True) as txn:
            ver = txn.get(b"format_version", db=self._meta)
            if ver is None and txn.stat(self._blocks)["entries"] == 0:
                init_meta(txn, self._meta, self._ns, o.block_bytes)
                return
            if ver != str(FORMAT_VERSION).encode():
                raise DiskTierError(f"disk_path {str(o.path)!r} has format version {ver!r}, this is {FORMAT_VERSION}")
            ns = txn.get(b"namespace", db=self._meta)
            if ns != self._ns:
                raise DiskTierError(f"disk_path {str(o.path)!r} belongs to namespace {ns!r}, not {self._ns!r}")
            bb = txn.get(b"block_bytes", db=self._meta)
            if bb != str(o.block_bytes).encode():
                raise DiskTierError(f"disk_path {str(o.path)!r} holds blocks of {bb!r} bytes, not {o.block_bytes}")

    def _target_slots(self) -> int:
        return max(1, self.opts.slots or self.opts.capacity_bytes // self.opts.block_bytes)

    def _open_slots(self) -> None:
        p = self.opts.path / SLOTS_NAME
        try:
            self._sfd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DiskTierError(f"disk_path {str(self.opts.path)!r}: cannot open {SLOTS_NAME}: {exc}") from exc
        # a slot cut short (a truncated file) still counts: an entry in it may have survived recovery
        self._slots_len = -(-os.fstat(self._sfd).st_size // self._slot_bytes)
        # a file longer than the configured capacity (it shrank) keeps its slots until compacted
        self._slots_max = max(self._target_slots(), self._slots_len)

    def _recover(self) -> None:
        """Purge writes under tombstoned tokens, drop dead tombs, index what remains."""
        t0 = time.perf_counter()
        rep = RecoveryReport()
        env = self._env
        assert env is not None
        entries: dict[bytes, StoredEntry] = {}
        owner: dict[int, tuple[bytes, int]] = {}  # slot -> (LMDB key, seq) of the entry using it
        file_bytes = os.fstat(self._sfd).st_size
        with env.begin(write=True, buffers=True) as txn:
            tombs = {bytes(k): bytes(v) for k, v in txn.cursor(db=self._tombs)}
            dead: list[bytes] = []
            cur = txn.cursor(db=self._blocks)
            for lk, v in cur:
                lk = bytes(lk)
                try:
                    h = parse_header(v)
                except CorruptEntry:
                    rep.corrupt += 1
                    dead.append(lk)
                    continue
                if h.namespace != self._ns or h.length != self.opts.block_bytes or lmdb_key(h.key) != lk:
                    rep.foreign += 1
                    dead.append(lk)
                    continue
                if h.token.bytes in tombs:
                    rep.purged += 1
                    dead.append(lk)
                    continue
                if h.in_slot:
                    if h.slot * self._slot_bytes + h.length > file_bytes:
                        rep.corrupt += 1   # the slot file was truncated under it
                        dead.append(lk)
                        continue
                    prev = owner.get(h.slot)
                    if prev is not None:
                        # two entries on one slot (only a lost commit could do that): the older one's
                        # bytes were overwritten, so it goes; the checksum still guards the newer one
                        rep.corrupt += 1
                        loser = prev[0] if prev[1] < h.seq else lk
                        dead.append(loser)
                        entries.pop(loser, None)
                        if loser == lk:
                            continue
                    owner[h.slot] = (lk, h.seq)
                entries[lk] = StoredEntry(h.key, h.token, h.length, h.seq)
                self._seq = max(self._seq, h.seq)
            for lk in dead:
                txn.delete(lk, db=self._blocks)
            for tk in tombs:
                txn.delete(tk, db=self._tombs)
            rep.tombs_dropped = len(tombs)
            # recency: a promote's touch may be newer than the write
            touched = {}
            for k, v in txn.cursor(db=self._touch):
                k = bytes(k)
                touched[k] = _U64.unpack(bytes(v))[0] if len(v) == _U64.size else None
            for k, seq in touched.items():
                e = entries.get(k)
                if seq is None:   # a damaged touch record: it only ever held recency, so it is dropped
                    txn.delete(k, db=self._touch)
                    continue
                if e is None:
                    txn.delete(k, db=self._touch)
                elif seq > e.seq:
                    entries[k] = StoredEntry(e.key, e.token, e.length, seq)
                self._seq = max(self._seq, seq)
            rep.entries = len(entries)
            self._free_slots = [i for i in range(self._slots_len) if i not in owner]
            heapq.heapify(self._free_slots)
            rep.slots_free = len(self._free_slots) + self._slots_max - self._slots_len
            rep.seconds = time.perf_counter() - t0
            txn.put(b"last_recovery", json.dumps(rep.as_dict()).encode(), db=self._meta)
        if self.opts.durability != "none":
            env.sync(True)
        self.entries = sorted(entries.values(), key=lambda e: e.seq)
        self.recovery = rep
        log.info("disk tier %s recovered in %.3f s: %d entries, %d purged under tombstones, %d corrupt, "
                 "%d foreign, %d tombstones dropped", self.opts.path, rep.seconds, rep.entries, rep.purged,
                 rep.corrupt, rep.foreign, rep.tombs_dropped)

    # ------------------------------------------------------------ owner-side API (never blocks on I/O)
    def submit_spill(self, token: uuid.UUID, key: bytes, src: memoryview) -> bool:
        """Queue a write of ``src`` (a leased host slot) under ``key``; False when the queue is full."""
        with self._cond:
            if not self._accepting or self._spills_queued >= self.opts.queue_blocks:
                return False
            op = _Spill(token, key, src, len(src))
            self._ops.append(op)
            self._spills_queued += 1
            with self._cancel_lock:
                self._unsettled.add(token)
            self._wake_writer(op)
        return True

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        """Cancel the spill ``token``: never published; removed if it already was (token must match)."""
        with self._cancel_lock:
            self._cancelled.add(token)
        self._push(_Tomb(token, key), front=True)

    def submit_delete(self, token: uuid.UUID, key: bytes) -> None:
        """Remove ``key``'s committed entry if it was written by ``token`` (eviction, invalidation)."""
        self._push(_Delete(token, key), front=True)

    def submit_touch(self, key: bytes) -> None:
        self._push(_Touch(key))

    def submit_flush(self, token: uuid.UUID) -> None:
        self._push(_Flush(token, self._failures))

    def submit_promote(self, token: uuid.UUID, key: bytes, expect: uuid.UUID, dst: memoryview) -> None:
        """Queue a read for a reader thread now (wakes one if it waits)."""
        self._reads.put(_Promote(token, key, expect, dst))

    def queue_promote(self, token: uuid.UUID, key: bytes, expect: uuid.UUID, dst: memoryview) -> None:
        """Hold a read in the caller's thread until :meth:`start_reads` (a list append: no lock, no wake-up)."""
        self._held_reads.append(_Promote(token, key, expect, dst))

    def start_reads(self) -> None:
        """Hand the reads held by :meth:`queue_promote` to the readers, in batches of what one reader
        takes at once: one queue item (at most one wake-up) per batch, and the reader that takes it
        sees the whole batch, so it reads in file order from the start."""
        held = self._held_reads
        if not held:
            return
        self._held_reads = []
        limit = self._read_limit()
        for i in range(0, len(held), limit):
            self._reads.put(held[i:i + limit])

    def _read_limit(self) -> int:
        return max(1, min(_READ_BATCH_MAX, self.opts.read_batch_bytes // self.opts.block_bytes))

    @property
    def queue_depth(self) -> int:
        return self._spills_queued

    def spill_room(self) -> bool:
        """Whether :meth:`submit_spill` would take a spill now.  Asked by the owner before it makes room
        on disk for one: only the owner adds spills, so the room seen here can only grow until its
        ``submit_spill`` (unless the writer dies meanwhile)."""
        return self._accepting and self._spills_queued < self.opts.queue_blocks

    def writer_alive(self) -> bool:
        return self._writer.is_alive()

    def file_bytes(self) -> int:
        """Size of LMDB's data.mdb (the index)."""
        try:
            return (self.opts.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    def slot_file_bytes(self) -> int:
        try:
            return os.fstat(self._sfd).st_size if self._sfd >= 0 else 0
        except OSError:
            return 0

    def disk_bytes(self) -> int:
        """What the tier takes on disk: the slot file and the index."""
        return self.file_bytes() + self.slot_file_bytes()

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def write_tombstone(self, token: uuid.UUID, key: bytes) -> bool:
        """Durably tombstone ``token`` from any thread or process (its own write transaction).

        Removes the committed entry if ``token`` wrote it, otherwise records the
        tomb so that a pending write under ``token`` is never published.
        Returns True if an entry was removed.
        """
        assert self._env is not None
        frees: list[int] = []
        undo: list[tuple[set[uuid.UUID], uuid.UUID]] = []
        self._rw.acquire_shared()
        try:
            with self._env.begin(write=True) as txn:
                removed = self._apply_tomb(txn, token, key, frees, undo=undo)
            txn_id = self._env.info()["last_txnid"]   # >= this commit's (another may have followed)
        except BaseException:
            self._undo(undo)
            raise
        finally:
            self._rw.release_shared()
        self._slots_dropped(frees, txn_id)
        return removed

    def close(self) -> None:
        """Finish queued ops, sync, stop threads, release the path.  Idempotent."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        # the writer drains what is queued, then stops; ops pushed after this are refused;
        # readers finish the reads queued before their stop sentinel (held ones included)
        self.start_reads()
        for _ in self._readers:
            self._reads.put(None)
        self._writer.join()
        self._accepting = False
        for t in self._readers:
            t.join()
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
        self._release_env()

    def _release_env(self) -> None:
        if self._env is not None:
            try:
                if self.opts.durability != "none":
                    self._env.sync(True)
            except lmdb.Error:
                pass
            self._env.close()
            self._env = None
        if self._sfd >= 0:
            os.close(self._sfd)
            self._sfd = -1
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------ writer thread
    def _push(self, op: Any, front: bool = False) -> None:
        with self._cond:
            if not self._accepting:
                if isinstance(op, _Flush):  # answer at once: nothing will commit any more
                    self._out.put(FlushDone(op.token, False, "disk writer is gone"))
                return
            (self._ops.appendleft if front else self._ops.append)(op)
            self._wake_writer(op)

    def _wake_writer(self, op: Any) -> None:
        """Under ``_cond``, after queueing ``op``: wake the writer if it waits for work, or if it is
        filling a batch and this op completes one (or is a flush).  A writer filling a batch otherwise
        sleeps on to the batch deadline: one wake-up per op (a thread switch and a GIL hand-off each,
        on the engine's cores) bought nothing, since the batch would not leave before the deadline.

        A recency touch (one per promote) wakes no one: it leaves with the writer's next batch, which
        the next other op or the idle wake-up (every ``_IDLE_WAKE_S``) starts.  Waking the writer for
        each promote burst ran its commits beside the readers and the owner's copies (warm promote,
        256 KiB: 7-19% GB/s).  A touch is recency for the next restart: a crash loses the touches
        still queued (about a second's worth at most) on top of what the durability level loses,
        and those entries then rank by their write sequence."""
        kind = type(op)
        if kind is _Touch:
            return
        o = self.opts
        if not self._filling or kind is _Flush or self._fill[0] + len(self._ops) >= o.batch_blocks \
                or self._fill[1] + self._spills_queued * o.block_bytes >= o.batch_bytes:
            self._cond.notify()

    def _take_batch(self) -> Optional[list[Any]]:
        o = self.opts
        with self._cond:
            while not self._ops:
                if self._closed:
                    return None
                self._cond.wait(timeout=0.5 if self._dirty else _IDLE_WAKE_S)
                if not self._ops and self._dirty:
                    return []  # idle: time to sync a batch-mode commit
            batch: list[Any] = []
            nbytes = 0
            deadline = time.monotonic() + o.batch_seconds
            self._filling = True
            try:
                while True:
                    while self._ops and len(batch) < o.batch_blocks and nbytes < o.batch_bytes:
                        op = self._ops.popleft()
                        if isinstance(op, _Spill):
                            self._spills_queued -= 1
                            nbytes += op.nbytes
                        batch.append(op)
                        if isinstance(op, _Flush):
                            return batch
                    self._fill[0], self._fill[1] = len(batch), nbytes
                    if len(batch) >= o.batch_blocks or nbytes >= o.batch_bytes or self._closed:
                        return batch
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return batch
                    self._cond.wait(timeout=left)
            finally:
                self._filling = False

    def _writer_main(self) -> None:
        try:
            while True:
                batch = self._take_batch()
                if batch is None:
                    break
                if not batch:
                    self._sync()
                    continue
                self._batch = batch
                self._run_batch(batch)
                self._batch = []
            self._sync()
        except BaseException as exc:  # the writer is dying: answer everything queued
            self.writer_error = exc
            self.healthy = False
            log.exception("disk writer thread died")
            self._on_error("writer_died", repr(exc))
            with self._cond:
                rest = self._batch + list(self._ops)
                self._batch = []
                self._ops.clear()
                self._spills_queued = 0
                self._accepting = False  # no further ops: they could never be answered
            self._fail_ops(rest, f"disk writer died: {exc!r}")
            if not isinstance(exc, Exception):
                raise

    def _run_batch(self, batch: list[Any]) -> None:
        """Commit ``batch`` in one transaction; on failure fail its spills and keep its control ops."""
        self._reader_check()
        for _attempt in range(4):
            try:
                self._grow_ahead(batch)
                results = self._commit(batch)
            except lmdb.MapFullError:
                try:
                    grown = self._grow(self._batch_bytes(batch))
                except Exception as exc:   # statvfs or set_mapsize failed: the batch fails, the writer goes on
                    self._batch_failed(batch, self._classify(exc), f"growing the LMDB map: {exc!r}")
                    return
                if grown:
                    continue
                self._batch_failed(batch, "map_full", "LMDB map full and the disk has no room to grow it")
                return
            except Exception as exc:  # an I/O error, or a bug: the batch fails, the writer carries on
                self._batch_failed(batch, self._classify(exc), repr(exc))
                return
            self._set_healthy()
            self._backoff = 0.0
            self._dirty = self.opts.durability == "batch"
            flushes = [op for op in batch if isinstance(op, _Flush)]
            if flushes:
                self._sync()
            for r in results:
                self._out.put(r)
            for f in flushes:
                ok = self._failures == f.failures_before and not self._sync_failed
                self._out.put(FlushDone(f.token, ok, None if ok else "a write covered by this flush failed"))
            return
        self._batch_failed(batch, "map_full", "LMDB map still full after growing")

    def _batch_failed(self, batch: list[Any], kind: str, msg: str) -> None:
        """Spills fail (they can be stored again); tombs, deletes and touches stay queued, in order.

        Flushes in the batch answer False.  The next attempt waits a little
        longer each time (up to 1 s) so a persistent fault does not spin.  Once
        the store is closing, the kept ops get ``_CLOSE_RETRIES`` more attempts
        and are then dropped (logged): a disk that fails every commit must not
        keep ``close()`` -- and the host process's shutdown -- waiting for ever.
        """
        self._degrade(kind, msg)
        self._failures += 1
        keep = [op for op in batch if isinstance(op, (_Tomb, _Delete, _Touch))]
        self._fail_ops([op for op in batch if not isinstance(op, (_Tomb, _Delete, _Touch))],
                       f"disk write failed ({kind}): {msg}")
        self._backoff = min(1.0, max(0.01, self._backoff * 2))
        dropped: list[Any] = []
        with self._cond:
            if self._closed:
                self._close_failures += 1
                if self._close_failures > _CLOSE_RETRIES:
                    dropped, keep = keep, []
            self._ops.extendleft(reversed(keep))
            if keep or not self._closed:
                self._cond.wait(timeout=self._backoff)
        if dropped:
            log.error("disk tier %s: closing after %d failed commits; dropped %d tomb/delete/touch op(s) that "
                      "could not be written (a tombstoned entry among them may be readable after reopen)",
                      self.opts.path, self._close_failures, len(dropped))

    def _reader_check(self) -> None:
        """Clear reader-table slots of processes that died inside a read transaction (a ``tiered-kv
        verify`` or ``export`` killed with SIGKILL): LMDB never ends such a transaction itself, and
        its snapshot would keep the writer from reusing any page freed after it -- data.mdb would
        grow with every commit until this process restarts.  A scan of the reader table and one
        lock probe per process in it: once per batch costs next to nothing beside its fdatasync."""
        env = self._env
        if env is None:
            return
        try:
            cleared = env.reader_check()
        except lmdb.Error as exc:
            self._on_error("lmdb_error", f"reader_check: {exc!r}")
            return
        if cleared:
            log.warning("disk tier %s: cleared %d reader slot(s) left by dead processes", self.opts.path, cleared)

    def _batch_bytes(self, batch: list[Any]) -> int:
        """The LMDB map space a batch's index records may take (payloads go to the slot file)."""
        return sum(HEADER_SIZE + len(self._ns) + len(op.key) + 1024 for op in batch if isinstance(op, _Spill))

    def _classify(self, exc: BaseException) -> str:
        kind = _error_kind(exc)
        if kind == "io_error":
            # LMDB reports a short write on a full disk as EIO: look at the free space
            try:
                if shutil.disk_usage(self.opts.path).free < 2 * self.opts.batch_bytes:
                    return "disk_full"
            except OSError:
                pass
        if isinstance(exc, SlotsExhausted):
            return "slots_exhausted"
        if kind == "lmdb_error" and not isinstance(exc, lmdb.Error):
            return "writer_error"
        return kind

    def _commit(self, batch: list[Any]) -> list[Report]:
        """Write ``batch``'s payloads into free slots, sync them, then publish in one transaction.

        Returns the reports to send once the transaction is committed.
        """
        env = self._env
        assert env is not None
        results: list[Report] = []
        t0 = time.perf_counter()
        if self.fault_hook is not None:
            self.fault_hook("commit")
        spills = [op for op in batch if isinstance(op, _Spill)]
        placed: list[int] = []      # slots taken by this batch, given back if it fails
        frees: list[int] = []       # slots of entries this transaction drops
        # the in-memory tomb state (_unsettled, _cancelled) this transaction changes, put back if it
        # aborts: a retry after MapFullError must see what the aborted attempt saw, or a spill that a
        # tomb prevented in the attempt would pass the tomb, now "settled", and be published
        undo: list[tuple[set[uuid.UUID], uuid.UUID]] = []
        prevented = 0
        hashing: Optional[concurrent.futures.Future[None]] = None
        try:
            todo: list[_Spill] = []
            for op in spills:
                op.slot = -1
                if self._is_cancelled(op.token):
                    continue        # never written; the transaction below answers it
                op.slot = self._alloc_slot()
                placed.append(op.slot)
                self._seq += 1
                op.seq = self._seq
                todo.append(op)
            # checksums and writes run in C without the GIL, straight from the leased host slots; a
            # large batch is checksummed on the hash thread while this one writes the same bytes
            # (the slots stay leased until the batch's reports, so both read what is published)
            if sum(op.nbytes for op in todo) >= self.opts.hash_offload_bytes:
                hashing = self._hasher().submit(self._pack_entries, todo)
            else:
                self._pack_entries(todo)
            for op in todo:
                self._pwrite(op.slot, op.src)
            if placed and self.opts.durability != "none":
                os.fdatasync(self._sfd)   # the bytes are durable before any index record points at them
                self._wb_lo, self._wb_hi, self._wb_bytes = 1 << 62, 0, 0
            if hashing is not None:
                h, hashing = hashing, None
                h.result()            # the index records, needed from here on
            unused: list[int] = []
            self._rw.acquire_shared()
            try:
                with env.begin(write=True, buffers=True) as txn:
                    for op in batch:
                        if isinstance(op, _Spill):
                            # settled from here on: a tomb later in this transaction finds the entry
                            # (and deletes it) or, if prevented, has nothing left to guard
                            self._discard(self._unsettled, op.token, undo)
                            if self._is_cancelled(op.token) or txn.get(op.token.bytes, db=self._tombs) is not None:
                                txn.delete(op.token.bytes, db=self._tombs)
                                self._discard(self._cancelled, op.token, undo)
                                if op.slot >= 0:
                                    unused.append(op.slot)
                                prevented += 1
                                results.append(Report(op.token, JobKind.SPILL, False, SPILL_PREVENTED,
                                                      copied=False))
                                continue
                            lk = lmdb_key(op.key)
                            old = txn.replace(lk, op.entry, db=self._blocks)
                            if old is not None:
                                self._note_dropped(old, frees)
                            txn.delete(lk, db=self._touch)
                            results.append(Report(op.token, JobKind.SPILL, True, None, op.nbytes, 0.0))
                        elif isinstance(op, _Tomb):
                            self._apply_tomb(txn, op.token, op.key, frees, from_queue=True, undo=undo)
                        elif isinstance(op, _Delete):
                            self._delete_if_token(txn, op.key, op.token, frees, op.unparseable_too)
                        elif isinstance(op, _Touch):
                            self._seq += 1
                            txn.put(lmdb_key(op.key), _U64.pack(self._seq), db=self._touch)
                    self.tombstones = txn.stat(self._tombs)["entries"]
            finally:
                self._rw.release_shared()
        except BaseException:
            if hashing is not None:   # let it stop reading the host slots before they are given up
                concurrent.futures.wait([hashing])
            self._give_back(placed)   # nothing committed references them
            self._undo(undo)
            raise
        self._give_back(unused)
        for _ in range(prevented):    # counted once committed: an aborted attempt prevented nothing
            self._on_prevented()
        # the last committed transaction, not this one's id: a transaction that changed nothing
        # commits nothing (no meta write, no sync), so it must not count as "a later commit"
        self._slots_dropped(frees, env.info()["last_txnid"])
        dt = time.perf_counter() - t0
        n = sum(1 for r in results if r.ok)
        for r in results:
            if r.ok:
                r.seconds = dt / n
        return results

    def _pack_entries(self, ops: list[_Spill]) -> None:
        """The index record (header + xxh3 of the payload + slot) of each op."""
        ns = self._ns
        for op in ops:
            op.entry = pack_slot_entry(ns, op.key, op.token, op.src, op.seq, op.slot)

    def _hasher(self) -> concurrent.futures.ThreadPoolExecutor:
        """The hash thread (started on first use by the writer; stopped by close())."""
        if self._hash_pool is None:
            self._hash_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiered-kv-hash")
        return self._hash_pool

    # ------------------------------------------------------------ slots
    def _alloc_slot(self) -> int:
        """The lowest free slot, growing the file by a chunk when none is free (writer thread)."""
        with self._slot_lock:
            if self._free_slots:
                return heapq.heappop(self._free_slots)
        self._grow_slots()
        with self._slot_lock:
            return heapq.heappop(self._free_slots)

    def _grow_slots(self) -> None:
        if self._slots_len >= self._slots_max:
            raise SlotsExhausted(f"all {self._slots_max} slots of {SLOTS_NAME} are in use")
        # chunks of >= 64 MiB (or what is left): few allocations, and the file stays as large as used
        chunk = min(self._slots_max - self._slots_len,
                    max(self.opts.batch_blocks, -(-(64 << 20) // self._slot_bytes)))
        start = self._slots_len
        try:
            os.posix_fallocate(self._sfd, start * self._slot_bytes, chunk * self._slot_bytes)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                # a filesystem without fallocate: a sparse file (a full disk then shows up as a write error)
                os.ftruncate(self._sfd, max(os.fstat(self._sfd).st_size, (start + chunk) * self._slot_bytes))
            elif exc.errno != errno.ENOSPC or chunk == 1:
                raise
            else:
                # a nearly full disk: take the one slot needed now (ENOSPC again fails the batch)
                chunk = 1
                os.posix_fallocate(self._sfd, start * self._slot_bytes, self._slot_bytes)
        with self._slot_lock:
            self._slots_len = start + chunk
            self._free_locked(list(range(start, start + chunk)))
        log.debug("disk tier: slot file grown to %d slots", self._slots_len)

    def _pwrite(self, slot: int, src: memoryview) -> None:
        off = slot * self._slot_bytes
        view = src
        while len(view):
            n = os.pwritev(self._sfd, [view], off)
            view = view[n:]
            off += n
        if self.opts.durability != "none":
            # start the writeback of what this batch wrote, every few MiB, so that the batch's
            # fdatasync finds most of it done (one call per slot costs more than it saves on small blocks)
            start = slot * self._slot_bytes
            self._wb_lo = min(self._wb_lo, start)
            self._wb_hi = max(self._wb_hi, start + len(src))
            self._wb_bytes += len(src)
            if self._wb_bytes >= _WRITEBACK_CHUNK:
                self._start_writeback(self._sfd, self._wb_lo, self._wb_hi - self._wb_lo)
                self._wb_lo, self._wb_hi, self._wb_bytes = 1 << 62, 0, 0

    def _give_back(self, slots: list[int]) -> None:
        """Slots no committed entry references: free at once."""
        if slots:
            with self._slot_lock:
                self._free_locked(slots)

    def _slots_dropped(self, slots: list[int], txn_id: int) -> None:
        """A commit dropped the entries of ``slots``; ``txn_id`` is the last committed transaction
        (that one or a later one).  Free the slots once it is durable.

        With ``durability="batch"`` a commit is durable once a later one is
        (LMDB syncs the meta page lazily: commit ``L``'s fdatasync covers meta
        page ``L-1``), so slots wait one real commit; the other modes free them
        at once ("sync": the commit is durable; "none": only a process crash is
        covered, and the page cache outlives it).
        """
        with self._slot_lock:
            if self.opts.durability != "batch":
                self._free_locked(slots)
                return
            self._free_durable_locked(txn_id - 1)   # a commit after theirs: those are durable now
            self._freed_unsynced.extend((txn_id, i) for i in slots)

    def _slots_synced(self, txn_id: int) -> None:
        """Every commit up to ``txn_id`` is durable (an explicit sync)."""
        with self._slot_lock:
            self._free_durable_locked(txn_id)

    def _free_durable_locked(self, txn_id: int) -> None:
        """Free the dropped slots whose commit is ``txn_id`` or older (``_slot_lock`` held)."""
        self._free_locked([i for t, i in self._freed_unsynced if t <= txn_id])
        self._freed_unsynced = [(t, i) for t, i in self._freed_unsynced if t > txn_id]

    def _free_locked(self, slots: list[int]) -> None:
        for i in slots:
            heapq.heappush(self._free_slots, i)

    @staticmethod
    def _note_dropped(value: Any, frees: list[int]) -> None:
        """An entry is being deleted or replaced: remember its slot (if it had a readable one)."""
        try:
            h = parse_header(value)
        except CorruptEntry:
            return
        if h.in_slot:
            frees.append(h.slot)

    @property
    def slots_in_use(self) -> int:
        with self._slot_lock:
            return self._slots_len - len(self._free_slots)

    def _apply_tomb(self, txn: Any, token: uuid.UUID, key: bytes, frees: list[int], from_queue: bool = False,
                    undo: Optional[list[tuple[set[uuid.UUID], uuid.UUID]]] = None) -> bool:
        """Inside ``txn``: delete ``key``'s entry if ``token`` wrote it, else keep the tomb durable unless
        nothing it guards can still come.  What it changes in memory is noted in ``undo``."""
        if self._delete_if_token(txn, key, token, frees):
            self._discard(self._cancelled, token, undo)
            return True
        with self._cancel_lock:
            settled = token not in self._unsettled
        if from_queue and settled:
            # this process's write under the token was committed and removed, prevented, or
            # failed: nothing it guards can still be published, so nothing is kept
            self._discard(self._cancelled, token, undo)
            return False
        # the guarded write may still come (queued here, or in another process): make the tomb durable
        txn.put(token.bytes, key, db=self._tombs)
        return False

    def _delete_if_token(self, txn: Any, key: bytes, token: uuid.UUID, frees: list[int],
                         unparseable_too: bool = False) -> bool:
        """Delete ``key``'s entry if ``token`` wrote it; True if it did.  ``unparseable_too``: also drop
        a record whose header cannot be parsed (no write of anyone's makes one), without counting it as
        the token's -- a tomb must not take it for the write it guards."""
        lk = lmdb_key(key)
        v = txn.get(lk, db=self._blocks)
        if v is None:
            return False
        try:
            h = parse_header(v)
        except CorruptEntry:
            if unparseable_too:
                txn.delete(lk, db=self._blocks)
                txn.delete(lk, db=self._touch)
            return False
        if h.token != token:
            return False
        if h.in_slot:
            frees.append(h.slot)
        txn.delete(lk, db=self._blocks)
        txn.delete(lk, db=self._touch)
        return True

    def _discard(self, s: set[uuid.UUID], token: uuid.UUID,
                 undo: Optional[list[tuple[set[uuid.UUID], uuid.UUID]]]) -> None:
        """Take ``token`` out of the tomb state set ``s``, noting it in ``undo`` (None: for good)."""
        with self._cancel_lock:
            if token in s:
                s.discard(token)
                if undo is not None:
                    undo.append((s, token))

    def _undo(self, undo: list[tuple[set[uuid.UUID], uuid.UUID]]) -> None:
        """A transaction aborted: its changes to the tomb state sets are put back (only the writer
        takes tokens out of them; the owner may have added some meanwhile, which stay)."""
        if undo:
            with self._cancel_lock:
                for s, token in undo:
                    s.add(token)
            undo.clear()

    def _is_cancelled(self, token: uuid.UUID) -> bool:
        with self._cancel_lock:
            return token in self._cancelled

    def _used_map_bytes(self) -> int:
        assert self._env is not None
        return (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]

    def _grow_ahead(self, batch: list[Any]) -> None:
        """Grow before MapFullError when the free map space is below twice what this batch writes."""
        need = self._batch_bytes(batch)
        if need and self.map_size - self._used_map_bytes() < 2 * need:
            self._grow(need)

    def _grow(self, need: int = 0) -> bool:
        """Grow the map (no transaction may be active); False if the disk lacks room."""
        env = self._env
        assert env is not None
        used = self._used_map_bytes()
        new = max(int(self.map_size * 1.5), used + 4 * need + 16 * (self.opts.block_bytes + 4096))
        free = shutil.disk_usage(self.opts.path).free
        file_bytes = self.file_bytes()
        if free < (new - file_bytes) // 4:
            # the file grows only as pages are written: ask for a quarter of the new room to be free now
            log.error("disk tier: cannot grow LMDB map to %d bytes, only %d free on the device", new, free)
            return False
        self._rw.acquire_exclusive()
        try:
            env.set_mapsize(new)
            self.map_size = env.info()["map_size"]
        finally:
            self._rw.release_exclusive()
        log.info("disk tier: LMDB map grown to %d bytes", self.map_size)
        return True

    def _sync(self) -> None:
        if self._env is None or self.opts.durability == "none" or not (self._dirty or self.opts.durability == "batch"):
            return
        try:
            txn_id = self._env.info()["last_txnid"]
            self._env.sync(True)
            self._slots_synced(txn_id)
            self._dirty = False
            self._sync_failed = False
        except lmdb.Error as exc:
            self._sync_failed = True
            self._degrade("sync_failed", repr(exc))

    def _settle(self, ops: list[Any]) -> None:
        """These spills failed: no write under their tokens can come any more."""
        with self._cancel_lock:
            for op in ops:
                if isinstance(op, _Spill):
                    self._unsettled.discard(op.token)

    def _fail_ops(self, ops: list[Any], error: str) -> None:
        # a cancelled spill's durable tomb committed before this failure stays until the next
        # recovery drops it (bounded by failed batches; it guards a write that never comes)
        self._settle(ops)
        for op in ops:
            if isinstance(op, _Spill):
                with self._cancel_lock:
                    self._cancelled.discard(op.token)
                self._out.put(Report(op.token, JobKind.SPILL, False, error, copied=False))
            elif isinstance(op, _Flush):
                self._out.put(FlushDone(op.token, False, error))

    def _degrade(self, kind: str, msg: str) -> None:
        self.healthy = False
        self._on_error(kind, msg)

    def _set_healthy(self) -> None:
        self.healthy = True

    # ------------------------------------------------------------ reader threads
    def _reader_main(self) -> None:
        while True:
            item = self._reads.get()
            if item is None:
                return
            ops, stop = self._take_queued(item)
            first = ops[0]
            answered: set[uuid.UUID] = set()
            try:
                # a lone read skips the batch machinery: 5-14 us less per read, same outcomes (ab_lone_read.py)
                for op, r in (self._read_many(ops) if len(ops) > 1 else [(first, self._read(first))]):
                    self._answer(op, r)
                    answered.add(op.token)
            except BaseException as exc:
                # a bug or an interrupt inside the read path: every read taken is still answered
                # once (failed, its entry removed like any unreadable one), and the reader goes on
                self._on_error("reader_error", repr(exc))
                for op in ops:
                    if op.token not in answered:
                        self._answer(op, Report(op.token, JobKind.PROMOTE, False, f"{_READ_FAILED} ({exc!r})",
                                                copied=False))
                if not isinstance(exc, Exception):
                    raise
            if stop:   # this reader's stop sentinel came up behind the reads it took
                return

    def _answer(self, op: _Promote, r: Report) -> None:
        if not r.ok and r.error is not None:
            # a bad entry stays out of the owner's index from now on: remove it here, where the
            # reason is known, so that it holds no slot outside the capacity count
            # token-matched (never a newer write of the key), and never re-read by the writer: the
            # owner has forgotten the entry, so one kept because a second read found it good would
            # hold a slot outside the capacity count, and a record whose length field is damaged
            # would fail every later batch when the writer tried to read that many bytes
            if r.error.startswith(_CORRUPT):
                self._push(_Delete(op.expect, op.key, unparseable_too=True))
            elif r.error.startswith(_READ_FAILED):
                self._push(_Delete(op.expect, op.key))      # only if still the write that was read
        self._out.put(r)

    def _take_queued(self, first: Union[_Promote, list[_Promote]]) -> tuple[list[_Promote], bool]:
        """``first`` (a read, or a batch from :meth:`start_reads`) and the reads queued behind it, up to
        ``read_batch_bytes`` and ``_READ_BATCH_MAX`` reads (small blocks: the batch's lookups come before
        its first read), a queued batch taken whole; True if a stop sentinel came."""
        ops = list(first) if isinstance(first, list) else [first]
        limit = self._read_limit()
        while len(ops) < limit:
            try:
                nxt = self._reads.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return ops, True
            if isinstance(nxt, list):
                ops += nxt
            else:
                ops.append(nxt)
        return ops, False

    def _read_many(self, ops: list[_Promote]) -> Iterator[tuple[_Promote, Report]]:
        """The reads of a batch: index records in one read transaction, slots in file order, runs of
        neighbouring slots in one ``preadv``; reports in file order, each run's as soon as it is verified.

        Why: a slot nobody read lately comes from the device, and slots are
        allocated in the writer's order, not the engine's.  In queue order the
        reads are a shuffle of block-sized synchronous requests; in file order
        on one descriptor the kernel's readahead sees a stream and keeps large
        requests in flight ahead of the reader.  One transaction and one read
        per run also take the GIL fewer times per block.  An LMDB error in the
        lookups, or an I/O error reading several slots at once, sends the reads
        concerned through :meth:`_read` one by one, which reports each its own
        way; a lone slot's I/O error is its read's answer.
        """
        n = self.opts.block_bytes
        sb = self._slot_bytes
        # a run's reports get the reader's time since the report before (the first: since the batch began,
        # its lookups included); an inline entry's, the time of its own lookup and copy
        t_last = time.perf_counter()
        todo: list[tuple[int, _Promote, bytes, EntryHeader]] = []   # (slot, op, index record, header)
        env = self._env
        if env is None:
            for op in ops:
                yield op, self._read(op)
            return
        done: list[tuple[_Promote, Report]] = []
        try:
            self._rw.acquire_shared()
            try:
                with env.begin(db=self._blocks, buffers=True) as txn:
                    for op in ops:
                        found = self._lookup(txn, op, time.perf_counter())
                        if isinstance(found, Report):
                            done.append((op, found))
                        else:
                            todo.append((found[1].slot, op, found[0], found[1]))
            finally:
                self._rw.release_shared()
        except lmdb.Error:
            for op in ops:
                yield op, self._read(op)
            return
        yield from done
        todo.sort(key=lambda x: x[0])
        pad = memoryview(bytearray(sb - n)) if sb > n else None
        most = max(1, min(1024 // 2, self.opts.read_run_bytes // sb))
        # The batch's first run is short (one slot by default).  The kernel serves a first request at a
        # new offset as a standalone read (what was asked, no readahead); only the request after it,
        # found sequential, opens the readahead window.  A short first read returns soonest and gets
        # that second request out (cold promote, 8 alternated pairs per round: 256 KiB +13/+20/+28%
        # GB/s in three rounds, 2 MiB +9/+17% in two).  The price, once per batch: when the first
        # stretch of neighbouring slots is short, that window reads up to ~4x a small request past it.
        first = min(most, self.opts.read_first_run_slots) or most
        runs: list[list[tuple[int, _Promote, bytes, EntryHeader]]] = []
        for x in todo:
            last = runs[-1] if runs else None
            if (last is not None and len(last) < (first if len(runs) == 1 else most) and x[0] == last[-1][0] + 1
                    and x[3].length == n and last[0][3].length == n):
                last.append(x)
            else:
                runs.append([x])
        for run in runs:
            if run[0][3].length != n:   # a record that says another length: corrupt without reading
                got = 0
            else:
                iov: list[memoryview] = []
                for k, (_, op, _, _) in enumerate(run):
                    if k and pad is not None:
                        iov.append(pad)
                    iov.append(op.dst)
                try:
                    got = os.preadv(self._sfd, iov, run[0][0] * sb)   # straight into the host slots, no GIL
                except OSError as exc:
                    if len(run) == 1:   # that was the read: it failed
                        yield run[0][1], self._read_failed(run[0][1], exc)
                    else:               # find which slots fail: each on its own
                        for _, op, _, _ in run:
                            yield op, self._read(op)
                    t_last = time.perf_counter()
                    continue
            # the run's reports leave together: the owner wakes once per run, not once per block
            answers = []
            for k, (_, op, value, h) in enumerate(run):
                answers.append((op, self._verify(op, value, max(0, min(n, got - k * sb)), t_last, h)))
                t_last = time.perf_counter()
            yield from answers

    def _lookup(self, txn: Any, op: _Promote, t0: float) -> Union[Report, tuple[bytes, EntryHeader]]:
        """Inside a read transaction: the read's answer (a Report), or its index record and header to read."""
        n = self.opts.block_bytes
        v = txn.get(lmdb_key(op.key))
        if v is None:
            return Report(op.token, JobKind.PROMOTE, False, "miss: absent", copied=False)
        try:
            h = parse_header(v)
            if not h.in_slot:   # an inline entry (imported): verify and copy under the txn
                h = verify_entry(v, self._ns, op.key, n)
                if h.token != op.expect:
                    return Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk", copied=False)
                op.dst[:] = v[h.payload_offset:h.payload_offset + n]
                return Report(op.token, JobKind.PROMOTE, True, None, n, time.perf_counter() - t0)
        except CorruptEntry as exc:
            self._on_corrupt(exc.reason)
            return Report(op.token, JobKind.PROMOTE, False, f"{_CORRUPT} ({exc})", copied=False)
        if h.token != op.expect:
            return Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk", copied=False)
        return bytes(v), h   # the index record (small); the payload is read outside the txn

    def _verify(self, op: _Promote, value: bytes, got: int, t0: float, h: EntryHeader) -> Report:
        """The answer for a slot read of ``got`` bytes into ``op.dst``, checked against its index record
        (``h``: the record's header, parsed by the lookup)."""
        n = self.opts.block_bytes
        try:
            verify_entry(value, self._ns, op.key, n, op.dst if got == n else op.dst[:got], h)
        except CorruptEntry as exc:
            try:
                changed = self._index_changed(lmdb_key(op.key), value)
            except lmdb.Error as lexc:
                return self._read_failed(op, lexc)
            if changed:
                # dropped and its slot reused while we read: the bytes are someone else's, not damaged
                return Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk", copied=False)
            self._on_corrupt(exc.reason)
            return Report(op.token, JobKind.PROMOTE, False, f"{_CORRUPT} ({exc})", copied=False)
        return Report(op.token, JobKind.PROMOTE, True, None, n, time.perf_counter() - t0)

    def _read(self, op: _Promote) -> Report:
        """One read on its own (a lone read, or where a batch gives up): look up, ``preadv``, verify."""
        env = self._env
        t0 = time.perf_counter()
        n = self.opts.block_bytes
        if env is None:
            return Report(op.token, JobKind.PROMOTE, False, "miss: disk tier closed", copied=False)
        try:
            self._rw.acquire_shared()
            try:
                with env.begin(db=self._blocks, buffers=True) as txn:
                    found = self._lookup(txn, op, t0)
            finally:
                self._rw.release_shared()
            if isinstance(found, Report):
                return found
            value, h = found
            # preadv straight into the host slot, without the GIL
            got = os.preadv(self._sfd, [op.dst], h.slot * self._slot_bytes) if h.length == n else 0
        except (lmdb.Error, OSError) as exc:
            return self._read_failed(op, exc)
        return self._verify(op, value, got, t0, h)

    def _read_failed(self, op: _Promote, exc: BaseException) -> Report:
        """An LMDB or I/O error reading ``op``: counted and logged (once per kind), a miss."""
        self._on_error(_error_kind(exc), repr(exc))
        return Report(op.token, JobKind.PROMOTE, False, f"{_READ_FAILED} ({exc})", copied=False)

    def _index_changed(self, lk: bytes, value: bytes) -> bool:
        env = self._env
        assert env is not None
        self._rw.acquire_shared()
        try:
            with env.begin(db=self._blocks, buffers=True) as txn:
                now = txn.get(lk)
                return now is None or bytes(now) != value
        finally:
            self._rw.release_shared()


def _libc_sync_file_range() -> Optional[Callable[[int, int, int], None]]:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start writeback of the dirty pages, do not wait

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, write)   # advisory: an error here shows up in the fdatasync that follows
    return start


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, lmdb.MapFullError):
        return "map_full"
    err = getattr(exc, "errno", None)
    text = str(exc)
    if err == errno.ENOSPC or "No space left" in text:
        return "disk_full"
    if err in (errno.EROFS, errno.EACCES, errno.EPERM) or "Read-only" in text or "Permission denied" in text:
        return "read_only"
    if err == errno.EIO or "Input/output" in text:
        return "io_error"
    return "lmdb_error"
