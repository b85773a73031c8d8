"""Adversarial review: write-back (``TierCore._writeback``, ``coldest(..., through_pins=True)``) and the
scheduler-side front end (``SlabScheduler``) with a disk tier.

What it proved wrong (each test failed before its fix):

* a lookup's read-back landed as an unused entry: with S3-FIFO or ARC on a hot host, the step's evict-ahead
  took exactly that block, and the engine's next lookup found it only on disk again (another read, another
  disk hit counted).  The lookup that asked is now the block's use (``TierCore._promote_reported``);
* a disk block dropped by a failed read-back (corrupt on disk), or not found by a restarted disk I/O process,
  left every tier without ``take_evicted()`` reporting it: vLLM and KV-event consumers kept believing it
  offloaded (``DiskTier.on_gone``);
* ``PrefixLRU.coldest`` did not foresee that an inner block's eviction makes its parent a leaf (the next
  victim), so write-back spilled another block than the next victim;
* an engine-failed store was counted ``cancelled`` when its report came before its ring mark, ``failed``
  after: now ``failed`` either way.

The plain tests pin guarantees that were checked and hold.
"""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry

from disk_helpers import WriterGate
from tiered_kv.config import TieredKVConfig
from tiered_kv.core.index import TierIndex
from tiered_kv.core.policy import make_policy
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics, sample_total

ROW = 256


def _payload(key: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(key[-4:].rjust(4, b"\0"), "little"))
    return torch.randint(0, 256, (ROW,), dtype=torch.uint8, generator=g)


class Sched:
    """A SlabScheduler on a one-rank shared slab; the test plays vLLM's worker and engine."""

    def __init__(self, tmp: Path, *, host_slots: int = 16, disk_slots: int = 64, **kw: Any) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.cfg = TieredKVConfig(namespace="review-wbsched", host_capacity_bytes=host_slots * ROW,
                                  disk_path=tmp / "disk" if disk_slots else None,
                                  disk_capacity_bytes=disk_slots * ROW, **kw)
        self.slab = SharedSlab.open(tmp / "slab", host_slots, ROW, 1)
        self.metrics = Metrics(registry=CollectorRegistry(), namespace=self.cfg.namespace)
        self.s = SlabScheduler(self.cfg, self.slab, metrics=self.metrics)
        self.gate: Any = None

    def hold_writer(self) -> WriterGate:
        store = self.s.disk
        assert store is not None and hasattr(store, "writer"), "needs disk_io='thread'"
        self.gate = WriterGate()
        store.fault_hook = self.gate
        return self.gate

    def store(self, ks: list[bytes], *, mark: bool = True, ok: bool = True, success: bool = True) -> Any:
        p = self.s.prepare_store(ks)
        assert p.keys, ks
        for k, slot in zip(p.keys, p.slots):
            self.slab.rows[slot] = _payload(k)
        if mark:
            self.slab.mark_done(0, p.seq, ok)
        self.s.complete_store(p.keys, success)
        return p

    def metric(self, name: str, **labels: str) -> float:
        self.metrics.flush()
        return sample_total(self.metrics.registry, name, **labels)

    def close(self) -> None:
        if self.gate is not None:
            self.gate.open()
        try:
            self.s.close()
        finally:
            self.slab.unlink()
            self.slab.close()


@pytest.fixture
def sched(tmp_path: Path) -> Iterator[Any]:
    made: list[Sched] = []

    def make(**kw: Any) -> Sched:
        s = Sched(tmp_path / f"s{len(made)}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


# =========================================================================== findings
def test_a_failed_store_is_counted_failed_whatever_the_ring_order(sched: Any) -> None:
    """A store the engine reports failed (``complete_store(keys, success=False)``) is one failed store.

    ``SlabScheduler.complete_store`` (tiered_kv/integrations/scheduler.py:236-248) sends it down two paths:
    when every rank's ring already shows the job, ``_finish_store`` -> ``_apply_store`` counts
    ``tiered_kv_jobs_total{kind="store",outcome="failed"}``; when the ring mark has not landed yet (the usual
    case with several ranks, or a copy still running), ``_cancel`` counts ``outcome="cancelled"`` instead
    (``_cancel``, scheduler.py:301) and no ``failed`` is ever counted for it.  Consequence: the same engine failure is
    reported as a cancellation or a failure depending on thread timing; dashboards and alerts on failed stores
    (deploy/ rules on outcome="failed") miss store failures.  Fix: in the not-yet-done branch, cancel the job
    for its slots' sake but count ``outcome="failed"`` (e.g. a ``count_as`` argument to ``_cancel``)."""
    s = sched(host_slots=16, disk_slots=0)
    s.store([b"fail-early"], mark=True, ok=False, success=False)     # ring first: counted failed
    s.s.tick()
    p = s.store([b"fail-late"], mark=False, success=False)           # report first, ring mark later
    s.slab.mark_done(0, p.seq, False)
    s.s.tick()
    assert s.s.debug_sizes()["quarantine"] == 0
    assert s.metric("tiered_kv_jobs_total", kind="store", outcome="failed") == 2
    assert s.metric("tiered_kv_jobs_total", kind="store", outcome="cancelled") == 0


def _prefix_index() -> tuple[TierIndex, list[Any]]:
    ix = TierIndex(8, policy=make_policy("prefix", 8))

    def put(keys: list[bytes]) -> list[Any]:
        _, es, _ = ix.reserve_absent(keys, uuid.uuid4(), keys, None, chain=True)
        for e in es:
            ix.publish(e)
        return es

    x, y, z = put([b"x", b"y", b"z"])    # chain x -> y -> z
    w, v = put([b"w", b"v"])             # chain w -> v
    ix.acquire_all([z, v])               # both tails leased (being loaded): x, y, w are inner blocks
    ix.touch(x)                          # inner queue, coldest first: y, w, x
    return ix, [x, y, z, w, v]


def test_prefix_coldest_is_the_order_victim_takes() -> None:
    """``coldest(n)`` must list the next ``n`` victims in the order ``victim()`` takes them (policy.py module
    table; write-back spills exactly these, ``TierCore._writeback``, tiers.py:980).

    ``PrefixLRU.coldest`` (tiered_kv/core/policy.py:878-942) walks the inner queue in its order once orphans and
    leaves run out, but evicting an inner block ``y`` takes the last child of its parent ``x``, which
    ``victim`` (policy.py:833-859, ``_drop`` -> ``_requeue``) then places as a *leaf*, ahead of every inner block.
    Here (leaves all leased) victim order is y, x, w; coldest says y, w, x.  Consequence: with
    ``host_policy="prefix"`` and ``write_mode="back"``, write-back writes ``w`` while eviction takes ``x``
    unwritten (counted ``shed{kind="spill",reason="evicted_unwritten"}``: a block lost that write-back meant to
    keep).  Fix: in the inner-block phase of ``coldest``, apply the same parent bookkeeping as the leaf phase
    (count the taken children per parent and, when a parent's last child goes, put it on ``front``/``back``)."""
    ix, _ = _prefix_index()
    c = copy.deepcopy(ix)
    victims = []
    for _ in range(3):
        e = c.policy.victim((), None)
        victims.append(None if e is None else e.key)
    assert victims == [b"y", b"x", b"w"]
    assert [e.key for e in ix.coldest(3)] == victims


def test_a_block_a_failed_read_back_drops_is_reported_gone(sched: Any) -> None:
    """``SlabScheduler.take_evicted`` promises "keys gone from every tier since the last call"
    (tiered_kv/integrations/scheduler.py:399-400); the vLLM adapter turns them into ``removed`` KV events
    (vllm.py ``take_events``/``prepare_store``) and vLLM's ``evicted_keys``.

    A lookup's read-back of a block that fails verification (corrupt on disk) drops the disk entry in
    ``DiskTier.finish_promote`` (tiered_kv/core/disk_tier.py:460-461, ``self.index.remove(d)``) and the host
    reservation in ``hindex.abort``; neither goes through an ``on_evict`` callback, so ``TierCore.evicted``
    never gets the key (only ``_host_evicted``/``_disk_evicted``, tiers.py:988-997, append).  The key is now
    in no tier, lookup answers MISS, yet vLLM is never told: its offloading manager and any KV-event consumer
    (a prefix-aware router) keep believing the block is offloaded.  Same gap for a restarted I/O process's
    reconciliation (disk_tier.py:299, ``index.remove(d)``).  Fix: when the core drops a READY disk entry whose
    key is not on the host (finish_promote's removal, restart's lost entries), append the key to
    ``core.evicted`` under ``collect_evicted`` (e.g. one ``TierCore._gone(key)`` helper used by all three)."""
    from disk_helpers import flip_slot_byte
    from tiered_kv.jobs import JobKind

    s = sched(host_slots=4, disk_slots=64)            # disk I/O process (the default): LMDB readable here
    k = b"gone-after-corrupt-read"
    s.store([k])
    s.s.tick()                                         # published, spilled (write-through)
    assert s.s.flush(timeout=30)
    for i in range(4):                                 # four more blocks push k off the 4-slot host
        s.store([b"filler-%d" % i])
        s.s.tick()
        assert s.s.flush(timeout=30)                   # each spill applied: its host slot unpinned
    assert s.s.state_of(k) == (None, "ready")
    assert k not in s.s.take_evicted()                 # still on disk: not gone
    flip_slot_byte(s.cfg.disk_dir, k, 0)
    core = s.s.core
    assert s.s.lookup(k) is Lookup.PENDING
    core.simple_block_until(lambda: core.n_in_flight[JobKind.PROMOTE] == 0, 30)
    assert s.s.lookup(k) is Lookup.MISS
    assert s.s.state_of(k) == (None, None)             # in no tier any more
    assert k in s.s.take_evicted()




def test_a_block_a_restarted_io_process_did_not_find_is_reported_gone(sched: Any) -> None:
    """The same gap in a restart's reconciliation (``DiskTier.restart``): an entry of the index the new disk
    I/O process did not find (its record lost with the dead one) left the index without being reported."""
    import signal
    import time

    s = sched(host_slots=4, disk_slots=64)
    k = b"lost-with-the-child"
    s.store([k])
    s.s.tick()
    assert s.s.flush(timeout=30)
    for i in range(4):
        s.store([b"filler-%d" % i])
        s.s.tick()
        assert s.s.flush(timeout=30)
    assert s.s.state_of(k) == (None, "ready") and k not in s.s.take_evicted()
    core = s.s.core
    tier = core.disk
    old = tier.store
    real = tier._reopen

    def reopen() -> Any:   # the new process does not find k's record
        st = real()
        st.entries = [e for e in st.entries if e.key != k]
        return st

    tier._reopen = reopen
    old.kill_for_test(signal.SIGKILL)
    old._receiver.join(30)
    deadline = time.monotonic() + 60
    while tier.store is old or tier._starting is not None:
        assert time.monotonic() < deadline, "the disk I/O process was not restarted"
        s.s.tick()
        core.simple_block_until(lambda: False, 0.01)
    assert s.s.state_of(k) == (None, None)
    assert k in s.s.take_evicted()


def _hot_host_with_a_block_only_on_disk(sched: Any, policy: str) -> tuple[Any, bytes]:
    """A 10-slot host (evict-ahead 1) whose every resident block was hit since it came, and a block ``k`` that is
    only on disk (evicted from the host long ago)."""
    s = sched(host_slots=10, disk_slots=64, host_policy=policy, host_evict_ahead_blocks=1, disk_io="thread")
    k = b"read-back-me"
    s.store([k])
    s.s.tick()
    assert s.s.flush(timeout=30)
    others = [b"hot-%02d" % i for i in range(25)]
    for o in others:                      # k leaves the host, and its policy's memory of it (ghosts) too
        s.store([o])
        s.s.tick()
        assert s.s.flush(timeout=30)
    for o in others:
        if s.s.state_of(o)[0] == "ready":
            assert s.s.lookup(o) is Lookup.HIT   # every resident block is in use
    s.s.tick()
    assert s.s.state_of(k) == (None, "ready")
    return s, k


@pytest.mark.disk_threads
@pytest.mark.parametrize("policy", [
    "s3fifo",
    "arc",
    "lru", "prefix"])
def test_a_read_back_a_lookup_asked_for_is_there_when_the_engine_asks_again(sched: Any, policy: str) -> None:
    """``SlabScheduler.lookup`` answers PENDING for a block only on disk and reads it back
    (tiered_kv/integrations/scheduler.py:146-158); the engine asks again at a later step and should get HIT.

    The read-back lands as a brand-new, *unused* entry (``DiskTier.finish_promote`` -> ``hindex.publish``,
    tiered_kv/core/disk_tier.py:452; no hit is recorded for the lookup that asked for it, and nothing protects
    the keys in ``SlabScheduler._read_back``).  The same step's evict-ahead (``TierCore.end_step``,
    tiers.py:1021) then asks the policy for a victim: S3-FIFO puts the new key in its small FIFO with frequency 0,
    ARC in T1, and when the rest of the host was used both evict exactly the block just read.  The next lookup
    finds it only on disk again: PENDING, another read, another disk hit counted (here S3-FIFO reads the block 4
    times and answers PENDING 4 times before a HIT; ARC twice).  Consequence: with ``host_policy`` s3fifo/arc
    and a hot host, a request waits extra engine steps for a prefix that was already read, the disk does
    repeated reads, and ``tiered_kv_lookup_hits_total{tier="disk"}`` over-counts.  (LRU inserts at the hot end and
    the prefix policy as a leaf at the hot end: they pass.)  Fix: record the lookup's reference when its
    read-back is published (``index.touch(entry)`` for a key in ``_read_back``; TierManager's loads already lease
    it on landing), or protect ``_read_back`` keys from evict-ahead until the engine asked again."""
    from tiered_kv.jobs import JobKind

    s, k = _hot_host_with_a_block_only_on_disk(sched, policy)
    core = s.s.core
    assert s.s.lookup(k) is Lookup.PENDING
    core.simple_block_until(lambda: core.n_in_flight[JobKind.PROMOTE] == 0, 30)   # the read landed
    assert s.s.state_of(k)[0] == "ready"
    s.s.tick()                                       # the step ends (evict-ahead)
    assert s.s.lookup(k) is Lookup.HIT               # the engine asks again
    assert s.metric("tiered_kv_lookup_hits_total", tier="disk") == 1

# =========================================================================== guarantees checked (hold)
@pytest.mark.disk_threads
def test_reset_while_write_back_spills_are_held_publishes_none_of_them(sched: Any) -> None:
    """Write-back pins the coldest blocks for its spill; ``reset()`` while the writer holds them: each part
    is tombstoned, the pinned host slots are freed once the report is applied, nothing is on disk after, and
    a flush before the writer moves times out cleanly (False) and a later one succeeds."""
    from tiered_kv.jobs import JobKind

    s = sched(host_slots=16, disk_slots=64, write_mode="back", host_evict_ahead_blocks=0, disk_io="thread")
    gate = s.hold_writer()
    ks = [b"wb-%02d" % i for i in range(14)]       # 14 of 16: past write-back's 3/4
    for k in ks:
        s.store([k])
    s.s.tick()                                     # write-back spills the coldest; the writer holds them
    core = s.s.core
    assert core.n_in_flight[JobKind.SPILL] >= 1
    pinned = [e for e in core.index.entries() if e.readers]
    assert pinned and all(e.spilled for e in pinned)
    assert s.s.flush(timeout=0.05) is False        # the writer is held: a clean timeout
    s.s.reset()
    assert s.s.host_blocks == 0 and s.s.disk_blocks == 0
    assert core.index.used_slots == len(pinned)    # pinned slots wait for the spill's report
    gate.open()
    assert s.s.flush(timeout=30)
    s.s.tick()
    assert core.index.used_slots == 0 and s.s.disk_blocks == 0
    assert core.n_in_flight[JobKind.SPILL] == 0
    for k in ks:
        assert s.s.lookup(k) is Lookup.MISS


@pytest.mark.disk_threads
def test_write_back_counts_each_block_evicted_unwritten_once_and_reports_it_gone(sched: Any) -> None:
    """With the writer held, stores past the host's size evict blocks write-back has not reached: each is
    counted once in ``shed{kind="spill",reason="evicted_unwritten"}`` and reported by ``take_evicted``; the
    blocks whose spills are in flight are never evicted (pinned) and land on disk once the writer moves."""
    from tiered_kv.jobs import JobKind

    s = sched(host_slots=16, disk_slots=64, write_mode="back", host_evict_ahead_blocks=0, disk_io="thread")
    gate = s.hold_writer()
    first = [b"ev-%02d" % i for i in range(14)]
    for k in first:
        s.store([k])
    s.s.tick()
    core = s.s.core
    spilling = {e.key for e in core.index.entries() if e.readers}
    assert spilling and core.n_in_flight[JobKind.SPILL] >= 1
    more = [b"ev-more-%02d" % i for i in range(10)]
    gone: list[bytes] = []
    for k in more:
        p = s.store([k])
        gone += p.evicted
    gone += s.s.take_evicted()
    assert not spilling & set(gone)                # pinned: never evicted
    assert gone and len(set(gone)) == len(gone)
    assert s.metric("tiered_kv_shed_total", kind="spill", reason="evicted_unwritten") == len(gone)
    gate.open()
    assert s.s.flush(timeout=30)
    s.s.tick()
    for k in spilling:
        assert s.s.state_of(k)[1] == "ready"
