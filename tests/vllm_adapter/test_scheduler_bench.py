"""benchmarks/vllm_scheduler_side.py: the side-by-side driver gives every manager the same calls."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vllm_scheduler_side", ROOT / "benchmarks" / "vllm_scheduler_side.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(r), "output_length": 1,
                                        "hash_ids": r}) + "\n" for i, r in enumerate(requests)))
    return path


def test_with_room_for_every_block_each_manager_serves_the_same_hits(bench, tmp_path: Path) -> None:
    # shared prefixes, one request per step: every store completes before the next lookup, and nothing is
    # evicted, so an exact cache hits each block seen before -- the same count for all three managers
    reqs = [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5], [6, 7], [0, 1, 2, 3, 8], [6, 7, 9]]
    out = tmp_path / "r.json"
    assert bench.main(["--trace", str(write_trace(tmp_path / "t.jsonl", reqs)), "--slots", "64", "--per-step", "1",
                       "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    expected_hits = 3 + 2 + 4 + 2   # requests 2, 3, 5 and 6 hit [0,1,2], [0,1], [0,1,2,3] and [6,7]
    for name in bench.MANAGERS:
        (run,) = result["runs"][name]
        assert run["block_refs"] == sum(map(len, reqs))
        assert run["hits"] == expected_hits, (name, run)
        assert run["stored"] == 10 and run["refused"] == 0, (name, run)   # the 10 distinct blocks
        assert run["us_per_block"] > 0
    assert result["facts"]["requests"] == len(reqs)


def test_a_bad_trace_line_is_named(bench, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = tmp_path / "bad.jsonl"
    t.write_text('{"hash_ids": [1, 2]}\n{"timestamp": 3}\n')
    with pytest.raises(SystemExit) as exc:
        bench.main(["--trace", str(t), "--repeats", "1"])
    assert exc.value.code == 2
    assert "bad.jsonl:2: missing field 'hash_ids'" in capsys.readouterr().err
