"""``tiered-kv export`` / ``import``: a portable archive that pre-warms another node, all or nothing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from test_ops_common import (NS, ROW, Template, build_env, cli, content, keys, live_writer, load_bytes,
                             not_lmdb_dir, open_manager, raw, raw_all, raw_put, set_meta, snapshot, stored_keys,
                             token_of)
from tiered_kv.tools.archive import FRAME_OVERHEAD, _FILE_HDR, pack_frame, read_header
from tiered_kv.disk.format import FORMAT_VERSION, HEADER_SIZE, lmdb_key

__all__ = ["live_writer"]

N = 8


@pytest.fixture(scope="module")
def tpl(tmp_path_factory):
    return Template(tmp_path_factory, keys(N))


@pytest.fixture(scope="module")
def archive(tpl, tmp_path_factory):
    """An export of the template (built once; tests copy it before damaging it)."""
    out = tmp_path_factory.mktemp("arch") / "a.tkv"
    from tiered_kv.tools.archive import export_archive
    rep = export_archive(tpl.src, NS, out)
    assert rep.frames == N
    return out


def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def _frame_offsets(data: bytes) -> list[int]:
    """Byte offset of every frame of an archive."""
    _m, _v, _f, _fl, _bb, _cr, ns_len, info_len = _FILE_HDR.unpack_from(data, 0)
    off = _FILE_HDR.size + ns_len + info_len + 8
    offs = []
    while data[off:off + 4] == b"TKVF":
        offs.append(off)
        (length,) = struct.unpack_from("<I", data, off + 12)
        off += FRAME_OVERHEAD + length
    return offs


# ============================================================================ happy paths
def test_an_import_into_new_directories_syncs_each_one_and_its_parent(archive, tmp_path, monkeypatch):
    """LMDB's commit syncs data.mdb, not the directory entries naming it and the directories the import
    made: a crash after ``import`` reported success could lose the whole new tier.  Each directory from
    the tier's up to the first that existed before is synced after the import."""
    from tiered_kv.disk import lock
    from tiered_kv.tools import archive as archive_mod
    synced: list[Path] = []
    real = lock.fsync_path

    def spy(p: Path, directory: bool = False) -> None:
        if directory:
            synced.append(Path(p))
        real(p, directory)

    monkeypatch.setattr(lock, "fsync_path", spy)
    dst = tmp_path / "a" / "b" / "tier"
    rep = archive_mod.import_archive(dst, archive)
    assert rep.imported == N
    assert synced == [dst.absolute(), (tmp_path / "a" / "b").absolute(), (tmp_path / "a").absolute(),
                      tmp_path.absolute()]
    synced.clear()
    archive_mod.import_archive(dst, archive)   # nothing new: no directory to sync
    assert synced == []


def test_export_import_end_to_end_serves_the_same_bytes(tpl, tmp_path, capsys):
    src = tpl.copy(tmp_path / "src")
    out = tmp_path / "warm.tkv"
    rc, o, err = cli(capsys, "export", str(src), "--namespace", NS, str(out))
    assert rc == 0, err
    assert f"exported {N} entries" in o and out.is_file()
    assert not list(tmp_path.glob("warm.tkv.partial-*"))
    dst = tmp_path / "fresh" / "node2"                       # does not exist yet
    rc, o, err = cli(capsys, "import", str(dst), str(out))
    assert rc == 0, err
    assert f"imported {N} of {N} entries" in o and "(created)" in o
    assert "verify" in err and "import" in err               # progress bars
    meta = raw(dst, "meta")
    assert meta[b"namespace"] == NS.encode() and meta[b"block_bytes"] == str(ROW).encode()
    assert meta[b"format_version"] == str(FORMAT_VERSION).encode()
    assert raw(dst) == raw(src)                              # the stored values travelled as is
    mgr, kv = open_manager(dst)                              # a TierManager opens it and serves the blocks
    try:
        assert mgr.lookup(tpl.keys) == N
        for k in tpl.keys:
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


def test_importing_twice_changes_nothing(archive, tmp_path, capsys):
    dst = tmp_path / "dst"
    rc, _, err = cli(capsys, "import", str(dst), str(archive))
    assert rc == 0, err
    before = snapshot(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(archive), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["imported"] == 0 and rep["already_present"] == N and rep["created"] is False
    assert snapshot(dst) == before


def test_import_into_a_tier_with_entries_keeps_local_ones(archive, tpl, tmp_path, capsys):
    dst = build_env(tmp_path / "dst", tpl.keys[:3] + keys(2, "local"))    # same keys, other writer tokens
    local = raw(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(archive), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["kept_existing"] == 3 and rep["imported"] == N - 3
    after = raw(dst)
    assert all(after[k] == v for k, v in local.items())     # local entries untouched
    assert stored_keys(dst) == set(tpl.keys) | set(keys(2, "local"))
    mgr, kv = open_manager(dst)
    try:
        for k in tpl.keys + keys(2, "local"):
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


def test_import_into_an_empty_directory_and_skips_tombstoned_tokens(archive, tpl, tmp_path, capsys):
    dst = tmp_path / "empty"
    dst.mkdir()
    rc, _, err = cli(capsys, "import", str(dst), str(archive))
    assert rc == 0, err
    assert stored_keys(dst) == set(tpl.keys)
    # a tombstone for one archived writer in the destination: that frame is skipped
    dst2 = tmp_path / "dst2"
    rc, _, _ = cli(capsys, "import", str(dst2), str(archive))
    tok = token_of(dst2, tpl.keys[4])
    raw_put(dst2, "blocks", lmdb_key(tpl.keys[4]), None)
    raw_put(dst2, "tombs", tok.bytes, tpl.keys[4])
    rc, out, _ = cli(capsys, "import", str(dst2), str(archive), "--json")
    assert rc == 0 and json.loads(out)["skipped_tombstoned"] == 1
    assert tpl.keys[4] not in stored_keys(dst2)


def test_export_skips_corrupt_and_orphaned_entries(tpl, tmp_path, capsys):
    src = tpl.copy(tmp_path / "src")
    v = bytearray(raw(src)[lmdb_key(tpl.keys[0])])
    v[-1] ^= 1
    raw_put(src, "blocks", lmdb_key(tpl.keys[0]), bytes(v))
    raw_put(src, "tombs", token_of(src, tpl.keys[1]).bytes, tpl.keys[1])
    out = tmp_path / "a.tkv"
    rc, o, err = cli(capsys, "export", str(src), "--namespace", NS, str(out), "--json")
    assert rc == 0, err
    rep = json.loads(o)
    assert rep["frames"] == N - 2 and rep["skipped_corrupt"] == 1 and rep["skipped_orphaned"] == 1
    dst = tmp_path / "dst"
    assert cli(capsys, "import", str(dst), str(out))[0] == 0
    assert stored_keys(dst) == set(tpl.keys[2:])


def test_export_beside_a_live_writer_in_another_process(live_writer, tmp_path, capsys):
    out = tmp_path / "live.tkv"
    rc, o, err = cli(capsys, "export", str(live_writer.path), "--namespace", NS, str(out), "--json")
    assert rc == 0, err
    n = json.loads(o)["frames"]
    assert n >= 8
    dst = tmp_path / "dst"
    rc, o, err = cli(capsys, "import", str(dst), str(out), "--json")
    assert rc == 0, err
    assert json.loads(o)["imported"] == n
    rc, _, _ = cli(capsys, "import", str(live_writer.path), str(out))      # but import needs the path
    assert rc == 3


def test_force_namespace_rewrites_headers_and_the_other_namespace_is_served(archive, tpl, tmp_path, capsys):
    dst = build_env(tmp_path / "dst", keys(1, "own"), namespace="other-model|u8|tp0")
    before = snapshot(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(archive))
    assert rc == 2 and "namespace 'other-model|u8|tp0'" in err and "--force-namespace" in err, err
    assert snapshot(dst) == before
    rc, out, err = cli(capsys, "import", str(dst), str(archive), "--force-namespace", "--json")
    assert rc == 0, err
    assert json.loads(out)["namespace_rewritten"] is True
    mgr, kv = open_manager(dst, namespace="other-model|u8|tp0")
    try:
        for k in tpl.keys:
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


# ============================================================================ refusals: nothing changes
def test_import_is_refused_while_a_tiermanager_holds_the_path(archive, tpl, tmp_path, capsys):
    dst = tpl.copy(tmp_path / "dst")
    mgr, _kv = open_manager(dst)
    try:
        before = snapshot(dst)
        rc, out, err = cli(capsys, "import", str(dst), str(archive))
        assert rc == 3 and "in use by a TierManager" in err and "nothing was changed" in err, err
        assert snapshot(dst) == before
    finally:
        mgr.close()


def _truncate_cases(data: bytes) -> dict[str, tuple[bytes, str]]:
    offs = _frame_offsets(data)
    return {
        "inside-header": (data[:20], "truncated inside the file header"),
        "inside-frame-3": (data[:offs[3] + FRAME_OVERHEAD + 100], "truncated inside frame 3"),
        "before-trailer": (data[:len(data) - 36], f"truncated at frame {N}"),
        "inside-trailer": (data[:len(data) - 5], "truncated inside the trailer"),
    }


@pytest.mark.parametrize("case", ["inside-header", "inside-frame-3", "before-trailer", "inside-trailer"])
@pytest.mark.parametrize("into", ["new", "existing"])
def test_truncated_archive_publishes_nothing(case, into, archive, tpl, tmp_path, capsys):
    bad, msg = _truncate_cases(archive.read_bytes())[case]
    arch = tmp_path / "bad.tkv"
    arch.write_bytes(bad)
    dst = tmp_path / "dst" if into == "new" else build_env(tmp_path / "dst", keys(2, "own"))
    before = snapshot(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(arch))
    assert rc == 2, (out, err)
    assert msg in err, err
    assert snapshot(dst) == before


@pytest.mark.parametrize("damage", ["frame-payload", "frame-length", "entry-inside-frame", "swapped-frames",
                                    "trailer-count", "trailing-garbage", "bad-magic"])
def test_corrupt_archive_publishes_nothing_and_names_the_frame(damage, archive, tpl, tmp_path, capsys):
    data = bytearray(archive.read_bytes())
    offs = _frame_offsets(bytes(data))
    if damage == "frame-payload":
        data[offs[3] + FRAME_OVERHEAD + HEADER_SIZE + 50] ^= 0x40
        msg = "frame 3 (offset %d) is corrupt: frame checksum mismatch" % offs[3]
    elif damage == "frame-length":
        struct.pack_into("<I", data, offs[5] + 12, 1 << 30)
        msg = "frame 5 (offset %d) is corrupt: length" % offs[5]
    elif damage == "entry-inside-frame":      # a well-framed frame whose entry is bad: the entry checksum catches it
        end = offs[4]
        (length,) = struct.unpack_from("<I", data, offs[2] + 12)
        value = bytearray(data[offs[2] + FRAME_OVERHEAD:offs[2] + FRAME_OVERHEAD + length])
        value[-3] ^= 1
        data[offs[2]:offs[3]] = pack_frame(2, bytes(value))
        assert offs[4] == end
        msg = "frame 2 (offset %d): its entry fails verification (checksum" % offs[2]
    elif damage == "swapped-frames":
        a, b, c = bytes(data[offs[1]:offs[2]]), bytes(data[offs[2]:offs[3]]), offs[3]
        data[offs[1]:c] = b + a
        msg = "frame 1 (offset %d) is out of order: it says index 2" % offs[1]
    elif damage == "trailer-count":
        data[-36 + 4] ^= 1
        msg = "trailer checksum mismatch"
    elif damage == "trailing-garbage":
        data += b"\0" * 10
        msg = "unexpected bytes after the trailer"
    else:
        data[offs[6]:offs[6] + 4] = b"XXXX"
        msg = "frame 6 (offset %d) is corrupt: bad frame magic" % offs[6]
    arch = tmp_path / "bad.tkv"
    arch.write_bytes(bytes(data))
    dst = build_env(tmp_path / "dst", keys(2, "own"))
    before = raw_all(dst)
    snap = snapshot(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(arch))
    assert rc == 2, (out, err)
    assert msg in err, err
    assert "Traceback" not in err
    assert snapshot(dst) == snap and raw_all(dst) == before   # not even the good frames before it


def test_archive_of_another_block_size_is_refused_even_with_force(archive, tmp_path, capsys):
    dst = build_env(tmp_path / "dst", keys(1, "own"), row=ROW // 2)
    before = snapshot(dst)
    for extra in ([], ["--force-namespace"]):
        rc, out, err = cli(capsys, "import", str(dst), str(archive), *extra)
        assert rc == 2 and "blocks of 2048 bytes, the archive 4096" in err, err
    assert snapshot(dst) == before


def test_archive_of_another_entry_format_is_refused(archive, tmp_path, capsys):
    data = bytearray(archive.read_bytes())
    struct.pack_into("<H", data, 10, 9)                       # entry_format
    import xxhash
    _m, _v, _f, _fl, _bb, _cr, ns_len, info_len = _FILE_HDR.unpack_from(data, 0)
    hend = _FILE_HDR.size + ns_len + info_len
    struct.pack_into("<Q", data, hend, xxhash.xxh3_64_intdigest(bytes(data[:hend])))
    arch = tmp_path / "v9.tkv"
    arch.write_bytes(bytes(data))
    dst = tmp_path / "dst"
    rc, out, err = cli(capsys, "import", str(dst), str(arch))
    assert rc == 2 and "format version 9" in err, err
    assert not dst.exists()


@pytest.mark.parametrize("kind", ["missing-archive", "not-an-archive", "not-lmdb-path", "path-is-a-file",
                                  "wrong-format-path"])
def test_import_bad_input(kind, archive, tpl, tmp_path, capsys):
    arch, dst = archive, tmp_path / "dst"
    if kind == "missing-archive":
        arch, msg = tmp_path / "nope.tkv", "does not exist"
    elif kind == "not-an-archive":
        arch, msg = tmp_path / "x.tkv", "not a tiered_kv archive"
        arch.write_bytes(b"hello world" * 10)
    elif kind == "not-lmdb-path":
        dst, msg = not_lmdb_dir(tmp_path), "is not an LMDB environment and is not empty"
    elif kind == "path-is-a-file":
        dst, msg = tmp_path / "f", "is not a directory"
        dst.write_bytes(b"x")
    else:
        dst, msg = tpl.copy(tmp_path / "dst"), "format version '1'"
        set_meta(dst, b"format_version", b"1")
    before = snapshot(dst)
    rc, out, err = cli(capsys, "import", str(dst), str(arch))
    assert rc == 2, (out, err)
    assert err.startswith("tiered-kv import: error: ") and msg in err, err
    assert snapshot(dst) == before


@pytest.mark.parametrize("kind", ["wrong-namespace", "out-exists", "missing-path", "not-lmdb", "wrong-format"])
def test_export_bad_input(kind, tpl, tmp_path, capsys):
    src, ns, out = tpl.copy(tmp_path / "src"), NS, tmp_path / "out.tkv"
    if kind == "wrong-namespace":
        ns, msg = "someone-else", f"holds namespace '{NS}', not 'someone-else'"
    elif kind == "out-exists":
        out.write_bytes(b"keep me")
        msg = "already exists"
    elif kind == "missing-path":
        src, msg = tmp_path / "nope", "does not exist"
    elif kind == "not-lmdb":
        src, msg = not_lmdb_dir(tmp_path), "not an LMDB environment"
    else:
        set_meta(src, b"format_version", b"1")
        msg = "format version '1'"
    before, before_out = snapshot(src), snapshot(out)
    rc, o, err = cli(capsys, "export", str(src), "--namespace", ns, str(out))
    assert rc == 2, (o, err)
    assert msg in err, err
    assert snapshot(src) == before and snapshot(out) == before_out
    assert not list(tmp_path.glob("out.tkv.partial-*"))


def test_archive_header_records_what_import_checks(archive):
    import asyncio
    hdr = asyncio.run(read_header(archive))
    assert hdr.namespace == NS.encode() and hdr.block_bytes == ROW and hdr.entry_format == FORMAT_VERSION and hdr.version == 1
    assert hdr.info["tiered_kv"] and hdr.created > 0


def test_import_grows_a_full_map_and_still_commits_once(archive, tpl, tmp_path, monkeypatch):
    import contextlib

    import tiered_kv.tools.archive as A
    real = A.open_writable

    @contextlib.contextmanager
    def tiny_map(p, extra_bytes=0, create=False, durability="sync"):
        with real(p, extra_bytes=0, create=create) as oe:
            oe.env.set_mapsize(64 << 10)          # far too small for the archive: MapFullError, grow, retry
            yield oe

    grown = []
    real_grow = A.grow_map
    monkeypatch.setattr(A, "open_writable", tiny_map)
    monkeypatch.setattr(A, "grow_map", lambda oe, need: grown.append(need) or real_grow(oe, need))
    rep = A.import_archive(tmp_path / "dst", archive)
    assert grown and rep.imported == N
    assert stored_keys(tmp_path / "dst") == set(tpl.keys)


def test_a_failed_write_pass_into_a_new_path_leaves_no_directory(archive, tmp_path, monkeypatch, capsys):
    import tiered_kv.tools.archive as A

    async def boom(*a, **kw):
        raise A.ArchiveError("the archive changed while it was imported; nothing was imported")

    monkeypatch.setattr(A, "_import_pass", boom)
    dst = tmp_path / "a" / "b"
    rc, out, err = cli(capsys, "import", str(dst), str(archive))
    assert rc == 2 and "changed while it was imported" in err
    assert not (tmp_path / "a").exists()


def test_small_io_chunks_stream_the_same_archive(tpl, archive, tmp_path, monkeypatch):
    """Many overlapping aiofiles writes (export) and reads split inside frames (import) give the same result."""
    import tiered_kv.tools.archive as A
    monkeypatch.setattr(A, "WRITE_CHUNK", 5000)      # a write in flight while the next frames are packed
    monkeypatch.setattr(A, "CHUNK", 777)             # read-ahead chunks that split headers and values
    out = tmp_path / "small.tkv"
    rep = A.export_archive(tpl.src, NS, out)
    assert rep.frames == N
    data, ref = out.read_bytes(), archive.read_bytes()
    hdr_len = len(ref) - sum(FRAME_OVERHEAD + len(v) for v in raw(tpl.src).values()) - 36
    assert data[hdr_len:] == ref[hdr_len:]            # same frames and trailer (the header has its own time)
    rep = A.import_archive(tmp_path / "dst", out)
    assert rep.imported == N and raw(tmp_path / "dst") == raw(tpl.src)
