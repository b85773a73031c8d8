"""Adversarial review of the configuration surface: TieredKVConfig (keyword / from_dict / from_env),
how TierManager's constructor uses it, tiered_kv.exposition and tiered_kv.hostmem.

What it proved wrong, each pinned by a test that failed before its fix: a key of ``max_key_bytes`` must
fit the disk header's 16-bit length (it failed its whole write batch); an LMDB map too small to open is
refused (the tier ran host-only, the directory called "damaged"); an impossible ``host_capacity_bytes``
is a ConfigError (it escaped as OverflowError/TypeError); write-back spills even when evict-ahead keeps
the host below 3/4 full (nothing ever reached disk); ``from_env`` ignored a misspelled ``TIERED_KV_``
variable without a word (now a warning naming the setting it resembles).  The other tests pin
guarantees the other test files do not check.
"""

from __future__ import annotations

import ctypes
import errno
import http.client
import logging
import mmap
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import Collector

from tiered_kv import TieredKVConfig, TierManager
from tiered_kv import hostmem
from tiered_kv.errors import ConfigError
from tiered_kv.exposition import serve_metrics
from tiered_kv.hostmem import prepare_host_memory

NS = "review|config"
ROW_FLOATS = 32            # float32 rows of 128 bytes
ROW_BYTES = ROW_FLOATS * 4


def _kv(rows: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn((rows, ROW_FLOATS), generator=g, dtype=torch.float32)


def _cfg(**kw: Any) -> TieredKVConfig:
    base: dict[str, Any] = dict(namespace=NS, host_capacity_bytes=16 * ROW_BYTES, pin_host_memory=False,
                                prefault_host_memory=False)
    base.update(kw)
    return TieredKVConfig(**base)


def _disk_cfg(path: Path, **kw: Any) -> TieredKVConfig:
    base: dict[str, Any] = dict(disk_path=str(path), disk_capacity_bytes=256 * ROW_BYTES, disk_io="thread")
    base.update(kw)
    return _cfg(**base)


def _on_disk(path: Path, keys: list[bytes], kv: torch.Tensor) -> list[bytes]:
    """The keys a fresh manager on ``path`` finds (lookup sees disk entries; the host starts empty)."""
    with TierManager(_disk_cfg(path), kv, registry=CollectorRegistry()) as mgr:
        return [k for k in keys if mgr.lookup([k]) == 1]


# ============================================================================ proven defects
def test_a_key_of_max_key_bytes_does_not_lose_the_other_spills_of_its_batch(tmp_path: Path) -> None:
    """``max_key_bytes`` accepts 65536 (its documented edge, tests/test_validation.py EDGES), and
    ``store`` accepts a key of that length.  The disk format packs the key length with struct "H"
    (at most 65535), so the writer's transaction raises ``struct.error``: every spill of that batch
    fails (``writer_error``), innocent keys included, and ``flush()`` says False."""
    try:
        cfg = _disk_cfg(tmp_path / "d", max_key_bytes=65536)
    except ConfigError:
        return   # fixed by refusing the edge the disk format cannot hold
    kv = _kv()
    keys = [b"a", b"k" * 65536, b"b", b"c"]
    with TierManager(cfg, kv, registry=CollectorRegistry()) as mgr:
        job = mgr.store_many(keys, [0, 1, 2, 3])
        assert job is not None and all(c.ok for c in mgr.wait([job], timeout=10))
        flushed = mgr.flush(timeout=10)
    found = _on_disk(tmp_path / "d", [b"a", b"b", b"c"], kv)
    assert found == [b"a", b"b", b"c"] and flushed, (found, flushed)


@pytest.mark.parametrize("size", [4096, 32768])
def test_a_disk_map_size_too_small_to_open_is_refused_or_works(tmp_path: Path, size: int) -> None:
    """``disk_map_size_bytes`` is "the initial LMDB map size" and any value in [0, 2**56] passes the
    config.  With 4096 (a user who meant KiB or pages), a fresh directory fails to open with
    MDB_MAP_FULL, reported as ``disk_path ... is damaged``; the manager silently serves host-only.
    Fixed: a ConfigError naming the field (config or constructor), or a map grown to what is needed."""
    kv = _kv()
    try:
        cfg = _disk_cfg(tmp_path / "d", disk_map_size_bytes=size)
        mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    except ConfigError as exc:
        assert "disk_map_size_bytes" in str(exc)
        return
    with mgr:
        job = mgr.store(b"a", 0)
        assert job is not None
        mgr.wait([job], timeout=10)
        mgr.flush(timeout=10)
    assert _on_disk(tmp_path / "d", [b"a"], kv) == [b"a"]


@pytest.mark.parametrize("disk_io", [None, "process"])
def test_an_impossible_host_capacity_is_a_config_error(tmp_path: Path, disk_io: Optional[str]) -> None:
    """The constructor turns a slab it cannot allocate into a ConfigError naming host_capacity_bytes
    (``_no_slab``), but only for RuntimeError (torch) and OSError (memfd).  With the shared slab
    (disk_io="process") 2**63 bytes or more make ``os.ftruncate`` raise OverflowError; without it, a
    slot count past 2**63 makes ``torch.empty`` raise TypeError ("Overflow when unpacking long long").
    ``disk_capacity_bytes`` has a bound (2**56); ``host_capacity_bytes`` has none."""
    kw: dict[str, Any] = {}
    if disk_io is not None:
        kw = dict(disk_path=str(tmp_path / "d"), disk_capacity_bytes=1 << 20, disk_io=disk_io)
    with pytest.raises(ConfigError, match="host_capacity_bytes"):
        TierManager(_cfg(host_capacity_bytes=1 << 80, **kw), _kv(), registry=CollectorRegistry())


def test_write_back_with_a_large_evict_ahead_still_writes_to_disk(tmp_path: Path) -> None:
    """16 host slots, ``host_evict_ahead_blocks=8`` (valid: below the slot count), ``write_mode="back"``,
    one store per step.  Each step ends with 9 slots used (< 12 = 3/4), so ``_writeback`` never
    starts, and evict-ahead then drops the coldest block, never spilled: 32 blocks evicted, 0 on
    disk.  The disk tier is configured, healthy and never written.  Fixed: the combination refused
    (ConfigError), or the blocks evict-ahead takes spilled first."""
    kv = _kv()
    try:
        cfg = _disk_cfg(tmp_path / "d", write_mode="back", host_evict_ahead_blocks=8)
        mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    except ConfigError as exc:
        assert "host_evict_ahead_blocks" in str(exc) or "write_mode" in str(exc)
        return
    stored = []
    with mgr:
        for i in range(40):
            job = mgr.store(b"wb%d" % i, 0)
            if job is not None:   # (a store may be shed while write-back spills hold host slots)
                stored.append(job.key)
                mgr.wait([job], timeout=10)
            mgr.poll()
            assert mgr.flush(timeout=10)   # the step's spills, if any, are done before the next step
        assert mgr._core.index.evictions >= 20   # (most of the 40 left the 16-slot host)
    assert _on_disk(tmp_path / "d", stored, kv), "no block was ever written back to the disk tier"


# ============================================================================ guarantees pinned
def test_keyword_from_dict_and_from_env_agree() -> None:
    """One field table behind the three ways in: the same values give equal configs."""
    values: dict[str, Any] = dict(namespace=NS, host_capacity_bytes=1 << 20, disk_path="/tmp/x",
                                  disk_capacity_bytes=1 << 30, durability="sync", write_mode="back",
                                  max_inflight_jobs=100, cpu_mover="threads", host_evict_ahead_blocks=0,
                                  pin_host_memory=False, prefault_host_memory=False, writer_queue_blocks=None,
                                  writer_batch_seconds=0.25, remote_ttl_seconds=None, disk_io="thread",
                                  host_policy="s3fifo", disk_admission="second_hit")
    env = {"TIERED_KV_" + k.upper(): ("none" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
           for k, v in values.items()}
    env["TIERED_KV_HOST_CAPACITY_BYTES"] = "1_048_576"
    env["TIERED_KV_PREFAULT_HOST_MEMORY"] = "No"
    kw = TieredKVConfig(**values)
    assert TieredKVConfig.from_dict(values) == kw
    assert TieredKVConfig.from_env(environ=env) == kw


def test_replace_runs_the_cross_field_checks() -> None:
    cfg = _cfg()
    with pytest.raises(ConfigError, match="remote_tomb_ttl_seconds"):
        cfg.replace(remote_write_deadline_seconds=600.0)
    with pytest.raises(ConfigError, match="disk_capacity_bytes"):
        cfg.replace(disk_path="/tmp/x")
    with pytest.raises(ConfigError, match="remote_prefetch_blocks"):
        cfg.replace(remote_queue_blocks=1, remote_batch_blocks=1)


def test_a_remote_password_is_in_no_repr_or_error() -> None:
    url = "redis://user:hunter2-secret@cache.internal:6379/0"
    cfg = _cfg(remote_url=url)
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    with pytest.raises(ConfigError) as ei:
        cfg.replace(remote_url=url.replace(":6379", ":notaport"))
    assert "hunter2" not in str(ei.value) and "***" in str(ei.value)


def _metrics_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tiered-kv-metrics")}


def test_serve_metrics_on_a_port_in_use_raises_and_leaves_nothing_running() -> None:
    before = _metrics_threads()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            serve_metrics(taken.getsockname()[1], registry=CollectorRegistry())
    assert _metrics_threads() == before


class _FailsOnce(Collector):
    def __init__(self) -> None:
        self.calls = 0

    def collect(self) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("collector failed")
        return iter(())


def test_a_failing_collector_is_a_500_and_the_endpoint_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    # wsgiref prints the handler's traceback to stderr: keep the test output clean
    import wsgiref.handlers
    monkeypatch.setattr(wsgiref.handlers.BaseHandler, "log_exception", lambda self, exc_info: None)
    reg = CollectorRegistry()
    Counter("review_probe_total", "probe", registry=reg).inc(3)
    reg.register(_FailsOnce())
    with serve_metrics(0, registry=reg) as srv:
        assert srv.addr == "127.0.0.1"
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(srv.url, timeout=10)
        assert ei.value.code == 500
        with urllib.request.urlopen(srv.url, timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            assert b"review_probe_total 3.0" in resp.read()
        assert srv.thread.is_alive()
    assert not srv.thread.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory advice")
def test_a_populate_refused_for_lack_of_memory_touches_nothing(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """ENOMEM from MADV_POPULATE_WRITE is not EINVAL (an old kernel): no page is written by hand
    (that would OOM-kill, or SIGBUS on a shared slab); the slab is left to fault in, with a warning."""
    real = hostmem._madvise

    def no_memory(lib: Any, addr: int, n: int, advice: int) -> bool:
        if advice == hostmem.MADV_POPULATE_WRITE:
            ctypes.set_errno(errno.ENOMEM)
            return False
        return real(lib, addr, n, advice)

    monkeypatch.setattr(hostmem, "_madvise", no_memory)
    mm = mmap.mmap(-1, 8 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(0xAB)
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        got = prepare_host_memory(t)
    assert got.populated == "no" and got.nbytes == 8 * mmap.PAGESIZE
    assert bool((t == 0xAB).all())
    assert any("MADV_POPULATE_WRITE" in r.getMessage() for r in caplog.records)


def test_an_empty_slab_is_left_alone() -> None:
    assert prepare_host_memory(torch.empty((0, 4096), dtype=torch.uint8)) == hostmem.HostMemory(0, False, "no", 0.0)


def test_the_smallest_disk_map_size_accepted_opens_a_fresh_tier(tmp_path: Path) -> None:
    """The bound is no wider than it must be: the smallest map size the config takes (64 KiB) opens."""
    with pytest.raises(ConfigError, match="disk_map_size_bytes"):
        _disk_cfg(tmp_path / "d", disk_map_size_bytes=(1 << 16) - 1)
    with TierManager(_disk_cfg(tmp_path / "d", disk_map_size_bytes=1 << 16), _kv(),
                     registry=CollectorRegistry()) as mgr:
        assert mgr.disk_healthy


def test_from_env_warns_of_a_variable_that_looks_like_a_misspelled_setting(caplog: pytest.LogCaptureFixture) -> None:
    """A typo in a variable's name used to be ignored silently: the tier ran with the default size.  It is
    still ignored (other tools use the prefix too: the bench's TIERED_KV_TRACE, the remote tier's
    TIERED_KV_REMOTE_USERNAME), but a name close to a setting's is logged, naming both."""
    env = {"TIERED_KV_NAMESPACE": NS, "TIERED_KV_HOST_CAPACTY_BYTES": "4096", "TIERED_KV_TRACE": "t.jsonl",
           "TIERED_KV_REMOTE_USERNAME": "u", "TIERED_KV_SOAK_CYCLES": "5", "OTHER_HOST_CAPACTY_BYTES": "1"}
    with caplog.at_level(logging.WARNING, logger="tiered_kv.config"):
        cfg = TieredKVConfig.from_env(environ=env, host_capacity_bytes=1 << 20)
    assert cfg.host_capacity_bytes == 1 << 20
    msgs = [r.getMessage() for r in caplog.records if r.name == "tiered_kv.config"]
    assert len(msgs) == 1, msgs
    assert "TIERED_KV_HOST_CAPACTY_BYTES" in msgs[0] and "TIERED_KV_HOST_CAPACITY_BYTES" in msgs[0]
