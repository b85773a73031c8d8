"""Bad input: the right error from tiered_kv.errors, naming the offending value,
raised before any state or metric changes."""

from __future__ import annotations

import math
import threading
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry

from fakes import (FakeMoverFactory, fill_row, instrument_get, make_config, make_fake_manager, make_kv,
                   metric_samples, snapshot)
from tiered_kv import Job, JobKind, TieredKVConfig, TierManager
from tiered_kv.errors import (BlockBusyError, ConfigError, DeviceTensorError, InvalidBlockError, InvalidJobError,
                              InvalidKeyError, ManagerClosedError, TieredKVError)

NS = "test|fp16|tp0"


@pytest.fixture
def busy(fake, kv):
    """A manager with some state: a READY key, a store in flight, a load in flight (row 40)."""
    mgr, mover = fake
    fill_row(kv, 0, b"ready")
    j = mgr.store(b"ready", 0)
    mover.complete(j)
    mgr.poll()
    fill_row(kv, 1, b"writing")
    mgr.store(b"writing", 1)
    mgr.load(b"ready", 40)
    mgr.lookup([b"ready"])
    return mgr, mover


def _unchanged(mgr, fn, exc_type, *needles):
    before = snapshot(mgr)
    with pytest.raises(exc_type) as ei:
        fn()
    assert isinstance(ei.value, TieredKVError)
    for n in needles:
        assert n in str(ei.value), f"{n!r} not named in {str(ei.value)!r}"
    assert snapshot(mgr) == before
    return ei.value


# ============================================================================ device_blocks
@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int64, torch.int32, torch.int16])
def test_unsupported_dtype(cfg, dtype):
    t = torch.zeros((8, 2, 4, 8), dtype=dtype)
    with pytest.raises(DeviceTensorError, match=str(dtype).replace(".", r"\.")):
        TierManager(cfg, t, registry=CollectorRegistry())


@pytest.mark.parametrize("shape,needle", [((16,), "(16,)"), ((), "()"), ((0, 2, 4, 8), "(0, 2, 4, 8)"), ((4, 0), "(4, 0)")])
def test_bad_shape(cfg, shape, needle):
    with pytest.raises(DeviceTensorError) as ei:
        TierManager(cfg, torch.zeros(shape, dtype=torch.float16), registry=CollectorRegistry())
    assert needle in str(ei.value)


@pytest.mark.parametrize("make", [
    lambda kv: kv.transpose(1, 2),          # transposed rows
    lambda kv: kv[::2],                     # strided rows
    lambda kv: kv[:, :, :, ::2],            # strided inside rows
    lambda kv: kv[:1].expand(8, 2, 4, 8),   # stride-0 rows
    lambda kv: kv.permute(1, 0, 2, 3),      # rows interleaved
], ids=["transposed", "strided-rows", "strided-inner", "expanded", "permuted"])
def test_non_contiguous(cfg, kv, make):
    t = make(kv)
    assert not t.is_contiguous()
    with pytest.raises(DeviceTensorError) as ei:
        TierManager(cfg, t, registry=CollectorRegistry())
    assert str(tuple(t.stride())) in str(ei.value)


def test_requires_grad(cfg):
    t = torch.zeros((8, 2, 4, 8), dtype=torch.float32, requires_grad=True)
    with pytest.raises(DeviceTensorError, match="grad"):
        TierManager(cfg, t, registry=CollectorRegistry())


def test_meta_device(cfg):
    t = torch.zeros((8, 2, 4, 8), dtype=torch.float16, device="meta")
    with pytest.raises(DeviceTensorError, match="meta"):
        TierManager(cfg, t, registry=CollectorRegistry())


@pytest.mark.parametrize("obj,needle", [([[0.0] * 4] * 4, "list"), (None, "NoneType"), ("kv", "str")])
def test_not_a_tensor(cfg, obj, needle):
    with pytest.raises(DeviceTensorError, match=needle):
        TierManager(cfg, obj, registry=CollectorRegistry())


def test_numpy_array_is_not_a_tensor(cfg):
    import numpy as np
    with pytest.raises(DeviceTensorError, match="ndarray"):
        TierManager(cfg, np.zeros((8, 64), dtype=np.float16), registry=CollectorRegistry())


def test_config_must_be_a_config(kv):
    with pytest.raises(ConfigError, match="dict"):
        TierManager({"namespace": NS, "host_capacity_bytes": 1 << 20}, kv, registry=CollectorRegistry())


def test_host_capacity_smaller_than_one_row(kv):
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=127)   # a row is 128 bytes
    with pytest.raises(ConfigError) as ei:
        TierManager(cfg, kv, registry=CollectorRegistry())
    assert "127" in str(ei.value) and "128" in str(ei.value)


def test_failed_construction_leaves_the_registry_usable(cfg, kv):
    """Validation happens before metrics are registered: retrying on the same registry works."""
    reg = CollectorRegistry()
    for bad in (torch.zeros(8, dtype=torch.float16), kv.transpose(1, 2), kv.to(torch.int64)):
        with pytest.raises(DeviceTensorError):
            TierManager(cfg, bad, registry=reg)
    with pytest.raises(ConfigError):
        TierManager(cfg.replace(host_capacity_bytes=1), kv, registry=reg)
    assert metric_samples(reg) == {}
    mgr = TierManager(cfg, kv, registry=reg)
    mgr.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-accelerator path")
def test_pin_host_memory_true_without_accelerator(kv):
    """Explicit pinning on a machine without CUDA is refused: a ConfigError naming the field
    (checks.pin_decision; docs/vllm.md: "``True`` without CUDA is refused"), raised before any
    metric is registered -- never a raw torch RuntimeError, and never silently unpinned.  Only
    ``None`` (the default) skips pinning without CUDA."""
    reg = CollectorRegistry()
    with pytest.raises(ConfigError, match=r"pin_host_memory=True needs CUDA"):
        TierManager(make_config(8, pin_host_memory=True), kv, registry=reg)
    assert metric_samples(reg) == {}
    for pin in (None, False):              # what is accepted without CUDA, and unpinned
        mgr = TierManager(make_config(8, pin_host_memory=pin), kv, registry=CollectorRegistry())
        try:
            assert mgr._host_rows.is_pinned() is False
        finally:
            mgr.close()


# ============================================================================ block
BAD_BLOCKS = [(256, InvalidBlockError, "256"), (10**12, InvalidBlockError, str(10**12)), (-1, InvalidBlockError, "-1"),
              (True, InvalidBlockError, "True"), (False, InvalidBlockError, "False"), (1.0, InvalidBlockError, "1.0"),
              ("3", InvalidBlockError, "'3'"), (None, InvalidBlockError, "None"), (3.5, InvalidBlockError, "3.5")]


@pytest.mark.parametrize("block,exc,needle", BAD_BLOCKS, ids=[repr(b[0]) for b in BAD_BLOCKS])
@pytest.mark.parametrize("op", ["store", "load", "free_block"])
def test_bad_block(busy, block, exc, needle, op):
    mgr, _ = busy
    fn = {"store": lambda: mgr.store(b"new", block), "load": lambda: mgr.load(b"ready", block),
          "free_block": lambda: mgr.free_block(block)}[op]
    _unchanged(mgr, fn, exc, needle)


def test_integer_like_blocks_are_accepted(fake, kv):
    import numpy as np
    mgr, mover = fake
    fill_row(kv, 3, b"a")
    j = mgr.store(b"a", np.int64(3))
    assert j is not None and j.block == 3 and type(j.block) is int
    assert mgr.free_block(torch.tensor(200)) is True


def test_block_busy_leaves_state_unchanged(busy):
    mgr, _ = busy
    _unchanged(mgr, lambda: mgr.store(b"other", 40), BlockBusyError, "40")
    _unchanged(mgr, lambda: mgr.load(b"ready", 40), BlockBusyError, "40")


# ============================================================================ key
BAD_KEYS = [("abc", "'abc'"), (bytearray(b"abc"), "bytearray(b'abc')"), (5, "5"), (None, "None"),
            (memoryview(b"abc"), "memoryview"), (b"", "b''"), (b"x" * 1025, "1025")]


@pytest.mark.parametrize("key,needle", BAD_KEYS, ids=["str", "bytearray", "int", "None", "memoryview", "empty", "too-long"])
@pytest.mark.parametrize("op", ["store", "load", "invalidate", "lookup", "host_bytes"])
def test_bad_key(busy, key, needle, op):
    mgr, _ = busy
    fn = {"store": lambda: mgr.store(key, 5), "load": lambda: mgr.load(key, 5), "invalidate": lambda: mgr.invalidate(key),
          "lookup": lambda: mgr.lookup([b"ready", key]), "host_bytes": lambda: mgr.host_bytes(key)}[op]
    _unchanged(mgr, fn, InvalidKeyError, needle)


def test_max_key_bytes_is_configurable(kv):
    mgr, _ = make_fake_manager(make_config(8, max_key_bytes=4), kv)
    fill_row(kv, 0, b"abcd")
    assert mgr.store(b"abcd", 0) is not None
    _unchanged(mgr, lambda: mgr.store(b"abcde", 0), InvalidKeyError, "5", "max_key_bytes=4")
    mgr.close()


@pytest.mark.parametrize("keys,needle", [("abc", "str"), (b"abc", "bytes"), (None, "NoneType"), (7, "int")])
def test_lookup_keys_must_be_a_sequence_of_bytes(busy, keys, needle):
    mgr, _ = busy
    _unchanged(mgr, lambda: mgr.lookup(keys), InvalidKeyError, needle)


def test_lookup_with_a_bad_key_touches_no_lru_entry(kv):
    """lookup validates every key before it touches the LRU."""
    mgr, mover = make_fake_manager(make_config(2), kv)
    for i, k in enumerate((b"a", b"b")):
        fill_row(kv, i, k)
        mover.complete(mgr.store(k, i))
    mgr.poll()
    with pytest.raises(InvalidKeyError):
        mgr.lookup([b"a", "b"])   # would make a the most recently used
    fill_row(kv, 2, b"c")
    mover.complete(mgr.store(b"c", 2))
    mgr.poll()
    assert mgr.lookup([b"a"]) == 0 and mgr.lookup([b"b"]) == 1  # a was still the LRU entry
    mgr.close()


# ============================================================================ config
BAD_FIELDS = [
    ("namespace", ""), ("namespace", 5), ("namespace", None), ("namespace", "n" * 513),
    ("host_capacity_bytes", 0), ("host_capacity_bytes", -1), ("host_capacity_bytes", True),
    ("host_capacity_bytes", 1.5), ("host_capacity_bytes", "8"),
    ("disk_path", 123), ("disk_path", ""), ("disk_path", b"/tmp/x"),
    ("disk_capacity_bytes", -1), ("disk_capacity_bytes", True), ("disk_capacity_bytes", 2.0),
    ("durability", "fast"), ("durability", None), ("durability", "SYNC"),
    ("write_mode", "around"), ("write_mode", 1),
    ("cpu_mover", "thread"), ("cpu_mover", None), ("cpu_mover", "NATIVE"),
    ("max_inflight_jobs", 0), ("max_inflight_jobs", (1 << 24) + 1), ("max_inflight_jobs", True),
    ("num_copy_workers", 0), ("num_copy_workers", 65), ("num_copy_workers", False),
    ("num_copy_streams", 0), ("num_copy_streams", 65), ("num_copy_streams", 2.0),
    ("copy_batch_max", 0), ("copy_batch_max", (1 << 16) + 1), ("copy_batch_max", True),
    ("host_evict_ahead_blocks", -1), ("host_evict_ahead_blocks", (1 << 20) + 1), ("host_evict_ahead_blocks", True),
    ("host_evict_ahead_blocks", 2.0), ("host_evict_ahead_blocks", "auto"),
    ("pin_host_memory", 1), ("pin_host_memory", "yes"), ("pin_host_memory", 0),
    ("max_key_bytes", 0), ("max_key_bytes", 65537), ("max_key_bytes", True),
    ("writer_queue_blocks", 0), ("writer_queue_blocks", (1 << 20) + 1),
    ("writer_batch_blocks", 0), ("writer_batch_blocks", 65537),
    ("writer_batch_bytes", 0), ("writer_batch_bytes", True),
    ("writer_batch_seconds", -0.001), ("writer_batch_seconds", 60.5), ("writer_batch_seconds", True),
    ("writer_batch_seconds", "0.1"), ("writer_batch_seconds", math.nan), ("writer_batch_seconds", math.inf),
    ("disk_map_size_bytes", -1), ("disk_map_size_bytes", 1.0),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r:.20}" for f, v in BAD_FIELDS])
def test_config_field_out_of_range(field, value):
    base = dict(namespace=NS, host_capacity_bytes=1 << 20)
    base[field] = value
    with pytest.raises(ConfigError) as ei:
        TieredKVConfig(**base)
    msg = str(ei.value)
    assert field in msg, msg
    if field == "namespace" and isinstance(value, str) and value:
        assert "513" in msg
    elif field == "disk_path" and value == "":
        assert msg == "disk_path must not be empty", msg
    else:
        assert repr(value) in msg, msg


def test_disk_path_without_capacity():
    with pytest.raises(ConfigError, match="disk_capacity_bytes") as ei:
        TieredKVConfig(namespace=NS, host_capacity_bytes=1 << 20, disk_path="/tmp/x")
    assert "0" in str(ei.value)


EDGES = dict(namespace="n" * 512, host_capacity_bytes=1, max_inflight_jobs=1 << 24, num_copy_workers=64,
             num_copy_streams=1, copy_batch_max=1, pin_host_memory=False, max_key_bytes=65535, writer_batch_seconds=0,
             writer_queue_blocks=1 << 20, writer_batch_blocks=1 << 16, host_evict_ahead_blocks=0,
             disk_capacity_bytes=0, disk_map_size_bytes=0)
PAST_EDGES = dict(namespace="n" * 513, host_capacity_bytes=0, max_inflight_jobs=(1 << 24) + 1, num_copy_workers=65,
                  num_copy_streams=0, copy_batch_max=0, max_key_bytes=65536, writer_batch_seconds=-1e-9,
                  writer_queue_blocks=(1 << 20) + 1, writer_batch_blocks=(1 << 16) + 1, host_evict_ahead_blocks=-1,
                  disk_capacity_bytes=-1, disk_map_size_bytes=-1)


def test_config_edges_are_accepted():
    """Every edge value is accepted and kept as given (no clamping or normalizing); one step past
    each edge is a ConfigError naming the field."""
    cfg = TieredKVConfig(**EDGES)
    for field, value in EDGES.items():
        got = getattr(cfg, field)
        assert got == value and type(got) is type(value), (field, got, value)
    defaults = TieredKVConfig(namespace=NS, host_capacity_bytes=1)
    for field in set(TieredKVConfig.field_names()) - set(EDGES):   # the rest keep their defaults
        assert getattr(cfg, field) == getattr(defaults, field), field
    assert cfg == TieredKVConfig.from_dict(EDGES)
    assert set(PAST_EDGES) == set(EDGES) - {"pin_host_memory"}
    for field, value in PAST_EDGES.items():
        with pytest.raises(ConfigError, match=field):
            TieredKVConfig(**dict(EDGES, **{field: value}))


def test_replace_validates_again():
    cfg = TieredKVConfig(namespace=NS, host_capacity_bytes=1 << 20)
    with pytest.raises(ConfigError, match="max_inflight_jobs"):
        cfg.replace(max_inflight_jobs=0)
    assert cfg.replace(max_inflight_jobs=5).max_inflight_jobs == 5


def test_from_dict():
    cfg = TieredKVConfig.from_dict({"namespace": NS, "host_capacity_bytes": 4096, "num_copy_workers": 3})
    assert cfg.host_capacity_bytes == 4096 and cfg.num_copy_workers == 3
    with pytest.raises(ConfigError) as ei:
        TieredKVConfig.from_dict({"namespace": NS, "host_capacity_bytes": 4096, "bogus_key": 1, "another": 2})
    assert "bogus_key" in str(ei.value) and "another" in str(ei.value)
    with pytest.raises(ConfigError, match="list"):
        TieredKVConfig.from_dict([("namespace", NS)])
    with pytest.raises(ConfigError, match="host_capacity_bytes"):
        TieredKVConfig.from_dict({"namespace": NS, "host_capacity_bytes": -5})


def test_from_dict_missing_required_field_is_a_config_error():
    """A mapping without host_capacity_bytes (e.g. vLLM's kv_connector_extra_config) is bad input."""
    with pytest.raises(ConfigError, match="host_capacity_bytes"):
        TieredKVConfig.from_dict({"namespace": NS})


def test_from_env_parsing():
    env = {"TIERED_KV_NAMESPACE": "m|bf16|tp1", "TIERED_KV_HOST_CAPACITY_BYTES": "0x1000",
           "TIERED_KV_MAX_INFLIGHT_JOBS": " 12 ", "TIERED_KV_PIN_HOST_MEMORY": "off",
           "TIERED_KV_WRITER_BATCH_SECONDS": "0.25", "TIERED_KV_DISK_PATH": "", "UNRELATED": "x"}
    cfg = TieredKVConfig.from_env(environ=env)
    assert cfg.namespace == "m|bf16|tp1" and cfg.host_capacity_bytes == 4096 and cfg.max_inflight_jobs == 12
    assert cfg.pin_host_memory is False and cfg.writer_batch_seconds == 0.25 and cfg.disk_path is None
    for raw, want in (("1", True), ("yes", True), ("auto", None), ("", None), ("FALSE", False)):
        assert TieredKVConfig.from_env(environ=dict(env, TIERED_KV_PIN_HOST_MEMORY=raw)).pin_host_memory is want
    for raw, want in (("auto", None), ("", None), ("0", 0), ("0x10", 16)):
        cfg = TieredKVConfig.from_env(environ=dict(env, TIERED_KV_HOST_EVICT_AHEAD_BLOCKS=raw))
        assert cfg.host_evict_ahead_blocks == want
    with pytest.raises(ConfigError, match="host_evict_ahead_blocks"):
        TieredKVConfig.from_env(environ=dict(env, TIERED_KV_HOST_EVICT_AHEAD_BLOCKS="some"))
    for field in ("writer_queue_blocks", "writer_batch_blocks"):   # None: derived from the block size
        for raw, want in (("auto", None), ("none", None), ("", None), ("0x20", 32)):
            assert getattr(TieredKVConfig.from_env(environ=dict(env, **{"TIERED_KV_" + field.upper(): raw})), field) == want
        with pytest.raises(ConfigError, match=field):
            TieredKVConfig.from_env(environ=dict(env, **{"TIERED_KV_" + field.upper(): "some"}))
    # overrides win, another prefix
    cfg = TieredKVConfig.from_env(prefix="X_", environ={"X_NAMESPACE": "a", "X_HOST_CAPACITY_BYTES": "10"},
                                  host_capacity_bytes=20)
    assert cfg.namespace == "a" and cfg.host_capacity_bytes == 20


_UNPARSEABLE = "environment value for {} is not valid: {!r}"


@pytest.mark.parametrize("var,raw,message", [
    ("TIERED_KV_HOST_CAPACITY_BYTES", "lots", _UNPARSEABLE.format("host_capacity_bytes", "lots")),
    ("TIERED_KV_HOST_CAPACITY_BYTES", "1e6", _UNPARSEABLE.format("host_capacity_bytes", "1e6")),
    ("TIERED_KV_PIN_HOST_MEMORY", "maybe", _UNPARSEABLE.format("pin_host_memory", "maybe")),
    ("TIERED_KV_WRITER_BATCH_SECONDS", "soon", _UNPARSEABLE.format("writer_batch_seconds", "soon")),
    # these parse; the field check refuses the value
    ("TIERED_KV_MAX_INFLIGHT_JOBS", "0", "max_inflight_jobs must be in [1, 16777216], got 0"),
    ("TIERED_KV_DURABILITY", "fast", "durability must be one of ('sync', 'batch', 'none'), got 'fast'"),
    ("TIERED_KV_CPU_MOVER", "gpu", "cpu_mover must be one of ('native', 'threads'), got 'gpu'"),
])
def test_from_env_bad_values(var, raw, message):
    env = {"TIERED_KV_NAMESPACE": "m", "TIERED_KV_HOST_CAPACITY_BYTES": "4096", var: raw}
    with pytest.raises(ConfigError) as ei:
        TieredKVConfig.from_env(environ=env)
    assert str(ei.value) == message


def test_from_env_unknown_override():
    with pytest.raises(ConfigError, match="nonsense"):
        TieredKVConfig.from_env(environ={"TIERED_KV_NAMESPACE": "m", "TIERED_KV_HOST_CAPACITY_BYTES": "8"}, nonsense=1)


def test_from_env_missing_required_field_is_a_config_error():
    with pytest.raises(ConfigError, match="host_capacity_bytes"):
        TieredKVConfig.from_env(environ={"TIERED_KV_NAMESPACE": "m"})


# ============================================================================ jobs
def test_cancel_non_job_and_foreign_job(busy, kv):
    mgr, _ = busy
    other, omover = make_fake_manager(make_config(8), make_kv(16, seed=2))
    fill_row(other._device_blocks, 0, b"o")
    foreign = other.store(b"o", 0)
    forged = Job(uuid.uuid4(), JobKind.STORE, b"ready", 0)
    for bad, needle in ((None, "None"), ("job", "'job'"), (42, "42"), (foreign, str(foreign.token)),
                        (forged, str(forged.token))):
        _unchanged(mgr, lambda: mgr.cancel(bad), InvalidJobError, needle)
    assert foreign.state.value == "pending"   # the other manager's job is untouched
    other.close()


def test_wait_with_foreign_jobs(busy):
    mgr, mover = busy
    forged = Job(uuid.uuid4(), JobKind.LOAD, b"ready", 40)
    _unchanged(mgr, lambda: mgr.wait([forged], timeout=0), InvalidJobError, str(forged.token))
    _unchanged(mgr, lambda: mgr.wait([None]), InvalidJobError, "None")


def test_a_copy_of_a_pending_job_is_refused_by_cancel_and_wait(busy):
    """A copy of a Job carries its token and owner tag, but the manager reports the object it returned:
    cancel(copy) used to cancel the copy's state while the record kept the original (two completions for
    one token, a store reported ok that stored nothing); wait([copy]) would never return."""
    import copy as copy_mod
    mgr, mover = busy
    job = next(j for j in mgr._jobs.values() if j.key == b"writing")
    for twin in (copy_mod.copy(job), copy_mod.deepcopy(job)):   # (a deep copy has another owner tag too)
        _unchanged(mgr, lambda: mgr.cancel(twin), InvalidJobError, str(job.token))
        _unchanged(mgr, lambda: mgr.wait([twin], timeout=0), InvalidJobError, str(job.token))
    mover.complete(job)
    out = mgr.poll()
    assert [(c.job, c.ok) for c in out] == [(job, True)]
    assert mgr.lookup([b"writing"]) == 1
    stale = copy_mod.copy(job)                # a copy of a reported job: cancel is a no-op, wait returns
    mgr.cancel(stale)
    assert mgr.wait([stale], timeout=0) == [] and mgr.poll() == []


def test_a_cancelled_load_waiting_for_its_promote_is_still_its_own_job(tmp_path):
    """The identity check knows the loads that left the job table for the delivery list: cancel() and
    wait() of such a load (before the poll that reports it) are accepted, and it is reported once."""
    import disk_helpers as dh
    kv = dh.make_kv(8)
    mgr = TierManager(dh.disk_config(tmp_path / "d", host_slots=2, disk_slots=8, host_evict_ahead_blocks=0), kv,
                      registry=CollectorRegistry())
    try:
        ks = dh.keys(3)
        dh.store_seq(mgr, kv, ks)             # the first key is evicted from the 2-slot host tier
        assert mgr.host_bytes(ks[0]) is None and mgr.lookup(ks[:1]) == 1
        load = mgr.load(ks[0], 6)
        assert load is not None and mgr.free_block(6) is True   # cancelled: into the delivery list
        assert load.state.value == "cancelling" and load.token.int not in mgr._jobs
        mgr.cancel(load)                      # accepted: a no-op
        done = mgr.wait([load], timeout=30)
        assert [(c.job, c.ok) for c in done if c.job is load] == [(load, False)]
    finally:
        mgr.close()


def test_wait_with_a_single_job_instead_of_an_iterable(busy):
    """``wait(job)`` (a Job, not a list of jobs) is bad input: a tiered_kv error naming it."""
    mgr, mover = busy
    job = next(iter(mgr._jobs.values()))
    _unchanged(mgr, lambda: mgr.wait(job, timeout=0), InvalidJobError, str(job.token))


@pytest.mark.parametrize("timeout", [-1, -0.001, "1", True, math.nan, [1], -math.inf],
                         ids=["-1", "-0.001", "str", "bool", "nan", "list", "-inf"])
def test_wait_and_flush_with_a_bad_timeout(busy, timeout):
    mgr, mover = busy
    # a report is waiting in the queue: a rejected call must not apply it
    mover.complete(mover.outstanding[0])
    _unchanged(mgr, lambda: mgr.wait(timeout=timeout), ConfigError, repr(timeout))
    _unchanged(mgr, lambda: mgr.wait([], timeout=timeout), ConfigError, repr(timeout))
    _unchanged(mgr, lambda: mgr.flush(timeout=timeout), ConfigError, repr(timeout))


def test_wait_with_infinite_timeout_waits_like_none(fake, kv):
    """timeout=inf is a valid "no deadline": wait returns once the job is reported."""
    mgr, mover = fake
    fill_row(kv, 0, b"a")
    j = mgr.store(b"a", 0)
    entered = threading.Event()
    instrument_get(mover.completions, lambda t: entered.set())

    def worker():
        if entered.wait(30):          # the owner is blocked in wait(): answer now
            mover.complete(j)

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    out = mgr.wait([j], timeout=math.inf)
    th.join(30)
    assert [c.job for c in out] == [j] and j.done and out[0].ok


# ============================================================================ closed
def test_calls_after_close_raise_manager_closed(busy):
    mgr, _ = busy
    some_job = next(iter(mgr._jobs.values()))
    mgr.close()
    mgr.close()  # idempotent
    calls = {
        "store": lambda: mgr.store(b"k", 0), "load": lambda: mgr.load(b"ready", 0),
        "lookup": lambda: mgr.lookup([b"ready"]),
        "free_block": lambda: mgr.free_block(0), "invalidate": lambda: mgr.invalidate(b"ready"),
        "poll": mgr.poll, "wait": lambda: mgr.wait(timeout=0), "flush": mgr.flush,
    }
    for name, fn in calls.items():
        before = metric_samples(mgr.metrics.registry)
        with pytest.raises(ManagerClosedError, match="closed"):
            fn()
        assert metric_samples(mgr.metrics.registry) == before, name
    # cancel() is valid at any time (a cleanup path's cancel after the manager's `with` block): after close()
    # it does nothing; a job not of this manager is still refused
    before = metric_samples(mgr.metrics.registry)
    state = some_job.state
    mgr.cancel(some_job)
    assert metric_samples(mgr.metrics.registry) == before and some_job.state is state
    with pytest.raises(InvalidJobError):
        mgr.cancel("not a job")


def test_context_manager_closes(cfg, kv):
    with TierManager(cfg, kv, registry=CollectorRegistry()) as mgr:
        fill_row(kv, 0, b"a")
        mgr.store(b"a", 0)
    with pytest.raises(ManagerClosedError):
        mgr.poll()
    assert mgr.jobs_in_flight == 0  # close() let the copy finish and applied its report
