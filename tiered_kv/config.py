"""The validated configuration object.

:class:`TieredKVConfig` is a frozen dataclass; every field is checked in
``__post_init__`` and a bad value raises :class:`~tiered_kv.errors.ConfigError`
naming the field and the value.  One field table drives construction from
keyword arguments, from a mapping (``from_dict``, e.g. vLLM's
``kv_connector_extra_config``) and from environment variables (``from_env``).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional, Union

from .errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["TieredKVConfig", "Durability", "WriteMode", "DiskIO", "CpuMover"]

Durability = Literal["sync", "batch", "none"]
WriteMode = Literal["through", "back"]
DiskIO = Literal["process", "thread"]
CpuMover = Literal["native", "threads"]

_DURABILITY = ("sync", "batch", "none")
_WRITE_MODES = ("through", "back")
_DISK_IO = ("process", "thread")
_CPU_MOVERS = ("native", "threads")
_MAX_NAMESPACE = 512
_MAX_DISK_BYTES = 1 << 56   # 64 PiB: past it LMDB cannot map the index the capacity implies (and a slab's size overflows)
_MIN_MAP_BYTES = 1 << 16    # a smaller LMDB map cannot hold a fresh environment's sub-databases (32 KiB cannot)
MAX_KEY_BYTES = 65535       # the disk entry header stores a key's length in 16 bits


def check_namespace(namespace: Any) -> None:
    """A namespace every tier can hold (each entry header carries it): a non-empty str, valid UTF-8, at most
    ``_MAX_NAMESPACE`` bytes; ConfigError naming the value otherwise (the config's check, and the remote store's)."""
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"namespace must be a non-empty str, got {namespace!r:.80}")
    try:
        ns_bytes = len(namespace.encode())
    except UnicodeEncodeError:   # from the environment, undecodable bytes arrive as lone surrogates
        raise ConfigError(f"namespace must be valid UTF-8, got {namespace!r:.80}") from None
    if ns_bytes > _MAX_NAMESPACE:
        raise ConfigError(f"namespace must be at most {_MAX_NAMESPACE} bytes, got {ns_bytes}")


def check_disk_path(disk_path: Any, name: str = "disk_path") -> None:
    """A disk tier directory as a path (str or ``os.PathLike``), not empty, without a NUL byte, or None;
    ConfigError naming ``name`` and the value otherwise (the config's check, and the vLLM adapter's before it
    joins a data-parallel replica's suffix onto the path)."""
    if disk_path is None:
        return
    if not isinstance(disk_path, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a path or None, got {disk_path!r}")
    text = os.fspath(disk_path)
    if not isinstance(text, str):   # an os.PathLike of bytes
        raise ConfigError(f"{name} must be a str path, got {disk_path!r}")
    if not text:
        raise ConfigError(f"{name} must not be empty")
    if "\0" in text:
        raise ConfigError(f"{name} must not contain a NUL byte, got {disk_path!r}")
    try:
        text.encode()
    except UnicodeEncodeError:   # from the environment, undecodable bytes arrive as lone surrogates: LMDB
        raise ConfigError(f"{name} must be valid UTF-8, got {disk_path!r}") from None   # opens UTF-8 paths only


def _check_int(name: str, value: Any, lo: int, hi: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be {rng}, got {value!r}")


def _check_float(name: str, value: Any, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        ok = lo <= float(value) <= hi
    except OverflowError:   # an int past any float
        ok = False
    if not ok:
        raise ConfigError(f"{name} must be in [{lo}, {hi}], got {value!r}")


@dataclasses.dataclass(frozen=True)
class TieredKVConfig:
    """Settings of one :class:`~tiered_kv.TierManager`.  Units are in the names.

    namespace: scopes every key (model, dtype, block shape, rank).  A block
        stored under one namespace is never served under another.
    host_capacity_bytes: size of the host slab in bytes (whole blocks of it are
        used).  ``TierManager`` allocates it at start, pinned per ``pin_host_memory``;
        the vLLM adapter sets it from its own options (docs/vllm.md).
    disk_path: directory of the LMDB disk tier, or ``None`` for no disk tier.
    disk_capacity_bytes: bytes of block data the disk tier may hold (LRU beyond).
    durability: ``"sync"`` | ``"batch"`` | ``"none"`` (see docs/architecture.md).
    write_mode: ``"through"`` spills each block once its store is done; ``"back"``
        keeps the host tier's next victims written: once the host tier is 3/4
        full (or as full as ``host_evict_ahead_blocks`` lets it get, or sooner
        when four steps' stores would not fit in what is free), each call spills
        the coldest host blocks not yet on disk, about as many as were stored
        since the last call (each host residency at most once).  A block evicted
        from the host before its turn is gone, counted as a shed spill
        (``tiered_kv_shed_total{reason="evicted_unwritten"}``).
    max_inflight_jobs: bound on jobs in flight.  A store or load is shed (counted,
        ``reason="inflight_limit"``) when the jobs in flight of every kind -- spills
        and promotes included -- have reached it; spills themselves are not shed by
        it (``writer_queue_blocks`` bounds them).  The vLLM adapter never sheds the
        loads vLLM was promised.
    cpu_mover: how a KV tensor without CUDA is copied.  ``"native"``: a step's
        copies run in torch's inter-op threads (``torch.jit.fork``), which never
        take the GIL, so they go on while the engine thread runs Python
        (:mod:`tiered_kv.movers.native`); rows no 8- or 16-byte view fits, or a
        torch without TorchScript, fall back to the threads.  ``"threads"``:
        ``num_copy_workers`` Python threads (:mod:`tiered_kv.movers.thread`).  Known
        limit of ``"native"``: torch's inter-op threads do not survive ``os.fork()``, and
        a child forked after a manager was made hangs in their teardown if it ends with
        ``sys.exit`` (one that ends with ``os._exit``, as ``multiprocessing`` does, is
        not affected): a host that forks such children uses ``"threads"``.
    num_copy_workers: worker threads of the CPU mover with ``cpu_mover="threads"``
        (ignored with CUDA).
    num_copy_streams: CUDA copy streams of the GPU mover.
    copy_batch_max: the movers queue the copies of ``store()``/``load()`` and
        start them together at the next ``poll()``/``wait()``, or at once when
        this many are queued; ``1`` starts each copy in its call.  On the GPU
        mover a batch takes one ordering barrier, not one per copy; on the CPU
        mover the copy threads are not woken while the engine makes its calls.
    host_evict_ahead_blocks: at the end of each ``poll()``/``wait()``, evict
        least recently used host blocks until this many slots are free, so that
        ``store()`` and the promotes of ``load()`` take a free slot instead of
        evicting in the engine's call.  ``None``: ``min(64, host slots // 32)``;
        ``0``: evict only when a slot is needed.  Must be below the slot count.
    pin_host_memory: ``None`` pins when CUDA is available.
    prefault_host_memory: fault an unpinned (CPU) host slab's pages in at start,
        with transparent huge pages where the kernel allows them, so that the
        engine's first stores copy at full speed (:mod:`tiered_kv.hostmem`; it
        costs about 0.25 s per GiB at start on the reference VM); the disk I/O
        process fills its own mapping's page table in the background too.  ``False``
        leaves the faults to the first stores and reads.  Pinned slabs are resident already.
    max_key_bytes: longest accepted key (at most 65535: a disk entry's header stores its length in 16 bits).
    writer_queue_blocks: bound of the disk writer's queue (spills shed beyond).
        ``None``: four write batches (of the size below, configured or derived), at least 256.
    writer_batch_blocks / writer_batch_bytes / writer_batch_seconds: a disk
        write transaction commits when any of these is reached.  Each commit makes
        its blocks durable with one ``fdatasync``, so small blocks need large
        batches to keep up.  ``writer_batch_blocks=None``: 16 MiB of blocks, at
        least 64 and at most 512 (64 from 256 KiB blocks up, 512 up to 32 KiB).
    disk_map_size_bytes: initial LMDB map size (``0``: derived from capacity; else at least 64 KiB).
    disk_io: where the disk tier's writer and readers run.  ``"process"`` (the
        default): in a child process of their own, which maps the host slab
        (shared memory) and talks to the engine over two pipes, so a busy engine
        thread never slows them through the GIL; a crash of that process is a
        fault (the disk tier misses, counted) and it is restarted.  ``"thread"``:
        threads in the engine's process (fewer moving parts; the disk keeps up
        only while the engine thread leaves the GIL free).  See
        docs/architecture.md, "The disk I/O process".
    disk_read_cached_in_wait: while ``TierManager.wait()`` (or ``flush()``/``close()``)
        blocks, its thread reads the blocks its loads need from disk itself when the
        page cache holds them whole (``preadv2`` with ``RWF_NOWAIT``: it never waits on
        the disk; a block not cached, or one whose check fails, goes to the disk readers
        as before), verified the same way, instead of waiting for the disk I/O side's
        answer.  ``False``: every read goes to the disk readers.
    remote_url: a Redis or Valkey server shared by several serving machines
        (docs/remote.md), or ``None`` for no remote tier: ``redis://``,
        ``rediss://`` (TLS), ``unix://`` or ``redis+cluster://h1:p1,h2:p2``
        (``rediss+cluster://``).  Credentials come from the URL or from the
        ``TIERED_KV_REMOTE_USERNAME`` / ``TIERED_KV_REMOTE_PASSWORD`` environment
        variables and are never logged.  Each block a store publishes is also
        written there; a lookup that misses locally asks the server.
    remote_ttl_seconds: remote values expire after this long; ``None``: never
        (the server's ``maxmemory`` policy evicts).
    remote_tomb_ttl_seconds: how long a remote tombstone (an invalidated key, a
        cancelled write) refuses writes from every machine; must exceed twice the
        longest a write can be in flight, ``remote_write_deadline_seconds`` plus two
        ``remote_timeout_seconds`` (a write is refused past half a tombstone's
        lifetime from when it was queued).  The machine that invalidated a key does
        not ask the server for it meanwhile.
    remote_timeout_seconds: socket timeout of one round trip to the server.
    remote_queue_blocks: bound of the remote writes queued (shed beyond).
    remote_batch_blocks: commands per pipelined round trip.
    remote_write_deadline_seconds: a remote write not sent this long after it was
        queued is dropped (counted).
    remote_prefetch_blocks: a lookup asks the server for at most this many keys
        past what the local tiers hold; at most ``max(remote_queue_blocks,
        remote_batch_blocks)``, what the remote reader takes queued.
    remote_miss_ttl_seconds: a key the server did not hold is not asked for again
        for this long (a lookup answers a miss meanwhile).
    host_policy / disk_policy: which evictable block a tier gives up first
        (docs/policies.md): ``"lru"`` (least recently used, the default),
        ``"s3fifo"``, ``"arc"``, or ``"prefix"`` (tails of a prefix chain before
        its heads, shared heads kept longest).  Leases are the index's, whatever
        the policy: a block being written or read is never evicted.
    host_admission / disk_admission: which new blocks enter a tier at all:
        ``"all"`` (the default), ``"second_hit"`` (a block seen once before: a
        bounded memory of recent keys) or ``"tinylfu"`` (a block seen more often
        than the one it would evict).  A reference is a lookup that asked for
        the key.  A refused block costs nothing already stored: on the disk tier
        it is simply not written (SSD wear), on the host tier the store is not
        made; both are counted in ``tiered_kv_admission_refused_total``.
    """

    namespace: str
    host_capacity_bytes: int
    disk_path: Optional[Union[str, "os.PathLike[str]"]] = None
    disk_capacity_bytes: int = 0
    durability: Durability = "batch"
    write_mode: WriteMode = "through"
    max_inflight_jobs: int = 4096
    cpu_mover: CpuMover = "native"
    num_copy_workers: int = 2
    num_copy_streams: int = 2
    copy_batch_max: int = 64
    host_evict_ahead_blocks: Optional[int] = None
    pin_host_memory: Optional[bool] = None
    prefault_host_memory: bool = True
    max_key_bytes: int = 1024
    writer_queue_blocks: Optional[int] = None
    writer_batch_blocks: Optional[int] = None
    writer_batch_bytes: int = 64 << 20
    writer_batch_seconds: float = 0.005
    disk_map_size_bytes: int = 0
    disk_io: DiskIO = "process"
    disk_read_cached_in_wait: bool = True
    remote_url: Optional[str] = dataclasses.field(default=None, repr=False)   # may hold a password
    remote_ttl_seconds: Optional[int] = 3600
    remote_tomb_ttl_seconds: int = 120
    remote_timeout_seconds: float = 1.0
    remote_queue_blocks: int = 256
    remote_batch_blocks: int = 32
    remote_write_deadline_seconds: float = 10.0
    remote_prefetch_blocks: int = 64
    remote_miss_ttl_seconds: float = 1.0
    host_policy: str = "lru"
    disk_policy: str = "lru"
    host_admission: str = "all"
    disk_admission: str = "all"

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        _check_int("host_capacity_bytes", self.host_capacity_bytes, 1, _MAX_DISK_BYTES)
        check_disk_path(self.disk_path)
        _check_int("disk_capacity_bytes", self.disk_capacity_bytes, 0, _MAX_DISK_BYTES)
        if self.disk_path is not None and self.disk_capacity_bytes == 0:
            raise ConfigError(f"disk_capacity_bytes must be > 0 when disk_path is set, got {self.disk_capacity_bytes!r}")
        if self.durability not in _DURABILITY:
            raise ConfigError(f"durability must be one of {_DURABILITY}, got {self.durability!r}")
        if self.write_mode not in _WRITE_MODES:
            raise ConfigError(f"write_mode must be one of {_WRITE_MODES}, got {self.write_mode!r}")
        _check_int("max_inflight_jobs", self.max_inflight_jobs, 1, 1 << 24)
        if self.cpu_mover not in _CPU_MOVERS:
            raise ConfigError(f"cpu_mover must be one of {_CPU_MOVERS}, got {self.cpu_mover!r}")
        _check_int("num_copy_workers", self.num_copy_workers, 1, 64)
        _check_int("num_copy_streams", self.num_copy_streams, 1, 64)
        _check_int("copy_batch_max", self.copy_batch_max, 1, 1 << 16)
        if self.host_evict_ahead_blocks is not None:
            _check_int("host_evict_ahead_blocks", self.host_evict_ahead_blocks, 0, 1 << 20)
        if self.pin_host_memory is not None and not isinstance(self.pin_host_memory, bool):
            raise ConfigError(f"pin_host_memory must be a bool or None, got {self.pin_host_memory!r}")
        if not isinstance(self.prefault_host_memory, bool):
            raise ConfigError(f"prefault_host_memory must be a bool, got {self.prefault_host_memory!r}")
        if not isinstance(self.disk_read_cached_in_wait, bool):
            raise ConfigError(f"disk_read_cached_in_wait must be a bool, got {self.disk_read_cached_in_wait!r}")
        _check_int("max_key_bytes", self.max_key_bytes, 1, MAX_KEY_BYTES)
        if self.writer_queue_blocks is not None:
            _check_int("writer_queue_blocks", self.writer_queue_blocks, 1, 1 << 20)
        if self.writer_batch_blocks is not None:
            _check_int("writer_batch_blocks", self.writer_batch_blocks, 1, 1 << 16)
        _check_int("writer_batch_bytes", self.writer_batch_bytes, 1)
        _check_float("writer_batch_seconds", self.writer_batch_seconds, 0.0, 60.0)
        _check_int("disk_map_size_bytes", self.disk_map_size_bytes, 0, _MAX_DISK_BYTES)
        if 0 < self.disk_map_size_bytes < _MIN_MAP_BYTES:   # LMDB cannot even create its sub-databases
            raise ConfigError(f"disk_map_size_bytes must be 0 (derived from the capacity) or >= {_MIN_MAP_BYTES}, "
                              f"got {self.disk_map_size_bytes!r}")
        if self.disk_io not in _DISK_IO:
            raise ConfigError(f"disk_io must be one of {_DISK_IO}, got {self.disk_io!r}")
        if self.remote_url is not None:
            from .remote.url import parse_url

            if not isinstance(self.remote_url, str):
                raise ConfigError(f"remote_url must be a str or None, got {type(self.remote_url).__name__}")
            try:
                parse_url(self.remote_url)   # the one check of its forms; names it with the password redacted
            except ConfigError as exc:
                raise ConfigError(f"remote_url: {exc}") from None
        if self.remote_ttl_seconds is not None:
            _check_int("remote_ttl_seconds", self.remote_ttl_seconds, 1, 1 << 31)
        _check_int("remote_tomb_ttl_seconds", self.remote_tomb_ttl_seconds, 1, 1 << 31)
        _check_float("remote_timeout_seconds", self.remote_timeout_seconds, 0.001, 600.0)
        _check_int("remote_queue_blocks", self.remote_queue_blocks, 1, 1 << 20)
        _check_int("remote_batch_blocks", self.remote_batch_blocks, 1, 1 << 16)
        _check_float("remote_write_deadline_seconds", self.remote_write_deadline_seconds, 0.001, 3600.0)
        _check_int("remote_prefetch_blocks", self.remote_prefetch_blocks, 0, 1 << 16)
        _check_float("remote_miss_ttl_seconds", self.remote_miss_ttl_seconds, 0.0, 3600.0)
        reads = max(self.remote_queue_blocks, self.remote_batch_blocks)   # what the remote reader takes queued
        if self.remote_prefetch_blocks > reads:
            raise ConfigError(f"remote_prefetch_blocks={self.remote_prefetch_blocks} exceeds the remote reads that can "
                              f"be queued (max(remote_queue_blocks, remote_batch_blocks) = {reads}): a step's probe "
                              f"of that many keys would never be taken")
        from .core.policy import ADMISSIONS, POLICIES

        for name in ("host_policy", "disk_policy"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in POLICIES:
                raise ConfigError(f"{name} must be one of {tuple(POLICIES)}, got {getattr(self, name)!r}")
        for name in ("host_admission", "disk_admission"):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in ADMISSIONS:
                raise ConfigError(f"{name} must be one of {tuple(ADMISSIONS)}, got {getattr(self, name)!r}")
        from .remote.records import tomb_ttl_problem

        problem = tomb_ttl_problem(self.remote_tomb_ttl_seconds, self.remote_write_deadline_seconds,
                                   self.remote_timeout_seconds)
        if problem is not None:
            raise ConfigError(f"remote_tomb_ttl_seconds={self.remote_tomb_ttl_seconds} {problem} "
                              f"(remote_write_deadline_seconds, remote_timeout_seconds)")

    @property
    def disk_dir(self) -> Optional[Path]:
        """``disk_path`` as a :class:`~pathlib.Path`, or ``None``."""
        return None if self.disk_path is None else Path(os.fspath(self.disk_path))

    def replace(self, **changes: Any) -> "TieredKVConfig":
        """A copy with ``changes`` applied (validated again); an unknown name raises :class:`ConfigError`."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known: {list(self.field_names())}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TieredKVConfig":
        """Build from a mapping; an unknown key raises :class:`ConfigError`."""
        if not isinstance(values, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(values).__name__}")
        bad = [k for k in values if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"config keys must be str, got {bad!r:.200}")
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known: {list(cls.field_names())}")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise ConfigError(f"missing required config keys {missing}")
        return cls(**dict(values))

    @classmethod
    def from_env(cls, prefix: str = "TIERED_KV_", environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "TieredKVConfig":
        """Build from ``{prefix}{FIELD}`` environment variables, then ``overrides``.

        A ``{prefix}`` variable that names no setting but is close to one (a typo: ``..._HOST_CAPACTY_BYTES``)
        is logged as a warning naming the setting it resembles, and ignored: other ``{prefix}`` variables
        may belong to other tools, so none is refused."""
        if not isinstance(prefix, str):
            raise ConfigError(f"from_env: prefix must be a str, got {prefix!r:.80}")
        if environ is not None and not isinstance(environ, Mapping):
            raise ConfigError(f"from_env: environ must be a mapping of str to str, got {type(environ).__name__}")
        env = os.environ if environ is None else environ
        bad = next((var for var in env if not isinstance(var, str)), None) if environ is not None else None
        if bad is not None:
            raise ConfigError(f"from_env: environ must be a mapping of str to str, got the key {bad!r:.80}")
        values: dict[str, Any] = {}
        fields = dataclasses.fields(cls)
        for f in fields:
            raw = env.get(prefix + f.name.upper())
            if raw is None:
                continue
            if not isinstance(raw, str):
                raise ConfigError(f"environment value for {prefix}{f.name.upper()} must be a str, got {raw!r:.80}")
            values[f.name] = _parse_env(f.name, raw, f.default)
        if prefix:
            names = [f.name.upper() for f in fields]
            for var in env:
                if var.startswith(prefix) and var[len(prefix):] not in names:
                    near = difflib.get_close_matches(var[len(prefix):], names, 1, 0.8)
                    if near:
                        log.warning("environment variable %s is no tiered_kv setting (ignored); did you mean %s%s?",
                                    var, prefix, near[0])
        values.update(overrides)
        return cls.from_dict(values)


def _parse_env(name: str, raw: str, default: Any) -> Any:
    try:
        if name in ("namespace", "durability", "write_mode", "disk_io", "cpu_mover", "host_policy", "disk_policy",
                    "host_admission", "disk_admission"):
            return raw
        if name == "remote_url":
            return raw or None
        if name == "remote_ttl_seconds":
            return None if raw.strip().lower() in ("", "none") else int(raw, 0)
        if name == "disk_path":
            return raw or None
        if name in ("host_evict_ahead_blocks", "writer_queue_blocks", "writer_batch_blocks"):
            return None if raw.strip().lower() in ("", "auto", "none") else int(raw, 0)
        if name in ("pin_host_memory", "prefault_host_memory", "disk_read_cached_in_wait"):
            low = raw.strip().lower()
            if low in ("", "auto", "none") and name == "pin_host_memory":
                return None
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, float):
            return float(raw)
        return int(raw, 0)
    except ValueError:
        raise ConfigError(f"environment value for {name} is not valid: {raw!r}") from None
