"""The ``tiered-kv`` command line.  The only module that prints."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from ..errors import DiskInUseError, TieredKVError

__all__ = ["main"]

log = logging.getLogger(__name__)

_METRICS_ADDR = "127.0.0.1"   # --metrics-addr when --metrics-port is given without it


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``ArgumentDefaultsHelpFormatter`` that appends "(default: X)" only where the help does not state its
    default already (a second, different one -- "(default: 20, ...) (default: None)" -- misleads) and where
    there is one to state (None is "not given", which the help explains)."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        if action.default is None or re.search(r"\bdefault\b", text, re.IGNORECASE):
            return text
        return super()._get_help_string(action)


def nonempty(text: str) -> str:
    """An argparse type for a value that must not be empty: "" (``--disk-path "$DIR"`` with DIR unset)
    would otherwise read as "not given" -- a throwaway temporary directory, no JSON written, or, for an
    address, every interface."""
    if not text:
        raise argparse.ArgumentTypeError("an empty value (an unset shell variable?)")
    return text


def _port(text: str) -> int:
    """An argparse type for a TCP port: refused here, naming the option and value (``bind`` would raise an
    OverflowError that names neither)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")
    return port


def check_output_file(opt: str, path: Optional[str]) -> None:
    """A file written at the end of a long run, checked before it: its directory must be writable and the
    path must not be a directory.  Raises ValueError naming ``opt`` and the path."""
    if path is None:
        return
    where = Path(path).parent
    if not (where.is_dir() and os.access(where, os.W_OK)):
        raise ValueError(f"{opt}: {str(where)!r} is not a writable directory")
    if Path(path).is_dir():
        raise ValueError(f"{opt}: {str(path)!r} is a directory, not a file to write")


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread is: a KeyboardInterrupt, so that it unwinds exactly as
    a Ctrl-C does (every ``finally`` runs, the manager is closed, temporary directories are removed, no
    lingering) and ``main`` exits 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals_unwind() -> Iterator[None]:
    """While the demo or a replay runs, SIGTERM (``kill``, ``docker stop``, a pod stop: where the demo is
    PID 1 the default action would even be ignored) and SIGHUP (a closed terminal) raise :class:`_Stopped`
    instead of ending the process with its cleanup skipped.  Only here, in the command line, and restored
    after: a library embedded in an engine leaves the engine's signals alone.  A signal the caller ignores
    (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():   # signal.signal works in it only
        yield
        return
    stopping: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not stopping:   # a second stop signal must not break off the cleanup the first one started
            stopping.append(signum)
            raise _Stopped(signum)

    old: dict[int, Any] = {}
    try:
        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                old[sig] = signal.signal(sig, handler)
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def _metrics_addr(args: argparse.Namespace) -> str:
    return args.metrics_addr if args.metrics_addr is not None else _METRICS_ADDR


def _workload_config(args: argparse.Namespace, offload: str, label: str, remote: bool = False) -> Any:
    """The run ``label``'s workload.  Under ``--compare`` each run with a disk tier gets its own directory
    under ``--disk-path`` (one run's spills are not the next one's warm start)."""
    from .demo import WorkloadConfig

    disk_path = args.disk_path
    if disk_path is not None and args.compare and offload == "disk":
        disk_path = str(Path(disk_path) / label.replace("+", "-").replace(" ", "-"))
    seconds = args.seconds if args.seconds is not None else (None if args.steps is not None else 20.0)
    return WorkloadConfig(seconds=seconds, steps=args.steps, seed=args.seed, offload=offload,
                          abort_rate=args.abort_rate, preempt_rate=args.preempt_rate,
                          device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                          disk_blocks=args.disk_blocks, disk_path=disk_path,
                          remote_url=args.remote_url if remote else None)


def _check_demo(args: argparse.Namespace, modes: list[tuple[str, str, bool]]) -> None:
    """What every run needs, checked before the first starts (a bad value found after a run, or after
    three with --compare, would waste them): each run's workload, the remote URL, the JSON file, the
    metrics port and address and the linger.  Raises ValueError naming the option."""
    for label, mode, remote in modes:
        _workload_config(args, mode, label, remote)
    if args.remote_url is not None:
        from ..remote.url import parse_url

        parse_url(args.remote_url)
    check_output_file("--json", args.json)
    if args.metrics_port is None:   # both act only through the /metrics server: alone they would do nothing
        for opt, value in (("--linger", args.linger), ("--metrics-addr", args.metrics_addr)):
            if value is not None:
                raise ValueError(f"{opt} needs --metrics-port (it applies to the /metrics server that starts)")
        return
    if args.linger is not None and not (math.isfinite(args.linger) and args.linger >= 0):
        raise ValueError(f"--linger must be a finite number of seconds >= 0, got {args.linger!r}")
    addr = _metrics_addr(args)
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        try:   # port 0 (any free port) too: the address itself may not be bindable
            s.bind((addr, args.metrics_port))
        except OSError as exc:
            raise ValueError(f"--metrics-addr {addr} --metrics-port {args.metrics_port}: {exc}") from None


def _run_one(args: argparse.Namespace, offload: str, label: str, remote: bool = False) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry
    from tqdm import tqdm

    from .demo import remote_url_for_display, run_workload

    cfg = _workload_config(args, offload, label, remote)
    if cfg.remote_url is not None:
        print(f"{label}: remote tier at {remote_url_for_display(cfg.remote_url)}", file=sys.stderr, flush=True)
    registry = CollectorRegistry()
    server = None

    def on_manager(mgr: Any) -> None:
        nonlocal server
        if args.metrics_port is not None:
            from ..exposition import serve_metrics

            server = serve_metrics(args.metrics_port, addr=_metrics_addr(args), registry=registry)
            # server.url: an IPv6 host in brackets, as a URL needs it
            print(f"serving /metrics on {server.url}", file=sys.stderr, flush=True)

    # no bar at all with --no-progress: a disabled tqdm still starts its monitor thread
    bar = None if args.no_progress else tqdm(total=100, desc=label, unit="%", file=sys.stderr,
                                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")
    last = [0]

    def progress(frac: float) -> None:
        n = int(frac * 100)
        if n > last[0]:
            if bar is not None:
                bar.update(n - last[0])
            last[0] = n

    interrupted = False
    linger = args.linger or 0.0
    try:
        summary = run_workload(cfg, registry=registry, progress=progress, on_manager=on_manager)
        if bar is not None:
            bar.update(100 - last[0])
    except KeyboardInterrupt:   # the user asked to stop (Ctrl-C, SIGTERM, SIGHUP): no lingering
        interrupted = True
        raise
    finally:
        if bar is not None:
            bar.close()
        try:
            if server is not None and linger > 0 and not interrupted:
                print(f"keeping /metrics up for {linger:g} s", file=sys.stderr, flush=True)
                time.sleep(linger)
        finally:   # a second Ctrl-C while lingering still closes the server
            if server is not None:
                server.close()
    return summary


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


_ROWS = [
    ("requests finished", lambda s: f"{s['requests_finished']:,}"),
    ("requests aborted", lambda s: f"{s['requests_aborted']:,}"),
    ("preemptions", lambda s: f"{s['preemptions']:,}"),
    ("prefix hit rate", lambda s: f"{s['prefix_hit_rate']:.1%}"),
    ("  hits in host", lambda s: f"{s['hits_by_tier']['host']:,}"),
    ("  hits on disk", lambda s: f"{s['hits_by_tier']['disk']:,}"),
    ("recompute avoided (tokens)", lambda s: f"{s['recompute_avoided_tokens']:,}"),
    ("recomputed (tokens)", lambda s: f"{s['recompute_tokens']:,}"),
    ("loads verified", lambda s: f"{s['loads_ok']:,}"),
    ("corrupt loads", lambda s: f"{s['corrupt_loads']}"),
    ("device->host", lambda s: _fmt_bytes(s["bytes_by_link"]["device->host"])),
    ("host->device", lambda s: _fmt_bytes(s["bytes_by_link"]["host->device"])),
    ("host->disk", lambda s: _fmt_bytes(s["bytes_by_link"]["host->disk"])),
    ("disk->host", lambda s: _fmt_bytes(s["bytes_by_link"]["disk->host"])),
    ("stale callbacks discarded", lambda s: ", ".join(f"{k}={v}" for k, v in s["stale_callbacks"].items() if v) or "0"),
    ("orphaned writes prevented", lambda s: f"{s['orphaned_writes_prevented']:,}"),
    ("spills shed", lambda s: f"{sum(s['shed'].values()):,}"),
    ("errors", lambda s: f"{s['errors'] + s['tier_errors']}"),
    ("engine steps", lambda s: f"{s['steps']:,}"),
    ("wall time", lambda s: f"{s['seconds']:.1f} s"),
]

# Rows of runs with a remote tier (``--remote-url``), after "  hits on disk"; "-" for a run without one
_REMOTE_AFTER = "  hits on disk"
_REMOTE_ROWS = [
    ("  hits on remote", lambda r: f"{r['hits']:,}"),
    ("host->remote", lambda r: _fmt_bytes(r["bytes_written"])),
    ("remote->host", lambda r: _fmt_bytes(r["bytes_read"])),
    ("remote writes ok / shed", lambda r: f"{r['puts']['ok']:,} / {r['puts']['shed']:,}"),
    ("remote writes refused", lambda r: ", ".join(f"{k}={v}" for k, v in r["refused_writes"].items() if v) or "0"),
    ("remote corrupt values", lambda r: f"{r['corrupt_values']}"),
    ("remote errors", lambda r: ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "0"),
    ("remote tier healthy", lambda r: {None: "?", 1.0: "yes"}.get(r["healthy"], "no")),
]


def _rows(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    if not any("remote" in s for s in summaries.values()):
        return _ROWS
    remote = [(label, lambda s, fn=fn: fn(s["remote"]) if "remote" in s else "-") for label, fn in _REMOTE_ROWS]
    i = [label for label, _ in _ROWS].index(_REMOTE_AFTER) + 1
    return _ROWS[:i] + remote + _ROWS[i:]


def _print_table(summaries: dict[str, dict[str, Any]]) -> None:
    names = list(summaries)
    rows = _rows(summaries)
    w0 = max(len(r[0]) for r in rows)
    cells = {n: [fn(summaries[n]) for _, fn in rows] for n in names}
    widths = {n: max(len(n), *(len(c) for c in cells[n])) for n in names}
    print("  ".join([" " * w0] + [n.rjust(widths[n]) for n in names]))
    for i, (label, _) in enumerate(rows):
        print("  ".join([label.ljust(w0)] + [cells[n][i].rjust(widths[n]) for n in names]))


def _demo(args: argparse.Namespace) -> int:
    remote = args.remote_url is not None
    if args.compare:   # the remote tier is a fourth run, beside the three without it
        modes = [("no offload", "none", False), ("host", "host", False), ("host+disk", "disk", False)]
        if remote:
            modes.append(("host+disk+remote", "disk", True))
    else:
        modes = [("tiered-kv demo", "disk", remote)]
    _check_demo(args, modes)
    summaries: dict[str, dict[str, Any]] = {}
    for label, mode, with_remote in modes:
        summaries[label] = _run_one(args, mode, label, with_remote)
    print()
    _print_table(summaries)
    if args.json is not None:
        from ..bench.report import clean   # strict JSON: a figure that is not a number is null

        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(clean(summaries if args.compare else summaries[modes[0][0]]), f, indent=2, sort_keys=True,
                      allow_nan=False)
    bad = [n for n, s in summaries.items() if s["corrupt_loads"] or s["errors"]]
    if bad:
        print(f"FAILED: corrupt loads or engine errors in {bad}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiered-kv", description="KV-cache tiering for LLM serving.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a seeded serving simulation through tiered_kv (CPU, no server needed)",
                       formatter_class=HelpFormatter)
    d.add_argument("--seconds", type=float, default=None,
                   help="wall-clock length of the run (default: 20, or as long as --steps takes)")
    d.add_argument("--steps", type=int, default=None, help="stop after this many engine steps instead")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--abort-rate", type=float, default=0.12, help="chance per step that a running request is aborted")
    d.add_argument("--preempt-rate", type=float, default=0.05, help="chance per step that a running request is preempted")
    d.add_argument("--device-blocks", type=int, default=96, help="rows in the device KV pool")
    d.add_argument("--host-blocks", type=int, default=160, help="slots in the host tier")
    d.add_argument("--disk-blocks", type=int, default=4096, help="blocks the disk tier may hold")
    d.add_argument("--disk-path", type=nonempty, default=None, help="LMDB directory (default: a temporary one, removed at exit)")
    d.add_argument("--remote-url", type=nonempty, default=None, metavar="URL",
                   help="also use a shared Redis/Valkey remote tier: redis://host:6379/0, rediss://..., "
                        "redis+cluster://h1:p1,h2:p2 (a password: TIERED_KV_REMOTE_PASSWORD, not the url); "
                        "default: none, no server needed")
    d.add_argument("--metrics-port", type=_port, default=None,
                   help="serve /metrics on this port while running (0: any free port)")
    # None, not the address: given without --metrics-port it is refused (alone it would do nothing)
    d.add_argument("--metrics-addr", type=nonempty, default=None,
                   help=f"address for --metrics-port (default: {_METRICS_ADDR})")
    d.add_argument("--linger", type=float, default=None,
                   help="with --metrics-port: keep /metrics up this many seconds after the run (not after a "
                        "Ctrl-C or a stop signal; default: 0)")
    d.add_argument("--compare", action="store_true",
                   help="run no offload, host only and host+disk side by side (and host+disk+remote with --remote-url)")
    d.add_argument("--json", metavar="PATH", type=nonempty, default=None, help="also write the summary as JSON")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    d.set_defaults(func=_demo)
    from ..bench.cli import add_bench_command
    from .ops_cli import add_operator_commands

    from .replay import add_replay_command

    add_operator_commands(sub)
    add_bench_command(sub)
    add_replay_command(sub)
    return p


# the subcommands that run for long and leave state behind when killed (the demo's temporary disk tier and
# manager, the replay's scratch directory): SIGTERM and SIGHUP unwind them as a Ctrl-C does
_UNWIND_ON_STOP = ("demo", "replay")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd in _UNWIND_ON_STOP:
            with _stop_signals_unwind():
                return int(args.func(args))
        return int(args.func(args))
    except _Stopped as exc:   # SIGTERM, SIGHUP: the shell's status for a process ended by that signal
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130
    except DiskInUseError as exc:   # as the operator commands: one line, status 3
        print(f"tiered-kv {args.cmd}: {exc}", file=sys.stderr)
        return 3
    except (TieredKVError, ValueError, OSError, OverflowError, MemoryError) as exc:   # a bad argument or a path
        # it cannot use, a size past what can be allocated: one line
        log.debug("tiered-kv %s failed", args.cmd, exc_info=True)
        print(f"tiered-kv {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
