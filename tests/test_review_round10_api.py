"""Review round 10: the public API boundary and fault handling.

What it proved wrong (each fixed; each test fails without its fix):

1. a ``mover_factory`` that returns no ``Mover`` was accepted, and the first ``store()`` raised
   ``AttributeError`` after recording its job (``close()`` too).  Fixed: the constructor refuses the result
   with a ``ConfigError``;
2. ``TieredKVConfig.from_env`` let ``TypeError``/``AttributeError`` escape for a prefix that is not a str, an
   ``environ`` that is not a mapping of str to str.  Fixed: ``ConfigError`` naming the value;
3. a ``disk_path`` that is not valid UTF-8 (lone surrogates from the environment) passed the config check and
   the tier opened host-only ("cannot be opened with these sizes"): LMDB opens UTF-8 paths only.  Fixed:
   refused by ``check_disk_path``, as ``check_namespace`` refuses such a namespace;
4. a nested tensor (layout strided, no one shape) escaped ``check_device_blocks`` as torch's ``RuntimeError``.
   Fixed: a ``DeviceTensorError``.

The contract these tests hold the library to (``tiered_kv/errors.py``, ``tiered_kv/manager.py``'s module
docstring): "Every error the library raises on bad input derives from TieredKVError and names the offending
value.  A raised error never leaves the manager in a changed state: validation happens before any
bookkeeping is touched."  Faults (EIO, ENOSPC, byte flips, a SIGKILLed disk I/O process) were injected
beside seeded fuzzes of the public calls and found handled: nothing raised, no wrong bytes.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from prometheus_client import CollectorRegistry

import torch

from fakes import fill_row, make_config, make_kv
from tiered_kv import TieredKVConfig, TierManager
from tiered_kv.errors import ConfigError, DeviceTensorError, TieredKVError


# ============================================================================ TierManager(mover_factory=...)
def test_a_mover_factory_that_returns_no_mover_is_refused_before_any_state_changes() -> None:
    """``TierManager(..., mover_factory=f)`` checks only that ``f`` is callable (``checks.check_mover_factory``,
    tiered_kv/checks.py:151); what it returns is stored as the mover unchecked (tiered_kv/manager.py:218,
    ``self._mover = mover_factory(...)``), although ``MoverFactory`` is typed to return a ``Mover``
    (movers/base.py:45, an ABC).  A factory that returns ``None`` (a factory that forgot its ``return``) is
    accepted; the bad value is found only by the first ``store()``, which has by then recorded the job,
    reserved a host slot and put the row in ``_row_stores`` (manager.py ``_submit_store``), and raises
    ``AttributeError`` -- not a TieredKVError.  The job never reports, its slot stays leased, and ``close()``
    raises ``AttributeError`` too (``self._mover.close()``), so the manager cannot even be closed.

    Expected: the constructor refuses the factory's result with a ``ConfigError`` naming it (an
    ``isinstance(mover, Mover)`` check right after the call, before the core is built)."""
    kv = make_kv(16)
    try:
        mgr = TierManager(make_config(8), kv, registry=CollectorRegistry(), mover_factory=lambda d, h, c: None)
    except ConfigError as exc:
        assert "mover_factory" in str(exc) and "None" in str(exc), str(exc)
        return
    fill_row(kv, 0, b"a")
    try:
        mgr.store(b"a", 0)
    except TieredKVError:
        pass
    except Exception as exc:  # noqa: BLE001 - the defect: a non-library error, after state changed
        pytest.fail(f"store() raised {type(exc).__name__}: {exc}, after recording state "
                    f"(jobs_in_flight={mgr.jobs_in_flight}, host_used_slots={mgr.host_used_slots}, "
                    f"row_stores={mgr.debug_sizes()['row_stores']})")
    mgr.close()


# ============================================================================ TieredKVConfig.from_env
_BASE_ENV = {"TIERED_KV_NAMESPACE": "m|u8|tp0", "TIERED_KV_HOST_CAPACITY_BYTES": "4096"}

_FROM_ENV_BAD: dict[str, Callable[[], Any]] = {
    # a mapping of settings whose values are already numbers (a config dict passed as ``environ``)
    "environ-value-int": lambda: TieredKVConfig.from_env(environ={**_BASE_ENV, "TIERED_KV_HOST_CAPACITY_BYTES": 4096}),
    "environ-not-a-mapping": lambda: TieredKVConfig.from_env(environ=list(_BASE_ENV.items())),
    "environ-key-not-str": lambda: TieredKVConfig.from_env(environ={**_BASE_ENV, 1: "x"}),
    "prefix-None": lambda: TieredKVConfig.from_env(prefix=None, environ=_BASE_ENV),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("case", list(_FROM_ENV_BAD), ids=list(_FROM_ENV_BAD))
def test_from_env_bad_argument_types_are_config_errors(case: str) -> None:
    """``TieredKVConfig.from_env(prefix, environ)`` is public API, and ``errors.py`` says every error the library
    raises on bad input is a TieredKVError naming the value.  ``from_env`` never checks its arguments'
    types: ``env.get(prefix + ...)`` (tiered_kv/config.py:359) raises ``TypeError`` for ``prefix=None`` and
    ``AttributeError`` for a list of pairs as ``environ``; ``var.startswith(prefix)`` (config.py:366)
    raises ``AttributeError`` for a non-str key; and ``_parse_env`` catches only ``ValueError``
    (config.py:400), so an environ value that is an ``int`` (``int(4096, 0)``) escapes as a bare
    ``TypeError`` -- while the same
    non-str value for ``namespace`` is a ``ConfigError`` (it is passed through unparsed).

    Expected: a ``ConfigError`` naming the argument or the variable and its value."""
    with pytest.raises(ConfigError):
        _FROM_ENV_BAD[case]()


# ============================================================================ disk_path that is not UTF-8
def test_a_disk_path_that_is_not_utf8_is_refused_or_opened(tmp_path) -> None:
    """A path from the environment whose bytes are not UTF-8 arrives as a str with lone surrogates
    (``os.fsdecode``): ``/data/kv\\udcff``.  It is a valid POSIX path -- ``os`` functions take it, and the tier
    does create the directory and its lock file there -- but ``DiskEnv`` hands it to ``lmdb.open(str(path))``
    (tiered_kv/disk/env.py:126), which encodes it strictly as UTF-8: ``UnicodeEncodeError``, a ``ValueError``,
    which ``DiskStore._open`` (tiered_kv/disk/store.py:141-143) reports as "cannot be opened with these sizes".
    The manager then runs host-only (``open_failed``, ``tiered_kv_healthy{tier="disk"} 0``) although nothing is
    wrong with the path or the sizes.  ``TieredKVConfig.__post_init__`` checks the namespace for exactly this
    case ("from the environment, undecodable bytes arrive as lone surrogates", ``check_namespace``) but
    ``check_disk_path`` (tiered_kv/config.py:54) refuses only NUL bytes, so the bad value is accepted at
    configuration and fails silently later.

    Expected: either ``TieredKVConfig`` refuses such a path with a ``ConfigError`` naming ``disk_path``, or the
    disk tier opens it (``lmdb.open(os.fsencode(path), ...)``)."""
    import disk_helpers as dh

    path = str(tmp_path / "kv\udcff")   # the bytes b"kv\xff": a valid file name on Linux
    try:
        cfg = dh.disk_config(path, host_slots=2, disk_slots=16, host_evict_ahead_blocks=0, disk_io="thread")
    except ConfigError as exc:
        assert "disk_path" in str(exc), str(exc)
        return
    kv = dh.make_kv(8)
    mgr = TierManager(cfg, kv, registry=CollectorRegistry())
    try:
        assert mgr.disk is not None, (
            f"disk tier not opened (host-only) for a valid path; open_failed="
            f"{dh.metric(mgr, 'tiered_kv_errors_total', tier='disk', error='open_failed')}")
        dh.store_one(mgr, kv, b"k", 0)
        assert mgr.disk_blocks == 1
    finally:
        mgr.close()


# ============================================================================ device_blocks: a nested tensor
def test_a_nested_device_tensor_is_a_device_tensor_error() -> None:
    """``check_device_blocks`` (tiered_kv/checks.py:123) refuses tensors whose layout is not ``torch.strided``
    (the fix of an earlier round for sparse and MKLDNN tensors, tests/test_review_boundary.py), but a nested
    tensor made by ``torch.nested.nested_tensor(...)`` with its default layout reports ``layout ==
    torch.strided``: it passes checks.py:126 and the dtype and ``dim()`` checks, and ``t.shape[0]``
    (checks.py:133) raises torch's ``RuntimeError: Internal error: NestedTensorImpl doesn't support sizes``
    out of ``TierManager(...)`` -- not a DeviceTensorError naming ``device_blocks``.

    Expected: ``DeviceTensorError`` (e.g. ``if t.is_nested: raise DeviceTensorError(...)`` before the shape is
    read)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "nested tensors are a prototype"
        t = torch.nested.nested_tensor([torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 8, dtype=torch.float16)])
    assert t.layout is torch.strided and t.is_nested
    with pytest.raises(DeviceTensorError, match="device_blocks"):
        TierManager(make_config(4, row_bytes=32), t, registry=CollectorRegistry())
