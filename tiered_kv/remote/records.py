"""Plain records of the remote tier: its options, and the labels of its outcomes.

Torch-free and redis-free: the core imports these whether or not a remote tier is configured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["RemoteOptions", "tomb_ttl_problem", "PUT_REFUSED_TOMB", "PUT_REFUSED_TOKEN", "PUT_CANCELLED", "PUT_EXPIRED",
           "REMOTE_DOWN", "FETCH_MISS", "FETCH_CORRUPT", "REMOTE_ERROR_KINDS"]

PUT_REFUSED_TOMB = "refused_tomb"      # the server holds a tombstone for the key (invalidated on some machine)
PUT_REFUSED_TOKEN = "refused_token"    # the server holds a tombstone for the writer's token (its job was cancelled)
PUT_CANCELLED = "cancelled"            # cancelled on this machine before it was sent: never sent
PUT_EXPIRED = "expired"                # not sent within write_deadline_s of its submission: never sent
REMOTE_DOWN = "remote_down"            # the circuit breaker is open (or the store is closing): never sent
FETCH_MISS = "miss"                    # the server does not hold the key (a fetch part)
FETCH_CORRUPT = "corrupt"              # the value failed verification: a miss, deleted if still the same bytes

# tiered_kv_errors_total{tier="remote", error=...}: exported at 0 from the start
REMOTE_ERROR_KINDS = ("connection", "timeout", "server_error", "oom", "cluster", "script", "corrupt", "breaker_open",
                      "tomb_dropped")


@dataclass(frozen=True)
class RemoteOptions:
    """What a :class:`~tiered_kv.remote.store.RemoteStore` needs (built by the core from the config).

    ``url``: ``redis://``, ``rediss://``, ``unix://`` or the cluster forms ``redis+cluster://`` /
    ``rediss+cluster://`` (several ``host:port`` seeds, comma separated).  ``namespace`` scopes every
    key on the server and is checked in every value's header.  ``ttl_seconds``: values expire after
    this long (``None``: never; the server's ``maxmemory`` policy evicts).  ``tomb_ttl_seconds``:
    how long a tombstone refuses writes; more than twice the longest a write can be in flight
    (``write_deadline_s`` + two timeouts: :func:`tomb_ttl_problem`).  ``queue_blocks``: bound of the puts queued and
    not yet answered (beyond it the core sheds).  ``batch_blocks``: commands per pipeline.
    """

    url: str = field(repr=False)   # it may hold a password
    namespace: str
    block_bytes: int
    ttl_seconds: Optional[int] = 3600
    tomb_ttl_seconds: int = 120
    timeout_s: float = 1.0
    queue_blocks: int = 256
    batch_blocks: int = 32
    write_deadline_s: float = 10.0
    breaker_failures: int = 3
    breaker_backoff_min_s: float = 0.5
    breaker_backoff_max_s: float = 30.0


def tomb_ttl_problem(tomb_ttl_s: float, write_deadline_s: float, timeout_s: float) -> Optional[str]:
    """Why a tombstone TTL is too short, or None.  A write is refused by the server past half a tombstone's
    lifetime from when it was queued (its deadline, ``Writer._commands``), so no write queued before an
    invalidation lands after that invalidation's tombstone expired; half a lifetime must then exceed the
    longest a write can be in flight (its write deadline, then a timeout for the attempt sent just before it
    and one for the script), or every write that late would be refused."""
    longest = write_deadline_s + 2 * timeout_s
    if tomb_ttl_s <= 2 * longest:
        return (f"must exceed twice the longest a remote write can be in flight (write deadline + 2 x timeout = "
                f"{longest:g} s): a write is refused past half a tombstone's lifetime from when it was queued")
    return None
