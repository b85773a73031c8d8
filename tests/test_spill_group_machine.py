"""A state machine over spill groups: stores of several keys, invalidations, the writer held and let
through commit by commit, loads, polls; compared with the simplest model of what must hold.

The model is a set: the keys invalidated since they were last stored.  Whatever the interleaving
(an invalidation before the group's batch is taken, while the writer holds it, after it committed
and before its report is applied, after the report), a key of that set is never served (lookup 0,
no load), and once everything settles none of them is on disk.  Every key that is on disk, read
back by a fresh manager after close, has its own bytes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest
from disk_helpers import WriterGate, drain, raw_keys
from fakes import fill_row, make_config, make_fake_manager, make_kv, row_matches, sm_settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

pytestmark = pytest.mark.disk_threads

KEYS = [b"sg%d" % i for i in range(6)]
ROWS = 16
LOAD_ROW = 12          # store rows are 0..3; loads go here


def _manager(path: Path, kv, policy: str = "lru"):
    cfg = make_config(host_slots=4, disk_path=path, disk_capacity_bytes=64 * 128,
                      writer_batch_seconds=0.0, host_evict_ahead_blocks=0, host_policy=policy, disk_policy=policy)
    return make_fake_manager(cfg, kv)


def _load_checked(mgr, mover, kv, key: bytes, row: int) -> bool:
    """Load ``key`` into ``row`` (its read from disk first, if it is only there), answer the copy,
    and check the bytes.  False when the load was refused or failed (never wrong bytes)."""
    fill_row(kv, row, b"sentinel")
    job = mgr.load(key, row)
    if job is None:
        return False
    deadline = time.monotonic() + 30
    while not job.done and not mover.is_outstanding(job):   # a promote runs first
        mgr.wait(timeout=0.01)
        assert time.monotonic() < deadline, f"load of {key!r} never reached its copy: {mgr.debug_sizes()}"
    if not job.done:
        mover.complete(job)
        mgr.poll()
    assert job.done
    ok = job.state.value == "done"
    if ok:
        assert row_matches(kv, row, key), f"load of {key!r} reported ok with WRONG BYTES"
    else:
        assert row_matches(kv, row, b"sentinel")
    mgr.free_block(row)
    return ok


class SpillGroupMachine(RuleBasedStateMachine):
    policy = "lru"   # host_policy and disk_policy

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tkv-spill-groups-"))
        self.path = self.dir / "d"
        self.kv = make_kv(ROWS)
        self.mgr, self.mover = _manager(self.path, self.kv, self.policy)
        self.gate = WriterGate(block_from=1, max_hold=30)
        self.mgr.disk.fault_hook = self.gate
        self.gone: set[bytes] = set()       # invalidated since last stored

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def store(self, keys: list[bytes]) -> None:
        rows = list(range(len(keys)))
        for k, r in zip(keys, rows):
            fill_row(self.kv, r, k)
        job = self.mgr.store_many(keys, rows)
        if job is not None:
            self.mover.complete(job)
        self.mgr.poll()
        for r in rows:
            self.mgr.free_block(r)
        for k in keys:                      # stored now (or present already): served again
            if self.mgr.lookup([k]) == 1:
                self.gone.discard(k)

    @rule(k=st.sampled_from(KEYS))
    def invalidate(self, k: bytes) -> None:
        self.mgr.invalidate(k)
        self.gone.add(k)

    @rule(n=st.integers(1, 3))
    def let_the_writer_commit(self, n: int) -> None:
        self.gate.step(n)

    @rule()
    def poll(self) -> None:
        self.mgr.poll()

    @rule()
    def wait_a_little(self) -> None:
        self.mgr.wait(timeout=0.005)

    @rule(k=st.sampled_from(KEYS))
    def load(self, k: bytes) -> None:
        ok = _load_checked(self.mgr, self.mover, self.kv, k, LOAD_ROW)
        assert not (ok and k in self.gone), f"{k!r} was loaded after it was invalidated"

    @invariant()
    def invalidated_keys_are_never_served(self) -> None:
        for k in self.gone:
            assert self.mgr.lookup([k]) == 0, f"{k!r} is served after it was invalidated"

    def teardown(self) -> None:
        try:
            self.gate.open()
            assert self.mgr.flush(timeout=30)
            drain(self.mgr)
            self.invalidated_keys_are_never_served()
            assert not self.mgr._core.jobs, self.mgr.debug_sizes()
        finally:
            self.gate.open()
            self.mgr.close()
        try:
            on_disk = raw_keys(self.path)
            assert not on_disk & self.gone, f"invalidated keys on disk: {sorted(on_disk & self.gone)}"
            kv = make_kv(ROWS)
            mgr, mover = _manager(self.path, kv, self.policy)
            try:
                for k in sorted(on_disk):
                    assert _load_checked(mgr, mover, kv, k, LOAD_ROW), f"{k!r} on disk but not readable"
            finally:
                mgr.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


SpillGroupMachine.TestCase.settings = sm_settings(60, 40)
test_spill_group_state_machine = SpillGroupMachine.TestCase


# the same machine with the host and disk tiers under each other eviction policy (fewer examples each):
# the leases and tombstones are the index's, whatever order the policy evicts in
def _under(policy: str) -> type:
    m = type(f"SpillGroupMachine_{policy}", (SpillGroupMachine,), {"policy": policy})
    m.TestCase.settings = sm_settings(20, 30)
    return m.TestCase


test_spill_group_state_machine_s3fifo = _under("s3fifo")
test_spill_group_state_machine_arc = _under("arc")
test_spill_group_state_machine_prefix = _under("prefix")
