"""Third adversarial review of the owner-side core (TierCore, TierIndex, DiskTier) and its per-batch front
end (TierManager).

Each test failed before its fix.  Interleavings are forced with :class:`~fakes.FakeMover` (copies answered only
when the test says, in any order), test_review_core2's ``FakeRemoteStore`` (a server answering probes and
fetches on command) and reports put on the completion queue by hand; nothing sleeps for ordering.

What it proved wrong: a store that is not made (host full, admission refused) still drops the fetch of its
key, so the block reaches no tier; one malformed worker report raises out of ``poll()`` and loses every
report drained with it (a live job is never reported); the constructor lets a bad ``registry`` or
``mover_factory`` escape as AttributeError/TypeError; docs/architecture.md says ``close()`` takes the
metrics off the registry, which it does not.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_fake_manager
from test_review_core2 import FakeRemoteStore, blob, decode, fake_remote, fill, open_remote_manager  # noqa: F401
from tiered_kv import JobKind, JobState, TierManager
from tiered_kv.errors import TieredKVError
from tiered_kv.movers import Report

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "docs" / "architecture.md"


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


# ============================================================================ a worker's malformed answer
@pytest.mark.parametrize("kind", [None, "copy"], ids=["no-kind", "foreign-kind"])
def test_a_malformed_report_neither_raises_in_poll_nor_loses_the_reports_drained_with_it(fake: Any, kv: torch.Tensor,
                                                                                          kind: Any) -> None:
    """DESIGN.md, "Jobs and tokens": a completion whose token is unknown "is discarded: never raised, always
    counted in tiered_kv_stale_callbacks_total".  The project holds a foreign or broken worker's answer to
    that (tests/test_review_jobs.py: a token that is no UUID is counted ``unknown_token``).  A broken
    worker's report with an unknown token and no kind it knows (``None``, ``"copy"``) is looked up in the stale counter's
    children by ``(r.kind, reason)`` (tiers.py ``TierCore.stale``) and raises KeyError in the engine's
    ``poll()``.  Worse, ``apply_arrived`` had drained the queue into a list: every report behind the bad
    one in that list is dropped on the floor, so a live store is never reported (its slot stays leased,
    ``wait()`` on it would hang until its timeout)."""
    mgr, mover = fake
    fill_row(kv, 0, b"a")
    job = mgr.store(b"a", 0)
    assert job is not None
    mover.completions.put(Report(uuid.uuid4(), kind, True))   # a broken worker's answer
    mover.complete(job)                                       # the store's own report, right behind it
    out = []
    for _ in range(3):
        out += mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, True)]
    assert job.state is JobState.DONE and mgr.jobs_in_flight == 0


# ============================================================================ a store that supersedes a fetch
@pytest.mark.parametrize("call", ["store", "store_many"])
@pytest.mark.parametrize("cause", ["host_full", "admission"])
def test_a_store_not_made_leaves_the_keys_fetch_alone(fake_remote: list[FakeRemoteStore], call: str,
                                                      cause: str) -> None:
    """The engine's own block wins over a fetch of its key in flight -- *when it is stored*
    (docs/architecture.md, lifecycle: "a store supersedes a fetch"; commit 0c35375 and
    test_review_core2's ``test_a_store_shed_at_the_inflight_limit_leaves_the_keys_fetch_alone`` hold the
    same rule at ``max_inflight_jobs``).  Two other ways a store is not made come after the fetch was
    superseded: every host slot leased (shed ``host_full``), and the host admission filter refusing the key
    (invariant 21: "Admission never costs a block already stored" -- here it costs the block the server
    was sending).  Either way the fetch's part is discarded when it lands and the engine's block is not
    stored: ``b"r"``, held by the server and offered by the engine, is in no tier afterwards."""
    if cause == "host_full":
        mgr, mover, kv = open_remote_manager(host_slots=2)
    else:
        mgr, mover, kv = open_remote_manager(host_slots=4, host_admission="second_hit")
    remote = fake_remote[0]
    remote.held[b"r"] = (None, blob(b"r", 1))
    try:
        assert mgr.lookup([b"r"]) == 0            # wanted: the step's probe goes out at the next pass
        mgr.poll()
        remote.answer_read()                      # the probe: the server holds it
        mgr.poll()                                # the fetch: a host slot reserved, its read in flight
        assert mgr._core.n_in_flight[JobKind.FETCH] == 1
        if cause == "host_full":                  # the other slot: a store whose copy is in flight
            fill(kv, 0, b"other", 1)
            assert mgr.store(b"other", 0) is not None
        fill(kv, 1, b"r", 2)
        job = mgr.store(b"r", 1) if call == "store" else mgr.store_many([b"r"], [1])
        assert job is None                        # not made (shed host_full / refused by admission)
        assert mgr._core.index.get(b"r") is not None, "the store was not made, yet the fetch was dropped"
        remote.answer_read()                      # the fetch lands
        mover.complete_all()
        mgr.poll()
        got = mgr.host_bytes(b"r")
        assert got is not None and decode(got.numpy().tobytes()) == (b"r", 1), "b'r' reached no tier"
    finally:
        while remote.reads:
            remote.answer_read(0, fault=True)
        remote.answer_puts()                      # the other store's write-through (close() would wait it out)
        mgr.close()


# ============================================================================ the constructor's arguments
@pytest.mark.parametrize("registry", [object(), "tiered_kv", 9477], ids=["object", "str", "int"])
def test_a_registry_that_is_not_a_collector_registry_is_refused_naming_it(kv: torch.Tensor, registry: Any) -> None:
    """docs/architecture.md invariant 18 ("Errors before state: a bad argument raises an error from
    tiered_kv.errors naming the value") and manager.py's module docstring ("either does what it says or
    raises an error from tiered_kv.errors before touching any state").  The constructor refuses a config
    that is no TieredKVConfig (ConfigError) and a bad device tensor (DeviceTensorError), but a ``registry``
    that is not a CollectorRegistry escapes as prometheus_client's AttributeError."""
    with pytest.raises(TieredKVError, match="registry"):
        TierManager(make_config(8), kv, registry=registry)


def test_a_mover_factory_that_is_not_callable_is_refused_naming_it(kv: torch.Tensor) -> None:
    """The same boundary rule for ``mover_factory``: a string where a factory was meant is a caller's
    mistake the constructor should name (it does clean up the slab and the registry; the error is the
    wrong kind and does not name the argument)."""
    reg = CollectorRegistry()
    with pytest.raises(TieredKVError, match="mover_factory"):
        TierManager(make_config(8), kv, registry=reg, mover_factory="threads")   # type: ignore[arg-type]


# ============================================================================ docs against the code
def test_architecture_doc_says_what_close_does_to_the_registry(kv: torch.Tensor) -> None:
    """docs/architecture.md, "Metrics on the hot path": "After any poll(), wait(), flush() or close()
    returns ..., the registry is exact (`close()` then takes the manager's metrics off it:
    `Metrics.close`)".  The code (manager.py ``close`` -> ``self.metrics.closed()``) and
    docs/observability.md say the opposite: the final counts stay readable on the registry until the
    caller's own ``mgr.metrics.close()``, and a second manager on the same registry is refused until then.
    Whichever is meant, the architecture page must say what close() does."""
    reg = CollectorRegistry()
    mgr, _ = make_fake_manager(make_config(8), kv, reg)
    mgr.close()
    text = _norm(ARCH.read_text(encoding="utf-8"))
    claims_off = "`close()` then takes the manager's metrics off it" in text
    still_there = sorted({f.name for f in reg.collect() if f.name.startswith("tiered_kv_")})
    assert not (claims_off and still_there), (
        f"architecture.md says close() takes the metrics off the registry; after close() it still exports "
        f"{len(still_there)} tiered_kv families, e.g. {still_there[:3]}")
