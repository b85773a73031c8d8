"""The process that tests/test_disk_crash.py kills with SIGKILL.

It stores, loads, waits, flushes and invalidates continuously (seeded RNG) on a
disk tier at DISK_PATH, and appends what it may claim to a journal:

    R <recovery seconds> <entries> <purged>   the manager is open
    S <key>          before store(key) is called
    I <key>          before invalidate(key) is called
    F <d,d,...>|<a,a,...>   after flush() returned True: the keys whose store had
                     completed before flush() was called (and not invalidated
                     since): durable; and the keys invalidated before flush() was
                     called (and not stored again since): gone for good
    BAD <key>        a load reported ok with wrong bytes (fatal)
    SHED <n> / SPILLFAIL <n>   a spill was shed / failed: the claims would not hold

Every line is one ``write()`` on an O_APPEND descriptor, so it survives the
process being killed; "F" lines are also fsync'd.  Keys are ASCII.

Run directly::

    python tests/crash_worker.py run DISK_PATH JOURNAL SEED DURABILITY [MAX_OPS]

or as a fork server (``serve``) that imports torch once and forks one worker
per command -- the crash test uses this to run 20+ rounds in seconds::

    -> run {"path": ..., "journal": ..., "seed": ..., "durability": ...}
    <- pid <n>
    -> wait <n>
    <- status <waitpid status>
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from typing import Optional

import torch
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager

ROW = 4096
ROWS = 16               # device rows 0..11 for stores, 12..15 for loads
KEYS = [f"ck{i:03d}".encode() for i in range(48)]
NAMESPACE = "crash|u8|tp0"
HOST_SLOTS = 24
DISK_SLOTS = 4 * len(KEYS)   # nothing is ever evicted by capacity
QUEUE = 4096                 # nothing is ever shed by backpressure


def content(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.shake_128(b"crash:" + key).digest(ROW)), dtype=torch.uint8)


def config(path: str, durability: str) -> TieredKVConfig:
    return TieredKVConfig(namespace=NAMESPACE, host_capacity_bytes=HOST_SLOTS * ROW, disk_path=path,
                          disk_capacity_bytes=DISK_SLOTS * ROW, durability=durability,
                          writer_queue_blocks=QUEUE, writer_batch_blocks=8, writer_batch_seconds=0.002)


class Journal:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, line: str, sync: bool = False) -> None:
        os.write(self.fd, (line + "\n").encode())
        if sync:
            os.fsync(self.fd)


def run(path: str, journal_path: str, seed: int, durability: str, max_ops: Optional[int] = None) -> int:
    rng = random.Random(seed)
    journal = Journal(journal_path)
    kv = torch.zeros((ROWS, ROW), dtype=torch.uint8)
    mgr = TierManager(config(path, durability), kv, registry=CollectorRegistry())
    rec = mgr.disk.recovery if mgr.disk is not None else None
    if rec is None:
        journal.write("NODISK", sync=True)
        return 2
    journal.write(f"R {rec.seconds:.6f} {rec.entries} {rec.purged}", sync=True)

    status: dict[bytes, object] = {}   # key -> its store Job (storing) | "stored" | "invalidated"
    store_jobs = {}                    # job -> key
    reg = mgr.metrics.registry

    def sample(name: str, **labels: str) -> float:
        return reg.get_sample_value(name, labels) or 0.0

    def absorb(completions) -> None:
        for c in completions:
            k = store_jobs.pop(c.job, None)
            if k is not None and c.ok and status.get(k) is c.job:
                status[k] = "stored"

    row = 0
    ops = 0
    while max_ops is None or ops < max_ops:
        ops += 1
        op = rng.random()
        key = rng.choice(KEYS)
        if op < 0.45:                                  # store
            row = (row + 1) % 12
            if not mgr.free_block(row):                # never: loads use other rows
                journal.write(f"ERR free_block {row}", sync=True)
                return 3
            kv[row].copy_(content(key))
            journal.write(f"S {key.decode()}")
            job = mgr.store(key, row)
            if job is not None:
                store_jobs[job] = key
                status[key] = job
        elif op < 0.60:                                # invalidate
            journal.write(f"I {key.decode()}")
            mgr.invalidate(key)
            status[key] = "invalidated"
        elif op < 0.72:                                # load (promotes from disk, touches recency)
            r = 12 + rng.randrange(4)
            kv[r].zero_()
            job = mgr.load(key, r)
            if job is not None:
                done = mgr.wait([job], timeout=30)
                absorb(done)
                for c in done:
                    if c.job is job and c.ok and not torch.equal(kv[r], content(key)):
                        journal.write(f"BAD {key.decode()}", sync=True)
                        return 4
        elif op < 0.90:                                # poll / wait a little
            absorb(mgr.poll() if rng.random() < 0.5 else mgr.wait(timeout=0.002))
        else:                                          # flush
            absorb(mgr.poll())
            durable = sorted(k.decode() for k, s in status.items() if s == "stored")
            gone = sorted(k.decode() for k, s in status.items() if s == "invalidated")
            if mgr.flush(timeout=30):
                shed = sample("tiered_kv_jobs_total", kind="spill", outcome="shed")
                failed = sample("tiered_kv_jobs_total", kind="spill", outcome="failed")
                if shed:
                    journal.write(f"SHED {shed:.0f}", sync=True)
                if failed:
                    journal.write(f"SPILLFAIL {failed:.0f}", sync=True)
                journal.write(f"F {','.join(durable)}|{','.join(gone)}", sync=True)
    mgr.close()
    journal.write("DONE", sync=True)
    return 0


def serve() -> int:
    """Fork server: imports done once, one forked worker per "run" command."""
    out = sys.stdout
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "run":
            a = json.loads(arg)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    devnull = os.open(os.devnull, os.O_RDWR)
                    os.dup2(devnull, 0)
                    os.dup2(devnull, 1)
                    code = run(a["path"], a["journal"], int(a["seed"]), a["durability"], a.get("max_ops"))
                except BaseException as exc:  # pragma: no cover - reported through the journal
                    try:
                        Journal(a["journal"]).write(f"EXC {exc!r}", sync=True)
                    finally:
                        code = 5
                finally:
                    os._exit(code)
            print(f"pid {pid}", file=out, flush=True)
        elif cmd == "wait":
            _, st = os.waitpid(int(arg), 0)
            print(f"status {st}", file=out, flush=True)
        elif cmd == "quit":
            break
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        return serve()
    if argv[:1] == ["run"] and len(argv) in (5, 6):
        return run(argv[1], argv[2], int(argv[3]), argv[4], int(argv[5]) if len(argv) == 6 else None)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
