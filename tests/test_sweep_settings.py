"""The state machines' hypothesis settings (tests/fakes.py: ``sm_settings``)."""

from __future__ import annotations

import pytest


def test_state_machine_settings_sweep_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state machines run fixed examples in CI; TIERED_KV_SWEEP_EXAMPLES=N asks for N random ones."""
    from fakes import SWEEP_ENV, sm_settings
    monkeypatch.delenv(SWEEP_ENV, raising=False)
    s = sm_settings(7, 20, report_multiple_bugs=False)
    assert (s.max_examples, s.stateful_step_count, s.derandomize, s.database, s.deadline) == (7, 20, True, None, None)
    assert s.report_multiple_bugs is False
    monkeypatch.setenv(SWEEP_ENV, "1000")
    s = sm_settings(7, 20)
    assert (s.max_examples, s.stateful_step_count, s.derandomize) == (1000, 20, False)
    monkeypatch.setenv(SWEEP_ENV, "lots")
    with pytest.raises(ValueError, match="lots"):
        sm_settings(7, 20)
