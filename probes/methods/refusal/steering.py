"""The refusal method's two steerings, built as :class:`steerkit.Intervention` lists: directional ablation of a
direction at every block input, attention output and MLP output, and activation addition at one block's input."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.interventions import Intervention

if TYPE_CHECKING:
    from steerkit.hooks.manager import HookHandle
    from steerkit.model import SteerModel

ABLATION_SITES = ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")


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


def ablation_interventions(sm: "SteerModel", direction: Float[Tensor, " d_model"]) -> list[Intervention]:
    """``Intervention.ablate`` of ``direction`` (normalised) at every block's input, attention output and MLP
    output, all positions.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import ablation_interventions
        >>> ivs = ablation_interventions(tiny, torch.randn(64))
        >>> len(ivs), ivs[0].site, ivs[0].op
        (12, 'blocks.0.hook_resid_pre', 'ablate')
    """
    r = unit(direction, sm.d_model)
    return [Intervention.ablate(f"blocks.{layer}.{site}", r) for layer in range(sm.n_layers) for site in ABLATION_SITES]


def addition_interventions(direction: Float[Tensor, " d_model"], layer: int, scale: float = 1.0) -> list[Intervention]:
    """``Intervention.add`` of ``scale * direction`` at ``blocks.{layer}.hook_resid_pre``, all positions.

    Examples:
        >>> from steerkit.probes.methods.refusal.steering import addition_interventions
        >>> addition_interventions(torch.ones(64), 2, 0.5)
        [Intervention('blocks.2.hook_resid_pre', add, (64,), scale=0.5, positions='all')]
    """
    return [Intervention.add(f"blocks.{int(layer)}.hook_resid_pre", torch.as_tensor(direction).float(), scale)]


def ablation(sm: "SteerModel", direction: Float[Tensor, " d_model"]) -> "HookHandle":
    """Directional ablation of ``direction`` (normalised) at every block input, attention output
    and MLP output, all positions (:func:`ablation_interventions`). Returns a handle; use it with ``with``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> r = torch.randn(64)
        >>> with R.ablation(tiny, r), tiny.record("blocks.3.hook_resid_post") as cache:
        ...     _ = R.last_logits(tiny, ["bake bread"])
        >>> float((cache["blocks.3.hook_resid_post"] @ (r / r.norm())).abs().max()) < 1e-4  # nothing left along r
        True
    """
    return sm.steer(ablation_interventions(sm, direction), label="refusal: ablate the direction everywhere")


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
