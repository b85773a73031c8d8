"""Adversarial review of the vLLM adapter, third pass: the front end (tiered_kv/integrations/vllm.py), its
scheduler and worker halves (scheduler.py, copier.py) and the shared slab (slab.py), driven the way vLLM
0.32's OffloadingConnector calls them (vllm/distributed/kv_transfer/kv_connector/v1/offloading/).

What it proved wrong (each test failed before its fix):

* a worker process started again after the scheduler dropped the slab's name made a new, empty slab and
  reported loads out of it as successful (zeros in the engine's KV): the scheduler now writes its token
  prefix into the slab as its owner, and the vLLM worker fails every job its slab's owner did not make;
* ``_follow`` linked a key to the request's previous key across a gap (a lookup past a grown GPU prefix hit, a
  store that skipped a block): it links only the block right before it;
* ``shm_dir`` was taken unchecked (a missing directory, or None) and failed later in every process, without
  naming the key;
* a bad ``eviction_policy`` was refused naming ``host_policy``;
* under data parallelism ``disk_path`` was checked after the replica's ``dp<i>`` suffix was joined on, so
  ``""`` or ``5`` became a relative directory;
* ``host_bytes`` and ``cpu_bytes_to_use`` that disagreed: the second was dropped without a word.

Each forces its interleaving by the order of its calls; nothing is ordered by sleeping, every directory is a
temp one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

import test_vllm_adapter as base  # noqa: E402  (helpers only: no test is re-collected from here)
from test_adapter_regressions import _at, _chain_keys, _fresh_cfg, _parallel  # noqa: E402  (helpers only)
from test_vllm_adapter import (  # noqa: E402
    ROW_BYTES,
    Pair,
    block_bytes,
    canonical,
    gpu_spec,
    keys,
    make_spec,
    new_kv,
    offloading_config,
    tkv_extra,
)
from tiered_kv.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.timeout(60)

model_dir = base.model_dir  # the module-scoped tiny-Llama config fixture


def _spec_error(model_dir: str, tmp_path: Path, **over: Any) -> str:
    """The ConfigError vLLM's spec creation raises for ``over`` (pytest.fail when the spec is accepted)."""
    extra = tkv_extra(tmp_path)
    extra.update(over)   # (tkv_extra drops None values; a None written by the user is kept here)
    try:
        spec = OffloadingSpecFactory.create_spec(offloading_config(model_dir, extra))
    except ConfigError as exc:
        return str(exc)
    pytest.fail(f"{over} accepted at spec creation (spec.shm_dir={spec.shm_dir!r})")


# ============================================================================= a worker process restart
def test_a_restarted_worker_never_reports_a_load_from_a_slab_the_scheduler_never_wrote(model_dir: str,
                                                                                      tmp_path: Path) -> None:
    """vLLM's order: the workers map the slab, then the scheduler attaches and unlinks its name
    (TieredKVOffloadingManager.__init__).  A worker process that starts again later (a respawned worker, a
    re-registration) opens ``slab_path(engine_id)``, finds no file and silently creates a new, empty slab of the
    same geometry.  The scheduler still hands out slots of *its* slab: the restarted worker copies the new slab's
    zeros into the engine's KV blocks and reports the load successful, so vLLM computes on wrong KV (the rings
    cannot catch it: the scheduler only waits on them, the worker's report already released the request).
    Expected: the load fails loudly (refused or reported failed), or the stored bytes land."""
    cfg = offloading_config(model_dir, tkv_extra(tmp_path))
    kv = new_kv(seed=71)
    p = Pair(cfg, kv, worker_first=True)
    w2 = None
    try:
        ctx = ReqContext(req_id="r")
        ks = keys(2, "restart")
        p.store(ks, [1, 2], ctx)
        want = [block_bytes(kv, b) for b in (1, 2)]
        p.worker.shutdown()                                   # the worker process goes away ...
        try:
            w2 = make_spec(dataclasses.replace(cfg)).get_worker(canonical(kv))   # ... and registers again
        except ConfigError:
            return                                            # refused at start: no wrong bytes can follow
        assert [p.mgr.lookup(k, ctx) for k in ks] == [LookupResult.HIT] * 2
        src = p.mgr.prepare_load(ks, ctx)
        try:
            submitted = w2.submit_load(900, src, gpu_spec([40, 41]))
        except Exception:   # noqa: BLE001 - refusing the job loudly is one right answer
            return
        assert submitted
        w2.wait({900})
        (res,) = w2.get_finished()
        assert not res.success or [block_bytes(kv, b) for b in (40, 41)] == want, (
            "the restarted worker reported a successful load of bytes nobody stored")
    finally:
        if w2 is not None:
            w2.shutdown()
        p.mgr.shutdown()


# ============================================================================= _follow: prefix chains
def test_follow_links_a_key_only_to_the_block_right_before_it(model_dir: str, tmp_path: Path) -> None:
    """_follow's contract (its docstring): link ``k`` to "the block before it".  vLLM's lookups start at the GPU
    prefix-cache hit (OffloadingConnectorScheduler._maximal_prefix_lookup from ``num_computed_tokens``), and that
    hit can grow between two lookups of one request: step N asks chunks 1..2 (the second on disk: HIT_PENDING,
    the request deferred), another request meanwhile computes the prefix on the GPU, step N+1 asks from chunk 4
    on.  Stores skip chunks too (``_build_store_jobs`` drops ``block_id == 0``).  vLLM records every key's end
    token (ReqContext.set_offload_key_position), so the gap is visible: chunk 4 ends 3 blocks after chunk 1 and
    is no child of it.  Linked anyway, the prefix policy keeps chunk 1 as the parent of a block that is
    unreachable through it."""
    p = Pair(offloading_config(model_dir, tkv_extra(tmp_path, host_policy="prefix")), new_kv(seed=72))
    try:
        ks = _chain_keys("gap", 4)
        ctx = ReqContext(req_id="r")
        _at(ctx, ks)                                  # ks[i] ends at (i + 1) * BS tokens
        p.store([ks[0]], [1], ctx)
        p.store([ks[3]], [4], ctx)                    # ks[1], ks[2] never seen by the manager in this request
        pol = p.mgr.tiers.core.index.policy
        assert pol.nodes[ks[3]].parent != ks[0], "ks[3] recorded as the child of ks[0], three blocks before it"
    finally:
        p.close()


# ============================================================================= config validation
@pytest.mark.parametrize("shm_dir", ["/nonexistent/tkv-shm", None], ids=["missing-dir", "None"])
def test_a_bad_shm_dir_is_refused_at_spec_creation_naming_the_key(model_dir: str, tmp_path: Path,
                                                                  shm_dir: Any) -> None:
    """docs/vllm.md: "a bad value raises ConfigError naming the key and the value when vLLM creates the spec,
    before it starts its workers".  ``shm_dir`` is one of the keys (OPTIONS); a directory that does not exist, or
    None (JSON null, str() makes it the relative directory 'None'), is accepted and the slab open fails later,
    in the worker and EngineCore processes."""
    msg = _spec_error(model_dir, tmp_path, shm_dir=shm_dir)
    assert "shm_dir" in msg and repr(shm_dir) in msg, msg


def test_a_bad_eviction_policy_is_refused_naming_eviction_policy(model_dir: str, tmp_path: Path) -> None:
    """vLLM's own ``eviction_policy`` key is accepted as ``host_policy`` (docs/vllm.md); a bad value must be
    refused naming the key the user wrote, as the size options are ("naming the key the user wrote",
    test_vllm_adapter's cpu_bytes_to_use cases).  Today: "host_policy must be one of ..., got 'mru'"."""
    msg = _spec_error(model_dir, tmp_path, eviction_policy="mru")
    assert "eviction_policy" in msg and "'mru'" in msg, msg


@pytest.mark.parametrize("disk_path", ["", 5], ids=["empty", "int"])
def test_disk_path_is_checked_before_the_data_parallel_suffix(model_dir: str, tmp_path: Path, disk_path: Any) -> None:
    """Without data parallelism ``disk_path=""`` is refused ("disk_path must not be empty") and ``disk_path=5``
    ("must be a path or None"); with data_parallel_size=2 the same values are accepted as the relative directory
    'dp0' / '5/dp0' in the engine's working directory: a config's validity depends on the DP size."""
    extra = tkv_extra(tmp_path, disk_bytes=64 * ROW_BYTES)
    extra["disk_path"] = disk_path
    with pytest.raises(ConfigError, match="disk_path"):
        make_spec(_fresh_cfg(model_dir, extra))      # DP 1: refused naming disk_path (holds today)
    cfg = _parallel(_fresh_cfg(model_dir, extra), data_parallel_index=0, data_parallel_size=2)
    try:
        spec = make_spec(cfg)
    except ConfigError as exc:
        assert "disk_path" in str(exc), str(exc)
        return
    pytest.fail(f"disk_path={disk_path!r} accepted under DP=2 as {spec.tkv_config.disk_path!r}")


def test_host_bytes_and_cpu_bytes_to_use_that_disagree_are_refused(model_dir: str, tmp_path: Path) -> None:
    """Two names for one option (docs/vllm.md: ``host_bytes``, "``cpu_bytes_to_use`` is accepted too") that
    disagree: the spec sizes the slab by one and drops the other without a word (here 64 blocks instead of the
    8 the vLLM key asks for).  vllm.py refuses the analogous eviction_policy/host_policy disagreement."""
    msg = _spec_error(model_dir, tmp_path, host_bytes=64 * ROW_BYTES, cpu_bytes_to_use=8 * ROW_BYTES)
    assert "cpu_bytes_to_use" in msg and "host_bytes" in msg, msg
