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

import hashlib
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig
from tiered_kv.integrations.scheduler import Lookup, SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

HIT, MISS = Lookup.HIT, Lookup.MISS


# =========================================================================== helpers
def pattern(key: bytes, tag: str, n: int) -> torch.Tensor:
    """``n`` bytes that only (key, tag) produces."""
    return torch.frombuffer(bytearray(hashlib.shake_128(tag.encode() + b"|" + key).digest(n)), dtype=torch.uint8)


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.slabs: list[SharedSlab] = []
        self.tiers: list[SlabScheduler] = []

    def slab(self, num_slots: int = 4, row_bytes: int = 32, world_size: int = 1, name: str = "rv.slab",
             **kw: Any) -> SharedSlab:
        s = SharedSlab.open(self.tmp_path / name, num_slots, row_bytes, world_size, **kw)
        self.slabs.append(s)
        return s

    def open(self, slab: SharedSlab, **kw: Any) -> SlabScheduler:
        cfg = TieredKVConfig(namespace="t", host_capacity_bytes=slab.num_slots * slab.row_bytes, **kw)
        t = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
        self.tiers.append(t)
        return t

    def close(self) -> None:
        for t in self.tiers:
            t.close()
        for s in self.slabs:
            s.close()


@pytest.fixture
def rig(tmp_path: Path):
    r = Rig(tmp_path)
    yield r
    r.close()


def copy_in(slab: SharedSlab, keys: list[bytes], slots: list[int], tag: str, ranks: Optional[list[int]] = None) -> None:
    """Play a worker's store copy (no ring mark): each key's bytes into its slot, on ``ranks``' parts."""
    rb = slab.rank_bytes
    for r in (range(slab.world_size) if ranks is None else ranks):
        for k, s in zip(keys, slots):
            slab.rows[s, r * rb:(r + 1) * rb] = pattern(k, tag, slab.row_bytes)[r * rb:(r + 1) * rb]


def mark(slab: SharedSlab, seq: int, ranks: Optional[list[int]] = None, ok: bool = True) -> None:
    for r in (range(slab.world_size) if ranks is None else ranks):
        slab.mark_done(r, seq, ok)


def store_ready(tiers: SlabScheduler, keys: list[bytes], tag: str = "v1") -> list[int]:
    p = tiers.prepare_store(keys)
    assert p.keys == keys, p
    copy_in(tiers.slab, p.keys, p.slots, tag)
    mark(tiers.slab, p.seq)
    tiers.complete_store(p.keys)
    assert [tiers.lookup(k) for k in keys] == [HIT] * len(keys)
    return p.slots


def served_bytes(tiers: SlabScheduler, key: bytes) -> torch.Tensor:
    """The bytes a load of ``key`` copies to the device (the slot it leases, read while leased)."""
    pl = tiers.prepare_load([key])
    out = tiers.slab.rows[pl.slots[0]].clone()
    mark(tiers.slab, pl.seq)
    tiers.complete_load([key])
    return out


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
    copy_in(slab, [b"A"], pa.slots, "v1", ranks=[0])   # rank 0 copied, rank 1's copy failed
    mark(slab, pa.seq, ranks=[0])
    mark(slab, pa.seq, ranks=[1], ok=False)
    assert slab.done(pa.seq) and not slab.ok(pa.seq)
    later = [b"B", b"C", b"D", b"E"]
    for k in later:                                    # R more jobs, each copied and marked on both ranks
        p = tiers.prepare_store([k])
        copy_in(slab, p.keys, p.slots, "v1")
        mark(slab, p.seq)
        tiers.complete_store(p.keys)
    assert (pa.seq + R) % R == pa.seq % R
    if engine_report == "late":
        tiers.complete_store([b"A"])
    else:
        tiers.tick()
    # A's copy failed on rank 1: never published (a miss), whatever the ring entry holds now
    assert tiers.lookup(b"A") == MISS, (
        f"published A; its bytes: {served_bytes(tiers, b'A')[32:40].tolist()} (rank 1's part) vs "
        f"{pattern(b'A', 'v1', 64)[32:40].tolist()}")
