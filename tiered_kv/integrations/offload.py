"""The two halves of an offloading backend split across processes (no vLLM import).

:class:`SlabTiers` runs where lookups are answered (vLLM's scheduler, in the
EngineCore process).  It owns every piece of bookkeeping: the host index over
the shared slab, the disk tier (LMDB writer and readers), the job records and
their tokens.  :class:`SlabCopier` runs in each worker process and only copies
between the engine's KV tensors and the slab.

The token protocol across the split:

* every job the scheduler prepares gets a token from a :class:`TokenFactory`;
  its counter half is the job's sequence number ``seq``;
* the worker copies, then marks ``seq`` done in its rank's ring of the shared
  slab (:meth:`SharedSlab.mark_done`), then reports to the engine;
* a completion from the engine is matched to a *live* job by its key set and
  applied only if the rings show that job finished; a completion that matches
  no live job (late, duplicate, or of a job cancelled by ``reset``) is
  discarded and counted in ``tiered_kv_stale_callbacks_total``, never raised;
* a cancelled job's slots stay leased ("quarantined") until the rings show its
  copies finished, so no slot is reused while a worker may still touch it;
* a store is published (host READY, then spilled to disk) only by its own
  completion, so a store cancelled or invalidated before it completes is never
  published on host or disk; a spill already queued is stopped by its tomb.

Everything here is driven from one owner thread (vLLM's scheduler thread);
the disk writer and readers talk to it only through a completion queue.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..config import TieredKVConfig
from ..disk import DiskStore, FlushDone
from ..disktier import (SlotViews, TierViews, check_writer, disk_levels, evict_from_disk, finish_promote, finish_spill,
                        open_disk_tier, replay_recovered, start_spill)
from ..errors import ConfigError, InvalidKeyError
from ..host import EntryState, HostEntry, HostIndex, TierIndex
from ..jobs import JobKind, StaleReason, TokenFactory
from ..metrics import Metrics
from ..movers import CompletionQueue
from .slab import SharedSlab

__all__ = ["SlabTiers", "SlabCopier", "Lookup", "PreparedStore", "PreparedLoad", "CopyResult"]

log = logging.getLogger(__name__)

_STORE, _LOAD, _SPILL, _PROMOTE = JobKind.STORE, JobKind.LOAD, JobKind.SPILL, JobKind.PROMOTE
_SEQ_MASK = (1 << 48) - 1


def token_seq(token: uuid.UUID) -> int:
    """The sequence number of a job: the counter half of its token (unique per factory)."""
    return token.int & _SEQ_MASK


class Lookup:
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"   # on disk, being read back into the host slab


@dataclass(frozen=True)
class PreparedStore:
    keys: list[bytes]          # the keys to store, in the order of ``slots``
    token: bytes               # the job's token (16 bytes)
    seq: int
    slots: list[int]
    evicted: list[bytes]       # keys no longer offloaded anywhere because of this call


@dataclass(frozen=True)
class PreparedLoad:
    token: bytes
    seq: int
    slots: list[int]


class _Job:
    __slots__ = ("token", "seq", "kind", "keys", "entries", "live")

    def __init__(self, token: uuid.UUID, kind: JobKind, keys: frozenset[bytes], entries: list[HostEntry]) -> None:
        self.token = token
        self.seq = token_seq(token)
        self.kind = kind
        self.keys = keys
        self.entries = entries
        self.live = True


class _DiskJob:
    __slots__ = ("token", "kind", "entry", "dentry", "live")

    def __init__(self, token: uuid.UUID, kind: JobKind, entry: HostEntry, dentry: HostEntry) -> None:
        self.token = token
        self.kind = kind
        self.entry = entry
        self.dentry = dentry
        self.live = True


class SlabTiers(TierViews):
    """Scheduler-side owner of the host index, the disk tier and the job records."""

    def __init__(self, config: TieredKVConfig, slab: SharedSlab, *, metrics: Metrics,
                 collect_published: bool = False) -> None:
        self.config = config
        self.slab = slab
        self.row_bytes = slab.row_bytes
        self.metrics = metrics
        # number jobs above anything already in the rings (a restarted scheduler on a used slab),
        # or an old mark would pass for one of ours
        self._tokens = TokenFactory(start=slab.max_seq() + 1)
        self._index = HostIndex(slab.num_slots, on_evict=self._on_host_evict)
        self._live: dict[JobKind, dict[frozenset[bytes], collections.deque[_Job]]] = {_STORE: {}, _LOAD: {}}
        self._quarantine: list[_Job] = []       # cancelled jobs whose copies may still touch their slots
        self._awaiting: list[_Job] = []         # completed by the engine, rings not yet showing it
        self._disk_jobs: dict[uuid.UUID, _DiskJob] = {}
        self._spill_faults = 0   # spills whose write failed (applied reports), for flush()
        self._n_in_flight = {k: 0 for k in JobKind}  # live engine jobs and disk jobs, by kind
        self._completions = CompletionQueue()
        self._evicted: list[bytes] = []
        self._collect_published = collect_published
        self._published: list[bytes] = []       # keys made READY by a store (for KV events), if collected
        self._slot_views = SlotViews(slab.rows)
        self._disk: Optional[DiskStore] = None
        self._dindex: Optional[TierIndex] = None
        self._disk_usable = False
        self._closed = False
        m = metrics
        m.capacity["host"].set(slab.num_slots * self.row_bytes)
        m.health["host"].set(1)
        if config.disk_path is not None:
            self._open_disk()

    # ------------------------------------------------------------ disk open
    def _open_disk(self) -> None:
        cfg = self.config
        disk_blocks = cfg.disk_capacity_bytes // self.row_bytes
        if disk_blocks < 1:
            raise ConfigError(f"disk_capacity_bytes={cfg.disk_capacity_bytes} holds no block of {self.row_bytes} bytes")
        self._disk, self._dindex = open_disk_tier(cfg, self.row_bytes, disk_blocks, self._completions, self.metrics,
                                                  self._on_disk_evict)
        self._disk_usable = self._disk is not None
        if self._disk is not None and self._dindex is not None:
            replay_recovered(self._disk, self._dindex, self.metrics)
            log.info("tiered_kv disk tier at %s: %d blocks recovered in %.1f ms", cfg.disk_dir, len(self._dindex),
                     self._disk.recovery.seconds * 1e3)

    # ------------------------------------------------------------ lookups
    def lookup(self, key: bytes, protect: Collection[bytes] = ()) -> str:
        """HIT when ``key`` is READY in the host slab; PENDING while it is read back from disk.

        A read-back needs a host slot; it never evicts a key in ``protect``
        (the keys the same request was just told are hits), so a prefix longer
        than the slab gets the part that fits instead of evicting itself forever.
        """
        self._check_key(key)
        m = self.metrics
        m.count(m.lookups)
        entry = self._index.get(key)
        if entry is not None:
            if entry.state is EntryState.READY:
                self._index.touch(entry)
                m.count(m.hits["host"])
                return Lookup.HIT
            dj = self._disk_jobs.get(entry.writer)
            if dj is not None and dj.kind is _PROMOTE:
                self._drain()  # the read may have landed since the last step
                if entry.state is EntryState.READY:
                    m.count(m.hits["host"])
                    return Lookup.HIT
                return Lookup.PENDING if entry.live else Lookup.MISS
            return Lookup.MISS  # being stored from the device: not offloaded yet
        d = self._dindex.ready(key) if self._dindex is not None else None
        if d is None:
            return Lookup.MISS
        if not self._start_promote(key, d, protect):
            return Lookup.MISS
        m.count(m.hits["disk"])
        return Lookup.PENDING

    def touch(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            e = self._index.get(k)
            if e is not None:
                self._index.touch(e)
            elif self._dindex is not None:
                d = self._dindex.get(k)
                if d is not None:
                    self._dindex.touch(d)

    # ------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[bytes]) -> PreparedLoad:
        """Lease the READY host slots of ``keys`` to a load job (the engine copies them to the device)."""
        entries = []
        for k in keys:
            self._check_key(k)
            e = self._index.ready(k)
            if e is None:
                raise InvalidKeyError(f"prepare_load of key {k!r:.80} that lookup did not report as a hit "
                                      f"(state: {self._index.get(k)!r:.120})")
            entries.append(e)
        for e in entries:
            self._index.acquire(e)
        job = self._register(_LOAD, keys, entries)
        return PreparedLoad(job.token.bytes, job.seq, [e.slot for e in entries])

    def complete_load(self, keys: Iterable[bytes]) -> None:
        job = self._match(_LOAD, keys)
        if job is None:
            return
        if not self.slab.done(job.seq):
            self._awaiting.append(job)
            return
        self._finish_load(job)

    def _finish_load(self, job: _Job) -> None:
        for e in job.entries:
            self._index.release(e)
        # job outcomes are counted here, bytes and copy times by the worker that copied them
        self.metrics.count(self.metrics.job_outcome[(_LOAD, "ok")])

    # ------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[bytes]) -> PreparedStore:
        """Reserve host slots for the keys not offloaded yet.

        A key already in a tier is skipped; one that finds no evictable slot is
        shed (counted in ``tiered_kv_shed_total``), so the engine just stores less.
        """
        keys = list(keys)
        for k in keys:
            self._check_key(k)
        protect = frozenset(keys)
        todo: list[bytes] = []
        entries = []
        token = self._tokens()
        for k in keys:
            # (a key repeated in ``keys`` is in the index after its first reserve)
            if k in self._index or (self._dindex is not None and k in self._dindex):
                continue
            e = self._index.reserve(k, token, protect=protect)
            if e is None:
                self._shed(_STORE, "host_full")
                continue
            todo.append(k)
            entries.append(e)
        evicted, self._evicted = self._evicted, []
        if evicted:  # evicted since the last call but stored again meanwhile (or by this call): not gone
            evicted = [k for k in evicted if k not in self._index and (self._dindex is None or k not in self._dindex)]
        if not todo:  # everything offloaded already, or shed (counted): nothing for the engine to copy
            return PreparedStore([], token.bytes, token_seq(token), [], evicted)
        job = self._register(_STORE, todo, entries, token)
        return PreparedStore(todo, job.token.bytes, job.seq, [e.slot for e in entries], evicted)

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        job = self._match(_STORE, keys)
        if job is None:
            return
        if not self.slab.done(job.seq):
            if not success:
                self._cancel(job)
                return
            self._awaiting.append(job)
            return
        self._finish_store(job, success)

    def _finish_store(self, job: _Job, success: bool) -> None:
        m = self.metrics
        # publish only what every rank's ring records as copied: a success report matched by key
        # set may be a late one of an older job with the same keys.  The engine's own failure is
        # honoured too (so a late *failure* of an older job can cost this store: a miss, never
        # wrong bytes; vLLM 0.32 never reports failures)
        if not success or not self.slab.ok(job.seq):
            for e in job.entries:
                self._index.writer_done(e)
                self._index.abort(e)
            m.count(m.job_outcome[(_STORE, "failed")])
            return
        published = []
        for e in job.entries:
            if self._index.publish(e):
                published.append(e)
        if self._collect_published:
            self._published.extend(e.key for e in published)
        m.count(m.job_outcome[(_STORE, "ok")])
        if self._disk is not None and self.config.write_mode == "through":
            for e in published:
                if self._disk_usable:
                    self._start_spill(e)
                else:
                    self._shed(_SPILL, "disk_down")

    # ------------------------------------------------------------ jobs
    def _register(self, kind: JobKind, keys: Sequence[bytes], entries: list[HostEntry],
                  token: Optional[uuid.UUID] = None) -> _Job:
        job = _Job(token or self._tokens(), kind, frozenset(keys), entries)
        self._live[kind].setdefault(job.keys, collections.deque()).append(job)
        self._n_in_flight[kind] += 1
        return job

    def _match(self, kind: JobKind, keys: Iterable[bytes]) -> Optional[_Job]:
        """The live job of ``kind`` this engine completion is for; None (counted) when there is none."""
        ks = frozenset(keys)
        jobs = self._live[kind].get(ks)
        if jobs:
            # the engine reports jobs of the same key set in the order it submitted them; prefer one
            # the rings already show finished, so a late report never completes a newer job early
            pick = next((j for j in jobs if self.slab.done(j.seq)), jobs[0])
            jobs.remove(pick)
            if not jobs:
                del self._live[kind][ks]
            pick.live = False
            self._n_in_flight[kind] -= 1
            return pick
        reason = StaleReason.UNKNOWN_TOKEN
        for j in self._quarantine:
            if j.kind is kind and j.keys == ks:
                reason = StaleReason.CANCELLED
                break
        self.metrics.count(self.metrics.stale[(kind, reason)])
        log.debug("discarded stale %s completion for %d keys: %s", kind.value, len(ks), reason.value)
        return None

    def _cancel(self, job: _Job) -> None:
        """Drop a live job's keys now; its slots stay leased until the rings show its copies done."""
        jobs = self._live[job.kind].get(job.keys)
        if jobs is not None and job in jobs:
            jobs.remove(job)
            if not jobs:
                del self._live[job.kind][job.keys]
            self._n_in_flight[job.kind] -= 1
        job.live = False
        if job.kind is _STORE:
            for e in job.entries:
                self._index.abort(e)  # out of the index; the slot waits for writer_done
        self._quarantine.append(job)
        self.metrics.count(self.metrics.job_outcome[(job.kind, "cancelled")])

    def reset(self) -> None:
        """Forget every block in every tier (vLLM ``reset_cache``): nothing stored before is served again.

        Jobs in flight are cancelled: their late completions are counted as
        stale, their slots freed once their copies finished, and a store among
        them is never published.  Disk entries get durable tombs.
        """
        for kind in (_STORE, _LOAD):
            for jobs in list(self._live[kind].values()):
                for job in list(jobs):
                    self._cancel(job)
        # completed by the engine but not yet seen in the rings: never published now
        waiting, self._awaiting = self._awaiting, []
        for job in waiting:
            self._cancel(job)
        for entry in self._index.entries():
            dj = self._disk_jobs.get(entry.writer)
            if dj is not None and dj.kind is _PROMOTE:
                dj.live = False
                self._index.abort(entry)
            else:
                self._index.remove(entry)
        if self._dindex is not None and self._disk is not None:
            for d in self._dindex.entries():
                dj = self._disk_jobs.get(d.writer)
                if dj is not None and dj.kind is _SPILL and d.writing:
                    dj.live = False
                    self._dindex.abort(d)
                else:
                    self._dindex.remove(d)
                self._disk.cancel(d.writer, d.key)
        self._refresh()
        log.info("tiered_kv: every tier reset; %d jobs quarantined until their copies finish", len(self._quarantine))

    # ------------------------------------------------------------ the step
    def tick(self) -> None:
        """Once per engine step: apply disk reports, release finished quarantined jobs, update gauges."""
        self._drain()
        if self._awaiting:
            waiting, self._awaiting = self._awaiting, []
            for job in waiting:
                if not self.slab.done(job.seq):
                    self._awaiting.append(job)
                elif job.kind is _STORE:
                    self._finish_store(job, True)
                else:
                    self._finish_load(job)
        if self._quarantine:
            keep = []
            for job in self._quarantine:
                if not self.slab.done(job.seq):
                    keep.append(job)
                    continue
                for e in job.entries:
                    if job.kind is _STORE:
                        self._index.writer_done(e)
                    else:
                        self._index.release(e)
            self._quarantine = keep
        if self._disk is not None:
            self._disk_usable = check_writer(self._disk, self._disk_usable)
        self._refresh()

    @property
    def pending_work(self) -> bool:
        """True while a disk read-back is in flight: a request waits on it, so the engine must keep stepping.

        Quarantined and awaiting jobs do not count: they settle at the next
        step whatever happens, and asking for steps on their behalf could spin
        an idle engine if the engine never ran one of them.
        """
        return self._n_in_flight[_PROMOTE] > 0

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every spill queued so far is durable (tests and shutdown)."""
        if self._disk is None:
            return True
        faults = self._spill_faults   # as TierManager.flush: a failure this call applies answers False
        token = self._tokens()
        self._disk.submit_flush(token)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            r = self._completions.get(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic())))
            if isinstance(r, FlushDone) and r.token == token:
                self._drain()
                return r.ok and self._spill_faults == faults
            if r is not None:
                self._apply_disk(r)
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if not self._disk.writer_alive():
                return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._disk is not None:
            deadline = time.monotonic() + 30
            while self._disk_jobs and time.monotonic() < deadline:
                r = self._completions.get(0.5)
                if r is not None:
                    self._apply_disk(r)
            self._disk.close()
            self._drain()
        self._slot_views.release()
        self._refresh()

    def take_published(self) -> list[bytes]:
        """Keys published by stores since the last call (``collect_published=True`` only)."""
        out, self._published = self._published, []
        return out

    # ------------------------------------------------------------ views (tests, tools)
    def state_of(self, key: bytes) -> tuple[Optional[str], Optional[str]]:
        """(host state, disk state) of ``key``: 'ready', 'writing' or None."""
        e = self._index.get(key)
        d = self._dindex.get(key) if self._dindex is not None else None
        return (e.state.value if e is not None else None, d.state.value if d is not None else None)

    def debug_sizes(self) -> dict[str, int]:
        return {
            "live_stores": sum(len(v) for v in self._live[_STORE].values()),
            "live_loads": sum(len(v) for v in self._live[_LOAD].values()),
            "quarantine": len(self._quarantine),
            "awaiting": len(self._awaiting),
            "disk_jobs": len(self._disk_jobs),
            "host_entries": len(self._index),
            "host_used_slots": self._index.used_slots,
            "disk_entries": self.disk_blocks,
        }

    # ------------------------------------------------------------ internals: disk
    def _start_spill(self, entry: HostEntry) -> None:
        assert self._dindex is not None and self._disk is not None
        token = self._tokens()
        d = start_spill(self._disk, self._dindex, self._index, entry, token, self._slot_views[entry.slot])
        if isinstance(d, str):
            self._shed(_SPILL, d)
        elif d is not None:
            self._disk_jobs[token] = _DiskJob(token, _SPILL, entry, d)
            self._n_in_flight[_SPILL] += 1

    def _start_promote(self, key: bytes, d: HostEntry, protect: Collection[bytes] = ()) -> bool:
        assert self._dindex is not None and self._disk is not None
        token = self._tokens()
        entry = self._index.reserve(key, token, protect=protect)
        if entry is None:
            self._shed(_LOAD, "host_full")
            return False
        self._dindex.acquire(d)
        self._disk_jobs[token] = _DiskJob(token, _PROMOTE, entry, d)
        self._n_in_flight[_PROMOTE] += 1
        self._disk.submit_promote(token, key, d.writer, self._slot_views[entry.slot])
        return True

    def _drain(self) -> None:
        for r in self._completions.drain():
            self._apply_disk(r)

    def _apply_disk(self, r: Any) -> None:
        if isinstance(r, FlushDone):
            if not r.ok:
                self.metrics.error("disk", "flush_failed")
            return
        dj = self._disk_jobs.pop(r.token, None)
        m = self.metrics
        if dj is None:
            m.count(m.stale[(r.kind, StaleReason.UNKNOWN_TOKEN)])
            return
        self._n_in_flight[dj.kind] -= 1
        assert self._dindex is not None and self._disk is not None
        if dj.kind is _SPILL:
            self._index.release(dj.entry)
            if not dj.live:
                m.count(m.stale[(_SPILL, StaleReason.SUPERSEDED)])
                self._dindex.writer_done(dj.dentry)
            elif finish_spill(self._dindex, m, dj.dentry, r):
                self._spill_faults += 1
            return
        entry = dj.entry
        self._dindex.release(dj.dentry)
        if not dj.live or not entry.live:
            m.count(m.stale[(_PROMOTE, StaleReason.SUPERSEDED)])
            self._index.writer_done(entry)
            if entry.live:
                self._index.abort(entry)
        else:
            finish_promote(self._disk, self._index, self._dindex, m, entry, dj.dentry, r)

    def _on_disk_evict(self, d: HostEntry) -> None:
        evict_from_disk(self._disk, self.metrics, d)  # type: ignore[arg-type]
        if d.key not in self._index:
            self._evicted.append(d.key)

    def _on_host_evict(self, entry: HostEntry) -> None:
        if self._dindex is None or self._dindex.ready(entry.key) is None:
            self._evicted.append(entry.key)

    # ------------------------------------------------------------ internals: misc
    def _shed(self, kind: JobKind, why: str) -> None:
        self.metrics.count(self.metrics.job_outcome[(kind, "shed")])
        self.metrics.count(self.metrics.shed[(kind, why)])

    def _check_key(self, key: Any) -> None:
        if type(key) is not bytes or not key:
            raise InvalidKeyError(f"key must be non-empty bytes, got {type(key).__name__}: {key!r:.80}")
        if len(key) > self.config.max_key_bytes:
            raise InvalidKeyError(f"key of {len(key)} bytes exceeds max_key_bytes={self.config.max_key_bytes}")

    def _refresh(self) -> None:
        self.metrics.publish_levels(self._index.used_slots * self.row_bytes, len(self._index), self._n_in_flight,
                                    disk_levels(self._disk, self._dindex, self.row_bytes, self._disk_usable),
                                    self._index.evictions)


# ====================================================================== worker side
@dataclass
class CopyResult:
    job_id: int
    ok: bool
    nbytes: int
    seconds: float
    store: bool = False   # a device->host copy (whose failure the scheduler side handles as a miss)


class _CopyJob:
    __slots__ = ("job_id", "token", "seq", "store", "blocks", "slots", "ready")

    def __init__(self, job_id: int, token: bytes, seq: int, store: bool, blocks: torch.Tensor, slots: torch.Tensor):
        self.job_id = job_id
        self.token = token
        self.seq = seq
        self.store = store
        self.blocks = blocks
        self.slots = slots
        self.ready: Any = None  # CUDA: an event on the engine's stream the copy must wait for


class SlabCopier:
    """Worker-side copies between the engine's KV tensors and this rank's part of the slab.

    One copy thread executes jobs in submission order, so two jobs touching
    the same slot never overlap.  The thread marks each job done in the
    rank's ring *after* its copies completed, then posts the job's token; the
    owner thread (the engine's, in :meth:`finished`) maps tokens back to the
    engine's job ids.  A token it does not know (a duplicate or a report
    after :meth:`close`) is discarded and counted, never raised.
    """

    def __init__(self, slab: SharedSlab, rank: int, tensors: Sequence[torch.Tensor], *, metrics: Metrics,
                 on_stale: Optional[Callable[[JobKind], None]] = None) -> None:
        if not 0 <= rank < slab.world_size:
            raise ConfigError(f"rank {rank} out of range [0, {slab.world_size})")
        widths = []
        for i, t in enumerate(tensors):
            if t.dim() != 2 or t.dtype not in (torch.int8, torch.uint8):
                raise ConfigError(f"KV tensor {i} must be a 2-D int8/uint8 (num_blocks, page_bytes) view, "
                                  f"got {t.dtype} {tuple(t.shape)}")
            widths.append(int(t.shape[1]))
        if sum(widths) > slab.rank_bytes:
            raise ConfigError(f"a block of this worker is {sum(widths)} bytes; the slab gives each rank "
                              f"{slab.rank_bytes}")
        self.slab = slab
        self.rank = rank
        self.metrics = metrics
        base = rank * slab.rank_bytes
        self._pairs = []  # (engine tensor as uint8, its region of the slab rows)
        off = base
        for t, w in zip(tensors, widths):
            self._pairs.append((t.view(torch.uint8), slab.rows[:, off:off + w]))
            off += w
        self.block_bytes = off - base
        # CUDA KV caches (untested on a GPU in this repository): copies run on a side stream that
        # first waits for the engine's stream as it was at submit time, and the job is marked
        # done only after that stream has finished
        self._cuda = bool(tensors) and tensors[0].is_cuda
        self._device = tensors[0].device if tensors else torch.device("cpu")
        self._stream: Any = torch.cuda.Stream(self._device) if self._cuda else None
        self._jobs: dict[bytes, _CopyJob] = {}          # token -> job, owner thread only
        self._todo: "queue.SimpleQueue[Optional[_CopyJob]]" = queue.SimpleQueue()
        self._done: "queue.SimpleQueue[tuple[bytes, bool, float]]" = queue.SimpleQueue()
        self._finished: list[CopyResult] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"tiered-kv-slab-copier-{rank}", daemon=True)
        self._thread.start()

    def submit(self, job_id: int, token: bytes, seq: int, store: bool, blocks: Sequence[int],
               slots: Sequence[int]) -> bool:
        if self._closed:
            return False
        if len(blocks) != len(slots):
            raise ConfigError(f"job {job_id}: {len(blocks)} device blocks for {len(slots)} slab slots; "
                              f"tiered_kv stores one device block per key (blocks_per_chunk=1)")
        if token in self._jobs:
            self.metrics.count(self.metrics.stale[(_STORE if store else _LOAD, StaleReason.UNKNOWN_TOKEN)])
            log.warning("job %d reuses the token of a job in flight; ignored", job_id)
            return True
        # (a sequence or a numpy array: vLLM's block ids arrive as int32 arrays, converted once here)
        job = _CopyJob(job_id, token, seq, store, torch.as_tensor(blocks, dtype=torch.long),
                       torch.as_tensor(slots, dtype=torch.long))
        if self._cuda:
            job.blocks = job.blocks.to(self._device)
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream(self._device))
        self._jobs[token] = job
        self._todo.put(job)
        return True

    def _run(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            t0 = time.perf_counter()
            ok = True
            try:
                if len(job.blocks):
                    if self._cuda:
                        self._copy_cuda(job)
                    else:
                        for dev, region in self._pairs:
                            if job.store:
                                region.index_copy_(0, job.slots, dev.index_select(0, job.blocks))
                            else:
                                dev.index_copy_(0, job.blocks, region.index_select(0, job.slots))
            except Exception:  # noqa: BLE001 - reported as a failed job, never kills the thread
                log.exception("slab copy of job %d failed", job.job_id)
                ok = False
            try:
                self.slab.mark_done(self.rank, job.seq, ok)  # after the copies: the scheduler may reuse the slots
            except Exception:  # noqa: BLE001 - unmarked, the job's slots stay quarantined: safe, counted
                log.exception("marking job %d done in the slab failed", job.job_id)
                ok = False
            self._done.put((job.token, ok, time.perf_counter() - t0))

    def _copy_cuda(self, job: _CopyJob) -> None:
        stream = self._stream
        with torch.cuda.stream(stream):
            stream.wait_event(job.ready)
            for dev, region in self._pairs:
                if job.store:
                    region.index_copy_(0, job.slots, dev.index_select(0, job.blocks).to("cpu"))
                else:
                    dev.index_copy_(0, job.blocks, region.index_select(0, job.slots).to(self._device))
        stream.synchronize()

    def finished(self) -> list[CopyResult]:
        """Owner thread: the jobs finished since the last call."""
        out, self._finished = self._finished, []
        while True:
            try:
                token, ok, secs = self._done.get_nowait()
            except queue.Empty:
                break
            self._take(token, ok, secs, out)
        self.metrics.flush()
        return out

    def _take(self, token: bytes, ok: bool, secs: float, out: list[CopyResult]) -> None:
        job = self._jobs.pop(token, None)
        m = self.metrics
        if job is None:
            m.count(m.stale[(_STORE, StaleReason.UNKNOWN_TOKEN)])
            return
        n = len(job.blocks) * self.block_bytes
        # bytes and copy times are counted here, job outcomes by the scheduler side (once per job)
        if not ok:
            m.error("host", "copy_failed")
        else:
            link = ("device", "host") if job.store else ("host", "device")
            m.count(m.link_bytes[link], n)
            m.observe(m.link_seconds[link], secs / max(1, len(job.blocks)))
        out.append(CopyResult(job.job_id, ok, n, secs, job.store))

    def wait(self, job_ids: Iterable[int], timeout: Optional[float] = None) -> None:
        """Block until the jobs ``job_ids`` have finished (their results stay for :meth:`finished`)."""
        want = set(job_ids)
        pending = {j.token for j in self._jobs.values() if j.job_id in want}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return
            try:
                token, ok, secs = self._done.get(timeout=remaining)
            except queue.Empty:
                return
            pending.discard(token)
            self._take(token, ok, secs, self._finished)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        """Finish queued copies and stop the thread.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._todo.put(None)
        self._thread.join(timeout=30)
        self._pairs = []
        self.metrics.flush()
