"""ARC: a store that takes over a fetch's reservation of a ghost key moves ``p`` once for that miss.

A fetch from the remote tier reserves a host slot for a key that ARC remembers in B1 (a ghost hit): the
victim for it adapts ``p`` and marks the key (``ARC.adapted``), so that its insert does not adapt ``p`` again.
The engine then stores the same key while the fetch is in flight: ``TierIndex.reserve(..., replace=fetch)``
removes the fetch's entry and reserves anew.  The removal told the policy the reservation ended
(``Policy.abandon``), which dropped the mark: the new reservation's victim, or its insert, adapted ``p`` a
second time for the same miss.  Now the removal hands the reservation over (``remove(handover=True)``).
Deterministic: no threads, no randomness.
"""

from __future__ import annotations

import uuid

import pytest

from test_review_round36 import _arc_ghost_hit


@pytest.mark.parametrize("slot_free", [False, True], ids=["evicting", "free-slot"])
def test_a_store_replacing_a_fetchs_reservation_of_a_ghost_adapts_p_once(slot_free: bool) -> None:
    idx, fetch = _arc_ghost_hit()   # ``a`` reserved again: its victim moved p once (0 -> 1)
    arc = idx.policy
    assert arc.p == 1.0 and b"a" in arc.adapted
    if slot_free:   # a block invalidated meanwhile: the store's reservation needs no victim
        idx.remove(idx.get(b"c"))
    e = idx.reserve(b"a", uuid.uuid4(), (), fetch)
    assert e is not None and idx.get(b"a") is e and not fetch.live
    idx.publish(e)
    assert arc.p == 1.0, f"p moved twice for one miss of a ghost key: {arc.p}"
    assert list(arc.t2)[-1] == b"a" and b"a" not in arc.b1 and b"a" not in arc.adapted


def test_a_reservation_that_ends_without_a_handover_still_drops_the_mark() -> None:
    """The plain removal of a reservation (its store failed or was dropped) forgets the mark, as before."""
    idx, fetch = _arc_ghost_hit()
    idx.remove(fetch)
    assert b"a" not in idx.policy.adapted
