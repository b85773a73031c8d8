"""``tiered-kv inspect``: what it reports, and that it is read-only and refuses bad input clearly."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tiered_kv.disk.format import FORMAT_VERSION, SLOTS_NAME

from test_ops_common import (NS, ROW, Template, cli, cli_subprocess, garbage_lmdb_dir, keys, live_writer,
                             not_lmdb_dir, open_manager, plain_lmdb_dir, raw_put, set_meta, snapshot, token_of)

__all__ = ["live_writer"]


@pytest.fixture(scope="module")
def tpl(tmp_path_factory):
    return Template(tmp_path_factory, keys(6))


def test_inspect_text(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    before = snapshot(path)
    rc, out, err = cli(capsys, "inspect", str(path))
    assert rc == 0, err
    assert f"'{NS}'" in out
    lines = dict((ln.split("  ", 1)[0].strip(), ln.split("  ", 1)[1].strip()) for ln in out.splitlines() if "  " in ln)
    assert lines["entries"] == "6"
    assert lines["block bytes"] == f"{ROW:,}"
    assert lines["format version"].startswith(f"{FORMAT_VERSION} ")
    assert lines["stored bytes"].endswith("6 entries in the slot file, 0 inline)")
    assert lines["slots.tkv"].startswith(f"{(path / SLOTS_NAME).stat().st_size:,} bytes")
    assert lines["tombstones"] == "0"
    assert lines["writer"].startswith("none")
    assert "entries" in lines["last recovery"]
    assert snapshot(path) == before, "inspect changed the environment"


def test_inspect_json(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    rc, out, err = cli(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["namespace"] == NS and rep["block_bytes"] == ROW and rep["format_version"] == str(FORMAT_VERSION)
    assert rep["entries"] == 6 and rep["entry_namespaces"] == {NS: 6}
    # the payloads are in the slot file: LMDB holds the index records only
    assert rep["payload_bytes"] == 6 * ROW and 0 < rep["stored_bytes"] < ROW
    assert rep["slot_entries"] == 6 and rep["inline_entries"] == 0
    assert rep["slot_file_bytes"] == (path / SLOTS_NAME).stat().st_size >= 6 * ROW
    assert rep["tombstones"] == 0 and rep["foreign_entries"] == 0 and rep["writer_pids"] == []
    lm = rep["lmdb"]
    assert lm["page_bytes"] > 0 and lm["pages_total"] >= lm["pages_used"] > 0
    assert lm["map_size_bytes"] >= lm["pages_total"] * lm["page_bytes"]
    assert lm["subdbs"]["blocks"]["entries"] == 6
    assert rep["file_bytes"] == (path / "data.mdb").stat().st_size
    rec = rep["last_recovery"]
    assert set(rec) >= {"entries", "purged", "corrupt", "foreign", "tombs_dropped", "seconds", "at"}


def test_inspect_shows_tombstones_and_the_last_recovery(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    k = tpl.keys[2]
    raw_put(path, "tombs", token_of(path, k).bytes, k)        # a crash left an orphaned write behind
    rc, out, _ = cli(capsys, "inspect", str(path), "--json")
    assert json.loads(out)["tombstones"] == 1
    mgr, _kv = open_manager(path)                              # recovery purges it and records a report
    mgr.close()
    raw_put(path, "tombs", uuid.uuid4().bytes, b"other")       # a tomb whose write never came
    rc, out, _ = cli(capsys, "inspect", str(path), "--json")
    rep = json.loads(out)
    assert rc == 0
    assert rep["entries"] == 5 and rep["tombstones"] == 1
    assert rep["last_recovery"]["purged"] == 1 and rep["last_recovery"]["entries"] == 5


def _bad(kind, tmp_path, tpl):
    if kind == "missing":
        return tmp_path / "nope", "does not exist"
    if kind == "file":
        f = tmp_path / "afile"
        f.write_bytes(b"x" * 100)
        return f, "not a directory"
    if kind == "not-lmdb":
        return not_lmdb_dir(tmp_path), "not an LMDB environment"
    if kind == "garbage-data":
        return garbage_lmdb_dir(tmp_path), "not an LMDB environment"
    if kind == "plain-lmdb":
        return plain_lmdb_dir(tmp_path), "not a tiered_kv disk tier"
    if kind == "format":
        p = tpl.copy(tmp_path / "disk")
        set_meta(p, b"format_version", b"1")
        return p, "format version '1'"
    if kind == "truncated":
        p = tpl.copy(tmp_path / "disk")
        data = p / "data.mdb"
        os.truncate(data, data.stat().st_size // 2)
        return p, "truncated"
    raise AssertionError(kind)


BAD = ["missing", "file", "not-lmdb", "garbage-data", "plain-lmdb", "format", "truncated"]


@pytest.mark.parametrize("kind", BAD)
def test_inspect_bad_input(kind, tpl, tmp_path, capsys):
    path, msg = _bad(kind, tmp_path, tpl)
    before = snapshot(path)
    rc, out, err = cli(capsys, "inspect", str(path))
    assert rc == 2, (out, err)
    assert err.startswith("tiered-kv inspect: error: ") and msg in err, err
    assert "Traceback" not in err
    assert snapshot(path) == before, "a refused inspect changed something"


def test_inspect_wrong_format_still_shows_what_it_can_in_json(tpl, tmp_path, capsys):
    path, _ = _bad("format", tmp_path, tpl)
    rc, out, err = cli(capsys, "inspect", str(path), "--json")
    assert rc == 2 and "format version" in err
    rep = json.loads(out)
    assert rep["format_version"] == "1" and rep["namespace"] == NS and rep["entries"] == 6


def test_inspect_beside_a_live_writer_in_another_process(live_writer, capsys):
    path = live_writer.path
    rc, out, err = cli(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["writer_pids"] == [live_writer.pid]
    assert rep["entries"] >= 8 and rep["foreign_entries"] == 0 and rep["unparsable_entries"] == 0
    rc, out, _ = cli(capsys, "inspect", str(path))
    assert rc == 0 and f"pid {live_writer.pid}" in out


def test_inspect_refuses_a_path_open_in_this_process(tpl, tmp_path, capsys):
    path = tpl.copy(tmp_path / "disk")
    mgr, _kv = open_manager(path)
    try:
        rc, out, err = cli(capsys, "inspect", str(path))
    finally:
        mgr.close()
    assert rc == 3 and "this very process" in err, err


def test_inspect_as_a_subprocess(tpl, tmp_path):
    path = tpl.copy(tmp_path / "disk")
    r = cli_subprocess("inspect", str(path), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["entries"] == 6
