"""Review of "native mover: the launch hands over lists, not tensors the owner made": edge cases of the
launched copy and the owner's inline copy that tests/test_native_mover.py does not reach.

* the owner's inline copy (``help_one`` under ``hold``: ``self._run(self._planes_now, ...)``) over two planes of
  different element widths, stores and loads in one flush, scattered and run indexes: the same bytes as a launch;
* a flush one direction of which the screen answers whole (no group), the other copied: ``to_host`` stays
  aligned with the groups that are copied, in the launched and the inline path;
* several movers alive at once, one closed and another made: each launch copies its own mover's planes;
* a plane whose rows are wider than the staging buffer (``_stage_rows`` 0: one ``copy_`` per row) beside a
  staged one, scattered both sides, stores and loads in one launch.
"""

from __future__ import annotations

from typing import Any

import torch

from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, NativeMover, Transfer
from tiered_kv.movers.thread import STAGE_BYTES

from test_native_mover import _answers, _rows   # the mover tests' helpers, shared

_STORE, _LOAD = JobKind.STORE, JobKind.LOAD


def _expect(devs: list[torch.Tensor], slab: torch.Tensor, widths: list[int],
            ts: list[Transfer]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The planes after ``ts`` (stores first, then loads, as a flush runs them), computed row by row."""
    devs, slab = [d.clone() for d in devs], slab.clone()
    for kind in (_STORE, _LOAD):
        for t in ts:
            if t.kind is not kind or t.cancelled:
                continue
            for r, s in zip(t.rows, t.slots):
                o = 0
                for w, d in zip(widths, devs):
                    if kind is _STORE:
                        slab[s, o:o + w] = d[r]
                    else:
                        d[r] = slab[s, o:o + w]
                    o += w
    return devs, slab


def _two_planes(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A 48-byte plane (16-byte view) and a 24-byte one (8-byte view) over one slab with 8 bytes of padding."""
    devs = [_rows(12, 48, seed), _rows(12, 24, seed + 1)]
    slab = _rows(12, 80, seed + 2)
    return devs, slab, [(devs[0], slab[:, :48]), (devs[1], slab[:, 48:72])]


_MIXED = [   # stores and loads of one flush, sources never a destination of the same flush
    Transfer("s-scattered", _STORE, [7, 1, 4], [9, 2, 5]),
    Transfer("s-run", _STORE, [8, 9], [10, 11]),          # concatenated with the first: neither side a run
    Transfer("l-dst-run", _LOAD, [2, 3, 4], [6, 0, 3]),
    Transfer("l-src-run", _LOAD, [11, 5], [7, 8]),
]


def test_the_owners_inline_copy_lands_the_same_bytes_as_a_launch():
    """hold(True) + help_one: the owner copies what it holds itself (no launch), over its own planes
    (``_planes_now``, device then host), stores into slots and loads into rows, on two planes of 16- and
    8-byte elements, staged two rows a pass.  The launched copy of the same flush lands the same bytes."""
    launched: list[Any] = []
    results = []
    for inline in (True, False):
        devs, slab, planes = _two_planes(31)
        want_devs, want_slab = _expect(devs, slab, [48, 24], _MIXED)
        q = CompletionQueue()
        m = NativeMover(planes, q, batch_max=64)
        real = m._launch

        def spy(*args: Any) -> Any:
            launched.append(inline)
            return real(*args)

        m._launch = spy
        m._stage_rows = [2, 2]
        try:
            if inline:
                m.hold(True)
            for t in _MIXED:
                m.submit(Transfer(t.token, t.kind, list(t.rows), list(t.slots)))
            if inline:
                assert m.help_one() is True     # copied here, at once: 10 rows of 72 bytes, under HELP_BYTES
                reps = q.drain()
            else:
                m.flush()
                reps = _answers(m, q, len(_MIXED))
            assert sorted(r.token for r in reps) == sorted(t.token for t in _MIXED)
            assert all(r.ok for r in reps), reps
            assert torch.equal(slab, want_slab), f"inline={inline}: host slots"
            assert all(torch.equal(d, w) for d, w in zip(devs, want_devs)), f"inline={inline}: device rows"
            results.append((slab.clone(), [d.clone() for d in devs]))
        finally:
            m.hold(False)
            m.close()
    assert launched == [False], "the inline copy launched, or the launch did not"
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_a_direction_the_screen_answers_whole_leaves_the_other_copied_the_right_way():
    """A flush whose stores are all cancelled or out of range (no store group) and whose loads go, and the
    other way round: the one group copied keeps its own direction (``to_host`` holds one entry per group
    copied, not per group screened), launched and copied inline."""
    for inline in (False, True):
        for dead in (_STORE, _LOAD):
            devs, slab, planes = _two_planes(41)
            ts = [
                Transfer("s-cancelled", _STORE, [0, 1], [0, 1], cancelled=True),
                Transfer("s-out", _STORE, [2], [99]),
                Transfer("l-a", _LOAD, [6, 3], [4, 9]),
                Transfer("l-b", _LOAD, [7], [10]),
            ] if dead is _STORE else [
                Transfer("l-cancelled", _LOAD, [0, 1], [0, 1], cancelled=True),
                Transfer("l-out", _LOAD, [99], [2]),
                Transfer("s-a", _STORE, [6, 3], [4, 9]),
                Transfer("s-b", _STORE, [7], [10]),
            ]
            want_devs, want_slab = _expect(devs, slab, [48, 24], [t for t in ts if max(t.rows + t.slots) < 12])
            q = CompletionQueue()
            m = NativeMover(planes, q, batch_max=64)
            try:
                if inline:
                    m.hold(True)
                for t in ts:
                    m.submit(t)
                if inline:
                    assert m.help_one() is True
                    reps = {r.token: r for r in q.drain()}
                else:
                    m.flush()
                    reps = {r.token: r for r in _answers(m, q, len(ts))}
                assert set(reps) == {t.token for t in ts}
                assert [t.token for t in ts if reps[t.token].ok] == [t.token for t in ts[2:]]
                where = f"inline={inline}, screened={dead.value}"
                assert torch.equal(slab, want_slab), where
                assert all(torch.equal(d, w) for d, w in zip(devs, want_devs)), where
            finally:
                m.hold(False)
                m.close()


def test_movers_alive_at_once_and_one_made_after_a_close_each_copy_their_own_planes():
    """Each mover's launches copy between its own planes (the future it made at start), whatever other
    movers -- of other element widths and plane counts -- were made, launched or closed in the process."""
    a_dev, a_host = _rows(8, 32, 51), torch.zeros((8, 32), dtype=torch.uint8)        # 16-byte view
    b_devs, b_slab, b_planes = _two_planes(52)                                         # 16- and 8-byte views
    qa, qb = CompletionQueue(), CompletionQueue()
    a = NativeMover([(a_dev, a_host)], qa, batch_max=64)
    b = NativeMover(b_planes, qb, batch_max=64)
    try:
        b_before = [d.clone() for d in b_devs], b_slab.clone()
        a.submit(Transfer("a1", _STORE, [5, 0, 3], [1, 6, 2]))
        a.flush()
        want_devs, want_slab = _expect(b_devs, b_slab, [48, 24], _MIXED)
        for t in _MIXED:
            b.submit(Transfer(t.token, t.kind, list(t.rows), list(t.slots)))
        b.flush()
        assert all(r.ok for r in _answers(a, qa, 1)) and all(r.ok for r in _answers(b, qb, len(_MIXED)))
        assert torch.equal(a_host[[1, 6, 2]], a_dev[[5, 0, 3]])
        assert not a_host[[0, 3, 4, 5, 7]].any(), "mover a's slots written by another mover"
        assert torch.equal(b_slab, want_slab) and all(torch.equal(d, w) for d, w in zip(b_devs, want_devs))
        assert not torch.equal(b_slab, b_before[1])
    finally:
        a.close()
    # a closed; c made on fresh planes of an 8-byte view only; b still copies its own
    c_dev, c_host = _rows(6, 40, 53), torch.zeros((6, 40), dtype=torch.uint8)
    qc = CompletionQueue()
    c = NativeMover([(c_dev, c_host)], qc, batch_max=64)
    try:
        a_host_then = a_host.clone()
        c.submit(Transfer("c1", _STORE, [4, 2], [0, 5]))
        c.submit(Transfer("c2", _LOAD, [1], [0]))          # the slot the store just filled
        b.submit(Transfer("b9", _STORE, [10, 0], [1, 4]))
        c.flush()
        b.flush()
        assert all(r.ok for r in _answers(c, qc, 2)) and all(r.ok for r in _answers(b, qb, 1))
        assert torch.equal(c_host[[0, 5]], c_dev[[4, 2]]) and torch.equal(c_dev[1], c_dev[4])
        assert not c_host[[1, 2, 3, 4]].any()
        assert torch.equal(b_slab[[1, 4], :48], b_devs[0][[10, 0]])
        assert torch.equal(b_slab[[1, 4], 48:72], b_devs[1][[10, 0]])
        assert torch.equal(a_host, a_host_then), "a closed mover's planes written"
    finally:
        c.close()
        b.close()


def test_a_plane_wider_than_the_stage_is_copied_row_by_row_beside_a_staged_one():
    """Rows wider than STAGE_BYTES (``_stage_rows`` 0: one ``copy_`` per row, indexes read one by one in the
    inter-op thread) beside a narrow plane staged in passes; scattered on both sides, stores and loads in
    one launch."""
    wide = STAGE_BYTES + 16
    devs = [_rows(5, wide, 61), _rows(5, 16, 62)]
    hosts = [_rows(5, wide, 63), _rows(5, 16, 64)]
    q = CompletionQueue()
    m = NativeMover(list(zip(devs, hosts)), q, batch_max=64)
    try:
        assert m._stage_rows[0] == 0 and m._stage_rows[1] > 0
        m._stage_rows = [0, 1]          # the narrow plane: one row a pass, so it takes several
        before = [d.clone() for d in devs], [h.clone() for h in hosts]
        m.submit(Transfer("s", _STORE, [4, 0, 2], [1, 3, 0]))
        m.submit(Transfer("l", _LOAD, [3, 1], [4, 2]))
        m.flush()
        assert m.batches == 1
        assert all(r.ok for r in _answers(m, q, 2))
        for p in range(2):
            d0, h0 = before[0][p], before[1][p]
            assert torch.equal(hosts[p][[1, 3, 0]], d0[[4, 0, 2]]), f"plane {p}: stored slots"
            assert torch.equal(devs[p][[3, 1]], h0[[4, 2]]), f"plane {p}: loaded rows"
            assert torch.equal(hosts[p][[2, 4]], h0[[2, 4]]) and torch.equal(devs[p][[0, 2, 4]], d0[[0, 2, 4]])
    finally:
        m.close()
