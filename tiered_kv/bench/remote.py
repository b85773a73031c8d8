"""The remote tier (Redis/Valkey): put and get GB/s beside the same client's pipelined SET/GET, and
the hit rate of two machines sharing one server on the Mooncake trace.

Owns one measurement, ``bench_remote``, and a small launcher of a private ``redis-server``
(:class:`PrivateServer`).  The server: ``remote_url`` when given (``tiered-kv bench --remote-url``;
only this run's keys are deleted between runs, by pattern), else a private ``redis-server`` (or
``valkey-server``) from ``PATH`` on a free loopback port, no persistence, its own temporary
directory, ``FLUSHALL`` between runs, stopped at the end.  Without either, or without the ``redis``
package, the section is skipped, saying why.

**Put and get GB/s** (block sizes 4 KiB, 256 KiB and 2 MiB).  tiered_kv: a manager with the remote
tier stores N blocks, ``remote_batch_blocks`` keys per ``store_many`` and a ``poll()`` after each
(an engine storing a step's blocks per step), then ``wait()`` for the stores and ``flush()``: timed
from the first store until ``flush()`` returns (every remote write answered).  The stores copy the
device rows (CPU memory here) into the host slab; each block is written (write-through) with its
header, through the store's conditional-write script.  A second manager (a fresh host slab: the
other machine) then ``lookup()``\\ s the N keys and ``poll()``\\ s until the fetch landed, timed from
the lookup until the last block is published in its host tier (each value verified by the store:
header, namespace, key, checksum).  Its bytes are then loaded into device rows and compared with
the originals: a wrong byte is a ``wrong_bytes`` problem (exit 1).  Baseline: the same redis-py
client class, built with the store's options (:class:`tiered_kv.remote.conn.Conn`), doing pipelined
``SET ... EX`` of the same bytes (prepared ``bytes`` objects) in pipelines of ``remote_batch_blocks``,
then pipelined ``GET`` of them with an xxh3-64 of each value compared with the original's (a
hand-written path that still checks the bytes).  The two alternate, median of ``repeats``; the
server is emptied between runs.  The managers are sized so that nothing is evicted or shed (host
slots, ``remote_queue_blocks`` and ``remote_prefetch_blocks`` for all N blocks, ``max_inflight_jobs``
above 2N: each remote write in flight counts as a job), so each block is written and fetched once.

**Two machines on the shared trace.**  Two managers A and B (two serving machines: their own host
tiers, each 2% of the trace's distinct blocks, 256-byte rows) against one server; request ``i``
goes to A when ``i`` is even, else to B.  Per request: ``lookup(keys)``; when the local prefix is
short, poll until the fetch it started landed, ``lookup`` again (the hits: local + fetched), poll
until the misses that second lookup asked again were answered, then ``store_many`` the missing blocks,
``wait()`` and ``flush()`` (their remote writes land before the next request, as they would
between two requests seconds apart).  ``remote_miss_ttl_seconds=0`` (a replay compresses time: a
miss remembered for a second would span hundreds of requests) and ``remote_prefetch_blocks`` = the
longest request.  Baseline: the same replay without the remote tier (host only).  A hit-rate figure,
not a speed figure: no target.

There is no public call that says "this manager's fetch landed"; :func:`fetch_idle` reads the
core's counters as ``tests/test_remote_tier.py``'s ``fetched`` does.  Nothing here asserts a
timing; :mod:`.report` applies the targets.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.metrics import sample_total

from .common import KiB, LoadMonitor, MiB, as_mode, gbs, summarize

__all__ = ["bench_remote", "format_remote", "PrivateServer", "fetch_idle", "PLANS", "TARGET_VS_RAW",
           "TARGET_SIZES", "TRACE_ROW_BYTES", "TRACE_HOST_FRACTION", "SERVER_MISSING", "REDIS_MISSING"]

TARGET_VS_RAW = 0.9             # put and get GB/s / the same client's pipelined SET / GET+xxh3 (>=)
TARGET_SIZES = (256 * KiB, 2 * MiB)   # the sizes the target applies to; 4 KiB is a small-block row without one
TRACE_ROW_BYTES = 256
TRACE_HOST_FRACTION = 0.02      # each machine's host tier: this share of the replayed requests' distinct blocks
TIMEOUT_S = 5.0                 # remote_timeout_seconds of the managers and of the baseline's client
WAIT_S = 30.0                   # bound of every wait for the server (a flush, a fetch)
POLL_SLEEP_S = 0.0002           # between two poll()s while a fetch is in flight (the engine computing)
READY_S = 15.0                  # a private server must answer PING within this

SERVER_MISSING = ("no server: pass --remote-url redis://HOST:PORT/0, or put redis-server (or valkey-server) on PATH "
                  "(Debian: apt-get install redis-server)")
REDIS_MISSING = "the 'redis' package is not installed (pip install 'redis>=5' hiredis)"

PLANS: dict[str, dict[str, Any]] = {
    # (block bytes, blocks) per size, repeats of each put/get pair, requests of the trace replayed
    "full": {"sizes": ((4 * KiB, 8192), (256 * KiB, 1024), (2 * MiB, 128)), "repeats": 5, "requests": None},
    "quick": {"sizes": ((4 * KiB, 2048), (256 * KiB, 256), (2 * MiB, 32)), "repeats": 3, "requests": 1000},
    "smoke": {"sizes": ((4 * KiB, 64), (256 * KiB, 8), (2 * MiB, 4)), "repeats": 1, "requests": 60},
}


# ----------------------------------------------------------------------------- the server
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateServer:
    """A ``redis-server`` (or ``valkey-server``) child on a free loopback port: no persistence, its own
    temporary directory, readiness polled with a deadline; :meth:`stop` ends it and removes the directory."""

    def __init__(self, binary: Optional[str] = None) -> None:
        self.binary = binary or shutil.which("redis-server") or shutil.which("valkey-server")
        self.port = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.dir: Optional[str] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.dir or "", "server.log"), encoding="utf-8", errors="replace") as f:
                return " | ".join(line.strip() for line in f.readlines()[-5:])
        except OSError:
            return "(no log)"

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.settimeout(0.5)
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> "PrivateServer":
        """Start and wait until it answers PING; another port when the first was taken. Raises RuntimeError."""
        if self.binary is None:
            raise RuntimeError(SERVER_MISSING)
        self.dir = tempfile.mkdtemp(prefix="tkv-bench-redis-")
        why = ""
        for _ in range(3):
            self.port = _free_port()
            argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", self.dir, "--daemonize", "no", "--logfile", os.path.join(self.dir, "server.log"),
                    "--protected-mode", "no"]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + READY_S
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._answers():
                    return self
                time.sleep(0.02)
            why = (f"exited with status {self.proc.returncode}" if self.proc.poll() is not None
                   else f"no answer to PING within {READY_S:g} s")
            why += f" ({self._log_tail()})"
            self._kill()
        self.stop()
        raise RuntimeError(f"{self.binary} did not start: {why}")

    def _kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(5.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5.0)

    def cpu_seconds(self) -> Optional[float]:
        """CPU time the server used so far (Linux ``/proc``; None elsewhere): the bench's load monitor counts
        it among the other processes'."""
        if self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        """End the server and remove its directory; idempotent."""
        self._kill()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _client(url: str) -> Any:
    """The redis-py client the remote store's I/O threads use (same class, same options), for the baseline."""
    from tiered_kv.remote.conn import Conn
    from tiered_kv.remote.url import parse_url

    return Conn(parse_url(url), TIMEOUT_S, name="bench baseline").client()


def _pipeline(client: Any) -> Any:
    import redis

    return client.pipeline() if isinstance(client, redis.RedisCluster) else client.pipeline(transaction=False)


def _server_facts(client: Any) -> dict[str, Any]:
    import redis

    try:
        info = client.info("server")
        if isinstance(client, redis.RedisCluster):   # {node: info}: the first node's
            info = next(iter(info.values())) if info and isinstance(next(iter(info.values())), dict) else info
        return {"server": info.get("server_name") or "redis", "version": info.get("valkey_version") or
                info.get("redis_version"), "mode": info.get("redis_mode")}
    except Exception as exc:  # noqa: BLE001 - facts only
        return {"error": f"{type(exc).__name__}: {exc}"}


class _Cleaner:
    """Empties the server between runs: ``FLUSHALL`` on a private server, else a scan-and-unlink of this run's
    keys only (the tiered_kv namespaces used and the baseline's prefix) on a server given by URL."""

    def __init__(self, client: Any, private: bool, raw_prefix: bytes) -> None:
        self.client = client
        self.private = private
        self.patterns: list[bytes] = [raw_prefix + b"*"]

    def add_namespace(self, namespace: str) -> None:
        from tiered_kv.remote.keys import KeyNames

        self.patterns.append(("tkv:{" + KeyNames(namespace).ns_id + ":*").encode())

    def __call__(self) -> None:
        if self.private:
            self.client.flushall()
            return
        for pat in self.patterns:
            batch: list[bytes] = []
            for k in self.client.scan_iter(match=pat, count=1000):
                batch.append(k)
                if len(batch) >= 500:
                    self._unlink(batch)
                    batch = []
            if batch:
                self._unlink(batch)

    def _unlink(self, names: list[bytes]) -> None:
        pipe = _pipeline(self.client)
        for k in names:
            pipe.unlink(k)
        pipe.execute()


# ----------------------------------------------------------------------------- helpers on a manager
def fetch_idle(mgr: TierManager) -> bool:
    """No fetch of ``mgr`` gathered or in flight (what ``tests/test_remote_tier.py``'s ``fetched`` waits for:
    there is no public call for it)."""
    from tiered_kv.jobs import JobKind

    core = mgr._core
    return core.n_in_flight[JobKind.FETCH] == 0 and (core.remote is None or core.remote.want_token is None)


def _until_fetched(mgr: TierManager, deadline_s: float = WAIT_S) -> bool:
    """poll() until the fetch a lookup started landed; False after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    mgr.poll()
    while not fetch_idle(mgr):
        if time.monotonic() > end:
            return False
        time.sleep(POLL_SLEEP_S)
        mgr.poll()
    return True


def _metric(mgr: TierManager, name: str, **labels: str) -> float:
    return sample_total(mgr.metrics.registry, name, **labels)


def _read_back(mgr: TierManager, dev: torch.Tensor, keys: list[bytes]) -> Optional[torch.Tensor]:
    """Load ``keys`` into ``dev``'s first rows; a copy of those rows (None: the load was refused or failed)."""
    from tiered_kv.jobs import JobState

    job = mgr.load_many(keys, list(range(len(keys))))
    if job is None:
        return None
    mgr.wait([job], timeout=WAIT_S)
    if job.state is not JobState.DONE:
        return None
    return dev[:len(keys)].clone()


def _bad_rows(got: torch.Tensor, want: torch.Tensor) -> int:
    """Rows of ``got`` that differ from ``want`` (every row when the shapes differ)."""
    if got.shape != want.shape:
        return int(want.shape[0])
    return int((got != want).any(dim=1).sum().item())


def _config(url: Optional[str], namespace: str, slots: int, row_bytes: int, **kw: Any) -> TieredKVConfig:
    return TieredKVConfig(namespace=namespace, host_capacity_bytes=slots * row_bytes, remote_url=url,
                          remote_timeout_seconds=TIMEOUT_S, **kw)


# ----------------------------------------------------------------------------- put / get GB/s
def _tkv_run(url: str, namespace: str, data: torch.Tensor, batch: int) -> dict[str, Any]:
    """One put (manager A) and get (manager B) of ``data``'s rows; timings, counts and the bytes checked."""
    n, bb = data.shape
    keys = [b"bench-remote:%d:%08d" % (bb, i) for i in range(n)]
    warm = b"bench-remote:warm"
    slots = n + 8
    # room for every block in the host tier and the remote write queue (nothing evicted or shed: each block is
    # written and fetched once); each remote write in flight counts toward max_inflight_jobs, so it is raised too
    kw = dict(host_evict_ahead_blocks=0, remote_queue_blocks=max(n, batch), remote_prefetch_blocks=n,
              remote_batch_blocks=batch, remote_miss_ttl_seconds=0.0, max_inflight_jobs=max(4096, 2 * n + 64))
    dev_a = torch.cat([data, torch.zeros(1, bb, dtype=torch.uint8)])
    dev_b = torch.zeros(n + 1, bb, dtype=torch.uint8)
    out: dict[str, Any] = {"problems": []}
    a = TierManager(_config(url, namespace, slots, bb, **kw), dev_a, registry=CollectorRegistry())
    b: Optional[TierManager] = None
    try:
        # warm-up, untimed: both connections made, scripts loaded, one block through the whole path
        j = a.store_many([warm], [n])
        if j is not None:
            a.wait([j])
        a.flush(timeout=WAIT_S)
        gc.collect()
        t0 = time.perf_counter()
        jobs = []
        for i in range(0, n, batch):
            j = a.store_many(keys[i:i + batch], list(range(i, min(n, i + batch))))
            if j is not None:
                jobs.append(j)
            a.poll()
        a.wait(jobs, timeout=WAIT_S)
        out["put_stores_s"] = time.perf_counter() - t0    # the stores' copies into the host slab, writes queued
        flush_ok = a.flush(timeout=WAIT_S)
        out["put_s"] = time.perf_counter() - t0
        out["flush_ok"] = flush_ok
        out["stores_refused"] = (n + batch - 1) // batch - len(jobs)
        out["puts_ok"] = _metric(a, "tiered_kv_jobs_total", kind="put", outcome="ok") - 1
        out["puts_failed"] = _metric(a, "tiered_kv_jobs_total", kind="put", outcome="failed")
        out["puts_cancelled"] = _metric(a, "tiered_kv_jobs_total", kind="put", outcome="cancelled")
        out["puts_shed"] = _metric(a, "tiered_kv_shed_total", kind="put")
        out["put_bytes"] = _metric(a, "tiered_kv_transfer_bytes_total", src="host", dst="remote") - bb

        b = TierManager(_config(url, namespace, slots, bb, **kw), dev_b, registry=CollectorRegistry())
        b.lookup([warm])
        _until_fetched(b)
        gc.collect()
        t0 = time.perf_counter()
        n0 = b.lookup(keys)
        out["get_lookup_s"] = time.perf_counter() - t0    # the lookup: a host slot reserved per key
        landed = _until_fetched(b)
        out["get_s"] = time.perf_counter() - t0
        out["fetch_landed"] = landed
        out["local_before_fetch"] = n0
        out["held_after_fetch"] = b.lookup(keys)
        b.poll()   # a lookup's counts are applied at the end of its step
        # the lookup that finds the fetched keys counts them as remote hits (the warm-up key: no lookup found it)
        out["remote_hits"] = _metric(b, "tiered_kv_lookup_hits_total", tier="remote")
        out["get_bytes"] = _metric(b, "tiered_kv_transfer_bytes_total", src="remote", dst="host") - bb
        out["fetch_failed"] = _metric(b, "tiered_kv_jobs_total", kind="fetch", outcome="failed")
        out["corrupt_values"] = _metric(b, "tiered_kv_remote_corrupt_values_total")
        got = _read_back(b, dev_b, keys)
        out["read_back_failed"] = got is None
        out["bad_rows"] = 0 if got is None else _bad_rows(got, data)
    finally:
        if b is not None:
            b.close()
        a.close()
    p = out["problems"]
    if not out["flush_ok"]:
        p.append("flush() returned False (a remote write failed or the wait timed out)")
    if out["puts_ok"] != n or out["stores_refused"] or out["puts_shed"]:
        p.append(f"{out['puts_ok']:.0f} of {n} puts ok (stores refused {out['stores_refused']}, puts shed "
                 f"{out['puts_shed']:.0f}, failed {out['puts_failed']:.0f}, cancelled {out['puts_cancelled']:.0f})")
    if not landed:
        p.append(f"the fetch had not landed after {WAIT_S:g} s")
    if out["read_back_failed"]:
        p.append("loading the fetched blocks into device rows was refused or failed: their bytes were not checked")
    if out["held_after_fetch"] != n:
        p.append(f"after the fetch {out['held_after_fetch']} of {n} keys held (remote hits {out['remote_hits']:.0f}, "
                 f"fetch faults {out['fetch_failed']:.0f}, corrupt values {out['corrupt_values']:.0f})")
    return out


def _raw_run(client: Any, prefix: bytes, values: list[bytes], digests: list[int], batch: int,
             ttl: int) -> dict[str, Any]:
    """The baseline: pipelined SET EX of ``values``, then pipelined GET with an xxh3-64 of each value checked."""
    import xxhash

    h = xxhash.xxh3_64_intdigest
    n = len(values)
    names = [prefix + b"%08d" % i for i in range(n)]
    gc.collect()
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        pipe = _pipeline(client)
        for k, v in zip(names[i:i + batch], values[i:i + batch]):
            pipe.set(k, v, ex=ttl)
        pipe.execute()
    put_s = time.perf_counter() - t0
    gc.collect()
    bad = 0
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        pipe = _pipeline(client)
        for k in names[i:i + batch]:
            pipe.get(k)
        for v, d in zip(pipe.execute(), digests[i:i + batch]):
            if v is None or h(v) != d:
                bad += 1
    get_s = time.perf_counter() - t0
    return {"put_s": put_s, "get_s": get_s, "bad_values": bad}


def _size_row(url: str, client: Any, clean: _Cleaner, run_id: str, bb: int, n: int, repeats: int, seed: int,
              batch: int, log: Callable[[str], None]) -> dict[str, Any]:
    import xxhash

    g = torch.Generator().manual_seed(seed * 1_000_003 + bb)
    data = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)
    values = [bytes(memoryview(data[i].numpy())) for i in range(n)]
    digests = [xxhash.xxh3_64_intdigest(v) for v in values]
    ttl = TieredKVConfig(namespace="x", host_capacity_bytes=1).remote_ttl_seconds or 0
    total = n * bb
    tkv: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for rep in range(repeats):
        for system in (("tkv", "raw") if rep % 2 == 0 else ("raw", "tkv")):
            clean()
            if system == "tkv":
                ns = f"bench/remote/{run_id}/{bb}/{rep}"
                clean.add_namespace(ns)
                r = _tkv_run(url, ns, data, batch)
                tkv.append(r)
                log(f"{bb // KiB} KiB x {n} run {rep + 1}/{repeats} tiered_kv: put {gbs(total, r['put_s']):.3f} GB/s, "
                    f"get {gbs(total, r['get_s']):.3f} GB/s")
            else:
                r = _raw_run(client, b"%s:raw:%d:%d:" % (run_id.encode(), bb, rep), values, digests, batch, ttl)
                raw.append(r)
                log(f"{bb // KiB} KiB x {n} run {rep + 1}/{repeats} raw: SET {gbs(total, r['put_s']):.3f} GB/s, "
                    f"GET+xxh3 {gbs(total, r['get_s']):.3f} GB/s")
    clean()
    row: dict[str, Any] = {"block_bytes": bb, "blocks": n, "bytes": total, "batch_blocks": batch, "repeats": repeats,
                           "runs": {"tkv": tkv, "raw": raw}}
    for op in ("put", "get"):
        t = [gbs(total, r[f"{op}_s"]) for r in tkv]
        b = [gbs(total, r[f"{op}_s"]) for r in raw]
        row[op] = {"tkv": summarize(t, "GB/s"), "raw": summarize(b, "GB/s"),
                   "tkv_seconds": summarize([r[f"{op}_s"] for r in tkv], "s"),
                   "raw_seconds": summarize([r[f"{op}_s"] for r in raw], "s")}
        row[op]["ratio"] = row[op]["tkv"]["median"] / row[op]["raw"]["median"] if row[op]["raw"]["median"] else \
            float("nan")
        row[op]["paired_ratios"] = [x / y if y else float("nan") for x, y in zip(t, b)]
    row["bad_rows"] = sum(r["bad_rows"] for r in tkv)
    row["raw_bad_values"] = sum(r["bad_values"] for r in raw)
    row["problems"] = [f"run {i + 1}: {p}" for i, r in enumerate(tkv) for p in r["problems"]]
    return row


# ----------------------------------------------------------------------------- two machines on the trace
def _replay(reqs: list[list[bytes]], slots: int, rows: int, url: Optional[str], namespace: str) -> dict[str, Any]:
    """Requests alternate between two managers (A even, B odd); hits per machine, see the module doc."""
    kw: dict[str, Any] = {}
    if url is not None:
        kw = dict(remote_miss_ttl_seconds=0.0, remote_prefetch_blocks=max(1, rows),
                  remote_queue_blocks=max(256, 4 * rows))
    made = [TierManager(_config(url, namespace, slots, TRACE_ROW_BYTES, **kw),
                        torch.zeros(rows, TRACE_ROW_BYTES, dtype=torch.uint8), registry=CollectorRegistry())
            for _ in range(2)]
    per = [{"requests": 0, "refs": 0, "hits": 0, "hits_local": 0, "hits_after_fetch": 0, "wait_timeouts": 0,
            "stores_refused": 0, "flush_failed": 0} for _ in made]
    t0 = time.perf_counter()
    try:
        for i, keys in enumerate(reqs):
            m, s = made[i % 2], per[i % 2]
            n = local = m.lookup(keys)
            if url is not None and n < len(keys):
                if not _until_fetched(m):
                    s["wait_timeouts"] += 1
                n = m.lookup(keys)          # the hits: local + landed; the misses are asked again ...
                if n < len(keys) and not _until_fetched(m):   # ... and answered before they are stored
                    s["wait_timeouts"] += 1
            s["requests"] += 1
            s["refs"] += len(keys)
            s["hits"] += n
            s["hits_local"] += local
            s["hits_after_fetch"] += n - local
            if n < len(keys):
                j = m.store_many(keys[n:], list(range(n, len(keys))))
                if j is None:
                    s["stores_refused"] += 1
                else:
                    m.wait([j], timeout=WAIT_S)
                for r in range(n, len(keys)):
                    m.free_block(r)
                if url is not None and not m.flush(timeout=WAIT_S):
                    s["flush_failed"] += 1
        wall = time.perf_counter() - t0
        for m in made:
            m.poll()   # the last lookups' counts are applied at the end of their step
        for m, s in zip(made, per):
            s["hit_ratio"] = s["hits"] / s["refs"] if s["refs"] else float("nan")
            s["remote_hits"] = _metric(m, "tiered_kv_lookup_hits_total", tier="remote")
            s["host_hits"] = _metric(m, "tiered_kv_lookup_hits_total", tier="host")
            s["puts_ok"] = _metric(m, "tiered_kv_jobs_total", kind="put", outcome="ok")
            s["puts_shed"] = _metric(m, "tiered_kv_shed_total", kind="put")
            s["puts_failed"] = _metric(m, "tiered_kv_jobs_total", kind="put", outcome="failed")
            s["fetch_failed"] = _metric(m, "tiered_kv_jobs_total", kind="fetch", outcome="failed")
    finally:
        for m in made:
            m.close()
    refs = sum(s["refs"] for s in per)
    hits = sum(s["hits"] for s in per)
    return {"a": per[0], "b": per[1], "pair": {"refs": refs, "hits": hits,
                                               "hit_ratio": hits / refs if refs else float("nan"),
                                               "hits_after_fetch": sum(s["hits_after_fetch"] for s in per)},
            "wall_s": wall}


def _trace_part(url: str, clean: _Cleaner, run_id: str, trace: Optional[Union[str, Path]], requests: Optional[int],
                log: Callable[[str], None]) -> dict[str, Any]:
    from .trace import _TRACE_ENV, _TRACE_NAME, default_trace, keys_of, load_trace

    path = Path(trace) if trace is not None else default_trace()
    if path is None:
        return {"skipped": f"no trace: pass --trace PATH or set {_TRACE_ENV} (benchmarks/traces/{_TRACE_NAME} "
                           f"in a source checkout)"}
    reqs = keys_of(load_trace(path, requests))
    distinct = len({k for r in reqs for k in r})
    longest = max(len(r) for r in reqs)
    want = math.ceil(TRACE_HOST_FRACTION * distinct)
    slots = max(want, 2 * longest)   # a fetch or a store of the longest request must fit beside what is held
    seen: set[bytes] = set()
    ideal = 0                        # one cache that never forgets, shared by all: each prefix seen before hits
    for r in reqs:
        n = 0
        while n < len(r) and r[n] in seen:
            n += 1
        ideal += n
        seen.update(r)
    out: dict[str, Any] = {"trace": str(path), "requests": len(reqs), "block_refs": sum(map(len, reqs)),
                           "distinct_blocks": distinct, "longest_request": longest, "row_bytes": TRACE_ROW_BYTES,
                           "host_slots": slots, "host_fraction": slots / distinct,
                           "host_slots_floor_applied": slots > want,
                           "unbounded_shared_hit_ratio": ideal / max(1, sum(map(len, reqs)))}
    clean()
    ns = f"bench/remote/{run_id}/trace"
    clean.add_namespace(ns)
    out["remote"] = _replay(reqs, slots, longest, url, ns)
    log(f"two machines, remote tier: B hit ratio {out['remote']['b']['hit_ratio']:.3f}, pair "
        f"{out['remote']['pair']['hit_ratio']:.3f} ({out['remote']['wall_s']:.1f} s)")
    clean()
    out["host_only"] = _replay(reqs, slots, longest, None, ns + "/host")
    log(f"two machines, host only: B hit ratio {out['host_only']['b']['hit_ratio']:.3f}, pair "
        f"{out['host_only']['pair']['hit_ratio']:.3f}")
    return out


# ----------------------------------------------------------------------------- the section
def bench_remote(quick: Union[bool, str] = False, seed: int = 0, remote_url: Optional[str] = None,
                 trace: Optional[Union[str, Path]] = None,
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Put/get GB/s beside pipelined SET/GET and the two-machine trace hit rate (module doc).

    Skipped (``{"skipped": why, ...}``) without a server or the ``redis`` package."""
    mode = as_mode(quick)
    plan = PLANS[mode]
    batch = TieredKVConfig(namespace="x", host_capacity_bytes=1).remote_batch_blocks
    out: dict[str, Any] = {"mode": mode, "plan_sizes": [list(s) for s in plan["sizes"]], "batch_blocks": batch,
                           "repeats": plan["repeats"], "skipped": None}
    if importlib.util.find_spec("redis") is None or importlib.util.find_spec("xxhash") is None:
        out["skipped"] = REDIS_MISSING
        return out
    server: Optional[PrivateServer] = None
    if remote_url is None:
        server = PrivateServer()
        if server.binary is None:
            out["skipped"] = SERVER_MISSING
            return out
        try:
            server.start()
        except (RuntimeError, OSError) as exc:
            out["skipped"] = f"private server: {exc}"
            return out
        url = server.url
    else:
        url = remote_url
    from tiered_kv.remote.url import redact_url

    out["server"] = {"url": redact_url(url), "private": server is not None,
                     "binary": server.binary if server is not None else None}
    run_id = f"tkvbench:{uuid.uuid4().hex[:12]}"
    client: Any = None
    try:
        try:
            client = _client(url)
            client.ping()
        except Exception as exc:  # noqa: BLE001 - any failure to reach it skips the section
            out["skipped"] = f"cannot reach {redact_url(url)}: {type(exc).__name__}: {exc}"
            return out
        out["server"].update(_server_facts(client))
        clean = _Cleaner(client, server is not None, run_id.encode() + b":raw:")
        with LoadMonitor() as lm:
            out["sizes"] = [_size_row(url, client, clean, run_id, bb, n, plan["repeats"], seed, batch, log)
                            for bb, n in plan["sizes"]]
            out["trace"] = _trace_part(url, clean, run_id, trace, plan["requests"], log)
            clean()
        out["background_load"] = lm.result
        if server is not None:
            out["server"]["cpu_s"] = server.cpu_seconds()
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing
                pass
        if server is not None:
            server.stop()
    return out


def _size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def format_remote(r: dict[str, Any]) -> str:
    """The section's own report (``tiered-kv bench`` details)."""
    if r.get("skipped"):
        return f"remote tier: skipped ({r['skipped']})"
    s = r["server"]
    lines = [f"remote tier: {s.get('server', '?')} {s.get('version', '?')} at {s['url']} "
             f"({'private, started by the bench' if s['private'] else 'given by --remote-url'}); pipelines of "
             f"{r['batch_blocks']} blocks, median of {r['repeats']} (GB/s: median, min..max)"
             + (f"; the server used {s['cpu_s']:.0f} CPU s" if s.get("cpu_s") is not None else "")]
    for x in r["sizes"]:
        for op, base in (("put", "SET"), ("get", "GET+xxh3")):
            t, b = x[op]["tkv"], x[op]["raw"]
            lines.append(f"  {op} {_size(x['block_bytes']):>7} x {x['blocks']:>5}: tiered_kv {t['median']:7.3f} "
                         f"({t['min']:.3f}..{t['max']:.3f})  raw {base:8s} {b['median']:7.3f} "
                         f"({b['min']:.3f}..{b['max']:.3f})  ratio {x[op]['ratio']:.2f}x")
        tk = x["runs"]["tkv"]
        st = summarize([r["put_stores_s"] / r["put_s"] for r in tk], "")["median"]
        lk = summarize([r["get_lookup_s"] / r["get_s"] for r in tk], "")["median"]
        lines.append(f"      share of the put until the stores were copied and their writes queued {st:.0%}, "
                     f"of the get in its lookup() {lk:.0%}; wrong rows {x['bad_rows']}, "
                     f"raw wrong values {x['raw_bad_values']}"
                     + (f"; problems: {'; '.join(x['problems'])}" if x["problems"] else ""))
    t = r.get("trace") or {}
    if t.get("skipped"):
        lines.append(f"  two machines on the trace: skipped ({t['skipped']})")
    elif t:
        lines.append(f"  two machines on the trace: {t['requests']} requests, {t['block_refs']:,} block references "
                     f"({t['distinct_blocks']:,} distinct), {t['row_bytes']}-byte rows, {t['host_slots']} host slots "
                     f"each ({t['host_fraction']:.1%} of the distinct blocks); one shared cache that never forgets "
                     f"would hit {t['unbounded_shared_hit_ratio']:.3f}")
        for key, name in (("remote", "host + remote"), ("host_only", "host only")):
            x = t[key]
            lines.append(f"    {name:14s} hit ratio A {x['a']['hit_ratio']:.3f}  B {x['b']['hit_ratio']:.3f}  pair "
                         f"{x['pair']['hit_ratio']:.3f}; blocks found after a fetch {x['pair']['hits_after_fetch']:,}"
                         + (f"; remote hits (fetched) A {x['a']['remote_hits']:,.0f} B {x['b']['remote_hits']:,.0f}"
                            if key == "remote" else "") + f"; {x['wall_s']:.1f} s")
    return "\n".join(lines)
