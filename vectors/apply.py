"""Applying artifacts to a model, with a compatibility check first.

How it works
------------
:func:`check_compatible` compares the artifact's provenance with the model: ``d_model``,
``n_layers`` (every layer the artifact touches must exist) and the model fingerprint
(:func:`steerkit.vectors.provenance.model_fingerprint`).  A mismatch raises
:class:`ModelMismatchError` naming both sides; ``override=True`` turns fingerprint and
n_layers mismatches into warnings (a ``d_model`` mismatch can never be applied).  Fields the
artifact does not know (e.g. a vector imported from a foreign format) are reported as a warning.

:func:`steer` is a context manager that applies a :class:`SteeringVector` or a
:class:`DirectionSet` for the duration of the ``with`` block.  On a ``SteerModel`` it goes
through the core's ``sm.edit_op`` (so steerkit's own hooks do the work):

* ``add``      -> ``edit_op("add", {blocks.l.<site>: v_l}, scale=...)`` (schedule folded in);
* ``project``  -> ``edit_op("clamp", ...)`` per layer: the component along ``v_l`` becomes
  ``scale * |v_l|``;
* ablation     -> ``edit_op("ablate", ...)`` at ``blocks.l.<site>``, or, for "everywhere"
  (``layers=None``), at ``blocks.0.hook_resid_pre`` (the embedding output) and every
  ``hook_attn_out`` and ``hook_mlp_out`` -- exactly what orthogonalised weights compute.

On a bare Hugging Face model (no ``edit_op``) it registers plain forward hooks on
``model.model.layers[l]`` (whose output is ``blocks.l.hook_resid_post``), on the embedding and
on each ``o_proj`` / ``down_proj``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

from .artifacts import DirectionSet, SteeringVector
from .errors import ModelMismatchError, VectorsError
from .provenance import model_fingerprint

_FP_CACHE: dict[int, tuple[Any, str]] = {}


def _hf(model: Any) -> Any:
    return getattr(model, "hf_model", None) or getattr(model, "model", None) if not hasattr(model, "config") else model


def fingerprint_of(model: Any) -> str:
    hf = _hf(model)
    key = id(hf)
    hit = _FP_CACHE.get(key)
    if hit is not None and hit[0] is hf:
        return hit[1]
    fp = model_fingerprint(hf)
    _FP_CACHE[key] = (hf, fp)
    return fp


def _model_facts(model: Any) -> dict:
    hf = _hf(model)
    cfg = getattr(hf, "config", None)
    return {
        "name": getattr(model, "name", None) or getattr(cfg, "_name_or_path", None),
        "d_model": getattr(model, "d_model", None) or getattr(cfg, "hidden_size", None),
        "n_layers": getattr(model, "n_layers", None) or getattr(cfg, "num_hidden_layers", None),
    }


def _layers_of(a: Any) -> list[int]:
    if isinstance(a, SteeringVector):
        return a.layers
    if isinstance(a, DirectionSet):
        return a.layers or []
    layer = getattr(a, "layer", None)
    return [layer] if layer is not None else []


def check_compatible(artifact: Any, model: Any, *, override: bool = False) -> list[str]:
    """Check ``artifact`` against ``model``; returns warnings, raises ModelMismatchError on a mismatch."""
    return check_against(artifact, {**_model_facts(model), "fingerprint": fingerprint_of(model)}, override=override,
                         stacklevel=4)


def check_against(artifact: Any, facts: dict, *, override: bool = False, stacklevel: int = 3) -> list[str]:
    """:func:`check_compatible` against plain facts about a model (``{"name", "d_model", "n_layers",
    "fingerprint"}``), for a model this process does not hold (e.g. one a vLLM server serves)."""
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


# ---------------------------------------------------------------------------- plain-hook fallback
def _add_hook(vec: torch.Tensor, mode: str, positions: Any):
    def hook(_mod, _inp, out):
        h = out[0] if isinstance(out, tuple) else out
        v = vec.to(h.device, h.dtype)
        if mode == "add":
            new = h + v
        else:  # project: component along v becomes |v|
            u = v / v.norm()
            new = h + (v.norm() - (h * u).sum(-1, keepdim=True)) * u
        if positions is not None:
            keep = torch.zeros(h.shape[-2], dtype=torch.bool, device=h.device)
            keep[list(positions)] = True
            new = torch.where(keep[:, None], new, h)
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return hook


def _ablate_hook(basis: torch.Tensor):
    def hook(_mod, _inp, out):
        h = out[0] if isinstance(out, tuple) else out
        b = basis.to(h.device, h.dtype)
        new = h - (h @ b.T) @ b
        return (new, *out[1:]) if isinstance(out, tuple) else new
    return hook


def _fallback(model: Any, artifact: Any, scale: float) -> list:
    hf = _hf(model)
    layers = hf.model.layers
    handles = []
    if isinstance(artifact, SteeringVector):
        if artifact.hook_site != "hook_resid_post":
            raise VectorsError("expected hook_resid_post for a bare HF model; wrap it with steerkit.wrap() for other sites")
        eff = artifact.effective()
        for l, d in eff.directions.items():
            handles.append(layers[l].register_forward_hook(_add_hook(d * scale, artifact.operation, artifact.positions)))
    else:
        b = artifact.basis
        if artifact.layers is None:
            handles.append(hf.model.embed_tokens.register_forward_hook(_ablate_hook(b)))
            for layer in layers:
                handles.append(layer.self_attn.o_proj.register_forward_hook(_ablate_hook(b)))
                handles.append(layer.mlp.down_proj.register_forward_hook(_ablate_hook(b)))
        else:
            for l in artifact.layers:
                handles.append(layers[l].register_forward_hook(_ablate_hook(b)))
    return handles


# ---------------------------------------------------------------------------- public
def edits_for(artifact: Any, n_layers: int, scale: float = 1.0) -> list[tuple[str, dict, dict]]:
    """The core edits that implement ``artifact``: a list of ``(op, {hook: tensor}, kwargs)``."""
    if isinstance(artifact, SteeringVector):
        if artifact.schedule is not None and artifact.schedule.position_weights is not None:
            raise VectorsError("per-token schedules cannot be applied by steer() yet; drop position_weights "
                               "or apply the vector per position with sm.edit(..., positions=...)")
        eff = artifact.effective()
        pos = artifact.positions if artifact.positions is not None else "all"
        if artifact.operation == "add":
            return [("add", {artifact.hook_name(l): d for l, d in eff.directions.items()}, {"scale": scale, "positions": pos})]
        return [("clamp", {artifact.hook_name(l): d / d.norm()}, {"value": float(scale * d.norm()), "positions": pos})
                for l, d in eff.directions.items()]
    if isinstance(artifact, DirectionSet):
        if artifact.layers is None:
            hooks = ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.{h}" for l in range(n_layers) for h in ("hook_attn_out", "hook_mlp_out")]
        else:
            hooks = [f"blocks.{l}.{artifact.hook_site}" for l in artifact.layers]
        return [("ablate", {h: artifact.basis for h in hooks}, {})]
    raise VectorsError(f"expected a SteeringVector or DirectionSet to apply, found {type(artifact).__name__}")


@contextlib.contextmanager
def steer(model: Any, artifact: Any, scale: float = 1.0, *, override: bool = False) -> Iterator[Any]:
    """Apply ``artifact`` to ``model`` inside a ``with`` block (checks compatibility first)."""
    check_compatible(artifact, model, override=override)
    handles = []
    try:
        if hasattr(model, "edit_op"):
            for op, per_hook, kw in edits_for(artifact, model.n_layers, scale):
                handles.append(model.edit_op(op, per_hook, **kw))
        else:
            handles = _fallback(model, artifact, scale)
        yield model
    finally:
        for h in reversed(handles):
            h.remove()
