"""Recovery on open: what a disk tier holds once a crash (or a clean close) is behind it.

Owns :func:`recover` and its :class:`RecoveryReport`.  Runs once, before the writer and readers
start.  Invariants on return:

* every entry written under a tombstoned token is purged, and every tomb is dropped (no write
  guarded by one can arrive any more: this process queued none yet);
* entries of another namespace or block length, unparsable records, records whose slot lies past
  the slot file's end, and of two records on one slot the one whose checksum fails over its bytes
  (the older when both or neither verify) are removed;
* the sequence number the writer resumes from is no damaged record's: an entry numbered
  :data:`SEQ_CHECKED` or more (no writer gets there) is kept only if its checksum verifies, a touch
  record so numbered is dropped (unless a kept entry is numbered that high: then up to
  :data:`SEQ_LIMIT`), so the writer's later writes stay below :data:`SEQ_LIMIT` (the next open keeps
  them) for another 2**61 writes at least;
* every slot no remaining entry references is free; recency is the newer of an entry's write
  sequence and its touch record;
* the report is stored in ``meta`` (``last_recovery``) and the transaction synced (unless
  durability is "none").
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .env import DiskEnv
from .format import CorruptEntry, EntryHeader, lmdb_key, parse_header, verify_entry, where_of
from .records import StoredEntry
from .slots import SlotFile

__all__ = ["RecoveryReport", "recover", "U64", "SEQ_LIMIT", "SEQ_CHECKED", "touch_limit", "removed_why", "REMOVED_AS"]

log = logging.getLogger(__name__)

U64 = struct.Struct("<Q")   # a touch record: the entry's newest sequence number
SEQ_LIMIT = 1 << 62         # no writer numbers this many writes (146 years at 10**9 a second): a higher one is damage
# ... nor half as many (73 years): a number this high is checked.  Recovery reads no checksum otherwise, and a
# damaged number just below SEQ_LIMIT would make the writer number every later write past it (dropped at the
# next open); a writer resumed from below SEQ_CHECKED has 2**61 writes to go before it reaches SEQ_LIMIT
SEQ_CHECKED = SEQ_LIMIT >> 1


def touch_limit(seq: int) -> int:
    """The first touch record number that is damage, where the highest verified entry is numbered ``seq``: a
    touch has no checksum, so one numbered :data:`SEQ_CHECKED` or more is damage unless a verified entry is
    numbered that high (a writer resumed from it numbers its touches past it too); :data:`SEQ_LIMIT` or more
    always is.  Recovery's rule, and export's (which must not sign a damaged number into an archive)."""
    return SEQ_CHECKED if seq < SEQ_CHECKED else SEQ_LIMIT


REMOVED_AS = {"bad_seq": "corrupt", "wrong_namespace": "foreign", "wrong_length": "foreign",
              "lmdb_key_mismatch": "foreign", "unverified": "corrupt", "tombstoned": "purged"}
"""Each :func:`removed_why` reason, as :class:`RecoveryReport` counts it."""


def removed_why(h: EntryHeader, lk: bytes, ns: bytes, block_bytes: int, tombs: Any,
                verifies: Callable[[], bool]) -> Optional[str]:
    """Why recovery removes the entry whose parsed header is ``h``, stored under LMDB key ``lk``, or None when it
    keeps it (the slot checks aside: a slot past the file's end, two records on one slot).  ``tombs``: the
    tombstoned tokens' bytes; ``verifies``: whether the entry's checksum verifies, asked only of one numbered
    :data:`SEQ_CHECKED` or more (recovery reads no slot otherwise).  The one statement of the rule: recovery
    applies it, and the operator tools ask it what recovery will keep (``verify``, export's touch limit)."""
    if h.seq >= SEQ_LIMIT:   # recovery reads no checksum: a damaged sequence number would number every
        return "bad_seq"     # later write past 64 bits (the entry's read would fail its checksum anyway)
    if h.namespace != ns:
        return "wrong_namespace"
    if h.length != block_bytes:
        return "wrong_length"
    if lmdb_key(h.key) != lk:
        return "lmdb_key_mismatch"
    if h.seq >= SEQ_CHECKED and not verifies():
        return "unverified"   # a damaged sequence number (the read would fail its checksum too)
    if h.token.bytes in tombs:
        return "tombstoned"
    return None


@dataclass
class RecoveryReport:
    seconds: float = 0.0
    entries: int = 0
    purged: int = 0            # entries written under a tombstoned token
    corrupt: int = 0           # unparsable headers, slots past the file's end, a slot claimed twice (removed)
    foreign: int = 0           # entries of another namespace/length (removed)
    slots_free: int = 0        # free slots of the data file after recovery
    tombs_dropped: int = 0     # tombstones garbage-collected
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def recover(db: DiskEnv, slots: SlotFile, ns: bytes, block_bytes: int) -> tuple[list[StoredEntry], int, RecoveryReport]:
    """Purge writes under tombstoned tokens, drop dead tombs, index what remains.

    Returns the entries (oldest first), the highest sequence number seen, and the report.
    """
    t0 = time.perf_counter()
    rep = RecoveryReport()
    env = db.env
    assert env is not None
    seq = 0
    entries: dict[bytes, StoredEntry] = {}
    owner: dict[int, tuple[bytes, int]] = {}  # slot -> (LMDB key, seq) of the entry using it
    file_bytes = os.fstat(slots.fd).st_size
    sb = slots.slot_bytes
    with env.begin(write=True, buffers=True) as txn:
        tombs = {bytes(k): bytes(v) for k, v in txn.cursor(db=db.tombs)}
        dead: list[bytes] = []
        cur = txn.cursor(db=db.blocks)
        for lk, v in cur:
            lk = bytes(lk)
            try:
                h = parse_header(v)
            except CorruptEntry:
                rep.corrupt += 1
                dead.append(lk)
                continue
            why = removed_why(h, lk, ns, block_bytes, tombs, lambda: _verifies(v, h, ns, slots.fd, sb, file_bytes))
            if why is not None:
                counted = REMOVED_AS[why]
                setattr(rep, counted, getattr(rep, counted) + 1)
                dead.append(lk)
                continue
            if h.in_slot:
                if h.slot * sb + h.length > file_bytes:
                    rep.corrupt += 1   # the slot file was truncated under it
                    dead.append(lk)
                    continue
                prev = owner.get(h.slot)
                if prev is not None:
                    # two entries on one slot: a lost commit (the older one's bytes were overwritten) or a
                    # damaged slot number (the checksum does not cover it); the one whose checksum verifies
                    # over the slot's bytes stays
                    rep.corrupt += 1
                    loser = _loser(txn, db, prev, lk, h, v, ns, slots.fd, sb, file_bytes)
                    dead.append(loser)
                    entries.pop(loser, None)
                    if loser == lk:
                        continue
                owner[h.slot] = (lk, h.seq)
            entries[lk] = StoredEntry(h.key, h.token, h.seq, where_of(v, h))
            seq = max(seq, h.seq)
        for lk in dead:
            txn.delete(lk, db=db.blocks)
        for tk in tombs:
            txn.delete(tk, db=db.tombs)
        rep.tombs_dropped = len(tombs)
        # recency: a promote's touch may be newer than the write.  A touch has no checksum: one numbered past
        # SEQ_CHECKED is damage, unless a verified entry is numbered that high (a writer resumed from it numbers
        # its touches past it too); past SEQ_LIMIT it always is
        limit = touch_limit(seq)
        touched = {}
        for k, v in txn.cursor(db=db.touch):
            k = bytes(k)
            touched[k] = U64.unpack(bytes(v))[0] if len(v) == U64.size else None
            if touched[k] is not None and touched[k] >= limit:
                touched[k] = None   # damage: a touch is recency only, dropped below
        for k, tseq in touched.items():
            e = entries.get(k)
            if tseq is None:   # a damaged touch record: it only ever held recency, so it is dropped
                txn.delete(k, db=db.touch)
                continue
            if e is None:
                txn.delete(k, db=db.touch)
            elif tseq > e.seq:
                entries[k] = StoredEntry(e.key, e.token, tseq, e.where)
            seq = max(seq, tseq)
        rep.entries = len(entries)
        rep.slots_free = slots.recovered({slot: lk for slot, (lk, _) in owner.items()})
        rep.seconds = time.perf_counter() - t0
        txn.put(b"last_recovery", json.dumps(rep.as_dict()).encode(), db=db.meta)
    if db.durability != "none":
        env.sync(True)
    log.info("disk tier %s recovered in %.3f s: %d entries, %d purged under tombstones, %d corrupt, "
             "%d foreign, %d tombstones dropped", db.name, rep.seconds, rep.entries, rep.purged,
             rep.corrupt, rep.foreign, rep.tombs_dropped)
    return sorted(entries.values(), key=lambda e: e.seq), seq, rep


def _loser(txn: Any, db: DiskEnv, prev: tuple[bytes, int], lk: bytes, h: EntryHeader, value: Any, ns: bytes,
           fd: int, slot_bytes: int, file_bytes: int) -> bytes:
    """Of two records naming one slot (``prev``: the LMDB key and sequence number of the one seen first;
    ``lk``, ``h``, ``value``: the other), the one to remove: the one whose checksum fails over the slot's
    bytes while the other's verifies; when both or neither verify, the older (a lost commit: the older
    write's bytes were overwritten).  The slot is read only here: two records on one slot are rare."""
    prev_value = txn.get(prev[0], db=db.blocks)
    try:
        prev_ok = prev_value is not None and _verifies(prev_value, parse_header(prev_value), ns, fd, slot_bytes,
                                                       file_bytes)
    except CorruptEntry:
        prev_ok = False
    this_ok = _verifies(value, h, ns, fd, slot_bytes, file_bytes)
    if prev_ok != this_ok:
        return lk if prev_ok else prev[0]
    return prev[0] if prev[1] < h.seq else lk


def _verifies(value: Any, h: EntryHeader, ns: bytes, fd: int, slot_bytes: int, file_bytes: int) -> bool:
    """Whether an entry's checksum verifies (its slot's payload read from ``fd``): only for an entry whose
    sequence number no writer reaches, and for two records on one slot, so recovery reads no slot otherwise."""
    payload = None
    try:
        if h.in_slot:
            if h.slot * slot_bytes + h.length > file_bytes:
                return False
            payload = os.pread(fd, h.length, h.slot * slot_bytes)
        verify_entry(value, ns, h.key, h.length, payload, header=h)
    except (CorruptEntry, OSError):
        return False
    return True
