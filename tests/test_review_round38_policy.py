"""Round 38 adversarial review of the cache policies and admission filters (``tiered_kv/core/policy.py``), how the
tier index drives them (``tiered_kv/core/index.py``) and the trace tools that evaluate them
(``tiered_kv/tools/tracetools.py``, ``tiered_kv/tools/replay.py``).  Not repeated here: what tests/test_policies.py,
tests/test_policy_core.py, tests/test_review_policy.py, tests/test_review_policy2.py, tests/test_arc_handover.py,
tests/test_trace_tools.py, tests/test_review_tracetools.py and tests/test_review_replay.py already cover.

Findings (each test failed on the code as reviewed, main at 9c7cf94; all fixed since: ``S3FIFO.lease`` counts no
use and leaves the entry in its FIFO, passed over while read (``Policy.leases_in_place``); ``_replay`` publishes a
request's stores, then its promotes, leases those and releases the prefix in key order, as the core does;
``TraceError`` is a ``TieredKVError`` and a line nested too deep one):

1. ``test_s3fifo_under_the_manager_follows_the_published_algorithm`` -- S3-FIFO through ``TierManager`` is not
   S3-FIFO: one read of a block (``lookup`` then ``load_many``, the only way an engine reads one) counts as two
   uses (``hit`` +1, then ``S3FIFO.lease`` calls ``hit`` again) and moves the block to the newest end of its
   FIFO when the load's lease ends (``S3FIFO.unlease``).  The published algorithm counts one use per access and
   never reorders on a hit (that is its "lazy promotion"); the difference shows in which blocks stay.
2. ``test_write_through_simulation_equals_the_replay_when_no_spill_order_is_involved`` -- ``simulate_tiers``
   (the "simulated" column of ``tiered-kv replay``) does not make the core's calls in the core's order for a
   request with a disk hit: the core's load waits for its promote, so it releases its host hits only after the
   step's stores and the promote were published (and leases the promoted block too); the simulator unleases the
   host hits first, then publishes.  The LRU order differs, and so do the hits (host 1 / disk 2 simulated against
   host 2 / disk 1 replayed on a 7-request trace whose disk never fills), contrary to docs/policies.md ("with a
   disk tier and write-through ... the two differ only by the order a step's spills land in").
3. ``test_a_deeply_nested_trace_line_is_a_trace_error_naming_the_line`` -- a trace line whose JSON nests 1,000
   deep raises ``RecursionError`` out of ``read_trace`` (no file, no line), and ``tiered-kv replay`` dies with a
   traceback instead of exit 2.
4. ``test_trace_errors_are_tiered_kv_errors`` -- ``TraceError`` (every malformed-trace error) is a bare
   ``ValueError``, not a :class:`tiered_kv.errors.TieredKVError`, against errors.py's contract ("every error the
   library raises on bad input derives from TieredKVError").

Pinned correct (checked to matter, kept as regression guards):

* ``test_arc_under_the_manager_follows_the_published_algorithm`` -- ARC through ``TierManager`` (lookup, load,
  store, one key a request) keeps exactly the T1/T2/B1/B2 lists and target ``p`` of Megiddo & Modha's ARC, step
  by step (p adaptation with delta = max(1, |B_other|/|B_own|), the |L1| = c and |L1|+|L2| = 2c ghost trims,
  REPLACE's tie rule for a B2 hit).

Also tried, found to hold: S3-FIFO with the lease behaviour of finding 1 patched out matches the reference model
exactly through the manager; ghost lists and ARC's ghost-hit marks stayed bounded in random workloads; a random
fuzz of store/lookup/load/complete/fail/cancel/free_block/invalidate under every policy with ``all`` and
``tinylfu`` kept tests/test_review_policy2.py's ``check_index`` invariants; the default sweep sizes equal the
exact "1%,2%,5%,10%" ones for every trace size up to 2,000,000 distinct blocks.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path
from typing import Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.errors import TieredKVError
from tiered_kv.movers import ImmediateMover
from tiered_kv.tools import tracetools as tt
from tiered_kv.tools.cli import main
from tiered_kv.tools.replay import replay
from tiered_kv.tools.tracetools import Request, TraceError

pytestmark = pytest.mark.timeout(120)

ROW = 64


def _manager(slots: int, policy: str) -> TierManager:
    """A host-only manager whose copies are answered at once, in order (as ``tiered-kv replay`` runs it)."""
    cfg = TieredKVConfig(namespace="review-round38", host_capacity_bytes=slots * ROW, host_policy=policy,
                         host_evict_ahead_blocks=0)
    return TierManager(cfg, torch.zeros(2, ROW, dtype=torch.uint8), registry=CollectorRegistry(),
                       mover_factory=ImmediateMover)


def _request(mgr: TierManager, key: bytes) -> None:
    """The engine's step for a one-block request: lookup; a hit is loaded, a miss stored."""
    j = mgr.load_many([key], [0]) if mgr.lookup([key]) else mgr.store_many([key], [0])
    if j is not None:
        mgr.wait([j], timeout=30)
    mgr.free_block(0)


def _keys(seed: int, n: int, universe: int) -> list[bytes]:
    rnd = random.Random(seed)
    return [b"k%d" % min(universe - 1, int(rnd.paretovariate(0.7))) for _ in range(n)]


# ============================================================================================ finding 1: S3-FIFO

class RefS3FIFO:
    """S3-FIFO (Yang et al., SOSP'23) as docs/policies.md states it: new keys enter a small FIFO (10% of the slots);
    its oldest moves to the main FIFO if it was hit there (one hit promotes), else it is evicted and remembered in
    a ghost FIFO (as many keys as slots); a ghost key that comes back enters main; main's oldest goes round again
    with one use less while it has uses (capped at 3), else it is evicted.  A hit adds one use and moves nothing.
    (The small FIFO's used entries drain into main without evicting from main meanwhile, as the library reads it.)"""

    def __init__(self, c: int) -> None:
        self.c, self.target = c, max(1, c // 10)
        self.small: OrderedDict[bytes, None] = OrderedDict()
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}

    def _evict(self) -> None:
        while True:
            if self.small and (len(self.small) >= self.target or not self.main):
                while self.small:
                    k, _ = self.small.popitem(last=False)
                    if self.freq[k] > 0:
                        self.main[k] = None
                        continue
                    del self.freq[k]
                    self.ghost[k] = None
                    if len(self.ghost) > self.c:
                        self.ghost.popitem(last=False)
                    return
                continue
            while self.main:
                k, _ = self.main.popitem(last=False)
                if self.freq[k] > 0:
                    self.freq[k] -= 1
                    self.main[k] = None
                else:
                    del self.freq[k]
                    return

    def access(self, k: bytes) -> None:
        if k in self.freq:
            self.freq[k] = min(3, self.freq[k] + 1)
            return
        if len(self.small) + len(self.main) >= self.c:
            self._evict()
        self.freq[k] = 0
        if k in self.ghost:
            del self.ghost[k]
            self.main[k] = None
        else:
            self.small[k] = None


def test_s3fifo_under_the_manager_follows_the_published_algorithm() -> None:
    """What is wrong: under ``TierManager`` one read of a block counts as two uses and reorders it.  An engine reads
    a block with ``lookup`` (``TierIndex.ready_run`` -> ``S3FIFO.hit``: +1) then ``load_many`` (``TierIndex.acquire``
    -> ``S3FIFO.lease``, which calls ``self.hit`` again: +1 more, and takes the entry out of its FIFO); when the
    load ends, ``S3FIFO.unlease`` files it at the *newest* end of its FIFO.  Published S3-FIFO counts one use per
    access (so "up to three more passes for its hits", docs/policies.md, is one pass per hit) and never moves an
    object on a hit -- the FIFO order with lazy promotion is the algorithm.  Here a block read once gets two main
    passes and a fresh place in the queue, i.e. LRU-like recency plus a doubled frequency, and the blocks kept
    differ from S3-FIFO's (first divergence: the 4th request of this seeded workload).  LRU and ARC are unaffected
    (a lease there is idempotent with the hit), the prefix policy's lease adds no use.

    Where: ``tiered_kv/core/policy.py``: ``S3FIFO.lease`` / ``S3FIFO.unlease`` (and the docstring's "a hit or a lease
    adds one").  tracetools' simulator makes the same hit+lease calls, so its s3fifo figures in docs/policies.md
    carry the same departure.

    Fix: count a use once per access -- ``lease`` should not call ``hit`` (the lookup's hit counted it; a front end
    that loads without a lookup can ``touch`` first) -- and keep a leased entry at its place: leave it in its FIFO
    (``victim``/``peek``/``coldest`` already pass over ``e.readers``, as for a pin) or remember its neighbour and put
    it back there on ``unlease``.  With exactly that patched in, this reference comparison passes for many seeds."""
    c = 10
    mgr = _manager(c, "s3fifo")
    ref = RefS3FIFO(c)
    try:
        pol = mgr._core.index.policy
        for step, k in enumerate(_keys(1, 200, 3 * c)):
            _request(mgr, k)
            ref.access(k)
            got = (list(pol.small), list(pol.main), {x: f for x, f in pol.freq.items()})
            want = (list(ref.small), list(ref.main), dict(ref.freq))
            assert got == want, (f"request {step} ({k!r}): the manager's S3-FIFO (small, main, uses) {got} != "
                                 f"published S3-FIFO {want}")
    finally:
        mgr.close()


# ============================================================================================ pinned: ARC

class RefARC:
    """ARC, transcribed from Megiddo & Modha (FAST'03), Fig. 4, for cache size ``c``."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1: OrderedDict[bytes, None] = OrderedDict()
        self.t2: OrderedDict[bytes, None] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def _replace(self, x: bytes) -> None:
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            k, _ = self.t1.popitem(last=False)
            self.b1[k] = None
        else:
            k, _ = self.t2.popitem(last=False)
            self.b2[k] = None

    def access(self, x: bytes) -> None:
        c, b1, b2 = self.c, self.b1, self.b2
        if x in self.t1:
            del self.t1[x]
            self.t2[x] = None
        elif x in self.t2:
            self.t2.move_to_end(x)
        elif x in b1:
            self.p = min(c, self.p + (1 if len(b1) >= len(b2) else len(b2) / len(b1)))
            self._replace(x)
            del b1[x]
            self.t2[x] = None
        elif x in b2:
            self.p = max(0, self.p - (1 if len(b2) >= len(b1) else len(b1) / len(b2)))
            self._replace(x)
            del b2[x]
            self.t2[x] = None
        else:
            l1, l2 = len(self.t1) + len(b1), len(self.t2) + len(b2)
            if l1 == c:
                if len(self.t1) < c:
                    b1.popitem(last=False)
                    self._replace(x)
                else:
                    self.t1.popitem(last=False)
            elif l1 + l2 >= c:
                if l1 + l2 == 2 * c:
                    b2.popitem(last=False)
                self._replace(x)
            self.t1[x] = None


@pytest.mark.parametrize("c,seed", [(3, 0), (5, 1), (8, 2)])
def test_arc_under_the_manager_follows_the_published_algorithm(c: int, seed: int) -> None:
    """Pinned correct behaviour (not a finding): ARC through ``TierManager`` -- each read a lookup, a load and its
    release; each miss a store -- keeps the paper's T1, T2, B1, B2 and ``p`` at every step.  It matters because the
    core splits the paper's one "request" over ``victim`` (p adapted for a ghost key before REPLACE), ``insert``
    (the ghost trims) and lease/unlease (a hit's move to T2 must survive the lease), and a change to any of them
    (e.g. trimming B1 before the victim joins it, or adapting ``p`` twice for one ghost hit) breaks this."""
    mgr = _manager(c, "arc")
    ref = RefARC(c)
    try:
        pol = mgr._core.index.policy
        for step, k in enumerate(_keys(seed, 250, 3 * c + 2)):
            _request(mgr, k)
            ref.access(k)
            got = (list(pol.t1), list(pol.t2), list(pol.b1), list(pol.b2), pol.p)
            want = (list(ref.t1), list(ref.t2), list(ref.b1), list(ref.b2), float(ref.p))
            assert got == want, f"request {step} ({k!r}): {got} != {want}"
    finally:
        mgr.close()


# ============================================================================================ finding 2: the simulator's order

def test_write_through_simulation_equals_the_replay_when_no_spill_order_is_involved(tmp_path: Path) -> None:
    """What is wrong: ``simulate_tiers`` (``tiered_kv/tools/tracetools.py``: ``_replay``) unleases a request's host
    hits and then publishes its promotes and stores; the core does the opposite for a request with a disk hit.
    ``TierCore.begin_load`` makes the load wait for its PROMOTE, so the step's store is published first, then the
    promoted block (which the load then leases: an extra use for S3-FIFO), and only when the load's copies are done
    does ``release_taken`` put the host hits back, in key order -- after everything else.  Under LRU the two end a
    step in different orders, and different blocks are evicted next.

    The trace: ``[1] [2] [3] [4] [1,3] [5,6] [3]``, host 3 blocks, disk 100 (it never fills: no spill is ever shed or
    reordered), write-through.  Request 5 finds 1 on disk, 3 on the host: the core ends with LRU order
    ``4, 1, 3``, the simulator with ``4, 3, 1``; request 6 evicts 4 and then 1 (core) or 3 (simulator); request 7's
    block 3 is a host hit in the core, a disk hit in the simulator.  docs/policies.md says the replay and the
    simulator "with a disk tier and write-through (the default) ... differ only by the order a step's spills land
    in"; here no spill order is involved.  On real traces the host/disk split moves (the chat trace's first 400
    requests, host 200 / disk 400, LRU: host hits 2,959 replayed vs 2,942 simulated) and with S3-FIFO on the host
    the totals too (Mooncake's first 400, s3fifo host, lru disk: 151 vs 146).

    Fix (in ``_replay``): for a request with promotes, publish the stores, then the promotes, lease each promoted
    entry (its load reads it), then unlease every entry of ``keys[:n]`` in key order; keep today's order for a
    request served from the host alone (which the host-only equality tests pin)."""
    ids = [[1], [2], [3], [4], [1, 3], [5, 6], [3]]
    reqs = [Request(i, 512 * len(x), 1, tuple(x)) for i, x in enumerate(ids)]
    sim = tt.simulate_tiers(reqs, 3, 100, "lru", "lru", write_mode="through")
    core = replay(reqs, 3, 100, host_policy="lru", disk_policy="lru", write_mode="through", scratch=str(tmp_path))
    assert core["spills_shed"] == 0 and core["disk_evictions"] == 0
    assert (core["host_hits"], core["disk_hits"]) == (2, 1)   # what the core does (traced by hand above)
    assert (sim.host_hits, sim.disk_hits) == (core["host_hits"], core["disk_hits"]), (
        f"simulated host/disk hits {sim.host_hits}/{sim.disk_hits} != replayed {core['host_hits']}/{core['disk_hits']}")


# ============================================================================================ findings 3, 4: trace errors

def test_a_deeply_nested_trace_line_is_a_trace_error_naming_the_line(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """What is wrong: ``tiered_kv/tools/tracetools.py``: ``_parse`` catches only ``ValueError`` from ``json.loads``;
    a line nesting 1,000 JSON arrays (a corrupt or hostile trace line, 2 KB long) makes the decoder raise
    ``RecursionError``, which escapes ``read_trace`` naming neither the file nor the line, and ``tiered-kv replay``
    (``cli.main`` catches ``TieredKVError``/``ValueError``/``OSError``/...) dies with a traceback instead of the
    one-line message and exit status 2 every other malformed line gets.

    Fix: in ``_parse``, ``except (ValueError, RecursionError) as exc: raise _bad(path, n, "not JSON ...")``."""
    p = tmp_path / "deep.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]})
    deep = '{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": ' + "[" * 1000 + "]" * 1000 + "}"
    p.write_text(good + "\n" + deep + "\n", encoding="utf-8")
    try:
        tt.read_trace(p)
    except TraceError as exc:
        assert f"{p}:2" in str(exc)
    except RecursionError as exc:
        pytest.fail(f"read_trace raised RecursionError naming no line: {exc}")
    else:
        pytest.fail("a 1000-deep line was read")
    try:
        rc: Optional[int] = main(["replay", str(p), "--host", "4", "--quiet"])
    except RecursionError:
        rc = None
    err = capsys.readouterr().err
    assert rc == 2 and f"{p}:2" in err, (rc, err)


def test_trace_errors_are_tiered_kv_errors(tmp_path: Path) -> None:
    """What is wrong: ``tiered_kv/tools/tracetools.py``: ``class TraceError(ValueError)`` -- the error of every malformed
    trace line -- is not a ``tiered_kv.errors.TieredKVError``, though errors.py's contract is that "every error the
    library raises on bad input derives from TieredKVError and names the offending value" (``ConfigError``,
    ``InvalidKeyError``, ... all do).  A caller of the public ``read_trace`` (or of ``tiered_kv.bench.trace
    .load_trace``) that catches ``TieredKVError`` lets a bad trace through.

    Fix: ``class TraceError(TieredKVError, ValueError)`` (keeping ``ValueError`` for existing callers)."""
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": [1]}\n', encoding="utf-8")
    with pytest.raises(TraceError) as info:
        tt.read_trace(p)
    assert f"{p}:1" in str(info.value)
    assert isinstance(info.value, TieredKVError), "TraceError is not a tiered_kv.errors.TieredKVError"
