"""A stored clamp of sparse-autoencoder latents: :class:`LatentClamp`, what a request to a server (or
``sm.steer``) names to set chosen latents of an SAE to a value, with the SAE's error term kept.

It carries exactly what the encode needs, as the SAE artifact it holds: for a ReLU, JumpReLU or gated
SAE only the clamped latents (their encoder columns, biases, thresholds and decoder rows: a few
kilobytes); for a TopK SAE the whole encoder, since which ``k`` latents win depends on every
pre-activation. It lowers to :meth:`steerkit.Intervention.sae_latent` (``mode="clamp"``), so it runs
where every intervention runs: ``sm.steer``, the vLLM plugin (its host path: a clamp is a torch step,
not a fused-kernel operation) and the app.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Sequence, Union

import torch
from torch import Tensor

from steerkit.deprecation import moved
from steerkit.errors import InputError
from steerkit.hooks.positions import plain_positions
from steerkit.interventions import Intervention, ModelFacts, clamp_target, latent_indices

from ..errors import ArtifactFormatError, VectorsError
from ..provenance import Provenance
from .base import _Artifact, _fields, checked_from_payload
from .sae import SAE


def __getattr__(name: str) -> Any:
    if name == "CLAMP_POSITIONS":  # the one list of position names is the core's
        return moved(__name__, name, "steerkit.hooks.positions", "POSITION_NAMES")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(eq=False)
class LatentClamp(_Artifact):
    """Clamp ``latents`` of an SAE at its site: each becomes ``value`` (one number per latent) or ``scale``
    times its own activation, with the error term kept (``h + decode(f_clamped) - decode(f)``). ``sae`` holds
    what the encode needs; ``restricted``: its weights are only the clamped latents, in the order of
    ``latents`` (the indices in the SAE they came from). Build it with :meth:`of`; a request's ``scale``
    multiplies the value (or the multiple), so scale 0 turns the latents off.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.vectors import SAE, LatentClamp, Provenance
        >>> g = torch.Generator().manual_seed(0)
        >>> W = torch.nn.functional.normalize(torch.randn(256, 64, generator=g), dim=-1)
        >>> sae = SAE(SAEWeights(W.T.clone(), torch.zeros(256), W, torch.zeros(64)), "blocks.2.hook_resid_post",
        ...           provenance=Provenance.from_model(tiny))
        >>> clamp = LatentClamp.of(sae, [7, 40], value=6.0)
        >>> clamp.restricted, clamp.sae.d_sae, clamp.latents
        (True, 2, (7, 40))
        >>> (iv,) = clamp.to_interventions(tiny)
        >>> iv.site, iv.op
        ('blocks.2.hook_resid_post', 'latent')
        >>> store.save("clamp", clamp), store.load("clamp@1") == clamp
        ('clamp@1', True)
    """

    sae: SAE
    latents: tuple[int, ...]
    value: Optional[Tensor] = None
    scale: Optional[float] = None
    restricted: bool = False
    positions: Union[str, list[int]] = "all"
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="latent_clamp"))
    kind: ClassVar[str] = "latent_clamp"

    def __post_init__(self) -> None:
        if not isinstance(self.sae, SAE):
            raise VectorsError(f"expected sae as a steerkit.vectors.SAE, found {type(self.sae).__name__}")
        if self.sae.weights.transcoder:
            raise VectorsError("expected an autoencoder to clamp latents at its own site, found a transcoder; add "
                               "its decoder rows with SteeringVector.from_sae_latent at the site it writes")
        self.latents = tuple(int(i) for i in self.latents)
        try:
            latent_indices(list(range(len(self.latents))) if self.restricted else list(self.latents),
                           self.sae.d_sae)
        except InputError as e:
            raise VectorsError(f"expected latents of the stored SAE: {e}") from None
        if self.restricted and self.sae.d_sae != len(self.latents):
            raise VectorsError(f"expected a restricted SAE of exactly the {len(self.latents)} clamped latents, found "
                               f"d_sae={self.sae.d_sae}")
        try:
            self.value, self.scale = clamp_target(self.value, self.scale, len(self.latents))
        except InputError as e:
            raise VectorsError(str(e)) from None
        self.positions = plain_positions(self.positions, "a latent clamp's positions", error=VectorsError)
        self.provenance = self.sae.provenance.replace(operation="latent_clamp")

    @classmethod
    def of(cls, sae: SAE, latents: Union[int, Sequence[int]], *, value: Any = None, scale: Optional[float] = None,
           positions: Union[str, Sequence[int]] = "all") -> "LatentClamp":
        """The clamp of ``latents`` of the stored ``sae`` to ``value`` or ``scale`` times themselves (exactly
        one), keeping only the latents' weights unless the SAE is TopK (which needs its whole encoder)."""
        if not isinstance(sae, SAE):
            raise VectorsError(f"expected a steerkit.vectors.SAE (steerkit.load_sae), found {type(sae).__name__}")
        try:
            idx = latent_indices(latents, sae.d_sae)
        except InputError as e:
            raise VectorsError(str(e)) from None
        whole = sae.architecture == "topk"
        kept = sae if whole else dataclasses.replace(sae, weights=sae.weights.restrict(list(idx)))
        return cls(kept, idx, value=value, scale=scale, restricted=not whole,
                   positions=positions if isinstance(positions, str) else list(positions))

    # ---- what it is
    @property
    def site(self) -> str:
        return self.sae.site

    @property
    def layers(self) -> list[int]:
        return self.sae.layers

    @property
    def d_model(self) -> int:
        return self.sae.d_model

    def summary(self) -> dict:
        return {**super().summary(), "site": self.site, "latents": list(self.latents),
                "value": None if self.value is None else self.value.tolist(), "scale": self.scale,
                "architecture": self.sae.architecture}

    # ---- steering
    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """One :meth:`~steerkit.Intervention.sae_latent` clamp at the SAE's site, checked against ``facts`` as
        the SAE is; ``scale`` multiplies the value (or the multiple)."""
        self.sae.check(facts, override=override)
        idx = list(range(len(self.latents))) if self.restricted else list(self.latents)
        value = None if self.value is None else self.value * float(scale)
        mult = None if self.scale is None else self.scale * float(scale)
        return [Intervention.sae_latent(self.site, self.sae.weights, idx, value=value, scale=mult,
                                        positions=self.positions)]

    # ---- payload
    def _map_tensors(self, fn) -> "LatentClamp":
        return dataclasses.replace(self, sae=self.sae._map_tensors(fn),
                                   value=None if self.value is None else fn(self.value))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LatentClamp):
            return NotImplemented
        same_value = (self.value is None and other.value is None) or (
            self.value is not None and other.value is not None and torch.equal(self.value.cpu(), other.value.cpu()))
        return (self.sae == other.sae and same_value and (self.latents, self.scale, self.restricted, self.positions)
                == (other.latents, other.scale, other.restricted, other.positions))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        sae_tensors, sae_meta = self.sae.to_payload()
        tensors = {f"sae.{k}": v for k, v in sae_tensors.items()}
        if self.value is not None:
            tensors["value"] = self.value.detach().cpu().float().contiguous()
        fields = {"sae": sae_meta, "latents": list(self.latents), "scale": self.scale, "restricted": self.restricted,
                  "positions": self.positions}
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "LatentClamp":
        fields = _fields(meta, cls.kind)
        sae_meta = fields.get("sae")
        if not isinstance(sae_meta, dict) or sae_meta.get("kind") != SAE.kind:
            raise ArtifactFormatError(f"expected the clamp's SAE as a nested 'sae' artifact, found {sae_meta!r:.80}")
        extra = set(tensors) - {"value"} - {k for k in tensors if k.startswith("sae.")}
        if extra:
            raise ArtifactFormatError(f"expected tensors 'value' and 'sae.*' in a latent clamp, found {sorted(extra)[:10]}")
        sae = checked_from_payload(SAE, {k[4:]: v for k, v in tensors.items() if k.startswith("sae.")}, sae_meta)
        latents, scale, restricted = fields.get("latents"), fields.get("scale"), fields.get("restricted")
        if not isinstance(latents, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in latents):
            raise ArtifactFormatError(f"expected latents as a list of ints, found {latents!r:.80}")
        if not isinstance(restricted, bool) or not (scale is None or isinstance(scale, (int, float))):
            raise ArtifactFormatError(f"expected restricted as a bool and scale as a number or null, found "
                                      f"{restricted!r:.20}, {scale!r:.20}")
        return cls(sae, tuple(latents), value=tensors.get("value"), scale=scale, restricted=restricted,
                   positions=fields.get("positions", "all"))


__all__ = ["LatentClamp"]
