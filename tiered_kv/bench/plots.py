"""PNG plots of a ``tiered-kv bench`` result (matplotlib, an optional ``bench`` extra, imported lazily).

``write_plots(result, dir)`` writes, for the sections present:

* ``throughput-host.png`` -- host tier (and CUDA link) GB/s by block size, tiered_kv beside raw copy;
* ``throughput-disk.png`` -- spill, promote and full-and-evicting GB/s beside raw I/O and diskcache;
* ``latency-under-load.png`` -- engine-thread call latency with the disk writer saturated (beside the
  same loop without a disk tier), and ``store()`` latency with copies running (beside the unsafe original);
* ``end-to-end.png`` -- the demo workload's hit rate and recompute by offload mode.

Every bar stands beside its baseline from the same run; whiskers span the repeats (min..max).
Works on a result read back from JSON (missing numbers are None).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .common import TARGETS, KiB, MiB

__all__ = ["write_plots", "matplotlib_missing"]

_TKV, _BASE, _PEER = "#1f77b4", "#7f7f7f", "#ff7f0e"


def matplotlib_missing() -> Optional[str]:
    """None when matplotlib imports, else why not."""
    try:
        import matplotlib  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"{type(exc).__name__}: {exc}"
    return None


def _plt() -> Any:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // KiB} KiB"


def _n(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _footer(result: dict[str, Any]) -> str:
    m = result.get("machine", {})
    fs = m.get("filesystem") or {}
    cuda = m.get("cuda_device") if m.get("cuda") else "no CUDA"
    return (f"{m.get('cores')} cores ({m.get('cpu_model')}), torch {m.get('torch')}, {cuda}, bench dir on "
            f"{fs.get('type')}; tiered-kv bench {result.get('mode')}, seed {result.get('seed')}, "
            f"{(m.get('date_utc') or '')[:10]}; shared machine: figures are noisy, compare bars within a group")


def _bars(ax: Any, groups: list[str], series: list[tuple[str, str, list[Any], list[Any], list[Any]]],
          ratios: Optional[list[Optional[float]]] = None, ratio_label: str = "") -> None:
    """Grouped bars: series = (label, colour, medians, lows, highs); ratios printed above each group.

    Leaves headroom above the bars for the ratios and a legend in the upper left corner.
    """
    import math
    k = len(series)
    width = 0.8 / k
    tops = [0.0] * len(groups)
    for j, (label, colour, med, lo, hi) in enumerate(series):
        xs = [i + (j - (k - 1) / 2) * width for i in range(len(groups))]
        m = [_n(v) for v in med]
        err_lo = [max(0.0, a - _n(b)) if not (math.isnan(a) or math.isnan(_n(b))) else 0.0 for a, b in zip(m, lo)]
        err_hi = [max(0.0, _n(b) - a) if not (math.isnan(a) or math.isnan(_n(b))) else 0.0 for a, b in zip(m, hi)]
        ax.bar(xs, [0.0 if math.isnan(v) else v for v in m], width, label=label, color=colour,
               yerr=[err_lo, err_hi], capsize=3, error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        for i, (x, v) in enumerate(zip(xs, m)):
            if math.isnan(v):
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
            else:
                tops[i] = max(tops[i], v + err_hi[i])
    ymax = max(tops + [1e-9])
    ax.set_ylim(0, ymax * (1.45 if ratios else 1.3))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    if ratios:
        for i, r in enumerate(ratios):
            if r is not None and not math.isnan(r):
                ax.text(i, tops[i] + ymax * 0.04, f"{r:.2f}x", ha="center", va="bottom", fontsize=9,
                        fontweight="bold")
        if ratio_label:
            ax.plot([], [], " ", label=f"bold: {ratio_label}")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _gb_range(x: dict[str, Any]) -> tuple[Any, Any, Any]:
    return x.get("gb_per_s"), x.get("gb_per_s_worst"), x.get("gb_per_s_best")


def _host_plot(result: dict[str, Any], out: Path) -> Optional[Path]:
    core = result.get("sections", {}).get("core") or {}
    h = (core.get("host_throughput") or {}).get("sizes") or []
    cu = (core.get("cuda_copy") or {}).get("sizes") or []
    if not h and not cu:
        return None
    plt = _plt()
    panels = [("host", d, h) for d in ("store", "load") if h] + [("cuda", d, cu) for d in ("store", "load") if cu]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (kind, d, sizes) in zip(axes[0], panels):
        groups = [_size(s["block_bytes"]) for s in sizes]
        base_key = "baseline_raw_copy_1_thread" if kind == "host" else "baseline_torch_copy"
        t = [_gb_range(s[d]["tiered_kv"]) for s in sizes]
        b = [_gb_range(s[d][base_key]) for s in sizes]
        _bars(ax, groups, [("tiered_kv", _TKV, [x[0] for x in t], [x[1] for x in t], [x[2] for x in t]),
                           ("raw torch copy_, 1 thread" if kind == "host" else "torch copy_, same pinned buffers",
                            _BASE, [x[0] for x in b], [x[1] for x in b], [x[2] for x in b])],
              [s[d].get("ratio_tiered_kv_over_baseline") for s in sizes], "tiered_kv / baseline (medians)")
        link = {"store": "device->host (store)", "load": "host->device (load)"}[d]
        ax.set_title(f"{'host tier' if kind == 'host' else 'CUDA'}: {link}", fontsize=10)
        ax.set_xlabel("block size")
        ax.set_ylabel("GB/s (median pass; whiskers: worst..best)")
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Throughput by block size: tiered_kv beside a raw copy of the same bytes (same run)", fontsize=11)
    fig.text(0.01, 0.01, _footer(result), fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out / "throughput-host.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fig_range(f: Optional[dict[str, Any]]) -> tuple[Any, Any, Any]:
    if not f:
        return None, None, None
    return f.get("median"), f.get("min"), f.get("max")


def _disk_plot(result: dict[str, Any], out: Path) -> Optional[Path]:
    d = result.get("sections", {}).get("disk") or {}
    spill, promote, ev = d.get("spill") or [], d.get("promote") or [], d.get("evicting")
    if not (spill or promote or ev):
        return None
    plt = _plt()
    widths = [max(1, len(spill)), max(1, 2 * len(promote)), 1.6]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.0), gridspec_kw={"width_ratios": widths}, squeeze=False)
    ax = axes[0][0]
    if spill:
        groups = [f"{_size(s['block_bytes'])}\n{s['durability']}" for s in spill]
        rows = [(s["figures"].get("tkv"), s["figures"].get("raw_fresh"), s["figures"].get("diskcache")) for s in spill]
        _bars(ax, groups, [(lab, col, *[list(z) for z in zip(*[_fig_range(r[i]) for r in rows])])
                           for i, (lab, col) in enumerate((("tiered_kv (until flush())", _TKV),
                                                            ("raw write + fsync", _BASE),
                                                            ("diskcache set + syncfs", _PEER)))],
              [s["ratios"].get("tkv_vs_raw_fresh") for s in spill], "tiered_kv / raw")
        ax.set_title("spill (host -> disk), timed until flush()\nbatch / sync durability", fontsize=10)
        ax.set_ylabel("GB/s (median; whiskers: min..max of repeats)")
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[0][1]
    if promote:
        groups, rows, ratios = [], [], []
        for p in promote:
            for st in ("cold", "warm"):
                f = p["figures"].get(st) or {}
                if "tkv" not in f:
                    continue
                label = "cold" if p.get("drop_caches_worked") else "cold (not dropped)"
                groups.append(f"{_size(p['block_bytes'])}\n{label if st == 'cold' else 'warm'}")
                rows.append((f.get("tkv"), f.get("raw"), f.get("diskcache")))
                ratios.append(p["ratios"][st].get("tkv_vs_raw"))
        _bars(ax, groups, [(lab, col, *[list(z) for z in zip(*[_fig_range(r[i]) for r in rows])])
                           for i, (lab, col) in enumerate((("tiered_kv load()", _TKV), ("raw readinto", _BASE),
                                                            ("diskcache get", _PEER)))],
              ratios, "tiered_kv / raw")
        ax.set_title("promote (disk -> host -> row)\npage cache dropped (cold) / warm", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[0][2]
    if ev:
        t = ev["tkv"]
        w = t.get("window_gbps") or {}
        dc = ev.get("diskcache") or {}
        _bars(ax, ["2 MiB, full\n+ evicting"],
              [("tiered_kv (steady windows)", _TKV, [w.get("median")], [w.get("min")], [w.get("max")]),
               ("raw circular pwrite + fsync", _BASE, [ev["raw_circular"]["gbps"]], [None], [None]),
               ("diskcache size_limit", _PEER, [dc.get("gbps")], [None], [None])],
              [ev["ratios"].get("tkv_steady_vs_raw_circular")], "tiered_kv / raw")
        ax.set_title(f"tier full and evicting\n(slot file + data.mdb = {_n(t.get('file_vs_capacity_end')):.2f}x capacity)", fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("Disk tier GB/s beside raw file I/O and python-diskcache on the same filesystem (same run)",
                 fontsize=11)
    fig.text(0.01, 0.01, _footer(result), fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out / "throughput-disk.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency_plot(result: dict[str, Any], out: Path) -> Optional[Path]:
    s = result.get("sections", {})
    lat = (s.get("disk") or {}).get("latency")
    sl = (s.get("core") or {}).get("store_latency")
    if not lat and not sl:
        return None
    plt = _plt()
    panels = [p for p in (("engine", lat), ("store", sl)) if p[1]]
    ratios = [4 if k == "engine" else 1.6 for k, _ in panels]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * sum(ratios), 5.0), squeeze=False,
                             gridspec_kw={"width_ratios": ratios})
    for ax, (kind, data) in zip(axes[0], panels):
        if kind == "engine":
            calls = [c for c in ("store", "lookup", "load", "poll") if c in data["saturated"]["calls_us"]]
            series = [("disk writer saturated", _TKV, data["saturated"]["calls_us"]),
                      ("no disk tier (baseline)", _BASE, data["no_disk_tier"]["calls_us"])]
            groups = [f"{c}()" for c in calls]
            title = "engine-thread calls while the disk writer is saturated"
        else:
            calls = ["store"]
            series = [("tiered_kv store()", _TKV, {"store": data["tiered_kv"]["store_all_calls"]}),
                      ("unsafe original store() (baseline)", _BASE, {"store": data["baseline_figures"]["store_all_calls"]})]
            groups = ["store()"]
            title = (f"store() with {data.get('num_copy_workers')} copy workers\nbusy ({_size(data.get('row_bytes') or 0)} "
                     "rows)")
        pct = (("median", "p50"), ("p90", "p90"), ("p99", "p99"), ("max", "max"))
        xs_all, labels = [], []
        hi = lo = None
        k = len(series)
        width = 0.8 / k
        for gi, c in enumerate(calls):
            for j, (label, colour, table) in enumerate(series):
                x0 = gi + (j - (k - 1) / 2) * width
                st = table.get(c) or {}
                vals = [_n(st.get(key)) for key, _ in pct]
                ok = [v for v in vals if v == v and v > 0]
                if ok:
                    hi = max(ok + ([hi] if hi else []))
                    lo = min(ok + ([lo] if lo else []))
                ax.bar(x0, vals[2], width * 0.9, color=colour, alpha=0.85, label=label if gi == 0 else None)
                ax.plot([x0] * 4, vals, color="black", linewidth=0.8)
                for v, (_, name), mk in zip(vals, pct, ("o", "s", "_", "^")):
                    ax.plot([x0], [v], marker=mk, color="black", markersize=4 if mk != "_" else 10)
            xs_all.append(gi)
            labels.append(groups[gi])
        ax.set_yscale("log")
        if hi and lo:
            ax.set_ylim(lo / 2, hi * 12)  # room for the legend above the markers
        # the targets are ratios of the baseline's p99 (issue 22 section 4): a red segment over each call's group
        factor = TARGETS["engine_call_p99_vs_no_disk"] if kind == "engine" else TARGETS["store_p99_vs_unsafe_copies_running"]
        drawn = False
        for gi, c in enumerate(calls):
            if c == "poll":
                continue
            b99 = _n((series[1][2].get(c) or {}).get("p99"))
            if b99 == b99 and b99 > 0:
                ax.hlines(b99 * factor, gi - 0.45, gi + 0.45, colors="red", linestyles="--", linewidth=1,
                          label=None if drawn else f"target: p99 <= {factor:g}x the baseline's p99")
                drawn = True
        ax.set_xticks(xs_all)
        ax.set_xticklabels(labels)
        ax.set_ylabel("microseconds per call (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.set_axisbelow(True)
        ax.legend(fontsize=7, loc="upper left")
        ax.text(0.99, 0.99, "bar = p99\nmarkers: ● p50, ■ p90,\n— p99, ▲ max", transform=ax.transAxes,
                ha="right", va="top", fontsize=7)
    fig.suptitle("Latency under load: each call beside its baseline from the same run", fontsize=11)
    fig.text(0.01, 0.01, _footer(result), fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    path = out / "latency-under-load.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _e2e_plot(result: dict[str, Any], out: Path) -> Optional[Path]:
    e = result.get("sections", {}).get("e2e")
    if not e:
        return None
    plt = _plt()
    m = e["modes"]
    modes = [k for k in ("none", "host", "disk") if k in m]
    labels = [m[k]["label"] for k in modes]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), squeeze=False)
    for ax, key, title in ((axes[0][0], "prefix_hit_rate", "prefix hit rate"),
                           (axes[0][1], "recomputed_fraction", "tokens recomputed / tokens needed")):
        st = [m[k][key] for k in modes]
        _bars(ax, labels, [("median over repeats", _TKV, [x.get("median") for x in st], [x.get("min") for x in st],
                            [x.get("max") for x in st])])
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 1.15)
        for i, x in enumerate(st):
            if x.get("median") is not None:
                ax.text(i, _n(x["median"]) + 0.02, f"{_n(x['median']):.2f}", ha="center", fontsize=8)
    fig.suptitle(f"End to end: the demo workload, {e['steps_per_run']} engine steps, same seed per mode "
                 f"(baseline: no offload)", fontsize=11)
    fig.text(0.01, 0.01, _footer(result), fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    path = out / "end-to-end.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(result: dict[str, Any], directory: str | Path) -> list[Path]:
    """Write the PNGs for the sections present in ``result``; returns their paths."""
    why = matplotlib_missing()
    if why:
        raise RuntimeError(f"plots need matplotlib ({why}); pip install 'tiered-kv[bench]'")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fn in (_host_plot, _disk_plot, _latency_plot, _e2e_plot):
        p = fn(result, out)
        if p is not None:
            written.append(p)
    return written
