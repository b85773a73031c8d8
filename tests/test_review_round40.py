"""Review round 40: adversarial review of the day's fixes (``git log 9e2036b..3883945``): 5b6fcb6 (a promote pins its
disk entry), 3bac09d (``_repair`` under S3-FIFO, the simulator's promote protection, ``rows_len``), 8f2e087 (the
handed-on counter of a dead child's page-cache reads), 3883945 (a failed import's clean-up; ``OpsError`` a
``TieredKVError``).

Findings (each test failed at 3883945; both fixed since: the import creates PATH's missing directories one at a
time and records each its ``mkdir`` made, removing exactly those, newest first, while empty (``archive._mkdirs``,
``_rmdirs``); ``S3FIFO.victim`` records the FIFO its walk pops from (``walk``) and ``restore`` puts an entry an
interrupt left out back at that FIFO's cold end):

1. ``test_a_failed_import_removes_only_the_directories_it_made`` -- archive.import_async: the clean-up of a failed
   import into a new PATH walks PATH's *lexical* parents (``Path.parent`` of ``p.absolute()``, never normalised) up
   to ``created`` and ``rmdir``s each while empty.  The directories ``p.mkdir(parents=True)`` made are not those
   lexical parents when PATH holds a ``..``: for ``new/../spare/tier`` (``new`` absent, ``spare`` an existing empty
   directory of someone else's, e.g. a mount point prepared for another tier) the import makes ``new`` and
   ``spare/tier``; its failure removes ``spare`` -- a directory it never made -- and leaves ``new``, which it made.
2. ``test_an_interrupted_s3fifo_eviction_puts_a_leased_main_entry_back_in_main`` -- 3bac09d: ``TierIndex._repair``
   now restores a leased entry an interrupted ``S3FIFO.victim`` popped, through ``S3FIFO.restore``, which always
   puts it at the *small* FIFO's cold end; one popped from the *main* FIFO (main's oldest, leased) ends up in the
   small FIFO, and after its release and the next eviction at main's hot end -- the order depends on whether an
   interrupt landed, what the round-39 fix meant to prevent.

Checked and found to hold (no test): ``TierIndex.pin`` is atomic under an interrupt at any call return (its only call,
the set's ``add``, comes last; ``start_promote``'s handler re-pins only when ``_dentry[0]`` is still None); a pinned
disk entry is passed over by every eviction path under lru/s3fifo/arc/prefix (``_evict_lru``'s reader filter,
``LRU.peek``/``victim``, ``S3FIFO.victim``/``peek``, ``ARC._oldest`` with the fall-back to the other list,
``PrefixLRU.victim``/``peek``), so its slot is never freed or reused while the read is in flight; a pinned entry
removed meanwhile (``DiskTier.promote_reported`` on a failed read, an invalidate's ``forget``, ``_adopt`` after a
restart) keeps its slot until ``release_taken``, which then frees it from the pinned set (``_maybe_free``); a disk
entry is pinned only by promotes (nothing leases disk entries any more), one promote per key residency; the
simulator agrees with the replay (host/disk hits) on 600 random write-through traces of requests no longer than
the host (lru, s3fifo, arc, prefix; host 4-8, disk 100) -- it differs on traces with a request longer than the host
(the simulator sheds a block the core stores), as it did at 9e2036b already; the operator CLI's ``_run`` catches
``OpsError`` before ``main``'s ``DiskInUseError``/``TieredKVError`` clauses, so the exit codes (2, 3) are unchanged,
and no library ``except DiskTierError``/``TieredKVError`` clause runs operator-tool code.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tiered_kv.core.index import Entry, TierIndex
from tiered_kv.core.policy import S3FIFO
from tiered_kv.tools import archive as A

from test_ops_common import NS, build_env, keys
from test_review_round39_fixes import reserve_interrupted_in_victim

pytestmark = pytest.mark.timeout(60)


class _Boom(Exception):
    """The import's write pass broken off (a full disk, an archive changed since pass 1, Ctrl-C)."""


def test_a_failed_import_removes_only_the_directories_it_made(tmp_path: Path) -> None:
    """What is wrong: ``import_async`` (tiered_kv/tools/archive.py), for a new PATH whose parents do not exist,
    records ``created`` -- the topmost *lexical* ancestor of ``p.absolute()`` whose parent exists -- and on failure
    runs ``d = p.absolute(); while True: d.rmdir(); if d == created: break; d = d.parent``.  ``Path.absolute()``
    does not normalise ``..``, so the lexical chain from PATH up to ``created`` is not the chain of directories
    ``p.mkdir(parents=True)`` made.  PATH ``new/../spare/tier`` with ``new`` absent and ``spare`` an existing empty
    directory (another tier's mount point, made by the operator): ``created`` is ``new``; ``mkdir`` makes ``new``
    (as a parent of ``new/..``) and ``spare/tier``.  The failed import then removes ``spare/tier`` (its own),
    ``new/../spare`` = ``spare`` (not its own: it existed before, empty) and stops at ``new/..`` (``rmdir`` of
    ``..`` fails), leaving ``new`` (its own) behind.  The round-39 fix's stated intent -- "remember every directory
    the import made ... rmdir its directories bottom up" -- is not what the code does.

    Fix: make the directories one level at a time and record each one this call created (``os.mkdir`` per missing
    component of ``os.path.abspath``-free resolution: walk ``p.absolute().parents`` down from the first existing
    one, ``mkdir`` each, append to ``made_dirs`` only when this call's ``mkdir`` succeeded), and on failure
    ``rmdir`` exactly ``reversed(made_dirs)``, each only while empty; or refuse a PATH holding ``..`` components
    (``ValueError``/``OpsError``) before anything is made."""
    src = build_env(tmp_path / "src", keys(3, "a"))
    arch = Path(A.export_archive(src, NS, tmp_path / "a.tkv").out)
    spare = tmp_path / "spare"
    spare.mkdir()                                   # someone else's, empty: an import must never remove it
    new = tmp_path / "new"
    dst = new / ".." / "spare" / "tier"
    assert not new.exists() and not dst.exists()

    def progress(phase: str, done: int, total: int) -> None:
        if phase == "import":
            raise _Boom("the write pass broke off")

    with pytest.raises(_Boom):
        A.import_archive(dst, arch, progress=progress)
    assert not (spare / "tier" / "data.mdb").exists()   # all or nothing: nothing imported stays
    assert spare.is_dir() and not new.exists(), (
        f"after the failed import into {str(dst)!r}: spare/ (existed before, empty, not the import's) "
        f"{'kept' if spare.is_dir() else 'REMOVED'}; new/ (made by the import) "
        f"{'LEFT BEHIND' if new.exists() else 'removed'}")


# ============================================================================================ finding 2


_N = 10
_KEYS = [b"k%d" % i for i in range(_N)]


def _s3fifo_main_with_k0_leased() -> tuple[TierIndex, Entry, list[Any]]:
    """10 slots (small FIFO target 1): k0..k8 used once and moved to the main FIFO by a reservation of z (k9
    evicted; z's copy not landed: its slot taken, nothing in the small FIFO); k0, main's oldest, leased."""
    idx = TierIndex(_N, policy=S3FIFO(_N))
    _, new, _ = idx.reserve_absent(_KEYS, uuid.uuid4(), (), None)
    idx.publish_all(new)
    idx.ready_run(_KEYS[:9])
    assert idx.reserve(b"z", uuid.uuid4()) is not None
    p: Any = idx.policy
    assert list(p.main) == _KEYS[:9] and not p.small
    into: list[Any] = [None]
    idx.acquire(new[0], into, 0)
    return idx, new[0], into


def test_an_interrupted_s3fifo_eviction_puts_a_leased_main_entry_back_in_main() -> None:
    """What is wrong: since 3bac09d ``TierIndex._repair`` (tiered_kv/core/index.py) restores a leased entry that an
    interrupted ``S3FIFO.victim`` walk popped (``policy.leases_in_place``), through ``S3FIFO.restore``
    (tiered_kv/core/policy.py), which puts every entry whose frequency it still records "back at the cold end it was
    taken from" -- always the *small* FIFO's.  A leased entry the walk popped from the *main* FIFO (main's oldest,
    leased by a load: the walk pops it, then sets it aside in ``held_main``) lands in the small FIFO instead.  The
    uninterrupted reservation leaves k0 at main's cold end; after the interrupt (and the engine's retry) k0 is in
    the small FIFO, where the next eviction moves it to main's *hot* end (it has a use): its place in the order
    depends on whether an interrupt landed, which the round-39 fix set out to prevent ("back at the cold end it was
    taken from").

    Fix: let the victim walk record which FIFO a popped entry came from before popping (e.g. peek the key with
    ``next(iter(q))`` and move it to ``held_*`` with ``q.pop(k)`` in one C call, or keep a ``self._walking = (k,
    which)`` mark), and have ``S3FIFO.restore`` put a held entry back at the cold end of *that* FIFO (main when the
    key is main's); or, simpler, never pop a leased entry: skip entries with readers by iterating the FIFO's
    ``items()`` and popping only the one taken."""
    twin, tk0, tinto = _s3fifo_main_with_k0_leased()
    assert twin.reserve(b"y", uuid.uuid4()) is not None       # uninterrupted: k0 passed over in main
    tp: Any = twin.policy
    assert tp.main.get(b"k0") is tk0 and b"k0" not in tp.small
    twin.release_taken(tinto)
    expected = (list(tp.small), list(tp.main), dict(tp.freq))

    idx, k0, into = _s3fifo_main_with_k0_leased()
    reserve_interrupted_in_victim(idx, b"y", "main")
    p: Any = idx.policy
    where = "main" if p.main.get(b"k0") is k0 else "small" if p.small.get(b"k0") is k0 else "nowhere"
    idx.release_taken(into)
    got = (list(p.small), list(p.main), dict(p.freq))
    assert where == "main" and got == expected, (
        f"after an interrupt in S3FIFO.victim the leased k0 (taken from main) was put back in {where}; released, "
        f"small={got[0]}, main={got[1]} -- uninterrupted: small={expected[0]}, main={expected[1]}")
