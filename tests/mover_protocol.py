"""The owner's side of the mover protocol as a hypothesis state machine base, for every CPU mover's machine.

Transfers are submitted, cancelled and flushed the way an owner does: sources are never written
while a transfer reads them and destinations are leased to one transfer.  The model: each transfer
answered exactly once; an ok one's destinations hold its sources' bytes as they were at submit;
nothing but destinations is ever written.  A subclass makes the mover (``self.m``, reporting on
``self.q``) in its ``@initialize`` after :meth:`start`, adds the rules that make copies finish, and
may check a report further (:meth:`check_report`) or the state (:meth:`check_state`).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, Transfer

__all__ = ["MoverProtocolMachine", "random_rows"]

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD


def random_rows(n: int, width: int, seed: int) -> torch.Tensor:
    """Random bytes: as 16-byte elements they hold NaNs, infinities and denormals of every kind."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8)


class MoverProtocolMachine(RuleBasedStateMachine):
    ROWS, SLOTS, WIDTH = 12, 12, 32

    def start(self, seed: int) -> None:
        self.dev = random_rows(self.ROWS, self.WIDTH, seed)
        self.host = random_rows(self.SLOTS, self.WIDTH, seed + 1)
        self.q = CompletionQueue()
        self.pending: dict[str, Transfer] = {}
        self.expect: dict[str, list[torch.Tensor]] = {}   # the sources' bytes when submitted
        self.answered: dict[str, bool] = {}
        self.n = 0
        self.first = (self.dev.clone(), self.host.clone())
        self.written: tuple[set[int], set[int]] = (set(), set())   # device rows, host slots ever a destination

    def _busy(self) -> tuple[set[int], set[int], set[int], set[int]]:
        """(device rows written, host slots written, device rows read, host slots read) by pending transfers."""
        dw, hw, dr, hr = set(), set(), set(), set()
        for t in self.pending.values():
            if t.kind is _STORE:
                dr.update(t.rows)
                hw.update(t.slots)
            else:
                dw.update(t.rows)
                hr.update(t.slots)
        return dw, hw, dr, hr

    @rule(store=st.booleans(), data=st.data())
    def submit(self, store: bool, data: Any) -> None:
        dw, hw, dr, hr = self._busy()
        if store:   # reads device rows nobody writes, writes slots nobody touches
            srcs = [r for r in range(self.ROWS) if r not in dw]
            dsts = [s for s in range(self.SLOTS) if s not in hw and s not in hr]
        else:
            srcs = [s for s in range(self.SLOTS) if s not in hw]
            dsts = [r for r in range(self.ROWS) if r not in dw and r not in dr]
        if not srcs or not dsts:
            return
        k = data.draw(st.integers(1, min(4, len(dsts))))
        starts = [d for d in dsts if all(d + i in dsts for i in range(k))]
        if data.draw(st.booleans()) and starts:   # consecutive destinations (the batched copy's one-op case)
            d0 = data.draw(st.sampled_from(starts))
            out = list(range(d0, d0 + k))
        else:
            out = data.draw(st.lists(st.sampled_from(dsts), min_size=k, max_size=k, unique=True))
        ins = data.draw(st.lists(st.sampled_from(srcs), min_size=k, max_size=k))
        name = f"t{self.n}"
        self.n += 1
        t = Transfer(name, _STORE if store else _LOAD, ins if store else out, out if store else ins)
        self.expect[name] = [(self.dev if store else self.host)[i].clone() for i in ins]
        self.pending[name] = t
        self.written[1 if store else 0].update(out)
        self.m.submit(t)

    @rule(data=st.data())
    def cancel(self, data: Any) -> None:
        if self.pending:
            self.pending[data.draw(st.sampled_from(sorted(self.pending)))].cancelled = True

    @rule()
    def flush(self) -> None:
        self.m.flush()

    def check_report(self, t: Transfer, ok: bool, error: Any) -> None:
        """A subclass's further check of one report."""

    def check_state(self) -> None:
        """A subclass's further check, at every step."""

    def collect(self) -> None:
        for r in self.q.drain():
            assert r.token not in self.answered, f"{r.token} answered twice"
            self.answered[r.token] = r.ok
            t = self.pending.pop(r.token)
            self.check_report(t, r.ok, r.error)
            if r.ok:
                dst = self.host if t.kind is _STORE else self.dev
                for d, want in zip(t.slots if t.kind is _STORE else t.rows, self.expect[r.token]):
                    assert torch.equal(dst[d], want), (r.token, d)

    @invariant()
    def answered_once_and_nothing_else_written(self) -> None:
        if hasattr(self, "m"):
            self.check_state()
            self.collect()
            for t, before, written in zip((self.dev, self.host), self.first, self.written):
                untouched = [i for i in range(t.shape[0]) if i not in written]
                assert torch.equal(t[untouched], before[untouched])
