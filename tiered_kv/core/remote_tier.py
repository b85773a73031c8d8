"""The remote tier as the core sees it: the store's handle, and what this owner knows of the server.

The server is shared by many machines, so no index of it is kept here: a lookup that misses the
local tiers asks the server, in two FETCH jobs: a probe of the step's keys (does the server hold
them?), then, for those it holds, the read into host slots reserved only then -- so a miss, the
common answer for a new prompt, costs no host slot and evicts nothing.  What the server did not
hold is remembered for ``remote_miss_ttl_seconds``, so that an engine retrying a lookup every step
does not ask again each time; what this machine invalidated is not asked for while its tombstone
lives (``remote_tomb_ttl_seconds``).  Each block a store publishes is also written there (a PUT job of
the step's keys, one token per key, like a spill job): write-through from host, beside the disk.

Owner thread only; the store's I/O threads never see this object.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Optional, Union

from ..config import TieredKVConfig
from ..errors import ConfigError
from ..metrics import Metrics
from ..reports import CompletionQueue, Report
from ..remote.records import (FETCH_CORRUPT, FETCH_MISS, PUT_CANCELLED, PUT_REFUSED_TOKEN, PUT_REFUSED_TOMB,
                              RemoteOptions)
from .index import Entry, TierIndex

__all__ = ["RemoteTier", "MISSED_MAX"]

log = logging.getLogger(__name__)

MISSED_MAX = 1 << 16


class Refused(NamedTuple):
    """A probe the store refused: why (a shed reason) and how many keys it asked for."""
    why: str
    keys: int
"""At most this many keys not to ask the server for are remembered (the oldest quarter goes beyond it)."""


class RemoteTier:
    """An open remote tier: ``store`` (the I/O threads), the puts in flight by key, the recent misses,
    and the keys this step wants fetched."""

    def __init__(self, store: Any, metrics: Metrics, miss_ttl: float, prefetch: int, tomb_ttl: float) -> None:
        self.store = store
        self.miss_ttl = miss_ttl
        self.tomb_ttl = tomb_ttl
        self.prefetch = prefetch
        # key -> (its token, the PUT job) of this owner's write of it in flight; only the job's first token is
        # in TierCore.jobs (the report's), so that a job of many blocks is one job against max_inflight_jobs
        self.putting: dict[bytes, tuple[uuid.UUID, Any]] = {}
        # key -> until when (monotonic) it is not asked for: the server missed it lately (bounded: the oldest
        # are forgotten) ...
        self.missed: dict[bytes, float] = {}
        # ... or this machine invalidated it (any value the server holds then is one the invalidation's tomb
        # deletes): never forgotten before it expires
        self.guards: dict[bytes, float] = {}
        # keys whose fetch found no host slot: the next ask of each is a miss, whatever the miss TTL (asked again
        # at once, a request would be told to retry at every step while the slots stay taken)
        self.no_slot: dict[bytes, None] = {}
        # keys fetched into the host tier and not yet found there by a lookup: that lookup counts them as
        # remote hits (bounded: the oldest are forgotten, then counted as host hits)
        self.landed: dict[bytes, Entry] = {}   # key -> the host entry its fetch published (bounded)
        # key -> the token of the probe or fetch asking the server for it (or of this step's probe)
        self.asking: dict[bytes, uuid.UUID] = {}
        # the probe being gathered this step (submitted by TierCore.end_step)
        self.want_token: Optional[uuid.UUID] = None
        self.want_keys: list[bytes] = []
        self._metrics = metrics

    @classmethod
    def open(cls, cfg: TieredKVConfig, row_bytes: int, completions: CompletionQueue,
             metrics: Metrics) -> "RemoteTier":
        """The tier, its I/O threads started.  An unreachable server is not an error (the tier misses
        until it is reachable); a malformed URL or a missing ``redis`` package is (:class:`ConfigError`)."""
        try:
            from ..remote.store import RemoteStore
        except ImportError as exc:   # pragma: no cover - the package is part of tiered_kv; redis is checked below
            raise ConfigError(f"remote_url is set but the remote tier cannot be loaded: {exc}") from exc
        assert cfg.remote_url is not None
        opts = RemoteOptions(url=cfg.remote_url, namespace=cfg.namespace, block_bytes=row_bytes,
                             ttl_seconds=cfg.remote_ttl_seconds, tomb_ttl_seconds=cfg.remote_tomb_ttl_seconds,
                             timeout_s=cfg.remote_timeout_seconds, queue_blocks=cfg.remote_queue_blocks,
                             batch_blocks=cfg.remote_batch_blocks,
                             write_deadline_s=cfg.remote_write_deadline_seconds)
        m = metrics
        m.enable_remote_health(True)
        logged: set[str] = set()

        def on_error(kind: str, msg: str) -> None:   # any thread: prometheus_client's own locks
            m.error("remote", kind)
            if kind not in logged:
                logged.add(kind)
                log.error("remote tier error (%s): %s; further %s errors are counted, not logged", kind, msg, kind)

        def on_refused(reason: str) -> None:
            m.refused["token" if reason == PUT_REFUSED_TOKEN else "tomb"].inc()

        def on_corrupt(reason: str) -> None:   # a fault too: the remote errors alert sees it
            m.remote_corrupt.labels(reason=reason).inc()
            m.error("remote", "corrupt")

        store = RemoteStore(opts, completions, on_error=on_error, on_refused=on_refused, on_corrupt=on_corrupt)
        return cls(store, metrics, cfg.remote_miss_ttl_seconds, cfg.remote_prefetch_blocks, cfg.remote_tomb_ttl_seconds)

    # ------------------------------------------------------------------ puts
    def puts_room(self, entries: list[Entry]) -> list[Entry]:
        """The first of ``entries`` whose writes fit in the store's queue now (none while the server is down)."""
        room = self.store.put_room()
        return [] if room <= 0 else entries[:room] if len(entries) > room else entries

    @staticmethod
    def refused(error: Optional[str]) -> bool:
        """A put part that failed by design (a tombstone refused it, or it was cancelled before it was sent),
        not by a fault."""
        return error in (PUT_REFUSED_TOMB, PUT_REFUSED_TOKEN, PUT_CANCELLED)

    @staticmethod
    def missing(error: Optional[str]) -> bool:
        """A fetch part the server did not hold (or held bad bytes of): a miss, not a fault."""
        return error in (FETCH_MISS, FETCH_CORRUPT)

    def put_done(self, key: bytes, token: uuid.UUID) -> None:
        p = self.putting.get(key)
        if p is not None and p[0] == token:
            del self.putting[key]

    # ------------------------------------------------------------------ fetches
    def recently_missed(self, key: bytes, now: float) -> bool:
        """The server missed ``key`` lately, or it was invalidated here lately (:meth:`invalidate`)."""
        until = self.guards.get(key)
        if until is not None:
            if now < until:
                return True
            del self.guards[key]
        until = self.missed.get(key)
        if until is None:
            return False
        if now < until:
            return True
        del self.missed[key]
        return False

    def note_miss(self, key: bytes, now: float, ttl: Optional[float] = None) -> None:
        """Do not ask the server for ``key`` for ``ttl`` seconds (default: ``remote_miss_ttl_seconds``)."""
        missed = self.missed
        missed.pop(key, None)
        missed[key] = now + (self.miss_ttl if ttl is None else ttl)
        if len(missed) > MISSED_MAX:   # forget the oldest quarter (insertion order is the order noted)
            for k in list(missed)[:MISSED_MAX // 4]:
                del missed[k]

    def want(self, key: bytes, take_token: Callable[[], uuid.UUID]) -> bool:
        """Ask the server for ``key`` (in no local tier): True while it is being asked (with this step's
        probe, or by a probe or fetch in flight).  False when the server is unavailable, missed it
        lately, the key's last fetch found no host slot (once), or this step asks for
        ``remote_prefetch_blocks`` keys already.  Nothing local is taken: a host slot is reserved only
        once the server said it holds the key."""
        if key in self.asking:
            return True
        no_slot = self.no_slot
        if no_slot and key in no_slot:
            del no_slot[key]
            return False
        if (len(self.want_keys) >= self.prefetch or not self.store.available
                or self.recently_missed(key, time.monotonic()) or self.store.invalidating(key)):
            return False
        token = self.want_token
        if token is None:
            token = self.want_token = take_token()
        self.want_keys.append(key)
        self.asking[key] = token
        return True

    def take_wanted(self) -> Union[None, Refused, tuple[uuid.UUID, list[bytes]]]:
        """Submit this step's probe (does the server hold these keys?): (token, keys) when queued,
        :class:`Refused` (a shed reason, ``"backpressure"`` or ``"remote_down"``, and how many keys) when
        the store refused it, None when no key is wanted."""
        token, keys = self.want_token, self.want_keys
        if token is None:
            return None
        self.want_token, self.want_keys = None, []
        asking = self.asking
        # not invalidated or stored meanwhile; a key wanted again after an invalidation of it is asked once
        keys = list(dict.fromkeys(k for k in keys if asking.get(k) == token))
        if not keys:
            return None
        if not self.store.submit_probe(token, keys):
            for k in keys:
                del asking[k]
            return Refused("backpressure" if self.store.available else "remote_down", len(keys))
        return token, keys

    def probe_found(self, token: uuid.UUID, keys: Sequence[bytes], r: Report, hindex: TierIndex,
                    dindex: Optional[TierIndex]) -> list[bytes]:
        """A probe's answer: the keys the server holds, still wanted and still in no local tier (left asked for
        under the probe's token, for :meth:`fetch_found`); the others are no longer asked for, and those it does
        not hold are remembered as missed.  Safe to run again (an interrupt leaves the report queued): a key let
        go by a pass before is passed over, one remembered as missed is remembered again."""
        asking, failed, now = self.asking, r.failed, time.monotonic()
        found: list[bytes] = []
        for i, k in enumerate(keys):
            if asking.get(k) != token:
                continue   # invalidated, or stored by the engine, meanwhile (or let go by a pass before)
            if r.ok or (failed is not None and i not in failed):
                if k in hindex or (dindex is not None and k in dindex):
                    del asking[k]
                else:
                    found.append(k)
            else:
                if self.missing(r.error if failed is None else failed[i]):
                    self.note_miss(k, now)   # (before its ask goes: a pass again remembers it again, never not)
                del asking[k]
        return found

    def fetch_found(self, probe: uuid.UUID, found: list[bytes], fetch: uuid.UUID, hindex: TierIndex,
                    view: Callable[[int], Any], promised: Collection[bytes] = ()
                    ) -> Union[None, Refused, tuple[list[bytes], list[Entry], int]]:
        """Fetch the keys ``probe`` found (:meth:`probe_found`) as one job under ``fetch``: each gets a host slot
        (WRITING); (keys, entries, how many found no slot) when queued; a :class:`Refused` when the reader has no
        room for them (asked before any slot is reserved: a reservation may evict), or no slot for any
        (``"host_full"``).  A key that found no slot is a miss at its next ask (:meth:`want`).  The
        reservations evict neither the fetched keys nor ``promised`` (the keys a front end told its requests are
        hits: :attr:`TierCore.promised`).  Run once; an interrupt inside is finished or undone by
        :meth:`TierCore._fetch_start_broken`."""
        asking, store = self.asking, self.store
        if not store.take_fetch_room(len(found)):
            # refused before any host slot is reserved: a reservation may evict READY blocks, for nothing here
            for k in found:
                del asking[k]
            return Refused("backpressure" if store.available else "remote_down", len(found))
        got: list[bytes] = []
        entries: list[Entry] = []
        protect: Collection[bytes] = found if not promised else set(found).union(promised)
        for k in found:
            e = hindex.reserve(k, fetch, protect)
            if e is None:   # every slot leased or promised: the rest of the prefix is not fetched this time,
                no_slot = self.no_slot          # and a miss at its next ask (not asked again at once: a
                for rest in found[len(got):]:   # request would be told to retry at every step)
                    no_slot[rest] = None
                    del asking[rest]
                if len(no_slot) > MISSED_MAX:
                    for k in list(no_slot)[:MISSED_MAX // 4]:
                        del no_slot[k]
                break
            got.append(k)
            entries.append(e)
            asking[k] = fetch
        unplaced = len(found) - len(got)
        if unplaced:
            store.give_fetch_room(unplaced)
        if not got:
            return Refused("host_full", unplaced)
        if not store.submit_fetch(fetch, got, [view(e.slot) for e in entries], room_taken=True):
            for k, e in zip(got, entries):   # the store closes meanwhile
                del asking[k]
                hindex.writer_done(e)
                hindex.abort(e)
            return None
        return got, entries, unplaced

    def landed_key(self, key: bytes, entry: Entry) -> None:
        """``key``'s fetch published it in the host tier, as ``entry``."""
        landed = self.landed
        landed[key] = entry
        if len(landed) > MISSED_MAX:
            for k in list(landed)[:MISSED_MAX // 4]:
                del landed[k]

    def hits_among(self, keys: Sequence[bytes], hindex: Any) -> int:
        """How many of ``keys`` (a lookup's hits) are fetched blocks found in the host tier for the first
        time; they are no longer counted so afterwards.  Only the entry the fetch published counts: the
        engine's own block of the key, stored after that one left the host tier, is a host hit."""
        landed, n = self.landed, 0
        for k in keys:
            e = landed.pop(k, None)
            if e is not None and hindex.get(k) is e:
                n += 1
        return n

    def fetched(self, key: bytes, token: uuid.UUID) -> None:
        """A fetch's answer for ``key`` was applied."""
        if self.asking.get(key) == token:
            del self.asking[key]

    def superseded(self, key: bytes) -> None:
        """``key`` is no longer asked for: invalidated, or the engine stores it itself."""
        self.asking.pop(key, None)

    # ------------------------------------------------------------------ removal
    def invalidate(self, key: bytes) -> Optional[tuple[uuid.UUID, Any]]:
        """``key`` is invalidated on this machine: a tombstone on the server stops every machine's
        write of it and deletes its value.  Returns (token, PUT job) of this owner's write of it in
        flight, if any.  The server is not asked for the key while the tomb lives: until the tomb
        reaches it (the writer's queue may be behind the reader's probes) it may still hold the old
        value, and afterwards it refuses every write of the key anyway.  Nor while the INVALIDATE has not
        run there (:meth:`RemoteStore.invalidating`: the server may be away for longer than the tomb's
        TTL).  The guards are kept apart from the bounded miss marks: a burst of misses never drops one."""
        now = time.monotonic()
        self.landed.pop(key, None)
        guards = self.guards
        guards.pop(key, None)
        guards[key] = now + self.tomb_ttl
        if len(guards) > MISSED_MAX:   # expired ones go (one TTL for all: the oldest first, in insertion order)
            for k in [k for k, until in itertools.takewhile(lambda kv: kv[1] <= now, guards.items())]:
                del guards[k]
        self.asking.pop(key, None)
        put = self.putting.pop(key, None)
        if put is not None:
            self.store.cancel(put[0], key)
        self.store.invalidate(key)
        return put

    def levels(self) -> tuple[int, int]:
        """The gauge values for :meth:`Metrics.publish_levels`."""
        s = self.store
        return s.queue_depth, 1 if s.available and s.healthy else 0
