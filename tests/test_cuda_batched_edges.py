"""``CudaMover``'s batched path (tiered_kv/movers/cuda.py) at its edges, on the simulated device (tests/fake_cuda.py).

Written as an adversarial review: random episodes over odd plane layouts (several planes, dtypes, strided
and byte-region host planes, rows not a multiple of 8 bytes), several flushes before the device runs, stages
smaller than a chunk and faults at any call, checked against the mover's contract at every report; then the
three defects that review proved (planes the batched constructor could not view, rows or slots out of range
answered ok with wrong bytes or faulting the device, an empty transfer failed by a call that carried none of
its blocks), each kept as a regression test.
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fake_cuda import FakeGPU
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, CudaMover, Report, Transfer
from tiered_kv.movers import cuda as cuda_mod
from tiered_kv.movers.base import rows_view

STORE, LOAD = JobKind.STORE, JobKind.LOAD
ERR = RuntimeError("CUDA error: injected")


# ----------------------------------------------------------------------------- helpers
def tr(kind: JobKind, rows: list[int], slots: list[int], cancelled: bool = False) -> Transfer:
    return Transfer(uuid.uuid4(), kind, list(rows), list(slots), cancelled)


def addrs(t: torch.Tensor) -> set[int]:
    """The byte addresses tensor ``t`` covers."""
    if t.numel() == 0:
        return set()
    es = t.element_size()
    off = torch.zeros((), dtype=torch.int64)
    for d, (n, s) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[d] = n
        off = off + (torch.arange(n, dtype=torch.int64) * (s * es)).view(shape)
    base = off.reshape(-1, 1) + t.data_ptr() + torch.arange(es, dtype=torch.int64)
    return set(base.flatten().tolist())


def op_writes(op: tuple[Any, ...]) -> set[int]:
    """The byte addresses a queued operation writes when it runs."""
    if op[0] in ("copy", "gather"):
        return addrs(op[1])
    if op[0] == "scatter":
        out: set[int] = set()
        for r in op[2].tolist():
            out |= addrs(op[1][r])
        return out
    return set()


def queued_writes(gpu: FakeGPU) -> set[int]:
    out: set[int] = set()
    for s in gpu.streams:
        for op in s.ops:
            out |= op_writes(op)
    return out


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes (each below 64: finite floats) into every row of ``t``."""
    v = rows_view(t)
    assert v is not None
    v.copy_(torch.randint(0, 64, v.shape, dtype=torch.uint8, generator=gen))


class Planes:
    """Device and host planes of one layout, with byte views to check them by."""

    # (dtype, per-row shape of the device plane, device layout)
    SPECS = {
        "u8x8": (torch.uint8, (8,), "plain"),
        "f16x6": (torch.float16, (6,), "plain"),        # 12 bytes: byte views, not 8-byte words
        "f32x3": (torch.float32, (3,), "plain"),        # 12 bytes
        "i16x5": (torch.int16, (5,), "plain"),          # 10 bytes
        "u8x5": (torch.uint8, (5,), "plain"),           # 5 bytes
        "f64x2": (torch.float64, (2,), "plain"),        # 16 bytes
        "f16x2x4": (torch.float16, (2, 4), "plain"),    # 3-D rows of 16 bytes
        "kv_half": (torch.float16, (4,), "half"),       # a half of a [rows, 2, 4] tensor: rows not one range
        "u8x16_off": (torch.uint8, (16,), "offset"),    # rows of a bigger tensor, skipping 3 bytes a row
    }

    def __init__(self, specs: list[str], rows: int, slots: int, host_mode: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.dev: list[torch.Tensor] = []
        self.host: list[torch.Tensor] = []
        self.keep: list[torch.Tensor] = []
        widths = []
        for name in specs:
            dtype, shape, lay = self.SPECS[name]
            if lay == "plain":
                d = torch.empty((rows,) + shape, dtype=dtype)
            elif lay == "half":
                big = torch.empty((rows, 2) + shape, dtype=dtype)
                fill_random(big, gen)
                self.keep.append(big)
                d = big[:, 1]
            else:
                big = torch.empty((rows, shape[0] + 3), dtype=dtype)
                fill_random(big, gen)
                self.keep.append(big)
                d = big[:, 3:]
            fill_random(d, gen)
            self.dev.append(d)
            widths.append(d[0].numel() * d.element_size())
        total = sum(widths)
        if host_mode == "regions":                 # byte regions of one slab's rows (vLLM layout)
            slab = torch.empty((slots, total), dtype=torch.uint8)
            fill_random(slab, gen)
            self.keep.append(slab)
            off = 0
            for w in widths:
                self.host.append(slab[:, off:off + w])
                off += w
        elif host_mode == "split":                 # consecutive ranges of one flat slab
            flat = torch.empty(slots * total, dtype=torch.uint8)
            fill_random(flat, gen)
            self.keep.append(flat)
            off = 0
            for w in widths:
                self.host.append(flat[off:off + slots * w].view(slots, w))
                off += slots * w
        else:                                      # own tensors, the device plane's dtype and row shape
            for d in self.dev:
                h = torch.empty((slots,) + tuple(d.shape[1:]), dtype=d.dtype)
                fill_random(h, gen)
                self.host.append(h)
        self.bytes = sum(widths)

    @property
    def planes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.dev, self.host))

    def snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [rows_view(d).clone() for d in self.dev], [rows_view(h).clone() for h in self.host]  # type: ignore

    def dst_addrs(self, t: Transfer) -> set[int]:
        out: set[int] = set()
        if t.kind is STORE:
            for h in self.host:
                for s in t.slots:
                    out |= addrs(h[s])
        else:
            for d in self.dev:
                for r in t.rows:
                    out |= addrs(d[r])
        return out


def dst_of(dev: torch.Tensor, host: torch.Tensor) -> Any:
    """A transfer's destination bytes on a one-plane mover: its slots (store) or rows (load)."""
    def dst(t: Transfer) -> set[int]:
        out: set[int] = set()
        for i in (t.slots if t.kind is STORE else t.rows):
            out |= addrs((host if t.kind is STORE else dev)[i])
        return out
    return dst


def bare(rows: int = 8, slots: int = 8, streams: int = 1, **kw: Any) -> tuple[FakeGPU, CompletionQueue,
                                                                                torch.Tensor, torch.Tensor, CudaMover]:
    gpu, out = FakeGPU(), CompletionQueue()
    dev = torch.arange(rows * 8, dtype=torch.uint8).view(rows, 8)
    host = (torch.arange(slots * 8, dtype=torch.int64) + 128).to(torch.uint8).view(slots, 8)
    return gpu, out, dev, host, CudaMover([(dev, host)], out, streams, runtime=gpu, **kw)


class CheckedQueue(CompletionQueue):
    """A completion queue that checks each report at the moment the mover puts it (the vLLM copier's queue
    marks the slab ring done inside ``put``: what matters is the device's state then)."""

    def __init__(self) -> None:
        super().__init__()
        self.check: Optional[Any] = None

    def put(self, item: Any) -> None:
        if self.check is not None:
            self.check(item)
        super().put(item)


class Watch:
    """Checks each answer as the mover puts it: once, and never while a queued operation writes its
    destination; after each call, ``in_flight()`` exact and no free event still named by a pending chunk."""

    def __init__(self, gpu: FakeGPU, mover: CudaMover, out: CheckedQueue,
                 dst: Any, check_fence: bool = True) -> None:
        self.gpu, self.mover, self.out, self.dst = gpu, mover, out, dst
        self.check_fence = check_fence
        self.submitted: dict[Any, Transfer] = {}
        self.answered: dict[Any, Report] = {}
        self.problems: list[str] = []
        out.check = self.on_put

    def on_put(self, r: Report) -> None:
        """Records what is wrong rather than raising (the mover's ``except Exception`` would swallow it)."""
        t = self.submitted.get(r.token)
        if t is None:
            self.problems.append("a report for no transfer")
        elif r.token in self.answered:
            self.problems.append(f"answered twice: {t}")
        elif self.check_fence and self.dst(t) & queued_writes(self.gpu):
            self.problems.append(f"{t} answered ({r.ok}, {r.error}) while a queued operation still writes "
                                 "its destination")
        self.answered.setdefault(r.token, r)

    def submit(self, t: Transfer) -> None:
        self.submitted[t.token] = t
        self.mover.submit(t)
        self.collect()

    def collect(self) -> None:
        self.out.drain()
        self.check_state()

    def check_state(self) -> None:
        assert not self.problems, self.problems
        m = self.mover
        assert m.in_flight() == len(self.submitted) - len(self.answered), "in_flight() is not exact"
        free = m._events
        assert len({id(e) for e in free}) == len(free), "an event twice in the free list"
        named = {id(e) for p in m._pending for c in p for e in (c.start, c.end)}
        assert not named & {id(e) for e in free}, "a free event is still named by a pending chunk"

    def harvest(self) -> None:
        self.mover.harvest()
        self.collect()

    def flush(self) -> None:
        self.mover.flush()
        self.collect()

    def steps(self, rng: random.Random, n: int) -> None:
        for _ in range(n):
            ready = self.gpu.runnable()
            if not ready:
                return
            self.gpu.step(rng.choice(ready))

    def finish(self) -> None:
        for _ in range(10_000):
            self.harvest()
            if not self.gpu.runnable():
                break
            self.gpu.step()
        self.harvest()
        assert set(self.answered) == set(self.submitted), "a transfer never answered"
        assert self.mover.in_flight() == 0 and self.gpu.idle


# ----------------------------------------------------------------------------- random episodes
FAULTS = ("copy", "index", "record", "switch")
LAYOUTS = [["u8x8"], ["f16x6"], ["i16x5"], ["u8x5"], ["kv_half"], ["u8x16_off"], ["f16x2x4"],
           ["u8x8", "f16x6"], ["f64x2", "u8x5", "kv_half"], ["f32x3", "u8x16_off"], ["i16x5", "f16x2x4", "u8x8"]]


SIZES = {"rows": 16, "blocks": 4, "transfers": 8}   # per episode (a wider search: raise them)


def run_episode(data: st.DataObject, layout: list[str], host_mode: str, streams: int, per_event: int,
                stage_bytes: int, batch_max: int, faults: dict[str, int], seed: int,
                event_faults: bool = False) -> None:
    rows_n = slots_n = SIZES["rows"]
    old = cuda_mod.STAGE_BYTES
    cuda_mod.STAGE_BYTES = stage_bytes
    try:
        pl = Planes(layout, rows_n, slots_n, host_mode, seed)
        gpu, out = FakeGPU(), CheckedQueue()
        mover = CudaMover(pl.planes, out, streams, runtime=gpu, batch_max=batch_max,
                          event_bytes=per_event * pl.bytes)
        dev0, host0 = pl.snapshot()
        w = Watch(gpu, mover, out, pl.dst_addrs, check_fence=not event_faults)
        rows_left = data.draw(st.permutations(range(rows_n)), label="rows")
        slot_order = data.draw(st.sampled_from(("ascending", "random", "runs")), label="slot order")
        if slot_order == "ascending":
            slots_left = list(range(slots_n))
        elif slot_order == "random":
            slots_left = data.draw(st.permutations(range(slots_n)), label="slots")
        else:   # ascending runs in random order
            cuts = sorted(set(data.draw(st.lists(st.integers(1, slots_n - 1), max_size=4), label="cuts")))
            pieces = [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [slots_n])]
            pieces = data.draw(st.permutations(pieces), label="pieces")
            slots_left = [s for p in pieces for s in p]
        for what, skip in faults.items():
            setattr(gpu, f"{what}_error", ERR)
            setattr(gpu, f"{what}_error_skip", skip)
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        ts: list[Transfer] = []
        want_dev = [d.clone() for d in dev0]          # a store's source bytes as the engine's queued work leaves them
        engine_reads: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        while rows_left and len(ts) < SIZES["transfers"]:
            n = data.draw(st.integers(1, min(SIZES["blocks"], len(rows_left))), label="blocks")
            kind = data.draw(st.sampled_from((STORE, LOAD)), label="kind")
            odd = data.draw(st.sampled_from(("plain",) * 6 + ("cancelled", "mismatched")), label="odd")
            r, s = rows_left[:n], slots_left[:n]
            rows_left, slots_left = rows_left[n:], slots_left[n:]
            t = tr(kind, r, s[:-1] if odd == "mismatched" else s, cancelled=odd == "cancelled")
            if data.draw(st.booleans(), label="engine work before"):
                if kind is STORE:      # the engine's write of the rows, queued before the store: the store copies it
                    new = [torch.randint(0, 64, (n, rows_view(d).shape[1]), dtype=torch.uint8, generator=gen)
                           for d in pl.dev]
                    for p, d in enumerate(pl.dev):
                        want_dev[p][r] = new[p]

                    def write(r: list[int] = r, new: list[torch.Tensor] = new) -> None:
                        for p, d in enumerate(pl.dev):
                            rows_view(d)[r] = new[p]
                    gpu.kernel(write)
                else:                  # the engine's last read of the rows, queued before the load: sees old bytes
                    seen: list[torch.Tensor] = []
                    engine_reads.append(([dev0[p][r].clone() for p in range(len(pl.dev))], seen))

                    def read(r: list[int] = r, seen: list[torch.Tensor] = seen) -> None:
                        seen.extend(rows_view(d)[r].clone() for d in pl.dev)
                    gpu.kernel(read)
            ts.append(t)
            w.submit(t)
            act = data.draw(st.sampled_from(("none", "none", "flush", "run", "harvest")), label="act")
            if act == "flush":
                w.flush()
            elif act == "run":
                w.steps(rng, rng.randint(1, 6))
                w.harvest()
            elif act == "harvest":
                w.harvest()
            if event_faults and data.draw(st.integers(0, 3), label="event fault") == 0:
                chunks = [c for p in mover._pending for c in p]
                if chunks:
                    c = chunks[rng.randrange(len(chunks))]
                    c.end.fail = RuntimeError("CUDA error: an illegal memory access was encountered")
        w.flush()
        while gpu.runnable():
            w.steps(rng, rng.randint(1, 4))
            w.harvest()
        w.finish()
        met = any(getattr(gpu, f"{what}_error") is None for what in faults) or event_faults
        by = {t.token: t for t in ts}
        for tok, rep in w.answered.items():
            t = by[tok]
            if t.cancelled or len(t.rows) != len(t.slots):
                assert not rep.ok, t
            elif not met:
                assert rep.ok, (t, rep)
        for want, seen in engine_reads:
            assert len(seen) == len(want) and all(torch.equal(a, b) for a, b in zip(seen, want)), \
                "a load landed before the engine's read queued ahead of it"
        dev1, host1 = pl.snapshot()
        may_dev: set[int] = set()
        may_host: set[int] = set()
        for t in ts:
            rep = w.answered[t.token]
            if t.kind is STORE:
                if rep.ok:
                    for p in range(len(pl.dev)):
                        assert torch.equal(host1[p][t.slots], want_dev[p][t.rows]), ("store bytes", t, p)
                if not (t.cancelled or len(t.rows) != len(t.slots)):
                    may_host |= set(t.slots)
            else:
                if rep.ok:
                    for p in range(len(pl.dev)):
                        assert torch.equal(dev1[p][t.rows], host0[p][t.slots]), ("load bytes", t, p)
                if not (t.cancelled or len(t.rows) != len(t.slots)):
                    may_dev |= set(t.rows)
        keep_r = [r for r in range(rows_n) if r not in may_dev]
        keep_s = [s for s in range(slots_n) if s not in may_host]
        for p in range(len(pl.dev)):
            assert torch.equal(dev1[p][keep_r], want_dev[p][keep_r]), ("device rows changed", p)
            assert torch.equal(host1[p][keep_s], host0[p][keep_s]), ("host slots changed", p)
    finally:
        cuda_mod.STAGE_BYTES = old


EPISODE = dict(data=st.data(), layout=st.sampled_from(LAYOUTS), host_mode=st.sampled_from(("own", "regions", "split")),
               streams=st.integers(1, 3), per_event=st.integers(1, 5),
               stage_bytes=st.sampled_from((1, 8, 16, 24, 40, 1 << 20)), batch_max=st.sampled_from((1, 2, 3, 64)),
               faults=st.dictionaries(st.sampled_from(FAULTS), st.integers(0, 8), max_size=2),
               seed=st.integers(0, 2 ** 16))


@settings(max_examples=250, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(**EPISODE)
def test_random_episodes_keep_every_contract(data: st.DataObject, layout: list[str], host_mode: str, streams: int,
                                             per_event: int, stage_bytes: int, batch_max: int, faults: dict[str, int],
                                             seed: int) -> None:
    """Random multi-plane layouts (dtypes, odd row sizes, 3-D rows, strided device rows, host planes of their own /
    byte regions of one slab / ranges of one slab), several flushes and partial device runs interleaved (1-3
    streams, batch_max 1..64), engine writes and reads queued before the transfers, cancelled and mismatched
    transfers, up to two injected faults at any call (copy/gather/scatter, index, event record, stream switch),
    stage rows fewer than a chunk's: every transfer answered once, never while a queued operation writes its
    destination; in_flight() exact; no free event named by a pending chunk; ok transfers move exactly their
    bytes (a store the engine's queued write, a load after the engine's queued read) on every plane; nothing
    outside the transfers' destinations changes; with no fault met, every plain transfer is ok."""
    run_episode(data, layout, host_mode, streams, per_event, stage_bytes, batch_max, faults, seed)


@settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(**EPISODE)
def test_random_episodes_with_event_query_errors_answer_every_transfer_once(
        data: st.DataObject, layout: list[str], host_mode: str, streams: int, per_event: int, stage_bytes: int,
        batch_max: int, faults: dict[str, int], seed: int) -> None:
    """As above, with errors raised by the queries of random pending end events (``event.fail``, left set on
    the event as a sticky error): every transfer still answered exactly once, in_flight() exact, the event
    pool consistent, ok transfers' bytes right."""
    run_episode(data, layout, host_mode, streams, per_event, stage_bytes, batch_max, faults, seed, event_faults=True)


# ----------------------------------------------------------------------------- findings
def _misaligned_base_host(slots: int, width: int) -> tuple[torch.Tensor, bytearray]:
    """Host rows whose first byte is 8-byte aligned but whose storage starts 7 bytes before it (a slab mapped
    with ``torch.frombuffer(buf, offset=...)`` at an odd offset): ``data_ptr() % 8 == 0``, ``storage_offset() == 7``."""
    buf = bytearray(slots * width + 32)
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    o = (1 - addr) % 8 or 8                      # the storage starts at an address 1 (mod 8)
    base = torch.frombuffer(buf, dtype=torch.uint8, offset=o)
    h = base[7:7 + slots * width].view(slots, width)
    assert h.data_ptr() % 8 == 0 and h.storage_offset() == 7
    return h, buf


@pytest.mark.parametrize("layout", ["column-strided uint8 host rows", "host storage starting off 8-byte alignment"])
def test_planes_the_per_block_path_takes_are_taken_by_the_batched_mover_too(layout: str) -> None:
    """Byte rows whose width, row stride and start are multiples of 8 but which torch will not view as 8-byte
    elements (a column stride of 2; a storage offset of 7): the batched mover copies them as bytes or block by
    block (``rows_view``, ``widen``) instead of raising in its constructor."""
    slots, rows = 4, 4
    keep: Any = None
    if layout.startswith("column"):
        slab = torch.zeros((slots, 32), dtype=torch.uint8)
        host = slab[:, ::2]                                  # (4, 16), strides (32, 2): every other byte of a row
        keep = slab
    else:
        host, keep = _misaligned_base_host(slots, 16)
        host.zero_()
    dev = torch.arange(rows * 16, dtype=torch.uint8).view(rows, 16)
    want = dev[[3, 1]].clone()
    for batched in (False, True):    # the per-block path copies this plane fine; the batched constructor raises
        host.zero_()
        gpu, out = FakeGPU(), CompletionQueue()
        mover = CudaMover([(dev, host)], out, 1, runtime=gpu, batched=batched)
        t = tr(STORE, [3, 1], [0, 1])
        mover.submit(t)
        mover.flush()
        gpu.run_all()
        mover.harvest()
        (r,) = out.drain()
        assert r.ok and torch.equal(host[:2], want), batched
    del keep


OUT_OF_RANGE = {   # 4 device rows, 4 host slots
    "load from slots 3, 4 (one run, consecutive rows)": (LOAD, [0, 1], [3, 4]),
    "store of rows 3, 4 (one run, consecutive rows)": (STORE, [3, 4], [0, 1]),
    "load from slots 3, 4 into scattered rows": (LOAD, [2, 0], [3, 4]),
    "store of rows 4, 0 (gathered)": (STORE, [4, 0], [0, 1]),
}


@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
@pytest.mark.parametrize("batched", [True, False])
def test_a_transfer_naming_a_row_or_slot_out_of_range_fails_before_any_copy(case: str, batched: bool) -> None:
    """A transfer naming a device row or host slot past the end is answered failed at the flush, with nothing
    queued: the batched path slices ranges (a slice past the end is silently one row short, and ``copy_``
    would broadcast a row's bytes into its neighbour, answered ok) and uploads row numbers (an index past the
    end faults the device, on CUDA poisoning the context).  The other transfers of the batch go on."""
    kind, rows, slots = OUT_OF_RANGE[case]
    gpu, out, dev, host, mover = bare(4, 4, batched=batched)
    dev0, host0 = dev.clone(), host.clone()
    t = tr(kind, rows, slots)
    u = tr(STORE, [2], [2])
    mover.submit(t)
    mover.submit(u)
    mover.flush()
    (r,) = out.drain()
    assert r.token == t.token and not r.ok and "out of range" in (r.error or "")
    gpu.run_all()
    mover.harvest()
    (ru,) = out.drain()
    assert ru.token == u.token and ru.ok
    assert torch.equal(dev, dev0) and torch.equal(host[[0, 1, 3]], host0[[0, 1, 3]])
    assert torch.equal(host[2], dev0[2])


def test_an_empty_transfer_between_the_blocks_of_a_failing_call_is_ok() -> None:
    """A call fails the transfers with a block in it, and a transfer with no blocks has none.  T1 (row 3 ->
    slot 0), E (no rows), T2 (row 5 -> slot 1): slots 0, 1 are one gathered run, whose gather fails; E sits
    at [1, 1) inside the failed run [0, 2) and is answered ok, as on the per-block path."""
    gpu, out, dev, host, mover = bare()
    t1, e, t2 = tr(STORE, [3], [0]), tr(STORE, [], []), tr(STORE, [5], [1])
    for t in (t1, e, t2):
        mover.submit(t)
    gpu.copy_error = ERR                              # the gather of the run slots 0, 1
    mover.flush()
    assert gpu.copy_error is None
    gpu.run_all()
    mover.harvest()
    reps = {r.token: r for r in out.drain()}
    assert set(reps) == {t1.token, e.token, t2.token}
    assert not reps[t1.token].ok and not reps[t2.token].ok
    assert reps[e.token].ok, reps[e.token].error


# ----------------------------------------------------------------------------- properties that hold
def test_an_empty_transfer_is_ok_alone_and_on_the_per_block_path() -> None:
    """An empty transfer alone is answered ok at its (empty) chunk's end event; between the blocks of a failing
    copy on the per-block path, too."""
    gpu, out, dev, host, mover = bare()
    e = tr(LOAD, [], [])
    mover.submit(e)
    mover.flush()
    assert out.drain() == [] and mover.in_flight() == 1
    gpu.run_all()
    mover.harvest()
    (r,) = out.drain()
    assert r.token == e.token and r.ok and r.nbytes == 0 and mover.in_flight() == 0
    gpu, out, dev, host, mover = bare(batched=False)
    t1, e, t2 = tr(STORE, [3], [0]), tr(STORE, [], []), tr(STORE, [5], [1])
    for t in (t1, e, t2):
        mover.submit(t)
    gpu.copy_error = ERR
    mover.flush()
    gpu.run_all()
    mover.harvest()
    reps = {r.token: r for r in out.drain()}
    assert not reps[t1.token].ok and reps[e.token].ok and reps[t2.token].ok


def test_staging_rows_survive_three_flushes_on_two_streams_run_op_by_op_in_lockstep(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage of one row (smaller than the 3-block chunks), two streams, three flushes queued before the device
    runs anything (stores, loads, stores: the round robin puts flushes 1 and 3 on one stream, each chunk's
    gather/copy and copy/scatter through the same staging row); the device then runs the streams alternately,
    one operation at a time.  Every answer comes after its copies; every byte lands where it should."""
    monkeypatch.setattr(cuda_mod, "STAGE_BYTES", 8)
    gpu, out, dev, host, mover = bare(16, 16, streams=2, event_bytes=24)
    dev0, host0 = dev.clone(), host.clone()
    batches = [[tr(STORE, [9, 3, 7], [0, 1, 2]), tr(STORE, [1, 5], [3, 4])],
               [tr(LOAD, [12, 0, 14], [8, 9, 10]), tr(LOAD, [2], [11])],
               [tr(STORE, [15, 11, 13], [5, 6, 7]), tr(STORE, [4, 10], [12, 13])]]
    chk = CheckedQueue()
    mover._out = chk
    w = Watch(gpu, mover, chk, dst_of(dev, host))
    for b in batches:
        for t in b:
            w.submit(t)
        w.flush()
    s0, s1 = gpu.side
    assert len(gpu.batches) == 3 and gpu.batches[0] is s0 and gpu.batches[1] is s1 and gpu.batches[2] is s0
    while gpu.runnable():
        for s in (s0, s1, gpu.compute):
            gpu.step(s)
        w.harvest()
    w.finish()
    assert all(r.ok for r in w.answered.values())
    for t in batches[0] + batches[2]:
        assert torch.equal(host[t.slots], dev0[t.rows]), t
    for t in batches[1]:
        assert torch.equal(dev[t.rows], host0[t.slots]), t


def test_a_failed_index_upload_in_one_plane_is_retried_by_the_next_and_fails_only_that_runs_transfers() -> None:
    """Two planes whose device rows are not one range (both gathered); the index upload of the first plane's
    only staged run fails: the second plane uploads again and gathers; the transfers of that run fail, answered
    at the chunk's end event, the transfer of the other (straight) run is ok."""
    gpu, out = FakeGPU(), CompletionQueue()
    pl = Planes(["kv_half", "u8x5"], 8, 8, "own", 7)
    dev0, host0 = pl.snapshot()
    mover = CudaMover(pl.planes, out, 1, runtime=gpu)
    a, b, c = tr(STORE, [6], [0]), tr(STORE, [2], [1]), tr(STORE, [4], [5])   # runs: slots 0 1 (gathered) | 5
    for t in (a, b, c):
        mover.submit(t)
    gpu.index_error = ERR
    mover.flush()
    assert gpu.index_error is None and gpu.calls == 5        # index (fails), copy of c; index, gather, copy
    assert out.drain() == [] and mover.in_flight() == 3
    gpu.run_all()
    mover.harvest()
    reps = {r.token: r for r in out.drain()}
    assert not reps[a.token].ok and not reps[b.token].ok and reps[c.token].ok
    dev1, host1 = pl.snapshot()
    for p in range(2):
        assert torch.equal(host1[p][[5]], dev0[p][[4]])
        assert torch.equal(host1[p][[2, 3, 4, 6, 7]], host0[p][[2, 3, 4, 6, 7]])


def test_the_event_pool_stays_bounded_over_many_multi_chunk_flushes_on_two_streams() -> None:
    """Batches of several chunks, stores and loads on two streams, harvested after the device ran: the events
    are recycled (no pool growth after the first rounds) and none is free while a pending chunk names it."""
    gpu, out, dev, host, mover = bare(16, 16, streams=2, event_bytes=16)
    chk = CheckedQueue()
    mover._out = chk
    w = Watch(gpu, mover, chk, dst_of(dev, host))
    rng = random.Random(5)
    for i in range(60):
        rows = rng.sample(range(16), 6)
        slots = sorted(rng.sample(range(16), 6))
        w.submit(tr(STORE, rows[:3], slots[:3]))
        w.submit(tr(LOAD, rows[3:], slots[3:]))
        w.flush()
        if i % 3 == 2:
            w.steps(rng, 10 ** 6)
            w.harvest()
    w.finish()
    assert all(r.ok for r in w.answered.values())
    assert len(gpu.events) <= 3 * 8, len(gpu.events)


def test_a_record_failure_after_a_transfer_spanning_chunks_waits_for_its_queued_copies_on_every_plane() -> None:
    """Multi-plane, one block per chunk; the end event of a transfer's second chunk cannot be recorded: its
    first chunk's copies (behind a recorded event) and the second's (behind none) are on the stream.  It is
    answered failed only after the stream ran them; the transfer before it is answered ok at its event; the
    next batch goes through."""
    gpu, out = FakeGPU(), CheckedQueue()
    pl = Planes(["f16x6", "kv_half"], 8, 8, "split", 3)
    mover = CudaMover(pl.planes, out, 1, runtime=gpu, event_bytes=1)
    w = Watch(gpu, mover, out, pl.dst_addrs)
    a, b = tr(LOAD, [1], [0]), tr(LOAD, [5, 3, 7], [4, 5, 6])
    gpu.record_error, gpu.record_error_skip = ERR, 3             # start, a's end, b's first end: b's second fails
    w.submit(a)
    w.submit(b)
    w.flush()
    assert gpu.record_error is None
    assert not w.answered[b.token].ok
    w.finish()
    assert w.answered[a.token].ok
    c = tr(STORE, [0, 2], [1, 2])
    w.submit(c)
    w.finish()
    assert w.answered[c.token].ok


def test_a_batch_whose_stream_cannot_be_made_current_gives_its_start_event_back_and_queues_no_copy() -> None:
    """The stream switch of a flush's stores fails: they are answered failed in the flush, with no copy queued
    (their stream holds only the barrier and the start record), the start event back in the pool; the loads of
    the same flush, on the other stream, go through (their batch reuses that start event)."""
    gpu, out = FakeGPU(), CheckedQueue()
    pl = Planes(["u8x8", "u8x5"], 8, 8, "regions", 1)
    mover = CudaMover(pl.planes, out, 2, runtime=gpu)
    w = Watch(gpu, mover, out, pl.dst_addrs)
    st_, ld = tr(STORE, [3, 1], [0, 1]), tr(LOAD, [4], [6])
    gpu.switch_error = ERR
    w.submit(st_)
    w.submit(ld)
    w.flush()
    assert set(w.answered) == {st_.token} and not w.answered[st_.token].ok
    s0, s1 = gpu.side
    assert [op[0] for op in s0.ops] == ["wait", "event"]
    assert len(gpu.events) == 2          # the stores' start event was given back: the loads' batch started with it
    w.finish()
    assert w.answered[ld.token].ok
