"""The remote store's queued work: put parts and their job, tombstone ops, fetch jobs.

A put job of several blocks is one :class:`PutGroup` answered by one :class:`~tiered_kv.reports.Report`
once all its :class:`PutPart` are answered (like the disk writer's spill groups).  Parts are answered
on the writer thread only (or by ``close()`` once that thread is gone), so a group needs no lock; a
part's ``state`` moves QUEUED -> TAKEN under the store's lock (the owner's ``cancel()`` may still drop
a QUEUED part, never a TAKEN one).
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

from ..jobs import JobKind
from ..reports import Report

__all__ = ["PutGroup", "PutPart", "TombOp", "FetchJob", "QUEUED", "CANCELLED", "TAKEN", "DONE",
           "CANCEL", "INVALIDATE", "DROP"]

QUEUED, CANCELLED, TAKEN, DONE = 0, 1, 2, 3
CANCEL, INVALIDATE, DROP = "cancel", "invalidate", "drop_if_same"


class PutGroup:
    """One owner job's puts, answered as one report under the first part's token."""

    __slots__ = ("token", "left", "nbytes", "sent_at", "failed")

    def __init__(self, token: uuid.UUID, parts: int) -> None:
        self.token = token
        self.left = parts
        self.nbytes = 0
        self.sent_at = 0.0                      # first time a part went on the wire (0: none did)
        self.failed: Optional[dict[int, str]] = None

    def answer(self, part: int, ok: bool, reason: Optional[str], nbytes: int) -> Optional[Report]:
        """Record one part; the job's report once it was the last one, else None."""
        self.left -= 1
        if ok:
            self.nbytes += nbytes
        else:
            if self.failed is None:
                self.failed = {}
            self.failed[part] = reason or "failed"
        if self.left:
            return None
        failed = self.failed
        first = None if failed is None else failed[min(failed)]
        seconds = time.monotonic() - self.sent_at if self.sent_at else 0.0
        return Report(self.token, JobKind.PUT, failed is None, first, self.nbytes, seconds, failed)


class PutPart:
    """Block ``key`` to publish under ``token`` from ``view`` (the owner's leased host slot)."""

    __slots__ = ("group", "part", "token", "key", "view", "queued_at", "state")

    def __init__(self, group: PutGroup, part: int, token: uuid.UUID, key: bytes, view: memoryview,
                 queued_at: float) -> None:
        self.group = group
        self.part = part
        self.token = token
        self.key = key
        self.view = view
        self.queued_at = queued_at
        self.state = QUEUED


class TombOp:
    """A cancel (``token`` + ``key``), an invalidate (``key``) or a reader's delete of a corrupt value
    (``key`` + ``sha``).  Never shed while the server is reachable; retried when the server refuses."""

    __slots__ = ("kind", "key", "token", "sha", "attempts", "pause", "retry_at")

    def __init__(self, kind: str, key: bytes, token: Optional[uuid.UUID] = None, sha: str = "") -> None:
        self.kind = kind
        self.key = key
        self.token = token
        self.sha = sha
        self.attempts = 0       # refusals by the server (not counting its node being away)
        self.pause = 0.0        # its back-off after a failed trip (doubling, at most 1 s)
        self.retry_at = 0.0     # not sent again before this (monotonic)


class FetchJob:
    """One fetch: ``keys[i]`` into ``views[i]``; ``next`` is the first part not yet sent.  A probe
    (``probe``, no views) only asks whether the server holds each key."""

    __slots__ = ("token", "keys", "views", "next", "left", "nbytes", "sent_at", "failed", "probe")

    def __init__(self, token: uuid.UUID, keys: list[bytes], views: list[memoryview], probe: bool = False) -> None:
        self.token = token
        self.keys = keys
        self.views = views
        self.probe = probe
        self.next = 0
        self.left = len(keys)
        self.nbytes = 0
        self.sent_at = 0.0
        self.failed: Optional[dict[int, str]] = None

    def answer(self, part: int, reason: Optional[str], nbytes: int = 0) -> Optional[Report]:
        """Record part ``part`` (``reason`` None: a hit of ``nbytes``); the report once it was the last one."""
        self.left -= 1
        if reason is None:
            self.nbytes += nbytes
        else:
            if self.failed is None:
                self.failed = {}
            self.failed[part] = reason
        if self.left:
            return None
        return self.report()

    def report(self) -> Report:
        failed = self.failed
        first = None if failed is None else failed[min(failed)]
        seconds = time.monotonic() - self.sent_at if self.sent_at else 0.0
        return Report(self.token, JobKind.FETCH, failed is None, first, self.nbytes, seconds, failed)
