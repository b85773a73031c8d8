"""Test doubles and helpers shared by the core test-suite.

* :class:`FakeMover` -- a mover that does nothing until the test says so.  It
  records every submitted :class:`~tiered_kv.movers.Transfer`; the test answers
  them explicitly, in any order, at any time.  The copy between the uint8 views
  happens *at completion time* (like a slow worker), so a store whose source row
  was rewritten meanwhile really copies the new bytes.
* :func:`content` / :func:`fill_row` / :func:`row_matches` / :func:`host_matches`
  -- block bytes derived deterministically from the key, so that "never wrong
  bytes" can be checked byte for byte.
* :func:`sample` / :func:`metric_samples` / :func:`snapshot` -- read metrics and
  the manager's observable state (for "state unchanged" checks).
* :func:`sm_settings` -- the state machines' hypothesis settings: deterministic
  in CI, a random sweep on request (``TIERED_KV_SWEEP_EXAMPLES``).
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any, Optional, Union

import torch
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry

from tiered_kv import Completion, Job, TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind
from tiered_kv.movers import CompletionQueue, Mover, Report, Transfer

SWEEP_ENV = "TIERED_KV_SWEEP_EXAMPLES"


def sm_settings(max_examples: int, stateful_step_count: int, **kw: Any) -> settings:
    """A state machine's settings.  In CI: ``max_examples`` derandomized examples (the same on every run), no
    example database, no deadline, the "too slow" and "filter too much" health checks off; ``kw`` adds to
    or overrides those.  With ``TIERED_KV_SWEEP_EXAMPLES=N`` in the environment: N random examples
    instead -- a deeper sweep, reproducible with pytest's ``--hypothesis-seed``::

        TIERED_KV_SWEEP_EXAMPLES=1000 pytest tests/test_cuda_mover_state_machine.py --hypothesis-seed=21
    """
    base: dict[str, Any] = dict(max_examples=max_examples, stateful_step_count=stateful_step_count,
                                derandomize=True, database=None, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    base.update(kw)
    n = os.environ.get(SWEEP_ENV)
    if n:
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"{SWEEP_ENV} must be a positive integer, got {n!r}")
        base.update(max_examples=int(n), derandomize=False)
    return settings(**base)


ROW_SHAPE = (2, 4, 8)
DTYPE = torch.float16
ROW_BYTES = 2 * 4 * 8 * 2  # 128


# --------------------------------------------------------------------------- content
@lru_cache(maxsize=4096)
def _content_cached(key: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    t.requires_grad_(False)
    return t


def content(key: bytes, shape: Sequence[int] = ROW_SHAPE, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """The bytes a row holding ``key`` must contain (do not modify the result)."""
    return _content_cached(bytes(key), tuple(shape), dtype)


def content_u8(key: bytes, shape: Sequence[int] = ROW_SHAPE, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return content(key, shape, dtype).reshape(-1).view(torch.uint8)


def fill_row(kv: torch.Tensor, row: int, key: bytes) -> None:
    """The engine "computes" block ``key`` into device row ``row``."""
    kv[row].copy_(content(key, tuple(kv.shape[1:]), kv.dtype))


def row_matches(kv: torch.Tensor, row: int, key: bytes) -> bool:
    """True when device row ``row`` holds exactly ``key``'s bytes (bitwise)."""
    return torch.equal(kv[row].reshape(-1).view(torch.uint8), content_u8(key, tuple(kv.shape[1:]), kv.dtype))


def host_matches(mgr: TierManager, key: bytes, kv: torch.Tensor) -> Optional[bool]:
    """None when ``key`` is not READY in the host tier, else whether its bytes are right."""
    b = mgr.host_bytes(key)
    if b is None:
        return None
    return torch.equal(b.reshape(-1), content_u8(key, tuple(kv.shape[1:]), kv.dtype))


def make_kv(rows: int = 256, seed: int = 1234, shape: Sequence[int] = ROW_SHAPE, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """A seeded device tensor ``[rows, *shape]`` (garbage content, not any key's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, *shape), generator=g, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------- metrics
def sample(registry: CollectorRegistry, name: str, labels: Optional[dict[str, str]] = None, **kw: str) -> float:
    """A metric sample's value, 0.0 when the series does not exist (yet)."""
    lab = dict(labels or {}, **kw)
    v = registry.get_sample_value(name, lab)
    return 0.0 if v is None else float(v)


def mgr_metric(mgr: TierManager, name: str, **labels: str) -> float:
    """A sample of ``mgr``'s registry, counts batched until the next poll flushed first; 0.0 when absent."""
    mgr.metrics.flush()
    return sample(mgr.metrics.registry, name, **labels)


def reported(completions: Iterable[Completion], job: Job) -> list[Completion]:
    """The completions of ``job`` among ``completions``."""
    return [c for c in completions if c.job is job]


def metric_samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry (without the ``*_created`` timestamps)."""
    out = {}
    for metric in registry.collect():
        for s in metric.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def snapshot(mgr: TierManager) -> dict[str, Any]:
    """Everything observable about a manager's state, to compare before/after."""
    return {
        "sizes": mgr.debug_sizes(),
        "jobs_in_flight": mgr.jobs_in_flight,
        "host_used_slots": mgr.host_used_slots,
        "host_blocks": mgr.host_blocks,
        "metrics": metric_samples(mgr.metrics.registry),
    }


# --------------------------------------------------------------------------- fake mover
class FakeMover(Mover):
    """A mover whose transfers are answered only when the test says so.

    ``submitted`` lists every transfer in submission order; ``outstanding`` the
    ones not answered yet; ``reports`` every report put so far (also injected
    and duplicate ones).
    """

    polled = False

    def __init__(self, device_rows: torch.Tensor, host_rows: torch.Tensor, completions: CompletionQueue) -> None:
        self.dev_rows = device_rows
        self.host_rows = host_rows
        self.completions = completions
        self.row_bytes = int(host_rows.shape[1])
        self.submitted: list[Transfer] = []
        self.outstanding: list[Transfer] = []
        self.reports: list[Report] = []
        self.harvests = 0
        self.closed = False
        self._lock = threading.Lock()

    # -- Mover ------------------------------------------------------
    def submit(self, t: Transfer) -> None:
        t.taken = True   # (the mover contract: Transfer.taken)
        with self._lock:
            self.submitted.append(t)
            self.outstanding.append(t)

    def harvest(self) -> None:
        self.harvests += 1

    def close(self) -> None:
        self.closed = True

    # -- lookups -------------------------------------------------------------
    def transfer_of(self, job: Any) -> Transfer:
        """The transfer submitted for ``job`` (a Job or a token)."""
        token = getattr(job, "token", job)
        for t in self.submitted:
            if t.token == token:
                return t
        raise LookupError(f"no transfer submitted for token {token}")

    def is_outstanding(self, job: Any) -> bool:
        token = getattr(job, "token", job)
        return any(t.token == token for t in self.outstanding)

    # -- answering -----------------------------------------------------------
    def _take(self, t: Union[Transfer, Any]) -> Transfer:
        if not isinstance(t, Transfer):
            t = self.transfer_of(t)
        with self._lock:
            for i, x in enumerate(self.outstanding):
                if x is t:
                    del self.outstanding[i]
                    return t
        raise AssertionError(f"transfer {t} was already answered (use duplicate() to repeat a report)")

    def _copy(self, t: Transfer) -> None:
        for r, s in zip(t.rows, t.slots, strict=True):
            if t.kind is JobKind.STORE:
                self.host_rows[s].copy_(self.dev_rows[r])
            else:
                self.dev_rows[r].copy_(self.host_rows[s])

    def complete(self, t: Union[Transfer, Any], ok: bool = True, *, copy: Optional[bool] = None,
                 honor_cancel: bool = False, error: Optional[str] = None) -> Report:
        """Answer ``t`` (a Transfer, a Job or a token) exactly once.

        ``ok=True`` performs the copy now and reports success.  With
        ``honor_cancel`` a transfer whose ``cancelled`` hint is set is skipped
        like ThreadMover does (``ok=False``, no copy).  ``copy`` forces or
        suppresses the copy regardless of ``ok`` (a failed worker may have
        written part of the destination).
        """
        t = self._take(t)
        if honor_cancel and t.cancelled:
            ok, do_copy, error = False, False, "cancelled before copy"
        else:
            do_copy = ok if copy is None else copy
            if not ok and error is None:
                error = "injected failure"
        if do_copy:
            self._copy(t)
        r = Report(t.token, t.kind, ok, error, len(t.rows) * self.row_bytes if ok else 0, 1e-4 if ok else 0.0)
        self.reports.append(r)
        self.completions.put(r)
        return r

    def fail(self, t: Union[Transfer, Any], error: str = "injected failure", *, copy: bool = False) -> Report:
        return self.complete(t, ok=False, copy=copy, error=error)

    def complete_all(self, order: Union[str, Iterable[int]] = "fifo", ok: Union[bool, Callable[[Transfer], bool]] = True,
                     rng: Optional[random.Random] = None, honor_cancel: bool = False) -> list[Report]:
        """Answer every outstanding transfer: ``order`` is "fifo", "lifo",
        "random" (with ``rng``) or a permutation of indices into ``outstanding``."""
        pending = list(self.outstanding)
        if order == "fifo":
            seq = pending
        elif order == "lifo":
            seq = pending[::-1]
        elif order == "random":
            seq = list(pending)
            (rng or random.Random(0)).shuffle(seq)
        else:
            idx = list(order)  # type: ignore[arg-type]
            if sorted(idx) != list(range(len(pending))):
                raise ValueError(f"order {idx} is not a permutation of {len(pending)} transfers")
            seq = [pending[i] for i in idx]
        out = []
        for t in seq:
            this_ok = ok(t) if callable(ok) else ok
            out.append(self.complete(t, this_ok, honor_cancel=honor_cancel))
        return out

    def inject(self, token: Optional[uuid.UUID] = None, kind: JobKind = JobKind.STORE, ok: bool = True,
               error: Optional[str] = None) -> Report:
        """Put a report for an arbitrary (by default never issued) token."""
        r = Report(token if token is not None else uuid.uuid4(), kind, ok, error, self.row_bytes if ok else 0, 1e-4)
        self.reports.append(r)
        self.completions.put(r)
        return r

    def duplicate(self, what: Union[Report, Transfer, Any]) -> Report:
        """Put again a report already put for ``what`` (a Report, Transfer, Job or token)."""
        if isinstance(what, Report):
            r = what
        else:
            token = getattr(what, "token", what)
            rs = [x for x in self.reports if x.token == token]
            if not rs:
                raise LookupError(f"no report was put for token {token}")
            r = rs[-1]
        dup = Report(r.token, r.kind, r.ok, r.error, r.nbytes, r.seconds)
        self.reports.append(dup)
        self.completions.put(dup)
        return dup


class FakeMoverFactory:
    """``mover_factory`` for TierManager that keeps the FakeMover it built."""

    def __init__(self) -> None:
        self.mover: Optional[FakeMover] = None

    def __call__(self, device_rows: torch.Tensor, host_rows: torch.Tensor, completions: CompletionQueue) -> FakeMover:
        self.mover = FakeMover(device_rows, host_rows, completions)
        return self.mover


DEFAULT_DISK_IO: Optional[str] = None
"""Set per test by conftest.py: "thread" for tests marked ``disk_threads``, else the library's default."""


def reports(q: CompletionQueue, n: int) -> list[Report]:
    """The next ``n`` reports on ``q`` (each waited for up to 30 s: a transfer never answered fails)."""
    out = []
    while len(out) < n:
        r = q.get(timeout=30)
        assert r is not None, "a transfer was never answered"
        out.append(r)
    return out


def make_config(host_slots: int = 64, row_bytes: int = ROW_BYTES, **kw: Any) -> TieredKVConfig:
    if DEFAULT_DISK_IO is not None and kw.get("disk_path") is not None:
        kw.setdefault("disk_io", DEFAULT_DISK_IO)
    return TieredKVConfig(namespace=kw.pop("namespace", "test|fp16|tp0"), host_capacity_bytes=host_slots * row_bytes, **kw)


def make_fake_manager(cfg: TieredKVConfig, kv: torch.Tensor,
                      registry: Optional[CollectorRegistry] = None) -> tuple[TierManager, FakeMover]:
    f = FakeMoverFactory()
    mgr = TierManager(cfg, kv, registry=registry if registry is not None else CollectorRegistry(), mover_factory=f)
    assert f.mover is not None
    return mgr, f.mover


def instrument_get(completions: CompletionQueue, on_enter: Callable[[Any], None]) -> None:
    """Call ``on_enter(timeout)`` whenever the owner blocks for a report (``completions.wait``)."""
    orig = completions.wait

    def wait(timeout: Optional[float]) -> bool:
        on_enter(timeout)
        return orig(timeout)

    completions.wait = wait  # type: ignore[method-assign]


# --------------------------------------------------------------------------- batched API over a disk tier
def stored(mgr: TierManager, mover: "FakeMover", kv: torch.Tensor, keys: list[bytes], rows: list[int]) -> Job:
    """``store_many(keys, rows)`` of freshly filled rows, answered and applied; the rows freed after."""
    for k, r in zip(keys, rows):
        fill_row(kv, r, k)
    job = mgr.store_many(keys, rows)
    assert job is not None
    mover.complete(job)
    mgr.poll()
    for r in rows:
        assert mgr.free_block(r)
    return job


def fake_disk_manager(path: Any) -> tuple[TierManager, "FakeMover", torch.Tensor]:
    """A fake-mover manager with a 4-slot host tier over a 64-block disk tier at ``path``."""
    kv = make_kv(64)
    cfg = make_config(host_slots=4, disk_path=path, disk_capacity_bytes=64 * ROW_BYTES,
                      host_evict_ahead_blocks=0, writer_batch_seconds=0.0)
    mgr, mover = make_fake_manager(cfg, kv, CollectorRegistry())
    return mgr, mover, kv


def on_disk_only(mgr: TierManager, mover: "FakeMover", kv: torch.Tensor, keys: list[bytes]) -> None:
    """Store ``keys`` (each spilled), then push them out of the 4-slot host tier: they are on disk only."""
    for i, k in enumerate(keys):
        stored(mgr, mover, kv, [k], [i])
        assert mgr.flush(timeout=30)
    for i in range(4):
        stored(mgr, mover, kv, [f"filler-{i}".encode()], [40 + i])
        assert mgr.flush(timeout=30)
    assert all(mgr.host_bytes(k) is None for k in keys) and mgr.lookup(list(keys)) == len(keys)

