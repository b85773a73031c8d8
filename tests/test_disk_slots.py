"""The disk tier's slot file (``slots.tkv``): slot accounting, reuse, growth, damage, recovery.

Payloads live in fixed-size slots of a preallocated data file; LMDB's
``blocks`` sub-database holds per key only an index record pointing at a slot
(tiered_kv/disk.py, tiered_kv/diskformat.py).  Checked here:

1. a slot is referenced by at most one committed entry, and
   ``DiskStore.slots_in_use`` equals the committed slot entries after any mix of
   spills, capacity evictions, invalidations, cancels and re-stores;
2. ``durability="batch"``: a slot dropped by a commit is handed out again only
   after a later commit (or an explicit sync); ``"sync"``/``"none"``: at once;
3. the slot file never grows past the configured slots, grows in chunks and
   falls back to one slot at a time on ENOSPC;
4. a flipped payload byte is a miss counted as ``reason="checksum"``, and the
   entry (and its slot) goes;
5. a truncated slot file: recovery drops the entries past the end, keeps and
   serves the others, and never hands out a slot a kept entry still uses;
6. two index records on one slot: recovery keeps the higher seq;
7. a reader whose slot was reused while it read reports "superseded", not
   corruption (the interleaving is forced through a patched ``os.preadv``);
8. a spill cancelled before its payload is written takes no slot; one cancelled
   after the write gives its slot back at once;
9. reopen serves every entry byte for byte and frees exactly the unreferenced
   slots;

plus a hypothesis state machine against a dict model.  Ordering is forced with
writer gates, events inside patched I/O calls and ``flush()``; never sleeps.
The committed index is read through the store's own LMDB environment while a
manager is open, and with LMDB directly (``disk_helpers.raw_*``) once closed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import CollectorRegistry

import tiered_kv.disk.readers as readers_mod
import tiered_kv.disk.slots as slots_mod
from disk_helpers import (NS, PYTHON, ROW, child_env, content, disk_config, drain, fill, flip_slot_byte, keys,
                          load_into, load_ok, make_kv, metric, metric_sum, put_raw, raw_index, readline, rig, row_is,
                          slot_file, store_one, store_seq)
from fakes import sm_settings
from tiered_kv import TierManager
from tiered_kv.disk import DiskOptions, DiskStore
from tiered_kv.disk.writer import Writer
from tiered_kv.disk.format import SLOTS_NAME, lmdb_key, pack_slot_entry, parse_header, slot_bytes_for
from tiered_kv.movers import CompletionQueue

# the writer's own hooks and internals: the in-process threads (tests/test_disk_process.py has the process)
pytestmark = pytest.mark.disk_threads

__all__ = ["rig"]

SB = slot_bytes_for(ROW)        # 4096: one block per slot in most tests


# ============================================================================ helpers
def expected_slots(disk_blocks: int, batch_cfg: int = 64, row: int = ROW) -> tuple[int, int, int]:
    """(batch_blocks, index_blocks, slots) exactly as disktier.open_disk_tier derives them (default config)."""
    batch = max(1, min(batch_cfg, (64 << 20) // row, disk_blocks // 16))
    index = disk_blocks - 2 * batch if disk_blocks >= 32 else disk_blocks
    return batch, index, max(disk_blocks, index + 2 * batch)


def index_slots(disk: DiskStore) -> dict[bytes, int]:
    """Block key -> slot of every committed slot entry, read through the open store's own environment."""
    env = disk.db.env
    assert env is not None
    out: dict[bytes, int] = {}
    disk.db.rw.acquire_shared()
    try:
        with env.begin(db=disk.db.blocks) as txn:
            for _, v in txn.cursor():
                h = parse_header(v)
                assert h.in_slot, f"{h.key!r} is stored inline"
                out[h.key] = h.slot
    finally:
        disk.db.rw.release_shared()
    return out


def raw_slots(path: Any) -> dict[bytes, int]:
    """Block key -> slot of every committed entry, read with LMDB directly (manager closed)."""
    out = {}
    for v in raw_index(path).values():
        h = parse_header(v)
        assert h.in_slot
        out[h.key] = h.slot
    return out


def free_slots(disk: DiskStore) -> set[int]:
    with disk.slots.lock:
        return set(disk.slots.free)


def pending_slots(disk: DiskStore) -> list[int]:
    """Slots dropped by a commit that is not durable yet (durability="batch")."""
    with disk.slots.lock:
        return sorted(i for _, i in disk.slots.freed_unsynced)


def check_slots(mgr: TierManager) -> dict[bytes, int]:
    """Invariant 1 on a quiet, flushed manager: one slot per committed entry, no leak, file in bounds."""
    disk = mgr.disk
    assert disk is not None
    idx = index_slots(disk)
    used = list(idx.values())
    assert len(set(used)) == len(used), f"two committed entries share a slot: {sorted(idx.items())}"
    assert pending_slots(disk) == [], "a flush leaves no dropped slot waiting"
    free = free_slots(disk)
    assert not free & set(used), f"live slots on the free list: {sorted(free & set(used))}"
    assert disk.slots_in_use == len(used), (disk.slots_in_use, len(used))
    assert free | set(used) == set(range(disk.slots.length)), "a slot is neither free nor referenced (leak)"
    assert mgr.disk_blocks == len(idx), (mgr.disk_blocks, len(idx))
    assert all(0 <= s < disk.opts.slots for s in used), used
    assert disk.slot_file_bytes() <= disk.opts.slots * disk.slot_bytes
    return idx


def quiesce(mgr: TierManager) -> None:
    mgr.wait(timeout=30)
    drain(mgr)
    assert mgr.flush(timeout=30) is True
    drain(mgr)


def offload_checksums(mgr: TierManager) -> None:
    """Every batch, however small, is checksummed on the disk tier's hash thread (as large batches are)."""
    assert mgr.disk is not None
    mgr.disk.writer.opts = dataclasses.replace(mgr.disk.writer.opts, hash_offload_bytes=0)  # type: ignore[misc]


def corrupt_total(mgr: TierManager) -> float:
    return metric_sum(mgr, "tiered_kv_corrupt_blocks_total")


def store_nowait(mgr: TierManager, kv, key: bytes, row: int, tag: Optional[bytes] = None):
    """Start a store of ``key`` from ``row`` filled with the bytes of ``tag`` (default: the key)."""
    kv[row].copy_(content(tag or key, kv.shape[1]))
    return mgr.store(key, row)


class ReaderHold:
    """Patches ``os.preadv`` (as used by tiered_kv.disk): the first call made by a disk reader thread
    signals ``reading`` and waits for ``go`` before reading, so the test runs in between."""

    def __init__(self, monkeypatch) -> None:
        self.reading = threading.Event()
        self.go = threading.Event()
        self.calls = 0
        real = os.preadv

        def preadv(fd, buffers, offset, *a):
            if threading.current_thread().name == "tiered-kv-disk-reader":
                self.calls += 1
                if self.calls == 1:
                    self.reading.set()
                    self.go.wait(30)          # never hang a failing test
            return real(fd, buffers, offset, *a)

        monkeypatch.setattr(readers_mod.os, "preadv", preadv)

    def release(self) -> None:
        self.go.set()


def record_reads(disk: DiskStore) -> list:
    """Every Report a reader thread produces (the manager discards a cancelled promote's report)."""
    got: list = []
    orig = disk.readers._answer

    def answer(group):
        got.extend(r for _, r in group)
        orig(group)

    disk.readers._answer = answer  # type: ignore[method-assign]
    return got


def raw_store(path: Path, *, block_bytes: int, slots: int, durability: str = "none", errors: Optional[list] = None):
    q = CompletionQueue()
    errs = errors if errors is not None else []
    s = DiskStore(DiskOptions(path=path, namespace=NS, block_bytes=block_bytes, capacity_bytes=slots * block_bytes,
                              durability=durability, batch_blocks=1, batch_bytes=block_bytes, batch_seconds=0.0,
                              slots=slots, num_readers=1), q, on_error=lambda kind, msg: errs.append(kind))
    return s, q


def await_token(q: CompletionQueue, token: uuid.UUID, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        item = q.get(max(0.0, deadline - time.monotonic()))
        if item is None:
            raise AssertionError(f"no answer for {token} within {timeout} s")
        if item.token == token:
            return item


def spill(s: DiskStore, q: CompletionQueue, key: bytes, buf: bytearray):
    tok = uuid.uuid4()
    assert s.submit_spill(tok, key, memoryview(buf))
    return tok, await_token(q, tok)


# ============================================================================ 1. accounting under churn
@pytest.mark.parametrize("durability", ["batch", "sync", "none"])
@pytest.mark.parametrize("hash_thread", [False, True], ids=["inline_checksums", "hash_thread"])
def test_slots_in_use_equals_committed_entries_after_seeded_churn(rig, durability, hash_thread):
    rng = random.Random(f"churn-{durability}")
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=3, disk_slots=12, durability=durability)
    if hash_thread:
        offload_checksums(mgr)
    _, index_blocks, slots = expected_slots(12)
    assert mgr.disk.opts.slots == slots == 14
    pool = keys(30)
    expect: dict[bytes, bytes] = {}          # key -> the tag whose bytes it holds (if still stored)
    versions: dict[bytes, int] = {}
    checks = spill_cancels = cancel_spill_ops = 0
    for step in range(160):
        op = rng.choice(["store", "store", "store", "invalidate", "cancel_spill", "cancel_store", "load"])
        k = rng.choice(pool if op != "cancel_spill" else [p for p in pool if p not in expect])
        cancel_spill_ops += op == "cancel_spill"
        row = step % 4
        if op in ("store", "cancel_spill", "cancel_store"):
            versions[k] = versions.get(k, 0) + 1
            tag = k + b"#%d" % versions[k]
            gate = None
            if op == "cancel_spill":
                drain(mgr)                        # no host slot leased to a spill: this store is not shed
                gate = rig.gate(mgr)              # and no spill report can arrive before the cancel
            job = store_nowait(mgr, kv, k, row, tag)
            if job is not None and op == "cancel_store":
                mgr.cancel(job)
                assert [c.ok for c in mgr.wait([job], timeout=30) if c.job is job] == [False]
            elif job is not None:
                done = [c for c in mgr.wait([job], timeout=30) if c.job is job]
                assert len(done) == 1 and done[0].ok, done
                expect[k] = tag
                if op == "cancel_spill":          # its spill is queued or held in the writer: cancel it
                    gate.entered(1)
                    mgr.invalidate(k)
                    expect.pop(k)
                    spill_cancels += 1
            if gate is not None:
                gate.open()
        elif op == "invalidate":
            mgr.invalidate(k)
            expect.pop(k, None)
        else:
            job, comp = load_into(mgr, kv, k, 4 + row)
            if job is not None:
                assert comp is not None and comp.ok, comp
                assert k in expect and row_is(kv, 4 + row, expect[k]), f"load of {k!r}: wrong bytes"
        if step % 16 == 15:
            quiesce(mgr)
            idx = check_slots(mgr)
            assert len(idx) <= index_blocks
            assert set(idx) <= set(expect), f"invalidated keys still committed: {set(idx) - set(expect)}"
            checks += 1
    quiesce(mgr)
    idx = check_slots(mgr)
    assert checks == 10
    assert corrupt_total(mgr) == 0
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 0
    assert metric(mgr, "tiered_kv_evictions_total", tier="disk") > 0, "the churn never hit the capacity"
    assert spill_cancels == cancel_spill_ops > 10
    # (plain invalidations may cancel spills still in flight too)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") >= spill_cancels
    for i, k in enumerate(sorted(idx)):       # every committed entry serves exactly its bytes
        job, comp = load_into(mgr, kv, k, i % 8)
        assert job is not None and comp is not None and comp.ok, (k, comp)
        assert row_is(kv, i % 8, expect[k])
    quiesce(mgr)
    check_slots(mgr)
    rig.close(mgr)
    on_disk = raw_slots(rig.path)
    assert set(on_disk) == set(idx) and len(set(on_disk.values())) == len(on_disk)


# ============================================================================ 2. when a dropped slot is reused
@pytest.mark.parametrize("durability", ["batch", "sync", "none"])
def test_dropped_slot_is_reused_after_a_later_commit_in_batch_mode_at_once_otherwise(rig, durability):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, durability=durability)
    disk = mgr.disk
    store_one(mgr, kv, b"A", 0)
    assert index_slots(disk) == {b"A": 0}
    gate = rig.gate(mgr)
    mgr.invalidate(b"A")                       # tomb -> T1 drops A's slot 0
    gate.entered(1)                            # the writer holds [tomb A] (never idle from here on)
    store_one(mgr, kv, b"B", 1, flush=False)   # B's spill queues behind it
    gate.step()                                # T1 commits
    gate.entered(2)                            # T1 is complete; B's batch has not placed anything yet
    assert index_slots(disk) == {}
    if durability == "batch":
        assert pending_slots(disk) == [0] and 0 not in free_slots(disk)
        assert disk.slots_in_use == 1          # T1 is not durable: slot 0 still counts
    else:
        assert pending_slots(disk) == [] and 0 in free_slots(disk)
        assert disk.slots_in_use == 0
    store_one(mgr, kv, b"C", 2, flush=False)   # C's spill queues behind B's
    gate.step()                                # B is placed and committed (T2)
    gate.entered(3)                            # T2 complete, C's batch not placed yet
    b_slot = index_slots(disk)[b"B"]
    if durability == "batch":
        assert b_slot == 1, "slot 0 was handed out before a later commit made T1 durable"
        assert pending_slots(disk) == [] and 0 in free_slots(disk)   # T2 released it
    else:
        assert b_slot == 0
    gate.open()
    quiesce(mgr)
    idx = check_slots(mgr)
    assert idx == ({b"B": 1, b"C": 0} if durability == "batch" else {b"B": 0, b"C": 1})
    assert load_ok(mgr, kv, b"B", 5) and load_ok(mgr, kv, b"C", 6)


def test_explicit_sync_frees_a_dropped_slot_in_batch_mode(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, durability="batch")
    disk = mgr.disk
    store_seq(mgr, kv, [b"A", b"B"])
    mgr.invalidate(b"A")
    assert mgr.flush(timeout=30) is True       # commit + sync: slot 0 is durable-free
    assert pending_slots(disk) == [] and free_slots(disk) >= {0}
    assert disk.slots_in_use == 1
    store_one(mgr, kv, b"C", 0)
    assert index_slots(disk) == {b"B": 1, b"C": 0}
    check_slots(mgr)


def test_write_transaction_that_commits_nothing_does_not_free_dropped_slots(rig):
    """Batch mode: a transaction with nothing to write (a spill prevented by its cancel) commits
    nothing in LMDB -- no meta page, no fdatasync, last_txnid unchanged -- so the commit that
    dropped slot 0 is still not durable, and slot 0 must stay out of the free list."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, durability="batch")
    disk = mgr.disk
    store_one(mgr, kv, b"A", 0)
    assert index_slots(disk) == {b"A": 0}
    gate = rig.gate(mgr)
    mgr.invalidate(b"A")
    gate.entered(1)                            # the writer holds [tomb A]
    store_one(mgr, kv, b"B", 1, flush=False)   # B's spill queues behind it
    gate.step()                                # T1: A deleted, slot 0 dropped
    gate.entered(2)                            # the writer holds [spill B], nothing placed yet
    t1 = disk.db.env.info()["last_txnid"]
    assert pending_slots(disk) == [0] and disk.slots_in_use == 1
    mgr.invalidate(b"B")                       # B is cancelled before its payload is placed
    gate.step()                                # B's transaction: prevented, writes nothing
    gate.entered(3)                            # the writer holds [tomb B]
    assert disk.db.env.info()["last_txnid"] == t1, "the prevented spill's transaction committed something"
    early = (0 in free_slots(disk), disk.slots_in_use, pending_slots(disk))
    store_one(mgr, kv, b"C", 2, flush=False)   # C's spill queues behind [tomb B]
    gate.step()                                # [tomb B]: nothing to write either
    gate.entered(4)                            # the writer holds [spill C]
    assert disk.db.env.info()["last_txnid"] == t1
    c_in_zero_before_t1_durable = 0 in free_slots(disk)
    gate.open()
    quiesce(mgr)
    c_slot = index_slots(disk)[b"C"]
    assert (early, c_in_zero_before_t1_durable, c_slot) == ((False, 1, [0]), False, 1), (
        f"slot 0 (dropped by T1 = txn {t1}) was put on the free list by a transaction that committed "
        f"nothing (last_txnid still {t1}): (free?, slots_in_use, pending) after it = {early}; "
        f"C was then written into slot {c_slot} while T1 was still not durable")
    check_slots(mgr)


# ============================================================================ 3. growth and bounds
@pytest.mark.parametrize("disk_slots", [8, 48], ids=["toy-tier", "tier-with-headroom"])
def test_full_tier_evicting_continuously_never_grows_past_the_configured_slots(rig, disk_slots):
    kv = make_kv(16)
    mgr = rig.open(kv, host_slots=16, disk_slots=disk_slots)
    disk = mgr.disk
    batch, index_blocks, slots = expected_slots(disk_slots)
    assert (disk.opts.slots, disk.opts.batch_blocks) == (slots, batch)
    seen: list[tuple[int, int, int]] = []
    orig = disk.slots.alloc

    def alloc() -> int:
        i = orig()
        seen.append((i, disk.slots_in_use, disk.slot_file_bytes()))
        return i

    disk.slots.alloc = alloc  # type: ignore[method-assign]
    burst = min(12, index_blocks)              # a burst never exceeds what the index can evict
    total = 6 * burst
    stored: list[bytes] = []
    n = 0
    for rnd in range(6):
        drain(mgr)                             # the last burst's spills are reported (no flush, no sync)
        gate = rig.gate(mgr)                   # hold the writer: a burst of deletes and spills piles up
        jobs = []
        for r in range(burst):
            k = b"burst%04d" % n
            n += 1
            job = store_nowait(mgr, kv, k, r)
            assert job is not None
            jobs.append((k, job))
        comps = mgr.wait([j for _, j in jobs], timeout=30)
        assert sum(1 for c in comps if c.ok) == burst, comps
        stored += [k for k, _ in jobs]
        gate.entered(1)
        gate.open()
    quiesce(mgr)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="ok") == total
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 0
    assert metric_sum(mgr, "tiered_kv_shed_total") == 0
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") == 0
    assert metric(mgr, "tiered_kv_evictions_total", tier="disk") == total - index_blocks
    assert len(seen) == total
    assert max(i for i, _, _ in seen) < slots
    assert max(u for _, u, _ in seen) <= slots
    assert max(b for _, _, b in seen) <= slots * SB
    assert disk.slot_file_bytes() == slots * SB          # one chunk, capped at the configured slots
    idx = check_slots(mgr)
    # LRU: whole bursts survive newest first (the order inside a burst is the stores' completion order)
    whole = index_blocks // burst * burst
    assert len(idx) == index_blocks and set(stored[-whole:]) <= set(idx) <= set(stored[-whole - burst:])
    for i, k in enumerate(sorted(idx)):
        assert load_ok(mgr, kv, k, i % 16), k


def test_slot_file_grows_in_chunks_capped_at_the_configured_slots(tmp_path, monkeypatch):
    block = 4 << 20                            # 4 MiB blocks: a 64 MiB chunk is 16 slots
    calls: list[tuple[int, int]] = []
    real = os.posix_fallocate

    def fallocate(fd, off, length):
        calls.append((off, length))
        return real(fd, off, length)

    monkeypatch.setattr(slots_mod.os, "posix_fallocate", fallocate)
    errors: list[str] = []
    path = tmp_path / "big"
    s, q = raw_store(path, block_bytes=block, slots=18, errors=errors)
    try:
        buf = bytearray(block)
        sizes = []
        for i in range(19):
            buf[:8] = i.to_bytes(8, "little")
            _, r = spill(s, q, b"b%02d" % i, buf)
            assert r.ok == (i < 18), (i, r)
            sizes.append(s.slot_file_bytes())
        assert calls == [(0, 16 * block), (16 * block, 2 * block)]
        assert sizes[0] == sizes[15] == 16 * block
        assert sizes[16] == sizes[17] == sizes[18] == 18 * block       # never past 18 slots
        assert s.slots_in_use == 18
        assert "slots_exhausted" in (r.error or "") and errors == ["slots_exhausted"]
        assert os.path.getsize(path / SLOTS_NAME) == 18 * block
    finally:
        s.close()
        os.remove(path / SLOTS_NAME)


def test_enospc_on_a_chunk_falls_back_to_one_slot_at_a_time(tmp_path, monkeypatch):
    calls: list[tuple[int, int, str]] = []
    real = os.posix_fallocate
    mode = {"fail_above": SB}                  # ENOSPC for anything larger than one slot

    def fallocate(fd, off, length):
        if length > mode["fail_above"]:
            calls.append((off, length, "ENOSPC"))
            raise OSError(errno.ENOSPC, "No space left on device")
        calls.append((off, length, "ok"))
        return real(fd, off, length)

    monkeypatch.setattr(slots_mod.os, "posix_fallocate", fallocate)
    errors: list[str] = []
    s, q = raw_store(tmp_path / "d", block_bytes=ROW, slots=8, durability="batch", errors=errors)
    try:
        toks = {}
        for i in range(5):
            buf = bytearray(content(b"e%d" % i).numpy().tobytes())
            toks[b"e%d" % i], r = spill(s, q, b"e%d" % i, buf)
            assert r.ok, r
            assert s.slot_file_bytes() == (i + 1) * SB
        assert calls == [c for i in range(5) for c in ((i * SB, (8 - i) * SB, "ENOSPC"), (i * SB, SB, "ok"))]
        assert s.slots_in_use == 5 and errors == []
        # ENOSPC on the single slot too: the batch fails, nothing leaks, the file does not grow
        mode["fail_above"] = 0
        _, r = spill(s, q, b"e5", bytearray(ROW))
        assert not r.ok and "disk_full" in (r.error or ""), r
        assert errors == ["disk_full"]
        assert s.slots_in_use == 5 and s.slot_file_bytes() == 5 * SB
        # room again: the next spill takes slot 5 and everything reads back
        mode["fail_above"] = 1 << 62
        toks[b"e6"], r = spill(s, q, b"e6", bytearray(content(b"e6").numpy().tobytes()))
        assert r.ok and s.slots_in_use == 6
        for k, t in toks.items():
            dst = bytearray(ROW)
            rt = uuid.uuid4()
            s.queue_promote(rt, k, t, memoryview(dst))
            s.start_reads()
            assert await_token(q, rt).ok and bytes(dst) == content(k).numpy().tobytes(), k
    finally:
        s.close()
    assert sorted(raw_slots(tmp_path / "d").values()) == [0, 1, 2, 3, 4, 5]


# ============================================================================ 4. a flipped payload byte
def test_flipped_slot_byte_is_a_checksum_miss_and_its_slot_is_reclaimed(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    disk = mgr.disk
    ks = keys(4)
    store_seq(mgr, kv, ks)                     # ks[0], ks[1] only on disk
    victim_slot = index_slots(disk)[ks[0]]
    assert victim_slot == 0
    fd = os.open(slot_file(rig.path), os.O_RDWR)
    try:
        at = victim_slot * SB + 1234
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
    finally:
        os.close(fd)
    fill(kv, 5, b"sentinel")
    job, comp = load_into(mgr, kv, ks[0], 5)
    assert job is not None and comp is not None and not comp.ok and "corrupt" in (comp.error or ""), comp
    assert row_is(kv, 5, b"sentinel"), "a failed load wrote the row"
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="checksum") == 1
    assert corrupt_total(mgr) == 1
    quiesce(mgr)
    idx = check_slots(mgr)
    assert ks[0] not in idx and mgr.lookup([ks[0]]) == 0
    assert 0 in free_slots(disk) and disk.slots_in_use == 3
    store_one(mgr, kv, b"fresh", 0)            # takes the reclaimed slot 0
    assert index_slots(disk)[b"fresh"] == 0
    for i, k in enumerate(ks[1:] + [b"fresh"]):
        assert load_ok(mgr, kv, k, 4 + i), k
    quiesce(mgr)
    check_slots(mgr)
    assert corrupt_total(mgr) == 1
    rig.close(mgr)
    assert set(raw_slots(rig.path)) == set(ks[1:]) | {b"fresh"}


def test_flipped_slot_byte_found_at_reopen_is_a_counted_miss(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2)
    ks = keys(3)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    flip_slot_byte(rig.path, ks[1], ROW - 1)
    mgr = rig.open(kv, host_slots=2)
    assert mgr.disk.recovery.corrupt == 0      # recovery does not read payloads
    fill(kv, 5, b"sentinel")
    job, comp = load_into(mgr, kv, ks[1], 5)
    assert job is not None and not comp.ok and row_is(kv, 5, b"sentinel")
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="checksum") == 1
    assert load_ok(mgr, kv, ks[0], 1) and load_ok(mgr, kv, ks[2], 2)
    quiesce(mgr)
    idx = check_slots(mgr)
    assert set(idx) == {ks[0], ks[2]}


# ============================================================================ 5. a truncated slot file
@pytest.mark.parametrize("cut", ["slot-boundary", "mid-payload"])
def test_truncated_slot_file_drops_entries_past_the_end_and_serves_the_rest(rig, cut):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    ks = keys(6)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    assert raw_slots(rig.path) == {k: i for i, k in enumerate(ks)}
    os.truncate(slot_file(rig.path), 3 * SB + (0 if cut == "slot-boundary" else 100))
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    disk = mgr.disk
    rep = disk.recovery
    assert (rep.entries, rep.corrupt, rep.foreign, rep.purged) == (3, 3, 0, 0)
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="recovery") == 3
    assert rep.slots_free == disk.opts.slots - 3
    assert disk.slots_in_use == 3
    assert mgr.lookup(ks[3:4]) == 0 and mgr.lookup(ks[4:5]) == 0 and mgr.lookup(ks[5:]) == 0
    for i, k in enumerate(ks[:3]):
        assert load_ok(mgr, kv, k, 4 + i), k
    more = keys(6, "new")
    store_seq(mgr, kv, more)
    quiesce(mgr)
    idx = check_slots(mgr)
    assert set(idx) == set(ks[:3]) | set(more)
    for i, k in enumerate(ks[:3] + more):
        assert load_ok(mgr, kv, k, i % 8), k
    assert corrupt_total(mgr) == 3


def test_truncated_slot_file_keeping_a_partial_last_slot_never_hands_that_slot_out(rig):
    """Blocks of 1000 bytes in 4 KiB slots.  The file is cut right after slot 2's payload: recovery keeps
    slot 2's entry (its 1000 bytes are all there) but must count slot 2 as used, or the next spill
    that grows the file is handed slot 2 and overwrites a live entry."""
    row = 1000
    sb = slot_bytes_for(row)
    kv = make_kv(8, row_bytes=row)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    ks = keys(4)
    store_seq(mgr, kv, ks)
    rig.close(mgr)
    assert raw_slots(rig.path) == {k: i for i, k in enumerate(ks)}
    os.truncate(slot_file(rig.path), 2 * sb + row)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    disk = mgr.disk
    rep = disk.recovery
    assert (rep.entries, rep.corrupt) == (3, 1)           # slot 3 is gone, slots 0..2 are whole
    assert mgr.lookup([ks[3]]) == 0
    in_use = disk.slots_in_use
    store_seq(mgr, kv, keys(2, "new"))
    quiesce(mgr)
    idx = index_slots(disk)
    shared = {s: sorted(k for k in idx if idx[k] == s) for s in set(idx.values())
              if sum(1 for v in idx.values() if v == s) > 1}
    lost = [k for i, k in enumerate(ks[:3] + keys(2, "new")) if not load_ok(mgr, kv, k, i % 8)]
    assert (in_use, shared, lost, corrupt_total(mgr)) == (3, {}, [], 1), (
        f"recovery kept the entries of slots 0..2 (file cut inside slot 2, after its payload): "
        f"slots_in_use was {in_use} with 3 committed entries; slots shared by two committed entries: {shared}; "
        f"entries lost after new spills: {lost}; corrupt counted: {corrupt_total(mgr)}")


# ============================================================================ 6. two records on one slot
@pytest.mark.parametrize("loser,winner", [(b"a-old", b"z-new"), (b"z-old", b"a-new")],
                         ids=["loser-scanned-first", "winner-scanned-first"])
def test_two_records_on_one_slot_recovery_keeps_the_higher_seq(rig, loser, winner):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    store_seq(mgr, kv, [loser, b"m-other"])
    rig.close(mgr)
    before = raw_index(rig.path)
    seqs = {parse_header(v).key: parse_header(v).seq for v in before.values()}
    assert raw_slots(rig.path) == {loser: 0, b"m-other": 1}
    # a lost commit: the loser's delete never made it, slot 0 was reused by a newer write of `winner`
    payload = content(winner).numpy().tobytes()
    fd = os.open(slot_file(rig.path), os.O_RDWR)
    try:
        os.pwrite(fd, payload, 0)
    finally:
        os.close(fd)
    put_raw(rig.path, "blocks", lmdb_key(winner),
            pack_slot_entry(NS.encode(), winner, uuid.uuid4(), payload, max(seqs.values()) + 5, 0))
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    disk = mgr.disk
    rep = disk.recovery
    assert (rep.entries, rep.corrupt) == (2, 1)
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="recovery") == 1
    assert mgr.lookup([loser]) == 0 and mgr.load(loser, 0) is None
    assert disk.slots_in_use == 2 and free_slots(disk).isdisjoint({0, 1})
    assert load_ok(mgr, kv, winner, 2) and load_ok(mgr, kv, b"m-other", 3)
    store_seq(mgr, kv, keys(4, "after"))
    quiesce(mgr)
    idx = check_slots(mgr)
    assert idx[winner] == 0 and idx[b"m-other"] == 1
    for i, k in enumerate([winner, b"m-other"] + keys(4, "after")):
        assert load_ok(mgr, kv, k, i % 8), k
    assert corrupt_total(mgr) == 1
    rig.close(mgr)
    assert loser not in raw_slots(rig.path)


def test_two_records_on_one_slot_with_the_older_scanned_last_is_dropped(rig):
    """The forged record is the *older* one (lower seq) and points at a live entry's slot."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    store_seq(mgr, kv, [b"a-live", b"b-other"])
    rig.close(mgr)
    payload = content(b"z-ghost").numpy().tobytes()
    put_raw(rig.path, "blocks", lmdb_key(b"z-ghost"),
            pack_slot_entry(NS.encode(), b"z-ghost", uuid.uuid4(), payload, 0, 0))   # seq 0 < a-live's
    mgr = rig.open(kv, host_slots=2, disk_slots=16)
    assert (mgr.disk.recovery.entries, mgr.disk.recovery.corrupt) == (2, 1)
    assert mgr.lookup([b"z-ghost"]) == 0
    assert load_ok(mgr, kv, b"a-live", 2) and load_ok(mgr, kv, b"b-other", 3)
    assert mgr.disk.slots_in_use == 2
    assert corrupt_total(mgr) == 1


# ============================================================================ 7. a reader whose slot was reused
def _disk_only(rig, kv, durability="batch", **kw):
    mgr = rig.open(kv, host_slots=2, durability=durability, **kw)
    store_seq(mgr, kv, [b"A", b"B", b"C"])     # A only on disk now, in slot 0
    assert mgr.host_bytes(b"A") is None and index_slots(mgr.disk)[b"A"] == 0
    return mgr


def _reader_holding_a(rig, kv, monkeypatch, durability="batch"):
    """A only on disk (slot 0) and a load of A whose reader is held after its index lookup, before
    its pread.  Returns (manager, load job, the hold, the readers' reports)."""
    mgr = _disk_only(rig, kv, durability)
    hold = ReaderHold(monkeypatch)
    reports = record_reads(mgr.disk)
    load = mgr.load(b"A", 5)
    assert load is not None
    mgr.poll()                                 # the read leaves for a reader at the next poll()
    assert hold.reading.wait(30)               # the reader has A's index record, not its bytes
    return mgr, load, hold, reports


@pytest.mark.parametrize("durability", ["batch", "none"])
def test_reader_whose_slot_was_reused_by_another_key_reports_superseded(rig, monkeypatch, durability):
    kv = make_kv(8)
    mgr, load, hold, reports = _reader_holding_a(rig, kv, monkeypatch, durability)
    disk = mgr.disk
    mgr.invalidate(b"A")                       # A's entry is dropped ...
    assert mgr.flush(timeout=30) is True       # ... durably, so slot 0 is free
    assert 0 in free_slots(disk)
    store_one(mgr, kv, b"D", 0)                # ... and D is written into slot 0
    assert index_slots(disk)[b"D"] == 0
    hold.release()
    drain(mgr)
    assert [(r.ok, r.error) for r in reports] == [(False, "miss: superseded on disk")]
    assert corrupt_total(mgr) == 0, "a reused slot was counted as corruption"
    assert load.done and load.state.value == "cancelled"
    assert mgr.lookup([b"A"]) == 0
    assert load_ok(mgr, kv, b"D", 6)
    quiesce(mgr)
    assert set(check_slots(mgr)) == {b"B", b"C", b"D"}


def test_reader_whose_slot_was_rewritten_for_the_same_key_reports_superseded(rig, monkeypatch):
    kv = make_kv(8)
    mgr, _load, hold, reports = _reader_holding_a(rig, kv, monkeypatch)
    disk = mgr.disk
    mgr.invalidate(b"A")
    assert mgr.flush(timeout=30) is True
    job = store_nowait(mgr, kv, b"A", 0, tag=b"A-v2")      # A again, other bytes, into slot 0
    assert job is not None
    assert [c.ok for c in mgr.wait([job], timeout=30) if c.job is job] == [True]
    assert mgr.flush(timeout=30) is True
    assert index_slots(disk)[b"A"] == 0
    hold.release()
    drain(mgr)
    assert [(r.ok, r.error) for r in reports] == [(False, "miss: superseded on disk")]
    assert corrupt_total(mgr) == 0
    job, comp = load_into(mgr, kv, b"A", 6)
    assert comp is not None and comp.ok and row_is(kv, 6, b"A-v2")
    quiesce(mgr)
    assert check_slots(mgr)[b"A"] == 0


def test_reader_whose_slot_bytes_changed_without_an_index_change_reports_corrupt(rig, monkeypatch):
    """The control of the two tests above: the same interleaving, but the index is unchanged."""
    kv = make_kv(8)
    mgr, load, hold, reports = _reader_holding_a(rig, kv, monkeypatch)
    fd = os.open(slot_file(rig.path), os.O_RDWR)
    try:
        os.pwrite(fd, content(b"D").numpy().tobytes(), 0)   # slot 0 overwritten behind the index's back
    finally:
        os.close(fd)
    hold.release()
    comps = mgr.wait([load], timeout=30)
    drain(mgr)
    assert len(reports) == 1 and not reports[0].ok and reports[0].error.startswith("miss: corrupt (checksum")
    assert [c.ok for c in comps if c.job is load] == [False]
    assert metric(mgr, "tiered_kv_corrupt_blocks_total", reason="checksum") == 1
    quiesce(mgr)
    assert set(check_slots(mgr)) == {b"B", b"C"}


def test_read_error_drops_the_entry_and_frees_its_slot(rig, monkeypatch):
    """An I/O error reading a slot is a miss counted in tiered_kv_errors_total; the index forgets the
    key and the writer removes its entry (token-matched), so no slot stays held outside the count."""
    kv = make_kv(8)
    # the disk readers' path (a blocked wait() would read a cached block itself)
    mgr = _disk_only(rig, kv, disk_read_cached_in_wait=False)
    real = os.preadv

    def failing(fd, buffers, offset, *a):
        if threading.current_thread().name == "tiered-kv-disk-reader":
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(readers_mod.os, "preadv", failing)
    fill(kv, 5, b"sentinel")
    job, comp = load_into(mgr, kv, b"A", 5)
    assert job is not None and comp is not None and not comp.ok and "read failed" in (comp.error or "")
    assert row_is(kv, 5, b"sentinel")
    assert metric(mgr, "tiered_kv_errors_total", tier="disk", error="io_error") == 1
    assert corrupt_total(mgr) == 0
    monkeypatch.setattr(readers_mod.os, "preadv", real)
    quiesce(mgr)
    assert mgr.lookup([b"A"]) == 0
    assert set(check_slots(mgr)) == {b"B", b"C"}         # A's entry and slot are gone, nothing leaked
    assert load_ok(mgr, kv, b"B", 6)


def _flushed(store: DiskStore, q: CompletionQueue) -> list:
    """Flush ``store`` and return every other report that arrived before the flush's answer."""
    token = uuid.uuid4()
    store.submit_flush(token)
    seen = []
    while True:
        r = q.get(30)
        assert r is not None, "the flush was never answered"
        if getattr(r, "token", None) == token and not hasattr(r, "kind"):
            assert r.ok
            return seen
        seen.append(r)


def test_unreadable_entry_removal_never_removes_a_newer_write_of_the_key(tmp_path, monkeypatch):
    """The reader queues the removal of an entry it could not read (token-matched).  Pin the
    interleaving where a newer write of the same key commits while the failed read is in progress:
    the removal must leave the newer write alone."""
    q = CompletionQueue()
    store = DiskStore(DiskOptions(path=tmp_path / "d", namespace=NS, block_bytes=ROW, capacity_bytes=64 * ROW), q)
    try:
        t1, t2 = uuid.uuid4(), uuid.uuid4()
        v1 = memoryview(bytearray(content(b"A").numpy().tobytes()))
        v2 = memoryview(bytearray(content(b"A-v2").numpy().tobytes()))
        assert store.submit_spill(t1, b"A", v1)
        assert [(r.token, r.ok) for r in _flushed(store, q)] == [(t1, True)]
        entered, go = threading.Event(), threading.Event()
        real = os.preadv

        def failing(fd, buffers, offset, *a):
            if threading.current_thread().name == "tiered-kv-disk-reader":
                entered.set()
                assert go.wait(30)
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, buffers, offset, *a)

        monkeypatch.setattr(readers_mod.os, "preadv", failing)
        read1 = uuid.uuid4()
        store.queue_promote(read1, b"A", t1, memoryview(bytearray(ROW)))
        store.start_reads()
        assert entered.wait(30)                      # the reader holds t1's index record, mid-read
        assert store.submit_spill(t2, b"A", v2)      # ... and a newer write of A commits meanwhile
        assert [(r.token, r.ok) for r in _flushed(store, q)] == [(t2, True)]
        go.set()                                     # the read fails: the reader queues delete(t1, A) ...
        rep = q.get(30)                              # ... before it reports
        assert rep is not None and rep.token == read1 and not rep.ok and "read failed" in rep.error
        assert _flushed(store, q) == []              # this flush is queued after that delete
        monkeypatch.setattr(readers_mod.os, "preadv", real)
        dst = memoryview(bytearray(ROW))
        read2 = uuid.uuid4()
        store.queue_promote(read2, b"A", t2, dst)
        store.start_reads()
        r = q.get(30)
        assert r is not None and r.token == read2 and r.ok, r
        assert bytes(dst) == bytes(v2)
        assert store.slots_in_use == 1
    finally:
        store.close()
    assert {k: parse_header(v).token for k, v in raw_index(tmp_path / "d").items()} == {b"A": t2}


# ============================================================================ 8. cancelled spills
def test_spill_cancelled_before_its_payload_is_written_takes_no_slot(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, durability="batch")
    disk = mgr.disk
    allocs: list[int] = []
    orig = disk.slots.alloc
    disk.slots.alloc = lambda: allocs.append(orig()) or allocs[-1]  # type: ignore[method-assign]
    gate = rig.gate(mgr)
    store_one(mgr, kv, b"A", 0, flush=False)
    gate.entered(1)                            # the writer holds [spill A] before placing it
    mgr.invalidate(b"A")
    gate.open()
    quiesce(mgr)
    assert allocs == [], f"a cancelled spill was given slot(s) {allocs}"
    assert disk.slots_in_use == 0 and disk.slot_file_bytes() == 0
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 1
    assert metric(mgr, "tiered_kv_orphaned_writes_prevented_total") == 1
    assert mgr.debug_sizes()["disk_tombstones"] == 0
    check_slots(mgr)
    store_one(mgr, kv, b"B", 1)
    assert allocs == [0] and index_slots(disk) == {b"B": 0}


@pytest.mark.parametrize("durability", ["batch", "sync"])
def test_spill_cancelled_after_its_payload_was_written_gives_its_slot_back_at_once(rig, durability):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, durability=durability)
    disk = mgr.disk
    written, go = threading.Event(), threading.Event()
    orig_pwrite, orig_dropped = disk.slots.pwrite, disk.slots.dropped
    dropped: list[int] = []

    def pwrite(slot, src):
        orig_pwrite(slot, src)
        written.set()
        go.wait(30)

    def slots_dropped(slots, txn_id):
        dropped.extend(slots)
        orig_dropped(slots, txn_id)

    disk.slots.pwrite = pwrite  # type: ignore[method-assign]
    disk.slots.dropped = slots_dropped  # type: ignore[method-assign]
    store_one(mgr, kv, b"A", 0, flush=False)
    assert written.wait(30)                    # A's payload is in slot 0, not published
    mgr.invalidate(b"A")
    go.set()
    drain(mgr)                                 # the spill's (cancelled) report is in: its commit is done
    assert dropped == [], "a never-published slot went through the dropped-slot path"
    assert pending_slots(disk) == [] and 0 in free_slots(disk) and disk.slots_in_use == 0
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 1
    disk.slots.pwrite = orig_pwrite  # type: ignore[method-assign]
    store_one(mgr, kv, b"B", 1, flush=False)   # no sync in between: slot 0 is free already
    quiesce(mgr)
    assert check_slots(mgr) == {b"B": 0}
    assert load_ok(mgr, kv, b"B", 5)


# ============================================================================ 9. reopen
@pytest.mark.parametrize("durability", ["batch", "sync", "none"])
def test_reopen_serves_every_entry_and_frees_exactly_the_unreferenced_slots(rig, durability):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=12, durability=durability)
    _, _, slots = expected_slots(12)
    ks = keys(20)
    store_seq(mgr, kv, ks[:16])                # 4 evicted by capacity
    for k in (ks[5], ks[9], ks[13]):
        mgr.invalidate(k)                      # holes in the middle of the file
    store_seq(mgr, kv, ks[16:])                # 1 more evicted
    quiesce(mgr)
    live = check_slots(mgr)
    rig.close(mgr)
    refs = raw_slots(rig.path)
    assert refs == live and len(refs) == 12
    mgr = rig.open(kv, host_slots=2, disk_slots=12, durability=durability)
    disk = mgr.disk
    rep = disk.recovery
    assert (rep.entries, rep.corrupt, rep.foreign, rep.purged) == (12, 0, 0, 0)
    assert disk.slots.length == slots
    assert rep.slots_free == slots - 12
    assert free_slots(disk) == set(range(slots)) - set(refs.values())
    assert disk.slots_in_use == 12
    for i, k in enumerate(sorted(refs)):
        assert load_ok(mgr, kv, k, i % 8), k
    idx = _store_more_and_read_everything(mgr, kv, keys(6, "re"))   # evicts 6 old ones
    rig.close(mgr)
    again = raw_slots(rig.path)
    assert again == idx and len(set(again.values())) == len(again)


_KILLED_CHILD = """
import json, sys
from prometheus_client import CollectorRegistry
from tiered_kv import TierManager
from disk_helpers import disk_config, keys, make_kv, store_seq
kv = make_kv(8)
mgr = TierManager(disk_config(sys.argv[1], host_slots=2, disk_slots=12, durability="none"), kv,
                  registry=CollectorRegistry())
ks = keys(20)
store_seq(mgr, kv, ks[:16])
for k in (ks[2], ks[7], ks[11]):
    mgr.invalidate(k)
store_seq(mgr, kv, ks[16:])
assert mgr.flush(timeout=30) is True
print(json.dumps(sorted(k.decode() for k in ks if mgr.lookup([k]) == 1)), flush=True)
sys.stdin.readline()                      # SIGKILLed here, never closed
"""


def test_reopen_after_a_process_kill_with_durability_none_serves_every_flushed_entry(rig):
    proc = subprocess.Popen([PYTHON, "-c", _KILLED_CHILD, str(rig.path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        expect = [k.encode() for k in json.loads(readline(proc, 120))]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(expect) == 12
    refs = raw_slots(rig.path)
    assert set(refs) == set(expect) and len(set(refs.values())) == 12
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=2, disk_slots=12, durability="none")
    disk = mgr.disk
    rep = disk.recovery
    assert (rep.entries, rep.corrupt, rep.foreign, rep.purged) == (12, 0, 0, 0)
    assert free_slots(disk) == set(range(disk.slots.length)) - set(refs.values())
    assert rep.slots_free == disk.opts.slots - 12 and disk.slots_in_use == 12
    for i, k in enumerate(expect):
        assert load_ok(mgr, kv, k, i % 8), k
    _store_more_and_read_everything(mgr, kv, keys(5, "post"))


def _store_more_and_read_everything(mgr, kv, new: list[bytes]) -> dict[bytes, int]:
    """After a reopen: new spills never overwrite a live slot; every entry reads back byte for byte."""
    store_seq(mgr, kv, new)
    quiesce(mgr)
    idx = check_slots(mgr)
    assert set(new) <= set(idx)
    for i, k in enumerate(sorted(idx)):
        assert load_ok(mgr, kv, k, i % 8), k
    assert corrupt_total(mgr) == 0
    return idx


# ============================================================================ state machine
SM_KEYS = [b"s%d" % i for i in range(8)]
SM_ROWS = 4
SM_DISK = 4                                     # index 4 blocks, batch 1, 6 slots
SM_SLOTS = 6


class SlotMachine(RuleBasedStateMachine):
    """A TierManager (host 2 blocks, disk 4 blocks in 6 slots) against a dict model: key -> tag of its bytes.

    A key in the model may be served -- only with exactly its tag's bytes -- or be gone by capacity
    (pruned at each flush); a key not in the model (never stored, invalidated, or gone) is never
    served.  After every flush the committed slot entries read from LMDB equal ``slots_in_use`` and
    ``disk_blocks``; after every reopen recovery finds exactly what LMDB holds."""

    DURABILITY = "batch"

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tkv-slots-"))
        self.path = self.tmp / "disk"
        self.kv = make_kv(SM_ROWS, seed=11)
        self.model: dict[bytes, bytes] = {}
        self.version = 0
        self.mgr: Optional[TierManager] = None
        self.since_reopen = 0

    def _open(self) -> None:
        cfg = disk_config(self.path, host_slots=2, disk_slots=SM_DISK, durability=self.DURABILITY,
                          writer_batch_seconds=0.001)
        self.mgr = TierManager(cfg, self.kv, registry=CollectorRegistry())
        assert self.mgr.disk is not None and self.mgr.disk.opts.slots == SM_SLOTS
        self.since_reopen = 0

    @initialize()
    def open(self) -> None:
        self._open()

    def _store(self, key: bytes, row: int):
        self.version += 1
        tag = key + b"#%d" % self.version
        return store_nowait(self.mgr, self.kv, key, row, tag), tag

    def _check_load(self, key: bytes, row: int) -> bool:
        self.kv[row].fill_(0xA5)
        job, comp = load_into(self.mgr, self.kv, key, row)
        if job is None:
            return False
        assert comp is not None and comp.ok, comp
        assert key in self.model, f"{key!r} was invalidated, never stored or gone, yet served"
        assert row_is(self.kv, row, self.model[key]), f"load of {key!r}: wrong bytes"
        return True

    @rule(key=st.sampled_from(SM_KEYS), row=st.integers(0, SM_ROWS - 1))
    def store(self, key: bytes, row: int) -> None:
        self.since_reopen += 1
        job, tag = self._store(key, row)
        if job is None:
            return                             # already stored somewhere (or shed): the model stands
        comps = [c for c in self.mgr.wait([job], timeout=30) if c.job is job]
        assert len(comps) == 1 and comps[0].ok, comps
        self.model[key] = tag

    @rule(ks=st.lists(st.sampled_from(SM_KEYS), min_size=2, max_size=SM_ROWS, unique=True))
    def store_burst(self, ks: list[bytes]) -> None:
        self.since_reopen += 1
        started = [(k, *self._store(k, r)) for r, k in enumerate(ks)]
        jobs = [j for _, j, _ in started if j is not None]
        comps = {c.job: c for c in self.mgr.wait(jobs, timeout=30)}
        for k, j, tag in started:
            if j is not None:
                assert j in comps and comps[j].ok, (k, comps.get(j))
                self.model[k] = tag

    @rule(key=st.sampled_from(SM_KEYS), row=st.integers(0, SM_ROWS - 1), how=st.sampled_from(["invalidate", "cancel"]))
    def store_and_cancel(self, key: bytes, row: int, how: str) -> None:
        """``invalidate``: the store completed and its spill is queued or in the writer's hands when it is
        cancelled; ``cancel``: the store itself is cancelled (no spill)."""
        self.since_reopen += 1
        job, tag = self._store(key, row)
        if how == "invalidate":
            if job is not None:
                self.mgr.wait([job], timeout=30)
            self.mgr.invalidate(key)
            self.model.pop(key, None)
        elif job is not None:
            self.mgr.cancel(job)
            comps = [c for c in self.mgr.wait([job], timeout=30) if c.job is job]
            assert len(comps) == 1 and not comps[0].ok, comps

    @rule(key=st.sampled_from(SM_KEYS))
    def invalidate(self, key: bytes) -> None:
        self.since_reopen += 1
        self.mgr.invalidate(key)
        self.model.pop(key, None)

    @rule(pick=st.integers(0, len(SM_KEYS) - 1), row=st.integers(0, SM_ROWS - 1), stored=st.booleans())
    def load(self, pick: int, row: int, stored: bool) -> None:
        """A key of the model (``stored``) or any key (never-stored and invalidated ones too)."""
        pool = sorted(self.model) if stored and self.model else SM_KEYS
        self._check_load(pool[pick % len(pool)], row)

    @rule()
    def load_all(self) -> None:
        """Every key of the model, coldest disk entries included (promotes through a 2-block host tier)."""
        for i, k in enumerate(sorted(self.model)):
            self._check_load(k, i % SM_ROWS)

    @rule()
    def flush(self) -> None:
        quiesce(self.mgr)
        idx = check_slots(self.mgr)
        assert set(idx) <= set(self.model), f"not in the model but committed: {set(idx) - set(self.model)}"
        assert len(idx) <= SM_DISK
        for k in list(self.model):             # gone from both tiers: never served again
            if k not in idx and self.mgr.host_bytes(k) is None:
                del self.model[k]

    @precondition(lambda self: self.since_reopen >= 4)
    @rule()
    def reopen(self) -> None:
        self.mgr.close()
        refs = raw_slots(self.path)
        assert len(set(refs.values())) == len(refs) and all(0 <= v < SM_SLOTS for v in refs.values()), refs
        assert set(refs) <= set(self.model)
        self._open()
        disk = self.mgr.disk
        rep = disk.recovery
        assert (rep.entries, rep.corrupt, rep.foreign) == (len(refs), 0, 0)
        assert rep.slots_free == SM_SLOTS - len(refs)
        assert disk.slots_in_use == len(refs)
        assert free_slots(disk) == set(range(disk.slots.length)) - set(refs.values())
        for k in list(self.model):             # the host tier is gone: what is not on disk is gone
            if k not in refs:
                del self.model[k]

    @invariant()
    def never_corrupt_and_in_bounds(self) -> None:
        if self.mgr is None:
            return
        disk = self.mgr.disk
        assert disk is not None
        assert disk.slot_file_bytes() <= SM_SLOTS * SB
        assert disk.slots_in_use <= SM_SLOTS
        assert corrupt_total(self.mgr) == 0
        assert metric(self.mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 0

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                self.mgr.close()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


_SM_SETTINGS = sm_settings(10, 30)  # 10 examples per durability mode: 30 in all


class SlotMachineBatch(SlotMachine):
    DURABILITY = "batch"


class SlotMachineSync(SlotMachine):
    DURABILITY = "sync"


class SlotMachineNone(SlotMachine):
    DURABILITY = "none"


SlotMachineBatch.TestCase.settings = SlotMachineSync.TestCase.settings = SlotMachineNone.TestCase.settings = \
    _SM_SETTINGS
test_slot_state_machine_batch = SlotMachineBatch.TestCase
test_slot_state_machine_sync = SlotMachineSync.TestCase
test_slot_state_machine_none = SlotMachineNone.TestCase


# ============================================================================ 11. checksums on the hash thread
class HashHold:
    """Wraps the disk tier's ``_pack_entries`` (run on the hash thread once offloaded): it signals
    ``hashing`` with the keys of its batch, then waits for ``go`` (or raises ``fail``) first."""

    def __init__(self, disk: DiskStore, fail: Optional[BaseException] = None) -> None:
        self.hashing, self.go = threading.Event(), threading.Event()
        self.keys: list[bytes] = []
        self.threads: list[str] = []
        self.finished = threading.Event()   # the hash thread no longer reads the batch's host slots
        orig = disk.writer._pack_entries

        def pack(ops):
            self.keys = [op.key for op in ops]
            self.threads.append(threading.current_thread().name)
            self.hashing.set()
            try:
                assert self.go.wait(30)
                if fail is not None:
                    raise fail
                orig(ops)
            finally:
                self.finished.set()

        disk.writer._pack_entries = pack  # type: ignore[method-assign]


def held_spill(rig, durability: str, fail: Optional[BaseException] = None, before_store=None):
    """A manager whose spill of A (row 0) is held on the hash thread, its checksum not yet computed."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, durability=durability)
    offload_checksums(mgr)
    hold = HashHold(mgr.disk, fail=fail)
    if before_store is not None:
        before_store(mgr.disk)
    store_one(mgr, kv, b"A", 0, flush=False)
    assert hold.hashing.wait(30) and hold.keys == [b"A"]
    return kv, mgr, mgr.disk, hold


def test_offloaded_checksums_run_beside_the_payload_writes_and_gate_publication(rig):
    written = threading.Event()

    def watch_writes(disk):
        orig = disk.slots.pwrite

        def pwrite(slot, src):
            orig(slot, src)
            written.set()
        disk.slots.pwrite = pwrite  # type: ignore[method-assign]

    kv, mgr, disk, hold = held_spill(rig, "batch", before_store=watch_writes)
    assert hold.threads[0].startswith("tiered-kv-hash"), hold.threads
    assert written.wait(30), "the payload write waited for its checksum"
    with open(slot_file(rig.path), "rb") as f:
        assert f.read(ROW) == content(b"A").numpy().tobytes()
    assert index_slots(disk) == {}, "an index record was published before its checksum existed"
    assert mgr.poll() == [] and mgr.lookup([b"A"]) == 1   # still served from the host tier
    hold.go.set()
    quiesce(mgr)
    assert check_slots(mgr) == {b"A": 0}
    for i, k in enumerate([b"B", b"C", b"D", b"E"]):   # 4 host slots: A leaves the host tier
        store_one(mgr, kv, k, 1 + i)
    assert mgr.host_bytes(b"A") is None
    assert load_ok(mgr, kv, b"A", 6)                     # from disk: its record and bytes verify
    assert corrupt_total(mgr) == 0


def test_checksum_failure_on_the_hash_thread_fails_the_batch_and_gives_its_slots_back(rig):
    kv, mgr, disk, hold = held_spill(rig, "batch", fail=MemoryError("hash thread out of memory"))
    hold.go.set()
    drain(mgr)
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 1
    assert metric_sum(mgr, "tiered_kv_errors_total", tier="disk") >= 1
    assert index_slots(disk) == {} and disk.slots_in_use == 0 and free_slots(disk) >= {0}
    assert mgr.lookup([b"A"]) == 1                # the host copy still serves
    disk.writer._pack_entries = Writer._pack_entries.__get__(disk.writer)  # type: ignore[method-assign]
    store_one(mgr, kv, b"B", 1)                   # the writer carries on
    quiesce(mgr)
    assert check_slots(mgr) == {b"B": 0}
    assert mgr.disk_healthy


def test_a_batch_whose_write_fails_answers_only_once_the_hash_thread_let_go_of_its_host_slots(rig):
    """The failure report releases the spill's lease on its host slot (which may then be reused), so the
    writer must not send it while the hash thread still reads that slot."""
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4, durability="batch")
    offload_checksums(mgr)
    disk = mgr.disk
    hold = HashHold(disk)
    failed = threading.Event()
    reported: list[bool] = []                # per failed batch: had the hash thread finished?
    orig_failed = disk.writer._batch_failed

    def pwrite(slot, src):
        failed.set()
        raise OSError(errno.EIO, "injected write error")

    def batch_failed(batch, kind, msg):
        reported.append(hold.finished.is_set())
        orig_failed(batch, kind, msg)

    disk.slots.pwrite = pwrite  # type: ignore[method-assign]
    disk.writer._batch_failed = batch_failed  # type: ignore[method-assign]
    store_one(mgr, kv, b"A", 0, flush=False)
    assert hold.hashing.wait(30) and failed.wait(30)   # the write failed while A's checksum is held
    # the writer now waits for the hash thread: no failure report within a generous window
    assert not drain_for_spill(mgr, 1.0), "a spill was answered while its host slot was still being read"
    assert reported == []
    hold.go.set()
    drain(mgr)
    assert reported == [True]
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="failed") == 1
    assert index_slots(disk) == {} and disk.slots_in_use == 0


def drain_for_spill(mgr: TierManager, seconds: float) -> bool:
    """Poll for up to ``seconds``; True as soon as a spill outcome is counted (a negative check's window)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        mgr.poll()
        if metric_sum(mgr, "tiered_kv_jobs_total", kind="spill") > 0:
            return True
        time.sleep(0.01)
    return False


def test_spill_cancelled_while_its_checksum_runs_is_never_published(rig):
    kv, mgr, disk, hold = held_spill(rig, "sync")   # A has a slot, and its payload is being written
    mgr.invalidate(b"A")
    hold.go.set()
    quiesce(mgr)
    assert index_slots(disk) == {} and disk.slots_in_use == 0
    assert metric(mgr, "tiered_kv_jobs_total", kind="spill", outcome="cancelled") == 1
    assert metric(mgr, "tiered_kv_orphaned_writes_prevented_total") == 1
    check_slots(mgr)
    assert mgr.lookup([b"A"]) == 0


def test_close_stops_the_hash_thread(rig):
    kv = make_kv(8)
    mgr = rig.open(kv, host_slots=4)
    offload_checksums(mgr)
    store_one(mgr, kv, b"A", 0)
    assert any(t.name.startswith("tiered-kv-hash") for t in threading.enumerate())
    rig.close(mgr)
    assert not any(t.name.startswith("tiered-kv-hash") and t.is_alive() for t in threading.enumerate())
