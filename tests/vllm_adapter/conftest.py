"""Tests of the vLLM adapter (tiered_kv.integrations.vllm): skipped as a whole without vLLM.

The main venv (``.venv``) has no vLLM; these tests run in the vLLM venv::

    .venv-vllm/bin/python -m pytest tests/vllm_adapter

(``make test`` does both).  ``harness.py`` here is an end-to-end driver run as a
subprocess, not a test module.

The directory is not called ``vllm``: ``tests/`` is on ``sys.path``, and a
directory of that name would pass for an (empty, namespace) vLLM package where
none is installed.  The check below still insists on a real vLLM module.
"""

from __future__ import annotations

import sys

import pytest


def _vllm_problem() -> str | None:
    try:
        import vllm

        if getattr(vllm, "__file__", None) is None:  # some directory named vllm, seen as a namespace package
            sys.modules.pop("vllm", None)
            return "ModuleNotFoundError: no vLLM installed"
        from vllm.v1.kv_offload.base import OffloadingSpec  # noqa: F401  (the adapter's plug-in surface)
    except Exception as exc:  # ImportError, or a broken install (torch ABI mismatch...)
        return f"{type(exc).__name__}: {exc}"
    return None


_problem = _vllm_problem()

if _problem is not None:
    _REASON = (f"vLLM is not importable here ({_problem}); the vLLM adapter tests run in the vLLM venv: "
               f".venv-vllm/bin/python -m pytest tests/vllm_adapter")

    class _SkippedModule(pytest.Module):
        """A test module of this directory, reported as skipped instead of imported."""

        def collect(self):  # type: ignore[override]
            pytest.skip(_REASON, allow_module_level=True)

    def pytest_pycollect_makemodule(module_path, parent):  # type: ignore[no-untyped-def]
        # a hook rather than a module-level skip here: that one crashes pytest when this directory is
        # named on the command line (its conftest is then loaded while the command line is parsed)
        return _SkippedModule.from_parent(parent, path=module_path)
