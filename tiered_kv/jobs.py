"""Jobs, their tokens, and the job state machine.

A job is one movement of a set of blocks (one key is the special case) between
two tiers.  It is created on the
owner (engine) thread with a fresh UUID token; workers only ever see
``(token, what to move)`` and answer ``(token, outcome)``.  The owner matches
the answer by token, so a late, duplicate or foreign answer can never touch
another job's state.

State table (the only allowed moves, ``ALLOWED_MOVES``; ``Job._move`` checks one against it; the
library sets a state directly, each time from a state it checked first or holds by construction)::

    PENDING     --report ok-------------> DONE        (reported ok)
    PENDING     --report failed---------> FAILED      (reported not ok)
    PENDING     --cancel/free/invalidate-> CANCELLING  (not yet reported)
    CANCELLING  --delivered--------------> CANCELLED   (reported not ok)

A store in CANCELLING is delivered at the next ``poll()`` (its result is
discarded anyway); a load in CANCELLING is delivered only when its worker has
reported, because until then its copy may still land in the device row.
"""

from __future__ import annotations

import enum
import itertools
import os
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

from .untrack import untrack

__all__ = ["Job", "JobKind", "JobState", "Completion", "StaleReason", "TokenFactory", "uuid_from_int"]


class JobKind(str, enum.Enum):
    STORE = "store"      # device row -> host slot
    LOAD = "load"        # host slot -> device row
    SPILL = "spill"      # host slot -> disk
    PROMOTE = "promote"  # disk -> host slot
    PUT = "put"          # host slot -> remote store
    FETCH = "fetch"      # remote store -> host slot

    def __str__(self) -> str:
        return self.value


class JobState(str, enum.Enum):
    PENDING = "pending"
    CANCELLING = "cancelling"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})

ALLOWED_MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLING}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class StaleReason(str, enum.Enum):
    """Why a worker report was discarded (label ``reason`` of the stale counter)."""

    UNKNOWN_TOKEN = "unknown_token"    # no live job has that token (never issued, or already applied)
    CANCELLED = "cancelled"            # the job was cancelled by cancel()
    SUPERSEDED = "superseded"          # the key was invalidated (and maybe stored again) meanwhile
    SOURCE_REUSED = "source_reused"    # the source row was freed / rewritten while the copy ran

    def __str__(self) -> str:
        return self.value


class TokenFactory:
    """Issues UUID tokens: a random prefix per factory plus a 48-bit counter.

    The prefix is 80 bits of which the UUID version and variant fix 6, so 74 are
    random.  Unique within a factory by construction and, across factories,
    processes and restarts, with the collision odds of 74 random bits -- at a
    fraction of the cost of ``uuid.uuid4()`` per job, which matters on the
    engine thread.
    """

    def __init__(self, start: int = 1) -> None:
        """``start``: the first counter value (a sequence shared with another process may need to skip)."""
        # version 4 and the RFC 4122 variant are set in the prefix once; the counter
        # occupies the low 48 bits, which neither touches
        prefix = uuid.UUID(int=int.from_bytes(os.urandom(16), "big"), version=4).int
        self._prefix = prefix & ~((1 << 48) - 1)
        #: the tokens' first 10 bytes (all but the counter), the same for every token of this factory
        self.prefix = self._prefix.to_bytes(16, "big")[:10]
        self._counter = itertools.count(max(1, int(start)))

    def __call__(self) -> uuid.UUID:
        n = next(self._counter)
        if n >= 1 << 48:  # pragma: no cover - 2.8e14 jobs
            self.__init__()  # type: ignore[misc]
            n = next(self._counter)
        return uuid_from_int(self._prefix | n)


_new_uuid = object.__new__
_set = object.__setattr__
_UUID = uuid.UUID
_UNKNOWN = uuid.SafeUUID.unknown  # looked up once: an enum member read through its class costs ~0.3 us


def uuid_from_int(value: int) -> uuid.UUID:
    """``uuid.UUID(int=value)`` for a value known to be a 128-bit UUID (a token made here or read
    from a header), built directly: ``UUID.__init__`` validates and re-masks on every call, which
    costs about twice as much on the engine thread (tokens) and the disk readers (headers)."""
    u = _new_uuid(_UUID)
    _set(u, "int", value)
    _set(u, "is_safe", _UNKNOWN)
    untrack(u)   # an int and an enum member: never in a cycle (tokens live as long as their blocks; untrack.py)
    return u


_NO_ENTRIES: list[Any] = []  # never appended to: every job that leases entries gets its own list


class Job:
    """One movement of a set of blocks between two tiers.  Read-only for callers.

    ``token`` identifies the job everywhere (workers, logs, disk headers).
    ``keys`` are the blocks it moves and ``blocks`` their device rows (STORE/LOAD;
    empty for SPILL/PROMOTE and for the vLLM adapter, whose rows vLLM keeps);
    ``key``/``block`` are the first of them, the whole job for the one-key
    calls ``store()``/``load()`` (``block`` is ``-1`` without a device row).

    A ``Job`` is also the owner's record of the movement while it is in flight:
    the attributes with a leading underscore are the leases it holds, read and
    written by the owner thread only (``tiered_kv.core``).
    """

    __slots__ = ("token", "kind", "key", "block", "state", "cancel_reason", "error", "_owner", "keys", "blocks",
                 "_entries", "_dentry", "_transfer", "_waiters", "_dead")

    _dentry: Any
    _transfer: Any
    _waiters: Optional[list[Any]]
    _dead: Optional[dict[int, StaleReason]]

    def __init__(self, token: uuid.UUID, kind: JobKind, key: bytes, block: int, state: JobState = JobState.PENDING,
                 cancel_reason: Optional[StaleReason] = None, error: Optional[str] = None, _owner: object = None,
                 keys: Sequence[bytes] = (), blocks: Sequence[int] = ()) -> None:
        self.token = token
        self.kind = kind
        self.key = key
        self.block = block
        self.state = state
        self.cancel_reason = cancel_reason
        self.error = error
        self._owner = _owner
        self.keys: Sequence[bytes] = keys or (key,)
        self.blocks: Sequence[int] = blocks
        self._entries: list[Any] = _NO_ENTRIES   # host entries written (store/promote) or read (load/spill), per key
        # spill: the disk entries written (one per key, each under its own token), promote: the one read;
        # the mover's transfer (None while a load waits for its reads); promote: (load, part) waiting for
        # it, load: the promotes it waits for; a store or spill of several keys: the parts cancelled, and why
        self._dentry = self._transfer = self._waiters = self._dead = None

    def _move(self, new: JobState) -> None:
        if new not in ALLOWED_MOVES[self.state]:
            raise AssertionError(f"job {self.token} illegal move {self.state} -> {new}")  # internal bug
        self.state = new

    @property
    def done(self) -> bool:
        """True once the job has been reported by ``poll()``/``wait()``."""
        return self.state.terminal

    def __hash__(self) -> int:
        return hash(self.token)

    def __repr__(self) -> str:
        many = f", keys={len(self.keys)}" if len(self.keys) > 1 else ""
        return (f"Job(token={self.token}, kind={self.kind}, key={self.key!r:.80}, block={self.block}{many}, "
                f"state={self.state}, cancel_reason={self.cancel_reason}, error={self.error!r})")


class Completion(NamedTuple):
    """What ``poll()``/``wait()`` report for a job: exactly once per job."""

    job: Job
    ok: bool
    error: Optional[str] = None
