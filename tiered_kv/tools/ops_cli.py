"""Operator commands for a disk tier (inspect, verify, compact, export, import).

The work is done by :mod:`tiered_kv.tools.ops` and :mod:`tiered_kv.tools.archive`; this
module parses arguments, prints, and turns refusals into exit statuses:

    0  done, nothing wrong
    1  verify found corrupt or orphaned entries (without --repair)
    2  bad input or refused: missing path, not a disk tier, wrong format version,
       namespace or block size, bad archive (nothing was changed)
    3  the path is in use (a TierManager or another writing command holds it);
       nothing was changed

Errors go to stderr as one line ``tiered-kv CMD: error: ...``.  See docs/operations.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any, Callable, Optional

__all__ = ["add_operator_commands"]


def add_operator_commands(sub: Any) -> None:
    """Register the operator subcommands on the ``tiered-kv`` parser's subparsers."""
    p = sub.add_parser("inspect", help="show a disk tier's namespace, entries, sizes, map usage and last recovery",
                       description="Read-only; safe beside a live TierManager in another process.")
    p.add_argument("path", metavar="PATH", help="the disk tier directory (disk_path)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_run(_inspect))

    p = sub.add_parser("verify", help="check every entry's header and checksum; --repair removes the bad ones",
                       description="Without --repair: read-only, safe beside a live TierManager in another "
                                   "process.  With --repair: refused while a TierManager holds the path.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--repair", action="store_true",
                   help="remove the corrupt and orphaned entries (and only those); needs the path to itself")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run(_verify))

    p = sub.add_parser("compact", help="rewrite the environment compactly and swap it in atomically",
                       description="Refused while a TierManager holds the path or another process has the "
                                   "environment open.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run(_compact))

    p = sub.add_parser("export", help="write a namespace's entries to a portable archive",
                       description="Read-only on PATH; safe beside a live TierManager in another process.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--namespace", required=True, metavar="NS", help="the namespace PATH holds (checked)")
    p.add_argument("out", metavar="OUT", help="archive file to create (must not exist)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run(_export))

    p = sub.add_parser("import", help="load an archive into a disk tier (created if new); all or nothing",
                       description="Verifies the whole archive before anything becomes visible; refused while a "
                                   "TierManager holds the path.  Importing twice changes nothing.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("archive", metavar="IN", help="archive written by tiered-kv export")
    p.add_argument("--force-namespace", action="store_true",
                   help="import an archive of another namespace, rewriting each entry's header to PATH's "
                        "namespace (block size and format must still match)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_run(_import))


# ---------------------------------------------------------------- plumbing
def _run(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import lmdb

        from .ops import EXIT_BAD_INPUT, OpsError

        try:
            return fn(args)
        except OpsError as exc:
            report = getattr(exc, "report", None)
            if report is not None and getattr(args, "json", False):
                print(json.dumps(report, indent=2, sort_keys=True, default=str))
            _err(args, str(exc))
            return exc.exit_code
        except (lmdb.Error, OSError) as exc:
            where = getattr(args, "path", None)
            # an error on a descriptor (a read of a slot file that is a directory) names no file: say which tier
            named = getattr(exc, "filename", None) is not None or where is None
            _err(args, f"{type(exc).__name__}: {exc}" + ("" if named else f" (in {str(where)!r})"))
            return EXIT_BAD_INPUT
    return run


def _err(args: argparse.Namespace, msg: str) -> None:
    print(f"tiered-kv {args.cmd}: error: {msg}", file=sys.stderr, flush=True)


def _bar(args: argparse.Namespace, desc: str, total: int, unit: str = "B") -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr,
                disable=bool(getattr(args, "no_progress", False)), leave=True)


class _Progress:
    """A tqdm bar driven by absolute ``(done, total)`` callbacks."""

    def __init__(self, args: argparse.Namespace, desc: str, unit: str = "B") -> None:
        self.args, self.desc, self.unit = args, desc, unit
        self.bar: Any = None
        self.last = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = _bar(self.args, self.desc, total, self.unit)
        if total != self.bar.total:
            self.bar.total = total
        if done > self.last:
            self.bar.update(done - self.last)
            self.last = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.last = 0


def _n(v: Optional[int]) -> str:
    return "-" if v is None else f"{v:,}"


def _when(ts: Optional[float]) -> str:
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _rows(rows: list[tuple[str, str]]) -> None:
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k.ljust(w)}  {v}")


# ---------------------------------------------------------------- inspect
def _inspect(args: argparse.Namespace) -> int:
    from .ops import inspect

    rep = inspect(args.path)
    if args.json:
        print(json.dumps(rep, indent=2, sort_keys=True))
        return 0
    lm = rep["lmdb"]
    rec = rep["last_recovery"]
    if rec and "unparsable" in rec:
        rec_s = f"unreadable record {rec['unparsable']!r}"
    elif rec:
        rec_s = (f"{_when(rec.get('at'))}, {rec.get('seconds', 0):.3f} s: {rec.get('entries', 0):,} entries, "
                 f"{rec.get('purged', 0)} purged under tombstones, {rec.get('corrupt', 0)} corrupt, "
                 f"{rec.get('foreign', 0)} foreign, {rec.get('tombs_dropped', 0)} tombstones dropped")
    else:
        rec_s = "none recorded"
    ns_s = ", ".join(f"{k!r} ({v:,})" for k, v in sorted(rep["entry_namespaces"].items())) or "-"
    rows = [
        ("path", rep["path"]),
        ("format version", f"{rep['format_version']} (this tiered_kv: {rep['format_version_supported']})"),
        ("namespace", repr(rep["namespace"])),
        ("block bytes", _n(rep["block_bytes"])),
        ("created", f"unreadable record {rep['created_raw']!r}" if "created_raw" in rep else _when(rep["created"])),
        ("writer", ", ".join(f"pid {p}" for p in rep["writer_pids"]) + " (a TierManager holds the path)"
         if rep["writer_pids"] else "none (no TierManager holds the path)"),
        ("entries", f"{rep['entries']:,}" + (f" ({rep['foreign_entries']:,} of another namespace or size, "
                                             f"{rep['unparsable_entries']:,} unparsable)"
                                             if rep["foreign_entries"] or rep["unparsable_entries"] else "")),
        ("entry namespaces", ns_s),
        ("stored bytes", f"{rep['stored_bytes']:,} in LMDB (payload {rep['payload_bytes']:,}: "
                         f"{rep['slot_entries']:,} entries in the slot file, {rep['inline_entries']:,} inline)"),
        ("tombstones", f"{rep['tombstones']:,}"),
        ("touch records", f"{rep['touch_records']:,}"),
        ("capacity", "not recorded on disk (the TierManager's disk_capacity_bytes)"),
        ("data.mdb", f"{rep['file_bytes']:,} bytes (the index)"),
        ("slots.tkv", f"{rep['slot_file_bytes']:,} bytes (payload slots, preallocated as the tier grows)"),
        ("map", f"{lm['map_size_bytes']:,} bytes, {lm['map_unused_bytes']:,} never used"),
        ("pages", f"{lm['pages_total']:,} of {lm['page_bytes']:,} B: {lm['pages_used']:,} in use, "
                  f"{lm['pages_free']:,} free ({lm['bytes_free']:,} bytes reusable; compact to return them)"),
        ("reader table", f"{lm['readers']} of {lm['max_readers']} slots used so far (this command included)"),
        ("last recovery", rec_s),
    ]
    if rep["leftover_compact_dirs"]:
        rows.append(("leftovers", ", ".join(rep["leftover_compact_dirs"]) + " (an interrupted compact; the next "
                                                                          "compact removes them)"))
    _rows(rows)
    return 0


# ---------------------------------------------------------------- verify
def _show_key(hexkey: Optional[str]) -> str:
    """A key for people: ``b'...'`` when printable, else hex; shortened."""
    if hexkey is None:
        return "?"
    k = bytes.fromhex(hexkey)
    text = repr(k) if all(32 <= c < 127 for c in k) else "0x" + hexkey
    return text if len(text) <= 48 else text[:45] + "..."


def _problem_line(pr: Any) -> str:
    return f"  {pr.kind:8s} {pr.reason:18s} key={_show_key(pr.key)} token={pr.token or '?'}  {pr.detail}"


def _verify(args: argparse.Namespace) -> int:
    from .ops import EXIT_OK, EXIT_PROBLEMS, verify

    bar = _Progress(args, "verify", unit="entries")
    try:
        rep = verify(args.path, repair=args.repair, progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2, sort_keys=True))
    else:
        print(f"{rep.path}: namespace {rep.namespace!r}, blocks of {rep.block_bytes:,} bytes")
        if rep.writer_pids:
            print(f"read-only check beside a live TierManager (pid {', '.join(map(str, rep.writer_pids))}): "
                  f"a consistent snapshot")
        print(f"checked {rep.checked:,} entries in {rep.seconds:.3f} s: {rep.ok:,} ok, {len(rep.corrupt):,} corrupt, "
              f"{len(rep.orphaned):,} orphaned (written under a tombstoned token)")
        shown = (rep.corrupt + rep.orphaned)[:50]
        for pr in shown:
            print(_problem_line(pr))
        if rep.problems > len(shown):
            print(f"  ... and {rep.problems - len(shown):,} more (--json lists all)")
        if rep.changed_meanwhile:
            print(f"note: {rep.changed_meanwhile:,} entries were dropped or rewritten by the live writer while "
                  f"they were read (not counted as problems)")
        if rep.dangling_touch:
            print(f"note: {rep.dangling_touch:,} touch records of absent keys (harmless; dropped at the next open)")
        if rep.repaired:
            after = rep.after or {}
            print(f"repaired: removed {rep.removed:,} entries; check after repair: {after.get('ok', 0):,} ok, "
                  f"{after.get('corrupt', 0)} corrupt, {after.get('orphaned', 0)} orphaned")
        elif rep.problems:
            print("to remove them: stop the TierManager, then 'tiered-kv verify --repair' (a TierManager never "
                  "serves them: orphaned and unparsable ones are purged when it opens, the others are misses "
                  "removed when read)")
    if rep.repaired:
        return EXIT_OK if rep.after and not (rep.after["corrupt"] or rep.after["orphaned"]) else EXIT_PROBLEMS
    return EXIT_PROBLEMS if rep.problems else EXIT_OK


# ---------------------------------------------------------------- compact
def _compact(args: argparse.Namespace) -> int:
    from .ops import compact

    bar = _Progress(args, "compact")
    try:
        rep = compact(args.path, progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2, sort_keys=True))
        return 0
    saved = rep.before_bytes - rep.after_bytes
    pct = 100.0 * saved / rep.before_bytes if rep.before_bytes else 0.0
    print(f"{rep.path}: compacted in {rep.seconds:.2f} s")
    print(f"before  {rep.before_bytes:,} bytes")
    print(f"after   {rep.after_bytes:,} bytes ({saved:,} bytes, {pct:.1f}% smaller)")
    print(f"kept    {rep.entries['blocks']:,} entries, {rep.entries['tombs']:,} tombstones, "
          f"{rep.entries['touch']:,} touch records, {rep.entries['meta']:,} meta records")
    return 0


# ---------------------------------------------------------------- export / import
def _export(args: argparse.Namespace) -> int:
    from .archive import export_archive

    bar = _Progress(args, "export", unit="entries")
    try:
        rep = export_archive(args.path, args.namespace, args.out, progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2, sort_keys=True))
        return 0
    print(f"exported {rep.frames:,} entries of namespace {rep.namespace!r} ({rep.value_bytes:,} bytes) from "
          f"{rep.path} to {rep.out} ({rep.archive_bytes:,} bytes) in {rep.seconds:.2f} s")
    if rep.skipped_corrupt or rep.skipped_orphaned:
        print(f"skipped {rep.skipped_corrupt:,} corrupt and {rep.skipped_orphaned:,} orphaned entries "
              f"(never exported; 'tiered-kv verify' lists them)")
    return 0


def _import(args: argparse.Namespace) -> int:
    from .archive import import_archive

    bars: dict[str, _Progress] = {}

    def progress(phase: str, done: int, total: int) -> None:
        if phase not in bars:
            for b in bars.values():
                b.close()
            bars[phase] = _Progress(args, phase)
        bars[phase](done, total)

    try:
        rep = import_archive(args.path, args.archive, force_namespace=args.force_namespace, progress=progress)
    finally:
        for b in bars.values():
            b.close()
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2, sort_keys=True))
        return 0
    print(f"imported {rep.imported:,} of {rep.frames:,} entries from {rep.archive} into {rep.path}"
          f"{' (created)' if rep.created else ''} in {rep.seconds:.2f} s")
    if rep.namespace_rewritten:
        print(f"namespace rewritten: {rep.archive_namespace!r} -> {rep.namespace!r} (--force-namespace)")
    print(f"already present (same key and writer): {rep.already_present:,}; kept local entry of another writer: "
          f"{rep.kept_existing:,}; replaced corrupt local entries: {rep.replaced_corrupt:,}; "
          f"skipped under a local tombstone: {rep.skipped_tombstoned:,}")
    return 0
