import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model():
    """The real embedded default model (SmolLM2-135M-Instruct), HF backend, float32, loaded once."""
    import steerkit
    sm = steerkit.load_model()
    yield sm
    sm.reset()


@pytest.fixture
def sm(default_model):
    """The default model, checked to carry no leftover hooks before and after each test."""
    before = default_model.hook_count()
    yield default_model
    leftover = default_model.hook_count() - before
    default_model.reset()
    assert leftover == 0, f"test left {leftover} hooks on the model"
