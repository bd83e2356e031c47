import os
import shutil
from pathlib import Path

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

from tiny_models import no_leftover_hooks, tiny_model  # noqa: E402

INTEGRATION = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(items):
    """Every test under tests/integration/ is marked ``integration``: ``pytest -m "not integration"`` is the
    fast suite."""
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)


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


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """``scratch(name)``: a new folder for the module's fixtures (an exported model, a GGUF file, a built site:
    hundreds of MB each), like ``tmp_path_factory.mktemp(name)``; every one is removed once the module's tests are
    done, so that they never pile up over a run (a test's own ``tmp_path`` is removed when the test passes:
    ``tmp_path_retention_policy`` in pyproject.toml)."""
    made: list[Path] = []

    def mktemp(name: str) -> Path:
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]
    yield mktemp
    for folder in made:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def make_tiny():
    """The one factory of tiny random-weight models: ``make_tiny(arch="llama", *, seed=0, name=None,
    **config)`` builds a fresh :class:`steerkit.SteerModel` (``tiny_models.tiny_model``: the family's
    transformers config with tiny sizes, ``config`` overriding them; named ``tiny-<arch>`` unless ``name``)."""
    import steerkit

    def make(arch: str = "llama", *, seed: int = 0, name: str | None = None, **config):
        model, tok = tiny_model(arch, seed=seed, **config)
        return steerkit.wrap(model, tok, name=name or f"tiny-{arch}")
    return make


@pytest.fixture(scope="session")
def make_tiny_folder(tmp_path_factory):
    """``make_tiny_folder(arch="llama", *, seed=0, **config)``: the model :func:`make_tiny` would build, saved as a
    Hugging Face folder (weights, config, tokenizer) named ``tiny-<arch>``, once per arguments in a session; treat
    it as read-only."""
    made: dict = {}

    def make(arch: str = "llama", *, seed: int = 0, **config):
        key = (arch, seed, tuple(sorted(config.items())))
        if key not in made:
            model, tok = tiny_model(arch, seed=seed, **config)
            folder = tmp_path_factory.mktemp("tiny") / f"tiny-{arch}"
            model.save_pretrained(folder)
            tok.save_pretrained(folder)
            made[key] = folder
        return made[key]
    return make


@pytest.fixture(scope="module")
def tiny(make_tiny, request):
    """A tiny random-weight Llama for the module's tests (``make_tiny()``: 2 blocks, d_model 64; a module's
    ``TINY`` dict, e.g. ``TINY = {"num_hidden_layers": 3}``, passes its options); its hooks and attached SAEs
    are removed afterwards."""
    sm = make_tiny("llama", **getattr(request.module, "TINY", {}))
    yield sm
    sm.reset()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for the module (sums in one order: graphs compared value by value), restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def circuit_sm():
    """The tiny Llama the circuit tests trace (``tiny_models.tiny_circuit_llama``, seed 3: features that fire on
    its prompts), wrapped once for the module."""
    import steerkit
    from tiny_models import tiny_circuit_llama

    model, tok = tiny_circuit_llama(seed=3)
    return steerkit.wrap(model, tok, name="tiny-circuit-llama")


@pytest.fixture(scope="module")
def corpus_slice(tmp_path_factory) -> Path:
    """A slice of the vendored corpus for the training tests: 8 documents' first 1,500 characters (a character
    tokenizer: ~12k tokens), as a .jsonl file."""
    import json

    import steerkit.probes

    docs = steerkit.probes.read_corpus()
    path = tmp_path_factory.mktemp("corpus") / "slice.jsonl"
    path.write_text("".join(json.dumps({"text": d[:1500]}) + "\n" for d in docs[::46][:8]), encoding="utf-8")
    return path
