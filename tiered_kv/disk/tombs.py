"""Tombstones: what keeps a cancelled spill from ever being published, in memory and on disk.

Owns the in-memory sets (``cancelled``: tokens the owner cancelled whose tomb is not applied yet;
``unsettled``: spills queued and not yet committed, prevented or failed), the durable ``tombs``
sub-database (writer token -> the key whose write it guards), and the token-matched deletes.  A cancelled spill's whole path is here:
:meth:`Tombs.cancel` (owner) -> :meth:`Tombs.prevents` (writer, before its ``put``) or
:meth:`Tombs.apply` (writer, the tomb op) -> :meth:`Tombs.forget` (the spill failed).
Invariants:

* before each ``put`` the writer asks :meth:`Tombs.prevents` inside the same write transaction:
  a spill whose token is cancelled in memory or tombstoned in ``tombs`` is never published;
* a tomb deletes the committed entry of its key only if the stored writer token matches (never a
  newer write of the same key); if the guarded write may still come, the tomb is made durable in
  ``tombs`` and garbage-collected when that write is prevented (or by recovery);
* every change to the in-memory sets made inside a write transaction is noted in an ``undo`` list
  and put back by :meth:`Tombs.undo` if the transaction aborts, so a retry sees what the aborted
  attempt saw.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Iterable, Optional

from .env import DiskEnv
from .format import CorruptEntry, lmdb_key, parse_header
from .slots import SlotFile

__all__ = ["Tombs", "Undo"]

Undo = list[tuple[set[uuid.UUID], uuid.UUID]]


class Tombs:
    def __init__(self, db: DiskEnv, slots: Optional[SlotFile] = None) -> None:
        self._db = db
        self._slots = slots   # whose holders say whether a removed record's slot number is to be trusted
        self.lock = threading.Lock()
        self.cancelled: set[uuid.UUID] = set()
        self.unsettled: set[uuid.UUID] = set()

    # ------------------------------------------------------------ owner thread
    def cancel(self, token: uuid.UUID) -> None:
        """The owner cancelled ``token`` (its tomb op follows through the writer's queue)."""
        with self.lock:
            self.cancelled.add(token)

    def queued(self, token: uuid.UUID) -> None:
        """A spill under ``token`` was queued: a tomb for it must be kept until it settles."""
        with self.lock:
            self.unsettled.add(token)

    # ------------------------------------------------------------ writer thread
    def is_cancelled(self, token: uuid.UUID) -> bool:
        with self.lock:
            return token in self.cancelled

    def prevents(self, txn: Any, token: uuid.UUID, undo: Undo) -> bool:
        """Inside the transaction that would publish spill ``token``: settle it, and True if a tomb (in
        memory or durable) prevents it -- the tomb is then consumed."""
        # settled from here on: a tomb later in this transaction finds the entry (and deletes it) or,
        # if prevented, has nothing left to guard
        self._discard(self.unsettled, token, undo)
        if self.is_cancelled(token) or txn.get(token.bytes, db=self._db.tombs) is not None:
            txn.delete(token.bytes, db=self._db.tombs)
            self._discard(self.cancelled, token, undo)
            return True
        return False

    def apply(self, txn: Any, token: uuid.UUID, key: bytes, frees: list[int], undo: Undo) -> bool:
        """The tomb op of ``token`` (queued by the owner's cancel), inside ``txn``: delete ``key``'s entry
        if ``token`` wrote it; keep the tomb durable if the guarded write may still come.  What it
        changes in memory is noted in ``undo``.  True as :meth:`delete_if_token` says."""
        lost = self.delete_if_token(txn, key, token, frees)
        with self.lock:
            settled = token not in self.unsettled
        if settled:
            # this process's write under the token was committed (and just removed), prevented, or
            # failed: nothing it guards can still be published, so nothing is kept
            self._discard(self.cancelled, token, undo)
            return lost
        # the guarded write is still queued: the tomb is made durable (it names the key it guards),
        # and stays cancelled in memory until that write is prevented
        txn.put(token.bytes, key, db=self._db.tombs)
        return lost

    def delete_if_token(self, txn: Any, key: bytes, token: uuid.UUID, frees: list[int],
                        found_corrupt: bool = False) -> bool:
        """Delete ``key``'s entry (and its touch record) if ``token`` wrote it, noting its slot in
        ``frees``.  A record whose header cannot be parsed is deleted whoever asks (no write of anyone's
        makes one, and nothing can read it: the owner's removal -- an eviction, an invalidation -- would
        else leave it and its slot taken until a reopen).  ``found_corrupt`` (a reader's removal of a
        record it found corrupt): never trust the record's slot number, which its checksum does not
        cover: a damaged one may name another live entry's slot, which would be handed to the next
        write.  Otherwise the slot is noted only if it holds this key's record (``SlotFile.drop``;
        without a slot file, as given).  True when it dropped a record without noting its slot: the
        writer finds the slot by a scan of the index once the transaction committed
        (``Writer._reclaim``: the slot no readable record names)."""
        db = self._db
        lk = lmdb_key(key)
        v = txn.get(lk, db=db.blocks)
        if v is None:
            return False
        try:
            h = parse_header(v)
        except CorruptEntry:
            txn.delete(lk, db=db.blocks)
            txn.delete(lk, db=db.touch)
            return True
        if h.token != token:
            return False
        txn.delete(lk, db=db.blocks)   # (``v`` shows other bytes from here on: ``h`` was parsed before)
        txn.delete(lk, db=db.touch)
        if found_corrupt:
            return h.in_slot
        if self._slots is not None:
            return not self._slots.drop(None, lk, frees, h)
        if h.in_slot:
            frees.append(h.slot)
        return False

    def undo(self, undo: Undo) -> None:
        """A transaction aborted: its changes to the in-memory sets are put back (only the writer
        takes tokens out of them; the owner may have added some meanwhile, which stay)."""
        if undo:
            with self.lock:
                for s, token in undo:
                    s.add(token)
            undo.clear()

    def forget(self, tokens: Iterable[uuid.UUID]) -> None:
        """These spills failed: no write under their tokens can come any more.  A durable tomb one of
        them committed before the failure stays until the next recovery drops it (bounded by failed
        batches; it guards a write that never comes)."""
        with self.lock:
            for token in tokens:
                self.unsettled.discard(token)
                self.cancelled.discard(token)

    def _discard(self, s: set[uuid.UUID], token: uuid.UUID, undo: Undo) -> None:
        """Take ``token`` out of ``s``, noting it in ``undo``."""
        with self.lock:
            if token in s:
                s.discard(token)
                undo.append((s, token))
