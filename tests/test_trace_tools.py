"""tiered_kv.tools.tracetools: trace reading, the offline policy simulator, Belady, block sizes, generators."""

from __future__ import annotations

import functools
import itertools
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.bench.trace import TraceError, default_trace, load_trace
from tiered_kv.core.policy import ADMISSIONS, POLICIES
from tiered_kv.tools import tracegen as tg
from tiered_kv.tools import tracetools as tt
from tiered_kv.tools.tracetools import Request

TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "traces"
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def reqs(*idss: Sequence[int]) -> list[Request]:
    """Requests of full 512-token blocks, 1 ms apart."""
    return [Request(i, 512 * len(ids), 1, tuple(ids)) for i, ids in enumerate(idss)]


@functools.lru_cache(maxsize=None)
def mooncake(limit: int) -> tuple[Request, ...]:
    p = default_trace()
    if p is None or not p.is_file():
        pytest.skip("no Mooncake trace in this checkout")
    return tuple(tt.read_trace(p, limit))


# ------------------------------------------------------------------------------------ read_trace

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def _rec(**kw: object) -> str:
    d = dict(GOOD)
    for k, v in kw.items():
        if v is _DROP:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d)


_DROP = object()


@pytest.mark.parametrize("bad, what", [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_rec(timestamp=_DROP), "missing field 'timestamp'"),
    (_rec(input_length=_DROP), "missing field 'input_length'"),
    (_rec(output_length=_DROP), "missing field 'output_length'"),
    (_rec(hash_ids=_DROP), "missing field 'hash_ids'"),
    (_rec(timestamp="0"), "'timestamp' must be a number"),
    (_rec(input_length=1.5), "'input_length' must be an int"),
    (_rec(output_length=True), "'output_length' must be an int"),
    (_rec(hash_ids="1,2"), "'hash_ids' must be a list"),
    (_rec(hash_ids=[1, "2"]), "'hash_ids' must be a list of ints"),
    (_rec(hash_ids=[1, False]), "'hash_ids' must be a list of ints"),
    (_rec(timestamp=-1), "'timestamp' must be >= 0"),
    (_rec(input_length=-1), "'input_length' must be >= 0"),
    (_rec(output_length=-5), "'output_length' must be >= 0"),
    (_rec(hash_ids=[1, -3]), "'hash_ids' must be non-negative"),
])
def test_read_trace_errors_name_file_and_line(tmp_path: Path, bad: str, what: str) -> None:
    p = _write(tmp_path, [json.dumps(GOOD), "", bad, json.dumps(GOOD)])
    with pytest.raises(TraceError) as ei:
        tt.read_trace(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:3: "), msg
    assert what in msg, msg


def test_read_trace_empty_and_missing_files(tmp_path: Path) -> None:
    for text in ("", "\n\n  \n"):
        p = tmp_path / "empty.jsonl"
        p.write_text(text, encoding="utf-8")
        with pytest.raises(TraceError, match=f"{p}: no requests"):
            tt.read_trace(p)
    with pytest.raises(TraceError, match="cannot read trace .*nope.jsonl"):
        tt.read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="limit must be a positive int or None, got 0"):
        tt.read_trace(tmp_path / "nope.jsonl", 0)


def test_read_trace_round_trip_and_limit(tmp_path: Path) -> None:
    rs = [Request(0, 600, 3, (1, 2)), Request(5, 512, 0, (1,)), Request(9.5, 0, 7, ())]
    p = tmp_path / "rt.jsonl"
    assert tt.write_trace(p, rs) == 3
    assert tt.read_trace(p) == rs
    assert tt.read_trace(p, 2) == rs[:2]
    assert load_trace(p) == [list(r.hash_ids) for r in rs]   # bench's reader agrees on the ids


def test_read_trace_reads_mooncake_like_load_trace() -> None:
    rs = mooncake(500)
    assert [list(r.hash_ids) for r in rs] == load_trace(default_trace(), 500)   # type: ignore[arg-type]
    assert all(-(-r.input_length // 512) == len(r.hash_ids) for r in rs)


# ------------------------------------------------------------------------------ reference models

def od_lru(requests: Sequence[Request], cap: int) -> tuple[int, int, int, int]:
    """A plain OrderedDict LRU prefix cache with the tier index's order: the lookup touches the hit
    prefix; the store touches cached blocks after the miss and reserves the others, evicting the least
    recently used block not in the request, and appends the new ones once the request's evictions are
    done.  Returns (hits, inserts, evictions, shed)."""
    od: OrderedDict[int, None] = OrderedDict()
    hits = inserts = evictions = shed = 0
    for r in requests:
        keys = r.hash_ids
        protect = set(keys)
        n = 0
        for k in keys:
            if k not in od:
                break
            od.move_to_end(k)
            n += 1
        hits += n
        new: list[int] = []
        for k in keys[n:]:
            if k in od:
                od.move_to_end(k)
                continue
            if k in new:
                continue
            if len(od) + len(new) >= cap:
                v = next((x for x in od if x not in protect), None)
                if v is None:
                    shed += 1
                    continue
                del od[v]
                evictions += 1
            new.append(k)
            inserts += 1
        for k in new:
            od[k] = None
    return hits, inserts, evictions, shed


def brute_force(requests: Sequence[Request], cap: int) -> int:
    """The most prefix hits any choice of stores and evictions gets: per request, the prefix hits, then
    any subset of the missing blocks stored, each when full evicting any cached block not in the
    request (exhaustive, memoized on the cache's contents)."""
    trace = [r.hash_ids for r in requests]

    @functools.lru_cache(maxsize=None)
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(trace):
            return 0
        ids = trace[i]
        n = 0
        while n < len(ids) and ids[n] in cache:
            n += 1
        missing = [h for h in dict.fromkeys(ids[n:]) if h not in cache]
        evictable = sorted(cache - set(ids))
        out = 0
        for m in range(len(missing) + 1):
            for ins in itertools.combinations(missing, m):
                need = max(0, len(cache) + m - cap)
                if need > len(evictable):
                    continue
                for ev in itertools.combinations(evictable, need):
                    out = max(out, best(i + 1, (cache - frozenset(ev)) | frozenset(ins)))
        return n + out

    return best(0, frozenset())


@st.composite
def tree_traces(draw: st.DrawFn, max_requests: int = 7, max_new: int = 3) -> list[Request]:
    """Prefix-consistent traces: each request a prefix of an earlier one plus fresh blocks."""
    out: list[tuple[int, ...]] = []
    nxt = 0
    for _ in range(draw(st.integers(1, max_requests))):
        ids: list[int] = []
        if out and draw(st.booleans()):
            base = draw(st.sampled_from(out))
            ids = list(base[:draw(st.integers(0, len(base)))])
        k = draw(st.integers(0 if ids else 1, max_new))
        ids.extend(range(nxt, nxt + k))
        nxt += k
        out.append(tuple(ids))
    return reqs(*out)


any_traces = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=5), min_size=1, max_size=12).map(
    lambda xs: reqs(*xs))


# ------------------------------------------------------------------------------------------ belady

HAND = [
    (reqs([0, 1], [2, 3], [0, 1], [2, 3], [0, 1]), 2),
    (reqs([0], [1], [2], [0], [1], [2], [0], [1], [2]), 2),
    (reqs([0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2], [0, 1, 3]), 3),
    (reqs([0, 1], [0, 1, 2], [0, 1, 2], [3], [0, 1]), 2),
    (reqs([0, 1, 2, 3], [0, 1, 2, 3], [0, 1], [0, 1, 2, 3]), 3),
    (reqs([0], [1, 2], [0], [1, 2], [1, 3], [0], [1, 3]), 2),
]


@pytest.mark.parametrize("trace, cap", HAND)
def test_belady_equals_brute_force_on_hand_made_traces(trace: list[Request], cap: int) -> None:
    assert tt.prefix_consistent(trace)
    for c in range(cap + 2):
        b = tt.belady(trace, c)
        assert b.hits == b.prefix_hits == brute_force(trace, c), c


@HYP
@given(tree_traces(), st.integers(0, 4))
def test_belady_is_the_prefix_optimum_on_prefix_consistent_traces(trace: list[Request], cap: int) -> None:
    b = tt.belady(trace, cap)
    assert b.hits == b.prefix_hits == brute_force(trace, cap)


@HYP
@given(any_traces, st.integers(0, 4))
def test_belady_bounds_the_prefix_optimum_on_any_trace(trace: list[Request], cap: int) -> None:
    assert tt.belady(trace, cap).hits >= brute_force(trace, cap)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@HYP
@given(trace=st.one_of(tree_traces(10, 4), any_traces), cap=st.integers(0, 6))
def test_belady_bounds_every_policy_on_random_traces(policy: str, trace: list[Request], cap: int) -> None:
    assert tt.belady(trace, cap).hits >= tt.simulate(trace, cap, policy).hits


@pytest.mark.parametrize("admission", sorted(set(ADMISSIONS) - {"all"}))
@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(HYP, max_examples=40)
@given(trace=st.one_of(tree_traces(10, 4), any_traces), cap=st.integers(0, 6))
def test_belady_bounds_every_policy_with_admission(policy: str, admission: str, trace: list[Request],
                                                   cap: int) -> None:
    s = tt.simulate(trace, cap, policy, admission)
    assert tt.belady(trace, cap).hits >= s.hits
    assert s.inserts + s.refused + s.shed + s.hits <= s.refs


@pytest.mark.parametrize("cap", [64, 256, 1024, 4096])
def test_belady_bounds_every_policy_on_mooncake(cap: int) -> None:
    trace = mooncake(800)
    b = tt.belady(trace, cap)
    assert b.hits == b.prefix_hits   # Mooncake's ids are prefix-chain hashes: the bound is reachable
    for p in POLICIES:
        for a in ADMISSIONS:
            s = tt.simulate(trace, cap, p, a)
            assert b.hit_ratio >= s.hit_ratio, (p, a, cap)
            assert b.tokens_saved >= s.tokens_saved, (p, a, cap)


def test_belady_bypasses_and_counts() -> None:
    trace = reqs([0], [1], [0])
    b = tt.belady(trace, 1)   # MIN with bypass keeps 0 and never writes 1 (never used again)
    assert (b.hits, b.inserts, b.refused, b.evictions) == (1, 1, 1, 0)
    assert tt.belady(trace, 0).hits == 0


# ------------------------------------------------------------------------------------------ simulate

@HYP
@given(trace=st.one_of(tree_traces(12, 4), any_traces), cap=st.integers(0, 8))
def test_simulate_lru_equals_ordered_dict_lru(trace: list[Request], cap: int) -> None:
    s = tt.simulate(trace, cap, "lru")
    assert (s.hits, s.inserts, s.evictions, s.shed) == od_lru(trace, cap)
    assert s.prefix_hits == s.hits and s.refs == sum(len(r.hash_ids) for r in trace)


@pytest.mark.parametrize("cap", [100, 1000, 5000])
def test_simulate_lru_equals_ordered_dict_lru_on_mooncake(cap: int) -> None:
    trace = mooncake(1000)
    s = tt.simulate(trace, cap, "lru")
    assert (s.hits, s.inserts, s.evictions, s.shed) == od_lru(trace, cap)
    assert s.bytes_written == s.inserts * tt.DEFAULT_BLOCK_BYTES


@pytest.mark.skipif("second_hit" not in ADMISSIONS, reason="no second_hit admission")
def test_simulate_asks_the_admission_filter() -> None:
    s = tt.simulate(reqs([0], [0], [0]), 1, "lru", "second_hit")
    assert (s.hits, s.inserts, s.refused) == (1, 1, 1)   # stored at its second reference, hit at the third


def test_tokens_saved_counts_the_last_block_partially() -> None:
    trace = [Request(0, 700, 1, (0, 1)), Request(1, 700, 1, (0, 1)), Request(2, 1100, 1, (0, 1, 2))]
    s = tt.simulate(trace, 10, "lru")
    assert s.hits == 4 and s.tokens_saved == 700 + 1024
    assert s.input_tokens == 2500
    assert tt.belady(trace, 10).tokens_saved == 700 + 1024


def test_simulate_rejects_unknown_names_and_bad_capacity() -> None:
    trace = reqs([0])
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        tt.simulate(trace, 4, "nope")
    with pytest.raises(ValueError, match="unknown admission 'nope'"):
        tt.simulate(trace, 4, "lru", "nope")
    with pytest.raises(ValueError, match="capacity must be a non-negative int .*got -1"):
        tt.simulate(trace, -1, "lru")
    with pytest.raises(ValueError, match="capacity must be a non-negative int"):
        tt.belady(trace, 1.5)   # type: ignore[arg-type]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_runs_on_mooncake(policy: str) -> None:
    s = tt.simulate(mooncake(600), 512, policy)
    assert 0 < s.hits <= s.refs and s.inserts >= s.evictions


@HYP
@given(trace=tree_traces(12, 4), caps=st.lists(st.integers(0, 10), min_size=2, max_size=2))
def test_capacity_monotonic_lru_and_belady_random(trace: list[Request], caps: list[int]) -> None:
    lo, hi = sorted(caps)
    assert tt.belady(trace, hi).hits >= tt.belady(trace, lo).hits
    longest = max(len(r.hash_ids) for r in trace)
    if lo >= longest:   # LRU's inclusion property needs every request to fit (nothing shed)
        assert tt.simulate(trace, hi, "lru").hits >= tt.simulate(trace, lo, "lru").hits


def test_capacity_monotonic_on_mooncake() -> None:
    trace = mooncake(1500)
    caps = [400, 800, 1600, 3200, 6400]
    for name, run in (("lru", lambda c: tt.simulate(trace, c, "lru")), ("belady", lambda c: tt.belady(trace, c))):
        hits = [run(c).hits for c in caps]
        assert hits == sorted(hits), (name, hits)


# ------------------------------------------------------------------------------------------- tiers

@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_tiers_with_no_disk_equal_the_host_only_sim(policy: str) -> None:
    trace = mooncake(800)
    for cap in (300, 2000):
        s = tt.simulate(trace, cap, policy)
        t = tt.simulate_tiers(trace, cap, 0, policy, "lru", "all")
        assert t.disk_hits == t.disk_inserts == t.promotes == 0
        assert (t.host_hits, t.host_inserts, t.host_evictions, t.host_shed, t.tokens_saved) == \
            (s.hits, s.inserts, s.evictions, s.shed, s.tokens_saved)
        assert t.host_bytes_written == s.bytes_written


def test_two_tiers_with_a_big_disk_hit_like_an_infinite_cache() -> None:
    trace = mooncake(800)
    stats = tt.trace_stats(trace)
    host = stats["max_blocks"]   # every request fits: nothing is shed
    t = tt.simulate_tiers(trace, host, stats["distinct_blocks"], "lru", "lru", "all")
    assert t.hits == round(stats["infinite_cache_hit_ratio"] * stats["block_refs"])
    assert t.disk_hits > 0 and t.promotes == t.disk_hits and t.disk_evictions == 0
    assert t.disk_inserts <= t.host_evictions
    assert t.disk_bytes_written == t.disk_inserts * tt.DEFAULT_BLOCK_BYTES


def test_two_tiers_small_hand_trace() -> None:
    # host 1, disk 2: 0 is spilled when 1 arrives, then hit on disk and promoted (1 spilled in turn)
    t = tt.simulate_tiers(reqs([0], [1], [0], [1]), 1, 2)
    assert (t.host_hits, t.disk_hits, t.promotes, t.disk_inserts, t.host_inserts) == (0, 2, 2, 2, 4)


# ------------------------------------------------------------------------------------------- sweep

def test_sweep_has_every_policy_and_belady() -> None:
    trace = mooncake(400)
    out = tt.sweep(trace, [50, 500])
    assert set(out["hit_ratio"]) == set(POLICIES) | {"belady"}
    for name, hr in out["hit_ratio"].items():
        assert len(hr) == 2 and all(0 <= x <= 1 for x in hr), name
        assert out["hit_ratio"]["belady"][0] >= hr[0] and out["hit_ratio"]["belady"][1] >= hr[1]
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        tt.sweep(trace, [10], ["nope"])


# ------------------------------------------------------------------------------------- block bytes

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}


def test_model_block_bytes() -> None:
    assert tt.model_block_bytes(32, 8, 128, "bfloat16") == 64 << 20
    assert tt.model_block_bytes(32, 8, 128, "torch.float16", 16) == 2 << 20
    assert tt.model_block_bytes(80, 8, 128, "float8_e4m3fn") == 80 << 20
    assert tt.model_block_bytes(1, 1, 1, "float32", 1) == 8
    assert tt.model_block_bytes(1, 1, 1, "int8", 1) == 2
    with pytest.raises(ValueError, match="unknown dtype 'float12'"):
        tt.model_block_bytes(32, 8, 128, "float12")
    with pytest.raises(ValueError, match="layers must be a positive int, got 0"):
        tt.model_block_bytes(0, 8, 128, "bf16")


def test_model_from_hf_config(tmp_path: Path) -> None:
    m = tt.model_from_hf_config(LLAMA3_8B)
    assert (m.layers, m.kv_heads, m.head_dim, m.dtype) == (32, 8, 128, "bfloat16")
    assert m.block_bytes == 64 << 20
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA3_8B), encoding="utf-8")
    assert tt.model_from_hf_config(p, dtype="float8").block_bytes == 32 << 20
    # no num_key_value_heads: multi-head attention; explicit head_dim wins over hidden/heads
    mha = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    assert tt.model_from_hf_config(mha).kv_heads == 32
    assert tt.model_from_hf_config({**LLAMA3_8B, "head_dim": 256}).head_dim == 256
    assert tt.model_from_hf_config({"text_config": LLAMA3_8B}).block_bytes == 64 << 20
    assert tt.model_from_hf_config({**LLAMA3_8B, "torch_dtype": None, "dtype": "float16"}).dtype == "float16"


@pytest.mark.parametrize("cfg, what", [
    ({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"}, "missing field 'num_hidden_layers'"),
    ({k: v for k, v in LLAMA3_8B.items() if k not in ("num_key_value_heads", "num_attention_heads")},
     "missing field 'num_attention_heads'"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "hidden_size"}, "missing field 'head_dim'"),
    ({k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}, "missing field 'torch_dtype'"),
    ({**LLAMA3_8B, "torch_dtype": "float64"}, "unknown dtype 'float64'"),
    ({**LLAMA3_8B, "num_hidden_layers": "32"}, "'num_hidden_layers' must be a positive int"),
    ({**LLAMA3_8B, "hidden_size": 4000, "num_attention_heads": 48}, "not a multiple of num_attention_heads"),
])
def test_model_from_hf_config_errors(cfg: dict, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        tt.model_from_hf_config(cfg)


def test_model_from_hf_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read model config"):
        tt.model_from_hf_config(tmp_path / "missing.json")
    p = tmp_path / "bad.json"
    p.write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=f"model config {p} is not JSON"):
        tt.model_from_hf_config(p)


# -------------------------------------------------------------------------------------- generators

@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_generators_are_deterministic_and_valid(kind: str, tmp_path: Path) -> None:
    gen = tg.GENERATORS[kind]
    a = gen(1500, 7)
    assert a == gen(1500, 7)
    assert a != gen(1500, 8)
    assert a[:300] == gen(300, 7)   # a prefix of a longer run: the committed traces can be checked cheaply
    ts = [r.timestamp for r in a]
    assert all(type(t) is int for t in ts) and all(x < y for x, y in zip(ts, ts[1:]))
    assert all(-(-r.input_length // 512) == len(r.hash_ids) and r.output_length > 0 for r in a)
    assert tt.prefix_consistent(a)
    stats = tt.trace_stats(a)
    assert stats["distinct_blocks"] < stats["block_refs"] and stats["infinite_cache_hit_ratio"] > 0.5
    p = tmp_path / f"{kind}.jsonl"
    assert tg.main([kind, str(p), "--requests", "1500", "--seed", "7"]) == 0
    assert tt.read_trace(p) == a


@pytest.mark.parametrize("kind", ["chat", "agent"])
def test_committed_traces_come_from_the_generators(kind: str) -> None:
    p = TRACES / f"{kind}_synthetic_trace.jsonl"
    if not p.is_file():
        pytest.skip(f"{p} not in this checkout")
    assert tt.read_trace(p, 400) == tg.GENERATORS[kind](400, 0)


def test_generators_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="n_requests must be a positive int, got 0"):
        tg.gen_chat(0, 1)
    with pytest.raises(ValueError, match="seed must be an int, got '1'"):
        tg.gen_agent(5, "1")   # type: ignore[arg-type]


def test_the_generator_cli_names_a_bad_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tg.main(["chat", str(tmp_path / "c.jsonl"), "--requests", "0"]) == 2
    assert "n_requests must be a positive int, got 0" in capsys.readouterr().err
