"""TierManager: the owner of all bookkeeping, driven from the engine thread.

The manager owns the key index, the leases and the job records; movers own
nothing but the copies.  Every public method runs on the owner thread, returns
without waiting for I/O, and either does what it says or raises an error from
:mod:`tiered_kv.errors` *before* touching any state.

Invariants (see docs/architecture.md for the full table):

1. Every job returned by ``store``/``load`` is reported exactly once by
   ``poll()``/``wait()``.
2. A worker report is applied only if its token names a live, PENDING job whose
   source is unchanged; otherwise it is discarded and counted in
   ``tiered_kv_stale_callbacks_total{kind,reason}``, never raised.
3. A host slot leased to a job is never reused before that job's report has
   been applied; a device row with a load in flight is fenced
   (``free_block`` returns False, ``store``/``load`` on it raise) until the
   load's report has been applied.
4. Job records are dropped when their report is applied, so memory is bounded
   by ``max_inflight_jobs``.
"""

from __future__ import annotations

import collections
import logging
import operator
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from prometheus_client import CollectorRegistry

from .config import TieredKVConfig
from .disk import DiskStore, FlushDone
from .disktier import (SlotViews, TierViews, check_writer, disk_levels, evict_from_disk, finish_promote, finish_spill,
                       open_disk_tier, replay_recovered, start_spill)
from .errors import (
    BlockBusyError,
    ConfigError,
    DeviceTensorError,
    InvalidBlockError,
    InvalidJobError,
    InvalidKeyError,
    ManagerClosedError,
)
from .host import EntryState, HostEntry, HostIndex, TierIndex
from .jobs import Completion, Job, JobKind, JobState, StaleReason, TokenFactory
from .metrics import Metrics
from .movers import CompletionQueue, Mover, Report, Transfer, make_mover

__all__ = ["TierManager", "SUPPORTED_DTYPES", "MoverFactory"]

log = logging.getLogger(__name__)

SUPPORTED_DTYPES = frozenset(
    getattr(torch, n) for n in ("float16", "bfloat16", "float32", "float64", "int8", "uint8",
                                "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)
)

MoverFactory = Callable[[torch.Tensor, torch.Tensor, CompletionQueue], Mover]

_STORE, _LOAD, _SPILL, _PROMOTE = JobKind.STORE, JobKind.LOAD, JobKind.SPILL, JobKind.PROMOTE
# enum members as module constants: reading one through its class costs ~0.1 us, on every job
_PENDING, _CANCELLING, _DONE, _FAILED, _CANCELLED = (JobState.PENDING, JobState.CANCELLING, JobState.DONE,
                                                   JobState.FAILED, JobState.CANCELLED)
_R_CANCELLED, _R_SUPERSEDED, _R_SOURCE_REUSED, _R_UNKNOWN_TOKEN = (StaleReason.CANCELLED, StaleReason.SUPERSEDED,
                                                                  StaleReason.SOURCE_REUSED, StaleReason.UNKNOWN_TOKEN)
_D2H, _H2D = ("device", "host"), ("host", "device")
_INTERNAL = frozenset({_SPILL, _PROMOTE})  # jobs the manager starts itself; never returned to the engine
_CANCELLED_ERROR = {r: f"cancelled ({r.value})" for r in StaleReason}
_tuple_new = tuple.__new__  # Completion(...) without the generated __new__: a Python frame less per job
# what poll()/wait() prepare for the next engine step, so that store() and load() neither evict nor
# build a token in the engine's call: free host slots (auto: at most this many) and tokens
_EVICT_AHEAD_MAX = 64
_TOKEN_POOL = 64  # refilled at each poll with as many as were taken: the poll's work follows its step's


class _Flight:
    """A job whose worker report has not been applied yet, with its leases."""

    __slots__ = ("job", "entry", "gen", "transfer", "dentry", "waiters", "promote")

    def __init__(self, job: Job, entry: HostEntry, gen: int, transfer: Optional[Transfer],
                 dentry: Optional[HostEntry] = None) -> None:
        self.job = job
        self.entry = entry        # the host entry written (store/promote) or read (load/spill)
        self.gen = gen            # the device row's generation when the job started
        self.transfer = transfer  # None for a load still waiting for its promote
        self.dentry = dentry      # the disk entry written (spill) or read (promote)
        self.waiters: list[_Flight] = []        # promote: loads waiting for it
        self.promote: Optional[_Flight] = None  # load: the promote it waits for


class TierManager(TierViews):
    """Moves KV blocks between the engine's device rows, a pinned host slab and LMDB.

    Not thread-safe by design: one owner thread (the engine's) calls every
    method; workers talk to it only through the completion queue.
    """

    def __init__(self, config: TieredKVConfig, device_blocks: torch.Tensor, *,
                 registry: Optional[CollectorRegistry] = None,
                 mover_factory: Optional[MoverFactory] = None) -> None:
        if not isinstance(config, TieredKVConfig):
            raise ConfigError(f"config must be a TieredKVConfig, got {type(config).__name__}")
        _check_device_blocks(device_blocks)
        self.config = config
        self.num_blocks = int(device_blocks.shape[0])
        self.row_bytes = int(device_blocks[0].numel() * device_blocks.element_size())
        num_slots = config.host_capacity_bytes // self.row_bytes
        if num_slots < 1:
            raise ConfigError(f"host_capacity_bytes={config.host_capacity_bytes} holds no block of "
                              f"{self.row_bytes} bytes")
        disk_blocks = config.disk_capacity_bytes // self.row_bytes
        if config.disk_path is not None and disk_blocks < 1:
            raise ConfigError(f"disk_capacity_bytes={config.disk_capacity_bytes} holds no block of "
                              f"{self.row_bytes} bytes")
        self.num_host_slots = num_slots
        ahead = config.host_evict_ahead_blocks
        if ahead is None:
            ahead = min(_EVICT_AHEAD_MAX, num_slots // 32)
        elif ahead >= num_slots:
            raise ConfigError(f"host_evict_ahead_blocks={ahead} must be below the host tier's {num_slots} slots "
                              f"(host_capacity_bytes={config.host_capacity_bytes} / {self.row_bytes}-byte blocks)")
        self._evict_ahead = ahead
        self._device_blocks = device_blocks
        self._dev_rows = device_blocks.view(torch.uint8).view(self.num_blocks, self.row_bytes)
        pin = config.pin_host_memory
        if pin is None:
            pin = bool(device_blocks.is_cuda and torch.cuda.is_available())
        elif pin and not torch.cuda.is_available():
            raise ConfigError("pin_host_memory=True needs CUDA, and torch.cuda.is_available() is False")
        elif not pin and device_blocks.is_cuda:
            log.warning("pin_host_memory=False with CUDA device_blocks: copies to and from a pageable host slab "
                        "are synchronous, so store() and load() will block the calling thread for each copy")
        self._host_rows = torch.empty((num_slots, self.row_bytes), dtype=torch.uint8, pin_memory=pin)
        self.metrics = Metrics(registry, config.namespace)
        self._index = HostIndex(num_slots)  # its eviction total is published once per poll
        self._completions = CompletionQueue()
        self._tokens = TokenFactory()
        # tokens made ahead at the end of each poll()/wait(): store() and load() take one from here
        self._token_pool: collections.deque[uuid.UUID] = collections.deque()
        self._owner_tag = object()
        self._max_key_bytes = config.max_key_bytes
        self._max_inflight = config.max_inflight_jobs
        self._appliers = {_STORE: self._apply_store, _LOAD: self._apply_load, _SPILL: self._apply_spill,
                          _PROMOTE: self._apply_promote}
        self._log_debug = log.isEnabledFor(logging.DEBUG)  # refreshed once per poll
        # token.int -> job awaiting its worker report: an int key hashes in C, a UUID calls UUID.__hash__
        self._jobs: dict[int, _Flight] = {}
        self._deliver: list[Job] = []                        # cancelled jobs to report at the next poll
        self._outbox: list[Completion] = []                  # applied, not yet returned by poll()/wait()
        self._row_gen = [0] * self.num_blocks                # bumped whenever a row's content is given up
        self._row_stores: dict[int, list[_Flight]] = {}      # row -> stores reading it (live jobs only)
        self._row_load: dict[int, _Flight] = {}              # row -> the load writing it (live jobs only)
        self._key_loads: dict[bytes, list[_Flight]] = {}     # key -> loads of that key (live jobs only)
        self._n_in_flight = {k: 0 for k in JobKind}
        self._flushes: dict[uuid.UUID, Optional[FlushDone]] = {}
        self._spill_faults = 0   # spills whose write failed (applied reports): flush() looks at what it applies
        self._closed = self._closing = False
        self._disk: Optional[DiskStore] = None
        self._dindex: Optional[TierIndex] = None
        self._disk_usable = False
        if mover_factory is None:
            self._mover: Mover = make_mover([(self._dev_rows, self._host_rows)], self._completions,
                                            config.num_copy_workers, config.num_copy_streams,
                                            config.copy_batch_max)
        else:
            self._mover = mover_factory(self._dev_rows, self._host_rows, self._completions)
        # a mover that queues transfers (CudaMover, ThreadMover with copy_batch_max > 1) starts a step's
        # copies, and those submitted while reports were applied (loads behind promotes), at the end of
        # each poll
        self._mover_flush: Optional[Callable[[], None]] = getattr(self._mover, "flush", None)
        self._slot_views = SlotViews(self._host_rows)
        m = self.metrics
        m.capacity["host"].set(num_slots * self.row_bytes)
        m.capacity["device"].set(self.num_blocks * self.row_bytes)
        if config.disk_path is not None:
            try:
                self._open_disk(disk_blocks)
            except BaseException:
                self._mover.close()
                raise
        self._refresh_gauges()
        log.info("tiered_kv manager: namespace=%s rows=%d row_bytes=%d host_slots=%d pinned=%s mover=%s disk=%s",
                 config.namespace, self.num_blocks, self.row_bytes, num_slots, pin, type(self._mover).__name__,
                 config.disk_path if self._disk is not None else None)

    def _open_disk(self, disk_blocks: int) -> None:
        self._disk, self._dindex = open_disk_tier(self.config, self.row_bytes, disk_blocks, self._completions,
                                                  self.metrics, self._on_disk_evict)
        self._disk_usable = self._disk is not None
        if self._disk is not None and self._dindex is not None:
            replay_recovered(self._disk, self._dindex, self.metrics)

    # ------------------------------------------------------------------ API
    def store(self, key: bytes, block: int) -> Optional[Job]:
        """Copy device row ``block`` to the host tier under ``key`` (and on to disk).

        Returns None when the key is already stored or being stored in any
        tier, or when the store is shed (no unleased host slot, too many jobs
        in flight).  With CUDA rows the copy goes to the device at the next
        ``poll()``/``wait()`` (``copy_batch_max``), behind the work then queued
        on the current stream; until the job is reported the row must hold the
        block (or be given up with ``free_block``, which discards the store).
        """
        if (self._closed or type(key) is not bytes or not key or len(key) > self._max_key_bytes
                or type(block) is not int or not 0 <= block < self.num_blocks):
            key, block = self._check_args(key, block)
        if block in self._row_load:
            raise BlockBusyError(f"block {block} has a load in flight; its content is not there yet")
        entry = self._index.get(key)
        if entry is not None:
            self._index.touch(entry)
            return None
        if self._dindex is not None and key in self._dindex:
            return None
        if len(self._jobs) >= self._max_inflight:
            return self._shed(_STORE, "inflight_limit")
        pool = self._token_pool
        token = pool.popleft() if pool else self._tokens()
        entry = self._index.reserve(key, token)
        if entry is None:
            return self._shed(_STORE, "host_full")
        job = Job(token, _STORE, key, block, _PENDING, None, None, self._owner_tag)
        fl = _Flight(job, entry, self._row_gen[block], Transfer(token, _STORE, [block], [entry.slot], False))
        self._jobs[token.int] = fl
        self._row_stores.setdefault(block, []).append(fl)
        self._n_in_flight[_STORE] += 1
        self._mover.submit(fl.transfer)  # type: ignore[arg-type]
        return job

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are ready in a lower tier (host or disk)."""
        if self._closed:
            self._check_open()  # raises
        if type(keys) is not list:
            if isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable):
                raise InvalidKeyError(f"keys must be a sequence of bytes, got {type(keys).__name__}")
            keys = list(keys)
        mk = self._max_key_bytes
        for k in keys:  # _check_key inline, as in store(); it raises
            if type(k) is not bytes or not k or len(k) > mk:
                self._check_key(k)
        run = self._index.ready_run
        n = host = run(keys)
        dindex = self._dindex
        if dindex is not None:
            total = len(keys)
            while n < total:   # a key only on disk, then maybe host keys again
                d = dindex.ready(keys[n])
                if d is None:
                    break
                dindex.touch(d)
                end = run(keys, n + 1)
                host += end - n - 1
                n = end
        m = self.metrics  # counted like the per-job counters: applied at the end of the next poll()
        m.count(m.lookups, len(keys))
        if host:
            m.count(m.hits["host"], host)
        if n > host:
            m.count(m.hits["disk"], n - host)
        return n

    def load(self, key: bytes, block: int) -> Optional[Job]:
        """Copy ``key``'s bytes into device row ``block`` (via the host tier).

        Returns None when the key is not ready in a lower tier (or the load is
        shed).  Until the returned job is reported, the row is fenced.  With
        CUDA rows the copy goes to the device at the next ``poll()``/``wait()``,
        behind the work then queued on the current stream.  A key only on disk
        is read back into the host tier first; that read, too, starts at the
        next ``poll()``/``wait()`` (with the step's other reads, as one batch).
        """
        if (self._closed or type(key) is not bytes or not key or len(key) > self._max_key_bytes
                or type(block) is not int or not 0 <= block < self.num_blocks):
            key, block = self._check_args(key, block)
        if block in self._row_load:
            raise BlockBusyError(f"block {block} already has a load in flight")
        entry = self._index.get(key)
        promote: Optional[_Flight] = None
        d: Optional[HostEntry] = None   # the disk entry to promote, when the key is only on disk
        if entry is not None and entry.state is not EntryState.READY:
            promote = self._jobs.get(entry.writer.int)
            if promote is None or promote.job.kind is not _PROMOTE:
                return None  # being stored from a device row: not in a lower tier yet
        elif entry is None:
            d = self._dindex.ready(key) if self._dindex is not None else None
            if d is None:
                return None
        if len(self._jobs) >= self._max_inflight:
            return self._shed(_LOAD, "inflight_limit")
        if d is not None:
            promote = self._start_promote(key, d)
            if promote is None:
                return None
        # the load overwrites the row: stores still reading it lose their source
        self._give_up_row(block)
        pool = self._token_pool
        token = pool.popleft() if pool else self._tokens()
        job = Job(token, _LOAD, key, block, _owner=self._owner_tag)
        if promote is not None:
            fl = _Flight(job, promote.entry, self._row_gen[block], None)
            fl.promote = promote
            promote.waiters.append(fl)
        else:
            assert entry is not None
            self._index.acquire(entry)
            fl = _Flight(job, entry, self._row_gen[block], Transfer(token, _LOAD, [block], [entry.slot]))
        self._jobs[token.int] = fl
        self._row_load[block] = fl
        self._key_loads.setdefault(key, []).append(fl)
        self._n_in_flight[_LOAD] += 1
        if fl.transfer is not None:
            self._mover.submit(fl.transfer)
        return job

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: idempotent, valid in any state at any time."""
        if self._closed:
            self._check_open()  # raises
        if not isinstance(job, Job) or job._owner is not self._owner_tag or job.kind in _INTERNAL:
            raise InvalidJobError(f"not a job of this manager: {job!r}")
        if job.state is _PENDING and not self._issued(job):
            raise InvalidJobError(f"not a job this manager returned (a copy of one?): {job!r}")
        self._cancel(job, _R_CANCELLED)

    def free_block(self, block: int) -> bool:
        """The engine is about to reuse row ``block``.

        Cancels the stores reading it.  Returns False while a load into it is
        in flight: that load is cancelled too, and the row must not be written
        until its completion has been reported (call again after ``poll()``).
        """
        self._check_open()
        block = self._check_block(block)
        self._give_up_row(block)
        fl = self._row_load.get(block)
        if fl is not None:
            self._cancel(fl.job, _R_CANCELLED)
        return block not in self._row_load

    def invalidate(self, key: bytes) -> None:
        """Remove ``key`` from every tier; it is never served again until stored again."""
        self._check_open()
        key = self._check_key(key)
        entry = self._index.get(key)
        if entry is not None:
            if entry.state is EntryState.WRITING:
                fl = self._jobs.get(entry.writer.int)
                if fl is not None:
                    self._cancel(fl.job, _R_SUPERSEDED)
            self._index.remove(entry)
        for fl in list(self._key_loads.get(key, ())):
            self._cancel(fl.job, _R_SUPERSEDED)
        if self._dindex is not None:
            d = self._dindex.get(key)
            if d is not None:
                spill = self._jobs.get(d.writer.int) if d.state is EntryState.WRITING else None
                if spill is not None:
                    self._cancel(spill.job, _R_SUPERSEDED)
                else:
                    self._dindex.remove(d)
                    self._disk.cancel(d.writer, key)  # type: ignore[union-attr]

    def poll(self) -> list[Completion]:
        """Apply every worker report that has arrived; return the jobs now reported."""
        if self._closed:
            self._check_open()  # raises
        self._poll(True)
        out, self._outbox = self._outbox, []
        return out

    def wait(self, jobs: Optional[Iterable[Job]] = None, timeout: Optional[float] = None) -> list[Completion]:
        """Block until ``jobs`` are reported; with None, until every store and load is
        reported and every worker report applied (no slot or row leased to a copy, no
        read from disk in flight).

        Returns every completion applied meanwhile (also of other jobs).  On
        timeout returns what was applied so far; check ``job.done``.
        """
        self._check_open()
        timeout = _check_timeout(timeout)
        if jobs is None:
            # quiescence: every store/load reported *and* every worker report in, so no
            # slot or row is still leased to a copy or a read (spills are flush()'s business).
            # A promote counts even when no load waits for it any more (its loads were
            # cancelled): its read still writes a host slot until its report is applied
            n = self._n_in_flight
            self._block_until(lambda: n[_STORE] == 0 and n[_LOAD] == 0 and n[_PROMOTE] == 0
                              and not self._deliver, timeout)
            out, self._outbox = self._outbox, []
            return out
        if isinstance(jobs, Job) or not isinstance(jobs, Iterable):
            raise InvalidJobError(f"jobs must be an iterable of Job or None, got {type(jobs).__name__}: {jobs!r:.120}")
        targets = list(jobs)
        for j in targets:
            if not isinstance(j, Job) or j._owner is not self._owner_tag:
                raise InvalidJobError(f"not a job of this manager: {j!r:.120}")
            if not j.state.terminal and not self._issued(j):  # a copy would never be reported: wait() would hang
                raise InvalidJobError(f"not a job this manager returned (a copy of one?): {j!r:.120}")
        first = [0]  # targets before this index are known to be reported

        def all_reported() -> bool:
            i = first[0]
            while i < len(targets) and targets[i].state.terminal:
                i += 1
            first[0] = i
            return i == len(targets)

        self._block_until(all_reported, timeout)
        out, self._outbox = self._outbox, []
        return out

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Block until every spill submitted so far is durable (at the configured level) or discarded.

        Returns True at once without a disk tier; False on timeout or when the
        disk tier failed to commit a write it covers (the fault is counted): a
        batch that failed after it was asked for, or a spill whose failure had
        not been applied by an earlier ``poll()``.  Completions applied
        meanwhile are returned by the next ``poll()``.
        """
        self._check_open()
        timeout = _check_timeout(timeout)
        if self._disk is None:
            return True
        if not self._disk.writer_alive():
            self._poll(True)
            return False
        # a spill that failed before the flush was queued, but whose report this call is the first to
        # apply, is covered too: the writer's own check sees only batches failing after the marker
        faults = self._spill_faults
        self._poll()  # stores already copied get their spills queued ahead of the flush marker
        token = self._tokens()
        self._flushes[token] = None
        self._disk.submit_flush(token)
        self._block_until(lambda: self._flushes[token] is not None, timeout)
        done = self._flushes.pop(token)
        return bool(done is not None and done.ok and self._spill_faults == faults)

    def close(self) -> None:
        """Let in-flight copies and writes finish, apply their reports, stop the workers.  Idempotent."""
        if self._closed:
            return
        self._closing = True
        if self._disk is not None:  # promotes may still hand loads to the mover
            self._block_until(lambda: self._n_in_flight[_PROMOTE] == 0, 30.0)
        self._mover.close()
        self._poll()
        if self._disk is not None:
            self._block_until(lambda: self._n_in_flight[_SPILL] == 0, 30.0)
            self._disk.close()
            self._poll()
        self._closed = True
        log.info("tiered_kv manager closed: namespace=%s", self.config.namespace)

    def __enter__(self) -> "TierManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ read-only views
    @property
    def jobs_in_flight(self) -> int:
        """Jobs whose worker report has not been applied (including cancelled and internal ones)."""
        return len(self._jobs)

    @property
    def host_used_slots(self) -> int:
        return self._index.used_slots

    @property
    def disk_healthy(self) -> bool:
        return self._disk is not None and self._disk.healthy and self._disk.writer_alive()

    def debug_sizes(self) -> dict[str, int]:
        """Sizes of every internal table: all must stay bounded over a long run."""
        return {
            "jobs": len(self._jobs),
            "deliver": len(self._deliver),
            "outbox": len(self._outbox),
            "row_stores": len(self._row_stores),
            "row_load": len(self._row_load),
            "key_loads": len(self._key_loads),
            "flushes": len(self._flushes),
            "host_entries": len(self._index),
            "host_used_slots": self._index.used_slots,
            "disk_entries": self.disk_blocks,
            "disk_tombstones": self._disk.tombstones if self._disk is not None else 0,
        }

    def host_bytes(self, key: bytes) -> Optional[torch.Tensor]:
        """A copy of ``key``'s bytes in the host tier if READY (for tests and tools)."""
        entry = self._index.ready(self._check_key(key))
        return None if entry is None else self._host_rows[entry.slot].clone()

    # ------------------------------------------------------------ internals: reports
    def _poll(self, last: bool = False) -> None:
        """Apply what has arrived.  ``last``: the final pass of an API call (``poll()``, the end of a
        ``wait()``/``flush()``), which also prepares the next engine step: free host slots and tokens."""
        self._log_debug = log.isEnabledFor(logging.DEBUG)
        if self._disk is not None:
            self._disk.start_reads()   # the promotes load() queued since the last pass, as one batch
        self._mover.harvest()
        apply = self._apply
        for report in self._completions.drain():
            apply(report)
        if self._deliver:
            self._deliver_cancelled()
        if self._disk is not None:
            self._disk_usable = check_writer(self._disk, self._disk_usable, self._closing)
            if self.config.write_mode == "back":
                self._writeback_tick()
        if self._mover_flush is not None:
            self._mover_flush()
        if last:
            # prepare the next engine step, so that its store() and load() calls neither evict nor build
            # a token; only the last pass of an API call does it, so a wait() evicts for the state it
            # leaves, not for one it passed through (the state machines model exactly that)
            if self._evict_ahead:
                self._index.evict_ahead(self._evict_ahead)
            if len(self._token_pool) < _TOKEN_POOL:
                self._refill_tokens()
        self._refresh_gauges()

    def _refill_tokens(self) -> None:
        # popleft() takes the oldest: tokens are issued in the order they were made
        make = self._tokens
        self._token_pool.extend(make() for _ in range(_TOKEN_POOL - len(self._token_pool)))

    def _deliver_cancelled(self) -> None:
        if self._deliver:
            pending, self._deliver = self._deliver, []
            for job in pending:
                self._finish_cancelled(job)

    def _block_until(self, done: Callable[[], bool], timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        slice_s = 0.0005 if self._mover.polled else None
        # a mover whose copies wait in a queue for worker threads (ThreadMover) lets this thread run
        # them while it would otherwise sleep: no thread wake-up per copy and per report
        help_copy: Optional[Callable[[], bool]] = getattr(self._mover, "help_one", None)
        # and the copies this thread submits from here on (loads behind promotes) wait for it instead
        # of waking a worker: two threads copying beside a disk reader over-subscribe a small machine
        # (warm promotes: about +12% GB/s).  Whatever is left when this returns goes to the workers.
        hold: Optional[Callable[[bool], None]] = getattr(self._mover, "hold", None)
        if hold is not None:
            hold(True)
        try:
            self._poll()
            last_full = time.monotonic()
            while not done():
                now = time.monotonic()
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    return
                if help_copy is not None and help_copy():
                    # copy on while copies are queued, for up to 2 ms: their reports wait in the queue and
                    # are applied together below (applying each between two copies holds the GIL the
                    # workers need), then done() is checked again
                    until = now + 0.002 if deadline is None else min(now + 0.002, deadline)
                    while time.monotonic() < until and help_copy():
                        pass
                    report = None
                else:
                    step = remaining if slice_s is None else (slice_s if remaining is None else min(slice_s, remaining))
                    if step is None or step > 0.5:
                        step = 0.5  # wake up now and then to notice a dead disk writer
                    report = self._completions.get(step)
                if report is not None:
                    self._apply(report)
                if now - last_full >= 0.002:
                    self._poll()
                    last_full = now
                else:
                    # reports come one at a time while copies finish: apply them, but leave the
                    # per-poll bookkeeping (gauges, writer check) to every few ms -- each wake-up
                    # holds the GIL that the copy workers need between two copies
                    self._mover.harvest()
                    for r in self._completions.drain():
                        self._apply(r)
                    self._deliver_cancelled()
        finally:
            if hold is not None:
                hold(False)
            self._poll(True)

    def _apply(self, r: Any) -> None:
        if isinstance(r, FlushDone):
            if r.token in self._flushes:
                self._flushes[r.token] = r
            if not r.ok:
                self.metrics.error("disk", "flush_failed")
            return
        try:
            fl = self._jobs.pop(r.token.int, None)
        except AttributeError:  # not a token at all (a foreign or broken mover): nothing of ours either
            fl = None
        if fl is None:
            self._stale(r.kind, _R_UNKNOWN_TOKEN, r.token)
            return
        kind = fl.job.kind
        self._n_in_flight[kind] -= 1
        self._appliers[kind](fl, r)

    def _apply_store(self, fl: _Flight, r: Report) -> None:
        job, entry = fl.job, fl.entry
        self._drop_row_store(fl)
        if job.state is not _PENDING:  # cancelled: delivered or queued for delivery
            self._stale(_STORE, job.cancel_reason or _R_CANCELLED, job.token)
            self._index.writer_done(entry)
            return
        if not r.ok:
            self._index.writer_done(entry)
            self._index.abort(entry)
            self._fail(job, r, "host")
            return
        if fl.gen != self._row_gen[job.block]:  # defence in depth: free_block already cancels
            self._index.writer_done(entry)
            self._index.abort(entry)
            self._stale(_STORE, _R_SOURCE_REUSED, job.token)
            job._move(_CANCELLING)
            job.cancel_reason = _R_SOURCE_REUSED
            self._finish_cancelled(job)
            return
        self._index.publish(entry)
        self._ok(job, r, _D2H)
        if self._disk is not None and self.config.write_mode == "through":
            if self._disk_usable:
                self._start_spill(entry)
            else:
                self._shed(_SPILL, "disk_down")

    def _apply_load(self, fl: _Flight, r: Report) -> None:
        job = fl.job
        self._unfence_load(fl)
        self._index.release(fl.entry)
        if job.state is not _PENDING:
            self._stale(_LOAD, job.cancel_reason or _R_CANCELLED, job.token)
            self._finish_cancelled(job)
        elif not r.ok:
            self._fail(job, r, "device")
        else:
            self._ok(job, r, _H2D)

    def _apply_spill(self, fl: _Flight, r: Report) -> None:
        job, d = fl.job, fl.dentry
        assert d is not None and self._dindex is not None
        self._index.release(fl.entry)
        if job.state is not _PENDING:
            self._stale(_SPILL, job.cancel_reason or _R_CANCELLED, job.token)
            self._dindex.writer_done(d)
            job._move(_CANCELLED)
            self.metrics.count(self.metrics.job_outcome[(_SPILL, "cancelled")])
            return
        job._move(_DONE if r.ok else _FAILED)
        if finish_spill(self._dindex, self.metrics, d, r):
            self._spill_faults += 1

    def _apply_promote(self, fl: _Flight, r: Report) -> None:
        job, entry, d = fl.job, fl.entry, fl.dentry
        assert d is not None and self._dindex is not None and self._disk is not None
        self._dindex.release(d)
        m = self.metrics
        if job.state is not _PENDING:  # invalidated meanwhile
            self._stale(_PROMOTE, job.cancel_reason or _R_SUPERSEDED, job.token)
            self._index.writer_done(entry)
            job._move(_CANCELLED)
            m.count(m.job_outcome[(_PROMOTE, "cancelled")])
            for w in fl.waiters:
                self._cancel(w.job, job.cancel_reason or _R_SUPERSEDED)
            return
        job._move(_DONE if r.ok else _FAILED)
        finish_promote(self._disk, self._index, self._dindex, m, entry, d, r)
        if not r.ok:
            for w in list(fl.waiters):
                self._fail_waiter(w, r.error or "miss")
            return
        for w in fl.waiters:
            w.promote = None
            if w.job.state is _PENDING and entry.live:
                self._index.acquire(entry)
                w.transfer = Transfer(w.job.token, _LOAD, [w.job.block], [entry.slot])
                self._mover.submit(w.transfer)
            elif w.job.state is _PENDING:  # invalidated between: cancel() already handled it
                self._fail_waiter(w, "superseded")
        fl.waiters = []

    def _fail_waiter(self, w: _Flight, error: str) -> None:
        """A load whose promote failed: nothing will reach its row, report it now."""
        w.promote = None
        if self._jobs.pop(w.job.token.int, None) is not None:
            self._n_in_flight[_LOAD] -= 1
        self._unfence_load(w)
        if w.job.state is _PENDING:
            self._fail(w.job, Report(w.job.token, _LOAD, False, error), "disk")

    def _ok(self, job: Job, r: Report, link: tuple[str, str]) -> None:
        # callers apply only PENDING jobs, and PENDING -> DONE is always allowed (jobs.ALLOWED_MOVES)
        job.state = _DONE
        self.metrics.moved(job.kind, link, r.nbytes, r.seconds)
        self._outbox.append(_tuple_new(Completion, (job, True, None)))

    def _fail(self, job: Job, r: Report, tier: str) -> None:
        job._move(_FAILED)
        job.error = r.error or "failed"
        self.metrics.count(self.metrics.job_outcome[(job.kind, "failed")])
        if not job.error.startswith("miss"):
            self.metrics.error(tier, "copy_failed")
            log.warning("%s job %s for key %r failed: %s", job.kind, job.token, job.key, job.error)
        self._outbox.append(Completion(job, False, f"failed: {job.error}"))

    def _finish_cancelled(self, job: Job) -> None:
        job._move(_CANCELLED)
        job.error = _CANCELLED_ERROR[job.cancel_reason or _R_CANCELLED]
        self.metrics.count(self.metrics.job_outcome[(job.kind, "cancelled")])
        self._outbox.append(_tuple_new(Completion, (job, False, job.error)))

    # ------------------------------------------------------------ internals: cancellation
    def _cancel(self, job: Job, reason: StaleReason) -> None:
        if job.state is not _PENDING:
            return
        fl = self._jobs.get(job.token.int)
        if fl is None:  # pragma: no cover - a PENDING job always has a record
            raise AssertionError(f"pending job without record: {job!r}")
        job.state = _CANCELLING  # PENDING -> CANCELLING, checked just above (jobs.ALLOWED_MOVES)
        job.cancel_reason = reason
        if fl.transfer is not None:
            fl.transfer.cancelled = True
        kind = job.kind
        if kind is _STORE:
            # its result will be discarded: forget the key now, keep the slot leased until the report
            self._drop_row_store(fl)
            self._index.abort(fl.entry)
            self._deliver.append(job)
        elif kind is _LOAD:
            if fl.promote is not None:
                # still waiting for its promote: nothing can reach the row, so report it now
                fl.promote.waiters.remove(fl)
                fl.promote = None
                del self._jobs[job.token.int]
                self._n_in_flight[_LOAD] -= 1
                self._unfence_load(fl)
                self._deliver.append(job)
            # else: stays fenced in _row_load until its worker has reported
        elif kind is _SPILL:
            assert fl.dentry is not None and self._dindex is not None and self._disk is not None
            self._dindex.abort(fl.dentry)
            self._disk.cancel(job.token, job.key)
        else:  # promote: the key was invalidated; the host entry is dropped by the caller
            self._index.abort(fl.entry)
            for w in list(fl.waiters):
                self._cancel(w.job, reason)

    def _issued(self, job: Job) -> bool:
        """``job`` (not yet reported) is the very object this manager returned: its record holds it,
        or it waits in ``_deliver`` (a load cancelled while it waited for its promote).  A copy of a
        Job carries the same token and owner tag, but the manager would report the original."""
        fl = self._jobs.get(job.token.int)
        return (fl is not None and fl.job is job) or any(d is job for d in self._deliver)

    def _unfence_load(self, fl: _Flight) -> None:
        job = fl.job
        if self._row_load.get(job.block) is fl:
            del self._row_load[job.block]
        loads = self._key_loads.get(job.key)
        if loads is not None and fl in loads:
            loads.remove(fl)
            if not loads:
                del self._key_loads[job.key]

    def _give_up_row(self, block: int) -> None:
        self._row_gen[block] += 1
        stores = self._row_stores.pop(block, None)
        if stores:
            for fl in list(stores):
                self._cancel(fl.job, _R_SOURCE_REUSED)

    def _drop_row_store(self, fl: _Flight) -> None:
        stores = self._row_stores.get(fl.job.block)
        if stores is not None and fl in stores:
            stores.remove(fl)
            if not stores:
                del self._row_stores[fl.job.block]

    # ------------------------------------------------------------ internals: disk
    def _start_spill(self, entry: HostEntry) -> None:
        """Write a READY host entry to disk (internal SPILL job); shed and count when it cannot."""
        assert self._dindex is not None and self._disk is not None
        token = self._tokens()
        d = start_spill(self._disk, self._dindex, self._index, entry, token, self._slot_views[entry.slot])
        if isinstance(d, str):
            self._shed(_SPILL, d)
            return
        entry.spilled = True  # this residency is on disk or on its way: write-back never spills it again
        if d is not None:
            job = Job(token, _SPILL, entry.key, -1, _owner=self._owner_tag)
            self._jobs[token.int] = _Flight(job, entry, 0, None, d)
            self._n_in_flight[_SPILL] += 1

    def _start_promote(self, key: bytes, d: HostEntry) -> Optional[_Flight]:
        """Read ``key`` (its READY disk entry ``d``) from disk into a new host slot (internal PROMOTE job)."""
        assert self._dindex is not None and self._disk is not None
        pool = self._token_pool  # on load()'s path: a token made ahead, as for the load itself
        token = pool.popleft() if pool else self._tokens()
        entry = self._index.reserve(key, token)
        if entry is None:
            self._shed(_LOAD, "host_full")
            return None
        self._dindex.acquire(d)
        job = Job(token, _PROMOTE, key, -1, _owner=self._owner_tag)
        fl = _Flight(job, entry, 0, None, d)
        self._jobs[token.int] = fl
        self._n_in_flight[_PROMOTE] += 1
        # held until this poll()/wait(): no reader woken inside the engine's call, and the reader
        # gets the step's reads as one batch, in file order from the start
        self._disk.queue_promote(token, key, d.writer, self._slot_views[entry.slot])
        return fl

    def _writeback_tick(self) -> None:
        """Write-back mode: spill the coldest host entries not yet on disk once the host is 3/4 full.

        Each host residency is spilled at most once (``HostEntry.spilled``): with a disk tier smaller
        than the host tier, each spill evicts a disk entry whose key is still on the host, and
        spilling "whatever is not on disk" would rewrite the same blocks at every poll.  Nothing is
        started while the manager closes, so ``close()`` waits only for the spills already running.
        """
        if (not self._disk_usable or self._closing
                or self._index.used_slots * 4 < self._index.num_slots * 3):
            return
        budget = 8
        for entry in self._index.coldest(64):
            if budget == 0 or self._disk.queue_depth >= self.config.writer_queue_blocks:  # type: ignore[union-attr]
                break
            if not entry.spilled and entry.key not in self._dindex:  # type: ignore[operator]
                self._start_spill(entry)
                budget -= 1

    def _on_disk_evict(self, d: HostEntry) -> None:
        evict_from_disk(self._disk, self.metrics, d)  # type: ignore[arg-type]

    # ------------------------------------------------------------ internals: misc
    def _stale(self, kind: JobKind, reason: StaleReason, token: uuid.UUID) -> None:
        self.metrics.count(self.metrics.stale[(kind, reason)])
        if self._log_debug:
            log.debug("discarded stale %s report for token %s: %s", kind, token, reason)

    def _shed(self, kind: JobKind, why: str) -> None:
        # counted in the batch applied at the end of poll(): under overload every store() may shed
        m = self.metrics
        m.count(m.job_outcome[(kind, "shed")])
        m.count(m.shed[(kind, why)])
        if self._log_debug:
            log.debug("%s shed: %s", kind, why)
        return None

    def _refresh_gauges(self) -> None:
        """Push batched counters and changed gauge values (once per poll, not per job)."""
        self.metrics.publish_levels(self._index.used_slots * self.row_bytes, len(self._index), self._n_in_flight,
                                    disk_levels(self._disk, self._dindex, self.row_bytes, self._disk_usable),
                                    self._index.evictions)

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the TierManager is closed")

    def _check_args(self, key: Any, block: Any) -> tuple[bytes, int]:
        """store()/load(): their fast path tests the common case in one condition (the engine calls
        them per block) and comes here otherwise, which raises naming the bad value, or returns the
        key and the block as an int (e.g. a numpy integer)."""
        self._check_open()
        return self._check_key(key), self._check_block(block)

    def _check_key(self, key: Any) -> bytes:
        if type(key) is not bytes:
            raise InvalidKeyError(f"key must be bytes, got {type(key).__name__}: {key!r:.80}")
        if not key:
            raise InvalidKeyError("key must not be empty: b''")
        if len(key) > self._max_key_bytes:   # the same bound store()'s inline check uses
            raise InvalidKeyError(f"key of {len(key)} bytes exceeds max_key_bytes={self._max_key_bytes}: {key!r:.80}")
        return key

    def _check_block(self, block: Any) -> int:
        if isinstance(block, bool):
            raise InvalidBlockError(f"block must be an int, got bool {block!r}")
        try:
            b = operator.index(block)
        except TypeError:
            raise InvalidBlockError(f"block must be an int, got {type(block).__name__}: {block!r:.80}") from None
        if not 0 <= b < self.num_blocks:
            raise InvalidBlockError(f"block {b} out of range [0, {self.num_blocks})")
        return b


def _check_timeout(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ConfigError(f"timeout must be None or a number >= 0, got {timeout!r}")
    return float(timeout)


def _check_device_blocks(t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise DeviceTensorError(f"device_blocks must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise DeviceTensorError(f"device_blocks dtype {t.dtype} is not supported; use one of "
                                f"{sorted(str(d) for d in SUPPORTED_DTYPES)}")
    if t.dim() < 2:
        raise DeviceTensorError(f"device_blocks must be [num_blocks, ...] with >= 2 dims, got shape {tuple(t.shape)}")
    if t.shape[0] < 1 or t[0].numel() < 1:
        raise DeviceTensorError(f"device_blocks must have >= 1 non-empty row, got shape {tuple(t.shape)}")
    if t.device.type not in ("cpu", "cuda"):
        raise DeviceTensorError(f"device_blocks must be on cpu or cuda, got {t.device}")
    if not t.is_contiguous():
        raise DeviceTensorError(f"device_blocks rows must be contiguous, got shape {tuple(t.shape)} "
                                f"strides {t.stride()}")
    if t.requires_grad:
        raise DeviceTensorError("device_blocks must not require grad")
