"""Checks shared by the refusal method's tests (tests/probes) and the run-from-a-cache tests (tests/core)."""
from __future__ import annotations

import math

import pytest


def same_tables(a, b, tol=1e-5):
    """Two refusal selections agree: the same table (scores within ``tol``), statuses, choice and baselines."""
    assert [(c.pos, c.layer) for c in a.table] == [(c.pos, c.layer) for c in b.table]
    for x, y in zip(a.table, b.table):
        for k in ("bypass", "induce", "kl"):
            u, v = getattr(x, k), getattr(y, k)
            assert math.isnan(u) == math.isnan(v), (x, y, k)
            if not math.isnan(u):
                assert abs(u - v) <= tol * max(1.0, abs(v)), (x, y, k)
        assert x.status == y.status, (x, y)
    assert (a.best.pos, a.best.layer) == (b.best.pos, b.best.layer) and a.rule == b.rule
    assert a.baseline_harmful == pytest.approx(b.baseline_harmful) and a.baseline_harmless == pytest.approx(
        b.baseline_harmless)




def steer_rows_spy(monkeypatch, sm) -> list:
    """Watch ``sm.steer``: the returned list gets, for each call, its number of per-row steerings (1 for a
    shared steering)."""
    calls: list = []
    real = sm.steer

    def spy(steering=None, *a, rows=None, **k):
        calls.append(len(rows) if rows is not None else 1)
        return real(steering, *a, rows=rows, **k)
    monkeypatch.setattr(sm, "steer", spy)
    return calls
