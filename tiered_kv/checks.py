"""Argument checks at the API boundary: a bad value raises an error from :mod:`tiered_kv.errors` naming it,
before any state is touched.  Pure functions, shared by the front ends' public methods."""

from __future__ import annotations

import logging
import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Set
from typing import Any, Optional

import torch
from prometheus_client import CollectorRegistry

from .errors import ConfigError, DeviceTensorError, InvalidBlockError, InvalidKeyError

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED_DTYPES", "NOT_SEQUENCES", "check_key", "check_block", "check_many", "check_timeout", "check_device_blocks",
           "check_registry", "check_mover_factory", "pin_decision", "plain_alias"]

SUPPORTED_DTYPES = frozenset(
    getattr(torch, n) for n in ("float16", "bfloat16", "float32", "float64", "int8", "uint8",
                                "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)
)



def check_key(key: Any, max_key_bytes: int) -> bytes:
    if type(key) is not bytes:
        raise InvalidKeyError(f"key must be bytes, got {type(key).__name__}: {key!r:.80}")
    if not key:
        raise InvalidKeyError("key must not be empty: b''")
    if len(key) > max_key_bytes:   # the same bound store()'s inline check uses
        raise InvalidKeyError(f"key of {len(key)} bytes exceeds max_key_bytes={max_key_bytes}: {key!r:.80}")
    return key


def check_block(block: Any, num_blocks: int) -> int:
    """The row as an int (e.g. from a numpy integer), in ``[0, num_blocks)``."""
    if isinstance(block, bool) or (isinstance(block, torch.Tensor) and block.dtype is torch.bool):
        raise InvalidBlockError(f"block must be an int, got bool {block!r}")   # a bool tensor indexes as 0 or 1
    try:
        b = operator.index(block)
    except TypeError:
        raise InvalidBlockError(f"block must be an int, got {type(block).__name__}: {block!r:.80}") from None
    if not 0 <= b < num_blocks:
        raise InvalidBlockError(f"block {b} out of range [0, {num_blocks})")
    return b


NOT_SEQUENCES = (bytes, bytearray, memoryview, str, Set, Mapping)
"""Iterables refused where a sequence of keys or rows is asked for: one key (its bytes would be taken as
keys), or a collection without an order (its keys would be paired with rows in hash order)."""


def _as_list(v: Any, name: str, error: type[Exception]) -> list[Any]:
    """A copy of a sequence argument as a list (the caller may reuse its own), or ``error`` naming it."""
    if type(v) is list:
        return v[:]
    if type(v) is tuple or not (isinstance(v, NOT_SEQUENCES) or not isinstance(v, Iterable)):
        return list(v)
    raise error(f"{name} must be a sequence, got {type(v).__name__}: {v!r:.80}")


def check_many(keys: Any, blocks: Any, max_key_bytes: int, num_blocks: int) -> tuple[list[bytes], list[int]]:
    """``store_many``/``load_many``: each key and row checked, equal lengths, no key or row twice."""
    ks = _as_list(keys, "keys", InvalidKeyError)
    bs = _as_list(blocks, "blocks", InvalidBlockError)
    n = len(ks)
    # the common case in two plain loops and two sets: the engine calls this once per step, and on
    # CPython 3.11 the loops' specialized bytecode costs less than map() over builtins
    if n and n == len(bs):
        for k in ks:
            if type(k) is not bytes or not k or len(k) > max_key_bytes:
                break
        else:
            for b in bs:
                if type(b) is not int or not 0 <= b < num_blocks:
                    break
            else:
                if len(set(ks)) == n and len(set(bs)) == n:
                    return ks, bs
    for k in ks:
        check_key(k, max_key_bytes)
    bs = [check_block(b, num_blocks) for b in bs]
    if not ks:
        raise InvalidKeyError("keys must not be empty")
    if len(ks) != len(bs):
        raise InvalidBlockError(f"{len(ks)} keys for {len(bs)} blocks: one device row per key")
    if len(set(ks)) != len(ks):
        dup = _first_repeat(ks)
        raise InvalidKeyError(f"key {dup!r:.80} appears twice in one call")
    if len(set(bs)) != len(bs):
        raise InvalidBlockError(f"block {_first_repeat(bs)} appears twice in one call")
    return ks, bs


def _first_repeat(xs: list[Any]) -> Any:
    """The first element of ``xs`` seen before in it (in linear time: a batch of 100k keys is refused in
    milliseconds, not the seconds of a scan of the prefix per element)."""
    seen: set[Any] = set()
    for x in xs:
        if x in seen:
            return x
        seen.add(x)
    raise AssertionError("no repeat")   # callers check len(set(xs)) first


def check_timeout(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    # any real number: numpy's scalars too (a timeout computed from a numpy array is a numpy float)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise ConfigError(f"timeout must be None or a number >= 0, got {timeout!r}")
    try:
        return float(timeout)
    except OverflowError:   # an int past any float: as long as inf
        return math.inf


def check_device_blocks(t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise DeviceTensorError(f"device_blocks must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:   # (a nested tensor says strided, and has no one shape)
        raise DeviceTensorError(f"device_blocks must be a dense (strided) tensor, got layout {t.layout}"
                                f"{' (nested)' if t.is_nested else ''}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise DeviceTensorError(f"device_blocks dtype {t.dtype} is not supported; use one of "
                                f"{sorted(str(d) for d in SUPPORTED_DTYPES)}")
    if t.dim() < 2:
        raise DeviceTensorError(f"device_blocks must be [num_blocks, ...] with >= 2 dims, got shape {tuple(t.shape)}")
    if t.shape[0] < 1 or t[0].numel() < 1:
        raise DeviceTensorError(f"device_blocks must have >= 1 non-empty row, got shape {tuple(t.shape)}")
    if t.device.type not in ("cpu", "cuda"):
        raise DeviceTensorError(f"device_blocks must be on cpu or cuda, got {t.device}")
    if not t.is_contiguous() or t.stride(-1) != 1:   # a size-1 last dim's stride: contiguous to torch, not to view()
        raise DeviceTensorError(f"device_blocks rows must be contiguous, got shape {tuple(t.shape)} "
                                f"strides {t.stride()}")
    if t.requires_grad:
        raise DeviceTensorError("device_blocks must not require grad")


def check_registry(registry: Any) -> None:
    """``registry``: None (a private one) or a prometheus_client :class:`CollectorRegistry`."""
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise ConfigError(f"registry must be None or a prometheus_client CollectorRegistry, got "
                          f"{type(registry).__name__}: {registry!r:.80}")


def check_mover_factory(factory: Any) -> None:
    """``mover_factory``: None (the default mover) or a callable that makes one."""
    if factory is not None and not callable(factory):
        raise ConfigError(f"mover_factory must be None or a callable (dev_rows, host_rows, completions) -> Mover, "
                          f"got {type(factory).__name__}: {factory!r:.80}")


def plain_alias(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or where ``t`` is an inference tensor (made under ``torch.inference_mode()``), a normal
    tensor over the same memory.  The copy threads write the engine's rows outside inference mode (it is
    per thread), where torch refuses any in-place write to an inference tensor; through this alias they
    write the same bytes.  (The tiers' own tensors -- slabs, staging rows -- are made outside inference mode, for
    the same reason, whatever the caller's mode.)"""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                  t.shape, t.stride())


def pin_decision(pin: Optional[bool], device_is_cuda: bool) -> bool:
    """Whether to pin the host slab (``pin_host_memory``), the same rule under every front end.

    ``None`` pins when the KV tensors are on CUDA (and CUDA is available); ``True`` without
    CUDA raises :class:`ConfigError`; ``False`` with CUDA tensors is honoured with a warning."""
    if pin is None:
        return bool(device_is_cuda and torch.cuda.is_available())
    if pin and not torch.cuda.is_available():
        raise ConfigError("pin_host_memory=True needs CUDA, and torch.cuda.is_available() is False")
    if not pin and device_is_cuda:
        log.warning("pin_host_memory=False with CUDA KV tensors: copies to and from a pageable host slab "
                    "are synchronous, so each copy blocks the calling thread")
    return bool(pin)
