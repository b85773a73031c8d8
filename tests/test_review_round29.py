"""Adversarial review, round 29: ``CudaMover``'s groups of planes side by side in one host row (commit c409aae,
tiered_kv/movers/cuda.py ``_Group``/``_host_groups``/``_group``/``_queue_group``/``_group_stage``/``_copy_blocks``)
and the bench's vLLM worker layout (commit bc1bd0e, tiered_kv/bench/core.py ``_cuda_worker_layout``), on the
simulated device of ``tests/fake_cuda.py``.

What it proved wrong (all fixed; each test fails on 584f6ee, the tree before the fixes, and passes now):

1. ``test_a_grouped_load_of_one_row_twice_moves_bytes_not_values`` (and, same cause,
   ``test_a_grouped_store_without_staging_memory_moves_bytes_not_values``): the per-block fallbacks of a group
   (a chunk that loads one row twice; since 467bdb3 also staging rows that cannot be made) call ``_copy_blocks``,
   which copies ``self._blocks[p]``: for every plane the batched path takes that is ``(dev, host)`` as given, not
   byte rows.  fp16 device rows beside int16 slab rows are converted value by value and reported ok; bf16 device
   rows beside uint8 slab rows get a ``copy_`` of mismatched shapes (a failed load on a GPU, an exception on the
   simulated device).  Round 2's fix 7 (``base.byte_rows``) is bypassed for exactly the grouped planes.  Not
   reachable through ``SlabCopier`` (it views every KV tensor as uint8), only through ``CudaMover``'s own planes.
2. ``test_a_solo_plane_never_scatters_one_row_twice_in_one_index_copy``: the class docstring (new in c409aae)
   says "a chunk that loads one row twice is copied block by block too, in order", but only groups check it:
   a plane whose host rows are one range still queues ``index_copy_`` with a repeated index (which of the two
   lands is undefined on CUDA).  (The solo path itself predates c409aae; the promise is new.)
3. ``test_grouping_keeps_the_plane_order_of_overlapping_host_regions``: planes are no longer copied in plane
   order (groups first, then the solo planes), so where a solo plane's host region overlaps a group's, a store
   lands the solo plane's bytes where copying block by block over the planes in order lands the group's (the
   mover before c409aae did that).  An aliased layout, so low severity.
4. ``test_the_worker_layout_bench_byte_check_sees_bytes_moved_within_a_row``: ``_cuda_worker_layout`` fills each
   KV tensor's row with one repeated byte, so its "failed, missing or wrong" count cannot see bytes misplaced
   inside a plane's columns: a device whose gathers reverse each row's words reports 0 problems.
5. ``test_a_row_that_is_not_an_int_fails_only_its_own_transfer_in_a_group``: one transfer whose row is 1.5 makes
   the group's single index upload fail, which fails every good transfer of its chunk (block by block, or before
   c409aae, only that transfer failed).  Within the letter of "a call that cannot be queued fails the transfers
   with a block in it", but a regression of round 2's "answered alone" (fixes 8, 9); medium-low severity.

Fixed: byte rows for every plane's copies block by block (1); a chunk that loads a row twice copies every plane
block by block (2); no group that may share host bytes with a plane outside it (3; ``_overlapped``); the bench's
rows vary along the row (4); a failed index upload leaves the group's chunk to copies block by block (5).  Also
from the suspicions: the device probe now checks 1-byte elements as well as 8-byte ones.

Checked, found sound (plain tests below where cheap):
- an interrupt (KeyboardInterrupt) or a RuntimeError raised at *every* line executed in ``_queue_copies``,
  ``_queue_group``, ``_group_stage``, ``_copy_blocks``, ``_failed``, ``_slot_runs`` and ``close`` (via
  ``sys.settrace``; ~550 points per layout), for a group of three planes plus a solo plane, whole-row and
  part-of-row regions, one and two streams, transfers spanning chunks, staging smaller than a chunk, a load
  of one row twice: every transfer answered exactly once, never while a copy into it was still queued, and the
  transfers answered ok hold the right bytes;
- random batches over two groups (two slabs) plus a solo plane, with duplicate rows and slots across transfers,
  against the same mover with the probe refused (per block, plane by plane): same bytes, same answers;
- grouping: planes listed twice (no group since the fix for 3), planes of two slabs at adjacent offsets, different
  slot counts, gaps, odd widths / misaligned starts (stay bytes: no int64 widening), device rows with
  a row stride above their width, device tensors with different row counts;
- a store chunk with one slot twice: the later block lands last (copies per run in order);
- ``batched=False`` and a probe answering False make no group;
- the SlabCopier with world_size 2 (existing test_cuda_groups/test_review_movers3 cover it end to end).

Suspected, not shown:
- (taken up, tests/test_cuda_groups.py) a load pass whose host->staging copy fails still scattered the staging
  rows of that run into the failed transfers' device rows (stale bytes from an earlier pass or chunk); such a pass
  now copies only the other blocks' rows;
- (taken up: ``TorchCuda.strided_index_ops`` now probes uint8 column slices too, which groups whose widths do not
  widen use; whether any device needs it takes a GPU to show);
- the probe's ``.cpu()`` reads wait for the device's current stream at construction (documented; at start only).
"""

from __future__ import annotations

import logging
import random
import sys
import uuid
from typing import Any

import pytest
import torch

from fake_cuda import FakeGPU, FakeStream
from test_review_movers3 import LoggedQueue, settle
from test_cuda_batched import done as answers   # every report, each transfer once
from test_cuda_batched_edges import addrs
from tiered_kv.bench import core
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, CudaMover, Transfer
from tiered_kv.movers import cuda as cuda_mod

pytestmark = pytest.mark.timeout(120)

STORE, LOAD = JobKind.STORE, JobKind.LOAD


def tr(kind: JobKind, rows: list[Any], slots: list[Any]) -> Transfer:
    return Transfer(uuid.uuid4(), kind, list(rows), list(slots))




# ============================================================================= 1
@pytest.mark.parametrize("dev_dtype,host_dtype", [(torch.float16, torch.int16), (torch.bfloat16, torch.uint8)])
def test_a_grouped_load_of_one_row_twice_moves_bytes_not_values(dev_dtype: torch.dtype,
                                                                host_dtype: torch.dtype) -> None:
    """Two KV tensors of 16-byte rows side by side in a slab row form a group (their byte views fit).  A chunk
    that loads row 5 twice (from slot 1, then slot 6) goes block by block through ``_copy_blocks``, which takes
    ``self._blocks[p]``: for a plane the batched path takes that is ``(dev, host)`` as given, so the copy_ is
    between fp16 and int16 elements (values converted, reported ok) or between a bf16 row of 8 and a uint8 row of
    16 (shapes differ: on a GPU the call raises and both loads fail; the simulated device raises when it runs).

    Fixed: ``CudaMover.__init__`` keeps byte rows (``byte_rows``) for every plane's copies block by block, the
    batched planes' fallbacks included."""
    gen = torch.Generator().manual_seed(29)
    n_el = 16 // torch.empty((), dtype=host_dtype).element_size()
    slab = torch.randint(0, 200, (8, 2 * n_el), dtype=torch.int32, generator=gen).to(host_dtype)
    if host_dtype == torch.int16:
        slab = torch.randint(-30000, 30000, (8, 2 * n_el), dtype=torch.int32, generator=gen).to(torch.int16)
    d_el = 16 // torch.empty((), dtype=dev_dtype).element_size()
    devs = [torch.zeros((8, d_el), dtype=dev_dtype) for _ in range(2)]
    planes = [(devs[0], slab[:, :n_el]), (devs[1], slab[:, n_el:])]
    gpu, out = FakeGPU(), CompletionQueue()
    m = CudaMover(planes, out, 1, runtime=gpu)
    assert len(m._groups) == 1
    first, second = tr(LOAD, [2, 5], [0, 1]), tr(LOAD, [5], [6])
    m.submit(first)
    m.submit(second)
    m.flush()
    try:
        gpu.run_all()
    except RuntimeError as exc:
        pytest.fail(f"a queued per-block copy_ could not run: {exc}")
    m.harvest()
    got = {r.token: r for r in out.drain()}
    assert got[first.token].ok and got[second.token].ok
    for row, slot in ((2, 0), (5, 6)):
        want = slab[slot].contiguous().view(torch.uint8)
        have = torch.cat([devs[0][row].view(torch.uint8), devs[1][row].view(torch.uint8)])
        assert torch.equal(have, want), f"device row {row}: values converted, not bytes moved"


def test_a_grouped_store_without_staging_memory_moves_bytes_not_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same root cause as the test above, reached by the fallback the current tree adds for a device out of memory
    for a group's staging rows (commit 467bdb3, ``_queue_copies``: ``_copy_blocks`` for every plane of the group):
    a store of fp16 device rows into int16 slab rows converts each value (1.5 -> 1), reported ok.

    Fixed as above (byte rows in ``self._blocks`` for every plane)."""
    gen = torch.Generator().manual_seed(30)
    slab = torch.zeros((8, 16), dtype=torch.int16)
    devs = [(torch.randn((8, 8), generator=gen) * 100).to(torch.float16) for _ in range(2)]
    planes = [(devs[0], slab[:, :8]), (devs[1], slab[:, 8:])]
    gpu, out = FakeGPU(), CompletionQueue()
    m = CudaMover(planes, out, 1, runtime=gpu)
    assert len(m._groups) == 1

    def no_memory(self: CudaMover, *a: Any) -> Any:
        raise RuntimeError("CUDA out of memory (injected)")

    monkeypatch.setattr(CudaMover, "_group_stage", no_memory)
    logging.disable(logging.CRITICAL)
    try:
        t = tr(STORE, [3, 1], [0, 1])
        m.submit(t)
        m.flush()
        assert answers(gpu, m, out)[t.token].ok
    finally:
        logging.disable(logging.NOTSET)
    for r, s in zip(t.rows, t.slots):
        want = torch.cat([devs[0][r].view(torch.uint8), devs[1][r].view(torch.uint8)])
        assert torch.equal(slab[s].contiguous().view(torch.uint8), want), f"slot {s}: values converted, not bytes"


# ============================================================================= 2
def test_a_solo_plane_never_scatters_one_row_twice_in_one_index_copy() -> None:
    """``CudaMover``'s docstring (c409aae): "A chunk that loads one row twice is copied block by block too, in
    order" -- because "one index_copy_ would land either" (``_queue_copies``' comment; torch documents
    ``index_copy_`` with duplicate indices as nondeterministic).  Only the group loop checks it.  A plane whose host
    rows are one range (the TierManager's plane, or the copier's with one KV tensor and one rank): loads of row 5
    from slots 1 and 2 in one flush are one run of slots, so one staging copy and one ``index_copy_`` with index
    ``[5, 5]``: the simulated (CPU) device happens to land the later one, a GPU need not.

    Fixed: ``CudaMover._queue_copies`` checks once per chunk whether a load names a row twice and then copies every
    plane, group or solo, block by block in order (``_copy_blocks`` over byte rows)."""
    dev = torch.zeros((8, 8), dtype=torch.uint8)
    host = torch.arange(64, dtype=torch.uint8).view(8, 8)
    gpu, out = FakeGPU(), CompletionQueue()
    m = CudaMover([(dev, host)], out, 1, runtime=gpu)
    a, b = tr(LOAD, [5], [1]), tr(LOAD, [5], [2])
    m.submit(a)
    m.submit(b)
    m.flush()
    (side,) = gpu.side
    repeated = [op[2].tolist() for op in side.ops if op[0] == "scatter" and len(set(op[2].tolist())) < op[2].numel()]
    got = answers(gpu, m, out)
    assert got[a.token].ok and got[b.token].ok
    assert torch.equal(dev[5], host[2])
    assert repeated == [], f"index_copy_ queued with a repeated row: {repeated}"


# ============================================================================= 3
def test_grouping_keeps_the_plane_order_of_overlapping_host_regions() -> None:
    """Plane 0 covers the whole slab row, planes 1 and 2 its two halves (a group).  Copying block by block over
    the planes in order (the contract's model; the mover before c409aae, and the same mover with the probe refused)
    lands planes 1 and 2 last; the grouped mover queues the group first and plane 0 after it, so a store leaves
    plane 0's bytes in the slot, and reports ok.

    Fixed: ``_host_groups`` forms no group that may share host bytes with a plane outside it (``_overlapped``: a
    plane of the same storage is clear only with the same row stride and bytes of the row beside the group's), so
    these planes are copied plane by plane, in order."""
    gen = torch.Generator().manual_seed(3)
    dc, da, db = (torch.randint(0, 256, (4, w), dtype=torch.uint8, generator=gen) for w in (16, 8, 8))
    slabs = []
    for probe in (False, True):
        slab = torch.zeros((4, 16), dtype=torch.uint8)
        gpu, out = FakeGPU(), CompletionQueue()
        gpu.strided_ok = probe
        m = CudaMover([(dc, slab[:, 0:16]), (da, slab[:, 0:8]), (db, slab[:, 8:16])], out, 1, runtime=gpu)
        assert m._groups == []   # planes 1 and 2 share plane 0's bytes: no group (a probe refused: none either)
        t = tr(STORE, [1], [2])
        m.submit(t)
        m.flush()
        assert answers(gpu, m, out)[t.token].ok
        slabs.append(slab)
    assert torch.equal(slabs[0][2], torch.cat([da[1], db[1]]))        # block by block, planes in order
    assert torch.equal(slabs[1], slabs[0]), "grouped: plane 0's bytes landed over the group's"


# ============================================================================= 4
class _FlipStream(FakeStream):
    """A faulty device: a gather lands each selected row's elements in reverse order within the output columns."""

    def run_one(self) -> None:
        op = self.ops[0]
        if op[0] != "gather":
            super().run_one()
            return
        self.ops.popleft()
        self.ran += 1
        self._gpu.time += 1
        op[1].copy_(torch.index_select(op[2], 0, op[3]).flip(1))


class _FlipGPU(FakeGPU):
    def new_stream(self, device: Any) -> FakeStream:
        s = _FlipStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s


def test_the_worker_layout_bench_byte_check_sees_bytes_moved_within_a_row() -> None:
    """The faulty device really moves wrong bytes (checked first, on a row of distinct bytes); the bench's
    "failed, missing or wrong" count over the same device stays 0.

    Fixed: ``_cuda_worker_layout`` fills the KV tensors with ``(row * 7 + i * 13 + column) % 251``, bytes that vary
    along the row too, so a byte in the wrong column is counted."""
    gen = torch.Generator().manual_seed(5)
    devs = [torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=gen) for _ in range(2)]
    slab = torch.zeros((4, 32), dtype=torch.uint8)
    gpu, out = _FlipGPU(), CompletionQueue()
    m = CudaMover([(devs[0], slab[:, :16]), (devs[1], slab[:, 16:])], out, 1, runtime=gpu)
    t = tr(STORE, [1, 2], [0, 1])
    m.submit(t)
    m.flush()
    assert answers(gpu, m, out)[t.token].ok
    assert not torch.equal(slab[0], torch.cat([devs[0][1], devs[1][1]])), "the faulty device moved the right bytes"
    r = core._cuda_worker_layout("smoke", random.Random(0), core._Device(_FlipGPU()), planes=4, plane_bytes=64)
    assert r["grouped"]["groups"] == 1
    assert r["grouped"]["problems"] > 0, "wrong bytes on every stored row, 0 problems counted"


# ============================================================================= 5
@pytest.mark.parametrize("kind", [STORE, LOAD])
def test_a_row_that_is_not_an_int_fails_only_its_own_transfer_in_a_group(kind: JobKind) -> None:
    """``transfer_error`` leaves a row's type unchecked by design ("a row that is not an int fails where it is used":
    round 2's fixes 8 and 9 answer such a transfer alone).  Copied block by block (the same planes with the probe
    refused, or before c409aae) only that transfer fails; through a group the chunk's single ``array("q")`` index
    upload refuses row 1.5, and ``_queue_copies`` fails blocks ``0..n`` of the chunk: every good transfer beside
    it (a whole engine step: a chunk is up to 64 MiB) is answered failed with no copy.

    Fixed: where the group's index upload raises, ``CudaMover._queue_copies`` copies the group's planes of that
    chunk block by block (as the staging-memory fallback does), so only the blocks whose row is refused fail."""
    oks = []
    for probe in (False, True):
        devs = [torch.arange(64, dtype=torch.uint8).view(8, 8) + 64 * i for i in range(2)]
        slab = torch.zeros((8, 16), dtype=torch.uint8)
        gpu, out = FakeGPU(), CompletionQueue()
        gpu.strided_ok = probe
        m = CudaMover([(devs[0], slab[:, :8]), (devs[1], slab[:, 8:])], out, 1, runtime=gpu)
        assert len(m._groups) == (1 if probe else 0)
        ts = [tr(kind, [1], [1]), tr(kind, [1.5], [2]), tr(kind, [3], [3])]
        for t in ts:
            m.submit(t)
        logging.disable(logging.CRITICAL)
        try:
            m.flush()
            got = answers(gpu, m, out)
        finally:
            logging.disable(logging.NOTSET)
        oks.append([got[t.token].ok for t in ts])
    assert oks[0] == [True, False, True]           # block by block: only the malformed transfer fails
    assert oks[1] == oks[0], f"grouped: {oks[1]}"


# ============================================================================= checked, found sound
_TRACED = {cuda_mod.CudaMover._queue_group.__code__, cuda_mod.CudaMover._queue_copies.__code__,
           cuda_mod.CudaMover._group_stage.__code__, cuda_mod.CudaMover._copy_blocks.__code__,
           cuda_mod._failed.__code__, cuda_mod._slot_runs.__code__}


class _RaiseAtLine:
    """A trace function raising ``exc`` at the ``k``-th line executed in the traced functions (what CPython does
    with a pending KeyboardInterrupt at that point, or a CUDA error raised by the call on that line)."""

    def __init__(self, k: int, exc: BaseException) -> None:
        self.k, self.n, self.exc, self.fired = k, 0, exc, False

    def glob(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code in _TRACED or (frame.f_code.co_name == "close" and "cuda" in frame.f_code.co_filename):
            return self.local
        return None

    def local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not self.fired:
            if self.n == self.k:
                self.fired = True
                raise self.exc
            self.n += 1
        return self.local


def _sweep_rig(one_range: bool, streams: int, seed: int) -> tuple[FakeGPU, LoggedQueue, CudaMover, list[Any]]:
    gen = torch.Generator().manual_seed(seed)
    before = 0 if one_range else 8
    devs = [torch.randint(0, 256, (10, w), dtype=torch.uint8, generator=gen) for w in (8, 16, 8)]
    slab = torch.randint(0, 256, (12, before + 32), dtype=torch.uint8, generator=gen)
    planes, at = [], before
    for d, w in zip(devs, (8, 16, 8)):
        planes.append((d, slab[:, at:at + w]))
        at += w
    planes.append((torch.randint(0, 256, (10, 8), dtype=torch.uint8, generator=gen),
                   torch.randint(0, 256, (12, 8), dtype=torch.uint8, generator=gen)))     # a solo plane
    gpu = FakeGPU(rng=random.Random(seed))
    out = LoggedQueue(gpu)
    m = CudaMover(planes, out, streams, runtime=gpu, batch_max=1000, event_bytes=3 * 40, stage_bytes=2 * 32)
    assert len(m._groups) == 1 and m._groups[0].one_range == one_range
    return gpu, out, m, planes


@pytest.mark.parametrize("one_range,streams,kind", [(True, 2, "interrupt"), (False, 1, "interrupt"),
                                                    (False, 2, "error")])
def test_an_interrupt_or_error_at_every_line_of_the_group_path_answers_each_transfer_once_after_its_copies(
        one_range: bool, streams: int, kind: str) -> None:
    logging.disable(logging.CRITICAL)
    try:
        k = 0
        while True:
            gpu, out, m, planes = _sweep_rig(one_range, streams, k)
            start = [(d.clone(), h.clone()) for d, h in planes]
            ts = [tr(STORE, [0, 1, 2, 3], [0, 1, 2, 3]), tr(STORE, [4], [7]), tr(LOAD, [5, 6, 7], [8, 9, 10]),
                  tr(STORE, [8, 9], [5, 4]), tr(LOAD, [5], [11])]      # spans chunks; row 5 loaded twice
            for t in ts:
                m.submit(t)
            hook = _RaiseAtLine(k, KeyboardInterrupt() if kind == "interrupt" else RuntimeError("injected"))
            sys.settrace(hook.glob)
            try:
                m.flush()
            except BaseException:   # noqa: BLE001 - the injected interrupt or error
                pass
            finally:
                sys.settrace(None)
            if not hook.fired:
                break
            settle(gpu, m)
            got = out.answers()
            for i, t in enumerate(ts):
                assert len(got.get(t.token, [])) == 1, f"k={k}: transfer {i} answered {len(got.get(t.token, []))}x"
                dst: set[int] = set()
                for r, s in zip(t.rows, t.slots):
                    for d, h in planes:
                        dst |= addrs(h[s] if t.kind is STORE else d[r])
                for rep, pending in out.log:
                    assert rep.token != t.token or not (dst & pending), f"k={k}: {i} answered, a copy into it queued"
                if not got[t.token][0].ok:
                    continue
                for r, s in zip(t.rows, t.slots):
                    if i == 2 and r == 5:
                        continue   # loaded again by transfer 4
                    for (d, h), (d0, h0) in zip(planes, start):
                        assert torch.equal(h[s] if t.kind is STORE else d[r], d0[r] if t.kind is STORE else h0[s]), \
                            f"k={k}: transfer {i} ok with wrong bytes"
            k += 1
        assert k > 300   # the sweep reached the group path's lines
    finally:
        logging.disable(logging.NOTSET)


def test_two_groups_and_a_solo_plane_land_what_the_per_block_mover_lands_over_random_batches() -> None:
    rng = random.Random(2929)
    for trial in range(40):
        gen = torch.Generator().manual_seed(trial)
        results = []
        batches = []
        for _ in range(rng.randint(1, 3)):
            batch = []
            for _ in range(rng.randint(1, 6)):
                n = rng.randint(1, 3)
                rows = rng.sample(range(10), n)
                s0 = rng.randint(0, 11 - n)
                slots = list(range(s0, s0 + n)) if rng.random() < 0.5 else rng.sample(range(12), n)
                batch.append((rng.choice([STORE, LOAD]), rows, slots))
            batches.append(batch)
        ev, stg, ns = rng.randint(1, 6), rng.randint(1, 5), rng.choice([1, 1, 2])
        w1, w2 = rng.choice([[8, 16], [3, 5, 13]]), rng.choice([[8, 8], [4, 12]])
        d1 = [torch.randint(0, 256, (10, w), dtype=torch.uint8, generator=gen) for w in w1]
        d2 = [torch.randint(0, 256, (11, w), dtype=torch.uint8, generator=gen) for w in w2]   # (uint8: see test 1)
        s1 = torch.randint(0, 256, (12, sum(w1) + 3), dtype=torch.uint8, generator=gen)
        s2 = torch.randint(0, 256, (12, sum(w2)), dtype=torch.uint8, generator=gen)
        solo = (torch.randint(0, 256, (10, 8), dtype=torch.uint8, generator=gen),
                torch.randint(0, 256, (12, 8), dtype=torch.uint8, generator=gen))
        for probe in (False, True):
            ds1, ds2 = [d.clone() for d in d1], [d.clone() for d in d2]
            h1, h2, so = s1.clone(), s2.clone(), (solo[0].clone(), solo[1].clone())
            planes = [so]
            at = 0
            for d, w in zip(ds1, w1):
                planes.append((d, h1[:, at:at + w]))
                at += w
            at = 0
            for d, w in zip(ds2, w2):
                planes.append((d, h2[:, at:at + w]))
                at += w
            rng_order = random.Random(trial)
            rng_order.shuffle(planes)
            gpu, out = FakeGPU(), CompletionQueue()
            gpu.strided_ok = probe
            block = sum(w1) + sum(w2) + 8
            m = CudaMover(planes, out, ns, runtime=gpu, batch_max=1000, event_bytes=ev * block,
                          stage_bytes=stg * block)
            assert len(m._groups) == (2 if probe else 0)
            oks = []
            for batch in batches:
                ts = [tr(k, r, s) for k, r, s in batch]
                for t in ts:
                    m.submit(t)
                m.flush()
                gpu.run_all()   # one batch at a time: stores and loads of a batch touch other streams' bytes
                got = answers(gpu, m, out)
                oks.append([got[t.token].ok for t in ts])
            results.append((oks, [d.clone() for d in ds1 + ds2], h1.clone(), h2.clone(), so[0].clone(),
                            so[1].clone()))
        (ok0, dv0, *hs0), (ok1, dv1, *hs1) = results
        if ns == 2 and any(k is STORE for b in batches for k, _, _ in b) and any(
                k is LOAD for b in batches for k, _, _ in b):
            continue   # two streams: a flush's stores and loads run at once (by design), no model of their bytes
        assert ok0 == ok1, f"trial {trial}"
        assert all(torch.equal(a, b) for a, b in zip(dv0, dv1)), f"trial {trial}: device rows differ"
        assert all(torch.equal(a, b) for a, b in zip(hs0, hs1)), f"trial {trial}: host bytes differ"


def test_grouping_edge_cases() -> None:
    gpu = FakeGPU()
    gen = torch.Generator().manual_seed(7)
    devs = [torch.randint(0, 256, (8, w), dtype=torch.uint8, generator=gen) for w in (8, 8, 8)]
    slab = torch.zeros((8, 24), dtype=torch.uint8)
    a, b, c = (devs[0], slab[:, 0:8]), (devs[1], slab[:, 8:16]), (devs[2], slab[:, 16:24])
    # a plane listed twice: its host bytes are another plane's too, so no group (plane order kept)
    m = CudaMover([a, b, a], CompletionQueue(), 1, runtime=gpu)
    assert m._groups == [] and m._solo == [0, 1, 2]
    assert len(CudaMover([a, b, c], CompletionQueue(), 1, runtime=gpu)._groups) == 1
    # two slabs at adjacent addresses of one buffer but different storages: no group across them
    buf = torch.zeros(8 * 32, dtype=torch.uint8)
    s1 = torch.frombuffer(memoryview(buf.numpy()).cast("B")[:128], dtype=torch.uint8).view(8, 16)
    s2 = torch.frombuffer(memoryview(buf.numpy()).cast("B")[128:], dtype=torch.uint8).view(8, 16)
    m = CudaMover([(devs[0], s1[:, 8:16]), (devs[1], s2[:, 0:8])], CompletionQueue(), 1, runtime=gpu)
    assert m._groups == []
    # different slot counts: no group
    m = CudaMover([(devs[0], slab[:6, 0:8]), (devs[1], slab[:, 8:16])], CompletionQueue(), 1, runtime=gpu)
    assert m._groups == []
    # a misaligned start: stays bytes; device rows with a row stride above their width and different row counts
    wide = torch.randint(0, 256, (6, 32), dtype=torch.uint8, generator=gen)
    odd = torch.zeros((8, 40), dtype=torch.uint8)
    out = CompletionQueue()
    m = CudaMover([(wide[:, :16], odd[:, 3:19]), (devs[2], odd[:, 19:27])], out, 1, runtime=gpu)
    (g,) = m._groups
    assert g.host.dtype == torch.uint8 and not g.one_range
    keep = odd.clone()
    t = tr(STORE, [5, 0, 5], [1, 2, 2])       # slot 2 twice: the later block lands last
    m.submit(t)
    m.flush()
    assert answers(gpu, m, out)[t.token].ok
    assert torch.equal(odd[1, 3:27], torch.cat([wide[5, :16], devs[2][5]]))
    assert torch.equal(odd[2, 3:27], torch.cat([wide[5, :16], devs[2][5]]))
    assert torch.equal(odd[:, :3], keep[:, :3]) and torch.equal(odd[:, 27:], keep[:, 27:])
    # batched=False and a refused probe: no group
    assert CudaMover([a, b, c], CompletionQueue(), 1, runtime=gpu, batched=False)._groups == []
    gpu2 = FakeGPU()
    gpu2.strided_ok = False
    assert CudaMover([a, b, c], CompletionQueue(), 1, runtime=gpu2)._groups == []
