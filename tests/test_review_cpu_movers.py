"""Second adversarial review of the CPU copy movers (``tiered_kv/movers/{base,thread,native,rowcopy,__init__}.py``).

What it proved wrong, each pinned by a test that failed before its fix (all fixed):

1. **A flush interrupted while it hands the transfers to the copy threads loses them.**
   ``ThreadMover.flush`` swaps ``_held`` for an empty deque, then cuts the transfers into batches
   (``split_batches``, Python) and puts the batches on the workers' queue one by one, with no handler.
   A ``KeyboardInterrupt`` (a Ctrl-C in the engine's ``poll()``) landing after the swap and before the
   last ``put`` drops every transfer not yet queued: never copied, never answered -- the job stays
   PENDING for ever, a load's row stays fenced and its slots leased.  ``hold()`` and ``close()`` go through
   the same code.
2. **The same in ``NativeMover._start_held``**: ``self._held`` is emptied and ``split_batches`` runs *before* the
   ``try`` whose handler answers what was not started (``_answer_unstarted``), so an interrupt there loses
   the flush's transfers (``flush``, ``hold(False)``, ``help_one``, ``submit`` at ``batch_max``).
3. **The blocking owner's memmove of a lone transfer loses it when interrupted right after taking it.**
   ``NativeMover._memmove_one`` pops the transfer off ``_held`` before its ``try``; a signal handled at the
   eval-breaker check that ends the ``popleft()`` call (or at the next lines) drops it unanswered.
   ``ThreadMover.help_one`` guards the same take (the transfer joins its batch before it leaves the queue).

4. **A ThreadMover copying row by row converts element values instead of moving bytes, and reports ok.**
   Where ``fast_planes``/``wide_planes`` refuse *any* plane (they are all or nothing), every plane is copied by
   ``_copy_rows`` with ``Tensor.copy_(host[s], dev[r])``: between an fp8/bf16 device row and its uint8 host
   bytes that is a value conversion (with broadcasting), so a store is reported ok over other bytes (or a
   load fails on the shape).  ``make_mover`` picks that mover for such planes -- a strided element plane, or a
   contiguous fp8 plane beside a strided byte plane.  Latent for the front ends (``TierManager`` and the vLLM
   copier hand uint8 device planes) but reachable through ``make_mover``/``ThreadMover`` with a non-byte
   device plane, which ``fast_planes``, ``wide_planes`` and ``NativeMover`` all accept.
5. **``fast_planes`` measures a host row as ``shape[1] * element_size``** (``check_planes`` and ``wide_planes``
   use the whole row): host rows of more than two dimensions lose the memmove, and a lone small transfer on
   the threads mover fails on ``copy_``'s shapes while batches of the same planes land.  Latent likewise.

Checked and found to hold (plain tests below): every plane layout ``make_mover`` hands a mover (bf16, fp8,
fp16, fp32, int32, int8 rows of odd byte widths, storage offsets, rows with gaps, strided byte rows among byte
planes, up to three planes over padded slab regions) lands the bytes of a per-row reference copy, whichever
mover it picks, launched, handed to the copy threads or copied by a blocking owner, with stages of several
passes or of no row, and each transfer is answered once, with its bytes, or failed alone; the native mover
is picked exactly where 8-byte views fit every side; an interrupt after a flush's last batch was queued, or
before the owner's memmove takes its transfer, answers each transfer exactly once (never failed while a copy
of it is still queued).
"""

from __future__ import annotations

import collections
import time
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_kv, row_matches
from tiered_kv import TierManager
from tiered_kv.jobs import JobKind, JobState
from tiered_kv.movers import CompletionQueue, NativeMover, ThreadMover, Transfer, make_mover
from tiered_kv.movers import native as native_mod
from tiered_kv.movers import thread as thread_mod

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
WAIT_S = 30.0


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8)


def _all_reports(m: Any, q: CompletionQueue, n: int) -> list[Any]:
    """Reports until ``n`` arrived: harvesting, helping, else waiting a little (bounded)."""
    out: list[Any] = []
    end = time.monotonic() + WAIT_S
    while True:
        out += q.drain()
        if len(out) >= n:
            return out
        assert time.monotonic() < end, f"{len(out)} of {n} reports"
        m.harvest()
        if not m.help_one():
            r = q.get(0.01)
            if r is not None:
                out.append(r)


class _Once:
    """Stands in for a function of the mover's module: the first call raises KeyboardInterrupt (a Ctrl-C
    whose handler runs in it -- ``split_batches`` is Python with a loop: the eval breaker is checked on
    entry and at every iteration), later calls run the real one."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.fired = 0

    def __call__(self, *a: Any, **kw: Any) -> Any:
        if not self.fired:
            self.fired += 1
            raise KeyboardInterrupt
        return self.real(*a, **kw)


class _InterruptAfterQueueing(collections.deque):
    """The flush's record of when batches were queued, whose ``extend`` raises KeyboardInterrupt: the first point
    after the owner's C loop of puts where a signal handler can run (every batch is queued then)."""

    def extend(self, items: Any) -> None:
        raise KeyboardInterrupt


class _InterruptAtPut:
    """The copy threads' queue, whose ``n``-th ``put`` (from the owner) raises KeyboardInterrupt ``before`` the
    item is queued or ``after`` it (as a signal handler does at the eval-breaker check around a call)."""

    def __init__(self, q: Any, n: int, when: str) -> None:
        self.q, self.n, self.when = q, n, when

    def put(self, item: Any) -> None:
        self.n -= 1
        fire = self.n == 0
        if fire and self.when == "before":
            raise KeyboardInterrupt
        self.q.put(item)
        if fire:
            raise KeyboardInterrupt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.q, name)


# ============================================================================ 1: ThreadMover.flush
@pytest.mark.parametrize("where", [
    "in split_batches",
    "before the second batch is queued",
    "after the last batch is queued",
])
def test_an_interrupted_thread_mover_flush_answers_each_transfer_exactly_once(monkeypatch, where):
    """A flush of a store and a load (two batches: stores, then loads) interrupted at three points.  Whatever
    the interrupt, ``close()`` must answer each transfer once (copied, or failed without a copy)."""
    dev, host = _rows(8, 64, 1), _rows(8, 64, 2)
    dev0, host0 = dev.clone(), host.clone()
    q = CompletionQueue()
    m = ThreadMover([(dev, host)], q, num_workers=1, batch_max=64)
    try:
        m.submit(Transfer("s", _STORE, [0, 1, 2], [0, 1, 2]))
        m.submit(Transfer("l", _LOAD, [5, 6, 7], [7, 6, 5]))
        if where == "in split_batches":
            monkeypatch.setattr(thread_mod, "split_batches", _Once(thread_mod.split_batches))
        elif where.startswith("before"):
            m._q = _InterruptAtPut(m._q, 2, "before")  # type: ignore[assignment]
        else:   # the puts run in C: an interrupt lands after the last one, not between a put and its record
            m._put_at = _InterruptAfterQueueing(maxlen=1024)  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt):
            m.flush()
    finally:
        m.close()
    reps = q.drain()
    assert sorted(r.token for r in reps) == ["l", "s"], f"answered after close(): {[r.token for r in reps]}"
    by = {r.token: r for r in reps}
    if by["s"].ok:
        assert torch.equal(host[:3], dev0[:3])
    if by["l"].ok:
        assert torch.equal(dev[5:8], host0[[7, 6, 5]])


# ============================================================================ 2: NativeMover._start_held
def test_an_interrupted_native_flush_answers_each_transfer_exactly_once(monkeypatch):
    dev, host = _rows(8, 64, 3), _rows(8, 64, 4)
    dev0, host0 = dev.clone(), host.clone()
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    try:
        m.submit(Transfer("s", _STORE, [0, 1, 2], [0, 1, 2]))
        m.submit(Transfer("l", _LOAD, [5, 6, 7], [7, 6, 5]))
        monkeypatch.setattr(native_mod, "split_batches", _Once(native_mod.split_batches))
        with pytest.raises(KeyboardInterrupt):
            m.flush()
    finally:
        m.close()
    reps = q.drain()
    assert sorted(r.token for r in reps) == ["l", "s"], f"answered after close(): {[r.token for r in reps]}"
    by = {r.token: r for r in reps}
    if by["s"].ok:
        assert torch.equal(host[:3], dev0[:3])
    if by["l"].ok:
        assert torch.equal(dev[5:8], host0[[7, 6, 5]])


@pytest.mark.parametrize("cpu_mover", [
    "native",
    "threads",
])
def test_a_load_whose_poll_was_interrupted_in_the_movers_flush_is_still_reported(monkeypatch, cpu_mover):
    """Through a TierManager: the load's transfer is lost by the interrupted flush, so no later ``wait()`` ever
    reports it and ``free_block`` refuses its row for good."""
    kv = make_kv(16)
    mgr = TierManager(make_config(host_slots=16, cpu_mover=cpu_mover, num_copy_workers=1), kv,
                      registry=CollectorRegistry())
    mod = native_mod if cpu_mover == "native" else thread_mod
    try:
        assert isinstance(mgr._mover, NativeMover if cpu_mover == "native" else ThreadMover)
        fill_row(kv, 0, b"cached")
        mgr.wait([mgr.store(b"cached", 0)], timeout=WAIT_S)
        job = mgr.load(b"cached", 5)
        assert job is not None
        monkeypatch.setattr(mod, "split_batches", _Once(mod.split_batches))
        with pytest.raises(KeyboardInterrupt):
            mgr.poll()                          # its flush hands the load's copy over, interrupted
        mgr.wait([job], timeout=0.3)
        assert job.state.terminal, f"the load is {job.state} after the interrupted flush"
        assert mgr.free_block(5)
        if job.state is JobState.DONE:
            assert row_matches(kv, 5, b"cached")
    finally:
        mgr.close()


# ============================================================================ 3: NativeMover._memmove_one
class _PopInterrupted(collections.deque):
    """The owner's queue of held transfers, whose first ``popleft`` is interrupted ``before`` it takes the
    transfer or ``after`` (the call returned; the handler runs at the eval-breaker check that ends it)."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when
        self.armed = True

    def popleft(self) -> Any:
        if self.armed and self.when == "before":
            self.armed = False
            raise KeyboardInterrupt
        t = super().popleft()
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return t


@pytest.mark.parametrize("when", [
    "before",
    "after",
])
def test_an_interrupt_as_the_owners_memmove_takes_its_transfer_answers_it_once(when):
    """A blocking owner copies a lone one-row load itself (``help_one`` -> ``_memmove_one``); the take is
    interrupted.  The load must still be answered once: copied later, or failed with nothing landing after."""
    dev, host = _rows(8, 64, 5), _rows(8, 64, 6)
    q = CompletionQueue()
    m = NativeMover([(dev, host)], q, batch_max=64)
    try:
        m.hold(True)
        m._held = _PopInterrupted(when)
        m.submit(Transfer("l", _LOAD, [5], [1]))
        assert len(m._held) == 1 and m._fast is not None
        with pytest.raises(KeyboardInterrupt):
            m.help_one()
        m.hold(False)                           # starts whatever the owner still holds
    finally:
        m.close()
    reps = q.drain()
    assert [r.token for r in reps] == ["l"], f"answers: {[(r.token, r.ok, r.error) for r in reps]}"
    if reps[0].ok:
        assert torch.equal(dev[5], host[1])


# ============================================================================ 4: ThreadMover's per-row copy converts values
def _element_planes(case: str, seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Planes make_mover gives a ThreadMover whose row-by-row copy is ``Tensor.copy_``: ``beside`` -- a contiguous
    fp8 plane (memmove and 8-byte views fit it) next to a byte plane whose bytes are 2 apart; ``strided`` -- one
    fp8 plane whose elements are 2 apart.  The host sides are byte regions of one slab row."""
    if case == "beside":
        fp8 = _rows(6, 8, seed).view(torch.float8_e4m3fn)
        strided = _rows(6, 16, seed + 1)[:, ::2]
        slab = _rows(6, 16, seed + 2)
        return [(fp8, slab[:, :8]), (strided, slab[:, 8:])], [slab]
    fp8 = _rows(6, 8, seed).view(torch.float8_e4m3fn)[:, ::2]
    slab = _rows(6, 4, seed + 2)
    return [(fp8, slab)], [slab]


@pytest.mark.parametrize("case", ["beside", "strided"])
def test_a_plane_of_non_byte_elements_is_copied_byte_for_byte_or_refused(case):
    """``copy_`` between an fp8 device row and its uint8 host row converts each value (1.5 -> 1, NaN -> 0)
    instead of moving its bits; with ``beside`` only because another plane turned ``_fast``/``_wide`` off for
    every plane.  Either the bytes land or the planes are refused: never a report ok over other bytes."""
    planes, _ = _element_planes(case, 11)
    before = [(d.clone(), h.clone()) for d, h in planes]
    q = CompletionQueue()
    try:
        m = make_mover(planes, q, 1, 1, 64, "native")
    except ValueError:
        return                                   # refused: fine
    try:
        m.submit(Transfer("s", _STORE, [1, 3, 4], [0, 2, 5]))
        m.submit(Transfer("l", _LOAD, [0, 5], [3, 1]))
        m.flush()
        reps = {r.token: r for r in _all_reports(m, q, 2)}
    finally:
        m.close()
    for (d, h), (d0, h0) in zip(planes, before):
        if reps["s"].ok:
            assert torch.equal(h[[0, 2, 5]], _bytes(d0[[1, 3, 4]])), f"{case}: store ok, host bytes {h[[0, 2, 5]]}"
        if reps["l"].ok:
            assert torch.equal(_bytes(d[[0, 5]]), h0[[3, 1]]), f"{case}: load ok, device bytes {_bytes(d[[0, 5]])}"


# ============================================================================ 5: fast_planes measures host rows by shape[1]
def test_a_lone_transfer_of_a_plane_with_3d_host_rows_is_copied_like_a_batch_of_it():
    """Host rows ``[slots, 2, 8]`` (16 bytes, contiguous) beside 16-byte device rows: ``check_planes``,
    ``wide_planes`` and the native mover take them, and batches of them land; but ``fast_planes`` measures
    the host row as ``shape[1] * element_size`` (2 bytes), refuses the memmove, and the row-by-row
    ``copy_`` of a lone transfer (``FEW_ROWS``) fails on the shapes."""
    dev, host = _rows(6, 16, 21), torch.zeros((6, 2, 8), dtype=torch.uint8)
    q = CompletionQueue()
    m = make_mover([(dev, host)], q, 1, 1, 64, "threads")
    try:
        assert isinstance(m, ThreadMover)
        m.submit(Transfer("batch-a", _STORE, [2, 3], [1, 2]))
        m.submit(Transfer("batch-b", _STORE, [4], [3]))
        m.flush()
        m.submit(Transfer("lone", _STORE, [1], [0]))
        m.flush()
        reps = {r.token: r for r in _all_reports(m, q, 3)}
    finally:
        m.close()
    assert reps["batch-a"].ok and reps["batch-b"].ok
    assert torch.equal(host[1:4].reshape(3, 16), dev[2:5])
    assert reps["lone"].ok, reps["lone"].error
    assert torch.equal(host[0].reshape(16), dev[1])


# ============================================================================ layouts: batch == per-row reference
_DTYPES = [torch.uint8, torch.int8, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.float32, torch.int32, torch.float64]


def _bytes(row: torch.Tensor) -> torch.Tensor:
    """A device row's bytes, writable in place (a strided byte row is already bytes)."""
    return row if row.dtype == torch.uint8 else row.view(torch.uint8)


def _views(devs: list[torch.Tensor], slab: torch.Tensor, specs: list[dict[str, Any]], nrows: int
           ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The planes over the buffers: per spec a device tensor of its dtype (``offset`` elements in, ``gap``
    elements between rows; or, ``strided``, byte rows whose bytes are 2 apart) and its region of the slab rows."""
    planes = []
    o = 0
    for base, sp in zip(devs, specs):
        e, off, gap = sp["elems"], sp["offset"], sp["gap"]
        if sp["strided"]:
            d = base[off:off + nrows * (2 * e + gap)].view(nrows, 2 * e + gap)[:, :2 * e:2]
        else:
            d = base.view(sp["dtype"])[off:off + nrows * (e + gap)].view(nrows, e + gap)[:, :e]
        o += sp["host_gap"]
        planes.append((d, slab[:, o:o + sp["nbytes"]]))
        o += sp["nbytes"]
    return planes


@st.composite
def _layouts(draw: Any) -> tuple[int, int, list[dict[str, Any]], int]:
    """Planes over a device buffer each and one slab: mostly ``aligned`` (widths, offsets, gaps and slab
    regions in multiples of 8 bytes: the batched copies' 16- and 8-byte views), else anything (memmove or
    the per-row copy)."""
    nrows, nslots = draw(st.integers(2, 9)), draw(st.integers(2, 9))
    aligned = draw(st.integers(0, 2)) > 0
    specs = []
    n = draw(st.integers(1, 3))
    # a strided plane only among byte planes (the front ends' planes): beside an element plane it is finding 4
    strided_at = draw(st.integers(0, 3 * n))
    for i in range(n):
        strided = i == strided_at
        dtype = (draw(st.sampled_from([torch.uint8, torch.int8])) if strided_at < n
                 else draw(st.sampled_from(_DTYPES)))
        dtype = torch.uint8 if strided else dtype
        es = torch.empty((), dtype=dtype).element_size()
        if aligned and not strided:
            per8 = max(1, 8 // es)                 # elements in 8 bytes
            elems = per8 * draw(st.integers(1, 4))
            offset, gap = per8 * draw(st.integers(0, 2)), per8 * draw(st.integers(0, 1))
            host_gap = draw(st.sampled_from([0, 0, 8, 16]))
        else:
            elems, offset, gap = draw(st.integers(1, 12)), draw(st.integers(0, 3)), draw(st.integers(0, 2))
            host_gap = draw(st.sampled_from([0, 0, 1, 3, 8]))
        specs.append({"dtype": dtype, "elems": elems, "strided": strided, "offset": offset, "gap": gap,
                      "host_gap": host_gap, "nbytes": elems * es})
    return nrows, nslots, specs, draw(st.sampled_from([0, 8] if aligned else [0, 0, 5, 8]))


def _flush(data: Any, nrows: int, nslots: int) -> list[Transfer]:
    """A flush as the owner makes them: destinations leased to one transfer and read by none; sources
    repeated, unsorted; some transfers cancelled, out of range, malformed or empty."""
    draw = data.draw
    w_rows: set[int] = set()
    w_slots: set[int] = set()
    r_rows: set[int] = set()
    r_slots: set[int] = set()
    out: list[Transfer] = []
    for i in range(draw(st.integers(1, 8))):
        odd = draw(st.sampled_from([""] * 12 + ["cancelled", "range", "negative", "lengths", "empty"]))
        store = draw(st.booleans())
        kind = _STORE if store else _LOAD
        if odd == "range":
            out.append(Transfer(f"t{i}", kind, [0, nrows if store else 0], [nslots if not store else 0, 0]))
            continue
        if odd == "negative":
            out.append(Transfer(f"t{i}", kind, [-1], [0]) if draw(st.booleans()) else Transfer(f"t{i}", kind, [0], [-1]))
            continue
        if odd == "lengths":
            out.append(Transfer(f"t{i}", kind, [0, 1], [0]))
            continue
        if odd == "empty":
            out.append(Transfer(f"t{i}", kind, [], []))
            continue
        if store:
            dsts = [s for s in range(nslots) if s not in w_slots and s not in r_slots]
            srcs = [r for r in range(nrows) if r not in w_rows]
        else:
            dsts = [r for r in range(nrows) if r not in w_rows and r not in r_rows]
            srcs = [s for s in range(nslots) if s not in w_slots]
        if not dsts or not srcs:
            continue
        k = draw(st.integers(1, min(4, len(dsts))))
        if draw(st.booleans()):
            starts = [d for d in dsts if all(d + j in dsts for j in range(k))]
            dst = list(range(starts[0], starts[0] + k)) if starts else draw(st.permutations(dsts))[:k]
        else:
            dst = draw(st.permutations(dsts))[:k]
        src = [draw(st.sampled_from(srcs)) for _ in range(k)]
        if draw(st.booleans()):   # a source range
            starts = [s for s in srcs if all(s + j in srcs for j in range(k))]
            if starts:
                src = list(range(starts[-1], starts[-1] + k))
        if store:
            w_slots.update(dst)
            r_rows.update(src)
            out.append(Transfer(f"t{i}", kind, src, dst, cancelled=odd == "cancelled"))
        else:
            w_rows.update(dst)
            r_slots.update(src)
            out.append(Transfer(f"t{i}", kind, dst, src, cancelled=odd == "cancelled"))
    return out


def _valid(t: Transfer, nrows: int, nslots: int) -> bool:
    return (len(t.rows) == len(t.slots) and all(0 <= r < nrows for r in t.rows)
            and all(0 <= s < nslots for s in t.slots))


def _fits_8(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t``'s rows are ``nbytes`` consecutive bytes that 8-byte elements tile (width, row stride, start)."""
    es = t.element_size()
    contiguous = t.dim() == 2 and (t.shape[1] == 1 or t.stride(1) == 1)
    return contiguous and nbytes % 8 == 0 and (t.stride(0) * es) % 8 == 0 and t.data_ptr() % 8 == 0


@settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(layout=_layouts(), data=st.data(), owner=st.booleans(), stage_bytes=st.sampled_from([None, 40, 200]))
def test_every_plane_layout_lands_the_bytes_of_a_per_row_reference_copy(layout, data, owner, stage_bytes):
    """``make_mover`` on CPU planes of every kind it may be given (``cpu_mover`` native and threads): one flush
    of stores and loads, launched / handed to the copy threads, or copied by a blocking owner (``hold`` +
    ``help_one``), with stages of several passes or of no row (one copy per row).  The buffers under the planes
    -- offsets, gaps, slab padding -- end as a per-row reference copy leaves them; each transfer is answered
    once, ok with its bytes exactly when it is valid and not cancelled; the native mover is picked exactly
    where 8-byte views fit every side."""
    nrows, nslots, specs, tail = layout
    seed = data.draw(st.integers(0, 2 ** 16))
    devs0 = []
    for i, sp in enumerate(specs):
        es = torch.empty((), dtype=sp["dtype"]).element_size()
        per = 2 * sp["elems"] + sp["gap"] if sp["strided"] else sp["elems"] + sp["gap"]
        devs0.append(_rows(1, (sp["offset"] + nrows * per) * es, seed + i).view(-1))
    width = sum(sp["host_gap"] + sp["nbytes"] for sp in specs) + tail
    slab0 = _rows(nslots, width, seed + 7)
    block = sum(sp["nbytes"] for sp in specs)
    ts = _flush(data, nrows, nslots)

    ref_devs, ref_slab = [d.clone() for d in devs0], slab0.clone()
    ref = _views(ref_devs, ref_slab, specs, nrows)
    for kind in (_STORE, _LOAD):
        for t in ts:
            if t.kind is kind and not t.cancelled and _valid(t, nrows, nslots):
                for r, s in zip(t.rows, t.slots):
                    for d, h in ref:
                        if kind is _STORE:
                            h[s].copy_(_bytes(d[r]))
                        else:
                            _bytes(d[r]).copy_(h[s])

    for cpu_mover in ("native", "threads"):
        devs, slab = [d.clone() for d in devs0], slab0.clone()
        planes = _views(devs, slab, specs, nrows)
        want_native = cpu_mover == "native" and all(_fits_8(d, sp["nbytes"]) and _fits_8(h, sp["nbytes"])
                                                    for (d, h), sp in zip(planes, specs))
        q = CompletionQueue()
        with mock.patch.object(thread_mod, "STAGE_BYTES", stage_bytes or thread_mod.STAGE_BYTES):
            m = make_mover(planes, q, 1, 1, 64, cpu_mover)
            try:
                assert isinstance(m, NativeMover) is want_native, (cpu_mover, type(m).__name__)
                if stage_bytes is not None and isinstance(m, NativeMover):
                    m._stage_rows = [stage_bytes // (int(h.shape[1]) * h.element_size()) for h in m._host]
                if owner:
                    m.hold(True)
                for t in ts:
                    m.submit(Transfer(t.token, t.kind, list(t.rows), list(t.slots), t.cancelled))
                m.flush()
                reps = _all_reports(m, q, len(ts))
                if owner:
                    m.hold(False)
            finally:
                m.close()
        assert not q.drain(), "more reports than transfers"
        by = {r.token: r for r in reps}
        assert sorted(by) == sorted(t.token for t in ts) and len(reps) == len(ts)
        where = f"{type(m).__name__}, owner={owner}, stage={stage_bytes}"
        for t in ts:
            r = by[t.token]
            assert r.kind is t.kind
            if t.cancelled and _valid(t, nrows, nslots) and t.rows:
                assert not r.ok and r.error == "cancelled before copy", (where, t, r)
            elif not _valid(t, nrows, nslots):
                assert not r.ok and r.error.startswith("copy failed: "), (where, t, r)
            else:
                assert r.ok and r.nbytes == len(t.rows) * block, (where, t, r)
        assert torch.equal(slab, ref_slab), f"{where}: host slots"
        assert all(torch.equal(d, w) for d, w in zip(devs, ref_devs)), f"{where}: device rows"
