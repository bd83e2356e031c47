"""The values a steering is made of: :class:`Intervention` (one operation at one site) and its
per-token :class:`Gate`."""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.kernels import ORTHO_TOL, Polyhedron, SteerConfig
from steerkit.hooks.positions import PositionSpec, validate_positions

from steerkit.interventions.checks import _basis, _indices, _number, _tensor, _vector
from steerkit.interventions.conditions import Condition, When
from steerkit.interventions.latents import LatentEdit, latent_indices as latent_indices_of, sae_weights

Op = Literal["add", "ablate", "clamp", "replace", "patch", "project", "apply", "latent"]
OPS: tuple[str, ...] = ("add", "ablate", "clamp", "replace", "patch", "project", "apply", "latent")
KERNEL_OPS = ("add", "ablate", "clamp", "project")


@dataclasses.dataclass(frozen=True)
class Gate:
    """Steer a row (its ``add`` / ``project`` part) only where ``|u . h| / |h|`` is ``above`` / ``below``
    ``threshold`` (``u`` the unit ``direction``).

    Examples:
        >>> gate = Gate(torch.ones(64), threshold=0.3, mode="below")
        >>> gate.mode, gate.threshold, tuple(gate.direction.shape)
        ('below', 0.3, (64,))
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0, gate=gate)
        >>> with tiny.steer(add):
        ...     steered = tiny.forward("hello world", chat=False)
        >>> tuple(steered.shape) == tuple(tiny.forward("hello world", chat=False).shape)
        True
    """

    direction: Float[Tensor, " d_model"]
    threshold: float
    mode: Literal["above", "below"] = "above"

    def __post_init__(self):
        if self.mode not in ("above", "below"):
            raise InputError(f"expected a gate mode 'above' or 'below', found {self.mode!r}")
        object.__setattr__(self, "direction", _vector(self.direction, "the gate direction"))
        object.__setattr__(self, "threshold", _number(self.threshold, "the gate threshold"))


@dataclasses.dataclass(frozen=True, eq=False)
class Intervention:
    """One operation at one site. Build it with the class methods, which validate everything:

    - ``Intervention.add(site, v, scale)``: ``h + scale * v``
    - ``Intervention.ablate(site, B, strength=1)``: ``h - strength * B^T (B h)`` (``B`` orthonormal rows)
    - ``Intervention.clamp(site, u, value)``: the projections on ``u``'s rows become ``value``
    - ``Intervention.replace(site, v, scale=1)``: ``h := scale * v``
    - ``Intervention.patch(site, source)``: ``h[p] := source[p]`` at each selected position ``p`` (the
      values of another run at this site, e.g. a clean run patched into a corrupted one)
    - ``Intervention.project(site, region, strength=1)``: move ``h`` towards a polyhedral region
    - ``Intervention.apply(site, fn)``: ``fn(h)`` for any callable on the site's activations
    - ``Intervention.sae_latent(site, sae, latents, value=, scale=, mode=)``: a sparse autoencoder's
      latents clamped with its error term kept (``h + (f_clamped - f) @ W_dec``), or their decoder rows added

    ``positions`` (see :mod:`steerkit.hooks.positions`) limits it to some tokens; ``gate`` (add / project)
    makes it conditional per token; ``when`` (a :class:`When` of :class:`Condition` values, any operation)
    applies it only on the rows whose prompt fires the rule (CAST); ``preserve_norm`` rescales edited rows
    to their original norm; ``heads``
    (attention component sites; experts at ``mlp.hook_expert_out``) / ``neurons`` (MLP sites) limit it to
    those heads / experts / neurons, whose
    vectors are then ``d_head`` / ``len(neurons)`` wide.

    Examples:
        >>> v = torch.randn(tiny.d_model)
        >>> iv = Intervention.add("blocks.2.hook_resid_post", v, 4.0, positions="last")
        >>> iv
        Intervention('blocks.2.hook_resid_post', add, (64,), scale=4.0, positions='last')
        >>> with tiny.steer(iv), tiny.record("blocks.2.hook_resid_post") as cache:
        ...     _ = tiny.forward("hello world", chat=False)
        >>> with tiny.record("blocks.2.hook_resid_post") as plain:
        ...     _ = tiny.forward("hello world", chat=False)
        >>> delta = cache["blocks.2.hook_resid_post"] - plain["blocks.2.hook_resid_post"]
        >>> torch.allclose(delta[0, -1], 4.0 * v, atol=1e-4), bool(delta[0, :-1].abs().max() < 1e-6)
        (True, True)
    """

    site: str
    op: str
    tensor: Optional[Tensor] = None  # add / replace: [d_model]; ablate / clamp: [k, d_model] orthonormal
    scale: float = 1.0  # add / replace: multiplier; ablate: strength; project: strength
    value: Optional[Tensor] = None  # clamp: target per direction [k]
    region: Optional[Polyhedron] = None
    fn: Optional[Callable[[Tensor], Tensor]] = None
    positions: PositionSpec = "all"
    gate: Optional[Gate] = None
    preserve_norm: bool = False
    heads: Optional[tuple] = None
    neurons: Optional[tuple] = None
    when: Optional[When] = None  # CAST: only on rows whose rule fires (decided on the prompt pass, then held)
    latent: Optional[LatentEdit] = None  # latent: the SAE latents to clamp and how

    def __post_init__(self):
        if not isinstance(self.site, str) or not self.site:
            raise InputError(f"expected a hook name as the site, found {self.site!r:.80}")
        if self.op not in OPS:
            raise InputError(f"expected an operation in {OPS}, found {self.op!r}")
        object.__setattr__(self, "positions", validate_positions(self.positions))
        object.__setattr__(self, "scale", _number(self.scale, "scale"))
        if isinstance(self.when, Condition):
            object.__setattr__(self, "when", When((self.when,)))
        if self.when is not None and not isinstance(self.when, When):
            raise InputError(f"expected when= a steerkit.When (or one Condition), found {type(self.when).__name__}")
        if self.gate is not None and self.op not in ("add", "project"):
            raise InputError(f"expected a gate only on add or project interventions, found one on {self.op!r}")
        for what in ("heads", "neurons"):
            v = getattr(self, what)
            if v is not None:
                object.__setattr__(self, what, _indices(v, what))
        if self.heads is not None and self.neurons is not None:
            raise InputError("expected heads= (attention sites) or neurons= (MLP sites), found both")
        if self.op == "latent" and (self.latent is None or self.heads is not None or self.neurons is not None):
            raise InputError("expected a latent clamp built by Intervention.sae_latent (on the whole site: no "
                             "heads= / neurons=), found " + ("none" if self.latent is None else "heads= / neurons="))
        if (self.heads is not None or self.neurons is not None) and self.op == "project":
            raise InputError("expected heads= / neurons= on add, ablate, clamp, replace, patch or apply, found them "
                             "on a region projection (a region lives in the whole feature space)")

    # --- construction -------------------------------------------------------------
    @classmethod
    def add(cls, site: str, vector, scale: float = 1.0, *, positions: PositionSpec = "all",
            gate: Optional[Gate] = None, preserve_norm: bool = False, heads=None, neurons=None,
            when: Optional[When] = None) -> "Intervention":
        return cls(site, "add", _vector(vector, "the add vector"), scale, positions=positions, gate=gate,
                   preserve_norm=preserve_norm, heads=heads, neurons=neurons, when=when)

    @classmethod
    def ablate(cls, site: str, basis, strength: float = 1.0, *, positions: PositionSpec = "all",
               preserve_norm: bool = False, heads=None, neurons=None, when: Optional[When] = None) -> "Intervention":
        return cls(site, "ablate", _basis(basis, "the ablation basis"), strength, positions=positions,
                   preserve_norm=preserve_norm, heads=heads, neurons=neurons, when=when)

    @classmethod
    def clamp(cls, site: str, direction, value=0.0, *, positions: PositionSpec = "all",
              preserve_norm: bool = False, heads=None, neurons=None, when: Optional[When] = None) -> "Intervention":
        b = _basis(direction, "the clamp direction")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = torch.full((b.shape[0],), _number(value, "the clamp value"))
        else:
            v = _tensor(value, "the clamp values").reshape(-1).float()
            if v.numel() == 1:
                v = v.expand(b.shape[0]).clone()
            if v.numel() != b.shape[0]:
                raise InputError(f"expected one clamp value per direction ({b.shape[0]}), found {v.numel()}")
        return cls(site, "clamp", b, 1.0, value=v, positions=positions, preserve_norm=preserve_norm, heads=heads,
                   neurons=neurons, when=when)

    @classmethod
    def replace(cls, site: str, vector, scale: float = 1.0, *, positions: PositionSpec = "all", heads=None,
                neurons=None, when: Optional[When] = None) -> "Intervention":
        return cls(site, "replace", _vector(vector, "the replacement vector"), scale, positions=positions,
                   heads=heads, neurons=neurons, when=when)

    @classmethod
    def patch(cls, site: str, source, *, positions: PositionSpec = "all", heads=None, neurons=None,
              when: Optional[When] = None) -> "Intervention":
        """At every selected position ``p`` the activation becomes ``source[p]``: ``source`` holds a run's
        values at this site without the batch axis, in the site's shape (``[pos, d_model]``,
        ``[pos, heads, d_head]``, ``[pos, d_mlp]``, or ``[heads, q_pos, k_pos]`` for an attention matrix),
        indexed by absolute position. With ``heads`` / ``neurons`` only those are written."""
        t = _tensor(source, "the patch source")
        if t.dim() < 2 or t.shape[0] == 0:
            raise InputError(f"expected the patch source as the site's values over positions ([pos, ...], no batch "
                             f"axis), found shape {tuple(t.shape)}; take one row of a recording, e.g. cache[hook][0]")
        return cls(site, "patch", t, 1.0, positions=positions, heads=heads, neurons=neurons, when=when)

    @classmethod
    def project(cls, site: str, region: Polyhedron, strength: float = 1.0, *, positions: PositionSpec = "all",
                gate: Optional[Gate] = None, preserve_norm: bool = False, when: Optional[When] = None) -> "Intervention":
        if not isinstance(region, Polyhedron):
            raise InputError(f"expected a steerkit.Polyhedron to project into, found {type(region).__name__}; "
                             "build one with steerkit.Polyhedron(mean, projection, normals, offsets) "
                             "or load a stored region artifact (it is one)")
        return cls(site, "project", None, strength, region=region, positions=positions, gate=gate,
                   preserve_norm=preserve_norm, when=when)

    @classmethod
    def apply(cls, site: str, fn: Callable[[Tensor], Tensor], *, positions: PositionSpec = "all",
              when: Optional[When] = None) -> "Intervention":
        """``fn(h)`` on the site's activations in their own shape (``[batch, pos, d_model]``,
        ``[batch, pos, heads, d_head]``, ``[batch, heads, q_pos, k_pos]`` ...), returning that shape."""
        if not callable(fn):
            raise InputError(f"expected a callable taking and returning the site's activations (e.g. "
                             f"[batch, pos, d_model]), found {fn!r:.80}")
        return cls(site, "apply", fn=fn, positions=positions, when=when)

    @classmethod
    def sae_latent(cls, site: str, sae, latents, value=None, scale: Optional[float] = None, *,
                   mode: Literal["clamp", "add"] = "clamp", positions: PositionSpec = "all",
                   when: Optional[When] = None, source: Optional[str] = None) -> "Intervention":
        """Steer with latents of a sparse autoencoder at ``site`` (``sae``: ``steerkit.load_sae(...)`` or
        a :class:`steerkit.sae.SAEWeights`; ``latents``: an index or several).

        A transcoder's clamp is a two-site edit: ``site`` is the site it writes (``blocks.{l}.hook_mlp_out``)
        and ``source`` the site it reads (``blocks.{l}.mlp.hook_in``; a stored transcoder ``SAE`` gives both);
        the latents are encoded from the source's activation in the same pass and ``(f_clamped - f) @ W_dec``
        is added at ``site``, so the MLP's real output stays (see :mod:`steerkit.interventions.latents`).

        - ``mode="clamp"``: each latent's activation becomes ``value`` (a number, or one per latent) or
          ``scale`` times itself (exactly one of the two), with the SAE's error term kept:
          ``h + decode(f_clamped) - decode(f)`` = ``h + (f_clamped - f) @ W_dec`` (see
          :mod:`steerkit.interventions.latents`); ``value=0`` turns a feature off where it fires.
        - ``mode="add"``: ``h + scale * sum(W_dec[latents])`` (``scale`` default 1; ``value`` not used), a
          plain ``add`` that runs in the fused kernel and exports as a vector.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> g = torch.Generator().manual_seed(0)
            >>> sae = SAEWeights(torch.randn(64, 256, generator=g) / 8, torch.zeros(256),
            ...                  torch.randn(256, 64, generator=g) / 8, torch.zeros(64))
            >>> clamp = Intervention.sae_latent("blocks.1.hook_resid_post", sae, [7, 9], value=4.0, positions="last")
            >>> clamp
            Intervention('blocks.1.hook_resid_post', latent, scale=1.0, positions='last')
            >>> with tiny.steer(clamp), tiny.record("blocks.1.hook_resid_post") as cache:
            ...     _ = tiny.forward("hello world", chat=False)
            >>> with tiny.record("blocks.1.hook_resid_post") as plain:
            ...     _ = tiny.forward("hello world", chat=False)
            >>> h, h2 = plain["blocks.1.hook_resid_post"][0, -1], cache["blocks.1.hook_resid_post"][0, -1]
            >>> torch.allclose(h2 - h, (4.0 - sae.encode(h)[[7, 9]]) @ sae.W_dec[[7, 9]], atol=1e-5)
            True
            >>> Intervention.sae_latent("blocks.1.hook_resid_post", sae, 7, scale=3.0, mode="add").op
            'add'
        """
        # a transcoder's decoder rows (and its clamp) belong at the site it predicts
        w = sae_weights(sae)
        own_site, out_site = getattr(sae, "site", None), getattr(sae, "output_site", None)
        site_of = (out_site if mode == "add" or w.transcoder else None) or own_site
        if w.transcoder and mode == "clamp":
            if isinstance(own_site, str) and source is not None and source != own_site:
                raise InputError(f"expected the transcoder's own input site {own_site!r} as source=, found "
                                 f"{source!r}; leave source= out")
            source = source if source is not None else own_site if isinstance(own_site, str) else None
        if isinstance(site_of, str) and site_of != site:
            raise InputError(f"expected the SAE's own site for its latents, found the SAE at {site_of!r} and "
                             f"site={site!r}; pass site={site_of!r} (an SAE's latents mean something only where "
                             "it was trained)")
        if mode == "add":
            if source is not None:
                raise InputError(f"expected source= only for a transcoder's clamp (mode='clamp'), found it with "
                                 f"mode='add'; decoder rows are added at {site!r} alone")
            if value is not None:
                raise InputError("expected scale= (the multiple of the decoder rows to add) with mode='add', found "
                                 "value=; value= sets a latent's activation in mode='clamp'")
            rows = w.W_dec[torch.tensor(latent_indices_of(latents, w.d_sae))].float().sum(0)
            return cls.add(site, rows, 1.0 if scale is None else scale, positions=positions, when=when)
        if mode != "clamp":
            raise InputError(f"expected mode 'clamp' or 'add', found {mode!r}")
        return cls(site, "latent", None, 1.0, positions=positions, when=when,
                   latent=LatentEdit.of(sae, latents, value=value, scale=scale, source=source))

    def at(self, positions: PositionSpec) -> "Intervention":
        """The same intervention at other positions."""
        return dataclasses.replace(self, positions=positions)

    @property
    def d_model(self) -> Optional[int]:
        """The width of this intervention's vectors (``None`` for apply / patch, whose shape is checked
        when they run)."""
        if self.op == "patch":
            return None
        if self.tensor is not None:
            return int(self.tensor.shape[-1])
        if self.region is not None:
            return int(self.region.mean.shape[0])
        if self.latent is not None:
            return self.latent.d_out
        return None

    def config(self) -> SteerConfig:
        """This (kernel) intervention as one kernel configuration (:func:`kernel_config`)."""
        return kernel_config([self], repr(self.site))

    def __repr__(self):
        shape = "" if self.tensor is None else f", {tuple(self.tensor.shape)}"
        when = "" if self.when is None else f", when={self.when!r}"
        source = "" if self.latent is None or self.latent.source is None else f", source={self.latent.source!r}"
        return (f"Intervention({self.site!r}, {self.op}{shape}, scale={self.scale}, positions={self.positions!r}"
                f"{source}{when})")


Steering = Sequence[Intervention]


def kernel_config(parts: Sequence[Intervention], where: str = "") -> SteerConfig:
    """One kernel configuration doing all of ``parts`` (one row's kernel interventions at one site whose
    positions select a token): bases stacked (orthonormal together), injections summed, at most one region
    and one gate. The one place interventions become the kernel's configuration.

    Examples:
        >>> u = torch.eye(64)
        >>> cfg = kernel_config([Intervention.add("blocks.1.hook_resid_post", u[0], 2.0),
        ...                      Intervention.clamp("blocks.1.hook_resid_post", u[1], 3.0)])
        >>> tuple(cfg.basis.shape), cfg.target.tolist(), cfg.add_scale.tolist()
        ((1, 64), [3.0], [2.0])
    """
    if not parts or any(p.op not in KERNEL_OPS for p in parts):
        raise InputError(f"expected kernel operations {KERNEL_OPS} at {where or 'a site'}, found "
                         f"{[p.op for p in parts] or 'none'}")
    bases, strengths, targets, adds, add_scales, regions, gates = [], [], [], [], [], [], []
    for p in parts:
        t = p.tensor
        if p.op in ("ablate", "clamp") and t is not None:
            k = t.shape[0]
            bases.append(t.float())
            strengths.append(torch.full((k,), p.scale if p.op == "ablate" else 1.0))
            targets.append(p.value.float() if p.op == "clamp" and p.value is not None else torch.zeros(k))
        elif p.op == "add" and t is not None:
            adds.append(t.float()[None])
            add_scales.append(torch.tensor([p.scale], dtype=torch.float32))
        elif p.op == "project" and p.region is not None:
            regions.append((p.region, p.scale))
        if p.gate is not None:
            gates.append(p.gate)
    if len(regions) > 1:
        raise InputError(f"expected at most one region projection per row at {where}, found {len(regions)}")
    if gates and (len(gates) != sum(p.op in ("add", "project") for p in parts) or any(
            not torch.equal(g.direction, gates[0].direction) or g.threshold != gates[0].threshold
            or g.mode != gates[0].mode for g in gates)):
        raise InputError(f"expected one gate for every add / project applied together at {where}, found "
                         "different (or missing) gates; apply them at different sites or positions")
    kw: dict = {}
    if len(bases) > 1:
        B = torch.cat(bases)
        err = float((B.double() @ B.double().T - torch.eye(B.shape[0], dtype=torch.float64)).abs().max())
        if err > ORTHO_TOL:
            raise InputError(f"expected the ablate / clamp directions applied together at {where} to be orthonormal "
                             f"(max |B B^T - I| = {err:.3g}), found overlapping ones; apply them at different "
                             "sites or pass one basis from steerkit.orthonormalize")
    if bases:
        kw.update(basis=torch.cat(bases), strength=torch.cat(strengths), target=torch.cat(targets))
    if adds:
        kw.update(add=torch.cat(adds), add_scale=torch.cat(add_scales))
    if regions:
        kw["region"], kw["region_strength"] = regions[0]
    if gates:
        g = gates[0]
        kw.update(gate_direction=g.direction, gate_threshold=g.threshold, gate_mode=g.mode)
    return SteerConfig(**kw)

