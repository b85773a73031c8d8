"""Round 39 adversarial review of the round-38 fixes (``git log 9c7cf94..9e2036b``): 826bd80 (remote RESP caps),
bf3e229 (movers: the wait's hold, malformed transfers), 9e2036b (S3-FIFO leases in place, the simulator's order).

Findings (each test failed on 9e2036b; all fixed since: ``TierIndex._repair`` restores a leased entry too under a
policy that keeps leases in place; the simulator reserves a promote's slot protecting the load's keys alone, as
``TierCore.begin_load`` does; the blocking owner's paths size a transfer with ``thread.rows_len``, 0 for rows
that are no sequence, leaving its answer to ``screen``):

1. ``test_an_interrupted_s3fifo_eviction_puts_a_leased_entry_back_in_its_fifo`` -- since 9e2036b S3-FIFO keeps a
   leased entry in its FIFO (``Policy.leases_in_place``), and ``S3FIFO.victim`` pops every entry it walks, leased
   ones too (kept aside in ``held_small``/``held_main`` and put back by its ``finally``).  An interrupt at the return
   of the ``popitem`` that took a leased entry leaves it out of both FIFOs, and ``TierIndex._repair`` (core/index.py)
   skips it: it repairs only entries with no reader or pinned ones ("No step leaves a leased entry in the order" --
   no longer true).  While leased the entry is out of the order (``holds`` False, ``len(policy)`` short, a removal
   leaks its frequency); at its release ``S3FIFO.unlease`` finds it not held and inserts it as a new key: frequency
   0 at the small FIFO's newest end, its hits forgotten, where the uninterrupted call leaves it in place, used.
2. ``test_write_through_simulation_protects_a_promote_as_the_core_does`` -- 9e2036b's ``_replay`` fix ("the
   simulator orders a disk hit's request as the core does") is incomplete: the simulator reserves a promote's host
   slot protecting *every* key of the request, the core (``TierCore.begin_load``) only the load's keys (the prefix
   up to the first miss).  A host block cached behind the miss is evicted by the core's promote but kept by the
   simulator: host 1 / disk 2 replayed against host 2 / disk 1 simulated, under all four policies, on a 7-request
   trace whose disk never fills -- contrary to docs/policies.md ("with a disk tier and write-through ... the two
   differ only by the order a step's spills land in").
3. ``test_a_malformed_transfer_held_for_a_blocking_owner_is_answered_alone`` -- bf3e229 made ``split_batches``
   size a transfer without a row list as 0 so that ``screen`` answers it alone, but the blocking owner's path
   measures ``len(t.rows)`` before any screen too: ``NativeMover.help_one`` (``len(held[0].rows)``,
   ``sum(len(t.rows) ...)``) and ``ThreadMover._help`` (``nbytes += len(t.rows) * block``) raise ``TypeError`` out
   of ``help_one`` -- out of ``TierManager.wait()`` -- and the thread mover answers the *valid* transfers taken
   before it "copy interrupted".  Reachable through the movers' own API only (as round 38's finding 2).

Pinned correct (checked to matter; kept as a regression guard):

* ``test_every_reply_the_store_gets_from_a_real_server_passes_the_new_caps`` -- every command the store's I/O
  threads send (SET, EXISTS, GET into a view / drained, the four scripts by EVALSHA and by EVAL, ASKING) at 10 B,
  70 KiB and 2 MiB values gets a reply within 826bd80's caps (no bulk over 64 KiB but a GET's, no nesting, no
  simple string to a GET), from a real ``redis-server``, standalone and cluster.

Also checked and found to hold (no test): ``Replies._line``'s resumed CRLF search across reads of random sizes,
compaction and growth (error lines 0 B - 900 KB beside bulk and GET replies: a fuzz of 400 streams against a
model); a real GET of a hash gives WRONGTYPE (an error, which a GET may get); ``NativeMover._start``'s restart of a
refused group answers each transfer once under a launcher failure, and under an interrupt anywhere in the
recursion (``_start_held``'s ``_answer_unstarted`` skips what is in flight; a transfer the recursion failed is
answered twice, as the screen's already were, and the second discarded); ``_waiting`` is set before the hold and
cleared after it, and ``poll()`` un-holds only outside a wait; S3-FIFO never evicts or chooses for write-back an
entry with a lease (``victim``/``peek``/``coldest`` pass ``e.readers``; the index passes only its pinned set through;
``coldest(n, pins)`` equals the next ``n`` victims with the pins ended, 3,000 random states); a small FIFO full of
leased entries makes ``victim`` walk it and go on to main (no loop, ``None`` when nothing else is evictable); host
only, ``simulate`` equals the replay for S3-FIFO on 90 random traces.
"""

from __future__ import annotations

import collections
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from tiered_kv.core.index import Entry, TierIndex
from tiered_kv.core.policy import S3FIFO
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, NativeMover, ThreadMover, Transfer
from tiered_kv.tools import tracetools as tt
from tiered_kv.tools.replay import replay
from tiered_kv.tools.tracetools import Request

pytestmark = pytest.mark.timeout(120)

_STORE = JobKind.STORE


# ============================================================================================ finding 1

SLOTS = 6
KEYS = [b"k%d" % i for i in range(SLOTS)]


def _s3fifo_full_with_k0_leased() -> tuple[TierIndex, list[Entry], list[Any]]:
    """A full S3-FIFO tier of 6 READY entries (all in the small FIFO, oldest k0), k0 looked up twice (frequency 2)
    and leased by a load (``into`` holds the lease)."""
    idx = TierIndex(SLOTS, policy=S3FIFO(SLOTS))
    _, new, full = idx.reserve_absent(KEYS, uuid.uuid4(), (), None)
    assert full == 0
    idx.publish_all(new)
    idx.ready_run(KEYS[:1])
    idx.ready_run(KEYS[:1])
    into: list[Any] = [None]
    idx.acquire(new[0], into, 0)
    return idx, new, into


def _interrupt_at_first_popitem_in_victim(fifo: Optional[str] = None) -> tuple[Any, list[bool]]:
    """A profile hook raising ``KeyboardInterrupt`` at the return of the first ``popitem`` called by
    ``S3FIFO.victim`` (where a signal's handler runs: a C call's return) -- of the FIFO named ``fifo``
    (``"small"``/``"main"``; None: either); one shot."""
    code = S3FIFO.victim.__code__
    fired: list[bool] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if (not fired and event == "c_return" and frame.f_code is code and getattr(arg, "__name__", "") == "popitem"
                and (fifo is None or getattr(arg, "__self__", None) is frame.f_locals.get(fifo))):
            fired.append(True)
            raise KeyboardInterrupt(f"at the return of {fifo or 'a'} popitem in S3FIFO.victim")

    return hook, fired


def reserve_interrupted_in_victim(idx: TierIndex, key: bytes, fifo: Optional[str] = None) -> None:
    """``idx.reserve(key)`` broken off at the first ``popitem`` of S3-FIFO's victim walk (of ``fifo``), then
    retried as the engine would until it gets its entry."""
    hook, fired = _interrupt_at_first_popitem_in_victim(fifo)
    sys.setprofile(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            idx.reserve(key, uuid.uuid4())
    finally:
        sys.setprofile(None)
    assert fired
    if idx.get(key) is None:   # the engine retries the reservation
        assert idx.reserve(key, uuid.uuid4()) is not None


def _state(idx: TierIndex) -> tuple[list[bytes], list[bytes], dict[bytes, int]]:
    p: Any = idx.policy
    return list(p.small), list(p.main), dict(p.freq)


def test_an_interrupted_s3fifo_eviction_puts_a_leased_entry_back_in_its_fifo() -> None:
    """What is wrong: ``TierIndex._repair`` (tiered_kv/core/index.py) puts back in the order only an entry with no
    reader or one whose readers are all pins (``e.readers == 0 or e in pinned``); its docstring says "No step leaves
    a leased entry in the order".  Since 9e2036b S3-FIFO does keep a leased entry in its FIFO
    (``S3FIFO.leases_in_place``: "``len()`` and ``holds`` then count it"), and ``S3FIFO.victim``
    (tiered_kv/core/policy.py) pops each entry it walks -- a leased one too, set aside in ``held_small`` and put back
    by its ``finally``.  An interrupt at the return of ``small.popitem()`` that took the leased k0 (before it reaches
    ``held_small``) loses it from both FIFOs; ``TierIndex._evict_one``'s ``_repair(evicting=True)`` then skips it
    (it has a reader that is not a pin).  The engine's retry of the reservation succeeds, and k0 stays out of the
    order while its load runs (a removal then would leave its frequency behind: ``S3FIFO.remove`` finds it in no
    FIFO).  When the load ends, ``S3FIFO.unlease`` finds it not held and inserts it as a new key: frequency 0 at
    the small FIFO's newest end.  The uninterrupted reservation leaves k0 at the small FIFO's cold end with its
    two uses (the next victim moves it to main); after the interrupt its uses are forgotten and it is evicted as a
    block never read.

    Fix: in ``TierIndex._repair``, treat a live READY leased entry as belonging in the order when
    ``policy.leases_in_place`` -- ``elif e.state is _READY and (e.readers == 0 or e in pinned or
    policy.leases_in_place) and not policy.holds(e)`` -> ``policy.restore(e)`` (S3-FIFO's ``restore`` puts an entry
    whose frequency it still records back at the small FIFO's cold end, where the walk took it from); the
    ``gave_up`` branch keeps its ``not e.readers`` guard.  Update the docstring's "No step leaves a leased entry in
    the order"."""
    twin, twin_new, twin_into = _s3fifo_full_with_k0_leased()
    assert twin.reserve(b"z", uuid.uuid4()) is not None   # uninterrupted: k0 passed over (leased), k1 evicted
    twin.publish(twin.get(b"z"))  # type: ignore[arg-type]
    assert twin.policy.holds(twin_new[0])
    twin.release_taken(twin_into)
    expected = _state(twin)
    assert expected[0][0] == b"k0" and expected[2][b"k0"] == 2   # (the reference: in place, its two uses kept)

    idx, new, into = _s3fifo_full_with_k0_leased()
    reserve_interrupted_in_victim(idx, b"z")
    # the engine goes on: its copy lands
    idx.publish(idx.get(b"z"))  # type: ignore[arg-type]
    k0 = new[0]
    assert k0.live and k0.readers == 1 and idx.get(b"k0") is k0
    in_order_while_leased = idx.policy.holds(k0)
    idx.release_taken(into)
    got = _state(idx)
    assert in_order_while_leased and got == expected, (
        f"after an interrupt in S3FIFO.victim the leased k0 was out of the order while read "
        f"(holds={in_order_while_leased}); released, the policy is small={got[0]}, freq[k0]={got[2].get(b'k0')}, "
        f"not the uninterrupted small={expected[0]}, freq[k0]={expected[2][b'k0']} (its uses forgotten)")


# ============================================================================================ finding 2

@pytest.mark.parametrize("policy", ["lru", "s3fifo", "arc", "prefix"])
def test_write_through_simulation_protects_a_promote_as_the_core_does(policy: str, tmp_path: Path) -> None:
    """What is wrong: ``tiered_kv/tools/tracetools.py``: ``_replay`` reserves each promote's host slot with
    ``host.reserve(k, protect, ...)``, ``protect`` being every key of the request; the core's promote protects only
    the load's keys -- ``TierCore.begin_load`` (tiered_kv/core/tiers.py) calls ``start_promote(key, d,
    frozenset(keys))`` with the keys of ``load_many(keys[:n])``, the prefix up to the first miss (nothing for a
    one-key load).  A host block that the request finds cached *behind* its miss is fair game for the core's
    promote, and protected in the simulator.

    Trace ``[1] [2] [3] [4,5,6] [7] [1,2,8,3] [3]``, host 6 blocks, disk 100 (never fills: no spill is shed or
    reordered, no disk eviction), write-through.  Request 6 finds 1 on disk, 2 on the host, misses 8, and 3 is on
    the host behind the miss.  LRU: the host's order is then 3,4,5,6,7,2; the core's promote of 1 evicts 3 (only 1
    and 2 protected), the simulator's evicts 4; request 7's block 3 is a disk hit replayed, a host hit simulated
    (host/disk hits 1/2 against 2/1).  Every policy shows it.  docs/policies.md: "with a disk tier and
    write-through (the default) the two differ only by the order a step's spills land in"; 9e2036b's
    ``_replay`` change ("orders a disk hit's request as the core does") fixed the publish order only.

    Fix (in ``_replay``): reserve promotes with the load's protection, ``set(keys[:n]) if n > 1 else set()``, as
    ``begin_load`` does; since the simulator's fake entries carry no reader count and S3-FIFO now passes a leased
    entry over by ``e.readers`` alone, also count the simulated leases on the entries (``e.readers += 1`` at
    ``hpol.lease``, ``-= 1`` before ``hpol.unlease``).  With both changes a fuzz of 48 random write-through runs
    (host 6 and 8, lru and s3fifo) agreed with the replay exactly, where today 4 of them differ."""
    ids = [[1], [2], [3], [4, 5, 6], [7], [1, 2, 8, 3], [3]]
    reqs = [Request(i, 512 * len(x), 1, tuple(x)) for i, x in enumerate(ids)]
    core = replay(reqs, 6, 100, host_policy=policy, disk_policy="lru", write_mode="through", scratch=str(tmp_path))
    sim = tt.simulate_tiers(reqs, 6, 100, policy, "lru", write_mode="through")
    assert core["spills_shed"] == 0 and core["disk_evictions"] == 0 and core["stores_shed"] == 0
    assert (core["host_hits"], core["disk_hits"]) == (1, 2)   # the core, traced by hand above
    assert (sim.host_hits, sim.disk_hits) == (core["host_hits"], core["disk_hits"]), (
        f"{policy}: simulated host/disk hits {sim.host_hits}/{sim.disk_hits} != replayed "
        f"{core['host_hits']}/{core['disk_hits']} (the simulator's promote protected block 3, the core's did not)")


# ============================================================================================ finding 3

def _mover(kind: str, dev: torch.Tensor, host: torch.Tensor, q: CompletionQueue) -> Any:
    if kind == "native":
        return NativeMover([(dev, host)], q, batch_max=64)
    return ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)


@pytest.mark.parametrize("lone", [False, True], ids=["with-neighbours", "alone"])
@pytest.mark.parametrize("kind", ["native", "threads"])
def test_a_malformed_transfer_held_for_a_blocking_owner_is_answered_alone(kind: str, lone: bool) -> None:
    """What is wrong: bf3e229 fixed round 38's finding 2 (a transfer whose rows are not a sequence, ``None``,
    failing the flush of every other one) in ``split_batches`` alone; the blocking owner's path measures
    ``len(t.rows)`` before any ``screen`` as well.  While ``TierManager._block_until`` holds the mover it calls
    ``help_one``: ``NativeMover.help_one`` (tiered_kv/movers/native.py) evaluates ``len(held[0].rows)`` and
    ``sum(len(t.rows) for t in held)``, and ``ThreadMover._help`` (thread.py) ``nbytes += len(t.rows) * block`` as
    it takes each transfer into its batch.  Both raise ``TypeError`` out of ``help_one`` -- out of the engine's
    ``wait()`` -- and the thread mover's handler answers every transfer it had taken, the *valid* ones before the
    bad one included, "copy interrupted".  The transfers are the same that ``flush()`` now answers correctly
    (round 38's ``test_a_transfer_without_a_row_list_is_answered_alone``); only the owner's wait differs.
    Reachable through the movers' own API (``TierManager`` hands them int lists), as round 38's finding 2.

    Fix: size held transfers as ``split_batches`` does (a helper ``_rows_len(t)`` returning 0 on ``TypeError``,
    used by ``NativeMover.help_one``, ``ThreadMover._help`` and ``ThreadMover._do_batch``'s ``len(ts[0].rows)``),
    leaving the answer to ``screen``/``copy_one``."""
    dev = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(3901), dtype=torch.uint8)
    host = torch.zeros((8, 16), dtype=torch.uint8)
    q = CompletionQueue()
    m = _mover(kind, dev, host, q)
    bad = Transfer("bad", _STORE, None, [1])  # type: ignore[arg-type]
    ts = [bad] if lone else [Transfer("g1", _STORE, [0], [0]), bad, Transfer("g2", _STORE, [2], [2])]
    raised: Optional[BaseException] = None
    try:
        m.hold(True)   # as TierManager._block_until does before it helps
        for t in ts:
            m.submit(t)
        try:
            while m.help_one():
                pass
        except Exception as exc:   # noqa: BLE001 - the defect: TierManager.wait() would raise it
            raised = exc
        m.hold(False)
    finally:
        # (cleanup only: a malformed transfer left held must not make close() raise)
        m._held = collections.deque(t for t in m._held if t.rows is not None)
        m.close()
    got = {r.token: r for r in q.drain()}
    assert raised is None, f"{kind}: help_one() raised {raised!r} for one malformed held transfer"
    assert sorted(got) == sorted(t.token for t in ts), f"{kind}: answered {sorted(got)}"
    assert not got["bad"].ok
    if not lone:
        assert got["g1"].ok and got["g2"].ok, (
            f"{kind}: valid neighbours failed: {got['g1'].error!r}, {got['g2'].error!r}")
        assert torch.equal(host[0], dev[0]) and torch.equal(host[2], dev[2])


# ============================================================================================ pinned correct

@pytest.mark.parametrize("use_evalsha", [True, False], ids=["evalsha", "eval"])
@pytest.mark.parametrize("which", ["standalone", "cluster"])
def test_every_reply_the_store_gets_from_a_real_server_passes_the_new_caps(which: str, use_evalsha: bool,
                                                                           request: pytest.FixtureRequest) -> None:
    """826bd80 made ``Replies.read`` (tiered_kv/remote/resp.py) refuse, as ``InvalidResponse`` (the link dropped and
    every command of the trip failed), a bulk over ``READ_BUFFER`` (64 KiB) to anything but a block's GET, arrays
    nested over ``MAX_DEPTH``, lines over ``MAX_LINE``, and a GET answered by anything but a bulk string, nil or an
    error.  Pinned: no command the store's I/O threads send (``reader._fetch``: EXISTS, GET into a view;
    ``writer``: SET of the staged value, the publish / cancel / invalidate / drop_if_same scripts by EVALSHA or EVAL;
    ``Conn._follow``: ASKING) gets such a reply from a real server, standalone or cluster, at 10 B, 70 KiB and 2 MiB
    values -- a regression here would fail every put or fetch against a healthy server."""
    pytest.importorskip("redis")
    from redis.exceptions import InvalidResponse, ResponseError

    from tiered_kv.remote.conn import Conn
    from tiered_kv.remote.keys import KeyNames
    from tiered_kv.remote.resp import Drained, GetInto, Landed
    from tiered_kv.remote.url import parse_url

    url = request.getfixturevalue("redis_url" if which == "standalone" else "redis_cluster_url")
    conn = Conn(parse_url(url), 5.0, use_evalsha=use_evalsha, name="review-round39")
    try:
        conn.ping()   # (loads the scripts for EVALSHA)
        names = KeyNames("review-round39")
        tok = uuid.uuid4()
        for size in (10, 70 << 10, 2 << 20):
            key = b"key-%d" % size
            tag = names.tag(key)
            staged = names.staged(key, tok)
            value = bytes(range(256)) * (size // 256) + b"v" * (size % 256)
            cmds: list[Any] = [
                ("SET", staged, value, "EX", 60),
                conn.script("publish", [staged, tag + ":v", tag + ":t", f"{tag}:x:{tok.hex}"], [0, 0]),
                ("EXISTS", names.value(key)),
                GetInto(names.value(key), 5, memoryview(bytearray(size - 5))),   # the expected length: Landed
                GetInto(names.value(key), 5, memoryview(bytearray(17))),         # another length: Drained
                conn.script("cancel", [names.value(key), names.token_tomb(key, tok)], [b"\0" * 16, 10]),
                conn.script("drop_if_same", [names.value(key)], ["0" * 40]),
                conn.script("drop_if_same", [names.value(key)], [""]),
                conn.script("invalidate", [names.value(key), names.tomb(key)], [10]),
            ]
            if which == "standalone":
                cmds.append(("ASKING",))   # (an error reply here: cluster support disabled)
            got = conn.round_trip(cmds)
            assert not [r for r in got if isinstance(r, InvalidResponse)], (size, got)
            assert got[:3] == [b"OK", 0, 1], (size, got[:3])
            assert isinstance(got[3], Landed) and isinstance(got[4], Drained) and got[4].n == size, (size, got[3:5])
            assert got[5:9] == [0, 0, 0, 1], (size, got[5:9])
            if which == "standalone":
                assert isinstance(got[9], ResponseError), got[9]
    finally:
        conn.close()
