"""Portable, versioned archives of a disk tier's entries (``tiered-kv export`` / ``import``).

An archive pre-warms another node's disk tier.  Layout (all integers little endian)::

    file header
      magic        8s  b"TKVARCH\\0"
      version      H   ARCHIVE_VERSION
      entry_format H   disk.format.FORMAT_VERSION of the entries inside
      flags        I   0
      block_bytes  Q
      created      d   unix time of the export
      ns_len       H
      info_len     I
      namespace    ns_len bytes
      info         info_len bytes of JSON (tiered_kv version, source path, host; informative only)
      checksum     Q   xxh3_64 of everything above
    frames, one per entry, index 0, 1, 2...
      magic        4s  b"TKVF"
      index        Q
      length       I   bytes of the value
      checksum     Q   xxh3_64 of the 16 bytes above + value
      value        the stored LMDB value as is: entry header + namespace + key + payload
                   (so the entry's own xxh3 checksum travels too)
    trailer
      magic        4s  b"TKVE"
      count        Q   number of frames
      value_bytes  Q   sum of the frames' lengths
      digest       Q   xxh3_64 over every frame's bytes in order
      checksum     Q   xxh3_64 of the 28 bytes above
    end of file (anything after the trailer is an error)

Both directions stream with :mod:`aiofiles`: export reads the environment in
one LMDB read transaction (a consistent snapshot, safe beside a live
TierManager in another process) and writes frames with double-buffered
asynchronous writes; import reads frames with asynchronous read-ahead.

Import is all or nothing: a first pass verifies the whole archive (header,
every frame's checksum and the entry inside it with
:func:`~tiered_kv.disk.format.verify_entry`, frame order, trailer) without
touching PATH; only then is the TierManager lock taken and every entry written
in one LMDB write transaction, verifying each frame again as it is written (the
file may have changed since), and committed only after the trailer checked out.
A bad frame therefore publishes nothing, and the error names its index and
byte offset.

Longer than the project's usual 500 lines: the layout above, its writer (export)
and its reader (import) are one versioned contract, kept in one module so that a
format change is one diff that both directions see.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import aiofiles
import lmdb
import xxhash

from ..config import MAX_KEY_BYTES
from ..disk.env import init_meta
from ..disk.format import (FORMAT_VERSION, HEADER_SIZE, CorruptEntry, SlotReader, inline_value, lmdb_key, pack_header,
                           parse_header, verify_entry)
from ..disk.lock import LOCK_NAME
from ..disk.recovery import SEQ_CHECKED, SEQ_LIMIT, U64, removed_why, touch_limit
from ..disk.lock import sync_dirs
from .ops import (OpenEnv, OpsError, PathLike, fsync_path, check_env_dir, check_meta, grow_map,
                  hold_path, open_readonly, open_writable, record_changed, stored_payload)

__all__ = ["ARCHIVE_MAGIC", "ARCHIVE_VERSION", "ArchiveError", "ArchiveHeader", "ExportReport", "ImportReport",
           "export_archive", "import_archive", "export_async", "import_async", "read_header", "scan_archive"]

ARCHIVE_MAGIC = b"TKVARCH\x00"
ARCHIVE_VERSION = 1
FRAME_MAGIC = b"TKVF"
TRAILER_MAGIC = b"TKVE"
_FILE_HDR = struct.Struct("<8sHHIQdHI")   # 36 bytes
_FRAME = struct.Struct("<4sQI")           # 16 bytes, then the checksum
_TRAILER = struct.Struct("<4sQQQ")        # 28 bytes, then the checksum
_SUM = struct.Struct("<Q")
FRAME_OVERHEAD = _FRAME.size + _SUM.size
_MAX_NS = 512            # config's namespace limit
_MAX_KEY = MAX_KEY_BYTES  # config's max_key_bytes limit
_MAX_INFO = 1 << 20
CHUNK = 1 << 20          # aiofiles read size
WRITE_CHUNK = 4 << 20    # bytes of frames gathered per aiofiles write


class ArchiveError(OpsError):
    """The archive is unreadable, truncated or corrupt; ``frame`` is the bad frame's index (None: header/trailer)."""

    def __init__(self, message: str, frame: Optional[int] = None, offset: Optional[int] = None) -> None:
        super().__init__(message)
        self.frame = frame
        self.offset = offset


@dataclass(frozen=True)
class ArchiveHeader:
    version: int
    entry_format: int
    block_bytes: int
    created: float
    namespace: bytes
    info: dict[str, Any]
    size: int             # bytes of the file header

    @property
    def namespace_str(self) -> str:
        return self.namespace.decode(errors="replace")


def pack_file_header(namespace: bytes, block_bytes: int, created: float, info: dict[str, Any]) -> bytes:
    info_b = json.dumps(info, sort_keys=True).encode()
    head = _FILE_HDR.pack(ARCHIVE_MAGIC, ARCHIVE_VERSION, FORMAT_VERSION, 0, block_bytes, created,
                          len(namespace), len(info_b)) + namespace + info_b
    return head + _SUM.pack(xxhash.xxh3_64_intdigest(head))


def pack_frame(index: int, value: bytes) -> bytes:
    head = _FRAME.pack(FRAME_MAGIC, index, len(value))
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(value)
    return head + _SUM.pack(h.intdigest()) + value


def pack_trailer(count: int, value_bytes: int, digest: int) -> bytes:
    body = _TRAILER.pack(TRAILER_MAGIC, count, value_bytes, digest)
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


# ============================================================================ reading
class _Reader:
    """Buffered asynchronous reads over an aiofiles file, with one read ahead in flight."""

    def __init__(self, f: Any, progress: Optional[Callable[[int], None]] = None) -> None:
        self.f = f
        self.buf = bytearray()
        self.off = 0          # consumed bytes of buf
        self.pos = 0          # file offset of buf[off]
        self.eof = False
        self._ahead: Optional[asyncio.Future[bytes]] = None
        self._progress = progress

    async def _fill(self) -> None:
        fut = self._ahead if self._ahead is not None else asyncio.ensure_future(self.f.read(CHUNK))
        self._ahead = None
        data = await fut
        if not data:
            self.eof = True
            return
        if self.off > (len(self.buf) >> 1):
            del self.buf[:self.off]
            self.off = 0
        self.buf += data
        self._ahead = asyncio.ensure_future(self.f.read(CHUNK))   # overlap the next read with parsing

    async def read(self, n: int) -> bytes:
        """Up to ``n`` bytes (fewer only at end of file)."""
        while len(self.buf) - self.off < n and not self.eof:
            await self._fill()
        out = bytes(self.buf[self.off:self.off + n])
        self.off += len(out)
        self.pos += len(out)
        if self._progress is not None:
            self._progress(self.pos)
        return out

    async def at_eof(self) -> bool:
        if len(self.buf) - self.off:
            return False
        if not self.eof:
            await self._fill()
        return self.eof and len(self.buf) == self.off

    async def close(self) -> None:
        if self._ahead is not None:
            try:
                await self._ahead
            except Exception:
                pass
            self._ahead = None


async def _read_header(r: _Reader, name: str) -> ArchiveHeader:
    raw = await r.read(_FILE_HDR.size)
    if len(raw) < 8 or raw[:8] != ARCHIVE_MAGIC:
        raise ArchiveError(f"{name}: not a tiered_kv archive (bad magic)")
    if len(raw) < _FILE_HDR.size:
        raise ArchiveError(f"{name}: truncated inside the file header")
    magic, version, entry_format, _flags, bb, created, ns_len, info_len = _FILE_HDR.unpack(raw)
    if version != ARCHIVE_VERSION:
        raise ArchiveError(f"{name}: archive version {version}; this tiered_kv reads version {ARCHIVE_VERSION}")
    if ns_len == 0 or ns_len > _MAX_NS or info_len > _MAX_INFO:
        raise ArchiveError(f"{name}: corrupt file header (namespace length {ns_len}, info length {info_len})")
    rest = await r.read(ns_len + info_len + _SUM.size)
    if len(rest) < ns_len + info_len + _SUM.size:
        raise ArchiveError(f"{name}: truncated inside the file header")
    (stored,) = _SUM.unpack_from(rest, ns_len + info_len)
    if xxhash.xxh3_64_intdigest(raw + rest[:ns_len + info_len]) != stored:
        raise ArchiveError(f"{name}: file header checksum mismatch")
    try:
        info = json.loads(rest[ns_len:ns_len + info_len] or b"{}")
    except (ValueError, RecursionError):   # descriptive only: a damaged one is dropped (nested past the parser too)
        info = {}
    if bb <= 0:
        raise ArchiveError(f"{name}: corrupt file header (block_bytes {bb})")
    return ArchiveHeader(version, entry_format, bb, created, bytes(rest[:ns_len]), info,
                         _FILE_HDR.size + ns_len + info_len + _SUM.size)


@dataclass
class _Frame:
    index: int
    offset: int
    value: bytes
    header: Any   # diskformat.EntryHeader


@dataclass
class _Summary:
    frames: int = 0
    value_bytes: int = 0
    near: int = SEQ_CHECKED   # collect the sequence numbers this high ...
    high: list[int] = field(default_factory=list)   # ... (import renumbers those SEQ_CHECKED or more, and below)


async def _frames(r: _Reader, hdr: ArchiveHeader, name: str, summary: _Summary) -> AsyncIterator[_Frame]:
    """Yield every verified frame; check the trailer and end of file; raise :class:`ArchiveError`."""
    max_len = HEADER_SIZE + _MAX_NS + _MAX_KEY + hdr.block_bytes
    digest = xxhash.xxh3_64()
    index = 0
    while True:
        off = r.pos
        magic = await r.read(4)
        if len(magic) < 4:
            raise ArchiveError(f"{name}: truncated at frame {index} (offset {off}): the archive ends before its "
                               f"trailer", index, off)
        if magic == TRAILER_MAGIC:
            rest = await r.read(_TRAILER.size - 4 + _SUM.size)
            if len(rest) < _TRAILER.size - 4 + _SUM.size:
                raise ArchiveError(f"{name}: truncated inside the trailer (offset {off})", None, off)
            body = magic + rest[:_TRAILER.size - 4]
            (stored,) = _SUM.unpack_from(rest, _TRAILER.size - 4)
            if xxhash.xxh3_64_intdigest(body) != stored:
                raise ArchiveError(f"{name}: trailer checksum mismatch (offset {off})", None, off)
            _m, count, value_bytes, dig = _TRAILER.unpack(body)
            if count != index:
                raise ArchiveError(f"{name}: trailer says {count} frames, the archive holds {index}", None, off)
            if value_bytes != summary.value_bytes or dig != digest.intdigest():
                raise ArchiveError(f"{name}: trailer digest does not match the frames (reordered or altered frames)",
                                   None, off)
            if not await r.at_eof():
                raise ArchiveError(f"{name}: unexpected bytes after the trailer (offset {r.pos})", None, r.pos)
            return
        if magic != FRAME_MAGIC:
            raise ArchiveError(f"{name}: frame {index} (offset {off}) is corrupt: bad frame magic {magic!r}", index, off)
        rest = await r.read(FRAME_OVERHEAD - 4)
        if len(rest) < FRAME_OVERHEAD - 4:
            raise ArchiveError(f"{name}: truncated inside frame {index} (offset {off})", index, off)
        head = magic + rest[:_FRAME.size - 4]
        _m, fidx, length = _FRAME.unpack(head)
        (stored,) = _SUM.unpack_from(rest, _FRAME.size - 4)
        if length > max_len:
            raise ArchiveError(f"{name}: frame {index} (offset {off}) is corrupt: length {length} exceeds "
                               f"{max_len}", index, off)
        value = await r.read(length)
        if len(value) < length:
            raise ArchiveError(f"{name}: truncated inside frame {index} (offset {off}): {len(value)} of {length} "
                               f"bytes", index, off)
        h = xxhash.xxh3_64()
        h.update(head)
        h.update(value)
        if h.intdigest() != stored:
            raise ArchiveError(f"{name}: frame {index} (offset {off}) is corrupt: frame checksum mismatch", index, off)
        if fidx != index:
            raise ArchiveError(f"{name}: frame {index} (offset {off}) is out of order: it says index {fidx}", index, off)
        try:
            eh = verify_entry(value, hdr.namespace, None, hdr.block_bytes)
        except CorruptEntry as exc:
            raise ArchiveError(f"{name}: frame {index} (offset {off}): its entry fails verification ({exc})",
                               index, off) from None
        if not eh.key:   # no TierManager writes one (and LMDB refuses the empty key it maps to)
            raise ArchiveError(f"{name}: frame {index} (offset {off}): its entry has an empty key", index, off)
        if eh.seq >= SEQ_LIMIT:   # what recovery deletes (no writer numbers that many writes)
            raise ArchiveError(f"{name}: frame {index} (offset {off}): its entry's sequence number {eh.seq} is past "
                               f"what any writer reaches ({SEQ_LIMIT})", index, off)
        digest.update(head)
        digest.update(rest[_FRAME.size - 4:])
        digest.update(value)
        summary.frames += 1
        summary.value_bytes += length
        if eh.seq >= summary.near:
            summary.high.append(eh.seq)
        yield _Frame(index, off, value, eh)
        index += 1


async def read_header(archive: PathLike) -> ArchiveHeader:
    name = str(archive)
    async with _open_archive(archive) as f:
        r = _Reader(f)
        try:
            return await _read_header(r, name)
        finally:
            await r.close()


class _open_archive:
    def __init__(self, archive: PathLike) -> None:
        self.path = Path(archive)
        self._cm: Any = None

    async def __aenter__(self) -> Any:
        if not self.path.exists():
            raise OpsError(f"archive {str(self.path)!r} does not exist")
        if not self.path.is_file():
            raise OpsError(f"archive {str(self.path)!r} is not a regular file")
        try:
            self._cm = aiofiles.open(self.path, "rb")
            return await self._cm.__aenter__()
        except OSError as exc:
            raise OpsError(f"archive {str(self.path)!r} cannot be read: {exc.strerror}") from None

    async def __aexit__(self, *exc: Any) -> None:
        await self._cm.__aexit__(*exc)


async def scan_archive(archive: PathLike, progress: Optional[Callable[[int], None]] = None) -> tuple[ArchiveHeader, int, int]:
    """Verify a whole archive without using it: (header, frames, value bytes), or :class:`ArchiveError`."""
    hdr, s = await _scan(archive, progress)
    return hdr, s.frames, s.value_bytes


async def _scan(archive: PathLike, progress: Optional[Callable[[int], None]] = None,
                near: int = SEQ_CHECKED) -> tuple[ArchiveHeader, _Summary]:
    """Verify the whole archive; its summary collects the sequence numbers ``near`` or more."""
    name = str(archive)
    async with _open_archive(archive) as f:
        r = _Reader(f, progress)
        try:
            hdr = await _read_header(r, name)
            s = _Summary(near=near)
            async with contextlib.aclosing(_frames(r, hdr, name, s)) as frames:
                async for _ in frames:
                    pass
            return hdr, s
        finally:
            await r.close()


# ============================================================================ export
@dataclass
class ExportReport:
    path: str
    out: str
    namespace: str
    block_bytes: int
    frames: int = 0
    value_bytes: int = 0
    archive_bytes: int = 0
    skipped_corrupt: int = 0
    skipped_orphaned: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def export_async(path: PathLike, namespace: str, out: PathLike,
                       progress: Optional[Callable[[int, int], None]] = None) -> ExportReport:
    """Write every valid entry of ``path`` (namespace ``namespace``) to the archive ``out``.

    Read-only on ``path`` (safe beside a live TierManager in another process).
    Corrupt entries and entries written under a tombstoned token are skipped
    and counted, never exported.  ``out`` is written as ``out.partial-PID``
    then renamed, so a failed export never leaves a file named ``out``.
    """
    t0 = time.perf_counter()
    outp = Path(out)
    if outp.exists():
        raise OpsError(f"{str(outp)!r} already exists; remove it or choose another name")
    if not outp.parent.is_dir():
        raise OpsError(f"{str(outp.parent)!r} is not a directory")
    with open_readonly(path) as oe:
        ns, bb = check_meta(oe.meta, oe.path)
        if namespace.encode() != ns:
            raise OpsError(f"{str(oe.path)!r} holds namespace {ns.decode(errors='replace')!r}, not {namespace!r}")
        rep = ExportReport(str(oe.path), str(outp), namespace, bb)
        tmp = outp.with_name(f"{outp.name}.partial-{os.getpid()}")
        from .. import __version__
        info = {"tiered_kv": __version__, "source_path": str(oe.path.resolve()), "host": socket.gethostname()}
        try:
            async with aiofiles.open(tmp, "xb") as f:
                pending: Optional[asyncio.Future[Any]] = None   # the write in flight while the next chunk is built
                try:
                    buf: list[bytes] = [pack_file_header(ns, bb, time.time(), info)]
                    nbuf = len(buf[0])
                    digest = xxhash.xxh3_64()
                    unsure: list[tuple[bytes, bytes]] = []   # corrupt, unless rewritten: told once the txn ended
                    with oe.begin(buffers=True) as txn, SlotReader(oe.path, bb) as slots:
                        tombs = {bytes(k) for k, _ in txn.cursor(db=oe.dbs["tombs"])}
                        total = txn.stat(oe.dbs["blocks"])["entries"]
                        limit = touch_limit(_top_seq(txn, oe.dbs["blocks"], ns, bb, slots, tombs))
                        for lk, v in txn.cursor(db=oe.dbs["blocks"]):
                            payload = stored_payload(v, bb, slots)
                            try:
                                h = verify_entry(v, ns, None, bb, payload)
                            except CorruptEntry:
                                # skipped either way; counted as corrupt unless rewritten meanwhile (which cannot
                                # be told while the map grew under this transaction: asked again after it)
                                moved = record_changed(oe, bytes(lk), v)
                                if moved is None:
                                    unsure.append((bytes(lk), bytes(v)))
                                elif not moved:
                                    rep.skipped_corrupt += 1
                                continue
                            why = removed_why(h, bytes(lk), ns, bb, tombs, lambda: True)   # (verified above)
                            if why == "tombstoned":
                                rep.skipped_orphaned += 1
                                continue
                            if why is not None:
                                rep.skipped_corrupt += 1
                                continue
                            # frames carry self-contained inline entries (the payload inside), with the
                            # entry's recency: a promote's touch record is newer than the write (recovery
                            # orders the LRU by the newer of the two; the archive has no touch records).  A
                            # touch record has no checksum: one recovery would drop as damage is not signed in
                            t = txn.get(lk, db=oe.dbs["touch"])
                            touched = U64.unpack(bytes(t))[0] if t is not None and len(t) == U64.size else 0
                            if touched >= limit:
                                touched = 0
                            if payload is None and touched <= h.seq:
                                value = bytes(v)
                            else:
                                value = inline_value(v, payload, max(h.seq, touched))
                            frame = pack_frame(rep.frames, value)
                            digest.update(frame)
                            buf.append(frame)
                            nbuf += len(frame)
                            rep.frames += 1
                            rep.value_bytes += len(value)
                            if nbuf >= WRITE_CHUNK:
                                if pending is not None:
                                    await pending
                                pending = asyncio.ensure_future(f.write(b"".join(buf)))
                                buf, nbuf = [], 0
                                if progress is not None:
                                    progress(rep.frames + rep.skipped_corrupt + rep.skipped_orphaned, total)
                    rep.skipped_corrupt += sum(1 for lk, v in unsure if not record_changed(oe, lk, v))
                    buf.append(pack_trailer(rep.frames, rep.value_bytes, digest.intdigest()))
                    if pending is not None:
                        p, pending = pending, None
                        await p
                    await f.write(b"".join(buf))
                    await f.flush()
                    await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())
                finally:
                    if pending is not None:   # an error while a write was in flight: let it finish first
                        with contextlib.suppress(Exception):
                            await pending
            try:   # never over a file that appeared at OUT while this ran (OUT must not exist): a link fails then
                os.link(tmp, outp)
                tmp.unlink()
            except FileExistsError:
                raise OpsError(f"{str(outp)!r} already exists (it appeared while the export ran): it was left as "
                               f"it is, nothing was written there") from None
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                if outp.exists():   # a filesystem without hard links: checked, then renamed
                    raise OpsError(f"{str(outp)!r} already exists (it appeared while the export ran): it was left "
                                   f"as it is") from None
                os.replace(tmp, outp)
            fsync_path(outp.parent, directory=True)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        if progress is not None:
            progress(total, total)
    rep.archive_bytes = outp.stat().st_size
    rep.seconds = time.perf_counter() - t0
    return rep


# ============================================================================ import
@dataclass
class ImportReport:
    path: str
    archive: str
    namespace: str                 # namespace the entries were written under in PATH
    archive_namespace: str
    block_bytes: int
    frames: int = 0
    imported: int = 0
    already_present: int = 0       # same key, same writer token: importing twice changes nothing
    kept_existing: int = 0         # same key, another valid writer: the local entry wins
    replaced_corrupt: int = 0      # same key, the local entry failed verification
    skipped_tombstoned: int = 0    # PATH holds a tombstone for the frame's writer token
    created: bool = False          # PATH was created with DiskStore's meta
    namespace_rewritten: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_ALLOWED_IN_NEW = {LOCK_NAME, "lock.mdb"}


def _path_state(p: Path) -> str:
    """"new" (absent, or a directory with nothing of an environment) or "existing"; else :class:`OpsError`."""
    if not p.exists():
        return "new"
    if not p.is_dir():
        raise OpsError(f"{str(p)!r} is not a directory")
    if (p / "data.mdb").exists():
        check_env_dir(p)
        return "existing"
    others = sorted(n.name for n in p.iterdir() if n.name not in _ALLOWED_IN_NEW)
    if others:
        raise OpsError(f"{str(p)!r} exists, is not an LMDB environment and is not empty ({', '.join(others[:5])}); "
                       f"import creates a disk tier only in a new or empty directory")
    return "new"


def _check_compat(meta: dict[str, Any], p: Path, hdr: ArchiveHeader, force_namespace: bool) -> tuple[bytes, bool]:
    """(namespace to write under, whether to rewrite) for an initialised PATH, or :class:`OpsError`."""
    ns, bb = check_meta(meta, p)
    if bb != hdr.block_bytes:
        raise OpsError(f"{str(p)!r} holds blocks of {bb} bytes, the archive {hdr.block_bytes}; refused "
                       f"(no override: blocks of another size are another model layout)")
    if ns != hdr.namespace:
        if not force_namespace:
            raise OpsError(f"{str(p)!r} belongs to namespace {ns.decode(errors='replace')!r}, the archive to "
                           f"{hdr.namespace_str!r}; refused (--force-namespace rewrites the entries' headers)")
        return ns, True
    return ns, False


def _init_meta(txn: Any, oe: OpenEnv, ns: bytes, bb: int) -> None:
    """The meta records DiskStore writes on a fresh path."""
    init_meta(txn, oe.dbs["meta"], ns, bb)


def _renumbering(numbers: list[int]) -> dict[int, int]:
    """An archive's sequence numbers ``SEQ_CHECKED`` or more carried just below it, still the newest and in their
    order: from the top down each number takes the next one free below ``SEQ_CHECKED`` (or keeps its own, lower),
    so those just below ``SEQ_CHECKED`` move down in turn, until one is already below the next free.  ``numbers``:
    every number the archive holds from ``SEQ_CHECKED`` minus its frame count up (none lower can move)."""
    out: dict[int, int] = {}
    free = SEQ_CHECKED - 1
    for seq in sorted(set(numbers), reverse=True):
        if seq <= free:
            break
        out[seq] = free
        free -= 1
    return out


def _top_seq(txn: Any, blocks: Any, ns: bytes, bb: int, slots: SlotReader, tombs: set[bytes]) -> int:
    """The highest sequence number of an entry recovery keeps (not of another namespace or length, not stored under
    another key's LMDB key, not written under a tombstoned token, one numbered ``SEQ_CHECKED`` or more only if it
    verifies): what ``touch_limit`` is measured against, as recovery measures it."""
    top = 0
    for lk, v in txn.cursor(db=blocks):
        try:
            h = parse_header(v)
        except CorruptEntry:
            continue
        if h.seq > top and removed_why(h, bytes(lk), ns, bb, tombs, lambda: _verifies(v, ns, bb, slots)) is None:
            top = h.seq
    return top


def _verifies(v: Any, ns: bytes, bb: int, slots: SlotReader) -> bool:
    try:
        verify_entry(v, ns, None, bb, stored_payload(v, bb, slots))
    except CorruptEntry:
        return False
    return True


async def _import_pass(oe: OpenEnv, archive: Path, hdr0: ArchiveHeader, rep: ImportReport, init_meta: bool,
                       target_ns: bytes, rewrite: bool, progress: Optional[Callable[[int], None]],
                       renumber: Optional[dict[int, int]] = None) -> None:
    """One write transaction with every frame; committed only after the trailer checked out.  ``renumber``: the
    new number of each sequence number that moves (:func:`_renumbering`, from pass 1); every other keeps its own."""
    name = str(archive)
    dbs = oe.dbs
    bb = hdr0.block_bytes
    async with _open_archive(archive) as f:
        r = _Reader(f, progress)
        slots = SlotReader(oe.path, bb)   # to verify entries already there (imported ones stay inline)
        txn = oe.env.begin(write=True, buffers=True)
        try:
            hdr = await _read_header(r, name)
            if (hdr.namespace, hdr.block_bytes, hdr.entry_format) != (hdr0.namespace, hdr0.block_bytes, hdr0.entry_format):
                raise ArchiveError(f"{name}: the archive changed while it was imported; nothing was imported")
            if init_meta:
                _init_meta(txn, oe, target_ns, bb)
            s = _Summary()
            counts = dict.fromkeys(("imported", "already_present", "kept_existing", "replaced_corrupt",
                                    "skipped_tombstoned"), 0)
            async with contextlib.aclosing(_frames(r, hdr, name, s)) as frames:
                async for fr in frames:
                    eh = fr.header
                    value = fr.value
                    # a number SEQ_CHECKED or more (from a source whose writer got there) is carried just below it:
                    # the destination's writer resumes from the highest, and one that high would number its own
                    # writes past what recovery keeps; they were the source's newest and stay the newest here, in
                    # their order
                    seq = (renumber or {}).get(eh.seq, eh.seq if eh.seq < SEQ_CHECKED else SEQ_CHECKED - 1)
                    if rewrite or seq != eh.seq:
                        payload = value[eh.payload_offset:]
                        value = pack_header(target_ns, eh.key, eh.token, payload, seq) + payload
                    lk = lmdb_key(eh.key)
                    if txn.get(eh.token.bytes, db=dbs["tombs"]) is not None:
                        counts["skipped_tombstoned"] += 1
                        continue
                    old = txn.get(lk, db=dbs["blocks"])
                    if old is not None:
                        try:
                            oh = verify_entry(old, target_ns, eh.key, bb, stored_payload(old, bb, slots))
                        except CorruptEntry:
                            oh = None
                        if oh is not None and txn.get(oh.token.bytes, db=dbs["tombs"]) is not None:
                            oh = None   # written under a tombstoned token: the next open purges it
                        if oh is not None and oh.seq >= SEQ_LIMIT:
                            oh = None   # numbered past what any writer reaches: the next open deletes it
                        if oh is not None:
                            counts["already_present" if oh.token == eh.token else "kept_existing"] += 1
                            continue
                        counts["replaced_corrupt"] += 1
                    txn.put(lk, value, db=dbs["blocks"])
                    txn.delete(lk, db=dbs["touch"])
                    counts["imported"] += 1 if old is None else 0
            txn.commit()
        except BaseException:
            txn.abort()
            raise
        finally:
            slots.close()
            await r.close()
    rep.frames = s.frames
    for k, v in counts.items():
        setattr(rep, k, v)


async def import_async(path: PathLike, archive: PathLike, force_namespace: bool = False,
                       progress: Optional[Callable[[str, int, int], None]] = None) -> ImportReport:
    """Import every entry of ``archive`` into the disk tier at ``path`` (created if new); all or nothing.

    An existing PATH: the TierManager lock is taken first (refused while held)
    and kept to the end; the archive's header is checked against PATH's meta;
    pass 1 verifies the whole archive; pass 2 writes it in one transaction.  A
    new PATH: pass 1 runs before anything is created, then PATH is created and
    locked, initialised with DiskStore's meta in the same transaction as the
    entries, and removed again if pass 2 fails.
    ``progress(phase, done_bytes, total_bytes)``, phase "verify" then "import".
    """
    t0 = time.perf_counter()
    p = Path(path)
    a = Path(archive)
    state = _path_state(p)
    total = a.stat().st_size if a.is_file() else 0
    on_verify = None if progress is None else (lambda n: progress("verify", n, total))
    on_import = None if progress is None else (lambda n: progress("import", n, total))
    with contextlib.ExitStack() as stack:
        if state == "existing":
            stack.enter_context(hold_path(p))
        hdr = await read_header(a)
        if hdr.entry_format != FORMAT_VERSION:
            raise ArchiveError(f"{str(a)!r} holds entries of format version {hdr.entry_format}; this tiered_kv "
                               f"writes version {FORMAT_VERSION}")
        if state == "existing":
            with open_readonly(p) as oe:
                with oe.begin() as txn:
                    empty = txn.stat(oe.dbs["blocks"])["entries"] == 0
                if not (oe.meta.get("format_version") is None and empty):   # else: initialised below, like DiskStore
                    _check_compat(oe.meta, p, hdr, force_namespace)
        # pass 1: verify everything before anything is written
        _, scanned = await _scan(a, on_verify)
        if scanned.high:   # (rare) the numbers just below SEQ_CHECKED they are carried onto: verified once more
            _, scanned = await _scan(a, None, SEQ_CHECKED - scanned.frames)
        renumber = _renumbering(scanned.high)
        dirs: list[Path] = []   # the directories this import created, in the order it created them
        made: list[Path] = []
        if state == "new":
            if not p.exists():
                try:
                    _mkdirs(p.absolute(), dirs)
                except OSError as exc:
                    _rmdirs(dirs)
                    raise OpsError(f"{str(p)!r} cannot be created: {exc.strerror}") from None
            made = [p / n for n in ("data.mdb", "lock.mdb", LOCK_NAME) if not (p / n).exists()]
        try:
            if state == "new":
                try:
                    stack.enter_context(hold_path(p))
                except BaseException:
                    # refused: whoever holds the path now (a TierManager started meanwhile) owns what is
                    # in it, the directory and files this call made included -- nothing is removed
                    dirs, made = [], []
                    raise
                state = _path_state(p)   # again, under the lock: a TierManager may have created it meanwhile
                if state == "existing":   # its tier: nothing is removed if this import fails
                    made, dirs = [], []
            need = 2 * total + (16 << 20)
            with open_writable(p, extra_bytes=need, create=state == "new") as oe:
                init = oe.meta.get("format_version") is None
                if init:
                    with oe.env.begin() as txn:
                        if txn.stat(oe.dbs["blocks"])["entries"]:
                            check_meta(oe.meta, p)  # raises: entries without meta is not ours to fix
                    target_ns, rewrite = hdr.namespace, False
                else:
                    target_ns, rewrite = _check_compat(oe.meta, p, hdr, force_namespace)
                rep = ImportReport(str(p), str(a), target_ns.decode(errors="replace"), hdr.namespace_str,
                                   hdr.block_bytes, created=init, namespace_rewritten=rewrite)
                for attempt in range(4):
                    try:
                        await _import_pass(oe, a, hdr, rep, init, target_ns, rewrite, on_import, renumber)
                        break
                    except lmdb.MapFullError:
                        if attempt == 3 or not grow_map(oe, need):
                            raise OpsError(f"{str(p)!r}: not enough disk space for the import; "
                                           f"nothing was imported") from None
        except BaseException:
            for f in made:
                with contextlib.suppress(OSError):
                    f.unlink()
            _rmdirs(dirs)
            raise
    if dirs or made:
        # the new files' directory entries, and each directory this call made, survive a crash too (LMDB's
        # commit syncs its file, not the entry naming it): each parent up to the first that existed
        sync_dirs(p.absolute(), (dirs[0] if dirs else p.absolute()).parent)
    rep.seconds = time.perf_counter() - t0
    return rep


def _mkdirs(d: Path, made: list[Path]) -> None:
    """``d`` and its missing parents, as ``mkdir -p`` makes them, each directory this call created appended to
    ``made`` (a path through ``..`` names directories its parents' chain by name does not: only what ``mkdir``
    made is recorded)."""
    for first in (True, False):
        try:
            d.mkdir()
        except FileNotFoundError:
            if not first or d.parent == d:
                raise
            _mkdirs(d.parent, made)   # then this one again
            continue
        except FileExistsError:
            if not d.is_dir():
                raise
            return
        made.append(d)
        return


def _rmdirs(made: list[Path]) -> None:
    """The directories :func:`_mkdirs` made, newest first, each only while empty: another process may have put
    something in one meanwhile (a sibling tier under the same new parent), which is not this call's to remove."""
    for d in reversed(made):
        with contextlib.suppress(OSError):   # (not empty: kept, with the directories above it that hold it)
            d.rmdir()


# ============================================================================ sync wrappers
def export_archive(path: PathLike, namespace: str, out: PathLike,
                   progress: Optional[Callable[[int, int], None]] = None) -> ExportReport:
    return asyncio.run(export_async(path, namespace, out, progress))


def import_archive(path: PathLike, archive: PathLike, force_namespace: bool = False,
                   progress: Optional[Callable[[str, int, int], None]] = None) -> ImportReport:
    return asyncio.run(import_async(path, archive, force_namespace, progress))
