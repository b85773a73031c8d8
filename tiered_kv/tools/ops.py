"""Operator tools for a disk tier directory: inspect, verify/repair, compact.

These functions never print (``ops_cli.py`` does); they return plain data and
raise :class:`OpsError` (with the process exit status to use) on bad input or
when the path is in use.  Export/import live in :mod:`tiered_kv.tools.archive`.

Safety rules (docs/operations.md):

* Read-only tools (inspect, verify without ``--repair``, export) open the
  environment with ``lmdb.open(readonly=True, lock=True)``: they register in
  LMDB's reader table like any reader, never write ``data.mdb``, never touch
  ``DIR/tiered_kv.lock`` (probing that flock could make a TierManager that is
  starting at the same moment fail with ``DiskInUseError``), and are safe beside
  a live TierManager in *another* process.  LMDB forbids having one
  environment open twice in one process, so they refuse when the path is held
  by a TierManager of the calling process.
* Writing tools (verify ``--repair``, compact, import) take the same exclusive
  ``flock`` on ``DIR/tiered_kv.lock`` that :class:`~tiered_kv.disk.DiskStore`
  takes, hold it until they are done, and refuse (exit 3, naming the holder's
  pid) while a TierManager or another writing tool holds it.
* Nothing is opened (so no ``lock.mdb`` is created) until ``data.mdb`` carries
  LMDB's meta-page magic, and nothing is mapped beyond the end of a truncated
  ``data.mdb`` (that would be SIGBUS).

Longer than the project's usual 500 lines: inspect, verify and compact share the holder checks and
the read-only/writable opening above, and each is one screenful of its own; split, each part would
reach into the others' opening and holder state.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import stat
import struct
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import lmdb

from ..disk import lock
from ..disk.env import MAX_DBS, MIN_MAP, MIN_READERS, SUBDBS, map_in_use
from ..disk.format import (FORMAT_VERSION, HEADER_SIZE, HEADER_STRUCT, SLOTS_NAME, CorruptEntry, SlotReader, lmdb_key,
                           parse_header, verify_entry)
from ..disk.lock import LOCK_NAME, fsync_path
from ..disk.recovery import SEQ_LIMIT, removed_why
from ..errors import DiskInUseError, TieredKVError

__all__ = [
    "OpsError", "PathInUseError", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_BAD_INPUT", "EXIT_IN_USE",
    "LOCK_NAME", "SUBDBS", "OpenEnv", "Problem", "VerifyReport", "CompactReport",
    "check_env_dir", "check_meta", "open_readonly", "open_writable", "hold_path", "lock_holders", "env_users",
    "grow_map", "fsync_path",
    "inspect", "verify", "compact",
]

# exit statuses of the operator commands
EXIT_OK = 0          # done, nothing wrong
EXIT_PROBLEMS = 1    # verify found corrupt or orphaned entries (and was not asked to repair)
EXIT_BAD_INPUT = 2   # missing path, not a disk tier, wrong format/namespace/block size, bad archive...
EXIT_IN_USE = 3      # a TierManager (or another writing command) holds the path

MAX_READERS = MIN_READERS    # what DiskStore uses with its default 2 reader threads
LMDB_MAGIC = 0xBEEFC0DE      # mm_magic of an LMDB meta page: after the 16-byte page header
LMDB_DATA_VERSION = 1
COMPACT_TMP_PREFIX = ".compact-tmp-"

PathLike = Union[str, "os.PathLike[str]"]

_held: set[str] = set()           # realpaths whose TierManager lock this process holds via hold_path()
_held_lock = threading.Lock()


class OpsError(TieredKVError):
    """A refusal or bad input; ``exit_code`` is the CLI's exit status."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, exit_code: Optional[int] = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class PathInUseError(OpsError, DiskInUseError):
    """A TierManager (or another writing command, or an LMDB reader during compact) holds the path."""

    exit_code = EXIT_IN_USE

    def __init__(self, message: str, holder: Optional[str] = None) -> None:
        super().__init__(message)
        self.holder = holder


# ============================================================================ locks and holders
def _proc_locks(path: Path, kind: str) -> list[int]:
    """Pids holding ``kind`` ("FLOCK" or "POSIX") locks on ``path`` per /proc/locks (Linux); [] if unknown."""
    try:
        st = os.stat(path)
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    exact: list[int] = []
    by_inode: list[int] = []
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a blocked waiter: "1: -> FLOCK ..."
            continue
        try:
            i = parts.index(kind)
            pid, ident = int(parts[i + 3]), parts[i + 4]
        except (ValueError, IndexError):
            continue
        if ident == dev:
            exact.append(pid)
        elif ident.rsplit(":", 1)[-1] == str(st.st_ino):  # overlay filesystems report another device
            by_inode.append(pid)
    return sorted(set(exact or by_inode))


def lock_holders(path: PathLike) -> list[int]:
    """Pids holding the TierManager lock (``DIR/tiered_kv.lock``), without taking it.

    Reads /proc/locks, so a TierManager starting at the same moment is never
    refused because of us.  [] when nobody holds it (or when /proc/locks is
    unavailable).
    """
    lock = Path(path) / LOCK_NAME
    if not lock.exists():
        return []
    return _proc_locks(lock, "FLOCK")


def env_users(path: PathLike) -> list[int]:
    """Pids that have the LMDB environment open (a shared fcntl lock on ``lock.mdb``), per /proc/locks."""
    lock = Path(path) / "lock.mdb"
    if not lock.exists():
        return []
    return _proc_locks(lock, "POSIX")


@contextlib.contextmanager
def hold_path(path: PathLike) -> Iterator[None]:
    """Take ``DIR/tiered_kv.lock`` exactly like DiskStore (:mod:`tiered_kv.disk.lock`), hold it, release it.

    Raises :class:`PathInUseError` naming the holder's pid when a TierManager
    (or another writing command) holds it.  Our pid is written into the file
    while we hold it, so that a TierManager refused meanwhile names us.
    """
    p = Path(path)
    had_lock = (p / LOCK_NAME).exists()
    try:
        fd = lock.take(p)
        if not had_lock:
            _own_like_data(p / LOCK_NAME, p)
    except lock.LockHeld as held:
        who = "this process" if held.holder == str(os.getpid()) else f"pid {held.holder}"
        raise PathInUseError(f"{str(p)!r} is in use by a TierManager or another tiered-kv command ({who} holds "
                             f"{LOCK_NAME}); stop it first, nothing was changed", held.holder) from None
    except OSError as exc:
        raise OpsError(f"{str(p)!r}: cannot open the lock file {LOCK_NAME}: {exc.strerror}") from None
    real = os.path.realpath(p)
    try:
        with _held_lock:
            _held.add(real)
        yield
    finally:
        with _held_lock:
            _held.discard(real)
        lock.release(fd)


# ============================================================================ opening
def _lmdb_magic_ok(data: Path) -> bool:
    try:
        with open(data, "rb") as f:
            head = f.read(24)
    except OSError:
        return False
    if len(head) < 24:
        return False
    magic, version = struct.unpack_from("<II", head, 16)
    return magic == LMDB_MAGIC and version == LMDB_DATA_VERSION


def check_env_dir(path: PathLike) -> Path:
    """``path`` as a Path if it looks like an LMDB environment directory, else :class:`OpsError`.

    Looks only at the files (creates nothing): the directory exists, holds a
    regular ``data.mdb`` whose first meta page has LMDB's magic.
    """
    p = Path(path)
    if not p.exists():
        raise OpsError(f"{str(p)!r} does not exist")
    if not p.is_dir():
        raise OpsError(f"{str(p)!r} is not a directory (a disk tier is a directory holding data.mdb)")
    data = p / "data.mdb"
    if not data.is_file():
        raise OpsError(f"{str(p)!r} is not an LMDB environment (no data.mdb)")
    if not _lmdb_magic_ok(data):
        raise OpsError(f"{str(p)!r} is not an LMDB environment (data.mdb has no LMDB meta page)")
    return p


@dataclass
class OpenEnv:
    """An open environment and its tiered_kv sub-databases."""

    path: Path
    env: Any
    dbs: dict[str, Any]
    meta: dict[str, Any]
    writable: bool
    open_txns: int = 0   # transactions begun here and not yet ended

    @contextlib.contextmanager
    def begin(self, write: bool = False, buffers: bool = False) -> Iterator[Any]:
        """A transaction (a context manager, as ``env.begin``'s); a read one is retried once after adopting
        a map grown by a live writer -- only when no other transaction of this environment is open: LMDB
        forbids remapping under one (its pages would go from under its cursor: a crash).  Then
        :class:`MapGrewMeanwhile` is raised instead, for the caller to retry once that one ended."""
        try:
            txn = self.env.begin(write=write, buffers=buffers)
        except lmdb.MapResizedError:
            if self.open_txns:
                raise MapGrewMeanwhile(f"{str(self.path)!r}: the live writer grew the map under an open transaction")
            self.env.set_mapsize(0)
            txn = self.env.begin(write=write, buffers=buffers)
        self.open_txns += 1
        try:
            with txn:
                yield txn
        finally:
            self.open_txns -= 1


class MapGrewMeanwhile(Exception):
    """A live writer grew the map while a transaction of this environment was open: a new transaction can
    begin once that one ended (:meth:`OpenEnv.begin`)."""


def _read_meta(txn: Any, meta_db: Any) -> dict[str, Any]:
    raw = {bytes(k): bytes(v) for k, v in txn.cursor(db=meta_db)}
    out: dict[str, Any] = {"raw_keys": sorted(k.decode(errors="replace") for k in raw)}
    fv = raw.get(b"format_version")
    out["format_version"] = None if fv is None else fv.decode(errors="replace")
    ns = raw.get(b"namespace")
    out["namespace_bytes"] = ns
    out["namespace"] = None if ns is None else ns.decode(errors="replace")
    bb = raw.get(b"block_bytes")
    try:
        out["block_bytes"] = None if bb is None else int(bb)
    except ValueError:
        out["block_bytes"] = None
        out["block_bytes_raw"] = bb.decode(errors="replace") if bb is not None else None
    cr = raw.get(b"created")
    out["created"] = None if cr is None else _timestamp(cr)
    if cr is not None and out["created"] is None:
        out["created_raw"] = cr[:200].decode(errors="replace")
    lr = raw.get(b"last_recovery")
    if lr is None:
        out["last_recovery"] = None
    else:
        try:
            rec = json.loads(lr)
        except (ValueError, RecursionError):   # damaged: not JSON, or nested past what the parser takes
            rec = None
        # a report as recovery writes it: numbers only (its time a timestamp); else shown as the text it is
        ok = isinstance(rec, dict) and all(type(v) in (int, float) and _finite(v) for v in rec.values())
        if ok and "at" in rec and _timestamp(rec["at"]) is None:
            ok = False
        out["last_recovery"] = rec if ok else {"unparsable": lr[:200].decode(errors="replace")}
    return out


_LAST_TIMESTAMP = 253402300799.0   # 9999-12-31 23:59:59 UTC: the last second a datetime can show


def _timestamp(raw: Union[bytes, float]) -> Optional[float]:
    """``raw`` as a Unix time a date can be printed for, or None (not a number, not finite, out of range)."""
    try:
        t = float(raw)
    except (ValueError, TypeError):
        return None
    return t if 0.0 <= t <= _LAST_TIMESTAMP else None


def check_meta(meta: dict[str, Any], path: Path) -> tuple[bytes, int]:
    """The (namespace, block_bytes) a DiskStore would accept at ``path``, or :class:`OpsError`."""
    fv = meta.get("format_version")
    if fv is None:
        raise OpsError(f"{str(path)!r} has no tiered_kv format_version in its meta sub-database "
                       f"(never opened by a TierManager?)")
    if fv != str(FORMAT_VERSION):
        raise OpsError(f"{str(path)!r} has format version {fv!r} in meta; this tiered_kv reads version "
                       f"{FORMAT_VERSION} only")
    ns, bb = meta.get("namespace_bytes"), meta.get("block_bytes")
    if ns is None or bb is None or bb <= 0 or bb >= 1 << 64:   # (an entry header's length is 64 bits)
        raise OpsError(f"{str(path)!r}: meta lacks a namespace or a valid block_bytes "
                       f"(namespace={meta.get('namespace')!r}, block_bytes={meta.get('block_bytes', meta.get('block_bytes_raw'))!r})")
    return ns, int(bb)


def _open_dbs(env: Any, path: Path, create: bool) -> dict[str, Any]:
    dbs = {}
    for name in SUBDBS:
        try:
            dbs[name] = env.open_db(name.encode(), create=create)
        except lmdb.NotFoundError:
            raise OpsError(f"{str(path)!r} is an LMDB environment but not a tiered_kv disk tier "
                           f"(no {name!r} sub-database)") from None
        except lmdb.Error as exc:
            raise OpsError(f"{str(path)!r}: cannot open sub-database {name!r}: {exc}") from None
    return dbs


def _check_not_truncated(env: Any, path: Path) -> None:
    need = map_in_use(env)
    size = (path / "data.mdb").stat().st_size
    if size < need:
        raise OpsError(f"{str(path)!r}: data.mdb is truncated ({size} bytes < {need} in use); "
                       f"nothing can be read safely")


def _ino(data: Path) -> int:
    try:
        return data.stat().st_ino
    except FileNotFoundError:
        raise OpsError(f"{str(data.parent)!r} is not an LMDB environment (no data.mdb)") from None


def _own_like_data(made: Path, p: Path) -> None:
    """A file this command made in the tier ``p`` (a lock file LMDB or the path lock created) is given to
    the owner of ``p/data.mdb`` when this command runs as root: a root-owned ``lock.mdb`` or
    ``tiered_kv.lock`` would keep the serving user's TierManager from opening its own tier.  Best effort."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    try:
        st = (p / "data.mdb").stat()
        if (made.stat().st_uid, made.stat().st_gid) != (st.st_uid, st.st_gid):
            os.chown(made, st.st_uid, st.st_gid)
    except OSError:
        pass


def _lmdb_open(p: Path, **kw: Any) -> Any:
    """``lmdb.open(p, **kw)``, its ``lock.mdb`` given to the tier's owner if this call made it."""
    had = (p / "lock.mdb").exists()
    env = lmdb.open(str(p), **kw)
    if not had:
        _own_like_data(p / "lock.mdb", p)
    return env


def _open_current(p: Path) -> Any:
    """``lmdb.open`` read-only, making sure the data file LMDB opened is still ``p/data.mdb``.

    LMDB opens data.mdb before it waits for lock.mdb.  An open that waited
    through a compaction's swap would hold the replaced file with the new
    file's lock state; such an open is closed and made again.
    """
    data = p / "data.mdb"
    for _ in range(5):
        ino = _ino(data)
        try:
            env = _lmdb_open(p, readonly=True, lock=True, subdir=True, max_dbs=MAX_DBS, create=False,
                             map_size=0, readahead=False, max_readers=MAX_READERS)
        except lmdb.Error as exc:
            raise OpsError(f"{str(p)!r} is not a usable LMDB environment: {exc}") from None
        if _ino(data) == ino:
            return env
        env.close()
    raise OpsError(f"{str(p)!r}: data.mdb keeps being replaced (compactions?); retry later")


@contextlib.contextmanager
def open_readonly(path: PathLike) -> Iterator[OpenEnv]:
    """Open an existing disk tier read-only, safe beside a live TierManager in another process."""
    p = check_env_dir(path)
    with _held_lock:
        ours = os.path.realpath(p) in _held   # held by hold_path() in this process: no TierManager here
    if (not ours and os.getpid() in lock_holders(p)) or os.getpid() in env_users(p):
        raise PathInUseError(f"{str(p)!r} is open in this very process (a TierManager?); LMDB forbids opening "
                             f"an environment twice in one process: run the command from another process",
                             str(os.getpid()))
    env = _open_current(p)
    try:
        _check_not_truncated(env, p)
        dbs = _open_dbs(env, p, create=False)
        oe = OpenEnv(p, env, dbs, {}, False)
        with oe.begin() as txn:
            oe.meta = _read_meta(txn, dbs["meta"])
        yield oe
    finally:
        env.close()


@contextlib.contextmanager
def open_writable(path: PathLike, extra_bytes: int = 0, create: bool = False, durability: str = "sync") -> Iterator[OpenEnv]:
    """Open (or, with ``create``, create) a disk tier for writing.  The caller must hold :func:`hold_path`.

    The map is sized for the data file plus ``extra_bytes`` (what the caller
    means to add); :func:`grow_map` grows it further.
    """
    p = Path(path)
    if not create:
        check_env_dir(p)
    data = p / "data.mdb"
    existing = data.exists()
    size = data.stat().st_size if existing else 0
    want = max(MIN_MAP, size + extra_bytes + (16 << 20))
    try:
        env = _lmdb_open(p, readonly=False, lock=True, subdir=True, max_dbs=MAX_DBS, create=create,
                         map_size=want, sync=durability != "none", metasync=durability == "sync",
                         writemap=False, map_async=False, readahead=False, meminit=False, max_readers=MAX_READERS)
    except lmdb.Error as exc:
        raise OpsError(f"{str(p)!r} is not a usable LMDB environment: {exc}") from None
    try:
        if existing:
            _check_not_truncated(env, p)
        dbs = _open_dbs(env, p, create=create or not existing)
        oe = OpenEnv(p, env, dbs, {}, True)
        with env.begin() as txn:
            oe.meta = _read_meta(txn, dbs["meta"])
        yield oe
    finally:
        try:
            env.sync(True)
        except lmdb.Error:
            pass
        env.close()


def grow_map(oe: OpenEnv, need_extra: int) -> bool:
    """Grow the map of a writable env (no transaction may be open); False if the disk lacks room."""
    cur = oe.env.info()["map_size"]
    new = max(int(cur * 1.5), cur + need_extra)
    if shutil.disk_usage(oe.path).free < new - cur:
        return False
    oe.env.set_mapsize(new)
    return True


# ============================================================================ inspect
def _page_usage(oe: OpenEnv, txn: Any) -> dict[str, Any]:
    info, main = oe.env.info(), oe.env.stat()
    psize = main["psize"]
    total = info["last_pgno"] + 1
    used = 2 + main["branch_pages"] + main["leaf_pages"] + main["overflow_pages"]   # 2 meta pages
    per_db = {}
    for name, db in oe.dbs.items():
        s = txn.stat(db)
        per_db[name] = {"entries": s["entries"], "depth": s["depth"], "branch_pages": s["branch_pages"],
                        "leaf_pages": s["leaf_pages"], "overflow_pages": s["overflow_pages"]}
        used += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
    return {
        "page_bytes": psize,
        "map_size_bytes": info["map_size"],
        "pages_total": total,                 # pages the data file has ever used (last_pgno + 1)
        "pages_used": used,                   # pages of the live trees
        "pages_free": max(0, total - used),   # derived: reusable by LMDB (includes the freelist's own pages)
        "bytes_used": used * psize,
        "bytes_free": max(0, total - used) * psize,
        "map_unused_bytes": max(0, info["map_size"] - total * psize),
        "last_txnid": info["last_txnid"],
        "readers": info["num_readers"],
        "max_readers": info["max_readers"],
        "subdbs": per_db,
    }


def inspect(path: PathLike) -> dict[str, Any]:
    """Everything an operator wants to know about a disk tier, read-only.

    Raises :class:`OpsError` when the meta's format version is not ours, *after*
    filling ``exc.report`` with what could be read (meta, sizes), so the CLI can
    still show it.
    """
    with open_readonly(path) as oe:
        p = oe.path
        meta = oe.meta
        rep: dict[str, Any] = {
            "path": str(p),
            "format_version": meta["format_version"],
            "format_version_supported": FORMAT_VERSION,
            "namespace": meta["namespace"],
            "block_bytes": meta["block_bytes"],
            "created": meta["created"],
            **({"created_raw": meta["created_raw"]} if "created_raw" in meta else {}),
            "capacity_bytes": None,   # not recorded on disk: it is the TierManager's disk_capacity_bytes
            "last_recovery": meta["last_recovery"],
            "writer_pids": lock_holders(p),
            "env_user_pids": [pid for pid in env_users(p) if pid != os.getpid()],
            "file_bytes": (p / "data.mdb").stat().st_size,
            "slot_file_bytes": (p / SLOTS_NAME).stat().st_size if (p / SLOTS_NAME).exists() else 0,
            "leftover_compact_dirs": sorted(d.name for d in p.glob(COMPACT_TMP_PREFIX + "*")),
        }
        with oe.begin(buffers=True) as txn:
            rep["lmdb"] = _page_usage(oe, txn)
            subs = rep["lmdb"]["subdbs"]
            rep["tombstones"] = subs["tombs"]["entries"]
            rep["touch_records"] = subs["touch"]["entries"]
            bad = None
            try:
                ns, bb = check_meta(meta, p)
            except OpsError as exc:
                bad = exc
                ns, bb = b"", 0
            entries = stored = payload = foreign = unparsable = in_slots = 0
            namespaces: dict[str, int] = {}
            if bad is None:
                for _lk, v in txn.cursor(db=oe.dbs["blocks"]):
                    entries += 1
                    stored += len(v)
                    try:
                        h = parse_header(v)
                    except CorruptEntry:
                        unparsable += 1
                        continue
                    name = h.namespace.decode(errors="replace")
                    namespaces[name] = namespaces.get(name, 0) + 1
                    payload += h.length
                    in_slots += h.in_slot
                    if h.namespace != ns or h.length != bb:
                        foreign += 1
            else:
                entries = subs["blocks"]["entries"]
        rep.update(entries=entries, stored_bytes=stored, payload_bytes=payload, entry_namespaces=namespaces,
                   foreign_entries=foreign, unparsable_entries=unparsable, slot_entries=in_slots,
                   inline_entries=entries - unparsable - in_slots)
        if bad is not None:
            rep["error"] = str(bad)
            bad.report = rep  # type: ignore[attr-defined]
            raise bad
        return rep


# ============================================================================ verify / repair
@dataclass
class Problem:
    kind: str              # "corrupt" | "orphaned"
    reason: str            # diskformat's CorruptEntry reason, "lmdb_key_mismatch", or "tombstoned"
    lmdb_key: str          # hex
    key: Optional[str]     # hex of the header's key when it could be parsed
    token: Optional[str]
    detail: str = ""


@dataclass
class VerifyReport:
    path: str
    namespace: str
    block_bytes: int
    checked: int = 0
    ok: int = 0
    corrupt: list[Problem] = field(default_factory=list)
    orphaned: list[Problem] = field(default_factory=list)
    tombstones: int = 0
    dangling_touch: int = 0       # touch records of absent keys (harmless; recovery drops them)
    changed_meanwhile: int = 0    # read-only beside a live writer: entries dropped or rewritten while read
    repaired: bool = False
    removed: int = 0
    after: Optional[dict[str, int]] = None   # a fresh check after --repair
    writer_pids: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def problems(self) -> int:
        return len(self.corrupt) + len(self.orphaned)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["problems"] = self.problems
        return d


_ENTRY_HDR = HEADER_STRUCT
_ENTRY_HDR_SIZE = HEADER_SIZE


def _lenient_key_token(v: Any) -> tuple[Optional[str], Optional[str]]:
    """Key and writer token (hex, str) of a damaged entry when its header still says them; else None."""
    if len(v) < _ENTRY_HDR_SIZE:
        return None, None
    _magic, _ver, _flags, ns_len, key_len, _length, _seq, token = _ENTRY_HDR.unpack_from(v, 0)
    off = _ENTRY_HDR_SIZE + ns_len
    key = bytes(v[off:off + key_len]).hex() if off + key_len <= len(v) and key_len else None
    return key, str(uuid.UUID(bytes=bytes(token)))


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:   # an int past a float's range: no report of recovery holds one
        return False


def stored_payload(v: Any, bb: int, slots: SlotReader) -> Optional[bytes]:
    """The payload to verify ``v`` against: read from its slot for a slot entry, else None (inline)."""
    try:
        h = parse_header(v)
    except CorruptEntry:
        return None            # verify_entry raises the same error
    if not h.in_slot:
        return None
    return slots.payload(h) if h.length == bb else b""


def record_changed(oe: Any, lk: bytes, value: Any) -> Optional[bool]:
    """Whether ``lk``'s index record is no longer ``value`` (dropped or rewritten) in a fresh read
    transaction.  The index is a snapshot, the slot file is not: beside a live writer a slot read
    through an old record may hold a newer write's bytes, which is a change, not corruption.  None
    when it cannot tell now: the writer grew the map while the caller's own transaction is open (ask
    again once it ended)."""
    try:
        with oe.begin() as txn:
            now = txn.get(lk, db=oe.dbs["blocks"])
    except MapGrewMeanwhile:
        return None
    return now is None or bytes(now) != bytes(value)


def _scan(txn: Any, dbs: dict[str, Any], ns: bytes, bb: int, rep: VerifyReport, slots: SlotReader,
          progress: Optional[Callable[[int, int], None]] = None,
          changed: Optional[Callable[[bytes, Any], Optional[bool]]] = None,
          later: Optional[list[tuple[bytes, bytes, CorruptEntry]]] = None) -> list[bytes]:
    """Check every entry (and the payload in its slot); fill ``rep``; return the LMDB keys of the bad ones.

    ``changed(lmdb key, record)``: read-only runs ask it before calling an entry corrupt (see
    :func:`record_changed`); one that changed is counted in ``changed_meanwhile`` instead, one it cannot
    tell about yet goes to ``later`` (key, record, error) for the caller to settle after the scan."""
    tombs = {bytes(k) for k, _ in txn.cursor(db=dbs["tombs"])}
    rep.tombstones = len(tombs)
    bad: list[bytes] = []
    present: set[bytes] = set()
    total = txn.stat(dbs["blocks"])["entries"]
    for i, (lk, v) in enumerate(txn.cursor(db=dbs["blocks"])):
        lk = bytes(lk)
        present.add(lk)
        rep.checked += 1
        if progress is not None and i % 256 == 0:
            progress(rep.checked, total)
        try:
            h = verify_entry(v, ns, None, bb, stored_payload(v, bb, slots))
        except CorruptEntry as exc:
            moved = changed(lk, v) if changed is not None else False
            if moved is None and later is not None:
                later.append((lk, bytes(v), exc))
                continue
            if moved:
                rep.changed_meanwhile += 1
                continue
            rep.corrupt.append(_corrupt(lk, v, exc))
            bad.append(lk)
            continue
        why = removed_why(h, lk, ns, bb, tombs, lambda: True)   # what recovery removes (the checksum verified above)
        if why is None:
            rep.ok += 1
            continue
        if why == "tombstoned":
            rep.orphaned.append(Problem("orphaned", why, lk.hex(), h.key.hex(), str(h.token),
                                        "written under a tombstoned token"))
        elif why == "lmdb_key_mismatch":
            rep.corrupt.append(Problem("corrupt", why, lk.hex(), h.key.hex(), str(h.token),
                                       f"stored under {lk[:40].hex()}, header key maps to {lmdb_key(h.key)[:40].hex()}"))
        elif why == "bad_seq":
            rep.corrupt.append(Problem("corrupt", why, lk.hex(), h.key.hex(), str(h.token),
                                       f"sequence number {h.seq} is past what any writer reaches ({SEQ_LIMIT})"))
        else:
            rep.corrupt.append(Problem("corrupt", why, lk.hex(), h.key.hex(), str(h.token), f"recovery removes it ({why})"))
        bad.append(lk)
    rep.dangling_touch = sum(1 for k, _ in txn.cursor(db=dbs["touch"]) if bytes(k) not in present)
    if progress is not None:
        progress(rep.checked, total)
    return bad


def _corrupt(lk: bytes, v: Any, exc: CorruptEntry) -> Problem:
    key, tok = _lenient_key_token(v)
    return Problem("corrupt", exc.reason, lk.hex(), key, tok, str(exc))


_META_REASONS = ("wrong_namespace", "wrong_length")   # an entry that disagrees with meta, not with itself


def verify(path: PathLike, repair: bool = False,
           progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Check every entry's header and checksum; with ``repair`` remove the bad ones (and only those),
    unless no entry agrees with meta's namespace and block size (then meta is suspect: nothing is removed).

    Without ``repair`` the environment is opened read-only (safe beside a live
    TierManager in another process).  With ``repair`` the TierManager lock is
    taken and held; a held path raises :class:`PathInUseError` before anything
    is opened.
    """
    t0 = time.perf_counter()
    p = check_env_dir(path)
    if not repair:
        with open_readonly(p) as oe:
            ns, bb = check_meta(oe.meta, p)
            rep = VerifyReport(str(p), ns.decode(errors="replace"), bb, writer_pids=lock_holders(p))
            later: list[tuple[bytes, bytes, CorruptEntry]] = []
            with oe.begin(buffers=True) as txn, SlotReader(p, bb) as slots:
                _scan(txn, oe.dbs, ns, bb, rep, slots, progress, lambda lk, v: record_changed(oe, lk, v), later)
            for lk, v, exc in later:   # the scan's transaction ended: the grown map is adopted now
                if record_changed(oe, lk, v):
                    rep.changed_meanwhile += 1
                else:
                    rep.corrupt.append(_corrupt(lk, v, exc))
        rep.seconds = time.perf_counter() - t0
        return rep
    with hold_path(p):
        with open_writable(p) as oe:
            ns, bb = check_meta(oe.meta, p)
            rep = VerifyReport(str(p), ns.decode(errors="replace"), bb, repaired=True)
            # (a removed entry's slot is free at the next open: the free list is derived from the index)
            with oe.env.begin(write=True, buffers=True) as txn, SlotReader(p, bb) as slots:
                bad = _scan(txn, oe.dbs, ns, bb, rep, slots, progress)
                if (rep.ok == 0 and not rep.orphaned and rep.corrupt
                        and all(pr.reason in _META_REASONS for pr in rep.corrupt)):
                    # no entry agrees with meta: a damaged meta record is likelier than a tier of foreign
                    # entries, and removing them would empty the tier
                    raise OpsError(f"{str(p)!r}: none of its {rep.checked:,} entries has meta's namespace "
                                   f"{ns.decode(errors='replace')!r} and block size {bb:,} (see verify without "
                                   f"--repair); meta itself may be damaged: nothing was removed")
                for lk in bad:
                    if txn.delete(lk, db=oe.dbs["blocks"]):
                        rep.removed += 1
                    txn.delete(lk, db=oe.dbs["touch"])  # the entry's recency record goes with it
            again = VerifyReport(str(p), rep.namespace, bb)
            with oe.env.begin(buffers=True) as txn, SlotReader(p, bb) as slots:
                _scan(txn, oe.dbs, ns, bb, again, slots)
            rep.after = {"checked": again.checked, "ok": again.ok, "corrupt": len(again.corrupt),
                         "orphaned": len(again.orphaned)}
    rep.seconds = time.perf_counter() - t0
    return rep


# ============================================================================ compact
@dataclass
class CompactReport:
    path: str
    before_bytes: int
    after_bytes: int
    entries: dict[str, int]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["saved_bytes"] = self.before_bytes - self.after_bytes
        return d


def _counts(oe: OpenEnv) -> dict[str, int]:
    with oe.begin() as txn:
        return {name: txn.stat(db)["entries"] for name, db in oe.dbs.items()}


def _try_exclusive_env(p: Path) -> Optional[int]:
    """Take LMDB's own "sole user" lock (a write fcntl lock on byte 0 of lock.mdb) without waiting.

    Returns the open fd (the lock is held while it, or any other fd of this
    process on lock.mdb, stays open), -1 when lock.mdb does not exist, or
    raises :class:`PathInUseError` when another process has the env open.
    """
    lock = p / "lock.mdb"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return -1
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EACCES, errno.EAGAIN):
            raise
        users = [pid for pid in env_users(p) if pid != os.getpid()]
        who = ", ".join(f"pid {u}" for u in users) or "another process"
        raise PathInUseError(f"{str(p)!r}: the LMDB environment is open in {who} (an inspect/verify/export "
                             f"reading it?); compaction needs it to itself, nothing was changed; retry when it is done",
                             str(users[0]) if users else None) from None
    return fd


def compact(path: PathLike, progress: Optional[Callable[[int, int], None]] = None) -> CompactReport:
    """Rewrite the environment compactly and swap it in atomically (see docs/operations.md).

    1. Take the TierManager lock (refuse while it is held) and keep it to the end.
    2. ``env.copy(compact=True)`` into ``PATH/.compact-tmp-<pid>/`` (same filesystem as data.mdb,
       even when PATH is a mount point), fsync it, and check every sub-database's entry count.
    3. Make sure no other process has the environment open (LMDB's own byte-0 lock on lock.mdb),
       hold that lock, ``rename`` the copy over ``PATH/data.mdb``, fsync the directory.
    4. Open the new file in this process while still holding byte 0: LMDB sees itself as the
       sole user and re-initialises lock.mdb from the new data file's meta (the compacted copy
       restarts transaction ids, a stale lock.mdb would point readers at the wrong meta page).

    Killed during 1-2: data.mdb is untouched; a leftover ``.compact-tmp-*`` directory is removed by
    the next compact.  Killed after the rename: the new file is complete and fsynced; lock.mdb is
    stale but nobody has it open, so the next opener is LMDB's first user and re-initialises it.
    """
    t0 = time.perf_counter()
    p = check_env_dir(path)
    with hold_path(p):
        for old in p.glob(COMPACT_TMP_PREFIX + "*"):  # leftovers of a killed compaction (we hold the lock)
            shutil.rmtree(old, ignore_errors=True)
        data = p / "data.mdb"
        before = data.stat().st_size
        tmp = p / f"{COMPACT_TMP_PREFIX}{os.getpid()}"
        tmp.mkdir()
        try:
            with open_readonly(p) as oe:
                check_meta(oe.meta, p)
                counts = _counts(oe)
                with oe.begin() as txn:
                    usage = _page_usage(oe, txn)
                estimate = max(usage["bytes_used"], 1)
                if shutil.disk_usage(p).free < estimate + (16 << 20):
                    raise OpsError(f"{str(p)!r}: not enough free space for the compacted copy "
                                   f"(about {estimate} bytes needed)")
                err: list[BaseException] = []

                def run() -> None:
                    try:
                        oe.env.copy(str(tmp), compact=True)
                    except BaseException as exc:  # reported on the calling thread
                        err.append(exc)

                th = threading.Thread(target=run, name="tiered-kv-compact", daemon=True)
                th.start()
                out = tmp / "data.mdb"
                try:
                    while th.is_alive():
                        th.join(0.05)
                        if progress is not None:
                            with contextlib.suppress(OSError):
                                progress(min(out.stat().st_size, estimate), estimate)
                finally:
                    th.join()   # never close the environment under a running copy (Ctrl-C lands here)
                if err:
                    raise OpsError(f"{str(p)!r}: compacting copy failed: {err[0]}")
            out.stat()  # the copy exists and is complete
            if progress is not None:
                progress(estimate, estimate)
            st = data.stat()
            os.chmod(out, stat.S_IMODE(st.st_mode))
            if (out.stat().st_uid, out.stat().st_gid) != (st.st_uid, st.st_gid):
                try:
                    os.chown(out, st.st_uid, st.st_gid)
                except PermissionError:
                    raise OpsError(f"{str(p)!r}: data.mdb belongs to uid {st.st_uid}; run compact as that user "
                                   f"(or root) so that the TierManager can still open it; nothing was changed") from None
            fsync_path(out)
            fsync_path(tmp, directory=True)
            if not _lmdb_magic_ok(out):
                raise OpsError(f"{str(p)!r}: the compacted copy is not a valid LMDB file; nothing was changed")
            with open_readonly(tmp) as co:
                got = _counts(co)
                check_meta(co.meta, tmp)
            if got != counts:
                raise OpsError(f"{str(p)!r}: the compacted copy holds {got}, the original {counts}; nothing was changed")
            lfd = _try_exclusive_env(p)
            try:
                os.replace(out, data)
                fsync_path(p, directory=True)
                # re-initialise lock.mdb from the new file while we are LMDB's sole user (see above)
                env = _lmdb_open(p, readonly=True, lock=True, subdir=True, max_dbs=MAX_DBS, create=False,
                                 map_size=0, max_readers=MAX_READERS)
                try:
                    dbs = _open_dbs(env, p, create=False)
                    with env.begin() as txn:
                        final = {name: txn.stat(db)["entries"] for name, db in dbs.items()}
                finally:
                    env.close()
            finally:
                if lfd >= 0:
                    os.close(lfd)
            if final != counts:  # pragma: no cover - the copy was checked before the swap
                raise OpsError(f"{str(p)!r}: after the swap the environment holds {final}, expected {counts}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return CompactReport(str(p), before, data.stat().st_size, counts, time.perf_counter() - t0)
