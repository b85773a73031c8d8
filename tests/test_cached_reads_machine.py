"""A state machine over the owner's page-cache reads (tiered_kv/disk/cached.py) and the disk readers.

A real TierManager (4 host slots, 32 disk slots, 4 KiB rows) under each disk I/O mode, driven by:
stores (store + wait, sometimes flush), pushes of the stored keys out of the host tier by stores of
new keys, loads answered by ``wait()`` (where a held promote of a block only on disk is read on the
owner's thread when the page cache holds it), two or four loads in one ``wait()`` (one batch of reads, read
here a chunk per pass: the chunk's size is a rule's too, one block at first; four keys only on disk, then
all loaded), loads
answered by a ``poll()`` loop (the disk readers' path only), invalidations (also of a key whose load
is in flight), drops of the slot file's page cache (``POSIX_FADV_DONTNEED``: the reads then go to the
disk readers), one damaged byte in a disk-only key's slot (found through the owner's own record of it,
``Entry.where``, checked to name a slot holding the key's current bytes), that damage followed at once
by a load (by wait() or a poll() loop), and a close and reopen on the same path (the records then
come from recovery).  Store rows are 0-3, load rows 4-7 (each set to a sentinel before its load).

The model, per key: the version of its bytes last stored (each store writes ``content(key@version)``),
whether it was invalidated (or removed as corrupt) since, whether its block on disk was damaged since.
After every step:

* a load reported ok put exactly the key's current bytes into its row: never another key's, never an
  older version's, never a damaged block's; a key invalidated is never served (lookup 0, no load ok)
  until stored again;
* every job returned is reported exactly once, by the wait()/poll() results, and nothing else is;
* no report was discarded as ``unknown_token``;
* the load of a damaged block fails, the corrupt counter counts it at most once (and, per manager,
  never more than the blocks damaged), and the key is not served afterwards (until stored again).

Sizes: 25 + 14 derandomized examples of up to 40 steps (``sm_settings``), about 35 s for the file on a
2-core VM under load; ``TIERED_KV_SWEEP_EXAMPLES=N`` runs N random examples instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prometheus_client import CollectorRegistry

from tiered_kv import Completion, Job, TierManager
from tiered_kv.disk.format import NO_WHERE, slot_bytes_for, where_slot

from disk_helpers import content, disk_config, make_kv, metric_sum, slot_file
from fakes import sm_settings

pytestmark = pytest.mark.timeout(300)

ROW = 4096
HOST_SLOTS = 4
DISK_SLOTS = 32
KEYS = [b"m%d" % i for i in range(4)]
STORE_ROWS = [0, 1, 2, 3]
LOAD_ROWS = [4, 5, 6, 7]
SENTINEL = torch.full((ROW,), 0xA5, dtype=torch.uint8)   # what a load row holds before each load
TIMEOUT = 30.0


def _bytes(key: bytes, version: int) -> torch.Tensor:
    return content(key + b"@%d" % version, ROW)


class CachedReadsMachine(RuleBasedStateMachine):
    io = "thread"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tkv-cached-sm-"))
        self.path = self.dir / "disk"
        self.kv = make_kv(rows=8, row_bytes=ROW)
        self.mgr: Optional[TierManager] = None
        self._open()
        self.version: dict[bytes, int] = {}      # key -> version of its bytes last stored ok
        self.gone: set[bytes] = set()            # invalidated (or removed as corrupt) since last stored
        self.damaged: set[bytes] = set()         # its block on disk damaged since last stored
        self.jobs: list[Job] = []                # every job returned to us, in this manager's life
        self.reports: dict[int, int] = {}        # id(job) -> times reported
        self.next_version = 0
        self.fillers = 0
        self.store_row = 0

    # ------------------------------------------------------------------ helpers
    def _open(self) -> None:
        cfg = disk_config(self.path, host_slots=HOST_SLOTS, disk_slots=DISK_SLOTS, row_bytes=ROW, disk_io=self.io,
                          writer_batch_seconds=0.0)
        self.mgr = TierManager(cfg, self.kv, registry=CollectorRegistry())
        self.mgr.disk.cached.chunk_ops = 1     # a batch's reads a block per pass (the chunk rule changes it)
        self.corrupt_allowance = 0               # damage events this manager may count as corrupt blocks
        self.jobs = []
        self.reports = {}

    def _seen(self, comps: list[Completion]) -> list[Completion]:
        mine = {id(j) for j in self.jobs}
        for c in comps:
            assert id(c.job) in mine, f"a job never returned to us was reported: {c}"
            self.reports[id(c.job)] = self.reports.get(id(c.job), 0) + 1
            assert c.ok is (c.job.state.name == "DONE"), c
        return comps

    def _job(self, job: Optional[Job]) -> Optional[Job]:
        if job is not None:
            self.jobs.append(job)
        return job

    def _wait(self, jobs: list[Job]) -> list[Completion]:
        got = self._seen(self.mgr.wait(jobs, timeout=TIMEOUT))
        assert all(j.done for j in jobs), f"not reported within {TIMEOUT} s: {jobs} {self.mgr.debug_sizes()}"
        return got

    def _flush(self) -> None:
        assert self.mgr.flush(timeout=TIMEOUT) is True
        self._seen(self.mgr.poll())      # completions applied by flush() come with the next poll()

    def _corrupt(self) -> float:
        return metric_sum(self.mgr, "tiered_kv_corrupt_blocks_total")

    def _store(self, key: bytes) -> Optional[bool]:
        """store + wait: True/False as reported, None when not started (present, or shed)."""
        row = STORE_ROWS[self.store_row % len(STORE_ROWS)]
        self.store_row += 1
        v = self.next_version
        self.next_version += 1
        self.kv[row].copy_(_bytes(key, v))
        job = self._job(self.mgr.store(key, row))
        if job is None:
            return None
        self._wait([job])
        if job.state.name == "DONE":
            self.version[key] = v
            self.gone.discard(key)
            self.damaged.discard(key)
            return True
        return False

    def _check_load(self, key: bytes, job: Job, row: int, corrupt_before: float, allow: int = 1) -> None:
        ok = job.state.name == "DONE"
        if ok:
            assert key not in self.gone, f"{key!r} was served after it was invalidated (or removed as corrupt)"
            assert key not in self.damaged, f"{key!r} was served from its damaged block"
            assert key in self.version, f"{key!r} was served but never stored"
            got = self.kv[row]
            if not torch.equal(got, _bytes(key, self.version[key])):
                others = [(k, v) for k in KEYS for v in range(self.next_version) if torch.equal(got, _bytes(k, v))]
                raise AssertionError(f"load of {key!r} v{self.version[key]} reported ok with WRONG BYTES "
                                     f"(they are {others or 'no version of any key'})")
        elif key in self.damaged and job.state.name == "FAILED":
            # the damaged block's read: counted at most once, removed, never served afterwards
            assert self._corrupt() - corrupt_before <= allow, "a damaged block counted more than once"
            assert self.mgr.lookup([key]) == 0, f"{key!r} still served after its damaged block failed to load"
            self.damaged.discard(key)
            self.gone.add(key)

    def _disk_only(self, key: bytes) -> Optional[int]:
        """The slot file offset of ``key``'s block when it is only on disk (from the owner's record)."""
        if self.mgr.host_bytes(key) is not None:
            return None
        e = self.mgr._core.dindex.ready(key)
        if e is None or e.where == NO_WHERE:
            return None
        return where_slot(e.where) * slot_bytes_for(ROW)

    # ------------------------------------------------------------------ rules
    @rule(key=st.sampled_from(KEYS), flush=st.booleans())
    def store(self, key: bytes, flush: bool) -> None:
        self._store(key)
        if flush:
            self._flush()

    @rule(n=st.integers(1, HOST_SLOTS))
    def push_out(self, n: int) -> None:
        """Store ``n`` new keys (each flushed): the stored keys leave the host tier."""
        self._push(n)

    @rule(key=st.sampled_from(KEYS))
    def store_to_disk_only(self, key: bytes) -> None:
        """Store (flushed), then push it out of the host tier: a load of it reads from disk."""
        self._store(key)
        self._flush()
        self._push(HOST_SLOTS)

    def _push(self, n: int) -> None:
        for _ in range(n):
            self.fillers += 1
            self._store(b"fill%d" % self.fillers)
            self._flush()

    def _start_load(self, key: bytes, row: int):  # type: ignore[no-untyped-def]
        """A load of ``key`` into ``row`` (set to the sentinel first), and the corrupt count before it."""
        self.kv[row].copy_(SENTINEL)
        before = self._corrupt()
        return self._job(self.mgr.load(key, row)), before

    @rule(key=st.sampled_from(KEYS), row=st.sampled_from(LOAD_ROWS))
    def load_wait(self, key: bytes, row: int) -> None:
        """The main path: a blocked wait() may read the block from the page cache itself."""
        job, before = self._start_load(key, row)
        if job is None:
            return
        self._wait([job])
        self._check_load(key, job, row, before)

    @rule(a=st.sampled_from(KEYS), b=st.sampled_from(KEYS))
    def load_two_wait(self, a: bytes, b: bytes) -> None:
        """Two loads answered by one wait(): one batch of held reads (after a cold block, the rest go on)."""
        if a == b:
            return
        self._load_batch([(a, LOAD_ROWS[0]), (b, LOAD_ROWS[1])])

    def _load_batch(self, pairs: list[tuple[bytes, int]]) -> None:
        """A load of each (key, row), then one wait() for them all: one batch of held reads."""
        before = self._corrupt()
        started = []
        for key, row in pairs:
            self.kv[row].copy_(SENTINEL)
            job = self._job(self.mgr.load(key, row))
            if job is not None:
                started.append((key, job, row))
        self._wait([j for _, j, _ in started])
        allow = sum(1 for key, _, _ in started if key in self.damaged)   # each damaged block at most once
        for key, job, row in started:
            self._check_load(key, job, row, before, allow)

    @rule()
    def load_all_wait(self) -> None:
        """Every key loaded, one wait(): a batch of up to four held reads, some read here chunk by chunk."""
        self._load_batch(list(zip(KEYS, LOAD_ROWS)))

    @rule(restore=st.booleans())
    def load_all_from_disk(self, restore: bool) -> None:
        """Every key only on disk (stored first where it has no current bytes, or always: ``restore``), then
        all loaded by one wait(): the batch the chunks split, its blocks in the page cache unless dropped."""
        for key in KEYS:
            if restore or key not in self.version or key in self.gone:
                self._store(key)
        self._flush()
        self._push(HOST_SLOTS)
        self.load_all_wait()

    @rule(n=st.sampled_from([1, 2, 3, 1 << 20]))
    def chunk(self, n: int) -> None:
        """The owner's page-cache reads per pass from here on (1 << 20: a batch in one pass)."""
        self.mgr.disk.cached.chunk_ops = n

    @rule(key=st.sampled_from(KEYS), row=st.sampled_from(LOAD_ROWS))
    def load_poll(self, key: bytes, row: int) -> None:
        """The readers' path: poll() never reads on the engine's thread."""
        job, before = self._start_load(key, row)
        if job is None:
            return
        deadline = time.monotonic() + TIMEOUT
        while not job.done:
            self._seen(self.mgr.poll())
            assert time.monotonic() < deadline, f"load of {key!r} not reported by poll() in {TIMEOUT} s"
            time.sleep(0.0005)
        self._check_load(key, job, row, before)

    @rule(key=st.sampled_from(KEYS))
    def invalidate(self, key: bytes) -> None:
        self.mgr.invalidate(key)
        self.gone.add(key)
        self.damaged.discard(key)

    @rule(key=st.sampled_from(KEYS), row=st.sampled_from(LOAD_ROWS))
    def load_then_invalidate(self, key: bytes, row: int) -> None:
        """A load (its read held if the key is only on disk) and the key invalidated before any wait."""
        self.kv[row].copy_(SENTINEL)
        job = self._job(self.mgr.load(key, row))
        self.mgr.invalidate(key)
        self.gone.add(key)
        self.damaged.discard(key)
        if job is not None:
            self._wait([job])
            assert job.state.name != "DONE", f"load of {key!r} reported ok after its key was invalidated"

    @rule()
    def drop_page_cache(self) -> None:
        """After a flush the slot file's pages are clean: DONTNEED drops them (no effect on tmpfs)."""
        self._flush()
        f = slot_file(self.path)
        if not f.exists():
            return
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    @rule(key=st.sampled_from(KEYS), pos=st.integers(0, ROW - 1))
    def damage(self, key: bytes, pos: int) -> None:
        """Flip one byte of a disk-only key's block, found through the owner's record of it."""
        if key in self.gone or key in self.damaged or key not in self.version:
            return   # (one damaged byte per stored block: the check below reads the block whole)
        off = self._disk_only(key)
        if off is None:
            return
        fd = os.open(slot_file(self.path), os.O_RDWR)
        try:
            block = os.pread(fd, ROW, off)
            # the owner's record names the slot holding this key's current bytes
            assert block == bytes(_bytes(key, self.version[key]).numpy()), \
                f"the owner's record of {key!r} names a slot that does not hold its bytes"
            os.pwrite(fd, bytes([block[pos] ^ 0x5A]), off + pos)
        finally:
            os.close(fd)
        self.corrupt_allowance += 1
        self.damaged.add(key)

    @rule(key=st.sampled_from(KEYS), pos=st.integers(0, ROW - 1), row=st.sampled_from(LOAD_ROWS), poll=st.booleans())
    def damage_then_load(self, key: bytes, pos: int, row: int, poll: bool) -> None:
        """The corrupt path every time: the key only on disk (stored and pushed out if it is not),
        one byte of its block damaged, then loaded by wait() (the page-cache read's check refuses it)
        or by a poll() loop (the readers alone)."""
        if self._disk_only(key) is None or key in self.gone or key not in self.version:
            self.store_to_disk_only(key)
        self.damage(key, pos)
        if poll:
            self.load_poll(key, row)
        else:
            self.load_wait(key, row)

    @rule()
    def reopen(self) -> None:
        """Close and open again on the same path: the owner's records come from recovery."""
        self._flush()
        self._close_checked()
        self._open()
        self.corrupt_allowance = len(self.damaged)   # recovery, or a load, may count each once

    # ------------------------------------------------------------------ invariants
    @invariant()
    def every_job_reported_once(self) -> None:
        for j in self.jobs:
            assert j.done, f"job not reported at the end of a step: {j}"
            n = self.reports.get(id(j), 0)
            assert n == 1, f"job reported {n} times: {j}"

    @invariant()
    def no_unknown_token_reports(self) -> None:
        assert metric_sum(self.mgr, "tiered_kv_stale_callbacks_total", reason="unknown_token") == 0

    @invariant()
    def corrupt_blocks_counted_at_most_once(self) -> None:
        assert self._corrupt() <= self.corrupt_allowance, (self._corrupt(), self.corrupt_allowance)

    @invariant()
    def invalidated_keys_are_never_served(self) -> None:
        for k in self.gone:
            assert self.mgr.lookup([k]) == 0, f"{k!r} is served after it was invalidated (or removed as corrupt)"

    # ------------------------------------------------------------------ teardown
    def _close_checked(self) -> None:
        mgr = self.mgr
        try:
            self.no_unknown_token_reports()
            self.every_job_reported_once()
        finally:
            mgr.close()

    def teardown(self) -> None:
        try:
            if self.mgr is not None:
                self._close_checked()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


class ProcessCachedReadsMachine(CachedReadsMachine):
    io = "process"


CachedReadsMachine.TestCase.settings = sm_settings(25, 40)
ProcessCachedReadsMachine.TestCase.settings = sm_settings(14, 40)
test_cached_reads_machine_thread = CachedReadsMachine.TestCase
test_cached_reads_machine_process = ProcessCachedReadsMachine.TestCase
