"""Adversarial review of the trace tools: ``tiered_kv/tools/tracegen.py``, ``tiered_kv/tools/tracetools.py`` and
how ``tiered-kv replay`` (``tiered_kv/tools/replay.py``, ``tiered_kv/tools/cli.py``) uses them.

What it proved wrong, each pinned by a test that failed before its fix: ``read_trace`` let an integer
timestamp or length too large for a float through (an ``OverflowError`` naming no line, later) and took
block ids of any size (a key past ``max_key_bytes`` in the replay); ``parse_size`` floored a float product
("29%" of 100 blocks was 28); ``replay --json`` wrote NaN, found a ``--json`` that is a directory, and
``--sweep`` without matplotlib, only after the whole run; a trace of no block references failed in the
manager; ``--requests 0`` named ``read_trace``'s parameter; ``write_trace`` wrote ``Infinity``; the trace's
duration was last minus first timestamp; the simulator made a list of every slot of a tier up front.  The
other tests pin behaviours checked to be right, each of which fails if the code breaks it.  Not repeated here: what
tests/test_trace_tools.py, tests/test_replay_cli.py, tests/test_review_replay.py and
tests/test_review_boundary.py already cover.  Hand-made traces live in ``tmp_path``; everything is seeded.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import pytest

from tiered_kv.tools import replay as replay_mod
from tiered_kv.tools import tracegen as tg
from tiered_kv.tools import tracetools as tt
from tiered_kv.tools.cli import main
from tiered_kv.tools.replay import parse_size
from tiered_kv.tools.tracetools import Request, TraceError

H8 = sum(1 / r for r in range(1, 9))   # Zipf over 8 prompts (weight 1/rank)
H4 = sum(1 / r for r in range(1, 5))


def hand_trace(path: Path, requests: Sequence[tuple[int, Sequence[int]]]) -> Path:
    """(input_length, hash_ids) per request, 1 ms apart, as Mooncake-format JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for i, (n, ids) in enumerate(requests):
            f.write(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": list(ids)}) + "\n")
    return path


def full(*idss: Sequence[int]) -> list[tuple[int, Sequence[int]]]:
    return [(512 * len(ids), ids) for ids in idss]


def _no_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def _spy_replay(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts runs of the replay through the core (the long part of ``tiered-kv replay``)."""
    ran: list[int] = []
    real = replay_mod.replay

    def spy(*a: Any, **k: Any) -> Any:
        ran.append(1)
        return real(*a, **k)

    monkeypatch.setattr(replay_mod, "replay", spy)
    return ran


# =========================================================================================== defects

def test_a_timestamp_too_big_for_a_float_is_a_trace_error_naming_the_line(tmp_path: Path) -> None:
    """A 400-digit integer timestamp is a TraceError naming file and line, not an OverflowError from math."""
    p = tmp_path / "ts.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]})
    p.write_text(good + "\n" + '{"timestamp": 1' + "0" * 400
                 + ', "input_length": 512, "output_length": 1, "hash_ids": [2]}\n', encoding="utf-8")
    with pytest.raises(TraceError, match=f"^{p}:2: 'timestamp'"):
        tt.read_trace(p)


def test_an_absurd_input_length_is_refused_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An input_length of 10**400 is refused at its line, not by trace_stats' overflow later."""
    p = tmp_path / "il.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}) + "\n"
                 + '{"timestamp": 1, "input_length": 1' + "0" * 400 + ', "output_length": 1, "hash_ids": [1]}\n',
                 encoding="utf-8")
    rc = main(["replay", str(p), "--host", "4", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{p}:2" in err, (rc, err)


def test_a_huge_block_id_is_replayed_or_refused_naming_the_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A 2,500-digit block id is refused at its line (ids are at most 128 bits), not by the core's key check."""
    big = 10 ** 2500
    p = hand_trace(tmp_path / "huge.jsonl", full([big], [big]))
    out = tmp_path / "o.json"
    rc = main(["replay", str(p), "--host", "4", "--quiet", "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{p}:1" in err and "2**128" in err, (rc, err)
    assert not out.exists()
    ok = hand_trace(tmp_path / "big-ok.jsonl", full([2 ** 128 - 1], [2 ** 128 - 1]))   # the largest id replays
    assert main(["replay", str(ok), "--host", "4", "--quiet", "--json", str(out)]) == 0
    o = json.loads(out.read_text())
    assert o["core"]["hits"] == o["simulated"]["hits"] == 1


def test_a_percentage_size_is_exact() -> None:
    """Shares are exact: 0.29 * 100 in floats is 28.999..., floored to 28."""
    assert [parse_size(f"{p}%", 100, 1) for p in (29, 57, 58)] == [29, 57, 58]
    assert parse_size("29%", 1000, 1) == 290


def test_replay_json_is_strict_json_on_a_trace_with_no_reuse(tmp_path: Path) -> None:
    """A figure with no denominator is null in --json, never NaN (not JSON)."""
    p = hand_trace(tmp_path / "noreuse.jsonl", full([1, 2], [3]))
    out = tmp_path / "o.json"
    assert main(["replay", str(p), "--host", "4", "--quiet", "--json", str(out)]) == 0
    o = json.loads(out.read_text(encoding="utf-8"), parse_constant=_no_constant)
    assert o["possible"]["hits"] == 0


def test_a_json_path_that_is_a_directory_is_refused_before_the_replay(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """--json naming a directory is refused before the run, not by EISDIR after it."""
    p = hand_trace(tmp_path / "t.jsonl", full([1, 2], [1, 2]))
    target = tmp_path / "a-directory"
    target.mkdir()
    ran = _spy_replay(monkeypatch)
    rc = main(["replay", str(p), "--host", "2", "--quiet", "--json", str(target)])
    err = capsys.readouterr().err
    assert rc == 2 and "--json" in err, (rc, err)
    assert not ran, "the replay ran before the output path was found unusable"


def test_sweep_without_matplotlib_is_refused_before_the_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--sweep without matplotlib is refused before the run, not after it (which printed nothing)."""
    import tiered_kv.bench.plots as plots

    monkeypatch.setattr(plots, "matplotlib_missing", lambda: "ImportError: No module named 'matplotlib'")
    p = hand_trace(tmp_path / "t.jsonl", full([1, 2], [1, 2]))
    ran = _spy_replay(monkeypatch)
    rc = main(["replay", str(p), "--host", "2", "--quiet", "--sweep", str(tmp_path / "c.png")])
    assert rc == 2 and "matplotlib" in capsys.readouterr().err
    assert not ran, "a long replay ran, then was thrown away for want of matplotlib"


def test_a_trace_of_no_block_references_is_replayed_or_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace read_trace accepts whose requests name no block replays (an idle row), not a manager error."""
    p = hand_trace(tmp_path / "noblocks.jsonl", [(0, []), (0, [])])
    assert len(tt.read_trace(p)) == 2   # read_trace accepts it
    rc = main(["replay", str(p), "--host", "4", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 0, (rc, err)


def test_requests_zero_names_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--requests 0 names the option, not read_trace's parameter."""
    p = hand_trace(tmp_path / "t.jsonl", full([1], [1]))
    assert main(["replay", str(p), "--requests", "0", "--quiet"]) == 2
    assert "--requests" in capsys.readouterr().err


def test_write_trace_refuses_what_is_not_json(tmp_path: Path) -> None:
    """write_trace refuses what read_trace would (an infinite or NaN timestamp was written as Infinity/NaN)."""
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError):
            tt.write_trace(tmp_path / "w.jsonl", [Request(bad, 512, 1, (1,))])


def test_trace_stats_duration_of_an_unsorted_trace() -> None:
    """The duration spans the earliest to the latest timestamp, also when lines are out of time order."""
    rs = [Request(3000, 512, 1, (1,)), Request(0, 512, 1, (2,)), Request(1000, 512, 1, (1,))]
    assert tt.trace_stats(rs)["duration_s"] == 3.0


def test_simulate_memory_does_not_grow_with_an_unused_capacity() -> None:
    """A tier gives out slots as they are first used: no list of every slot of a large, unused capacity."""
    trace = [Request(0, 512, 1, (1,)), Request(1, 512, 1, (1,))]
    tracemalloc.start()
    try:
        s = tt.simulate(trace, 1_000_000, "lru")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert s.hits == 1
    assert peak < 4 << 20, f"peak {peak / 2**20:.1f} MiB for a trace of one block"


# ====================================================================== guarantees checked

def test_generators_do_not_depend_on_the_hash_seed() -> None:
    """The seed alone decides a trace: two interpreters with other PYTHONHASHSEEDs make the same bytes as this one
    (a generator seeded through hash() or iterating a set would not)."""
    code = ("import hashlib; from tiered_kv.tools.tracegen import gen_chat, gen_agent; "
            "print(hashlib.sha256(repr((gen_chat(300, 5), gen_agent(300, 5))).encode()).hexdigest())")
    here = hashlib.sha256(repr((tg.gen_chat(300, 5), tg.gen_agent(300, 5))).encode()).hexdigest()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             timeout=120, cwd=str(Path(__file__).resolve().parents[1])).stdout.strip()
        assert got == here, seed


def _common_prefix(idss: list[tuple[int, ...]]) -> int:
    m, shortest = 0, min(len(x) for x in idss)
    while m < shortest and all(x[m] == idss[0][m] for x in idss):
        m += 1
    return m


def test_chat_follows_its_documented_shape() -> None:
    """gen_chat's docstring: 8 system prompts of 4-16 blocks, Zipf popularity (1/rank), Poisson arrivals of mean
    250 ms, a session ends once its context passes 24k tokens (a request is at most 24k + the largest paste)."""
    n = 20_000
    rs = tg.gen_chat(n, 3)
    first = Counter(r.hash_ids[0] for r in rs)
    assert len(first) == 8   # every request starts with one of the 8 shared prompts
    shares = [c / n for _, c in first.most_common()]
    for rank, share in enumerate(shares[:4], 1):
        assert abs(share - 1 / (rank * H8)) < 0.04, (rank, shares)
    for h in first:
        prompt = _common_prefix([r.hash_ids for r in rs if r.hash_ids[0] == h])
        assert 4 <= prompt <= 16, (h, prompt)
    ts = [r.timestamp for r in rs]
    assert 240 <= (ts[-1] - ts[0]) / (n - 1) <= 260
    assert max(r.input_length for r in rs) <= 24_000 + 8_000


def test_agent_follows_its_documented_shape() -> None:
    """gen_agent's docstring: 4 shared tool prefixes of 8-24 blocks for 60% of the agents (Zipf), the others a
    private prompt; Poisson arrivals of mean 50 ms."""
    n = 20_000
    rs = tg.gen_agent(n, 3)
    first = Counter(r.hash_ids[0] for r in rs).most_common()
    tools = first[:4]
    assert first[4][1] < tools[3][1] / 4   # the 5th most common start is a private prompt, far behind
    shared = sum(c for _, c in tools) / n
    assert 0.5 <= shared <= 0.7, shared
    for rank, (h, c) in enumerate(tools, 1):
        assert abs(c / n - 0.6 / (rank * H4)) < 0.04, (rank, tools)
        prefix = _common_prefix([r.hash_ids for r in rs if r.hash_ids[0] == h])
        assert 8 <= prefix <= 24, (h, prefix)
    ts = [r.timestamp for r in rs]
    assert 47 <= (ts[-1] - ts[0]) / (n - 1) <= 53


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_a_partial_last_block_is_never_reused(kind: str) -> None:
    """A prompt's partial last block changes as the context grows, so its id is fresh each time (docs: "the partial
    last block gets a fresh id each turn"); full blocks are reused.  A reused partial id would fake hits."""
    rs = tg.GENERATORS[kind](3000, 9)
    refs = Counter(h for r in rs for h in r.hash_ids)
    partial = [r.hash_ids[-1] for r in rs if r.input_length % 512]
    assert len(partial) > 2500
    assert all(refs[h] == 1 for h in partial)
    assert sum(1 for h, c in refs.items() if c > 1) > 1000


def test_read_trace_with_a_limit_stops_before_a_later_bad_line(tmp_path: Path) -> None:
    """The first N requests of a long or damaged trace are read without parsing the rest (a replay of
    ``--requests 1000`` of a big trace reads 1000 lines)."""
    p = hand_trace(tmp_path / "t.jsonl", full([1], [1, 2]))
    with open(p, "a", encoding="utf-8") as f:
        f.write("{broken\n")
    assert tt.read_trace(p, limit=2) == [Request(0, 512, 1, (1,)), Request(1, 1024, 1, (1, 2))]
    with pytest.raises(TraceError, match=f"^{p}:3: not JSON"):
        tt.read_trace(p, limit=3)


def test_read_trace_keeps_unicode_line_separators_inside_a_record(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 are line breaks to ``str.splitlines`` but not to JSONL: a record holding them
    raw (an extra field, ignored) is one line, and later lines keep their numbers."""
    rec = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [7], "note": "a\u2028b\u2029c\x85d é"}
    p = tmp_path / "u.jsonl"
    p.write_text(json.dumps(rec, ensure_ascii=False) + "\n" + json.dumps({**rec, "hash_ids": [7, 8]}) + "\n"
                 + "[]\n", encoding="utf-8")
    assert tt.read_trace(p, limit=2) == [Request(0, 512, 1, (7,)), Request(0, 512, 1, (7, 8))]
    with pytest.raises(TraceError, match=f"^{p}:3: expected a JSON object"):
        tt.read_trace(p)


def test_trace_stats_infinite_cache_is_the_unbounded_prefix_cache_on_a_non_prefix_trace() -> None:
    """``infinite_cache_hit_ratio`` counts prefix hits (a block seen before but behind a miss is no hit), as the
    replay's "unbounded" column does: [3, 2] hits nothing though 2 was seen; [1, 2, 3] hits all three."""
    rs = [Request(i, 512 * len(ids), 1, ids) for i, ids in enumerate([(1, 2), (3, 2), (1, 2, 3)])]
    st = tt.trace_stats(rs)
    assert (st["block_refs"], st["distinct_blocks"], st["prefix_consistent"]) == (7, 3, False)
    assert st["infinite_cache_hit_ratio"] == 3 / 7
    assert tt.simulate(rs, st["distinct_blocks"], "lru").hits == 3


def test_block_key_is_injective_across_the_64_bit_boundary() -> None:
    """16 bytes up to 2**64 - 1, longer from 2**64, little-endian: no two ids share a key (a truncating or
    wrapping pack would make 2**64 the key of 0)."""
    keys = [tt.block_key(h) for h in (0, 1, 255, 256, 2 ** 64 - 1, 2 ** 64, 2 ** 64 + 1, 2 ** 72, 2 ** 128)]
    assert len(set(keys)) == len(keys)
    assert tt.block_key(0) == b"mooncake" + bytes(8)
    assert tt.block_key(256) == b"mooncake\x00\x01" + bytes(6)
    assert [len(k) for k in keys] == [16, 16, 16, 16, 16, 17, 17, 18, 25]
    # the simulator keeps them apart too: two requests of ids 0 and 2**64 are two blocks, no hit
    assert tt.simulate([Request(0, 512, 1, (0,)), Request(1, 512, 1, (2 ** 64,))], 4, "lru").hits == 0


def test_the_generator_cli_writes_what_it_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m tiered_kv.tools.tracegen agent OUT``: the stats it prints are those of the file it wrote."""
    p = tmp_path / "a.jsonl"
    assert tg.main(["agent", str(p), "--requests", "250", "--seed", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"out": str(p), **tt.trace_stats(tt.read_trace(p))}
    assert printed["requests"] == 250 and printed["prefix_consistent"] is True
    assert tg.main(["chat", str(tmp_path / "missing" / "c.jsonl"), "--requests", "3"]) == 2
    assert "missing" in capsys.readouterr().err
