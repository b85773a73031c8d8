"""Fixtures of the core test-suite (helpers live in tests/fakes.py)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
from hypothesis import Phase, settings
from prometheus_client import CollectorRegistry

sys.path.insert(0, os.path.dirname(__file__))

import fakes  # noqa: E402

pytest_plugins = ["redis_servers"]   # real redis-server processes for the remote tier's tests
from fakes import FakeMover, make_config, make_fake_manager  # noqa: E402
from tiered_kv import TieredKVConfig, TierManager  # noqa: E402


def _mutating() -> bool:
    """``make mutate`` runs this test process against one mutant (mutmut names it in the environment)."""
    return "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", "")


@pytest.fixture(autouse=True)
def _disk_io_for_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """``disk_config`` (tests/disk_helpers.py) and ``make_config`` (tests/fakes.py) make managers with the library's default disk I/O, the
    disk I/O process; a test marked ``disk_threads`` (or a module with ``pytestmark`` of it) gets the
    in-process threads, whose writer and readers it can hook."""
    import disk_helpers
    io = "thread" if request.node.get_closest_marker("disk_threads") else None
    disk_helpers.DEFAULT_DISK_IO = fakes.DEFAULT_DISK_IO = io
    yield
    disk_helpers.DEFAULT_DISK_IO = fakes.DEFAULT_DISK_IO = None


@pytest.fixture(autouse=True)
def _every_interrupt_point_fires() -> Iterator[None]:
    """A test that arms an interrupt at a named call return (``test_review_round29_sweep._interrupt_on``) fails when
    that return never came: a point renamed or gone from the code would leave the test passing, testing nothing."""
    mod = sys.modules.get("test_review_round29_sweep")
    if mod is not None:
        mod.ARMED.clear()
    yield
    mod = sys.modules.get("test_review_round29_sweep")
    if mod is None:
        return
    dead = [what for what, fired in mod.ARMED if not fired]
    mod.ARMED.clear()
    assert not dead, f"interrupt points armed that never came (gone from the code?): {dead}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``make mutate``, a mutant's tests run fastest first: mutmut 3.8.1 hands them over in set
    order, and a killed mutant should cost its quickest failing test, not a state machine's run."""
    if not _mutating():
        return
    try:
        with open("mutmut-stats.json", encoding="utf-8") as f:   # mutmut runs the tests inside mutants/
            durations = json.load(f)["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return
    items.sort(key=lambda item: durations.get(item.nodeid, 0.0))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``make mutate``, Hypothesis does not shrink a failing example: the failure is all a mutant
    needs, and shrinking a state machine's can take many minutes.  Done when the test runs, not at
    import: mutmut imports the tests once, then forks a process per mutant."""
    if not _mutating():
        return
    phases = (Phase.explicit, Phase.reuse, Phase.generate)
    cls = getattr(item, "cls", None)
    if cls is not None and isinstance(getattr(cls, "settings", None), settings):   # a state machine's TestCase
        cls.settings = settings(cls.settings, phases=phases)
    fn = getattr(item, "obj", None)
    own = getattr(fn, "_hypothesis_internal_use_settings", None)
    if isinstance(own, settings):                                               # an @given test
        fn._hypothesis_internal_use_settings = settings(own, phases=phases)


@pytest.fixture
def kv() -> torch.Tensor:
    """A seeded device tensor: 256 rows of shape (2, 4, 8) float16 (128 bytes per row)."""
    return fakes.make_kv(256, seed=1234)


@pytest.fixture
def row_bytes(kv: torch.Tensor) -> int:
    return int(kv[0].numel() * kv.element_size())


@pytest.fixture
def cfg(row_bytes: int) -> TieredKVConfig:
    """64 host slots."""
    return make_config(host_slots=64, row_bytes=row_bytes)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def fake(cfg: TieredKVConfig, kv: torch.Tensor, registry: CollectorRegistry) -> Iterator[tuple[TierManager, FakeMover]]:
    """A manager driven by a FakeMover, on a fresh registry: ``mgr, mover = fake``."""
    mgr, mover = make_fake_manager(cfg, kv, registry)
    yield mgr, mover
    mgr.close()


@pytest.fixture
def manager(cfg: TieredKVConfig, kv: torch.Tensor, registry: CollectorRegistry) -> Iterator[TierManager]:
    """A manager with the real ThreadMover, on a fresh registry."""
    mgr = TierManager(cfg, kv, registry=registry)
    yield mgr
    mgr.close()


@pytest.fixture
def metric(registry: CollectorRegistry) -> Callable[..., float]:
    """``metric(name, **labels)``: a sample's value on the test's registry (0.0 if absent)."""
    def read(name: str, labels: Any = None, **kw: str) -> float:
        return fakes.sample(registry, name, labels, **kw)
    return read


@pytest.fixture
def fill_row() -> Callable[[torch.Tensor, int, bytes], None]:
    """``fill_row(kv, row, key)``: write the bytes derived from ``key`` into the row."""
    return fakes.fill_row
