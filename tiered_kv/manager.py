"""TierManager: the per-key and per-batch engine API over the tier core.

The front end of :class:`~tiered_kv.core.TierCore` for an engine that owns a
device KV tensor: it maps device rows onto core jobs and keeps what only rows
have -- the fences of rows a load writes, the stores reading each row, the
mover that copies between rows and host slots, and the completions it reports.
Every tier decision (which slot, which key, spill, promote, eviction, stale and
shed accounting) is the core's.  Every public method runs on the owner thread,
returns without waiting for I/O, and either does what it says or raises an
error from :mod:`tiered_kv.errors` *before* touching any state.

Invariants (docs/architecture.md has the table and where each is enforced):

1. Every job returned by ``store``/``load``/``store_many``/``load_many`` is
   reported exactly once by ``poll()``/``wait()`` (``_outbox``, ``_deliver``).
2. A worker report is applied only to the live job its token names (the core),
   and a store reading a row is cancelled when the row is given up
   (``_give_up_row``): its report is discarded and counted, never raised.
3. A row with a load in flight is fenced (``_row_load``): ``free_block`` returns
   False, ``store``/``load`` on it raise, until the load's report was applied.

Longer than the project's usual 500 lines: the public API's docstrings are the
user's reference (README and docs/architecture.md point here), and the blocking
calls (``wait``/``flush``/``close``) share ``_block_until`` with it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque as _deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from prometheus_client import CollectorRegistry

from .config import TieredKVConfig
from .core import CLOSE_TIMEOUT_S, TierCore
from .core.tiers import Applied
from .core import POLL_SLICE_S as _POLL_SLICE_S, WAKE_S as _WAKE_S
from .checks import (SUPPORTED_DTYPES, check_block, check_device_blocks, check_key, check_many, check_mover_factory,
                     check_registry, check_timeout, NOT_SEQUENCES, pin_decision, plain_alias)
from .errors import BlockBusyError, ConfigError, InvalidJobError, InvalidKeyError, ManagerClosedError
from .disk.proc import SharedHost
from .hostmem import make_shared_rows, prepare_host_memory, register_pinned, unregister_pinned
from .jobs import Completion, Job, JobKind, JobState, StaleReason
from .metrics import Metrics
from .movers import CompletionQueue, Mover, Report, Transfer, make_mover

__all__ = ["TierManager", "SUPPORTED_DTYPES", "MoverFactory"]

log = logging.getLogger(__name__)

MoverFactory = Callable[[torch.Tensor, torch.Tensor, CompletionQueue], Mover]

_STORE, _LOAD, _SPILL, _PROMOTE, _FETCH = JobKind.STORE, JobKind.LOAD, JobKind.SPILL, JobKind.PROMOTE, JobKind.FETCH
# enum members as module constants: reading one through its class costs a dict lookup more, on every job
_PENDING, _CANCELLING, _DONE, _FAILED, _CANCELLED = (JobState.PENDING, JobState.CANCELLING, JobState.DONE,
                                                   JobState.FAILED, JobState.CANCELLED)
_R_CANCELLED, _R_SUPERSEDED, _R_SOURCE_REUSED = (StaleReason.CANCELLED, StaleReason.SUPERSEDED,
                                                 StaleReason.SOURCE_REUSED)
_D2H, _H2D = ("device", "host"), ("host", "device")
_INTERNAL = frozenset({_SPILL, _PROMOTE})  # jobs the core starts itself; never returned to the engine
_CANCELLED_ERROR = {r: f"cancelled ({r.value})" for r in StaleReason}
_tuple_new = tuple.__new__  # Completion(...) without the generated __new__: a Python frame less per job


def _copy_queued(job: Job) -> bool:
    """The mover took ``job``'s copy (its report will come); a load may still name the last read it waited for
    then, until the core's pass over that read's report ends (``TierCore._promote_reported``)."""
    t = job._transfer
    return t is not None and t.taken


_HELP_SLICE_S = 0.002
"""While blocking, the owner copies for at most this long before it applies the reports and checks again."""


def _consume(it: Iterable[Any]) -> None:
    """Run an iterator to its end in C (``collections.deque(it, maxlen=0)``)."""
    _deque(it, 0)


def _add_job(m: dict[Any, Any], ks: Sequence[Any], job: Job) -> None:
    """Record ``job`` under each of ``ks`` in a map whose values are one job, or a list of the jobs
    where several share a key (the rare case: one store per row, one load per key is the rule)."""
    if len(ks) == 1 and m.setdefault(ks[0], job) is job:   # store()/load(): one key, not held (a C call)
        return
    if m.keys().isdisjoint(ks):
        m.update(dict.fromkeys(ks, job))   # one C loop
        return
    for k in ks:
        held = m.setdefault(k, job)
        if held is not job:
            if type(held) is list:
                held.append(job)
            else:
                m[k] = [held, job]


def _jobs_of(held: Any) -> Sequence[Job]:
    """The jobs a map of :func:`_add_job` holds under one key (``held``: its value, or None), as a new
    sequence: the caller may change the map while it goes through them."""
    return () if held is None else list(held) if type(held) is list else (held,)


def _drop_job(m: dict[Any, Any], ks: Sequence[Any], job: Job) -> None:
    """Undo :func:`_add_job` for ``job`` under ``ks`` (keys it is no longer under are passed over)."""
    if len(ks) == 1 and m.get(ks[0]) is job:   # store()/load(): one key, the job alone under it
        del m[ks[0]]
        return
    if list(map(m.get, ks)).count(job) == len(ks):
        _consume(map(m.pop, ks))   # the job alone under each key: one C loop
        return
    for k in ks:
        held = m.get(k)
        if held is job:
            del m[k]
        elif type(held) is list:
            if job in held:
                held.remove(job)
            if len(held) <= 1:   # (also a list an interrupted pass left so)
                if held:
                    m[k] = held[0]
                else:
                    del m[k]


def _slots(entries: list[Any]) -> list[int]:
    """The slots of a job's entries (one key written out: a list comprehension is a call of its own)."""
    if len(entries) == 1:
        return [entries[0].slot]
    return [e.slot for e in entries]


class TierManager:
    """Moves KV blocks between the engine's device rows, a pinned host slab and LMDB.

    Not thread-safe by design: one owner thread (the engine's) calls every
    method; workers talk to it only through the completion queue.
    """

    def __init__(self, config: TieredKVConfig, device_blocks: torch.Tensor, *,
                 registry: Optional[CollectorRegistry] = None,
                 mover_factory: Optional[MoverFactory] = None) -> None:
        if not isinstance(config, TieredKVConfig):
            raise ConfigError(f"config must be a TieredKVConfig, got {type(config).__name__}")
        check_device_blocks(device_blocks)
        check_registry(registry)
        check_mover_factory(mover_factory)
        self.config = config
        self.num_blocks = int(device_blocks.shape[0])
        self.row_bytes = int(device_blocks[0].numel() * device_blocks.element_size())
        num_slots = config.host_capacity_bytes // self.row_bytes
        if num_slots < 1:
            raise ConfigError(f"host_capacity_bytes={config.host_capacity_bytes} holds no block of "
                              f"{self.row_bytes} bytes")
        if config.disk_path is not None and config.disk_capacity_bytes < self.row_bytes:
            raise ConfigError(f"disk_capacity_bytes={config.disk_capacity_bytes} holds no block of "
                              f"{self.row_bytes} bytes")
        self.num_host_slots = num_slots
        if config.host_evict_ahead_blocks is not None and config.host_evict_ahead_blocks >= num_slots:
            raise ConfigError(f"host_evict_ahead_blocks={config.host_evict_ahead_blocks} must be below the host "
                              f"tier's {num_slots} slots (host_capacity_bytes={config.host_capacity_bytes} / "
                              f"{self.row_bytes}-byte blocks)")
        # first: a registry that refuses these metrics (it holds another manager's) leaks nothing
        try:
            self.metrics = Metrics(registry, config.namespace)
        except ValueError as exc:
            if "Duplicated timeseries" not in str(exc):   # prometheus_client's words for a name taken
                raise
            raise ConfigError(f"registry already holds tiered_kv metrics (one manager per registry; a closed "
                              f"manager's stay until its metrics.close()): {exc}") from None
        self._host_fd = -1
        self._host_pinned = False   # registered with CUDA here (a shared slab), unregistered at close
        try:
            with torch.inference_mode(False):   # the slab, the movers' planes: never inference tensors (plain_alias)
                self._open(config, device_blocks, num_slots, mover_factory)
        except BaseException:
            self._close_host_fd()
            self.metrics.close()
            raise

    def _open(self, config: TieredKVConfig, device_blocks: torch.Tensor, num_slots: int,
              mover_factory: Optional[MoverFactory]) -> None:
        """The constructor's resources: the host slab, the mover, the core (and its disk and remote tiers).
        When one fails, the mover is closed here and the slab by the caller."""
        self._device_blocks = device_blocks
        # (torch 2.13's view(dtype) outside inference mode happens to drop the flag too; nothing documents it)
        self._dev_rows = plain_alias(device_blocks).view(torch.uint8).view(self.num_blocks, self.row_bytes)
        pin = pin_decision(config.pin_host_memory, device_blocks.is_cuda)
        host: Optional[SharedHost] = None
        if config.disk_path is not None and config.disk_io == "process":
            # the disk I/O process maps the slab too: shared memory, pinned by registering it with CUDA
            try:
                mm, self._host_fd = make_shared_rows(num_slots, self.row_bytes)
            except OSError as exc:
                raise self._no_slab(config, num_slots, exc) from None
            self._host_rows = torch.frombuffer(mm, dtype=torch.uint8).view(num_slots, self.row_bytes)
            if pin:
                register_pinned(self._host_rows)
                self._host_pinned = True
            host = SharedHost(self._host_fd, 0, num_slots, self.row_bytes, self._host_rows.data_ptr(),
                              config.prefault_host_memory)
        else:
            try:
                self._host_rows = torch.empty((num_slots, self.row_bytes), dtype=torch.uint8, pin_memory=pin)
            except RuntimeError as exc:   # torch's allocator: the memory is not there
                raise self._no_slab(config, num_slots, exc) from None
        #: what was done at start to make the slab's pages resident (``prefault_host_memory``)
        self.host_memory = prepare_host_memory(self._host_rows, config.prefault_host_memory, pin)
        self._completions = CompletionQueue()
        self._read_cached = config.disk_read_cached_in_wait
        self._owner_tag = object()
        self._max_key_bytes = config.max_key_bytes
        self._deliver: list[Job] = []                 # cancelled jobs to report at the next poll
        self._waiting = False   # a blocking call holds the mover (_block_until); poll() ends a hold an interrupt left
        # row -> the store reading it, or a list when several do (live jobs only): one store per row is the rule
        self._row_stores: dict[int, Any] = {}
        self._row_load: dict[int, Job] = {}           # row -> the load writing it (live jobs only)
        # key -> the load of that key, or a list when several load it (live jobs only)
        self._key_loads: dict[bytes, Any] = {}
        self._closed = False
        self._mover_closed = False   # close() closed the mover: a load whose promote lands later gets no copy
        if mover_factory is None:
            self._mover: Mover = make_mover([(self._dev_rows, self._host_rows)], self._completions,
                                            config.num_copy_workers, config.num_copy_streams,
                                            config.copy_batch_max, config.cpu_mover)
        else:
            mover = mover_factory(self._dev_rows, self._host_rows, self._completions)
            if not isinstance(mover, Mover):   # refused before anything uses it (a factory that forgot its return)
                raise ConfigError(f"mover_factory must return a tiered_kv.movers.Mover, got "
                                  f"{type(mover).__name__}: {mover!r:.80}")
            self._mover = mover
        try:
            core = self._core = TierCore(config, self._host_rows, self.metrics, completions=self._completions,
                                         host=host)
        except BaseException:
            self._mover.close()
            raise
        try:   # (the disk and remote tiers are open: anything raising from here closes them)
            # (completions applied, not yet returned by poll()/wait(), wait in core.outbox)
            core.on_store = self._store_reported
            core.after_store = self._store_applied
            core.on_load = self._load_reported
            core.after_load = self._load_applied
            core.on_load_ready = self._load_ready
            core.on_load_failed = self._load_failed
            core.cancel_hook = self._cancel
            self._jobs = core.jobs
            self._index = core.index
            self.metrics.capacity["device"].set(self.num_blocks * self.row_bytes)
            core.refresh_gauges()
        except BaseException:
            core.close_disk(core.simple_block_until)
            self._mover.close()
            raise
        log.info("tiered_kv manager: namespace=%s rows=%d row_bytes=%d host_slots=%d pinned=%s mover=%s disk=%s",
                 config.namespace, self.num_blocks, self.row_bytes, num_slots, pin, type(self._mover).__name__,
                 config.disk_path if core.disk is not None else None)

    # ------------------------------------------------------------------ API
    def store(self, key: bytes, block: int) -> Optional[Job]:
        """Copy device row ``block`` to the host tier under ``key`` (and on to disk).

        Returns None when the key is already stored or being stored in any
        tier, or when the store is shed (no unleased host slot, too many jobs
        in flight).  The copy starts at the next ``poll()``/``wait()``
        (``copy_batch_max``), behind the work then queued on the current stream;
        until the job is reported the row must hold the block (or be given up
        with ``free_block``, which discards the store).
        """
        if (self._closed or type(key) is not bytes or not key or len(key) > self._max_key_bytes
                or type(block) is not int or not 0 <= block < self.num_blocks):
            key, block = self._check_args(key, block)
        if block in self._row_load:
            raise BlockBusyError(f"block {block} has a load in flight; its content is not there yet")
        core = self._core
        core.begun = None
        try:
            job = core.begin_store_one(key)
            if job is None:
                return None
            return self._submit_store(job, [block])
        except BaseException:
            self._unsubmit()
            raise

    def store_many(self, keys: Sequence[bytes], blocks: Sequence[int]) -> Optional[Job]:
        """``store()`` of many keys as one job: ``keys[i]`` from device row ``blocks[i]``.

        The job covers the keys in no tier yet that found a host slot (``job.keys``,
        ``job.blocks``); None when none did.  Per key the guarantees are those of
        ``store()``: freeing one of its rows (or invalidating one of its keys)
        cancels that key's part, whose copy is then discarded and counted
        (``source_reused``/``superseded``), and the rest is stored.
        """
        keys, blocks = self._check_many(keys, blocks)
        row_load = self._row_load
        if row_load and not row_load.keys().isdisjoint(blocks):
            b = next(b for b in blocks if b in row_load)
            raise BlockBusyError(f"block {b} has a load in flight; its content is not there yet")
        core = self._core
        core.begun = None
        try:
            job = core.begin_store(keys, keys if len(keys) > 1 else ())
            if job is None:
                return None
            if len(job.keys) != len(keys):
                row_of = dict(zip(keys, blocks))
                return self._submit_store(job, [row_of[k] for k in job.keys])
            return self._submit_store(job, blocks)
        except BaseException:
            self._unsubmit()
            raise

    def _submit_store(self, job: Job, blocks: list[int]) -> Job:
        job.block = blocks[0]
        job.blocks = blocks
        job._owner = self._owner_tag
        _add_job(self._row_stores, blocks, job)
        t = job._transfer = Transfer(job.token, _STORE, blocks, _slots(job._entries))
        self._mover.submit(t)
        return job

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are ready in a lower tier (host or disk).

        With a remote tier, the keys past those (up to ``remote_prefetch_blocks``) are asked from the
        server at the next ``poll()``/``wait()``, without waiting: those it holds are host hits for
        a later lookup once they landed; those it misses are not asked again for
        ``remote_miss_ttl_seconds``."""
        if self._closed:
            self._check_open()  # raises
        if type(keys) is not list:
            if isinstance(keys, NOT_SEQUENCES) or not isinstance(keys, Iterable):
                raise InvalidKeyError(f"keys must be a sequence of bytes, got {type(keys).__name__}: {keys!r:.80}")
            keys = list(keys)
        mk = self._max_key_bytes
        for k in keys:  # _check_key inline, as in store(); it raises
            if type(k) is not bytes or not k or len(k) > mk:
                self._check_key(k)
        return self._core.lookup_prefix(keys)

    def load(self, key: bytes, block: int) -> Optional[Job]:
        """Copy ``key``'s bytes into device row ``block`` (via the host tier).

        Returns None when the key is not ready in a lower tier (or the load is
        shed).  Until the returned job is reported, the row is fenced.  The copy
        starts at the next ``poll()``/``wait()``, behind the work then queued on
        the current stream.  A key only on disk is read back into the host tier
        first; that read, too, starts at the next ``poll()``/``wait()`` (with the
        step's other reads, as one batch).
        """
        if (self._closed or type(key) is not bytes or not key or len(key) > self._max_key_bytes
                or type(block) is not int or not 0 <= block < self.num_blocks):
            key, block = self._check_args(key, block)
        if block in self._row_load:
            raise BlockBusyError(f"block {block} already has a load in flight")
        core = self._core
        core.begun = None
        try:
            job = core.begin_load((key,))
            if job is None:
                return None
            return self._submit_load(job, (block,))
        except BaseException:
            self._unsubmit()
            raise

    def load_many(self, keys: Sequence[bytes], blocks: Sequence[int]) -> Optional[Job]:
        """``load()`` of many keys as one job: ``keys[i]`` into device row ``blocks[i]``.

        None unless every key is ready in a lower tier (and then nothing started), or when
        shed (a read from disk that finds no host slot: the reads already started for its
        other keys finish as prefetches).  Every
        row is fenced until the job is reported; freeing any of them cancels the
        whole job (its copies may still land, so every row stays fenced until its
        report).  Keys only on disk are read back first; the copies start once all
        of them landed, and the job fails if one read fails.
        """
        keys, blocks = self._check_many(keys, blocks)
        row_load = self._row_load
        if row_load and not row_load.keys().isdisjoint(blocks):
            b = next(b for b in blocks if b in row_load)
            raise BlockBusyError(f"block {b} already has a load in flight")
        core = self._core
        core.begun = None
        try:
            job = core.begin_load(keys)
            if job is None:
                return None
            return self._submit_load(job, tuple(blocks))
        except BaseException:
            self._unsubmit()
            raise

    def _unsubmit(self) -> None:
        """A store or load an interrupt (or any exception) broke off inside its call: the job the core registered
        (``TierCore.begun``; a begin broken off before that undid its own part), unless the mover took its
        transfer (``Transfer.taken``, then its report comes), is answered failed through the completion queue.
        The next poll applies that report as any failed copy's, so every slot, lease, row fence and map entry the
        call had made is freed by the one path that frees them, whichever of them it had reached; a load is first
        taken off the reads from disk it waits for, so that one landing before that report queues no copy.  The caller
        never got the job: the completion names one it does not know."""
        core = self._core
        job, core.begun = core.begun, None
        if job is None or job.state is not _PENDING:
            return
        t = job._transfer
        if t is not None and t.taken:
            return
        if job.kind is _LOAD:   # no longer waiting for its reads: one that lands before this report queues no copy
            core.release_load(job)
        self._completions.put(Report(job.token, job.kind, False, "interrupted before its copy was queued"))

    def _submit_load(self, job: Job, blocks: tuple[int, ...]) -> Job:
        job.block = blocks[0]
        job.blocks = blocks
        job._owner = self._owner_tag
        row_stores = self._row_stores
        if row_stores and not row_stores.keys().isdisjoint(blocks):
            for b in blocks:
                self._give_up_row(b)   # the load overwrites the row: stores still reading it lose their source
        row_load = self._row_load
        if len(blocks) == 1:
            row_load[blocks[0]] = job
        else:
            row_load.update(dict.fromkeys(blocks, job))
        _add_job(self._key_loads, job.keys, job)
        if not job._waiters:
            self._load_ready(job)
        return job

    def _load_ready(self, job: Job) -> None:
        """Every host slot of ``job`` is READY and leased to it: queue its copies.  Once ``close()`` closed
        the mover (its wait for promotes timed out), none: a copy queued then could land after close()
        returned and would never be reported; the load is answered as a miss instead.  Safe to run again (the
        core's pass over a read's report, broken off): a copy the mover took (``Transfer.taken``) is not queued
        again, a load answered already is not answered again."""
        if _copy_queued(job):
            return
        if self._mover_closed:
            self._load_failed(job, "miss: the manager closed before its read from disk landed", "device")
            self._core.abandon(job)
            return
        t = job._transfer = Transfer(job.token, _LOAD, list(job.blocks), _slots(job._entries))
        self._mover.submit(t)

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: idempotent, valid in any state at any time (after ``close()`` too, where it does
        nothing: the manager's copies and reads are over)."""
        if not isinstance(job, Job) or job._owner is not self._owner_tag or job.kind in _INTERNAL:
            raise InvalidJobError(f"not a job of this manager: {job!r}")
        if self._closed:
            return
        if job.state is _PENDING and not self._issued(job):
            raise InvalidJobError(f"not a job this manager returned (a copy of one?): {job!r}")
        self._cancel(job, _R_CANCELLED)

    def free_block(self, block: int) -> bool:
        """The engine is about to reuse row ``block``.

        Cancels the stores reading it (their part of it, for ``store_many``
        jobs).  Returns False while a load into it is in flight: that load is
        cancelled too, and the row must not be written until its completion has
        been reported (call again after ``poll()``).
        """
        self._check_open()
        block = self._check_block(block)
        self._give_up_row(block)
        job = self._row_load.get(block)
        if job is not None:
            self._cancel(job, _R_CANCELLED)
        return block not in self._row_load

    def invalidate(self, key: bytes) -> None:
        """Remove ``key`` from every tier; it is never served again until stored again."""
        self._check_open()
        key = self._check_key(key)
        for job in _jobs_of(self._key_loads.get(key)):
            self._cancel(job, _R_SUPERSEDED)
        self._core.drop_key(key)

    def poll(self) -> list[Completion]:
        """Apply every worker report that has arrived; return the jobs now reported."""
        if self._closed:
            self._check_open()  # raises
        if self._waiting:   # a wait() an interrupt broke off as it took or ended its hold: the copies go now
            self._mover.hold(False)
            self._waiting = False
        self._poll(True)
        core = self._core
        out, core.outbox = core.outbox, []
        return out

    def wait(self, jobs: Optional[Iterable[Job]] = None, timeout: Optional[float] = None) -> list[Completion]:
        """Block until ``jobs`` are reported; with None, until every store and load is
        reported and every copy's and read's report applied (no slot or row leased to a copy,
        no read from disk or from the remote tier in flight).  Spills and remote writes are
        ``flush()``'s: their reports may still be on their way.

        Returns every completion applied meanwhile (also of other jobs).  On
        timeout returns what was applied so far; check ``job.done``.
        """
        self._check_open()
        timeout = check_timeout(timeout)
        if jobs is None:
            # quiescence: every store/load reported *and* every worker report in, so no slot or row is
            # still leased to a copy or a read (spills are flush()'s business).  A promote counts even
            # when no load waits for it any more: its read still writes a host slot until it is applied; so
            # does a remote fetch's
            n = self._core.n_in_flight
            self._block_until(lambda: n[_STORE] == 0 and n[_LOAD] == 0 and n[_PROMOTE] == 0 and n[_FETCH] == 0
                              and not self._deliver, timeout)
            core = self._core
            out, core.outbox = core.outbox, []
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
        core = self._core
        out, core.outbox = core.outbox, []
        return out

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Block until every spill submitted so far is durable (at the configured level) or discarded,
        and every remote write, invalidation and cancel queued so far is answered by the server.

        Returns True at once without a disk or remote tier; False on timeout or when the
        disk tier failed to commit a write it covers (the fault is counted): a
        batch that failed after it was asked for, or a spill whose failure had
        not been applied by an earlier ``poll()``; likewise a remote write that
        failed by a fault (a write a tombstone refused is no fault), and a remote
        invalidation or cancel the writer dropped meanwhile (counted as
        ``error="tomb_dropped"``).  Completions applied meanwhile are returned by
        the next ``poll()``.
        """
        self._check_open()
        timeout = check_timeout(timeout)
        core = self._core
        if core.disk is None and core.remote is None:
            self._poll(True)   # nothing to write; the registry is exact on return all the same
            return True
        if core.disk is not None and not core.disk.store.writer_alive():
            self._poll(True)
            return False
        # a spill that failed before the flush was queued, but whose report this call is the first to
        # apply, is covered too; stores already copied get their spills queued ahead of the marker
        before = core.fault_counts()
        self._poll()
        return core.flush(self._block_until, timeout, before)

    def close(self) -> None:
        """Let in-flight copies and writes finish, apply their reports, stop the workers.  Idempotent."""
        if self._closed:
            return
        core = self._core
        core.closing = True
        if core.disk is not None:  # promotes may still hand loads to the mover
            self._block_until(lambda: core.n_in_flight[_PROMOTE] == 0, CLOSE_TIMEOUT_S)
        self._mover_closed = True
        self._mover.close()
        self._poll()
        core.close_disk(self._block_until)
        self._poll()
        core.slot_views.release()
        self._close_host_fd()
        self.metrics.closed()   # its final counts stay readable; nothing it reports is healthy now
        self._closed = True
        log.info("tiered_kv manager closed: namespace=%s", self.config.namespace)

    def _no_slab(self, config: TieredKVConfig, num_slots: int, exc: BaseException) -> ConfigError:
        return ConfigError(f"host_capacity_bytes={config.host_capacity_bytes}: cannot allocate the host slab of "
                           f"{num_slots * self.row_bytes} bytes ({num_slots} blocks): {exc}")

    def _close_host_fd(self) -> None:
        """The shared slab's file (the mapping stays while the tensor lives) and its CUDA registration."""
        if self._host_pinned:
            self._host_pinned = False
            unregister_pinned(self._host_rows)
        if self._host_fd >= 0:
            os.close(self._host_fd)
            self._host_fd = -1

    def __enter__(self) -> "TierManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ read-only views
    @property
    def jobs_in_flight(self) -> int:
        """Jobs whose worker report has not been applied (including cancelled and internal ones; a spill
        job counts once per block it writes, each under its own token)."""
        return len(self._jobs)

    @property
    def host_used_slots(self) -> int:
        return self._index.used_slots

    @property
    def host_blocks(self) -> int:
        return len(self._index)

    @property
    def disk_blocks(self) -> int:
        return 0 if self._core.dindex is None else len(self._core.dindex)

    @property
    def disk(self) -> Any:
        """The disk tier's store (None without one or when it failed to open)."""
        return None if self._core.disk is None else self._core.disk.store

    @property
    def disk_healthy(self) -> bool:
        d = self.disk
        return d is not None and d.healthy and d.writer_alive()

    def debug_sizes(self) -> dict[str, int]:
        """Sizes of every internal table: all must stay bounded over a long run."""
        d = self.disk
        return {
            "jobs": len(self._jobs),
            "deliver": len(self._deliver),
            "outbox": len(self._core.outbox),
            "row_stores": len(self._row_stores),
            "row_load": len(self._row_load),
            "key_loads": len(self._key_loads),
            "flushes": len(self._core._flushes),
            "host_entries": len(self._index),
            "host_used_slots": self._index.used_slots,
            "disk_entries": self.disk_blocks,
            "disk_tombstones": d.tombstones if d is not None else 0,
        }

    def host_bytes(self, key: bytes) -> Optional[torch.Tensor]:
        """A copy of ``key``'s bytes in the host tier if READY (for tests and tools)."""
        self._check_open()
        entry = self._index.ready(self._check_key(key))
        return None if entry is None else self._host_rows[entry.slot].clone()

    # ------------------------------------------------------------ internals: reports
    def _poll(self, last: bool = False, gauges: bool = True) -> None:
        """Apply what has arrived.  ``last``: the final pass of an API call (``poll()``, the end of a
        ``wait()``/``flush()``), which also prepares the next engine step: free host slots and tokens.
        Only the last pass does it, so a wait() evicts for the state it leaves, not one it passed.
        ``gauges``: an inner pass publishes the counters and gauges too (the last one always does)."""
        core = self._core
        self._mover.harvest()
        core.apply_arrived()
        if self._deliver:
            self._deliver_cancelled()
        core.end_step(last, gauges)
        # a step's copies, and those submitted while reports were applied (loads behind promotes)
        self._mover.flush()

    def _deliver_cancelled(self) -> None:
        """Report the cancelled jobs :meth:`_cancel` queued: stores, and loads that waited for their promotes (no
        copy queued: given up here).  A job leaves ``_deliver`` only once reported, and each step before is safe to
        run again, so an interrupt anywhere loses none and reports none twice; a cancel an interrupt broke off is
        finished here."""
        deliver, core = self._deliver, self._core
        while deliver:
            job = deliver[0]
            if not job.state.terminal:
                reason = job.cancel_reason or _R_CANCELLED
                if job.kind is _STORE:
                    core.cancel(job, reason)   # (a no-op unless an interrupt stopped _cancel before it)
                    self._drop_row_stores(job)
                    self._finish_cancelled(job)
                elif (job._waiters and not _copy_queued(job)) or self._jobs.get(job.token.int) is not job:
                    # waiting (no copy queued: a read's pass broken off may have queued it, still named), or given up
                    core.cancel(job, reason)
                    core.abandon(job)
                    self._unfence_load(job)
                    self._finish_cancelled(job)
                else:   # its promotes landed meanwhile and its copy is queued: fenced until that copy's report
                    core.cancel(job, reason)
            if deliver and deliver[0] is job:
                del deliver[0]

    def _block_until(self, done: Callable[[], bool], timeout: Optional[float]) -> None:
        """Block until ``done()`` (or the timeout), applying reports as they come.

        A mover whose copies wait in a queue for worker threads lets this thread run them while
        it would otherwise sleep (``help_one``: no thread wake-up per copy and per report), and
        the copies this thread submits meanwhile (loads behind promotes) wait for it instead of
        waking a worker (``hold``); whatever is left when this returns goes to the workers.  A batch of
        reads this thread serves from the page cache is read a chunk per pass: before each next chunk the
        copies of the blocks read so far go to the workers, to run beside its reads (``disk/cached.py``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        mover = self._mover
        core = self._core
        self._waiting = True   # before the hold: cleared only once the hold is over (poll() ends one left on)
        try:
            mover.hold(True)
            # reads the page cache holds are read on this thread too (it blocks anyway): no hand-off to the disk
            # I/O side and back (disk/cached.py; never a wait on the disk)
            core.read_here = self._read_cached
            core.read_until = deadline
            # the first pass leaves the counters and gauges to the last one (or to a pass _HELP_SLICE_S on):
            # publishing them is tens of microseconds, much of a lone load's wait
            self._poll(gauges=False)
            last_full = time.monotonic()
            while not done():
                now = time.monotonic()
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    return
                if core.reads_left():
                    # this thread reads a batch from the page cache a chunk per pass (disk/cached.py): the copies
                    # of the blocks read so far start on the mover's threads, to run while the pass below reads
                    # the next chunk (hold(False) starts what is held, flush() what a mover that does not hold
                    # queued -- CUDA's; the hold goes on for what comes after)
                    mover.hold(False)
                    mover.flush()
                    mover.hold(True)
                elif mover.help_one():
                    # copy on while copies are queued, for a slice: their reports wait in the queue and are
                    # applied together below (applying each between two copies holds the GIL the workers need)
                    until = now + _HELP_SLICE_S if deadline is None else min(now + _HELP_SLICE_S, deadline)
                    while time.monotonic() < until and mover.help_one():
                        pass
                else:
                    # wake each slice while a polled mover's copies end unseen (harvested at each wake-up) or the
                    # disk I/O process's pipe holds ops back (sent at each); else at the next report: a wake-up
                    # for nothing only takes the GIL from a disk reader verifying a block
                    step = remaining
                    if mover.needs_harvest() or core.unsent():
                        step = _POLL_SLICE_S if remaining is None else min(_POLL_SLICE_S, remaining)
                    if step is None or step > _WAKE_S:
                        step = _WAKE_S
                    self._completions.wait(step)   # a report that came stays queued: applied below
                if now - last_full >= _HELP_SLICE_S:
                    self._poll()
                    last_full = now
                else:
                    # reports come one at a time while copies finish: apply them, but leave the per-step
                    # bookkeeping (gauges, writer check) to every slice -- each wake-up holds the GIL
                    mover.harvest()
                    core.apply_arrived()
                    self._deliver_cancelled()
                    core.kick()   # what those reports queued (a probe's fetch, a promote's touch) goes now
        finally:
            # first, with no call before it: an interrupt in what follows must not leave poll() reading here
            core.read_here, core.read_until = False, None
            mover.hold(False)
            self._waiting = False
            self._poll(True)

    # ------------------------------------------------------------ internals: reports (TierCore.apply's hooks)
    def _store_reported(self, job: Job, r: Report) -> Applied:
        """A store's report, up to its commit: safe to run again (an interrupt leaves the report queued)."""
        self._drop_row_stores(job)
        core = self._core
        if job.state is not _PENDING:  # cancelled: delivered or queued for delivery
            core.drop_store(job, failed=False)
            return None, None, None
        if not r.ok:
            core.drop_store(job, failed=True)
            job.error = r.error or "failed"
            return _FAILED, Completion(job, False, f"failed: {job.error}"), None
        return _DONE, _tuple_new(Completion, (job, True, None)), core.publish_entries(job)

    def _store_applied(self, job: Job, r: Report, published: Any) -> None:
        """After a store's commit, once: its counts, and its spills and remote writes (write-through)."""
        core = self._core
        state = job.state
        if state is _DONE:
            core.after_publish(job, published)
            self._count_ok(job, r, _D2H)
        elif state is _FAILED:
            core.count_dropped(job, failed=True)
            self._count_failed(job, "host")
        else:
            core.count_dropped(job, failed=False)

    def _load_reported(self, job: Job, r: Report) -> Applied:
        """A load's report, up to its commit: safe to run again (an interrupt leaves the report queued)."""
        self._unfence_load(job)
        self._core.release_load(job)
        if job.state is not _PENDING:   # cancelled with its copy queued: this report delivers it
            job.error = err = _CANCELLED_ERROR[job.cancel_reason or _R_CANCELLED]
            return _CANCELLED, _tuple_new(Completion, (job, False, err)), None
        if not r.ok:
            job.error = r.error or "failed"
            return _FAILED, Completion(job, False, f"failed: {job.error}"), None
        return _DONE, _tuple_new(Completion, (job, True, None)), None

    def _load_applied(self, job: Job, r: Report, extra: Any) -> None:
        """After a load's commit, once: its counts."""
        state = job.state
        if state is _DONE:
            self._count_ok(job, r, _H2D)
        elif state is _FAILED:
            self._count_failed(job, "device")
        else:
            self._core.stale(_LOAD, job.cancel_reason or _R_CANCELLED, job.token)
            self.metrics.count(self.metrics.job_outcome[(_LOAD, "cancelled")])

    def _load_failed(self, job: Job, error: str, tier: str = "disk") -> None:
        """A load given up before its copy was queued (its read from disk failed): nothing reaches its rows, and
        it is answered failed unless it was answered already (safe to run again; the core then drops its record,
        :meth:`TierCore.abandon`)."""
        self._unfence_load(job)
        if job.state is _PENDING:
            self._fail(job, error, tier)

    def _count_ok(self, job: Job, r: Report, link: tuple[str, str]) -> None:
        n = len(job.keys)   # the histogram is one block's copy: the job's time shared by its blocks
        self.metrics.moved(job.kind, link, r.nbytes, r.seconds / n, 1, n)

    def _count_failed(self, job: Job, tier: str) -> None:
        self.metrics.count(self.metrics.job_outcome[(job.kind, "failed")])
        if not job.error.startswith("miss"):
            self.metrics.error(tier, "copy_failed")
            log.warning("%s job %s for key %r failed: %s", job.kind, job.token, job.key, job.error)

    def _fail(self, job: Job, error: str, tier: str) -> None:
        """A load given up outside a report's application (its read from disk failed, the manager closed)."""
        c = _tuple_new(Completion, (job, False, f"failed: {error}"))
        job.state = _FAILED   # then no call until the completion is out
        job.error = error
        self._core.outbox.append(c)
        self._count_failed(job, tier)

    def _finish_cancelled(self, job: Job) -> None:
        err = _CANCELLED_ERROR[job.cancel_reason or _R_CANCELLED]
        c = _tuple_new(Completion, (job, False, err))
        job.state = _CANCELLED   # then no call until the completion is out
        job.error = err
        self._core.outbox.append(c)
        self.metrics.count(self.metrics.job_outcome[(job.kind, "cancelled")])

    # ------------------------------------------------------------ internals: cancellation
    def _cancel(self, job: Job, reason: StaleReason) -> None:
        """The core's cancel hook and this front end's: the core's part, then the rows'."""
        if job.state is not _PENDING:
            return
        kind = job.kind
        waiting = kind is _LOAD and bool(job._waiters) and not _copy_queued(job)
        if kind is _STORE or waiting:
            job.cancel_reason = reason
            self._deliver.append(job)
        self._core.cancel(job, reason)
        if kind is _STORE:
            # its result will be discarded: the key is forgotten now, the slot leased until the report
            self._drop_row_stores(job)
        elif waiting:
            # still waiting for its promotes: no copy was queued, so nothing can reach its rows
            self._core.abandon(job)
            self._unfence_load(job)
        # else a load stays fenced in _row_load until its worker has reported

    def _issued(self, job: Job) -> bool:
        """``job`` (not yet reported) is the very object this manager returned: its record holds it,
        or it waits in ``_deliver`` (a load cancelled while it waited for its promote).  A copy of a
        Job carries the same token and owner tag, but the manager would report the original."""
        return self._jobs.get(job.token.int) is job or any(d is job for d in self._deliver)

    def _unfence_load(self, job: Job) -> None:
        row_load, key_loads = self._row_load, self._key_loads
        blocks, keys = job.blocks, job.keys
        if list(map(row_load.get, blocks)).count(job) == len(blocks):
            _consume(map(row_load.pop, blocks))   # the common case, in one C loop
        else:
            for b in blocks:
                if row_load.get(b) is job:
                    del row_load[b]
        _drop_job(key_loads, keys, job)

    def _give_up_row(self, block: int) -> None:
        for job in _jobs_of(self._row_stores.get(block)):
            if len(job.blocks) == 1:
                self._cancel(job, _R_SOURCE_REUSED)
            elif job.state is _PENDING:
                self._core.cancel_part(job, job.blocks.index(block), _R_SOURCE_REUSED)
        self._row_stores.pop(block, None)

    def _drop_row_stores(self, job: Job) -> None:
        _drop_job(self._row_stores, job.blocks, job)

    # ------------------------------------------------------------ internals: arguments
    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the TierManager is closed")

    def _check_args(self, key: Any, block: Any) -> tuple[bytes, int]:
        """store()/load(): their fast path tests the common case in one condition (the engine calls
        them per block) and comes here otherwise, which raises naming the bad value, or returns the
        key and the block as an int (e.g. a numpy integer)."""
        self._check_open()
        return self._check_key(key), self._check_block(block)

    def _check_many(self, keys: Any, blocks: Any) -> tuple[list[bytes], list[int]]:
        self._check_open()
        return check_many(keys, blocks, self._max_key_bytes, self.num_blocks)

    def _check_key(self, key: Any) -> bytes:
        return check_key(key, self._max_key_bytes)

    def _check_block(self, block: Any) -> int:
        return check_block(block, self.num_blocks)
