"""Operator tools for a disk tier directory: inspect, verify/repair, compact (:mod:`.ops`), export/import
(:mod:`.archive`), and their ``tiered-kv`` subcommands (:mod:`.ops_cli`).

They take the path lock of :mod:`tiered_kv.disk.lock` and use the environment constants and meta
records of :mod:`tiered_kv.disk.env`, exactly as a running :class:`~tiered_kv.disk.DiskStore` does.
"""
