"""Eviction and admission policies of a tier index, behind one small interface.

A :class:`~tiered_kv.core.index.TierIndex` keeps the leases (which slot may be written or read, and
when a slot is free); its policy only keeps the *order*: which of the evictable entries goes next.
An entry is evictable while it is READY, live and has no reader.  A reader is one of two kinds:

* a *lease* (a load reading the slot: a use) takes the entry out of the policy (``lease``) until its
  last reader lets go (``unlease``), so a policy never sees a leased entry -- except S3-FIFO, whose
  FIFOs never move on a use: there a leased entry stays where it is, passed over as a pinned one is;
* a *pin* (a spill or a remote put reading the slot: not a use) leaves the entry where it is in the
  policy's order; the policy passes over an entry with readers (``e.readers``) exactly as over a
  protected key, in ``victim``, ``peek`` and ``coldest``, and it is evictable again, in the same place,
  once the index unpins it.  A write-back spill of the coldest blocks leaves them the coldest.

The calls:

==================  =========================================================================
``insert(e)``       a new entry became READY with no reader (a store's or promote's copy landed)
``hit(e)``          a lookup or a store found the key (``e`` may be leased: then nothing to move)
``lease(e)``        its first reader took it: not evictable until ``unlease`` (a use, like a hit;
                    S3-FIFO counts the lookup's hit only and leaves the entry in place)
``unlease(e)``      its last reader let go and it is still READY and live: evictable again
``remove(e)``       it left the index for another reason than eviction (invalidated, aborted)
``victim(p, k)``    choose, forget and return the next evictable entry whose key is not ``k`` and
                    not in ``p``, with no reader (None: nothing evictable)
``peek(p, k)``      the entry ``victim(p, k)`` would take now, changing nothing (what an admission
                    filter weighs a new key against: :func:`admission_victim`)
``coldest(n, t)``   up to ``n`` evictable entries with no reader, the next victims first, forgetting
                    none (a bounded simulation: past its steps, queue order); ``through_pins``:
                    pinned entries count as evictable, the order once their reads end (write-back
                    spills in this order: what it picks does not depend on whether the reports
                    of the spills in flight were applied yet)
``link(keys)``      ``keys`` were seen in prefix order (a lookup's or a store's sequence)
``holds(e)``        whether ``e`` is in the order now (evictable, or pinned in place)
``restore(e)``      ``e``, live, READY and with no reader but pins, is not in the order (a step an
                    interrupt broke off left it out): it comes back, a lease still recorded for it
                    ended (by default: ``unlease``)
``gave_up(e)``      ``e`` is not in the order because a ``victim`` broken off gave it up already (its
                    ghost recorded, its node dropped): the index finishes that eviction
==================  =========================================================================

Admission (:class:`Admission`) decides whether a new key enters a tier at all: ``admit(key, victim)``
with the key the tier would evict for it (:func:`admission_victim`; None when a slot is free).  A
refused key costs nothing already stored: admission only gates new entries.

Every call runs on the owner thread (the index's caller); nothing here locks.

Why one module of this size: every policy and filter here implements the one contract of the tables
above, which the index relies on (a policy never returns an entry with a reader); kept beside it, each can be
checked against it line by line, and tests/test_policies.py runs one contract machine over them all.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from itertools import chain, islice
from typing import TYPE_CHECKING, Optional, TypeVar

from xxhash import xxh3_64_intdigest

if TYPE_CHECKING:   # pragma: no cover
    from .index import Entry

_T = TypeVar("_T")

__all__ = ["Policy", "LRU", "S3FIFO", "ARC", "PrefixLRU", "Admission", "AdmitAll", "SecondHit", "TinyLFU", "POLICIES",
           "ADMISSIONS", "make_policy", "make_admission", "admission_victim"]


def _consume(it: Iterator[object]) -> None:
    """Run an iterator to its end in C (no Python code runs inside it, so no interrupt lands between its steps)."""
    deque(it, 0)


class Policy:
    """The order of one tier's evictable entries (see the module's table).  ``__init__(num_slots)``:
    the tier's size, for policies that size their queues or ghost lists by it."""

    name = "policy"
    leases_in_place = False
    """True where a leased entry stays in the order, passed over while it has readers (S3-FIFO), instead of
    leaving it until its release: ``len()`` and ``holds`` then count it."""

    def abandon(self, key: bytes) -> None:
        """A reservation of ``key`` left the index before it was inserted (nothing to forget by default)."""

    def __len__(self) -> int:   # pragma: no cover - every policy says
        raise NotImplementedError

    def insert(self, e: "Entry") -> None:   # pragma: no cover
        raise NotImplementedError

    def hit(self, e: "Entry") -> None:   # pragma: no cover
        raise NotImplementedError

    def lease(self, e: "Entry") -> None:   # pragma: no cover
        raise NotImplementedError

    def unlease(self, e: "Entry") -> None:   # pragma: no cover
        raise NotImplementedError

    def remove(self, e: "Entry") -> None:   # pragma: no cover
        raise NotImplementedError

    def victim(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:   # pragma: no cover
        raise NotImplementedError

    def coldest(self, n: int, through_pins: bool = False) -> list["Entry"]:   # pragma: no cover
        raise NotImplementedError

    def peek(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:   # pragma: no cover
        """The entry ``victim(protect, key)`` would take now, changing nothing (None: it would take none)."""
        raise NotImplementedError

    def holds(self, e: "Entry") -> bool:   # pragma: no cover
        """Whether ``e`` is in the eviction order now (evictable, or pinned where it is)."""
        raise NotImplementedError

    def restore(self, e: "Entry") -> None:
        """``e`` should be in the order and is not (:meth:`TierIndex._repair`, after an interrupt): back as a
        release puts it, which ends a lease still recorded for it or inserts it as new."""
        self.unlease(e)

    def gave_up(self, e: "Entry") -> bool:
        """``e``, out of the order after a ``victim`` an interrupt broke off, was that victim's choice, given up
        already (the index finishes its eviction rather than :meth:`restore` it)."""
        return False

    uses_links = False   # True: the index calls link() (the others ignore the prefix structure: no call)

    def link(self, keys: Sequence[bytes]) -> None:
        """Most policies ignore the prefix structure."""


class LRU(Policy):
    """Least recently used first; a lease takes the entry out and its release puts it back as most
    recently used (a read is a use); a pinned entry stays in place, passed over."""

    name = "lru"
    __slots__ = ("od",)

    def __init__(self, num_slots: int = 0) -> None:
        self.od: OrderedDict[bytes, "Entry"] = OrderedDict()

    def __len__(self) -> int:
        return len(self.od)

    def insert(self, e: "Entry") -> None:
        self.od[e.key] = e

    unlease = insert

    def hit(self, e: "Entry") -> None:
        od = self.od
        if od.get(e.key) is e:   # a leased entry is not here: its release makes it the newest
            od.move_to_end(e.key)

    def lease(self, e: "Entry") -> None:
        self.od.pop(e.key, None)

    def holds(self, e: "Entry") -> bool:
        return self.od.get(e.key) is e

    def remove(self, e: "Entry") -> None:
        od = self.od
        if od.get(e.key) is e:
            del od[e.key]

    def victim(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        od = self.od
        if not od:
            return None
        k, e = next(iter(od.items()))   # the oldest, in C: the common case (not protected) scans no further
        if k != key and k not in protect and not e.readers:
            del od[k]
            return e
        for k, e in od.items():
            if k == key or k in protect or e.readers:
                continue
            del od[k]
            return e
        return None

    def coldest(self, n: int, through_pins: bool = False) -> list["Entry"]:
        if through_pins:
            return list(islice(self.od.values(), max(0, n)))
        out: list["Entry"] = []
        for e in self.od.values():
            if len(out) >= n:
                break
            if not e.readers:
                out.append(e)
        return out

    def peek(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        for k, e in self.od.items():
            if k != key and k not in protect and not e.readers:
                return e
        return None


class Admission:
    """Whether a new key enters a tier: ``record(key)`` sees every reference to a key (lookups and
    stores), ``admit(key, victim)`` answers for a key about to be inserted (``victim``: the key the
    tier would evict for it, None while a slot is free)."""

    name = "admission"

    def record(self, key: bytes) -> None:
        """Most filters count references; admitting everything needs none."""

    def admit(self, key: bytes, victim: Optional[bytes]) -> bool:   # pragma: no cover
        raise NotImplementedError


class AdmitAll(Admission):
    name = "all"

    def __init__(self, num_slots: int = 0) -> None:
        pass

    def admit(self, key: bytes, victim: Optional[bytes]) -> bool:
        return True


# -- S3-FIFO ---------------------------------------------------------------------------------------

class S3FIFO(Policy):
    """S3-FIFO (Yang et al., SOSP'23): a small FIFO (10% of the slots) that new keys enter, a main
    FIFO, a ghost FIFO of the keys evicted from the small one (as many keys as slots), and a 2-bit
    frequency per entry (a hit adds one, capped at 3).

    A victim comes from the small FIFO while it holds at least its share (its oldest entry moves to
    the main FIFO if it was used, else it is evicted and its key remembered in the ghost), else from
    the main FIFO (a used entry loses one and goes round again, an unused one is evicted).  A new key
    found in the ghost enters the main FIFO.  An access is counted once, by the lookup's (or store's)
    ``hit``, and moves nothing (the algorithm's lazy promotion): a load's lease therefore adds no use and
    leaves the entry where it is, passed over while it has readers as a pinned one is (the exception to
    the module's "a lease takes the entry out"), so a block read keeps its place in its FIFO.  Protected
    keys are invisible to one ``victim`` call: they are passed over untouched and stay where they were.
    """

    name = "s3fifo"
    leases_in_place = True
    __slots__ = ("small", "main", "ghost", "freq", "target", "ghost_max", "walk", "held")

    def __init__(self, num_slots: int = 0) -> None:
        self.small: OrderedDict[bytes, "Entry"] = OrderedDict()   # oldest first
        self.main: OrderedDict[bytes, "Entry"] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}        # every entry held (leased ones too: they stay in their FIFO)
        self.target = max(1, num_slots // 10)   # the small FIFO's share
        self.ghost_max = max(1, num_slots)
        self.walk = self.small   # the FIFO victim() pops from (restore puts back there what an interrupt left out)
        # the entries victim() passed over, by FIFO, until its finally puts them back (restore reads them)
        self.held: tuple[list[tuple[bytes, "Entry"]], list[tuple[bytes, "Entry"]]] = ([], [])

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def insert(self, e: "Entry") -> None:
        k = e.key
        self.freq[k] = 0
        if k in self.ghost:
            del self.ghost[k]
            self.main[k] = e
        else:
            self.small[k] = e

    def hit(self, e: "Entry") -> None:
        freq = self.freq
        f = freq.get(e.key)
        if f is not None and f < 3:   # None: not held (being written)
            freq[e.key] = f + 1

    def lease(self, e: "Entry") -> None:
        """Nothing: the entry stays where it is, passed over while it has readers (``e.readers``), and its
        access was counted by the lookup's ``hit``."""

    def unlease(self, e: "Entry") -> None:
        if not self.holds(e):   # not held here: a new entry as far as this policy knows
            self.insert(e)

    def holds(self, e: "Entry") -> bool:
        k = e.key
        return self.small.get(k) is e or self.main.get(k) is e

    def gave_up(self, e: "Entry") -> bool:
        return e.key not in self.freq   # (a victim forgets its frequency last)

    def restore(self, e: "Entry") -> None:
        k = e.key
        if k not in self.freq:
            self.insert(e)
        else:   # held, out of its FIFO (a victim's walk broken off): back at the cold end of the FIFO it was taken
            # from: the one whose walk passed it over, else the one the walk was popping from
            held_small, held_main = self.held
            q = (self.small if any(x is e for _, x in held_small) else
                 self.main if any(x is e for _, x in held_main) else self.walk)
            q[k] = e
            q.move_to_end(k, last=False)
            if q is self.walk and not any(x is e for _, x in held_small + held_main):
                # the entry the walk had popped and not placed: behind those it passed over before it, as the
                # walk found them (its finally put them back at the cold end)
                for k2, x in reversed(held_small if q is self.small else held_main):
                    if q.get(k2) is x:
                        q.move_to_end(k2, last=False)

    def remove(self, e: "Entry") -> None:
        k = e.key
        if self.small.get(k) is e:
            del self.small[k]
        elif self.main.get(k) is e:
            del self.main[k]
        else:
            return
        del self.freq[k]

    def victim(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        small, main, freq = self.small, self.main, self.freq
        held_small: list[tuple[bytes, "Entry"]] = []   # protected: passed over, put back where they were
        held_main: list[tuple[bytes, "Entry"]] = []
        self.held = held_small, held_main
        try:
            while True:
                if small and (len(small) >= self.target or not main):
                    self.walk = small
                    while small:   # evict from the small FIFO: used entries move to main
                        k, e = small.popitem(last=False)
                        if k == key or k in protect or e.readers:
                            held_small.append((k, e))
                        elif freq[k] > 0:
                            main[k] = e
                        else:
                            del freq[k]
                            ghost = self.ghost
                            ghost[k] = None
                            if len(ghost) > self.ghost_max:
                                ghost.popitem(last=False)
                            return e
                    continue
                if main:
                    self.walk = main
                    while main:    # evict from the main FIFO: used entries go round once more
                        k, e = main.popitem(last=False)
                        if k == key or k in protect or e.readers:
                            held_main.append((k, e))
                            continue
                        f = freq[k]
                        if f > 0:
                            freq[k] = f - 1
                            main[k] = e
                        else:
                            del freq[k]
                            return e
                    continue
                return None
        finally:
            for q, held in ((small, held_small), (main, held_main)):
                for k, e in reversed(held):
                    q[k] = e
                    q.move_to_end(k, last=False)

    def coldest(self, n: int, through_pins: "bool | Collection[Entry]" = False) -> list["Entry"]:
        """The next ``n`` victims, computed on a view of the FIFOs (at most ``8 n + 64`` steps of
        the eviction; past that the rest in FIFO order).  ``through_pins``: True, every entry with readers
        counts as evictable; or the pinned entries alone (the index's: a leased one, in place here, is
        still passed over)."""
        out: list["Entry"] = []
        if n <= 0:
            return out
        pins = None if isinstance(through_pins, bool) else through_pins

        def passed(e: "Entry") -> bool:   # read, and not counted through: passed over as victim() passes it
            return bool(e.readers) and not (through_pins is True or (pins is not None and e in pins))
        freq = self.freq
        s_it, m_it = iter(self.small.items()), iter(self.main.items())
        s_left, m_left = len(self.small), len(self.main)
        moved: deque[tuple[bytes, "Entry", int]] = deque()   # appended to main meanwhile, with its frequency
        n_small = s_left
        budget = 8 * n + 64
        while len(out) < n and budget > 0:
            if s_left and (n_small >= self.target or not (m_left or moved)):
                while s_left and budget > 0:
                    budget -= 1
                    k, e = next(s_it)
                    s_left -= 1
                    if passed(e):   # pinned: passed over, it stays in the small FIFO
                        continue
                    n_small -= 1
                    f = freq[k]
                    if f > 0:
                        moved.append((k, e, f))
                    else:
                        out.append(e)
                        break
                continue
            if m_left or moved:
                while (m_left or moved) and budget > 0:
                    budget -= 1
                    if m_left:
                        k, e = next(m_it)
                        m_left -= 1
                        if passed(e):   # pinned: passed over
                            continue
                        f = freq[k]
                    else:
                        k, e, f = moved.popleft()
                    if f > 0:
                        moved.append((k, e, f - 1))
                    else:
                        out.append(e)
                        break
                continue
            break
        if len(out) < n and budget <= 0:   # out of steps: the rest in FIFO order
            seen = {id(e) for e in out}
            for e in chain((e for _, e in s_it), (e for _, e in m_it), (e for _, e, _ in moved)):
                if len(out) >= n:
                    break
                if id(e) not in seen and not passed(e):
                    seen.add(id(e))
                    out.append(e)
        return out

    def peek(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        """:meth:`victim`'s walk on a view of the FIFOs: protected entries passed over, used small ones
        moved to main, used main ones going round with one use less (at most four rounds of main)."""
        freq, small, main = self.freq, self.small, self.main
        moved: deque[tuple["Entry", int]] = deque()   # appended to main's view meanwhile, with its uses left

        def from_small() -> Optional["Entry"]:
            for k, e in small.items():
                if k != key and k not in protect and not e.readers:
                    f = freq[k]
                    if f == 0:
                        return e
                    moved.append((e, f))
            return None

        def from_main(own: bool) -> Optional["Entry"]:
            src = ((e, freq[k]) for k, e in main.items() if k != key and k not in protect and not e.readers) if own else ()
            for e, f in chain(src, _drain(moved)):
                if f == 0:
                    return e
                moved.append((e, f - 1))
            return None

        if small and (len(small) >= self.target or not main):
            e = from_small()
            return e if e is not None else from_main(True)
        e = from_main(True)
        if e is not None or not small:
            return e
        # main held only protected entries: victim() found it empty then, and went on to the small FIFO
        e = from_small()
        return e if e is not None else from_main(False)


def _drain(q: "deque[_T]") -> Iterator[_T]:
    """``q``'s items, oldest first, including those appended while it is drained."""
    while q:
        yield q.popleft()


# -- ARC -------------------------------------------------------------------------------------------

class ARC(Policy):
    """ARC (Megiddo & Modha, FAST'03) for ``c = num_slots``: T1 (used once) and T2 (used again) of
    entries, least recently used first, B1 and B2 of the keys evicted from them, and the target size
    ``p`` of T1.  A hit moves an entry to T2's newest end; a new key found in B1 (B2) grows (shrinks)
    ``p`` and enters T2.  The victim follows REPLACE: T1's oldest while ``|T1| > p`` (or ``== p``
    for a key in B2), else T2's oldest; the other list when all of one are protected.

    ``victim(protect, key)`` adapts ``p`` for ``key`` when it is a ghost (it is the key about to be
    inserted); ``insert`` does it for a ghost key that came without a victim (a slot was free).  A
    leased entry leaves its list (still counted in its size) and returns to the newest end of it;
    a hit while leased sends it to T2.
    """

    name = "arc"
    __slots__ = ("c", "p", "t1", "t2", "b1", "b2", "leased", "n_leased", "adapted")

    def __init__(self, num_slots: int = 0) -> None:
        self.c = max(1, num_slots)
        self.p = 0.0
        self.t1: OrderedDict[bytes, "Entry"] = OrderedDict()
        self.t2: OrderedDict[bytes, "Entry"] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.leased: dict[bytes, int] = {}      # leased entry -> 1 (T1) or 2 (T2)
        self.n_leased = [0, 0, 0]               # by list
        self.adapted: OrderedDict[bytes, None] = OrderedDict()   # ghost keys whose victim adapted p

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def _adapted(self, k: bytes) -> Optional[float]:
        """``p`` after a miss on ``k`` when ``k`` is a ghost (B1 grows it, B2 shrinks it); None when not."""
        b1, b2 = self.b1, self.b2
        if k in b1:
            return min(float(self.c), self.p + (1.0 if len(b1) >= len(b2) else len(b2) / len(b1)))
        if k in b2:
            return max(0.0, self.p - (1.0 if len(b2) >= len(b1) else len(b1) / len(b2)))
        return None

    def _adapt(self, k: bytes) -> bool:
        """A miss on ``k``: move ``p`` if ``k`` is a ghost; whether it was."""
        p = self._adapted(k)
        if p is None:
            return False
        self.p = p
        return True

    def insert(self, e: "Entry") -> None:
        # decided before anything changes, then filed with ``p`` with no call between; the mark, the ghost key and a
        # trimmed ghost go after it (an interrupt lands at a call's return: the entry is filed, and ``p`` adapted,
        # once or not at all; ``restore`` finds it held and does not insert it again)
        k = e.key
        b1, b2, adapted = self.b1, self.b2, self.adapted
        done = k in adapted   # its victim adapted p already
        if k in b1 or k in b2 or done:
            p = self.p if done else self._adapted(k)
            self.t2[k] = e
            self.p = p   # type: ignore[assignment]   # (a ghost: _adapted gave a value)
            if done:
                del adapted[k]
            if k in b1:
                del b1[k]
            if k in b2:
                del b2[k]
            return
        c = self.c
        l1 = len(self.t1) + self.n_leased[1] + len(b1)
        trim = b1 if l1 >= c else b2 if b2 and l1 + len(self.t2) + self.n_leased[2] + len(b2) >= 2 * c else None
        self.t1[k] = e
        if trim:
            trim.popitem(last=False)

    def hit(self, e: "Entry") -> None:
        k = e.key
        t2 = self.t2
        if self.t1.get(k) is e:
            del self.t1[k]
            t2[k] = e
        elif t2.get(k) is e:
            t2.move_to_end(k)
        elif self.leased.get(k) == 1:
            self.leased[k] = 2
            self.n_leased[1] -= 1
            self.n_leased[2] += 1

    def lease(self, e: "Entry") -> None:
        k = e.key
        if self.t1.get(k) is e:
            del self.t1[k]
            q = 1
        elif self.t2.get(k) is e:
            del self.t2[k]
            q = 2
        else:
            return
        self.leased[k] = q
        self.n_leased[q] += 1

    def unlease(self, e: "Entry") -> None:
        k = e.key
        q = self.leased.get(k, 0)
        if q == 0:   # not leased here: a new entry as far as this policy knows
            self.insert(e)
            return
        # back in its list, the lease's record and count gone, with no call between: never out of both
        (self.t1 if q == 1 else self.t2)[k] = e
        del self.leased[k]
        self.n_leased[q] -= 1

    def holds(self, e: "Entry") -> bool:
        k = e.key
        return self.t1.get(k) is e or self.t2.get(k) is e

    def gave_up(self, e: "Entry") -> bool:
        return e.key in self.b1 or e.key in self.b2   # (a victim's key joins its ghost list as it leaves its list)

    def remove(self, e: "Entry") -> None:
        k = e.key
        if self.t1.get(k) is e:
            del self.t1[k]
        elif self.t2.get(k) is e:
            del self.t2[k]
        elif k in self.leased:
            q = self.leased[k]
            del self.leased[k]   # (with its count, no call between)
            self.n_leased[q] -= 1

    @staticmethod
    def _oldest(od: "OrderedDict[bytes, Entry]", protect: Collection[bytes],
                key: Optional[bytes]) -> Optional["Entry"]:
        for k, e in od.items():
            if k == key or k in protect or e.readers:
                continue
            return e
        return None

    def victim(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        ghost = False
        if key is not None:
            ghost = key in self.adapted
            if not ghost and self._adapt(key):
                ghost = True
                adapted = self.adapted
                adapted[key] = None
                if len(adapted) > self.c:
                    adapted.popitem(last=False)
        e = self._replace(protect, key, ghost)
        if e is None and key is not None:
            self.adapted.pop(key, None)   # no reservation follows: the mark must not outlive it
        return e

    def abandon(self, key: bytes) -> None:
        """A reservation of ``key`` ended without an insert (its store failed or was dropped): a ghost
        hit's mark goes with it, so a later insert of ``key`` is a ghost hit only if it is one then."""
        self.adapted.pop(key, None)

    def _replace(self, protect: Collection[bytes], key: Optional[bytes], ghost: bool) -> Optional["Entry"]:
        """ARC's REPLACE for a reservation of ``key`` (``ghost``: a ghost hit, ``p`` adapted already)."""
        picked = self._pick(protect, key, ghost, self.p)
        if picked is None:
            return None
        e, od, ghosts = picked
        del od[e.key]
        if ghosts is not None:
            ghosts[e.key] = None
            b1, b2 = self.b1, self.b2
            if len(b1) + len(b2) > 2 * self.c:   # a safety net: REPLACE keeps them within 2c
                (b2 if b2 else b1).popitem(last=False)
        return e

    def _pick(self, protect: Collection[bytes], key: Optional[bytes], ghost: bool, p: float
              ) -> Optional[tuple["Entry", "OrderedDict[bytes, Entry]", "Optional[OrderedDict[bytes, None]]"]]:
        """REPLACE's choice with target ``p``, changing nothing: the entry, its list, and the ghost list
        its key joins (None: T1 is the whole cache, its oldest goes without a ghost)."""
        t1, t2 = self.t1, self.t2
        n1 = len(t1) + self.n_leased[1]
        if key is not None and not ghost and n1 >= self.c:
            e = self._oldest(t1, protect, key)
            if e is not None:
                return e, t1, None
        in_b2 = key is not None and key in self.b2
        from_t1 = n1 >= 1 and ((in_b2 and n1 == p) or n1 > p)
        for od, ghosts in (((t1, self.b1), (t2, self.b2)) if from_t1 else ((t2, self.b2), (t1, self.b1))):
            e = self._oldest(od, protect, key)
            if e is not None:
                return e, od, ghosts
        return None

    def peek(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        """REPLACE as :meth:`victim` would run it: with ``p`` adapted first for a ghost ``key``."""
        p, ghost = self.p, False
        if key is not None:
            ghost = key in self.adapted
            if not ghost:
                q = self._adapted(key)
                if q is not None:
                    p, ghost = q, True
        picked = self._pick(protect, key, ghost, p)
        return None if picked is None else picked[0]

    def coldest(self, n: int, through_pins: bool = False) -> list["Entry"]:
        """The next ``n`` victims by REPLACE for keys that are no ghosts."""
        out: list["Entry"] = []
        # a pinned entry is passed over, in its list
        it1 = (e for e in self.t1.values() if through_pins or not e.readers)
        it2 = (e for e in self.t2.values() if through_pins or not e.readers)
        h1, h2 = next(it1, None), next(it2, None)
        n1 = len(self.t1) + self.n_leased[1]
        p = self.p
        while len(out) < n and (h1 is not None or h2 is not None):
            if (n1 >= 1 and n1 > p and h1 is not None) or h2 is None:
                out.append(h1)   # type: ignore[arg-type]
                h1 = next(it1, None)
                n1 -= 1
            else:
                out.append(h2)
                h2 = next(it2, None)
        return out


# -- prefix-aware ----------------------------------------------------------------------------------

_LEASED, _ORPHAN, _LEAF, _INNER = 0, 1, 2, 3


class _Node:
    __slots__ = ("entry", "parent", "t", "q", "orphan", "freq")

    def __init__(self, entry: "Entry", t: int) -> None:
        self.entry = entry
        self.parent: Optional[bytes] = None   # the key before it in a prefix chain, when known
        self.t = t                            # last use, on the policy's clock
        self.q = _LEAF                        # the queue it is in (_LEASED: none)
        self.orphan = False                   # its parent left this tier while it stayed
        self.freq = 0                         # uses since it came (capped at 3): second chances as a leaf


class PrefixLRU(Policy):
    """Prefix-aware LRU for prefix caches: a block is only worth keeping while the blocks before it
    in its chain are kept, so tails go before heads.

    ``link(keys)`` tells each key its parent (the key before it).  The evictable entries are in three
    queues, each least recently used first, and a victim comes from the first that has one:

    1. orphans: a block whose parent left this tier while it stayed (a prefix lookup stops before it);
    2. leaves: no child of it is in this tier (evictable or leased): the tails of the chains.  A
       CLOCK: each use gives a leaf one more round (at most 3), so a reused block (a shared head, a
       conversation's history) outlives a tail used once;
    3. inner blocks (every leaf is protected or leased): their children become orphans.

    When its last child leaves, a block becomes a leaf at the cold end of the leaves if it was used
    no later than the coldest leaf (the rest of a cold chain goes next, tail first, unless a use gives
    it another round), else at the hot end.  A head with many children stays an inner block while
    any of them is here.  A block that comes back (a promote) adopts its children again; a key
    evicted lately (a ghost, ``num_slots + 64`` of them) comes back with one round in hand.

    Memory for links: parents of the entries held, and FIFOs of ``num_slots + 64`` keys not held
    (links of keys linked by a lookup or a store before they are inserted, and of ghosts).
    """

    name = "prefix"
    __slots__ = ("nodes", "children", "links", "links_max", "orphans", "leaves", "inner", "clock", "ghosts")

    def __init__(self, num_slots: int = 0) -> None:
        self.nodes: dict[bytes, _Node] = {}              # every entry held, evictable or leased
        self.children: dict[bytes, set[bytes]] = {}      # parent key (held or not) -> its children held
        self.links: OrderedDict[bytes, bytes] = OrderedDict()   # key not held -> its parent
        self.links_max = max(1, num_slots) + 64
        self.orphans: OrderedDict[bytes, _Node] = OrderedDict()
        self.leaves: OrderedDict[bytes, _Node] = OrderedDict()
        self.inner: OrderedDict[bytes, _Node] = OrderedDict()
        self.clock = 0
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.orphans) + len(self.leaves) + len(self.inner)

    def _queue(self, q: int) -> "OrderedDict[bytes, _Node]":
        return self.orphans if q == _ORPHAN else self.leaves if q == _LEAF else self.inner

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _place(self, k: bytes, node: _Node) -> None:
        """Put an evictable node at the hot end of the queue its state says (its mark and its place with no call
        between: an interrupt lands at a call's return, and a node marked for a queue it is not in would raise
        ``KeyError`` when it leaves it)."""
        q = _ORPHAN if node.orphan else _INNER if self.children.get(k) else _LEAF
        queue = self._queue(q)
        node.q = q
        queue[k] = node

    def _requeue(self, k: bytes, node: _Node) -> None:
        """An evictable node's state changed (orphaned, adopted, lost its last child): it moves to the queue its
        state says, out of one and into the other in one C call (never in none, nor in two)."""
        if node.q == _LEASED:
            return
        q = _ORPHAN if node.orphan else _INNER if self.children.get(k) else _LEAF
        old, new = self._queue(node.q), self._queue(q)
        _consume(chain(map(old.pop, (k,), (None,)), map(setattr, (node,), ("q",), (q,)),
                       map(new.__setitem__, (k,), (node,))))
        if q != _LEAF:
            return
        leaves = self.leaves   # a new leaf: the cold end when used no later than the coldest leaf
        for first in leaves.values():
            if node.t <= first.t:
                leaves.move_to_end(k, last=False)
            break

    uses_links = True

    def link(self, keys: Sequence[bytes]) -> None:
        nodes, links = self.nodes, self.links
        prev: Optional[bytes] = None
        for k in keys:
            if prev is not None and prev != k:
                node = nodes.get(k)
                if node is None:
                    links[k] = prev
                    links.move_to_end(k)
                    if len(links) > self.links_max:
                        links.popitem(last=False)
                elif node.parent is None:
                    self._adopt(k, node, prev)
            prev = k

    def _by_use(self, kids: set[bytes]) -> list[bytes]:
        """``kids`` least recently used first: the order they join a queue in (a set's own order is its
        hashes', which changes from one process to the next with Python's hash seed)."""
        nodes = self.nodes
        return sorted(kids, key=lambda c: nodes[c].t) if len(kids) > 1 else list(kids)

    def _adopt(self, k: bytes, node: _Node, parent: bytes) -> None:
        node.parent = parent
        kids = self.children.get(parent)
        if kids is None:
            kids = self.children[parent] = set()
        kids.add(k)
        pn = self.nodes.get(parent)
        if pn is not None and len(kids) == 1 and pn.q == _LEAF:
            self._requeue(parent, pn)   # no longer a leaf

    def insert(self, e: "Entry") -> None:
        k = e.key
        nodes = self.nodes
        old = nodes.get(k)
        if old is not None:   # not in the contract; keep the queues consistent anyway
            self._drop(k, old, False)
        node = nodes[k] = _Node(e, self._tick())
        if k in self.ghosts:
            del self.ghosts[k]
            node.freq = 1
        parent = self.links.pop(k, None)
        if parent is not None and parent != k:
            self._adopt(k, node, parent)
        kids = self.children.get(k)
        if kids:   # back in this tier: its children are no orphans any more
            for c in self._by_use(kids):
                cn = nodes[c]
                if cn.orphan:
                    cn.orphan = False
                    self._requeue(c, cn)
        self._place(k, node)

    def hit(self, e: "Entry") -> None:
        k = e.key
        node = self.nodes.get(k)
        if node is None or node.entry is not e:
            return
        node.t = self._tick()
        if node.freq < 3:
            node.freq += 1
        if node.q == _ORPHAN or node.q == _INNER:   # a leaf's use is its frequency (CLOCK)
            self._queue(node.q).move_to_end(k)

    def lease(self, e: "Entry") -> None:
        k = e.key
        node = self.nodes.get(k)
        if node is None or node.entry is not e or node.q == _LEASED:
            return
        self._queue(node.q).pop(k, None)   # (out of it already: a removal an interrupt broke off)
        node.q = _LEASED
        node.t = self._tick()

    def holds(self, e: "Entry") -> bool:
        node = self.nodes.get(e.key)
        return node is not None and node.entry is e and node.q != _LEASED and self._queue(node.q).get(e.key) is node

    def gave_up(self, e: "Entry") -> bool:
        node = self.nodes.get(e.key)
        return node is None or node.entry is not e   # (its _drop ran to the node's removal; before, restore relinks it)

    def restore(self, e: "Entry") -> None:
        k = e.key
        node = self.nodes.get(k)
        if node is None or node.entry is not e:
            self.insert(e)
            return
        if node.q != _LEASED:
            self._queue(node.q).pop(k, None)
        # held: linked under its parent again, and no child of it an orphan (an insert or a drop broken off between)
        parent = node.parent
        if parent is not None and k not in self.children.get(parent, ()):
            self._adopt(k, node, parent)
        kids = self.children.get(k)
        if kids:
            nodes = self.nodes
            for c in self._by_use(kids):
                cn = nodes[c]
                if cn.orphan or cn.q == _ORPHAN:   # (marked, or unmarked and still in the orphans' queue)
                    cn.orphan = False
                    self._requeue(c, cn)
        self._place(k, node)

    def unlease(self, e: "Entry") -> None:
        k = e.key
        node = self.nodes.get(k)
        if node is None or node.entry is not e:
            self.insert(e)
        elif node.q == _LEASED:
            self._place(k, node)

    def remove(self, e: "Entry") -> None:
        node = self.nodes.get(e.key)
        if node is not None and node.entry is e:
            self._drop(e.key, node, False)

    def _drop(self, k: bytes, node: _Node, evicted: bool) -> None:
        """``node`` leaves the tier: its children become orphans, its parent may become a leaf."""
        # every reference to k goes before its node does, the node last: an interrupt leaves no key in a queue
        # or a parent's children without its node (looked up by key there: KeyError), and k still found by a
        # retry (``remove`` again), which finishes the rest (a node out of its queue is let go of tolerantly)
        nodes, children = self.nodes, self.children
        if node.q != _LEASED:
            self._queue(node.q).pop(k, None)
        kids = children.get(k)
        if kids:   # kept (for a return of k) while any of them is held
            for c in self._by_use(kids):
                cn = nodes[c]
                if not cn.orphan:
                    cn.orphan = True
                    self._requeue(c, cn)
        parent = node.parent
        if parent is not None:
            sib = children.get(parent)
            if sib is not None:
                sib.discard(k)
                if not sib:
                    del children[parent]
                    pn = nodes.get(parent)
                    if pn is not None and pn.q == _INNER:
                        self._requeue(parent, pn)
        del nodes[k]
        if evicted:
            g = self.ghosts
            g[k] = None
            if len(g) > self.links_max:
                g.popitem(last=False)
        if parent is not None:
            if evicted:   # remembered for a while: a promote of k links it again
                links = self.links
                links[k] = parent
                if len(links) > self.links_max:
                    links.popitem(last=False)

    def victim(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        for k, node in self.orphans.items():
            if k != key and k not in protect and not node.entry.readers:
                self._drop(k, node, True)   # changes the queues: no next step of this loop
                return node.entry
        # CLOCK over the leaves from the front: a protected leaf is passed over where it is, a used one goes round
        # with one use less, the first unused one goes.  Each change is one C call (an interrupt lands at a call's
        # return): a leaf is never out of its queue while marked in it (its removal would raise KeyError)
        leaves = self.leaves
        while True:
            for k, node in leaves.items():   # the first leaf not passed over (from the front: a move ends the loop)
                if k != key and k not in protect and not node.entry.readers:
                    break
            else:
                break   # every leaf protected or leased
            if node.freq > 0:            # used since it came: one more round
                node.freq -= 1
                leaves.move_to_end(k)
            else:
                self._drop(k, node, True)
                return node.entry
        for k, node in self.inner.items():
            if k != key and k not in protect and not node.entry.readers:
                self._drop(k, node, True)
                return node.entry
        return None

    def peek(self, protect: Collection[bytes], key: Optional[bytes]) -> Optional["Entry"]:
        """:meth:`victim`'s choice on a view of the queues: the first orphan, else the leaves' CLOCK
        (a used leaf goes round with one use less), else the first inner block; protected ones passed over."""
        for k, node in self.orphans.items():
            if k != key and k not in protect and not node.entry.readers:
                return node.entry
        again: deque[tuple[_Node, int]] = deque()   # leaves gone round meanwhile, with their uses left
        for node, f in chain(((nd, nd.freq) for k, nd in self.leaves.items()
                              if k != key and k not in protect and not nd.entry.readers), _drain(again)):
            if f == 0:
                return node.entry
            again.append((node, f - 1))
        for k, node in self.inner.items():
            if k != key and k not in protect and not node.entry.readers:
                return node.entry
        return None

    def coldest(self, n: int, through_pins: bool = False) -> list["Entry"]:
        """The next ``n`` victims: orphans (and the children their eviction orphans), then leaves (their
        second chances and the parents a leaf's eviction makes leaves foreseen, within ``8 n + 64``
        steps), then inner blocks (and the children their eviction orphans, and the parents it makes leaves)."""
        out: list["Entry"] = []
        nodes, children = self.nodes, self.children
        taken: set[int] = set()
        orphans: deque[_Node] = deque(self.orphans.values())
        while orphans and len(out) < n:
            node = orphans.popleft()
            if node.entry.readers and not through_pins:   # pinned: passed over (its children stay where they
                taken.add(id(node))  # are); an orphan now, in no other queue: not a leaf the leaves below compare with
                continue
            out.append(node.entry)
            taken.add(id(node))
            kids = children.get(node.entry.key)
            if kids:   # orphaned by its eviction: at the hot end of the orphans
                orphans.extend(cn for cn in map(nodes.__getitem__, self._by_use(kids))
                               if not cn.orphan and cn.q != _LEASED and id(cn) not in taken)
        if len(out) >= n:
            return out
        gone: dict[bytes, int] = {}                 # parent -> children of it taken here
        front: list[tuple[_Node, int]] = []         # new leaves at the cold end (last: first)
        back: deque[tuple[_Node, int]] = deque()    # at the hot end: second chances, new leaves
        it = (nd for nd in self.leaves.values() if id(nd) not in taken)
        nxt = next(it, None)
        budget = 8 * n + 64
        while len(out) < n and budget > 0:
            budget -= 1
            if front:
                node, f = front.pop()
            elif nxt is not None:
                node, f = nxt, nxt.freq
                nxt = next(it, None)
            elif back:
                node, f = back.popleft()
            else:
                break
            if node.entry.readers and not through_pins:   # pinned: passed over, its uses kept
                continue
            if f > 0:
                back.append((node, f - 1))
                continue
            out.append(node.entry)
            taken.add(id(node))
            parent = node.parent
            pn = None if parent is None else nodes.get(parent)
            if pn is None or pn.q != _INNER:
                continue
            g = gone[parent] = gone.get(parent, 0) + 1
            if g == len(children[parent]):            
                head = front[-1][0] if front else nxt if nxt is not None else back[0][0] if back else None
                (front if head is None or pn.t <= head.t else back).append((pn, pn.freq))
        if len(out) < n:   # the leaves left in queue order (none unless the steps ran out)
            rest = chain((nd for nd, _ in reversed(front)), () if nxt is None else (nxt,), it, (nd for nd, _ in back))
            for node in rest:
                if len(out) >= n:
                    break
                if id(node) not in taken and (through_pins or not node.entry.readers):
                    taken.add(id(node))
                    out.append(node.entry)
        # then the inner blocks: the children one's eviction orphans go next (orphans first), then a parent whose
        # last child it was (a leaf now, and the only one)
        inner = iter(self.inner.values())
        orphaned: deque[_Node] = deque()
        leaf: list[_Node] = []
        while len(out) < n:
            node = orphaned.popleft() if orphaned else leaf.pop() if leaf else next(inner, None)
            if node is None:
                break
            if id(node) in taken or (node.entry.readers and not through_pins):
                continue
            taken.add(id(node))
            out.append(node.entry)
            kids = children.get(node.entry.key)
            if kids:
                orphaned.extend(cn for cn in map(nodes.__getitem__, self._by_use(kids))
                                if cn.q != _LEASED and id(cn) not in taken)
            parent = node.parent
            pn = None if parent is None else nodes.get(parent)
            if pn is not None and pn.q == _INNER and id(pn) not in taken:
                g = gone[parent] = gone.get(parent, 0) + 1
                if g == len(children[parent]):
                    leaf.append(pn)
        return out


# -- admission -------------------------------------------------------------------------------------

class SecondHit(Admission):
    """Admits a key referenced before the reference that stores it: ``record`` counts references
    in a bounded doorkeeper (the last ``4 num_slots`` distinct keys, at least 64), and ``admit`` wants
    two of them (the one being admitted is recorded first)."""

    name = "second_hit"
    __slots__ = ("seen", "bound")

    def __init__(self, num_slots: int = 0) -> None:
        self.seen: OrderedDict[bytes, int] = OrderedDict()   # key -> references (1 or 2), newest last
        self.bound = max(64, 4 * num_slots)

    def record(self, key: bytes) -> None:
        seen = self.seen
        n = seen.get(key)
        if n is None:
            seen[key] = 1
            if len(seen) > self.bound:
                seen.popitem(last=False)
        else:
            seen[key] = 2
            seen.move_to_end(key)

    def admit(self, key: bytes, victim: Optional[bytes]) -> bool:
        return self.seen.get(key, 0) >= 2


_HALF = bytes(i >> 1 for i in range(256))
_M64 = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class TinyLFU(Admission):
    """TinyLFU (Einziger et al.): a count-min sketch of 4 rows of 4-bit counters (a byte each, capped
    at 15) behind a doorkeeper Bloom filter that takes a key's first reference.  Every ``10 num_slots``
    references the counters halve and the doorkeeper clears (the counts age).  ``admit`` lets a key in
    when no victim is named, else when it was referenced more often than the victim.
    Hashes are CRC-32 based: the same keys give the same answers in every process."""

    name = "tinylfu"
    __slots__ = ("rows", "mask", "door", "door_mask", "window", "refs")

    def __init__(self, num_slots: int = 0) -> None:
        width = 16
        while width < max(16, num_slots):
            width <<= 1
        self.rows = [bytearray(width) for _ in _SEEDS]
        self.mask = width - 1
        self.door = bytearray(width)          # 8 bits per slot of the tier
        self.door_mask = 8 * width - 1
        self.window = max(16, 10 * num_slots)
        self.refs = 0

    @staticmethod
    def _hash(key: bytes) -> int:
        # 64 bits of xxh3: two independent 32-bit halves (two CRC-32s of one key are not: CRC is linear,
        # so keys of one length with one CRC-32 would share every row and the doorkeeper)
        return xxh3_64_intdigest(key)

    def _in_door(self, h: int) -> bool:
        door, m = self.door, self.door_mask
        a, b = h & m, (h >> 32) & m
        return bool(door[a >> 3] & (1 << (a & 7))) and bool(door[b >> 3] & (1 << (b & 7)))

    def record(self, key: bytes) -> None:
        h = self._hash(key)
        if self._in_door(h):
            mask = self.mask
            for row, seed in zip(self.rows, _SEEDS):
                i = (((h * seed) & _M64) >> 40) & mask
                if row[i] < 15:
                    row[i] += 1
        else:
            door, m = self.door, self.door_mask
            a, b = h & m, (h >> 32) & m
            door[a >> 3] |= 1 << (a & 7)
            door[b >> 3] |= 1 << (b & 7)
        self.refs += 1
        if self.refs >= self.window:
            self.age()

    def age(self) -> None:
        """Halve every counter and clear the doorkeeper (once a window)."""
        self.refs = 0
        self.rows = [row.translate(_HALF) for row in self.rows]
        self.door = bytearray(len(self.door))

    def frequency(self, key: bytes) -> int:
        """The estimated references of ``key`` in the current window (the doorkeeper's one included)."""
        h = self._hash(key)
        mask = self.mask
        est = min(row[(((h * seed) & _M64) >> 40) & mask] for row, seed in zip(self.rows, _SEEDS))
        return est + self._in_door(h)

    def admit(self, key: bytes, victim: Optional[bytes]) -> bool:
        return victim is None or self.frequency(key) > self.frequency(victim)


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "s3fifo": S3FIFO, "arc": ARC, "prefix": PrefixLRU}
ADMISSIONS: dict[str, type[Admission]] = {"all": AdmitAll, "second_hit": SecondHit, "tinylfu": TinyLFU}


def admission_victim(policy: Policy, protect: Collection[bytes], key: bytes) -> Optional[bytes]:
    """The key an admission filter weighs ``key`` against in a full tier: the entry ``victim(protect, key)``
    would take, found with ``peek``, which changes nothing (the filter may refuse, and then nothing is
    evicted); None when every evictable entry is protected.  The tier index and the trace simulator both
    ask through here."""
    e = policy.peek(protect, key)
    return None if e is None else e.key


def make_policy(name: str, num_slots: int) -> Policy:
    """The policy called ``name`` for a tier of ``num_slots`` slots (the config validated the name).
    Every policy's constructor takes the tier's size (those that need none ignore it)."""
    return POLICIES[name](num_slots)   # type: ignore[call-arg]


def make_admission(name: str, num_slots: int) -> Admission:
    """The admission filter called ``name`` for a tier of ``num_slots`` slots."""
    return ADMISSIONS[name](num_slots)   # type: ignore[call-arg]
