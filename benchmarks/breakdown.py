"""Where the time of six missed targets goes: one load from disk at a time, the engine step, a
step's copies batched, ``store()``'s p99 while copies run, the native CPU mover's launch in the
copy step, and the copy step's calls.

    .venv/bin/python benchmarks/breakdown.py promote [--block-kib 2048] [--loads 32]
    .venv/bin/python benchmarks/breakdown.py step [--steps 600]
    .venv/bin/python benchmarks/breakdown.py batched [--block-kib 64] [--pass-mib 128]
    .venv/bin/python benchmarks/breakdown.py first-store [--steps 400] [--block-kib 2048] [--rows 512] [--torch-threads N]
    .venv/bin/python benchmarks/breakdown.py launch [--steps 300] [--block-kib 64]
    .venv/bin/python benchmarks/breakdown.py copy-step [--steps 500]

``promote``: the parts of one ``load(key, row)`` + ``wait([job])`` of a key only on disk (page
cache warm), each a median over 32 loads, timed by wrapping the methods that do them (the reader's
index lookup and checksum, the owner's page-cache read, the owner's apply, the mover's copy).  The
default reads such a block on the waiting owner's thread (``disk_read_cached_in_wait``); with it off
the disk readers read it: their parts are timed with the disk I/O on threads of this process
(``disk_io="thread"``), while in the disk I/O process they run in the child, so only the owner's
parts and the whole load are printed for it.
Beside them, the same three
operations done by hand on one thread -- ``pread`` into one hot buffer or into a different
(cache-cold) slot each time, xxh3 over the block, ``copy_`` into a row -- which is what the
``tiered-kv bench`` baseline (``pread`` + ``copy_`` into one buffer) pays, less the checksum.

``step``: the engine thread's CPU time per call of ``tiered-kv bench``'s engine step (32
``lookup`` x 16 keys, ``load_many(64)``, ``store_many(64)``, ``poll()``), with the disk tier on and
off, beside the unsafe dict original's whole step.

``batched``: ``tiered-kv bench``'s batched host passes (``store_many`` of 64 blocks then ``poll()``,
step after step, then ``wait()``; the loads likewise), split into the time in the engine's calls
and in the final ``wait()``, beside one ``copy_`` of the pass's bytes; 128 MiB per pass, 4 passes
(the first a warm-up).

``first-store``: ``tiered-kv bench``'s ``store()`` latency loop (16 ``store()`` calls of 2 MiB rows,
``poll()``, 10 ms of sleep; 512 rows, host tier = rows, so every store evicts), the wall time of each
step's first ``store()`` and of the others, and of ``poll()``, medians; four managers taking turns
of 25 steps (after 5 more, not recorded): with the native CPU mover as it is, with its copy made on
the engine thread inside ``poll()`` (the launch replaced by a synchronous run of the same compiled
copy), with no copy at all (a launch that answers at once), and with the Python copy threads.  The
bench's p99 over all calls is one of the first calls (one in 16), so this shows what that call pays
for.  ``--torch-threads 1``: the same with the copies on one core.

``launch``: the engine thread's CPU time in the native CPU mover's launch (``rowcopy.compiled().launch``:
the argument lists converted to TorchScript values, the inter-op thread woken), the call ``poll()`` makes
once per step of ``tiered-kv bench``'s copy step: a 64-row launch (64 stores and 64 loads, rows and slots
in order) after a 1-row copy, a 1-row launch after that 64-row copy, a 1-row launch after a 1-row
copy, and a 1-row launch after this thread filled 8 MiB of memory (no copy: whether any sweep of the
caches, not the copy, makes the launch slow), each followed by its ``wait()`` and 2 ms of sleep, medians
over ``--steps`` rounds; beside them a fixed Python loop (500 dict lookups) alone and while a 64-row copy
is in flight.

``copy-step``: the engine thread's CPU time per call of ``tiered-kv bench``'s copy step (``load_many(64)``,
``store_many(64)`` of 64 KiB rows, ``poll()``; the default CPU mover), with the engine sleeping 2 ms between
steps and busy in Python 2 ms, and the parts of ``poll()``: the mover's launch of the step's copies, the
harvest of the copies done, the reports applied, and the end of the step (evictions ahead, gauges).

Diagnostics, not figures of record: wrapping methods adds a little to each part, and the figures
move with the machine's load.  Nothing here is imported by the library or the tests.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash
from prometheus_client import CollectorRegistry

from tiered_kv import TieredKVConfig, TierManager


def _wrap(obj: Any, name: str, tag: str, marks: list[tuple[str, float]]) -> None:
    f = getattr(obj, name)
    pc = time.perf_counter

    def w(*a: Any, **k: Any) -> Any:
        marks.append((tag + ">", pc()))
        try:
            return f(*a, **k)
        finally:
            marks.append((tag + "<", pc()))
    setattr(obj, name, w)


def promote(block: int, n: int = 32) -> None:
    """The parts need the disk I/O on threads of this process (``disk_io="thread"``), where the wrapped
    reader methods run; the default, the disk I/O process, is timed whole beside it."""
    from tiered_kv.core import tiers
    from tiered_kv.disk import cached, readers

    marks: list[tuple[str, float]] = []
    _wrap(readers.Readers, "_lookup", "lookup", marks)
    _wrap(readers.Readers, "_verify", "verify", marks)
    _wrap(cached.CachedReads, "read", "cached", marks)
    _wrap(tiers.TierCore, "apply", "apply", marks)
    dev = torch.randint(0, 255, (n, block), dtype=torch.uint8)
    orig = dev.clone()
    d = Path(tempfile.mkdtemp(prefix="tkv-breakdown-"))
    try:
        for disk_io, here in (("process", True), ("thread", False), ("process", False)):
            _promote_parts(block, n, dev, orig, d / f"{disk_io}-{here}", disk_io, here, marks)
        _promote_by_hand(block, n, orig, d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _promote_parts(block: int, n: int, dev: torch.Tensor, orig: torch.Tensor, d: Path, disk_io: str, here: bool,
                   marks: list[tuple[str, float]]) -> None:
    # a host tier smaller than the keys stored: the first ones are only on disk when they are loaded
    cfg = TieredKVConfig(namespace="breakdown", host_capacity_bytes=max(1, min(4, n // 2)) * block, disk_path=str(d / "kv"),
                         disk_capacity_bytes=4 * n * block, disk_io=disk_io,  # type: ignore[arg-type]
                         disk_read_cached_in_wait=here)
    dev.copy_(orig)
    mgr = TierManager(cfg, dev, registry=CollectorRegistry())
    _wrap(mgr._mover, "help_one", "copy", marks)
    keys = [os.urandom(16) for _ in range(n)]
    for i, k in enumerate(keys):   # each spilled before the next store: none is shed for a full host tier
        mgr.store(k, i)
        mgr.wait()
        assert mgr.flush()
    dev.zero_()
    parts: dict[str, list[float]] = collections.defaultdict(list)
    pc = time.perf_counter
    for i, k in enumerate(keys):
        if mgr.host_bytes(k) is not None:
            continue
        marks.clear()
        t0 = pc()
        job = mgr.load(k, i)
        t1 = pc()
        got = mgr.wait([job])
        t2 = pc()
        assert got[-1].ok and torch.equal(dev[i], orig[i])
        m = dict((tag, t) for tag, t in marks if tag in ("lookup>", "lookup<", "verify>", "verify<", "cached>",
                                                         "cached<"))
        copies = [(a, b) for (ta, a), (tb, b) in zip(marks, marks[1:]) if ta == "copy>" and tb == "copy<" and b - a > 1e-5]
        applies = [(a, b) for (ta, a), (tb, b) in zip(marks, marks[1:]) if ta == "apply>" and tb == "apply<"]
        parts["load() call"].append(t1 - t0)
        if here:   # read on this thread: the page-cache read and its check, and what came before it
            parts["until the owner reads it"].append(m["cached>"] - t1)
            parts["pread + check on the owner"].append(m["cached<"] - m["cached>"])
        elif disk_io == "thread":   # in the I/O process the reader's parts run where they cannot be wrapped
            parts["until the reader looks it up"].append(m["lookup>"] - t1)
            parts["LMDB lookup"].append(m["lookup<"] - m["lookup>"])
            parts["pread into the host slot"].append(m["verify>"] - m["lookup<"])
            parts["xxh3 over the block"].append(m["verify<"] - m["verify>"])
        parts["slot -> row copy (owner thread)"].append(sum(b - a for a, b in copies))
        parts["owner's applies"].append(sum(b - a for a, b in applies))
        parts["whole load + wait"].append(t2 - t0)
    mgr.close()
    print(f"one load from disk at a time, disk_io={disk_io}, read by the {'owner' if here else 'disk readers'}, "
          f"{block >> 10} KiB blocks, page cache warm (median of {len(parts['load() call'])}):")
    for k, v in parts.items():
        print(f"  {k:34s} {statistics.median(v) * 1e6:8.0f} us")


def _promote_by_hand(block: int, n: int, orig: torch.Tensor, d: Path) -> None:
    """The same operations by hand, on one thread."""
    pc = time.perf_counter
    p = d / "raw"
    p.write_bytes(orig.numpy().tobytes())
    fd = os.open(p, os.O_RDONLY)
    hot = torch.empty(block, dtype=torch.uint8)
    slots = torch.ones(n, block, dtype=torch.uint8)
    rows = torch.ones(n, block, dtype=torch.uint8)

    def by_hand(cold: bool) -> dict[str, float]:
        xs: dict[str, list[float]] = collections.defaultdict(list)
        with _one_thread():
            for i in range(n):
                buf = slots[i] if cold else hot
                mv = memoryview(buf.numpy())
                a = pc()
                os.preadv(fd, [mv], i * block)
                b = pc()
                xxhash.xxh3_64(mv).intdigest()
                c = pc()
                rows[i].copy_(buf)
                e = pc()
                xs["pread"].append(b - a)
                xs["xxh3"].append(c - b)
                xs["copy_"].append(e - c)
        return {k: statistics.median(v) * 1e6 for k, v in xs.items()}
    by_hand(False)
    for cold in (False, True):
        r = by_hand(cold)
        print(f"  by hand, {'a different slot each time' if cold else 'one hot buffer':26s} "
              + "  ".join(f"{k} {v:6.0f} us" for k, v in r.items()))
    os.close(fd)


class _one_thread:
    def __enter__(self) -> None:
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: Any) -> None:
        torch.set_num_threads(self.n)


def step(steps: int) -> None:
    import tiered_kv.bench.step as st

    acc: dict[str, int] = collections.defaultdict(int)
    polls = [0]   # the step's last call is its one poll(): the parts of the warm-up steps are dropped after it
    tt = time.thread_time_ns
    originals = {n: getattr(TierManager, n) for n in ("lookup", "load_many", "store_many", "poll")}
    warm = 100

    def wrap(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def w(self: Any, *a: Any, **k: Any) -> Any:
            c = tt()
            try:
                return f(self, *a, **k)
            finally:
                acc[name] += tt() - c
                if name == "poll":
                    polls[0] += 1
                    if polls[0] == warm:   # the warm-up is over: the parts cover the timed steps, as the whole
                        acc.clear()
        return w
    for name, f in originals.items():
        setattr(TierManager, name, wrap(name, f))
    for disk in (True, False):
        acc.clear()
        polls[0] = 0
        top = Path(tempfile.mkdtemp(prefix="tkv-breakdown-"))
        if not disk:
            st.DISK_SLOTS = 0
        try:
            r = st._run("tkv", 0, steps, warm, 0.002, top / "disk" if disk else None)
        finally:
            shutil.rmtree(top, ignore_errors=True)
        per = {k: v / steps / 1e3 for k, v in acc.items()}
        print(f"engine step, {'host + disk' if disk else 'host only  '}: CPU {r['cpu_us']['mean']:6.0f} us per step; "
              + ", ".join(f"{k} {v:.0f}" for k, v in per.items()) + f" us; garbage collector {r['gc']['us_per_step']:.0f}")
    r = st._run("dict", 0, steps, warm, 0.002, None)
    print(f"engine step, dict original: CPU {r['cpu_us']['mean']:6.0f} us per step; garbage collector "
          f"{r['gc']['us_per_step']:.0f}")


def batched(block: int, pass_bytes: int = 128 << 20) -> None:
    n = max(pass_bytes // block // 64 * 64, 64)   # whole calls of 64 blocks
    kv = torch.empty((2 * n, block), dtype=torch.uint8).fill_(1)
    cfg = TieredKVConfig(namespace="breakdown/batched", host_capacity_bytes=n * block, host_evict_ahead_blocks=0)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    big = torch.empty(n * block, dtype=torch.uint8)
    pc = time.perf_counter
    try:
        for p in range(4):
            keys = [os.urandom(16) for _ in range(n)]
            out = []
            for rows0, call in ((0, mgr.store_many), (n, mgr.load_many)):
                calls = polls = 0.0
                t0 = pc()
                for i in range(0, n, 64):
                    a = pc()
                    call(keys[i:i + 64], list(range(rows0 + i, rows0 + i + 64)))
                    b = pc()
                    mgr.poll()
                    calls, polls = calls + b - a, polls + pc() - b
                t1 = pc()
                mgr.wait()
                out.append(f"calls {calls * 1e3:5.1f} ms, polls {polls * 1e3:4.1f}, wait {(pc() - t1) * 1e3:5.1f}, "
                           f"total {(pc() - t0) * 1e3:5.1f}")
            a = pc()
            big.copy_(kv[:n].view(-1))
            print(f"pass {p}{' (warm-up)' if p == 0 else ''}: store {out[0]} | load {out[1]} | one large copy_ "
                  f"{(pc() - a) * 1e3:.1f} ms")
    finally:
        mgr.close()


def first_store(steps: int, row: int = 2 << 20, n: int = 512) -> None:
    from tiered_kv.movers import native as native_mod
    from tiered_kv.movers.rowcopy import compiled

    cu = compiled()

    def on_engine(*a: Any) -> Any:    # the same copy, on the calling thread, its outcome a finished future
        fut: Any = torch.futures.Future()
        with torch.jit.optimized_execution(False):
            fut.set_result(cu.copy_groups(a[0].wait(), *a[1:]))   # the planes the launcher holds, then the rest
        return fut

    def no_copy(*a: Any) -> Any:
        fut: Any = torch.futures.Future()
        fut.set_result(0)
        return fut

    per_round = 25
    kv = torch.empty((n, row), dtype=torch.uint8).fill_(1)
    real_init = native_mod.NativeMover.__init__
    managers: dict[str, TierManager] = {}
    for label, mover, launch in (("native mover", "native", None), ("copy on the engine thread", "native", on_engine),
                                 ("no copy", "native", no_copy), ("Python copy threads", "threads", None)):
        if launch is not None:
            def init(self: Any, planes: Any, completions: Any, batch_max: int = 1, launch_fn: Any = None,
                     run_fn: Any = None, _launch: Any = launch) -> None:
                real_init(self, planes, completions, batch_max, launch_fn=_launch, run_fn=cu.copy_groups)
            native_mod.NativeMover.__init__ = init   # type: ignore[method-assign]
        try:
            cfg = TieredKVConfig(namespace="breakdown/first-store", host_capacity_bytes=n * row, cpu_mover=mover)
            managers[label] = TierManager(cfg, kv, registry=CollectorRegistry())
        finally:
            native_mod.NativeMover.__init__ = real_init   # type: ignore[method-assign]
    pc = time.perf_counter_ns
    samples: dict[str, tuple[list[int], list[int], list[int]]] = {k: ([], [], []) for k in managers}
    i = 0
    try:
        # the managers take turns, a round of steps each (the first 5 of a turn not recorded), so that all
        # four meet the same moments of the machine
        for rnd in range(-(-steps // per_round)):
            for label, mgr in (managers.items() if rnd % 2 == 0 else reversed(managers.items())):
                first, rest, polls = samples[label]
                for s in range(per_round + 5):
                    keep = s >= 5
                    for j in range(16):
                        t = pc()
                        mgr.store(b"k%d" % i, i % n)
                        if keep:
                            (first if j == 0 else rest).append(pc() - t)
                        i += 1
                    t = pc()
                    mgr.poll()
                    if keep:
                        polls.append(pc() - t)
                    time.sleep(0.010)
                mgr.wait()
    finally:
        for mgr in managers.values():
            mgr.close()
    med = statistics.median
    for label, (first, rest, polls) in samples.items():
        print(f"{label:26s} ({type(managers[label]._mover).__name__}): first store() {med(first) / 1e3:5.1f} us, "
              f"the others {med(rest) / 1e3:4.1f} us, poll() {med(polls) / 1e3:5.0f} us")


def launch(rounds: int, row: int) -> None:
    from tiered_kv.movers.rowcopy import compiled, list_args
    from tiered_kv.movers.thread import STAGE_BYTES

    cu = compiled()
    width = max(1, row // 8)   # int64 elements per row, as the native mover views rows
    dev = torch.ones((256, width), dtype=torch.int64)
    host = torch.ones((512, width), dtype=torch.int64)
    held = cu.hold_planes([dev], [host])
    held.wait()
    stage = [max(1, STAGE_BYTES // (width * 8))]   # the staging rows the native mover passes

    def args(n: int) -> tuple[Any, ...]:   # n device rows into slots 100.., and n slots 300.. into rows 64..
        stores = list_args(list(range(100, 100 + n)), list(range(n)))
        loads = list_args(list(range(64, 64 + n)), list(range(300, 300 + n)))
        return ([True, False], *zip(stores, loads), stage)

    big, small = args(64), args(1)
    table = dict.fromkeys(range(100_000), 1)
    keys = list(range(0, 100_000, 37))[:500]

    def walk() -> int:
        total = 0
        for k in keys:
            total += table[k]
        return total

    tt = time.thread_time_ns
    got: dict[str, list[int]] = {"64-row launch after a 1-row copy": [], "1-row launch after a 64-row copy": [],
                                 "1-row launch after a 1-row copy": [],
                                 "1-row launch after an 8 MiB fill": [], "walk alone": [],
                                 "walk beside a copy": []}
    junk = torch.zeros(8 << 20, dtype=torch.uint8)   # no copy at all: this thread sweeps 8 MiB of memory
    # each round: the walks (the second beside a 64-row copy), then launches whose copy before them is known
    order = (("1-row launch after a 64-row copy", small), ("", small), ("1-row launch after a 1-row copy", small),
             ("64-row launch after a 1-row copy", big))
    for _ in range(rounds):
        walk()
        t = tt()
        walk()
        got["walk alone"].append(tt() - t)
        fut = cu.launch(held, *big)
        t = tt()
        walk()
        got["walk beside a copy"].append(tt() - t)
        fut.wait()
        time.sleep(0.002)
        for label, a in order:
            t = tt()
            fut = cu.launch(held, *a)
            spent = tt() - t
            fut.wait()
            time.sleep(0.002)
            if label:
                got[label].append(spent)
        junk.fill_(len(got["walk alone"]) & 255)
        time.sleep(0.002)
        t = tt()
        fut = cu.launch(held, *small)
        got["1-row launch after an 8 MiB fill"].append(tt() - t)
        fut.wait()
        time.sleep(0.002)
    med = statistics.median
    print(f"native mover launch, {row // 1024} KiB rows, engine-thread CPU, median of {rounds} rounds")
    for label, xs in got.items():
        print(f"  {label:34s} {med(xs) / 1e3:6.1f} us")


def copy_step(steps: int) -> None:
    import tiered_kv.bench.step as st
    from tiered_kv.core import tiers
    from tiered_kv.movers import native

    acc: dict[str, int] = collections.defaultdict(int)
    calls: collections.Counter[str] = collections.Counter()
    tt = time.thread_time_ns
    parts = [(TierManager, "load_many", "load_many"), (TierManager, "store_many", "store_many"),
             (TierManager, "poll", "poll"), (native.NativeMover, "_start", "  launch of the copies"),
             (native.NativeMover, "harvest", "  harvest"), (tiers.TierCore, "apply_arrived", "  reports applied"),
             (tiers.TierCore, "end_step", "  end of the step"), (tiers.TierCore, "refresh_gauges", "    gauges")]
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in parts]

    def wrap(tag: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def w(*a: Any, **k: Any) -> Any:
            c = tt()
            try:
                return f(*a, **k)
            finally:
                acc[tag] += tt() - c
                calls[tag] += 1
        return w
    try:
        for cls, name, tag in parts:
            setattr(cls, name, wrap(tag, getattr(cls, name)))
        for busy in (False, True):
            acc.clear()
            calls.clear()
            r = st._copy_run("batched", 0, steps, 0, 0.002, busy)
            n = calls["poll"]
            print(f"copy step, engine {'busy in Python' if busy else 'sleeping'} 2 ms between steps: CPU "
                  f"{r['cpu_us']['mean']:6.0f} us per step (mean of {steps}); per step:")
            for _, _, tag in parts:
                print(f"  {tag:28s} {acc[tag] / n / 1e3:7.1f} us  ({calls[tag] / n:.2f} calls)")
    finally:
        for cls, name, f in originals:
            setattr(cls, name, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["promote", "step", "batched", "first-store", "launch", "copy-step"])
    ap.add_argument("--block-kib", type=int, default=None,
                    help="default: 2048 (promote, first-store), 64 (batched, launch)")
    ap.add_argument("--rows", type=int, default=512, help="first-store: device rows (and host slots)")
    ap.add_argument("--steps", type=int, default=None,
                    help="default: 600 (step), 400 (first-store), 300 (launch), 500 (copy-step)")
    ap.add_argument("--loads", type=int, default=32, help="promote: blocks loaded one at a time (at least 2)")
    ap.add_argument("--pass-mib", type=int, default=128, help="batched: MiB per pass")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch.set_num_threads(N) first (the copies' intra-op threads)")
    a = ap.parse_args()
    if a.loads < 2:
        ap.error(f"--loads must be at least 2 (a smaller host tier holds the rest), got {a.loads}")
    gc.collect()
    gc.freeze()   # what was alive after the imports joins the permanent generation, as tiered-kv bench does
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    if a.what == "promote":
        promote((a.block_kib or 2048) << 10, a.loads)
    elif a.what == "batched":
        batched((a.block_kib or 64) << 10, a.pass_mib << 20)
    elif a.what == "first-store":
        first_store(a.steps or 400, (a.block_kib or 2048) << 10, a.rows)
    elif a.what == "launch":
        launch(a.steps or 300, (a.block_kib or 64) << 10)
    elif a.what == "copy-step":
        copy_step(a.steps or 500)
    else:
        step(a.steps or 600)


if __name__ == "__main__":
    main()
