"""Tests of the vLLM adapter (tiered_kv.integrations.vllm): skipped as a whole without vLLM.

The main venv (``.venv``) has no vLLM; these tests run in the vLLM venv::

    .venv-vllm/bin/python -m pytest tests/vllm

(``make test`` does both).  ``harness.py`` here is an end-to-end driver run as a
subprocess, not a test module.
"""

from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401
except Exception as exc:  # ImportError, or a broken install (torch ABI mismatch...)
    pytest.skip(f"vLLM is not importable here ({type(exc).__name__}: {exc}); the vLLM adapter tests run in "
                f"the vLLM venv: .venv-vllm/bin/python -m pytest tests/vllm", allow_module_level=True)
