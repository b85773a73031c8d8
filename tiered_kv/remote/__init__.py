"""The remote tier's I/O side: a Redis/Valkey store (standalone, unix socket, TLS or cluster) shared by machines.

One concern per module:

* :mod:`.records` -- options and outcome labels (torch-free, redis-free: the core imports them always);
* :mod:`.url`     -- the url forms, credentials, :func:`redact_url`;
* :mod:`.keys`    -- server-side names and the Lua scripts that make writes conditional;
* :mod:`.conn`    -- one I/O thread's connection: pipelined round trips, NOSCRIPT, cluster redirections, error kinds;
* :mod:`.breaker` -- the circuit breaker;
* :mod:`.ops`     -- queued work (put parts and jobs, tombstone ops, fetch jobs);
* :mod:`.writer`  -- the writer thread; :mod:`.reader` -- the reader thread;
* :mod:`.store`   -- :class:`RemoteStore`, the facade the core drives.

Importing this package imports neither ``redis`` nor the store (the names below load on first use).
"""

from __future__ import annotations

from typing import Any

from .records import (FETCH_CORRUPT, FETCH_MISS, PUT_CANCELLED, PUT_EXPIRED, PUT_REFUSED_TOKEN, PUT_REFUSED_TOMB,
                      REMOTE_DOWN, REMOTE_ERROR_KINDS, RemoteOptions)
from .url import parse_url, redact_url

__all__ = ["RemoteStore", "RemoteOptions", "KeyNames", "redact_url", "parse_url", "PUT_REFUSED_TOMB",
           "PUT_REFUSED_TOKEN", "PUT_CANCELLED", "PUT_EXPIRED", "REMOTE_DOWN", "FETCH_MISS", "FETCH_CORRUPT",
           "REMOTE_ERROR_KINDS"]


def __getattr__(name: str) -> Any:
    if name == "RemoteStore":
        from .store import RemoteStore
        return RemoteStore
    if name == "KeyNames":
        from .keys import KeyNames
        return KeyNames
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
