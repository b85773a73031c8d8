"""Eviction and admission policies inside the core: chosen per tier by the config, with the index's leases
and fences intact under every one of them, and admission never costing a block already stored.

The policies' own orders are tested against models in tests/test_policies.py; here they run under a
real ``TierManager`` (CPU mover, disk tier on threads, write-through) and a seeded random engine
(tests/random_engine.py) that catches any row or host slot holding another key's bytes.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Optional

import pytest
from prometheus_client import CollectorRegistry

from fakes import DTYPE, ROW_BYTES, ROW_SHAPE, fill_row, host_matches, make_kv, mgr_metric, row_matches
from random_engine import random_engine
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.errors import ConfigError
from tiered_kv.core.policy import ADMISSIONS, POLICIES, Admission

ROWS = 48
HOST_SLOTS = 12
DISK_SLOTS = 24


def manager(tmp: Optional[Path], host_slots: int = HOST_SLOTS, **kw: Any) -> TierManager:
    kv = make_kv(ROWS)
    disk: dict[str, Any] = {}
    if tmp is not None:
        disk = dict(disk_path=str(tmp / "disk"), disk_capacity_bytes=DISK_SLOTS * ROW_BYTES, disk_io="thread")
    cfg = TieredKVConfig(namespace="policy-test", host_capacity_bytes=host_slots * ROW_BYTES,
                         host_evict_ahead_blocks=0, **disk, **kw)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    mgr._test_kv = kv   # type: ignore[attr-defined]
    return mgr


class RefuseMarked(Admission):
    """A test filter: refuses every key that starts with b"no-" (deterministic, unlike the real filters)."""

    name = "refuse_marked"

    def __init__(self, num_slots: int = 0) -> None:
        self.recorded: list[bytes] = []

    def record(self, key: bytes) -> None:
        self.recorded.append(key)

    def admit(self, key: bytes, victim: Optional[bytes]) -> bool:
        return not key.startswith(b"no-")


@pytest.fixture
def refuse_marked(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(ADMISSIONS, RefuseMarked.name, RefuseMarked)
    return RefuseMarked.name


def store(mgr: TierManager, key: bytes, row: int) -> bool:
    kv = mgr._test_kv   # type: ignore[attr-defined]
    fill_row(kv, row, key)
    job = mgr.store(key, row)
    if job is None:
        return False
    mgr.wait([job], timeout=30)
    return job.state.value == "done"


# --------------------------------------------------------------------------- leases and fences per policy
@pytest.mark.parametrize("policy,admission", [(p, "all") for p in sorted(POLICIES)] +
                         [("lru", a) for a in sorted(ADMISSIONS) if a != "all"])
def test_every_policy_keeps_the_leases_under_a_random_engine(policy: str, admission: str, tmp_path: Path) -> None:
    """Stores, loads, frees, cancels, invalidations and polls in random order, the host and disk tiers both
    under ``policy`` (and ``admission`` on the disk tier: this engine makes no lookups, so a filter on the
    host would refuse every store): no load or host slot ever holds another key's bytes, every job is
    reported once."""
    # 24 host slots: the engine's stores in flight (their copies wait for the next poll) leave room to evict
    mgr = manager(tmp_path, host_slots=24, host_policy=policy, disk_policy=policy, disk_admission=admission)
    kv = mgr._test_kv   # type: ignore[attr-defined]
    with mgr:
        ok_loads, ok_stores = random_engine(
            mgr, random.Random(20261203), ROWS, 1200, (0.30, 0.30, 0.10, 0.05, 0.04, 0.0, 0.02),
            compute=lambda row, key: fill_row(kv, row, key), row_holds=lambda row, key: row_matches(kv, row, key),
            host_holds=lambda key: host_matches(mgr, key, kv), device_tick=lambda rng: None,
            after_wait=lambda: mgr.flush(timeout=30), prefix=f"{policy}-")
        assert mgr.debug_sizes()["host_used_slots"] == mgr.debug_sizes()["host_entries"]
    # the run did exercise loads and stores: the engine's waits (2% of its operations) let every store and
    # load in flight finish, so stored keys are there to load however slowly the copy threads run (without
    # them a loaded 2-core machine once finished 11 stores and no load in the whole run)
    assert ok_loads > 5 and ok_stores > 5, (ok_loads, ok_stores)
    assert mgr._core.index.policy.name == policy


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_leased_block_is_never_the_victim(policy: str) -> None:
    """Every host slot but one leased to a load in flight: stores evict only the one unleased block (the most
    recently used and hit: the victim every policy would pick last), then shed."""
    mgr = manager(None, host_policy=policy)
    kv = mgr._test_kv   # type: ignore[attr-defined]
    keys = [b"k%02d" % i for i in range(HOST_SLOTS)]
    with mgr:
        for i, k in enumerate(keys):
            assert store(mgr, k, i)
        mgr.poll()
        # copy_batch_max (64) holds the loads' copies with the owner until the next poll: their slots stay leased
        assert mgr.lookup([keys[-1]]) == 1      # the one left unleased is the most recently used (and hit)
        loads = [mgr.load(k, 20 + i) for i, k in enumerate(keys[:-1])]
        assert all(j is not None for j in loads)
        fill_row(kv, 40, b"new-1")
        first = mgr.store(b"new-1", 40)        # evicts keys[-1], the only evictable block
        fill_row(kv, 41, b"new-2")
        second = mgr.store(b"new-2", 41)       # nothing evictable: shed
        assert first is not None and second is None
        mgr.wait(timeout=30)
        for i, (k, j) in enumerate(zip(keys[:-1], loads)):
            assert j is not None and j.state.value == "done", j
            assert row_matches(kv, 20 + i, k)
        assert mgr.lookup([keys[-1]]) == 0 and mgr.lookup(keys[:-1]) == HOST_SLOTS - 1
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="store", reason="host_full") == 1


# --------------------------------------------------------------------------- admission
def test_disk_admission_keeps_refused_blocks_off_disk_and_counts_them(tmp_path: Path, refuse_marked: str) -> None:
    mgr = manager(tmp_path, disk_admission=refuse_marked)
    with mgr:
        assert store(mgr, b"no-1", 0) and store(mgr, b"yes-1", 1)
        assert mgr.flush(timeout=30)
        dindex = mgr._core.dindex
        assert dindex is not None
        assert b"yes-1" in dindex and b"no-1" not in dindex
        assert mgr._core.index.get(b"no-1") is not None, "a refused spill still leaves the block on the host"
        mgr.poll()
        assert mgr_metric(mgr, "tiered_kv_admission_refused_total", tier="disk") == 1
        assert mgr_metric(mgr, "tiered_kv_admission_refused_total", tier="host") == 0
        assert mgr_metric(mgr, "tiered_kv_shed_total", kind="spill", reason="backpressure") == 0
        adm = dindex.admission
        assert isinstance(adm, RefuseMarked)
        mgr.lookup([b"yes-1", b"no-1", b"other"])
        assert adm.recorded == [b"yes-1", b"no-1", b"other"], "a lookup's keys are the references it counts"


def test_write_back_offers_a_refused_block_once_per_residency(tmp_path: Path, refuse_marked: str) -> None:
    mgr = manager(tmp_path, disk_admission=refuse_marked, write_mode="back")
    with mgr:
        for i in range(HOST_SLOTS):
            assert store(mgr, (b"no-%d" if i % 2 else b"yes-%d") % i, i)
        for _ in range(5):   # the write-back passes of five steps
            mgr.poll()
        assert mgr.flush(timeout=30)
        mgr.poll()
        assert mgr_metric(mgr, "tiered_kv_admission_refused_total", tier="disk") == HOST_SLOTS // 2


def test_admission_never_costs_a_block_already_stored(tmp_path: Path, refuse_marked: str) -> None:
    """A block on disk before the filter would refuse it stays readable: promotes do not ask the filter."""
    mgr = manager(tmp_path)
    with mgr:
        assert store(mgr, b"no-kept", 0)
        assert mgr.flush(timeout=30)
    mgr = manager(tmp_path, disk_admission=refuse_marked, host_admission=refuse_marked)
    kv = mgr._test_kv   # type: ignore[attr-defined]
    with mgr:
        assert mgr.lookup([b"no-kept"]) == 1
        job = mgr.load(b"no-kept", 5)
        assert job is not None
        mgr.wait([job], timeout=30)
        assert job.state.value == "done" and row_matches(kv, 5, b"no-kept")


def test_host_admission_refuses_the_store_without_touching_a_slot(refuse_marked: str) -> None:
    mgr = manager(None, host_admission=refuse_marked)
    with mgr:
        assert store(mgr, b"yes-a", 0)
        used = mgr.debug_sizes()["host_used_slots"]
        fill_row(mgr._test_kv, 1, b"no-a")   # type: ignore[attr-defined]
        assert mgr.store(b"no-a", 1) is None
        assert mgr.store_many([b"no-b", b"yes-b"], [2, 3]) is not None
        mgr.wait(timeout=30)
        assert mgr.debug_sizes()["host_used_slots"] == used + 1
        assert mgr.lookup([b"yes-b"]) == 1 and mgr.lookup([b"no-a"]) == 0 and mgr.lookup([b"no-b"]) == 0
        mgr.poll()
        assert mgr_metric(mgr, "tiered_kv_admission_refused_total", tier="host") == 2
        adm = mgr._core.index.admission
        assert isinstance(adm, RefuseMarked) and adm.recorded == [b"yes-b", b"no-a", b"no-b"]


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("field", ["host_policy", "disk_policy", "host_admission", "disk_admission"])
def test_the_config_names_an_unknown_policy(field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field} must be one of .*'belady'"):
        TieredKVConfig(namespace="x", host_capacity_bytes=1, **{field: "belady"})


def test_policy_names_from_the_environment() -> None:
    cfg = TieredKVConfig.from_env(environ={"TIERED_KV_NAMESPACE": "n", "TIERED_KV_HOST_CAPACITY_BYTES": "64",
                                           "TIERED_KV_DISK_POLICY": "lru", "TIERED_KV_DISK_ADMISSION": "all"})
    assert (cfg.host_policy, cfg.disk_policy, cfg.disk_admission) == ("lru", "lru", "all")


def test_shape_constants_still_match() -> None:   # the helpers above assume fakes' row layout
    assert ROW_BYTES == make_kv(1).element_size() * make_kv(1)[0].numel() and tuple(ROW_SHAPE) and DTYPE
