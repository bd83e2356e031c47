"""A stored clamp of sparse-autoencoder latents: :class:`LatentClamp`, what a request to a server (or
``sm.steer``) names to set chosen latents of an SAE to a value, with the SAE's error term kept.

It carries exactly what the encode needs, as the SAE artifact it holds: for a ReLU, JumpReLU or gated
SAE only the clamped latents (their encoder columns, biases, thresholds and decoder rows: a few
kilobytes); for a TopK SAE the whole encoder, since which ``k`` latents win depends on every
pre-activation. It lowers to :meth:`steerkit.Intervention.sae_latent` (``mode="clamp"``), so it runs
where every intervention runs: ``sm.steer``, the vLLM plugin (its host path: a clamp is a torch step,
not a fused-kernel operation) and the app.

A clamp may also span several layers: further :class:`ClampPart` values (``more``), each an SAE (restricted
like the first), its latents and its own positions. Transcoders make such clamps (:meth:`LatentClamp.of_transcoders`,
:func:`steerkit.probes.supernode_clamp`): each part holds block ``l``'s transcoder restricted to the clamped features
(a TopK transcoder whole), reading ``blocks.{l}.mlp.hook_in`` and writing ``blocks.{l}.hook_mlp_out``, and lowers
to one two-site :meth:`~steerkit.Intervention.sae_latent` clamp per part (the MLP's real output kept).
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


#: the most parts (SAEs and positions) one clamp may hold: a stored clamp is untrusted input
MAX_CLAMP_PARTS = 4096


def __getattr__(name: str) -> Any:
    if name == "CLAMP_POSITIONS":  # the one list of position names is the core's
        return moved(__name__, name, "steerkit.hooks.positions", "POSITION_NAMES")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class ClampPart:
    """One further part of a :class:`LatentClamp`: ``latents`` of ``sae`` (a stored :class:`~steerkit.vectors.SAE`,
    restricted to them as the clamp's first part is) at ``positions`` (``None``: the clamp's own). A clamp over
    several layers holds one per layer (or per layer and position).

    Examples:
        >>> from steerkit.vectors import LatentClamp, Provenance, Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d = tiny.n_layers, tiny.d_model
        >>> tc = Transcoders([torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(32)] * L,
        ...                  [torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  provenance=Provenance.from_model(tiny))
        >>> clamp = LatentClamp.of_transcoders(tc, {1: [3, 4], 2: [7]}, scale=0.0)
        >>> [(p.sae.site, p.latents, p.positions) for p in clamp.parts]
        [('blocks.1.mlp.hook_in', (3, 4), 'all'), ('blocks.2.mlp.hook_in', (7,), 'all')]
    """

    sae: SAE
    latents: tuple[int, ...]
    positions: Optional[Union[str, list[int]]] = None


@dataclasses.dataclass(eq=False)
class LatentClamp(_Artifact):
    """Clamp ``latents`` of an SAE at its site: each becomes ``value`` (one number per latent) or ``scale``
    times its own activation, with the error term kept (``h + decode(f_clamped) - decode(f)``). ``sae`` holds
    what the encode needs; ``restricted``: its weights are only the clamped latents, in the order of
    ``latents`` (the indices in the SAE they came from). Build it with :meth:`of`; a request's ``scale``
    multiplies the value (or the multiple), so scale 0 turns the latents off.

    ``more``: further :class:`ClampPart` values (other SAEs, other layers, other positions), restricted as the
    first; ``value`` then holds one number per latent of every part, in :attr:`parts` order. A transcoder's part
    reads its input site and writes its output site; :meth:`of_transcoders` builds such a clamp over several blocks.

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
    more: tuple[ClampPart, ...] = ()
    kind: ClassVar[str] = "latent_clamp"

    def __post_init__(self) -> None:
        if not isinstance(self.sae, SAE):
            raise VectorsError(f"expected sae as a steerkit.vectors.SAE, found {type(self.sae).__name__}")
        self.latents = tuple(int(i) for i in self.latents)
        self.positions = plain_positions(self.positions, "a latent clamp's positions", error=VectorsError)
        self.more = tuple(self.more)
        if len(self.more) >= MAX_CLAMP_PARTS:
            raise VectorsError(f"expected at most {MAX_CLAMP_PARTS} parts in a latent clamp, found {len(self.more) + 1}")
        parts = []
        for part in self.more:
            if not isinstance(part, ClampPart) or not isinstance(part.sae, SAE):
                raise VectorsError(f"expected further parts as ClampPart values holding a steerkit.vectors.SAE, found "
                                   f"{type(part).__name__}")
            pos = None if part.positions is None else plain_positions(part.positions, "a clamp part's positions",
                                                                      error=VectorsError)
            parts.append(ClampPart(part.sae, tuple(int(i) for i in part.latents), pos))
        self.more = tuple(parts)
        for part in self.parts:
            try:
                latent_indices(list(range(len(part.latents))) if self.restricted else list(part.latents),
                               part.sae.d_sae)
            except InputError as e:
                raise VectorsError(f"expected latents of the stored SAE at {part.sae.site}: {e}") from None
            if self.restricted and part.sae.d_sae != len(part.latents):
                raise VectorsError(f"expected a restricted SAE of exactly the {len(part.latents)} clamped latents at "
                                   f"{part.sae.site}, found d_sae={part.sae.d_sae}")
        try:
            self.value, self.scale = clamp_target(self.value, self.scale, sum(len(p.latents) for p in self.parts))
        except InputError as e:
            raise VectorsError(str(e)) from None
        # the SAE's provenance (model, sites), with what made the clamp (a graph's method and parameters) kept
        given = self.provenance
        prov = self.sae.provenance.replace(operation="latent_clamp")
        if given.method is not None or given.method_params:
            prov = prov.replace(method=given.method, method_params=dict(given.method_params),
                                prompts_hash=given.prompts_hash, notes=given.notes)
        self.provenance = prov

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

    @classmethod
    def of_transcoders(cls, transcoders: Any, latents: Any, *, value: Any = None, scale: Optional[float] = None,
                       positions: Union[str, Sequence[int]] = "all", provenance: Optional[Provenance] = None
                       ) -> "LatentClamp":
        """The clamp of features of a per-layer :class:`~steerkit.vectors.Transcoders` set over several blocks:
        ``latents`` is ``{layer: features}`` (all at ``positions``) or a list of ``(layer, features, positions)``
        (each its own positions, e.g. a graph's nodes where they are); each part holds block ``l``'s transcoder
        restricted to its features (a TopK set: the whole transcoder of the block, whose choice needs every
        pre-activation); a cross-layer transcoder gives a part per block the features write. ``value``: a number,
        or one per feature over the items in order; or ``scale``.
        ``provenance``: the method and parameters to record (the transcoders' provenance gives the model).

        Examples:
            >>> from steerkit.vectors import LatentClamp, Provenance, Transcoders
            >>> g = torch.Generator().manual_seed(0)
            >>> L, d = tiny.n_layers, tiny.d_model
            >>> tc = Transcoders([torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(32)] * L,
            ...                  [torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
            ...                  provenance=Provenance.from_model(tiny))
            >>> clamp = LatentClamp.of_transcoders(tc, [(1, [3], [2]), (3, [0, 5], "last")], value=2.0)
            >>> [(iv.site, iv.latent.source, iv.positions) for iv in clamp.to_interventions(tiny)]
            [('blocks.1.hook_mlp_out', 'blocks.1.mlp.hook_in', [2]), ('blocks.3.hook_mlp_out', 'blocks.3.mlp.hook_in', 'last')]
        """
        layer_sae, written = getattr(transcoders, "layer_sae", None), getattr(transcoders, "written", None)
        if not callable(layer_sae) or not callable(written):
            raise VectorsError(f"expected a steerkit.vectors.Transcoders, found {type(transcoders).__name__}")
        items = ([(layer, feats, None) for layer, feats in latents.items()] if isinstance(latents, dict)
                 else [tuple(x) for x in latents])
        if not items or any(len(x) != 3 for x in items):
            raise VectorsError("expected latents as {layer: features} or a non-empty list of (layer, features, "
                               f"positions), found {latents!r:.80}")
        default = positions if isinstance(positions, str) else list(positions)
        parts: list[ClampPart] = []
        per_feature: list[Tensor] = []  # each part's values, when one value per feature is given
        values = None if value is None else torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        given = values is not None and values.numel() > 1
        saes: dict = {}
        start = 0
        for layer, feats, pos in items:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise VectorsError(f"expected a block index, found {layer!r:.40}")
            for out in written(layer):  # a cross-layer transcoder's features write every later block: a part each
                key = (layer, out)
                sae = saes[key] if key in saes else saes.setdefault(key, layer_sae(layer, written=out))
                try:
                    idx = latent_indices(feats, sae.d_sae)
                except InputError as e:
                    raise VectorsError(f"block {layer}: {e}") from None
                kept = sae if sae.architecture == "topk" else dataclasses.replace(sae, weights=sae.weights.restrict(list(idx)))
                parts.append(ClampPart(kept, idx, default if pos is None else pos if isinstance(pos, str) else list(pos)))
                if given:
                    assert values is not None
                    per_feature.append(values[start:start + len(idx)])
            start += len(parts[-1].latents)
        if given:
            assert values is not None
            if values.numel() != start:
                raise VectorsError(f"expected one clamp value per feature ({start}), found {values.numel()}")
            value = torch.cat(per_feature)
        first = parts[0]
        assert first.positions is not None
        return cls(first.sae, first.latents, value=value, scale=scale, restricted=first.sae.architecture != "topk",
                   positions=first.positions, provenance=provenance or Provenance(operation="latent_clamp"),
                   more=tuple(parts[1:]))

    @property
    def parts(self) -> list[ClampPart]:
        """Every part, the first (``sae``, ``latents``, ``positions``) and then :attr:`more`, each with its
        positions (a part without its own has the clamp's)."""
        first = ClampPart(self.sae, self.latents, self.positions)
        return [first] + [p if p.positions is not None else dataclasses.replace(p, positions=self.positions)
                          for p in self.more]

    # ---- what it is
    @property
    def site(self) -> str:
        """The first part's site (the site its SAE reads)."""
        return self.sae.site

    @property
    def layers(self) -> list[int]:
        """Every block a part reads, ascending."""
        return sorted({layer for p in self.parts for layer in p.sae.layers})

    @property
    def d_model(self) -> int:
        return self.sae.d_model

    def summary(self) -> dict:
        out = {**super().summary(), "site": self.site, "latents": list(self.latents),
               "value": None if self.value is None else self.value.tolist(), "scale": self.scale,
               "architecture": self.sae.architecture}
        if self.more:
            out["parts"] = [{"site": p.sae.site, "output_site": p.sae.output_site, "latents": list(p.latents),
                             "positions": p.positions} for p in self.parts]
        return out

    # ---- steering
    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """One :meth:`~steerkit.Intervention.sae_latent` clamp per part at its SAE's site (a transcoder's: at the site
        it writes, reading the site it reads in the same pass), each SAE checked against ``facts`` first; ``scale``
        multiplies the value (or the multiple)."""
        out: list[Intervention] = []
        start = 0
        for part in self.parts:
            part.sae.check(facts, override=override)
            n = len(part.latents)
            idx = list(range(n)) if self.restricted else list(part.latents)
            value = None if self.value is None else self.value[start:start + n] * float(scale)
            mult = None if self.scale is None else self.scale * float(scale)
            start += n
            w = part.sae.weights
            site = part.sae.output_site if w.transcoder and part.sae.output_site else part.sae.site
            pos = self.positions if part.positions is None else part.positions
            out.append(Intervention.sae_latent(site, w, idx, value=value, scale=mult, positions=pos,
                                               source=part.sae.site if w.transcoder else None))
        return out

    # ---- payload
    def _map_tensors(self, fn) -> "LatentClamp":
        return dataclasses.replace(self, sae=self.sae._map_tensors(fn),
                                   value=None if self.value is None else fn(self.value),
                                   more=tuple(dataclasses.replace(p, sae=p.sae._map_tensors(fn)) for p in self.more))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LatentClamp):
            return NotImplemented
        same_value = (self.value is None and other.value is None) or (
            self.value is not None and other.value is not None and torch.equal(self.value.cpu(), other.value.cpu()))
        same_parts = len(self.more) == len(other.more) and all(
            a.sae == b.sae and (a.latents, a.positions) == (b.latents, b.positions) for a, b in zip(self.more, other.more))
        return (self.sae == other.sae and same_value and same_parts
                and (self.latents, self.scale, self.restricted, self.positions)
                == (other.latents, other.scale, other.restricted, other.positions))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        sae_tensors, sae_meta = self.sae.to_payload()
        tensors = {f"sae.{k}": v for k, v in sae_tensors.items()}
        if self.value is not None:
            tensors["value"] = self.value.detach().cpu().float().contiguous()
        more = []
        for i, part in enumerate(self.more):
            part_tensors, part_meta = part.sae.to_payload()
            tensors.update({f"more.{i}.{k}": v for k, v in part_tensors.items()})
            more.append({"sae": part_meta, "latents": list(part.latents), "positions": part.positions})
        fields: dict[str, Any] = {"sae": sae_meta, "latents": list(self.latents), "scale": self.scale,
                                  "restricted": self.restricted, "positions": self.positions}
        if more:
            fields["more"] = more
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "LatentClamp":
        fields = _fields(meta, cls.kind)
        more_meta = fields.get("more", [])
        if not isinstance(more_meta, list) or len(more_meta) >= MAX_CLAMP_PARTS:
            raise ArtifactFormatError(f"expected 'more' as a list of fewer than {MAX_CLAMP_PARTS} parts, found "
                                      f"{type(more_meta).__name__}")
        prefixes = ["sae."] + [f"more.{i}." for i in range(len(more_meta))]
        extra = {k for k in tensors if k != "value" and not any(k.startswith(p) for p in prefixes)}
        if extra:
            raise ArtifactFormatError(f"expected tensors 'value', 'sae.*' and 'more.<i>.*' in a latent clamp, found "
                                      f"{sorted(extra)[:10]}")

        def nested(prefix: str, part_meta: Any) -> SAE:
            if not isinstance(part_meta, dict) or part_meta.get("kind") != SAE.kind:
                raise ArtifactFormatError(f"expected the clamp's SAE as a nested 'sae' artifact, found {part_meta!r:.80}")
            n = len(prefix)
            return checked_from_payload(SAE, {k[n:]: v for k, v in tensors.items() if k.startswith(prefix)}, part_meta)

        def int_list(v: Any) -> list[int]:
            if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
                raise ArtifactFormatError(f"expected latents as a list of ints, found {v!r:.80}")
            return v
        sae = nested("sae.", fields.get("sae"))
        latents, scale, restricted = int_list(fields.get("latents")), fields.get("scale"), fields.get("restricted")
        if not isinstance(restricted, bool) or not (scale is None or isinstance(scale, (int, float))):
            raise ArtifactFormatError(f"expected restricted as a bool and scale as a number or null, found "
                                      f"{restricted!r:.20}, {scale!r:.20}")
        more = []
        for i, part in enumerate(more_meta):
            if not isinstance(part, dict):
                raise ArtifactFormatError(f"expected each further part as an object, found {type(part).__name__}")
            more.append(ClampPart(nested(f"more.{i}.", part.get("sae")), tuple(int_list(part.get("latents"))),
                                  part.get("positions", "all")))
        return cls(sae, tuple(latents), value=tensors.get("value"), scale=scale, restricted=restricted,
                   positions=fields.get("positions", "all"), provenance=Provenance.from_dict(meta.get("provenance", {})),
                   more=tuple(more))


__all__ = ["LatentClamp", "ClampPart", "MAX_CLAMP_PARTS"]
