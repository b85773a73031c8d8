"""A hypothesis state machine: puts, cancels, invalidations, corruptions and fetches from two stores (two
"machines") on one real server, against a model of what each key's current value is.

The model is exact because every step waits until the stores are idle, and the steps that race the two
stores (a put against another machine's invalidate or cancel) are resolved by the put's own report.
The property: a fetch hits exactly when the model holds a value for the key, with exactly its bytes --
no fetch ever returns bytes the model says are not the key's current value.
"""

from __future__ import annotations

import random
import uuid
from typing import Optional

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from fakes import sm_settings
from redis_servers import RedisServer
from test_remote_store import Handle, Rig
from tiered_kv.remote import FETCH_CORRUPT, FETCH_MISS, PUT_REFUSED_TOKEN, PUT_REFUSED_TOMB

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")

BLOCK = 64
KEYS = [b"key-%d" % i for i in range(4)]
key_ix = st.integers(0, len(KEYS) - 1)
store_ix = st.integers(0, 1)
seeds = st.integers(0, 2**32 - 1)


def payload(seed: int) -> bytes:
    return random.Random(seed).randbytes(BLOCK)


class RemoteModel(RuleBasedStateMachine):
    url = ""
    server: Optional[RedisServer] = None

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig()
        self.current: dict[bytes, Optional[tuple[bytes, uuid.UUID]]] = {k: None for k in KEYS}
        self.tomb: dict[bytes, bool] = {k: False for k in KEYS}
        self.tokens: dict[bytes, list[uuid.UUID]] = {k: [] for k in KEYS}
        self.stores: list[Handle] = []

    @initialize()
    def open(self) -> None:
        assert self.server is not None
        self.server.flush()
        self.raw = self.server.client()
        self.stores = [self.rig.open(self.url, block_bytes=BLOCK, batch_blocks=4, tomb_ttl_seconds=600)
                       for _ in range(2)]

    def teardown(self) -> None:
        self.rig.close()

    def _idle(self) -> None:
        for h in self.stores:
            h.idle()

    # ------------------------------------------------------------------ writes
    @rule(s=store_ix, parts=st.lists(st.tuples(key_ix, seeds), min_size=1, max_size=6))
    def put(self, s: int, parts: list[tuple[int, int]]) -> None:
        """One job of several parts (a key may repeat: the later part wins, in submission order)."""
        h = self.stores[s]
        keys = [KEYS[k] for k, _ in parts]
        data = [payload(seed) for _, seed in parts]
        tokens, r = h.put(keys, data)
        failed = r.failed or {}
        for i, (k, d, t) in enumerate(zip(keys, data, tokens)):
            self.tokens[k].append(t)
            if self.tomb[k]:
                assert failed.get(i) == PUT_REFUSED_TOMB, (i, r)
            else:
                assert i not in failed, (i, r)
                self.current[k] = (d, t)

    @rule(s=store_ix, k=key_ix, pick=st.integers(0, 50))
    def cancel(self, s: int, k: int, pick: int) -> None:
        key = KEYS[k]
        if not self.tokens[key]:
            return
        token = self.tokens[key][pick % len(self.tokens[key])]
        self.stores[s].store.cancel(token, key)
        self._idle()
        cur = self.current[key]
        if cur is not None and cur[1] == token:
            self.current[key] = None

    @rule(s=store_ix, k=key_ix)
    def invalidate(self, s: int, k: int) -> None:
        self.stores[s].store.invalidate(KEYS[k])
        self._idle()
        self.current[KEYS[k]] = None
        self.tomb[KEYS[k]] = True

    @rule(k=key_ix)
    def tomb_expires(self, k: int) -> None:
        self.raw.delete(self.stores[0].names.tomb(KEYS[k]))
        self.tomb[KEYS[k]] = False

    @rule(s=store_ix, k=key_ix, at=st.integers(0, 200))
    def corrupt(self, s: int, k: int, at: int) -> None:
        """Flip one byte of the stored value (header or payload): from now on it is never served."""
        name = self.stores[0].names.value(KEYS[k])
        v = self.raw.get(name)
        if v is None:
            return
        at %= len(v)
        self.raw.setrange(name, at, bytes([v[at] ^ 0x5A]))
        self.current[KEYS[k]] = None
        self.fetch(s, [k])

    @rule(s=store_ix, k=key_ix, seed=seeds)
    def race_put_and_invalidate(self, s: int, k: int, seed: int) -> None:
        """Machine ``s`` puts while the other invalidates: in either order the key ends with no value."""
        key = KEYS[k]
        a, b = self.stores[s], self.stores[1 - s]
        (tok,) = a.put_async([key], [payload(seed)])
        b.store.invalidate(key)
        b.store.kick()
        r = a.report()
        self._idle()
        self.tokens[key].append(tok)
        assert r.ok or r.failed == {0: PUT_REFUSED_TOMB}, r
        self.current[key] = None
        self.tomb[key] = True

    @rule(s=store_ix, k=key_ix, seed=seeds)
    def race_put_and_cancel(self, s: int, k: int, seed: int) -> None:
        """Machine ``s`` puts under a token the other machine cancels at the same time: the put either landed
        and was deleted, or was refused and the previous value stays."""
        key = KEYS[k]
        a, b = self.stores[s], self.stores[1 - s]
        tok = uuid.uuid4()
        a.put_async([key], [payload(seed)], tokens=[tok])
        b.store.cancel(tok, key)
        b.store.kick()
        r = a.report()
        self._idle()
        self.tokens[key].append(tok)
        if self.tomb[key]:
            assert r.failed in ({0: PUT_REFUSED_TOMB}, {0: PUT_REFUSED_TOKEN}), r
        elif r.ok:
            self.current[key] = None
        else:
            assert r.failed == {0: PUT_REFUSED_TOKEN}, r

    # ------------------------------------------------------------------ reads
    @rule(s=store_ix, ks=st.lists(key_ix, min_size=1, max_size=4))
    def fetch(self, s: int, ks: list[int]) -> None:
        keys = [KEYS[k] for k in ks]
        r, got = self.stores[s].fetch(keys)
        failed = r.failed or {}
        for i, key in enumerate(keys):
            cur = self.current[key]
            if cur is None:
                assert got[i] is None and failed[i] in (FETCH_MISS, FETCH_CORRUPT), (key, r)
            else:
                assert got[i] == cur[0], f"part {i} ({key!r}): {failed.get(i)}"
        self._idle()   # a corrupt value's delete

    @invariant()
    def nothing_failed_unexpectedly(self) -> None:
        for h in self.stores:
            assert not h.errors, h.errors


def test_remote_store_model(redis_url: str, redis_server: RedisServer) -> None:
    RemoteModel.url = redis_url
    RemoteModel.server = redis_server
    run_state_machine_as_test(RemoteModel, settings=sm_settings(60, 40))


