"""steerkit: record, find, edit and deploy directions in a language model's residual stream.

Quick start::

    import steerkit
    sm = steerkit.load_model()                      # embedded SmolLM2-135M-Instruct
    with sm.record(steerkit.resid_post(range(sm.n_layers)), positions="last") as cache:
        sm.forward(["I love this", "I hate this"])
    v = cache["blocks.15.hook_resid_post"][0] - cache["blocks.15.hook_resid_post"][1]
    with sm.edit("blocks.15.hook_resid_post", add=v, scale=4.0):
        print(sm.generate(["Tell me about your day"], max_new_tokens=32))

See ``docs/ARCHITECTURE.md`` for how data flows through the package.
"""
from __future__ import annotations

import importlib

from steerkit.version import __version__

from steerkit.errors import (BackendUnavailableError, HookNameError, InputError, ModelNotFoundError, RowIndexError,
                             SteerkitError, UnsupportedArchitectureError)
from steerkit.generation import Recycle, continuation_logprobs, continue_thinking
from steerkit.hooks.manager import ActivationCache, HookHandle, RecordHandle
from steerkit.hooks.names import layer_names, resid_post, resid_pre
from steerkit.hooks.positions import AnyOf, TokenMatch
from steerkit.interventions import (ORTHO_TOL, CompiledSteering, Condition, Gate, Intervention, ModelFacts, Polyhedron,
                                    Steerable,
                                    When, orthonormalize)
from steerkit.loading.adapters import Adapter, adapter_for, register_adapter
from steerkit.model import SteerModel, Tokens, load_model, wrap

__all__ = [
    "__version__", "load_model", "wrap", "SteerModel", "Tokens", "Adapter", "adapter_for", "register_adapter",
    "Intervention", "Steerable", "Gate", "Condition", "When", "ModelFacts", "CompiledSteering", "orthonormalize", "ORTHO_TOL",
    "Polyhedron", "ActivationCache", "HookHandle", "RecordHandle", "layer_names", "resid_post", "resid_pre",
    "TokenMatch", "AnyOf",
    "SteerkitError", "HookNameError", "InputError", "ModelNotFoundError", "UnsupportedArchitectureError",
    "BackendUnavailableError", "RowIndexError",
    "generate", "Recycle", "continue_thinking", "continuation_logprobs",
]

#: subpackages reachable as attributes (``import steerkit; steerkit.probes``), imported on first use: the layers
#: above the core (and the extras some of them need) load only when asked for
SUBPACKAGES = ("probes", "vectors", "kernels", "apps", "serving", "cli", "interventions", "hooks", "loading",
               "storage", "backends", "sae")


#: names of the layers above the core offered at the top level, imported on first use: name -> its module
LAZY_NAMES = {"load_sae": "steerkit.vectors", "load_transcoders": "steerkit.vectors"}


def __getattr__(name: str):
    """``steerkit.probes`` and the other subpackages without a separate import, and the few names of the layers
    above the core offered here (:data:`LAZY_NAMES`: ``steerkit.load_sae`` is ``steerkit.vectors.load_sae``,
    ``steerkit.load_transcoders`` ``steerkit.vectors.load_transcoders``).

    Examples:
        >>> import steerkit
        >>> steerkit.vectors.SteeringVector.__name__, steerkit.probes.__name__
        ('SteeringVector', 'steerkit.probes')
        >>> steerkit.load_sae is steerkit.vectors.load_sae
        True
    """
    if name in SUBPACKAGES:
        return importlib.import_module(f"steerkit.{name}")
    if name in LAZY_NAMES:
        return getattr(importlib.import_module(LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'steerkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(SUBPACKAGES) | set(LAZY_NAMES))

def generate(sm: SteerModel, prompts, **kwargs):
    """``steerkit.generate(model, prompts, ...)``: the same as ``sm.generate``.

    Examples:
        >>> out = steerkit.generate(tiny, ["Hello", "Bye"], max_new_tokens=3, chat=False)
        >>> out == tiny.generate(["Hello", "Bye"], max_new_tokens=3, chat=False), len(out)
        (True, 2)
    """
    return sm.generate(prompts, **kwargs)
