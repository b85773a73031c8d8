"""Adversarial review of the vLLM integration side: the shared slab's completion rings
(tiered_kv.integrations.slab) read by the scheduler front end (integrations.scheduler).  No vLLM import:
the scheduler is driven by hand and the worker is played by the test (bytes written into
``slab.rows[slot]``, then ``slab.mark_done``), in whatever order each case needs, so every interleaving is
forced by call order, never by sleeps.  Block bytes are derived from (key, tag) so a block written by the
wrong job is told apart byte for byte.

What it proved wrong (the proof failed with an AssertionError before the fix): ``SharedSlab.ok()`` asked
only "is the ring entry exactly the failed mark?", so a rank's failed copy whose entry the job
``ring_size`` numbers later overwrote before the scheduler applied it read as success, and the store was
published with that rank's part of the row never written.  Fixed: ok() asks for the success mark itself;
an overwritten entry counts as failed (a miss).  The case uses a small ``ring_size`` (a public parameter of
:meth:`SharedSlab.open`); the default 65,536 only makes it rarer.
"""

from __future__ import annotations

import pytest

from test_vllm_scheduler import MISS, mark, pattern, rig, slot_bytes_of, worker_store  # noqa: F401  (rig: the fixture)


# =========================================================================== ring wrap-around
@pytest.mark.parametrize("engine_report", ["late", "before_ring"])
def test_a_store_whose_copy_failed_on_a_rank_is_never_published_after_its_ring_entry_wrapped(rig, engine_report):
    """Rank 1's copy of the store of A fails (ring entry ``2*seq+1``).  Before the scheduler applies the
    job, the job numbered ``seq + ring_size`` finishes and overwrites that ring entry with ``2*(seq+R)``.
    ``done(seq)`` rightly says the job is over (a larger value), but ``ok(seq)`` only asks "is the entry
    exactly the failed mark?", so the overwritten failure reads as success and A is published with rank 1's
    half of the row never written: wrong bytes served.  The outcome of an overwritten entry is unknown and
    must count as failed (a miss), never as ok.

    ``late``: vLLM's completion of A arrives after the later jobs; ``before_ring``: it arrived first (A
    waits in ``_awaiting``), the ring entry is overwritten, and ``tick()`` publishes it."""
    R = 4
    slab = rig.slab(num_slots=8, row_bytes=64, world_size=2, ring_size=R)
    tiers = rig.open(slab)
    slab.rows.fill_(0xEE)                              # what rank 1's part of the slot holds: not A's bytes
    pa = tiers.prepare_store([b"A"])
    if engine_report == "before_ring":
        tiers.complete_store([b"A"])                   # waits for the rings
        assert tiers.debug_sizes()["awaiting"] == 1
    worker_store(slab, [b"A"], pa.slots, pa.seq, "v1", ranks=[0])   # rank 0 copied, rank 1's copy failed
    mark(slab, pa.seq, ranks=[1], ok=False)
    assert slab.done(pa.seq) and not slab.ok(pa.seq)
    later = [b"B", b"C", b"D", b"E"]
    for k in later:                                    # R more jobs, each copied and marked on both ranks
        p = tiers.prepare_store([k])
        worker_store(slab, p.keys, p.slots, p.seq, "v1")
        tiers.complete_store(p.keys)
    assert (pa.seq + R) % R == pa.seq % R
    if engine_report == "late":
        tiers.complete_store([b"A"])
    else:
        tiers.tick()
    # A's copy failed on rank 1: never published (a miss), whatever the ring entry holds now
    assert tiers.lookup(b"A") == MISS, (
        f"published A; its bytes: {slot_bytes_of(tiers, b'A')[32:40].tolist()} (rank 1's part) vs "
        f"{pattern(b'A', 'v1', 64)[32:40].tolist()}")
