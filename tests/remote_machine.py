"""One "serving machine" for tests/test_remote_two_machines.py: a TierManager with a remote tier in a
process of its own, driven line by line over stdin/stdout.

    python tests/remote_machine.py URL NAMESPACE

Commands (one per line; each answered by one line ``ok ...`` or ``error ...``):
``store K1,K2`` (store and wait for the copies), ``flush``, ``fetch K1,K2`` (look up, wait for the
server's answers, answer how many leading keys are held), ``same K1,K2`` (load them and compare
the bytes), ``invalidate K``, ``hold`` (the next remote write is stopped on its I/O thread before it
is sent: ``held`` is printed then), ``release``, ``metric NAME label=value ...``, ``quit``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prometheus_client import CollectorRegistry  # noqa: E402

from disk_helpers import fill, make_kv, metric_sum, row_is  # noqa: E402
from tiered_kv import TieredKVConfig, TierManager  # noqa: E402
from tiered_kv.jobs import JobKind  # noqa: E402

ROW = 4096
DEADLINE_S = 20.0
_out = threading.Lock()


def say(line: str) -> None:
    with _out:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> int:
    url, ns = sys.argv[1], sys.argv[2]
    cfg = TieredKVConfig(namespace=ns, host_capacity_bytes=64 * ROW, remote_url=url, remote_miss_ttl_seconds=0.0)
    mgr = TierManager(cfg, make_kv(32, ROW, seed=11), registry=CollectorRegistry())
    kv = mgr._device_blocks
    gate = threading.Event()
    gate.set()
    armed = threading.Event()

    def hook(where: str) -> None:
        if where == "write" and armed.is_set():
            armed.clear()
            gate.clear()
            say("held")
            gate.wait(DEADLINE_S)

    mgr._core.remote.store.set_test_hook(hook)
    say("ready")
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        ks = [k.encode() for k in rest.split(",") if k]
        try:
            if cmd == "store":
                rows = list(range(len(ks)))
                for k, r in zip(ks, rows):
                    fill(kv, r, k)
                job = mgr.store_many(ks, rows)
                mgr.wait([job] if job is not None else [])
                for r in rows:
                    mgr.free_block(r)
                say("ok")
            elif cmd == "flush":
                say(f"ok {mgr.flush(timeout=DEADLINE_S)}")
            elif cmd == "fetch":
                mgr.lookup(ks)
                deadline = time.monotonic() + DEADLINE_S
                core = mgr._core
                while core.n_in_flight[JobKind.FETCH] or core.remote.want_token is not None:
                    if time.monotonic() > deadline:
                        raise TimeoutError("fetch")
                    mgr.poll()
                    time.sleep(0.002)
                say(f"ok {mgr._core.index.ready_run(ks)}")
            elif cmd == "same":
                rows = list(range(32 - len(ks), 32))
                job = mgr.load_many(ks, rows)
                done = mgr.wait([job]) if job is not None else []
                say(f"ok {job is not None and all(c.ok for c in done) and all(row_is(kv, r, k) for r, k in zip(rows, ks))}")
            elif cmd == "invalidate":
                for k in ks:
                    mgr.invalidate(k)
                mgr.poll()
                say("ok")
            elif cmd == "hold":
                armed.set()
                say("ok")
            elif cmd == "release":
                gate.set()
                say("ok")
            elif cmd == "metric":
                name, *labels = rest.split()
                say(f"ok {metric_sum(mgr, name, **dict(lab.split('=', 1) for lab in labels))}")
            elif cmd == "quit":
                break
            else:
                say(f"error unknown command {cmd!r}")
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            say("error " + traceback.format_exc().replace("\n", " | "))
    gate.set()
    mgr.close()
    say("bye")
    return 0


if __name__ == "__main__":
    sys.exit(main())
