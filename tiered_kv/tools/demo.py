"""A simulated serving engine that drives a TierManager as a real one would.

Multi-round chat: users share a few system prompts and come back for more
rounds, so prefixes repeat across users and rounds.  Requests arrive as a
Poisson process; each needs one device row per block.  The engine looks up
the prefix, loads hits, "computes" misses, stores new blocks, aborts some
requests mid-flight (client aborts), and preempts running requests when the
pool runs out (or at random, at ``preempt_rate``).  Each block's KV content
is a deterministic function of its prefix key, so every completed load is
verified byte for byte.  The loop never sleeps: it calls ``poll()`` once per
step like an engine.

With ``remote_url`` the manager also has the shared remote tier (a Redis or
Valkey server): every stored block is written there too, and a lookup that
misses the local tiers asks the server.  Without it nothing needs a server.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import xxhash
from prometheus_client import CollectorRegistry

from ..config import TieredKVConfig
from ..jobs import Job, JobKind
from ..manager import TierManager
from ..metrics import OUTCOMES, REFUSED_REASONS, SHED_REASONS, sample_total
from ..remote.records import REMOTE_ERROR_KINDS

__all__ = ["WorkloadConfig", "run_workload", "block_content", "chain_keys", "summary_from_registry",
           "remote_summary", "remote_url_for_display", "OFFLOAD_MODES"]

log = logging.getLogger(__name__)

OFFLOAD_MODES = ("none", "host", "disk")


@dataclass(frozen=True)
class WorkloadConfig:
    """The simulated workload.  Sizes are in blocks; ``row_shape`` is one block's KV."""

    seconds: Optional[float] = 20.0    # wall-clock budget (None: run ``steps`` steps)
    steps: Optional[int] = None
    seed: int = 0
    offload: str = "disk"              # none | host | disk
    abort_rate: float = 0.12           # chance per step that one running request is aborted
    preempt_rate: float = 0.05         # chance per step that one running request is preempted
    invalidate_rate: float = 0.05      # chance per step that a recently stored key is invalidated
    device_blocks: int = 96
    host_blocks: int = 160
    disk_blocks: int = 4096
    disk_path: Optional[str] = None    # None: a temporary directory removed at the end
    system_prompts: int = 4
    system_prompt_blocks: int = 6
    users: int = 48
    arrivals_per_step: float = 0.6
    max_new_blocks: int = 5
    tokens_per_block: int = 16
    row_shape: tuple[int, ...] = (2, 16, 8, 64)  # K/V x tokens x heads x head_dim: 32 KiB of fp16
    remote_url: Optional[str] = field(default=None, repr=False)  # a Redis/Valkey url (may hold a password)

    def __post_init__(self) -> None:
        if self.seconds is None and self.steps is None:
            raise ValueError("give seconds or steps")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"seconds must be > 0, got {self.seconds}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {self.offload!r}")
        for name in ("abort_rate", "preempt_rate", "invalidate_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if self.device_blocks < 2 * (self.system_prompt_blocks + self.max_new_blocks):
            raise ValueError(f"device_blocks={self.device_blocks} too small for one request")
        if self.host_blocks < 1 or self.disk_blocks < 1 or self.users < 1 or self.system_prompts < 1:
            raise ValueError(f"sizes must be >= 1: {self}")
        if self.remote_url is not None and self.offload == "none":
            raise ValueError("remote_url needs a manager: offload must be host or disk")


_HISTORY = 3   # rounds of a user's history a request carries


def chain_keys(parent: bytes, parts: list[bytes]) -> list[bytes]:
    """Prefix-chain hashes: each key names its block *and* everything before it."""
    out = []
    for p in parts:
        parent = xxhash.xxh3_128_digest(parent + p)
        out.append(parent)
    return out


def block_content(key: bytes, like: torch.Tensor) -> torch.Tensor:
    """The KV bytes a block with this key must hold (deterministic in the key)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & ((1 << 63) - 1))
    return torch.randn(like.shape, generator=g, dtype=torch.float32).to(like.dtype)


@dataclass
class _Request:
    rid: int
    keys: list[bytes]
    rows: list[int] = field(default_factory=list)
    jobs: list[Job] = field(default_factory=list)
    decode_steps: int = 0


class _Engine:
    def __init__(self, cfg: WorkloadConfig, mgr: Optional[TierManager], kv: torch.Tensor) -> None:
        self.cfg, self.mgr, self.kv = cfg, mgr, kv
        self.rng = random.Random(cfg.seed)
        self.free_rows = list(range(cfg.device_blocks))
        self.fenced: list[int] = []
        self.running: dict[int, _Request] = {}
        self.stats: dict[str, int] = dict(
            steps=0, requests_started=0, requests_finished=0, requests_aborted=0, requests_rejected=0,
            preemptions=0, lookup_keys=0, lookup_hits=0, loads_ok=0, loads_failed=0, loads_cancelled=0,
            corrupt_loads=0, stores_ok=0, stores_failed=0, stores_cancelled=0, blocks_computed=0,
            blocks_needed=0, invalidations=0, errors=0)
        self.recent: list[bytes] = []  # keys stored lately (candidates for invalidation)
        self.next_rid = 0
        self.rounds: dict[int, int] = {}
        # user -> the chain keys of their last rounds (at most _HISTORY): a request hashes one round
        # more, not the user's whole history again
        self.history: dict[int, list[bytes]] = {}
        # invalidations draw from their own stream: a run without a manager (--compare's "no offload")
        # sees the same arrivals, aborts and preemptions as the runs with one
        self.inval_rng = random.Random(f"{cfg.seed}-invalidate")

    # -- requests -------------------------------------------------------------
    def _new_request(self) -> _Request:
        cfg, rng = self.cfg, self.rng
        user = rng.randrange(cfg.users)
        rounds = self.rounds.get(user, 0)
        self.rounds[user] = rounds + 1
        system = chain_keys(b"sys%d" % (user % cfg.system_prompts),
                            [b"s%d" % i for i in range(cfg.system_prompt_blocks)])
        # the user's rounds so far, chained after the system prompt; a request carries the last _HISTORY of
        # them (a bounded window, so requests fit the pool)
        past = self.history.setdefault(user, [])
        if rounds:
            past += chain_keys(past[-1] if past else system[-1], [b"u%d.r%d" % (user, rounds - 1)])
            del past[:-_HISTORY]
        history = past[-min(rounds, _HISTORY):] if rounds else []
        base = history[-1] if history else system[-1]
        new = chain_keys(base, [b"u%d.r%d.n%d" % (user, rounds, i)
                                for i in range(rng.randint(1, cfg.max_new_blocks))])
        self.next_rid += 1
        return _Request(self.next_rid, system + history + new)

    def _alloc(self, n: int) -> Optional[list[int]]:
        while len(self.free_rows) < n and self.running:
            self._preempt()
        if len(self.free_rows) < n:
            return None
        rows, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        return rows

    def _preempt(self) -> None:
        victim = self.rng.choice(sorted(self.running))
        self.stats["preemptions"] += 1
        # like vLLM's scheduler: free the rows without cancelling; free_block cancels the stores
        self._release(self.running.pop(victim), cancel=False)

    def _release(self, req: _Request, cancel: bool = True) -> None:
        mgr = self.mgr
        for job in req.jobs:
            if mgr is not None and cancel and not job.done:
                mgr.cancel(job)
        for row in req.rows:
            if mgr is None or mgr.free_block(row):
                self.free_rows.append(row)
            else:
                self.fenced.append(row)  # a load is still landing in it
        req.rows, req.jobs = [], []

    def admit(self) -> None:
        req = self._new_request()
        rows = self._alloc(len(req.keys))
        if rows is None:
            self.stats["requests_rejected"] += 1
            return
        mgr = self.mgr
        req.rows = rows
        self.stats["requests_started"] += 1
        self.stats["blocks_needed"] += len(req.keys)
        hit = mgr.lookup(req.keys) if mgr is not None else 0
        self.stats["lookup_keys"] += len(req.keys)
        self.stats["lookup_hits"] += hit
        for i, (key, row) in enumerate(zip(req.keys, rows)):
            job = mgr.load(key, row) if (mgr is not None and i < hit) else None
            if job is not None:
                req.jobs.append(job)
                continue
            self.kv[row].copy_(block_content(key, self.kv[row]))  # "compute" the block
            self.stats["blocks_computed"] += 1
            if mgr is not None:
                sj = mgr.store(key, row)
                if sj is not None:
                    req.jobs.append(sj)
                    self.recent.append(key)
        del self.recent[:-64]
        req.decode_steps = self.rng.randint(2, 12)
        self.running[req.rid] = req

    def step(self) -> None:
        cfg, rng, mgr = self.cfg, self.rng, self.mgr
        self.stats["steps"] += 1
        for _ in range(_poisson(rng, cfg.arrivals_per_step)):
            self.admit()
        if self.running and rng.random() < cfg.abort_rate:
            rid = rng.choice(sorted(self.running))
            self.stats["requests_aborted"] += 1
            self._release(self.running.pop(rid))
        if self.running and rng.random() < cfg.preempt_rate:
            self._preempt()
        if mgr is not None and self.recent and self.inval_rng.random() < cfg.invalidate_rate:
            # e.g. a user edited a message: its KV must never be served again
            mgr.invalidate(self.recent[self.inval_rng.randrange(len(self.recent))])
            self.stats["invalidations"] += 1
        if mgr is not None:
            for c in mgr.poll():
                self._on_completion(c.job, c.ok)
            still = []
            for row in self.fenced:
                (self.free_rows if mgr.free_block(row) else still).append(row)
            self.fenced = still
        for rid in sorted(self.running):
            req = self.running[rid]
            if all(j.done for j in req.jobs):
                req.decode_steps -= 1
                if req.decode_steps <= 0:
                    self.stats["requests_finished"] += 1
                    self._release(self.running.pop(rid))

    def _on_completion(self, job: Job, ok: bool) -> None:
        s = self.stats
        if job.kind is JobKind.LOAD:
            if ok:
                s["loads_ok"] += 1
                if not torch.equal(self.kv[job.block], block_content(job.key, self.kv[job.block])):
                    s["corrupt_loads"] += 1
                    log.error("corrupt load of key %r into row %d", job.key, job.block)
            elif job.error and job.error.startswith("cancelled"):
                s["loads_cancelled"] += 1
            else:
                s["loads_failed"] += 1
        elif job.kind is JobKind.STORE:
            if ok:
                s["stores_ok"] += 1
            elif job.error and job.error.startswith("cancelled"):
                s["stores_cancelled"] += 1
            else:
                s["stores_failed"] += 1

    def drain(self) -> None:
        for rid in sorted(self.running):
            self._release(self.running.pop(rid))
        if self.mgr is not None:
            for c in self.mgr.wait(timeout=60):
                self._on_completion(c.job, c.ok)


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def run_workload(cfg: WorkloadConfig, registry: Optional[CollectorRegistry] = None,
                 progress: Optional[Callable[[float], None]] = None,
                 on_manager: Optional[Callable[[TierManager], None]] = None) -> dict[str, Any]:
    """Run the simulated engine; return its summary.

    ``progress(fraction_done)`` is called now and then; ``on_manager(mgr)`` once
    the manager exists (e.g. to start a metrics endpoint on its registry).
    """
    try:
        kv = torch.zeros((cfg.device_blocks, *cfg.row_shape), dtype=torch.float16)
    except (RuntimeError, MemoryError) as exc:   # torch's allocator: the memory is not there
        raise ValueError(f"device_blocks={cfg.device_blocks}: cannot allocate the device pool ({exc})") from None
    row_bytes = kv[0].numel() * kv.element_size()
    registry = registry if registry is not None else CollectorRegistry()
    tmpdir = None
    mgr: Optional[TierManager] = None
    if cfg.offload != "none":
        disk_path = None
        if cfg.offload == "disk":
            # "is not None", not "or": an empty disk_path is the config's to refuse, not a throwaway tier
            disk_path = cfg.disk_path if cfg.disk_path is not None else (
                tmpdir := tempfile.mkdtemp(prefix="tiered-kv-demo-"))
        mcfg = TieredKVConfig(namespace=f"demo|fp16|{'x'.join(map(str, cfg.row_shape))}|tp0",
                              host_capacity_bytes=cfg.host_blocks * row_bytes, disk_path=disk_path,
                              disk_capacity_bytes=cfg.disk_blocks * row_bytes if disk_path is not None else 0,
                              remote_url=cfg.remote_url)
        try:
            mgr = TierManager(mcfg, kv, registry=registry)
            if disk_path is not None and not mgr.disk_healthy:
                # the library runs on without a tier it cannot open (an engine must); a demo asked for one
                mgr.close()
                mgr = None
                raise ValueError(f"disk_path {str(disk_path)!r}: the disk tier could not be opened (see the log)")
        except BaseException:
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
    t0 = time.perf_counter()
    loop_s = float("nan")   # the step loop alone (the manager made before it, drained and closed after)
    remote_healthy: Optional[float] = None
    try:
        if mgr is not None and on_manager is not None:
            on_manager(mgr)   # inside the try: a failure here (a port in use) still closes the manager
        eng = _Engine(cfg, mgr, kv)
        try:
            n = 0
            while True:
                if cfg.steps is not None and n >= cfg.steps:
                    break
                elapsed = time.perf_counter() - t0
                if cfg.seconds is not None and elapsed >= cfg.seconds:
                    break
                eng.step()
                n += 1
                if progress is not None and n % 50 == 0:
                    progress(min(1.0, elapsed / cfg.seconds) if cfg.seconds else n / cfg.steps)  # type: ignore[operator]
            loop_s = time.perf_counter() - t0
            eng.drain()
        except Exception:
            if loop_s != loop_s:   # (NaN: the loop itself raised) its seconds up to the raise
                loop_s = time.perf_counter() - t0
            log.exception("engine loop raised")
            eng.stats["errors"] += 1
        if mgr is not None:
            mgr.flush(timeout=30)
            mgr.poll()
            remote_healthy = registry.get_sample_value("tiered_kv_healthy", {"tier": "remote"})
    finally:
        if mgr is not None:
            mgr.close()
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)
    summary: dict[str, Any] = dict(eng.stats)
    summary.update(summary_from_registry(registry))
    if cfg.remote_url is not None:
        summary["remote"] = remote_summary(registry, remote_healthy)
    summary.update(
        offload=cfg.offload, seed=cfg.seed, seconds=time.perf_counter() - t0, loop_seconds=loop_s,
        tokens_per_block=cfg.tokens_per_block, block_bytes=row_bytes,
        prefix_hit_rate=eng.stats["lookup_hits"] / max(1, eng.stats["lookup_keys"]),
        recompute_avoided_tokens=eng.stats["loads_ok"] * cfg.tokens_per_block,
        recompute_tokens=eng.stats["blocks_computed"] * cfg.tokens_per_block,
    )
    return summary


def remote_url_for_display(url: str) -> str:
    """``url`` with its password masked: the only form of it the demo prints."""
    from ..remote.url import redact_url

    return redact_url(url)


def remote_summary(registry: CollectorRegistry, healthy: Optional[float] = None) -> dict[str, Any]:
    """The remote tier's figures (a run with ``remote_url``): ``healthy`` is its health at the end of the run."""
    def total(name: str, **labels: str) -> float:
        return sample_total(registry, name, **labels)

    return {
        "hits": int(total("tiered_kv_lookup_hits_total", tier="remote")),
        "bytes_written": int(total("tiered_kv_transfer_bytes_total", src="host", dst="remote")),
        "bytes_read": int(total("tiered_kv_transfer_bytes_total", src="remote", dst="host")),
        "puts": {o: int(total("tiered_kv_jobs_total", kind="put", outcome=o)) for o in OUTCOMES},
        "fetches": {o: int(total("tiered_kv_jobs_total", kind="fetch", outcome=o)) for o in OUTCOMES},
        "refused_writes": {r: int(total("tiered_kv_remote_refused_writes_total", reason=r)) for r in REFUSED_REASONS},
        "corrupt_values": int(total("tiered_kv_remote_corrupt_values_total")),
        "errors": {e: int(v) for e in REMOTE_ERROR_KINDS
                   if (v := total("tiered_kv_errors_total", tier="remote", error=e))},
        "healthy": healthy,
    }


def summary_from_registry(registry: CollectorRegistry) -> dict[str, Any]:
    """The summary figures that come from tiered_kv's metrics."""
    def total(name: str, **labels: str) -> float:
        return sample_total(registry, name, **labels)

    out: dict[str, Any] = {
        "hits_by_tier": {t: int(total("tiered_kv_lookup_hits_total", tier=t)) for t in ("host", "disk")},
        "bytes_by_link": {f"{a}->{b}": int(total("tiered_kv_transfer_bytes_total", src=a, dst=b))
                          for a, b in (("device", "host"), ("host", "device"), ("host", "disk"), ("disk", "host"))},
        "stale_callbacks": {r: int(total("tiered_kv_stale_callbacks_total", reason=r))
                            for r in ("unknown_token", "cancelled", "superseded", "source_reused")},
        "orphaned_writes_prevented": int(total("tiered_kv_orphaned_writes_prevented_total")),
        "orphaned_writes_purged": int(total("tiered_kv_orphaned_writes_purged_total")),
        "shed": {r: int(total("tiered_kv_shed_total", reason=r))
                 for r in SHED_REASONS},
        "corrupt_blocks": int(total("tiered_kv_corrupt_blocks_total")),
        "tier_errors": int(total("tiered_kv_errors_total")),
    }
    return out
