"""A tier's index: keys -> entries in slots, with leases and LRU eviction.

Pure Python, no tensors and no I/O.  The core keeps one for the host slab (a
slot is a row of the slab) and one for the disk tier (a slot is a unit of
capacity; the disk store places the bytes).  Invariants (tested in tests/test_tier_index.py and the state machines):

* a slot belongs to at most one :class:`Entry`; it returns to the free
  list only when its entry is out of the index *and* no worker may still
  write it (``writing``) *and* no load reads it (``readers == 0``);
* only READY entries with no readers are evictable, and never a key the
  evicting call protects;
* entries are objects that jobs hold directly: nothing keyed by a slot number
  outlives the job that leased it.
"""

from __future__ import annotations

import enum
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Container, Iterator, Sequence
from typing import Optional

__all__ = ["TierIndex", "Entry", "EntryState"]


class EntryState(enum.Enum):
    WRITING = "writing"  # a store/promote is filling the slot
    READY = "ready"      # the slot holds the key's verified bytes


_WRITING, _READY = EntryState.WRITING, EntryState.READY  # module constants: cheaper than class attributes


class Entry:
    __slots__ = ("key", "slot", "state", "writer", "readers", "live", "writing", "spilled")

    def __init__(self, key: bytes, slot: int, writer: uuid.UUID) -> None:
        self.key = key
        self.slot = slot
        self.state = _WRITING
        self.writer = writer      # token of the job that fills the slot
        self.readers = 0          # loads/spills reading the slot right now
        self.live = True          # present in the index
        self.writing = True       # a worker may still write the slot
        self.spilled = False      # host index only: written to (or found on) disk once in this residency

    def __repr__(self) -> str:
        return (f"Entry(key={self.key!r}, slot={self.slot}, {self.state.value}, "
                f"readers={self.readers}, live={self.live}, writing={self.writing})")


class TierIndex:
    """Key -> entry map of one tier (the host slab, or the disk tier's capacity) with leases and LRU eviction.

    ``on_evict(entry)`` is called before an evicted entry leaves the index; it must not change this
    index (the owners' callbacks queue a disk delete or note the key).
    """

    def __init__(self, num_slots: int, on_evict: Optional[Callable[[Entry], None]] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._entries: dict[bytes, Entry] = {}
        self._lru: OrderedDict[bytes, Entry] = OrderedDict()  # READY, readers == 0
        self._on_evict = on_evict
        self.evictions = 0

    # -- queries -------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> Optional[Entry]:
        return self._entries.get(key)

    def ready(self, key: bytes) -> Optional[Entry]:
        e = self._entries.get(key)
        return e if e is not None and e.state is _READY else None

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def coldest(self, n: int) -> list[Entry]:
        """Up to ``n`` evictable entries, least recently used first."""
        out = []
        for entry in self._lru.values():
            if len(out) >= n:
                break
            out.append(entry)
        return out

    def ready_run(self, keys: Sequence[bytes], start: int = 0) -> int:
        """Mark recently used the READY entries of ``keys[start:]`` up to the first key that is
        not READY here, and return that key's index (``len(keys)`` when all are)."""
        entries, lru = self._entries, self._lru
        i, n = start, len(keys)
        while i < n:
            e = entries.get(keys[i])
            if e is None or e.state is not _READY:
                break
            if lru.get(e.key) is e:  # touch() written out
                lru.move_to_end(e.key)
            i += 1
        return i

    # -- moves -------------------------------------------------------------
    def touch(self, entry: Entry) -> None:
        """Mark recently used."""
        lru = self._lru
        if lru.get(entry.key) is entry:   # a READY entry leased to a reader is not in the LRU
            lru.move_to_end(entry.key)

    def reserve(self, key: bytes, writer: uuid.UUID, protect: Collection[bytes] = ()) -> Optional[Entry]:
        """A new WRITING entry for ``key`` in a free or evicted slot; None when full of leased slots."""
        entries = self._entries
        if key in entries:
            raise AssertionError(f"reserve of present key {key!r}")  # internal bug: callers check first
        free = self._free
        if not free and not self._evict_one(protect, key):
            return None
        entry = Entry(key, free.pop(), writer)
        entries[key] = entry
        return entry

    def reserve_absent(self, keys: Sequence[bytes], writer: uuid.UUID, protect: Collection[bytes],
                       elsewhere: Optional[Container[bytes]]) -> tuple[list[bytes], list[Entry], int]:
        """:meth:`reserve` for each of ``keys`` in no tier yet, under one ``writer``.

        A key present here is touched, a key in ``elsewhere`` (another tier) skipped, a
        key repeated is reserved once.  Returns (keys reserved, their entries, keys that
        found no evictable slot).  One call per job: the engine stores a step's blocks.
        """
        entries, lru, free = self._entries, self._lru, self._free
        get, pop, lru_get = entries.get, free.pop, lru.get
        got: list[bytes] = []
        new: list[Entry] = []
        add_key, add_entry = got.append, new.append
        full = 0
        for k in keys:
            e = get(k)
            if e is not None:
                if lru_get(k) is e:   # touch() written out
                    lru.move_to_end(k)
                continue
            if elsewhere is not None and k in elsewhere:
                continue
            if not free:
                if type(protect) is list and len(protect) > 8:
                    protect = set(protect)   # a full tier evicts per key here, each a look-up in protect
                if not self._evict_one(protect, k):
                    full += 1
                    continue
            e = entries[k] = Entry(k, pop(), writer)
            add_key(k)
            add_entry(e)
        return got, new, full

    def publish_all(self, entries: Sequence[Entry]) -> list[Entry]:
        """:meth:`publish` for each of ``entries``; returns those now READY (the others left the index
        while they were written, and their slots are free now)."""
        lru = self._lru
        out = []
        for e in entries:
            e.writing = False
            if not e.live:
                self._maybe_free(e)
                continue
            e.state = _READY
            if e.readers == 0:
                lru[e.key] = e
            out.append(e)
        return out

    def publish(self, entry: Entry) -> bool:
        """The writer's copy landed: WRITING -> READY, if the entry is still in the index."""
        entry.writing = False
        if not entry.live:
            self._maybe_free(entry)
            return False
        entry.state = _READY
        if entry.readers == 0:
            self._lru[entry.key] = entry
        return True

    def abort(self, entry: Entry) -> None:
        """The writer's copy failed or will be discarded: drop the entry (slot kept while writing)."""
        self.remove(entry)

    def writer_done(self, entry: Entry) -> None:
        """A worker that may have written the slot has reported."""
        entry.writing = False
        self._maybe_free(entry)

    def acquire(self, entry: Entry) -> None:
        """Lease a READY entry's slot to a reader (load or spill)."""
        if entry.state is not _READY or not entry.live:
            raise AssertionError(f"acquire of {entry!r}")  # internal bug
        entry.readers += 1
        self._lru.pop(entry.key, None)

    def release(self, entry: Entry) -> None:
        """A reader finished; the slot becomes evictable (MRU) or is freed if removed."""
        if entry.readers <= 0:
            raise AssertionError(f"release without acquire: {entry!r}")  # internal bug
        entry.readers -= 1
        if entry.readers == 0:
            if entry.live and entry.state is _READY:
                self._lru[entry.key] = entry
            else:
                self._maybe_free(entry)

    def remove(self, entry: Entry) -> None:
        """Take the entry out of the index; its slot is freed once no lease holds it."""
        if entry.live:
            entry.live = False
            if self._entries.get(entry.key) is entry:
                del self._entries[entry.key]
            if self._lru.get(entry.key) is entry:
                del self._lru[entry.key]
        self._maybe_free(entry)

    # -- internals -------------------------------------------------------
    def _maybe_free(self, entry: Entry) -> None:
        if not entry.live and not entry.writing and entry.readers == 0 and entry.slot >= 0:
            self._free.append(entry.slot)
            entry.slot = -1

    def evict_ahead(self, free: int) -> int:
        """Evict least recently used entries until ``free`` slots are free or nothing is evictable.

        The owner calls it between engine steps, so that the next step's reservations find free
        slots instead of evicting in the engine's call.  Returns how many entries it evicted.
        """
        lru, entries, slots = self._lru, self._entries, self._free
        n = min(free - len(slots), len(lru))
        if n <= 0:
            return 0
        on_evict = self._on_evict
        pop, add = lru.popitem, slots.append
        for _ in range(n):   # _evicted() written out: once per block of a step
            key, entry = pop(False)
            if on_evict is not None:
                on_evict(entry)
            entry.live = False
            del entries[key]
            add(entry.slot)
            entry.slot = -1
        self.evictions += n
        return n

    def _evict_one(self, protect: Collection[bytes], key: bytes) -> bool:
        lru = self._lru
        for k, entry in lru.items():
            if k == key or k in protect:
                continue
            del lru[k]
            self._evicted(entry)
            return True
        return False

    def _evicted(self, entry: Entry) -> None:
        """An entry just taken out of the LRU leaves the index; its slot is free at once.

        ``remove()`` written out: the LRU holds live READY entries with no reader and no
        writer, so nothing else can hold the slot (a full tier evicts once per reservation).
        """
        if self._on_evict is not None:
            self._on_evict(entry)
        entry.live = False
        del self._entries[entry.key]
        self._free.append(entry.slot)
        entry.slot = -1
        self.evictions += 1

