"""The shared host slab (tiered_kv.integrations.slab): create/attach, geometry checks, rings.

Every slab lives under ``tmp_path`` (nothing needs ``/dev/shm``).  Cross-process
sharing is checked once with a real child process; the other tests attach a
second mapping of the same file in this process, which is the same mechanism
(``MAP_SHARED`` of one file).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.slab import RING_SIZE, SharedSlab, slab_path

REPO = Path(__file__).resolve().parent.parent


def _rand(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


@pytest.fixture
def opened():
    """``open_(path, ...)``: SharedSlab.open that closes every mapping at the end of the test."""
    slabs: list[SharedSlab] = []

    def open_(*a, **kw) -> SharedSlab:
        s = SharedSlab.open(*a, **kw)
        slabs.append(s)
        return s

    yield open_
    for s in slabs:
        s.close()


# --------------------------------------------------------------------------- create / attach
def test_create_then_attach_shares_rows_and_rings(tmp_path, opened):
    p = tmp_path / "x.slab"
    a = opened(p, 4, 64, 2)
    assert a.created is True and p.exists()
    assert (a.num_slots, a.row_bytes, a.world_size, a.rank_bytes, a.ring_size) == (4, 64, 2, 32, RING_SIZE)
    assert a.rows.shape == (4, 64) and a.rows.dtype == torch.uint8
    assert int(a.rows.sum()) == 0 and not a.done(1)   # a new slab is zeroed: no job finished
    data = _rand((4, 64), seed=11)
    a.rows.copy_(data)
    a.mark_done(0, 7)
    a.mark_done(1, 7)

    b = opened(p, 4, 64, 2)
    assert b.created is False
    assert torch.equal(b.rows, data)
    assert b.done(7) and not b.done(8)
    # and the other way round: writes through the second mapping are seen by the first
    b.rows[2].fill_(0xAB)
    b.mark_done(0, 9)
    b.mark_done(1, 9)
    assert torch.equal(a.rows[2], torch.full((64,), 0xAB, dtype=torch.uint8))
    assert a.done(9)
    assert torch.equal(a.rows[[0, 1, 3]], data[[0, 1, 3]])


def test_attach_from_another_process_sees_the_same_memory(tmp_path, opened):
    p = tmp_path / "x.slab"
    a = opened(p, 3, 32, 1)
    a.rows[1].copy_(torch.arange(32, dtype=torch.uint8))
    a.mark_done(0, 5)
    child = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from tiered_kv.integrations.slab import SharedSlab
        s = SharedSlab.open(Path({str(p)!r}), 3, 32, 1)
        assert s.created is False
        assert s.done(5) and not s.done(6)
        assert s.rows[1].tolist() == list(range(32)), s.rows[1].tolist()
        s.rows[2].fill_(0x5A)
        s.mark_done(0, 6)
        s.close()
        print("child-ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x))
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "child-ok" in r.stdout, r.stderr[-3000:]
    assert a.done(6)
    assert torch.equal(a.rows[2], torch.full((32,), 0x5A, dtype=torch.uint8))


@pytest.mark.parametrize("other", [
    dict(num_slots=5, row_bytes=64, world_size=2),     # more slots
    dict(num_slots=4, row_bytes=128, world_size=2),    # wider rows
    dict(num_slots=4, row_bytes=64, world_size=4),     # more ranks
    dict(num_slots=4, row_bytes=64, world_size=2, ring_size=1024),
])
def test_attach_with_other_geometry_raises_naming_both(tmp_path, opened, other):
    p = tmp_path / "x.slab"
    a = opened(p, 4, 64, 2)
    a.rows.fill_(3)
    other = dict(other)   # the parameter's dict is shared by every run of this case (mutmut runs it twice)
    ring = other.pop("ring_size", RING_SIZE)
    with pytest.raises(ConfigError) as ei:
        SharedSlab.open(p, other["num_slots"], other["row_bytes"], other["world_size"], ring_size=ring, timeout=5)
    msg = str(ei.value)
    assert str(p) in msg
    assert str((4, 64, 2, RING_SIZE)) in msg, msg                                   # what the file holds
    assert str((other["num_slots"], other["row_bytes"], other["world_size"], ring)) in msg, msg  # what was asked
    # the existing slab is untouched
    assert torch.equal(a.rows, torch.full((4, 64), 3, dtype=torch.uint8))
    assert opened(p, 4, 64, 2).created is False


@pytest.mark.parametrize("args", [
    (0, 64, 1), (-1, 64, 1), (1.5, 64, 1), (True, 64, 1), ("4", 64, 1), (None, 64, 1),
    (4, 0, 1), (4, -64, 1), (4, 64.0, 1), (4, False, 1),
    (4, 64, 0), (4, 64, -2), (4, 64, True),
    (4, 64, 3),                      # 64 bytes cannot be split over 3 ranks
    (4, 10, 4),
])
def test_bad_arguments_raise_config_error_and_create_nothing(tmp_path, args):
    p = tmp_path / "x.slab"
    with pytest.raises(ConfigError) as ei:
        SharedSlab.open(p, *args)
    assert not p.exists()
    names = ("num_slots", "row_bytes", "world_size")
    assert any(n in str(ei.value) for n in names), str(ei.value)


@pytest.mark.parametrize("ring_size", [0, -1])
def test_bad_ring_size_raises_config_error(tmp_path, ring_size):
    """ring_size is a parameter of open() like the others, but it is not validated: with 0 the
    slab opens and every later mark_done()/done() raises ZeroDivisionError; with -1 a bare
    struct.error escapes open()."""
    p = tmp_path / "x.slab"
    try:
        with pytest.raises(ConfigError, match="ring_size"):
            s = SharedSlab.open(p, 4, 64, 1, ring_size=ring_size)
            s.close()
        assert not p.exists()
    finally:
        if p.exists():
            p.unlink()


def test_attach_to_a_file_never_initialised_times_out_with_config_error(tmp_path):
    p = tmp_path / "x.slab"
    p.write_bytes(b"")  # a creator that died before writing its header
    p.chmod(0o600)      # (as the creator makes it)
    with pytest.raises(ConfigError, match="not initialised"):
        SharedSlab.open(p, 4, 64, 1, timeout=0.05)
    p.write_bytes(b"NOTASLAB" + bytes(4096))  # some other file at that name
    with pytest.raises(ConfigError, match="not initialised"):
        SharedSlab.open(p, 4, 64, 1, timeout=0.05)


@pytest.mark.parametrize("how", ["mode", "owner", "link", "directory"])
def test_a_slab_file_this_user_did_not_make_alone_is_never_attached(tmp_path, opened, how):
    """Review round 26 (suspected, shown here): ``/dev/shm`` is writable by every local user, and a slab's rows
    are the engine's KV, loaded with no checksum.  A file under the engine's slab name that another user owns,
    that other users may read or write, or that is a link or a directory, is refused with a ConfigError naming
    it -- before it is mapped -- and left as it is."""
    real = tmp_path / "real.slab"
    opened(real, 4, 64, 1).close()   # a genuine slab's file, header and all
    p = tmp_path / "x.slab"
    if how == "link":
        p.symlink_to(real)
    elif how == "directory":
        p.mkdir()
    else:
        p.write_bytes(real.read_bytes())
        p.chmod(0o666 if how == "mode" else 0o600)
        if how == "owner":
            if os.geteuid() != 0:
                pytest.skip("giving a file to another user needs root")
            os.chown(p, 65534, 65534)
    before = os.lstat(p)
    with pytest.raises(ConfigError, match=r"x\.slab") as e:
        SharedSlab.open(p, 4, 64, 1, timeout=0.05)
    assert {"mode": "0666", "owner": "uid 65534", "link": "attach", "directory": "attach"}[how] in str(e.value)
    after = os.lstat(p)
    assert (after.st_ino, after.st_mode, after.st_uid) == (before.st_ino, before.st_mode, before.st_uid)


def _creator_mid_initialisation(path: Path, num_slots: int, row_bytes: int, world: int) -> int:
    """What a creator has done just before it writes its header: the file exists, sized, headerless."""
    from tiered_kv.integrations import slab as slab_mod
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, SharedSlab.total_bytes(num_slots, row_bytes, world))
    assert slab_mod.MAGIC  # the header is written last, below, by the test
    return fd


def _attacher_waiting(monkeypatch, path: Path, geometry: tuple[int, int, int], timeout: float = 30):
    """Start SharedSlab.open(path) on a thread; return (thread, result box) once it waits for a header."""
    from tiered_kv.integrations import slab as slab_mod
    waiting = threading.Event()
    real_sleep = slab_mod.time.sleep

    def sleep(s: float) -> None:  # the attacher's start-up wait loop: signal the first time it waits
        waiting.set()
        real_sleep(s)

    monkeypatch.setattr(slab_mod.time, "sleep", sleep)
    box: dict = {}

    def attach() -> None:
        try:
            box["slab"] = SharedSlab.open(path, *geometry, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=attach)
    t.start()
    assert waiting.wait(30), "the attacher never waited for the header"
    return t, box


def test_attacher_waits_for_a_creator_mid_initialisation_then_shares_its_memory(tmp_path, monkeypatch):
    """Forced interleaving: the creator has made and sized the file but not written its header when
    another process attaches; the attacher waits, and once the header lands both map the same bytes."""
    from tiered_kv.integrations import slab as slab_mod
    p, geometry = tmp_path / "x.slab", (4, 64, 2)
    fd = _creator_mid_initialisation(p, *geometry)
    t, box = _attacher_waiting(monkeypatch, p, geometry)
    os.pwrite(fd, slab_mod._HEADER.pack(slab_mod.MAGIC, slab_mod.VERSION, 4, 64, 2, RING_SIZE), 0)
    os.close(fd)
    t.join(30)
    assert "error" not in box, box.get("error")
    attached = box["slab"]
    creator = SharedSlab.open(p, *geometry)       # a third mapping, attaching normally
    try:
        assert not attached.created and not creator.created
        attached.rows[3].copy_(_rand((64,), 7))
        attached.mark_done(1, 5)
        assert torch.equal(creator.rows[3], attached.rows[3])
        assert not creator.done(5)                # rank 0 has not marked it
        attached.mark_done(0, 5)
        assert creator.done(5) and creator.ok(5)
    finally:
        attached.close()
        creator.close()


def test_attacher_gives_up_when_the_creator_dies_mid_initialisation(tmp_path, monkeypatch):
    """Forced interleaving: the creator removes its half-made file (its start failed) while another
    process waits for the header: the waiter raises ConfigError instead of waiting out its timeout."""
    p, geometry = tmp_path / "x.slab", (4, 64, 1)
    fd = _creator_mid_initialisation(p, *geometry)
    # an hour-long timeout: only noticing the removed file can end the wait within the join below
    t, box = _attacher_waiting(monkeypatch, p, geometry, timeout=3600)
    os.unlink(p)
    os.close(fd)
    t.join(30)
    assert not t.is_alive()
    assert isinstance(box.get("error"), ConfigError), box
    assert "not initialised" in str(box["error"])


def test_layout_is_page_aligned_and_sized(tmp_path, opened):
    s = opened(tmp_path / "x.slab", 3, 100, 2, ring_size=16)
    assert s.row_address(0) % mmap.PAGESIZE == 0
    assert s.row_address(2) - s.row_address(0) == 200
    assert s.rows.data_ptr() == s.row_address(0)
    total = SharedSlab.total_bytes(3, 100, 2, ring_size=16)
    assert os.path.getsize(tmp_path / "x.slab") == total
    assert total == mmap.PAGESIZE * 2 + 300  # header page + one page of rings (2 x 16 x 8 bytes) + rows


def test_slab_path_sanitises_engine_id(tmp_path):
    assert slab_path("engine-1_a.b", str(tmp_path)) == tmp_path / "tiered_kv_engine-1_a.b.slab"
    odd = slab_path("../x y/z", str(tmp_path))
    assert odd.parent == tmp_path and odd.name.startswith("tiered_kv_.._x_y_z-") and odd.suffix == ".slab"


def test_engines_with_different_ids_never_share_a_slab(tmp_path):
    """Review round 26 (suspected, shown here): ``e:1``, ``e/1``, ``e 1`` and ``e_1`` were all the file of
    ``e_1``: a second engine attached to the first one's live slab and took over its rows.  Each id has its
    own file now; an id too long for a file name is cut and kept apart by its digest."""
    ids = ["e_1", "e:1", "e/1", "e 1", "é1", "e\udcff1", "x" * 300, "x" * 300 + "y"]
    paths = [slab_path(i, str(tmp_path)) for i in ids]
    assert len(set(paths)) == len(ids)
    assert all(p.parent == tmp_path and len(p.name) < 255 for p in paths)
    assert paths[0].name == "tiered_kv_e_1.slab"   # an id that is already a file name keeps it
    assert slab_path("e:1", str(tmp_path)) == paths[1]   # the same id, the same file, in every process


# --------------------------------------------------------------------------- rings
def test_done_needs_every_rank(tmp_path, opened):
    s = opened(tmp_path / "x.slab", 2, 64, 2)
    for seq in (1, 2, 3):
        assert not s.done(seq)
    s.mark_done(0, 2)
    assert not s.done(2)            # rank 1 has not finished job 2
    s.mark_done(1, 3)
    assert not s.done(3)            # rank 0 has not finished job 3
    s.mark_done(1, 2)
    assert s.done(2) and not s.done(3) and not s.done(1)
    s.mark_done(0, 3)
    assert s.done(3)
    assert not s.done(1)            # never marked: out-of-order finishing does not imply earlier jobs


def test_done_across_ring_wraparound(tmp_path, opened):
    s = opened(tmp_path / "x.slab", 2, 32, 2, ring_size=8)
    s.mark_done(0, 3)
    s.mark_done(1, 3)
    assert s.done(3)
    assert not s.done(11)           # same ring entry, a later job: not finished yet
    s.mark_done(0, 11)
    assert not s.done(11) and s.done(3)   # rank 1 still shows 3 there
    s.mark_done(1, 11)
    assert s.done(11)
    assert s.done(3)                # a job ring_size numbers later finished there: counts as finished
    assert not s.done(19)


def test_ranks_own_disjoint_parts_of_a_row(tmp_path, opened):
    s = opened(tmp_path / "x.slab", 2, 64, 4)
    assert s.rank_bytes == 16
    for r in range(4):
        s.rows[1, r * s.rank_bytes:(r + 1) * s.rank_bytes].fill_(r + 1)
    assert s.rows[1].tolist() == [1] * 16 + [2] * 16 + [3] * 16 + [4] * 16
    assert int(s.rows[0].sum()) == 0


# --------------------------------------------------------------------------- unlink / close
def test_unlink_is_idempotent_and_memory_outlives_the_name(tmp_path, opened):
    p = tmp_path / "x.slab"
    a = opened(p, 2, 32, 1)
    b = opened(p, 2, 32, 1)
    a.rows[0].fill_(9)
    a.unlink()
    assert not p.exists() and a.unlinked
    a.unlink()                          # again: no error
    b.unlink()                          # the other mapping: the name is already gone, no error
    assert b.unlinked
    # both mappings still share the memory
    b.rows[1].fill_(4)
    assert int(a.rows[1, 0]) == 4 and int(b.rows[0, 0]) == 9
    a.mark_done(0, 1)
    assert b.done(1)
    # the name can be taken by a new, separate slab
    c = opened(p, 2, 32, 1)
    assert c.created is True and int(c.rows.sum()) == 0 and not c.done(1)


def test_unlink_after_file_removed_elsewhere(tmp_path, opened):
    p = tmp_path / "x.slab"
    a = opened(p, 1, 8, 1)
    os.unlink(p)
    a.unlink()
    a.unlink()
    assert a.unlinked


def test_close_is_idempotent_and_drops_rows(tmp_path):
    p = tmp_path / "x.slab"
    s = SharedSlab.open(p, 2, 16, 1)
    s.rows[0].fill_(1)
    s.close()
    s.close()
    assert s.rows.numel() == 0
    t = SharedSlab.open(p, 2, 16, 1)   # the file (and its bytes) stay until unlinked
    try:
        assert t.created is False and int(t.rows[0, 0]) == 1
    finally:
        t.unlink()
        t.close()
    assert not p.exists()
