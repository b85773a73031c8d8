"""On-disk format of the disk tier: entry headers, meta records, tombstones.

A stored entry (sub-database ``blocks``, LMDB key = :func:`lmdb_key`) is::

    header (52 bytes, little endian)        then namespace, key, and either
      magic    4s  b"TKVB"                    the payload     (flags 0: inline)
      version  H   FORMAT_VERSION             or a slot number (flags FLAG_SLOT)
      flags    H   0 or FLAG_SLOT
      ns_len   H
      key_len  H
      length   Q   payload bytes
      seq      Q   writer sequence number (recency across restarts)
      token    16s writer token (UUID bytes)
      -- then --
      checksum Q   xxh3_64 over header[0:44] + namespace + key + payload

The writer stores payloads in fixed-size slots of a preallocated data file
(:data:`SLOTS_NAME`, slot ``i`` at byte ``i * slot_bytes``) and only the
header and the slot number (``Q``) in LMDB: LMDB stays the transactional
index, the payload never goes through LMDB's page allocator (whose freelist
fragments under churn) and is written and read with ``pwritev``/``preadv``
straight from and into a host slot.  Inline entries (payload inside the LMDB
value) are still read: ``tiered-kv import`` writes them.

Every read verifies magic, version, namespace, key, length and checksum (over
the payload actually read); any failure is a miss (the entry is removed and
counted as corrupt).
"""

from __future__ import annotations

import os
import struct
import uuid
from typing import NamedTuple, Optional, Union

import xxhash

from ..jobs import uuid_from_int

__all__ = ["FORMAT_VERSION", "HEADER_SIZE", "HEADER_STRUCT", "EntryHeader", "pack_header", "pack_slot_entry",
           "parse_header", "verify_entry", "verify_split", "lmdb_key", "CorruptEntry", "FLAG_SLOT", "SLOTS_NAME",
           "slot_bytes_for", "SlotReader", "inline_value", "where_of", "record_where", "where_slot",
           "slot_payload_verifies", "NO_WHERE"]

FORMAT_VERSION = 2                    # 2: payloads in the slot file (1 kept them in LMDB)
FLAG_SLOT = 1
SLOTS_NAME = "slots.tkv"              # the data file beside data.mdb
SLOT_ALIGN = 4096
_SLOT = struct.Struct("<Q")
MAGIC = b"TKVB"
_HDR = struct.Struct("<4sHHHHQQ16s")  # 44 bytes
HEADER_STRUCT = _HDR                  # the fixed fields, for tools that read damaged headers
_SUM = struct.Struct("<Q")
HEADER_SIZE = _HDR.size + _SUM.size   # 52
MAX_LMDB_KEY = 480                    # below LMDB's default 511-byte key limit

Buffer = Union[bytes, bytearray, memoryview]


class CorruptEntry(Exception):
    """An entry failed verification; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class EntryHeader(NamedTuple):
    """The parsed fixed fields of a stored entry (immutable; a tuple, built on every read)."""

    namespace: bytes
    key: bytes
    token: uuid.UUID
    length: int
    seq: int
    payload_offset: int     # inline entries: where the payload starts in the value; slot entries: -1
    slot: int = -1          # slot entries: the slot number in the data file; inline entries: -1

    @property
    def in_slot(self) -> bool:
        return self.slot >= 0


def slot_bytes_for(block_bytes: int) -> int:
    """A slot's size in the data file: the block rounded up to whole 4 KiB pages."""
    return -(-block_bytes // SLOT_ALIGN) * SLOT_ALIGN


def lmdb_key(key: bytes) -> bytes:
    """The LMDB key of a block key: itself if short, else a 128-bit digest.

    A digest collision can only cause a miss: the header stores the full key
    and every read compares it.
    """
    if len(key) <= MAX_LMDB_KEY:
        return key
    return b"\xff#" + xxhash.xxh3_128_digest(key)


def pack_header(namespace: bytes, key: bytes, token: uuid.UUID, payload: Buffer, seq: int, flags: int = 0) -> bytes:
    """Header + namespace + key for ``payload`` (the payload itself is appended by the caller)."""
    head = _fixed(flags, namespace, key, len(payload), seq, token)
    return head + _SUM.pack(_checksum(head, namespace, key, payload)) + namespace + key


def _fixed(flags: int, namespace: bytes, key: bytes, length: int, seq: int, token: uuid.UUID) -> bytes:
    """The header's fixed fields (the checksum's first input)."""
    return _HDR.pack(MAGIC, FORMAT_VERSION, flags, len(namespace), len(key), length, seq, token.bytes)


def _checksum(head: Buffer, namespace: Buffer, key: Buffer, payload: Buffer) -> int:
    """The stored checksum: xxh3-64 over the fixed fields, the namespace, the key and the payload."""
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(namespace)
    h.update(key)
    h.update(payload)
    return h.intdigest()


def pack_slot_entry(namespace: bytes, key: bytes, token: uuid.UUID, payload: Buffer, seq: int, slot: int) -> bytes:
    """The whole LMDB value of an entry whose ``payload`` lies in data-file slot ``slot``."""
    return pack_header(namespace, key, token, payload, seq, FLAG_SLOT) + _SLOT.pack(slot)


# ---- where a slot entry's payload lies, and what its record says, as one int the owner keeps per disk entry
#: no known slot record (an inline entry, or not told): read through the disk I/O side only
NO_WHERE = 0
_W64 = (1 << 64) - 1


def where_of(value: Buffer, header: Optional[EntryHeader] = None) -> int:
    """A slot entry's record (its LMDB value) reduced to what a reader that knows the namespace, key,
    token and length needs to read and verify the payload: the slot, the sequence number and the
    checksum, as one int (``(slot + 1) << 128 | seq << 64 | checksum``; never :data:`NO_WHERE`).
    :data:`NO_WHERE` for an inline entry or one that does not parse (a reader then asks the store).
    ``header``: what :func:`parse_header` returned for this same ``value``, not parsed again."""
    try:
        h = parse_header(value) if header is None else header
    except CorruptEntry:
        return NO_WHERE
    if not h.in_slot:
        return NO_WHERE
    return record_where(value, h.slot, h.seq)


def record_where(value: Buffer, slot: int, seq: int) -> int:
    """:func:`where_of` of a slot record whose slot and sequence number the caller has (the writer, which
    packed it): nothing parsed."""
    (stored,) = _SUM.unpack_from(value, _HDR.size)
    return (slot + 1) << 128 | seq << 64 | stored


def where_slot(where: int) -> int:
    """The data-file slot of a :func:`where_of` value (not :data:`NO_WHERE`)."""
    return (where >> 128) - 1


def slot_payload_verifies(namespace: bytes, key: bytes, token: uuid.UUID, where: int, payload: Buffer) -> bool:
    """True when ``payload`` is exactly what was written for this namespace, key and writer token under
    the record :func:`where_of` reduced: :func:`verify_entry` of that record made again with these
    fields, without building and parsing it (the owner's page-cache reads, ``disk/cached.py``)."""
    head = _fixed(FLAG_SLOT, namespace, key, len(payload), (where >> 64) & _W64, token)
    return _checksum(head, namespace, key, payload) == where & _W64


def inline_value(value: Buffer, payload: Optional[Buffer], seq: Optional[int] = None) -> bytes:
    """The inline form of an entry (same header fields and checksum input, payload inside).

    For tools that must hand out self-contained entries (``tiered-kv
    export``).  The checksum is recomputed over the flags change only after
    the payload was verified against the stored one by the caller.  ``payload``:
    a slot entry's bytes (None for an entry inline already); ``seq``: a newer
    sequence number to carry instead of the write's (its recency: a touch record).
    """
    h = parse_header(value)
    new_seq = h.seq if seq is None else seq
    if not h.in_slot:
        if new_seq == h.seq:
            return bytes(value)
        payload = memoryview(value)[h.payload_offset:h.payload_offset + h.length]
    assert payload is not None
    return pack_header(h.namespace, h.key, h.token, payload, new_seq) + bytes(payload)


def parse_header(value: Buffer, apart: int = 0) -> EntryHeader:
    """Parse without verifying the checksum (for tools and recovery scans).

    ``apart``: an inline entry's payload was read apart from ``value`` (which holds the header,
    namespace and key only), this many bytes of it.
    """
    if len(value) < HEADER_SIZE:
        raise CorruptEntry("truncated", f"{len(value)} bytes < header {HEADER_SIZE}")
    magic, version, flags, ns_len, key_len, length, seq, token = _HDR.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad_magic", repr(bytes(magic)))
    if version != FORMAT_VERSION:
        raise CorruptEntry("bad_version", str(version))
    if flags & ~FLAG_SLOT:
        raise CorruptEntry("bad_flags", f"{flags:#x}")
    off = HEADER_SIZE
    ns = bytes(value[off:off + ns_len])
    k = bytes(value[off + ns_len:off + ns_len + key_len])
    end = off + ns_len + key_len
    tok = uuid_from_int(int.from_bytes(token, "big"))   # the struct guarantees its 16 bytes
    if flags & FLAG_SLOT:
        if len(value) != end + _SLOT.size:
            raise CorruptEntry("truncated", f"{len(value)} bytes, a slot entry has {end + _SLOT.size}")
        (slot,) = _SLOT.unpack_from(value, end)
        if slot >= 1 << 48:
            raise CorruptEntry("bad_slot", str(slot))
        return EntryHeader(ns, k, tok, length, seq, -1, slot)
    if len(value) + apart != end + length:
        raise CorruptEntry("truncated", f"{len(value) + apart} bytes, header says {end + length}")
    return EntryHeader(ns, k, tok, length, seq, end)


def verify_entry(value: Buffer, namespace: bytes, key: Optional[bytes], length: Optional[int] = None,
                 payload: Optional[Buffer] = None, header: Optional[EntryHeader] = None) -> EntryHeader:
    """Verify ``value`` completely; return its header or raise :class:`CorruptEntry`.

    A slot entry needs its ``payload`` (the bytes read from its slot); an
    inline entry's payload is inside ``value``.  ``header``: what
    :func:`parse_header` returned for this same ``value`` (a reader that
    parsed it to find the slot), not parsed again.
    """
    hdr = parse_header(value) if header is None else header
    h, stored, mv = _check_fields(hdr, value, namespace, key, length)
    if hdr.in_slot:
        if payload is None:   # e.g. a slot entry inside an archive, which must hold inline entries
            raise CorruptEntry("slot_entry", f"slot {hdr.slot}: the payload is not here")
        if len(payload) != hdr.length:
            raise CorruptEntry("truncated", f"slot {hdr.slot}: read {len(payload)} of {hdr.length} bytes")
        h.update(mv[HEADER_SIZE:len(mv) - _SLOT.size])
        h.update(payload)
    else:
        h.update(mv[HEADER_SIZE:])
    if h.intdigest() != stored:
        raise CorruptEntry("checksum", f"stored {stored:#x}")
    return hdr


def verify_split(head: Buffer, payload: Buffer, namespace: bytes, key: bytes, length: int) -> EntryHeader:
    """:func:`verify_entry` of an inline entry read in two pieces: ``head`` (header, namespace and key)
    and ``payload`` (its bytes, read straight into a host slot by the remote tier's reader).  The
    header's length must be ``length`` (the payload's) and the head and payload together as long as
    the header says, so the header's namespace and key end exactly where ``head`` does whenever this
    returns: a value of another layout that happens to have the same total length is refused."""
    hdr = parse_header(head, apart=len(payload))
    h, stored, mv = _check_fields(hdr, head, namespace, key, length)
    h.update(mv[HEADER_SIZE:])
    h.update(payload)
    if h.intdigest() != stored:
        raise CorruptEntry("checksum", f"stored {stored:#x}")
    return hdr


def _check_fields(hdr: EntryHeader, value: Buffer, namespace: bytes, key: Optional[bytes],
                  length: Optional[int]) -> tuple["xxhash.xxh3_64", int, memoryview]:
    """Namespace, key and length checked; (the checksum's hasher fed the fixed fields, the stored sum, a view of ``value``)."""
    if hdr.namespace != namespace:
        raise CorruptEntry("wrong_namespace", repr(hdr.namespace))
    if key is not None and hdr.key != key:
        raise CorruptEntry("wrong_key", repr(hdr.key))
    if length is not None and hdr.length != length:
        raise CorruptEntry("wrong_length", f"{hdr.length} != {length}")
    (stored,) = _SUM.unpack_from(value, _HDR.size)
    mv = memoryview(value)
    h = xxhash.xxh3_64()
    h.update(mv[:_HDR.size])
    return h, stored, mv


class SlotReader:
    """Read-only access to a disk tier's slot file, for the operator tools.

    ``payload(h)`` returns a slot entry's bytes: short (empty without a slot
    file) when the file is truncated, so that :func:`verify_entry` reports it.
    """

    def __init__(self, directory: Union[str, "os.PathLike[str]"], block_bytes: int) -> None:
        self.slot_bytes = slot_bytes_for(block_bytes)
        try:
            self._fd = os.open(os.path.join(directory, SLOTS_NAME), os.O_RDONLY)
        except FileNotFoundError:
            self._fd = -1

    def payload(self, h: EntryHeader) -> bytes:
        if self._fd < 0:
            return b""
        off = h.slot * self.slot_bytes
        if off >= os.fstat(self._fd).st_size:
            return b""   # a slot past the end (a damaged slot number): truncated, not an OverflowError
        return os.pread(self._fd, h.length, off)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SlotReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
