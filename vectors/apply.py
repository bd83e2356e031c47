"""Checking an artifact against a model before it steers.

:func:`check_against` compares an artifact's provenance with a model's facts
(:class:`steerkit.ModelFacts`, or a ``{"name", "d_model", "n_layers", "fingerprint"}`` dict for a
model this process does not hold, e.g. one a vLLM server serves): ``d_model``, ``n_layers`` (every
layer the artifact touches must exist) and the model fingerprint. A mismatch raises
:class:`ModelMismatchError` naming both sides; ``override=True`` turns fingerprint and n_layers
mismatches into warnings (a ``d_model`` mismatch can never be applied). Fields the artifact does not
know (e.g. a vector imported from a foreign format) are reported as a warning.

Applying goes through the one steering path: every artifact kind has
``to_interventions(facts, scale=..., override=...)`` (it runs this check first), and
``sm.steer(artifact)`` compiles what it returns.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

from steerkit.loading.fingerprint import model_fingerprint
from steerkit.interventions import ModelFacts

from .errors import ModelMismatchError, VectorsError

_FP_CACHE: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _hf(model: Any) -> Any:
    return getattr(model, "hf_model", None) or getattr(model, "model", None) if not hasattr(model, "config") else model


def fingerprint_of(model: Any) -> str:
    """The fingerprint of a SteerModel or a bare HF model, computed once per model object (held weakly).

    Examples:
        >>> from steerkit.vectors import fingerprint_of
        >>> fp = fingerprint_of(tiny)
        >>> fp == fingerprint_of(tiny.hf_model) == tiny.fingerprint(), fp[:4]
        (True, 'sk1:')
    """
    hf = _hf(model)
    fp = _FP_CACHE.get(hf)
    if fp is None:
        fp = _FP_CACHE[hf] = model_fingerprint(hf)
    return fp


def facts_of(model: Any) -> ModelFacts:
    """:class:`ModelFacts` of a SteerModel (its own) or of a bare HF model.

    Examples:
        >>> from steerkit.vectors import facts_of
        >>> f = facts_of(tiny.hf_model)
        >>> f.n_layers, f.d_model, f.n_heads, f.d_mlp
        (4, 64, 4, 128)
    """
    f = getattr(model, "facts", None)
    if isinstance(f, ModelFacts):
        return f
    hf = _hf(model)
    cfg = getattr(hf, "config", None)
    if cfg is None:
        raise VectorsError(f"expected a SteerModel or a Hugging Face model with a config, found "
                           f"{type(model).__name__} without one; pass the SteerModel or its hf_model")
    name = str(getattr(model, "name", None) or getattr(cfg, "_name_or_path", None) or type(hf).__name__)
    return ModelFacts.from_hf_config(hf.config, name=name, fingerprint=fingerprint_of(hf), model=hf)


def _layers_of(a: Any) -> list[int]:
    layers = getattr(a, "layers", None)
    if isinstance(layers, list):
        return layers
    layer = getattr(a, "layer", None)
    return [layer] if isinstance(layer, int) else []


def check_compatible(artifact: Any, model: Any, *, override: bool = False) -> list[str]:
    """Check ``artifact`` against ``model``; returns warnings, raises ModelMismatchError on a mismatch.

    Examples:
        >>> from steerkit.vectors import ModelMismatchError, SteeringVector, check_compatible
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2, model=tiny)
        >>> check_compatible(v, tiny)  # same model: nothing to warn about
        []
        >>> try:
        ...     check_compatible(SteeringVector.from_direction(torch.ones(64), layer=9), tiny)
        ... except ModelMismatchError as e:
        ...     print(str(e)[:30])
        expected layers below 4, found
    """
    return check_against(artifact, facts_of(model), override=override, stacklevel=4)


def check_against(artifact: Any, facts: ModelFacts | dict, *, override: bool = False, stacklevel: int = 3) -> list[str]:
    """:func:`check_compatible` against a model's facts (see the module docstring).

    Examples:
        >>> from steerkit.vectors import SteeringVector, check_against
        >>> v = SteeringVector.from_direction(torch.ones(64), layer=2)  # made without a model
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as issued:
        ...     notes = check_against(v, tiny.facts)  # each note is also issued as a warning
        >>> "no model fingerprint" in notes[0]
        True
    """
    if isinstance(facts, ModelFacts):
        facts = facts.as_dict()
    p = artifact.provenance
    fp = facts.get("fingerprint")
    ours = (f"this model is {facts['name']!r} (fingerprint {fp}, d_model={facts['d_model']}, "
            f"n_layers={facts['n_layers']})")
    theirs = (f"the artifact was made for {p.model_name!r} (fingerprint {p.model_fingerprint}, "
              f"d_model={p.d_model}, n_layers={p.n_layers})")
    notes: list[str] = []
    if artifact.d_model != facts["d_model"]:
        raise ModelMismatchError(
            f"expected an artifact of d_model={facts['d_model']}, found d_model={artifact.d_model}: {theirs}; {ours}. "
            "A vector of another width cannot be applied, not even with override=True"
        )
    bad = [l for l in _layers_of(artifact) if facts["n_layers"] is not None and l >= facts["n_layers"]]
    problems = []
    if p.n_layers is not None and facts["n_layers"] is not None and p.n_layers != facts["n_layers"]:
        problems.append(f"n_layers differs ({p.n_layers} vs {facts['n_layers']})")
    if bad:
        raise ModelMismatchError(f"expected layers below {facts['n_layers']}, found {bad}: {theirs}; {ours}")
    if p.model_fingerprint is not None and p.model_fingerprint != fp:
        problems.append(f"fingerprint differs ({p.model_fingerprint} vs {fp})")
    if problems:
        msg = f"{'; '.join(problems)}: {theirs}; {ours}"
        if not override:
            raise ModelMismatchError(msg + ". Pass override=True to apply it anyway")
        notes.append("override: " + msg)
    if p.model_fingerprint is None:
        notes.append(f"the artifact records no model fingerprint, so it cannot be checked against {facts['name']!r}")
    for n in notes:
        warnings.warn(n, stacklevel=stacklevel)
    return notes
