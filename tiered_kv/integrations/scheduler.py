"""The vLLM adapter's scheduler side: vLLM's offloading-manager calls mapped onto the tier core.

Runs where lookups are answered (vLLM's scheduler, in the EngineCore process).
Every piece of tier bookkeeping -- the host index over the shared slab, the
disk tier, the job records and tokens, stale and shed accounting, spills,
promotes, write policies, evict-ahead -- is :class:`~tiered_kv.core.TierCore`'s.
What this shell adds is vLLM's protocol (no vLLM import here):

* a job covers the key set vLLM prepared; vLLM reports completions by key set,
  so a completion is matched to a *live* job with that key set; one matching
  none (late, duplicate, or of a job cancelled by ``reset``) is discarded and
  counted in ``tiered_kv_stale_callbacks_total``, never raised;
* the copies run in the worker processes, which mark each job's sequence
  number (the counter half of its token) in their rank's ring of the shared
  slab after its copies (:class:`~tiered_kv.integrations.slab.SharedSlab`); a
  completion is applied to the core only once every rank's ring shows the job
  finished (until then it is *awaiting*), and a store is published only if no
  rank recorded a failed copy;
* ``reset`` cancels the live jobs into a *quarantine*: their slots stay leased
  until the rings show their copies finished, even when vLLM never reports
  them again, so a slot is never reused under a running copy and a store
  cancelled before it completed is never published, on host or disk;
* a lookup answers vLLM's HIT / PENDING (a read-back from disk) / RETRY (a
  fetch from the remote tier) and counts each request's block once
  (``_waiting``, by request); the blocks a waiting request was told are hits
  stay until it asks again (``_asked``/``_kept``).

Longer than the project's usual 500 lines: these are one state machine over the
same maps (a lookup's answer decides what a store may evict and what a tick
keeps; reset and close reach every map), and split, each part would reach into
the others'.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import uuid
from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any, NamedTuple, Optional

from ..config import TieredKVConfig
from ..core import CLOSE_TIMEOUT_S, TierCore
from ..core.tiers import Applied
from ..core.index import EntryState
from ..disk.proc import SharedHost
from ..errors import InvalidKeyError
from ..jobs import Job, JobKind, JobState, StaleReason
from ..metrics import Metrics
from ..movers import Report
from .slab import SharedSlab

__all__ = ["SlabScheduler", "Lookup", "Prepared", "token_seq"]

log = logging.getLogger(__name__)

_STORE, _LOAD, _PROMOTE, _FETCH = JobKind.STORE, JobKind.LOAD, JobKind.PROMOTE, JobKind.FETCH
_PENDING = JobState.PENDING
_READY = EntryState.READY
_SEQ_MASK = (1 << 48) - 1
# named requests that wait on a lookup's answer, kept until finished (request_finished): a front end that never
# finishes its requests loses the oldest past this many.  Not tied to the slots: any number of waiting requests
# may share one read-back (a common prefix)
REQUESTS_MAX = 1 << 16
_NOT_ASKED: Any = object()   # SlabScheduler._waiting: a key not waiting for its answer


def token_seq(token: uuid.UUID) -> int:
    """The sequence number of a job: the counter half of its token (unique per factory)."""
    return token.int & _SEQ_MASK


class Lookup(enum.Enum):
    """What :meth:`SlabScheduler.lookup` answers for one key."""

    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"   # on disk, being read back into the host slab
    RETRY = "retry"       # asked from the remote tier: ask again at a later step


class Prepared(NamedTuple):
    """A job as the worker side needs it: its keys, token, sequence number and slab slots."""

    keys: list[bytes]          # the keys the job moves, in the order of ``slots``
    token: bytes               # the job's token (16 bytes)
    seq: int
    slots: list[int]
    evicted: list[bytes] = []  # prepare_store: keys no longer offloaded anywhere since the last call


def _waited(w: Any, entry: Any, request: Any) -> bool:
    """Whether a lookup of a key that ``SlabScheduler._waiting`` held as ``w`` for ``request`` is that request
    asking again (counted a lookup key at its first ask).  Named (not None), any wait of its own is.  Unnamed
    (a caller that names no request), it is guessed: it waited on the remote tier (None), on this read-back
    (``entry``), or on one that never landed (its read failed); a read-back that landed and that no lookup
    was told of (its request went away; the block was evicted since) is a new request's key."""
    if request is not None:
        return w is not _NOT_ASKED
    return w is None or w is entry or (w is not _NOT_ASKED and w.state is not _READY)


class SlabScheduler:
    """vLLM's scheduler-side calls on the tier core, with the slab's rings as the copies' reports."""

    def __init__(self, config: TieredKVConfig, slab: SharedSlab, *, metrics: Metrics,
                 collect_published: bool = False) -> None:
        self.config = config
        self.slab = slab
        self.row_bytes = slab.row_bytes
        self.metrics = metrics
        # number jobs above anything already in the rings (a restarted scheduler on a used slab),
        # or an old mark would pass for one of ours
        # the disk I/O process (disk_io="process") maps the slab's rows from its file; an fd of our own
        # keeps it reachable for a restarted process after the engine unlinks the name
        self._host_fd = -1
        host: Optional[SharedHost] = None
        if config.disk_path is not None and config.disk_io == "process":
            self._host_fd = os.open(slab.path, os.O_RDWR | os.O_CLOEXEC)
            host = SharedHost(self._host_fd, slab.rows_offset, slab.num_slots, slab.row_bytes, slab.rows.data_ptr(),
                              config.prefault_host_memory)
        try:
            core = self.core = TierCore(config, slab.rows, metrics, token_start=slab.max_seq() + 1,
                                        collect_evicted=True, collect_published=collect_published, host=host)
        except BaseException:
            self._close_host_fd()
            raise
        try:   # (the disk and remote tiers are open: anything raising from here closes them)
            slab.set_owner(core.tokens.prefix)   # the workers copy only this scheduler's jobs (slab.py: the owner)
            core.on_store = self._store_reported
            core.after_store = self._store_applied
            core.on_load = self._load_reported
            core.after_load = self._load_applied
            core.cancel_hook = self._cancel_hook
            self._live: dict[JobKind, dict[frozenset[bytes], collections.deque[Job]]] = {_STORE: {}, _LOAD: {}}
            self._quarantine: list[Job] = []   # cancelled jobs whose copies may still touch their slots
            self._awaiting: list[Job] = []     # completed by the engine, rings not yet showing it
            # (request, key) -> its read-back's host entry (None: asked from the remote tier), for each key a lookup
            # answered PENDING or RETRY and the request has not been told HIT or MISS since: counted a lookup key
            # once.  ``_requests``: each named request that waits on a key, its keys there (request_finished drops
            # them).  Bounded: a named request's waits go when it is answered or finished (REQUESTS_MAX requests);
            # unnamed ones, one per host slot and per key asked from the remote tier (the oldest go)
            self._waiting: dict[tuple[Any, bytes], Any] = {}
            self._requests: dict[Any, set[bytes]] = {}
            self._named = 0   # the entries of _waiting of named requests (the sum of _requests' sets' sizes)
            # each named request's keys answered HIT since it was last scheduled or finished: a request vLLM asks again
            # (deferred on a read-back further down its prefix) is not counted a lookup key and a hit again for them.
            # Bounded as _requests is (REQUESTS_MAX requests, the oldest go)
            self._told: dict[Any, set[bytes]] = {}
            # and its keys answered MISS since then: asked again (vLLM's prefix scan goes on to the first miss at each
            # step a request is deferred) they are the same lookup keys.  Bounded as _told is
            self._missed: dict[Any, set[bytes]] = {}
            # keys answered HIT, PENDING or RETRY since the last tick() (``_looked``: any lookup since), and those of the
            # last step that made lookups, while a request waits: a store's reservation and the evict-ahead at the end
            # of a step leave them (a request waiting on a read-back is asked again later)
            self._asked: set[bytes] = set()
            self._looked = False
            self._kept: set[bytes] = set()
            # _asked | _kept, kept as one set (one object for the core's life): a read-back's or a fetch's host slot
            # never evicts one of them (core.promised)
            self._guard: set[bytes] = set()
            core.promised = self._guard
            self._closed = False
            metrics.health["host"].set(1)
            core.refresh_gauges()
        except BaseException:
            core.close_disk(core.simple_block_until)
            self._close_host_fd()
            raise

    # ------------------------------------------------------------ lookups
    def lookup(self, key: bytes, protect: Collection[bytes] = (), request: Optional[Hashable] = None) -> Lookup:
        """HIT when ``key`` is READY in the host slab; PENDING while it is read back from disk;
        RETRY while it is asked from the remote tier.

        A read-back needs a host slot; it never evicts a key in ``protect`` (the keys
        the same request was just told are hits), nor do a read-back, a fetch from the
        remote tier, a store's reservation and the evict-ahead at the end of a step evict a
        key answered HIT, PENDING or RETRY in this step or the last that made lookups, while a
        request waits to be asked again (:meth:`tick`, :meth:`prepare_store`,
        ``core.promised``: a request waiting on a read-back is asked again later); a read-back
        or a fetch that finds no other slot is a miss, so a prefix longer than the slab gets the
        part that fits instead of evicting itself forever.  The read starts at the end of the
        step (:meth:`tick`), with the step's other reads.  A block is one lookup key of a
        request however often it asks for it while it waits (PENDING, RETRY) and once it has
        its answer, and its hit is counted when it is served, a disk hit if it is the read-back
        the request waited on: a read-back that fails verification is a miss.  ``request``
        names the asking request (vLLM's request id; :meth:`request_finished` when it is
        done); without it, whether an ask is a waiting request's again is guessed by block.
        """
        self._check_key(key)
        self._looked = True
        core = self.core
        if core.admitting:   # a reference the admission filters count, as TierManager's lookup() does
            core.seen((key,))
        entry = core.index.get(key)
        if entry is not None:
            if entry.state is _READY:
                core.index.touch(entry)
                self._hit(key, entry, request)
                return Lookup.HIT
            p = core.jobs.get(entry.writer.int)
            if p is not None and p.kind is _PROMOTE:
                core.apply_arrived()  # the read may have landed since the last step
                if entry.state is _READY:
                    self._hit(key, entry, request)
                    return Lookup.HIT
                answer = Lookup.PENDING if entry.live else Lookup.MISS
            elif core.remote_pending(entry):
                answer = Lookup.RETRY   # asked from the server: a hit or a miss at a later step
            else:
                answer = Lookup.MISS    # being stored from the device: not offloaded yet
        else:
            # not while the disk I/O process is dead: the read would fail at once, the entry stay, and the
            # request be told PENDING (and the same read started) at every step until the restart
            disk = core.disk
            d = core.dindex.ready(key) if disk is not None else None
            if d is not None and disk.dead:   # (the remote tier is not asked for it either: it is held here)
                answer = Lookup.MISS
            elif d is None:
                # not held here: the remote tier (if any) is asked with the step's other keys
                answer = Lookup.RETRY if core.want_remote(key) else Lookup.MISS
            elif core.start_promote(key, d, self._guard if self._guard.issuperset(protect)
                                    else self._guard.union(protect)) is None:
                answer = Lookup.MISS
            else:
                answer = Lookup.PENDING
                entry = core.index.get(key)
        waiting = self._waiting
        rk = (request, key)
        w = waiting.pop(rk, _NOT_ASKED)
        missed: Optional[set[bytes]] = None   # the request's keys told MISS before: counted then
        if request is not None:
            if self._told:   # told HIT before, not now (evicted since): a new lookup key, whose
                told = self._told.get(request)       # hit is counted when it is served
                if told is not None:
                    told.discard(key)
            if self._missed:
                missed = self._missed.get(request)
                if missed is not None and key not in missed:
                    missed = None
        if not _waited(w, entry, request) and missed is None:   # else asked while it waited, or told MISS: counted then
            m = self.metrics
            m.count(m.lookups)
        if answer is Lookup.MISS:
            if request is not None:
                if w is not _NOT_ASKED:
                    self._unwait(request, key)
                if missed is None:
                    self._remember(self._missed, request).add(key)
            return answer
        if missed is not None:   # waits now: its wait carries the key (counted at the miss)
            missed.discard(key)
        # waits for its answer: one key however often it is asked; it goes last (the bounds trim the oldest)
        waiting[rk] = entry if answer is Lookup.PENDING else None
        if request is not None:
            requests = self._requests
            keys = requests.get(request)
            if keys is None:
                keys = requests[request] = set()
                if len(requests) > REQUESTS_MAX:   # (requests never finished: the oldest go)
                    self.request_finished(next(iter(requests)))
            if key not in keys:
                keys.add(key)
                self._named += 1
        else:
            # an unnamed ask: a read-back holds a host slot, a key asked from the remote tier an entry of its
            # asking map (until its fetch holds a slot), so older unnamed waits were evicted or answered.  A
            # named request's waits go when it is told HIT or MISS or finishes (REQUESTS_MAX bounds those never
            # finished)
            remote = core.remote
            if len(waiting) - self._named > core.index.num_slots + (0 if remote is None else len(remote.asking)):
                for old in waiting:   # the oldest unnamed one
                    if old[0] is None:
                        del waiting[old]
                        break
        # a block a request waits on is kept once it lands, until the request asks again (as a hit is)
        self._asked.add(key)
        self._guard.add(key)
        return answer

    def _hit(self, key: bytes, entry: Any, request: Optional[Hashable]) -> None:
        """A lookup found ``key`` READY in the host tier: one lookup key and one hit.  A key that waited for
        its answer (:meth:`lookup`) was counted a lookup key at its first ask; the read-back it waited for is a
        disk hit, anything else that made it READY meanwhile (a fetch from the remote tier) the host tier's or
        the remote tier's, as :meth:`TierCore.host_hit` tells.  A named request told HIT for it before, since it
        was last scheduled or finished (vLLM asks a deferred request again), was counted then."""
        self._asked.add(key)
        self._guard.add(key)
        first = True
        counted = False   # told MISS before: a lookup key then, a hit now
        if request is not None:
            told = self._remember(self._told, request)
            first = key not in told
            told.add(key)
            if self._missed:
                missed = self._missed.get(request)
                if missed is not None and key in missed:
                    missed.discard(key)
                    counted = True
        if self._waiting:
            w = self._waiting.pop((request, key), _NOT_ASKED)
            if w is not _NOT_ASKED and request is not None:
                self._unwait(request, key)
            if w is entry:
                m = self.metrics
                m.count(m.hits["disk"])
                return
            if _waited(w, entry, request):
                self.core.host_hit(key)
                return
        if first:
            if not counted:
                m = self.metrics
                m.count(m.lookups)
            self.core.host_hit(key)

    @staticmethod
    def _remember(per_request: dict[Any, set[bytes]], request: Hashable) -> set[bytes]:
        """``request``'s set in ``per_request`` (``_told``, ``_missed``), made if it has none; at most
        ``REQUESTS_MAX`` requests (never finished nor scheduled: the oldest go)."""
        keys = per_request.get(request)
        if keys is None:
            keys = per_request[request] = set()
            if len(per_request) > REQUESTS_MAX:
                del per_request[next(iter(per_request))]
        return keys

    def _unwait(self, request: Hashable, key: bytes) -> None:
        """``request`` no longer waits on ``key`` (answered HIT or MISS, or trimmed): a request that waits on
        nothing leaves ``_requests``."""
        keys = self._requests.get(request)
        if keys is not None and key in keys:
            keys.discard(key)
            self._named -= 1
            if not keys:
                del self._requests[request]

    def request_finished(self, request: Hashable) -> None:
        """``request`` (as named to :meth:`lookup`) is done, finished or aborted: the blocks it waited for are
        no longer its (a later ask of one is another request's lookup key); the blocks kept for the last
        lookups go at the next :meth:`tick` once no request waits (see there)."""
        self._told.pop(request, None)
        self._missed.pop(request, None)
        keys = self._requests.pop(request, None)
        if keys:
            self._named -= len(keys)
            waiting = self._waiting
            for k in keys:
                waiting.pop((request, k), None)
            remote = self.core.remote
            if remote is not None and remote.no_slot:   # its fetch's no-slot marks: not a miss for a later ask
                for k in keys:                           # (another request waiting on one is asked again)
                    remote.no_slot.pop(k, None)

    def request_scheduled(self, request: Hashable) -> None:
        """``request`` was scheduled (its load or its stores are prepared): its lookups are over, and a wait it
        left on a block it did not ask again (its lookups started past it, or stopped before it) is dropped as at
        :meth:`request_finished`, so that it keeps no block kept while it runs (:meth:`tick`)."""
        self.request_finished(request)

    def touch(self, keys: Iterable[bytes]) -> None:
        self.core.touch(list(keys))

    @property
    def links(self) -> bool:
        """A policy of either tier follows prefix chains: :meth:`link` does something."""
        return self.core.links

    def link(self, keys: Sequence[bytes]) -> None:
        """``keys`` are consecutive blocks of one sequence, in order (a prefix-aware policy's chain)."""
        self._check_keys(keys)
        self.core.link(keys)

    # ------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[bytes], request: Optional[Hashable] = None) -> Prepared:
        """Lease the READY host slots of ``keys`` to a load job (the engine copies them to the device).
        ``request``: the request it loads for, scheduled now: it waits on nothing any more
        (:meth:`request_scheduled`)."""
        keys = list(keys)
        if not keys:
            raise InvalidKeyError("prepare_load of no keys (vLLM loads only the keys lookup reported as hits)")
        for k in keys:
            self._check_key(k)
            if self.core.index.ready(k) is None:
                raise InvalidKeyError(f"prepare_load of key {k!r:.80} that lookup did not report as a hit "
                                      f"(state: {self.core.index.get(k)!r:.120})")
        # after the checks (a refused call changes nothing)
        if request is not None and (request in self._requests or request in self._told or request in self._missed):
            self.request_scheduled(request)
        job = self.core.begin_load(keys, promote=False, bounded=False)
        assert job is not None  # every key READY and no bound: the core always starts it
        self._register(job)
        return Prepared(keys, job.token.bytes, token_seq(job.token), [e.slot for e in job._entries])

    def complete_load(self, keys: Iterable[bytes]) -> None:
        job = self._match(_LOAD, keys)
        if job is None:
            return
        if not self.slab.done(token_seq(job.token)):
            self._awaiting.append(job)
            return
        self._finish_load(job)

    def _finish_load(self, job: Job) -> None:
        # as a store: the outcome is what every rank's ring records (a copy that failed on one rank failed)
        self.core.apply(Report(job.token, _LOAD, self.slab.ok(token_seq(job.token))))

    def _load_reported(self, job: Job, r: Report) -> Applied:
        """TierCore.apply's hook, up to the commit (safe to run again)."""
        self.core.release_load(job)
        return (JobState.DONE if r.ok else JobState.FAILED), None, None

    def _load_applied(self, job: Job, r: Report, extra: Any) -> None:
        # job outcomes are counted here, bytes and copy times by the worker that copied them
        self.metrics.count(self.metrics.job_outcome[(_LOAD, "ok" if r.ok else "failed")])

    # ------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[bytes], chain: bool = True, request: Optional[Hashable] = None) -> Prepared:
        """Reserve host slots for the keys not offloaded yet.

        A key already in a tier is skipped; one that finds no evictable slot is shed
        (counted in ``tiered_kv_shed_total``), so the engine just stores less.  The
        reservation evicts neither these keys nor a key a lookup answered HIT, PENDING or RETRY
        in this step (vLLM makes a step's lookups before its stores), or in a step that
        made none, in the last step that did (as the evict-ahead, :meth:`tick`): a request
        deferred by a read-back finds, when asked again, the blocks it was told are hits.
        ``chain``: ``keys`` are consecutive blocks of one sequence (False: the caller says
        the links itself with :meth:`link`).  ``request``: the request that stores them, scheduled:
        it waits on nothing any more (:meth:`request_scheduled`).
        """
        keys = list(keys)
        self._check_keys(keys)
        # after the checks (a refused call changes nothing)
        if request is not None and (request in self._requests or request in self._told or request in self._missed):
            self.request_scheduled(request)
        core = self.core
        protect = frozenset(keys)
        asked = self._asked if self._looked else self._kept
        if asked:
            protect = protect.union(asked)
        job = core.begin_store(keys, protect=protect, chain=chain)
        evicted = self.take_evicted()
        if job is None:  # everything offloaded already, or shed (counted): nothing for the engine to copy
            token = core.take_token()
            return Prepared([], token.bytes, token_seq(token), [], evicted)
        self._register(job)
        return Prepared(list(job.keys), job.token.bytes, token_seq(job.token), [e.slot for e in job._entries],
                        evicted)

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        job = self._match(_STORE, keys)
        if job is None:
            return
        if not self.slab.done(token_seq(job.token)):
            if not success:
                # its keys go now (never published); its slots wait for the rings' marks, as a cancelled
                # job's do: a failed copy may still be running.  (vLLM 0.30-0.33 report no store failed;
                # an engine that reports one it never ran keeps its slots until the ring entry is reused.)
                # Counted failed, as when the rings showed it done first: the engine's outcome, whatever the order
                self._cancel(job, "failed")
                return
            self._awaiting.append(job)
            return
        self._finish_store(job, success)

    def _finish_store(self, job: Job, success: bool) -> None:
        # publish only what every rank's ring records as copied: a success report matched by key set may
        # be a late one of an older job with the same keys.  The engine's own failure is honoured too (a
        # late *failure* of an older job can cost this store a miss, never wrong bytes)
        ok = success and self.slab.ok(token_seq(job.token))
        self.core.apply(Report(job.token, _STORE, ok))

    def _store_reported(self, job: Job, r: Report) -> Applied:
        """TierCore.apply's hook, up to the commit (safe to run again)."""
        if not r.ok:
            self.core.drop_store(job, failed=True)
            return JobState.FAILED, None, None
        return JobState.DONE, None, self.core.publish_entries(job)

    def _store_applied(self, job: Job, r: Report, published: Any) -> None:
        if not r.ok:
            self.core.count_dropped(job, failed=True)
            self.metrics.count(self.metrics.job_outcome[(_STORE, "failed")])
            return
        self.core.after_publish(job, published)
        self.metrics.count(self.metrics.job_outcome[(_STORE, "ok")])

    # ------------------------------------------------------------ jobs
    def _register(self, job: Job) -> None:
        self._live[job.kind].setdefault(frozenset(job.keys), collections.deque()).append(job)

    def _match(self, kind: JobKind, keys: Iterable[bytes]) -> Optional[Job]:
        """The live job of ``kind`` this engine completion is for; None (counted) when there is none."""
        ks = frozenset(keys)
        jobs = self._live[kind].get(ks)
        if jobs:
            # the engine reports jobs of the same key set in the order it submitted them; prefer one the
            # rings already show finished, so a late report never completes a newer job early
            done = self.slab.done
            pick = next((j for j in jobs if done(token_seq(j.token))), jobs[0])
            jobs.remove(pick)
            if not jobs:
                del self._live[kind][ks]
            return pick
        reason = StaleReason.UNKNOWN_TOKEN
        if any(j.kind is kind and frozenset(j.keys) == ks for j in self._quarantine):
            reason = StaleReason.CANCELLED
        self.core.stale(kind, reason, f"<{len(ks)} keys>")
        return None

    def _cancel(self, job: Job, outcome: str = "cancelled") -> None:
        """Drop a live job's keys now; its slots stay leased until the rings show its copies done.  The job is
        counted with ``outcome`` (an engine-failed store: ``failed``)."""
        jobs = self._live[job.kind].get(frozenset(job.keys))
        if jobs is not None and job in jobs:
            jobs.remove(job)
            if not jobs:
                del self._live[job.kind][frozenset(job.keys)]
        self.core.cancel(job, StaleReason.CANCELLED)
        self._quarantine.append(job)
        # vLLM is done with the job now (a late completion of it is stale): it is finished as cancelled (or failed)
        self.metrics.count(self.metrics.job_outcome[(job.kind, outcome)])

    def _cancel_hook(self, job: Job, reason: StaleReason) -> None:
        if job.kind is _STORE or job.kind is _LOAD:
            if job.state is _PENDING:
                self._cancel(job)
        else:
            self.core.cancel(job, reason)

    def reset(self) -> None:
        """Forget every block in every tier (vLLM ``reset_cache``): nothing stored before is served again from
        the host and disk tiers.  On a shared remote tier only the keys held here are invalidated: a block this
        engine wrote there and no longer holds (and any other engine's) may still be fetched; after a weight
        update give the engines a new ``namespace`` (``docs/remote.md``).

        Jobs in flight are cancelled: their late completions are counted as stale,
        their slots freed once their copies finished, and a store among them is never
        published.  Disk entries get durable tombs.
        """
        for kind in (_STORE, _LOAD):
            for jobs in list(self._live[kind].values()):
                for job in list(jobs):
                    self._cancel(job)
        # completed by the engine but not yet seen in the rings: never published now
        waiting, self._awaiting = self._awaiting, []
        for job in waiting:
            self._cancel(job)
        self.core.drop_all()
        self._waiting.clear()
        self._requests.clear()
        self._told.clear()
        self._missed.clear()
        self._named = 0
        self._asked, self._kept, self._looked = set(), set(), False
        self._guard.clear()
        self.core.refresh_gauges()
        log.info("tiered_kv: every tier reset; %d jobs quarantined until their copies finish", len(self._quarantine))

    # ------------------------------------------------------------ the step
    def tick(self) -> None:
        """Once per engine step: apply disk reports and the completions the rings now confirm, release
        quarantined jobs whose copies finished, prepare the next step (evict-ahead, tokens), gauges."""
        core, done = self.core, self.slab.done
        core.apply_arrived()
        if self._awaiting:
            waiting, self._awaiting = self._awaiting, []
            for job in waiting:
                if not done(token_seq(job.token)):
                    self._awaiting.append(job)
                elif job.kind is _STORE:
                    self._finish_store(job, True)
                else:
                    self._finish_load(job)
        if self._quarantine:
            keep = []
            for job in self._quarantine:
                if done(token_seq(job.token)):
                    core.settle_cancelled(job)
                else:
                    keep.append(job)
            self._quarantine = keep
        if self._looked:   # a step that made lookups: its keys are the ones to keep; one with none keeps the last
            self._kept, self._asked, self._looked = self._asked, set(), False
            guard = self._guard
            guard.clear()
            guard.update(self._kept)
        elif self._kept and not self._waiting:
            # ... while a request waits to be asked again (vLLM may skip it for a step); once none does (each
            # scheduled, finished or aborted), nothing is promised: the next steps' stores may take those slots
            self._kept = set()
            self._guard.clear()
        core.end_step(True, protect=self._kept)

    @property
    def pending_work(self) -> bool:
        """True while a disk read-back or a remote fetch is in flight (or wanted for the next step): a
        request waits on it, so the engine must keep stepping.

        Quarantined and awaiting jobs do not count: they settle at the next step whatever
        happens, and asking for steps on their behalf could spin an idle engine if the
        engine never ran one of them.
        """
        core = self.core
        remote = core.remote
        return (core.n_in_flight[_PROMOTE] > 0 or core.n_in_flight[_FETCH] > 0
                or (remote is not None and remote.want_token is not None))

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every spill queued so far is durable (tests and shutdown)."""
        core = self.core
        # a spill or remote write that failed before the flush was asked for, but whose report this call is
        # the first to apply, is covered too (as TierManager.flush): the writer's own check sees only later
        # batches
        before = core.fault_counts()
        core.apply_arrived()
        ok = core.flush(core.simple_block_until, timeout, before)
        core.apply_arrived()
        return ok and core.fault_counts() == before

    def close(self) -> None:
        """Let read-backs and spills finish (bounded), stop the disk and remote stores.  Idempotent; a close
        an interrupt broke off is finished by the next one (as ``TierManager.close``: each step may run again)."""
        if self._closed:
            return
        core = self.core
        core.closing = True
        core.simple_block_until(lambda: core.n_in_flight[_PROMOTE] == 0, CLOSE_TIMEOUT_S)
        core.close_disk(core.simple_block_until)
        core.slot_views.release()
        core.refresh_gauges()
        self.metrics.closed()   # every tier it reports unhealthy now, as TierManager.close() leaves them
        self._close_host_fd()
        self._closed = True   # last: an interrupt above leaves the rest to the next close()

    def _close_host_fd(self) -> None:
        if self._host_fd >= 0:
            os.close(self._host_fd)
            self._host_fd = -1

    def take_evicted(self) -> list[bytes]:
        """Keys gone from every tier since the last call, in the order they went (``collect_evicted``): evicted by
        a store, by evict-ahead at the end of a step, by a read-back's reservation.  A key evicted and ready
        again meanwhile (read back, or a store published) is not gone; a key only being written again is
        gone until that store is published, which reports it stored again (a failed one never does)."""
        core = self.core
        evicted, core.evicted = core.evicted, []
        if evicted:
            dindex = core.dindex
            evicted = [k for k in evicted if core.index.ready(k) is None and (dindex is None or dindex.ready(k) is None)]
        return evicted

    def take_published(self) -> list[bytes]:
        """Keys published by stores since the last call (``collect_published=True`` only)."""
        out, self.core.published = self.core.published, []
        return out

    # ------------------------------------------------------------ views (tests, tools)
    @property
    def host_blocks(self) -> int:
        return len(self.core.index)

    @property
    def disk_blocks(self) -> int:
        return 0 if self.core.dindex is None else len(self.core.dindex)

    @property
    def disk(self) -> Any:
        """The disk tier's store (None without one or when it failed to open)."""
        return None if self.core.disk is None else self.core.disk.store

    def state_of(self, key: bytes) -> tuple[Optional[str], Optional[str]]:
        """(host state, disk state) of ``key``: 'ready', 'writing' or None."""
        e = self.core.index.get(key)
        d = self.core.dindex.get(key) if self.core.dindex is not None else None
        return (e.state.value if e is not None else None, d.state.value if d is not None else None)

    def debug_sizes(self) -> dict[str, int]:
        core = self.core
        return {
            "live_stores": sum(len(v) for v in self._live[_STORE].values()),
            "live_loads": sum(len(v) for v in self._live[_LOAD].values()),
            "quarantine": len(self._quarantine),
            "awaiting": len(self._awaiting),
            "disk_jobs": core.disk_jobs,
            "host_entries": len(core.index),
            "host_used_slots": core.index.used_slots,
            "disk_entries": self.disk_blocks,
            "waiting_keys": len(self._waiting),
            "waiting_requests": len(self._requests),
        }

    def _check_keys(self, keys: Sequence[Any]) -> None:
        for k in keys:
            self._check_key(k)

    def _check_key(self, key: Any) -> None:
        if type(key) is not bytes or not key:
            raise InvalidKeyError(f"key must be non-empty bytes, got {type(key).__name__}: {key!r:.80}")
        if len(key) > self.config.max_key_bytes:
            raise InvalidKeyError(f"key of {len(key)} bytes exceeds max_key_bytes={self.config.max_key_bytes}")
