"""Trace tooling: read Mooncake-format traces, replay them through the eviction policies offline, bound
them with Belady's optimum, and size KV blocks from a model's config.

The cache model (every simulator here).  A trace is a list of requests; each request names its
prompt's blocks (``hash_ids``, one per 512-token block; equal ids are equal prefix blocks).  Per
request:

1. *lookup*: a prefix lookup.  The request hits its first ``k`` blocks when those are all cached and
   stops at the first miss (a block cached while its parent is not cannot be hit).
2. *store*: every block after the hits that is not cached is inserted; one already cached is touched.
   A full tier evicts a victim for each insert, never one of the request's own blocks (they are being
   read or written for it); when only those are left, the block is not stored (``shed``).

The figure is the hit ratio over block references (hits / blocks of all requests), beside the prefill
tokens the hits save and the bytes each tier writes (inserts x block bytes).  Nothing here touches a
real tier: policies from :data:`~tiered_kv.core.policy.POLICIES` are driven directly, holding fake
:class:`~tiered_kv.core.index.Entry` objects that are READY and never leased.

Generating synthetic traces: :mod:`tiered_kv.tools.tracegen`.  The command line is ``tiered-kv replay``
(:mod:`tiered_kv.tools.replay`).

Why one module of this size: reading, simulating and bounding share the one cache model above (a
simulator and Belady's bound must count the same hits over the same references) and its records
(:class:`Request`, :class:`SimResult`); split, each half would restate it.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

from ..core.index import Entry, EntryState
from ..core.policy import ADMISSIONS, POLICIES, Admission, AdmitAll, Policy, admission_victim
from ..errors import TieredKVError

__all__ = [
    "BLOCK_TOKENS", "DTYPE_BYTES", "DEFAULT_BLOCK_BYTES", "Request", "SimResult", "TierSimResult", "ModelShape",
    "TraceError", "default_trace", "TRACE_ENV", "TRACE_NAME", "read_trace", "write_trace", "trace_stats", "prefix_consistent", "simulate", "belady",
    "block_key", "hit_tokens",
    "simulate_tiers", "sweep", "model_block_bytes", "model_from_hf_config",
]

log = logging.getLogger(__name__)

BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
TRACE_ENV = "TIERED_KV_TRACE"
TRACE_NAME = "mooncake_synthetic_trace.jsonl"


class TraceError(TieredKVError, ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


def default_trace() -> Optional[Path]:
    """``$TIERED_KV_TRACE``, else the Mooncake trace of a source checkout (``benchmarks/traces/``)."""
    import os

    env = os.environ.get(TRACE_ENV)
    if env:
        return Path(env)
    p = Path(__file__).resolve().parents[2] / "benchmarks" / "traces" / TRACE_NAME
    return p if p.is_file() else None

# Bytes per element of the KV cache's dtype (aliases as Hugging Face configs and torch spell them).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e4m3": 1, "fp8_e4m3": 1, "e4m3": 1,
    "float8_e5m2": 1, "fp8_e5m2": 1, "e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "int8": 1,
}


class Request(NamedTuple):
    """One request of a trace: arrival (ms), prompt and output length (tokens), prompt block ids."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


# ---------------------------------------------------------------------------------------- reading

def _bad(path: Union[str, Path], n: int, what: str) -> TraceError:
    return TraceError(f"{path}:{n}: {what}")


_MAX_NUMBER = 2 ** 63 - 1   # timestamps and lengths
_ID_LIMIT = 2 ** 128        # block ids: a 128-bit prefix-chain hash at most


def _parse(path: Union[str, Path], n: int, line: str, ids_only: bool = False) -> Request:
    try:
        rec = json.loads(line)
    except ValueError as exc:
        raise _bad(path, n, f"not JSON ({exc})") from None
    except RecursionError:   # (the json module's own limit: a line nesting arrays or objects ~1,000 deep)
        raise _bad(path, n, "not a trace record: JSON nested too deep") from None
    if not isinstance(rec, dict):
        raise _bad(path, n, f"expected a JSON object, got {type(rec).__name__}")
    if ids_only:   # the bench's replays need the block ids alone: the other fields get neutral values
        rec = {"timestamp": 0, "input_length": 0, "output_length": 0, **rec}
    for f in _FIELDS:
        if f not in rec:
            raise _bad(path, n, f"missing field {f!r}")
    ts = rec["timestamp"]
    if type(ts) not in (int, float) or (type(ts) is float and not math.isfinite(ts)):
        raise _bad(path, n, f"'timestamp' must be a number, got {ts!r:.80}")
    if ts < 0:
        raise _bad(path, n, f"'timestamp' must be >= 0, got {ts!r:.80}")
    if ts > _MAX_NUMBER:   # an int past what a float holds (math and the statistics would overflow)
        raise _bad(path, n, f"'timestamp' must be at most 2**63 - 1, got {ts!r:.80}")
    for f in ("input_length", "output_length"):
        v = rec[f]
        if type(v) is not int:
            raise _bad(path, n, f"{f!r} must be an int, got {v!r:.80}")
        if v < 0:
            raise _bad(path, n, f"{f!r} must be >= 0, got {v!r:.80}")
        if v > _MAX_NUMBER:
            raise _bad(path, n, f"{f!r} must be at most 2**63 - 1, got {v!r:.80}")
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise _bad(path, n, f"'hash_ids' must be a list of ints, got {ids!r:.80}")
    for i in ids:
        if type(i) is not int:
            raise _bad(path, n, f"'hash_ids' must be a list of ints, got element {i!r:.80}")
        if i < 0:
            raise _bad(path, n, f"'hash_ids' must be non-negative, got {i!r:.80}")
        if i >= _ID_LIMIT:   # block_key's keys stay short (a 128-bit prefix hash: 24 bytes)
            raise _bad(path, n, f"'hash_ids' elements must be below 2**128, got {i!r:.80}")
    if len(set(ids)) != len(ids):   # a prompt's blocks are a prefix chain: one id twice is no such chain
        dup = next(i for k, i in enumerate(ids) if i in ids[:k])
        raise _bad(path, n, f"'hash_ids' names block {dup} twice in one request")
    return Request(ts, rec["input_length"], rec["output_length"], tuple(ids))


def read_trace(path: Union[str, Path], limit: Optional[int] = None, ids_only: bool = False) -> list[Request]:
    """The requests of a Mooncake-format JSONL trace (the first ``limit``; blank lines are skipped): the one
    trace reader (the bench's :func:`~tiered_kv.bench.trace.load_trace` is this with ``ids_only``).

    Every field is checked; ``ids_only``: only ``hash_ids`` is required (a missing timestamp or length
    reads as 0).  Raises :class:`TraceError` naming the file and line of a line that is not JSON, not
    an object, lacks a field, has a field of the wrong type or a negative value; and naming the file
    when it cannot be read or holds no request."""
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    out: list[Request] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    with f:
        try:
            for n, line in enumerate(f, 1):
                if limit is not None and len(out) >= limit:
                    break
                if not line.strip():
                    continue
                out.append(_parse(path, n, line, ids_only))
        except UnicodeDecodeError as exc:
            raise TraceError(f"{path}: not UTF-8 text ({exc})") from None
    if not out:
        raise TraceError(f"{path}: no requests")
    return out


def write_trace(path: Union[str, Path], requests: Iterable[Request]) -> int:
    """Write ``requests`` as Mooncake-format JSONL (the fields in Mooncake's order); returns how many.
    A request :func:`read_trace` would refuse raises ValueError naming it (and what was written before it
    stays in the file)."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            ts = r.timestamp
            if isinstance(ts, float) and ts.is_integer():
                ts = int(ts)
            try:
                line = json.dumps({"timestamp": ts, "input_length": r.input_length, "output_length": r.output_length,
                                   "hash_ids": list(r.hash_ids)}, allow_nan=False)
                _parse(path, n + 1, line)   # the reader's rules: what is written reads back
            except (TraceError, ValueError, TypeError) as exc:
                raise ValueError(f"write_trace: request {n} ({r!r:.200}) would not read back: {exc}") from None
            f.write(line)
            f.write("\n")
            n += 1
    return n


def prefix_consistent(requests: Sequence[Request]) -> bool:
    """Whether each block id always follows the same parent (the id before it in its request, or none)
    and no request repeats an id: the trace's ids form a prefix tree, as prefix-chain hashes do."""
    parent: dict[int, Optional[int]] = {}
    for r in requests:
        p: Optional[int] = None
        if len(set(r.hash_ids)) != len(r.hash_ids):
            return False
        for h in r.hash_ids:
            if parent.setdefault(h, p) != p:
                return False
            p = h
    return True


def trace_stats(requests: Sequence[Request]) -> dict[str, Any]:
    """Shape of a trace: requests, block references, distinct blocks, mean blocks and tokens per
    request, the hit ratio of an infinite prefix cache, whether the ids form a prefix tree."""
    if not requests:
        raise ValueError("trace_stats of an empty trace")
    seen: set[int] = set()
    refs = hits = 0
    for r in requests:
        ids = r.hash_ids
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hits += k
        refs += len(ids)
        seen.update(ids)
    n = len(requests)
    return {
        "requests": n, "block_refs": refs, "distinct_blocks": len(seen),
        "mean_blocks": refs / n, "max_blocks": max(len(r.hash_ids) for r in requests),
        "mean_input_tokens": sum(r.input_length for r in requests) / n,
        "mean_output_tokens": sum(r.output_length for r in requests) / n,
        "duration_s": (max(r.timestamp for r in requests) - min(r.timestamp for r in requests)) / 1000.0,
        "infinite_cache_hit_ratio": hits / refs if refs else float("nan"),
        "prefix_consistent": prefix_consistent(requests),
    }


# ------------------------------------------------------------------------------------ simulation

DEFAULT_BLOCK_BYTES = 64 << 20   # Llama-3-8B, bf16, 512 tokens: see model_block_bytes


@dataclass(frozen=True)
class SimResult:
    """One replay of a trace through one tier.  ``hits`` are block references served from the tier;
    for :func:`belady` they count every reference found cached (the bound, see there) and
    ``prefix_hits`` those a prefix lookup gets (equal on a :func:`prefix_consistent` trace).
    ``inserts``: blocks written to the tier; ``evictions``; ``shed``: blocks not stored because only the
    request's own blocks were evictable; ``refused``: blocks the admission filter (or Belady's bypass)
    kept out.  ``tokens_saved``: prefill tokens of the hits (512 a block, the last block of a prompt
    only its tokens); ``input_tokens``: all prompts' tokens."""

    policy: str
    admission: str
    capacity: int
    requests: int
    refs: int
    hits: int
    prefix_hits: int
    inserts: int
    evictions: int
    shed: int
    refused: int
    tokens_saved: int
    input_tokens: int
    block_bytes: int = DEFAULT_BLOCK_BYTES

    @property
    def misses(self) -> int:
        return self.refs - self.hits

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.refs if self.refs else float("nan")

    @property
    def token_hit_ratio(self) -> float:
        return self.tokens_saved / self.input_tokens if self.input_tokens else float("nan")

    @property
    def bytes_written(self) -> int:
        return self.inserts * self.block_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_ratio=self.hit_ratio, token_hit_ratio=self.token_hit_ratio, bytes_written=self.bytes_written)
        return d


@dataclass(frozen=True)
class TierSimResult:
    """One replay through host in front of disk (:func:`simulate_tiers`).  ``host_inserts`` counts
    stores and promotes into the host tier, ``disk_inserts`` spills written to disk, ``spills_refused``
    host victims the disk's admission kept out (they are lost), ``spills_shed`` those that found no
    evictable disk slot."""

    host_policy: str
    disk_policy: str
    disk_admission: str
    host_capacity: int
    disk_capacity: int
    requests: int
    refs: int
    host_hits: int
    disk_hits: int
    host_inserts: int
    promotes: int
    disk_inserts: int
    host_evictions: int
    disk_evictions: int
    host_shed: int
    spills_refused: int
    spills_shed: int
    tokens_saved: int
    input_tokens: int
    block_bytes: int = DEFAULT_BLOCK_BYTES

    @property
    def hits(self) -> int:
        return self.host_hits + self.disk_hits

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.refs if self.refs else float("nan")

    @property
    def host_hit_ratio(self) -> float:
        return self.host_hits / self.refs if self.refs else float("nan")

    @property
    def disk_hit_ratio(self) -> float:
        return self.disk_hits / self.refs if self.refs else float("nan")

    @property
    def host_bytes_written(self) -> int:
        return self.host_inserts * self.block_bytes

    @property
    def disk_bytes_written(self) -> int:
        return self.disk_inserts * self.block_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hits=self.hits, hit_ratio=self.hit_ratio, host_hit_ratio=self.host_hit_ratio,
                 disk_hit_ratio=self.disk_hit_ratio,
                 host_bytes_written=self.host_bytes_written, disk_bytes_written=self.disk_bytes_written)
        return d


def block_key(h: int) -> bytes:
    """The tier key of block id ``h``: ``b"mooncake"`` and the id in 8 bytes (16 in all, the size of an
    xxh3-128 prefix-chain hash), longer from 2**64 (distinct ids, distinct keys).  The simulators and the
    replay through the core (:func:`tiered_kv.bench.trace.keys_of`) key blocks alike, so that an admission
    filter's sketch sees the same bytes in both."""
    return b"mooncake" + h.to_bytes(max(8, (h.bit_length() + 7) // 8), "little")


def _block_tokens(r: Request, tokens_per_block: int = BLOCK_TOKENS) -> list[int]:
    """Prefill tokens of each block of ``r``'s prompt: ``tokens_per_block`` each, as far as the prompt's
    ``input_length`` goes (a trace whose lengths disagree with its block count saves no token past its
    prompt).  The first ``n`` blocks hold :func:`hit_tokens` of them."""
    tpb, left = tokens_per_block, r.input_length
    return [max(0, min(tpb, left - tpb * i)) for i in range(len(r.hash_ids))]


def hit_tokens(r: Request, n: int, tokens_per_block: int = BLOCK_TOKENS) -> int:
    """Prefill tokens a hit on the first ``n`` blocks of ``r`` saves (the sum of :func:`_block_tokens`'
    first ``n``): what every simulator here and the replay through the core count."""
    return max(0, min(n * tokens_per_block, r.input_length))


def _check_capacity(name: str, capacity: int) -> None:
    if type(capacity) is not int or capacity < 0:
        raise ValueError(f"{name} must be a non-negative int (blocks), got {capacity!r}")


def _make(kind: str, table: Mapping[str, type], name: str, slots: int) -> Any:
    cls = table.get(name)
    if cls is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
    return cls(max(1, slots))


_WRITER = uuid.UUID(int=0)
_READY = EntryState.READY


class _Tier:
    """One simulated tier: the keys it holds (fake READY entries), its policy and admission filter."""

    def __init__(self, capacity: int, policy: str, admission: str) -> None:
        self.capacity = capacity
        self.policy: Policy = _make("policy", POLICIES, policy, capacity)
        self.admission: Admission = _make("admission", ADMISSIONS, admission, capacity)
        self.admit_all = type(self.admission) is AdmitAll
        self.entries: dict[bytes, Entry] = {}
        self.free: list[int] = []   # slots given back by evictions; those past next_slot were never used
        self.next_slot = 0          # (a large tier a short trace never fills allocates nothing per slot)
        self.inserts = self.evictions = self.shed = self.refused = 0

    def reserve(self, key: bytes, protect: set[bytes], evicted: list[Entry], ask: bool = True) -> Optional[Entry]:
        """A new entry for ``key`` (the policy sees it at :meth:`publish`), evicting one if full; None
        when not stored (``refused`` or ``shed`` counted).  As the tier index does: the admission filter
        is asked first (unless ``ask`` is false: promotes serve a lookup that found the key), with the
        entry it would evict (:func:`~tiered_kv.core.policy.admission_victim`; None while a slot is
        free).  Evicted entries are appended to ``evicted``."""
        if self.capacity == 0:
            self.shed += 1
            return None
        full = not self.free and self.next_slot >= self.capacity
        if ask and not self.admit_all:
            cand = admission_victim(self.policy, protect, key) if full else None
            if not self.admission.admit(key, cand):
                self.refused += 1
                return None
        if full:
            v = self.policy.victim(protect, key)
            if v is None:
                self.shed += 1
                return None
            v.live = False
            del self.entries[v.key]
            self.free.append(v.slot)
            v.slot = -1
            self.evictions += 1
            evicted.append(v)
        if self.free:
            slot = self.free.pop()
        else:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        e = Entry(key, slot, _WRITER)
        e.writing = False
        self.entries[key] = e
        self.inserts += 1
        return e

    def publish(self, new: list[Entry]) -> None:
        insert = self.policy.insert
        for e in new:
            if e.live:
                e.state = _READY
                insert(e)


def _replay(requests: Sequence[Request], host: _Tier, disk: Optional[_Tier], write_mode: str = "back",
            tokens_per_block: int = BLOCK_TOKENS) -> dict[str, int]:
    """The cache model of the module doc over ``host`` (and ``disk`` behind it: see simulate_tiers)."""
    hpol, hadm, hent = host.policy, host.admission, host.entries
    hhit, dhit_n, tokens_saved, input_tokens, refs = 0, 0, 0, 0, 0
    promotes = spills_refused = spills_shed = 0
    for r in requests:
        keys = [block_key(h) for h in r.hash_ids]
        refs += len(keys)
        input_tokens += r.input_length
        protect = set(keys)
        hpol.link(keys)
        if disk is not None:
            disk.policy.link(keys)
        for k in keys:
            hadm.record(k)
            if disk is not None:
                disk.admission.record(k)
        # lookup; a host hit is then leased by the request's load until it lands (after the store's
        # touches, before its inserts land: the core's order); every reservation below protects it (S3-FIFO
        # keeps a leased entry in place)
        n = 0
        promote: list[bytes] = []
        leased: dict[bytes, Entry] = {}
        for k in keys:
            e = hent.get(k)
            if e is not None:
                hpol.hit(e)
                if k not in leased:   # (an id twice in one request: one lease; the core refuses such a call)
                    hpol.lease(e)
                    leased[k] = e
                hhit += 1
            else:
                d = disk.entries.get(k) if disk is not None else None
                if d is None:
                    break
                disk.policy.hit(d)   # type: ignore[union-attr]
                dhit_n += 1
                promote.append(k)
            n += 1
        tokens_saved += hit_tokens(r, n, tokens_per_block)
        # store: promotes, then the blocks after the hits that are in no tier
        evicted: list[Entry] = []
        new: list[Entry] = []
        # a promote's slot, as the core's load reserves it: protecting the load's other keys (TierCore.begin_load)
        load_protect = set(keys[:n]) if n > 1 else set()
        for k in promote:
            e2 = host.reserve(k, load_protect, evicted, ask=False)
            if e2 is not None:
                new.append(e2)
                promotes += 1
        promoted = len(new)
        for k in keys[n:]:
            e = hent.get(k)
            if e is not None:
                hpol.hit(e)
                continue
            if disk is not None:
                d = disk.entries.get(k)
                if d is not None:
                    disk.policy.hit(d)
                    continue
            e2 = host.reserve(k, protect, evicted)
            if e2 is not None:
                new.append(e2)
        if promoted:
            # the core's load waits for its promotes: the step's stores land first, then the promotes, which
            # the load leases too; its copies' report then releases every block of the prefix, in key order
            host.publish(new[promoted:])
            host.publish(new[:promoted])
            for e in new[:promoted]:
                if e.live and e.key not in leased:
                    hpol.lease(e)
                    leased[e.key] = e
            for k in keys[:n]:
                e = leased.pop(k, None)
                if e is not None:
                    hpol.unlease(e)
        else:
            for e in leased.values():
                hpol.unlease(e)
            host.publish(new)
        if disk is not None and write_mode == "through":
            # write-through: the blocks stored are written at once (a promote's is on disk already); host
            # victims are dropped
            evicted = [e for e in new if e.live and e.key not in disk.entries]
        if disk is not None and evicted:
            dnew: list[Entry] = []
            dev: list[Entry] = []
            for v in evicted:   # spill: a block not on disk is written there
                if v.key in disk.entries:
                    continue
                shed, refused = disk.shed, disk.refused
                d2 = disk.reserve(v.key, protect, dev)
                if d2 is not None:
                    dnew.append(d2)
                elif disk.refused > refused:
                    spills_refused += 1
                elif disk.shed > shed:
                    spills_shed += 1
            disk.publish(dnew)
    return {"refs": refs, "host_hits": hhit, "disk_hits": dhit_n, "tokens_saved": tokens_saved,
            "input_tokens": input_tokens, "promotes": promotes, "spills_refused": spills_refused,
            "spills_shed": spills_shed}


def simulate(requests: Sequence[Request], capacity: int, policy_name: str, admission_name: str = "all",
             *, block_bytes: int = DEFAULT_BLOCK_BYTES, tokens_per_block: int = BLOCK_TOKENS) -> SimResult:
    """Replay ``requests`` through one tier of ``capacity`` blocks evicting in the order of
    ``POLICIES[policy_name]`` and admitting through ``ADMISSIONS[admission_name]``.

    The calls per request, as the tier index makes them: ``link(keys)`` once with the request's keys;
    ``hit(e)`` for each block of the cached prefix and for each block after the first miss that is
    cached anyway; for each block to insert, ``admit(key, victim)`` (``victim``: the key
    ``admission_victim`` names when the tier is full, else None; not asked for ``all``), then when full
    ``victim(protect=the request's keys, key)``; ``insert(e)`` of the new entries after the request's
    evictions (a store publishes its blocks when their copies land).  ``record(key)`` sees each block
    reference once, at lookup (as the tier index's ``seen``).  Raises ValueError naming an unknown policy or admission or a bad
    capacity."""
    _check_capacity("capacity", capacity)
    tier = _Tier(capacity, policy_name, admission_name)
    s = _replay(requests, tier, None, tokens_per_block=tokens_per_block)
    return SimResult(policy_name, admission_name, capacity, len(requests), s["refs"], s["host_hits"], s["host_hits"],
                     tier.inserts, tier.evictions, tier.shed, tier.refused, s["tokens_saved"], s["input_tokens"],
                     block_bytes)


def simulate_tiers(requests: Sequence[Request], host_capacity: int, disk_capacity: int, host_policy: str = "lru",
                   disk_policy: str = "lru", disk_admission: str = "all", *, host_admission: str = "all",
                   block_bytes: int = DEFAULT_BLOCK_BYTES, write_mode: str = "back",
                   tokens_per_block: int = BLOCK_TOKENS) -> TierSimResult:
    """Replay ``requests`` through a host tier in front of a disk tier (capacities in blocks).

    The model, kept simple: a lookup's prefix runs over both tiers, each block served by the host when
    there, else by the disk (a *disk hit*, which is promoted: stored in the host, the disk keeping its
    copy).  The blocks after the hits that are in neither tier are stored in the host; a block after a
    miss that is on disk only stays there (touched).  Each host victim not already on disk is spilled to
    disk if the disk's admission filter admits it (spill on eviction; the disk evicts in its policy's
    order, never a block of the current request); one refused is gone.  Per-tier bytes written: host
    inserts (stores + promotes) and disk inserts (spills) x ``block_bytes``.  With ``disk_capacity`` 0
    the host sees exactly the calls of :func:`simulate`.

    ``write_mode``: ``"back"`` spills on eviction (above); ``"through"`` writes each block the host
    stores to disk at once (admission asked), as the core's default write-through does, and drops host
    victims (the disk holds them already, or refused them)."""
    if write_mode not in ("back", "through"):
        raise ValueError(f"write_mode must be 'back' or 'through', got {write_mode!r}")
    _check_capacity("host_capacity", host_capacity)
    _check_capacity("disk_capacity", disk_capacity)
    host = _Tier(host_capacity, host_policy, host_admission)
    disk = _Tier(disk_capacity, disk_policy, disk_admission)
    s = _replay(requests, host, disk, write_mode, tokens_per_block)
    return TierSimResult(host_policy, disk_policy, disk_admission, host_capacity, disk_capacity, len(requests),
                         s["refs"], s["host_hits"], s["disk_hits"], host.inserts, s["promotes"], disk.inserts,
                         host.evictions, disk.evictions, host.shed, s["spills_refused"], s["spills_shed"],
                         s["tokens_saved"], s["input_tokens"], block_bytes)


def belady(requests: Sequence[Request], capacity: int, *, block_bytes: int = DEFAULT_BLOCK_BYTES,
           tokens_per_block: int = BLOCK_TOKENS) -> SimResult:
    """Belady's offline optimum (MIN with bypass) at ``capacity`` blocks.

    Over the stream of block references (every request's ids in order): a reference to a cached block
    is a hit; a missed block is inserted unless its next reference is no sooner than that of every
    cached block (then it bypasses the tier; one never referenced again is never written), and a full
    tier evicts the cached block whose next reference is farthest in the future.  Next-use positions
    are precomputed, the farthest found in a max-heap with lazy deletion: O(R log R) for R references.

    ``hits`` counts every reference found cached: an **upper bound** on the hits of any policy and
    admission filter in the prefix-lookup model of :func:`simulate` (such a run is a bypassing demand
    cache on the same stream, whose lookups hit at most the blocks it holds, and MIN with bypass holds
    the most).  It need not be reachable by prefix lookups in general: a block cached while its parent
    is not cannot be hit, and the optimum may want to evict a block of the request being served.  On a
    :func:`prefix_consistent` trace (each id always after the same parent, as with prefix-chain hashes,
    e.g. Mooncake's) neither happens: a parent's next use always comes before its child's, so MIN never
    keeps a child without its parent nor evicts a block of the current request, its cached blocks of a
    request form a prefix, ``prefix_hits == hits``, and the figure *is* the prefix-model optimum.
    ``prefix_hits`` counts, per request, the hits before the first miss."""
    _check_capacity("capacity", capacity)
    ids: list[int] = []
    toks: list[int] = []
    ends: list[int] = []
    input_tokens = 0
    for r in requests:
        ids.extend(r.hash_ids)
        toks.extend(_block_tokens(r, tokens_per_block))
        ends.append(len(ids))
        input_tokens += r.input_length
    total = len(ids)
    inf = total   # "never again": every finite next use is < total
    nxt = [inf] * total
    last: dict[int, int] = {}
    for i in range(total - 1, -1, -1):
        h = ids[i]
        nxt[i] = last.get(h, inf)
        last[h] = i
    del last
    cached: dict[int, int] = {}   # id -> its next use
    heap: list[tuple[int, int]] = []   # (-next use, id); stale when cached[id] differs
    push, pop = heapq.heappush, heapq.heappop
    hits = prefix_hits = inserts = evictions = refused = saved = 0
    start = 0
    for end in ends:
        prefix = True
        for i in range(start, end):
            h, nu = ids[i], nxt[i]
            if h in cached:
                hits += 1
                saved += toks[i]
                if prefix:
                    prefix_hits += 1
                cached[h] = nu
                push(heap, (-nu, h))
                continue
            prefix = False
            if nu >= inf or capacity == 0:
                refused += 1
                continue
            if len(cached) >= capacity:
                while True:
                    neg, v = heap[0]
                    if cached.get(v) == -neg:
                        break
                    pop(heap)
                if -neg <= nu:   # the new block is needed last: bypass
                    refused += 1
                    continue
                pop(heap)
                del cached[v]
                evictions += 1
            cached[h] = nu
            push(heap, (-nu, h))
            inserts += 1
        start = end
    return SimResult("belady", "bypass", capacity, len(requests), total, hits, prefix_hits, inserts, evictions, 0,
                     refused, saved, input_tokens, block_bytes)


def sweep(requests: Sequence[Request], capacities: Sequence[int], policies: Optional[Sequence[str]] = None, *,
          admission: str = "all", with_belady: bool = True) -> dict[str, Any]:
    """Hit ratios of each of ``policies`` (default: every name in ``POLICIES``) and of :func:`belady` at
    each of ``capacities`` (blocks), for miss-ratio curves.  Returns ``{"capacities", "block_refs",
    "distinct_blocks", "hit_ratio": {name: [ratio per capacity]}, "seconds": {name: total}}``."""
    caps = list(capacities)
    for c in caps:
        _check_capacity("capacity", c)
    names = list(POLICIES) if policies is None else list(policies)
    for p in names:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; known: {', '.join(sorted(POLICIES))}")
    out: dict[str, Any] = {"capacities": caps, "block_refs": sum(len(r.hash_ids) for r in requests),
                           "distinct_blocks": len({h for r in requests for h in r.hash_ids}),
                           "hit_ratio": {}, "seconds": {}}
    runs: list[tuple[str, Any]] = [(p, lambda c, p=p: simulate(requests, c, p, admission)) for p in names]
    if with_belady:
        runs.append(("belady", lambda c: belady(requests, c)))
    for name, fn in runs:
        t0 = time.perf_counter()
        out["hit_ratio"][name] = [fn(c).hit_ratio for c in caps]
        out["seconds"][name] = time.perf_counter() - t0
        log.debug("sweep %s: %.1f s", name, out["seconds"][name])
    return out


# ---------------------------------------------------------------------------------- block sizes

def _dtype_bytes(dtype: str) -> int:
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a name such as 'bfloat16', got {dtype!r}")
    name = dtype.strip().lower()
    if name.startswith("torch."):
        name = name[6:]
    b = DTYPE_BYTES.get(name)
    if b is None:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return b


def _positive(name: str, v: Any) -> int:
    if type(v) is not int or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def model_block_bytes(layers: int, kv_heads: int, head_dim: int, dtype: str, tokens_per_block: int = BLOCK_TOKENS) -> int:
    """Bytes of one block's KV cache: K and V, ``2 x layers x kv_heads x head_dim x dtype bytes x tokens``.
    (Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, 512 tokens: 64 MiB.)"""
    return (2 * _positive("layers", layers) * _positive("kv_heads", kv_heads) * _positive("head_dim", head_dim)
            * _dtype_bytes(dtype) * _positive("tokens_per_block", tokens_per_block))


@dataclass(frozen=True)
class ModelShape:
    """A model's KV-cache shape, from :func:`model_from_hf_config`."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int = BLOCK_TOKENS

    @property
    def block_bytes(self) -> int:
        return model_block_bytes(self.layers, self.kv_heads, self.head_dim, self.dtype, self.tokens_per_block)


def model_from_hf_config(path_or_dict: Union[str, Path, Mapping[str, Any]], dtype: Optional[str] = None,
                         tokens_per_block: int = BLOCK_TOKENS) -> ModelShape:
    """The KV shape of a Hugging Face ``config.json`` (a path, or the parsed dict).

    ``num_hidden_layers``; ``num_key_value_heads``, else ``num_attention_heads``; ``head_dim``, else
    ``hidden_size / num_attention_heads``; the dtype: ``dtype`` when given, else the config's
    ``torch_dtype`` (or ``dtype``).  A multimodal config's ``text_config`` is used when the top level has
    no layers.  Raises ValueError naming the missing or bad field (and the file).  Models whose cache is
    not per-head K and V (MLA, e.g. DeepSeek-V2/V3) are not modelled."""
    where = "config"
    if isinstance(path_or_dict, Mapping):
        cfg: Mapping[str, Any] = path_or_dict
    else:
        where = str(path_or_dict)
        try:
            with open(path_or_dict, encoding="utf-8") as f:
                cfg = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read model config {where}: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"model config {where} is not JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"model config {where}: expected a JSON object, got {type(cfg).__name__}")
    top = cfg
    if cfg.get("num_hidden_layers") is None and isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]

    def field(name: str) -> Any:
        v = cfg.get(name)
        if v is None:
            raise ValueError(f"{where}: missing field {name!r}")
        if type(v) is not int or v < 1:
            raise ValueError(f"{where}: {name!r} must be a positive int, got {v!r}")
        return v

    layers = field("num_hidden_layers")
    kv_heads = field("num_key_value_heads") if cfg.get("num_key_value_heads") is not None \
        else field("num_attention_heads")
    if cfg.get("head_dim") is not None:
        head_dim = field("head_dim")
    else:
        if cfg.get("hidden_size") is None:
            raise ValueError(f"{where}: missing field 'head_dim' (and 'hidden_size' to derive it)")
        hidden, heads = field("hidden_size"), field("num_attention_heads")
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
    if dtype is None:
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or top.get("torch_dtype") or top.get("dtype")
        if dtype is None:
            raise ValueError(f"{where}: missing field 'torch_dtype' (or pass dtype=)")
    _dtype_bytes(dtype)
    _positive("tokens_per_block", tokens_per_block)
    name = dtype.strip().lower()
    return ModelShape(layers, kv_heads, head_dim, name[6:] if name.startswith("torch.") else name, tokens_per_block)
