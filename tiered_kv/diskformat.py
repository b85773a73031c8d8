"""On-disk format of the disk tier: entry headers, meta records, tombstones.

A stored entry (sub-database ``blocks``, LMDB key = :func:`lmdb_key`) is::

    header (48 bytes, little endian)        then namespace, key, payload
      magic    4s  b"TKVB"
      version  H   FORMAT_VERSION
      flags    H   0
      ns_len   H
      key_len  H
      length   Q   payload bytes
      seq      Q   writer sequence number (recency across restarts)
      token    16s writer token (UUID bytes)
      -- then --
      checksum Q   xxh3_64 over header[0:40] + namespace + key + payload

Every read verifies magic, version, namespace, key, length and checksum; any
failure is a miss (the entry is removed and counted as corrupt).
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass
from typing import Optional, Union

import xxhash

__all__ = ["FORMAT_VERSION", "HEADER_SIZE", "HEADER_STRUCT", "EntryHeader", "pack_header", "verify_entry",
           "lmdb_key", "CorruptEntry"]

FORMAT_VERSION = 1
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


@dataclass(frozen=True)
class EntryHeader:
    namespace: bytes
    key: bytes
    token: uuid.UUID
    length: int
    seq: int
    payload_offset: int


def lmdb_key(key: bytes) -> bytes:
    """The LMDB key of a block key: itself if short, else a 128-bit digest.

    A digest collision can only cause a miss: the header stores the full key
    and every read compares it.
    """
    if len(key) <= MAX_LMDB_KEY:
        return key
    return b"\xff#" + xxhash.xxh3_128_digest(key)


def pack_header(namespace: bytes, key: bytes, token: uuid.UUID, payload: Buffer, seq: int) -> bytes:
    """Header + namespace + key for ``payload`` (the payload itself is appended by the caller)."""
    head = _HDR.pack(MAGIC, FORMAT_VERSION, 0, len(namespace), len(key), len(payload), seq, token.bytes)
    h = xxhash.xxh3_64()
    h.update(head)
    h.update(namespace)
    h.update(key)
    h.update(payload)
    return head + _SUM.pack(h.intdigest()) + namespace + key


def parse_header(value: Buffer) -> EntryHeader:
    """Parse without verifying the checksum (for tools and recovery scans)."""
    if len(value) < HEADER_SIZE:
        raise CorruptEntry("truncated", f"{len(value)} bytes < header {HEADER_SIZE}")
    magic, version, _flags, ns_len, key_len, length, seq, token = _HDR.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad_magic", repr(bytes(magic)))
    if version != FORMAT_VERSION:
        raise CorruptEntry("bad_version", str(version))
    off = HEADER_SIZE
    ns = bytes(value[off:off + ns_len])
    k = bytes(value[off + ns_len:off + ns_len + key_len])
    payload_offset = off + ns_len + key_len
    if len(value) != payload_offset + length:
        raise CorruptEntry("truncated", f"{len(value)} bytes, header says {payload_offset + length}")
    return EntryHeader(ns, k, uuid.UUID(bytes=bytes(token)), length, seq, payload_offset)


def verify_entry(value: Buffer, namespace: bytes, key: Optional[bytes], length: Optional[int] = None) -> EntryHeader:
    """Verify ``value`` completely; return its header or raise :class:`CorruptEntry`."""
    hdr = parse_header(value)
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
    h.update(mv[HEADER_SIZE:])
    if h.intdigest() != stored:
        raise CorruptEntry("checksum", f"stored {stored:#x}")
    return hdr
