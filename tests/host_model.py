"""The oracle of the state machines (tests/test_state_machine.py with a fake mover,
tests/test_cuda_mover_state_machine.py with the CudaMover on a simulated device), written from the
SPEC, not from the library's code.

Sources, and nothing else: docs/architecture.md (the job state table "Lifecycle"; invariants 1
exactly once, 2 token match or discard, 3 leases and LRU, 4 fences, 5 rows given up cancel their
stores, 6 bounded memory and shedding; the stale-callback reasons), ../shared/DESIGN.md (jobs and
tokens, leases and fences) and the public docstrings of ``TierManager`` (``store``, ``load``,
``cancel``, ``free_block``, ``invalidate``, ``lookup``, ``poll``, ``wait``, ``debug_sizes``).  It is a
deliberately different shape from the code -- no slot numbers, no free list, no LRU list, no
per-row or per-key tables, no lease counters -- so that a bug copied into the code is not copied
into the oracle.  What it keeps:

* ``host``: which keys the host tier holds, each as a :class:`Copy` (one store's copy of the key),
  and whether it is readable (READY: its store was reported ok).  Content identity: a READY key
  holds exactly *that key's* bytes -- the machines derive every block's bytes from its key and
  check them byte for byte, so "readable" here means "readable with the key's own content".
* ``jobs``: the jobs issued whose worker report has not been applied yet, each with its state from
  the spec's table (pending | cancelling | done | failed | cancelled) and the reason it was
  cancelled; ``deliver``: cancelled stores the next ``poll()`` must report.
* ``reported``: the tokens reported so far -- each job exactly once (asserted here too).
* the counters the metrics must equal: ``jobs_total{kind,outcome}``, ``stale{kind,reason}``,
  ``shed{kind,reason}``, ``errors{tier}`` (copy_failed), ``evictions``, lookup ``hits``/``asked``.

Everything else is *derived* from those on demand, as the spec states it:

* slots in use (invariant 3, DESIGN "leases"): a copy holds its slot while its key is in the host
  tier *or* a job whose report is not applied still writes (store) or reads (load) it;
* fenced rows (invariant 4): the rows of loads whose report is not applied;
* ``debug_sizes()`` (invariant 6, "per-row and per-key tables hold live jobs only"): ``row_stores``
  = the rows read by stores still pending (a cancelled store no longer reads its row),
  ``row_load`` = the fenced rows, ``key_loads`` = the keys of those loads.

Eviction is modelled from the DOCUMENTED policy, strictly (not tolerantly): README and invariant 3
say the host tier evicts the *least recently used* entry that is READY and unleased (no load
reading it), when a store needs a slot and none is free, and at the end of each ``poll()``/
``wait()`` until ``host_evict_ahead_blocks`` slots are free.  "Used" is read as: its store reported
ok (it became readable), a ``lookup()`` hit, a ``store()`` of the key while present (store() returns
None then; "touched when on the host", says ``TierCore.begin_store``'s docstring), and a load
reading it (a lease: unevictable while the load runs; the lease ends, and the copy was last used,
when the load's report is applied, cancelled or not: "the slot becomes evictable (MRU)", says
``TierIndex.release``'s docstring).  Each use takes a tick of one clock; the victim is the
evictable copy with the oldest tick.  So a wrong victim (or an eviction where a free slot existed,
or none where one was needed) is a failure.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from tiered_kv import Job

Expected = tuple[bool, Optional[str]]   # (ok, the prefix of the error) of a completion
ERROR_TIER = {"store": "host", "load": "device"}   # the tier a failed copy is counted against (metrics docs)


@dataclass(eq=False)
class Copy:
    """One store's copy of ``key`` in the host tier (a slot's worth of bytes)."""

    key: bytes
    ready: bool = False       # readable: its store was reported ok
    used: int = 0             # the clock tick of its last use (LRU)


@dataclass(eq=False)
class MJob:
    """A store or load the manager returned."""

    job: Job
    kind: str                 # "store" | "load"
    key: bytes
    row: int
    copy: Copy                # the copy it writes (store) or reads (load)
    state: str = "pending"    # the spec's JobState values
    reason: Optional[str] = None   # why it was cancelled: cancelled | superseded | source_reused


@dataclass
class Model:
    capacity: int                  # host slots
    max_inflight: int              # max_inflight_jobs
    fail_error: str = "failed: "   # what a failed job's error starts with
    ahead: int = 0                 # host_evict_ahead_blocks
    host: dict[bytes, Copy] = field(default_factory=dict)          # the host tier's keys
    jobs: dict[Any, MJob] = field(default_factory=dict)            # token -> worker report not applied
    deliver: list[MJob] = field(default_factory=list)              # cancelled stores, for the next poll
    reported: set[Any] = field(default_factory=set)                # tokens reported so far
    jobs_total: Counter[tuple[str, str]] = field(default_factory=Counter)   # (kind, outcome)
    stale: Counter[tuple[str, str]] = field(default_factory=Counter)        # (kind, reason)
    shed: Counter[tuple[str, str]] = field(default_factory=Counter)         # (kind, reason)
    errors: Counter[str] = field(default_factory=Counter)                   # tier -> copy_failed
    evictions: int = 0
    hits: int = 0
    asked: int = 0                                                          # keys asked for by lookup()
    clock: Any = field(default_factory=itertools.count)

    # -- derived views -------------------------------------------------------
    def ready(self, key: bytes) -> bool:
        """``key`` is readable in the host tier (with its own bytes)."""
        c = self.host.get(key)
        return c is not None and c.ready

    def ready_keys(self) -> list[bytes]:
        return [k for k, c in self.host.items() if c.ready]

    def _live(self, kind: str) -> list[MJob]:
        return [mj for mj in self.jobs.values() if mj.kind == kind]

    @property
    def used_slots(self) -> int:
        """Copies holding a slot: in the host tier, or written/read by a job not yet answered."""
        held = {id(c) for c in self.host.values()}
        held.update(id(mj.copy) for mj in self.jobs.values())
        return len(held)

    def fenced(self, row: int) -> bool:
        """A load into ``row`` has not been answered: store/load on it raise, free_block is False."""
        return any(mj.row == row for mj in self._live("load"))

    def sizes(self) -> dict[str, int]:
        """What ``TierManager.debug_sizes()`` (and its views) must say, derived from the jobs and keys."""
        loads = self._live("load")
        return {
            "jobs": len(self.jobs),
            "deliver": len(self.deliver),
            "host_entries": len(self.host),
            "host_used_slots": self.used_slots,
            "row_load": len({mj.row for mj in loads}),
            "row_stores": len({mj.row for mj in self._live("store") if mj.state == "pending"}),
            "key_loads": len({mj.key for mj in loads}),
        }

    def unreported(self, issued: list[MJob]) -> list[MJob]:
        return [mj for mj in issued if mj.job.token not in self.reported]

    # -- LRU (the documented policy) -------------------------------------------
    def _use(self, c: Copy) -> None:
        c.used = next(self.clock)

    def _evictable(self) -> list[Copy]:
        reading = {id(mj.copy) for mj in self._live("load")}
        return [c for c in self.host.values() if c.ready and id(c) not in reading]

    def _evict_lru(self) -> bool:
        victims = self._evictable()
        if not victims:
            return False
        del self.host[min(victims, key=lambda c: c.used).key]
        self.evictions += 1
        return True

    def evict_ahead(self) -> None:
        """The end of poll()/wait(): least recently used entries go until ``ahead`` slots are free."""
        while self.capacity - self.used_slots < self.ahead and self._evict_lru():
            pass

    # -- the API -------------------------------------------------------------
    def _shed(self, kind: str, why: str) -> str:
        self.jobs_total[(kind, "shed")] += 1
        self.shed[(kind, why)] += 1
        return "none"

    def store(self, key: bytes, row: int) -> Union[str, Copy]:
        """'busy' (BlockBusyError), 'none' (store() returns None) or the copy a new store job fills."""
        if self.fenced(row):
            return "busy"
        if key in self.host:                       # already stored or being stored: a use
            self._use(self.host[key])
            return "none"
        if len(self.jobs) >= self.max_inflight:
            return self._shed("store", "inflight_limit")
        if self.used_slots >= self.capacity and not self._evict_lru():
            return self._shed("store", "host_full")
        c = self.host[key] = Copy(key)
        return c

    def load(self, key: bytes, row: int) -> Union[str, Copy]:
        """'busy', 'none' or the copy a new load job reads (unevictable until its report)."""
        if self.fenced(row):
            return "busy"
        if not self.ready(key):
            return "none"
        if len(self.jobs) >= self.max_inflight:
            return self._shed("load", "inflight_limit")
        self._give_up_row(row)                     # the load overwrites the row: its stores lose their source
        return self.host[key]

    def add(self, mj: MJob) -> MJob:
        """The job the manager returned for what :meth:`store`/:meth:`load` answered."""
        assert mj.job.token not in self.jobs and mj.job.token not in self.reported
        self.jobs[mj.job.token] = mj
        return mj

    def cancel(self, mj: MJob, reason: str) -> None:
        """PENDING -> CANCELLING (anything else: nothing).  A store's key leaves the host tier now and it
        is reported at the next poll; a load is reported once its worker answered (its copy may land)."""
        if mj.state != "pending":
            return
        mj.state, mj.reason = "cancelling", reason
        if mj.kind == "store":
            if self.host.get(mj.key) is mj.copy:
                del self.host[mj.key]
            self.deliver.append(mj)

    def _give_up_row(self, row: int) -> None:
        for mj in self._live("store"):
            if mj.row == row:
                self.cancel(mj, "source_reused")

    def free_block(self, row: int) -> bool:
        """Cancels the stores reading ``row`` and a load into it; False while that load is unanswered."""
        self._give_up_row(row)
        for mj in self._live("load"):
            if mj.row == row:
                self.cancel(mj, "cancelled")
        return not self.fenced(row)

    def invalidate(self, key: bytes) -> None:
        """``key`` leaves every tier: its loads and the store still writing it are cancelled (superseded)."""
        for mj in list(self.jobs.values()):
            if mj.key == key and (mj.kind == "load" or self.host.get(key) is mj.copy):
                self.cancel(mj, "superseded")
        self.host.pop(key, None)

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys are READY (each a use)."""
        n = 0
        for k in keys:
            if not self.ready(k):
                break
            self._use(self.host[k])
            n += 1
        self.hits += n
        self.asked += len(keys)
        return n

    # -- reports -------------------------------------------------------------
    def _report(self, mj: MJob, state: str, expected: Expected) -> Expected:
        assert mj.job.token not in self.reported, f"the model reports {mj.job} twice"
        self.reported.add(mj.job.token)
        mj.state = state
        outcome = {"done": "ok", "failed": "failed", "cancelled": "cancelled"}[state]
        self.jobs_total[(mj.kind, outcome)] += 1
        if state == "failed":
            self.errors[ERROR_TIER[mj.kind]] += 1
        return expected

    def _cancelled(self, mj: MJob) -> Expected:
        return self._report(mj, "cancelled", (False, f"cancelled ({mj.reason})"))

    def apply(self, mj: MJob, ok: bool) -> Optional[Expected]:
        """The worker's report for ``mj`` (its copy ``ok`` or not) applied: the completion it yields now,
        or None (a cancelled store's report: stale, the store is reported by its delivery)."""
        del self.jobs[mj.job.token]
        c = mj.copy
        if mj.kind == "load" and self.host.get(mj.key) is c:   # its lease ends, cancelled or not: a use
            self._use(c)
        if mj.state != "pending":                  # cancelled: the report is discarded and counted
            self.stale[(mj.kind, mj.reason or "cancelled")] += 1
            return None if mj.kind == "store" else self._cancelled(mj)
        if mj.kind == "store":
            assert self.host.get(mj.key) is c, "a pending store's key left the host tier"
            if not ok:
                del self.host[mj.key]
                return self._report(mj, "failed", (False, self.fail_error))
            c.ready = True
            self._use(c)
            return self._report(mj, "done", (True, None))
        if not ok:
            return self._report(mj, "failed", (False, self.fail_error))
        return self._report(mj, "done", (True, None))

    def take_deliver(self) -> list[tuple[MJob, Expected]]:
        """The cancelled stores the next poll reports, with their completions."""
        out, self.deliver = self.deliver, []
        return [(mj, self._cancelled(mj)) for mj in out]
