"""Cost of the vLLM adapter's per-step bookkeeping on the scheduler thread.

``SlabTiers.tick()`` plus ``pending_work`` (what vLLM calls once per engine step) with 200
store jobs of 4 keys in flight and a disk tier open.  To compare two versions, run it with
``PYTHONPATH`` pointing at each checkout::

    .venv/bin/python benchmarks/bench_scheduler_step.py LABEL
"""
import sys, time, tempfile, statistics
from pathlib import Path
from prometheus_client import CollectorRegistry
from tiered_kv.config import TieredKVConfig
from tiered_kv.metrics import Metrics
from tiered_kv.integrations.slab import SharedSlab
from tiered_kv.integrations.offload import SlabTiers
d = Path(tempfile.mkdtemp())
slab = SharedSlab.open(d / "s.slab", 1024, 4096, 1)
cfg = TieredKVConfig(namespace="t", host_capacity_bytes=1024 * 4096, disk_path=d / "disk", disk_capacity_bytes=4096 * 4096)
tiers = SlabTiers(cfg, slab, metrics=Metrics(registry=CollectorRegistry(), namespace="t"))
# a steady state: 200 live store jobs of 4 keys each (a busy step), none finishing
for i in range(200):
    tiers.prepare_store([f"k{i}-{j}".encode() for j in range(4)])
res = []
for rep in range(7):
    t0 = time.perf_counter()
    for _ in range(20000):
        tiers.tick(); tiers.pending_work
    res.append((time.perf_counter() - t0) / 20000 * 1e6)
print(f"{sys.argv[1] if len(sys.argv) > 1 else 'this checkout'}: tick()+pending_work per step, 200 live jobs: median {statistics.median(res):.2f} us (min {min(res):.2f})")
tiers.close()
