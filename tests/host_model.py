"""The plain model the state machines check the manager against (tests/test_state_machine.py with a
fake mover, tests/test_cuda_mover_state_machine.py with the CudaMover on a simulated device).

No tensors and no tokens of its own: host entries with an LRU and slot leases (as
``tiered_kv.core.index.TierIndex``), the manager's job tables (records, row fences, the
stores reading each row, the loads of each key, cancelled stores awaiting
delivery) and the counters the metrics must equal.  How and when a report
reaches the manager is each machine's business: it calls :meth:`Model.apply`
with the job and whether its copy succeeded.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from tiered_kv import Job

Expected = tuple[bool, Optional[str]]   # (ok, the prefix of the error) of a completion
ERROR_TIER = {"store": "host", "load": "device"}   # the tier a failed copy is counted against


@dataclass(eq=False)
class MEntry:
    """A host-tier entry: a leased slot, READY once its store's report is applied."""

    key: bytes
    ready: bool = False
    readers: int = 0          # loads reading the slot
    live: bool = True         # in the index
    writing: bool = True      # its store's copy may still write the slot
    holds_slot: bool = True
    writer: Optional["MJob"] = None


@dataclass(eq=False)
class MJob:
    """A store or load issued and not yet reported."""

    job: Job
    kind: str                 # "store" | "load"
    key: bytes
    row: int
    entry: MEntry
    stream: Any = None        # on a simulated device: the side stream of its copy (None: not queued)
    end: int = 0              # ... and its end event is operation number ``end`` of ``stream``
    state: str = "pending"    # pending | cancelling | done | failed | cancelled
    reason: Optional[str] = None


@dataclass
class Model:
    capacity: int
    max_inflight: int
    fail_error: str = "failed: "   # what a failed job's error starts with
    ahead: int = 0                 # host_evict_ahead_blocks: slots the end of poll()/wait() leaves free
    entries: dict[bytes, MEntry] = field(default_factory=dict)               # live entries
    lru: "OrderedDict[bytes, MEntry]" = field(default_factory=OrderedDict)   # READY, no readers
    used: int = 0                                                            # leased slots
    records: dict[Any, MJob] = field(default_factory=dict)                   # token -> report not applied yet
    deliver: list[MJob] = field(default_factory=list)                        # cancelled stores, next poll
    row_stores: dict[int, list[MJob]] = field(default_factory=dict)
    row_load: dict[int, MJob] = field(default_factory=dict)
    key_loads: dict[bytes, list[MJob]] = field(default_factory=dict)
    jobs_total: Counter[tuple[str, str]] = field(default_factory=Counter)    # (kind, outcome)
    stale: Counter[tuple[str, str]] = field(default_factory=Counter)         # (kind, reason)
    shed: Counter[tuple[str, str]] = field(default_factory=Counter)          # (kind, reason)
    errors: Counter[str] = field(default_factory=Counter)                    # tier -> copy_failed
    evictions: int = 0
    hits: int = 0
    asked: int = 0                                                           # keys asked for by lookup()

    # -- host index ----------------------------------------------------------
    def ready(self, key: bytes) -> Optional[MEntry]:
        e = self.entries.get(key)
        return e if e is not None and e.ready else None

    def touch(self, e: MEntry) -> None:
        if self.lru.get(e.key) is e:
            self.lru.move_to_end(e.key)

    def _maybe_free(self, e: MEntry) -> None:
        if not e.live and not e.writing and e.readers == 0 and e.holds_slot:
            e.holds_slot = False
            self.used -= 1

    def remove(self, e: MEntry) -> None:
        if e.live:
            e.live = False
            if self.entries.get(e.key) is e:
                del self.entries[e.key]
            if self.lru.get(e.key) is e:
                del self.lru[e.key]
        self._maybe_free(e)

    def reserve(self, key: bytes) -> Optional[MEntry]:
        if self.used >= self.capacity:
            victim = next((e for k, e in self.lru.items() if k != key), None)
            if victim is None:
                return None
            self.evictions += 1
            self.remove(victim)
        e = MEntry(key)
        self.entries[key] = e
        self.used += 1
        return e

    def evict_ahead(self) -> None:
        """The end of poll()/wait(): evict least recently used entries until ``ahead`` slots are free."""
        while self.capacity - self.used < self.ahead and self.lru:
            self.evictions += 1
            self.remove(next(iter(self.lru.values())))

    def publish(self, e: MEntry) -> None:
        e.writing = False
        if not e.live:
            self._maybe_free(e)
            return
        e.ready = True
        if e.readers == 0:
            self.lru[e.key] = e

    def writer_done(self, e: MEntry) -> None:
        e.writing = False
        self._maybe_free(e)

    def acquire(self, e: MEntry) -> None:
        e.readers += 1
        self.lru.pop(e.key, None)

    def release(self, e: MEntry) -> None:
        e.readers -= 1
        assert e.readers >= 0
        if e.readers == 0:
            if e.live and e.ready:
                self.lru[e.key] = e
            else:
                self._maybe_free(e)

    # -- the API -------------------------------------------------------------
    def _shed(self, kind: str, why: str) -> str:
        self.jobs_total[(kind, "shed")] += 1
        self.shed[(kind, why)] += 1
        return "none"

    def store(self, key: bytes, row: int) -> Union[str, MEntry]:
        """'busy' (BlockBusyError), 'none' (store() returns None) or the entry a new job fills."""
        if row in self.row_load:
            return "busy"
        e = self.entries.get(key)
        if e is not None:
            self.touch(e)
            return "none"
        if len(self.records) >= self.max_inflight:
            return self._shed("store", "inflight_limit")
        e2 = self.reserve(key)
        return self._shed("store", "host_full") if e2 is None else e2

    def load(self, key: bytes, row: int) -> Union[str, MEntry]:
        """'busy', 'none' or the (now leased) entry a new job reads."""
        if row in self.row_load:
            return "busy"
        e = self.ready(key)
        if e is None:
            return "none"
        if len(self.records) >= self.max_inflight:
            return self._shed("load", "inflight_limit")
        self.give_up_row(row)
        self.acquire(e)
        return e

    def add(self, mj: MJob) -> MJob:
        """The job the manager returned for what :meth:`store`/:meth:`load` expected."""
        self.records[mj.job.token] = mj
        if mj.kind == "store":
            mj.entry.writer = mj
            self.row_stores.setdefault(mj.row, []).append(mj)
        else:
            self.row_load[mj.row] = mj
            self.key_loads.setdefault(mj.key, []).append(mj)
        return mj

    def cancel(self, mj: MJob, reason: str) -> None:
        if mj.state != "pending":
            return
        mj.state, mj.reason = "cancelling", reason
        if mj.kind == "store":   # reported at the next poll; its slot stays leased until its report
            self._drop_row_store(mj)
            self.remove(mj.entry)
            self.deliver.append(mj)
        # a load stays fenced until its copy can no longer land

    def _drop_row_store(self, mj: MJob) -> None:
        lst = self.row_stores.get(mj.row)
        if lst is not None and mj in lst:
            lst.remove(mj)
            if not lst:
                del self.row_stores[mj.row]

    def give_up_row(self, row: int) -> None:
        for mj in list(self.row_stores.pop(row, ())):
            self.cancel(mj, "source_reused")

    def free_block(self, row: int) -> bool:
        self.give_up_row(row)
        mj = self.row_load.get(row)
        if mj is None:
            return True
        self.cancel(mj, "cancelled")
        return False

    def invalidate(self, key: bytes) -> None:
        e = self.entries.get(key)
        if e is not None:
            if not e.ready and e.writer is not None:
                self.cancel(e.writer, "superseded")
            self.remove(e)
        for mj in list(self.key_loads.get(key, ())):
            self.cancel(mj, "superseded")

    def lookup(self, keys: list[bytes]) -> int:
        n = 0
        for k in keys:
            e = self.ready(k)
            if e is None:
                break
            self.touch(e)
            n += 1
        self.hits += n
        self.asked += len(keys)
        return n

    # -- reports -------------------------------------------------------------
    def finish_cancelled(self, mj: MJob) -> Expected:
        mj.state = "cancelled"
        self.jobs_total[(mj.kind, "cancelled")] += 1
        return False, f"cancelled ({mj.reason})"

    def _fail(self, mj: MJob) -> Expected:
        mj.state = "failed"
        self.jobs_total[(mj.kind, "failed")] += 1
        self.errors[ERROR_TIER[mj.kind]] += 1
        return False, self.fail_error

    def apply(self, mj: MJob, ok: bool) -> Optional[Expected]:
        """The mover's report for ``mj`` (its copy ``ok`` or not) applied: the completion it yields,
        None for a cancelled store's (stale: the store was reported when cancelled)."""
        del self.records[mj.job.token]
        e = mj.entry
        if mj.kind == "store":
            self._drop_row_store(mj)
            if mj.state != "pending":
                self.stale[("store", mj.reason or "cancelled")] += 1
                self.writer_done(e)
                return None
            if not ok:
                self.writer_done(e)
                self.remove(e)
                return self._fail(mj)
            self.publish(e)
            mj.state = "done"
            self.jobs_total[("store", "ok")] += 1
            return True, None
        if self.row_load.get(mj.row) is mj:
            del self.row_load[mj.row]
        loads = self.key_loads[mj.key]
        loads.remove(mj)
        if not loads:
            del self.key_loads[mj.key]
        self.release(e)
        if mj.state != "pending":
            self.stale[("load", mj.reason or "cancelled")] += 1
            return self.finish_cancelled(mj)
        if not ok:
            return self._fail(mj)
        mj.state = "done"
        self.jobs_total[("load", "ok")] += 1
        return True, None

    def take_deliver(self) -> list[tuple[MJob, Expected]]:
        """The cancelled stores the next poll reports, with their completions."""
        out = [(mj, self.finish_cancelled(mj)) for mj in self.deliver]
        self.deliver = []
        return out
