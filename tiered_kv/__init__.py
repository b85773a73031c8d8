"""tiered_kv: token-guarded KV-cache tiering (device -> pinned host -> LMDB disk).

Public API::

    from tiered_kv import TierManager, TieredKVConfig, Job, Completion
    mgr = TierManager(TieredKVConfig(namespace="m|bf16|tp0", host_capacity_bytes=8 << 30), device_blocks=kv)

See docs/architecture.md for the tiers, the job lifecycle and the invariants.
"""

from __future__ import annotations

from . import errors
from .config import TieredKVConfig
from .jobs import Completion, Job, JobKind, JobState, StaleReason
from .manager import TierManager
from .metrics import Metrics

__all__ = [
    "TierManager",
    "TieredKVConfig",
    "Job",
    "Completion",
    "JobKind",
    "JobState",
    "StaleReason",
    "Metrics",
    "errors",
    "__version__",
]

__version__ = "0.1.0"
