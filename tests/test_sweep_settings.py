"""The state machines' hypothesis settings (tests/fakes.py: ``sm_settings``) and the random sweep that
``make test`` (what CI runs) adds after the main run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

MACHINES = ("tests/test_state_machine.py", "tests/test_cuda_mover_state_machine.py", "tests/test_spill_group_machine.py")
SWEEP_MAX = 1000   # examples per machine: 500 take about a minute and a half for the three on 2 cores


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
    assert s.database is None   # nothing replayed from an example database: the seed alone decides the examples
    monkeypatch.setenv(SWEEP_ENV, "lots")
    with pytest.raises(ValueError, match="lots"):
        sm_settings(7, 20)


def _draws(monkeypatch: pytest.MonkeyPatch, seed: int) -> list[int]:
    """Every value a small state machine draws in a sweep run under ``--hypothesis-seed=seed``."""
    import hypothesis.core
    from fakes import SWEEP_ENV, sm_settings
    monkeypatch.setenv(SWEEP_ENV, "5")
    monkeypatch.setattr(hypothesis.core, "global_force_seed", seed)   # what pytest's --hypothesis-seed sets
    seen: list[int] = []

    class Machine(RuleBasedStateMachine):
        @rule(n=st.integers(0, 1 << 30))
        def draw(self, n: int) -> None:
            seen.append(n)

    run_state_machine_as_test(Machine, settings=sm_settings(100, 10))
    return seen


def test_a_sweep_is_reproduced_by_its_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep (random examples) of a state machine replays exactly under the same --hypothesis-seed, and
    another seed gives other examples: the seed the Makefile prints is enough to reproduce a failure."""
    first = _draws(monkeypatch, 21)
    assert first and _draws(monkeypatch, 21) == first
    assert _draws(monkeypatch, 22) != first


def _test_recipe() -> str:
    """The recipe of the Makefile's ``test:`` target (its tab-indented lines, continuations joined)."""
    lines = (Path(__file__).resolve().parent.parent / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("test:"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line[1:])
    return "\n".join(recipe).replace("\\\n", " ")


def test_make_test_ends_with_a_bounded_random_sweep_whose_seed_is_printed() -> None:
    """``make test`` runs, after the main run, the state machines on a fixed, bounded budget of random
    examples, under a seed it echoes before the run and again on failure, passed as --hypothesis-seed."""
    recipe = _test_recipe()
    lines = recipe.splitlines()
    main = next(i for i, line in enumerate(lines) if re.search(r"-m pytest -q\s*$", line))
    sweep = next(i for i, line in enumerate(lines) if "TIERED_KV_SWEEP_EXAMPLES=" in line)
    assert main < sweep, "the sweep runs after the main run"
    cmd = lines[sweep]
    n = int(re.search(r"TIERED_KV_SWEEP_EXAMPLES=(\d+)", cmd).group(1))  # type: ignore[union-attr]
    assert 1 <= n <= SWEEP_MAX, f"the sweep's budget must be fixed and bounded, got {n}"
    assert all(m in cmd for m in MACHINES), cmd
    assert "--hypothesis-seed=$$seed" in cmd
    assert "seed=" in cmd.split("TIERED_KV_SWEEP_EXAMPLES=")[0], "the seed is chosen before the run"
    echo = cmd.index('echo "state machine sweep, seed $$seed')
    assert echo < cmd.index("env $$run"), "the seed is printed before the run"
    on_failure = cmd[cmd.index("env $$run"):]
    assert "||" in on_failure and "$$seed" in on_failure and "exit 1" in on_failure, \
        "a failing sweep prints its seed and fails make"
