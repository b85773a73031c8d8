"""Shared helpers of the operator-command tests (tests/test_ops_*.py); holds no tests itself.

* Fixture environments are written by a real TierManager with a disk tier
  (stores, then ``flush()``), built once per module and copied per test.
* ``cli(capsys, ...)`` runs ``tiered_kv.tools.cli.main`` in-process and returns
  ``(exit code, stdout, stderr)``.
* ``LiveWriter`` runs a TierManager in a child process that keeps spilling new
  blocks until told to stop (LMDB forbids opening one environment twice in a
  process, so "beside a live writer" means another process, as in production).
* ``snapshot(path)`` is what "nothing changed" compares: every file name under
  the path, and the bytes of every file but LMDB's and the TierManager's lock
  files (lock.mdb's reader table changes whenever anyone reads).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Optional

import lmdb
import pytest
import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.tools.cli import main
from tiered_kv.disk.format import SLOTS_NAME, CorruptEntry, inline_value, lmdb_key, parse_header, slot_bytes_for

ROW = 4096
NS = "ops-test|u8|tp0"
REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LOCK_FILES = {"lock.mdb", "tiered_kv.lock"}


def content(key: bytes, row: int = ROW) -> bytes:
    return hashlib.shake_128(b"blk:" + key).digest(row)


def keys(n: int, prefix: str = "k") -> list[bytes]:
    return [f"{prefix}{i:04d}".encode() for i in range(n)]


def open_manager(path: Path, *, namespace: str = NS, row: int = ROW, rows: int = 8, disk_slots: int = 256,
                 host_slots: int = 4) -> tuple[TierManager, torch.Tensor]:
    kv = torch.zeros((rows, row), dtype=torch.uint8)
    cfg = TieredKVConfig(namespace=namespace, host_capacity_bytes=host_slots * row, disk_path=path,
                         disk_capacity_bytes=disk_slots * row)
    return TierManager(cfg, kv, registry=CollectorRegistry()), kv


def store_keys(mgr: TierManager, kv: torch.Tensor, ks: list[bytes]) -> None:
    """Store each key (its content in a device row) and wait until its spill is durable."""
    row = int(kv.shape[1])
    for i, k in enumerate(ks):
        r = i % kv.shape[0]
        kv[r].copy_(torch.frombuffer(bytearray(content(k, row)), dtype=torch.uint8))
        job = mgr.store(k, r)
        assert job is not None, f"store of {k!r} not started"
        mgr.wait([job], timeout=30)
        assert job.done
        assert mgr.flush(timeout=30) is True


def load_bytes(mgr: TierManager, kv: torch.Tensor, key: bytes, row: int = 0) -> Optional[bytes]:
    """Load ``key`` into device row ``row``; its bytes, or None on a miss."""
    kv[row].zero_()
    job = mgr.load(key, row)
    if job is None:
        return None
    done = [c for c in mgr.wait([job], timeout=30) if c.job is job]
    assert job.done and len(done) == 1
    return bytes(kv[row].numpy().tobytes()) if done[0].ok else None


def build_env(path: Path, ks: list[bytes], *, namespace: str = NS, row: int = ROW) -> Path:
    mgr, kv = open_manager(path, namespace=namespace, row=row)
    try:
        store_keys(mgr, kv, ks)
    finally:
        mgr.close()
    return path


class Template:
    """An environment built once (per module) by a TierManager; ``copy()`` gives each test its own."""

    def __init__(self, factory: Any, ks: list[bytes], **kw: Any) -> None:
        self.keys = ks
        self.src = factory.mktemp("tpl") / "disk"
        build_env(self.src, ks, **kw)

    def copy(self, dst: Path) -> Path:
        shutil.copytree(self.src, dst)
        return dst


# --------------------------------------------------------------------------- CLI
def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_subprocess(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([PYTHON, "-m", "tiered_kv.tools.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=str(REPO))


# --------------------------------------------------------------------------- raw LMDB (no manager open on the path)
def raw(path: Path, db: str = "blocks", inline: bool = True) -> dict[bytes, bytes]:
    """The sub-database ``db`` as stored; ``blocks`` entries in their inline form (payload read from its slot)
    unless ``inline=False``."""
    env = lmdb.open(str(path), subdir=True, max_dbs=4, readonly=True, lock=True, map_size=0)
    try:
        h = env.open_db(db.encode(), create=False)
        with env.begin(db=h) as txn:
            out = {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()
    if db == "blocks" and inline:
        data = (path / SLOTS_NAME).read_bytes() if (path / SLOTS_NAME).exists() else b""
        for k, v in out.items():
            try:
                e = parse_header(v)
            except CorruptEntry:
                continue      # damaged on purpose: left as stored
            if e.in_slot:
                off = e.slot * slot_bytes_for(e.length)
                out[k] = inline_value(v, data[off:off + e.length])
    return out


def raw_all(path: Path) -> dict[str, dict[bytes, bytes]]:
    return {db: raw(path, db) for db in ("meta", "blocks", "tombs", "touch")}


def raw_put(path: Path, db: str, k: bytes, v: Optional[bytes]) -> None:
    env = lmdb.open(str(path), subdir=True, max_dbs=4, map_size=1 << 28)
    try:
        h = env.open_db(db.encode(), create=False)
        with env.begin(write=True, db=h) as txn:
            if v is None:
                txn.delete(k)
            else:
                txn.put(k, v)
    finally:
        env.close()


def stored_keys(path: Path) -> set[bytes]:
    return {parse_header(v).key for v in raw(path).values()}


def token_of(path: Path, key: bytes) -> uuid.UUID:
    return parse_header(raw(path)[lmdb_key(key)]).token


def set_meta(path: Path, name: bytes, value: bytes) -> None:
    raw_put(path, "meta", name, value)


def snapshot(path: Path) -> dict[str, Optional[str]]:
    """name -> sha256 (None for lock files, whose presence still counts) of everything under ``path``."""
    if not path.exists():
        return {"<absent>": None}
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    out: dict[str, Optional[str]] = {}
    for f in sorted(path.rglob("*")):
        rel = str(f.relative_to(path))
        if f.is_dir():
            out[rel + "/"] = None
        elif f.name in LOCK_FILES:
            out[rel] = None
        else:
            out[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def not_lmdb_dir(tmp: Path) -> Path:
    d = tmp / "notlmdb"
    d.mkdir()
    (d / "README.txt").write_text("not a disk tier\n")
    return d


def garbage_lmdb_dir(tmp: Path) -> Path:
    d = tmp / "garbage"
    d.mkdir()
    (d / "data.mdb").write_bytes(os.urandom(8192))
    return d


def plain_lmdb_dir(tmp: Path) -> Path:
    """A valid LMDB environment that is not a tiered_kv disk tier."""
    d = tmp / "plain"
    env = lmdb.open(str(d), max_dbs=2, map_size=1 << 24)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
    env.close()
    return d


# --------------------------------------------------------------------------- a TierManager in another process
LIVE_WRITER = r"""
import sys, threading, hashlib, torch
from prometheus_client import CollectorRegistry
from tiered_kv import TierManager, TieredKVConfig
path, ns, row, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
kv = torch.zeros((8, row), dtype=torch.uint8)
cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=4 * row, disk_path=path, disk_capacity_bytes=4096 * row)
mgr = TierManager(cfg, kv, registry=CollectorRegistry())
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
def put(i):
    k = b"live%06d" % i
    r = i % 8
    kv[r].copy_(torch.frombuffer(bytearray(hashlib.shake_128(b"blk:" + k).digest(row)), dtype=torch.uint8))
    job = mgr.store(k, r)
    if job is not None:
        mgr.wait([job], timeout=30)
    mgr.flush(timeout=30)
for i in range(n):
    put(i)
print("ready", flush=True)
i = n
while not stop.is_set():   # keep committing while the test reads (up to a bound), then idle
    if i < 2000:
        put(i)
        i += 1
    else:
        stop.wait()
mgr.close()
print("closed", i, flush=True)
"""


class LiveWriter:
    def __init__(self, path: Path, n: int = 8, namespace: str = NS, row: int = ROW) -> None:
        self.proc = subprocess.Popen([PYTHON, "-c", LIVE_WRITER, str(path), namespace, str(row), str(n)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"live writer did not start: {line!r} {self.proc.stderr.read()[-3000:]}")
        self.pid = self.proc.pid

    def stop(self) -> str:
        if self.proc.poll() is None:
            out, err = self.proc.communicate("", timeout=60)
            assert self.proc.returncode == 0, err[-3000:]
            return out
        return ""


@pytest.fixture(scope="module")
def live_writer(tmp_path_factory: Any) -> Any:
    path = tmp_path_factory.mktemp("live") / "disk"
    w = LiveWriter(path)
    w.path = path  # type: ignore[attr-defined]
    yield w
    w.stop()


# --------------------------------------------------------------------------- another process with the LMDB env open
LMDB_READER = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=4, map_size=0)
txn = env.begin()
print("open", flush=True)
sys.stdin.read()
txn.abort(); env.close()
"""


class LmdbReader:
    """A plain LMDB reader (no tiered_kv, no torch) holding the environment open in another process."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([PYTHON, "-c", LMDB_READER, str(path)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "open", self.proc.stderr.read()
        self.pid = self.proc.pid

    def close(self) -> None:
        self.proc.communicate("", timeout=30)
