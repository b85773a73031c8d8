"""Second adversarial review of the core (TierCore, TierIndex, DiskTier) and its front end (TierManager).

The disk store is replaced by :class:`FakeDiskStore` (monkeypatched into ``DiskTier.open``): an
in-memory store with the real store's owner-side contract -- spills answered as one report per job
under its first token (``Report.failed`` naming failed parts), tombs that prevent a queued write and
remove a committed one token-matched, token-matched deletes, held reads started by ``start_reads``
and answered "superseded" when the committed writer token is not the one expected, flushes answered
after the spills queued before them (not ok when a write failed meanwhile) -- whose every answer is
given only when the test says so; :class:`FakeRemoteStore` does the same for the remote tier.  With
:class:`~fakes.FakeMover` every interleaving of copies, spills, reads, fetches, puts, cancels, frees,
invalidations, polls, flushes, I/O-process deaths and restarts, and close() is deterministic.

Block bytes name a (key, generation): every store writes a fresh generation, so a served block says
which store wrote it.  What it proved wrong, each pinned by a test that failed before its fix: a spill
job of N blocks counted N against ``max_inflight_jobs``; ``wait()`` for quiescence returned while a
remote fetch still wrote a host slot; ``flush()`` of both front ends was True when a remote write's
fault was first applied by its own first pass.  The plain tests and :class:`CoreMachine` guard
behaviours that hold and would fail if broken.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import CollectorRegistry

from fakes import FakeMover, FakeMoverFactory, sm_settings
from tiered_kv import Job, JobKind, JobState, TieredKVConfig, TierManager
from tiered_kv.core import disk_tier as disk_tier_mod
from tiered_kv.disk import NOT_READ, SPILL_PREVENTED, FlushDone
from tiered_kv.disk.records import READ_FAILED, StoredEntry
from tiered_kv.metrics import sample_total
from tiered_kv.movers import Report

ROW = 64
NS = "review-core2|u8|tp0"


# ============================================================================ content: (key, generation) <-> bytes
_decode: dict[bytes, tuple[bytes, int]] = {}


def blob(key: bytes, gen: int) -> bytes:
    b = hashlib.shake_128(b"%s/%d" % (key, gen)).digest(ROW)
    _decode[b] = (key, gen)
    return b


def decode(b: bytes) -> Optional[tuple[bytes, int]]:
    return _decode.get(bytes(b))


def fill(kv: torch.Tensor, row: int, key: bytes, gen: int) -> None:
    kv[row].copy_(torch.frombuffer(bytearray(blob(key, gen)), dtype=torch.uint8))


def row_holds(kv: torch.Tensor, row: int) -> Optional[tuple[bytes, int]]:
    return decode(kv[row].numpy().tobytes())


# ============================================================================ the fake disk store
@dataclass
class _Recovery:
    seconds: float = 0.0
    purged: int = 0
    corrupt: int = 0
    foreign: int = 0


@dataclass
class SpillOp:
    tokens: list[uuid.UUID]
    keys: list[bytes]
    srcs: list[memoryview]
    seq: int


@dataclass
class ReadOp:
    token: uuid.UUID
    key: bytes
    expect: uuid.UUID
    dst: memoryview


@dataclass
class FakeDiskStore:
    """The owner-side contract of ``DiskStore``, answered on command (see the module docstring)."""

    opts: Any
    completions: Any
    on_error: Any = None
    on_prevented: Any = None
    on_corrupt: Any = None
    backlogged: bool = False
    committed: dict[bytes, tuple[uuid.UUID, bytes]] = field(default_factory=dict)
    cancelled: set[uuid.UUID] = field(default_factory=set)
    spills: list[SpillOp] = field(default_factory=list)
    held: list[ReadOp] = field(default_factory=list)
    reads: list[ReadOp] = field(default_factory=list)
    flushes: list[tuple[uuid.UUID, int, bool]] = field(default_factory=list)   # token, seq of last spill before, ok
    seq: int = 0
    dead: bool = False
    down: bool = False
    died: bool = False      # ended without closing (ProcessDiskStore.died): a close reconciles with one more start
    pid: int = 0
    last_flush_seq: int = 0
    promotes: int = 0
    spills_accepted: int = 0
    alive: bool = True
    closed: bool = False
    log: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recovery = _Recovery()
        self.entries: list[Any] = []

    # -- the owner's calls
    def submit_spills(self, tokens: list[uuid.UUID], keys: list[bytes], slots: list[int], view: Any) -> bool:
        if not self.alive or self.queue_depth + len(tokens) > self.opts.queue_blocks:
            return False
        self.seq += 1
        self.spills_accepted += 1
        self.spills.append(SpillOp(list(tokens), list(keys), [view(s) for s in slots], self.seq))
        self.log.append(("spill", tuple(keys), tuple(tokens)))
        return True

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        if self.dead:
            self.log.append(("lost tomb", key, token))
            return
        self.cancelled.add(token)
        self.log.append(("tomb", key, token))
        got = self.committed.get(key)
        if got is not None and got[0] == token:
            del self.committed[key]

    def submit_delete(self, token: uuid.UUID, key: bytes) -> None:
        if self.dead:
            self.log.append(("lost delete", key, token))
            return
        self.log.append(("delete", key, token))
        got = self.committed.get(key)
        if got is not None and got[0] == token:
            del self.committed[key]

    def submit_touch(self, key: bytes) -> None:
        pass

    def submit_flush(self, token: uuid.UUID) -> None:
        if self.dead:
            self.completions.put(FlushDone(token, False, "disk I/O process died"))
            return
        self.last_flush_seq = self.seq
        self.flushes.append((token, self.seq, True))
        self._answer_flushes()

    def queue_promote(self, token: uuid.UUID, key: bytes, expect: uuid.UUID, dst: memoryview, where: int = 0) -> None:
        self.promotes += 1
        if self.dead:
            self.completions.put(Report(token, JobKind.PROMOTE, False, f"{NOT_READ} (disk I/O process died)"))
            return
        self.held.append(ReadOp(token, key, expect, dst))

    def start_reads(self, lone_here: bool = False, cached_here: bool = False, until: Optional[float] = None) -> None:
        self.reads += self.held
        self.held = []

    def kick(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    # -- what the core reads
    @property
    def queue_depth(self) -> int:
        return sum(len(s.tokens) for s in self.spills)

    def spill_room(self) -> int:
        return max(0, self.opts.queue_blocks - self.queue_depth) if self.alive else 0

    def writer_alive(self) -> bool:
        return self.alive

    healthy = True
    tombstones = 0
    map_size = 0

    def die(self, committed_parts: frozenset[int] = frozenset()) -> None:
        """The disk I/O process dies: the spill parts numbered in ``committed_parts`` (counted over every
        queued spill) were committed just before, every op in flight is answered as failed, and every op
        from now on is lost (``ProcessDiskStore._gone``)."""
        n = 0
        for op in self.spills:
            for t, k, src in zip(op.tokens, op.keys, op.srcs):
                if n in committed_parts and t not in self.cancelled:
                    self.committed[k] = (t, bytes(src))
                n += 1
        self.alive = False
        for op in self.spills:
            self.completions.put(Report(op.tokens[0], JobKind.SPILL, False, "disk I/O process died"))
        for op in self.held + self.reads:
            self.completions.put(Report(op.token, JobKind.PROMOTE, False, f"{NOT_READ} (disk I/O process died)"))
        for t, _, _ in self.flushes:
            self.completions.put(FlushDone(t, False, "disk I/O process died"))
        self.spills, self.held, self.reads, self.flushes = [], [], [], []
        self.dead = self.down = self.died = True

    def reopened(self) -> "FakeDiskStore":
        """A new process over the same disk: what was committed survives (recovery's entries)."""
        new = FakeDiskStore(self.opts, self.completions)
        new.committed = dict(self.committed)
        new.cancelled = self.cancelled
        new.entries = [StoredEntry(k, t, i) for i, (k, (t, _)) in enumerate(self.committed.items())]
        new.promotes = self.promotes
        new.log = self.log
        new.pid = self.pid + 1
        return new

    # -- the test's answers
    def answer_spill(self, i: int, faults: frozenset[int] = frozenset()) -> None:
        op = self.spills.pop(i)
        failed: dict[int, str] = {}
        for part, (t, k, src) in enumerate(zip(op.tokens, op.keys, op.srcs)):
            if t in self.cancelled:
                failed[part] = SPILL_PREVENTED
            elif part in faults:
                failed[part] = "io_error: injected"
            else:
                self.committed[k] = (t, bytes(src))
        if any(e != SPILL_PREVENTED for e in failed.values()):
            self.flushes = [(t, s, False) for t, s, _ in self.flushes]
        if len(op.tokens) == 1:
            err = failed.get(0)
            self.completions.put(Report(op.tokens[0], JobKind.SPILL, err is None, err, 0 if err else ROW, 1e-4))
        else:
            first = next(iter(failed.values())) if failed else None
            self.completions.put(Report(op.tokens[0], JobKind.SPILL, not failed, first,
                                        ROW * (len(op.tokens) - len(failed)), 1e-4, failed or None))
        self._answer_flushes()

    def answer_read(self, i: int, fault: bool = False) -> None:
        op = self.reads.pop(i)
        got = self.committed.get(op.key)
        if fault:
            r = Report(op.token, JobKind.PROMOTE, False, f"{READ_FAILED} (injected)")
            self.submit_delete(op.expect, op.key)
        elif got is None:
            r = Report(op.token, JobKind.PROMOTE, False, "miss: absent")
        elif got[0] != op.expect:
            r = Report(op.token, JobKind.PROMOTE, False, "miss: superseded on disk")
        else:
            op.dst[:] = got[1]
            r = Report(op.token, JobKind.PROMOTE, True, None, ROW, 1e-4)
        self.completions.put(r)

    def _answer_flushes(self) -> None:
        first = min((s.seq for s in self.spills), default=self.seq + 1)
        keep = []
        for t, before, ok in self.flushes:
            if before < first:
                self.completions.put(FlushDone(t, ok, None if ok else "injected"))
            else:
                keep.append((t, before, ok))
        self.flushes = keep


@pytest.fixture
def fake_disk(monkeypatch: pytest.MonkeyPatch) -> list[FakeDiskStore]:
    made: list[FakeDiskStore] = []

    def make(opts: Any, completions: Any, **kw: Any) -> FakeDiskStore:
        s = FakeDiskStore(opts, completions, **kw)
        made.append(s)
        return s

    monkeypatch.setattr(disk_tier_mod, "DiskStore", make)
    return made


def open_manager(tmp_path: Any, *, rows: int = 8, host_slots: int = 4, disk_blocks: int = 8, queue: int = 16,
                 write_mode: str = "through", ahead: int = 0, **kw: Any) -> tuple[TierManager, FakeMover, torch.Tensor]:
    kv = torch.zeros((rows, ROW), dtype=torch.uint8)
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=host_slots * ROW, disk_path=str(tmp_path / "disk"),
                         disk_capacity_bytes=disk_blocks * ROW, disk_io="thread", write_mode=write_mode,
                         host_evict_ahead_blocks=ahead, writer_queue_blocks=queue, **kw)
    f = FakeMoverFactory()
    mgr = TierManager(cfg, kv, registry=CollectorRegistry(), mover_factory=f)
    assert f.mover is not None
    return mgr, f.mover, kv


# ============================================================================ the state machine
KEYS = [b"k%d" % i for i in range(7)]
ROWS = 10


class HelpingMover(FakeMover):
    """A fake mover whose ``help_one`` (called by the manager's blocking calls) answers one outstanding
    copy, else one disk read, else one spill of ``disk`` (so that ``close()`` finishes deterministically)."""

    core: Any = None

    @property
    def disk(self) -> Optional["FakeDiskStore"]:
        return None if self.core is None or self.core.disk is None else self.core.disk.store

    def close(self) -> None:
        """As the real movers: every transfer still held is answered (copied, or skipped when cancelled)."""
        while self.outstanding:
            self.complete(self.outstanding[0], honor_cancel=True)
        self.closed = True

    def submit(self, t: Any) -> None:
        assert not self.closed, f"a transfer submitted after the mover closed: {t}"
        super().submit(t)

    def help_one(self) -> bool:
        if self.outstanding:
            self.complete(self.outstanding[0])
            return True
        d = self.disk
        if d is not None and d.reads:
            d.answer_read(0)
            return True
        if d is not None and d.spills:
            d.answer_spill(0)
            return True
        r = None if self.core is None or self.core.remote is None else self.core.remote.store
        if r is not None and r.reads:
            r.answer_read(0)
            return True
        if r is not None and r.puts:
            r.answer_put(0)
            return True
        return False


class CoreMachine(RuleBasedStateMachine):
    """Random interleavings over the manager, the fake mover, the fake disk store (its process dying and
    restarted) and the fake remote store, under every policy, admission filter and write mode, checked
    against what the spec promises -- no model of *which* block is where, only what may never happen:

    * an ok load's rows, a READY host slot, a committed disk entry and a server value hold their key's
      bytes, of a generation stored after the key's last invalidate() and never one whose store (or
      part of one) was cancelled, freed or invalidated before it was published;
    * lookup()/load() never find a key invalidated and not stored since; nor does the disk index;
    * flush() is True only with no covered spill queued and no spill fault reported before it unapplied;
    * the core's per-kind in-flight counts equal its live job records;
    * at the end (all answered, or close() with everything in flight): every job reported exactly once,
      no host or disk slot held outside an entry, the disk holds exactly what its index holds (so no
      invalidated key comes back on reopen), every spill part and promote counted once in jobs_total,
      the store/load outcome counters equal what poll() reported, the front end's tables empty."""

    host_slots = 3
    disk_blocks = 5

    def __init__(self) -> None:
        super().__init__()
        self.mgr: Any = None

    @initialize(write_mode=st.sampled_from(["through", "back"]), ahead=st.integers(0, 1),
                host_policy=st.sampled_from(["lru", "lru", "s3fifo", "arc", "prefix"]),
                disk_policy=st.sampled_from(["lru", "lru", "s3fifo", "arc", "prefix"]),
                host_admission=st.sampled_from(["all", "all", "all", "second_hit", "tinylfu"]),
                disk_admission=st.sampled_from(["all", "all", "all", "second_hit", "tinylfu"]),
                inflight=st.sampled_from([4, 10, 64]), close_busy=st.booleans(), restartable=st.booleans(),
                remote=st.booleans(), host_slots=st.sampled_from([2, 3, 3, 5]), disk_blocks=st.sampled_from([2, 5, 5, 8]),
                queue=st.sampled_from([1, 3, 3, 8]))
    def open(self, write_mode: str, ahead: int, host_policy: str, disk_policy: str, host_admission: str,
             disk_admission: str, inflight: int, close_busy: bool, restartable: bool, remote: bool,
             host_slots: int, disk_blocks: int, queue: int) -> None:
        self.host_slots, self.disk_blocks = host_slots, disk_blocks
        import tempfile
        from pathlib import Path
        self._tmp = tempfile.TemporaryDirectory(prefix="review-core2-")
        self.mp = pytest.MonkeyPatch()
        self.made: list[FakeDiskStore] = []

        def make(opts: Any, completions: Any, **kw: Any) -> FakeDiskStore:
            s = FakeDiskStore(opts, completions, **kw)
            self.made.append(s)
            return s

        self.mp.setattr(disk_tier_mod, "DiskStore", make)
        self.mp.setattr(disk_tier_mod, "RESTART_BACKOFF_MIN_S", 1e9)   # a second death stays down until close()
        remote_kw: dict[str, Any] = {}
        self.remotes: list[FakeRemoteStore] = []
        if remote:
            import tiered_kv.remote.store as remote_store_mod

            def make_remote(opts: Any, completions: Any, **kw: Any) -> FakeRemoteStore:
                self.remotes.append(FakeRemoteStore(opts, completions))
                return self.remotes[-1]

            self.mp.setattr(remote_store_mod, "RemoteStore", make_remote)
            remote_kw = dict(remote_url="redis://127.0.0.1:1/0", remote_miss_ttl_seconds=0.0)
        kv = torch.zeros((ROWS, ROW), dtype=torch.uint8)
        cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=self.host_slots * ROW,
                             disk_path=str(Path(self._tmp.name) / "disk"), disk_capacity_bytes=self.disk_blocks * ROW,
                             disk_io="thread", write_mode=write_mode, host_evict_ahead_blocks=ahead,
                             writer_queue_blocks=queue, max_inflight_jobs=inflight, host_policy=host_policy,
                             disk_policy=disk_policy, host_admission=host_admission, disk_admission=disk_admission,
                             **remote_kw)
        movers: list[HelpingMover] = []

        def mover(dev: torch.Tensor, host: torch.Tensor, q: Any) -> HelpingMover:
            movers.append(HelpingMover(dev, host, q))
            return movers[0]

        self.mgr = TierManager(cfg, kv, registry=CollectorRegistry(), mover_factory=mover)
        self.mover, self.kv = movers[0], kv
        self.mover.core = core = self.mgr._core
        if restartable:   # as disk_io="process": a store that dies is restarted (DiskTier.restart)
            tier = core.disk
            tier._reopen = lambda: tier.store.reopened()
            real_start = tier._start

            def start_now() -> bool:
                # the start runs on a starter thread, adopted by the pass that finds it ended: waited for here,
                # so the pass that began it adopts it (which pass did depended on the thread's timing, and
                # hypothesis found the machine's runs of the same choices diverging)
                ok = real_start()
                if ok:
                    tier._starting[0].join(30)
                return ok

            tier._start = start_now
        self.restartable = restartable
        self.close_busy = close_busy
        self.gen = 0
        self.threshold = {k: 0 for k in KEYS}      # gens <= this were invalidated
        self.forbidden: set[tuple[bytes, int]] = set()
        self.parts: list[tuple[Job, bytes, int, int]] = []   # store parts: job, key, row, gen
        self.issued: list[Job] = []
        self.reported: dict[int, int] = {}
        self.loads: dict[int, tuple[list[bytes], list[int]]] = {}
        self.invalid = {k: False for k in KEYS}    # invalidated, no store of it started since
        self.fault_unapplied: set[uuid.UUID] = set()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.inflight = inflight
        self.sheds: list[tuple[str, str, int]] = []   # (kind, reason, distinct live jobs then)
        real_shed = core.shed

        def shed(kind: JobKind, why: str, n: int = 1) -> None:
            self.sheds.append((kind.value, why, len({id(j) for j in core.jobs.values()})))
            return real_shed(kind, why, n)

        core.shed = shed   # type: ignore[method-assign]

    @property
    def dstore(self) -> FakeDiskStore:
        return self.mgr._core.disk.store

    # -- helpers
    def allowed(self, k: bytes, g: int) -> bool:
        return g > self.threshold[k] and (k, g) not in self.forbidden

    def _forbid_row(self, r: int) -> None:
        for job, k, row, g in self.parts:
            if row == r and job.state is JobState.PENDING:
                self.forbidden.add((k, g))

    def _idle(self, r: int, n: int = 1) -> list[int]:
        """``n`` rows no pending store reads and no load writes, starting the search at ``r``."""
        busy = {row for job, _, row, _ in self.parts if job.state is JobState.PENDING}
        busy |= set(self.mgr._row_load)
        out = [x % ROWS for x in range(r, r + ROWS) if x % ROWS not in busy]
        return out[:n] if len(out) >= n else [(r + i) % ROWS for i in range(n)]

    def _live_jobs(self) -> int:
        return len({id(j) for j in self.mgr._core.jobs.values()})

    def _bounded(self, live: int, job: Optional[Job]) -> None:
        """A store or load started with ``live`` jobs in flight: only below ``max_inflight_jobs``."""
        assert job is None or live < self.inflight, f"{job} started with {live} jobs in flight of {self.inflight}"

    def _free(self, r: int) -> bool:
        self._forbid_row(r)
        return self.mgr.free_block(r)

    def _check(self, comps: list[Any]) -> None:
        for c in comps:
            job = c.job
            self.outcomes[(job.kind.value, "ok" if c.ok else "cancelled" if job.state.value == "cancelled"
                           else "failed")] += 1
            n = self.reported.get(id(job), 0)
            assert n == 0, f"{job} reported twice"
            self.reported[id(job)] = 1
            if c.ok and job.kind is JobKind.LOAD:
                keys, rows = self.loads[id(job)]
                for k, r in zip(keys, rows):
                    got = row_holds(self.kv, r)
                    assert got is not None and got[0] == k, f"load of {k!r} into row {r} landed {got}"
                    assert self.allowed(k, got[1]), f"load of {k!r} served generation {got[1]}, invalidated or cancelled"
        self.fault_unapplied = set()

    # -- engine calls
    @rule(k=st.sampled_from(KEYS), r=st.integers(0, ROWS - 1))
    def store(self, k: bytes, r: int) -> None:
        r = self._idle(r)[0]
        if not self._free(r):
            return
        self.gen += 1
        fill(self.kv, r, k, self.gen)
        live = self._live_jobs()
        job = self.mgr.store(k, r)
        self._bounded(live, job)
        if job is not None:
            self.parts.append((job, k, r, self.gen))
            self.issued.append(job)
            self.invalid[k] = False

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=2, max_size=3, unique=True),
          rs=st.lists(st.integers(0, ROWS - 1), min_size=3, max_size=3, unique=True))
    def store_many(self, ks: list[bytes], rs: list[int]) -> None:
        rs = self._idle(rs[0], len(ks))
        if not all([self._free(r) for r in rs]):
            return
        gens = {}
        for k, r in zip(ks, rs):
            self.gen += 1
            gens[k] = self.gen
            fill(self.kv, r, k, self.gen)
        live = self._live_jobs()
        job = self.mgr.store_many(ks, rs)
        self._bounded(live, job)
        if job is not None:
            for k, r in zip(job.keys, job.blocks):
                self.parts.append((job, k, r, gens[k]))
                self.invalid[k] = False
            self.issued.append(job)

    @rule(k=st.sampled_from(KEYS), r=st.integers(0, ROWS - 1))
    def load(self, k: bytes, r: int) -> None:
        r = self._idle(r)[0]
        if not self._free(r):
            return
        live = self._live_jobs()
        job = self.mgr.load(k, r)
        self._bounded(live, job)
        if job is not None:
            assert not self.invalid[k], f"load of invalidated {k!r} started"
            self.loads[id(job)] = ([k], [r])
            self.issued.append(job)

    def _disk_only(self) -> list[bytes]:
        core = self.mgr._core
        return [k for k in KEYS if core.dindex.ready(k) is not None and k not in core.index]

    @precondition(lambda self: self._disk_only())
    @rule(i=st.integers(0, 100), r=st.integers(0, ROWS - 1), two=st.booleans())
    def load_from_disk(self, i: int, r: int, two: bool) -> None:
        cands = self._disk_only()
        k = cands[i % len(cands)]
        if two and len(KEYS) > 1:
            other = KEYS[(KEYS.index(k) + 1 + i) % len(KEYS)]
            if other != k:
                self.load_many([k, other], [r, r + 1])
                return
        self.load(k, r)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=2, max_size=3, unique=True),
          rs=st.lists(st.integers(0, ROWS - 1), min_size=3, max_size=3, unique=True))
    def load_many(self, ks: list[bytes], rs: list[int]) -> None:
        rs = self._idle(rs[0], len(ks))
        if not all([self._free(r) for r in rs]):
            return
        live = self._live_jobs()
        job = self.mgr.load_many(ks, rs)
        self._bounded(live, job)
        if job is not None:
            assert not any(self.invalid[k] for k in ks)
            self.loads[id(job)] = (list(ks), list(rs))
            self.issued.append(job)

    @rule(r=st.integers(0, ROWS - 1))
    def free(self, r: int) -> None:
        self._free(r)

    @precondition(lambda self: self.issued)
    @rule(i=st.integers(0, 100))
    def cancel(self, i: int) -> None:
        job = self.issued[i % len(self.issued)]
        if job.kind is JobKind.STORE and job.state is JobState.PENDING:
            for j, k, _, g in self.parts:
                if j is job:
                    self.forbidden.add((k, g))
        self.mgr.cancel(job)

    @rule(k=st.sampled_from(KEYS))
    def invalidate(self, k: bytes) -> None:
        self.threshold[k] = self.gen
        self.invalid[k] = True
        self.mgr.invalidate(k)

    @rule(ks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True))
    def lookup(self, ks: list[bytes]) -> None:
        n = self.mgr.lookup(ks)
        for k in ks[:n]:
            assert not self.invalid[k], f"lookup found invalidated {k!r}"

    @rule()
    def poll(self) -> None:
        self._check(self.mgr.poll())

    @rule()
    def flush(self) -> None:
        unapplied = self.fault_unapplied - self.dstore.cancelled   # a write invalidated meanwhile is discarded
        ok = self.mgr.flush(timeout=0)
        covered = self.dstore.last_flush_seq
        if ok:
            assert not unapplied, "flush() True while a spill fault reported before it was never applied"
            assert all(s.seq > covered for s in self.dstore.spills), "flush() True with a covered spill in flight"
        self.fault_unapplied = set()
        self._check(self.mgr.poll())

    # -- workers
    @rule()
    def settle_copies(self) -> None:
        while self.mover.outstanding:
            self.mover.complete(self.mover.outstanding[0])
        self._check(self.mgr.poll())

    @rule()
    def settle_spills(self) -> None:
        while self.dstore.spills:
            self.dstore.answer_spill(0)
        self._check(self.mgr.poll())

    @precondition(lambda self: self.mover.outstanding)
    @rule(i=st.integers(0, 100), ok=st.booleans(), honor=st.booleans())
    def copy(self, i: int, ok: bool, honor: bool) -> None:
        t = self.mover.outstanding[i % len(self.mover.outstanding)]
        self.mover.complete(t, ok, honor_cancel=honor)

    @precondition(lambda self: self.dstore.spills)
    @rule(i=st.integers(0, 100), fault=st.integers(-1, 2))
    def spill(self, i: int, fault: int) -> None:
        faults = frozenset() if fault < 0 else frozenset({fault})
        op = self.dstore.spills[i % len(self.dstore.spills)]
        for p in faults:
            if p < len(op.tokens) and op.tokens[p] not in self.dstore.cancelled:
                self.fault_unapplied.add(op.tokens[p])
        self.dstore.answer_spill(i % len(self.dstore.spills), faults)

    @precondition(lambda self: self.dstore.reads)
    @rule(i=st.integers(0, 100), fault=st.booleans())
    def read(self, i: int, fault: bool) -> None:
        self.dstore.answer_read(i % len(self.dstore.reads), fault)

    @precondition(lambda self: self.dstore.alive)
    @rule(n=st.integers(0, 30))
    def writer_dies(self, n: int) -> None:
        """The disk writer stops (rarely): queued spills are answered failed, later ones are shed."""
        if n:
            return
        self.dstore.alive = False
        while self.dstore.spills:
            op = self.dstore.spills.pop(0)
            for t in op.tokens:
                if t not in self.dstore.cancelled:
                    self.fault_unapplied.add(t)
            if len(op.tokens) == 1:
                self.dstore.completions.put(Report(op.tokens[0], JobKind.SPILL, False, "disk writer is gone"))
            else:
                self.dstore.completions.put(Report(op.tokens[0], JobKind.SPILL, False, "disk writer is gone", 0, 0.0,
                                                  {i: "disk writer is gone" for i in range(len(op.tokens))}))
        self.dstore.flushes = [(t, s, False) for t, s, _ in self.dstore.flushes]
        self.dstore._answer_flushes()

    # -- invariants
    # -- the remote tier (another machine's writes, the server's answers)
    @precondition(lambda self: self.remotes and self.remotes[0].reads)
    @rule(i=st.integers(0, 100), fault=st.booleans())
    def remote_read(self, i: int, fault: bool) -> None:
        r = self.remotes[0]
        r.answer_read(i % len(r.reads), fault)

    @precondition(lambda self: self.remotes and self.remotes[0].puts)
    @rule(i=st.integers(0, 100), fault=st.booleans())
    def remote_put(self, i: int, fault: bool) -> None:
        r = self.remotes[0]
        r.answer_put(i % len(r.puts), "connection" if fault else None)

    @precondition(lambda self: self.remotes)
    @rule(k=st.sampled_from(KEYS))
    def foreign_write(self, k: bytes) -> None:
        """Another machine stores ``k`` on the server (refused there while this machine's tombstone lives)."""
        r = self.remotes[0]
        if k in r.tombs:
            return
        self.gen += 1
        r.held[k] = (None, blob(k, self.gen))

    @precondition(lambda self: self.restartable and not self.dstore.dead)
    @rule(n=st.integers(0, 8), mask=st.frozensets(st.integers(0, 5)))
    def child_dies(self, n: int, mask: frozenset[int]) -> None:
        """The disk I/O process dies (now and then), some of its queued spills committed just before."""
        if n:
            return
        store = self.dstore
        for op in store.spills:
            for t in op.tokens:
                if t not in store.cancelled:
                    self.fault_unapplied.add(t)
        store.die(mask)

    def _close_busy(self) -> None:
        """close() with copies, reads and spills in flight (answered only through help_one): every job
        issued ends terminal, every slot and disk entry is accounted for, no invalidated key is on disk."""
        mgr = self.mgr
        mgr.close()
        store = self.dstore   # close() restarts a process that is down, to delete what the index dropped
        core = mgr._core
        for k, (t, b) in store.committed.items():
            got = decode(b)
            assert got is not None and got[0] == k and self.allowed(k, got[1]), (k, got)
        left = [j for j in self.issued if not j.state.terminal]
        assert not left, f"close() left jobs unreported: {left}"
        assert not core.jobs, core.jobs
        assert all(v == 0 for v in core.n_in_flight.values()), core.n_in_flight
        assert core.index.used_slots == len(core.index), (core.index.used_slots, len(core.index))
        on_disk = {d.key: d.writer for d in core.dindex.entries() if d.state.value == "ready"}
        assert {k: t for k, (t, _) in store.committed.items()} == on_disk, (store.committed.keys(), on_disk)

    @invariant()
    def shed_inflight_limit_only_at_the_limit(self) -> None:
        """A store or load is shed ``inflight_limit`` only when the jobs in flight (of every kind, a spill
        or put job of many blocks once) have reached ``max_inflight_jobs``."""
        if self.mgr is None:
            return
        for kind, why, live in self.sheds:
            if why == "inflight_limit":
                assert live >= self.inflight, f"{kind} shed inflight_limit with {live} jobs of {self.inflight}"
        self.sheds.clear()

    @invariant()
    def never_wrong_bytes_anywhere(self) -> None:
        if self.mgr is None:
            return
        core = self.mgr._core
        for k in KEYS:
            b = self.mgr.host_bytes(k)
            if b is not None:
                got = decode(b.numpy().tobytes())
                assert got is not None and got[0] == k, f"host slot of {k!r} holds {got}"
                assert self.allowed(k, got[1]), f"host serves {k!r} generation {got[1]} (invalidated/cancelled)"
            if self.invalid[k]:
                assert core.dindex.ready(k) is None, f"invalidated {k!r} READY in the disk index"
        for k, (t, b) in self.dstore.committed.items():
            got = decode(b)
            assert got is not None and got[0] == k, f"disk holds {got} under {k!r}"
            if self.dstore.dead:
                continue   # a dead process lost its tombs; the restart deletes what the index dropped
            assert self.allowed(k, got[1]), f"disk holds {k!r} generation {got[1]} (invalidated/cancelled)"
        for r in self.remotes:
            for k, (_, b) in r.held.items():
                got = decode(b)
                assert got is not None and got[0] == k and self.allowed(k, got[1]), f"server holds {k!r} as {got}"
        assert self.mgr.host_used_slots <= self.host_slots
        distinct: dict[Any, int] = {}
        for j in {id(j): j for j in core.jobs.values()}.values():
            distinct[j.kind] = distinct.get(j.kind, 0) + 1
        assert {k: v for k, v in core.n_in_flight.items() if v} == distinct, (core.n_in_flight, distinct)

    def teardown(self) -> None:
        if self.mgr is None:
            return
        try:
            mgr, mover = self.mgr, self.mover
            if self.close_busy:
                self._close_busy()
                return
            for _ in range(50):
                store = self.dstore
                while mover.outstanding:
                    mover.complete(mover.outstanding[0])
                while store.reads:
                    store.answer_read(0)
                while store.spills:
                    store.answer_spill(0)
                for r in self.remotes:
                    while r.reads:
                        r.answer_read(0)
                    r.answer_puts()
                self._check(mgr.poll())
                if not mgr.jobs_in_flight and not mover.outstanding and not store.reads and not store.spills \
                        and not store.held and not any(r.reads or r.puts for r in self.remotes):
                    break
            self.never_wrong_bytes_anywhere()
            assert mgr.jobs_in_flight == 0, mgr.debug_sizes()
            core = mgr._core
            assert all(v == 0 for v in core.n_in_flight.values()), core.n_in_flight
            missing = [j for j in self.issued if id(j) not in self.reported]
            assert not missing, f"never reported: {missing}"
            assert mgr.host_used_slots == mgr.host_blocks, mgr.debug_sizes()
            assert core.dindex.used_slots == len(core.dindex)
            on_disk = {d.key: d.writer for d in core.dindex.entries()}
            if not store.dead:
                assert {k: t for k, (t, _) in store.committed.items()} == on_disk, (store.committed.keys(), on_disk)
            mgr.metrics.flush()
            reg = mgr.metrics.registry

            def outcomes(kind: str) -> dict[str, float]:
                return {o: reg.get_sample_value("tiered_kv_jobs_total", {"kind": kind, "outcome": o}) or 0.0
                        for o in ("ok", "failed", "cancelled")}

            parts = sum(len(e[1]) for e in store.log if e[0] == "spill")
            got = outcomes("spill")
            assert sum(got.values()) == parts, (got, parts)
            for kind in ("store", "load"):
                got = outcomes(kind)
                want = {o: float(self.outcomes[(kind, o)]) for o in ("ok", "failed", "cancelled")}
                assert got == want, (kind, got, want)
            got = outcomes("promote")
            assert sum(got.values()) == store.promotes, (got, store.promotes)
            sizes = mgr.debug_sizes()
            assert sizes["row_load"] == sizes["row_stores"] == sizes["key_loads"] == sizes["deliver"] == 0, sizes
            mgr.close()
            store = self.dstore   # close() restarts a process that is down, to delete what the index dropped
            for k, (t, b) in store.committed.items():
                got = decode(b)
                assert got is not None and got[0] == k and self.allowed(k, got[1]), ("after close", k, got)
            on_disk = {d.key: d.writer for d in core.dindex.entries()}
            assert {k: t for k, (t, _) in store.committed.items()} == on_disk, ("after close", store.committed.keys(), on_disk)
        finally:
            self.mp.undo()
            self._tmp.cleanup()


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = sm_settings(1500, 40)



# ============================================================================ a fake remote store
class FakeRemoteStore:
    """The owner-side contract of ``RemoteStore`` (probes, fetches, puts, cancels, invalidations), answered
    on command: a probe finds the keys in ``held``, a fetch copies their bytes into the reserved host
    slots, a put publishes its bytes unless a tombstone of its key or token refuses it."""

    def __init__(self, opts: Any, completions: Any, **kw: Any) -> None:
        self.opts = opts
        self.completions = completions
        self.held: dict[bytes, tuple[Optional[uuid.UUID], bytes]] = {}
        self.reads: list[tuple[uuid.UUID, list[bytes], Optional[list[memoryview]]]] = []
        self.puts: list[tuple[list[uuid.UUID], list[bytes], list[memoryview]]] = []
        self.tombs: set[bytes] = set()
        self.cancelled: set[uuid.UUID] = set()
        self.available = True
        self.healthy = True
        self.fetch_room_held = 0   # (room is never refused here)
        self.reads_accepted = 0
        self.puts_accepted = 0

    def put_room(self) -> int:
        return 1 << 20

    def submit_puts(self, tokens: list[uuid.UUID], keys: list[bytes], views: list[memoryview]) -> bool:
        self.puts.append((list(tokens), list(keys), list(views)))
        self.puts_accepted += 1
        return True

    def submit_probe(self, token: uuid.UUID, keys: list[bytes]) -> bool:
        self.reads.append((token, list(keys), None))
        self.reads_accepted += 1
        return True

    def take_fetch_room(self, n: int) -> bool:
        return True

    def give_fetch_room(self, n: int) -> None:
        pass

    def submit_fetch(self, token: uuid.UUID, keys: list[bytes], views: list[memoryview],
                     room_taken: bool = False) -> bool:
        self.reads.append((token, list(keys), list(views)))
        self.reads_accepted += 1
        return True

    def answer_read(self, i: int = 0, fault: bool = False) -> None:
        token, keys, views = self.reads.pop(i)
        failed = {}
        for j, k in enumerate(keys):
            if fault:
                failed[j] = "connection"
            elif k not in self.held:
                failed[j] = "miss"
            elif views is not None:
                views[j][:] = self.held[k][1]
        self.completions.put(Report(token, JobKind.FETCH, not failed, next(iter(failed.values()), None), 0, 1e-4,
                                    failed or None))

    def answer_put(self, i: int = 0, error: Optional[str] = None) -> None:
        tokens, keys, views = self.puts.pop(i)
        failed = {}
        for j, (t, k, v) in enumerate(zip(tokens, keys, views)):
            if t in self.cancelled:
                failed[j] = "refused_token"
            elif k in self.tombs:
                failed[j] = "refused_tomb"
            elif error is not None:
                failed[j] = error
            else:
                self.held[k] = (t, bytes(v))
        self.completions.put(Report(tokens[0], JobKind.PUT, not failed, next(iter(failed.values()), None), 0, 1e-4,
                                    failed or None))

    def answer_puts(self, error: Optional[str] = None) -> None:
        """Answer every queued put job: ok, or every part failed with ``error``."""
        while self.puts:
            self.answer_put(0, error)

    def cancel(self, token: uuid.UUID, key: bytes) -> None:
        self.cancelled.add(token)
        if key in self.held and self.held[key][0] == token:
            del self.held[key]

    def invalidate(self, key: bytes) -> None:
        self.tombs.add(key)
        self.held.pop(key, None)

    def invalidating(self, key: bytes) -> bool:
        return False

    def kick(self) -> None:
        pass

    def wait_writes(self, timeout: float = 10.0) -> bool:
        return True

    def close(self, timeout: float = 5.0) -> None:
        for token, keys, _ in self.reads:
            self.completions.put(Report(token, JobKind.FETCH, False, "remote_down", 0, 0.0,
                                        {j: "remote_down" for j in range(len(keys))}))
        self.reads.clear()
        while self.puts:
            self.answer_put(0, "remote_down")

    queue_depth = 0
    tombs_dropped = 0


@pytest.fixture
def fake_remote(monkeypatch: pytest.MonkeyPatch) -> list[FakeRemoteStore]:
    import tiered_kv.remote.store as remote_store_mod
    made: list[FakeRemoteStore] = []

    def make(opts: Any, completions: Any, **kw: Any) -> FakeRemoteStore:
        s = FakeRemoteStore(opts, completions, **kw)
        made.append(s)
        return s

    monkeypatch.setattr(remote_store_mod, "RemoteStore", make)
    return made


def open_remote_manager(*, rows: int = 8, host_slots: int = 4, **kw: Any) -> tuple[TierManager, FakeMover, torch.Tensor]:
    kv = torch.zeros((rows, ROW), dtype=torch.uint8)
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=host_slots * ROW, remote_url="redis://127.0.0.1:1/0",
                         remote_miss_ttl_seconds=0.0, host_evict_ahead_blocks=0, **kw)
    f = FakeMoverFactory()
    mgr = TierManager(cfg, kv, registry=CollectorRegistry(), mover_factory=f)
    assert f.mover is not None
    return mgr, f.mover, kv


# ============================================================================ defects this review proved
# Each of the next three failed at fa29da7 (proved as strict xfails) and was fixed in c35ed6d; they guard
# the fixes now.


def test_wait_for_quiescence_waits_for_a_remote_fetch_writing_a_host_slot(fake_remote: list[FakeRemoteStore]) -> None:
    """``wait()`` with no jobs promises quiescence: every worker report applied, no slot still leased to a
    read -- it waits for a promote even when no load waits for it, because its read still writes a host
    slot.  A remote FETCH's read writes a reserved host slot just the same (it was not waited for)."""
    from fakes import instrument_get
    mgr, mover, kv = open_remote_manager()
    remote = fake_remote[0]
    remote.held[b"r"] = (None, blob(b"r", 1))
    try:
        assert mgr.lookup([b"r"]) == 0            # wanted: the step's probe goes out at the next pass
        mgr.poll()
        remote.answer_read()                      # the server holds it
        mgr.poll()                                # the fetch: a host slot reserved, its read in flight
        core = mgr._core
        assert core.n_in_flight[JobKind.FETCH] == 1 and mgr.host_used_slots == 1
        instrument_get(mgr._completions, lambda timeout: remote.reads and remote.answer_read())
        mgr.wait(timeout=5)                       # quiescence: the fetch's read lands while it blocks
        assert core.n_in_flight[JobKind.FETCH] == 0, "wait() returned with the fetch's read still writing slot"
        assert decode(mgr.host_bytes(b"r").numpy().tobytes()) == (b"r", 1)
    finally:
        while remote.reads:
            remote.answer_read(0, fault=True)
        mgr.close()


def test_a_spill_job_counts_once_against_max_inflight_jobs(tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    """max_inflight_jobs bounds *jobs* in flight of every kind (config.py; the gauge
    ``tiered_kv_jobs_in_flight`` exports them per kind).  One write-through spill job of four blocks is
    one job: a store with one job in flight and a limit of four must not be shed ``inflight_limit``."""
    mgr, mover, kv = open_manager(tmp_path, host_slots=8, max_inflight_jobs=4)
    try:
        keys = [b"s%d" % i for i in range(4)]
        for i, k in enumerate(keys):
            fill(kv, i, k, 1)
        job = mgr.store_many(keys, list(range(4)))
        mover.complete(job)
        mgr.poll()                                     # published: one spill job of four blocks queued
        assert len(fake_disk[0].spills) == 1 and len(fake_disk[0].spills[0].tokens) == 4
        reg = mgr.metrics.registry
        gauge = {k: reg.get_sample_value("tiered_kv_jobs_in_flight", {"kind": k}) for k in ("store", "load", "spill",
                                                                                           "promote")}
        assert sum(gauge.values()) == 1, gauge         # the registry says: one job in flight
        fill(kv, 5, b"next", 1)
        assert mgr.store(b"next", 5) is not None, "shed inflight_limit with one job in flight of a limit of four"
    finally:
        for op in list(fake_disk[0].spills):
            fake_disk[0].answer_spill(0)
        mgr.close()


def test_flush_is_false_when_a_remote_write_failed_before_it_was_asked_for(fake_remote: list[FakeRemoteStore]) -> None:
    """``flush()``: False when "a spill whose failure had not been applied by an earlier poll(); likewise a
    remote write that failed by a fault".  ``TierCore.flush`` read ``put_faults`` only after the front
    end's first pass had applied the failed put (the spill half was read before it)."""
    mgr, mover, kv = open_remote_manager()
    remote = fake_remote[0]
    try:
        fill(kv, 0, b"p", 1)
        job = mgr.store(b"p", 0)
        mover.complete(job)
        mgr.poll()                                   # published: its put queued
        assert len(remote.puts) == 1
        remote.answer_puts(error="connection")       # a fault, reported before flush() and never polled
        assert mgr.flush(timeout=1) is False, "flush() True with a remote write that failed by a fault"
    finally:
        mgr.close()


def test_scheduler_flush_is_false_when_a_remote_write_failed_before_it_was_asked_for(
        tmp_path: Any, fake_remote: list[FakeRemoteStore]) -> None:
    """The vLLM front end's flush() has the TierManager.flush() defect fixed in c35ed6d: a config field (and
    flush()) means the same under every front end, and its own comment says a failure "this call is the
    first to apply, is covered too (as TierManager.flush)"."""
    from tiered_kv.integrations.scheduler import SlabScheduler
    from tiered_kv.integrations.slab import SharedSlab
    from tiered_kv.metrics import Metrics
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=8 * ROW, remote_url="redis://127.0.0.1:1/0")
    slab = SharedSlab.open(tmp_path / "slab", 8, ROW, 1)
    s = SlabScheduler(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace=NS))
    remote = fake_remote[0]
    try:
        p = s.prepare_store([b"v"])
        slab.rows[p.slots[0]] = torch.frombuffer(bytearray(blob(b"v", 1)), dtype=torch.uint8)
        slab.mark_done(0, p.seq)
        s.complete_store(p.keys)
        s.tick()                                     # published: its put queued
        assert len(remote.puts) == 1
        remote.answer_puts(error="connection")       # a fault, reported before flush() and never ticked
        assert s.flush(timeout=1) is False, "flush() True with a remote write that failed by a fault"
    finally:
        s.close()
        slab.unlink()
        slab.close()


def test_flush_is_false_when_a_remote_write_fails_while_it_waits(fake_remote: list[FakeRemoteStore]) -> None:
    """The half that holds: a put that fails by a fault while flush() waits for it makes it False, and a
    put refused by a tombstone (no fault) does not."""
    from fakes import instrument_get
    mgr, mover, kv = open_remote_manager()
    remote = fake_remote[0]
    try:
        for i, (key, error) in enumerate([(b"f", "connection"), (b"t", "refused_tomb")]):
            fill(kv, i, key, 1)
            job = mgr.store(key, i)
            mover.complete(job)
            mgr.poll()
            assert len(remote.puts) == 1
            instrument_get(mgr._completions, lambda timeout, e=error: remote.puts and remote.answer_puts(error=e))
            assert mgr.flush(timeout=5) is (error == "refused_tomb"), error
    finally:
        mgr.close()


# ============================================================================ plain tests: behaviours that hold
def _publish(mgr: TierManager, mover: FakeMover, kv: torch.Tensor, key: bytes, row: int, gen: int) -> Job:
    """Store ``key`` (generation ``gen``) from ``row``, its copy landed and applied; the row freed after."""
    fill(kv, row, key, gen)
    job = mgr.store(key, row)
    assert job is not None
    mover.complete(job)
    mgr.poll()
    assert job.state.value == "done"
    assert mgr.free_block(row)
    return job


def _spills_done(mgr: TierManager, store: FakeDiskStore) -> None:
    while store.spills:
        store.answer_spill(0)
    mgr.poll()


def _disk_only(tmp_path: Any, **kw: Any) -> tuple[TierManager, FakeMover, torch.Tensor]:
    """A manager (two host slots, evict-ahead one) whose key b"d" (generation 1) is on disk only."""
    mgr, mover, kv = open_manager(tmp_path, host_slots=2, ahead=1, **kw)
    store = mgr._core.disk.store
    _publish(mgr, mover, kv, b"d", 0, 1)
    _spills_done(mgr, store)
    _publish(mgr, mover, kv, b"filler", 1, 1)       # its spill pins it: evict-ahead takes b"d"
    _spills_done(mgr, store)
    assert mgr.host_bytes(b"d") is None and mgr.lookup([b"d"]) == 1
    return mgr, mover, kv


def test_an_invalidated_spills_host_slot_stays_leased_until_its_report_and_its_write_is_prevented(
        tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    mgr, mover, kv = open_manager(tmp_path)
    store = fake_disk[0]
    try:
        _publish(mgr, mover, kv, b"k", 0, 1)
        assert len(store.spills) == 1                 # write-through: queued, the host slot pinned
        mgr.invalidate(b"k")
        assert mgr.host_blocks == 0 and mgr.host_used_slots == 1, "the slot a queued spill reads was freed"
        assert store.spills[0].tokens[0] in store.cancelled, "the invalidated spill was not tombstoned"
        _publish(mgr, mover, kv, b"k2", 1, 2)         # takes another slot, never the one being read
        assert mgr.host_used_slots == 2
        store.answer_spill(0)                         # prevented by its tomb
        mgr.poll()
        assert b"k" not in store.committed and mgr.lookup([b"k"]) == 0
        assert mgr.host_used_slots == 1 and mgr.host_blocks == 1
    finally:
        _spills_done(mgr, store)
        mgr.close()


def test_free_block_of_a_load_waiting_for_its_read_unfences_at_once_and_no_copy_reaches_the_row(
        tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    mgr, mover, kv = _disk_only(tmp_path)
    store = mgr._core.disk.store
    try:
        job = mgr.load(b"d", 5)
        assert job is not None and mgr.free_block(5) is True    # no copy queued yet: free at once
        fill(kv, 5, b"engine", 9)                               # the engine reuses the row
        done = mgr.poll()                                       # the cancelled load is reported now ...
        assert [(c.job, c.ok) for c in done] == [(job, False)] and job.state.value == "cancelled"
        assert len(store.reads) == 1
        store.answer_read(0)                                    # ... and its read lands later: a prefetch
        assert mgr.poll() == []
        assert not [t for t in mover.submitted if t.kind is JobKind.LOAD], "a copy was queued into the row"
        assert row_holds(kv, 5) == (b"engine", 9)
        assert decode(mgr.host_bytes(b"d").numpy().tobytes()) == (b"d", 1)
        assert mgr.host_used_slots == mgr.host_blocks
    finally:
        mgr.close()


def test_a_read_that_landed_before_its_key_was_invalidated_never_publishes_after_a_new_store(
        tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    mgr, mover, kv = _disk_only(tmp_path)
    store = mgr._core.disk.store
    try:
        job = mgr.load(b"d", 5)
        mgr.poll()                                     # the read goes to the readers
        store.answer_read(0)                           # generation 1 lands in the reserved slot; not applied
        mgr.invalidate(b"d")                           # the load and its read are cancelled
        _publish(mgr, mover, kv, b"d", 2, 2)           # stored again: generation 2
        done = mgr.poll()                              # the read's report: stale
        assert job.state.value == "cancelled" and all(c.job is not job or not c.ok for c in done)
        assert decode(mgr.host_bytes(b"d").numpy().tobytes()) == (b"d", 2)
        _spills_done(mgr, store)
        assert store.committed[b"d"][1] == blob(b"d", 2)
        assert mgr.host_used_slots == mgr.host_blocks
    finally:
        mgr.close()


def test_flush_waits_for_the_spills_it_covers(tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    mgr, mover, kv = open_manager(tmp_path)
    store = fake_disk[0]
    try:
        _publish(mgr, mover, kv, b"k", 0, 1)
        assert mgr.flush(timeout=0) is False           # the spill is still queued
        store.answer_spill(0)
        assert mgr.flush(timeout=0) is True
        _publish(mgr, mover, kv, b"k2", 1, 1)
        store.answer_spill(0, frozenset({0}))          # failed by a fault, not applied by a poll before
        assert mgr.flush(timeout=0) is False
    finally:
        mgr.close()


def _restartable(tmp_path: Any, **kw: Any) -> tuple[TierManager, FakeMover, torch.Tensor]:
    mgr, mover, kv = open_manager(tmp_path, **kw)
    disk = mgr._core.disk
    disk._reopen = lambda: disk.store.reopened()   # as disk_io="process": a store that dies is restarted
    return mgr, mover, kv


def test_a_key_invalidated_while_the_io_process_was_down_is_deleted_by_the_restart(
        tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    mgr, mover, kv = _restartable(tmp_path)
    try:
        _publish(mgr, mover, kv, b"k", 0, 1)
        _spills_done(mgr, fake_disk[0])
        assert b"k" in fake_disk[0].committed
        fake_disk[0].die()
        mgr.invalidate(b"k")                           # its tomb is lost with the process
        assert b"k" in fake_disk[0].committed
        mgr.poll()                                     # the restart reconciles the new process's entries
        new = mgr._core.disk.store
        assert new is not fake_disk[0] and b"k" not in new.committed and mgr.lookup([b"k"]) == 0
    finally:
        mgr.close()


def test_a_spill_committed_just_before_the_process_died_leaves_no_orphan_after_the_restart(
        tmp_path: Any, fake_disk: list[FakeDiskStore]) -> None:
    mgr, mover, kv = _restartable(tmp_path)
    try:
        _publish(mgr, mover, kv, b"k", 0, 1)
        fake_disk[0].die(frozenset({0}))               # written, but answered "died": the index drops it
        assert mgr.flush(timeout=1) is False           # a covered write failed
        new = mgr._core.disk.store
        assert {k: t for k, (t, _) in new.committed.items()} == {d.key: d.writer for d in mgr._core.dindex.entries()}
    finally:
        mgr.close()


def test_close_restarts_a_process_that_is_down_to_delete_what_the_owner_dropped(
        tmp_path: Any, fake_disk: list[FakeDiskStore], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(disk_tier_mod, "RESTART_BACKOFF_MIN_S", 1e9)   # the second death's back-off outlasts the test
    mgr, mover, kv = _restartable(tmp_path)
    _publish(mgr, mover, kv, b"k", 0, 1)
    _spills_done(mgr, fake_disk[0])
    fake_disk[0].die()
    mgr.poll()                                         # first death: restarted at once
    second = mgr._core.disk.store
    assert second is not fake_disk[0]
    second.die()                                       # dies again at once: the restart backs off
    mgr.invalidate(b"k")
    mgr.poll()
    assert mgr._core.disk.store is second and b"k" in second.committed
    mgr.close()                                        # one more start, whatever the back-off
    last = mgr._core.disk.store
    assert last is not second and b"k" not in last.committed


@pytest.mark.parametrize("call", ["store", "store_many"])
def test_a_store_shed_at_the_inflight_limit_leaves_the_keys_fetch_alone(fake_remote: list[FakeRemoteStore],
                                                                      call: str) -> None:
    """The engine's own block wins over a fetch of its key in flight -- when it is stored.  At
    ``max_inflight_jobs`` the store is shed instead, and then the fetch must go on: ``store()`` (its one-key
    path) superseded the fetch first and shed the store after, so the block reached no tier (``store_many``
    kept the fetch).  Both calls behave the same."""
    mgr, mover, kv = open_remote_manager(max_inflight_jobs=2)
    remote = fake_remote[0]
    remote.held[b"r"] = (None, blob(b"r", 1))
    try:
        assert mgr.lookup([b"r"]) == 0
        mgr.poll()
        remote.answer_read()                      # the probe: the server holds it
        mgr.poll()                                # the fetch: a host slot reserved, its read in flight
        core = mgr._core
        assert core.n_in_flight[JobKind.FETCH] == 1
        fill(kv, 0, b"other", 1)
        assert mgr.store(b"other", 0) is not None  # two jobs in flight: the limit
        fill(kv, 1, b"r", 2)
        before = sample_total(mgr.metrics.registry, "tiered_kv_shed_total")
        job = mgr.store(b"r", 1) if call == "store" else mgr.store_many([b"r"], [1])
        assert job is None
        mgr.poll()
        assert mgr.host_used_slots == 2 and mgr._core.index.get(b"r") is not None, "the fetch was dropped"
        assert sample_total(mgr.metrics.registry, "tiered_kv_shed_total") == before, "a present key was shed"
        remote.answer_read()
        mgr.poll()
        assert decode(mgr.host_bytes(b"r").numpy().tobytes()) == (b"r", 1)
    finally:
        while remote.reads:
            remote.answer_read(0, fault=True)
        mgr.close()
