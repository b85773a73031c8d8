"""A tier's index: keys -> entries in slots, with leases, and eviction in its policy's order.

Pure Python, no tensors and no I/O.  The core keeps one for the host slab (a
slot is a row of the slab) and one for the disk tier (a slot is a unit of
capacity; the disk store places the bytes).  Invariants (tested in tests/test_tier_index.py and the state machines):

* a slot belongs to at most one :class:`Entry`; it returns to the free
  list only when its entry is out of the index *and* no worker may still
  write it (``writing``) *and* no load reads it (``readers == 0``);
* only READY entries with no readers are evictable, and never a key the
  evicting call protects; which of them goes first is the policy's choice
  (:mod:`.policy`: LRU by default).  A load's reader is a *lease*: the index takes
  the entry out of the policy until it is released (a use: back as the policy
  orders a use).  A spill's or a put's reader is a *pin*: the entry stays where it
  is in the policy's order and the policy passes over it while it has readers
  (reading a block to copy it elsewhere is no use of it);
* entries are objects that jobs hold directly: nothing keyed by a slot number
  outlives the job that leased it.

A little over the project's usual 500 lines on purpose: each batched path (a step's keys reserved,
leased, published or evicted together) sits beside the per-key method whose outcome it must
match, and both write the same private maps, free list and policy; split apart, a change to one
would not be seen next to the other.
"""

from __future__ import annotations

import enum
import uuid
from collections import deque
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Sequence
from itertools import chain, islice, repeat
from typing import Any, Optional

from ..untrack import untrack
from .policy import LRU, Admission, Policy, admission_victim

__all__ = ["TierIndex", "Entry", "EntryState"]


def _consume(it: Iterator[Any]) -> None:
    """Run an iterator to its end in C."""
    deque(it, 0)


class EntryState(enum.Enum):
    WRITING = "writing"  # a store/promote is filling the slot
    READY = "ready"      # the slot holds the key's verified bytes


_WRITING, _READY = EntryState.WRITING, EntryState.READY  # module constants: cheaper than class attributes


class Entry:
    __slots__ = ("key", "slot", "state", "writer", "readers", "live", "writing", "spilled", "where")

    def __init__(self, key: bytes, slot: int, writer: uuid.UUID) -> None:
        self.key = key
        self.slot = slot
        self.state = _WRITING
        self.writer = writer      # token of the job that fills the slot
        self.readers = 0          # loads, spills and puts reading the slot right now
        self.live = True          # present in the index
        self.writing = True       # a worker may still write the slot
        # host index only: offered to disk in this residency (True: written, on its way, found or refused;
        # None: shed, counted once, offered again by write-back; False: not yet, or its write failed)
        self.spilled: Optional[bool] = False
        # disk index only: where the block lies in the slot file with what its record says (disk.format.where_of;
        # 0: not known), so that a blocked owner may read it from the page cache itself (disk/cached.py)
        self.where = 0
        untrack(self)             # no container here: never in a cycle, freed by its reference count (untrack.py)

    def __repr__(self) -> str:
        return (f"Entry(key={self.key!r}, slot={self.slot}, {self.state.value}, "
                f"readers={self.readers}, live={self.live}, writing={self.writing})")


class TierIndex:
    """Key -> entry map of one tier (the host slab, or the disk tier's capacity) with leases, evicting in
    the order of its ``policy`` (:class:`~tiered_kv.core.policy.LRU` when None).

    ``on_evict(entry)`` is called before an evicted entry leaves the index; it must not change this
    index (the owners' callbacks queue a disk delete or note the key).

    A step's keys take batched paths where they can (new keys reserved together, the default policy's
    victims evicted together): the same outcome as key by key, except which free slot each key gets
    (``tests/test_index_batched.py`` runs both side by side).
    """

    _batched = True   # False: every call key by key (the tests' reference)

    def __init__(self, num_slots: int, on_evict: Optional[Callable[[Entry], None]] = None,
                 policy: Optional[Policy] = None, admission: Optional[Admission] = None) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._entries: dict[bytes, Entry] = {}
        #: ``get(key)``: the key's entry or None (the map's own ``get``: a C call, per key on every path)
        self.get: Callable[[bytes], Optional[Entry]] = self._entries.get
        self.policy: Policy = LRU() if policy is None else policy   # holds the READY entries with no reader
        # the default policy's OrderedDict, for the two per-key loops of the engine's calls (ready_run,
        # reserve_absent), which write LRU.hit out instead of calling it once per key (the bench's
        # engine step: 512 lookup hits a step); None for the other policies
        self._lru = self.policy.od if type(self.policy) is LRU else None
        self.admission = admission   # None: every new key is admitted
        self._pinned: set[Entry] = set()   # entries whose readers are all pins: still in the policy, in place
        self._on_evict = on_evict
        self.evictions = 0
        self.refused = 0             # new keys the admission filter kept out (running total, like evictions)

    # -- queries -------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def none_of(self, keys: Collection[bytes]) -> bool:
        """Whether no key of ``keys`` is here (in C)."""
        return self._entries.keys().isdisjoint(keys)

    @property
    def plain_lru(self) -> bool:
        """Whether this tier evicts by the default policy (:class:`~.policy.LRU`), whose answer to "no
        victim" changes nothing: the batched paths that stop at the first key without a slot need it."""
        return self._lru is not None

    def ready(self, key: bytes) -> Optional[Entry]:
        e = self._entries.get(key)
        return e if e is not None and e.state is _READY else None

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def entries(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def coldest(self, n: int, through_pins: bool = False) -> list[Entry]:
        """Up to ``n`` evictable entries, the policy's next victims first; ``through_pins``: the pinned
        ones too, in the order eviction will take them once their reads end."""
        policy = self.policy
        if through_pins and policy.leases_in_place:   # its leased entries are in the order: only pins go through
            return policy.coldest(n, self._pinned)   # type: ignore[arg-type]
        return policy.coldest(n, through_pins)

    def link(self, keys: Sequence[bytes]) -> None:
        """``keys`` are consecutive blocks of one sequence, in order: a prefix-aware policy links them
        (held or not yet: a key stored later joins its parent then); the other policies ignore it."""
        if self.policy.uses_links:
            self.policy.link(keys)

    def ready_run(self, keys: Sequence[bytes], start: int = 0) -> int:
        """A hit on each READY entry of ``keys[start:]`` up to the first key that is not READY here,
        and return that key's index (``len(keys)`` when all are).  ``keys`` are a prefix in order: the
        policy sees them as one chain (``link``) when ``start`` is 0."""
        entries, policy, lru = self._entries, self.policy, self._lru
        if start == 0 and policy.uses_links:
            policy.link(keys)
        i, n = start, len(keys)
        if lru is not None:
            while i < n:
                e = entries.get(keys[i])
                if e is None or e.state is not _READY:
                    break
                if lru.get(e.key) is e:   # LRU.hit written out
                    lru.move_to_end(e.key)
                i += 1
            return i
        hit = policy.hit
        while i < n:
            e = entries.get(keys[i])
            if e is None or e.state is not _READY:
                break
            hit(e)
            i += 1
        return i

    def ready_run_below(self, keys: Sequence[bytes], below: TierIndex) -> tuple[int, int]:
        """:meth:`ready_run` through this tier and the tier ``below`` it (the host tier and the disk
        tier): each key of ``keys`` READY here is a hit here, else a key READY ``below`` is a hit there;
        the run stops at the first key READY in neither.  Returns (the run's length, its hits here).

        With both tiers on the default policy, one loop with both policies' hits written out (the
        bench's engine step: 512 lookup keys a step, about a quarter of its hits only on disk); else key by key,
        the same outcome (``tests/test_index_batched.py`` runs both side by side).
        """
        lru, below_lru = self._lru, below._lru
        if below.policy.uses_links:   # the chain runs through the tier below too (this tier's: ready_run)
            below.policy.link(keys)
        if self._batched and lru is not None and below_lru is not None:
            get, below_get = self._entries.get, below._entries.get
            lru_get, below_lru_get = lru.get, below_lru.get
            i = host = 0
            for k in keys:
                e = get(k)
                if e is not None and e.state is _READY:
                    if lru_get(k) is e:   # LRU.hit written out
                        lru.move_to_end(k)
                    host += 1
                else:
                    e = below_get(k)
                    if e is None or e.state is not _READY:
                        break
                    if below_lru_get(k) is e:
                        below_lru.move_to_end(k)
                i += 1
            return i, host
        n = host = self.ready_run(keys)
        total = len(keys)
        while n < total:   # a key only below, then maybe keys here again
            d = below.ready(keys[n])
            if d is None:
                break
            below.touch(d)
            end = self.ready_run(keys, n + 1)
            host += end - n - 1
            n = end
        return n, host

    # -- admission ---------------------------------------------------------
    def seen(self, keys: Sequence[bytes]) -> None:
        """``keys`` were asked for (a lookup): references the admission filter counts."""
        adm = self.admission
        if adm is not None:
            record = adm.record
            for k in keys:
                record(k)

    def admits(self, key: bytes, protect: Collection[bytes] = ()) -> bool:
        """Whether a new entry for ``key`` may enter (asked just before reserving it, with the ``protect``
        the reservation gets; a refusal is counted in ``refused``).  Promotes and fetches do not ask:
        they serve a lookup that found the key."""
        adm = self.admission
        if adm is None:
            return True
        victim = None if self._free else admission_victim(self.policy, protect, key)
        if adm.admit(key, victim):
            return True
        self.refused += 1
        return False

    # -- moves -------------------------------------------------------------
    def touch(self, entry: Entry) -> None:
        """A hit (a use the policy orders by)."""
        self.policy.hit(entry)

    def reserve(self, key: bytes, writer: uuid.UUID, protect: Collection[bytes] = (),
                replace: Optional[Entry] = None) -> Optional[Entry]:
        """A new WRITING entry for ``key`` in a free or evicted slot; None when full of leased slots.

        ``replace``: ``key``'s entry here, not READY (a fetch in flight), that gives way to the new one: it
        leaves the index (:meth:`remove`) only once a slot for the new entry is certain, and stays when
        there is none.  The new reservation takes over the old one's: what the policy was told of it (ARC:
        ``p`` adapted for a ghost hit) stays for it, and goes (:meth:`Policy.abandon`) if no new entry comes
        of it after all (an interrupt, or no slot)."""
        entries = self._entries
        free = self._free
        if replace is not None:
            if entries.get(key) is not replace or replace.state is _READY:
                raise AssertionError(f"reserve of {key!r} replacing {replace!r}")  # internal bug
            if not free and self.policy.peek(protect, key) is None:
                return None
            try:
                self.remove(replace, handover=True)   # its slot stays leased to its writer: the victim is another
                entry = self._reserve_slot(key, writer, protect)
            except BaseException:
                if entries.get(key) is None:   # the old reservation gone, no new one: the policy forgets it
                    self.policy.abandon(key)
                raise
            if entry is None:
                self.policy.abandon(key)
            return entry
        if key in entries:
            raise AssertionError(f"reserve of present key {key!r}")  # internal bug: callers check first
        return self._reserve_slot(key, writer, protect)

    def _reserve_slot(self, key: bytes, writer: uuid.UUID, protect: Collection[bytes]) -> Optional[Entry]:
        """:meth:`reserve`'s new entry, ``key`` absent: a free slot, or an evicted one; None when none is left."""
        free = self._free
        if not free and not self._evict_one(protect, key):
            return None
        # the slot leaves the free list only once the entry holding it is in the map, with no call between
        # (an interrupt lands at a call's return): a caller's handler finds it there under ``writer``
        entry = Entry(key, free[-1], writer)
        self._entries[key] = entry
        free.pop()
        return entry

    def reserve_each(self, keys: Sequence[bytes], writers: Sequence[uuid.UUID]) -> list[Entry]:
        """:meth:`reserve` for ``keys`` in order, each under its own writer (a spill's blocks: a token each),
        until one finds no slot: the entries made, for a prefix of ``keys``.  None of ``keys`` may be here,
        none twice; the admission filter is not asked (the caller asks it).  With the default policy the
        victims leave together and the new entries are made in C: the same outcome as :meth:`reserve` key
        by key, except which free slot each key gets, and once one key found no slot no later one would
        (:attr:`plain_lru`).  Another policy may change its state when asked for a victim it does not
        find (ARC moves its target), so a caller that must match a loop over every key uses this only
        under the default policy."""
        entries, free, lru = self._entries, self._free, self._lru
        n = len(keys)
        if not entries.keys().isdisjoint(keys) or len(set(keys)) != n:   # internal bug: callers check first
            raise AssertionError(f"reserve_each of present or repeated keys {list(keys)!r}")
        if not self._batched or (lru is None and n > len(free)):
            out: list[Entry] = []
            for k, w in zip(keys, writers):
                e = self.reserve(k, w)
                if e is None:
                    break
                out.append(e)
            return out
        if n > len(free):
            self._evict_lru(n - len(free), ())   # fewer when fewer are evictable: the keys past them get none
        m = min(n, len(free))
        if not m:
            return []
        got = keys[:m] if m < n else keys
        slots = free[-m:]
        slots.reverse()
        new = list(map(Entry, got, slots, writers[:m] if m < len(writers) else writers))
        pairs = zip(got, new)
        del free[-m:]          # no call between these two (see reserve)
        entries.update(pairs)
        return new

    def reserve_absent(self, keys: Sequence[bytes], writer: uuid.UUID, protect: Collection[bytes],
                       elsewhere: Optional[Container[bytes]], chain: bool = True,
                       replace: Collection[Entry] = ()) -> tuple[list[bytes], list[Entry], int]:
        """:meth:`reserve` for each of ``keys`` in no tier yet, under one ``writer``.

        A key present here is touched, a key in ``elsewhere`` (another tier) skipped, a
        key the admission filter refuses skipped (counted in ``refused``), a key repeated is
        taken once (reserved, refused or found no slot once).  Returns (keys reserved, their entries, keys that found no evictable
        slot).  One call per job: the engine stores a step's blocks.  ``chain``: ``keys`` are consecutive
        blocks of one sequence, in order (a prefix-aware policy links them); False where they are not.
        ``replace``: entries of ``keys`` here, not READY (fetches in flight), reserved as if absent; each
        leaves the index only when its key gets its new entry (:meth:`reserve`'s ``replace``), and stays
        where the key is skipped or finds no slot.
        """
        entries, policy, free, lru = self._entries, self.policy, self._free, self._lru
        if chain and policy.uses_links:
            policy.link(keys)
        n = len(keys)
        if (n > 1 and self._batched and (n <= len(free) or lru is not None) and self.admission is None
                and list(map(entries.get, keys)).count(None) == n
                and (elsewhere is None or not any(map(elsewhere.__contains__, keys))) and len(set(keys)) == n
                and (n <= len(free) or self._evict_lru(n - len(free), protect))):
            # the engine's step: new keys, free slots (evicted between steps, or here at once), no filter;
            # the per-key work in C, slots taken in the order pop() would take them (ascending after a
            # start or an eviction: the copies of a step then write consecutive slots)
            got = list(keys)
            slots = free[-n:]
            slots.reverse()
            new = list(map(Entry, got, slots, repeat(writer, n)))
            pairs = zip(got, new)
            del free[-n:]          # no call between these two (see reserve)
            entries.update(pairs)
            return got, new, 0
        if n > 1 and len(set(keys)) != n:   # a key repeated: each key once -- reserved, refused or shed once
            keys = list(dict.fromkeys(keys))
            n = len(keys)
        get, pop, hit = entries.get, free.pop, policy.hit
        lru_get = None if lru is None else lru.get
        admits = None if self.admission is None else self.admits
        if type(protect) is list and len(protect) > 8 and (admits is not None or n > len(free)):
            protect = set(protect)   # looked up per key: by the filter's victim, or by a full tier's evictions
        got: list[bytes] = []
        new: list[Entry] = []
        add_key, add_entry = got.append, new.append
        full = 0
        for k in keys:
            e = get(k)
            if e is not None:
                if replace and e in replace:   # a repeated key finds this call's own entry: touched below
                    if elsewhere is not None and k in elsewhere:
                        continue
                    if admits is not None and not admits(k, protect):
                        continue
                    e = self.reserve(k, writer, protect, e)
                    if e is None:
                        full += 1
                        continue
                    add_key(k)
                    add_entry(e)
                    continue
                if lru_get is None:
                    hit(e)
                elif lru_get(k) is e:   # LRU.hit written out
                    lru.move_to_end(k)   # type: ignore[union-attr]
                continue
            if elsewhere is not None and k in elsewhere:
                continue
            if admits is not None and not admits(k, protect):
                continue
            if not free:
                if not self._evict_one(protect, k):
                    full += 1
                    continue
            e = Entry(k, free[-1], writer)
            entries[k] = e
            pop()   # the slot leaves the free list once its entry is in the map (see reserve)
            add_key(k)
            add_entry(e)
        return got, new, full

    def publish_all(self, entries: Sequence[Entry]) -> list[Entry]:
        """:meth:`publish` for each of ``entries``; returns those now READY (the others left the index
        while they were written, and their slots are free now)."""
        lru, insert = self._lru, self.policy.insert
        out = []
        try:
            for e in entries:
                e.writing = False
                if not e.live:
                    self._maybe_free(e)
                    continue
                if e.state is _READY:   # published already (a report applied again after an interrupt): in the order
                    out.append(e)
                    continue
                e.state = _READY
                if e.readers == 0:
                    if lru is not None:
                        lru[e.key] = e   # LRU.insert written out (each block a store publishes)
                    else:
                        insert(e)
                out.append(e)
        except BaseException:
            self._repair(entries)   # an insert broken off: READY, and in the order
            raise
        return out

    def publish(self, entry: Entry) -> bool:
        """The writer's copy landed: WRITING -> READY, if the entry is still in the index."""
        entry.writing = False
        if not entry.live:
            self._maybe_free(entry)
            return False
        if entry.state is _READY:   # published already (a report applied again after an interrupt)
            return True
        entry.state = _READY
        if entry.readers == 0:
            try:
                self.policy.insert(entry)
            except BaseException:
                self._repair((entry,))
                raise
        return True

    def abort(self, entry: Entry) -> None:
        """The writer's copy failed or will be discarded: drop the entry (slot kept while writing)."""
        self.remove(entry)

    def writer_done(self, entry: Entry) -> None:
        """A worker that may have written the slot has reported."""
        entry.writing = False
        self._maybe_free(entry)

    def acquire(self, entry: Entry, into: Optional[list[Any]] = None, i: int = 0) -> None:
        """Lease a READY entry's slot to a load (a use: out of the policy until released).

        ``into``: the holder's list of its leases; the lease is written to ``into[i]`` with no call between
        the count and that store, so under an interrupt (it lands at a call's return) the lease is either
        there or not taken.  The entry leaves the policy's order first, never leased inside it, where the
        default policy's batched eviction would free a slot being read; an interrupt before the count puts
        it back (:meth:`_repair`)."""
        if entry.state is not _READY or not entry.live:
            raise AssertionError(f"acquire of {entry!r}")  # internal bug
        pinned = self._pinned
        try:
            if entry.readers == 0 or (pinned and entry in pinned):
                lru = self._lru
                if lru is not None:
                    lru.pop(entry.key, None)   # LRU.lease written out (each load leases)
                else:
                    self.policy.lease(entry)
                pinned.discard(entry)   # pinned so far: the lease took it out of the policy now
            entry.readers += 1
            if into is not None:
                into[i] = entry
        except BaseException:
            self._repair((entry,))   # not counted: back in the order
            raise

    def pin(self, entry: Entry, into: list[Any], i: int) -> None:
        """:meth:`pin_all` of one READY entry, the pin written to ``into[i]`` as :meth:`acquire` writes a lease (no
        call between the count and that store; the set's add, a call, comes last): a promote's read of its disk
        entry, no use -- the lookup that found the block was -- so that where the entry stays in the disk
        tier's order does not depend on when the read's report is applied."""
        if entry.state is not _READY or not entry.live:
            raise AssertionError(f"pin of {entry!r}")  # internal bug
        n = entry.readers
        entry.readers = n + 1
        into[i] = entry
        if n == 0:
            self._pinned.add(entry)

    def pin_all(self, entries: Sequence[Entry]) -> None:
        """A reader that is no use for each READY entry of ``entries`` (a spill's or a put's copy): each
        stays where it is in the policy's order, passed over by eviction until :meth:`release`."""
        pinned = self._pinned
        for e in entries:
            if e.state is not _READY or not e.live:
                raise AssertionError(f"pin of {e!r}")  # internal bug
            n = e.readers
            e.readers = n + 1   # no call from here to the end of the add: an interrupt pins each entry or not
            if n == 0:
                pinned.add(e)

    def release(self, entry: Entry) -> None:
        """A reader finished; the slot becomes evictable (a lease's: as a use; a pin's: where it was)
        or is freed if removed."""
        if entry.readers <= 0:
            raise AssertionError(f"release without acquire: {entry!r}")  # internal bug
        entry.readers -= 1
        if entry.readers == 0:
            pinned = self._pinned
            try:
                if pinned and entry in pinned:
                    pinned.discard(entry)   # never left the policy
                    self._maybe_free(entry)
                elif entry.live and entry.state is _READY:
                    lru = self._lru
                    if lru is not None:
                        lru[entry.key] = entry   # LRU.unlease written out
                    else:
                        self.policy.unlease(entry)
                else:
                    self._maybe_free(entry)
            except BaseException:
                self._repair((entry,))   # released: in the order, or its slot freed
                raise

    def acquire_all(self, entries: Sequence[Entry], into: Optional[list[Any]] = None) -> None:
        """:meth:`acquire` for each of ``entries`` (a load's, leased together), each lease written to ``into[i]``
        as there (``into`` None: ``entries`` is the holder's list, and an interrupt may leave a lease taken
        that no list holds)."""
        if into is None:
            into = [None] * len(entries)
        lru, lease, pinned = self._lru, self.policy.lease, self._pinned
        try:
            for i, e in enumerate(entries):
                if e.state is not _READY or not e.live:
                    raise AssertionError(f"acquire of {e!r}")  # internal bug
                if e.readers == 0 or (pinned and e in pinned):
                    if lru is not None:
                        lru.pop(e.key, None)   # LRU.lease written out
                    else:
                        lease(e)
                    pinned.discard(e)
                e.readers += 1
                into[i] = e
        except BaseException:
            self._repair(entries)   # the lease broken off: back in the order
            raise

    def release_all(self, entries: Sequence[Optional[Entry]]) -> None:
        """:meth:`release` for each of ``entries`` that is not None (a load's, released together)."""
        self.release_taken(list(entries))

    def release_taken(self, entries: list[Optional[Entry]]) -> None:
        """:meth:`release_all` of the holder's own list, emptied: each entry leaves the list (its place set to
        None) and its count drops with no call between (an interrupt lands at a call's return), so that run
        again after an interrupt it releases exactly the entries not released yet; the one whose release was
        broken off is put back where its count says (:meth:`_repair`).  In the list's order, O(n)."""
        lru, unlease, pinned = self._lru, self.policy.unlease, self._pinned
        e = None
        try:
            for i, e in enumerate(entries):
                if e is None:
                    continue
                n = e.readers
                if n <= 0:
                    raise AssertionError(f"release without acquire: {e!r}")  # internal bug
                entries[i] = None   # no call from here to the count's drop
                e.readers = n - 1
                if n == 1:
                    if pinned and e in pinned:
                        pinned.discard(e)   # never left the policy
                        self._maybe_free(e)
                    elif e.live and e.state is _READY:
                        if lru is not None:
                            lru[e.key] = e   # LRU.unlease written out
                        else:
                            unlease(e)
                    else:
                        self._maybe_free(e)
            e = None
            entries.clear()
        except BaseException:
            if e is not None:
                self._repair((e,))
            raise

    def _repair(self, among: Optional[Iterable[Optional[Entry]]] = None, evicting: bool = False) -> None:
        """After an interrupt broke off a step that moves entries into or out of the policy's order (a lease, a
        release, a publish, an eviction, a removal): each entry of ``among`` (None: every entry), run through
        the policy's ``holds``/``restore``, ends up where its state says: live, READY and with no reader but
        pins (or leased, under a policy that keeps leases in place: S3-FIFO), in the order; removed, with no reader
        or writer, its slot free.  (Under the other policies no step leaves a leased entry in the order: a lease
        leaves it before it is counted.)  Each step is skipped where done already.  O(len(among)),
        on an interrupt only.  ``evicting``: a ``victim`` was broken off, and an entry it gave up already
        (``Policy.gave_up``) is evicted, as the uninterrupted call would have."""
        policy, pinned, entries = self.policy, self._pinned, self._entries
        for e in list(entries.values()) if among is None else list(among):
            if e is None:
                continue
            if not e.live or entries.get(e.key) is not e:
                self._maybe_free(e)
            elif e.state is _READY and (e.readers == 0 or e in pinned or policy.leases_in_place) and not policy.holds(e):
                if evicting and not e.readers and policy.gave_up(e):
                    self._evicted(e)
                else:
                    policy.restore(e)

    def remove(self, entry: Entry, handover: bool = False) -> None:
        """Take the entry out of the index; its slot is freed once no lease holds it.  ``handover``: a new
        reservation of the same key takes a reserved entry's place (:meth:`reserve`'s ``replace``), so the
        policy is not told that the reservation ended (:meth:`Policy.abandon`).

        Never a removed entry left in the policy's order, whatever call an interrupt breaks off (it lands at a
        call's return): its eviction would take the key's next entry out of the map, or raise ``KeyError`` in the
        engine's call.  The default policy's order, the map and the mark go in one C call; another policy forgets
        the entry first, while it is still live and in the map, so that an interrupt there leaves it in the
        index (removed by a retry: the policy's ``remove`` finds it gone), then the map and the mark go with no call
        between."""
        entries, key = self._entries, entry.key
        if entry.live and entries.get(key) is entry:
            lru = self._lru
            if lru is not None and entry.state is _READY:   # (evictable: in the order; leased: not in it)
                slot = entry.slot
                if entry.writing or entry.readers or slot < 0:   # its slot held: freed by its release
                    _consume(chain(map(lru.pop, (key,), (None,)), map(entries.__delitem__, (key,)),
                                   map(setattr, (entry,), ("live",), (False,))))
                else:   # (_maybe_free in the same C call)
                    _consume(chain(map(lru.pop, (key,), (None,)), map(entries.__delitem__, (key,)),
                                   map(setattr, (entry, entry), ("live", "slot"), (False, -1)),
                                   map(self._free.append, (slot,))))
                return
            else:
                try:
                    if entry.state is _READY:
                        self.policy.remove(entry)   # evictable or leased: the policy forgets it
                    elif not handover:
                        self.policy.abandon(key)   # never inserted: what the reservation told it goes
                except BaseException:
                    self._repair((entry,))   # still in the index: in the order again, for the retry to remove
                    raise
                del entries[key]
                entry.live = False
        elif entry.live:   # (not the map's entry: never the case for a live one)
            entry.live = False
        self._maybe_free(entry)

    # -- internals -------------------------------------------------------
    def _maybe_free(self, entry: Entry) -> None:
        slot = entry.slot
        if not entry.live and not entry.writing and entry.readers == 0 and slot >= 0:
            entry.slot = -1   # before the append, with no call between: run again, it never frees the slot twice
            self._free.append(slot)

    def evict_ahead(self, free: int, protect: Collection[bytes] = ()) -> int:
        """Evict the policy's victims until ``free`` slots are free or nothing is evictable, never an entry
        of a key in ``protect`` (the vLLM scheduler's: keys a waiting request was told are hits).

        The owner calls it between engine steps, so that the next step's reservations find free
        slots instead of evicting in the engine's call.  Returns how many entries it evicted.
        """
        n = free - len(self._free)
        if n <= 0:
            return 0
        if self._lru is not None and self._batched:   # the default policy: its n oldest entries go together
            before = self.evictions
            if self._evict_lru(n, protect) or self.evictions != before or not protect:
                return self.evictions - before
            # one of the n oldest is protected: one victim at a time, past it
        done = 0
        while done < n:
            if not self._evict_one(protect, None):
                break
            done += 1
        return done

    def _evict_lru(self, n: int, protect: Collection[bytes]) -> bool:
        """The default policy's ``n`` oldest entries leave together (fewer when fewer are evictable), the
        dicts' work in C; False, evicting nothing, when one of them is in ``protect``."""
        lru = self._lru
        assert lru is not None
        if self._pinned:   # passed over where they are (write-back spills: among the oldest)
            keys = list(islice((k for k, e in lru.items() if not e.readers), n))
        else:
            keys = list(islice(lru, n))
        if protect and not set(keys).isdisjoint(protect):
            return False
        victims = list(map(lru.__getitem__, keys))
        on_evict = self._on_evict
        if on_evict is not None:
            _consume(map(on_evict, victims))
        slots = [e.slot for e in reversed(victims)]   # pop() takes the oldest victim's slot first
        m = len(victims)
        # _evicted for each, in one C call (no Python code runs in it, so no interrupt lands inside): out of the
        # order and the map, their slots free, each marked removed -- all of it or none
        _consume(chain(map(lru.pop, keys), map(self._entries.__delitem__, keys), map(self._free.append, slots),
                       map(setattr, victims, repeat("live", m), repeat(False)),
                       map(setattr, victims, repeat("slot", m), repeat(-1))))
        self.evictions += m
        return m == n

    def _evict_one(self, protect: Collection[bytes], key: bytes) -> bool:
        lru = self._lru
        if lru is not None:
            # the default policy's victim leaves the order, the map and its slot in one C call, after the eviction
            # hook (an interrupt at the hook's return changes nothing here: the retry tells it again): never out of
            # the order while live, as a victim taken by ``victim`` and broken off before ``_evicted`` would be
            entry = self.policy.peek(protect, key)   # (LRU.victim's choice, changing nothing)
            if entry is None:
                return False
            if self._on_evict is not None:
                self._on_evict(entry)
            k, slot = entry.key, entry.slot
            _consume(chain(map(lru.pop, (k,)), map(self._entries.__delitem__, (k,)),
                           map(setattr, (entry, entry), ("live", "slot"), (False, -1)), map(self._free.append, (slot,))))
            self.evictions += 1
            return True
        # another policy: its victim leaves the order in its own steps.  Broken off after the policy gave the entry up
        # (or after it returned it), the eviction is finished (its hook told again at worst, as above); before, the
        # entry it was taking goes back in the order (``_repair``): never a live entry out of the order
        entry = None
        try:
            entry = self.policy.victim(protect, key)
            if entry is None:
                return False
            self._evicted(entry)
        except BaseException:
            if entry is not None and entry.live and self._entries.get(entry.key) is entry:
                self._evicted(entry)
            self._repair(evicting=True)
            raise
        return True

    def _evicted(self, entry: Entry) -> None:
        """An entry the policy just gave up as its victim leaves the index; its slot is free at once.

        ``remove()`` written out: the policy holds live READY entries with no reader and no
        writer, so nothing else can hold the slot (a full tier evicts once per reservation).
        """
        if self._on_evict is not None:
            self._on_evict(entry)
        entry.live = False
        del self._entries[entry.key]
        slot = entry.slot
        entry.slot = -1   # (as in _maybe_free)
        self._free.append(slot)
        self.evictions += 1
