"""``tiered-kv verify [--repair]``: corrupt and orphaned entries are found, and --repair removes those only."""

from __future__ import annotations

import json
import os

import pytest

from test_ops_common import (NS, ROW, Template, cli, content, garbage_lmdb_dir, keys, live_writer, load_bytes,
                             not_lmdb_dir, open_manager, raw, raw_all, raw_put, set_meta, snapshot, token_of)
from tiered_kv.disk.format import HEADER_SIZE, SLOTS_NAME, lmdb_key, parse_header, slot_bytes_for

__all__ = ["live_writer"]


@pytest.fixture(scope="module")
def tpl(tmp_path_factory):
    return Template(tmp_path_factory, keys(10))


def _damage(path, ks):
    """Four bad entries of four kinds; returns {reason: key}."""
    blocks = raw(path)
    v = bytearray(blocks[lmdb_key(ks[1])])
    v[-7] ^= 0x5A                                                   # payload bit rot
    raw_put(path, "blocks", lmdb_key(ks[1]), bytes(v))
    raw_put(path, "blocks", lmdb_key(ks[3]), blocks[lmdb_key(ks[3])][:-100])          # truncated value
    raw_put(path, "blocks", b"stray-key", blocks[lmdb_key(ks[5])])  # stored under another LMDB key
    raw_put(path, "tombs", token_of(path, ks[7]).bytes, ks[7])       # orphaned: its writer was tombstoned
    return {"checksum": ks[1], "truncated": ks[3], "lmdb_key_mismatch": ks[5], "tombstoned": ks[7]}


def test_verify_clean(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    before = snapshot(path)
    rc, out, err = cli(capsys, "verify", str(path))
    assert rc == 0, err
    assert "checked 10 entries" in out and "10 ok, 0 corrupt, 0 orphaned" in out
    assert snapshot(path) == before


def test_verify_reports_corrupt_and_orphaned_and_changes_nothing(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    bad = _damage(path, tpl.keys)
    before = snapshot(path)
    rc, out, err = cli(capsys, "verify", str(path), "--json")
    assert rc == 1, err
    rep = json.loads(out)
    assert rep["checked"] == 11 and rep["ok"] == 7 and rep["problems"] == 4
    got = {p["reason"]: bytes.fromhex(p["key"]) for p in rep["corrupt"] + rep["orphaned"]}
    assert got == bad
    assert [p["reason"] for p in rep["orphaned"]] == ["tombstoned"]
    rc, out, _ = cli(capsys, "verify", str(path))
    assert rc == 1 and "4 problems" not in out and "7 ok, 3 corrupt, 1 orphaned" in out
    assert "--repair" in out
    assert snapshot(path) == before, "verify without --repair changed the environment"


def test_repair_removes_those_and_only_those(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    bad = _damage(path, tpl.keys)
    raw_put(path, "touch", lmdb_key(bad["checksum"]), (99).to_bytes(8, "little"))
    before = raw_all(path)
    rc, out, err = cli(capsys, "verify", str(path), "--repair")
    assert rc == 0, err
    assert "removed 4 entries" in out and "7 ok, 0 corrupt, 0 orphaned" in out
    after = raw_all(path)
    removed = {lmdb_key(bad["checksum"]), lmdb_key(bad["truncated"]), b"stray-key", lmdb_key(bad["tombstoned"])}
    assert after["blocks"] == {k: v for k, v in before["blocks"].items() if k not in removed}
    assert after["touch"] == {}                               # the removed entry's recency record went with it
    assert after["tombs"] == before["tombs"] and after["meta"] == before["meta"]
    rc, out, _ = cli(capsys, "verify", str(path))
    assert rc == 0
    mgr, kv = open_manager(path)                              # a TierManager serves what is left, byte for byte
    try:
        for k in tpl.keys:
            got = load_bytes(mgr, kv, k)
            if k in bad.values() and k != bad["lmdb_key_mismatch"]:
                assert got is None
            else:
                assert got == content(k)
    finally:
        mgr.close()


def test_repair_is_refused_while_a_tiermanager_holds_the_path(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    _damage(path, tpl.keys)
    mgr, _kv = open_manager(path)       # recovery already purged the orphan; the corrupt ones remain
    try:
        before = snapshot(path)
        rc, out, err = cli(capsys, "verify", str(path), "--repair")
        assert rc == 3, (out, err)
        assert f"pid {os.getpid()}" in err or "this process" in err
        assert "nothing was changed" in err and "Traceback" not in err
        assert snapshot(path) == before
    finally:
        mgr.close()


def test_verify_beside_a_live_writer_in_another_process(live_writer, capsys):
    rc, out, err = cli(capsys, "verify", str(live_writer.path), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["checked"] >= 8 and rep["corrupt"] == [] and rep["orphaned"] == []
    assert rep["writer_pids"] == [live_writer.pid]
    rc, out, err = cli(capsys, "verify", str(live_writer.path), "--repair")
    assert rc == 3 and f"pid {live_writer.pid}" in err, err


@pytest.mark.parametrize("repair", [False, True])
@pytest.mark.parametrize("kind", ["missing", "not-lmdb", "garbage-data", "format", "no-meta"])
def test_verify_bad_input(kind, repair, tpl, tmp_path, capsys):
    if kind == "missing":
        path, msg = tmp_path / "nope", "does not exist"
    elif kind == "not-lmdb":
        path, msg = not_lmdb_dir(tmp_path), "not an LMDB environment"
    elif kind == "garbage-data":
        path, msg = garbage_lmdb_dir(tmp_path), "not an LMDB environment"
    elif kind == "format":
        path, msg = tpl.copy(tmp_path / "disk"), "format version '7'"
        set_meta(path, b"format_version", b"7")
    else:
        path, msg = tpl.copy(tmp_path / "disk"), "no tiered_kv format_version"
        raw_put(path, "meta", b"format_version", None)
    before = snapshot(path)
    rc, out, err = cli(capsys, "verify", str(path), *(["--repair"] if repair else []))
    assert rc == 2, (out, err)
    assert err.startswith("tiered-kv verify: error: ") and msg in err, err
    assert snapshot(path) == before


def test_verify_counts_entries_of_another_namespace_as_corrupt(tpl, tmp_path, capsys):
    from tiered_kv.disk.format import pack_header
    import uuid
    path = tpl.copy(tmp_path / "disk")
    payload = content(b"x")
    raw_put(path, "blocks", b"x", pack_header(b"other-ns", b"x", uuid.uuid4(), payload, 1) + payload)
    rc, out, _ = cli(capsys, "verify", str(path), "--json")
    rep = json.loads(out)
    assert rc == 1 and [p["reason"] for p in rep["corrupt"]] == ["wrong_namespace"]
    assert rep["namespace"] == NS and HEADER_SIZE > 0


def test_verify_reads_payloads_from_the_slot_file(tpl, tmp_path, capsys):
    """Bit rot in the slot file and a slot file cut short are found (the index records are intact),
    --repair removes those entries only, and export skips them."""
    path = tpl.copy(tmp_path / "disk")
    index = raw(path, inline=False)
    slot_bytes = slot_bytes_for(ROW)
    at = {k: parse_header(index[lmdb_key(k)]).slot * slot_bytes for k in tpl.keys}
    rotten = tpl.keys[2]
    with open(path / SLOTS_NAME, "r+b") as f:
        f.seek(at[rotten] + ROW // 3)
        b = f.read(1)
        f.seek(at[rotten] + ROW // 3)
        f.write(bytes([b[0] ^ 0x01]))
    last = max(tpl.keys, key=lambda k: at[k])                 # the entry in the highest slot loses its tail
    os.truncate(path / SLOTS_NAME, at[last] + ROW - 5)
    rc, out, err = cli(capsys, "verify", str(path), "--json")
    assert rc == 1, err
    rep = json.loads(out)
    got = {bytes.fromhex(p["key"]): p["reason"] for p in rep["corrupt"]}
    assert got == {rotten: "checksum", last: "truncated"}
    assert rep["ok"] == len(tpl.keys) - 2
    rc, out, err = cli(capsys, "export", str(path), "--namespace", NS, str(tmp_path / "a.tkv"))
    assert rc == 0 and f"exported {len(tpl.keys) - 2} entries" in out, (out, err)
    rc, out, err = cli(capsys, "verify", str(path), "--repair")
    assert rc == 0 and "removed 2 entries" in out, (out, err)
    mgr, kv = open_manager(path)
    try:
        for k in tpl.keys:
            assert load_bytes(mgr, kv, k) == (None if k in (rotten, last) else content(k))
    finally:
        mgr.close()
