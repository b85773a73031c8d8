"""The remote store's put and fetch throughput beside raw pipelined SET / GET of the same bytes.

    .venv/bin/python benchmarks/remote_raw.py [--url redis://127.0.0.1:6379/0] [--mib 256] [--rounds 3]

Without ``--url`` it starts a private ``redis-server`` (loopback, no persistence) for the run.  For each
block size (4 KiB and 256 KiB) and the same server in the same run, it times:

* ``raw set`` / ``raw get``: redis-py pipelines (``transaction=False``) of ``batch`` plain SET / GET
  commands of the payload alone, one thread -- what the network, the server and redis-py cost;
* ``put evalsha`` / ``put eval``: :class:`~tiered_kv.remote.store.RemoteStore` puts (header + checksum,
  the conditional publish script sent by sha or by text), all queued then ``wait_idle()``;
* ``fetch``: the store's fetches of those keys (GET read into the caller's buffer, then verified there).

Each figure is the best of ``--rounds`` interleaved runs over ``--mib`` MiB of payload: GB/s of payload
(10^9 bytes/s) and the server's CPU seconds per GB (``INFO cpu``: the shared, single-threaded resource).
Diagnostics, not figures of record (they move with the machine's load).  Nothing imports this module (but a test: ``store_options``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Optional

from tiered_kv.remote import RemoteOptions, RemoteStore
from tiered_kv.reports import CompletionQueue

SIZES = (4 << 10, 256 << 10)


def _start_server() -> tuple[subprocess.Popen[bytes], str, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not on PATH (ci/install_redis.sh) and no --url was given")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="tkv-remote-bench-")
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", d, "--logfile", os.path.join(d, "redis.log")])
    import redis
    c = redis.Redis(port=port)
    end = time.monotonic() + 10
    while True:
        try:
            c.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > end:
                raise
            time.sleep(0.02)
    return p, f"redis://127.0.0.1:{port}/0", d


def _server_cpu(client: Any) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _measure(client: Any, fn: Callable[[], float], nbytes: int, flush: bool = True) -> tuple[float, float]:
    """(GB/s of payload, server CPU seconds per GB) of one run of ``fn`` (which returns its seconds)."""
    if flush:
        client.flushall()
    cpu = _server_cpu(client)
    dt = fn()
    return nbytes / dt / 1e9, (_server_cpu(client) - cpu) / (nbytes / 1e9)


def _raw(client: Any, keys: list[str], payloads: list[bytes], batch: int, op: str) -> float:
    t = time.perf_counter()
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys[i:i + batch], payloads[i:i + batch]):
            if op == "set":
                pipe.set(k, v)
            else:
                pipe.get(k)
        out = pipe.execute()
        if op == "get":
            assert all(x is not None for x in out)
    return time.perf_counter() - t


def _store_puts(store: RemoteStore, keys: list[bytes], views: list[memoryview], q: CompletionQueue, job: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(keys), job):
        ks = keys[i:i + job]
        while not store.submit_puts([uuid.uuid4() for _ in ks], ks, views[i:i + job]):
            store.kick()
            q.get(1.0)   # room comes back with the answers
        store.kick()
    if not store.wait_idle(120):
        raise RuntimeError("puts did not finish")
    dt = time.perf_counter() - t
    bad = [r for r in q.drain() if not r.ok]
    assert not bad, bad[:3]
    return dt


def _store_fetch(store: RemoteStore, keys: list[bytes], bufs: list[memoryview], q: CompletionQueue, job: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(keys), job):
        while not store.submit_fetch(uuid.uuid4(), keys[i:i + job], bufs[i:i + job]):
            store.kick()
            q.get(1.0)
        store.kick()
    if not store.wait_idle(120):
        raise RuntimeError("fetches did not finish")
    dt = time.perf_counter() - t
    bad = [r for r in q.drain() if not r.ok]
    assert not bad, bad[:3]
    return dt


def store_options(url: str, size: int, batch: int) -> RemoteOptions:
    """The measured stores' options: no expiry, long timeouts (a slow VM never fails a write), and tombstones
    past twice the longest a write can be in flight (the store's bound)."""
    return RemoteOptions(url=url, namespace=f"bench-{size}", block_bytes=size, queue_blocks=4 * batch,
                         batch_blocks=batch, ttl_seconds=None, timeout_s=10.0, write_deadline_s=600,
                         tomb_ttl_seconds=1300)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None)
    ap.add_argument("--mib", type=int, default=256, help="payload per measurement (MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32, help="commands per pipeline (the store's batch_blocks)")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    workdir = None
    if url is None:
        proc, url, workdir = _start_server()
    try:
        import redis
        raw = redis.Redis.from_url(url, socket_timeout=10.0)   # as the store (a timeout makes socket I/O poll)
        print(f"{'block':>8} " + " ".join(f"{n:>16}" for n in ("raw set", "put evalsha", "put eval", "raw get",
                                                                 "fetch")) + "   (GB/s, server CPU s/GB)")
        for size in SIZES:
            n = max(args.batch, (args.mib << 20) // size)
            payloads = [os.urandom(size) for _ in range(min(n, 64))]
            payloads = [payloads[i % len(payloads)] for i in range(n)]
            keys = [f"bench:raw:{i}" for i in range(n)]
            bkeys = [b"bench:key:%d" % i for i in range(n)]
            views = [memoryview(p) for p in payloads]
            bufs = [memoryview(bytearray(size)) for _ in range(n)]
            nbytes = n * size
            stores = {}
            qs = {}
            for sha in (True, False):
                qs[sha] = CompletionQueue()
                stores[sha] = RemoteStore(store_options(url, size, args.batch), qs[sha], use_evalsha=sha)
            best: dict[str, tuple[float, float]] = {}

            def keep(name: str, r: tuple[float, float]) -> None:
                if name not in best or r[0] > best[name][0]:
                    best[name] = r
            try:
                for _ in range(args.rounds):   # interleaved: the same server state for each contender
                    keep("raw set", _measure(raw, lambda: _raw(raw, keys, payloads, args.batch, "set"), nbytes))
                    keep("raw get", _measure(raw, lambda: _raw(raw, keys, payloads, args.batch, "get"), nbytes,
                                             flush=False))
                    for sha, name in ((True, "put evalsha"), (False, "put eval")):
                        st, q = stores[sha], qs[sha]
                        keep(name, _measure(raw, lambda: _store_puts(st, bkeys, views, q, args.batch), nbytes))
                    keep("fetch", _measure(raw, lambda: _store_fetch(stores[True], bkeys, bufs, qs[True], args.batch),
                                           nbytes, flush=False))
                    assert all(bytes(b) == p for b, p in zip(bufs, payloads))
            finally:
                for st in stores.values():
                    st.close()
            raw.flushall()
            cols = [best[k] for k in ("raw set", "put evalsha", "put eval", "raw get", "fetch")]
            print(f"{size >> 10:>6}Ki " + " ".join(f"{g:>7.3f} {c:>6.2f}s/GB" for g, c in cols))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(workdir or "", ignore_errors=True)


if __name__ == "__main__":
    main()
