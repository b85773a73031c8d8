"""The disk tier's I/O side: a slot file and its LMDB index, one writer thread, reader threads (in a child process by default).

One concern per module (each module's docstring states what it owns and its invariants):

* :mod:`.store`    -- :class:`DiskStore`, the facade the manager talks to (messages in, reports out);
* :mod:`.records`  -- options, queued ops and their answers;
* :mod:`.format`   -- the on-disk format: entry headers, checksums, LMDB keys;
* :mod:`.lock`     -- the path lock (one writer of a directory: a store or an operator tool);
* :mod:`.env`      -- the LMDB environment: open, meta records, map growth, the reader/writer lock;
* :mod:`.slots`    -- the slot file and its allocator;
* :mod:`.tombs`    -- cancellations: in-memory sets, durable tombs, token-matched deletes;
* :mod:`.recovery` -- what open does before the first read;
* :mod:`.writer`   -- the writer thread; :mod:`.readers` -- the reader threads;
* :mod:`.proc`     -- the store in a process of its own (the owner's side); :mod:`.child` -- that process.
"""

from .env import MAX_DBS, MIN_MAP, SUBDBS, init_meta
from .lock import LOCK_NAME
from .records import NOT_READ, SPILL_PREVENTED, DiskOptions, FlushDone, StoredEntry, writable_view
from .recovery import RecoveryReport
from .store import DiskStore

__all__ = ["DiskStore", "DiskOptions", "FlushDone", "RecoveryReport", "StoredEntry", "writable_view",
           "init_meta", "LOCK_NAME", "SUBDBS", "MAX_DBS", "MIN_MAP", "SPILL_PREVENTED", "NOT_READ"]
