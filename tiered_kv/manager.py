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

import logging
import operator
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from prometheus_client import CollectorRegistry

from .config import TieredKVConfig
from .errors import (
    BlockBusyError,
    ConfigError,
    DeviceTensorError,
    InvalidBlockError,
    InvalidJobError,
    InvalidKeyError,
    ManagerClosedError,
)
from .host import EntryState, HostEntry, HostIndex
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

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
_D2H, _H2D = ("device", "host"), ("host", "device")


class _Flight:
    """A job whose worker report has not been applied yet, with its leases."""

    __slots__ = ("job", "entry", "gen", "transfer")

    def __init__(self, job: Job, entry: HostEntry, gen: int, transfer: Transfer) -> None:
        self.job = job
        self.entry = entry        # the host entry written (store) or read (load)
        self.gen = gen            # the device row's generation when the job started
        self.transfer = transfer


class TierManager:
    """Moves KV blocks between the engine's device rows and a pinned host slab.

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
        self.num_host_slots = num_slots
        self._device_blocks = device_blocks
        self._dev_rows = device_blocks.view(torch.uint8).view(self.num_blocks, self.row_bytes)
        pin = config.pin_host_memory
        if pin is None:
            pin = bool(device_blocks.is_cuda and torch.cuda.is_available())
        self._host_rows = torch.empty((num_slots, self.row_bytes), dtype=torch.uint8, pin_memory=pin)
        self.metrics = Metrics(registry, config.namespace)
        self._index = HostIndex(num_slots, on_evict=self._on_host_evict)
        self._completions = CompletionQueue()
        if mover_factory is None:
            self._mover: Mover = make_mover(self._dev_rows, self._host_rows, self._completions,
                                            config.num_copy_workers, config.num_copy_streams)
        else:
            self._mover = mover_factory(self._dev_rows, self._host_rows, self._completions)
        self._tokens = TokenFactory()
        self._owner_tag = object()
        self._jobs: dict[uuid.UUID, _Flight] = {}           # token -> job awaiting its worker report
        self._deliver: list[Job] = []                        # cancelled stores to report at next poll
        self._row_gen = [0] * self.num_blocks                # bumped whenever a row's content is given up
        self._row_stores: dict[int, list[_Flight]] = {}      # row -> stores reading it (live jobs only)
        self._row_load: dict[int, _Flight] = {}              # row -> the load writing it (live jobs only)
        self._key_loads: dict[bytes, list[_Flight]] = {}     # key -> loads reading its slot (live jobs only)
        self._n_in_flight = {_STORE: 0, _LOAD: 0}
        self._closed = False
        m = self.metrics
        m.capacity["host"].set(num_slots * self.row_bytes)
        m.capacity["device"].set(self.num_blocks * self.row_bytes)
        self._refresh_gauges()
        log.info("tiered_kv manager: namespace=%s rows=%d row_bytes=%d host_slots=%d pinned=%s mover=%s",
                 config.namespace, self.num_blocks, self.row_bytes, num_slots, pin, type(self._mover).__name__)

    # ------------------------------------------------------------------ API
    def store(self, key: bytes, block: int) -> Optional[Job]:
        """Copy device row ``block`` to the host tier under ``key``.

        Returns None when the key is already stored or being stored, or when
        the store is shed (no unleased host slot, too many jobs in flight).
        """
        self._check_open()
        key = self._check_key(key)
        block = self._check_block(block)
        if block in self._row_load:
            raise BlockBusyError(f"block {block} has a load in flight; its content is not there yet")
        entry = self._index.get(key)
        if entry is not None:
            self._index.touch(entry)
            return None
        if len(self._jobs) >= self.config.max_inflight_jobs:
            return self._shed(_STORE, "inflight_limit")
        token = self._tokens()
        entry = self._index.reserve(key, token)
        if entry is None:
            return self._shed(_STORE, "host_full")
        job = Job(token, _STORE, key, block, _owner=self._owner_tag)
        fl = _Flight(job, entry, self._row_gen[block], Transfer(token, _STORE, block, entry.slot))
        self._jobs[token] = fl
        self._row_stores.setdefault(block, []).append(fl)
        self._n_in_flight[_STORE] += 1
        self._mover.submit(fl.transfer)
        return job

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are ready in a lower tier (host)."""
        self._check_open()
        if isinstance(keys, (bytes, str)) or not isinstance(keys, Iterable):
            raise InvalidKeyError(f"keys must be a sequence of bytes, got {type(keys).__name__}")
        keys = list(keys)
        for k in keys:
            self._check_key(k)
        n = 0
        ready = self._index.ready
        for k in keys:
            entry = ready(k)
            if entry is None:
                break
            self._index.touch(entry)
            n += 1
        self.metrics.lookups.inc(min(n + 1, len(keys)))
        if n:
            self.metrics.hits["host"].inc(n)
        return n

    def load(self, key: bytes, block: int) -> Optional[Job]:
        """Copy ``key``'s bytes into device row ``block``.

        Returns None when the key is not ready in a lower tier (or the load is
        shed).  Until the returned job is reported, the row is fenced.
        """
        self._check_open()
        key = self._check_key(key)
        block = self._check_block(block)
        if block in self._row_load:
            raise BlockBusyError(f"block {block} already has a load in flight")
        entry = self._index.ready(key)
        if entry is None:
            return None
        if len(self._jobs) >= self.config.max_inflight_jobs:
            return self._shed(_LOAD, "inflight_limit")
        # the load overwrites the row: stores still reading it lose their source
        self._give_up_row(block)
        token = self._tokens()
        self._index.acquire(entry)
        job = Job(token, _LOAD, key, block, _owner=self._owner_tag)
        fl = _Flight(job, entry, self._row_gen[block], Transfer(token, _LOAD, block, entry.slot))
        self._jobs[token] = fl
        self._row_load[block] = fl
        self._key_loads.setdefault(key, []).append(fl)
        self._n_in_flight[_LOAD] += 1
        self._mover.submit(fl.transfer)
        return job

    def cancel(self, job: Job) -> None:
        """Cancel ``job``: idempotent, valid in any state at any time."""
        self._check_open()
        if not isinstance(job, Job) or job._owner is not self._owner_tag:
            raise InvalidJobError(f"not a job of this manager: {job!r}")
        self._cancel(job, StaleReason.CANCELLED)

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
        if fl is None:
            return True
        self._cancel(fl.job, StaleReason.CANCELLED)
        return False

    def invalidate(self, key: bytes) -> None:
        """Remove ``key`` from every tier; it is never served again until stored again."""
        self._check_open()
        key = self._check_key(key)
        entry = self._index.get(key)
        if entry is not None:
            if entry.state is EntryState.WRITING:
                fl = self._jobs.get(entry.writer)
                if fl is not None:
                    self._cancel(fl.job, StaleReason.SUPERSEDED)
            self._index.remove(entry)
        for fl in list(self._key_loads.get(key, ())):
            self._cancel(fl.job, StaleReason.SUPERSEDED)

    def poll(self) -> list[Completion]:
        """Apply every worker report that has arrived; return the jobs now reported."""
        self._check_open()
        return self._poll([])

    def wait(self, jobs: Optional[Iterable[Job]] = None, timeout: Optional[float] = None) -> list[Completion]:
        """Block until ``jobs`` (None: every job in flight) are reported.

        Returns every completion applied meanwhile (also of other jobs).  On
        timeout returns what was applied so far; check ``job.done``.
        """
        self._check_open()
        if jobs is None:
            targets = [fl.job for fl in self._jobs.values()] + list(self._deliver)
        else:
            targets = list(jobs)
            for j in targets:
                if not isinstance(j, Job) or j._owner is not self._owner_tag:
                    raise InvalidJobError(f"not a job of this manager: {j!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            raise ConfigError(f"timeout must be None or a number >= 0, got {timeout!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        out = self._poll([])
        slice_s = 0.0005 if self._mover.polled else None
        while not all(j.state.terminal for j in targets):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            step = remaining if slice_s is None else (slice_s if remaining is None else min(slice_s, remaining))
            report = self._completions.get(step)
            if report is not None:
                self._apply(report, out)
            self._poll(out)
        return out

    def flush(self, timeout: Optional[float] = None) -> None:
        """Return when every spill submitted so far is durable or discarded (no disk tier: at once)."""
        self._check_open()

    def close(self) -> None:
        """Let in-flight copies finish, apply their reports, stop the workers.  Idempotent."""
        if self._closed:
            return
        self._mover.close()
        self._poll([])
        self._closed = True
        log.info("tiered_kv manager closed: namespace=%s", self.config.namespace)

    def __enter__(self) -> "TierManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ read-only views
    @property
    def jobs_in_flight(self) -> int:
        """Jobs whose worker report has not been applied (including cancelled ones)."""
        return len(self._jobs)

    @property
    def host_used_slots(self) -> int:
        return self._index.used_slots

    @property
    def host_blocks(self) -> int:
        return len(self._index)

    def debug_sizes(self) -> dict[str, int]:
        """Sizes of every internal table: all must stay bounded over a long run."""
        return {
            "jobs": len(self._jobs),
            "deliver": len(self._deliver),
            "row_stores": len(self._row_stores),
            "row_load": len(self._row_load),
            "key_loads": len(self._key_loads),
            "host_entries": len(self._index),
            "host_used_slots": self._index.used_slots,
        }

    def host_bytes(self, key: bytes) -> Optional[torch.Tensor]:
        """A copy of ``key``'s bytes in the host tier if READY (for tests and tools)."""
        entry = self._index.ready(self._check_key(key))
        return None if entry is None else self._host_rows[entry.slot].clone()

    # ------------------------------------------------------------ internals
    def _poll(self, out: list[Completion]) -> list[Completion]:
        self._mover.harvest()
        for report in self._completions.drain():
            self._apply(report, out)
        if self._deliver:
            pending, self._deliver = self._deliver, []
            for job in pending:
                self._finish_cancelled(job, out)
        self._refresh_gauges()
        return out

    def _apply(self, r: Report, out: list[Completion]) -> None:
        fl = self._jobs.pop(r.token, None)
        if fl is None:
            self._stale(r.kind, StaleReason.UNKNOWN_TOKEN, r.token)
            return
        job = fl.job
        self._n_in_flight[job.kind] -= 1
        if job.kind is _STORE:
            self._apply_store(fl, r, out)
        else:
            self._apply_load(fl, r, out)

    def _apply_store(self, fl: _Flight, r: Report, out: list[Completion]) -> None:
        job, entry = fl.job, fl.entry
        self._drop_row_store(fl)
        if job.state is not JobState.PENDING:  # cancelled: delivered or queued for delivery
            self._stale(_STORE, job.cancel_reason or StaleReason.CANCELLED, job.token)
            self._index.writer_done(entry)
            return
        if not r.ok:
            self._index.writer_done(entry)
            self._index.abort(entry)
            self._fail(job, r, "host", out)
            return
        if fl.gen != self._row_gen[job.block]:  # defence in depth: free_block already cancels
            self._index.writer_done(entry)
            self._index.abort(entry)
            self._stale(_STORE, StaleReason.SOURCE_REUSED, job.token)
            job._move(JobState.CANCELLING)
            job.cancel_reason = StaleReason.SOURCE_REUSED
            self._finish_cancelled(job, out)
            return
        self._index.publish(entry)
        self._ok(job, r, _D2H, out)

    def _apply_load(self, fl: _Flight, r: Report, out: list[Completion]) -> None:
        job = fl.job
        if self._row_load.get(job.block) is fl:
            del self._row_load[job.block]
        loads = self._key_loads.get(job.key)
        if loads is not None:
            loads.remove(fl)
            if not loads:
                del self._key_loads[job.key]
        self._index.release(fl.entry)
        if job.state is not JobState.PENDING:
            self._stale(_LOAD, job.cancel_reason or StaleReason.CANCELLED, job.token)
            self._finish_cancelled(job, out)
        elif not r.ok:
            self._fail(job, r, "device", out)
        else:
            self._ok(job, r, _H2D, out)

    def _ok(self, job: Job, r: Report, link: tuple[str, str], out: list[Completion]) -> None:
        job._move(JobState.DONE)
        m = self.metrics
        m.job_outcome[(job.kind, "ok")].inc()
        m.link_bytes[link].inc(r.nbytes)
        m.link_seconds[link].observe(r.seconds)
        out.append(Completion(job, True, None))

    def _fail(self, job: Job, r: Report, tier: str, out: list[Completion]) -> None:
        job._move(JobState.FAILED)
        job.error = r.error or "failed"
        self.metrics.job_outcome[(job.kind, "failed")].inc()
        self.metrics.error(tier, "copy_failed")
        log.warning("%s job %s for key %r failed: %s", job.kind, job.token, job.key, job.error)
        out.append(Completion(job, False, f"failed: {job.error}"))

    def _finish_cancelled(self, job: Job, out: list[Completion]) -> None:
        job._move(JobState.CANCELLED)
        reason = job.cancel_reason or StaleReason.CANCELLED
        job.error = f"cancelled ({reason.value})"
        self.metrics.job_outcome[(job.kind, "cancelled")].inc()
        out.append(Completion(job, False, job.error))

    def _cancel(self, job: Job, reason: StaleReason) -> None:
        if job.state is not JobState.PENDING:
            return
        fl = self._jobs.get(job.token)
        job._move(JobState.CANCELLING)
        job.cancel_reason = reason
        if fl is None:  # pragma: no cover - a PENDING job always has a record
            raise AssertionError(f"pending job without record: {job!r}")
        fl.transfer.cancelled = True
        if job.kind is _STORE:
            # its result will be discarded: forget the key now, keep the slot leased until the report
            self._drop_row_store(fl)
            self._index.abort(fl.entry)
            self._deliver.append(job)
        # a load stays fenced in _row_load until its worker has reported

    def _give_up_row(self, block: int) -> None:
        self._row_gen[block] += 1
        stores = self._row_stores.pop(block, None)
        if stores:
            for fl in list(stores):
                self._cancel(fl.job, StaleReason.SOURCE_REUSED)

    def _drop_row_store(self, fl: _Flight) -> None:
        stores = self._row_stores.get(fl.job.block)
        if stores is not None and fl in stores:
            stores.remove(fl)
            if not stores:
                del self._row_stores[fl.job.block]

    def _stale(self, kind: JobKind, reason: StaleReason, token: uuid.UUID) -> None:
        self.metrics.stale[(kind, reason)].inc()
        log.debug("discarded stale %s report for token %s: %s", kind, token, reason)

    def _shed(self, kind: JobKind, why: str) -> None:
        self.metrics.job_outcome[(kind, "shed")].inc()
        log.debug("%s shed: %s", kind, why)
        return None

    def _on_host_evict(self, entry: HostEntry) -> None:
        self.metrics.evicted["host"].inc()

    def _refresh_gauges(self) -> None:
        m = self.metrics
        used = self._index.used_slots
        m.used["host"].set(used * self.row_bytes)
        m.blocks["host"].set(len(self._index))
        m.in_flight[_STORE].set(self._n_in_flight[_STORE])
        m.in_flight[_LOAD].set(self._n_in_flight[_LOAD])

    def _check_open(self) -> None:
        if self._closed:
            raise ManagerClosedError("the TierManager is closed")

    def _check_key(self, key: Any) -> bytes:
        if type(key) is not bytes:
            raise InvalidKeyError(f"key must be bytes, got {type(key).__name__}: {key!r:.80}")
        if not key:
            raise InvalidKeyError("key must not be empty: b''")
        if len(key) > self.config.max_key_bytes:
            raise InvalidKeyError(f"key of {len(key)} bytes exceeds max_key_bytes={self.config.max_key_bytes}: {key!r:.80}")
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
