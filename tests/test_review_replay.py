"""Adversarial review of ``tiered-kv replay`` (tiered_kv/tools/replay.py, tiered_kv/tools/tracetools.py): what
it proved wrong, each pinned by a test that failed before its fix, and the guarantees it relied on.

* host only, the replay through the core and the simulator agree exactly: the simulator leases a request's
  host hits until its stores' touches are done, as the core's load does, and keys blocks with the core's
  bytes (``block_key``), so an admission filter's sketch sees the same keys;
* prefill tokens saved never exceed the prompts, follow ``--tokens-per-block`` in every column, and a
  trace of no prompt tokens prints "n/a" instead of dividing by zero;
* Belady's bound never exceeds the unbounded cache (ids that are no prefix tree: capped, and said);
* an id from 2**64 is a key like any other; an id twice in one request is refused naming file and line;
* ``--sweep``'s directory is checked before the run, as ``--json``'s;
* ``--write-mode back`` (simulated as spill-on-eviction) hits what its simulation hits, within 5%: a
  write-back spill pins the coldest blocks in place instead of making them the most recently used.

Hand-made traces live in ``tmp_path``; the shipped traces are cut to their first few hundred requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest

from tiered_kv.tools import replay as replay_mod
from tiered_kv.tools.cli import main
from tiered_kv.tools.tracetools import read_trace, write_trace

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "traces"
MOONCAKE = TRACES / "mooncake_synthetic_trace.jsonl"
CHAT = TRACES / "chat_synthetic_trace.jsonl"


def hand_trace(path: Path, requests: Sequence[tuple[int, Sequence[int]]]) -> Path:
    """(input_length, hash_ids) per request, 1 ms apart, as Mooncake-format JSONL."""
    with open(path, "w", encoding="utf-8") as f:
        for i, (n, ids) in enumerate(requests):
            f.write(json.dumps({"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": list(ids)}) + "\n")
    return path


def full(*idss: Sequence[int]) -> list[tuple[int, Sequence[int]]]:
    """Requests of whole 512-token blocks."""
    return [(512 * len(ids), ids) for ids in idss]


def slice_of(src: Path, n: int, tmp_path: Path) -> Path:
    if not src.is_file():
        pytest.skip(f"{src.name} is not in this checkout")
    p = tmp_path / f"{src.stem}-{n}.jsonl"
    write_trace(p, read_trace(src, limit=n))
    return p


def run(tmp_path: Path, trace: Path, *argv: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "replay.json"
    rc = main(["replay", str(trace), "--quiet", "--json", str(out), *argv])
    return rc, (json.loads(out.read_text()) if rc == 0 else {})


# ------------------------------------------------------------------------------ proven defects

def test_host_only_lru_replay_equals_the_simulation_when_a_cached_block_follows_a_miss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/policies.md: "Host only, the replay's hits equal the simulator's exactly for every policy".
    Host of 3 blocks, default LRU, admission all.  Request 3 ([1, 2, 3]) hits 1, misses 2 (evicted) and
    finds 3 cached after the miss.  The simulator moves 1 to the MRU end at lookup, then touches 3 and
    inserts 2: order 1, 3, 2.  The core leases 1 for the load, touches 3, releases 1 when the load lands
    and publishes 2: order 3, 1, 2.  Request 4 ([5]) then evicts 1 in the simulator but 3 in the core,
    and request 5 ([1]) is a hit in the core only: core 3 hits, simulated 2."""
    p = hand_trace(tmp_path / "hole.jsonl", full([1, 2, 3], [1], [4], [1, 2, 3], [5], [1]))
    rc, o = run(tmp_path, p, "--host", "3")
    assert rc == 0
    assert o["core"]["hits"] == o["simulated"]["hits"], (o["core"]["hits"], o["simulated"]["hits"])


def test_host_only_tinylfu_replay_equals_the_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Same documented equality, host admission ``tinylfu``: the two make the same ``record``/``admit``
    calls in the same order, but ``tracetools._key`` feeds the count-min sketch ``h.to_bytes(8)`` while
    ``bench.trace.keys_of`` gives the core ``b"mooncake" + h.to_bytes(8)``: other hashes, other
    collisions, other admissions (here 5898 refused by the core, 5914 by the simulator)."""
    p = slice_of(MOONCAKE, 250, tmp_path)
    rc, o = run(tmp_path, p, "--host", "150", "--host-admission", "tinylfu")
    assert rc == 0
    core, sim = o["core"], o["simulated"]
    assert (core["hits"], core["host_refused"], core["host_blocks_written"]) == \
        (sim["hits"], sim["refused"], sim["inserts"])


@pytest.mark.parametrize("trace, policy", [(MOONCAKE, p) for p in ("lru", "s3fifo", "arc", "prefix")]
                         + [(CHAT, "lru"), (CHAT, "prefix")])
def test_write_back_replay_is_near_its_simulation(tmp_path: Path, trace: Path, policy: str) -> None:
    """With ``--write-mode back`` on the first 400 Mooncake requests (host 200, disk 400 blocks) the core
    hit 33 (+-6 from run to run) of the simulator's 118: a write-back spill leased the coldest blocks, and
    the lease's release made them the most recently used, so the host kept its coldest blocks and evicted
    the ones not yet written (about 1,300 of them).  A spill pins its blocks in place now, and write-back
    keeps a reserve of written victims sized to the steps' stores: the simulator's hits, at most a dozen
    victims unwritten (the simulator spills every host victim on eviction; the core spills ahead)."""
    p = slice_of(trace, 400, tmp_path)
    rc, o = run(tmp_path, p, "--host", "200", "--disk", "400", "--write-mode", "back", "--policy", policy)
    assert rc == 0
    ratio = o["core"]["hits"] / o["simulated"]["hits"]
    assert 0.95 <= ratio <= 1.05, (o["core"]["hits"], o["simulated"]["hits"])
    assert o["core"]["spills_shed"] <= 20, o["core"]["spills_shed"]


def test_an_id_beyond_64_bits_is_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``read_trace`` accepts any non-negative int id and ``tracetools._key`` makes longer keys for big ones,
    but ``bench.trace.keys_of`` packs each id into 8 bytes: ``OverflowError: int too big to convert``
    escapes ``main`` (it catches ValueError and OSError only).  Either refused naming the line, or replayed."""
    p = hand_trace(tmp_path / "big.jsonl", full([2 ** 64, 2 ** 64 + 1], [2 ** 64, 2 ** 64 + 1]))
    out = tmp_path / "o.json"
    rc = main(["replay", str(p), "--host", "4", "--quiet", "--json", str(out)])
    if rc == 0:
        o = json.loads(out.read_text())
        assert o["core"]["hits"] == o["simulated"]["hits"] == 2
    else:
        assert rc == 2 and f"{p}:1" in capsys.readouterr().err


def test_zero_input_tokens_are_no_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``_print`` computes ``core['tokens_saved'] / core['input_tokens']`` (replay.py, the "prefill tokens
    saved" row) with no guard; ``read_trace`` accepts ``input_length`` 0 (it only refuses negatives)."""
    p = hand_trace(tmp_path / "zero.jsonl", [(0, [1, 2]), (0, [1, 2])])
    rc = main(["replay", str(p), "--host", "4", "--quiet"])
    assert rc in (0, 2)
    if rc == 2:
        assert str(p) in capsys.readouterr().err


def test_prefill_tokens_saved_never_exceed_the_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Three 100-token prompts of three block ids each (a trace whose lengths disagree with its block
    count, which ``_block_tokens`` says it clamps for).  The core counts ``min(n * 512, input_length)``
    (100 a hit request: 200 of 300); the simulator, LRU, Belady and the unbounded cache count 512 + 512 + 0
    per hit request: 2048 of 300 input tokens, printed as 6.8267 in the same row as the core's 0.6667."""
    p = hand_trace(tmp_path / "short.jsonl", [(100, [1, 2, 3])] * 3)
    rc, o = run(tmp_path, p, "--host", "8")
    assert rc == 0
    for col in ("core", "simulated", "lru", "belady", "possible"):
        assert o[col]["tokens_saved"] <= o[col]["input_tokens"], (col, o[col]["tokens_saved"])
    assert o["core"]["tokens_saved"] == o["simulated"]["tokens_saved"]


def test_tokens_per_block_reaches_the_simulations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A trace of 16-token blocks (three ids a prompt) replayed with ``--tokens-per-block 16``: the second
    request hits 2 blocks (32 tokens), the third all 3 of its 40 tokens: the core saves 72 of 136 prompt
    tokens (0.5294); the simulated, LRU, Belady and unbounded columns claim 1024 + 1024 = 2048 (15.0588)
    because ``_block_tokens`` uses 512 per block."""
    p = hand_trace(tmp_path / "t16.jsonl", [(48, [1, 2, 3]), (48, [1, 2, 9]), (40, [1, 2, 3])])
    rc, o = run(tmp_path, p, "--host", "8", "--tokens-per-block", "16")
    assert rc == 0
    assert o["core"]["tokens_saved"] == 32 + 40
    for col in ("simulated", "lru", "belady", "possible"):
        assert o[col]["tokens_saved"] == 32 + 40, (col, o[col]["tokens_saved"])


def test_belady_never_exceeds_the_unbounded_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """[1, 2] then [3, 2]: no prefix lookup can hit 2 (its prefix starts with the miss 3), so the unbounded
    cache hits 0 and the report says "reach nan% of the possible hits"; ``belady`` counts 2 found cached and
    prints 0.25.  The replay never checks ``prefix_consistent`` nor caps the bound.  ``min(belady.hits,
    unbounded.hits)`` is still an upper bound of every policy in the prefix model."""
    p = hand_trace(tmp_path / "np.jsonl", full([1, 2], [3, 2]))
    rc, o = run(tmp_path, p, "--host", "4")
    assert rc == 0
    assert o["belady"]["hit_ratio"] <= o["possible"]["hit_ratio"], (o["belady"]["hit_ratio"], o["possible"]["hit_ratio"])


def test_a_repeated_id_in_one_request_is_named_by_file_and_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``read_trace`` accepts ``[5, 5]``; the replay then stops with "key b'mooncake\\x05\\x00...' appears twice
    in one call" from ``store_many``: the user cannot tell which line (docs: "a malformed line is refused
    naming the file and line").  Refused naming the line, or replayed with the simulator's figures."""
    p = hand_trace(tmp_path / "dup.jsonl", full([1, 2], [5, 5], [5, 5]))
    out = tmp_path / "o.json"
    rc = main(["replay", str(p), "--host", "4", "--quiet", "--json", str(out)])
    if rc == 0:
        o = json.loads(out.read_text())
        assert o["core"]["hits"] == o["simulated"]["hits"]
    else:
        assert rc == 2 and f"{p}:2" in capsys.readouterr().err


def test_an_unwritable_sweep_path_is_refused_before_the_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    p = hand_trace(tmp_path / "t.jsonl", full([1, 2], [1, 2]))

    def ran(*a: Any, **k: Any) -> Any:
        raise RuntimeError("the replay ran before --sweep's path was checked")

    monkeypatch.setattr(replay_mod, "replay", ran)
    rc = main(["replay", str(p), "--host", "2", "--quiet", "--sweep", str(tmp_path / "missing" / "curves.png")])
    assert rc == 2 and "--sweep" in capsys.readouterr().err


# ------------------------------------------------------------------------------ guarantees pinned

@pytest.mark.parametrize("opt, value", [("--host", "-5"), ("--host", "0"), ("--host", "lots"), ("--host", "0%"),
                                        ("--host", "1.5"), ("--host", "1KiB"), ("--disk", "-1"),
                                        ("--disk", "2 furlongs")])
def test_bad_sizes_exit_2_naming_the_value(opt: str, value: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    p = hand_trace(tmp_path / "t.jsonl", full([1, 2], [1, 2]))
    argv = ["replay", str(p), "--quiet", opt, value] + (["--host", "1"] if opt == "--disk" else [])
    assert main(argv) == 2
    assert repr(value) in capsys.readouterr().err


def test_unbounded_counts_no_first_reference_and_bounds_hold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix-tree trace: the unbounded cache hits only re-references (the first of each block is a miss),
    Belady is between the core and it, and bytes written are the model's block bytes per insert."""
    p = hand_trace(tmp_path / "t.jsonl", full([1, 2, 3], [4], [1, 2, 5], [6], [1, 2, 3], [4]))
    rc, o = run(tmp_path, p, "--host", "3", "--model", "2,2,8,float16")
    assert rc == 0
    assert o["block_bytes"] == 2 * 2 * 2 * 8 * 2 * 512
    assert o["possible"]["hits"] == 2 + 3 + 1   # [1,2] again, [1,2,3] again, [4] again
    assert o["core"]["hits"] <= o["belady"]["hits"] <= o["possible"]["hits"]
    assert o["core"]["host_blocks_written"] * o["block_bytes"] == o["simulated"]["bytes_written"]
    assert o["core"]["tokens_saved"] == o["simulated"]["tokens_saved"] == 512 * o["core"]["hits"]


def test_the_printed_table_agrees_with_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = slice_of(CHAT, 150, tmp_path)
    rc, o = run(tmp_path, p, "--host", "3%", "--disk", "6%")
    assert rc == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("block hit ratio, all tiers")).split()[-5:]
    assert row == [f"{o[c]['hit_ratio']:.4f}" for c in ("core", "simulated", "lru", "belady", "possible")]
    assert f"reach {100 * o['share_of_possible']:.1f}% of the possible hits" in text


def test_host_only_figures_do_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    """Two processes with different PYTHONHASHSEED: every figure of a host-only replay (the prefix policy's
    sets, TinyLFU's sketch) and of the simulations is the same."""
    p = slice_of(CHAT, 200, tmp_path)
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"seed{seed}.json"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-m", "tiered_kv.tools.cli", "replay", str(p), "--host", "2%", "--policy",
                        "prefix", "--host-admission", "tinylfu", "--quiet", "--json", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL, timeout=120)
        o = json.loads(out.read_text())
        for k in ("wall_s", "refs_per_s"):
            o["core"].pop(k)
        outs.append(o)
    assert outs[0] == outs[1]
