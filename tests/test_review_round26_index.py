"""Round 26 review: the batched hot-path index operations (``TierIndex.reserve_absent``, ``reserve_each``,
``publish_all``, ``acquire_all``, ``release_all``, ``pin_all``, ``_evict_lru``, ``evict_ahead``,
``_maybe_free``, ``writer_done``), their use in ``TierCore`` (``begin_store``, ``begin_load``,
``publish_store``, ``drop_store``, ``cancel_part``, ``_apply_spill``'s batched shortcut, ``end_step``) and
the manager's per-key job maps.

What was run besides the tests below (scratch harnesses, not kept; all found nothing):

* an index-level differential (batched ``TierIndex`` against the ``_batched = False`` reference, 4800 seeded
  runs over lru/s3fifo/arc/prefix x no filter/second_hit/tinylfu): ``reserve_absent`` with a protect list
  of the call's own keys and with foreign protect sets, ``reserve_each``, ``publish_all``, ``acquire_all``
  with a key named twice, ``pin_all``/``release_all``, ``evict_ahead`` *with* a protect set (the existing
  machine never passes one), ``remove``, ``ready_run``; compared entries, states, readers, the policy's
  order through pins, evictions, refusals and ``on_evict`` order after every call;
* a manager-level differential on the host tier (320 seeded runs of store/store_many/load/load_many/
  free_block/invalidate/cancel/out-of-order and failing copies/poll/lookup, every policy, admission on
  and off, evict-ahead 0 and 2): completions, index state and every metric sample equal step by step;
* the same over a disk tier (``FakeDiskStore`` of ``tests/test_review_core2.py``), the reference also
  forced off ``DiskTier.start_spills``' batched reservation (``none_of`` patched) and off
  ``_apply_spill``'s shortcut (``job._dead = {}``), write-through and write-back, faults in spill
  parts: completions, both indexes, metrics and the disk store's op log equal step by step;
* host-tier invariants under the same random engine (slots unique, no slot of an in-flight STORE/LOAD
  on the free list, used slots = live entries + entries held dead by jobs, no leak at quiescence, exactly
  once, never wrong bytes): 1600 runs;
* ``CoreMachine`` of ``tests/test_review_core2.py`` swept with 5000 random examples.

What it proved wrong (fixed; both tests below fail on the tree before the fix): a key named more than once
in one ``begin_store`` call (the vLLM front end's ``prepare_store`` passes its keys through unchecked) was
reserved once, as documented, but when it found no slot, or the admission filter refused it, it was counted
once per occurrence (``tiered_kv_shed_total{reason="host_full"}``, ``admission_refused_total``).  Fixed:
``TierIndex.reserve_absent`` takes each key of a call once.

Suspected, not shown:

* ``TierCore.begin_store`` at ``max_inflight_jobs`` counts one ``inflight_limit`` shed per call, while
  ``host_full`` counts per key (docs/observability.md calls ``shed_total`` per job, so consistent with the
  docs, but ``store_many`` of N absent keys and N ``store()`` calls report N:1 for the same overload); that
  branch also skips ``policy.link(keys)`` (a prefix policy never learns the chain of a store shed there).
* ARC: a ghost key that finds no slot adapts ``p`` at each reservation attempt (``ARC.victim`` pops its
  ``adapted`` mark when no victim is found), so the same key repeated in one call, or stored again each
  step while the tier is full of leased slots, moves ``p`` repeatedly for what is one miss (reproduced in
  scratch: ``reserve_absent([g, g])`` of a B1 ghost on a 2-slot tier with nothing evictable moves ``p``
  0 -> 2; the dedupe fix of the findings below would make it 1; not kept as a finding: whether a
  repeated key is one reference is the caller's to say).
* PrefixLRU: a store_many whose parent part was cancelled (``cancel_part``) publishes the child as a leaf
  adopting a parent that is not held; it is not an orphan, so it is not among the first victims although
  a prefix lookup stops before it.
* vLLM front end: a store of several keys whose every part is invalidated one by one ends in
  ``SlabScheduler._cancel`` with reason ``cancelled`` (its ``_cancel_hook`` drops the part's
  ``superseded``); the parts cancelled before are never counted stale there (``settle_cancelled`` counts
  nothing), while ``TierManager`` counts each part with its own reason (``drop_store``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig
from tiered_kv.integrations.scheduler import SlabScheduler
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.metrics import Metrics

ROW = 64


def _sample(m: Metrics, name: str, **labels: str) -> float:
    m.flush()
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else float(v)


@pytest.fixture
def sched(tmp_path: Path) -> Any:
    made: list[Any] = []

    def open_(slots: int, **kw: Any) -> SlabScheduler:
        slab = SharedSlab.open(tmp_path / f"s{len(made)}.slab", slots, ROW, 1)
        cfg = TieredKVConfig(namespace="r26", host_capacity_bytes=slots * ROW, host_evict_ahead_blocks=0, **kw)
        t = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="r26"))
        made.append((t, slab))
        return t

    yield open_
    for t, slab in made:
        t.close()
        slab.close()


def test_a_key_repeated_in_one_store_that_finds_no_slot_is_shed_once(sched: Any) -> None:
    """Contract: ``reserve_absent`` reserves a key repeated in one call once ("a key repeated is reserved
    once") and returns "keys that found no evictable slot"; ``tiered_kv_shed_total{reason="host_full"}``
    "counts each key that found no host slot" (docs/observability.md).  Two distinct keys that find no
    slot are two blocks not offloaded.

    What was wrong (before the fix): tiered_kv/core/index.py:344-371 (``reserve_absent``'s per-key loop): the repeated key
    is absent again at its second occurrence (its first found no slot), so it asks for a victim again and
    adds to ``full`` again; ``TierCore.begin_store`` (tiered_kv/core/tiers.py:268-269) sheds ``full`` keys.
    ``SlabScheduler.prepare_store`` passes its keys unchecked for repeats, so vLLM's call reaches it.
    Here ``[x, x, y]`` on a tier whose every slot is being written: 3 counted for 2 keys.

    Fixed: ``reserve_absent`` dedupes ``keys`` once (``dict.fromkeys``) before its per-key loop when a key
    repeats."""
    t = sched(2)
    first = t.prepare_store([b"a", b"b"])
    assert first.slots and len(first.slots) == 2      # both slots WRITING: nothing evictable
    got = t.prepare_store([b"x", b"x", b"y"])
    assert got.keys == []
    assert _sample(t.metrics, "tiered_kv_shed_total", kind="store", reason="host_full") == 2.0


def test_a_key_repeated_in_one_store_refused_by_admission_counts_once(sched: Any) -> None:
    """Contract: ``TierIndex.refused`` / ``tiered_kv_admission_refused_total{tier="host"}`` count "new blocks
    a tier's admission filter kept out"; a key named twice in one store is one block (it would be reserved
    once: ``reserve_absent``'s docstring).

    What was wrong (before the fix): tiered_kv/core/index.py:364-367 (``reserve_absent``'s per-key loop): a refused key is
    not in the index at its next occurrence, so ``admits`` is asked again and ``refused`` grows again
    (tiered_kv/core/index.py:238).  ``prepare_store([x, x])`` under ``second_hit`` counts 2 refusals.

    Fixed: as for ``host_full`` (each distinct key taken once per call)."""
    t = sched(4, host_admission="second_hit")
    got = t.prepare_store([b"x", b"x"])
    assert got.keys == []
    assert t.core.index.refused == 1
    t.tick()
    assert _sample(t.metrics, "tiered_kv_admission_refused_total", tier="host") == 1.0
