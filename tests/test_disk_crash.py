"""Crash tests of the disk tier (issue 3 section 8).

tests/crash_worker.py stores, loads, flushes and invalidates continuously and
journals what it may claim; this test kills it with SIGKILL at seeded points
(after a seeded number of journal lines, or right as it opens the store, i.e.
during recovery), reopens the same disk path and checks after every round:

* no wrong bytes, ever: every key that lookup() reports loads ok with exactly
  its bytes; no entry is counted corrupt or foreign;
* every key whose flush() returned (journal "F") is readable, unless the
  journal shows it was invalidated afterwards;
* nothing invalidated before the last successful flush() is readable, unless
  the journal shows it was stored again afterwards;
* keys the round did not touch are exactly as readable as after the previous
  round (nothing lost, nothing resurrected across rounds).

The worker runs forked from a server process that imported torch once, so the
30 rounds take seconds, not minutes.  The recovery time measured by each
reopen after a kill is printed (run with -s to see it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import crash_worker as cw
from disk_helpers import PYTHON, TESTS, child_env, readline
from tiered_kv import TierManager

ROUNDS = int(os.environ.get("TIERED_KV_CRASH_ROUNDS", "30"))
SEED = int(os.environ.get("TIERED_KV_CRASH_SEED", str(0x7EC0)), 0)   # override to explore other kill points


class ForkServer:
    def __init__(self, tmp: Path) -> None:
        self.err = open(tmp / "forkserver.stderr", "w+")
        self.proc = subprocess.Popen([PYTHON, str(TESTS / "crash_worker.py"), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, env=child_env())
        assert readline(self.proc, 180) == "ready", self.stderr()

    def stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()[-4000:]

    def cmd(self, line: str, timeout: float = 60) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return readline(self.proc, timeout)

    def start(self, **args) -> int:
        out = self.cmd("run " + json.dumps(args))
        assert out.startswith("pid "), out
        return int(out.split()[1])

    def reap(self, pid: int) -> int:
        out = self.cmd(f"wait {pid}")
        assert out.startswith("status "), out
        return int(out.split()[1])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def _journal(path: Path) -> list[str]:
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    lines = data.split("\n")
    return lines[:-1]          # the last element is "" or a line cut by the kill


def _kill_at(fs: ForkServer, pid: int, journal: Path, target_lines: int, deadline_s: float = 30) -> None:
    """SIGKILL ``pid`` once its journal has ``target_lines`` lines after "R" (0: as soon as it exists)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        if target_lines == 0:
            if journal.exists():
                break
        else:
            lines = _journal(journal)
            if any(not l.startswith(("S ", "I ", "F ", "R ")) for l in lines):
                break                      # the worker reported a problem: stop and check
            if len(lines) >= target_lines + 1:
                break
        time.sleep(0.002)                  # polling for progress, not ordering
    else:
        raise AssertionError(f"worker made no progress in {deadline_s} s: {_journal(journal)[-5:]}")
    os.kill(pid, signal.SIGKILL)


def _claims(lines: list[str]):
    problems = [l for l in lines if not l.startswith(("S ", "I ", "F ", "R "))]
    last_f = max((i for i, l in enumerate(lines) if l.startswith("F ")), default=None)
    durable: set[bytes] = set()
    gone: set[bytes] = set()
    after = lines
    if last_f is not None:
        d, _, a = lines[last_f][2:].partition("|")
        durable = {k.encode() for k in d.split(",") if k}
        gone = {k.encode() for k in a.split(",") if k}
        after = lines[last_f + 1:]
    stored_after = {l[2:].encode() for l in after if l.startswith("S ")}
    invalidated_after = {l[2:].encode() for l in after if l.startswith("I ")}
    touched = {l[2:].encode() for l in lines if l.startswith(("S ", "I "))}
    return problems, durable - invalidated_after, gone - stored_after, touched, last_f is not None


def _check(path: Path, durability: str, lines: list[str], before: set[bytes]) -> tuple[set[bytes], float, dict]:
    problems, must_read, must_not, touched, flushed = _claims(lines)
    assert not problems, f"the worker reported: {problems}"
    kv = torch.zeros((2, cw.ROW), dtype=torch.uint8)
    mgr = TierManager(cw.config(str(path), durability), kv, registry=CollectorRegistry())
    try:
        assert mgr.disk is not None, "the disk tier did not reopen after a crash"
        rep = mgr.disk.recovery
        assert rep.corrupt == 0 and rep.foreign == 0, rep
        readable: set[bytes] = set()
        for k in cw.KEYS:
            if mgr.lookup([k]):
                kv[0].zero_()
                job = mgr.load(k, 0)
                assert job is not None, k
                done = [c for c in mgr.wait([job], timeout=30) if c.job is job]
                assert len(done) == 1 and done[0].ok, (k, done)
                assert torch.equal(kv[0], cw.content(k)), f"WRONG BYTES for {k!r} after a crash"
                readable.add(k)
            else:
                assert mgr.load(k, 0) is None
        reg = mgr.metrics.registry
        corrupt = sum(s.value for f in reg.collect() for s in f.samples if s.name == "tiered_kv_corrupt_blocks_total")
        assert corrupt == 0
        missing = must_read - readable
        resurrected = must_not & readable
        lost = (before - touched) - readable
        appeared = (readable - touched) - before
        assert not missing, f"flushed keys not readable after the crash: {sorted(missing)}"
        assert not resurrected, f"keys invalidated before the last flush are readable: {sorted(resurrected)}"
        assert not lost, f"keys untouched this round were lost: {sorted(lost)}"
        assert not appeared, f"keys untouched this round appeared: {sorted(appeared)}"
        stats = {"entries": rep.entries, "purged": rep.purged, "tombs": rep.tombs_dropped,
                 "flushed": flushed, "claims": len(must_read), "gone": len(must_not)}
        return readable, rep.seconds, stats
    finally:
        mgr.close()


@pytest.mark.slow
def test_sigkill_at_random_points_never_serves_wrong_or_invalidated_bytes_and_keeps_flushed_ones(tmp_path):
    rng = random.Random(SEED)
    path = tmp_path / "disk"            # the same path in every round
    fs = ForkServer(tmp_path)
    recovery: list[float] = []
    kinds = {"early": 0, "late": 0}
    readable: set[bytes] = set()
    t_start = time.monotonic()
    try:
        for r in range(ROUNDS):
            durability = ("batch", "sync", "none")[r % 3]
            journal = tmp_path / f"journal-{r:02d}.txt"
            early = r % 6 == 0             # 5 rounds die while opening / recovering
            target = 0 if early else rng.randint(5, 400)
            kinds["early" if early else "late"] += 1
            pid = fs.start(path=str(path), journal=str(journal), seed=SEED + r, durability=durability)
            try:
                _kill_at(fs, pid, journal, target)
            finally:
                try:
                    os.kill(pid, signal.SIGKILL)   # no-op when already dead; never leave it running
                except ProcessLookupError:
                    pass
                status = fs.reap(pid)
            lines = _journal(journal)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, \
                (status, lines[-5:], fs.stderr())
            readable, secs, stats = _check(path, durability, lines, readable)
            recovery.append(secs)
            print(f"round {r:2d} {durability:5s} kill@{'open' if early else target:>4} "
                  f"recovery {secs * 1e3:7.3f} ms {stats}")
    finally:
        fs.close()
    print(f"crash rounds: {ROUNDS} ({kinds['early']} killed while opening), {time.monotonic() - t_start:.1f} s; "
          f"recovery after SIGKILL: min {min(recovery) * 1e3:.3f} ms, median {statistics.median(recovery) * 1e3:.3f} ms, "
          f"max {max(recovery) * 1e3:.3f} ms")
