"""Adversarial review, round 30, the vLLM side: 9f478f0 (shutdown unmaps the shared slab in each process:
``SlabCopier.close`` drops its mover, both ``shutdown()``s call ``SharedSlab.close``).

What it proved wrong (fixed by reverting 9f478f0 in 32f231f; the test fails on 9f478f0's tree and passes now):

1. ``test_a_disk_writer_left_behind_by_the_managers_close_never_touches_an_unmapped_slab``: with
   ``disk_io="thread"`` the disk tier's writer checksums and writes spills straight from the slab's rows (memoryviews
   of the mapping, ``SlotViews``).  ``SlabScheduler.close`` waits for them only boundedly (``CLOSE_TIMEOUT_S``,
   then ``DiskStore.close``'s ``CLOSE_JOIN_S``): a writer hung on the disk is left running, by design ("nothing it
   may still use is released until it ends", a reaper releases the rest later).  ``TieredKVOffloadingManager.
   shutdown`` then closes the slab at once, and ``SharedSlab.close``'s ``mm.close()`` unmaps it: its
   ``BufferError`` fallback ("a view is still alive somewhere") never fires, since neither ``torch.frombuffer`` nor
   these memoryviews (``writable_view`` of the tensor) hold a buffer export on the mmap.  When the disk comes back
   the writer goes on with the spills queued behind the hung batch and its xxhash reads the unmapped rows:
   SIGSEGV, the whole engine process (shown in a child process).  Before 9f478f0 the mapping stayed until exit.

Checked, found sound:
- worker shutdown before or after the manager's, each twice, in one process (the manager and the worker map the
  slab separately): no error; after the worker's shutdown ``get_finished`` returns what was left, ``submit_*``
  answers False and touches nothing (the copier is closed, its mover dropped); a report answered after the slab
  closed would meet ``mark_done`` on an empty ring list (IndexError, caught by ``_MarkThenPost``: the job fails,
  logged), never a crash;
- ``SlabCopier.close`` with jobs in flight finishes them first (``CudaMover.close`` synchronizes and harvests;
  ``ThreadMover.close`` joins its workers without a bound), so no copy of the copier runs after the unmap; an
  interrupt inside ``close`` before ``_close_done`` propagates out of ``shutdown`` before ``slab.close``.

Suspected, not shown:
- after ``SharedSlab.close`` the rings are ``[]``: ``done(seq)`` and ``ok(seq)`` answer True for every job
  (vacuously).  A scheduler call after the manager's shutdown (none in vLLM 0.32's order) would publish stores as
  copied; closing could make them raise instead;
- an interrupt inside ``SharedSlab.close`` between ``self._mm = None`` and ``mm.close()`` leaves the mapping to the
  garbage collector and a second ``close()`` returns at once (a leak until exit, not a crash);
- the remote tier's threads (``remote.store.close()`` after a bounded wait) reading slab rows for puts, and
  the same left-behind readers (a read-back's ``preadv`` into a slot, then its checksum) after the unmap.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

import test_vllm_adapter as base  # noqa: E402  (helpers only)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config  # noqa: E402
from vllm.v1.kv_offload.base import ReqContext  # noqa: E402

from test_vllm_adapter import model_dir  # noqa: E402,F401  (the fixture)

pytestmark = pytest.mark.timeout(120)

HERE = Path(__file__).resolve().parent

_CHILD = r'''
import sys, threading, faulthandler
faulthandler.enable()
here, tmp = sys.argv[1], __import__("pathlib").Path(sys.argv[2])
sys.path[:0] = [here, str(__import__("pathlib").Path(here).parent)]
import test_vllm_adapter as base
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.kv_offload.base import ReqContext
import tiered_kv.core.tiers as tiers_mod
import tiered_kv.disk.store as store_mod
from tiered_kv.disk.slots import SlotFile
tiers_mod.CLOSE_TIMEOUT_S = 0.5   # the close's bounded waits, shortened (30 s and 120 s in production)
store_mod.CLOSE_JOIN_S = 0.5
extra = base.tkv_extra(tmp, disk_path=str(tmp / "disk"), disk_bytes=64 * base.ROW_BYTES, disk_io="thread")
spec = base.make_spec(build_offloading_config(base.make_vllm_config(sys.argv[3], extra), base.make_kv_cache_config()))
mgr = spec.get_manager()
worker = spec.get_worker(base.canonical(base.new_kv(seed=30)))
entered, release = threading.Event(), threading.Event()
real_sync, calls = SlotFile.sync, [0]
def hung_sync(self):   # the writer's first fdatasync hangs (a dead disk) until released
    calls[0] += 1
    if calls[0] == 1:
        entered.set()
        release.wait(60)
    real_sync(self)
SlotFile.sync = hung_sync
job = [0]
def store(tag):
    ctx = ReqContext(req_id=tag)
    ks = base.keys(1, tag)
    out = mgr.prepare_store(ks, ctx)
    job[0] += 1
    assert worker.submit_store(job[0], base.gpu_spec([job[0]]), out.store_spec)
    worker.wait({job[0]})
    assert [r.job_id for r in worker.get_finished()] == [job[0]]
    mgr.complete_store(ks, ctx)
    mgr.on_schedule_end(base.NO_CTX)   # write-through: the block's spill is queued
store("a")
assert entered.wait(30), "the writer never reached its fdatasync"
store("b")
store("c")                             # spills queued behind the hung batch
worker.shutdown()
mgr.shutdown()                         # bounded: leaves the hung writer behind
print("shut down", flush=True)
release.set()                          # the disk answers again: the writer goes on with the queued spills
for t in [t for t in threading.enumerate() if t.name == "tiered-kv-disk-reaper"]:
    t.join(30)                         # the reaper ends once the writer did
print("survived", flush=True)
'''


def test_a_disk_writer_left_behind_by_the_managers_close_never_touches_an_unmapped_slab(
        model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """A writer hung in its fdatasync (a dead disk) with two more spills queued; worker and manager shut down as
    vLLM does (the close's bounds shortened to 0.5 s); then the disk answers.  The writer packs the queued spills:
    ``format._checksum`` (xxhash, in C) over memoryviews of slab rows that ``SharedSlab.close`` just unmapped --
    the child dies of SIGSEGV (rc -11).  With the slab left mapped (as before 9f478f0) it ends cleanly and the
    reaper releases the disk path.

    Fixed by reverting 9f478f0 (32f231f): neither side unmaps the slab at shutdown; it stays mapped until the
    process exits (a documented limit, docs/vllm.md).  Unmapping once no thread can use the rows any more would need
    the scheduler's close to say whether it left any behind; ``SharedSlab.close``'s ``BufferError`` fallback cannot
    be relied on for torch tensors or ``writable_view`` memoryviews (they hold no export on the mmap)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(HERE), str(tmp_path), model_dir],
                          capture_output=True, text=True, timeout=100)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert "shut down" in proc.stdout, tail
    assert proc.returncode == 0 and "survived" in proc.stdout, f"rc {proc.returncode}: {tail}"


def test_shutdown_in_either_order_twice_and_calls_after_it_touch_nothing(model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    for worker_first in (True, False):
        extra = base.tkv_extra(tmp_path / str(worker_first))
        (tmp_path / str(worker_first)).mkdir()
        spec = base.make_spec(build_offloading_config(base.make_vllm_config(model_dir, extra),
                                                      base.make_kv_cache_config()))
        mgr = spec.get_manager()
        worker = spec.get_worker(base.canonical(base.new_kv(seed=31)))
        ctx = ReqContext(req_id="r")
        ks = base.keys(1, "order")
        out = mgr.prepare_store(ks, ctx)
        assert worker.submit_store(1, base.gpu_spec([1]), out.store_spec)   # left in flight at shutdown
        first, second = (worker, mgr) if worker_first else (mgr, worker)
        first.shutdown()
        second.shutdown()
        first.shutdown()
        second.shutdown()
        assert [r.job_id for r in worker.get_finished()] == [1]
        assert worker.get_finished() == []
        assert worker.submit_store(2, base.gpu_spec([2]), out.store_spec) is False
        worker.wait({2})
