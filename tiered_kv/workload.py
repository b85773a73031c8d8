"""A small simulated serving engine that drives a TierManager as a real one would.

Requests share system prompts (prefix reuse across users and rounds); each
block's KV content is a deterministic function of its prefix key, so every
load is verified byte for byte.  The engine admits requests, looks up their
prefix, loads hits, "computes" misses, stores new blocks, aborts some
requests mid-flight and preempts when the device pool runs out.  It never
sleeps: it calls ``poll()`` once per step like an engine loop.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import xxhash

from .config import TieredKVConfig
from .jobs import Job, JobKind
from .manager import TierManager

__all__ = ["WorkloadConfig", "run_workload", "block_content", "chain_keys"]

log = logging.getLogger(__name__)

ROW_SHAPE = (2, 16, 64)  # K/V x tokens-per-block x head-dim slice: 4 KiB of fp16 per row


@dataclass(frozen=True)
class WorkloadConfig:
    steps: int = 400
    seed: int = 0
    abort_rate: float = 0.15        # chance per step that one running request is aborted
    device_blocks: int = 96
    host_blocks: int = 256
    system_prompts: int = 4
    system_prompt_blocks: int = 6
    users: int = 24
    arrivals_per_step: float = 0.8
    max_new_blocks: int = 6

    def __post_init__(self) -> None:
        if self.steps < 1 or self.device_blocks < 8 or self.host_blocks < 1:
            raise ValueError(f"bad workload config: {self}")
        if not 0.0 <= self.abort_rate <= 1.0:
            raise ValueError(f"abort_rate must be in [0, 1], got {self.abort_rate}")


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
    done_blocks: int = 0


class _Engine:
    def __init__(self, cfg: WorkloadConfig, mgr: TierManager, kv: torch.Tensor) -> None:
        self.cfg, self.mgr, self.kv = cfg, mgr, kv
        self.rng = random.Random(cfg.seed)
        self.free_rows = list(range(cfg.device_blocks))
        self.fenced: list[int] = []
        self.running: dict[int, _Request] = {}
        self.stats: dict[str, Any] = dict(requests_started=0, requests_finished=0, requests_aborted=0,
                                          preemptions=0, lookup_keys=0, host_hits=0, loads_ok=0,
                                          loads_cancelled=0, corrupt_loads=0, stores_ok=0,
                                          stores_cancelled=0, stores_shed=0, recomputed_blocks=0, errors=0)
        self.next_rid = 0
        self.rounds: dict[int, int] = {}

    # -- request lifecycle ----------------------------------------------------
    def _new_request(self) -> _Request:
        cfg, rng = self.cfg, self.rng
        user = rng.randrange(cfg.users)
        sp = user % cfg.system_prompts
        rounds = self.rounds.get(user, 0)
        self.rounds[user] = rounds + 1
        system = chain_keys(b"sys%d" % sp, [b"s%d" % i for i in range(cfg.system_prompt_blocks)])
        history = chain_keys(system[-1], [b"u%d.r%d" % (user, r) for r in range(rounds)])
        new = chain_keys(history[-1] if history else system[-1],
                         [b"u%d.r%d.n%d" % (user, rounds, i) for i in range(rng.randint(1, cfg.max_new_blocks))])
        self.next_rid += 1
        return _Request(self.next_rid, system + history + new)

    def _alloc(self, n: int) -> Optional[list[int]]:
        while len(self.free_rows) < n and self.running:
            victim = self.rng.choice(list(self.running))  # preemption
            self.stats["preemptions"] += 1
            self._release(self.running.pop(victim))
        if len(self.free_rows) < n:
            return None
        rows, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        return rows

    def _release(self, req: _Request) -> None:
        for job in req.jobs:
            if not job.done:
                self.mgr.cancel(job)
        for row in req.rows:
            (self.free_rows if self.mgr.free_block(row) else self.fenced).append(row)
        req.rows, req.jobs = [], []

    def admit(self) -> None:
        req = self._new_request()
        rows = self._alloc(len(req.keys))
        if rows is None:
            return
        req.rows = rows
        self.stats["requests_started"] += 1
        hit = self.mgr.lookup(req.keys)
        self.stats["lookup_keys"] += len(req.keys)
        self.stats["host_hits"] += hit
        for i, (key, row) in enumerate(zip(req.keys, rows)):
            job = self.mgr.load(key, row) if i < hit else None
            if job is not None:
                req.jobs.append(job)
            else:
                self.kv[row].copy_(block_content(key, self.kv[row]))  # "compute" the block
                self.stats["recomputed_blocks"] += 1
                sj = self.mgr.store(key, row)
                if sj is not None:
                    req.jobs.append(sj)
        self.running[req.rid] = req

    def step(self) -> None:
        cfg, rng = self.cfg, self.rng
        arrivals = _poisson(rng, cfg.arrivals_per_step)
        for _ in range(arrivals):
            self.admit()
        if self.running and rng.random() < cfg.abort_rate:
            rid = rng.choice(list(self.running))
            self.stats["requests_aborted"] += 1
            self._release(self.running.pop(rid))
        for c in self.mgr.poll():
            self._on_completion(c.job, c.ok)
        still = []
        for row in self.fenced:
            (self.free_rows if self.mgr.free_block(row) else still).append(row)
        self.fenced = still
        for rid in [r for r, req in self.running.items() if all(j.done for j in req.jobs) and rng.random() < 0.5]:
            self.stats["requests_finished"] += 1
            self._release(self.running.pop(rid))

    def _on_completion(self, job: Job, ok: bool) -> None:
        if job.kind is JobKind.LOAD:
            if ok:
                self.stats["loads_ok"] += 1
                if not torch.equal(self.kv[job.block], block_content(job.key, self.kv[job.block])):
                    self.stats["corrupt_loads"] += 1
                    log.error("corrupt load of key %r into row %d", job.key, job.block)
            else:
                self.stats["loads_cancelled"] += 1
        elif job.kind is JobKind.STORE:
            self.stats["stores_ok" if ok else "stores_cancelled"] += 1

    def drain(self) -> None:
        for req in list(self.running.values()):
            self._release(req)
        self.running.clear()
        for c in self.mgr.wait(timeout=30):
            self._on_completion(c.job, c.ok)


def _poisson(rng: random.Random, lam: float) -> int:
    # Knuth's method; lam is small
    import math
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def run_workload(cfg: WorkloadConfig, manager_config: Optional[TieredKVConfig] = None) -> dict[str, Any]:
    """Run the simulated engine; return a summary (also computed from the manager's metrics)."""
    kv = torch.zeros((cfg.device_blocks, *ROW_SHAPE), dtype=torch.float16)
    row_bytes = kv[0].numel() * kv.element_size()
    mcfg = manager_config or TieredKVConfig(namespace="demo|fp16|tp0", host_capacity_bytes=cfg.host_blocks * row_bytes)
    t0 = time.perf_counter()
    with TierManager(mcfg, kv) as mgr:
        eng = _Engine(cfg, mgr, kv)
        try:
            for _ in range(cfg.steps):
                eng.step()
            eng.drain()
        except Exception:
            log.exception("engine loop raised")
            eng.stats["errors"] += 1
        summary = dict(eng.stats)
        summary["stores_shed"] = int(_sample(mgr, "tiered_kv_jobs_total", kind="store", outcome="shed"))
        summary["stale_callbacks"] = {
            reason: int(_sample(mgr, "tiered_kv_stale_callbacks_total", reason=reason))
            for reason in ("unknown_token", "cancelled", "superseded", "source_reused")
        }
        summary["bytes_device_to_host"] = int(_sample(mgr, "tiered_kv_transfer_bytes_total", src="device", dst="host"))
        summary["bytes_host_to_device"] = int(_sample(mgr, "tiered_kv_transfer_bytes_total", src="host", dst="device"))
    summary.update(steps=cfg.steps, seed=cfg.seed, seconds=time.perf_counter() - t0,
                   host_hit_rate=summary["host_hits"] / max(1, summary["lookup_keys"]))
    return summary


def _sample(mgr: TierManager, name: str, **labels: str) -> float:
    total = 0.0
    for metric in mgr.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total
