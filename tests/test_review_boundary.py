"""Adversarial review of the public boundary (config, TierManager's arguments, hostmem, the CLI).

Every test here fails on the code it was written against: each pins one defect where bad input
escapes as a raw Python/torch/LMDB exception (or a traceback and exit status 1 from the CLI)
instead of an error from tiered_kv.errors naming the value, or where a documented input cannot
be given at all.  Where it matters, the test also checks that the refused call left a live
manager working and its stored blocks byte-exact."""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import disk_helpers as dh
from fakes import fill_row, make_config, make_kv, row_matches
from tiered_kv import TieredKVConfig, TierManager, hostmem
from tiered_kv.errors import ConfigError, DeviceTensorError, ManagerClosedError, TieredKVError

NS = "review|fp16|tp0"


def _refused_with(exc_type, fn, *needles):
    """``fn()`` must raise ``exc_type`` (a TieredKVError) naming each needle; any other exception fails
    the test with its type and message (not an error of the test itself)."""
    raw = None
    try:
        got = fn()
    except TieredKVError as exc:
        assert isinstance(exc, exc_type), f"{type(exc).__name__}: {exc}"
        for n in needles:
            assert n in str(exc), f"{n!r} not named in {str(exc)!r}"
        return exc
    except Exception as exc:   # noqa: BLE001 - the finding: a raw exception crossed the boundary
        raw = f"raw {type(exc).__name__} crossed the API boundary: {exc}"[:300]
    else:
        raw = f"accepted, returned {got!r:.120}"
    pytest.fail(raw)


def _env(**kv: str) -> dict[str, str]:
    env = {"TIERED_KV_NAMESPACE": NS, "TIERED_KV_HOST_CAPACITY_BYTES": "4096"}
    env.update({"TIERED_KV_" + k.upper(): v for k, v in kv.items()})
    return env


# ============================================================================ config: from_env
@pytest.mark.parametrize("raw,want", [("0", False), ("false", False), ("1", True), ("true", True)])
def test_from_env_can_set_prefault_host_memory(raw, want):
    """Every field is settable as TIERED_KV_<FIELD> (config.py docstring, docs/vllm.md table); the bool
    prefault_host_memory is not: "0"/"1" parse as ints the field check refuses, "false"/"true" do not parse."""
    try:
        cfg = TieredKVConfig.from_env(environ=_env(prefault_host_memory=raw))
    except ConfigError as exc:
        pytest.fail(f"TIERED_KV_PREFAULT_HOST_MEMORY={raw!r} refused: {exc}")
    assert cfg.prefault_host_memory is want


def test_from_env_namespace_that_is_not_utf8_is_a_config_error():
    """os.environ decodes a non-UTF-8 value with surrogateescape; the namespace length check encodes it
    strictly and raises UnicodeEncodeError out of from_env."""
    bad = b"model-\xff".decode("utf-8", "surrogateescape")
    _refused_with(ConfigError, lambda: TieredKVConfig.from_env(environ=_env(namespace=bad)), "namespace")
    _refused_with(ConfigError, lambda: TieredKVConfig(namespace=bad, host_capacity_bytes=4096), "namespace")


def test_from_env_remote_ttl_zero_means_one_thing():
    """TIERED_KV_REMOTE_TTL_SECONDS: "0" silently means None (never expire, undocumented: docs/remote.md
    says `none`), while "00" and "0x0" (the same integer) are refused as out of range."""
    def outcome(raw):
        try:
            return ("ok", TieredKVConfig.from_env(environ=_env(remote_ttl_seconds=raw)).remote_ttl_seconds)
        except ConfigError:
            return ("refused", None)
    assert outcome("0") == outcome("00") == outcome("0x0"), [outcome(r) for r in ("0", "00", "0x0")]


# ============================================================================ config: fields
@pytest.mark.parametrize("field", ["host_policy", "disk_policy", "host_admission", "disk_admission"])
def test_unhashable_policy_name_is_a_config_error(field):
    """A list (e.g. from a JSON extra config) as a policy name: `value not in POLICIES` on a dict raises
    TypeError: unhashable type."""
    _refused_with(ConfigError, lambda: TieredKVConfig.from_dict({"namespace": NS, "host_capacity_bytes": 4096,
                                                                 field: ["lru"]}), field)


@pytest.mark.parametrize("field", ["writer_batch_seconds", "remote_timeout_seconds",
                                   "remote_write_deadline_seconds", "remote_miss_ttl_seconds"])
def test_float_field_given_a_huge_int_is_a_config_error(field):
    """_check_float converts with float(value): an int past 1.8e308 raises OverflowError."""
    _refused_with(ConfigError, lambda: TieredKVConfig(namespace=NS, host_capacity_bytes=4096,
                                                      **{field: 10 ** 400}), field)


def test_replace_with_an_unknown_field_is_a_config_error():
    """from_dict names unknown keys in a ConfigError; replace() (documented as validating again) raises
    dataclasses' TypeError."""
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=4096)
    _refused_with(ConfigError, lambda: cfg.replace(host_capcity_bytes=8192), "host_capcity_bytes")


def test_disk_path_with_a_nul_byte_is_a_config_error(tmp_path):
    """The config accepts a disk_path containing NUL; TierManager() then raises a raw ValueError
    ("embedded null byte") from mkdir."""
    def make():
        cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=16 * 128, disk_path=str(tmp_path / "a\0b"),
                             disk_capacity_bytes=64 * 128)
        TierManager(cfg, make_kv(16), registry=CollectorRegistry()).close()
    _refused_with(ConfigError, make, "disk_path")


@pytest.mark.parametrize("kw", [dict(disk_capacity_bytes=1 << 62),
                                dict(disk_capacity_bytes=64 * 128, disk_map_size_bytes=1 << 70)],
                         ids=["capacity", "map_size"])
def test_disk_sizes_beyond_lmdb_are_refused_or_degrade_under_disk_io_thread(kw, tmp_path):
    """With disk_io="process" an LMDB OverflowError at open is a fault (disk tier off, counted); with
    disk_io="thread" the same config makes TierManager() raise the raw OverflowError (DiskTier.open
    catches only DiskTierError).  A config field must mean the same under both, and sizes LMDB cannot
    map should be refused by the config."""
    raw = None
    try:
        cfg = dh.disk_config(tmp_path / "d", row_bytes=128, disk_io="thread").replace(**kw)
        TierManager(cfg, dh.make_kv(4, row_bytes=128), registry=CollectorRegistry()).close()
    except TieredKVError:
        return   # refused with a library error: fine (degrading like disk_io="process" is fine too)
    except Exception as exc:   # noqa: BLE001
        raw = f"raw {type(exc).__name__} from TierManager(): {exc}"
    assert raw is None, raw


@pytest.mark.parametrize("size", [1 << 55, 1 << 62])
def test_host_capacity_that_cannot_be_allocated_is_a_config_error(size):
    """A host slab no machine can allocate is a ConfigError naming host_capacity_bytes: past 64 PiB from
    the config itself (bounded as the disk capacity is), below it from the constructor (not torch's
    RuntimeError, nor OSError from the shared slab's mmap)."""
    _refused_with(ConfigError, lambda: TierManager(TieredKVConfig(namespace=NS, host_capacity_bytes=size),
                                                   make_kv(16), registry=CollectorRegistry()),
                  "host_capacity_bytes")


# ============================================================================ TierManager
@pytest.mark.parametrize("make", [
    lambda: torch.zeros(4, 1, 8, dtype=torch.float16).transpose(1, 2),   # [4, 8, 1], strides (8, 1, 8)
    lambda: torch.zeros(4, 8).to_sparse_csr(),
    lambda: torch.zeros(4, 8).to_mkldnn(),
], ids=["size1-last-dim-stride", "sparse_csr", "mkldnn"])
def test_device_blocks_the_checks_let_through(make):
    """check_device_blocks relies on is_contiguous(): a size-1 last dim with a stride other than 1 is
    'contiguous' but cannot be viewed as bytes (raw RuntimeError), and non-strided layouts raise raw
    RuntimeError / NotImplementedError from is_contiguous() or view()."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = make()
    cfg = make_config(8, row_bytes=64)
    _refused_with(DeviceTensorError, lambda: TierManager(cfg, t, registry=CollectorRegistry()), "device_blocks")


def test_wait_and_flush_with_a_huge_int_timeout(fake, kv):
    """check_timeout does float(timeout): 10**400 raises OverflowError out of wait()/flush(); the manager
    must refuse with ConfigError (or treat it as no deadline, like inf) and keep its stored block."""
    mgr, mover = fake
    fill_row(kv, 0, b"a")
    mover.complete(mgr.store(b"a", 0))
    mgr.poll()
    raw = []
    for name, call in (("wait", lambda: mgr.wait(timeout=10 ** 400)), ("flush", lambda: mgr.flush(timeout=10 ** 400))):
        try:
            call()
        except ConfigError:
            pass
        except Exception as exc:   # noqa: BLE001
            raw.append(f"{name}: raw {type(exc).__name__}: {exc}")
    j = mgr.load(b"a", 7)
    mover.complete(j)
    mgr.poll()
    assert row_matches(kv, 7, b"a")
    assert not raw, raw


def test_host_bytes_after_close_is_refused(fake, kv):
    """Every call after close() raises ManagerClosedError ('no further calls are accepted'); host_bytes()
    still reads the released slab."""
    mgr, mover = fake
    fill_row(kv, 0, b"a")
    mover.complete(mgr.store(b"a", 0))
    mgr.poll()
    mgr.close()
    _refused_with(ManagerClosedError, lambda: mgr.host_bytes(b"a"), "closed")


# ============================================================================ hostmem
def test_prefault_does_not_touch_pages_the_kernel_could_not_populate(monkeypatch):
    """The one-write-per-page fallback is for kernels without MADV_POPULATE_WRITE (EINVAL).  It also runs
    when the kernel refused for lack of memory (ENOMEM), where writing every page gets the serving
    process OOM-killed (anonymous slab) or SIGBUS (memfd slab): the fault must degrade, not kill."""
    class Lib:
        def madvise(self, addr, length, advice):
            if advice == hostmem.MADV_POPULATE_WRITE:
                ctypes.set_errno(errno.ENOMEM)
                return -1
            return 0
    monkeypatch.setattr(hostmem, "_libc", lambda: Lib())
    mm = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    r = hostmem.prepare_host_memory(t)
    assert r.populated != "touch", r


# ============================================================================ CLI
def _cli(capsys, *argv):
    from tiered_kv.tools.cli import main
    raw = None
    try:
        rc = main(list(argv))
    except SystemExit as exc:   # argparse
        rc = exc.code
    except Exception as exc:   # noqa: BLE001
        raw = f"traceback, exit 1 ({type(exc).__name__}: {exc})"[:300]
    if raw is not None:
        pytest.fail(raw)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--seconds", "0"], "seconds"),
    (["--steps", "0"], "steps"),
    (["--steps", "2", "--device-blocks", "5"], "device_blocks"),
    (["--steps", "2", "--host-blocks", "0"], "host"),
    (["--steps", "2", "--abort-rate", "nan"], "abort"),
    (["--steps", "2", "--metrics-port", "99999"], "port"),
], ids=["seconds0", "steps0", "device5", "host0", "abort-nan", "port"])
def test_demo_bad_arguments_exit_2_without_a_traceback(argv, needle, capsys):
    """WorkloadConfig/serve_metrics raise ValueError and cli.main lets it out: a traceback, exit 1."""
    rc, err = _cli(capsys, "demo", "--no-progress", *argv)
    assert rc == 2 and needle in err, (rc, err)


def test_demo_on_a_disk_path_a_live_manager_holds_refuses_cleanly(tmp_path, capsys):
    """demo --disk-path of a path held by a live TierManager: DiskInUseError escapes as a traceback (the
    operator commands exit 3 naming the holder).  The live manager keeps its blocks."""
    path = tmp_path / "d"
    kv = dh.make_kv(8)
    mgr = TierManager(dh.disk_config(path, host_slots=2, disk_slots=16), kv, registry=CollectorRegistry())
    try:
        ks = dh.keys(3)
        dh.store_seq(mgr, kv, ks)
        rc, err = _cli(capsys, "demo", "--no-progress", "--steps", "2", "--disk-path", str(path))
        assert rc in (2, 3) and "in use" in err, (rc, err)
    finally:
        try:
            assert all(dh.load_ok(mgr, kv, k, 7) for k in ks)
        finally:
            mgr.close()


@pytest.fixture
def tiny_trace(tmp_path):
    from tiered_kv.tools.tracetools import Request, write_trace
    p = tmp_path / "t.jsonl"
    write_trace(p, [Request(float(i), 1024, 8, (0, 1, i + 2)) for i in range(12)])
    return p


@pytest.mark.parametrize("extra", [
    ["--json", "{tmp}/no-such-dir/out.json"],
    ["--disk", "8", "--scratch", "{tmp}/no-such-dir"],
    ["--disk", "8", "--scratch", "{trace}"],
    ["--sweep", "{tmp}/s.png", "--sweep-sizes", "lots"],
], ids=["json-dir-missing", "scratch-missing", "scratch-is-a-file", "sweep-sizes"])
def test_replay_bad_arguments_exit_2_without_a_traceback(extra, tiny_trace, tmp_path, capsys):
    """replay checks the trace and sizes inside its try, but --json (written after the whole run),
    --scratch (mkdtemp) and --sweep-sizes (parsed after the replay) fail with a traceback, exit 1."""
    if "--sweep" in extra:
        pytest.importorskip("matplotlib")
    argv = [a.format(tmp=tmp_path, trace=tiny_trace) for a in extra]
    rc, err = _cli(capsys, "replay", str(tiny_trace), "--quiet", "--host", "4", *argv)
    assert rc == 2 and err.startswith("tiered-kv replay"), (rc, err)


def test_a_constructor_that_fails_after_making_the_shared_slab_closes_it(tmp_path):
    """A manager whose disk tier cannot open (its path held by another manager: DiskInUseError from the
    core) raises after it made the shared host slab: the slab's file descriptor and the metrics it
    registered are let go (a second attempt on the same registry, once the path is free, works)."""
    import os

    from tiered_kv.errors import DiskInUseError

    def fds() -> set[str]:   # the listing's own directory fd is gone once listdir returns: lexists drops it
        return {fd for fd in os.listdir("/proc/self/fd") if os.path.lexists(f"/proc/self/fd/{fd}")}

    cfg = dh.disk_config(tmp_path / "d", row_bytes=128, disk_io="process")
    holder = TierManager(cfg, dh.make_kv(4, row_bytes=128), registry=CollectorRegistry())
    reg = CollectorRegistry()
    try:
        before = fds()
        with pytest.raises(DiskInUseError):
            TierManager(cfg, dh.make_kv(4, row_bytes=128), registry=reg)
        leaked = fds() - before
        assert not leaked, {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in leaked}
        assert list(reg.collect()) == []
    finally:
        holder.close()
    TierManager(cfg, dh.make_kv(4, row_bytes=128), registry=reg).close()


def test_a_timeout_may_be_any_real_number_numpy_scalars_included() -> None:
    """A deadline computed with numpy is a numpy scalar (float32, int64): a number like any other.  A
    bool, a string, NaN or a negative number is still refused, naming the value."""
    import numpy as np
    from tiered_kv.checks import check_timeout
    assert check_timeout(np.float32(0.5)) == 0.5 and check_timeout(np.int64(3)) == 3.0
    assert type(check_timeout(np.float32(0.5))) is float
    for bad in (True, np.bool_(True), "1", float("nan"), np.float64("nan"), -1, np.int64(-1)):
        with pytest.raises(ConfigError, match="timeout"):
            check_timeout(bad)
