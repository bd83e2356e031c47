"""Fixtures for steerkit.vectors tests.

``tiny_llama`` is a randomly initialised 4-block Llama (d_model 64) built in memory: fast,
offline, and enough to check hooks, fingerprints and weight orthogonalisation. The real embedded model is the
suite-wide ``default_model`` (tests/conftest.py, loaded once).
"""

from __future__ import annotations

import pytest
from _vectors_helpers import make_tiny_llama

from steerkit.vectors import Store


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture()
def store(tmp_path):
    return Store(tmp_path / "store")
