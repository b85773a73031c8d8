"""A GET that a cluster redirects (MOVED after a slot moved, ASK while it moves) is read on the store's own link.

The store reads every GET's reply itself (``remote/resp.py``): a value of the block's length straight into its
host slot, any other length drained in pieces and hashed (a foreign value may be hundreds of MiB; Redis takes up
to 512 MiB).  A redirected GET used to be sent again through the cluster client (``execute_command``), which
reads the value whole: the one path where the server's length sized an allocation.  Now ``Conn._follow`` sends
it on the link of the node the redirection names (``ASKING`` first for an ASK) and a MOVED patches the client's
slot table.  A real 3-master cluster (``tests/redis_servers.py``) forces each redirection by migrating a slot.
"""

from __future__ import annotations

import os
import tracemalloc
from typing import Any

import pytest

from redis_servers import RedisCluster
from test_remote_store import BLOCK, Rig, rig  # noqa: F401  (rig: the fixture)
from test_remote_store_faults import _slot_keys
from tiered_kv.remote import FETCH_CORRUPT

pytest.importorskip("redis", reason="the remote tier needs the redis package (pip install redis hiredis)")


def _gets_through_the_client(h: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every command the reader's cluster client sends itself (``execute_command``), recorded."""
    client = h.store._r.conn.client()
    real = client.execute_command
    sent: list[tuple[Any, ...]] = []

    def spy(*args: Any, **kw: Any) -> Any:
        sent.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(client, "execute_command", spy)
    return sent


def _move(cluster: RedisCluster, slot: int) -> tuple[Any, Any]:
    src = cluster.master_of_slot(slot)
    return src, next(m for m in cluster.masters() if m is not src)


def _give_back(cluster: RedisCluster, slot: int, src: Any, dst: Any) -> None:
    """However far the migration of ``slot`` from ``src`` to ``dst`` went, it ends and the slot goes back to
    ``src``: the session's cluster stays as the other tests expect it."""
    while cluster.move_keys(slot, src, dst):
        pass
    cluster.finish_migration(slot, dst)
    cluster.migrate_slot(slot, src)


def test_a_get_redirected_by_ask_or_moved_is_read_on_the_stores_link(rig: Rig, redis_cluster_url: str,  # noqa: F811
                                                                     redis_cluster: RedisCluster,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    h = rig.open(redis_cluster_url, batch_blocks=16)
    slot = redis_cluster.keyslot(h.names.value(b"x").encode())
    hot = _slot_keys(h, redis_cluster, slot, 4)
    data = [os.urandom(BLOCK) for _ in hot]
    assert h.put(hot, data)[1].ok
    sent = _gets_through_the_client(h, monkeypatch)
    src, dst = _move(redis_cluster, slot)
    redis_cluster.begin_migration(slot, src, dst)
    try:
        assert redis_cluster.move_keys(slot, src, dst, count=2) >= 1   # those moved answer ASK on src
        r, got = h.fetch(hot)
        assert r.ok and got == data, r
        assert not [c for c in sent if c[0] == "GET"], f"a redirected GET was read by the cluster client: {sent}"
        while redis_cluster.move_keys(slot, src, dst):
            pass
        redis_cluster.finish_migration(slot, dst)   # the store's slot table is stale: MOVED
        r, got = h.fetch(hot)
        assert r.ok and got == data, r
        assert not [c for c in sent if c[0] == "GET"], f"a redirected GET was read by the cluster client: {sent}"
        # the MOVED patched the client's slot table: the next fetch goes to dst at once
        client = h.store._r.conn.client()
        assert client.nodes_manager.get_node_from_slot(slot).port == dst.port
    finally:
        _give_back(redis_cluster, slot, src, dst)
    assert h.fetch(hot)[1] == data


def test_an_oversized_value_behind_an_ask_is_drained_not_read_whole(rig: Rig, redis_cluster_url: str,  # noqa: F811
                                                                   redis_cluster: RedisCluster,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """32 MiB where a 256-byte block's value belongs, in a slot that is moving (ASK): a corrupt miss, and the
    fetch allocates a few MiB at most (before: the 32 MiB, read whole by redis-py)."""
    h = rig.open(redis_cluster_url, batch_blocks=16)
    slot = redis_cluster.keyslot(h.names.value(b"y").encode())
    hot = _slot_keys(h, redis_cluster, slot, 3)
    data = [os.urandom(BLOCK) for _ in hot]
    assert h.put(hot, data)[1].ok
    src, dst = _move(redis_cluster, slot)
    name = h.names.value(hot[0])
    src.command("SET", name, b"\x00" * (32 << 20))
    redis_cluster.begin_migration(slot, src, dst)
    try:
        while redis_cluster.move_keys(slot, src, dst):   # every key of the slot on dst: src answers ASK for each
            pass
        sent = _gets_through_the_client(h, monkeypatch)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            r, got = h.fetch(hot)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.failed == {0: FETCH_CORRUPT}, r
        assert got[1:] == data[1:]
        assert peak < 4 << 20, f"fetching 256-byte blocks allocated {peak / (1 << 20):.1f} MiB (the 32 MiB value " \
                               f"read whole)"
        assert not [c for c in sent if c[0] == "GET"], sent
    finally:
        _give_back(redis_cluster, slot, src, dst)
        src.command("DEL", name)
