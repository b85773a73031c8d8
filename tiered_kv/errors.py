"""Exceptions raised at tiered_kv's API boundary.

Every error the library raises on bad input derives from :class:`TieredKVError`
and names the offending value.  A raised error never leaves the manager in a
changed state: validation happens before any bookkeeping is touched.

Faults inside the library (a worker thread dying, a disk error) are *not*
raised to the engine thread; they are counted, logged and reported as failed
jobs.  See docs/architecture.md.
"""

from __future__ import annotations

__all__ = [
    "TieredKVError",
    "ConfigError",
    "InvalidKeyError",
    "InvalidBlockError",
    "DeviceTensorError",
    "InvalidBufferError",
    "BlockBusyError",
    "InvalidJobError",
    "ManagerClosedError",
    "DiskTierError",
    "DiskInUseError",
    "UnsupportedVersionError",
]


class TieredKVError(Exception):
    """Base class of every exception tiered_kv raises."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class InvalidKeyError(TieredKVError, ValueError):
    """A block key is not non-empty ``bytes`` (or is too long)."""


class InvalidBlockError(TieredKVError, IndexError):
    """A device block (row) index is not an int in ``[0, num_blocks)``."""


class DeviceTensorError(TieredKVError, ValueError):
    """The engine's KV tensor has an unsupported dtype, shape, layout or device."""


class InvalidBufferError(TieredKVError, ValueError):
    """Buffers handed to a store (:class:`tiered_kv.remote.RemoteStore`) that it cannot use: a view that is not
    one C-contiguous block of the tier's size (writable, for a fetch), or lists of keys, tokens and views of
    different lengths."""


class BlockBusyError(TieredKVError, RuntimeError):
    """A device row is fenced by an in-flight load and cannot be read or written yet."""


class InvalidJobError(TieredKVError, ValueError):
    """An object passed as a job was not issued by this manager."""


class ManagerClosedError(TieredKVError, RuntimeError):
    """The manager was closed; no further calls are accepted."""


class DiskTierError(TieredKVError, RuntimeError):
    """The disk tier cannot be opened (wrong namespace, format version, path in use...)."""


class DiskInUseError(DiskTierError):
    """Another owner of the disk path (a TierManager or vLLM engine, in this or another process, or a
    writing operator tool) holds its lock."""


class UnsupportedVersionError(TieredKVError, ImportError):
    """An integration found a version of its host framework outside the range it supports."""
