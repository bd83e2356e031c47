"""The Steer page's computations: :func:`steer_setting` -> :class:`SteerSetting` (what the page applies,
as :class:`steerkit.Intervention` s) and :func:`steer_compare` -> :class:`SteerResult` (baseline and
steered generations of one prompt in one batch, each token with its projection on the direction).

Every steering goes through an artifact's own ``to_interventions(sm.facts, scale=...)``: a stored
artifact as it is (its hook site, positions and operation kept), and a direction that is not stored
(a profile's mean difference, a vector in a notebook) built into one first
(:func:`direction_artifacts`). No hook name is formed here: the interventions say where they act.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooks.names import parse as parse_hook
from steerkit.interventions import Intervention, Steerable
from steerkit.hooks.positions import AnyOf
from steerkit.vectors import ConditionalSteering, DirectionSet, Region, SteeringVector

from ..data import parse_layers
from .common import Cancelled

if TYPE_CHECKING:
    from steerkit.model import SteerModel

#: what the page's operation box builds from a direction that is not a stored artifact
OPERATIONS = ("add", "ablate", "clamp")
#: the stored artifacts the page steers with
STEERABLE = (SteeringVector, DirectionSet, Region, ConditionalSteering)


@dataclass
class SteerSetting:
    """What the Steer page applies: ``interventions`` for the steered row (one artifact's
    ``to_interventions``, or several for a per-layer direction), the ``layers`` they act at, and where
    the per-token projection is read (``proj_hook``: the site of the last intervention, after its edit,
    on the unit direction ``unit``)."""

    interventions: list[Intervention]
    layers: list[int]
    operation: str
    strength: float
    proj_hook: str
    unit: Float[Tensor, " d_model"]
    #: ``True`` for a direction set ablated at every write into the residual stream
    everywhere: bool = False
    #: ``True`` when the interventions act only on rows whose condition fires (a conditional steering)
    conditional: bool = False
    #: the layer of ``proj_hook``
    proj_layer: int = 0

    def describe(self) -> str:
        """What the steered row gets, in words (``+ 4 × v``, ``v ablated``, ...)."""
        last = self.interventions[-1]
        what = {"add": f"+ {self.strength:g} × v", "ablate": "v ablated",
                "clamp": f"projection clamped to {float(last.value[0]) if last.value is not None else 0.0:.4g}",
                "project": "projected into the region"}.get(self.operation, self.operation)
        return what + (" where its condition fires" if self.conditional else "")


def _layer_of(sm: SteerModel, site: str) -> int:
    return parse_hook(site, sm.n_layers, has_resid_mid=sm.facts.has_resid_mid).block_index


def _checked_vector(sm: SteerModel, v: Any, layer: Any) -> Tensor:
    t = torch.as_tensor(np.asarray(v, dtype=np.float32)).reshape(-1)
    if t.shape[0] != sm.d_model:
        raise InputError(f"expected a direction of d_model={sm.d_model} (this model), found {t.shape[0]}; "
                         "the vector belongs to another model")
    if not torch.isfinite(t).all() or float(t.norm()) == 0:
        raise InputError(f"expected a finite, non-zero direction at layer {layer}")
    return t


def direction_artifacts(sm: SteerModel, direction: Any, layers: Any = None, *,
                        operation: str = "add") -> list:
    """A direction that is not a stored artifact as artifacts of ``sm``: ``[d_model]`` at each of
    ``layers`` (required) or ``{layer: [d_model]}`` at its own layers (``layers`` selects among them).

    ``operation``: ``add`` (a :class:`SteeringVector`: ``h + strength * v``), ``clamp`` (a clamp
    :class:`SteeringVector` of the unit direction: the projection becomes ``strength``) or ``ablate``
    (a :class:`DirectionSet` at those layers)."""
    if operation not in OPERATIONS:
        raise InputError(f"expected operation in {OPERATIONS}, found {operation!r}")
    chosen = None if layers is None or (isinstance(layers, str) and not layers.strip()) else layers
    if isinstance(direction, dict):
        own = sorted(int(l) for l in direction)
        ls = own if chosen is None else parse_layers(chosen, sm.n_layers)
        missing = [l for l in ls if l not in own]
        if missing:
            raise InputError(f"expected a direction for every chosen layer, found none for {missing} (the direction "
                             f"has layers {own}); choose among them or clear the layer box")
        per_layer = [([l], _checked_vector(sm, direction[l], l)) for l in ls]
    else:
        if chosen is None:
            raise InputError("expected layers to steer at (like '12', '10-14' or '3,5,9'), found none")
        ls = parse_layers(chosen, sm.n_layers)
        per_layer = [(ls, _checked_vector(sm, direction, ls[0]))]
    if operation == "ablate":
        return [DirectionSet.from_directions(v, sm, layers=at, method="direction") for at, v in per_layer]
    if operation == "clamp":
        return [SteeringVector.from_direction(v.double() / v.double().norm(), at, sm, operation="clamp",
                                              method="direction") for at, v in per_layer]
    return [SteeringVector.from_direction(v, at, sm, method="direction") for at, v in per_layer]


def _applies_strength(art: Any) -> bool:
    """Whether the page's strength scales ``art``: a vector (added or clamped) does, alone or as the
    behaviour of a conditional steering; an ablation (direction set) and a region projection apply in full."""
    if isinstance(art, ConditionalSteering):
        return all(_applies_strength(r.behavior) for r in art.rules)
    return isinstance(art, SteeringVector)


def artifact_interventions(sm: SteerModel, art: Any, layers: Any = None, *, strength: float = 1.0
                           ) -> tuple[list[Intervention], float]:
    """``art.to_interventions(sm.facts, scale=...)`` at the chosen layers, and the scale applied.

    ``layers`` (``None`` or ``""``: all the artifact's own) selects among the layers the artifact acts
    at; one it does not act at is an :class:`InputError` naming those it has. A direction set stored to
    act everywhere (``layers=None``) may be placed at any layers (its hook site there); ``"all"`` keeps it
    everywhere."""
    if not isinstance(art, STEERABLE):
        kinds = ", ".join(c.kind for c in STEERABLE)
        raise InputError(f"expected an artifact the Steer page can apply ({kinds}), found a "
                         f"{getattr(art, 'kind', type(art).__name__)}; pick one of those from the store")
    scale = float(strength) if _applies_strength(art) else 1.0
    chosen = None if layers is None or (isinstance(layers, str) and layers.strip().lower() in ("", "all")) else layers
    if chosen is not None and isinstance(art, DirectionSet) and art.layers is None:
        art = dataclasses.replace(art, layers=parse_layers(chosen, sm.n_layers))
        chosen = None
    ivs = art.to_interventions(sm.facts, scale=scale)
    if chosen is not None:
        own = sorted({_layer_of(sm, iv.site) for iv in ivs})
        ls = parse_layers(chosen, sm.n_layers)
        missing = [l for l in ls if l not in own]
        if missing:
            raise InputError(f"expected layers of the artifact (it acts at layers {own}), found {missing}, which it "
                             "does not act at; choose among its layers or clear the layer box to use them all")
        ivs = [iv for iv in ivs if _layer_of(sm, iv.site) in ls]
    return ivs, scale


def _unit(iv: Intervention) -> Tensor:
    """The unit direction an intervention acts along (a region: its first axis)."""
    t = iv.region.projection[0] if iv.region is not None else iv.tensor
    t = torch.as_tensor(t).float().reshape(-1, torch.as_tensor(t).shape[-1])[0]
    return t / t.norm().clamp_min(1e-12)


def steer_setting(sm: SteerModel, direction: Any, layers=None, *, operation: str = "add",
                  strength: float = 4.0) -> SteerSetting:
    """The interventions for one Steer-page setting.

    ``direction``: a stored artifact (a :class:`~steerkit.vectors.SteeringVector`,
    :class:`~steerkit.vectors.DirectionSet`, :class:`~steerkit.vectors.Region` or
    :class:`~steerkit.vectors.ConditionalSteering`), steered through its own ``to_interventions`` --
    its hook site, positions and operation kept, ``operation`` unused, ``strength`` the scale of what
    adds or clamps (an ablation or a region projection applies in full), ``layers`` selecting among its
    layers (:func:`artifact_interventions`). Or a direction that is not stored, ``[d_model]`` or
    ``{layer: [d_model]}``, built into artifacts by :func:`direction_artifacts` with ``operation``
    (``add``: ``h + strength * v``; ``ablate``; ``clamp``: the projection on the unit direction becomes
    ``strength``) at ``layers`` (``"12"``, ``"10-14"``, ``"3,5,9"``, a list, ``"all"``).
    """
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(float(strength)):
        raise InputError(f"expected a finite strength, found {strength!r}")
    stored = isinstance(direction, Steerable)
    if stored:
        ivs, scale = artifact_interventions(sm, direction, layers, strength=float(strength))
        everywhere = isinstance(direction, DirectionSet) and direction.layers is None and (
            layers is None or (isinstance(layers, str) and layers.strip().lower() in ("", "all")))
    else:
        arts = direction_artifacts(sm, direction, layers, operation=operation)
        parts = [artifact_interventions(sm, a, strength=float(strength)) for a in arts]
        ivs, scale, everywhere = [iv for p, _ in parts for iv in p], parts[0][1], False
    if not ivs:
        raise InputError("expected the artifact to act somewhere, found no intervention at the chosen layers")
    last = ivs[-1]
    if stored:
        unit = _unit(last)
    else:  # the direction as given (one readout whatever the operation built from it)
        v = _checked_vector(sm, direction[_layer_of(sm, last.site)] if isinstance(direction, dict) else direction, "")
        unit = v / v.norm()
    return SteerSetting(ivs, sorted({_layer_of(sm, iv.site) for iv in ivs}), last.op, scale, last.site, unit,
                        everywhere=everywhere, conditional=any(iv.when is not None for iv in ivs),
                        proj_layer=_layer_of(sm, last.site))


@dataclass
class SteerResult:
    """Baseline and steered continuations of one prompt; per token, its projection on the direction.

    ``*_proj[k]`` is the projection on the unit direction at ``proj_layer``'s steered site (after the
    edits there) at the position that produced token ``k``: the last prompt token for ``k = 0``,
    generated token ``k - 1`` after that. ``*_ids``: the token ids.
    """

    prompt: str
    baseline_tokens: list[str]
    steered_tokens: list[str]
    baseline_proj: list[float]
    steered_proj: list[float]
    layers: list[int]
    operation: str
    strength: float
    proj_layer: int
    label: str = ""
    everywhere: bool = False
    #: the generation stopped at the time limit (``deadline``) with the tokens it had by then
    stopped_at_deadline: bool = False
    description: str = ""
    baseline_ids: list[int] = dataclasses.field(default_factory=list)
    steered_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def baseline_text(self) -> str:
        return "".join(self.baseline_tokens)

    @property
    def steered_text(self) -> str:
        return "".join(self.steered_tokens)


def steer_compare(sm: SteerModel, prompt: str, setting: SteerSetting, *, max_new_tokens: int = 32,
                  stream: Optional[Callable[[int, str], None]] = None, should_stop=None,
                  label: str = "", deadline: Optional[float] = None) -> SteerResult:
    """Generate ``prompt`` (with the chat template) unsteered (row 0) and steered by ``setting`` (row 1)
    in one greedy batch.

    One per-row steering ``rows=[None, setting.interventions]`` is installed for the batch
    (:meth:`SteerModel.steer`, the lowering ``generate(steering=...)`` uses) and, inside it, a
    record scope at ``setting.proj_hook``, so the recorded residual is the one after that site's
    edits. ``stream(row, text)`` is called as tokens arrive; ``should_stop()`` cancels between tokens.
    ``deadline``: seconds of generation after which it stops with the tokens each row has
    (``SteerResult.stopped_at_deadline`` says so).
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("expected a prompt, found an empty one")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"expected max_new_tokens >= 1, found {max_new_tokens!r}")
    ids: list[list[int]] = [[], []]
    end = None if deadline is None else time.monotonic() + float(deadline)
    late: list[bool] = []  # set when the deadline (not the caller) stopped the generation

    def on_token(row, token_id, text):
        if should_stop is not None and should_stop():
            raise Cancelled("cancelled")
        if end is not None and time.monotonic() > end:
            late.append(True)
            raise Cancelled("time limit")
        ids[row].append(int(token_id))
        if stream is not None:
            stream(row, text)

    stopped = False
    # the steering is registered before the record scope: at a shared site its hook runs first
    try:
        with sm.steer(rows=[None, setting.interventions], label="steer page (row 1)"), \
                sm.record(setting.proj_hook, positions=AnyOf("last", "generated")) as cache:
            sm.generate([prompt, prompt], max_new_tokens=max_new_tokens, stream=on_token, chat=True)
    except Cancelled:
        if not late:
            raise
        stopped = True
    projs: list[list[float]] = [[], []]
    if any(ids):
        h = cache[setting.proj_hook].float()
        proj = (h @ setting.unit.to(h.device)).cpu()
        projs = [proj[r, :len(ids[r])].tolist() for r in range(2)]
    toks = [[sm.tokenizer.decode([i]) for i in row] for row in ids]
    return SteerResult(prompt=prompt, baseline_tokens=toks[0], steered_tokens=toks[1], baseline_proj=projs[0],
                       steered_proj=projs[1], layers=setting.layers, operation=setting.operation,
                       strength=setting.strength, proj_layer=setting.proj_layer, label=label,
                       everywhere=setting.everywhere, stopped_at_deadline=stopped, description=setting.describe(),
                       baseline_ids=ids[0], steered_ids=ids[1])
