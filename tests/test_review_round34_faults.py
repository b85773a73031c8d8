"""Review round 34: faults, restarts and bad input at the API boundary.

Each test failed on the code it was written against (main at 1b01907); fixed since, as each docstring
proposes:

1. ``serve_metrics`` with a non-str ``addr`` raised a raw ``TypeError``, and a bad ``port`` a plain ``ValueError``:
   both ``ConfigError`` now, naming the value;
2. ``make_wsgi_app``/``make_asgi_app``/``serve_metrics`` took any object as the registry (every scrape an HTTP 500):
   refused with ``ConfigError``;
3. a remote value of another length than a block's was read whole into memory (its length the server's): it is
   drained in pieces, hashed, its first bytes kept (``remote/resp.py: Drained``);
4. while the disk I/O process was dead, ``lookup()`` counted blocks on disk as hits and ``load()`` started reads
   certain to fail: the disk index is not read then, a load is shed as ``disk_down`` (``TierCore.readable_dindex``);
5. ... and ``store()`` of a block held only on disk returned None: it goes to the host tier now;
6. ``tiered-kv bench --from-json`` of a malformed result died with a traceback (exit 1, the wrong-bytes status), and
   ``--sections ,`` measured nothing and exited 0: both are refused with exit 2.

Deterministic: seeded data, ``tmp_path``, bounded waits only.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from disk_helpers import load_ok, metric, rig  # noqa: F401
from tiered_kv.errors import TieredKVError
from tiered_kv.exposition import make_asgi_app, make_wsgi_app, serve_metrics

__all__ = ["rig"]


# ============================================================================ exposition: bad input
@pytest.mark.parametrize("addr", [None, 123, b"127.0.0.1"])
def test_serve_metrics_refuses_a_non_str_addr_with_a_tiered_kv_error_naming_it(addr) -> None:
    """``serve_metrics(port, addr=None)`` (an ``addr`` read from a config that left it unset) raises a raw
    ``TypeError: argument of type 'NoneType' is not iterable`` from ``":" in addr`` -- not an error of
    ``tiered_kv.errors``, and not naming ``addr`` (a bytes address gets ``TypeError: a bytes-like object is
    required``).  errors.py promises that every error on bad input derives from ``TieredKVError`` and names the
    value.  At fault: ``tiered_kv/exposition.py: serve_metrics`` checks ``port`` only.  Fix: check
    ``isinstance(addr, str)`` beside the port check and raise ``ConfigError(f"addr must be a str ..., got
    {addr!r}")``."""
    with pytest.raises(TieredKVError, match="addr"):
        serve_metrics(0, addr=addr)   # type: ignore[arg-type]


@pytest.mark.parametrize("port", [-1, 65536, "9400", True, 1.5])
def test_serve_metrics_bad_port_is_a_tiered_kv_error(port) -> None:
    """A bad ``port`` raises a plain ``ValueError`` (``tiered_kv/exposition.py: serve_metrics``), outside the
    ``TieredKVError`` hierarchy that errors.py says every bad-input error belongs to (a host catching
    ``TieredKVError`` around its tiered_kv setup lets this one through).  Fix: raise ``ConfigError`` (a
    ``ValueError`` subclass, so ``tests/test_exposition.py``'s ``pytest.raises(ValueError)`` still holds)."""
    with pytest.raises(TieredKVError, match="port"):
        serve_metrics(port)   # type: ignore[arg-type]


@pytest.mark.parametrize("make", [make_wsgi_app, make_asgi_app, lambda registry: serve_metrics(0, registry=registry)],
                         ids=["wsgi", "asgi", "serve_metrics"])
def test_metrics_apps_refuse_a_registry_that_is_no_collector(make, monkeypatch) -> None:
    """``make_wsgi_app(registry="oops")``, ``make_asgi_app(registry=42)`` and ``serve_metrics(0, registry=...)``
    accept any object as the registry: the endpoint starts, and every scrape is an HTTP 500 (prometheus_client
    calls ``.collect()`` on it), so the mistake shows up as a dead target in Prometheus, far from its cause.
    ``TierManager`` refuses the same mistake at once (``checks.check_registry``: ``ConfigError``).  At fault:
    ``tiered_kv/exposition.py: scrape_registry`` returns any non-None ``registry`` unchecked.  Fix: refuse a
    registry without a callable ``collect`` there with ``ConfigError`` naming it."""
    import wsgiref.handlers
    monkeypatch.setattr(wsgiref.handlers.BaseHandler, "log_exception", lambda self, exc_info: None)
    try:
        made = make("oops")
    except TieredKVError as exc:
        assert "registry" in str(exc)
        return
    if hasattr(made, "url"):   # the endpoint started: show what Prometheus would see
        try:
            with pytest.raises(urllib.error.HTTPError) as ei:
                urllib.request.urlopen(made.url, timeout=10)
            assert ei.value.code == 500
        finally:
            made.close()
    pytest.fail("a registry that is no prometheus Collector was accepted (each scrape would be an HTTP 500)")


# ============================================================================ remote tier: an untrusted server
def test_an_oversized_value_on_the_server_is_not_read_into_memory_whole(redis_server, redis_url, monkeypatch) -> None:
    """A value under a block's name that is much longer than a block (anything else sharing the server, a bug
    in another client, a hostile writer: the docs call the store shared and untrusted) is read whole into the
    engine's process before it is found corrupt: ``remote/resp.py: Replies.read`` allocates ``bytearray(n)``
    for any bulk reply whose length ``n`` is not the expected value's, with ``n`` taken from the server (up to
    Redis's 512 MiB ``proto-max-bulk-len``), and ``_Link.read`` keeps every reply of a pipelined batch
    (``remote_batch_blocks``, 32 by default) alive until the batch is verified -- 16 GiB of one probe's
    answers, an OOM kill of the host process for what the contract says is a counted miss.  Here one 32 MiB
    value for a 4 KiB block: the fetch allocates the 32 MiB.  Fix: in ``Replies.read``, a ``GetInto`` reply of
    another length is drained from the socket in bounded chunks, hashed as it goes (sha1, for
    ``DROP_IF_SAME``) and answered as a corrupt value (counted, a miss) without keeping its bytes."""
    import tracemalloc

    from prometheus_client import CollectorRegistry

    from disk_helpers import fill, make_kv
    from tiered_kv import TieredKVConfig, TierManager
    from tiered_kv.jobs import JobKind

    row = 4096
    cfg = TieredKVConfig(namespace="r34-oversized|u8", host_capacity_bytes=16 * row, remote_url=redis_url,
                         remote_miss_ttl_seconds=0.0)
    a = TierManager(cfg, make_kv(8, row, seed=1), registry=CollectorRegistry())
    b = TierManager(cfg, make_kv(8, row, seed=2), registry=CollectorRegistry())
    try:
        k = b"oversized-0"
        fill(a._device_blocks, 0, k)
        job = a.store(k, 0)
        assert job is not None
        a.wait([job])
        assert a.flush(timeout=15)
        client = redis_server.client()
        names = [n for n in client.keys("tkv:*") if n.endswith(b":v")]
        assert len(names) == 1
        client.set(names[0], b"\x00" * (32 << 20))   # 32 MiB where a 4 KiB block's value belongs
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            b.lookup([k])
            deadline = time.monotonic() + 15

            def corrupt() -> float:
                return sum(s.value for f in b.metrics.registry.collect() for s in f.samples
                           if s.name == "tiered_kv_remote_corrupt_values_total")

            while b._core.n_in_flight[JobKind.FETCH] or b._core.remote.want_token is not None or not corrupt():
                assert time.monotonic() < deadline, "the probe and fetch of the oversized value did not end"
                b.poll()
                time.sleep(0.002)   # not ordering anything: the server answers on its own time
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert b.lookup([k]) == 0   # a miss, as the contract says
        assert peak < 4 << 20, f"fetching one {row}-byte block allocated {peak / (1 << 20):.1f} MiB (the server's " \
                               f"32 MiB value read whole)"
        # the sha1 of the bytes drained is the whole value's: DROP_IF_SAME deletes it (the server still holds it)
        while client.exists(names[0]):
            assert time.monotonic() < deadline, "the oversized value was not deleted (its drained sha1 is wrong?)"
            b.poll()
            time.sleep(0.002)   # the writer thread's delete: not an ordering, a bounded wait for the server
    finally:
        a.close()
        b.close()


# ============================================================================ operator CLI: bad input
@pytest.mark.parametrize("text", ['[1, 2]', '"x"', '{"benchmark": "tiered-kv bench"}',
                                  '{"benchmark": "tiered-kv bench", "sections": 5}'],
                         ids=["list", "string", "no-fields", "sections-not-a-mapping"])
def test_bench_from_json_of_a_malformed_result_is_a_clear_error_not_a_traceback(tmp_path, capsys, text) -> None:
    """``tiered-kv bench --from-json FILE`` of a file that is JSON but not a bench result object (a list, a
    string, an object of the right ``benchmark`` name with its fields missing or of another type: a truncated
    or hand-edited result) dies with a Python traceback (``AttributeError: 'list' object has no attribute
    'get'``, ``KeyError: 'machine'``) and exit status 1 -- the status this command reserves for a run that
    found wrong bytes (``bench/cli.py``: ``return 1 if ... wrong_bytes``), so a script cannot tell a corrupt
    result file from a data-integrity failure.  At fault: ``tiered_kv/bench/cli.py: main`` calls
    ``result.get(...)`` without checking that ``json.load`` gave a dict, then ``report.revive`` /
    ``collect_figures`` / ``format_table`` on whatever it holds.  Fix: refuse a non-dict with ``_err`` (exit
    2), and turn a ``KeyError``/``TypeError``/``AttributeError`` while reading the result back into ``_err(f"{path}
    is not a complete 'tiered-kv bench' result: ...")``."""
    from tiered_kv.tools.cli import main

    path = tmp_path / "result.json"
    path.write_text(text, encoding="utf-8")
    try:
        rc = main(["bench", "--from-json", str(path)])
    except Exception as exc:   # noqa: BLE001 - what the shell shows as a traceback
        pytest.fail(f"tiered-kv bench --from-json raised {type(exc).__name__}: {exc} (a traceback, exit 1)")
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err and str(path) in err, (rc, err)


def test_bench_sections_that_name_no_section_are_refused(capsys) -> None:
    """``tiered-kv bench --sections ,`` (or ``--sections " "``: a list that names no section, e.g. an empty
    shell variable spliced in) is accepted: the bench measures nothing, prints an empty table and exits 0,
    as if every figure had been measured and met.  ``--sections bogus`` is refused (exit 2); an empty list
    should be too.  At fault: ``tiered_kv/bench/cli.py: main`` drops the empty names and checks only for
    unknown ones.  Fix: ``if args.sections is not None and not sections: return _err("--sections names no
    section; known: ...")``."""
    from tiered_kv.tools.cli import main

    rc = main(["bench", "--quick", "--sections", ",", "--no-details"])
    err = capsys.readouterr().err
    assert rc == 2 and "sections" in err, (rc, err)


# ============================================================================ disk I/O process: down is a miss
@contextlib.contextmanager
def _disk_io_process_down(rig: Any) -> Iterator[tuple[Any, Any, list[bytes]]]:
    """Four blocks only on disk, then the disk I/O process killed, its replacement's open held until the block
    ends (a long recovery scan: the tier stays down meanwhile); the restart settled after it."""
    import signal
    import threading

    from disk_helpers import disk_only_keys, settle_restart

    kv, mgr, ks = disk_only_keys(rig, "process", n=4)
    tier = mgr._core.disk
    gate = threading.Event()
    real_reopen = tier._reopen

    def held_reopen() -> Any:
        gate.wait(30)
        return real_reopen()

    tier._reopen = held_reopen
    try:
        mgr.disk.kill_for_test(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while tier._starting is None:   # the death applied and the restart begun: the tier is down
            assert time.monotonic() < deadline, "the disk I/O process's death was not noticed"
            mgr.wait(timeout=0.01)
        assert not tier.usable
        yield kv, mgr, ks
    finally:
        gate.set()
        settle_restart(mgr)


def test_lookup_reports_no_disk_hit_while_the_disk_io_process_is_down(rig) -> None:
    """While the disk I/O process is dead and its replacement not yet adopted (its open and recovery scan run on a
    starter thread: seconds on a large tier; after a restart that failed, a back-off of up to 60 s), the tier
    cannot read a block -- every read is answered ``NOT_READ`` at once -- yet ``lookup()`` counts every block on
    disk as ready: it returns them as a prefix hit, adds them to ``tiered_kv_lookup_hits_total{tier="disk"}``
    (the dashboard's "Prefix hit rate by tier" shows a healthy disk tier through the outage), and ``load()`` of
    them returns a job certain to fail (``miss: not read (disk I/O process died)``) instead of None, so the
    engine plans a step around blocks it then has to recompute.  README: "a crash of that process is counted
    and it is restarted, the disk tier missing meanwhile"; ``disk_tier.py``: "the tier down (spills shed as
    ``disk_down``, reads missing) meanwhile".  At fault: ``TierCore.lookup_prefix`` (``core/tiers.py``) walks
    ``dindex`` through ``TierIndex.ready_run_below`` whatever ``DiskTier.usable``/``dead`` say, and
    ``TierCore.begin_load`` starts promotes on a tier that is down.  Fix: while the disk tier is not usable
    (or its store is dead), look up and load through the host tier only (the disk index kept as it is, for the
    adoption's reconciliation), shedding a load that needs the disk as ``disk_down``."""
    with _disk_io_process_down(rig) as (kv, mgr, ks):
        hits0 = metric(mgr, "tiered_kv_lookup_hits_total", tier="disk")
        n = mgr.lookup(ks)
        job = mgr.load(ks[0], 0)
        outcome = None
        if job is not None:
            got = [c for c in mgr.wait([job], timeout=10) if c.job is job]
            outcome = got[0].error if got else "not reported"
        mgr.poll()   # (the step's counts applied)
        disk_hits = metric(mgr, "tiered_kv_lookup_hits_total", tier="disk") - hits0
        assert (n, disk_hits, job) == (0, 0, None), (
            f"with the disk I/O process down, lookup() answered {n} leading blocks ready ({disk_hits:g} counted as "
            f"disk hits) and load() started a job that ended {outcome!r}")
        assert metric(mgr, "tiered_kv_shed_total", kind="load", reason="disk_down") == 1
    assert mgr.lookup(ks) == len(ks)   # once the new process is adopted the blocks are served again
    for i, k in enumerate(ks):
        assert load_ok(mgr, kv, k, i)


def test_a_store_while_the_disk_io_process_is_down_is_not_refused_for_a_block_only_on_disk(rig) -> None:
    """Same root cause as the test above, on the store side: while the disk I/O process is down, ``store(key,
    row)`` of a block the disk index holds (and nothing else does) returns None -- "already stored" -- so the
    copy the engine offers is dropped, and for the whole outage that block is neither in the host tier nor
    readable from disk.  At fault: ``TierCore.begin_store_one`` / ``begin_store`` (``core/tiers.py``) skip a key
    READY in ``dindex`` whatever ``DiskTier.usable`` says.  Fix: while the disk tier is down, a key held only on
    disk is stored into the host tier like a key in no tier (its disk entry left for the adoption to
    reconcile)."""
    from disk_helpers import fill, row_is

    with _disk_io_process_down(rig) as (kv, mgr, ks):
        fill(kv, 3, ks[0])
        job = mgr.store(ks[0], 3)
        assert job is not None, ("store() of a block held only by the disk tier, which is down, returned None: the "
                                 "engine's copy is dropped and the block is unavailable for the whole outage")
        got = [c for c in mgr.wait([job], timeout=10) if c.job is job]
        assert got and got[0].ok
        kv[3].zero_()
        assert load_ok(mgr, kv, ks[0], 3) and row_is(kv, 3, ks[0])   # served from the host tier meanwhile
