"""A lone disk read through ``Readers._read`` against the batch path ``_read_many([op])``, in one process.

A disk reader that finds a single read queued runs ``_read``; a batch of reads goes through
``_read_many`` (one lookup transaction, file order, runs of slots).  This measures what the batch
machinery would cost a lone read: page-cache-warm reads of the same slots, both paths called
alternately on this thread (no reader threads), microseconds per read (median of the repeats).

    python benchmarks/ab_lone_read.py --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tiered_kv.disk import DiskOptions, DiskStore, FlushDone
from tiered_kv.disk.records import Promote as _Promote
from tiered_kv.movers import CompletionQueue


def _filled_store(path: Path, block: int, n: int) -> tuple[DiskStore, list[tuple[bytes, uuid.UUID]]]:
    q = CompletionQueue()
    s = DiskStore(DiskOptions(path=path, namespace="ab|lone-read", block_bytes=block, capacity_bytes=2 * n * block,
                              durability="none", slots=2 * n, num_readers=0), q)
    keys = []
    payload = bytearray(block)
    for i in range(n):
        key, tok = b"k%06d" % i, uuid.uuid4()
        payload[:8] = i.to_bytes(8, "little")
        while not s.submit_spill(tok, key, memoryview(bytes(payload))):
            time.sleep(0.001)   # writer queue full: let it drain (setup, not measured)
        keys.append((key, tok))
    flush = uuid.uuid4()
    s.submit_flush(flush)
    while True:
        item = q.get(30)
        if item is None:
            raise SystemExit("the disk writer did not answer within 30 s")
        if isinstance(item, FlushDone) and item.token == flush:
            if not item.ok:
                raise SystemExit(f"flush failed: {item.error}")
            return s, keys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20, help="reads of every key per repeat and path")
    ap.add_argument("--blocks", default="4096,262144", help="block sizes in bytes, comma-separated")
    args = ap.parse_args()
    print(f"us per warm lone read, median of {args.repeats} repeats of {args.keys} keys x {args.rounds}")
    for block in (int(b) for b in args.blocks.split(",")):
        with tempfile.TemporaryDirectory(prefix="tkv-lone-") as tmp:
            s, keys = _filled_store(Path(tmp) / "d", block, args.keys)
            dst = memoryview(bytearray(block))
            us: dict[str, list[float]] = {"_read": [], "_read_many([op])": []}
            try:
                for rep in range(args.repeats):
                    for name in (("_read", "_read_many([op])") if rep % 2 == 0 else ("_read_many([op])", "_read")):
                        ops = [_Promote(uuid.uuid4(), k, t, dst) for k, t in keys] * args.rounds
                        t0 = time.perf_counter()
                        for op in ops:
                            r = s.readers._read(op) if name == "_read" else next(iter(s.readers._read_many([op])))[1]
                            if not r.ok:
                                raise SystemExit(f"{name}: {op.key!r}: {r.error}")
                        us[name].append((time.perf_counter() - t0) / len(ops) * 1e6)
            finally:
                s.close()
        a, b = statistics.median(us["_read"]), statistics.median(us["_read_many([op])"])
        print(f"  {block:>8} B: _read {a:6.1f}  _read_many([op]) {b:6.1f}  (+{b - a:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
