"""``benchmarks/breakdown.py`` and ``benchmarks/cached_reads_ab.py`` run: each of their parts, on tiny
sizes, in a child process.

The script is not imported by the library or by the bench command, so nothing else would notice when
a change to the code it wraps breaks it (its ``promote`` part once failed with a ``KeyError`` once the
disk I/O moved into its own process, where the reader methods it wraps do not run).  The figures are
not checked: only that each part runs to its end and prints every line it promises.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "breakdown.py"


def _run(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, f"breakdown.py {' '.join(args)} failed:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def test_promote_prints_every_part_for_both_disk_io_modes() -> None:
    out = _run("promote", "--block-kib", "64", "--loads", "6")
    heads = ("disk_io=process, read by the owner", "disk_io=thread, read by the disk readers",
             "disk_io=process, read by the disk readers")
    assert all(h in out for h in heads), out
    owner_part = out.split(heads[1])[0]
    thread_part, process_part = out.split(heads[1])[1].split(heads[2])
    for part in ("until the owner reads it", "pread + check on the owner"):
        assert part in owner_part and part not in thread_part and part not in process_part, part
    for part in ("until the reader looks it up", "LMDB lookup", "pread into the host slot", "xxh3 over the block"):
        assert part in thread_part, part
        assert part not in process_part and part not in owner_part, part   # not measurable there: not printed
    for part in ("load() call", "slot -> row copy (owner thread)", "owner's applies", "whole load + wait"):
        assert part in thread_part and part in process_part and part in owner_part, part
    assert "by hand, one hot buffer" in out and "by hand, a different slot each time" in out


@pytest.mark.parametrize("args, lines", [
    (("step", "--steps", "20"), ("engine step, host + disk", "engine step, host only", "engine step, dict original")),
    (("batched", "--block-kib", "64", "--pass-mib", "8"), ("pass 0 (warm-up)", "pass 3:")),
    (("first-store", "--steps", "2", "--block-kib", "64", "--rows", "32", "--torch-threads", "1"),
     ("native mover", "copy on the engine thread", "no copy", "Python copy threads", "(ThreadMover)")),
    (("copy-step", "--steps", "5"), ("copy step, engine sleeping", "copy step, engine busy in Python",
                                     "launch of the copies", "reports applied", "gauges")),
    (("launch", "--steps", "3", "--block-kib", "16"),
     ("native mover launch, 16 KiB rows", "1-row launch after a 64-row copy", "1-row launch after an 8 MiB fill",
      "walk beside a copy")),
])
def test_the_other_diagnostics_run(args: tuple[str, ...], lines: tuple[str, ...]) -> None:
    out = _run(*args)
    for line in lines:
        assert line in out, (line, out)


AB = Path(__file__).resolve().parent.parent / "benchmarks" / "cached_reads_ab.py"


def test_cached_reads_ab_prints_both_sides_of_every_promote_figure() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(AB), "promote", "--mode", "smoke", "--rounds", "1"], capture_output=True,
                       text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if " on " in ln and " | off " in ln]
    names = [ln.split(" on ")[0].strip() for ln in lines]
    assert any("warm, batched" in n for n in names) and any("one at a time" in n for n in names), p.stdout
    for ln in lines:   # a figure on each side, not an empty list
        on, off = ln.split(" on ", 1)[1].split(" | off ")
        assert on.strip() and off.strip(), ln


@pytest.mark.skipif(not os.access("/proc/sys/vm/drop_caches", os.W_OK), reason="needs root for drop_caches")
def test_cached_reads_ab_cold_reads_back_every_block() -> None:
    p = subprocess.run([sys.executable, str(AB), "cold", "--block-kib", "64", "--mib", "2", "--rounds", "1"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr   # each round checks the rows the loads filled
    for mode in ("on", "off", "reads nothing"):
        assert any(ln.strip().startswith(mode) and "median" in ln for ln in p.stdout.splitlines()), p.stdout
