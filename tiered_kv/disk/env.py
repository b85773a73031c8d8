"""The LMDB environment of a disk tier: opening it, its meta records, its map growth.

Owns the ``lmdb.Environment``, its sub-databases (:data:`SUBDBS`), the meta records
(:func:`init_meta`, checked on open), and the map size.  Invariants (py-lmdb's rules):

* the map is grown only with no transaction of this process active: every transaction once the
  store's threads run is taken under ``rw`` shared, :meth:`DiskEnv.grow` takes it exclusive (the
  meta check and recovery run before any thread starts);
* ``writemap`` is never used, so a full disk is an error and not SIGBUS;
* data.mdb is kept at least as long as the environment's last page (:meth:`DiskEnv.cover_pages`, at open
  and after each commit): LMDB counts in its last page the pages a transaction allocated and freed again
  without writing them, so a healthy file may end before it; pages past the end then read as zeros.  A
  file that was cut short (damage) has pages its B-trees still reference past the old end: LMDB finds
  those zero pages corrupt (MDB_CORRUPTED), where reading past the end of the map would be SIGBUS.

The operator tools (:mod:`tiered_kv.tools`) use the same constants, :func:`init_meta` and
:func:`map_in_use`.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lmdb

from ..errors import DiskTierError
from .format import FORMAT_VERSION
from .lock import as_named

__all__ = ["SUBDBS", "MAX_DBS", "MIN_MAP", "DiskEnv", "RWLock", "init_meta", "map_in_use"]

log = logging.getLogger(__name__)

SUBDBS = ("meta", "blocks", "tombs", "touch")  # the named sub-databases of an environment
MAX_DBS = len(SUBDBS)
MIN_MAP = 64 << 20
MAP_BYTES_PER_SLOT = 4096   # initial map per slot: it holds only index records (payloads are in the slot file)
MIN_READERS = 126           # LMDB's default reader table; more readers get 4 slots each and some spare
MAP_GROWTH = 1.5            # a grown map is at least this much larger: few growths, each under an exclusive lock
GROW_NEED_FACTOR = 4        # ... and holds this many times what the batch that asked needs, beyond what is used
GROW_SPARE_BLOCKS = 16      # ... plus room for this many more index records of a block each (page-rounded)
RW_WAKE_S = 1.0             # a RWLock waiter looks again at least this often (a wake-up an interrupt cut off)
GROW_FREE_SHARE = 4         # growing needs 1/this of the new room free on the device now (the file grows as pages are written)


def init_meta(txn: Any, meta_db: Any, namespace: bytes, block_bytes: int) -> None:
    """The meta records of a fresh environment (DiskStore and ``tiered-kv import`` alike)."""
    txn.put(b"format_version", str(FORMAT_VERSION).encode(), db=meta_db)
    txn.put(b"namespace", namespace, db=meta_db)
    txn.put(b"block_bytes", str(block_bytes).encode(), db=meta_db)
    txn.put(b"created", str(time.time()).encode(), db=meta_db)


def map_in_use(env: Any) -> int:
    """Bytes of the map the environment has used (up to its last page): data.mdb must be this long."""
    return (env.info()["last_pgno"] + 1) * env.stat()["psize"]


class RWLock:
    """Many readers or one exclusive holder (the writer growing the map).

    Interrupt-safe for the owner's thread (``settle_orphans`` at close takes it shared): every method takes the
    raw lock with ``with self._lock:`` -- its C ``__enter__`` leaves no window where a signal handler finds the
    lock taken and no ``with`` to release it, unlike ``with self._cond:`` (``Condition.__enter__`` is Python code,
    bpo-29988) -- and each wait is timed (:data:`RW_WAKE_S`), so a wake-up an interrupt cut off inside
    ``notify_all`` (Python code) delays a waiter, never strands it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._readers = 0
        self._exclusive = False
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._lock:
            while self._exclusive or self._waiting:
                self._cond.wait(RW_WAKE_S)
            self._readers += 1

    def release_shared(self) -> None:
        with self._lock:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_exclusive(self) -> None:
        with self._lock:
            self._waiting += 1
            while self._exclusive or self._readers:
                self._cond.wait(RW_WAKE_S)
            self._waiting -= 1
            self._exclusive = True

    def release_exclusive(self) -> None:
        with self._lock:
            self._exclusive = False
            self._cond.notify_all()


class DiskEnv:
    """The environment of one DiskStore: ``env`` and the sub-database handles ``meta``, ``blocks``,
    ``tombs``, ``touch``.  ``env`` is read on each use (tests wrap it to inject faults)."""

    def __init__(self, path: Path, namespace: bytes, block_bytes: int, durability: str, map_size_bytes: int,
                 target_slots: int, num_readers: int, on_error: Callable[[str, str], None],
                 name: Optional[Path] = None) -> None:
        self.path = path   # what the files are opened through (the store's pinned directory)
        self.name = path if name is None else name   # the disk_path as configured, for messages
        self.durability = durability
        self.rw = RWLock()
        self._block_bytes = block_bytes
        self._on_error = on_error
        self.env: Any = None
        self.map_size = 0
        data = path / "data.mdb"
        existing = data.exists()
        want = map_size_bytes or max(MIN_MAP, MAP_BYTES_PER_SLOT * target_slots)
        if existing:
            size = data.stat().st_size
            if size == 0:
                # made by LMDB, which writes its first meta pages at the first commit: a process that died
                # (or a disk that filled) before it left no record; LMDB takes the empty file as a new one
                log.warning("disk_path %r: data.mdb is empty (no commit reached it): the tier starts empty",
                            str(self.name))
                existing = False
            # with room to grow: a map exactly as large as a full file would leave recovery's first write
            # transaction (it drops what it finds damaged) no page, and the tier would never open again
            want = max(want, int(size * MAP_GROWTH))
        try:
            env = lmdb.open(str(path), map_size=want, subdir=True, max_dbs=MAX_DBS, sync=durability != "none",
                            metasync=durability == "sync", writemap=False, map_async=False, readahead=True,
                            meminit=False, max_readers=max(MIN_READERS, 4 * num_readers + 8), lock=True)
        except lmdb.Error as exc:
            raise DiskTierError(f"disk_path {str(self.name)!r} is not a usable LMDB environment: "
                               f"{as_named(str(exc), path, self.name)}") from exc
        self.env = env
        try:
            self.reader_check()
            if existing:
                self.cover_pages()
            self.map_size = env.info()["map_size"]
            self.meta = env.open_db(b"meta")
            self.blocks = env.open_db(b"blocks")
            self.tombs = env.open_db(b"tombs")
            self.touch = env.open_db(b"touch")
            self._check_meta(namespace)
        except BaseException:
            self.close()
            raise

    def cover_pages(self) -> None:
        """data.mdb at least as long as the environment's last page (see the module's invariants).  Called
        with no write transaction running (at open, and by the writer after its commit), so the file does not
        grow meanwhile; the extension is sparse (no block is written)."""
        env = self.env
        if env is None:
            return
        need = map_in_use(env)
        data = self.path / "data.mdb"
        size = data.stat().st_size
        if size < need:
            os.truncate(data, need)
            log.info("disk_path %r: data.mdb extended from %d to %d bytes (LMDB's last page)", str(self.name), size,
                     need)

    def _check_meta(self, ns: bytes) -> None:
        """Write the meta records of a fresh environment, or refuse another format/namespace/block size."""
        p, bb_want = self.name, self._block_bytes
        with self.env.begin(write=True) as txn:
            ver = txn.get(b"format_version", db=self.meta)
            if ver is None and txn.stat(self.blocks)["entries"] == 0:
                init_meta(txn, self.meta, ns, bb_want)
                return
            if ver != str(FORMAT_VERSION).encode():
                raise DiskTierError(f"disk_path {str(p)!r} has format version {ver!r}, this is {FORMAT_VERSION}")
            got = txn.get(b"namespace", db=self.meta)
            if got != ns:
                raise DiskTierError(f"disk_path {str(p)!r} belongs to namespace {got!r}, not {ns!r}")
            bb = txn.get(b"block_bytes", db=self.meta)
            if bb != str(bb_want).encode():
                raise DiskTierError(f"disk_path {str(p)!r} holds blocks of {bb!r} bytes, not {bb_want}")

    def file_bytes(self) -> int:
        """Size of LMDB's data.mdb (the index)."""
        try:
            return (self.path / "data.mdb").stat().st_size
        except OSError:
            return 0

    def reader_check(self) -> None:
        """Clear reader-table slots of processes that died inside a read transaction (a ``tiered-kv
        verify`` or ``export`` killed with SIGKILL): LMDB never ends such a transaction itself, and
        its snapshot would keep the writer from reusing any page freed after it -- data.mdb would
        grow with every commit until this process restarts.  A scan of the reader table and one
        lock probe per process in it: once per batch costs next to nothing beside its fdatasync."""
        env = self.env
        if env is None:
            return
        try:
            cleared = env.reader_check()
        except lmdb.Error as exc:
            self._on_error("lmdb_error", f"reader_check: {exc!r}")
            return
        if cleared:
            log.warning("disk tier %s: cleared %d reader slot(s) left by dead processes", self.name, cleared)

    def grow_ahead(self, need: int) -> None:
        """Grow before MapFullError when the free map space is below twice what a batch writes."""
        if need and self.map_size - map_in_use(self.env) < 2 * need:
            self.grow(need)

    def grow(self, need: int = 0) -> bool:
        """Grow the map (no transaction may be active); False if the disk lacks room."""
        env = self.env
        assert env is not None
        used = map_in_use(env)
        new = max(int(self.map_size * MAP_GROWTH),
                  used + GROW_NEED_FACTOR * need + GROW_SPARE_BLOCKS * (self._block_bytes + 4096))
        free = shutil.disk_usage(self.path).free
        file_bytes = self.file_bytes()
        if free < (new - file_bytes) // GROW_FREE_SHARE:
            log.error("disk tier: cannot grow LMDB map to %d bytes, only %d free on the device", new, free)
            return False
        self.rw.acquire_exclusive()
        try:
            env.set_mapsize(new)
            self.map_size = env.info()["map_size"]
        finally:
            self.rw.release_exclusive()
        log.info("disk tier: LMDB map grown to %d bytes", self.map_size)
        return True

    def close(self) -> None:
        """Sync (unless durability is "none") and close; idempotent."""
        env: Optional[Any] = self.env
        if env is None:
            return
        try:
            if self.durability != "none":
                env.sync(True)
        except lmdb.Error:
            pass
        env.close()
        self.env = None
