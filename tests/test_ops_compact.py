"""``tiered-kv compact``: smaller file, same entries, atomic swap, refusals, and what a crash leaves behind."""

from __future__ import annotations

import json
import os
import shutil

import lmdb
import pytest

from test_ops_common import (Template, cli, content, garbage_lmdb_dir, keys, load_bytes, not_lmdb_dir, open_manager,
                             raw_all, raw_put, set_meta, snapshot, LmdbReader)
from tiered_kv.disk.format import lmdb_key
from tiered_kv.tools.ops import COMPACT_TMP_PREFIX

N = 48


@pytest.fixture(scope="module")
def tpl(tmp_path_factory):
    return Template(tmp_path_factory, keys(N))


def _thin(path, ks):
    """Delete every other entry (as evictions would) so that the file has free pages."""
    for k in ks[::2]:
        raw_put(path, "blocks", lmdb_key(k), None)
    return ks[1::2]


def _assert_served(path, present, absent=()):
    mgr, kv = open_manager(path)
    try:
        for k in present:
            assert load_bytes(mgr, kv, k) == content(k), k
        for k in absent:
            assert load_bytes(mgr, kv, k) is None, k
    finally:
        mgr.close()


def test_compact_shrinks_keeps_every_record_and_serves(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    left = _thin(path, tpl.keys)
    before = raw_all(path)
    size0 = (path / "data.mdb").stat().st_size
    rc, out, err = cli(capsys, "compact", str(path))
    assert rc == 0, err
    size1 = (path / "data.mdb").stat().st_size
    assert size1 < size0
    assert f"before  {size0:,} bytes" in out and f"after   {size1:,} bytes" in out
    assert "compact" in err and "100%" in err                 # the progress bar
    assert raw_all(path) == before                            # every sub-database, byte for byte
    assert not list(path.glob(COMPACT_TMP_PREFIX + "*"))
    rc, out, _ = cli(capsys, "verify", str(path))
    assert rc == 0
    _assert_served(path, left[:6], tpl.keys[0:6:2])
    rc, out, _ = cli(capsys, "inspect", str(path), "--json")   # the manager's recovery wrote into it again
    assert json.loads(out)["entries"] == len(left)


def test_compact_json_and_no_progress(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    rc, out, err = cli(capsys, "compact", str(path), "--json", "--no-progress")
    assert rc == 0 and err == ""
    rep = json.loads(out)
    assert rep["entries"]["blocks"] == N and rep["after_bytes"] == (path / "data.mdb").stat().st_size
    assert rep["saved_bytes"] == rep["before_bytes"] - rep["after_bytes"]


def test_compact_is_refused_while_a_tiermanager_holds_the_path(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    mgr, _kv = open_manager(path)
    try:
        before = snapshot(path)
        rc, out, err = cli(capsys, "compact", str(path))
        assert rc == 3, (out, err)
        assert "in use by a TierManager" in err and "nothing was changed" in err
        assert snapshot(path) == before
    finally:
        mgr.close()


def test_compact_is_refused_while_another_process_has_the_env_open(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    _thin(path, tpl.keys)
    before = snapshot(path)
    reader = LmdbReader(path)
    try:
        rc, out, err = cli(capsys, "compact", str(path))
    finally:
        reader.close()
    assert rc == 3, (out, err)
    assert f"pid {reader.pid}" in err and "nothing was changed" in err
    assert snapshot(path) == before                            # the copy was thrown away, data.mdb untouched
    rc, _, err = cli(capsys, "compact", str(path))             # and it works once the reader is gone
    assert rc == 0, err


@pytest.mark.parametrize("kind", ["missing", "not-lmdb", "garbage-data", "format"])
def test_compact_bad_input(kind, tpl, tmp_path, capsys):
    if kind == "missing":
        path, msg = tmp_path / "nope", "does not exist"
    elif kind == "not-lmdb":
        path, msg = not_lmdb_dir(tmp_path), "not an LMDB environment"
    elif kind == "garbage-data":
        path, msg = garbage_lmdb_dir(tmp_path), "not an LMDB environment"
    else:
        path, msg = tpl.copy(tmp_path / "disk"), "format version '1'"
        set_meta(path, b"format_version", b"1")
    before = snapshot(path)
    rc, out, err = cli(capsys, "compact", str(path))
    assert rc == 2, (out, err)
    assert err.startswith("tiered-kv compact: error: ") and msg in err, err
    after = snapshot(path)
    assert after == before


def test_killed_before_the_swap_leaves_the_original_and_a_leftover_the_next_compact_removes(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    left = _thin(path, tpl.keys)
    tmp = path / f"{COMPACT_TMP_PREFIX}99999"                  # what a compaction killed mid-copy leaves
    tmp.mkdir()
    (tmp / "data.mdb").write_bytes(os.urandom(20000))
    _assert_served(path, left[:3])                             # a TierManager ignores it
    rc, out, _ = cli(capsys, "inspect", str(path), "--json")
    assert json.loads(out)["leftover_compact_dirs"] == [tmp.name]
    rc, out, err = cli(capsys, "compact", str(path))
    assert rc == 0, err
    assert not tmp.exists()


def test_killed_right_after_the_rename_a_stale_lock_file_is_harmless(tpl, tmp_path):
    """The swap is a rename of a complete, fsynced file; lock.mdb still describes the old file (higher
    transaction ids).  Nobody has the env open at that point (compact checked), so the next opener is
    LMDB's first user and rebuilds lock.mdb from the new file."""
    path = tpl.copy(tmp_path / "disk")
    left = _thin(path, tpl.keys)                               # many write transactions: high txn ids
    env = lmdb.open(str(path), readonly=True, max_dbs=4, map_size=0)
    old_txn = env.info()["last_txnid"]
    side = tmp_path / "copy"
    side.mkdir()
    env.copy(str(side), compact=True)
    env.close()
    assert old_txn > 2
    os.replace(side / "data.mdb", path / "data.mdb")           # ...and the process dies here
    _assert_served(path, left[:6], tpl.keys[0:6:2])


def test_compact_of_an_environment_on_its_own_filesystem_root_uses_a_temp_dir_inside(tpl, tmp_path, capsys):
    # the temporary copy lives inside PATH, so the rename never crosses filesystems even when PATH is a mount point
    path = tpl.copy(tmp_path / "disk")
    seen = []
    orig = shutil.rmtree

    def spy(p, *a, **kw):
        seen.append(str(p))
        return orig(p, *a, **kw)

    shutil.rmtree = spy
    try:
        rc, _, err = cli(capsys, "compact", str(path))
    finally:
        shutil.rmtree = orig
    assert rc == 0, err
    assert any(s.startswith(str(path) + os.sep + COMPACT_TMP_PREFIX) for s in seen), seen


def test_an_lmdb_opener_waiting_through_the_swap_sees_the_new_file(tpl, tmp_path, capsys, monkeypatch):
    """A process that opens the environment between the rename and the end of compact (it opened the new
    data.mdb and waits on lock.mdb) must read the new file correctly: compact rebuilds lock.mdb before it
    lets go.  Without that, the stale transaction id would send it to the copy's empty meta page."""
    import subprocess
    import sys
    import time

    import tiered_kv.tools.ops as ops

    path = tpl.copy(tmp_path / "disk")
    left = _thin(path, tpl.keys)
    env = lmdb.open(str(path), readonly=True, max_dbs=4, map_size=0)
    odd = env.info()["last_txnid"] % 2
    env.close()
    if odd:   # an even old txn id: a stale lock.mdb then selects the copy's meta page 0 (an empty tree)
        raw_put(path, "touch", b"parity", (0).to_bytes(8, "little"))
    real_replace = os.replace
    waiter = {}
    lock_ino = (path / "lock.mdb").stat().st_ino

    def replace(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("data.mdb"):
            waiter["proc"] = p = subprocess.Popen(
                [sys.executable, "-c", "import sys, lmdb\n"
                 "env = lmdb.open(sys.argv[1], readonly=True, max_dbs=4, map_size=0)\n"
                 "db = env.open_db(b'blocks', create=False)\n"
                 "with env.begin(db=db) as t: print(t.stat(db)['entries'])\n", str(path)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:       # until it waits on lock.mdb's byte 0 (/proc/locks "->")
                with open("/proc/locks") as f:
                    if any("->" in ln and f":{lock_ino} " in ln and str(p.pid) in ln for ln in f):
                        break
                time.sleep(0.01)
            else:
                pytest.skip("could not observe the waiting opener in /proc/locks")

    monkeypatch.setattr(ops.os, "replace", replace)
    rc, _, err = cli(capsys, "compact", str(path), "--no-progress")
    monkeypatch.setattr(ops.os, "replace", real_replace)
    assert rc == 0, err
    out, perr = waiter["proc"].communicate(timeout=30)
    assert waiter["proc"].returncode == 0, perr
    assert int(out) == len(left)
