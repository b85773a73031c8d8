"""Metrics of the core (device <-> host) on an injected registry."""

from __future__ import annotations

import re
import uuid

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from fakes import fill_row, make_config, make_fake_manager, make_kv, metric_samples, sample
from tiered_kv import JobKind, TierManager

ALLOWED_LABELS = {"tier", "kind", "reason", "outcome", "src", "dst", "error", "namespace"}


def _stored(mgr, mover, kv, key, row):
    fill_row(kv, row, key)
    j = mgr.store(key, row)
    mover.complete(j)
    assert [c.ok for c in mgr.poll()] == [True]
    return j


def test_two_managers_on_two_registries_do_not_collide(kv):
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    kv2 = make_kv(16, seed=3)
    m1, f1 = make_fake_manager(make_config(8), kv, r1)
    m2, f2 = make_fake_manager(make_config(8), kv2, r2)   # same namespace, same metric names
    try:
        assert m1.metrics.registry is r1 and m2.metrics.registry is r2
        _stored(m1, f1, kv, b"a", 0)
        _stored(m1, f1, kv, b"b", 1)
        assert sample(r1, "tiered_kv_jobs_total", kind="store", outcome="ok") == 2
        assert sample(r2, "tiered_kv_jobs_total", kind="store", outcome="ok") == 0
        assert sample(r1, "tiered_kv_tier_capacity_bytes", tier="device") == kv.shape[0] * 128
        assert sample(r2, "tiered_kv_tier_capacity_bytes", tier="device") == 16 * 128
    finally:
        m1.close()
        m2.close()


def test_default_registry_is_private_not_the_global_one(kv):
    before = {m.name for m in prometheus_client.REGISTRY.collect()}
    m1 = TierManager(make_config(4), kv)
    m2 = TierManager(make_config(4), kv)   # would raise "Duplicated timeseries" on a shared registry
    try:
        assert m1.metrics.registry is not prometheus_client.REGISTRY
        assert m1.metrics.registry is not m2.metrics.registry
        after = {m.name for m in prometheus_client.REGISTRY.collect()}
        assert not {n for n in after - before if n.startswith("tiered_kv")}
        assert sample(m1.metrics.registry, "tiered_kv_info", namespace="test|fp16|tp0") == 1
    finally:
        m1.close()
        m2.close()


def test_names_prefix_base_units_and_bounded_labels(fake):
    mgr, _ = fake
    fams = list(mgr.metrics.registry.collect())
    assert fams, "no metric registered"
    for fam in fams:
        assert fam.name.startswith("tiered_kv_"), fam.name
        assert not re.search(r"_(ms|milliseconds|us|microseconds|kb|kib|mb|mib|gb|gib)(_|$)", fam.name), fam.name
        for s in fam.samples:
            extra = set(s.labels) - ALLOWED_LABELS - {"le"}
            assert not extra, f"{s.name} has unbounded/unknown labels {extra}"
    names = {f.name for f in fams}
    for required in ("tiered_kv_stale_callbacks", "tiered_kv_jobs", "tiered_kv_jobs_in_flight",
                     "tiered_kv_transfer_bytes", "tiered_kv_transfer_seconds", "tiered_kv_tier_used_bytes",
                     "tiered_kv_tier_capacity_bytes", "tiered_kv_tier_blocks", "tiered_kv_lookup_hits",
                     "tiered_kv_evictions"):
        assert required in names, f"missing {required} in {sorted(names)}"


def test_jobs_total_and_transfer_metrics_reflect_what_happened(kv, registry):
    mgr, mover = make_fake_manager(make_config(8, max_inflight_jobs=64), kv, registry)
    rb = 128
    # three stores ok
    for i, k in enumerate((b"a", b"b", b"c")):
        _stored(mgr, mover, kv, k, i)
    # one store cancelled, one failed
    fill_row(kv, 10, b"x")
    jx = mgr.store(b"x", 10)
    mgr.cancel(jx)
    fill_row(kv, 11, b"y")
    jy = mgr.store(b"y", 11)
    mover.fail(jy)
    mover.complete(jx)
    mgr.poll()
    # two loads ok, one cancelled, one failed
    for row in (20, 21):
        j = mgr.load(b"a", row)
        mover.complete(j)
    jc = mgr.load(b"b", 22)
    mgr.cancel(jc)
    jf = mgr.load(b"c", 23)
    mover.fail(jf)
    mover.complete(jc)
    out = mgr.poll()
    assert sorted(c.ok for c in out) == [False, False, True, True]

    s = lambda name, **kw: sample(registry, name, **kw)  # noqa: E731
    assert s("tiered_kv_jobs_total", kind="store", outcome="ok") == 3
    assert s("tiered_kv_jobs_total", kind="store", outcome="cancelled") == 1
    assert s("tiered_kv_jobs_total", kind="store", outcome="failed") == 1
    assert s("tiered_kv_jobs_total", kind="load", outcome="ok") == 2
    assert s("tiered_kv_jobs_total", kind="load", outcome="cancelled") == 1
    assert s("tiered_kv_jobs_total", kind="load", outcome="failed") == 1
    assert s("tiered_kv_transfer_bytes_total", src="device", dst="host") == 3 * rb
    assert s("tiered_kv_transfer_bytes_total", src="host", dst="device") == 2 * rb
    assert s("tiered_kv_transfer_seconds_count", src="device", dst="host") == 3
    assert s("tiered_kv_transfer_seconds_count", src="host", dst="device") == 2
    assert s("tiered_kv_transfer_seconds_sum", src="device", dst="host") == pytest.approx(3e-4)
    assert s("tiered_kv_errors_total", tier="host", error="copy_failed") == 1
    assert s("tiered_kv_errors_total", tier="device", error="copy_failed") == 1
    assert s("tiered_kv_stale_callbacks_total", kind="store", reason="cancelled") == 1
    assert s("tiered_kv_stale_callbacks_total", kind="load", reason="cancelled") == 1
    mgr.close()


def test_shed_counted_as_job_outcome(kv, registry):
    mgr, mover = make_fake_manager(make_config(2, max_inflight_jobs=3), kv, registry)
    for i in range(2):
        fill_row(kv, i, b"k%d" % i)
        assert mgr.store(b"k%d" % i, i) is not None
    fill_row(kv, 2, b"k2")
    assert mgr.store(b"k2", 2) is None            # both slots leased to writers: host_full
    mgr.poll()                                    # counters are up to date after poll()
    assert sample(registry, "tiered_kv_jobs_total", kind="store", outcome="shed") == 1
    mover.complete_all()
    mgr.poll()
    assert mgr.load(b"k0", 5) is not None
    assert mgr.load(b"k0", 6) is not None
    assert mgr.load(b"k1", 7) is not None
    assert mgr.load(b"k1", 8) is None             # 3 jobs in flight: inflight_limit
    mgr.poll()
    assert sample(registry, "tiered_kv_jobs_total", kind="load", outcome="shed") == 1
    mgr.close()


def test_tier_gauges_after_poll(fake, kv, registry):
    mgr, mover = fake
    rb = 128
    assert sample(registry, "tiered_kv_tier_capacity_bytes", tier="host") == mgr.num_host_slots * rb
    assert sample(registry, "tiered_kv_tier_capacity_bytes", tier="device") == kv.shape[0] * rb
    assert sample(registry, "tiered_kv_tier_used_bytes", tier="host") == 0
    for i in range(5):
        _stored(mgr, mover, kv, b"g%d" % i, i)
    fill_row(kv, 9, b"pending")
    jp = mgr.store(b"pending", 9)
    mgr.poll()
    assert mgr.host_used_slots == 6 and mgr.host_blocks == 6
    assert sample(registry, "tiered_kv_tier_used_bytes", tier="host") == 6 * rb
    assert sample(registry, "tiered_kv_tier_blocks", tier="host") == 6
    mgr.invalidate(b"g0")
    mgr.cancel(jp)       # slot still leased until the worker reports
    mgr.poll()
    assert sample(registry, "tiered_kv_tier_blocks", tier="host") == 4
    assert sample(registry, "tiered_kv_tier_used_bytes", tier="host") == 5 * rb
    mover.complete(jp)
    mgr.poll()
    assert sample(registry, "tiered_kv_tier_used_bytes", tier="host") == 4 * rb
    assert sample(registry, "tiered_kv_healthy", tier="host") == 1
    assert sample(registry, "tiered_kv_healthy", tier="device") == 1


def test_jobs_in_flight_gauge(fake, kv, registry):
    mgr, mover = fake
    _stored(mgr, mover, kv, b"a", 0)
    fill_row(kv, 1, b"b")
    fill_row(kv, 2, b"c")
    mgr.store(b"b", 1)
    jc = mgr.store(b"c", 2)
    jl = mgr.load(b"a", 3)
    mgr.cancel(jc)
    mgr.poll()
    assert sample(registry, "tiered_kv_jobs_in_flight", kind="store") == 2   # the cancelled one too
    assert sample(registry, "tiered_kv_jobs_in_flight", kind="load") == 1
    assert mgr.jobs_in_flight == 3
    mover.complete_all("lifo")
    mgr.poll()
    assert sample(registry, "tiered_kv_jobs_in_flight", kind="store") == 0
    assert sample(registry, "tiered_kv_jobs_in_flight", kind="load") == 0
    assert jl.done and mgr.jobs_in_flight == 0


def test_lookup_hits_and_evictions(kv, registry):
    mgr, mover = make_fake_manager(make_config(3), kv, registry)
    for i, k in enumerate((b"a", b"b", b"c")):
        _stored(mgr, mover, kv, k, i)
    assert mgr.lookup([b"a", b"b", b"zz", b"c"]) == 2
    assert mgr.lookup([b"c"]) == 1
    assert mgr.lookup([b"zz", b"a"]) == 0
    assert mgr.lookup([]) == 0
    mgr.poll()                                    # counters are up to date after poll()
    assert sample(registry, "tiered_kv_lookup_hits_total", tier="host") == 3
    # LRU after the lookups (oldest first): a, b, c -- a lookup that stops at a miss touches only the hits
    _stored(mgr, mover, kv, b"d", 3)
    assert sample(registry, "tiered_kv_evictions_total", tier="host") == 1
    assert mgr.lookup([b"a"]) == 0 and mgr.lookup([b"b"]) == 1   # now c, d, b
    _stored(mgr, mover, kv, b"e", 4)
    assert sample(registry, "tiered_kv_evictions_total", tier="host") == 2
    assert mgr.lookup([b"c"]) == 0 and mgr.lookup([b"b", b"d", b"e"]) == 3
    mgr.poll()
    assert sample(registry, "tiered_kv_lookup_hits_total", tier="host") == 3 + 1 + 3
    mgr.close()


def test_lookup_keys_total_counts_every_key_asked_for(fake, kv, registry):
    """HELP of tiered_kv_lookup_keys_total: "Keys asked for by lookup()"."""
    mgr, mover = fake
    _stored(mgr, mover, kv, b"a", 0)
    mgr.lookup([b"a", b"x", b"y", b"z"])   # 4 keys asked for, 1 hit
    mgr.lookup([b"q", b"r"])               # 2 keys asked for, 0 hits
    mgr.poll()
    fam = {f.name: f for f in registry.collect()}["tiered_kv_lookup_keys"]
    assert "asked" in fam.documentation
    assert sample(registry, "tiered_kv_lookup_keys_total") == 6
    assert sample(registry, "tiered_kv_lookup_hits_total", tier="host") == 1


def test_stale_callbacks_by_reason(fake, kv, registry):
    mgr, mover = fake
    s = lambda **kw: sample(registry, "tiered_kv_stale_callbacks_total", **kw)  # noqa: E731
    mover.inject(uuid.uuid4(), JobKind.LOAD)
    fill_row(kv, 1, b"c")
    jc = mgr.store(b"c", 1)
    mgr.cancel(jc)
    fill_row(kv, 2, b"s")
    js = mgr.store(b"s", 2)
    mgr.invalidate(b"s")
    fill_row(kv, 3, b"r")
    jr = mgr.store(b"r", 3)
    mgr.free_block(3)
    mover.complete_all("random")
    mgr.poll()
    assert s(kind="load", reason="unknown_token") == 1
    assert s(kind="store", reason="cancelled") == 1
    assert s(kind="store", reason="superseded") == 1
    assert s(kind="store", reason="source_reused") == 1
    assert all(j.done for j in (jc, js, jr))


def test_metrics_unchanged_by_read_only_views(fake, kv, registry):
    mgr, mover = fake
    _stored(mgr, mover, kv, b"a", 0)
    before = metric_samples(registry)
    mgr.debug_sizes(), mgr.jobs_in_flight, mgr.host_used_slots, mgr.host_blocks, mgr.host_bytes(b"a")
    assert metric_samples(registry) == before


# --- batched histogram observations (Metrics.flush buckets them before adding) ----------------------

_SECONDS = [0.0, 25e-6, 25e-6 + 1e-12, 7e-5, 1e-4, 3e-4, 3e-4, 0.0049, 0.005, 0.02, 0.7, 2.5, 2.6, 1e9, -1.0]


def _histogram_samples(registry, name):
    return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                  for m in registry.collect() for s in m.samples
                  if s.name.startswith(name) and not s.name.endswith("_created"))


def _assert_same_exposition(batched, direct) -> None:
    for name in ("tiered_kv_transfer_seconds", "tiered_kv_jobs_total", "tiered_kv_transfer_bytes_total"):
        got, want = _histogram_samples(batched.registry, name), _histogram_samples(direct.registry, name)
        assert [g[:2] for g in got] == [w[:2] for w in want], name
        for g, w in zip(got, want):  # counts exact; a _sum may differ in the last bit (added per batch)
            assert g[2] == (pytest.approx(w[2], rel=1e-12) if g[0].endswith("_sum") else w[2]), g


@pytest.mark.parametrize("per_flush", [1, 3, len(_SECONDS)])
def test_batched_observations_expose_what_one_observe_each_would(per_flush):
    """Bucketing in flush() (bisect, one add per bucket) exposes the same samples, edges included."""
    from tiered_kv.metrics import Metrics
    batched, direct = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    link = ("device", "host")
    for i in range(0, len(_SECONDS), per_flush):
        for v in _SECONDS[i:i + per_flush]:
            batched.moved(JobKind.STORE, link, 100, v)
            direct.link_seconds[link].observe(v)
            direct.job_outcome[(JobKind.STORE, "ok")].inc()
            direct.link_bytes[link].inc(100)
        batched.flush()
    _assert_same_exposition(batched, direct)
    assert sample(batched.registry, "tiered_kv_transfer_seconds_count", src="device", dst="host") == len(_SECONDS)


@pytest.mark.parametrize("per_flush", [1, 4])
def test_a_job_of_several_blocks_is_counted_and_observed_once_per_block(per_flush):
    """``moved(..., n)`` (a spill job's blocks) exposes what ``n`` jobs of one block each would."""
    from tiered_kv.metrics import Metrics
    batched, direct = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    link = ("host", "disk")
    seconds = [(3e-4, 3), (0.005, 64), (2.5, 1), (7e-5, 2)]
    for i in range(0, len(seconds), per_flush):
        for v, n in seconds[i:i + per_flush]:
            batched.moved(JobKind.SPILL, link, 100 * n, v, n)
            for _ in range(n):
                direct.link_seconds[link].observe(v)
                direct.job_outcome[(JobKind.SPILL, "ok")].inc()
                direct.link_bytes[link].inc(100)
        batched.flush()
    _assert_same_exposition(batched, direct)
    assert sample(batched.registry, "tiered_kv_transfer_seconds_count", src="host", dst="disk") == 70


def test_batched_observations_fall_back_to_observe_without_the_bucket_layout():
    """A histogram child without prometheus_client's _buckets/_sum layout gets plain observe() calls."""
    from tiered_kv.metrics import Metrics, _bucket_bounds

    class Child:
        def __init__(self):
            self.seen = []

        def observe(self, v):
            self.seen.append(v)

    m = Metrics(CollectorRegistry())
    child = Child()
    assert _bucket_bounds(child) is None
    assert _bucket_bounds(m.transfer_seconds) is None           # the labelled parent is not observable
    assert _bucket_bounds(m.link_seconds[("host", "disk")]) is not None
    for v in (0.1, 0.2, 0.3):
        m.observe(child, v)
    m.flush()
    assert child.seen == [0.1, 0.2, 0.3]
    m.link_seconds[("host", "disk")] = child        # a job of two blocks: observed twice
    m.moved(JobKind.SPILL, ("host", "disk"), 0, 0.5, 2)
    m.flush()
    assert child.seen == [0.1, 0.2, 0.3, 0.5, 0.5]
    m.moved(JobKind.SPILL, ("host", "disk"), 0, 0.25, 2)
    m.observe(child, 0.75)
    m.flush()
    assert child.seen == [0.1, 0.2, 0.3, 0.5, 0.5, 0.25, 0.25, 0.75]
