"""The manager's row and key maps (``_add_job``/``_drop_job``/``_jobs_of``) against a plain model.

Each map holds, per row (or key), the jobs recorded under it: one job as itself, several as a
list.  ``store()``/``load()`` take a one-key fast path; ``store_many``/``load_many`` a C loop when
no key is held; anything else goes key by key.  The model is a dict of lists; every path must
leave the same jobs under every key, in the order they were added.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings, strategies as st

from tiered_kv.manager import _add_job, _drop_job, _jobs_of


class _J:
    """A job stand-in: compared by identity, as the maps compare jobs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"J{self.n}"


def _view(m: dict[Any, Any]) -> dict[Any, list[Any]]:
    out = {k: list(_jobs_of(v)) for k, v in m.items()}
    for k, jobs in out.items():
        assert jobs, f"key {k} left with no job"
        if len(jobs) == 1:
            assert type(m[k]) is not list, f"key {k} holds a one-job list"
    return out


_keys = st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.booleans(), _keys, st.integers(0, 5)), max_size=40))
def test_maps_match_a_model(ops: list[tuple[bool, list[int], int]]) -> None:
    m: dict[Any, Any] = {}
    model: dict[int, list[Any]] = {}
    jobs = [_J(i) for i in range(6)]
    added: dict[int, list[int]] = {}   # job number -> the keys it was added under (while recorded)
    for add, ks, j in ops:
        job = jobs[j]
        if add:
            if j in added:   # the manager records a job once
                continue
            _add_job(m, ks, job)
            added[j] = ks
            for k in ks:
                model.setdefault(k, []).append(job)
        else:
            if j not in added:
                continue
            ks = added.pop(j)
            _drop_job(m, ks, job)
            for k in ks:
                model[k].remove(job)
                if not model[k]:
                    del model[k]
        assert _view(m) == model


def test_one_key_add_beside_a_held_job_makes_a_list() -> None:
    m: dict[Any, Any] = {}
    a, b = _J(1), _J(2)
    _add_job(m, [7], a)
    assert m == {7: a}
    _add_job(m, [7], b)
    assert m[7] == [a, b]
    _drop_job(m, [7], a)
    assert m == {7: b}
    _drop_job(m, [7], b)
    assert m == {}


def test_one_key_drop_of_a_job_not_there_changes_nothing() -> None:
    a, b = _J(1), _J(2)
    m: dict[Any, Any] = {7: a}
    _drop_job(m, [7], b)
    assert m == {7: a}
    _drop_job(m, [8], a)
    assert m == {7: a}
