"""Review round 39: the operator tools (inspect, verify/repair, compact, export/import).

Findings (each proved by the test named, which failed on main at 9e2036b; both fixed since: a failed import
removes the files it made and then each directory it made, deepest first, only while empty; ``OpsError`` derives
from ``TieredKVError`` and ``PathInUseError`` from ``DiskInUseError`` too):

1. test_a_failed_import_into_a_new_path_never_removes_a_sibling_tier_made_meanwhile --
   archive.import_async: when PATH's parent directories do not exist, the import makes them and, if its
   write pass then fails (an archive that changed between the passes, a full disk, Ctrl-C), removes the
   topmost one it made with ``shutil.rmtree`` -- together with everything another process put under it
   meanwhile: a sibling tier created at the same time (two imports provisioning rank0/rank1 under a new
   /nvme/kv, a TierManager started on a sibling path) is deleted.

2. test_operator_tool_errors_are_tiered_kv_errors -- tools/ops.py: ``OpsError`` (and so ``PathInUseError``,
   ``ArchiveError``), the one exception every public operator function raises on bad input, derives from
   ``Exception`` only, not from ``tiered_kv.errors.TieredKVError`` (errors.py: "Every error the library
   raises on bad input derives from TieredKVError"; docs/architecture.md: errors.py holds "every exception
   raised at the API boundary").  A provisioning script calling ``import_archive``/``verify`` and catching
   ``TieredKVError`` gets an uncaught exception.  (Lower severity: the CLI itself turns it into exit 2/3.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv.errors import DiskInUseError, TieredKVError
from tiered_kv.tools import archive as A
from tiered_kv.tools import ops
from tiered_kv.tools.ops import OpsError

from test_ops_common import NS, build_env, content, keys, load_bytes, open_manager


# --------------------------------------------------------------------------- 1
def test_a_failed_import_into_a_new_path_never_removes_a_sibling_tier_made_meanwhile(tmp_path):
    """What is wrong: ``import_async`` (tiered_kv/tools/archive.py) records ``created``, the topmost directory
    it made for a new PATH, and on any failure of the write pass runs ``shutil.rmtree(created)``.  That
    directory is not the import's alone: from the moment it exists, other processes may create things under
    it -- a second ``tiered-kv import`` provisioning a sibling rank, a TierManager started on a sibling
    ``disk_path`` (``take_path`` makes parents with ``exist_ok``).  Here the import into ``new/rank0``
    fails in pass 2 because the archive changed after pass 1 (the documented "the file may have changed
    since" case); meanwhile a real tier was made at ``new/rank1``.  The import's clean-up deletes rank1's
    whole tier (data.mdb, slots.tkv): a refused import destroys another node's cache.

    Fix: remember every directory the import made (top down to PATH); on failure unlink only the files the
    import made inside PATH, then ``os.rmdir`` its directories bottom up, stopping at the first that is not
    empty (never ``rmtree`` a directory others can write into)."""
    src = build_env(tmp_path / "src", keys(4, "a"))
    arch = Path(A.export_archive(src, NS, tmp_path / "a.tkv").out)
    total = arch.stat().st_size
    new = tmp_path / "new"
    dst, sibling = new / "rank0", new / "rank1"
    state = {"altered": False, "sibling": False}

    def progress(phase: str, done: int, _total: int) -> None:
        if phase == "verify" and done == total and not state["altered"]:
            # pass 1 checked the whole file; it is changed before pass 2 reads it (a copy still being written)
            blob = bytearray(arch.read_bytes())
            blob[total - 200] ^= 0x01          # inside the last frame's value
            arch.write_bytes(bytes(blob))
            state["altered"] = True
        elif phase == "import" and not state["sibling"]:
            # the import made new/ and new/rank0; meanwhile another tier is provisioned beside it
            build_env(sibling, keys(3, "s"))
            state["sibling"] = True

    with pytest.raises(OpsError):
        A.import_archive(dst, arch, progress=progress)
    assert state == {"altered": True, "sibling": True}
    assert not dst.exists() or not (dst / "data.mdb").exists()
    assert (sibling / "data.mdb").exists(), "the failed import removed a sibling tier it never owned"
    mgr, kv = open_manager(sibling)
    try:
        for k in keys(3, "s"):
            assert load_bytes(mgr, kv, k) == content(k)
    finally:
        mgr.close()


# --------------------------------------------------------------------------- 2
def test_operator_tool_errors_are_tiered_kv_errors(tmp_path):
    """What is wrong: ``OpsError`` in tiered_kv/tools/ops.py is ``class OpsError(Exception)``; the public
    operator API (``ops.inspect``/``verify``/``compact``, ``archive.export_archive``/``import_archive``,
    all in ``__all__``) raises it -- and its subclasses ``PathInUseError`` and ``ArchiveError`` -- for a
    missing path, a bad archive or a held path.  tiered_kv/errors.py promises that every error the library
    raises on bad input derives from ``TieredKVError`` (docs/architecture.md: errors.py holds every
    exception raised at the API boundary), so ``except TieredKVError`` around a tool call lets these
    through.  Fix: ``class OpsError(TieredKVError)`` (keeping ``exit_code``), and ``PathInUseError`` also
    a ``DiskInUseError`` (the same condition a TierManager reports), so one ``except`` covers both."""
    with pytest.raises(OpsError) as missing:
        ops.verify(tmp_path / "no-such-tier")
    bad = tmp_path / "bad.tkv"
    bad.write_bytes(b"not an archive at all")
    with pytest.raises(OpsError) as not_archive:
        A.import_archive(tmp_path / "dst", bad)
    assert isinstance(missing.value, TieredKVError), type(missing.value).__mro__
    assert isinstance(not_archive.value, TieredKVError), type(not_archive.value).__mro__
    assert issubclass(ops.PathInUseError, DiskInUseError), ops.PathInUseError.__mro__
