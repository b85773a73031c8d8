"""TierCore: every piece of tier bookkeeping, once, for every front end.

The core owns the host index (slots, leases, LRU, evict-ahead), the disk tier
(:class:`~tiered_kv.core.disk_tier.DiskTier`), the remote tier's owner side
(:class:`~tiered_kv.core.remote_tier.RemoteTier`: writes, probes and fetches), the job records (a
:class:`~tiered_kv.jobs.Job` per token, covering a set of keys; a spill job is
found under each of its keys' tokens), the tokens,
stale and shed accounting, spill and promote, write-through and write-back,
flush and close, and the gauges.  It does no I/O: the disk store and the movers
take token-tagged work and answer token-tagged reports, which :meth:`TierCore.apply`
matches by token on the owner thread.

Front ends map their engine's calls onto it and keep only what their engine
adds: :class:`~tiered_kv.manager.TierManager` the device rows (fences, the
stores reading each row, the mover); the vLLM scheduler side
(:class:`~tiered_kv.integrations.scheduler.SlabScheduler`) vLLM's key-set
completions and the slab's rings.  A front end sets the hooks ``on_store`` /
``on_load`` (apply a report of its STORE/LOAD job), ``on_load_ready`` /
``on_load_failed`` (a load's reads from disk landed / failed; each may be called again for the same load after
an interrupt, and must then neither queue its copy twice nor answer it twice) and
``cancel_hook`` (cancel one of its jobs); everything else it calls here.

Invariants enforced here: a report is applied only to the live job its token
names (else counted ``unknown_token``: :meth:`TierCore.apply`); a leased slot is
never reused before the job's report is applied (the index's leases, taken and
released only here); a cancelled store or part is never published (its entries
leave the index when it is cancelled: :meth:`TierCore.cancel`,
:meth:`TierCore.cancel_part`, :meth:`TierCore.cancel_spill_part`); a spill is shed,
never queued without bound (:meth:`DiskTier.start_spills`).

The module is longer than the project's usual 500 lines on purpose: it is one
state machine (jobs, leases and the two indexes change together in every
method), and splitting it would put the halves of one transition in two files.
The remote tier's transitions are here for the same reason (a fetch reserves and
publishes host entries, a store supersedes a fetch, an invalidation discards a
write's part); what concerns only the server -- the keys asked, missed and being
written -- is in :mod:`~tiered_kv.core.remote_tier`.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any, Optional

import torch

from ..config import TieredKVConfig
from ..disk import SPILL_PREVENTED, FlushDone, writable_view
from ..disk.proc import SharedHost
from ..errors import ConfigError
from ..jobs import Job, JobKind, JobState, StaleReason, TokenFactory
from ..metrics import Metrics
from ..movers import CompletionQueue, Report
from .disk_tier import DiskTier
from .index import Entry, EntryState, TierIndex
from .policy import make_admission, make_policy
from .remote_tier import Refused, RemoteTier

__all__ = ["TierCore", "SlotViews", "EVICT_AHEAD_MAX", "TOKEN_POOL", "CLOSE_TIMEOUT_S"]

log = logging.getLogger(__name__)

_STORE, _LOAD, _SPILL, _PROMOTE = JobKind.STORE, JobKind.LOAD, JobKind.SPILL, JobKind.PROMOTE
_PUT, _FETCH = JobKind.PUT, JobKind.FETCH
_HOST_DISK = ("host", "disk")
_HOST_REMOTE, _REMOTE_HOST = ("host", "remote"), ("remote", "host")
_PENDING, _CANCELLING, _DONE, _FAILED, _CANCELLED = (JobState.PENDING, JobState.CANCELLING, JobState.DONE,
                                                   JobState.FAILED, JobState.CANCELLED)
_READY, _WRITING = EntryState.READY, EntryState.WRITING
_state_of = attrgetter("state")
_writer_int = attrgetter("writer.int")

Applied = tuple[Optional[JobState], Any, Any]
"""What a front end's ``on_store``/``on_load`` return: the job's new state (None: unchanged), the completion to
queue in ``TierCore.outbox`` (None: none), and what to hand to ``after_store``/``after_load``."""


def _nothing(job: Job, r: Report, extra: Any) -> None:
    return None


_R_CANCELLED, _R_SUPERSEDED, _R_UNKNOWN = StaleReason.CANCELLED, StaleReason.SUPERSEDED, StaleReason.UNKNOWN_TOKEN
_PART_OK, _PART_FAILED, _PART_FAULT = "ok", "failed", "fault"   # a spill part's outcome (a cancelled one: its reason)

EVICT_AHEAD_MAX = 64
"""``host_evict_ahead_blocks=None``: at most this many free slots are prepared per step (and at most 1/32
of the slab), enough for a step's stores without evicting blocks the next step may still hit."""
TOKEN_POOL = 64
"""Tokens made ahead at the end of each step, so that the engine's calls take one instead of building it."""
POLL_SLICE_S = 0.0005
"""A blocked owner wakes this often while a store holds ops back (:meth:`TierCore.unsent`), to send them, or
while a polled mover has copies in flight (``TierManager``)."""
WAKE_S = 0.5
"""A blocked owner wakes at least this often, to notice a dead disk writer."""
CLOSE_TIMEOUT_S = 30.0
"""``close()`` waits this long for promotes and spills in flight: a disk that stopped answering must not
hang the host's shutdown (what is left is a miss after restart, never wrong bytes)."""
WRITEBACK_FILL = 0.75
"""Write-back starts spilling once the host slab is this full (sooner when a step stores more than the rest)."""
WRITEBACK_PER_STEP = 8
"""Write-back keeps the next ``max(EVICT_AHEAD_MAX, evict-ahead + WRITEBACK_AHEAD x the blocks a step
stores)`` victims written: each step it spills the blocks of that window not yet on disk, at most the
blocks stored since the last step plus this many (the backlog drains a few a step: a step's cost
follows its stores)."""
WRITEBACK_AHEAD = 4
"""The written reserve in steps of stores (a decaying peak of them): on the Mooncake and chat traces'
first 400 requests (host 200, disk 400 blocks) 4 leaves 0-19 victims unwritten per policy, 2 leaves
440-540 on Mooncake's (``tiered-kv replay --write-mode back``, docs/policies.md)."""


class SlotViews:
    """Writable byte views of a host slab's slots, as the disk store reads and writes them.

    One view over the whole (contiguous) slab, sliced per slot.  ``release()``
    before the slab's memory goes away.
    """

    def __init__(self, rows: torch.Tensor) -> None:
        if not rows.is_contiguous() or rows.dim() != 2:
            raise ValueError(f"a slab must be a contiguous [slots, bytes] tensor, got {tuple(rows.shape)}")
        self._bytes = int(rows.shape[1]) * rows.element_size()
        self._all: Optional[memoryview] = writable_view(rows)

    def __getitem__(self, slot: int) -> memoryview:
        assert self._all is not None, "slot views used after release()"
        return self._all[slot * self._bytes:(slot + 1) * self._bytes]

    def release(self) -> None:
        self._all = None


class TierCore:
    """The owner-side core.  One owner thread calls every method; workers only answer reports."""

    def __init__(self, config: TieredKVConfig, host_rows: torch.Tensor, metrics: Metrics, *,
                 completions: Optional[CompletionQueue] = None, token_start: int = 1,
                 collect_evicted: bool = False, collect_published: bool = False,
                 host: Optional[SharedHost] = None) -> None:
        self.config = config
        self.metrics = metrics
        self.row_bytes = int(host_rows.shape[1]) * host_rows.element_size()
        self.num_slots = num_slots = int(host_rows.shape[0])
        ahead = config.host_evict_ahead_blocks
        if ahead is None:
            ahead = min(EVICT_AHEAD_MAX, num_slots // 32)
        elif ahead >= num_slots:
            raise ConfigError(f"host_evict_ahead_blocks={ahead} must be below the host tier's {num_slots} slots "
                              f"(host_capacity_bytes={config.host_capacity_bytes} / {self.row_bytes}-byte blocks)")
        self.evict_ahead = ahead
        self.max_inflight = config.max_inflight_jobs
        # the tokens of spill jobs' parts past their first in ``jobs``: a spill job of N blocks is one job
        # against max_inflight_jobs (as the jobs_in_flight gauge counts it), not N
        self.spill_extra = 0
        self.completions = completions if completions is not None else CompletionQueue()
        self.tokens = TokenFactory(start=token_start)
        # tokens made at the end of each step: the engine's calls take one from here
        self.token_pool: collections.deque[uuid.UUID] = collections.deque()
        self.collect_evicted = collect_evicted
        self.collect_published = collect_published
        self.evicted: list[bytes] = []     # keys no longer in any tier (collect_evicted only)
        self.disk_closing = False          # close_disk() is closing the disk store (its restart is behind it)
        self.disk_closed = False           # ... and closed it
        self.disk_reconciled = False       # ... after one more start, for a disk I/O process that died
        self.published: list[bytes] = []   # keys stores and remote fetches made READY (collect_published only)
        # write-back: a host victim never offered to the disk is counted (shed, evicted_unwritten)
        self.write_back = config.write_mode == "back" and config.disk_path is not None
        self.index = TierIndex(num_slots, on_evict=self._host_evicted if collect_evicted or self.write_back else None,
                               policy=make_policy(config.host_policy, num_slots),
                               admission=None if config.host_admission == "all"
                               else make_admission(config.host_admission, num_slots))
        # token.int -> job whose report has not been applied: an int key hashes in C, a UUID in Python
        self.jobs: dict[int, Job] = {}
        self.n_in_flight = {k: 0 for k in JobKind}
        self.spill_faults = 0   # spills whose write failed (applied reports): flush() looks at what it applies
        self._wb_mark = 0       # write-back: host slots used + evictions at its last pass (the difference: stores)
        self._wb_rate = 0       # write-back: a decaying peak of the blocks stored between two passes
        self.closing = False
        # keys a front end told its requests are hits, to be asked again or loaded later (the vLLM scheduler's:
        # SlabScheduler): a fetch's reservation never evicts them (RemoteTier.fetch_found)
        self.promised: Collection[bytes] = ()
        # the job the last begin_store*/begin_load registered, set with no call between its registration and this
        # store: a front end whose submit an interrupt broke off finds here the job it may not hold (see
        # TierManager._unsubmit); a front end clears it before each begin
        self.begun: Optional[Job] = None
        # the front end blocks in a call (TierManager.wait/flush/close): a read the page cache holds is read on
        # this thread, which would otherwise wait for the disk I/O side's answer (config disk_read_cached_in_wait)
        self.read_here = False
        self.read_until: Optional[float] = None   # ... and its deadline (time.monotonic), if it has one
        self.log_debug = log.isEnabledFor(logging.DEBUG)   # refreshed once per step
        self.slot_views = SlotViews(host_rows)
        self._flushes: dict[uuid.UUID, Optional[FlushDone]] = {}
        # the front end's hooks (set by it): apply its STORE/LOAD reports, start a load whose promotes
        # landed, and cancel one of its jobs (a promote's waiting load, an invalidated store)
        # on_store/on_load: a report's application up to its commit, safe to run again (see apply); they return the
        # job's new state (None: unchanged) and the completion to queue in ``outbox`` (None: none), and an object
        # handed to after_store/after_load, which run once after the commit
        self.on_store: Callable[[Job, Report], Applied] = self._no_front_end
        self.on_load: Callable[[Job, Report], Applied] = self._no_front_end
        self.after_store: Callable[[Job, Report, Any], None] = _nothing
        self.after_load: Callable[[Job, Report, Any], None] = _nothing
        self.outbox: list[Any] = []   # the front end's completions (TierManager's; poll() takes the list)
        self.applied: Any = None      # a report whose application was committed, still queued (see apply_arrived)
        self.on_load_ready: Callable[[Job], None] = lambda job: None
        self.on_load_failed: Callable[[Job, str], None] = lambda job, error: None
        self.cancel_hook: Callable[[Job, StaleReason], None] = self.cancel
        self.disk: Optional[DiskTier] = None
        self.dindex: Optional[TierIndex] = None
        self.remote: Optional[RemoteTier] = None
        self.put_faults = 0     # remote writes that failed by a fault (applied reports): flush() looks at them too
        self._malformed_logged = False   # a report of no job kind was logged (once)
        metrics.capacity["host"].set(num_slots * self.row_bytes)
        if config.disk_path is not None:
            # a disk capacity below one row is refused by each front end, before it allocates anything
            self.disk = DiskTier.open(config, self.row_bytes, self.completions, metrics, self._disk_evicted, host)
            self.dindex = None if self.disk is None else self.disk.index
        # a lookup's keys are references the admission filters count (only when one is on)
        self.admitting = self.index.admission is not None or (self.dindex is not None and
                                                               self.dindex.admission is not None)
        # a policy of either tier follows the prefix chains (link() does something)
        self.links = self.index.policy.uses_links or (self.dindex is not None and self.dindex.policy.uses_links)
        if config.remote_url is not None:
            try:
                self.remote = RemoteTier.open(config, self.row_bytes, self.completions, metrics)
            except BaseException:
                if self.disk is not None:
                    self.disk.store.close()
                    self.disk.leave_path()
                raise

    @staticmethod
    def _no_front_end(job: Job, r: Report) -> Applied:  # pragma: no cover - a front end always sets its hooks
        raise AssertionError(f"no front end applies {job.kind} reports")

    # ------------------------------------------------------------------ tokens, accounting
    def take_token(self) -> uuid.UUID:
        pool = self.token_pool
        return pool.popleft() if pool else self.tokens()

    def shed(self, kind: JobKind, why: str, n: int = 1) -> None:
        """Count a job (or ``n`` keys) not started; batched like the per-job counters."""
        m = self.metrics
        m.count(m.job_outcome[(kind, "shed")], n)
        m.count(m.shed[(kind, why)], n)
        if self.log_debug:
            log.debug("%s shed: %s", kind, why)
        return None

    def stale(self, kind: JobKind, reason: StaleReason, token: Any = None) -> None:
        """Count a discarded report (never raised)."""
        self.metrics.count(self.metrics.stale[(kind, reason)])
        if self.log_debug:
            log.debug("discarded stale %s report for token %s: %s", kind, token, reason)

    # ------------------------------------------------------------------ stores
    def begin_store(self, keys: Sequence[bytes], protect: Collection[bytes] = (), chain: bool = True) -> Optional[Job]:
        """A STORE job for those of ``keys`` in no tier yet, each in a reserved host slot.

        A key present in a tier is skipped (touched when on the host) -- but a key whose
        fetch is in flight is stored, the fetch giving way once the key has its slot --, a key that
        finds no evictable slot is shed (``host_full``); ``None`` when nothing is
        left, or when the jobs in flight are at ``max_inflight_jobs`` (shed).  The
        front end fills in the device side (``block``/``blocks``) and submits it.  ``chain``: ``keys``
        are consecutive blocks of one sequence (see :meth:`link`).
        """
        jobs = self.jobs
        dindex = self.readable_dindex()
        if len(jobs) - self.spill_extra >= self.max_inflight:
            index = self.index
            absent = False
            for k in keys:
                e = index.get(k)
                if e is not None:
                    index.touch(e)
                elif dindex is None or k not in dindex:
                    absent = True
            return self.shed(_STORE, "inflight_limit") if absent else None
        fetching: Sequence[Entry] = ()
        if self.remote is not None:   # a key being fetched: the engine's own block wins, if it is stored
            pending = self.remote_pending
            fetching = [e for e in map(self.index.get, keys) if e is not None and e.state is not _READY and pending(e)]
        pool = self.token_pool
        token = None
        try:
            token = pool.popleft() if pool else self.tokens()
            got, entries, full = self.index.reserve_absent(keys, token, protect, dindex, chain, fetching)
            for e in fetching:
                if not e.live:   # its key reserved for this store: the fetch gave way
                    self._fetch_superseded(e)
            if full:   # each key that found no evictable slot (the blocks not offloaded), job started or not
                self.shed(_STORE, "host_full", full)
            if not entries:
                pool.appendleft(token)   # not issued: the next job takes it, in order
                return None
            job = Job(token, _STORE, got[0], -1, keys=got)
            job._entries = entries
            jobs[token.int] = job   # registered: from here to the return no call (see _unreserve)
            self.n_in_flight[_STORE] += 1
        except BaseException:
            self._unreserve(token, keys, fetching)
            raise
        self.begun = job
        return job

    def begin_store_one(self, key: bytes) -> Optional[Job]:
        """:meth:`begin_store` of one key, written out: the engine's ``store()`` calls it once per block,
        and the general path's lists would be four more allocations per call (the garbage collector's
        young generation fills that much sooner, and its pauses land in the engine's calls)."""
        index = self.index
        fetch = index.get(key)
        full = len(self.jobs) - self.spill_extra >= self.max_inflight
        if fetch is not None:
            # a fetch of the key in flight gives way to the engine's own block only if that is stored: the
            # reservation below replaces its entry once it has a slot (_fetch_superseded)
            if fetch.state is _READY or full or not self.remote_pending(fetch):
                index.touch(fetch)
                return None
        dindex = self.dindex
        if dindex is not None and key in dindex and not self.disk.dead:   # type: ignore[union-attr]
            return None
        if full:
            return self.shed(_STORE, "inflight_limit")
        if index.admission is not None and not index.admits(key):   # no call per store without a filter
            return None
        jobs = self.jobs
        pool = self.token_pool
        token = None
        try:
            token = pool.popleft() if pool else self.tokens()
            e = index.reserve(key, token, (), fetch)
            if e is None:
                pool.appendleft(token)   # not issued: the next job takes it, in order
                return self.shed(_STORE, "host_full")
            if fetch is not None:
                self._fetch_superseded(fetch)
            job = Job(token, _STORE, key, -1)
            job._entries = [e]
            jobs[token.int] = job   # registered: from here to the return no call (see _unreserve)
            self.n_in_flight[_STORE] += 1
        except BaseException:
            self._unreserve(token, (key,), () if fetch is None else (fetch,))
            raise
        self.begun = job
        return job

    def _unreserve(self, token: Optional[uuid.UUID], keys: Sequence[bytes], fetching: Sequence[Entry]) -> None:
        """A ``begin_store*`` an interrupt broke off before its job was registered: the host entries it reserved
        under ``token`` (found in the map: :meth:`TierIndex.reserve` puts an entry there before its slot leaves
        the free list) go, and a fetch that gave way to one is told so.  Nothing else holds them: no job, no
        transfer."""
        if token is None:
            return
        index = self.index
        for k in keys:
            e = index.get(k)
            if e is not None and e.writer is token and e.state is _WRITING:
                index.abort(e)
                index.writer_done(e)
        for e in fetching:
            if not e.live:
                self._fetch_superseded(e)

    def publish_entries(self, job: Job) -> list[Entry]:
        """A PENDING store's copies landed: its live parts become READY; returns them.  Safe to run again (a report
        whose application an interrupt broke off is applied again); :meth:`after_publish` follows, once."""
        return self.index.publish_all(job._entries)   # a cancelled part's entry left the index already

    def after_publish(self, job: Job, out: list[Entry]) -> None:
        """After :meth:`publish_entries`, once the report is applied (``out``: the live parts): cancelled
        parts counted stale, the live ones spilled (write-through) and put to the remote tier."""
        dead = job._dead
        if dead is not None:
            for reason in dead.values():
                self.stale(_STORE, reason, job.token)
        if self.collect_published:
            self.published.extend(e.key for e in out)
        if out:
            if self.disk is not None and self.config.write_mode == "through":
                self.start_spills(out)
            remote = self.remote
            if remote is not None:
                if remote.no_slot:   # held here now: a fetch that found no slot before is not a miss any more
                    for e in out:
                        remote.no_slot.pop(e.key, None)
                self.start_puts(out)

    def drop_store(self, job: Job, failed: bool) -> None:
        """A store's report that publishes nothing: it failed (the front end reports and counts it) or
        was cancelled (counted stale: :meth:`count_dropped`).  Safe to run again: each entry leaves the
        index and its writer's hold on the slot goes, once."""
        index = self.index
        for e in job._entries:
            if e.live:
                index.abort(e)   # a failed store's parts; a cancelled one's that a cancel interrupted left
            index.writer_done(e)

    def count_dropped(self, job: Job, failed: bool) -> None:
        """:meth:`drop_store`'s counts, run once its report is applied: the parts (or the whole job) cancelled
        before the report are discarded reports, counted stale (a failed one's cancelled parts too, whatever
        the copy did)."""
        dead = job._dead
        if failed:
            if dead is not None:
                for reason in dead.values():
                    self.stale(_STORE, reason, job.token)
            return
        why = job.cancel_reason or _R_CANCELLED
        if dead is None:   # cancelled whole: one report discarded
            self.stale(_STORE, why, job.token)
        else:   # its parts cancelled one by one (cancel_part): each with its own reason, as after_publish
            for i in range(len(job._entries)):
                self.stale(_STORE, dead.get(i) or why, job.token)

    def settle_cancelled(self, job: Job) -> None:
        """A cancelled STORE/LOAD whose copies are known to be over, without a report to apply (the
        vLLM adapter's rings show it): its record goes and its slots are free once nothing else holds them."""
        if self.jobs.pop(job.token.int, None) is None:
            return
        self.n_in_flight[job.kind] -= 1
        if job.kind is _STORE:
            for e in job._entries:
                self.index.writer_done(e)
        else:
            self.release_load(job)

    def cancel_part(self, job: Job, i: int, reason: StaleReason) -> None:
        """Cancel the part ``i`` of a PENDING store of several keys (its row was given up): the key
        leaves the index now, its slot stays leased until the report; the rest still publishes."""
        dead = job._dead
        if dead is None:
            dead = job._dead = {}
        e = job._entries[i]
        if e.live:
            self.index.abort(e)
        if i in dead:
            return
        dead[i] = reason
        if len(dead) == len(job._entries):
            self.cancel_hook(job, reason)

    # ------------------------------------------------------------------ loads
    def begin_load(self, keys: Sequence[bytes], protect: Collection[bytes] = (),
                   promote: bool = True, bounded: bool = True) -> Optional[Job]:
        """A LOAD job leasing the host slots of ``keys`` (READY there, or read back from disk first).

        ``None`` when a key is in no lower tier (being stored from the device does
        not count), without ``promote`` when a key is not READY on the host, or when
        shed (``bounded=False``: never by ``max_inflight_jobs``, for an engine that was
        promised the blocks).  A key only on disk starts a PROMOTE (the load waits for it: ``on_load_ready``
        once every promote it waits for landed, ``on_load_failed`` if one failed).
        """
        index, dindex, jobs = self.index, self.dindex, self.jobs
        plan: list[Any]
        if len(keys) > 1:
            plan = list(map(index.get, keys))
            if None not in plan and list(map(_state_of, plan)).count(_READY) == len(plan):   # all READY on the host
                if bounded and len(jobs) - self.spill_extra >= self.max_inflight:
                    return self.shed(_LOAD, "inflight_limit")
                token = self.take_token()
                job = Job(token, _LOAD, keys[0], -1, keys=tuple(keys))
                # registered before its leases, each written to job._entries as it is taken: whatever an interrupt
                # broke off, the job holds exactly the leases taken (the front end answers it failed)
                leased = job._entries = [None] * len(plan)
                jobs[token.int] = job
                self.n_in_flight[_LOAD] += 1
                self.begun = job
                index.acquire_all(plan, leased)
                return job
        plan = []                   # per key: its READY host entry, or the PROMOTE job to wait for
        reads: list[int] = []       # the keys to read from disk (plan holds their disk entries)
        for k in keys:
            e = index.get(k)
            if e is not None:
                if e.state is _READY:
                    plan.append(e)
                    continue
                p = jobs.get(e.writer.int)
                if not promote or p is None or p.kind is not _PROMOTE:
                    return None  # being stored from a device row: not in a lower tier yet
                plan.append(p)
                continue
            d = dindex.ready(k) if dindex is not None and promote else None
            if d is None:
                return None
            if self.disk.dead:   # type: ignore[union-attr]   # its read would fail at once: not started
                return self.shed(_LOAD, "disk_down")
            reads.append(len(plan))
            plan.append(d)
        if bounded and len(jobs) - self.spill_extra >= self.max_inflight:
            return self.shed(_LOAD, "inflight_limit")
        if reads:
            if len(keys) > 1:   # a slot for one read must not evict another key of this load
                protect = frozenset(keys).union(protect)
            for i in reads:
                p = plan[i] = self.start_promote(keys[i], plan[i], protect)
                if p is None:
                    return None   # shed (host_full); the reads already started finish as prefetches
        token = self.take_token()
        job = Job(token, _LOAD, keys[0], -1, keys=tuple(keys))
        # registered first, as above; a promote is named in the load's _waiters (the promotes it still waits
        # for) before the load is named in the promote's, so that a promote landing never finds a load that
        # does not know it (an interrupted begin leaves at most the other half, which release_load undoes)
        entries: list[Optional[Entry]] = [None] * len(plan)
        waits: list[Job] = []
        job._entries = entries
        job._waiters = waits
        jobs[token.int] = job
        self.n_in_flight[_LOAD] += 1
        self.begun = job
        for i, p in enumerate(plan):
            if type(p) is not Job:
                index.acquire(p, entries, i)
            else:
                waits.append(p)
                p._waiters.append((job, i))
        return job

    def release_load(self, job: Job) -> None:
        """A load's report was applied (or it was given up before a copy was queued): free its leases, and take
        it off the promotes it waited for.  Safe to run again after an interrupt: each lease leaves the job's
        list as it is released (:meth:`TierIndex.release_taken`), and the promotes forget it before it forgets
        them."""
        entries = job._entries
        if entries:
            self.index.release_taken(entries)
        waits = job._waiters
        if waits:
            for p in waits:
                if p._waiters:
                    p._waiters[:] = [w for w in p._waiters if w[0] is not job]
            job._waiters = None

    def abandon(self, job: Job) -> None:
        """A load given up before any copy was queued (it waited for promotes): no report will come,
        so its record goes now and its leases are freed."""
        tok = job.token.int
        if self.jobs.get(tok) is job:
            self.n_in_flight[job.kind] -= 1
            del self.jobs[tok]
        self.release_load(job)

    def lookup_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are READY in a lower tier (host, or disk), each marked recently used."""
        dindex = self.dindex
        if dindex is not None and self.disk.dead:   # type: ignore[union-attr]   # (readable_dindex, inline)
            dindex = None
        if dindex is None:
            n = host = self.index.ready_run(keys)
        else:
            n, host = self.index.ready_run_below(keys, dindex)
        if self.admitting:   # the filters' counts do not depend on the policies' order: after the run
            self.seen(keys)
        remote = self.remote
        m = self.metrics  # counted like the per-job counters: applied at the end of the step
        m.count(m.lookups, len(keys))
        if n > host:
            m.count(m.hits["disk"], n - host)
        if remote is not None:
            if n < len(keys):
                self._probe_remote(keys, n)
            if remote.landed and host:   # blocks the remote tier fetched into the host: remote hits, counted once
                fetched = remote.hits_among(keys[:n], self.index)
                if fetched:
                    host -= fetched
                    m.count(m.hits["remote"], fetched)
        if host:
            m.count(m.hits["host"], host)
        return n

    def readable_dindex(self) -> Optional[TierIndex]:
        """The disk tier's index while its blocks can be read; None without a disk tier, or while its disk I/O
        process is dead and no new one adopted (:attr:`DiskTier.dead`): a read would fail at once, so a lookup
        finds no block there, a load of one is shed (``disk_down``), and a store of one is the host tier's to
        keep (the disk index is left as it is, for the new process's adoption to reconcile)."""
        dindex = self.dindex
        return None if dindex is None or self.disk.dead else dindex   # type: ignore[union-attr]

    def seen(self, keys: Sequence[bytes]) -> None:
        """The engine asked for ``keys``: references the admission filters count (each front end's lookup)."""
        self.index.seen(keys)
        if self.dindex is not None:
            self.dindex.seen(keys)

    def link(self, keys: Sequence[bytes]) -> None:
        """``keys`` are consecutive blocks of one sequence, in order: a prefix-aware policy of either tier
        links them (its chain evicts from the tail).  A front end whose calls do not carry whole chains
        (vLLM's: a key at a time, a store of one block per KV group) says each link itself."""
        self.index.link(keys)
        if self.dindex is not None:
            self.dindex.link(keys)

    def host_hit(self, key: bytes) -> None:
        """A front end's lookup found ``key`` READY in the host tier: one hit, the remote tier's if it fetched
        the block there and no lookup found it before (as :meth:`lookup_prefix` counts a run of them)."""
        m, remote = self.metrics, self.remote
        if remote is not None and remote.landed and remote.hits_among((key,), self.index):
            m.count(m.hits["remote"])
        else:
            m.count(m.hits["host"])

    def _probe_remote(self, keys: Sequence[bytes], n: int) -> None:
        """Ask the server for the keys past the local prefix ``keys[:n]`` (at most ``remote_prefetch_blocks``
        a step) with this step's probe; those it holds are fetched and are host hits once they land.
        Stops at the first key the server missed lately (the prefix ends there)."""
        remote = self.remote
        assert remote is not None
        index, dindex = self.index, self.dindex
        for k in keys[n:n + remote.prefetch]:
            e = index.get(k)
            if e is not None or (dindex is not None and k in dindex):
                continue   # local (ready, being stored, or being fetched already)
            if not remote.want(k, self.take_token):
                break

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` recently used where they are (host, else disk)."""
        index, dindex = self.index, self.dindex
        for k in keys:
            e = index.get(k)
            if e is not None:
                index.touch(e)
            elif dindex is not None:
                d = dindex.get(k)
                if d is not None:
                    dindex.touch(d)

    # ------------------------------------------------------------------ cancellation
    def cancel(self, job: Job, reason: StaleReason) -> None:
        """PENDING -> CANCELLING, with the core's part of it.

        A store's keys leave the index now (slots leased until its report); a load
        keeps its leases until its report (its copy may still land), unless it still
        waits for promotes (then nothing was queued: the front end reports it at once);
        a spill is tombstoned on disk; a promote's host entry is dropped and its
        waiting loads are cancelled through the front end.
        """
        if job.state is not _PENDING:
            return
        job.state = _CANCELLING
        job.cancel_reason = reason
        t = job._transfer
        if t is not None:
            t.cancelled = True
        kind = job.kind
        if kind is _STORE:
            for e in job._entries:
                self.index.abort(e)
        elif kind is _SPILL:
            dead = job._dead
            for i, d in enumerate(job._dentry):
                if dead is None or i not in dead:
                    self._tomb_spill(d)
        elif kind is _PROMOTE:
            self.index.abort(job._entries[0])
            for w, _ in list(job._waiters or ()):
                self.cancel_hook(w, reason)
        elif kind is _PUT:
            assert self.remote is not None
            for key, token in zip(job.keys, job._dentry):
                self.remote.put_done(key, token)
                self.remote.store.cancel(token, key)
        elif kind is _FETCH:
            for e in job._entries:
                self.index.abort(e)
            for k in job.keys:
                self.remote.fetched(k, job.token)

    def drop_key(self, key: bytes) -> None:
        """Forget ``key`` in every tier: the job writing it is cancelled (only its part, for a store of
        several keys), its disk write tombstoned; it is never served again until stored again.  A key that was
        READY in a tier is collected as gone (``collect_evicted``), as an evicted one is."""
        entry = self.index.get(key)
        if self.collect_evicted and (entry is not None and entry.state is _READY
                                     or self.dindex is not None and self.dindex.ready(key) is not None):
            self.evicted.append(key)
        if entry is not None:
            if entry.state is not _READY:
                w = self.jobs.get(entry.writer.int)
                if w is not None and w.kind is _STORE and len(w._entries) > 1:
                    self.cancel_part(w, w._entries.index(entry), _R_SUPERSEDED)
                elif w is not None and w.kind is not _FETCH:   # a fetch's part: out of the index is enough
                    self.cancel_hook(w, _R_SUPERSEDED)
            self.index.remove(entry)
        remote = self.remote
        if remote is not None:
            got = remote.invalidate(key)
            if got is not None:   # this owner's write of it is in flight: that part is discarded
                token, put = got
                if put.state is _PENDING:
                    dead = put._dead
                    if dead is None:
                        dead = put._dead = {}
                    dead[put._dentry.index(token)] = _R_SUPERSEDED
        disk = self.disk
        if disk is not None:
            d = disk.index.get(key)
            if d is not None:
                spill = self.jobs.get(d.writer.int) if d.state is not _READY else None
                if spill is not None:
                    self.cancel_spill_part(spill, d, _R_SUPERSEDED)
                else:
                    disk.forget(d)

    def cancel_spill_part(self, job: Job, d: Entry, reason: StaleReason) -> None:
        """Cancel the write of disk entry ``d``, one part of the PENDING spill ``job`` (its key was
        invalidated): tombstoned and out of the index now; its host slot stays leased until the
        job's report; the other parts still publish.  The last live part cancels the whole job."""
        if job.state is not _PENDING:
            return
        parts = job._dentry
        i = next(i for i, x in enumerate(parts) if x is d)
        dead = job._dead
        if dead is None:
            dead = job._dead = {}
        if i in dead:
            return
        if len(dead) + 1 == len(parts):
            self.cancel(job, reason)
            return
        dead[i] = reason
        self._tomb_spill(d)

    def _tomb_spill(self, d: Entry) -> None:
        """A spill's write is cancelled: its disk entry leaves the index, a tomb stops its write."""
        disk = self.disk
        assert disk is not None
        disk.index.abort(d)
        disk.store.cancel(d.writer, d.key)

    def drop_all(self) -> None:
        """:meth:`drop_key` for every key of every tier (and the keys whose fetch found no slot: every slot
        is free now)."""
        for e in self.index.entries():
            self.drop_key(e.key)
        if self.dindex is not None:
            for d in self.dindex.entries():
                self.drop_key(d.key)
        if self.remote is not None:
            self.remote.no_slot.clear()

    # ------------------------------------------------------------------ reports
    def apply(self, r: Any) -> None:
        """Apply one worker report: to the live job its token names, else counted and dropped.

        A STORE/LOAD report's application is all-or-nothing under an interrupt.  The front end's ``on_store``/
        ``on_load`` do what may run again (the job stays in ``jobs``: an interrupt there leaves the report at the
        front of the queue, applied again by the next pass); then the commit, with no call from the record's
        removal to the completion's append (an interrupt lands at a call's return): the record goes, the job
        takes its new state, ``applied`` names the report (so that a pass after an interrupt past the commit
        skips it) and the completion is queued; then ``after_store``/``after_load`` (counts, spills), once.  The
        internal jobs' reports the same way: ``_<kind>_reported`` may run again, ``_<kind>_applied`` runs once (a
        probe's answer then starts the fetch of what it found: :meth:`_fetch_found`, finished or undone)."""
        if type(r) is FlushDone:
            if r.token in self._flushes:
                self._flushes[r.token] = r
            if not r.ok:
                self.metrics.error("disk", "flush_failed")
            self.applied = r
            return
        try:
            tok = r.token.int
        except AttributeError:  # not a token at all (a foreign or broken worker): nothing of ours either
            tok = None
        jobs = self.jobs
        job = jobs.get(tok)
        if job is None:
            self._unknown(r)
            self.applied = r
            return
        kind = job.kind
        if kind is _STORE or kind is _LOAD:
            state, c, extra = (self.on_store if kind is _STORE else self.on_load)(job, r)
            del jobs[tok]   # the commit: no call from here to the append
            self.n_in_flight[kind] -= 1
            self.applied = r
            if state is not None:
                job.state = state
            if c is not None:
                self.outbox.append(c)
            (self.after_store if kind is _STORE else self.after_load)(job, r, extra)
            return
        # the internal jobs as a STORE/LOAD: _<kind>_reported may run again, then the commit, then _<kind>_applied once
        if kind is _SPILL:
            state, extra, outcome = self._spill_reported(job, r)
            self._commit(job, tok, r, state, extra)   # (the other parts' tokens left jobs in _spill_reported)
            self._spill_applied(job, r, outcome)
            return
        if kind is _PROMOTE:
            self._commit(job, tok, r, self._promote_reported(job, r))
            self._promote_applied(job, r)
            return
        if kind is _PUT:
            self._commit(job, tok, r, self._put_reported(job, r))
            self._put_applied(job, r)
            return
        # a FETCH; a probe's answer then starts the fetch of what it found, once (finished or undone)
        remote = self.remote
        assert remote is not None
        live = job.state is _PENDING
        state = _CANCELLED if not live else _DONE if r.ok else _FAILED
        if job._entries:
            self._fetch_reported(job, r)
            self._commit(job, tok, r, state)
            self._fetch_applied(job, r)
            return
        found = remote.probe_found(job.token, job.keys, r, self.index, self.dindex) if live else None
        if found:
            self._fetch_found(job, tok, r, state, found)   # (commits first)
        else:
            self._commit(job, tok, r, state)
        if r.failed:
            faults = sum(1 for why in r.failed.values() if not remote.missing(why))
            if faults:
                self.metrics.count(self.metrics.job_outcome[(_FETCH, "failed")], faults)

    def _commit(self, job: Job, tok: int, r: Any, state: JobState, extra: int = 0) -> None:
        """An internal job's report committed, with no call from the record's removal to the job's new state (an
        interrupt lands at a call's return: at this one's, all of it is done): ``applied`` names the report, so
        that a pass after an interrupt past the commit skips it.  ``tok``: the report's token, naming the record;
        ``extra``: the spill's other parts' tokens."""
        del self.jobs[tok]
        self.n_in_flight[job.kind] -= 1
        self.spill_extra -= extra
        self.applied = r
        job.state = state
        job._waiters = None   # (a promote: the loads it named are done with it)

    def _unknown(self, r: Any) -> None:
        """A report no live job's token names: counted ``unknown_token`` under its kind.  A report with no
        kind of ours (a foreign or broken worker's, or not a report at all) is counted under
        ``kind="unknown"`` and logged once; never raised, so the reports drained with it are applied."""
        kind = getattr(r, "kind", None)
        if kind.__class__ is not JobKind:
            try:
                kind = JobKind(kind)
            except (ValueError, TypeError):
                m = self.metrics
                m.count(m.stale_callbacks.labels(kind="unknown", reason=_R_UNKNOWN.value))
                if not self._malformed_logged:
                    self._malformed_logged = True
                    log.warning("discarded a worker report of no job kind: %.200r; further ones are counted "
                                "(tiered_kv_stale_callbacks_total{kind=\"unknown\"}), not logged", r)
                return
        self.stale(kind, _R_UNKNOWN, getattr(r, "token", None))

    def apply_arrived(self) -> None:
        """Start the reads held since the last call, then apply every report that has arrived.  While the
        front end blocks (:attr:`read_here`), the disk store reads what the page cache holds of them on
        this thread (never waiting on the disk: ``disk/cached.py``), their reports applied below."""
        if self.disk is not None:
            self.disk.store.start_reads(cached_here=self.read_here, until=self.read_until)
        # each report leaves the queue only once applied (CompletionQueue.arrived moves them to its kept deque in
        # C): an interrupt in one leaves it and those behind it for the next pass (apply: committed or not)
        kept = self.completions.arrived()
        apply = self.apply
        while kept:
            r = kept[0]
            if r is not self.applied:
                try:
                    apply(r)
                except Exception:   # a fault, not an interrupt: that report is not applied again (it would raise again)
                    if kept and kept[0] is r:
                        kept.popleft()
                        self.applied = None
                    raise
            kept.popleft()
            # (cleared once the report is gone: the same report queued again by its producer is stale, counted)
            self.applied = None

    def _spill_reported(self, job: Job, r: Report) -> tuple[JobState, int, Optional[list[Any]]]:
        """A spill job's one report up to its commit, for each part; safe to run again (an interrupt leaves the
        report queued): the other parts' tokens leave ``jobs``, each live part's disk entry is published or
        dropped by its own outcome (``r.failed``), a cancelled part's is let go, and the host slots' leases go
        (:meth:`TierIndex.release_taken`).  Returns the job's new state, how many tokens beyond the report's it
        held (``spill_extra``), and each part's outcome for :meth:`_spill_applied` (None: every part written)."""
        disk = self.disk
        assert disk is not None
        dindex, jobs = disk.index, self.jobs
        live = job.state is _PENDING
        dead, failed = job._dead, r.failed
        parts, hosts = job._dentry, job._entries
        where = r.where   # each part's record, as the disk side wrote it (None from a store that does not say)
        for d in parts[1:]:   # (the first part's token is the report's: it leaves at the commit)
            jobs.pop(d.writer.int, None)
        state = _CANCELLED if not live else _DONE if r.ok else _FAILED
        if live and r.ok and dead is None and failed is None:   # every part written: the loop below, batched
            if where is not None:
                for d, w in zip(parts, where):
                    d.where = w
            dindex.publish_all(parts)   # (an entry published already is passed over)
            self.index.release_taken(hosts)
            return state, len(parts) - 1, None
        outcome: list[Any] = []
        for i, d in enumerate(parts):
            if not live or (dead is not None and i in dead):
                dindex.writer_done(d)
                why = dead.get(i) if dead is not None else None
                outcome.append(why or job.cancel_reason or _R_CANCELLED)
            elif r.ok or (failed is not None and i not in failed):
                if where is not None:
                    d.where = where[i]
                dindex.publish(d)
                outcome.append(_PART_OK)
            else:
                dindex.writer_done(d)
                dindex.abort(d)
                fault = (r.error if failed is None else failed[i]) != SPILL_PREVENTED
                if fault and hosts[i] is not None:   # (None: released by a pass an interrupt broke off, marked then)
                    hosts[i].spilled = False   # a fault, not a tomb: write-back offers the block again
                outcome.append(_PART_FAULT if fault else _PART_FAILED)
        self.index.release_taken(hosts)
        return state, len(parts) - 1, outcome

    def _spill_applied(self, job: Job, r: Report, outcome: Optional[list[Any]]) -> None:
        """After a spill's commit, once: its counts (a cancelled part stale, a failed one failed, a fault for
        ``flush()``, the bytes written)."""
        m, parts = self.metrics, job._dentry
        n = len(parts)
        if outcome is None:
            m.moved(_SPILL, _HOST_DISK, n * self.row_bytes, r.seconds / n, n)
            return
        ok_parts = 0
        for d, o in zip(parts, outcome):
            if o is _PART_OK:
                ok_parts += 1
            elif o is _PART_FAILED or o is _PART_FAULT:
                m.count(m.job_outcome[(_SPILL, "failed")])
                if o is _PART_FAULT:
                    self.spill_faults += 1
            else:   # a cancelled part: its reason
                self.stale(_SPILL, o, d.writer)
                m.count(m.job_outcome[(_SPILL, "cancelled")])
        if ok_parts:   # the writer's time, shared by the blocks it wrote (cancelled parts included)
            written = n - (0 if r.failed is None else len(r.failed))
            m.moved(_SPILL, _HOST_DISK, ok_parts * self.row_bytes, r.seconds / written, ok_parts)

    def _promote_reported(self, job: Job, r: Report) -> JobState:
        """A read from disk's report up to its commit; safe to run again (an interrupt leaves the report queued, and
        the job in ``jobs``).  The host entry is published (or dropped, with the disk entry when the read found it
        gone or bad); each load still waiting for this read leases the entry -- its copy queued once it was the
        last (``on_load_ready``) -- or, the read failed, is failed and given up (``on_load_failed``, ``abandon``);
        last, the disk entry's pin goes (``job._dentry`` holds it: empty once released).  Each step finds what a
        pass before it did: a lease written into the load's list, a load no longer waiting for this read.  A
        cancelled promote's loads were cancelled with it (the front end's ``_deliver`` finishes a cancel broken
        off).  Returns the job's new state."""
        disk, index = self.disk, self.index
        assert disk is not None
        entry, lease = job._entries[0], job._dentry
        if job.state is not _PENDING:   # invalidated meanwhile
            if entry.live:
                index.abort(entry)   # a cancel an interrupt broke off before its abort
            index.writer_done(entry)
            disk.index.release_taken(lease)
            return _CANCELLED
        disk.promote_reported(index, entry, lease[0] if lease else None, r)
        waiters = job._waiters
        if waiters:
            ok = r.ok and entry.live
            error = (r.error or "miss") if not r.ok else "superseded"
            for w, i in list(waiters):   # (a load given up leaves this list)
                ws = w._waiters
                if not ws or job not in ws:
                    continue   # its copy queued, given up, or no longer waiting for this read
                if w.state is _CANCELLING:
                    continue   # cancelled (its cancel broken off, or its copy queued): the front end finishes it
                if not ok:
                    self.on_load_failed(w, error)   # (a load failed by a pass before is not failed again)
                    self.abandon(w)
                    continue
                leased = w._entries
                if w.state is _PENDING and leased and leased[i] is None:
                    index.acquire(entry, leased, i)
                if len(ws) > 1:
                    ws.remove(job)   # other reads to wait for
                else:   # the last: its copy is queued (or, given up meanwhile, never), then it waits no more
                    self.on_load_ready(w)   # (run again, it finds the copy queued, or the load given up)
                    w._waiters = None
        elif r.ok and entry.live:
            # a lookup's read-back (no load waits for it): that lookup was a use of the block, so it is not the
            # policy's next victim, evicted ahead before the engine asks for it again (S3-FIFO, ARC)
            index.touch(entry)
        disk.index.release_taken(lease)
        return _DONE if r.ok else _FAILED

    def _promote_applied(self, job: Job, r: Report) -> None:
        """After a promote's commit, once: its counts (and the disk entry's recency)."""
        if job.state is _CANCELLED:
            self.stale(_PROMOTE, job.cancel_reason or _R_SUPERSEDED, job.token)
            self.metrics.count(self.metrics.job_outcome[(_PROMOTE, "cancelled")])
            return
        disk = self.disk
        assert disk is not None
        disk.promote_applied(job.key, r)

    # ------------------------------------------------------------------ remote
    def start_puts(self, entries: list[Entry]) -> None:
        """Write READY host entries to the remote tier as one internal PUT job (a token per key, one
        report); what does not fit in its queue is shed and counted.  Each host slot is pinned before the write is
        queued (the writer reads it until the job is answered); an interrupt inside is finished or undone
        (:meth:`_put_start_broken`)."""
        remote = self.remote
        assert remote is not None
        hosts = tokens = before = sent = None
        try:   # (from the first call on: an interrupt lands at a call's return)
            store = remote.store
            hosts = remote.puts_room(entries)
            if hosts:
                before = [e.readers for e in hosts]
                tokens = [self.tokens() for _ in hosts]
                sent = store.puts_accepted
                self.index.pin_all(hosts)   # a copy elsewhere is no use: each stays where it is in the eviction order
                if store.submit_puts(tokens, [e.key for e in hosts], [self.slot_views[e.slot] for e in hosts]):
                    self._register_put(hosts, tokens)
                else:
                    self.index.release_taken(list(hosts))
                    hosts = []
            if len(hosts) < len(entries):
                self.shed(_PUT, "remote_down" if not store.available else "backpressure", len(entries) - len(hosts))
        except BaseException:
            self._put_start_broken(hosts, tokens, before, sent)
            raise

    def _register_put(self, hosts: list[Entry], tokens: list[uuid.UUID]) -> None:
        remote = self.remote
        assert remote is not None
        job = Job(tokens[0], _PUT, hosts[0].key, -1, keys=[e.key for e in hosts])
        job._entries = hosts
        job._dentry = tokens
        tok = tokens[0].int   # the report's token; an invalidated key finds its part by key
        parts = list(zip(job.keys, zip(tokens, repeat(job))))
        putting = remote.putting
        # registered in one step, as a spill job (start_spills)
        self.jobs[tok] = job
        self.n_in_flight[_PUT] += 1
        putting.update(parts)

    def _put_start_broken(self, hosts: Optional[list[Entry]], tokens: Optional[list[uuid.UUID]],
                          before: Optional[list[int]], sent: Optional[int]) -> None:
        """An interrupt broke off :meth:`start_puts`: finish it if the store queued the writes, else undo it.  Read
        back (each step is all or nothing under an interrupt): a host entry was pinned if it holds one lease more
        than ``before``; the store queued the job if its count of put jobs queued moved from ``sent``.  Queued:
        the job is registered, unless it was (every slot was pinned before the writes were queued).  Not queued:
        each pin taken is released.  The shed count is lost.  (None: broken off before that was known -- nothing
        was pinned yet.)"""
        if not hosts or tokens is None or before is None or sent is None or tokens[0].int in self.jobs:
            return
        remote = self.remote
        assert remote is not None
        if remote.store.puts_accepted != sent:
            self._register_put(hosts, tokens)
            return
        index = self.index
        for e, n in zip(hosts, before):
            if e.readers == n + 1:
                index.release(e)

    def _put_reported(self, job: Job, r: Report) -> JobState:
        """A put job's one report up to its commit; safe to run again: each part leaves the writes in flight
        (``put_done``, by its token), and the host slots' leases go (:meth:`TierIndex.release_taken`).  Returns the
        job's new state."""
        remote = self.remote
        assert remote is not None
        put_done = remote.put_done
        for key, token in zip(job.keys, job._dentry):
            put_done(key, token)
        self.index.release_taken(job._entries)
        return _CANCELLED if job.state is not _PENDING else _DONE if r.ok else _FAILED

    def _put_applied(self, job: Job, r: Report) -> None:
        """After a put's commit, once: each part counted by its own outcome (a part whose key was invalidated
        meanwhile is counted stale)."""
        remote = self.remote
        assert remote is not None
        m = self.metrics
        live = job.state is not _CANCELLED
        dead, failed, tokens = job._dead, r.failed, job._dentry
        ok_parts = 0
        for i, token in enumerate(tokens):
            if not live or (dead is not None and i in dead):
                why = dead.get(i) if dead is not None else None
                self.stale(_PUT, why or job.cancel_reason or _R_CANCELLED, token)
                m.count(m.job_outcome[(_PUT, "cancelled")])
            elif r.ok or (failed is not None and i not in failed):
                ok_parts += 1
            else:
                error = r.error if failed is None else failed[i]
                if remote.refused(error):
                    m.count(m.job_outcome[(_PUT, "cancelled")])
                else:
                    m.count(m.job_outcome[(_PUT, "failed")])
                    self.put_faults += 1
        if ok_parts:
            m.moved(_PUT, _HOST_REMOTE, ok_parts * self.row_bytes, r.seconds / len(tokens), ok_parts)

    def want_remote(self, key: bytes) -> bool:
        """Ask the server for ``key`` (in no local tier) with this step's probe; True while it is being
        asked (a lookup answers "ask again later"), False when it will not be (a miss)."""
        remote = self.remote
        return remote is not None and remote.want(key, self.take_token)

    def remote_pending(self, entry: Entry) -> bool:
        """Whether a host entry that is not READY is being fetched from the server."""
        if self.remote is None:
            return False
        j = self.jobs.get(entry.writer.int)
        return j is not None and j.kind is _FETCH

    def _fetch_superseded(self, e: Entry) -> None:
        """The engine stores a key whose fetch is in flight: its own block wins once its store is made (the
        store's reservation took the fetch's entry ``e`` out of the index, ``TierIndex.reserve``'s
        ``replace``); the fetch's part is discarded when its answer comes (counted stale)."""
        assert self.remote is not None and not e.live
        self.remote.superseded(e.key)

    def _start_probe(self) -> None:
        """Submit the step's wanted keys as one FETCH job that first asks which of them the server holds.  An
        interrupt inside is finished or undone (:meth:`_probe_start_broken`): the probe is registered if the store
        queued it, else its keys are no longer asked for (each would be "asked" for good: ``RemoteTier.want``)."""
        remote = self.remote
        assert remote is not None
        token, wanted, sent = remote.want_token, remote.want_keys, None
        try:   # (from the first call on: an interrupt lands at a call's return)
            sent = remote.store.reads_accepted
            got = remote.take_wanted()
            if got is None:
                return
            if type(got) is Refused:   # not queued: the reader is full or the server unavailable (asked again later)
                self.shed(_FETCH, got.why, got.keys)   # counted per key, as fetches are
                return
            self._register_probe(*got)
        except BaseException:
            self._probe_start_broken(token, wanted, sent)
            raise

    def _register_probe(self, token: uuid.UUID, keys: list[bytes]) -> None:
        job = Job(token, _FETCH, keys[0], -1, keys=keys)
        job._entries = []   # a probe: no host slot yet (the fetch that follows has one per key)
        self.jobs[token.int] = job   # registered in one step: no call between this and the count
        self.n_in_flight[_FETCH] += 1

    def _probe_start_broken(self, token: Optional[uuid.UUID], wanted: list[bytes], sent: Optional[int]) -> None:
        """An interrupt broke off :meth:`_start_probe`: what it did is read back.  Its token still wanted: nothing
        was taken.  Registered already: done.  Queued (the store's count of reads queued moved): registered now,
        with the keys it was queued with (those still asked for under its token, in the order wanted).  Else
        none of its keys is asked for any longer (wanted again, they are asked again).  Its shed count is lost."""
        remote = self.remote
        assert remote is not None
        if token is None or sent is None or remote.want_token is token or token.int in self.jobs:
            return
        asking = remote.asking
        keys = list(dict.fromkeys(k for k in wanted if asking.get(k) == token))
        if not keys:
            return
        if remote.store.reads_accepted != sent:
            self._register_probe(token, keys)
            return
        for k in keys:
            del asking[k]

    def _fetch_found(self, job: Job, tok: int, r: Report, state: JobState, found: list[bytes]) -> None:
        """Commit the probe ``job``'s report, then start the fetch of the keys it found (still asked for under its
        token): one FETCH job, a host slot reserved for each (``RemoteTier.fetch_found``).  Run once; an interrupt
        inside, the commit's return included, is finished or undone (:meth:`_fetch_start_broken`)."""
        remote = self.remote
        assert remote is not None
        probe = job.token
        fetch = held = sent = None
        try:   # (from the first call on: an interrupt lands at a call's return)
            self._commit(job, tok, r, state)
            store = remote.store
            held = store.fetch_room_held
            sent = store.reads_accepted
            fetch = self.take_token()
            got = remote.fetch_found(probe, found, fetch, self.index, self.slot_views.__getitem__, self.promised)
            if type(got) is Refused:   # no room in the reader: nothing reserved, counted per key as fetches are
                self.shed(_FETCH, got.why, got.keys)
                return
            if got is None:
                return
            _, hosts, unplaced = got
            self._register_fetch(fetch, hosts)
            if unplaced:   # no host slot for the rest of the prefix: shed, as a read-back's would be
                self.shed(_FETCH, "host_full", unplaced)
        except BaseException:
            self._fetch_start_broken(probe, found, fetch, held, sent)
            raise

    def _register_fetch(self, fetch: uuid.UUID, hosts: list[Entry]) -> None:
        job = Job(fetch, _FETCH, hosts[0].key, -1, keys=[e.key for e in hosts])
        job._entries = hosts
        self.jobs[fetch.int] = job   # registered in one step, as a probe
        self.n_in_flight[_FETCH] += 1

    def _fetch_start_broken(self, probe: uuid.UUID, found: list[bytes], fetch: Optional[uuid.UUID],
                            held: Optional[int], sent: Optional[int]) -> None:
        """An interrupt broke off :meth:`_fetch_found`: finish it if the store queued the fetch, else undo it.

        Read back from the state (each step of it is all or nothing under an interrupt): the host entries
        reserved are those of ``found`` whose writer is ``fetch``; the store queued the fetch if its count of reads
        queued moved; the room taken and not used or given back is what its ``fetch_room_held`` gained.  Queued:
        the job is registered (unless it was) with the entries reserved, in order.  Not queued: each reservation
        is dropped.  Either way the room left held is given back and no key of ``found`` is asked for under the
        probe's token any longer (nor under the fetch's, when not queued).  The shed counts are lost.  (``held``
        and ``sent``: the counts before it, None when it was broken off before it read them: nothing done.)"""
        remote = self.remote
        assert remote is not None
        store, index, asking = remote.store, self.index, remote.asking
        queued = fetch is not None and sent is not None and store.reads_accepted != sent
        hosts = [] if fetch is None else [e for e in map(index.get, found) if e is not None and e.writer == fetch]
        if queued:
            if hosts and fetch.int not in self.jobs:
                self._register_fetch(fetch, hosts)
        else:
            for e in hosts:
                index.writer_done(e)
                index.abort(e)
        for k in found:
            t = asking.get(k)
            if t is not None and (t == probe or (not queued and t == fetch)):
                del asking[k]
        extra = 0 if held is None else store.fetch_room_held - held
        if extra > 0:
            store.give_fetch_room(extra)

    def _fetch_reported(self, job: Job, r: Report) -> None:
        """A fetch's report up to its commit; safe to run again: each part leaves the keys asked for; found, its
        host entry is published, else dropped (a key the server did not hold is remembered as missed).  A part
        whose key was invalidated or stored by the engine meanwhile (its entry out of the index before a pass
        published it) is let go, and named in ``job._dead`` (so a pass again, and the counts, take it as such)."""
        remote = self.remote
        assert remote is not None
        index, entries, failed = self.index, job._entries, r.failed
        stale = job._dead
        if stale is None:   # worked out before any change, then stored in one step: a pass again finds the same
            stale = job._dead = {i: _R_SUPERSEDED for i, e in enumerate(entries) if not e.live}
        now = time.monotonic()
        for i, e in enumerate(entries):
            remote.fetched(e.key, job.token)
            found = r.ok or (failed is not None and i not in failed)
            if found and i not in stale and not e.live and e.state is not _READY:
                stale[i] = _R_SUPERSEDED   # out of the index between two passes, before one published it
            if i in stale:
                index.writer_done(e)
            elif found:
                if e.state is not _READY:   # (published by a pass before: landed then, maybe counted a hit since)
                    index.publish(e)
                    remote.landed_key(e.key, e)
            else:
                index.writer_done(e)
                index.abort(e)
                if remote.missing(r.error if failed is None else failed[i]):
                    remote.note_miss(e.key, now)

    def _fetch_applied(self, job: Job, r: Report) -> None:
        """After a fetch's commit, once: each part counted (found, stale, or a fault: a part the server did not hold
        is a miss, not a failure), and the keys found told as published."""
        remote = self.remote
        assert remote is not None
        m, entries, failed = self.metrics, job._entries, r.failed
        stale = job._dead or {}
        found = faults = 0
        for i, e in enumerate(entries):
            if i in stale:
                self.stale(_FETCH, job.cancel_reason or _R_SUPERSEDED, job.token)
            elif r.ok or (failed is not None and i not in failed):
                if self.collect_published:   # held here now, as a store's block is (reported gone when evicted)
                    self.published.append(e.key)
                found += 1
            elif not remote.missing(r.error if failed is None else failed[i]):
                faults += 1
        if found:   # a lookup hit for the lookup that finds them (lookup_prefix), not now
            m.moved(_FETCH, _REMOTE_HOST, found * self.row_bytes, r.seconds / len(entries), found)
        if faults:
            m.count(m.job_outcome[(_FETCH, "failed")], faults)

    # ------------------------------------------------------------------ disk
    def start_spills(self, entries: list[Entry]) -> None:
        """Write READY host entries to disk as one internal SPILL job (a token per key, one report);
        each that cannot be is shed and counted."""
        disk = self.disk
        assert disk is not None
        # what a handler needs to tell how far a start an interrupt broke off went (_spill_start_broken): the
        # tokens made (a disk entry reserved under one of them is this start's), the host leases before (a pin
        # is one more), and the store's count of accepted submissions
        made: list[uuid.UUID] = []
        make = self.tokens

        def token() -> uuid.UUID:
            t = make()
            made.append(t)
            return t

        before = [e.readers for e in entries]
        sent = disk.store.spills_accepted
        try:
            self._start_spills(entries, token)
        except BaseException:
            self._spill_start_broken(entries, made, before, sent)
            raise

    def _start_spills(self, entries: list[Entry], token: Callable[[], uuid.UUID]) -> None:
        disk = self.disk
        assert disk is not None
        hosts, disks, shed = disk.start_spills(entries, self.index, token, self.slot_views.__getitem__)
        if shed:
            for e, why in shed:   # counted once a residency: write-back offers it again (spilled None)
                if e.spilled is not None:
                    self.shed(_SPILL, why)
            shed_now = {id(e) for e, _ in shed}
            for e in entries:
                e.spilled = None if id(e) in shed_now else True
        else:
            for e in entries:
                e.spilled = True  # on disk, on its way, or refused by the disk's admission: write-back offers it again only if its write fails
        if hosts:
            self._register_spill(hosts, disks)

    def _register_spill(self, hosts: list[Entry], disks: list[Entry]) -> None:
        """Record the spill job of ``hosts`` (pinned) whose writes to ``disks`` (reserved) were queued."""
        job = Job(disks[0].writer, _SPILL, hosts[0].key, -1, keys=[e.key for e in hosts])
        job._entries = hosts
        job._dentry = disks
        # every part's token names the job: an invalidated key finds its write
        parts = list(zip(map(_writer_int, disks), repeat(job)))
        extra = len(disks) - 1
        # registered in one step: no call before the update, itself one C call (an interrupt lands at a call's
        # return), so that the counts and the job map never disagree (a report would take the count below 0)
        self.spill_extra += extra
        self.n_in_flight[_SPILL] += 1
        self.jobs.update(parts)

    def _spill_start_broken(self, entries: list[Entry], made: list[uuid.UUID], before: list[int], sent: int) -> None:
        """An interrupt broke off :meth:`start_spills`: finish it if the store took its writes, else undo it.

        What it did is read back from the state (each step of it is all or nothing under an interrupt): the
        disk entries reserved are those, still in the disk index, whose writer is a token it made (a reservation
        its refusal path aborted is gone already); a host entry was pinned if it holds one lease more than before
        (one its refusal path released holds none more); the store took the writes if its count of accepted
        submissions moved.  Taken: the job is registered (unless it was), and its report comes.  Not taken: each
        pin is released and each reservation dropped.  The shed counts of a start broken off are lost."""
        disk = self.disk
        assert disk is not None
        mine = set(made)
        dmap = disk.index._entries
        hosts: list[Entry] = []
        disks: list[Entry] = []
        pinned: list[bool] = []
        for e, n in zip(entries, before):
            d = dmap.get(e.key)
            if d is not None and d.writer in mine:
                hosts.append(e)
                disks.append(d)
                pinned.append(e.readers == n + 1)
        if not hosts or disks[0].writer.int in self.jobs:   # nothing reserved, or registered already
            return
        if disk.store.spills_accepted != sent:
            for e in hosts:
                e.spilled = True
            self._register_spill(hosts, disks)
            return
        index, dindex = self.index, disk.index
        for e, d, p in zip(hosts, disks, pinned):
            if p:
                index.release(e)
            dindex.writer_done(d)
            dindex.abort(d)

    def start_promote(self, key: bytes, d: Entry, protect: Collection[bytes] = ()) -> Optional[Job]:
        """Read ``key`` (its READY disk entry ``d``) into a new host slot (an internal PROMOTE job).

        The read is held until the next :meth:`apply_arrived`: no reader is woken inside
        the engine's call, and the readers get a step's reads as one batch, in file order."""
        disk = self.disk
        assert disk is not None
        token = job = None
        try:
            token = self.take_token()
            entry = self.index.reserve(key, token, protect)
            if entry is None:
                return self.shed(_LOAD, "host_full")
            job = Job(token, _PROMOTE, key, -1)
            job._entries = [entry]
            job._dentry = [None]   # the disk entry's pin, written there as it is taken (TierIndex.pin)
            job._waiters = []
            self.jobs[token.int] = job
            self.n_in_flight[_PROMOTE] += 1
            disk.index.pin(d, job._dentry, 0)
            disk.store.queue_promote(token, key, d.writer, self.slot_views[entry.slot], d.where)
        except BaseException:
            if job is None or self.jobs.get(token.int) is not job:   # not registered: its reservation goes
                self._unreserve(token, (key,), ())
            else:   # registered: finished here, so that its report comes (a prefetch, if no load waits for it)
                if job._dentry[0] is None:
                    disk.index.pin(d, job._dentry, 0)
                if not disk.store.holds_read(token):
                    disk.store.queue_promote(token, key, d.writer, self.slot_views[job._entries[0].slot], d.where)
            raise
        return job

    def _writeback(self) -> None:
        """Write-back, once per API call (its last pass, and before a flush waits): keep the host's next
        victims written.  Once the host is filling up (3/4 full, as full as evict-ahead lets it get, or
        within ``reserve`` of full), the entries not yet on disk among the ``window`` coldest are spilled:
        at most the blocks stored since the last pass plus ``WRITEBACK_PER_STEP``, and what the writer
        queue takes.

        A spill pins its blocks where they are (no use of them), so the blocks written stay the next
        victims and a pass walks past them to the ones not written: the window holds the reserve of
        written blocks evictions take from, sized to ``WRITEBACK_AHEAD`` steps of stores (a decaying
        peak) beside evict-ahead.  The window counts the blocks whose spills are in flight, in their
        places (``coldest(..., through_pins=True)``): passed over, they would stretch it by as many
        blocks, so that what a pass spills would depend on whether the disk's last answers were applied
        before it (the same replay then spilled other blocks from run to run, and hit 95 or 123 times).
        A victim evicted before its spill is counted (``evicted_unwritten``).

        Each host residency is spilled at most once (``Entry.spilled``): with a disk tier
        smaller than the host tier, each spill evicts a disk entry whose key is still on the
        host, and spilling "whatever is not on disk" would rewrite the same blocks every step.
        Nothing starts while closing, so ``close()`` waits only for the spills already running.
        """
        disk, index = self.disk, self.index
        mark = index.used_slots + index.evictions
        stored, self._wb_mark = max(0, mark - self._wb_mark), mark
        rate = self._wb_rate = max(stored, self._wb_rate - (self._wb_rate + 7) // 8)
        slots = index.num_slots
        reserve = self.evict_ahead + WRITEBACK_AHEAD * rate   # written victims the next steps may take
        if (disk is None or not disk.usable or self.closing
                or index.used_slots < min(slots * WRITEBACK_FILL, slots - self.evict_ahead, slots - reserve)):
            return
        window = min(slots, max(EVICT_AHEAD_MAX, reserve))
        budget = min(stored + WRITEBACK_PER_STEP, disk.store.opts.queue_blocks - disk.store.queue_depth)
        todo = []
        on_disk = disk.index
        for entry in index.coldest(window, through_pins=True):
            if len(todo) >= budget:
                break
            if not entry.spilled and entry.key not in on_disk:
                todo.append(entry)
        if todo:
            self.start_spills(todo)

    def _host_evicted(self, entry: Entry) -> None:
        dindex = self.dindex
        if self.write_back and entry.spilled is False and dindex is not None and entry.key not in dindex:
            self.shed(_SPILL, "evicted_unwritten")   # write-back did not reach it in time: gone (a shed one: counted)
        if self.collect_evicted and (dindex is None or dindex.ready(entry.key) is None):
            self.evicted.append(entry.key)

    def _disk_evicted(self, d: Entry) -> None:
        if self.collect_evicted and d.key not in self.index:
            self.evicted.append(d.key)

    # ------------------------------------------------------------------ the step
    def end_step(self, last: bool, gauges: bool = True, protect: Collection[bytes] = ()) -> None:
        """Per-step bookkeeping after reports were applied.  ``last``: the final pass of an API call,
        which also prepares the next step (free host slots, tokens; the slots freed ahead are never those of
        keys in ``protect``).  ``gauges``: publish the counters and gauges (the last pass always does)."""
        self.log_debug = log.isEnabledFor(logging.DEBUG)
        disk = self.disk
        if disk is not None:
            if disk.down and not self.closing:
                self.apply_arrived()   # the dead I/O process's answers, before the index is reconciled
                disk.restart()
            disk.check_writer(self.closing)
            if last and self.write_back:
                self._writeback()
            disk.store.kick()
        remote = self.remote
        if remote is not None:
            if remote.want_token is not None:
                self._start_probe()
            remote.store.kick()
        if last:
            if self.evict_ahead:
                self.index.evict_ahead(self.evict_ahead, protect)
            pool = self.token_pool
            if len(pool) < TOKEN_POOL:
                make, add = self.tokens, pool.append   # popleft() takes the oldest: tokens are issued in the order made
                for _ in range(TOKEN_POOL - len(pool)):
                    add(make())
        if last or gauges:
            self.refresh_gauges()

    def kick(self) -> None:
        """Send what the stores queued since their last kick: the end of every pass does it, and a blocked
        owner's inner passes after applying reports that queued I/O (a probe's fetch, a promote's touch)."""
        if self.disk is not None:
            self.disk.store.kick()
        if self.remote is not None:
            self.remote.store.kick()

    def reads_left(self) -> bool:
        """A blocked owner's page-cache reads stopped after a chunk (``disk/cached.py``): the rest are held for
        its next pass, which it makes at once, the copies of the blocks read so far started meanwhile."""
        return self.read_here and self.disk is not None and getattr(self.disk.store, "reads_held", False)

    def unsent(self) -> bool:
        """A store holds ops it could not hand on yet (the disk I/O process's pipe was full): a blocked
        owner wakes each slice to send them (:meth:`kick`)."""
        return self.disk is not None and self.disk.store.backlogged

    def refresh_gauges(self) -> None:
        """Push batched counters and the gauge values that changed (once per step, not per job)."""
        disk = self.disk
        remote = self.remote
        if self.admitting:
            self.metrics.publish_refused(self.index.refused, 0 if self.dindex is None else self.dindex.refused)
        if disk is not None:
            disk.count_page_cache_reads()
        self.metrics.publish_levels(self.index.used_slots * self.row_bytes, len(self.index), self.n_in_flight,
                                    None if disk is None else disk.levels(self.row_bytes), self.index.evictions,
                                    None if remote is None else remote.levels())

    # ------------------------------------------------------------------ flush and close
    def fault_counts(self) -> tuple[int, int]:
        """The spill and remote-write faults applied so far.  A front end's ``flush()`` takes them before
        its own first pass and hands them to :meth:`flush`: a fault that pass is the first to apply is one
        the flush covers too."""
        return self.spill_faults, self.put_faults

    def flush(self, block_until: Callable[[Callable[[], bool], Optional[float]], None],
              timeout: Optional[float], before: Optional[tuple[int, int]] = None) -> bool:
        """Block (through the front end's ``block_until``) until every spill queued so far is durable,
        and every remote write, invalidation and cancel queued so far answered by the server.

        False on timeout, with a dead writer, or when a write it covers failed: a batch
        failing after the flush was queued, a spill or remote write failure (a fault, not a
        write a tombstone refused) this call -- from ``before`` (:meth:`fault_counts`) on -- is the
        first to apply, or a remote invalidation or cancel dropped while it waited."""
        ok = self._flush(block_until, timeout)
        return ok and (before is None or self.fault_counts() == before)

    def _flush(self, block_until: Callable[[Callable[[], bool], Optional[float]], None],
               timeout: Optional[float]) -> bool:
        disk, remote = self.disk, self.remote
        ok = True
        if remote is not None:
            faults, dropped = self.put_faults, remote.store.tombs_dropped
            remote.store.kick()
            n = self.n_in_flight
            deadline = None if timeout is None else time.monotonic() + timeout
            drained = [False]   # seen by the wait itself: its last pass may apply a store's report, whose write-through
                                # put (started after this flush) is not one it covers

            def puts_done() -> bool:
                drained[0] = n[_PUT] == 0
                return drained[0]

            block_until(puts_done, timeout)
            ok = drained[0] and self.put_faults == faults
            # an invalidation or a cancel has no report: wait until the writer sent it too
            left = 1e9 if deadline is None else max(0.0, deadline - time.monotonic())
            ok = remote.store.wait_writes(left) and ok
            # a tombstone op dropped meanwhile (refused too often, or shed while the server was away): the
            # server may still hold what it was to remove
            ok = ok and remote.store.tombs_dropped == dropped
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        if disk is None:
            return ok
        if not disk.store.writer_alive():
            return False
        if self.write_back:   # what write-back would spill now is covered by this flush too
            self._writeback()
        faults = self.spill_faults
        token = self.tokens()
        self._flushes[token] = None
        disk.store.submit_flush(token)
        try:
            block_until(lambda: self._flushes[token] is not None or not disk.store.writer_alive(), timeout)
        finally:
            done = self._flushes.pop(token)
        return bool(ok and done is not None and done.ok and self.spill_faults == faults)

    def close_disk(self, block_until: Callable[[Callable[[], bool], Optional[float]], None]) -> None:
        """Wait (bounded) for the spills and remote writes in flight, then stop the disk and remote
        stores' threads."""
        self.closing = True
        remote = self.remote
        if remote is not None:
            remote.store.kick()
            n = self.n_in_flight
            block_until(lambda: n[_PUT] == 0 and n[_FETCH] == 0, CLOSE_TIMEOUT_S)
            remote.store.close()
            self.apply_arrived()
        disk = self.disk
        if disk is None or self.disk_closed:
            return
        if not self.disk_closing:
            n = self.n_in_flight
            block_until(lambda: n[_SPILL] == 0, CLOSE_TIMEOUT_S)
            if disk.dead and not disk.down:
                # the I/O process died and its ops are still being answered: wait for those answers, so that
                # the reconciling start below is not skipped
                block_until(lambda: disk.down, CLOSE_TIMEOUT_S)
            self.disk_closing = True
        if disk.restarting:   # a start (or its adoption) a pass or an interrupted close left: finished first
            self.apply_arrived()
            # adopted, it reconciled; abandoned (a hung disk), no second start nor a second wait for one; a start
            # that failed leaves the reconciling start below to do
            if disk.restart(force=True) or disk.abandoned:
                self.disk_reconciled = True
        disk.store.close()   # idempotent: a close an interrupt broke off is finished by the next one
        self.apply_arrived()
        if disk.died and not self.disk_reconciled:
            # the I/O process died -- before the close, and no pass restarted it (the owner was closing, or in
            # the restart's back-off), or during it --: a key invalidated or evicted meanwhile is still on disk,
            # its delete lost with the process.  One more start reconciles the disk with the index and deletes
            # it, so that the next open does not find it (once: a second death ends the close)
            disk.restart(force=True)
            self.disk_reconciled = True
            disk.store.close()
            self.apply_arrived()
        disk.leave_path()
        self.disk_closed = True

    def simple_block_until(self, done: Callable[[], bool], timeout: Optional[float]) -> None:
        """Apply reports as they arrive until ``done()`` or the timeout (front ends without copies to run).
        What they queue is sent at once, and what a full pipe to the disk I/O process held back each
        :data:`POLL_SLICE_S` (a flush marker held back is otherwise never answered)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.apply_arrived()
        self.kick()
        while not done():
            step = WAKE_S if deadline is None else min(WAKE_S, deadline - time.monotonic())
            if step <= 0:
                return
            if self.unsent():
                step = min(step, POLL_SLICE_S)
            self.completions.wait(step)   # a report that came stays queued: applied below
            self.apply_arrived()
            self.kick()

    # ------------------------------------------------------------------ views
    @property
    def disk_jobs(self) -> int:
        """Spills and promotes whose report has not been applied."""
        return self.n_in_flight[_SPILL] + self.n_in_flight[_PROMOTE]
