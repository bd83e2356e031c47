"""The refusal method's two steerings, each the artifact the method saves and its lowering: directional
ablation of a direction everywhere (a :class:`~steerkit.vectors.DirectionSet` with ``layers=None``: the
embedding output and every attention and MLP output) and activation addition at one block's input (a
:class:`~steerkit.vectors.SteeringVector` at ``hook_resid_pre``). What the method measures (the candidates'
scores, the held-out evaluation) is what it stores."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.interventions import Intervention
from steerkit.vectors import DirectionSet, SteeringVector

if TYPE_CHECKING:
    from steerkit.hooks.manager import HookHandle
    from steerkit.model import SteerModel

METHOD = "refusal_direction"


def __getattr__(name: str) -> Any:
    if name == "ABLATION_SITES":  # the ablation now acts where the saved DirectionSet does
        warnings.warn("refusal.ABLATION_SITES is gone: the ablation acts where the DirectionSet it saves does "
                      "(ablation_artifact(sm, r).hook_names(sm.n_layers): the embedding output and every attention "
                      "and MLP output)", DeprecationWarning, stacklevel=2)
        return ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unit(v: Float[Tensor, " d_model"], d_model: int | None = None) -> Float[Tensor, " d_model"]:
    """``v / |v|`` (float32) after checking its width (``d_model``), finiteness and norm.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import unit
        >>> unit(torch.tensor([3.0, 4.0])).tolist()
        [0.6000000238418579, 0.800000011920929]
        >>> unit(torch.zeros(2))
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a non-zero direction, found the zero vector
    """
    v = torch.as_tensor(v).detach().float().reshape(-1)
    if d_model is not None and v.shape[0] != d_model:
        raise InputError(f"expected a direction of shape [{d_model}], found {tuple(v.shape)}")
    if not bool(torch.isfinite(v).all()):
        raise InputError("expected a direction with finite values, found NaN/inf")
    n = float(v.norm())
    if n == 0.0:
        raise InputError("expected a non-zero direction, found the zero vector")
    return v / n


def ablation_artifact(sm: "SteerModel", direction: Float[Tensor, " d_model"], *, prompts: Sequence[str] = (),
                      metrics: dict | None = None, params: dict | None = None) -> DirectionSet:
    """The ablation the method saves: ``direction`` (orthonormalised, so normalised) as a
    :class:`~steerkit.vectors.DirectionSet` that acts everywhere (``layers=None``: the embedding output and
    every attention and MLP output, what weight orthogonalisation bakes in), with its provenance.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import ablation_artifact
        >>> ds = ablation_artifact(tiny, torch.randn(64))
        >>> ds.layers, ds.hook_names(tiny.n_layers)[:3], ds.provenance.method
        (None, ['blocks.0.hook_resid_pre', 'blocks.0.hook_attn_out', 'blocks.0.hook_mlp_out'], 'refusal_direction')
    """
    unit(direction, sm.d_model)  # the checks (width, finite, non-zero) with their messages
    ds = DirectionSet.from_directions(torch.as_tensor(direction).detach().float()[None], sm, None, method=METHOD,
                                      prompts=list(prompts), metrics=metrics)
    if params is not None:
        ds.provenance.method_params = dict(params)
    return ds


def addition_artifact(sm: "SteerModel", direction: Float[Tensor, " d_model"], layer: int, *,
                      prompts: Sequence[str] = (), metrics: dict | None = None,
                      params: dict | None = None) -> SteeringVector:
    """The addition the method saves: the unnormalised ``direction`` added at ``blocks.{layer}.hook_resid_pre``,
    as a :class:`~steerkit.vectors.SteeringVector` with its provenance.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import addition_artifact
        >>> sv = addition_artifact(tiny, torch.ones(64), 2)
        >>> sv.hook_name(2), sv.scale, float(sv.directions[2].norm()) == 8.0
        ('blocks.2.hook_resid_pre', 1.0, True)
    """
    return SteeringVector.from_direction(torch.as_tensor(direction).detach().float(), int(layer), sm,
                                         hook_site="hook_resid_pre", method=METHOD, method_params=params,
                                         prompts=list(prompts), metrics=metrics)


def ablation_interventions(sm: "SteerModel", direction: Float[Tensor, " d_model"]) -> list[Intervention]:
    """The interventions of :func:`ablation_artifact`: ``Intervention.ablate`` of ``direction`` (normalised) at
    the embedding output and every attention and MLP output, all positions.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import ablation_interventions
        >>> ivs = ablation_interventions(tiny, torch.randn(64))
        >>> len(ivs), ivs[0].site, ivs[1].site, ivs[0].op
        (9, 'blocks.0.hook_resid_pre', 'blocks.0.hook_attn_out', 'ablate')
    """
    return ablation_artifact(sm, direction).to_interventions(sm.facts)


def addition_interventions(direction: Float[Tensor, " d_model"], layer: int, scale: float = 1.0) -> list[Intervention]:
    """``Intervention.add`` of ``scale * direction`` at ``blocks.{layer}.hook_resid_pre``, all positions: the
    lowering of :func:`addition_artifact` (``to_interventions(facts, scale=scale)``), without a model.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import addition_interventions
        >>> addition_interventions(torch.ones(64), 2, 0.5)
        [Intervention('blocks.2.hook_resid_pre', add, (64,), scale=0.5, positions='all')]
    """
    return [Intervention.add(f"blocks.{int(layer)}.hook_resid_pre", torch.as_tensor(direction).float(), scale)]


def ablation(sm: "SteerModel", direction: Float[Tensor, " d_model"]) -> "HookHandle":
    """Directional ablation of ``direction`` (normalised) at the embedding output and every attention and MLP
    output, all positions (:func:`ablation_artifact`). Returns a handle; use it with ``with``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> r = torch.randn(64)
        >>> with R.ablation(tiny, r), tiny.record("blocks.3.hook_resid_post") as cache:
        ...     _ = R.last_logits(tiny, ["bake bread"])
        >>> float((cache["blocks.3.hook_resid_post"] @ (r / r.norm())).abs().max()) < 1e-4  # nothing left along r
        True
    """
    return sm.steer(ablation_artifact(sm, direction), label="refusal: ablate the direction everywhere")


def addition(sm: "SteerModel", direction: Float[Tensor, " d_model"], layer: int, scale: float = 1.0) -> "HookHandle":
    """Activation addition of ``scale * direction`` at ``blocks.{layer}.hook_resid_pre``, all positions
    (:func:`addition_interventions`). Returns a handle; use it with ``with``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> v, base = torch.randn(64), R.last_logits(tiny, ["bake bread"])
        >>> with R.addition(tiny, v, layer=1, scale=4.0):
        ...     steered = R.last_logits(tiny, ["bake bread"])
        >>> bool(torch.allclose(steered, base)), bool(torch.allclose(R.last_logits(tiny, ["bake bread"]), base))
        (False, True)
    """
    return sm.steer(addition_interventions(direction, layer, scale), label=f"refusal: add the direction at layer {layer}")
