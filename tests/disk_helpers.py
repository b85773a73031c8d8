"""Helpers and fixtures of the disk-tier tests (tests/test_disk_*.py).

* Block bytes are derived from the key (:func:`content`), so "never wrong
  bytes" is checked byte for byte.  The device tensor is a plain
  ``uint8 [rows, row_bytes]`` CPU tensor.
* :class:`Rig` (fixture ``rig``) opens managers on ``tmp_path`` and always
  closes them, after releasing any writer gate a test left closed, so that a
  failing test never hangs in ``close()``.
* :class:`WriterGate` is a ``DiskStore.fault_hook``: the hook runs at the start
  of every write transaction in the writer thread, so a gate holds the writer
  deterministically (no sleeps) and can make a chosen commit raise.
* :func:`raw_env` and friends open the LMDB environment directly (with the
  manager closed) to inspect or damage what is stored.  :func:`raw_blocks`
  hands out every entry in its self-contained inline form (the payload read
  from its slot), and :func:`rewrite_value` stores the damaged result back
  inline, which the tier reads like any entry; :func:`flip_slot_byte` and
  friends damage the slot file itself.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import lmdb
import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import Completion, Job, TieredKVConfig, TierManager
from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.format import SLOTS_NAME, inline_value, lmdb_key, parse_header, slot_bytes_for
from tiered_kv.movers import CompletionQueue

ROW = 4096                  # bytes per block in most disk tests
NS = "disk-test|u8|tp0"
REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PYTHON = sys.executable


# --------------------------------------------------------------------------- content
def content(key: bytes, row_bytes: int = ROW) -> torch.Tensor:
    """The bytes a block named ``key`` holds (uint8, ``row_bytes`` long)."""
    return torch.frombuffer(bytearray(hashlib.shake_128(b"blk:" + key).digest(row_bytes)), dtype=torch.uint8)


def make_kv(rows: int = 16, row_bytes: int = ROW, seed: int = 7) -> torch.Tensor:
    """A seeded ``uint8 [rows, row_bytes]`` device tensor holding garbage (no key's bytes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)


def fill(kv: torch.Tensor, row: int, key: bytes) -> None:
    kv[row].copy_(content(key, kv.shape[1]))


def row_is(kv: torch.Tensor, row: int, key: bytes) -> bool:
    return torch.equal(kv[row], content(key, kv.shape[1]))


def keys(n: int, prefix: str = "k") -> list[bytes]:
    return [f"{prefix}{i:04d}".encode() for i in range(n)]


# --------------------------------------------------------------------------- config / metrics
DEFAULT_DISK_IO: Optional[str] = None
"""Set per test by conftest.py: "thread" for tests marked ``disk_threads``, else the library's default."""


def disk_config(path: Any, *, host_slots: int = 16, disk_slots: int = 64, row_bytes: int = ROW,
                namespace: str = NS, **kw: Any) -> TieredKVConfig:
    if DEFAULT_DISK_IO is not None:
        kw.setdefault("disk_io", DEFAULT_DISK_IO)
    return TieredKVConfig(namespace=namespace, host_capacity_bytes=host_slots * row_bytes, disk_path=path,
                          disk_capacity_bytes=disk_slots * row_bytes, **kw)


def metric(mgr: TierManager, name: str, **labels: str) -> float:
    v = mgr.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else float(v)


def metric_sum(mgr: TierManager, name: str, **labels: str) -> float:
    """Sum of every sample ``name`` whose labels include ``labels``."""
    total = 0.0
    for fam in mgr.metrics.registry.collect():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def disk_health(mgr: TierManager) -> Optional[float]:
    return mgr.metrics.registry.get_sample_value("tiered_kv_healthy", {"tier": "disk"})


# --------------------------------------------------------------------------- driving a manager
def store_one(mgr: TierManager, kv: torch.Tensor, key: bytes, row: int, *, flush: bool = True) -> Completion:
    """Store ``key`` from ``row`` and wait for it (and, by default, for its spill to be durable)."""
    fill(kv, row, key)
    job = mgr.store(key, row)
    assert job is not None, f"store of {key!r} was not started"
    done = mgr.wait([job], timeout=30)
    assert job.done, f"store of {key!r} not reported within 30 s"
    comp = [c for c in done if c.job is job]
    assert len(comp) == 1 and comp[0].ok, comp
    if flush:
        assert mgr.flush(timeout=30) is True
    return comp[0]


def store_seq(mgr: TierManager, kv: torch.Tensor, ks: Sequence[bytes], *, flush: bool = True) -> None:
    """Store each key in turn (deterministic spill order: each spill is durable before the next store)."""
    for i, k in enumerate(ks):
        store_one(mgr, kv, k, i % kv.shape[0], flush=flush)


def load_into(mgr: TierManager, kv: torch.Tensor, key: bytes, row: int,
              timeout: float = 30) -> tuple[Optional[Job], Optional[Completion]]:
    """``load`` and wait; returns (job or None, its single completion or None).

    Asserts that the job is reported exactly once, within the wait (a later
    poll() must not report it again).
    """
    job = mgr.load(key, row)
    if job is None:
        return None, None
    got = [c for c in mgr.wait([job], timeout=timeout) if c.job is job]
    assert job.done, f"load of {key!r} not reported within {timeout} s"
    got += [c for c in mgr.poll() if c.job is job]
    assert len(got) == 1, f"load of {key!r} reported {len(got)} times: {got}"
    return job, got[0]


def load_ok(mgr: TierManager, kv: torch.Tensor, key: bytes, row: int) -> bool:
    """True when ``key`` loads ok with its exact bytes; fails the test on wrong bytes."""
    job, comp = load_into(mgr, kv, key, row)
    if job is None:
        return False
    assert comp is not None
    if comp.ok:
        assert row_is(kv, row, key), f"load of {key!r} reported ok with WRONG BYTES"
    return comp.ok


def disk_only_keys(rig: "Rig", io: Optional[str], n: int = 4, prefix: str = "c",
                   **kw: Any) -> tuple[torch.Tensor, TierManager, list[bytes]]:
    """A manager (8 host slots, 64 on disk; ``io``: its ``disk_io``) with ``n`` keys stored, flushed, then
    pushed out of the host tier by 8 more: loading one of the ``n`` reads it from disk, and the owner
    knows where each lies (``Entry.where``: a blocked ``wait()`` may read it from the page cache)."""
    from tiered_kv.disk.format import NO_WHERE

    kv = make_kv(rows=8)
    if io is not None:
        kw["disk_io"] = io
    mgr = rig.open(kv, host_slots=8, disk_slots=64, **kw)
    ks = keys(n, prefix)
    store_seq(mgr, kv, ks)
    for i, k in enumerate(keys(8, prefix + "-over")):
        store_one(mgr, kv, k, i % 8)
    for k in ks:
        assert mgr.host_bytes(k) is None
        assert mgr._core.dindex.ready(k).where != NO_WHERE
    return kv, mgr, ks


def drain(mgr: TierManager, timeout: float = 30) -> list[Completion]:
    """Poll until no job (internal spills/promotes included) is in flight, and no start of a new disk I/O
    process is (:func:`settle_restart`)."""
    out: list[Completion] = []
    deadline = time.monotonic() + timeout
    while mgr.jobs_in_flight:
        out += mgr.wait(timeout=0.05)
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs still in flight after {timeout} s: {mgr.debug_sizes()}")
    return out + mgr.poll() + settle_restart(mgr, timeout)


def settle_restart(mgr: TierManager, timeout: float = 60) -> list[Completion]:
    """Poll until no start of a disk I/O process is in flight: a pass that finds the process dead starts a new
    one on a starter thread (``DiskTier.restart``), and a later pass adopts it (or counts its failure)."""
    out: list[Completion] = []
    tier = mgr._core.disk
    deadline = time.monotonic() + timeout
    while tier is not None and tier._starting is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the disk I/O process's start still in flight after {timeout} s")
        out += mgr.wait(timeout=0.01)
    return out


def restart_disk_process(mgr: TierManager, timeout: float = 60) -> None:
    """Kill the manager's disk I/O process and step until a new one is started and adopted."""
    old = mgr.disk
    old.kill_for_test(signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while mgr.disk is old or mgr._core.disk._starting is not None:   # a pass restarts it, a later one adopts it
        mgr.wait(timeout=0.05)
        settle_restart(mgr)
        assert time.monotonic() < deadline, "the disk I/O process was not restarted"


def spy_spills(mgr: TierManager) -> list[tuple[uuid.UUID, bytes]]:
    """Record ``(token, key)`` of every spill the manager submits to its DiskStore."""
    seen: list[tuple[uuid.UUID, bytes]] = []
    disk = mgr.disk
    assert disk is not None
    orig = disk.submit_spills

    def submit_spills(tokens: list[uuid.UUID], keys: list[bytes], slots: list[int], view: Any) -> bool:
        ok = orig(tokens, keys, slots, view)
        if ok:
            seen.extend(zip(tokens, keys))
        return ok

    disk.submit_spills = submit_spills  # type: ignore[method-assign]
    return seen


# --------------------------------------------------------------------------- writer gate
class WriterGate:
    """A ``fault_hook`` that holds the writer thread at the start of write transactions.

    ``block_from``: the first hook call (1-based) that blocks; every later call
    blocks too until :meth:`open` is called.  ``raise_at``: ``{call number:
    exception}`` raised by that call (after it was let through, if it blocked).
    ``entered(n)`` waits until the writer has made ``n`` hook calls.
    """

    def __init__(self, block_from: Optional[int] = 1, raise_at: Optional[dict[int, BaseException]] = None,
                 max_hold: float = 60.0) -> None:
        self.block_from = block_from
        self.raise_at = dict(raise_at or {})
        self.max_hold = max_hold
        self.calls = 0
        self.points: list[str] = []
        self._cond = threading.Condition()
        self._open = block_from is None
        self._permits = 0

    def __call__(self, point: str) -> None:
        with self._cond:
            self.calls += 1
            n = self.calls
            self.points.append(point)
            self._cond.notify_all()
            if self.block_from is not None and n >= self.block_from:
                deadline = time.monotonic() + self.max_hold
                while not self._open and self._permits == 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break  # never hang a test run: let the writer go
                    self._cond.wait(left)
                if self._permits and not self._open:
                    self._permits -= 1
            exc = self.raise_at.pop(n, None)
        if exc is not None:
            raise exc

    def entered(self, n: int = 1, timeout: float = 30.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.calls >= n, timeout):
                raise AssertionError(f"writer made {self.calls} write transactions, expected {n}")

    def step(self, n: int = 1) -> None:
        """Let ``n`` held (or future) write transactions through, keep the gate closed."""
        with self._cond:
            self._permits += n
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


# --------------------------------------------------------------------------- rig

class StoreRig:
    """A thread-mode DiskStore driven directly (no manager), its answers awaited by token (bounded waits only
    detect a hang); its records can be damaged in place (:meth:`break_header`, :meth:`set_slot`)."""

    def __init__(self, path: Path, slots: int = 8, durability: str = "sync", batch_blocks: int = 0,
                 **opts: Any) -> None:
        """``opts``: more :class:`DiskOptions` fields (one reader unless ``num_readers`` says otherwise)."""
        self.q = CompletionQueue()
        bb = batch_blocks or slots
        opts.setdefault("num_readers", 1)
        self.opts = DiskOptions(path=path, namespace=NS, block_bytes=ROW, capacity_bytes=slots * ROW,
                                durability=durability, batch_blocks=bb, batch_bytes=bb * ROW, batch_seconds=0.0,
                                slots=slots, **opts)
        self.s = DiskStore(self.opts, self.q)
        self.seen: dict[uuid.UUID, Any] = {}
        self.bufs: list[bytearray] = []   # the spills' sources stay alive until answered

    def answer(self, token: uuid.UUID) -> Any:
        item = self.wait_for(token)
        assert item is not None, f"no answer for {token}"
        return item

    def wait_for(self, token: uuid.UUID, timeout: float = 30.0) -> Any:
        """The answer to ``token`` (the others that come first are kept for their turn); None on timeout."""
        deadline = time.monotonic() + timeout
        while token not in self.seen:
            item = self.q.get(max(0.0, deadline - time.monotonic()))
            if item is None:
                return None
            self.seen[item.token] = item
        return self.seen.pop(token)

    def submit(self, key: bytes) -> uuid.UUID:
        buf = bytearray(content(key, ROW).numpy().tobytes())
        self.bufs.append(buf)
        t = uuid.uuid4()
        assert self.s.submit_spill(t, key, memoryview(buf))
        return t

    def write(self, key: bytes) -> uuid.UUID:
        t = self.submit(key)
        assert self.answer(t).ok
        return t

    def flush(self) -> bool:
        tok = uuid.uuid4()
        self.s.submit_flush(tok)
        r = self.answer(tok)
        assert isinstance(r, FlushDone)
        return r.ok

    def record(self, key: bytes) -> bytes:
        db = self.s.db
        assert db is not None
        with db.env.begin(db=db.blocks) as txn:
            return bytes(txn.get(lmdb_key(key)))

    def slot_of(self, key: bytes) -> int:
        return parse_header(self.record(key)).slot

    def _rewrite(self, key: bytes, change: Callable[[bytearray], None]) -> None:
        db = self.s.db
        assert db is not None
        db.rw.acquire_shared()
        try:
            with db.env.begin(write=True, db=db.blocks) as txn:
                v = bytearray(txn.get(lmdb_key(key)))
                change(v)
                txn.put(lmdb_key(key), bytes(v))
        finally:
            db.rw.release_shared()

    def break_header(self, key: bytes) -> None:
        """Bad magic: ``key``'s record has no parseable header."""
        self._rewrite(key, lambda v: v.__setitem__(0, v[0] ^ 0xFF))

    def set_slot(self, key: bytes, slot: int) -> None:
        """Damage ``key``'s record: its slot field (outside the checksum) now names ``slot``."""
        self._rewrite(key, lambda v: v.__setitem__(slice(-8, None), slot.to_bytes(8, "little")))

    def read(self, key: bytes, expect: uuid.UUID) -> tuple[Any, bytes]:
        dst = bytearray(ROW)
        p = uuid.uuid4()
        self.s.queue_promote(p, key, expect, memoryview(dst))
        self.s.start_reads()
        return self.answer(p), bytes(dst)

    def close(self) -> None:
        self.s.close()

class Rig:
    """Opens managers and guarantees they are closed at the end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.path = tmp_path / "disk"
        self.managers: list[TierManager] = []
        self.gates: list[WriterGate] = []

    def open(self, kv: torch.Tensor, path: Any = None, **kw: Any) -> TierManager:
        cfg = disk_config(self.path if path is None else path, row_bytes=int(kv.shape[1]), **kw)
        mgr = TierManager(cfg, kv, registry=CollectorRegistry())
        self.managers.append(mgr)
        return mgr

    def gate(self, mgr: TierManager, **kw: Any) -> WriterGate:
        g = WriterGate(**kw)
        self.gates.append(g)
        assert mgr.disk is not None
        assert hasattr(mgr.disk, "writer"), "a writer gate needs the in-process writer: mark the test disk_threads"
        mgr.disk.fault_hook = g
        return g

    def close(self, mgr: TierManager) -> None:
        for g in self.gates:
            if mgr.disk is not None and mgr.disk.fault_hook is g:
                g.open()
                g.raise_at.clear()
        mgr.close()

    def close_all(self) -> None:
        for g in self.gates:
            g.raise_at.clear()
            g.open()
        errors = []
        for mgr in self.managers:
            try:
                mgr.close()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close_all()


# --------------------------------------------------------------------------- raw LMDB access
@contextlib.contextmanager
def raw_env(path: Any, write: bool = False) -> Iterator[tuple[Any, dict[str, Any]]]:
    """The disk tier's LMDB environment opened directly (the manager must be closed)."""
    env = lmdb.open(str(path), subdir=True, max_dbs=4, readonly=not write, lock=True, map_size=1 << 30)
    try:
        dbs = {name: env.open_db(name.encode(), create=False) for name in ("meta", "blocks", "tombs", "touch")}
        yield env, dbs
    finally:
        env.close()


def raw_index(path: Any) -> dict[bytes, bytes]:
    """LMDB key -> stored value (index record or inline entry) of the ``blocks`` sub-database."""
    with raw_env(path) as (env, dbs):
        with env.begin(db=dbs["blocks"]) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}


def slot_file(path: Any) -> Path:
    return Path(path) / SLOTS_NAME


def raw_blocks(path: Any) -> dict[bytes, bytes]:
    """LMDB key -> every entry in inline form (a slot entry's payload read from the slot file)."""
    out = {}
    data = slot_file(path).read_bytes() if slot_file(path).exists() else b""
    for k, v in raw_index(path).items():
        h = parse_header(v)
        if h.in_slot:
            off = h.slot * slot_bytes_for(h.length)
            v = inline_value(v, data[off:off + h.length])
        out[k] = v
    return out


def slot_of(path: Any, key: bytes) -> tuple[int, int]:
    """(slot number, byte offset in the slot file) of ``key``'s payload."""
    h = parse_header(raw_index(path)[lmdb_key(key)])
    assert h.in_slot, f"{key!r} is stored inline"
    return h.slot, h.slot * slot_bytes_for(h.length)


def flip_slot_byte(path: Any, key: bytes, offset: int) -> None:
    """Flip one payload byte of ``key`` in the slot file (works while a manager runs: plain pwrite)."""
    _, base = slot_of(path, key)
    fd = os.open(slot_file(path), os.O_RDWR)
    try:
        b = os.pread(fd, 1, base + offset)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), base + offset)
    finally:
        os.close(fd)


def assert_reopens(rig: "Rig", kv: torch.Tensor, why: str = "", **kw: Any) -> None:
    """The path is free again: a new manager opens on it (and is closed), else the test fails (``why``: what held
    it, for the message).  For a close an interrupt broke off and the next close finished."""
    from tiered_kv.errors import DiskInUseError

    try:
        again = rig.open(kv, **kw)
    except DiskInUseError as exc:
        pytest.fail(f"the path is still locked after close() was finished{why}: {exc}")
    rig.close(again)


def raw_keys(path: Any) -> set[bytes]:
    """Block keys (from the headers) of every stored entry."""
    return {parse_header(v).key for v in raw_blocks(path).values()}


def raw_tombs(path: Any) -> dict[bytes, bytes]:
    with raw_env(path) as (env, dbs):
        with env.begin(db=dbs["tombs"]) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}


def raw_token(path: Any, key: bytes) -> uuid.UUID:
    v = raw_blocks(path)[lmdb_key(key)]
    return parse_header(v).token


def payload_offset(value: bytes) -> int:
    return parse_header(value).payload_offset


def rewrite_value(path: Any, key: bytes, fn: Callable[[bytearray], bytes]) -> None:
    """Replace ``key``'s entry by ``fn(bytearray(its inline form))``, stored inline."""
    old = raw_blocks(path).get(lmdb_key(key))
    assert old is not None, f"{key!r} is not stored"
    with raw_env(path, write=True) as (env, dbs):
        with env.begin(write=True, db=dbs["blocks"]) as txn:
            txn.put(lmdb_key(key), bytes(fn(bytearray(old))))


def put_raw(path: Any, db: str, k: bytes, v: bytes) -> None:
    with raw_env(path, write=True) as (env, dbs):
        with env.begin(write=True, db=dbs[db]) as txn:
            txn.put(k, v)


def flip(offset: int) -> Callable[[bytearray], bytes]:
    def f(b: bytearray) -> bytes:
        b[offset] ^= 0x5A
        return bytes(b)
    return f


# --------------------------------------------------------------------------- mounts
@contextlib.contextmanager
def tmpfs(path: Path, size: str = "2m", options: str = "") -> Iterator[Path]:
    """A small tmpfs mounted at ``path`` (root only); skips the test when mounting is not possible."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); needs root")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remount(path: Path, options: str) -> None:
    r = subprocess.run(["mount", "-o", f"remount,{options}", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount {path} {options}: {r.stderr.strip()}")


# --------------------------------------------------------------------------- subprocesses
def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def readline(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """One line of ``proc``'s stdout, or fail the test after ``timeout`` s."""
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise AssertionError(f"no line from child process within {timeout} s")
    finally:
        sel.close()
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr is not None else ""
        raise AssertionError(f"child process exited ({proc.poll()}): {err[-4000:]}")
    return line.rstrip("\n")


def iter_lines(text: str) -> Iterable[str]:
    return (line for line in text.splitlines() if line)


FLIP_SLOT_IN_CHILD = """
import os, sys, lmdb
from tiered_kv.disk.format import SLOTS_NAME, parse_header, slot_bytes_for
path, key, off, mapsize = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
env = lmdb.open(path, subdir=True, max_dbs=4, map_size=mapsize, readonly=True)
db = env.open_db(b"blocks", create=False)
with env.begin(db=db) as txn:
    h = parse_header(txn.get(key))
env.close()
fd = os.open(os.path.join(path, SLOTS_NAME), os.O_RDWR)
at = h.slot * slot_bytes_for(h.length) + off
os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
os.close(fd)
print("flipped", flush=True)
"""


def fail_first_batch(disk: Any) -> threading.Event:
    """Make the disk store's first write batch fail with EIO; the event is set once its spills were
    answered as failed (their reports queued), so a test can act between that and their application."""
    failed = threading.Event()
    calls = {"n": 0}

    def hook(point: str) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")

    orig = disk.writer._fail_ops

    def fail_ops(ops: Any, error: str) -> None:
        orig(ops, error)                 # puts the spills' failed reports
        failed.set()

    disk.writer._fail_ops = fail_ops
    disk.fault_hook = hook
    return failed


def ready_host_entries(mgr: Any, keys: list[bytes]) -> list[Any]:
    """READY host entries for ``keys``, made in ``mgr``'s host index directly (no store, no spill
    started for them): what ``DiskTier.start_spills`` is handed, for tests that call it themselves."""
    core = mgr._core
    out = []
    for k in keys:
        e = core.index.reserve(k, core.tokens())
        core.index.publish(e)
        out.append(e)
    return out
