"""The disk writer thread: the op queue, batches, the commit, failures and back-off, flushes.

Owns the queue of spill/tomb/delete/touch/flush ops (bounded for spills: a full queue sheds) and
every write transaction.  A batch is written in three steps: payloads into free slots (checksummed
on a helper thread when large), ``fdatasync`` of the slot file, then one LMDB transaction
publishing the index records; a crash before the commit leaves bytes in free slots that nothing
references.  Invariants:

* each op is answered once: spills by a Report after their batch commits (or fails), flushes by
  :class:`~tiered_kv.disk.records.FlushDone` (False if any batch or spill failed since it was queued);
* a spill whose payload finds no room (no slot, ENOSPC growing, writing or syncing the slot file)
  fails alone: the rest of its batch, its tombs and deletes above all, still commits;
* a failed batch fails its spills and flushes, drops its touches and keeps its tomb/delete ops, in
  order, retried with back-off at the head of the next batch, which still takes ``batch_blocks`` ops
  of the queue besides (so those are answered while the fault lasts); once closing they get
  :data:`CLOSE_RETRIES` attempts, then are dropped;
* nothing after a commit undoes it: a fault there (``cover_pages``) is counted as degraded;
* an idle writer that is not healthy commits a probe record after its back-off until one succeeds
  (:meth:`Writer._probe`): the owner sheds the spills that would evict while it is unhealthy, so a full
  tier would otherwise queue nothing that could make it healthy again;
* touches are bounded: one per key, at most ``queue_blocks`` queued (:meth:`Writer.push`);
* a writer that dies answers everything queued and refuses further ops.

Longer than the project's usual 500 lines: the queue, the batch, the commit and its failure paths are
one thread's logic over one state (the condition, the queue and the kept ops, the sequence number,
the failure count) and the invariants above hold across all of them; split, each part would reach
into the others' state.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import shutil
import threading
import time
import uuid
from typing import Any, Callable, Optional

import lmdb

from ..jobs import JobKind
from ..reports import CompletionQueue, Report
from .env import DiskEnv
from .format import HEADER_SIZE, lmdb_key, pack_slot_entry, record_where
from .recovery import U64
from .records import SPILL_PREVENTED, Delete, DiskOptions, Flush, FlushDone, Spill, SpillGroup, Tomb, Touch, error_kind
from .slots import SlotFile, SlotsExhausted
from .tombs import Tombs, Undo

__all__ = ["Writer", "CLOSE_RETRIES"]

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0       # an idle writer looks for queued touches (which wake no one) this often
DIRTY_SYNC_S = 0.5      # durability "batch": an idle writer syncs its last commit after this long
CLOSE_RETRIES = 3       # attempts left to the kept ops of a failed batch once close() has begun
MAP_FULL_ATTEMPTS = 4   # commits of one batch, growing the map between them, before it fails as map_full
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.01, 1.0   # a failing disk is retried this often: no spin, no long stall
RECORD_SLACK = 1024     # map bytes a spill's index record may take beyond its header, namespace and key


class Writer:
    def __init__(self, opts: DiskOptions, out: CompletionQueue, db: DiskEnv, slots: SlotFile, tombs: Tombs,
                 seq: int, on_error: Callable[[str, str], None], on_prevented: Callable[[], None]) -> None:
        self.opts = opts
        self._out = out
        self._db = db
        self._orphans: list[Any] = []   # tombs and deletes a dead writer could not commit (settle_orphans)
        self._slots = slots
        self._tombs = tombs
        self._ns = opts.namespace.encode()
        self._on_error = on_error
        self._on_prevented = on_prevented
        self._seq = seq
        # the owner's side takes the raw lock (``with self._lock:``), never the condition: see push()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ops: collections.deque[Any] = collections.deque()
        # the tombs and deletes a failed batch kept, retried first by the next batch on top of its
        # batch_blocks new ops (under _cond): however many are kept, the ops behind them are still taken
        self._retry: collections.deque[Any] = collections.deque()
        self._touched: set[bytes] = set()   # keys with a Touch queued in _ops (under _cond): one each
        self.spills_queued = 0
        self._filling = False   # the writer holds a partial batch and sleeps until its deadline (under _cond)
        self._fill = [0, 0]     # ... of this many ops and spill bytes
        self.accepting = True
        self._closed = False
        self._batch: list[Any] = []
        self._dirty = False
        self._hash_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # see _hasher()
        self.failures = 0         # failed batches so far (a flush after one answers False)
        self._close_failures = 0  # failed batches since close() began
        self._sync_failed = False
        self._backoff = 0.0
        self.healthy = True
        self.tombstones = 0
        self.writer_error: Optional[BaseException] = None
        self.fault_hook: Optional[Callable[[str], None]] = None  # tests: raise inside the writer at a named point
        self._running = True   # until _writer_main ends (alive())
        self.spill_jobs = 0    # submit_spills calls that queued their spills (owner thread; see DiskStore.spills_accepted)
        self._thread = threading.Thread(target=self._writer_main, name="tiered-kv-disk-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ owner side (never blocks on I/O)
    # Interrupt-safe (a KeyboardInterrupt at any point of the owner's thread): the owner takes the raw lock with
    # ``with self._lock:``, never ``with self._cond:``.  ``Condition.__enter__`` is Python code, and a signal handler
    # that runs at its return leaves the lock taken with no ``with`` to release it (bpo-29988): the engine's next
    # push, and the writer, deadlock.  ``Lock.__enter__`` is C, called by the BEFORE_WITH opcode, after which the
    # ``with`` block's handler covers the body with no eval-breaker check in between (CPython 3.11: a lock
    # acquire a signal interrupts raises without taking it).  Inside, each op is queued together with its
    # bookkeeping in one run of bytecodes with no call (``+=`` on the deque, the counters, the set): no signal
    # handler runs in between, so an interrupt leaves an op queued once with its counts, or not at all.  Only
    # the wake-up (``Condition.notify``, Python code) can be cut off: the writer's every wait is timed
    # (IDLE_WAKE_S at most), so that delays the op, never loses it.
    def submit_spills(self, tokens: list[uuid.UUID], keys: list[bytes], srcs: list[memoryview]) -> bool:
        """Queue the spills of one owner job (all or none): answered by one report under ``tokens[0]``
        (a :class:`SpillGroup` when there are several); False when the queue has no room for them all."""
        n = len(tokens)
        tombs = self._tombs
        with self._lock:
            if not self.accepting or self.spills_queued + n > self.opts.queue_blocks:
                return False
            group = SpillGroup(tokens[0], n) if n > 1 else None
            ops = [Spill(tokens[i], keys[i], srcs[i], len(srcs[i]), group=group, part=i) for i in range(n)]
            unsettled = set(tokens)
            with tombs.lock:   # (the writer reads tombs.unsettled under it; raw lock, as above)
                # one step, no call: each spill is unsettled (its tomb kept) before the writer can take it
                tombs.unsettled |= unsettled
                self._ops += ops
                self.spills_queued += n
                self.spill_jobs += 1
            self._wake_writer(ops[-1])
        return True

    def push(self, op: Any, front: bool = False) -> None:
        """Queue a tomb, delete, touch or flush.  A touch (recency only) is dropped when its key has one
        queued already or ``queue_blocks`` touches are queued: a writer stuck in a commit must not grow
        the queue by one per promote (the next restart then ranks those entries by an older use).

        Interrupted (see above), ``op`` is queued once or not at all (a retry queues it then); a tomb or delete
        queued at the front and interrupted in its ``appendleft`` is queued, its wake-up left to the writer's
        next timed wake."""
        with self._lock:
            if not self.accepting:
                if isinstance(op, Flush):  # answer at once: nothing will commit any more
                    self._out.put(FlushDone(op.token, False, "disk writer is gone"))
                elif isinstance(op, (Tomb, Delete)):   # a removal must not be lost: close() applies it
                    self._orphans.append(op)
                return
            if type(op) is Touch:
                touched = self._touched
                k = op.key
                if k in touched or len(touched) >= self.opts.queue_blocks:
                    return
                # one step, no call: queued and counted together (a touch wakes no one)
                touched |= {k}
                self._ops += (op,)
                return
            if front:
                self._ops.appendleft(op)
            else:
                self._ops += (op,)
            self._wake_writer(op)

    def room(self) -> int:
        """How many more spills the queue takes now."""
        return max(0, self.opts.queue_blocks - self.spills_queued) if self.accepting else 0

    def alive(self) -> bool:
        """The writer thread runs (its own flag, not ``Thread.is_alive()``: that one, interrupted on the owner's thread
        as its lock probe returns, marks a running thread stopped for good -- CPython 3.11's bpo-45274 handler -- and
        the disk tier would take its writer for dead)."""
        return self._running

    def begin_close(self) -> None:
        """Drain what is queued, then stop (ops pushed until :meth:`join` returns still count)."""
        with self._lock:   # (the owner's thread: see above; an interrupted notify is healed by the timed wait)
            self._closed = True
            self._cond.notify_all()

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait for the writer thread to end (after :meth:`begin_close`); False when it still runs after
        ``timeout`` seconds (None: no limit): a write or sync hung in the kernel."""
        self._thread.join(timeout)
        if self._running:   # (see alive())
            return False
        self.accepting = False
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None
        return True

    def settle_orphans(self) -> int:
        """After :meth:`join`: the removals (tombs of cancelled or invalidated entries, deletes) that a
        writer that died could not commit, applied in one transaction, so that none of those entries is
        served after a reopen.  No write can come under their tokens any more: each only deletes the
        entry its token wrote.  Returns how many were applied (0 when the transaction fails: logged)."""
        ops = self._orphans[:]   # (taken out once committed: a close an interrupt broke off applies them again)
        if not ops or self._db.env is None:
            return 0
        frees: list[int] = []
        try:
            self._db.rw.acquire_shared()
            try:
                with self._db.env.begin(write=True, buffers=True) as txn:
                    for op in ops:
                        self._tombs.delete_if_token(txn, op.key, op.token, frees,
                                                    isinstance(op, Delete) and op.found_corrupt)
            finally:
                self._db.rw.release_shared()
        except Exception as exc:   # noqa: BLE001 - the disk fails too: logged, as a writer's dropped ops are
            log.error("disk tier %s: %d removal(s) the dead writer left could not be written either (%r): a "
                      "removed entry among them may be readable after reopen", self.opts.path, len(ops), exc)
            return 0
        with self._lock:   # (pushes append under it; the owner's thread: see above)
            del self._orphans[:len(ops)]
        log.warning("disk tier %s: %d removal(s) the dead writer could not commit written at close", self.opts.path,
                    len(ops))
        return len(ops)

    # ------------------------------------------------------------ the queue
    def _wake_writer(self, op: Any) -> None:
        """Under ``_cond``, after queueing ``op``: wake the writer if it waits for work, or if it is
        filling a batch and this op completes one (or is a flush).  A writer filling a batch otherwise
        sleeps on to the batch deadline: one wake-up per op (a thread switch and a GIL hand-off each,
        on the engine's cores) bought nothing, since the batch would not leave before the deadline.

        A recency touch (one per promote) wakes no one: it leaves with the writer's next batch, which
        the next other op or the idle wake-up (every ``IDLE_WAKE_S``) starts.  Waking the writer for
        each promote burst ran its commits beside the readers and the owner's copies, and slowed warm
        promotes.  A touch is recency for the next restart: a crash loses the touches still queued
        (about a second's worth at most; with the disk I/O process, plus those the owner holds for its
        next frame: at most 64, and a second's worth while it polls) on top of what the durability level
        loses, and those entries then rank by their write sequence."""
        kind = type(op)
        if kind is Touch:
            return
        o = self.opts
        if not self._filling or kind is Flush or self._fill[0] + len(self._ops) >= o.batch_blocks \
                or self._fill[1] + self.spills_queued * o.block_bytes >= o.batch_bytes:
            self._cond.notify()

    def _take_batch(self) -> Optional[list[Any]]:
        """The next batch: the ops a failed batch kept (first, in order, not counted), then up to
        ``batch_blocks`` ops / ``batch_bytes`` of spills from the queue; [] when an idle writer should
        sync; None once closed and drained."""
        o = self.opts
        with self._cond:
            while not self._ops and not self._retry:
                if self._closed:
                    # drained: from here on a removal pushed (a reader close() left running) is kept for
                    # settle_orphans and a flush answered at once, none left in a queue no thread reads
                    self.accepting = False
                    return None
                if not self.healthy:   # idle while unhealthy: probe after the back-off (see _probe)
                    wait = max(BACKOFF_MIN_S, self._backoff)
                else:
                    wait = DIRTY_SYNC_S if self._dirty else IDLE_WAKE_S
                self._cond.wait(timeout=wait)
                if not self._ops and not self._retry and (self._dirty or not self.healthy):
                    return []  # idle: time to sync a batch-mode commit, or to probe an unhealthy disk
            batch: list[Any] = list(self._retry)
            self._retry.clear()
            kept = len(batch)
            nbytes = 0
            deadline = time.monotonic() + o.batch_seconds
            self._filling = True
            try:
                while True:
                    while self._ops and len(batch) - kept < o.batch_blocks and nbytes < o.batch_bytes:
                        op = self._ops.popleft()
                        kind = type(op)
                        if kind is Spill:
                            self.spills_queued -= 1
                            nbytes += op.nbytes
                        elif kind is Touch:
                            self._touched.discard(op.key)
                        batch.append(op)
                        if kind is Flush:
                            return batch
                    self._fill[0], self._fill[1] = len(batch) - kept, nbytes
                    if len(batch) - kept >= o.batch_blocks or nbytes >= o.batch_bytes or self._closed:
                        return batch
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return batch
                    self._cond.wait(timeout=left)
            finally:
                self._filling = False

    # ------------------------------------------------------------ the thread
    def _writer_main(self) -> None:
        try:
            self._writer_loop()
        finally:
            self._running = False

    def _writer_loop(self) -> None:
        try:
            while True:
                batch = self._take_batch()
                if batch is None:
                    break
                if not batch:
                    self._sync()
                    if not self.healthy:
                        self._probe()
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
                rest = self._batch + list(self._retry) + list(self._ops)
                self._batch = []
                self._retry.clear()
                self._ops.clear()
                self._touched.clear()
                self.spills_queued = 0
                self.accepting = False  # no further ops: they could never be answered
                self._orphans += [op for op in rest if isinstance(op, (Tomb, Delete))]
            self._fail_ops(rest, f"disk writer died: {exc!r}")
            if not isinstance(exc, Exception):
                raise

    def _run_batch(self, batch: list[Any]) -> None:
        """Commit ``batch`` in one transaction; on failure fail its spills and keep its tombs and deletes."""
        self._db.reader_check()
        for _attempt in range(MAP_FULL_ATTEMPTS):
            try:
                self._db.grow_ahead(self._batch_bytes(batch))
                results, fault = self._commit(batch)
            except lmdb.MapFullError:
                try:
                    grown = self._db.grow(self._batch_bytes(batch))
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
            # committed: from here on nothing rolls the batch back, nor answers it again if the thread dies
            self._batch = []
            self.healthy = True
            self._backoff = 0.0
            self._dirty = self.opts.durability == "batch"
            if fault is not None:   # spills whose payload could not be written failed, the rest committed
                self.failures += 1      # (a flush covering them answers False)
                self._degrade(*fault)
            flushes = [op for op in batch if isinstance(op, Flush)]
            if flushes:
                self._sync()
            answer = self._answer
            for op, r in results:
                answer(op, r)
            for f in flushes:
                ok = self.failures == f.failures_before and not self._sync_failed
                self._out.put(FlushDone(f.token, ok, None if ok else "a write covered by this flush failed"))
            self._cover_pages()
            return
        self._batch_failed(batch, "map_full", "LMDB map still full after growing")

    def _batch_failed(self, batch: list[Any], kind: str, msg: str) -> None:
        """Spills fail (they can be stored again); tombs and deletes are kept, in order, for the next
        batch, which takes them on top of its own ``batch_blocks`` ops (so the spills and flushes queued
        behind them are still answered while the fault lasts); touches (recency for the next restart,
        which a crash may lose anyway) are dropped, or a disk that fails every commit would grow the
        queue by one per promote for as long as it lasts.

        Flushes in the batch answer False.  The next attempt waits a little
        longer each time (up to ``BACKOFF_MAX_S``) so a persistent fault does not
        spin.  Once the store is closing, the kept ops get ``CLOSE_RETRIES`` more
        attempts and are then dropped (logged): a disk that fails every commit
        must not keep ``close()`` -- and the host process's shutdown -- waiting
        for ever.
        """
        self._degrade(kind, msg)
        self.failures += 1
        keep = [op for op in batch if isinstance(op, (Tomb, Delete))]
        self._fail_ops([op for op in batch if not isinstance(op, (Tomb, Delete, Touch))],
                       f"disk write failed ({kind}): {msg}")
        self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff * 2))
        dropped: list[Any] = []
        with self._cond:
            if self._closed:
                self._close_failures += 1
                if self._close_failures > CLOSE_RETRIES:
                    dropped, keep = keep, []
            self._retry.extend(keep)   # the next batch takes them first, and its own ops besides
            self._batch = []           # each op of it is answered, dropped or kept for a retry
            if keep or not self._closed:
                # the whole back-off: a spill queued meanwhile notifies this condition, and must not cut it
                # short (a failing disk would be retried once per spill); close() ends it
                deadline = time.monotonic() + self._backoff
                while not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(timeout=left)
        if dropped:
            log.error("disk tier %s: closing after %d failed commits; dropped %d tomb/delete op(s) that "
                      "could not be written (a tombstoned entry among them may be readable after reopen)",
                      self.opts.path, self._close_failures, len(dropped))

    def _batch_bytes(self, batch: list[Any]) -> int:
        """The LMDB map space a batch's index records may take (payloads go to the slot file)."""
        return sum(HEADER_SIZE + len(self._ns) + len(op.key) + RECORD_SLACK for op in batch if isinstance(op, Spill))

    def _classify(self, exc: BaseException) -> str:
        kind = error_kind(exc)
        if kind == "io_error":
            # LMDB reports a short write on a full disk as EIO: look at the free space
            try:
                if shutil.disk_usage(self._db.path).free < 2 * self.opts.batch_bytes:   # the store's own directory
                    return "disk_full"
            except OSError:
                pass
        if isinstance(exc, SlotsExhausted):
            return "slots_exhausted"
        if kind == "lmdb_error" and not isinstance(exc, lmdb.Error):
            return "writer_error"
        return kind

    # ------------------------------------------------------------ one commit
    def _commit(self, batch: list[Any]) -> tuple[list[tuple[Spill, Report]], Optional[tuple[str, str]]]:
        """Write ``batch``'s payloads into free slots, sync them, then publish in one transaction.

        Returns the reports to send once the transaction is committed, and ``(kind, message)`` when some
        spills found no room for their payload (:meth:`_no_room`: a full disk or slot file): those fail
        alone, and the rest of the batch -- its tombs and deletes above all, which take no slot space --
        still commits.  Raises on any other fault (an EIO) and when the transaction fails: then nothing
        committed and every change is undone.  Nothing after the commit raises or undoes it.
        """
        env = self._db.env
        assert env is not None
        slots, tombs, db = self._slots, self._tombs, self._db
        results: list[tuple[Spill, Report]] = []
        t0 = time.perf_counter()
        if self.fault_hook is not None:
            self.fault_hook("commit")
        placed: list[int] = []      # slots taken by this batch, given back if it fails
        frees: list[int] = []       # slots of entries this transaction drops
        # the in-memory tomb state this transaction changes, put back if it aborts: a retry after
        # MapFullError must see what the aborted attempt saw (see tombs.py)
        undo: Undo = []
        prevented = 0
        lost = 0                    # records dropped without their slot: a reader found them corrupt, or their
        #                             slot number names a slot they do not hold (SlotFile.drop): the scan finds it
        fault: Optional[tuple[str, str]] = None   # the first error writing a payload
        unwritten: set[int] = set()               # id() of the spills it (or a later one) failed
        hashing: Optional[concurrent.futures.Future[None]] = None
        try:
            todo: list[Spill] = []
            touch_seqs: list[int] = []   # each touch's sequence number, in batch order
            for op in batch:   # numbered in the order queued: recovery ranks by them (a touch is a use then)
                if isinstance(op, Touch):
                    self._seq += 1
                    touch_seqs.append(self._seq)
                    continue
                if not isinstance(op, Spill):
                    continue
                op.slot = -1
                if tombs.is_cancelled(op.token):
                    continue        # never written; the transaction below answers it
                try:
                    op.slot = slots.alloc()
                except (OSError, SlotsExhausted) as exc:   # no room for it (ENOSPC growing the file)
                    no_room = self._no_room(exc)
                    fault = fault or no_room
                    unwritten.add(id(op))
                    continue
                placed.append(op.slot)
                self._seq += 1
                op.seq = self._seq
                todo.append(op)
            touch_seq = iter(touch_seqs)
            # checksums and writes run in C without the GIL, straight from the leased host slots; a
            # large batch is checksummed on the hash thread while this one writes the same bytes
            # (the slots stay leased until the batch's reports, so both read what is published)
            if sum(op.nbytes for op in todo) >= self.opts.hash_offload_bytes:
                try:
                    hashing = self._hasher().submit(self._pack_entries, todo)
                except RuntimeError:   # the interpreter is exiting (concurrent.futures refuses new work then,
                    self._pack_entries(todo)   # before any atexit handler, e.g. one that closes the tier): here
            else:
                self._pack_entries(todo)
            written: list[Spill] = []
            for op in todo:
                try:
                    slots.pwrite(op.slot, op.src)
                except OSError as exc:   # ENOSPC: a sparse or copy-on-write file takes its blocks here
                    no_room = self._no_room(exc)
                    fault = fault or no_room
                    unwritten.add(id(op))
                    continue
                written.append(op)
            if written and self.opts.durability != "none":
                try:
                    slots.sync()   # the bytes are durable before any index record points at them
                except OSError as exc:   # ENOSPC (delayed allocation): none of them is known to be on disk
                    no_room = self._no_room(exc)
                    fault = fault or no_room
                    unwritten.update(id(op) for op in written)
            if hashing is not None:
                h, hashing = hashing, None
                h.result()            # the index records, needed from here on
            error = None if fault is None else f"disk write failed ({fault[0]}): {fault[1]}"
            unused: list[int] = []
            db.rw.acquire_shared()
            try:
                with env.begin(write=True, buffers=True) as txn:
                    for op in batch:
                        if isinstance(op, Spill):
                            if tombs.prevents(txn, op.token, undo):
                                if op.slot >= 0:
                                    unused.append(op.slot)
                                prevented += 1
                                results.append((op, Report(op.token, JobKind.SPILL, False, SPILL_PREVENTED)))
                                continue
                            if id(op) in unwritten:   # settled by prevents(): no tomb need wait for it
                                if op.slot >= 0:
                                    unused.append(op.slot)
                                results.append((op, Report(op.token, JobKind.SPILL, False, error)))
                                continue
                            lk = lmdb_key(op.key)
                            old = txn.replace(lk, op.entry, db=db.blocks)
                            if old is not None and not slots.drop(old, lk, frees):
                                lost += 1   # its slot number cannot be trusted: the scan finds its slot
                            slots.hold(op.slot, lk)
                            txn.delete(lk, db=db.touch)
                            results.append((op, Report(op.token, JobKind.SPILL, True, None, op.nbytes, 0.0, None,
                                                       [record_where(op.entry, op.slot, op.seq)])))
                        elif isinstance(op, Tomb):
                            lost += tombs.apply(txn, op.token, op.key, frees, undo)
                        elif isinstance(op, Delete):
                            lost += tombs.delete_if_token(txn, op.key, op.token, frees, op.found_corrupt)
                        elif isinstance(op, Touch):
                            seq = next(touch_seq)
                            lk = lmdb_key(op.key)
                            if txn.get(lk, db=db.blocks) is not None:   # not for an entry gone meanwhile
                                txn.put(lk, U64.pack(seq), db=db.touch)
                    tombstones = txn.stat(db.tombs)["entries"]
            finally:
                db.rw.release_shared()
        except BaseException:
            if hashing is not None:   # let it stop reading the host slots before they are given up
                concurrent.futures.wait([hashing])
            slots.give_back(placed)   # nothing committed references them
            tombs.undo(undo)
            raise
        # committed: from here on nothing may undo it (its slots are referenced, its tombs applied)
        self.tombstones = tombstones   # a failed commit's count is not the disk's
        slots.give_back(unused)
        for _ in range(prevented):    # counted once committed: an aborted attempt prevented nothing
            self._on_prevented()
        try:
            # the last committed transaction, not this one's id: a transaction that changed nothing
            # commits nothing (no meta write, no sync), so it must not count as "a later commit"
            last_txnid = env.info()["last_txnid"]
        except Exception as exc:   # noqa: BLE001 - the slots it dropped stay taken until the next open's recovery
            self._degrade(self._classify(exc), f"after a commit: {exc!r}")
        else:
            slots.dropped(frees, last_txnid)
            if lost:   # (not without dropped(): the scan would free this commit's drops before they are durable)
                self._reclaim(last_txnid)
        dt = time.perf_counter() - t0
        n = sum(1 for _, r in results if r.ok)
        for _, r in results:
            if r.ok:
                r.seconds = dt / n
        return results, fault

    def _reclaim(self, txn_id: int) -> None:
        """After a commit ``txn_id`` that dropped records whose slot number is not to be trusted (a reader found
        them corrupt, or the slot they name does not hold them: ``SlotFile.drop``): their slots are found by
        a scan of the index -- every slot no readable record references, neither free nor waiting to be --
        and freed once that commit is durable (``SlotFile.reclaim``).  Such a record's slot number is not to
        be trusted (none, when its header does not parse; the checksum does not cover it, so a damaged one
        may name a live entry's slot).  Rare (a damaged block), so a full scan per commit that dropped any (about a second per
        million entries, on this thread) is the price; a fault in it is counted, and the slots wait for
        the next open's recovery instead."""
        env = self._db.env
        assert env is not None
        used: list[int] = []
        try:
            self._db.rw.acquire_shared()
            try:
                with env.begin(db=self._db.blocks, buffers=True) as txn:
                    for _, v in txn.cursor():
                        SlotFile.named_slot(v, used)   # the slot a readable record names
            finally:
                self._db.rw.release_shared()
        except Exception as exc:   # noqa: BLE001 - committed already: nothing undone, the slots stay taken
            self._degrade(self._classify(exc), f"finding the slots of unreadable records: {exc!r}")
            return
        n = self._slots.reclaim(set(used), txn_id)
        log.debug("disk tier %s: %d slot(s) of corrupt records freed", self.opts.path, n)

    def _pack_entries(self, ops: list[Spill]) -> None:
        """The index record (header + xxh3 of the payload + slot) of each op."""
        ns = self._ns
        for op in ops:
            op.entry = pack_slot_entry(ns, op.key, op.token, op.src, op.seq, op.slot)

    def _hasher(self) -> concurrent.futures.ThreadPoolExecutor:
        """The hash thread (started on first use by the writer; stopped by :meth:`join`)."""
        if self._hash_pool is None:
            self._hash_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiered-kv-hash")
        return self._hash_pool

    def _sync(self) -> None:
        env = self._db.env
        # only "batch" commits wait for a sync (a flush's, or an idle writer's): LMDB syncs each "sync"
        # commit itself, and "none" never syncs
        if env is None or self.opts.durability != "batch":
            return
        try:
            txn_id = env.info()["last_txnid"]
            env.sync(True)
            self._slots.synced(txn_id)
            self._dirty = False
            self._sync_failed = False
        except lmdb.Error as exc:
            self._sync_failed = True
            self._degrade("sync_failed", repr(exc))

    def _probe(self) -> None:
        """An idle writer whose disk is not healthy commits a probe record (``meta``): healthy again once one
        commits.  While it is unhealthy the owner sheds the spills that would evict a readable block
        (``DiskTier.start_spills``), so with a full tier no spill would come to commit and end it.  A probe that
        fails is not counted again (the fault that made the disk unhealthy was); the next waits longer, up to
        ``BACKOFF_MAX_S``."""
        env = self._db.env
        if env is None:
            return
        try:
            if self.fault_hook is not None:
                self.fault_hook("probe")
            self._db.rw.acquire_shared()
            try:
                with env.begin(write=True, db=self._db.meta) as txn:
                    txn.put(b"probe", U64.pack(self._seq))
            finally:
                self._db.rw.release_shared()
            if self.opts.durability != "none":
                env.sync(True)
        except Exception as exc:   # noqa: BLE001 - still unhealthy; counted when it first failed
            self._backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff * 2))
            log.debug("disk tier %s: probe commit failed: %r", self.opts.path, exc)
            return
        self._backoff = 0.0
        self.healthy = True

    def _no_room(self, exc: BaseException) -> tuple[str, str]:
        """``(kind, message)`` of a payload that found no room (``disk_full``, ``slots_exhausted``): its
        spill fails alone.  Any other error is raised again: the whole batch fails and is retried."""
        kind = self._classify(exc)
        if kind not in ("disk_full", "slots_exhausted"):
            raise exc
        return kind, repr(exc)

    def _cover_pages(self) -> None:
        """After a commit (none running): data.mdb as long as LMDB's last page (see env.py).  A fault here
        is counted and logged as a degraded disk; the commit before it stands."""
        try:
            self._db.cover_pages()
        except Exception as exc:   # noqa: BLE001 - an I/O error (EIO, ENOSPC) or a bug: the writer goes on
            self._degrade(self._classify(exc), f"after a commit: {exc!r}")

    def _fail_ops(self, ops: list[Any], error: str) -> None:
        self._tombs.forget(op.token for op in ops if isinstance(op, Spill))
        for op in ops:
            if isinstance(op, Spill):
                self._answer(op, Report(op.token, JobKind.SPILL, False, error))
            elif isinstance(op, Flush):
                self._out.put(FlushDone(op.token, False, error))

    def _answer(self, op: Spill, r: Report) -> None:
        """Send a spill's report, or its group's once its last part is answered (writer thread)."""
        g = op.group
        if g is None:
            self._out.put(r)
            return
        done = g.answer(op.part, r)
        if done is not None:
            self._out.put(done)

    def _degrade(self, kind: str, msg: str) -> None:
        self.healthy = False
        self._on_error(kind, msg)
