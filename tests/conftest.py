import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton runs interpreted where there is no CUDA device. The variable is read when steerkit.kernels creates
# its kernels, which the import of any test module may cause (test_steering imports steerkit.kernels): set
# here, before every module, so the order in which files run does not matter (tests/kernels/conftest.py).
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

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
