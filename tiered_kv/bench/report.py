"""Turns the sections' raw results into figures (value, baseline, ratio, target, met) and tables.

A *figure* is one comparison, a flat dict with at least these keys (the JSON
schema the tests check)::

    id, section, name, unit, better ("higher" | "lower"),
    value, baseline, baseline_name, vs (short baseline label), ratio (value / baseline),
    target (text, or None), target_on ("ratio" | "value" | None), target_op (">=" | "<="),
    target_threshold, met (True | False | None when there is no target or it was skipped),
    stats ({"value": summary, "baseline": summary} as median/p90/p99/max, where the section has them),
    source (issue and section the target comes from), note, skipped (None, or why it did not run)

Non-finite numbers become None (strict JSON).  No absolute figure is reported
without its baseline: each figure carries both.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional

from . import busy as _busy
from . import core as _core
from . import disk as _disk
from . import remote as _remote
from . import step as _step
from . import trace as _trace
from .common import TARGETS, GiB, KiB, MiB

__all__ = ["collect_figures", "format_table", "format_markdown", "format_details", "clean", "revive", "problems"]

_ISSUE2 = "issue 2 section 8"
_ISSUE3 = "issue 3 section 9"
_ISSUE22 = "issue 22 section 2"
_ISSUE22_3 = "issue 22 section 3"
_ISSUE22_4 = "issue 22 section 4"
_ISSUE22_5 = "issue 22 section 5"
_ISSUE25 = "issue 25"
_ISSUE26 = "issue 26"
_ISSUE_REMOTE = "remote tier issue (bench)"


def _evict_runs(e: dict[str, Any]) -> str:
    """", median of N runs (pairs a-b)" for a repeated full-and-evicting section; "" for one run."""
    pairs = [x for x in (e.get("ratios") or {}).get("tkv_steady_vs_raw_circular_runs") or [] if x is not None]
    if len(pairs) < 2:
        return ""
    return f", median of {len(pairs)} runs each (paired ratios {min(pairs):.2f}-{max(pairs):.2f}x)"


def clean(x: Any) -> Any:
    """A copy of ``x`` with NaN/inf replaced by None and tuples made lists (strict JSON)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


_MEASURED = re.compile(r"(^|_)(ratio|ratios|gbps|mb_s|fraction|us|seconds|median|mean|min|max|p90|p99)(_|$)")


def revive(x: Any, measured: bool = False) -> Any:
    """:func:`clean` undone where it matters: a saved result's ``null`` back to NaN in the values the
    bench measures (a ``summarize()`` of no samples, a ratio without a baseline, a rate, a fraction),
    so that ``--from-json`` formats them as the run did; a ``null`` meaning "none" (``skipped``, a
    missing section) stays None."""
    if isinstance(x, dict):
        stats = "n" in x and "median" in x   # a summarize() result: every number in it is measured
        return {k: x[k] if k == "skipped" else revive(v, measured or stats or bool(_MEASURED.search(k)))
                for k, v in x.items()}
    if isinstance(x, list):
        return [revive(v, measured) for v in x]
    return float("nan") if x is None and measured else x


def _num(x: Any) -> Optional[float]:
    if x is None:
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def _fig(section: str, fid: str, name: str, unit: str, value: Any, baseline: Any, baseline_name: str, vs: str, *,
         better: str = "higher", target_on: Optional[str] = None, op: str = ">=", threshold: Optional[float] = None,
         ratio: Any = "auto", stats: Optional[dict[str, Any]] = None, source: Optional[str] = None, note: str = "",
         skipped: Optional[str] = None) -> dict[str, Any]:
    v, b = _num(value), _num(baseline)
    r = _num(v / b) if ratio == "auto" and v is not None and b else (None if ratio == "auto" else _num(ratio))
    target = None
    met: Optional[bool] = None
    if target_on is not None and threshold is not None:
        if target_on == "ratio":
            target = f"{op} {threshold:g}x {vs}"
        else:
            target = f"{op} {threshold:,.6g} {unit}"
        x = r if target_on == "ratio" else v
        if skipped is None and x is not None and b is None:   # every figure is judged beside its baseline
            skipped = "its baseline was not measured"
        if skipped is None and x is not None:
            met = bool(x >= threshold) if op == ">=" else bool(x <= threshold)
    return {"id": fid, "section": section, "name": name, "unit": unit, "better": better,
            "value": v, "baseline": b, "baseline_name": baseline_name, "vs": vs, "ratio": r,
            "target": target, "target_on": target_on, "target_op": op if target else None,
            "target_threshold": threshold if target else None, "met": met,
            "stats": clean(stats) if stats else None, "source": source, "note": note, "skipped": skipped}


# ----------------------------------------------------------------------------- core sections
def _core_figures(c: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    lc = c.get("lifecycles")
    if lc:
        for v in lc["variants"]:
            t, b = v["tiered_kv"], v["baseline"]
            batched = v.get("batched", False)
            seq = ("store_many->report->poll" if batched else
                   "store->cancel->late report" if "cancel" in v["name"] else "store->report->poll")
            out.append(_fig(
                "control path", f"control.lifecycles.{v['name']}",
                f"{'blocks' if batched else 'lifecycles'}, {seq}, {v['poll_every_n_stores']} "
                f"{'keys per call and poll' if batched else 'stores per poll' if v['poll_every_n_stores'] > 1 else 'poll per store'}",
                "blocks/s" if batched else "lifecycles/s",
                t["lifecycles_per_cpu_s"], b["lifecycles_per_cpu_s"],
                "UnsafeDictOffloader: the unsafe original as plain dicts, one store() per block" if batched else
                "UnsafeDictOffloader: the unsafe original as plain dicts, same operations", "dict original",
                target_on="value",
                threshold=TARGETS["store_many_blocks_per_cpu_s" if batched else "lifecycles_per_cpu_s"],
                stats={"value": t["cpu_us_per_lifecycle"], "baseline": b["cpu_us_per_lifecycle"]},
                source=_ISSUE2, note=f"per CPU second of the one pinned engine thread; wall-clock ratio "
                                     f"{v['ratio_wall_tiered_kv_over_baseline']:.3f}"))
    sl = c.get("store_latency")
    if sl:
        out.append(_store_p99(
            sl, "control path", "control.store_p99", f"store() p99, {sl['num_copy_workers']} copy workers busy",
            "the unsafe original's store() feeding its own ThreadMover, same rows and pacing",
            f"poll() p99 {sl['tiered_kv']['poll']['p99']:.1f} us (baseline {sl['baseline_figures']['poll']['p99']:.1f})"))
    h = c.get("host_throughput")
    if h:
        for s in h["sizes"]:
            for d in ("store", "load"):
                x = s[d]
                t, b = x["tiered_kv"], x["baseline_raw_copy_1_thread"]
                out.append(_fig(
                    "host tier", f"host.{d}.{s['block_bytes']}", f"host {d}, {_size(s['block_bytes'])} blocks", "GB/s",
                    t["gb_per_s"], b["gb_per_s"], "raw per-block torch copy_ into preallocated memory, one thread",
                    "raw copy_", target_on="ratio", threshold=TARGETS["host_copy_vs_raw_copy"],
                    stats={"value": t["seconds_per_pass"], "baseline": b["seconds_per_pass"]}, source=_ISSUE2,
                    note=f"GB/s worst..best {t['gb_per_s_worst']:.2f}..{t['gb_per_s_best']:.2f}; vs raw copy_ "
                         f"with torch's default threads {x['ratio_tiered_kv_over_raw_default_threads']:.2f}x"))
            if "tiered_kv_batched" not in s["store"]:   # results saved before the batched passes
                continue
            for d in ("store", "load"):
                x = s[d]
                big = s["block_bytes"] <= 256 * KiB
                for kind, key, label in (("batched", "tiered_kv_batched", "rows in order"),
                                         ("batched_scattered", "tiered_kv_batched_scattered", "rows scattered")):
                    t, b = x[key], x["baseline_one_large_copy"]
                    tgt = kind == "batched" and big
                    out.append(_fig(
                        "host tier", f"host.{kind}.{d}.{s['block_bytes']}",
                        f"host {d}, store_many/load_many of {h.get('step_blocks', 64)} x "
                        f"{_size(s['block_bytes'])}, {label}", "GB/s", t["gb_per_s"], b["gb_per_s"],
                        "one copy_ of the same bytes between two contiguous tensors, torch's default threads",
                        "one large copy_", target_on="ratio" if tgt else None,
                        threshold=TARGETS["host_batched_vs_large_copy"] if tgt else None,
                        stats={"value": t["seconds_per_pass"], "baseline": b["seconds_per_pass"]},
                        source=_ISSUE25 if tgt else None,
                        note=f"GB/s worst..best {t['gb_per_s_worst']:.2f}..{t['gb_per_s_best']:.2f}; the per-block "
                             f"API {x['tiered_kv']['gb_per_s']:.2f} GB/s ({x['ratio_per_block_over_large_copy']:.2f}x)"))
        fs = h.get("fresh_slab")
        if fs:
            g = fs["gb_per_s"]
            out.append(_fig(
                "host tier", "host.store.fresh_slab",
                f"host store, first pass into a new manager's slab, {_size(fs['block_bytes'])} blocks", "GB/s",
                g["prefault_pass"], g["raw"], "raw per-block torch copy_ into memory faulted in beforehand, one thread",
                "raw copy_", target_on="ratio", threshold=TARGETS["host_copy_vs_raw_copy"],
                stats={"value": fs["seconds"]["prefault_pass"], "baseline": fs["seconds"]["raw"]}, source=_ISSUE22,
                note=f"with prefault_host_memory (populated by {fs['populated']}); without it (huge pages still advised) "
                     f"{g['lazy_pass']:.2f} GB/s ({fs['ratio_first_pass_without_prefault_over_raw']:.2f}x); "
                     f"manager start {fs['start_seconds_per_gib']['prefault']:.2f} s per GiB of slab with it, "
                     f"{fs['start_seconds_per_gib']['lazy']:.2f} s without"))
    cu = c.get("cuda_copy")
    if cu is not None:
        if cu.get("skipped"):
            out.append(_fig("CUDA links", "cuda.copy", "device->host and host->device GB/s", "GB/s", None, None,
                            "torch copy_ between the same device rows and pinned slab", "torch copy_",
                            target_on="ratio", threshold=TARGETS["cuda_copy_vs_torch_copy"], source=_ISSUE2,
                            skipped=cu["skipped"]))
        for s in cu.get("sizes", []):
            for d in ("store", "load"):
                x = s[d]
                t, b = x["tiered_kv"], x["baseline_torch_copy"]
                out.append(_fig(
                    "CUDA links", f"cuda.{d}.{s['block_bytes']}", f"{x['link']}, {_size(s['block_bytes'])} blocks",
                    "GB/s", t["gb_per_s"], b["gb_per_s"], "torch copy_ between the same device rows and pinned slab",
                    "torch copy_", target_on="ratio", threshold=TARGETS["cuda_copy_vs_torch_copy"],
                    stats={"value": t["seconds_per_pass"], "baseline": b["seconds_per_pass"]}, source=_ISSUE2))
            if "tiered_kv_batched" in s["store"]:   # issue 25's rows (results saved before have none)
                for d in ("store", "load"):
                    x = s[d]
                    tgt = s["block_bytes"] <= 2 * MiB
                    t, b = x["tiered_kv_batched"], x["baseline_one_large_copy"]
                    out.append(_fig(
                        "CUDA links", f"cuda.batched.{d}.{s['block_bytes']}",
                        f"{x['link']}, store_many/load_many of 64 x {_size(s['block_bytes'])}", "GB/s",
                        t["gb_per_s"], b["gb_per_s"], "one copy_ of the same bytes between the device tensor and "
                        "the pinned slab", "one large copy_", target_on="ratio" if tgt else None,
                        threshold=TARGETS["cuda_batched_vs_large_copy"] if tgt else None,
                        stats={"value": t["seconds_per_pass"], "baseline": b["seconds_per_pass"]},
                        source=_ISSUE25 if tgt else None,
                        note=f"engine-thread CPU per step of 64 {d}s + poll, mean "
                             f"{x['engine_cpu_us_per_step']['mean']:.0f} us (a step of 64 stores + 64 loads: "
                             f"{s['engine_cpu_us_per_step_of_stores_and_loads']:.0f} us"
                             + (f"; on the per-block copies {s['engine_cpu_us_per_step_of_stores_and_loads_batched_per_block']:.0f} us"
                                if "tiered_kv_batched_per_block" in x else "") + ")"))
                    if "tiered_kv_batched_scattered" in x:
                        t = x["tiered_kv_batched_scattered"]
                        out.append(_fig(
                            "CUDA links", f"cuda.batched_scattered.{d}.{s['block_bytes']}",
                            f"{x['link']}, store_many/load_many of 64 x {_size(s['block_bytes'])}, rows shuffled "
                            "(gathered/scattered on the device)", "GB/s", t["gb_per_s"], b["gb_per_s"],
                            "one copy_ of the same bytes between the device tensor and the pinned slab",
                            "one large copy_", stats={"value": t["seconds_per_pass"], "baseline": b["seconds_per_pass"]},
                            note=f"engine-thread CPU per step, mean {x['engine_cpu_us_per_step_batched_scattered']['mean']:.0f} us"))
            # issue 25: the engine thread's CPU per CUDA step
            if "engine_cpu_us_per_step_of_stores_and_loads_batched_per_block" in s and s["block_bytes"] <= 2 * MiB:
                out.append(_fig(
                    "CUDA links", f"cuda.step_cpu.{s['block_bytes']}",
                    f"engine-thread CPU per step of 64 stores + 64 loads, {_size(s['block_bytes'])} blocks", "us",
                    s["engine_cpu_us_per_step_of_stores_and_loads"],
                    s["engine_cpu_us_per_step_of_stores_and_loads_batched_per_block"],
                    "the same store_many/load_many on the per-block copies (CudaMover(batched=False): a copy_ and "
                    "bookkeeping per block)", "per-block copies", better="lower", target_on="value", op="<=",
                    threshold=TARGETS["copy_step_engine_cpu_us"], source=_ISSUE25,
                    note="means over the batched passes above (rows in order), store steps + load steps, issued "
                         "back to back (the link saturated, not paced as an engine's steps)"
                         + (f"; one CUDA call on this host: an event record + query "
                            f"{cu['call_costs']['event_record_and_query_us']:.1f} us, a copy_ "
                            f"{cu['call_costs']['copy_call_us']:.1f} us" if cu.get("call_costs") else "")))
        w = cu.get("worker_layout")
        if w:   # the vLLM worker's copier layout, grouped (the default) against block by block
            for d in ("store", "load"):
                g, pb = w["grouped"][d], w["per_block"][d]
                out.append(_fig(
                    "CUDA links", f"cuda.worker_layout.{d}",
                    f"vLLM worker layout, {w['kv_tensors']} KV tensors x {_size(w['plane_bytes'])} side by side in a "
                    f"slab row, steps of {w['blocks_per_step']} blocks", "GB/s", g["gb_per_s"],
                    w[f"baseline_one_copy_{d}_gb_per_s"], "one copy_ of a step's bytes between a contiguous device "
                    "buffer and the slab", "one copy_",
                    note=f"block by block {pb['gb_per_s']:.2f} GB/s; engine-thread CPU per step, mean: grouped "
                         f"{g['engine_cpu_us_per_step']['mean']:.0f} us, block by block "
                         f"{pb['engine_cpu_us_per_step']['mean']:.0f} us; failed, missing or wrong: "
                         f"{w['grouped']['problems']} and {w['per_block']['problems']}"))
        cl = cu.get("store_latency")
        if cl:
            out.append(_store_p99(
                cl, "CUDA links", "cuda.store_p99", f"store() p99 on a CUDA KV tensor ({cl['mover']})",
                "the unsafe original's store() queuing the same side-stream copy and event",
                _cuda_poll_note(cl)))
    return out


def _cuda_poll_note(cl: dict[str, Any]) -> str:
    """What the engine thread pays besides store(): the copies go to the device in poll()."""
    t, b = cl["tiered_kv"], cl["baseline_figures"]
    note = (f"copy_batch_max={cl.get('copy_batch_max', '?')}: the copies are queued on the device in poll(), "
            f"p50/p99 {t['poll']['median']:.0f}/{t['poll']['p99']:.0f} us (baseline "
            f"{b['poll']['median']:.0f}/{b['poll']['p99']:.0f})")
    if t.get("engine_us_per_step_mean") and b.get("engine_us_per_step_mean"):
        note += (f"; engine thread per step (stores + poll), mean {t['engine_us_per_step_mean']:.0f} us, "
                 f"baseline {b['engine_us_per_step_mean']:.0f} us")
    return note


def _store_p99(sl: dict[str, Any], section: str, fid: str, name: str, baseline_name: str, more: str) -> dict[str, Any]:
    """A store() latency section's p99 figure beside the unsafe original's (target: a ratio, issue 22 section 4)."""
    t, b = sl["tiered_kv"]["store_all_calls"], sl["baseline_figures"]["store_all_calls"]
    return _fig(section, fid, name, "us", t["p99"], b["p99"], baseline_name, "dict original", better="lower",
                target_on="ratio", op="<=", threshold=TARGETS["store_p99_vs_unsafe_copies_running"],
                stats={"value": t, "baseline": b}, source=_ISSUE22_4,
                note=f"p50 {t['median']:.1f} / max {t['max']:.0f} us; {more}")


# ----------------------------------------------------------------------------- disk sections
def _dc_missing(d: dict[str, Any]) -> Optional[str]:
    return _disk.DISKCACHE_MISSING if d.get("diskcache", "installed") != "installed" else None


def _disk_figures(d: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    missing = _dc_missing(d)
    for s in d.get("spill", []):
        f, bb, dur = s["figures"], s["block_bytes"], s["durability"]
        tag = f"{_size(bb)}, durability={dur}"
        shed = (f"{s['spills_shed_total']} spills shed: the figure is not the whole working set's"
                if s["spills_shed_total"] else None)
        out.append(_fig(
            "disk tier", f"disk.spill.{bb}.{dur}", f"spill until flush(), {tag}", "GB/s",
            f["tkv"]["median"], f["raw_fresh"]["median"],
            f"os.write into a fresh file + fsync every {s['raw_fsync_every_blocks']} blocks", "raw write+fsync",
            target_on="ratio", threshold=TARGETS["spill_vs_raw_write_fsync"],
            stats={"value": f["tkv"], "baseline": f["raw_fresh"]}, source=_ISSUE3,
            note=f"vs in-place pwrite of a pre-written file {s['ratios']['tkv_vs_raw_overwrite']:.2f}x; "
                 f"spills shed {s['spills_shed_total']}",
            skipped=shed))
        tgt = TARGETS["spill_vs_diskcache"] if bb == 2 * MiB else None
        if "diskcache" in f:   # the same partial rate against diskcache's whole set: no verdict either
            out.append(_fig(
                "disk tier", f"disk.spill_vs_diskcache.{bb}.{dur}", f"spill vs diskcache, {tag}", "GB/s",
                f["tkv"]["median"], f["diskcache"]["median"], "diskcache.Cache.set() per block, then syncfs()",
                "diskcache", target_on="ratio" if tgt else None, threshold=tgt,
                stats={"value": f["tkv"], "baseline": f["diskcache"]}, source=_ISSUE3 if tgt else None,
                note=f"vs set() without syncfs (not durable) {s['ratios']['tkv_vs_diskcache_set']:.2f}x",
                skipped=shed))
        elif missing and bb == 2 * MiB:
            out.append(_fig("disk tier", f"disk.spill_vs_diskcache.{bb}.{dur}", f"spill vs diskcache, {tag}", "GB/s",
                            f["tkv"]["median"], None, "diskcache.Cache.set() per block, then syncfs()", "diskcache",
                            target_on="ratio", threshold=tgt, source=_ISSUE3, skipped=missing))
    for p in d.get("promote", []):
        bb = p["block_bytes"]
        for st in ("cold", "warm"):
            f = p["figures"].get(st) or {}
            if "tkv" not in f:
                continue
            dropped = p.get("drop_caches_worked")
            state = ("page cache dropped" if dropped else "page cache NOT dropped") if st == "cold" else "page cache warm"
            base = "raw_copy" if "raw_copy" in f else "raw"   # results saved before the pread + copy_ baseline
            out.append(_fig(
                "disk tier", f"disk.promote.{bb}.{st}", f"promote (load from disk), {_size(bb)}, {state}", "GB/s",
                f["tkv"]["median"], f[base]["median"],
                "pread() of each block into a buffer, then copy_ into its row (no checksum)" if base == "raw_copy"
                else "readinto() of the same bytes from one file, block by block",
                "raw pread+copy_" if base == "raw_copy" else "raw read", target_on="ratio",
                threshold=TARGETS["promote_vs_raw_pread_copy"],
                stats={"value": f["tkv"], "baseline": f[base]}, source=_ISSUE22_3 if base == "raw_copy" else _ISSUE3,
                note=f"misses {p['tkv_misses']}, failed {p['tkv_failed']}, wrong rows {p['tkv_bad_rows']}"))
            if "link" in f:
                # no target of its own: the issue's promote figure is the load above; this splits it
                out.append(_fig(
                    "disk tier", f"disk.promote_link.{bb}.{st}", f"promote, disk->host link alone, {_size(bb)}, {state}",
                    "GB/s", f["link"]["median"], f["raw"]["median"],
                    "readinto() of the same bytes from one file, block by block", "raw read",
                    stats={"value": f["link"], "baseline": f["raw"]},
                    note=(f"the same loads, host->row copies answered without copying (ImmediateMover); "
                          f"misses {p.get('link_misses', 0)}, failed {p.get('link_failed', 0)}, "
                          f"wrong blocks {p.get('link_bad_blocks', 0)} (of the last 16 loaded; "
                          f"{p.get('link_evicted_before_check', 0)} evicted before the check)")))
            one = (p.get("one_at_a_time") or {}).get(st)
            if one and not one.get("skipped"):
                out.append(_fig(
                    "disk tier", f"disk.promote_one.{bb}.{st}", f"one load from disk at a time, {_size(bb)}, {state}",
                    "us", one["tkv_us"]["median"], one["raw_us"]["median"],
                    "one pread() into a buffer + copy_ into the row, per block (no checksum)", "raw pread+copy_",
                    better="lower", target_on="ratio", op="<=", threshold=TARGETS["one_promote_vs_raw_pread_copy"],
                    stats={"value": one["tkv_us"], "baseline": one["raw_us"]}, source=_ISSUE22_3,
                    note=f"load(key, row) then wait([job]), {one['blocks']} blocks one by one, median per block; "
                         f"p90 {one['tkv_us']['p90']:.0f} us (baseline {one['raw_us']['p90']:.0f}); "
                         f"misses {one['misses']}, failed {one['failed']}, wrong rows {one['bad_rows']}"))
            ar = (p.get("after_reopen") or {}).get(st)
            if ar:
                # no target of its own (the issue's promote figure is the load above): what a restarted server meets
                out.append(_fig(
                    "disk tier", f"disk.promote_reopen.{bb}.{st}",
                    f"promote right after a reopen (new disk I/O process), {_size(bb)}, {state}", "GB/s",
                    ar["tkv"]["median"], ar["raw_copy"]["median"],
                    "pread() of each block into a buffer, then copy_ into its row (no checksum)", "raw pread+copy_",
                    stats={"value": ar["tkv"], "baseline": ar["raw_copy"]},
                    note=f"a reopen then load() of a working set, {ar['rounds']} rounds; misses {ar['misses']}, "
                         f"failed {ar['failed']}, wrong rows {ar['bad_rows']}"))
            tgt = TARGETS["promote_vs_diskcache"] if bb == 2 * MiB else None
            if "diskcache" in f:
                out.append(_fig(
                    "disk tier", f"disk.promote_vs_diskcache.{bb}.{st}", f"promote vs diskcache, {_size(bb)}, {state}",
                    "GB/s", f["tkv"]["median"], f["diskcache"]["median"], "diskcache.Cache.get() of every key",
                    "diskcache", target_on="ratio" if tgt else None, threshold=tgt,
                    stats={"value": f["tkv"], "baseline": f["diskcache"]}, source=_ISSUE3 if tgt else None))
            elif missing and bb == 2 * MiB:
                out.append(_fig("disk tier", f"disk.promote_vs_diskcache.{bb}.{st}",
                                f"promote vs diskcache, {_size(bb)}, {state}", "GB/s", f["tkv"]["median"], None,
                                "diskcache.Cache.get() of every key", "diskcache", target_on="ratio", threshold=tgt,
                                source=_ISSUE3, skipped=missing))
    e = d.get("evicting")
    if e:
        t, cap = e["tkv"], e["capacity_bytes"]
        overall = e.get("tkv_overall_gbps_median", t["gbps"])   # results saved before it: the median run's
        tag = _size(e["block_bytes"])
        sizes = f"capacity {cap // MiB} MiB, {e['bytes_written'] // MiB} MiB written"
        out.append(_fig(
            "disk tier", "disk.evicting.spill", f"spill, tier full and evicting, {tag}", "GB/s",
            t["steady_gbps_median"], e["raw_circular"]["gbps"],
            "pwrite in place, round robin over a pre-written file of the capacity, fsync per batch", "raw circular",
            target_on="ratio", threshold=TARGETS["spill_vs_raw_write_fsync"],
            stats={"value": t["window_gbps"]}, source=_ISSUE3,
            note=f"{sizes}; median of steady-state windows (first fill discarded){_evict_runs(e)}; overall "
                 f"{overall:.3f} GB/s = {e['ratios']['tkv_overall_vs_raw_circular']:.2f}x; evictions "
                 f"{t['evictions']}, shed {t['spills_shed']}"))
        out.append(_fig(
            "disk tier", "disk.evicting.file_vs_capacity", "slot file + data.mdb size / capacity, full and evicting", "x capacity",
            t["file_vs_capacity_end"], 1.0, "the raw circular file: exactly the capacity", "raw circular",
            better="lower", target_on="value", op="<=", threshold=TARGETS["disk_files_vs_capacity"], source=_ISSUE3,
            note=f"peak {t['file_vs_capacity_peak']:.2f}x"
                 + (f"; diskcache dir {e['diskcache']['dir_vs_capacity_end']:.2f}x" if "diskcache" in e else "")))
        if "diskcache" in e:
            out.append(_fig(
                "disk tier", "disk.evicting.vs_diskcache", f"spill vs diskcache, full and evicting, {tag}", "GB/s",
                overall, e["diskcache"]["gbps"], "diskcache.Cache(size_limit=capacity).set(), then syncfs()",
                "diskcache", target_on="ratio", threshold=TARGETS["spill_vs_diskcache"], source=_ISSUE3,
                note=f"{sizes}; overall rates, first fill included, for both"))
        elif missing:
            out.append(_fig("disk tier", "disk.evicting.vs_diskcache", f"spill vs diskcache, full and evicting, {tag}",
                            "GB/s", overall, None, "diskcache.Cache(size_limit=capacity).set(), then syncfs()",
                            "diskcache", target_on="ratio", threshold=TARGETS["spill_vs_diskcache"],
                            source=_ISSUE3, skipped=missing))
    lat = d.get("latency")
    if lat:
        sat, idle = lat["saturated"], lat["no_disk_tier"]
        w = sat.get("writer") or {}
        for call in ("store", "lookup", "load", "poll"):
            a, b = sat["calls_us"].get(call), idle["calls_us"].get(call)
            if not a:
                continue
            tgt = TARGETS["engine_call_p99_vs_no_disk"] if call != "poll" else None
            out.append(_fig(
                "engine thread, writer saturated", f"latency.{call}", f"{call}() p99, disk writer saturated", "us",
                a["p99"], (b or {}).get("p99"), "the same engine loop on a manager without a disk tier",
                "no disk tier", better="lower", target_on="ratio" if tgt else None, op="<=", threshold=tgt,
                stats={"value": a, "baseline": b}, source=_ISSUE22_4 if tgt else None,
                note=f"p50 {a['median']:.1f} / max {a['max']:.0f} us (no disk tier: p50 "
                     f"{(b or {}).get('median', float('nan')):.1f} / max {(b or {}).get('max', float('nan')):.0f}); "
                     f"writer busy {w.get('writer_busy_fraction', float('nan')):.2f}, "
                     f"spills shed {sat.get('spills_shed_backpressure')}"))
    return out


# ----------------------------------------------------------------------------- end to end
def _e2e_figures(e: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    m = e["modes"]
    base = m["none"]
    for mode in ("host", "disk"):
        x, lab = m[mode], m[mode]["label"]
        out.append(_fig("end to end", f"e2e.hit_rate.{mode}", f"prefix hit rate, {lab}", "fraction",
                        x["prefix_hit_rate"]["median"], base["prefix_hit_rate"]["median"],
                        "the same workload and seed with no offload", "no offload", ratio=None,
                        stats={"value": x["prefix_hit_rate"], "baseline": base["prefix_hit_rate"]},
                        note="ratio undefined: the baseline hits nothing"))
        out.append(_fig("end to end", f"e2e.recompute_avoided.{mode}", f"recompute avoided, {lab}", "tokens",
                        x["recompute_avoided_tokens"]["median"], base["recompute_avoided_tokens"]["median"],
                        "the same workload and seed with no offload", "no offload", ratio=None,
                        stats={"value": x["recompute_avoided_tokens"]}, note=f"{e['steps_per_run']} engine steps"))
        out.append(_fig("end to end", f"e2e.recomputed_fraction.{mode}", f"tokens recomputed / needed, {lab}",
                        "fraction", x["recomputed_fraction"]["median"], base["recomputed_fraction"]["median"],
                        "the same workload and seed with no offload", "no offload", better="lower",
                        stats={"value": x["recomputed_fraction"], "baseline": base["recomputed_fraction"]}))
        out.append(_fig("end to end", f"e2e.steps_per_s.{mode}", f"engine steps/s, {lab}", "steps/s",
                        x["steps_per_s"]["median"], base["steps_per_s"]["median"],
                        "the same workload and seed with no offload", "no offload",
                        stats={"value": x["steps_per_s"], "baseline": base["steps_per_s"]},
                        note="a CPU simulation: copies and the disk writer share the cores with the engine loop"))
    out.append(_fig("end to end", "e2e.hit_rate.disk_vs_host", "prefix hit rate, host+disk vs host only", "fraction",
                    m["disk"]["prefix_hit_rate"]["median"], m["host"]["prefix_hit_rate"]["median"],
                    "the same workload and seed, host tier only", "host only",
                    note=f"hits on disk (median run): {_median_run(m['disk'], 'disk')}"))
    return out


# ----------------------------------------------------------------------------- trace replay
def _trace_figures(t: dict[str, Any]) -> list[dict[str, Any]]:
    skipped = t.get("skipped")
    out: list[dict[str, Any]] = []
    for tier, lab, tgt in (("host", "host only", "trace_refs_per_s_host"),
                           ("disk", "host + disk", "trace_refs_per_s_disk")):
        x, b = t.get(tier, {}), t.get("dict", {})
        out.append(_fig("trace replay", f"trace.refs_per_s.{tier}",
                        f"Mooncake trace replay, {lab}: lookup/load_many/store_many/wait/free_block",
                        "refs/s", (x.get("refs_per_s") or {}).get("median"), (b.get("refs_per_s") or {}).get("median"),
                        "a plain OrderedDict LRU of the host tier's size: the same lookups and inserts, no jobs",
                        "dict LRU", target_on="value", threshold=TARGETS[tgt], source=_ISSUE22_5,
                        stats={"value": x.get("refs_per_s"), "baseline": b.get("refs_per_s")}, skipped=skipped,
                        note="" if skipped else
                        f"{t['block_refs']:,} block references, {t['row_bytes']}-byte rows; hit ratio "
                        f"{x['hit_ratio']:.3f} (baseline {b['hit_ratio']:.3f}); per CPU second of the engine thread "
                        f"{x['refs_per_cpu_s']['median']:,.0f}"))
    return out


def _step_figures(r: dict[str, Any]) -> list[dict[str, Any]]:
    t, b = r["tkv"], r["dict"]
    return [_fig("engine step", "step.engine_cpu_us",
                 f"engine step, {r['lookups']} lookups x {r['keys_per_lookup']} keys + load_many({r['loads']}) + "
                 f"store_many({r['stores']}) + poll, disk tier on", "us", t["cpu_us_mean"], b["cpu_us_mean"],
                 "the unsafe plain-dict original: the same lookups, one load() and store() per block, poll(); "
                 "no copies, no disk", "dict original", better="lower", target_on="value", op="<=",
                 threshold=TARGETS["step_engine_cpu_us"], source=_ISSUE22_5,
                 note=f"engine-thread CPU per step, mean of {r['steps']} steps (median of {r['repeats']} runs); "
                      f"p50 {t['cpu_us_p50']:.0f} / p99 {t['cpu_us_p99']:.0f} us; wall mean {t['wall_us_mean']:.0f} "
                      f"/ p99 {t['wall_us_p99']:.0f} us; {r['row_bytes']}-byte rows{_gc(t, b)}")]


def _copy_step_figures(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for compute, what in (("sleep", "sleeping"), ("busy", "busy in Python")):
        x = r[compute]
        t, pb, b = x["batched"], x["per_block"], x["dict"]
        c = r["runs"][compute]["batched"][0]["counts"]
        th = x.get("threads")
        tc = r["runs"][compute]["threads"][0]["counts"] if th is not None else None
        threads = ("" if th is None or tc is None else
                   f"; the Python copy threads (cpu_mover=\"threads\") {th['cpu_us_mean']:.0f} us, run 1: "
                   f"{tc['loads']} loads ({tc['loads_skipped_busy']} skipped: rows still loading), "
                   f"{tc['stores_none']} stores shed")
        out.append(_fig(
            "engine step", f"copy_step.engine_cpu_us.{compute}",
            f"engine step with copies, store_many({r['stores']}) + load_many({r['loads']}) + poll, "
            f"{r['row_bytes'] // 1024} KiB rows, engine {what} {r['compute_s'] * 1e3:g} ms between steps", "us",
            t["cpu_us_mean"], b["cpu_us_mean"],
            "the unsafe plain-dict original: one store() and load() per block, its own copy workers (one transfer "
            "per block), poll()", "dict original", better="lower", target_on="value", op="<=",
            threshold=TARGETS["copy_step_engine_cpu_us"], source=_ISSUE25,
            note=f"engine-thread CPU per step, mean of {r['steps']} steps (median of {r['repeats']} runs); p50 "
                 f"{t['cpu_us_p50']:.0f} / p99 {t['cpu_us_p99']:.0f} us; the per-block API (64 store() + 64 load()) "
                 f"{pb['cpu_us_mean']:.0f} us; run 1: {c['loads']} loads, {c['loads_none']} found their keys not yet "
                 f"stored, {c['loads_skipped_busy']} skipped (rows still loading), {c['stores_none']} stores shed"
                 f"{threads}{_gc(t, b)}"))
    return out


def _gc(t: dict[str, Any], b: dict[str, Any]) -> str:
    """The collector's share of tiered_kv's and the baseline's steps, for a step figure's note."""
    if not _step.gc_note(t):
        return ""
    return f"; {_step.gc_note(t)}; dict original: {_step.gc_note(b)}"


# ----------------------------------------------------------------------------- busy engine (issue 26)
def _busy_skip(*runs: Optional[dict[str, Any]]) -> Optional[str]:
    """Why a figure over these runs cannot be computed (a run missing or in error), else None."""
    for x in runs:
        if x is None:
            return "not run"
        if x.get("error"):
            return f"disk_io={x.get('disk_io')} did not run: {x['error']}"
    return None


def _shed_text(x: dict[str, Any]) -> str:
    by = x.get("shed_by_reason") or {}
    return f"{x['shed']:,.0f}" + (f" ({', '.join(f'{k} {v:,.0f}' for k, v in by.items())})" if by else "")


def _busy_figures(r: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    sec = "busy engine"
    tg = TARGETS
    idle_label = next(e for e in _busy.ENGINES if e[1] == "sleep")
    for io in _busy.DISK_IO:
        base = _busy.find_row(r, io, idle_label[0])
        for engine, kind, ms in _busy.ENGINES:
            if kind != "busy":
                continue
            x = _busy.find_row(r, io, engine)
            skipped = _busy_skip(x, base)
            note = ""
            if not skipped:
                assert x is not None and base is not None
                note = (f"{x['published']:,.0f} of {x['stores_done']:,.0f} stores published, shed {_shed_text(x)}, "
                        f"{x['written_mb_s']:.0f} MB/s published (offered {x['offered_mb_s']:.0f}); idle engine: "
                        f"shed {_shed_text(base)}; child processes started {x['child_processes_started']}")
                if x["stores_refused"]:
                    note += f"; stores refused {x['stores_refused']}"
            out.append(_fig(
                sec, f"busy.published_fraction.{io}.{engine}",
                f"spills published / stores, engine busy {ms:g} ms, disk_io={io}", "fraction",
                None if skipped else x["published_fraction"], None if skipped else base["published_fraction"],
                f"the same steps with the engine thread sleeping {idle_label[2]:g} ms (GIL free), same disk_io",
                "idle engine", target_on="value", threshold=tg["busy_published_fraction"], source=_ISSUE26,
                note=note, skipped=skipped))
    for engine, kind, ms in _busy.ENGINES:
        p, t = _busy.find_row(r, "process", engine), _busy.find_row(r, "thread", engine)
        skipped = _busy_skip(p, t)
        what = f"{'busy' if kind == 'busy' else 'sleeping'} {ms:g} ms"
        out.append(_fig(
            sec, f"busy.engine_cpu_us.{engine}",
            f"engine CPU per step, engine {what}, disk_io=process", "us",
            None if skipped else p["engine_cpu_us"]["mean"], None if skipped else t["engine_cpu_us"]["mean"],
            "the same steps with disk_io=thread (the writer and readers as threads of the engine's process)",
            "disk_io=thread", better="lower", target_on="ratio", op="<=",
            threshold=tg["busy_engine_cpu_process_vs_thread"], source=_ISSUE26, skipped=skipped,
            stats=None if skipped else {"value": p["engine_cpu_us"], "baseline": t["engine_cpu_us"]},
            note="" if skipped else
            f"engine-thread CPU of {r['stores_per_step']} store() + wait + free_block + poll() per step, mean over "
            f"{p['engine_cpu_us']['n']:,} steps; p99 {p['engine_cpu_us']['p99']:.0f} us (thread "
            f"{t['engine_cpu_us']['p99']:.0f}); the library's calls only, not the engine's own work"))
    pr = r.get("promote") or {}
    for io in ("process", "thread"):
        x = pr.get(io)
        skipped = _busy_skip(x)
        for stat, q in (("p50", "median"), ("p99", "p99")):
            target = io == "process"
            note = ""
            if not skipped:
                assert x is not None
                note = (f"after the {r['promote_engine_ms']:g} ms of engine work until wait() returns, "
                        f"{x['busy']['after_us']['n']} + {x['idle']['after_us']['n']} loads; load..wait {stat} "
                        f"{x['busy']['total_us'][q]:.0f} us busy / {x['idle']['total_us'][q]:.0f} us idle; "
                        f"child processes started {x['child_processes_started']}")
                if not target:
                    note = "disk_io=thread, for comparison with disk_io=process; " + note
            out.append(_fig(
                sec, f"busy.promote_{stat}.{io}",
                f"one load from disk {stat}, engine busy {r.get('promote_engine_ms', 5):g} ms, disk_io={io}", "us",
                None if skipped else x["busy"]["after_us"][q], None if skipped else x["idle"]["after_us"][q],
                f"the same loads with the engine thread sleeping {r.get('promote_engine_ms', 5):g} ms, same disk_io",
                "idle engine, loads", better="lower", target_on="ratio" if target else None, op="<=",
                threshold=tg["busy_promote_busy_vs_idle"] if target else None, source=_ISSUE26 if target else None,
                stats=None if skipped else {"value": x["busy"]["after_us"], "baseline": x["idle"]["after_us"]},
                note=note, skipped=skipped))
    return out


# ----------------------------------------------------------------------------- remote tier
def _remote_figures(r: dict[str, Any]) -> list[dict[str, Any]]:
    sec = "remote tier"
    out: list[dict[str, Any]] = []
    skipped = r.get("skipped")
    batch = r.get("batch_blocks", "?")
    base = {"put": (f"the same redis-py client class, pipelined SET EX of the same bytes, {batch} per pipeline",
                    "raw SET"),
            "get": (f"the same redis-py client class, pipelined GET of the same keys, {batch} per pipeline, "
                    f"xxh3-64 of each value checked", "raw GET+xxh3")}
    what = {"put": "store_many + wait + flush(): stored until every remote write answered",
            "get": "a second manager's lookup until the fetch landed in its host tier"}
    rows = r.get("sizes") or [{"block_bytes": bb, "blocks": n} for bb, n in r.get("plan_sizes") or []]
    for x in rows:
        bb = x["block_bytes"]
        tgt = _remote.TARGET_VS_RAW if bb in _remote.TARGET_SIZES else None
        # a run whose puts were shed, failed or refused moved less than the working set: no figure of its bytes (as
        # the spill's), neither of the get, which fetches what the put wrote; a fetch that did not land, held less
        # or whose bytes were not checked fails the get alone
        problems = x.get("problems") or []
        runs = (x.get("runs") or {}).get("tkv") or []
        put_bad = [r for r in runs if not r.get("flush_ok", True) or r.get("puts_ok", x["blocks"]) != x["blocks"]
                   or r.get("stores_refused") or r.get("puts_shed")]
        for op in ("put", "get"):
            f = x.get(op)
            bad = put_bad or (op == "get" and problems)
            why = skipped or (None if f else "not run") or (
                f"not every block moved ({len(problems)} problem(s): {problems[0] if problems else '?'})" if bad
                else None)
            note = ""
            if f:
                pr = [p for p in f["paired_ratios"] if p is not None and math.isfinite(p)]
                note = (f"{what[op]}; {x['blocks']} blocks ({_size(x['bytes'])}), median of {x['repeats']}"
                        + (f" (paired ratios {min(pr):.2f}-{max(pr):.2f}x)" if len(pr) > 1 else "")
                        + (f"; wrong rows {x['bad_rows']}" if op == "get" else "")
                        + ("" if tgt else "; small blocks: no target"))
            out.append(_fig(sec, f"remote.{op}.{bb}", f"remote {op}, {_size(bb)} blocks", "GB/s",
                            f["tkv"]["median"] if f else None, f["raw"]["median"] if f else None, base[op][0],
                            base[op][1], target_on="ratio" if tgt else None, threshold=tgt,
                            stats={"value": f["tkv"], "baseline": f["raw"]} if f else None,
                            source=_ISSUE_REMOTE if tgt else None, note=note, skipped=why))
    t = r.get("trace") or {}
    why = skipped or t.get("skipped") or (None if t else "not run")
    for who, label in (("b", "machine B's"), ("pair", "both machines'")):
        note = ""
        if not why:
            rm, ho = t["remote"], t["host_only"]
            note = (f"requests alternate between two managers (A even, B odd) sharing one server; {t['requests']} "
                    f"requests, {t['block_refs']:,} block references, {t['host_slots']} host slots each "
                    f"({t['host_fraction']:.1%} of {t['distinct_blocks']:,} distinct blocks); blocks found after a "
                    f"fetch {rm[who]['hits_after_fetch']:,}"
                    + (f", remote hits A {rm['a']['remote_hits']:,.0f} / B {rm['b']['remote_hits']:,.0f}"
                       if who == "pair" else f", remote hits {rm['b']['remote_hits']:,.0f}")
                    + f"; host only: {ho[who]['hits']:,} hits"
                    + (f"; one shared cache that never forgets: {t['unbounded_shared_hit_ratio']:.3f}"
                       if "unbounded_shared_hit_ratio" in t else ""))
        out.append(_fig(sec, f"remote.hit_ratio.{who}",
                        f"Mooncake trace on two machines, {label} block hit ratio, host + remote", "fraction",
                        None if why else t["remote"][who]["hit_ratio"],
                        None if why else t["host_only"][who]["hit_ratio"],
                        "the same replay without the remote tier (each machine's host tier only)", "host only",
                        note=note, skipped=why))
    return out


def _median_run(mode: dict[str, Any], tier: str) -> Any:
    runs = sorted(r["hits_by_tier"][tier] for r in mode["runs"])
    return runs[len(runs) // 2] if runs else None


def collect_figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure of a ``tiered-kv bench`` result, in report order."""
    s = result.get("sections", {})
    out: list[dict[str, Any]] = []
    if s.get("core"):
        out += _core_figures(s["core"])
    if s.get("disk"):
        out += _disk_figures(s["disk"])
    if s.get("e2e"):
        out += _e2e_figures(s["e2e"])
    if s.get("trace"):
        out += _trace_figures(s["trace"])
    if s.get("step"):
        out += _step_figures(s["step"])
    if s.get("copy_step"):
        out += _copy_step_figures(s["copy_step"])
    if s.get("busy"):
        out += _busy_figures(s["busy"])
    if s.get("remote"):
        out += _remote_figures(s["remote"])
    return out


def problems(result: dict[str, Any]) -> dict[str, list[str]]:
    """Correctness problems seen while measuring: ``wrong_bytes`` (fatal) and ``other`` (a figure is suspect)."""
    wrong: list[str] = []
    other: list[str] = []
    s = result.get("sections", {})
    c = s.get("core") or {}
    for v in (c.get("lifecycles") or {}).get("variants", []):
        other += [f"lifecycles {v['name']}: {p}" for p in v["problems"]]
    for key in ("host_throughput", "cuda_copy"):
        for z in (c.get(key) or {}).get("sizes", []):
            for p in z["problems"]:
                (wrong if "!=" in p else other).append(f"{key} {_size(z['block_bytes'])}: {p}")
    other += [f"host fresh slab: {p}" for p in ((c.get("host_throughput") or {}).get("fresh_slab") or {}).get("problems", [])]
    d = s.get("disk") or {}
    for p in d.get("promote", []):
        if p["tkv_bad_rows"]:
            wrong.append(f"promote {_size(p['block_bytes'])}: {p['tkv_bad_rows']} rows with wrong bytes")
        if p.get("raw_copy_bad_rows"):
            wrong.append(f"promote {_size(p['block_bytes'])}: the pread+copy_ baseline left {p['raw_copy_bad_rows']} "
                         f"rows with wrong bytes")
        for st, one in (p.get("one_at_a_time") or {}).items():
            if one.get("bad_rows"):
                wrong.append(f"promote one at a time {_size(p['block_bytes'])} {st}: {one['bad_rows']} rows with wrong bytes")
            if one.get("misses") or one.get("failed"):
                other.append(f"promote one at a time {_size(p['block_bytes'])} {st}: {one['misses']} misses, "
                             f"{one['failed']} failed")
        for st, ar in (p.get("after_reopen") or {}).items():
            if ar.get("bad_rows"):
                wrong.append(f"promote after a reopen {_size(p['block_bytes'])} {st}: {ar['bad_rows']} rows with wrong bytes")
            if ar.get("misses") or ar.get("failed") or ar.get("in_host_before"):
                other.append(f"promote after a reopen {_size(p['block_bytes'])} {st}: {ar['misses']} misses, "
                             f"{ar['failed']} failed, {ar['in_host_before']} loads found their key in the host tier")
        if p.get("link_bad_blocks"):
            wrong.append(f"promote link {_size(p['block_bytes'])}: {p['link_bad_blocks']} host blocks with wrong bytes")
        if p.get("link_misses") or p.get("link_failed"):
            other.append(f"promote link {_size(p['block_bytes'])}: {p['link_misses']} misses, {p['link_failed']} failed")
        if p["tkv_misses"] or p["tkv_failed"]:
            other.append(f"promote {_size(p['block_bytes'])}: {p['tkv_misses']} misses, {p['tkv_failed']} failed")
        if p.get("tkv_loads_already_in_host"):
            other.append(f"promote {_size(p['block_bytes'])}: {p['tkv_loads_already_in_host']} loads found their "
                         f"key in the host tier (measured a host load, not a promote)")
    for sp in d.get("spill", []):
        if sp["spills_shed_total"]:
            other.append(f"spill {_size(sp['block_bytes'])} {sp['durability']}: {sp['spills_shed_total']} spills shed")
    st_ = s.get("step") or {}
    for r in (st_.get("runs") or {}).get("tkv", []):
        if r.get("loads_failed"):
            other.append(f"engine step: {r['loads_failed']:.0f} loads failed")
    for compute, by_mode in ((s.get("copy_step") or {}).get("runs") or {}).items():
        for mode, runs in by_mode.items():
            for k, r in enumerate(runs):
                tag = f"copy step {compute} {mode} run {k + 1}"
                if r.get("bad_rows"):
                    wrong.append(f"{tag}: {r['bad_rows']} of {r['rows_checked']} loaded rows with wrong bytes")
                if r.get("copy_failed"):
                    other.append(f"{tag}: {r['copy_failed']:.0f} copies failed")
    bz = s.get("busy") or {}
    for x in bz.get("rows", []):
        tag = f"busy {x.get('disk_io')} {x.get('engine')}"
        if x.get("error"):
            other.append(f"{tag}: did not run: {x['error']}")
            continue
        if x["disk_io"] == "process" and x.get("child_processes_started") == 0:
            other.append(f"{tag}: disk_io=process started no child process (the row measured in-process I/O)")
        if not x["flush_ok"]:
            other.append(f"{tag}: flush() did not finish or failed")
        if x["spills_failed"] or x["disk_errors"]:
            other.append(f"{tag}: {x['spills_failed']:.0f} spills failed, {x['disk_errors']:.0f} disk errors")
        odd = {k: v for k, v in x["shed_by_reason"].items() if k != "backpressure"}
        if odd or x["stores_refused"]:
            other.append(f"{tag}: spills shed for {odd or 'no other reason'}, stores refused {x['stores_refused']} "
                         f"({x['stores_shed_by_reason']})")
    for io, p in (bz.get("promote") or {}).items():
        if p.get("error"):
            other.append(f"busy promote {io}: did not run: {p['error']}")
            continue
        if p["bad_rows"]:
            wrong.append(f"busy promote {io}: {p['bad_rows']} rows with wrong bytes")
        if p["misses"] or p["failed"] or p["already_in_host"]:
            other.append(f"busy promote {io}: {p['misses']} misses, {p['failed']} failed, {p['already_in_host']} "
                         f"keys already in the host tier")
        if io == "process" and p.get("child_processes_started") == 0:
            other.append(f"busy promote {io}: disk_io=process started no child process (measured in-process I/O)")
    rm = s.get("remote") or {}
    for z in rm.get("sizes", []):
        tag = f"remote {_size(z['block_bytes'])}"
        if z["bad_rows"]:
            wrong.append(f"{tag}: {z['bad_rows']} rows with wrong bytes after the put and the fetch")
        if z["raw_bad_values"]:
            wrong.append(f"{tag}: the SET/GET baseline read {z['raw_bad_values']} values with wrong bytes")
        other += [f"{tag}: {p}" for p in z["problems"]]
    rt = rm.get("trace") or {}
    for key in ("remote", "host_only"):
        for who in ("a", "b"):
            x = (rt.get(key) or {}).get(who)
            if not x:
                continue
            tag = f"remote trace {key} {who.upper()}"
            if x["wait_timeouts"] or x["stores_refused"] or x["flush_failed"]:
                other.append(f"{tag}: {x['wait_timeouts']} fetch waits timed out, {x['stores_refused']} stores "
                             f"refused, {x['flush_failed']} flushes failed")
            if x["puts_shed"] or x["puts_failed"] or x["fetch_failed"]:
                other.append(f"{tag}: {x['puts_shed']:.0f} puts shed, {x['puts_failed']:.0f} failed, "
                             f"{x['fetch_failed']:.0f} fetch parts failed")
    e = s.get("e2e") or {}
    for mode, x in (e.get("modes") or {}).items():
        if x["corrupt_loads"]:
            wrong.append(f"e2e {x['label']}: {x['corrupt_loads']} corrupt loads")
        if x["errors"]:
            other.append(f"e2e {x['label']}: {x['errors']} engine/tier errors")
    return {"wrong_bytes": wrong, "other": other}


# ----------------------------------------------------------------------------- text
def _fmt(x: Optional[float], unit: str = "") -> str:
    if x is None:
        return "-"
    a = abs(x)
    if unit == "fraction":
        return f"{x:.3f}"
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if a >= 0.1 or a == 0 else f"{x:.3f}"


def _met(f: dict[str, Any]) -> str:
    if f["skipped"]:
        return "skip"
    return "-" if f["met"] is None else ("met" if f["met"] else "MISSED")


def _header(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    fs = m.get("filesystem") or {}
    bl = result.get("background_load") or {}
    share = bl.get("foreign_share")
    lines = [
        f"tiered-kv bench ({result['mode']}, seed {result['seed']}) -- {m['date_utc']}, "
        f"{result.get('wall_seconds', 0):.0f} s",
        f"machine: {m['cores']} cores ({m['cpu_model']}), RAM {(m['mem_total_bytes'] or 0) / GiB:.1f} GiB, "
        f"Python {m['python']}, torch {m['torch']}, CUDA: {m['cuda_device'] if m['cuda'] else 'no'}, "
        f"diskcache: {m['diskcache'] or _disk.DISKCACHE_MISSING}",
        f"bench dir {m.get('bench_dir')}: {fs.get('type')} on {fs.get('device')}"
        + (f" (rotational={fs['rotational']})" if "rotational" in fs else "")
        + f"; tiered_kv {m['git_commit'] or '?'}{' + uncommitted changes' if m.get('git_tiered_kv_dirty') else ''}",
    ]
    if share is not None:
        lines.append(f"other processes used {share:.0%} of the machine's CPU while it ran "
                     f"({bl.get('foreign_cpu_s', 0):.0f} CPU s): figures are noisier than their repeats suggest"
                     if share > 0.05 else f"other processes used {share:.0%} of the machine's CPU while it ran")
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The summary table: one line per figure, grouped by section, then what the baselines are."""
    figs = result.get("figures") or collect_figures(result)
    lines = _header(result) + [""]
    w = max([20] + [len(f["name"]) for f in figs]) + 4
    wu = max([6] + [len(f["unit"]) for f in figs]) + 2
    wv = max([16] + [len(f["vs"]) for f in figs]) + 1
    wt = max([8] + [len(f["target"] or "") for f in figs]) + 2
    head = (f"{'figure':<{w}}{'unit':<{wu}}{'tiered_kv':>11}{'baseline':>11}  {'vs':<{wv}}{'ratio':>7}  "
            f"{'target':<{wt}}{'met':<6}")
    lines += [head, "-" * len(head)]
    section = None
    legend: dict[str, str] = {}
    for f in figs:
        if f["section"] != section:
            section = f["section"]
            lines.append(section)
        legend.setdefault(f["vs"], f["baseline_name"])
        if f["skipped"]:
            lines.append(f"  {f['name']:<{w - 2}}{f['unit']:<{wu}}{'-':>11}{'-':>11}  {f['vs']:<{wv}}{'-':>7}  "
                         f"{(f['target'] or '-'):<{wt}}{_met(f):<6}{f['skipped']}")
            continue
        r = f"{f['ratio']:.2f}x" if f["ratio"] is not None else "-"
        lines.append(f"  {f['name']:<{w - 2}}{f['unit']:<{wu}}{_fmt(f['value'], f['unit']):>11}"
                     f"{_fmt(f['baseline'], f['unit']):>11}  {f['vs']:<{wv}}{r:>7}  {(f['target'] or '-'):<{wt}}"
                     f"{_met(f)}".rstrip())
    with_t = [f for f in figs if f["met"] is not None]
    lines += ["", f"targets met: {sum(f['met'] for f in with_t)} of {len(with_t)} "
                  f"(targets from issues 2, 3, 22 and 26, each figure's source in --json; ratio = tiered_kv / baseline)",
              "", "baselines (measured in the same process, interleaved with tiered_kv):"]
    lines += [f"  {k:<{wv}}{v}" for k, v in legend.items()]
    notes = [f for f in figs if f["note"]]
    if notes:
        lines += ["", "notes:"]
        lines += [f"  {f['id']}: {f['note']}" for f in notes]
    pr = result.get("problems") or {}
    if pr.get("wrong_bytes") or pr.get("other"):
        lines += ["", "problems:"] + [f"  WRONG BYTES {p}" for p in pr.get("wrong_bytes", [])] + \
                 [f"  {p}" for p in pr.get("other", [])]
    return "\n".join(lines)


def format_markdown(result: dict[str, Any], second: Optional[dict[str, Any]] = None) -> str:
    """The summary table as Markdown (for docs/benchmarks.md); ``second``: another run, whose ratios are added."""
    figs = result.get("figures") or collect_figures(result)
    other = {f["id"]: f for f in ((second.get("figures") or collect_figures(second)) if second else [])}
    extra = " Ratio, 2nd run |" if second else ""
    lines = ["| Figure | Unit | tiered_kv | Baseline | vs | Ratio | Target | Met |" + extra,
             "|---|---|---:|---:|---|---:|---|---|" + ("---:|" if second else "")]
    section = None
    for f in figs:
        if f["section"] != section:
            section = f["section"]
            lines.append(f"| **{section}** | | | | | | | |" + (" |" if second else ""))
        tgt = (f["target"] or "-").replace("<=", "≤").replace(">=", "≥")
        if f["skipped"]:
            lines.append(f"| {f['name']} | {f['unit']} | - | - | {f['vs']} | - | {tgt} | "
                         f"skipped: {f['skipped'].removeprefix('skipped: ')} |" + (" - |" if second else ""))
            continue
        r = f"{f['ratio']:.2f}x" if f["ratio"] is not None else "-"
        met = _met(f)
        met = "**MISSED**" if met == "MISSED" else met
        row = (f"| {f['name']} | {f['unit']} | {_fmt(f['value'], f['unit'])} | {_fmt(f['baseline'], f['unit'])} "
               f"| {f['vs']} | {r} | {tgt} | {met} |")
        if second:
            g = other.get(f["id"])
            r2 = f"{g['ratio']:.2f}x" if g and g["ratio"] is not None else "-"
            if g and g.get("skipped"):   # not a valid figure in that run: no ratio to compare
                r2 = "skipped"
            elif g and g["met"] is not None and g["met"] != f["met"]:
                r2 += " (met)" if g["met"] else " (**MISSED**)"
            row += f" {r2} |"
        lines.append(row)
    return "\n".join(lines)


def format_details(result: dict[str, Any]) -> str:
    """Each section's own report (distributions as median/p90/p99/max, diagnostics)."""
    s = result.get("sections", {})
    parts = []
    if s.get("core"):
        parts.append(_core.format_report(s["core"]))
    if s.get("disk"):
        parts.append(_disk.format_report(s["disk"]))
    if s.get("e2e"):
        parts.append(_format_e2e(s["e2e"]))
    if s.get("trace"):
        parts.append(_trace.format_trace(s["trace"]))
    if s.get("step"):
        parts.append(_step.format_step(s["step"]))
    if s.get("copy_step"):
        parts.append(_step.format_copy_step(s["copy_step"]))
    if s.get("busy"):
        parts.append(_busy.format_busy(s["busy"]))
    if s.get("remote"):
        parts.append(_remote.format_remote(s["remote"]))
    return "\n\n".join(parts)


def _format_e2e(e: dict[str, Any]) -> str:
    m = e["modes"]
    cols = [m[k]["label"] for k in ("none", "host", "disk")]
    rows = [("prefix hit rate", "prefix_hit_rate", ".3f"), ("recompute avoided (tokens)", "recompute_avoided_tokens", ",.0f"),
            ("recomputed (tokens)", "recompute_tokens", ",.0f"), ("recomputed / needed", "recomputed_fraction", ".3f"),
            ("engine steps/s", "steps_per_s", ",.0f")]
    lines = [f"end to end: the demo workload, {e['steps_per_run']} engine steps per run, {e['repeats']} repeat(s), "
             f"seeds {e['seeds']}; median (min..max) over repeats",
             f"  {'':<28}" + "".join(f"{c:>30}" for c in cols)]
    for label, key, spec in rows:
        cells = []
        for k in ("none", "host", "disk"):
            x = m[k][key]
            cells.append(f"{format(x['median'], spec)} ({format(x['min'], spec)}..{format(x['max'], spec)})"
                         if x["n"] > 1 else format(x["median"], spec))
        lines.append(f"  {label:<28}" + "".join(f"{c:>30}" for c in cells))
    lines.append(f"  {'corrupt loads / errors':<28}" + "".join(f"{str(m[k]['corrupt_loads']) + ' / ' + str(m[k]['errors']):>30}"
                                                             for k in ("none", "host", "disk")))
    return "\n".join(lines)
