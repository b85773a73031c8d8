"""Prometheus metrics of one manager, on a registry the host process passes in.

Names carry the ``tiered_kv_`` prefix and base units; labels are bounded
(tier, kind, reason, outcome, src, dst, error).  A fresh private
:class:`~prometheus_client.CollectorRegistry` is used when none is given, so
no global state is created at import time and tests never collide.

Children for the label values used on the engine thread's hot path are bound
once here, so an update is one ``inc()``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from .jobs import JobKind, StaleReason

__all__ = ["Metrics", "sample_total", "TIERS", "OUTCOMES", "SHED_REASONS", "CORRUPT_REASONS", "ERROR_KINDS",
           "REFUSED_REASONS"]

TIERS = ("device", "host", "disk")
OUTCOMES = ("ok", "failed", "cancelled", "shed")
SHED_REASONS = ("inflight_limit", "host_full", "disk_full", "backpressure", "disk_down", "remote_down",
                "evicted_unwritten")
# label values known in advance, exported at 0 from the start (dashboards and alerts see a series)
CORRUPT_REASONS = ("truncated", "bad_magic", "bad_version", "wrong_namespace", "wrong_key", "wrong_length",
                   "checksum", "recovery", "foreign", "bad_flags", "bad_slot", "slot_entry")
ERROR_KINDS = (("device", "copy_failed"), ("host", "copy_failed"), ("disk", "copy_failed"),
               ("disk", "open_failed"), ("disk", "flush_failed"), ("disk", "writer_died"), ("disk", "sync_failed"),
               ("disk", "map_full"), ("disk", "disk_full"), ("disk", "read_only"), ("disk", "io_error"),
               ("disk", "lmdb_error"), ("disk", "writer_error"), ("disk", "slots_exhausted"), ("disk", "reader_error"),
               ("disk", "io_process_died"), ("disk", "io_process_restart_failed"), ("disk", "io_process_start_failed"))
# one block's share of a copy: a batched device<->host copy gives a few microseconds per block, a remote round
# trip up to seconds
_LATENCY_BUCKETS = (1e-6, 2.5e-6, 5e-6, 10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
                    50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LINKS = (("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"), ("host", "remote"),
          ("remote", "host"))
_KINDS = tuple(JobKind)
REFUSED_REASONS = ("tomb", "token")
# what verify_entry can say of a remote value (the disk's reasons less those of recovery), and a value of another
# type than a string under a block's name
REMOTE_CORRUPT_REASONS = tuple(r for r in CORRUPT_REASONS if r not in ("recovery", "foreign")) + ("wrong_type",)


def _bucket_bounds(child: Any) -> Optional[tuple[float, ...]]:
    """A histogram child's upper bounds when its buckets can be added to directly, else None."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    if (isinstance(bounds, (list, tuple)) and isinstance(buckets, list) and len(bounds) == len(buckets)
            and bounds and bounds[-1] == float("inf") and all(hasattr(b, "inc") for b in buckets)
            and hasattr(getattr(child, "_sum", None), "inc") and callable(getattr(child, "_is_observable", None))
            and child._is_observable()):
        return tuple(float(b) for b in bounds)
    return None


def _adder(child: Any) -> Callable[[float], None]:
    """How :meth:`Metrics.flush` adds a batched count to a counter child: its value's own ``inc`` when the
    child has prometheus_client's layout (``_value``; what ``Counter.inc`` does for a count >= 0 with no
    exemplar, less two checks and a call per add), else the public ``inc``."""
    value = getattr(child, "_value", None)
    if (callable(getattr(value, "inc", None)) and callable(getattr(child, "_is_observable", None))
            and child._is_observable()):
        return value.inc
    return child.inc


def sample_total(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of every sample ``name`` in ``registry`` whose labels include ``labels``."""
    total = 0.0
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


class Metrics:
    """Every tiered_kv metric, registered on ``registry``."""

    def __init__(self, registry: Optional[CollectorRegistry] = None, namespace: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._pending: dict[Any, float] = {}
        self._observations: list[tuple[Any, float, int]] = []   # (histogram child, value, how many times)
        self._bucketing: dict[Any, Optional[tuple[float, ...]]] = {}  # histogram child -> its bounds (None: observe())
        self._adders: dict[Any, Callable[[float], None]] = {}  # counter child -> how flush() adds to it
        self._levels: tuple[int, ...] = ()  # the values publish_levels() set last
        self._host_evictions = 0            # the host index's eviction total counted so far
        self._refused = (0, 0)              # the host and disk indexes' admission refusals counted so far
        r = self.registry
        self.stale_callbacks = Counter(
            "tiered_kv_stale_callbacks_total",
            "Worker reports discarded because their job was unknown, cancelled, superseded or its source reused.",
            ["kind", "reason"], registry=r)
        self.jobs = Counter("tiered_kv_jobs_total", "Jobs finished, by kind and outcome.", ["kind", "outcome"], registry=r)
        self.jobs_in_flight = Gauge("tiered_kv_jobs_in_flight", "Jobs whose worker report has not been applied.", ["kind"], multiprocess_mode="livesum", registry=r)
        self.transfer_bytes = Counter("tiered_kv_transfer_bytes_total", "Bytes moved per link.", ["src", "dst"], registry=r)
        self.transfer_seconds = Histogram("tiered_kv_transfer_seconds", "Duration of one block copy per link.", ["src", "dst"],
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.tier_used_bytes = Gauge("tiered_kv_tier_used_bytes", "Bytes of blocks held per tier.", ["tier"], multiprocess_mode="livesum", registry=r)
        self.tier_capacity_bytes = Gauge("tiered_kv_tier_capacity_bytes", "Capacity per tier.", ["tier"], multiprocess_mode="livesum", registry=r)
        self.tier_blocks = Gauge("tiered_kv_tier_blocks", "Blocks held per tier (ready or being written).", ["tier"], multiprocess_mode="livesum", registry=r)
        self.lookups = Counter("tiered_kv_lookup_keys_total", "Keys asked for by lookup().", registry=r)
        self.lookup_hits = Counter("tiered_kv_lookup_hits_total", "Keys found ready by lookup(), by tier.", ["tier"], registry=r)
        self.evictions = Counter("tiered_kv_evictions_total", "Blocks evicted by the tier's policy (host_policy, disk_policy), by tier.", ["tier"], registry=r)
        self.errors = Counter("tiered_kv_errors_total", "Faults absorbed (never raised to the engine), by tier and error.",
                              ["tier", "error"], registry=r)
        self.healthy = Gauge("tiered_kv_healthy", "1 when the tier serves normally, 0 when degraded.", ["tier"], multiprocess_mode="livemin", registry=r)
        self.shed_total = Counter("tiered_kv_shed_total", "Jobs not started under overload, by kind and reason.",
                                  ["kind", "reason"], registry=r)
        self.orphaned_prevented = Counter("tiered_kv_orphaned_writes_prevented_total",
                                          "Disk writes of cancelled or invalidated blocks stopped before publication.",
                                          registry=r)
        self.orphaned_purged = Counter("tiered_kv_orphaned_writes_purged_total",
                                       "Entries written under a tombstoned token removed by recovery on open.",
                                       registry=r)
        self.corrupt_blocks = Counter("tiered_kv_corrupt_blocks_total",
                                      "Disk entries that failed verification (served as misses and removed).",
                                      ["reason"], registry=r)
        self.recovery_seconds = Gauge("tiered_kv_recovery_seconds", "Duration of the last disk recovery on open.",
                                      multiprocess_mode="livemax", registry=r)
        self.recovery_purged = Gauge("tiered_kv_recovery_purged_entries",
                                     "Entries purged under tombstones by the last disk recovery.", multiprocess_mode="livesum", registry=r)
        self.writer_queue = Gauge("tiered_kv_writer_queue_blocks", "Spills queued for the disk writer.", multiprocess_mode="livesum", registry=r)
        self.tombstones = Gauge("tiered_kv_disk_tombstones", "Durable tombstones in the disk tier.", multiprocess_mode="livesum", registry=r)
        self.disk_map_bytes = Gauge("tiered_kv_disk_map_bytes", "Size of the LMDB map.", multiprocess_mode="livesum", registry=r)
        self.remote_refused = Counter("tiered_kv_remote_refused_writes_total",
                                      "Remote writes the server refused: a tombstone for the key (invalidated on some machine) "
                                      "or for the writer's token (its job was cancelled).", ["reason"], registry=r)
        self.remote_corrupt = Counter("tiered_kv_remote_corrupt_values_total",
                                      "Remote values that failed verification (served as misses, deleted if unchanged).",
                                      ["reason"], registry=r)
        self.remote_queue = Gauge("tiered_kv_remote_queue_blocks", "Remote writes queued and not yet answered.",
                                  multiprocess_mode="livesum", registry=r)
        self.page_cache_reads = Counter(
            "tiered_kv_disk_page_cache_reads_total",
            "Reads of blocks only on disk looked at by an owner blocked in wait()/flush()/close() "
            "(disk_read_cached_in_wait): served (read from the page cache on its thread and verified) or "
            "handed_on (not cached, or its check failed: read by the disk I/O side).", ["outcome"], registry=r)
        self.page_cache = {o: self.page_cache_reads.labels(outcome=o) for o in ("served", "handed_on")}
        self.info = Gauge("tiered_kv_info", "Constant 1, labelled with the manager's namespace.", ["namespace"], multiprocess_mode="livemax", registry=r)
        self.info.labels(namespace=namespace).set(1)

        # bound children for the hot path
        self.stale = {(k, s): self.stale_callbacks.labels(kind=k.value, reason=s.value) for k in JobKind for s in StaleReason}
        self.job_outcome = {(k, o): self.jobs.labels(kind=k.value, outcome=o) for k in JobKind for o in OUTCOMES}
        self.in_flight = {k: self.jobs_in_flight.labels(kind=k.value) for k in JobKind}
        self.link_bytes = {l: self.transfer_bytes.labels(src=l[0], dst=l[1]) for l in _LINKS}
        self.link_seconds = {l: self.transfer_seconds.labels(src=l[0], dst=l[1]) for l in _LINKS}
        # the device rows are the engine's: their capacity is known, what it holds in them is not
        self.used = {t: self.tier_used_bytes.labels(tier=t) for t in TIERS if t != "device"}
        self.capacity = {t: self.tier_capacity_bytes.labels(tier=t) for t in TIERS}
        self.blocks = {t: self.tier_blocks.labels(tier=t) for t in TIERS if t != "device"}
        self.hits = {t: self.lookup_hits.labels(tier=t) for t in (*TIERS, "remote")}
        self.evicted = {t: self.evictions.labels(tier=t) for t in TIERS}
        self.admission_refused = Counter(
            "tiered_kv_admission_refused_total", "New blocks a tier's admission filter kept out (host: the store "
            "was not made; disk: the block was not written).", ["tier"], registry=r)
        self.refused_by = {t: self.admission_refused.labels(tier=t) for t in ("host", "disk")}
        self.health = {t: self.healthy.labels(tier=t) for t in ("device", "host")}
        for t in ("device", "host"):
            self.health[t].set(1)
        self.shed = {(k, why): self.shed_total.labels(kind=k.value, reason=why)
                     for k in JobKind for why in SHED_REASONS}
        for reason in CORRUPT_REASONS:
            self.corrupt_blocks.labels(reason=reason)
        for tier, error in ERROR_KINDS:
            self.errors.labels(tier=tier, error=error)
        self.refused = {why: self.remote_refused.labels(reason=why) for why in REFUSED_REASONS}

    def closed(self) -> None:
        """The manager closed: every tier it reports is unhealthy now.  The metrics stay on the registry
        with their final values (:meth:`close` takes them off)."""
        for g in self.health.values():
            g.set(0)

    def close(self) -> None:
        """Take these metrics off the registry (idempotent), e.g. before a new manager registers on it."""
        r = self.registry
        for c in list(vars(self).values()):
            if isinstance(c, MetricWrapperBase):
                try:
                    r.unregister(c)
                except KeyError:   # not (or no longer) registered there
                    pass

    def count(self, child: Any, n: float = 1) -> None:
        """Add to a bound counter child; applied by :meth:`flush` (the owner thread's per-job path)."""
        p = self._pending
        p[child] = p.get(child, 0) + n

    def observe(self, child: Any, value: float, n: int = 1) -> None:
        """Observe ``value`` ``n`` times into a bound histogram child; applied by :meth:`flush`."""
        self._observations.append((child, value, n))

    def moved(self, kind: JobKind, link: tuple[str, str], nbytes: int, seconds: float, n: int = 1,
              blocks: Optional[int] = None) -> None:
        """A job finished ok: count it, its bytes on ``link`` and its copy time (batched, as :meth:`count`).
        ``n``: a spill job's blocks, each counted and observed on its own, at ``seconds`` each.
        ``blocks``: a store or load job of that many blocks, counted once and observed per block
        (``seconds`` is then one block's share).

        :meth:`count` twice and :meth:`observe` once, written out: three calls' overhead less on the poll
        path, which runs this once per job.
        """
        p = self._pending
        c = self.job_outcome[(kind, "ok")]
        p[c] = p.get(c, 0) + n
        c = self.link_bytes[link]
        p[c] = p.get(c, 0) + nbytes
        self._observations.append((self.link_seconds[link], seconds, n if blocks is None else blocks))

    def flush(self) -> None:
        """Apply batched counts and observations (called at the end of every ``poll()``)."""
        if self._pending:
            pending, self._pending = self._pending, {}
            adders = self._adders
            for child, n in pending.items():
                add = adders.get(child)
                if add is None:
                    add = adders[child] = _adder(child)
                add(n)
        if self._observations:
            obs, self._observations = self._observations, []
            self._apply_observations(obs)

    def _apply_observations(self, obs: list[tuple[Any, float, int]]) -> None:
        """Bucket the observations per histogram child here, then add each bucket's count once.

        The same samples as one ``observe()`` each (``(child, v, n)``: ``v`` observed ``n`` times), at a
        fraction of the cost: ``observe()`` walks the bucket bounds in Python and takes two locks per
        sample.  The per-bucket adds use the child's ``_buckets``/``_sum`` values (prometheus_client's
        layout since 0.0.x, mutex or mmap backed); a child without that layout gets plain
        ``observe()`` calls, and ``tests/test_metrics_core.py`` checks that both give the same exposition.
        """
        bucketing = self._bucketing
        if len(obs) == 1:   # the common step: one job's copy time; its two adds straight away
            child, v, n = obs[0]
            bounds = bucketing.get(child, False)
            if bounds is False:
                bounds = bucketing[child] = _bucket_bounds(child)
            if bounds is None:
                for _ in range(n):
                    child.observe(v)
            else:
                if v == v:   # a NaN lands in no bucket, as with observe()
                    child._buckets[bisect_left(bounds, v)].inc(n)
                child._sum.inc(v * n)
            return
        groups: dict[Any, list[Any]] = {}
        for child, v, n in obs:
            g = groups.get(child)
            if g is None:
                bounds = bucketing.get(child, False)
                if bounds is False:
                    bounds = bucketing[child] = _bucket_bounds(child)
                if bounds is None:
                    for _ in range(n):
                        child.observe(v)
                    continue
                g = groups[child] = [bounds, {}, 0.0]
            if v == v:  # a NaN lands in no bucket, as with observe()
                counts = g[1]
                i = bisect_left(g[0], v)
                counts[i] = counts.get(i, 0) + n
            g[2] += v * n
        for child, (_, counts, total) in groups.items():
            child._sum.inc(total)
            buckets = child._buckets
            for i, c in counts.items():
                buckets[i].inc(c)

    def publish_refused(self, host_total: int, disk_total: int) -> None:
        """The host and disk indexes' running totals of admission refusals: what grew since the last call
        is added to ``tiered_kv_admission_refused_total``."""
        old_h, old_d = self._refused
        if host_total != old_h:
            self.count(self.refused_by["host"], host_total - old_h)
        if disk_total != old_d:
            self.count(self.refused_by["disk"], disk_total - old_d)
        self._refused = (host_total, disk_total)

    def publish_levels(self, host_used_bytes: int, host_blocks: int, in_flight: Mapping[JobKind, int],
                       disk: Optional[tuple[int, int, int, int, int, int]] = None, host_evictions: int = 0,
                       remote: Optional[tuple[int, int]] = None) -> None:
        """Once per poll/step: flush batched counts, then set the level gauges whose value changed.

        ``disk`` is (used bytes, blocks, writer queue, tombstones, map bytes,
        healthy) for an owner with a disk tier, ``remote`` (queued writes, healthy) for one with a
        remote tier.  ``host_evictions`` is the host
        index's running eviction total (``TierIndex.evictions``): what it grew
        by since the last call is added to ``tiered_kv_evictions_total{tier="host"}``,
        so no owner counts evictions one by one.  Unchanged values cost one tuple
        comparison, not a locked ``set`` per gauge.
        """
        if host_evictions != self._host_evictions:
            self.count(self.evicted["host"], host_evictions - self._host_evictions)
            self._host_evictions = host_evictions
        self.flush()
        values = (host_used_bytes, host_blocks, *[in_flight.get(k, 0) for k in _KINDS], *(disk or ()), *(remote or ()))
        old = self._levels
        if values == old:
            return
        gauges = [self.used["host"], self.blocks["host"], *[self.in_flight[k] for k in _KINDS]]
        if disk is not None:
            gauges += [self.used["disk"], self.blocks["disk"], self.writer_queue, self.tombstones, self.disk_map_bytes,
                       self.health["disk"]]
        if remote is not None:
            gauges += [self.remote_queue, self.health["remote"]]
        for i, (g, v) in enumerate(zip(gauges, values)):
            if i >= len(old) or old[i] != v:
                g.set(v)
        self._levels = values

    def enable_disk_health(self, healthy: bool) -> None:
        """Export the disk tier's health (only managers configured with one)."""
        self.health["disk"] = self.healthy.labels(tier="disk")
        self.health["disk"].set(1 if healthy else 0)

    def enable_remote_health(self, healthy: bool) -> None:
        """Export the remote tier's health (only managers configured with one)."""
        self.health["remote"] = self.healthy.labels(tier="remote")
        self.health["remote"].set(1 if healthy else 0)
        from .remote.records import REMOTE_ERROR_KINDS
        for error in REMOTE_ERROR_KINDS:
            self.errors.labels(tier="remote", error=error)
        for reason in REMOTE_CORRUPT_REASONS:
            self.remote_corrupt.labels(reason=reason)

    def error(self, tier: str, error: str) -> None:
        self.errors.labels(tier=tier, error=error).inc()


from .exposition import make_asgi_app, make_wsgi_app, serve_metrics  # noqa: E402  (re-exported API)

__all__ += ["make_asgi_app", "make_wsgi_app", "serve_metrics"]
