"""Two serving machines sharing one remote tier: two independent managers in two processes, against a
real standalone redis-server and a real 3-master cluster.

Machine A is ``tests/remote_machine.py`` in a child process, driven over its stdin; machine B is a
manager in this process.  Nothing is ordered by sleeping: A's write is held on its I/O thread by a
test hook until B's invalidate has reached the server.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from disk_helpers import make_kv, metric_sum, row_is
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.jobs import JobKind

MACHINE = Path(__file__).with_name("remote_machine.py")
ROW = 4096
NS = "two-machines|u8|tp0"
DEADLINE_S = 30.0


class Machine:
    """Machine A: a child process answering one line per command."""

    def __init__(self, url: str, namespace: str = NS) -> None:
        self.proc = subprocess.Popen([sys.executable, str(MACHINE), url, namespace], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self.line() == "ready"

    def line(self) -> str:
        assert self.proc.stdout is not None
        out = self.proc.stdout.readline().strip()
        if not out:
            raise AssertionError(f"machine A exited (rc={self.proc.poll()})")
        return out

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def __call__(self, cmd: str) -> str:
        self.send(cmd)
        out = self.line()
        if not out.startswith("ok"):
            raise AssertionError(f"machine A: {cmd!r} -> {out}")
        return out[3:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            try:
                self.proc.wait(DEADLINE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module", params=["standalone", "cluster"])
def server(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("redis_server" if request.param == "standalone" else "redis_cluster")


@pytest.fixture(scope="module")
def machine_a(server: Any) -> Iterator[Machine]:
    """Machine A, one process per server for the module (it costs a Python start and a torch import)."""
    m = Machine(server.url)
    yield m
    m.close()


@pytest.fixture
def url(server: Any) -> str:
    server.flush()
    return str(server.url)


@pytest.fixture
def machine_b() -> Iterator[Callable[..., TierManager]]:
    made: list[TierManager] = []

    def make(url: str, namespace: str = NS) -> TierManager:
        cfg = TieredKVConfig(namespace=namespace, host_capacity_bytes=64 * ROW, remote_url=url,
                             remote_miss_ttl_seconds=0.0)
        m = TierManager(cfg, make_kv(32, ROW, seed=22 + len(made)), registry=CollectorRegistry())
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def keys(n: int, prefix: str) -> list[str]:
    return [f"{prefix}{i:03d}" for i in range(n)]


def fetch(b: TierManager, ks: list[bytes]) -> int:
    b.lookup(ks)
    deadline = time.monotonic() + DEADLINE_S
    core = b._core
    while core.n_in_flight[JobKind.FETCH] or core.remote.want_token is not None:
        assert time.monotonic() < deadline, "the fetch did not land"
        b.poll()
        time.sleep(0.002)   # not ordering anything: the server answers on its own time
    return core.index.ready_run(ks)


def same(b: TierManager, ks: list[bytes]) -> bool:
    rows = list(range(len(ks)))
    job = b.load_many(ks, rows)
    if job is None:
        return False
    done = b.wait([job])
    return all(c.ok for c in done) and all(row_is(b._device_blocks, r, k) for r, k in zip(rows, ks))


def test_b_gets_hits_for_the_prefixes_a_stored(url: str, machine_a: Machine, machine_b: Any) -> None:
    a, b = machine_a, machine_b(url)
    put_ok = float(a("metric tiered_kv_jobs_total kind=put outcome=ok"))
    ks = keys(12, "prefix")   # in a cluster, spread over the three masters by their hash tags
    a("store " + ",".join(ks))
    assert a("flush") == "True"
    kb = [k.encode() for k in ks]
    assert fetch(b, kb) == 12
    assert b.lookup(kb) == 12   # the lookup that finds them in B's host tier counts them as remote hits, once
    assert same(b, kb)
    assert metric_sum(b, "tiered_kv_lookup_hits_total", tier="remote") == 12
    assert metric_sum(b, "tiered_kv_lookup_hits_total", tier="host") == 0
    assert float(a("metric tiered_kv_jobs_total kind=put outcome=ok")) == put_ok + 12


def test_an_invalidate_on_b_stops_the_write_a_has_in_flight(url: str, machine_a: Machine, machine_b: Any) -> None:
    a, b = machine_a, machine_b(url)
    refused = float(a("metric tiered_kv_remote_refused_writes_total reason=tomb"))
    put_ok = float(a("metric tiered_kv_jobs_total kind=put outcome=ok"))
    k = "in-flight"
    a("hold")
    a.send(f"store {k}")   # A's store lands on its host; its remote write is taken, then held
    assert {a.line(), a.line()} == {"held", "ok"}
    b.invalidate(k.encode())   # reaches the server before A's write
    assert b.flush(timeout=DEADLINE_S)
    a("release")
    assert a("flush") == "True"                      # refused by a tombstone: not a fault
    assert float(a("metric tiered_kv_remote_refused_writes_total reason=tomb")) == refused + 1
    assert float(a("metric tiered_kv_jobs_total kind=put outcome=ok")) == put_ok
    assert fetch(b, [k.encode()]) == 0
    assert a("fetch " + k) == "1"                    # A's own host copy is A's: the remote is what B shares
    # a key A stores after the tombstone expired is shared again (covered by the store's own tests);
    # another key is not affected by the tombstone
    a("store other")
    assert a("flush") == "True"
    assert fetch(b, [b"other"]) == 1


def test_an_invalidate_on_b_removes_what_a_already_wrote(url: str, machine_a: Machine, machine_b: Any) -> None:
    a, b = machine_a, machine_b(url)
    ks = keys(3, "landed")
    a("store " + ",".join(ks))
    assert a("flush") == "True"
    b.invalidate(ks[1].encode())
    assert b.flush(timeout=DEADLINE_S)
    c = machine_b(url)   # a third machine, with nothing of its own
    assert fetch(c, [ks[0].encode()]) == 1
    assert fetch(c, [ks[1].encode()]) == 0
    assert fetch(c, [ks[2].encode()]) == 1
    assert same(c, [ks[2].encode()])


def test_machines_of_another_namespace_never_share(url: str, machine_a: Machine, machine_b: Any) -> None:
    a, b = machine_a, machine_b(url, "model-b|u8")
    ks = keys(4, "ns")
    a("store " + ",".join(ks))
    assert a("flush") == "True"
    assert fetch(b, [k.encode() for k in ks]) == 0
