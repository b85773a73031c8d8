"""Two managers sharing one real redis-server, driven by hypothesis against a simple model.

Each rule runs to completion (a store is flushed, a fetch waited for), so the model is exact:
the server holds, per key, the version of the last write no tombstone refused; an invalidate on
either manager removes the key there and on the server, and refuses every later write of it (the
tombstones outlive the test).  A fetch must return exactly the server's version, or miss when it
holds none; every key a manager holds must hold the bytes of the version the model says.  Block
bytes depend on (key, version), so a stale or resurrected value is caught by its bytes.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Optional

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from prometheus_client import CollectorRegistry

from fakes import sm_settings
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind

ROW = 256
KEYS = [f"k{i}".encode() for i in range(6)]
DEADLINE_S = 15.0


def version_bytes(key: bytes, version: int) -> torch.Tensor:
    data = hashlib.shake_128(b"%s/%d" % (key, version)).digest(ROW)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class SharedRemote(RuleBasedStateMachine):
    url = ""
    server: Any = None

    @initialize()
    def start(self) -> None:
        self.server.flush()
        cfg = TieredKVConfig(namespace="sm|u8", host_capacity_bytes=32 * ROW, remote_url=self.url,
                             remote_miss_ttl_seconds=0.0, host_evict_ahead_blocks=0)
        self.mgrs = [TierManager(cfg, torch.zeros(8, ROW, dtype=torch.uint8), registry=CollectorRegistry())
                     for _ in range(2)]
        self.local: list[dict[bytes, int]] = [{}, {}]
        self.remote: dict[bytes, int] = {}
        self.tombed: set[bytes] = set()
        self.next_version = 1

    def teardown(self) -> None:
        for m in getattr(self, "mgrs", []):
            m.close()

    @rule(m=st.integers(0, 1), key=st.sampled_from(KEYS))
    def store(self, m: int, key: bytes) -> None:
        mgr = self.mgrs[m]
        v = self.next_version
        self.next_version += 1
        mgr._device_blocks[0].copy_(version_bytes(key, v))
        job = mgr.store(key, 0)
        if job is not None:
            mgr.wait([job])
        mgr.free_block(0)
        assert mgr.flush(timeout=DEADLINE_S)
        if key in self.local[m]:
            assert job is None           # held already: not stored again, not written again
            return
        assert job is not None
        self.local[m][key] = v
        if key not in self.tombed:
            self.remote[key] = v

    @rule(m=st.integers(0, 1), key=st.sampled_from(KEYS))
    def invalidate(self, m: int, key: bytes) -> None:
        mgr = self.mgrs[m]
        mgr.invalidate(key)
        assert mgr.flush(timeout=DEADLINE_S)
        self.local[m].pop(key, None)
        self.remote.pop(key, None)
        self.tombed.add(key)

    @rule(m=st.integers(0, 1), key=st.sampled_from(KEYS))
    def fetch(self, m: int, key: bytes) -> None:
        mgr = self.mgrs[m]
        if key in self.local[m]:
            assert mgr.lookup([key]) == 1
            return
        assert mgr.lookup([key]) == 0
        core = mgr._core
        deadline = time.monotonic() + DEADLINE_S
        while core.n_in_flight[JobKind.FETCH] or core.remote.want_token is not None:
            assert time.monotonic() < deadline, "the fetch did not land"
            mgr.poll()
            time.sleep(0.001)   # not ordering anything: the server answers on its own time
        found: Optional[int] = self.remote.get(key)
        held = core.index.ready(key)
        if found is None:
            assert held is None, f"{key!r} fetched, but the server should hold no value of it"
        else:
            assert held is not None, f"{key!r} (version {found}) missed"
            self.local[m][key] = found

    @invariant()
    def every_held_key_holds_its_version(self) -> None:
        for mgr, local in zip(getattr(self, "mgrs", []), getattr(self, "local", [])):
            index = mgr._core.index
            assert {e.key for e in index.entries()} == set(local)
            for key, v in local.items():
                e = index.ready(key)
                assert e is not None
                assert torch.equal(mgr._host_rows[e.slot], version_bytes(key, v)), f"{key!r}: not version {v}"


def test_two_managers_sharing_a_server_match_the_model(redis_server: Any) -> None:
    SharedRemote.url = redis_server.url
    SharedRemote.server = redis_server
    run_state_machine_as_test(SharedRemote, settings=sm_settings(50, 30))


def test_the_model_catches_a_write_that_ignores_its_tombstone(redis_server: Any, monkeypatch: Any) -> None:
    """The machine above fails when the publish script stops checking the key tombstone: its rules,
    in the order that shows it (a key invalidated on one manager, stored there again, then fetched by
    the other; the manager that invalidated a key does not ask the server for it while its tomb lives,
    so a random run reaches this order less often than the search budget here allows)."""
    from tiered_kv.remote import keys as remote_keys

    check = remote_keys.KEY_TOMB_CHECK
    assert check in remote_keys.SCRIPTS["publish"]
    monkeypatch.setitem(remote_keys.SCRIPTS, "publish", remote_keys.SCRIPTS["publish"].replace(check, ""))
    SharedRemote.url = redis_server.url
    SharedRemote.server = redis_server
    machine = SharedRemote()
    try:
        machine.start()
        machine.invalidate(0, KEYS[0])
        machine.store(0, KEYS[0])
        with pytest.raises(AssertionError, match="the server should hold no value"):
            machine.fetch(1, KEYS[0])
    finally:
        machine.teardown()
