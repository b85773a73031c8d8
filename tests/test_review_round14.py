"""Adversarial review (round 14) of this session's fixes: 3d03d27 (``removed_why`` / ``REMOVED_AS``: one statement
of what recovery removes, asked by recovery, verify's ``_scan`` and export), 08f0a79 (``Writer.lost`` an
``OrderedDict`` with ``move_to_end``; import's ``_renumbering`` and the second ``_scan(..., near=SEQ_CHECKED -
frames)`` pass) and 0a3e5d2 (``DiskTier.open`` resolves ``disk_path`` once with ``os.path.realpath`` and locks and
opens the resolved path; ``make()`` leaves its lock share on any exception from ``ProcessDiskStore(...)``).

What it proved wrong (each test fails without its fix):

1. ``test_a_restarted_disk_io_process_opens_the_directory_the_tier_locked_after_it_was_replaced`` -- 0a3e5d2
   resolves the *name* once, but the name is still what every later store opens: ``DiskTier.open`` hands
   ``DiskOptions(path=realpath(disk_path))`` to ``make()``, and each replacement of a dead disk I/O process (a
   pass's ``restart``, ``close()``'s reconciling start) opens that path by name again, trusting the share of the
   tier's lock it is given (``DiskStore(lock_fd=...)`` never locks, never checks).  docs/architecture.md invariant
   16 now says "every store it starts opens the directory it locked"; that holds only while the resolved name
   still names that directory.  When the directory itself is replaced -- moved aside (``mv disk disk.old``, a
   cleanup or an operator "rotating" the cache), removed and recreated, or a filesystem mounted over it (a late
   mount unit, a bind mount: the same mechanism, not tested here because it needs CAP_SYS_ADMIN) -- the name names
   a directory whose ``tiered_kv.lock`` is another inode: another owner can take it (it is free), and A's
   replacement child opens it *without* its lock.  Forced here: A (process mode, absolute path, no links) spills
   four blocks; its directory is renamed aside; B opens a fresh tier at the same name and spills four; A's child
   is SIGKILLed; A's restart (in a pass, or at close) opens B's live tier, its adoption finds none of its tokens,
   drops its own four blocks from its index ("lost with the last one") and *deletes B's four blocks* ("on disk no
   longer wanted") -- round 13's finding 1 (two owners on one path, another owner's data deleted), through a door
   ``realpath`` does not close.  Why it matters: lost data of a live owner, two writers on one LMDB environment and
   slot file.  Suggested fix: pin the directory, not its name -- at open keep the locked directory's identity
   (``os.fstat`` of the tier's lock share: ``st_dev``/``st_ino`` of ``tiered_kv.lock``) and in ``make()`` refuse a
   start whose ``os.stat(path / LOCK_NAME)`` differs (``DiskTierError``: a failed restart, counted, tier down,
   host-only service), or keep an ``O_DIRECTORY`` fd of it and hand the child ``/proc/self/fd/N`` (``pass_fds``)
   as its path, so every store opens the very directory locked at the open.  Fixed the first way, in the store
   itself: a ``DiskStore`` given a share of its holder's lock checks, before and after it opens the environment,
   that ``PATH/tiered_kv.lock`` is the file that share holds (``lock.locks``, by device and inode); otherwise it
   refuses to open (a failed start, counted; the tier stays down until the name names its directory again).

2. ``test_a_disk_path_through_a_link_to_a_directory_not_named_in_utf8_still_opens`` -- a regression of 0a3e5d2.
   ``TieredKVConfig`` checks that ``disk_path`` is valid UTF-8 because "LMDB opens UTF-8 paths only"
   (config.check_disk_path); ``os.path.realpath`` then replaces the checked path by one that may not be: a link
   in the path whose target's real name is not UTF-8 (a Latin-1 named mount point or directory on an older
   filesystem: ``/data/kv -> /mnt/caf\\xe9/kv``) becomes a ``str`` with a lone surrogate (``caf\\udce9``), which
   py-lmdb cannot encode: ``lmdb.open`` raises ``UnicodeEncodeError`` (a ``ValueError``), which
   ``DiskStore._open`` reports as "cannot be opened with these sizes" -- the disk tier is ``open_failed`` and the
   service silently runs host-only, in both ``disk_io`` modes, where before this commit the same ``disk_path``
   (the kernel follows the link; LMDB is handed the UTF-8 name) opened and served.  Verified against the tree of
   0a3e5d2^ (``git archive`` into a scratch directory): the test passes there.  Suggested fix: do not hand LMDB
   the spelled-out target; e.g. keep the user's (validated) name for LMDB and the files and pin the directory by
   identity as in finding 1, or open through ``/proc/self/fd/N`` of a directory fd (ASCII, and pins the
   directory), or fall back to ``os.path.abspath`` (lexical) when the resolved path does not encode as UTF-8.
   Fixed the last way (``disk_tier._absolute``: the resolved name if it is UTF-8, else the absolute one, else the
   name as given), with finding 1's identity check covering what a name not resolved through its links names later.

Checked and found to hold (no test):

* 3d03d27, recovery: ``REMOVED_AS`` counts every ``removed_why`` reason as the old code did (``bad_seq`` and
  ``unverified`` corrupt; ``wrong_namespace``/``wrong_length``/``lmdb_key_mismatch`` foreign; ``tombstoned``
  purged), in the same order of checks (``bad_seq`` first, the checksum read only for a number >= SEQ_CHECKED,
  the tombstone last); the ``verifies`` lambda is called at once, so its late-binding of ``v``/``h`` is harmless;
  the slot checks (past EOF, two records on one slot) still follow.
* 3d03d27, verify ``_scan``: ``verify_entry(v, ns, None, bb, ...)`` runs first, so ``wrong_namespace``/
  ``wrong_length`` still come from it (``_META_REASONS`` and the "meta may be damaged" refusal unchanged) and
  ``unverified`` cannot arise (``verifies`` is ``lambda: True`` after a verified checksum); only the label of an
  entry both ``bad_seq`` and ``lmdb_key_mismatch`` changed (``bad_seq`` now), still corrupt and removed by
  ``--repair`` as recovery removes it; the tombstoned one is still ``orphaned``.
* 3d03d27, export: the skip rule (``tombstoned`` -> ``skipped_orphaned``, any other reason -> ``skipped_corrupt``)
  equals the old one (the old ``lmdb_key``/``SEQ_LIMIT`` checks came before the tombstone check too);
  ``_top_seq`` equals the old one (``_verifies`` reads the slot through ``stored_payload`` as before) and recovery's
  highest kept number as far as ``touch_limit`` can tell (round 13's argument about slot losers holds).
* 08f0a79, ``Writer._lost``: the OrderedDict's ``move_to_end`` only relinks its order list (``dict.get`` by a
  lock-free ``RemoteStore.invalidating`` sees the key throughout, bytes keys: no Python code runs, no GIL
  release); ``until`` is ``monotonic() + a constant`` (or ``inf`` for every key), so moving a re-lost key to the end
  keeps the map in expiry order and the front pruning sees every expired key; ``next(iter(lost))`` makes a fresh
  iterator under the writer's lock, no other code iterates ``lost``.
* 08f0a79, ``_renumbering`` (20,000 random archives, duplicates, ``SEQ_CHECKED - 1``, ``SEQ_CHECKED``,
  ``SEQ_LIMIT - 1``, numbers far below): every new number is below SEQ_CHECKED, strictly ordered numbers stay
  strictly ordered, equal ones stay equal; the chain moves at most the collected distinct numbers, so its lowest
  target is >= SEQ_CHECKED - frames and every number below ``near`` (not collected) is already below the next free
  one.  Destination entries are never overwritten because of a number (a present key with a valid writer is kept;
  a tie with a destination entry only orders the LRU, the key order breaking it).  An archive altered between the
  passes: pass 1b or the write pass re-verifies every frame and the trailer; a number missing from ``renumber``
  falls back to its own (< SEQ_CHECKED) or SEQ_CHECKED - 1, never to one recovery would distrust.
* 0a3e5d2, other path users: thread-mode ``DiskStore``, ``ProcessDiskStore``/the child, ``CachedReads``,
  ``DiskEnv``, ``SlotFile`` and the writer all take ``opts.path`` (resolved); ``manager.py`` and
  ``SlabScheduler`` use ``config.disk_path`` only to decide on a shared slab and for a log line; the operator
  tools lock ``PATH/tiered_kv.lock`` by their own spelling, the same inode through a link, so they are still
  refused while a tier holds it.  Error messages and the restart log now name the resolved path (the final "disk
  tier at" log line the configured one): informative only.  A dangling ``disk_path`` link now creates its target
  (before: ``mkdir`` refused it, open_failed): a benign change.  ``make()``'s ``leave(share)`` is identity-checked,
  so it never closes a descriptor the constructor already left, nor another lock that took its number.

Seen and not filed: a running child (or thread-mode store) whose directory was renamed keeps using its open files
but still ``stat``s / ``truncate``s ``path/data.mdb`` and asks ``shutil.disk_usage(path)`` by name after each
commit (``DiskEnv.cover_pages``; a ``writer_error`` FileNotFoundError while nothing is at the name; an extension of
another tier's ``data.mdb`` -- sparse, harmless to LMDB -- once something is): the same root cause as finding 1,
no data lost.

Deterministic: tmp_path, real disk I/O processes (SIGKILL through ``kill_for_test``), bounded condition waits
only (no sleep orders anything).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from disk_helpers import Rig, keys, make_kv, metric, rig, store_seq  # noqa: F401
from test_review_round13_disk import _kill_child

pytestmark = pytest.mark.timeout(60)

__all__ = ["rig"]


# =========================================================================== finding 1
@pytest.mark.parametrize("where", ["restart_in_a_pass", "reconciling_start_at_close"])
def test_a_restarted_disk_io_process_opens_the_directory_the_tier_locked_after_it_was_replaced(
        rig: Rig, tmp_path: Path, where: str) -> None:
    """Contract: invariant 16 (docs/architecture.md: one owner per disk path; "``DiskTier.open`` resolves
    ``disk_path`` once (``os.path.realpath``), so every store it starts opens the directory it locked") and
    ``DiskTier.restart``'s reconciliation (only what the owner dropped is deleted).  See finding 1."""
    base = tmp_path / "srv"
    live = base / "disk"            # absolute, no link anywhere: realpath changes nothing
    moved = base / "disk.old"
    kv_a = make_kv(rows=8)
    mgr_a = rig.open(kv_a, path=live, host_slots=8, disk_slots=64, disk_io="process")
    ks_a = keys(4, "r14a")
    store_seq(mgr_a, kv_a, ks_a)    # durable in A's tier
    os.rename(live, moved)          # A's directory is moved aside while A runs ...
    assert not live.exists()        # (the name now names nothing: its lock is anyone's)
    kv_b = make_kv(rows=8, seed=11)
    mgr_b = rig.open(kv_b, path=live, host_slots=8, disk_slots=64, disk_io="process")   # ... B opens a new tier there
    ks_b = keys(4, "r14b")
    store_seq(mgr_b, kv_b, ks_b)

    dead = _kill_child(mgr_a)
    tier = mgr_a._core.disk
    assert tier is not None
    kept_by_a = None
    if where == "restart_in_a_pass":
        # the engine's passes restart it (or a fixed tier refuses the start: counted, tier down); bounded wait
        deadline = time.monotonic() + 15
        while ((mgr_a.disk is dead or tier.restarting or not tier.usable)
               and not metric(mgr_a, "tiered_kv_errors_total", tier="disk", error="io_process_restart_failed")):
            mgr_a.wait(timeout=0.01)
            assert time.monotonic() < deadline, "the disk I/O process was neither restarted nor refused"
        kept_by_a = len(tier.index)
    mgr_a.close()                   # (at close: its reconciling start is the one that opens B's directory)
    mgr_b.close()

    mgr_b2 = rig.open(make_kv(rows=8), path=live, host_slots=8, disk_slots=64, disk_io="process")
    found_b = mgr_b2.lookup(ks_b)
    mgr_b2.close()
    mgr_a2 = rig.open(make_kv(rows=8), path=moved, host_slots=8, disk_slots=64, disk_io="process")
    found_a = mgr_a2.lookup(ks_a)
    mgr_a2.close()
    assert found_a == len(ks_a)     # A's own blocks are intact in the moved directory
    assert found_b == len(ks_b), (
        f"A's replacement disk I/O process opened {str(live)!r} -- B's live tier, not the directory A locked (now "
        f"{moved.name!r}) -- without its lock: A's reconciliation deleted {len(ks_b) - found_b} of B's "
        f"{len(ks_b)} blocks (A's index kept {kept_by_a} of its {len(ks_a)})")


# =========================================================================== finding 2
@pytest.mark.parametrize("disk_io", ["process", "thread"])
def test_a_disk_path_through_a_link_to_a_directory_not_named_in_utf8_still_opens(
        rig: Rig, tmp_path: Path, disk_io: str) -> None:
    """Contract: a ``disk_path`` the config accepts (valid UTF-8, config.check_disk_path) opens a disk tier, as it
    did before 0a3e5d2 (passes on 0a3e5d2^).  See finding 2."""
    real = os.fsencode(tmp_path) + b"/caf\xe9"        # a directory whose real name is Latin-1, not UTF-8
    os.mkdir(real)
    link = tmp_path / "store"                          # the configured path reaches it through a link
    os.symlink(real, os.fsencode(link))
    disk_path = link / "disk"
    str(disk_path).encode()                            # (valid UTF-8: the config accepts it)
    kv = make_kv(rows=8)
    mgr = rig.open(kv, path=disk_path, host_slots=8, disk_slots=64, disk_io=disk_io)
    failed = metric(mgr, "tiered_kv_errors_total", tier="disk", error="open_failed")
    assert mgr.disk is not None and not failed, (
        f"disk_path {str(disk_path)!r} (valid UTF-8, a link to {real!r}) did not open: the tier is open_failed "
        f"and the manager serves host-only")
    ks = keys(2, "r14u")
    store_seq(mgr, kv, ks)
    mgr.close()
    mgr2 = rig.open(make_kv(rows=8), path=disk_path, host_slots=8, disk_slots=64, disk_io=disk_io)
    assert mgr2.lookup(ks) == len(ks)


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "by-name"])
def test_a_store_on_a_shared_lock_never_mixes_two_directories_replaced_while_it_opens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: bool) -> None:
    """A directory moved aside and replaced between the environment's open and the slot file's: the store must
    not hold one directory's environment and another's slot file, under a lock of neither's.  Pinned (the
    default, ``/proc``): both are the locked directory's, wherever its name went, and nothing lands in the
    replacement.  By name (no ``/proc``): finding 1's check after the opens refuses it, and the share is
    closed."""
    import tiered_kv.disk.store as store_mod
    from disk_helpers import NS, ROW
    from tiered_kv.disk import DiskOptions, DiskStore
    from tiered_kv.disk import lock as lock_mod
    from tiered_kv.errors import DiskTierError
    from tiered_kv.movers import CompletionQueue

    d, aside = tmp_path / "disk", tmp_path / "aside"
    d.mkdir()
    held = lock_mod.take(d)
    share = os.dup(held)   # as the disk I/O process gets it (inherited; no registry in that process)
    real = store_mod.DiskEnv
    if not pinned:
        monkeypatch.setattr(lock_mod, "pinned_path", lambda dfd: None)

    def env_then_replace(*a: object, **k: object) -> object:
        env = real(*a, **k)   # type: ignore[arg-type]
        os.rename(d, aside)
        d.mkdir()
        return env

    monkeypatch.setattr(store_mod, "DiskEnv", env_then_replace)
    opts = DiskOptions(path=d, namespace=NS, block_bytes=ROW, capacity_bytes=8 * ROW, durability="none",
                       batch_blocks=8, batch_bytes=8 * ROW, batch_seconds=0.0, slots=8, num_readers=1)
    try:
        if pinned:
            store = DiskStore(opts, CompletionQueue(), lock_fd=share)
            store.close()
            assert {"data.mdb", "lock.mdb", "slots.tkv"} <= {p.name for p in aside.iterdir()}
            assert list(d.iterdir()) == []
        else:
            with pytest.raises(DiskTierError, match="no longer names the directory locked"):
                DiskStore(opts, CompletionQueue(), lock_fd=share)
        with pytest.raises(OSError):   # closed (never unlocked) by the store, once closed or refused
            os.fstat(share)
    finally:
        lock_mod.release(held)
