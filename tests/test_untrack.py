"""Index entries and tokens are kept out of the cyclic garbage collector (``tiered_kv/untrack.py``).

An untracked object must never be part of a reference cycle (the collector would never free the
cycle): these tests keep ``Entry`` and tokens to atomic attributes, check that a manager's entries
are untracked on both tiers, and that untracked objects are still freed by reference counting.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
import uuid
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.core.index import Entry, EntryState, TierIndex
from tiered_kv.jobs import TokenFactory, uuid_from_int
from tiered_kv.untrack import make_untrack, untrack

cpython = pytest.mark.skipif(sys.implementation.name != "cpython", reason="the collector's tracking is CPython's")

# what an Entry's attributes may hold: objects that can never refer back to an Entry
_ATOMIC = (bytes, int, bool, EntryState, uuid.UUID)


class _Plain:
    __slots__ = ("x",)


@cpython
def test_entries_and_tokens_are_untracked() -> None:
    token = TokenFactory()()
    assert not gc.is_tracked(token)
    assert not gc.is_tracked(Entry(b"k", 3, token))
    assert not gc.is_tracked(uuid_from_int(token.int))
    assert gc.is_tracked(_Plain())   # the class of object untrack() is for is tracked by default


def test_untrack_is_a_no_op_elsewhere_than_cpython() -> None:
    p = _Plain()
    make_untrack("pypy")(p)
    assert gc.is_tracked(p) or sys.implementation.name != "cpython"


@cpython
def test_untracking_twice_is_harmless_and_the_object_is_still_freed() -> None:
    p = _Plain()
    untrack(p)
    untrack(p)
    assert not gc.is_tracked(p)
    del p
    gc.collect()


def test_an_entry_holds_only_atomic_values_through_its_life() -> None:
    """An untracked Entry in a cycle would leak: every slot holds an atomic value at every stage of an
    entry's life in the index (a new slot that holds a container must take the untrack() out)."""
    assert set(Entry.__slots__) == {"key", "slot", "state", "writer", "readers", "live", "writing", "spilled",
                                    "where"}
    index = TierIndex(2)
    tokens = TokenFactory()
    seen: list[Entry] = []

    def check(e: Entry) -> None:
        for name in Entry.__slots__:
            v = getattr(e, name)
            assert isinstance(v, _ATOMIC), f"Entry.{name} holds a {type(v).__name__}"
        seen.append(e)

    a = index.reserve(b"a", tokens())
    assert a is not None
    check(a)
    index.publish(a)
    check(a)
    index.acquire(a)
    check(a)
    index.release(a)
    b = index.reserve(b"b", tokens())
    assert b is not None
    index.publish(b)
    c = index.reserve(b"c", tokens())   # evicts a
    assert c is not None
    check(a)
    check(c)
    assert not a.live and len(seen) == 5


@cpython
def test_untracked_entries_are_freed_by_their_reference_count() -> None:
    token = TokenFactory()()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        entries = [Entry(b"key-%d" % i, i, token) for i in range(20_000)]
        grown = tracemalloc.get_traced_memory()[0] - before
        del entries
        left = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown > 20_000 * 48     # the entries were allocated ...
    assert left < grown // 20      # ... and freed when the list went, without a collection


@cpython
def test_a_managers_entries_on_both_tiers_are_untracked(tmp_path: Path) -> None:
    cfg = TieredKVConfig(namespace="untrack", host_capacity_bytes=16 * 256, disk_path=tmp_path / "d",
                         disk_capacity_bytes=64 * 256)
    mgr = TierManager(cfg, torch.zeros(16, 256, dtype=torch.uint8), registry=CollectorRegistry())
    try:
        for step in range(4):
            keys = [b"k%d:%d" % (step, i) for i in range(8)]
            assert mgr.store_many(keys, list(range(8))) is not None
            mgr.wait(timeout=30)
            assert mgr.flush(timeout=30)   # spilled: the host slots are free for the next step
        core = mgr._core
        host = list(core.index._entries.values())
        assert core.dindex is not None
        disk = list(core.dindex._entries.values())
        assert host and disk
        for e in host + disk:
            assert not gc.is_tracked(e) and not gc.is_tracked(e.writer)
    finally:
        mgr.close()
