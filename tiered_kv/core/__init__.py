"""The owner-side runtime core: tier bookkeeping shared by every front end.

* :mod:`.index` -- a tier's index: entries in slots, leases, LRU eviction;
* :mod:`.disk_tier` -- the disk store's handle and index as the core uses them;
* :mod:`.tiers` -- :class:`TierCore`: jobs and tokens, stores, loads, spills,
  promotes, write policies, evict-ahead, flush/close, accounting and gauges.
"""

from .index import Entry, EntryState, TierIndex
from .tiers import CLOSE_TIMEOUT_S, POLL_SLICE_S, WAKE_S, SlotViews, TierCore

__all__ = ["TierCore", "TierIndex", "Entry", "EntryState", "SlotViews", "CLOSE_TIMEOUT_S", "POLL_SLICE_S", "WAKE_S"]
