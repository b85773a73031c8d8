"""SlabScheduler's lookup counters and KV events against a model of vLLM's requests (hypothesis).

The machine plays vLLM's scheduler over a host slab with a disk tier (no remote tier): stores
(prepare_store -> worker copy -> complete_store), new requests asking a prefix of one of two key chains
(``lookup`` key by key with the request's ``protect`` set, stopping at the first MISS; a request with a
PENDING answer waits and asks its whole prefix again later; one without loads its hits:
prepare_load + ring mark + complete_load), a waiting request asking again, a waiting request aborted,
a whole scheduler step (every waiting request asks again, maybe after its read-backs landed, a new
request asks, ``tick``), ``tick``, ``reset``, settle (read-backs landed, spills durable), and read-backs made to fail
verification (the readers' ``verify_entry`` raises ``CorruptEntry`` for a marked key once).

Checked after every rule, against the model's counts:

* ``tiered_kv_lookup_keys_total``: a (request, block) is one key, counted at the first ask; the asks
  of a block the request was told PENDING, until it is told HIT or MISS, are the same key (a HIT of a
  block that did not wait is one key per answer: a deferred request that asks its HIT blocks again asks
  anew -- lookup's docstring: "one lookup key however often vLLM asks for it while it waits ... and
  once it has its answer");
* ``tiered_kv_lookup_hits_total{tier}``: one per HIT answer, ``disk`` when the block served is the
  read-back the request waited on, ``host`` otherwise; a read-back that fails verification is no hit;
* a HIT answer only for a key READY in the host tier (and prepare_load of the HIT keys never refuses);
* the KV events folded in order as vLLM's manager hands them out (integrations/vllm.py: "stored" for
  ``take_published``, "removed" for ``prepare_store``'s ``evicted`` and ``take_evicted``, reset_cache's
  order included) never claim, after ``tick`` + take_*, a key that no tier holds READY.

The bound on the scheduler's waiting keys (``len(_waiting) > num_slots`` trims the oldest) is the library's
documented bound and is modelled as such.

What it proved wrong (each pinned below by a minimal deterministic test, which failed before the fix; the
machine's own lookups name no request, so it models the library's guess on those paths, counting how often
it took them):

1. ``test_a_read_back_evicted_before_its_request_asks_again_is_still_one_lookup_key``.
   A request told PENDING for a disk block whose read-back lands and is evicted before the request asks
   again (it is not scheduled in the next step -- token budget -- whose lookups of other blocks replace the
   protected set, and whose store's reservation takes the slot) is counted a second lookup key when it
   asks again: one block asked for by one request and served from disk is 2 keys and 1 hit (hit ratio
   1/2, the defect fixed twice before, on this path).
   Where: scheduler.py ``_waited`` -- ``w.state is not _READY`` treats the landed-then-evicted entry (its
   ``state`` stays READY after ``TierIndex._evicted``) as "a new request's key".  Its docstring says this is
   on purpose ("its request went away; the block was evicted since"), because ``lookup`` cannot tell the
   waiting request from a new one.

2. ``test_a_new_request_for_a_block_an_aborted_request_waited_on_is_a_lookup_key``.
   The other side of the same guess: a request told PENDING goes away (aborted, or finished by its other
   blocks' misses); a new request asking the same block is *not* counted a key (it is taken for the old
   request asking again) and, if the read-back landed, its HIT is counted a ``disk`` hit although it never
   waited: two requests asked, one key and one hit counted (hit ratio 1 instead of 1/2).

3. ``test_two_requests_waiting_on_one_read_back_both_count_a_disk_hit``.
   Two waiting requests share a block's read-back: the second request's first ask is not counted (taken as
   the first asking again) and, once the first took the HIT, its HIT counts a new key and a ``host`` hit.
   Totals happen to agree (2 keys, 2 hits) but the tier is wrong (1 disk + 1 host for two blocks served
   from the read-back both waited on).

All three have one cause: ``SlabScheduler.lookup(key, protect)`` gets no request identity, so
``_waiting`` is keyed by block alone and the "is this the same request asking again" question is guessed.
Fixed: ``lookup`` takes the request (``request=``; integrations/vllm.py passes ``req_context.req_id``),
``_waiting`` is keyed by (request, block), and ``SlabScheduler.request_finished`` (called from the
manager's ``on_request_finished``) drops a request's entries; "asked again" is then exact, the
landed-and-evicted read-back stays the same key, and a new request's ask is always a new key.  A caller
that names no request still gets the guess by block.
How the machine keeps off these paths: (3) is avoided (a new request never asks a block a live request
waits on); on (2) an aborted request's waits are handed to the next request that asks the block, as the
library does (``seen["orphan_adopted"]``); (1) is expected as the library counts it
(``seen["evicted_then_asked"]``).  Everything else is checked against the semantics above.  With the
settings below (60 derandomized examples of up to 30 steps) a run takes ~20 s on 2 cores and reaches ~85
PENDING answers, ~55 disk hits, ~13 failed read-backs asked again, ~200 loads; sweeps of 3 x 200 random
examples (``TIERED_KV_SWEEP_EXAMPLES``) passed too.  A rule ends by waiting (applying nothing) until the
disk threads answered what they were handed (``quiesce``), and no precondition reads the state: hypothesis
replays the same draws whatever the threads' timing.

Mutation check (monkeypatched in a throwaway run in /tmp, never in the library; each caught by this machine):
``_hit`` counting the served read-back as ``hits["host"]`` instead of ``hits["disk"]`` (counts invariant);
``_waited`` always False (every ask a new key: the bug fixed before) and ``_waited = w is None or w is
entry`` (the re-ask after a failed read-back counted again) (counts invariant); ``TierCore.drop_key``
not collecting the dropped keys as gone (reset's KV-event bug fixed before) (events check).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from prometheus_client import CollectorRegistry

import tiered_kv.disk.readers as _readers
from fakes import sm_settings
from test_vllm_scheduler import (  # noqa: F401  (rig: the fixture)
    HIT, MISS, PENDING, A, B, C, D, mark, metric, rig, store_ready, wait_promotes, worker_store,
)
from tiered_kv import TieredKVConfig
from tiered_kv.core.index import EntryState
from tiered_kv.disk.format import CorruptEntry
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.jobs import JobKind
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

KEYS_M = "tiered_kv_lookup_keys_total"
HITS_M = "tiered_kv_lookup_hits_total"
TIERS = ("host", "disk", "remote")

ROW = 256
SLOTS = 4
DISK_BLOCKS = 6
CHAINS = [[b"a%d" % i for i in range(4)], [b"b%d" % i for i in range(4)]]
ALL_KEYS = [k for c in CHAINS for k in c]
ORPHAN = -1          # the owner of a wait whose request was aborted


# =========================================================================== injected read failures
class _Corrupt:
    """Keys whose next disk read fails verification (the readers' ``verify_entry`` raises once)."""

    keys: set[bytes] = set()
    real = None

    @classmethod
    def install(cls) -> None:
        if cls.real is None:
            cls.real = _readers.verify_entry

            def verify(value: Any, namespace: bytes, key: Optional[bytes], *a: Any, **kw: Any) -> Any:
                if key is not None and bytes(key) in cls.keys:
                    cls.keys.discard(bytes(key))
                    raise CorruptEntry("checksum", "injected by the test")
                return cls.real(value, namespace, key, *a, **kw)

            _readers.verify_entry = verify
        cls.keys.clear()

    @classmethod
    def uninstall(cls) -> None:
        if cls.real is not None:
            _readers.verify_entry = cls.real
            cls.real = None
        cls.keys.clear()


def _counts(m: Metrics) -> tuple[float, dict[str, float]]:
    return metric(m, KEYS_M), {t: metric(m, HITS_M, tier=t) for t in TIERS}


def _offloaded(tiers: SlabScheduler, k: bytes) -> bool:
    core = tiers.core
    return core.index.ready(k) is not None or (core.dindex is not None and core.dindex.ready(k) is not None)


class _Wait:
    """The model's record of a block a request was told PENDING for (and not HIT or MISS since)."""

    __slots__ = ("owner", "entry")

    def __init__(self, owner: int, entry: Any) -> None:
        self.owner, self.entry = owner, entry


# =========================================================================== the machine
class SchedulerCountsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tkv-counts-sm-"))
        self.slab = SharedSlab.open(self.dir / "m.slab", SLOTS, ROW, 1, ring_size=4096)
        self.metrics = Metrics(registry=CollectorRegistry(), namespace="t")
        cfg = TieredKVConfig(namespace="t", host_capacity_bytes=SLOTS * ROW, disk_path=self.dir / "disk",
                             disk_capacity_bytes=DISK_BLOCKS * ROW, writer_batch_seconds=0.0,
                             disk_io="thread", host_evict_ahead_blocks=1)
        _Corrupt.install()
        self.tiers = SlabScheduler(cfg, self.slab, metrics=self.metrics, collect_published=True)
        # the model
        self.keys = 0
        self.hits = {t: 0 for t in TIERS}
        self.waits: "OrderedDict[bytes, _Wait]" = OrderedDict()   # as the library's _waiting: one per block
        self.requests: dict[int, list[bytes]] = {}                 # live (waiting) requests: id -> prefix
        self.next_rid = 0
        self.claimed: dict[bytes, bool] = {}                       # what a KV-event consumer believes
        self.seen = {"evicted_then_asked": 0, "orphan_adopted": 0, "disk_hits": 0, "read_failed": 0,
                     "loads": 0, "pending": 0, "steps": 0, "quiesce_timeouts": 0}

    # -- the model's lookup ----------------------------------------------------
    def _landed_elsewhere(self, w: Optional[_Wait], cur: Any) -> bool:
        """Finding 1: the read-back ``w`` waited on landed and is no longer the host entry (evicted since):
        the library takes the next ask for a new request's (one more lookup key)."""
        return (w is not None and w.entry is not None and w.entry.state is EntryState.READY
                and w.entry is not cur)

    def _lookup(self, rid: int, k: bytes, protect: set[bytes]) -> Lookup:
        tiers = self.tiers
        w = self.waits.get(k)
        assert w is None or w.owner in (rid, ORPHAN), (k, w.owner, rid)   # by construction (finding 3)
        if w is not None and w.owner == ORPHAN:
            self.seen["orphan_adopted"] += 1        # finding 2: the library takes it for the old request's ask
            w.owner = rid
        ans = tiers.lookup(k, protect=protect)
        cur = tiers.core.index.get(k)
        new_key = w is None or self._landed_elsewhere(w, cur)
        if w is not None and self._landed_elsewhere(w, cur):
            self.seen["evicted_then_asked"] += 1
        if ans is HIT:
            assert cur is not None and cur.state is EntryState.READY, f"{k!r} answered HIT, host: {cur!r}"
            assert tiers.state_of(k)[0] == "ready"
            self.waits.pop(k, None)
            if w is not None and w.entry is cur:
                self.hits["disk"] += 1               # served from the read-back it waited on
                self.seen["disk_hits"] += 1
            else:
                self.hits["host"] += 1
                if new_key:
                    self.keys += 1
        elif ans is PENDING:
            assert cur is not None and cur.state is not EntryState.READY, (k, cur)
            self.seen["pending"] += 1
            if new_key:
                self.keys += 1
            self.waits.pop(k, None)
            self.waits[k] = _Wait(rid, cur)           # last: the bound trims the oldest
            if len(self.waits) > tiers.core.index.num_slots:
                del self.waits[next(iter(self.waits))]
        else:
            assert ans is MISS, ans                   # no remote tier: never RETRY
            if w is not None and w.entry is not None and w.entry.state is not EntryState.READY and not w.entry.live:
                self.seen["read_failed"] += 1
            self.waits.pop(k, None)
            if new_key:
                self.keys += 1
        return ans

    def _ask(self, rid: int, prefix: list[bytes]) -> None:
        """One scheduler step's lookups of a request (vLLM's maximal prefix lookup, integrations/vllm.py's
        ``protect``); a request with no PENDING answer loads its hits and is done, one with any waits."""
        seen: set[bytes] = set()
        hits: list[bytes] = []
        deferred = False
        for k in prefix:
            ans = self._lookup(rid, k, seen)
            if ans is MISS:
                break
            seen.add(k)
            if ans is HIT:
                hits.append(k)
            else:
                deferred = True
        if deferred:
            self.requests[rid] = list(prefix)
            return
        self.requests.pop(rid, None)
        for w in self.waits.values():   # a block past its first MISS: the request went on without it
            if w.owner == rid:
                w.owner = ORPHAN
        if hits:
            pl = self.tiers.prepare_load(hits)       # raises if a key told HIT is not READY
            mark(self.slab, pl.seq)
            self.tiers.complete_load(hits)
            self.seen["loads"] += 1

    # -- events ------------------------------------------------------------------
    def _fold(self, stored: list[bytes], removed: list[bytes]) -> None:
        for k in stored:
            self.claimed[k] = True
        for k in removed:
            self.claimed[k] = False

    def _take_events_and_check(self) -> None:
        self._fold(self.tiers.take_published(), self.tiers.take_evicted())
        wrong = sorted(k for k, v in self.claimed.items() if v and not _offloaded(self.tiers, k))
        assert not wrong, f"the KV events claim {wrong} offloaded; no tier holds them READY"

    # -- rules ---------------------------------------------------------------------
    @initialize(order=st.permutations(ALL_KEYS))
    def populate(self, order: list[bytes]) -> None:
        """Blocks stored one at a time, each made durable: the host holds the last ones, the disk the rest."""
        for k in order:
            p = self.tiers.prepare_store([k])
            self._fold(self.tiers.take_published(), p.evicted)
            worker_store(self.slab, p.keys, p.slots, p.seq, "v")
            self.tiers.complete_store(p.keys)
            assert self.tiers.flush(timeout=30)
        self.tiers.tick()
        self._take_events_and_check()

    @rule(chain=st.integers(0, 1), start=st.integers(0, 3), n=st.integers(1, 3), durable=st.booleans())
    def store(self, chain: int, start: int, n: int, durable: bool) -> None:
        keys = CHAINS[chain][start:start + n]
        p = self.tiers.prepare_store(keys)
        self._fold(self.tiers.take_published(), p.evicted)     # as the vLLM manager's prepare_store
        for k in p.evicted:
            assert not _offloaded(self.tiers, k) or k in p.keys, k
        if p.keys:
            worker_store(self.slab, p.keys, p.slots, p.seq, "v")
            self.tiers.complete_store(p.keys)
        if durable:   # the spills done: the host slots they pinned are evictable again (disk-only blocks follow)
            assert self.tiers.flush(timeout=30)

    @rule(chain=st.integers(0, 1), n=st.integers(1, 4), bad=st.integers(0, 2))
    def new_request(self, chain: int, n: int, bad: int) -> None:
        """A new request; with ``bad == 0`` the first disk-only block of its prefix fails verification when read."""
        prefix = CHAINS[chain][:n]
        if bad == 0:
            only = [k for k in prefix if self.tiers.state_of(k) == (None, "ready")]
            if only:
                _Corrupt.keys.add(only[0])
        busy = {k for k, w in self.waits.items() if w.owner != ORPHAN}
        if busy.intersection(prefix):
            return                                  # finding 3's path: two requests waiting on one block
        rid = self.next_rid
        self.next_rid += 1
        self._ask(rid, prefix)

    # no preconditions on the model's state: the data drawn has the same shape whatever the timing of the
    # disk threads made of the state (hypothesis replays the draws; a state-dependent precondition would not be)
    @rule(i=st.integers(0, 7), landed=st.booleans())
    def ask_again(self, i: int, landed: bool) -> None:
        """A waiting request's next step: at once, or (``landed``) once the step's read-backs landed."""
        if not self.requests:
            return
        rid = sorted(self.requests)[i % len(self.requests)]
        if landed:
            wait_promotes(self.tiers)
            self._take_events_and_check()
        self._ask(rid, self.requests[rid])

    @rule(landed=st.booleans(), chain=st.integers(0, 1), n=st.integers(0, 4), bad=st.integers(0, 2))
    def scheduler_step(self, landed: bool, chain: int, n: int, bad: int) -> None:
        """One scheduler step as vLLM runs it: every waiting request asks again (``landed``: the last step's
        read-backs have landed), then a new request asks (``n`` blocks; none with 0), then the step ends."""
        if landed:
            wait_promotes(self.tiers)
            self._take_events_and_check()
        for rid in sorted(self.requests):
            if rid in self.requests:
                self._ask(rid, self.requests[rid])
        if n:
            self.new_request(chain, n, bad)
        self.tick()

    @rule(i=st.integers(0, 7))
    def abort(self, i: int) -> None:
        if not self.requests:
            return
        rid = sorted(self.requests)[i % len(self.requests)]
        del self.requests[rid]
        for w in self.waits.values():
            if w.owner == rid:
                w.owner = ORPHAN

    @rule()
    def tick(self) -> None:
        self.tiers.tick()
        self._take_events_and_check()

    @rule()
    def settle(self) -> None:
        wait_promotes(self.tiers)
        assert self.tiers.flush(timeout=30)
        self.tiers.tick()
        self._take_events_and_check()

    @rule(go=st.integers(0, 3))
    def reset(self, go: int) -> None:
        if go < 3:
            return
        tiers = self.tiers
        self._fold(tiers.take_published(), tiers.take_evicted())   # as the vLLM manager's reset_cache
        tiers.reset()
        self._fold([], tiers.take_evicted())
        # vLLM resets the prefix cache with no request running: the requests are gone, and so are their waits
        self.requests.clear()
        self.waits.clear()
        _Corrupt.keys.clear()
        tiers.tick()
        self._take_events_and_check()
        for k in ALL_KEYS:
            assert tiers.state_of(k) == (None, None), (k, tiers.state_of(k))

    # -- invariants -------------------------------------------------------------
    @invariant()
    def quiesce(self) -> None:
        """Between two rules, wait (without applying anything) until every disk read and spill handed to the
        threads has reported: what the next rule's calls apply is then the same on every run, so that
        hypothesis replays and shrinks deterministically (reads held for the next step stay held)."""
        core = self.tiers.core
        if core.disk is None:
            return
        held = len(core.disk.store.readers._held_reads)
        want = core.n_in_flight[JobKind.PROMOTE] - held + core.n_in_flight[JobKind.SPILL]
        q = core.completions
        deadline = time.monotonic() + 5.0
        while q._q.qsize() + len(q._kept) < want:
            if time.monotonic() > deadline:
                self.seen["quiesce_timeouts"] += 1
                return
            time.sleep(0.0005)

    @invariant()
    def named_waits_counted(self) -> None:
        """``SlabScheduler._named`` (what the unnamed waits' bound leaves out) is the named requests' waits."""
        t = self.tiers
        assert t._named == sum(map(len, t._requests.values())) == sum(1 for r, _ in t._waiting if r is not None)

    @invariant()
    def counts_agree(self) -> None:
        self.seen["steps"] += 1
        keys, hits = _counts(self.metrics)
        assert (keys, hits) == (self.keys, self.hits), (
            f"lookup keys {keys} (model {self.keys}), hits {hits} (model {self.hits})")

    def teardown(self) -> None:
        try:
            if sys.exc_info()[0] is None:
                self.settle()
                self.counts_agree()
        finally:
            try:
                self.tiers.close()
            finally:
                _Corrupt.uninstall()
                self.slab.close()
                shutil.rmtree(self.dir, ignore_errors=True)


SchedulerCountsMachine.TestCase.settings = sm_settings(
    60, 30, report_multiple_bugs=False,
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
)
test_scheduler_counts_machine = SchedulerCountsMachine.TestCase


# =========================================================================== findings (xfail, strict)
def _disk_tiers(rig: Any, num_slots: int) -> SlabScheduler:
    slab = rig.slab(num_slots=num_slots, row_bytes=ROW)
    return rig.open(slab, disk=True, disk_blocks=16, disk_io="thread", host_evict_ahead_blocks=0)


def _make_disk_only(tiers: SlabScheduler, key: bytes, fillers: list[bytes]) -> None:
    """``key`` stored (spilled, write-through), then evicted from the host by stores of ``fillers``."""
    store_ready(tiers, [key])
    assert tiers.flush(timeout=30)
    for f in fillers:
        store_ready(tiers, [f])
    assert tiers.flush(timeout=30)
    tiers.tick()
    assert tiers.state_of(key) == (None, "ready"), tiers.state_of(key)


def test_a_read_back_evicted_before_its_request_asks_again_is_still_one_lookup_key(rig):
    tiers = _disk_tiers(rig, num_slots=2)
    _make_disk_only(tiers, A, [B, C])                # host: B, C; disk: A (and B, C)
    base = _counts(tiers.metrics)
    assert tiers.lookup(A, request="R") == PENDING   # request R waits on A's read-back (B evicted for it)
    wait_promotes(tiers)                             # it landed; R is not scheduled in the next step
    assert tiers.state_of(A)[0] == "ready"
    assert tiers.lookup(C, request="O") == HIT       # the next step: another request's hit (loaded at once) ...
    pl = tiers.prepare_load([C])
    mark(tiers.slab, pl.seq)
    tiers.complete_load([C])
    p = tiers.prepare_store([D])                     # ... and a store: its reservation takes A's slot
    assert p.keys == [D] and tiers.state_of(A)[0] is None, (p, tiers.state_of(A))
    worker_store(tiers.slab, p.keys, p.slots, p.seq)
    tiers.complete_store(p.keys)
    assert tiers.flush(timeout=30)
    tiers.tick()
    assert tiers.state_of(A) == (None, "ready")
    assert tiers.lookup(A, request="R") == PENDING   # R asks again: read back again
    wait_promotes(tiers)
    assert tiers.lookup(A, request="R") == HIT       # served from the read-back R waited on
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["disk"] - base[1]["disk"], hits["host"] - base[1]["host"])
    assert got[1:] == (1, 1), got
    assert got[0] == 2, f"R asked for A, the other request for C: {got[0]} lookup keys"


def test_a_new_request_for_a_block_an_aborted_request_waited_on_is_a_lookup_key(rig):
    tiers = _disk_tiers(rig, num_slots=2)
    _make_disk_only(tiers, A, [B, C])
    base = _counts(tiers.metrics)
    assert tiers.lookup(A, request="R1") == PENDING  # request R1 waits on A's read-back, then is aborted
    wait_promotes(tiers)
    tiers.request_finished("R1")
    assert tiers.lookup(A, request="R2") == HIT      # request R2 (new) asks: the block is in the host tier
    keys, hits = _counts(tiers.metrics)
    assert keys - base[0] == 2, f"two requests asked for A: {keys - base[0]} lookup key(s), hits {hits}"


def test_two_requests_waiting_on_one_read_back_both_count_a_disk_hit(rig):
    tiers = _disk_tiers(rig, num_slots=2)
    _make_disk_only(tiers, A, [B, C])
    base = _counts(tiers.metrics)
    assert tiers.lookup(A, request="R1") == PENDING  # R1
    assert tiers.lookup(A, request="R2") == PENDING  # R2, same block, same step
    wait_promotes(tiers)
    assert tiers.lookup(A, request="R1") == HIT      # R1 asks again
    assert tiers.lookup(A, request="R2") == HIT      # R2 asks again
    keys, hits = _counts(tiers.metrics)
    got = (keys - base[0], hits["disk"] - base[1]["disk"], hits["host"] - base[1]["host"])
    assert got == (2, 2, 0), f"(keys, disk hits, host hits) = {got}: both requests waited on A's read-back"


def test_a_finished_request_leaves_nothing_waiting(rig):
    """request_finished drops what a request waited for (vLLM calls it for every request, aborted ones too)."""
    tiers = _disk_tiers(rig, num_slots=2)
    _make_disk_only(tiers, A, [B, C])
    assert tiers.lookup(A, request="R1") == PENDING
    assert tiers.lookup(A, request="R2") == PENDING
    assert (tiers.debug_sizes()["waiting_keys"], tiers.debug_sizes()["waiting_requests"]) == (2, 2)
    tiers.request_finished("R1")
    tiers.request_finished("gone")                   # never asked anything: nothing to drop
    assert (tiers.debug_sizes()["waiting_keys"], tiers.debug_sizes()["waiting_requests"]) == (1, 1)
    wait_promotes(tiers)
    assert tiers.lookup(A, request="R2") == HIT      # answered: no longer waiting, its request still known
    assert tiers.debug_sizes()["waiting_keys"] == 0
    tiers.request_finished("R2")
    assert tiers.debug_sizes()["waiting_requests"] == 0


# =========================================================================== checked and found right
def test_a_failed_read_back_then_the_block_stored_again_is_one_key_and_a_host_hit(rig):
    """The request waited on a read that failed verification, the engine recomputed and stored the block,
    the request asks again: one key, one host hit, and the removal was reported before the new store."""
    tiers = _disk_tiers(rig, num_slots=2)
    tiers.core.collect_published = True
    _make_disk_only(tiers, A, [B, C])
    tiers.take_published(), tiers.take_evicted()
    base = _counts(tiers.metrics)
    _Corrupt.install()
    try:
        _Corrupt.keys.add(A)
        assert tiers.lookup(A) == PENDING
        wait_promotes(tiers)
        assert tiers.state_of(A) == (None, None)
        assert tiers.take_evicted() == [A]           # gone from every tier: reported removed
        store_ready(tiers, [A], tag="again")
        assert tiers.lookup(A) == HIT
    finally:
        _Corrupt.uninstall()
    keys, hits = _counts(tiers.metrics)
    assert (keys - base[0], hits["host"] - base[1]["host"], hits["disk"] - base[1]["disk"]) == (1, 1, 0)
