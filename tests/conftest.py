import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.tiny_models import no_leftover_hooks  # noqa: E402


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
    with no_leftover_hooks(default_model) as m:
        yield m
