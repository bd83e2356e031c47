"""Interventions: the one value every way of steering lowers to, and the one step that compiles them.

An :class:`Intervention` says, at one site (a hook name), what to do to the activations: ``add`` a
vector, ``ablate`` an orthonormal basis, ``clamp`` projections to values, ``replace`` with a vector,
``patch`` in the values of another run, ``project`` into a polyhedral region, or ``apply`` any callable;
optionally behind a conditional ``gate``, at some ``positions``, for some attention ``heads`` (experts at
``mlp.hook_expert_out``) or MLP ``neurons``, with norm preservation. A list of interventions is a *steering*.

Sites with structure (TransformerLens's component hooks) are seen by the kernel as rows of their
features: ``[.., heads, d_head]`` flattened to ``heads * d_head`` (per-expert outputs ``[.., n_experts,
d_model]`` the same way, an expert standing for a head), attention matrices
``[batch, heads, q, k]`` as ``[batch, q, heads * k]`` (positions select queries). ``heads=`` /
``neurons=`` are lowered by :func:`compile` to full-width tensors (a ``d_head`` vector placed at each
chosen head; a basis embedded head by head, which stays orthonormal) or to a feature mask (replace,
patch); an ``apply`` callable gets the natural shape.

Everything that steers lowers to interventions: keyword calls (``sm.edit(hook, add=v)``), kernel
specs (``{hook: SteerConfig}``), stored artifacts (``artifact.to_interventions(facts)``), a vLLM
request's spec, the app's Steer page and the published methods.

:func:`compile` is the one lowering step: it turns the interventions of a batch (one steering for
every row, or one per row) into a :class:`CompiledSteering`, one :class:`SiteProgram` per site,
made once at registration: per site ONE kernel table holding every configuration a row can need
(the combination of that row's kernel interventions whose positions select a token), the fused call
bound once (:func:`steerkit.kernels.bind_steer`, the implementation chosen then), and the torch
steps (``replace`` / ``apply``). At run time a program only builds masks and row indices:

- local backends (hf, tlens, nnsight) call ``program(x, call)`` from their hook functions;
- the vLLM worker calls ``program.apply(h, groups, mask_of)`` on the flattened rows of a step.

Order at one site: the kernel's operations (ablate / clamp, gate, add, region, norm preservation),
then ``replace`` and ``apply`` in the order given.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Callable, Literal, Mapping, Optional, Sequence, Union

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooknames import EXPERT_OUT, HEAD_HOOKS, KV_HOOKS, MATRIX_HOOKS, MLP_HOOKS, ROUTER_LOGITS, ROUTING_HOOKS
from steerkit.hooknames import record_only_error
from steerkit.hooknames import parse as parse_hook
from steerkit.kernels import ORTHO_TOL, Polyhedron, SteerConfig, SteerTable, bind_steer
# what the layers above take from the kernels, through the core (only the core and serving import kernels)
from steerkit.kernels import MAX_HALFSPACES as MAX_HALFSPACES, MAX_M as MAX_M  # noqa: E401
from steerkit.kernels import SteerConfigError as SteerConfigError, orthonormalize as orthonormalize
from steerkit.kernels.config import add_terms
from steerkit.positions import PositionSpec, RunState, chunk_mask, spec_key, validate_positions

Op = Literal["add", "ablate", "clamp", "replace", "patch", "project", "apply"]
OPS: tuple[str, ...] = ("add", "ablate", "clamp", "replace", "patch", "project", "apply")
KERNEL_OPS = ("add", "ablate", "clamp", "project")
#: distinct position specs among one row's kernel interventions at one site (2^n - 1 combinations)
MAX_POSITION_SPECS = 4


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What lowering needs to know of a model, without the model: its name, depth, width, whether
    blocks have a ``hook_resid_mid`` (sequential blocks), its weight fingerprint, and the widths of the
    component hooks (heads, KV heads, head size, MLP width; routed experts per sparse block and experts
    per token on a mixture-of-experts model; ``None`` where unknown or absent).

    Examples:
        >>> f = tiny.facts
        >>> f.n_layers, f.d_model, f.n_heads, f.n_kv_heads, f.d_head, f.d_mlp
        (4, 64, 4, 2, 16, 128)
        >>> f.width("attn.hook_k", "blocks.0.attn.hook_k"), f.width("hook_resid_post", "blocks.0.hook_resid_post")
        (32, 64)
    """

    name: str
    n_layers: int
    d_model: int
    fingerprint: Optional[str] = None
    has_resid_mid: bool = True
    n_heads: Optional[int] = None
    n_kv_heads: Optional[int] = None
    d_head: Optional[int] = None
    d_mlp: Optional[int] = None
    n_experts: Optional[int] = None
    top_k: Optional[int] = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _dim(self, name: str, site: str) -> int:
        v = getattr(self, name)
        if v is None:
            raise InputError(f"expected the model's {name} to lower an intervention at {site!r}, found none in its "
                             "facts; build them from the model (sm.facts)")
        return int(v)

    def heads_at(self, kind: str, site: str) -> int:
        """How many heads a head site of ``kind`` has (KV heads for hook_k / hook_v)."""
        return self._dim("n_kv_heads" if kind in KV_HOOKS else "n_heads", site)

    def width(self, kind: str, site: str) -> Optional[int]:
        """The feature width the kernel sees at a site of ``kind`` (``None``: it varies, as the key
        axis of an attention matrix does)."""
        if kind in MATRIX_HOOKS:
            return None
        if kind in HEAD_HOOKS:
            return self.heads_at(kind, site) * self._dim("d_head", site)
        if kind in MLP_HOOKS:
            return self._dim("d_mlp", site)
        if kind == ROUTER_LOGITS:
            return self._dim("n_experts", site)
        if kind == EXPERT_OUT:
            return self._dim("n_experts", site) * self.d_model
        if kind in ROUTING_HOOKS:
            raise record_only_error(site)
        return self.d_model

    def units_at(self, kind: str, site: str) -> tuple[int, int]:
        """``(count, width)`` of the units ``heads=`` selects at a site of ``kind``: attention heads of
        ``d_head`` features, or experts of ``d_model`` features at ``mlp.hook_expert_out``."""
        if kind == EXPERT_OUT:
            return self._dim("n_experts", site), self.d_model
        return self.heads_at(kind, site), self._dim("d_head", site)


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


CONDITION_MEASURES = ("cast", "cosine")
CONDITION_AGGREGATES = ("mean", "last")
CONDITION_COMPARATORS = ("above", "below")
RULE_MODES = ("any", "all")


def aggregate_rows(x: Float[Tensor, "batch pos width"], mask: Optional[Tensor],
                   aggregate: str = "mean") -> Float[Tensor, "batch width"]:
    """One vector per row of ``x``: the ``"mean"`` over the positions ``mask`` (``[batch, pos]`` bool,
    ``None``: every position) selects, or the ``"last"`` selected position (float32).

    Examples:
        >>> x = torch.arange(12.0).reshape(1, 3, 4)
        >>> aggregate_rows(x, torch.tensor([[False, True, True]]), "mean")
        tensor([[6., 7., 8., 9.]])
        >>> aggregate_rows(x, None, "last")
        tensor([[ 8.,  9., 10., 11.]])
    """
    if aggregate not in CONDITION_AGGREGATES:
        raise InputError(f"expected aggregate in {CONDITION_AGGREGATES}, found {aggregate!r}")
    x = x.float()
    B, T = int(x.shape[0]), int(x.shape[1])
    m = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.to(x.device).bool()
    if aggregate == "mean":
        w = m.to(x.dtype)
        return (x * w.unsqueeze(-1)).sum(1) / w.sum(1, keepdim=True).clamp_min(1.0)
    idx = torch.where(m, torch.arange(T, device=x.device).expand(B, T), torch.full_like(m, -1, dtype=torch.long))
    last = idx.amax(1).clamp_min(0)
    return x[torch.arange(B, device=x.device), last]


def condition_similarity(h: Float[Tensor, "*rows width"], direction: Float[Tensor, " width"],
                         measure: str = "cast") -> Float[Tensor, " *rows"]:
    """THE similarity a :class:`Condition` compares with its threshold (the evaluator of compiled
    steering and :func:`steerkit.probes.fit_condition` both call it): ``"cast"`` is CAST's
    ``cos(h, tanh(P h))`` with ``P = u u^T`` (Lee et al. 2024), ``"cosine"`` is ``cos(h, u)``
    (``u`` the unit ``direction``), in float32.

    Examples:
        >>> u = torch.tensor([1.0, 0.0])
        >>> round(float(condition_similarity(torch.tensor([3.0, 4.0]), u, "cosine")), 3)
        0.6
        >>> round(float(condition_similarity(torch.tensor([3.0, 4.0]), u, "cast")), 3)
        0.6
    """
    if measure not in CONDITION_MEASURES:
        raise InputError(f"expected measure in {CONDITION_MEASURES}, found {measure!r}")
    h = h.float()
    u = direction.to(device=h.device, dtype=torch.float32)
    u = u / u.norm().clamp_min(1e-12)
    y = u.expand_as(h) if measure == "cosine" else torch.tanh((h @ u).unsqueeze(-1) * u)
    return (h * y).sum(-1) / (h.norm(dim=-1) * y.norm(dim=-1)).clamp_min(1e-12)


@dataclasses.dataclass(frozen=True, eq=False)
class Condition:
    """A CAST condition (Lee et al. 2024): a test of each row's prompt at ``site``.

    On the forward pass that holds a row's prompt, the site's activations over the row's prompt tokens
    (padding excluded) are aggregated (``"mean"`` or the ``"last"`` token), their similarity with the
    unit ``direction`` is taken (:func:`condition_similarity`, ``measure`` ``"cast"`` or ``"cosine"``) and
    the condition *fires* when it is ``"above"`` / ``"below"`` ``threshold``. The decision is held for
    the rest of the run (every decoding step). Conditions with equal fields are equal (and hash equal).

    Examples:
        >>> c = Condition("blocks.1.hook_resid_pre", torch.ones(64), 0.5)
        >>> round(float(c.direction.norm()), 3), c.comparator, c.aggregate, c.measure
        (1.0, 'above', 'mean', 'cast')
        >>> c.fires(torch.tensor([0.7, 0.2]))
        tensor([ True, False])
    """

    site: str
    direction: Float[Tensor, " d_model"]
    threshold: float
    comparator: str = "above"
    aggregate: str = "mean"
    measure: str = "cast"

    def __post_init__(self):
        if not isinstance(self.site, str) or not self.site:
            raise InputError(f"expected a hook name as the condition's site, found {self.site!r:.80}")
        for name, allowed in (("comparator", CONDITION_COMPARATORS), ("aggregate", CONDITION_AGGREGATES),
                              ("measure", CONDITION_MEASURES)):
            if getattr(self, name) not in allowed:
                raise InputError(f"expected a condition {name} in {allowed}, found {getattr(self, name)!r}")
        d = _vector(self.direction, "the condition direction").detach().float().cpu()
        n = float(d.norm())
        if n < 1e-12:
            raise InputError("expected a nonzero condition direction, found a zero vector; fit it with "
                             "steerkit.probes.fit_condition")
        object.__setattr__(self, "direction", (d / n).contiguous())
        object.__setattr__(self, "threshold", _number(self.threshold, "the condition threshold"))
        digest = hashlib.sha1(self.direction.numpy().tobytes()).hexdigest()
        object.__setattr__(self, "_key", (self.site, int(self.direction.shape[0]), digest, self.threshold,
                                          self.comparator, self.aggregate, self.measure))

    @property
    def key(self) -> tuple:
        """What identifies this condition (two conditions with equal keys are one evaluator)."""
        return self._key  # type: ignore[attr-defined]

    def __eq__(self, other):
        return isinstance(other, Condition) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def scores(self, x: Float[Tensor, "batch pos width"], mask: Optional[Tensor] = None) -> Float[Tensor, " batch"]:
        """Each row's similarity: ``x`` aggregated over the positions ``mask`` selects, then measured."""
        return condition_similarity(aggregate_rows(x, mask, self.aggregate), self.direction, self.measure)

    def fires(self, similarity: Tensor) -> Tensor:
        """Where the condition fires for these similarities (bool, same shape)."""
        return similarity > self.threshold if self.comparator == "above" else similarity < self.threshold

    def __repr__(self):
        return (f"Condition({self.site!r}, [{self.direction.shape[0]}], {self.comparator} {self.threshold:.4g}, "
                f"aggregate={self.aggregate!r}, measure={self.measure!r})")


@dataclasses.dataclass(frozen=True, eq=False)
class When:
    """When a behaviour applies: on rows where ``"any"`` / ``"all"`` of ``conditions`` fire (the
    opposite with ``negate``). "if C1 then B1, if C2 then B2" is two behaviours, each with its own
    ``When``. A row whose conditions are not decided yet (a site that runs before the conditions' on
    the prompt pass) gets nothing.

    Examples:
        >>> c = Condition("blocks.1.hook_resid_pre", torch.ones(64), 0.5)
        >>> w = When(c)
        >>> w.mode, len(w.conditions), w.negate
        ('any', 1, False)
        >>> w.rule([torch.tensor([True, False])])
        tensor([ True, False])
    """

    conditions: tuple
    mode: str = "any"
    negate: bool = False

    def __post_init__(self):
        cs = self.conditions
        cs = (cs,) if isinstance(cs, Condition) else tuple(cs) if isinstance(cs, (list, tuple)) else cs
        if not isinstance(cs, tuple) or not cs or not all(isinstance(c, Condition) for c in cs):
            raise InputError(f"expected When(conditions) with one or more steerkit.Condition values, found "
                             f"{self.conditions!r:.100}")
        uniq = tuple(dict.fromkeys(cs))
        object.__setattr__(self, "conditions", uniq)
        if self.mode not in RULE_MODES:
            raise InputError(f"expected a rule mode in {RULE_MODES}, found {self.mode!r}")
        if not isinstance(self.negate, bool):
            raise InputError(f"expected negate as a bool, found {self.negate!r:.60}")
        object.__setattr__(self, "_key", (tuple(c.key for c in uniq), self.mode, self.negate))

    @property
    def key(self) -> tuple:
        return self._key  # type: ignore[attr-defined]

    def __eq__(self, other):
        return isinstance(other, When) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def rule(self, fired: Sequence[Tensor]) -> Tensor:
        """The rows this rule selects, from each condition's decision (in ``conditions`` order)."""
        s = torch.stack([f.bool() for f in fired])
        r = s.any(0) if self.mode == "any" else s.all(0)
        return ~r if self.negate else r

    def __repr__(self):
        return f"When({list(self.conditions)!r}, mode={self.mode!r}, negate={self.negate})"


class Decisions:
    """What the conditions of one compiled steering decided on the latest run: per condition the
    run it was decided on, each row's similarity and each row's decision (held over decoding steps).

    Examples:
        >>> c = Condition("blocks.1.hook_resid_post", torch.ones(64), 0.0, measure="cosine")
        >>> d = Decisions([c])
        >>> x = torch.stack([torch.ones(3, 64), -torch.ones(3, 64)])  # [batch 2, pos 3, d_model]
        >>> d.evaluate(c, x, None, run_id=0)
        >>> d.fired()[c].tolist(), [round(s, 3) for s in d.similarities()[c].tolist()]
        ([True, False], [1.0, -1.0])
    """

    def __init__(self, conditions: Sequence[Condition]):
        self.conditions = tuple(conditions)
        self._state: dict = {}  # condition key -> (run id, similarity [B], fired [B])

    def evaluate(self, c: Condition, x: Tensor, mask: Optional[Tensor], run_id) -> None:
        sim = c.scores(x, mask)
        self._state[c.key] = (run_id, sim.detach(), c.fires(sim).detach())

    def rows(self, when: When, run_id, B: int, device) -> Tensor:
        """``[B]`` bool: the rows ``when`` selects on run ``run_id`` (none where a condition is undecided)."""
        fired = []
        for c in when.conditions:
            e = self._state.get(c.key)
            if e is None or e[0] != run_id or int(e[2].shape[0]) != B:
                return torch.zeros(B, dtype=torch.bool, device=device)
            fired.append(e[2].to(device))
        return when.rule(fired)

    def fired(self) -> dict:
        """``{condition: bool tensor [batch]}`` of the latest run each condition was evaluated on."""
        return {c: self._state[c.key][2] for c in self.conditions if c.key in self._state}

    def similarities(self) -> dict:
        """``{condition: float tensor [batch]}``, as :meth:`fired`."""
        return {c: self._state[c.key][1] for c in self.conditions if c.key in self._state}


def _number(x, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        if isinstance(x, Tensor) and x.numel() == 1:
            x = float(x)
        else:
            raise InputError(f"expected {what} to be a finite number, found {type(x).__name__} {x!r:.60}")
    x = float(x)
    if not math.isfinite(x):
        raise InputError(f"expected {what} to be a finite number, found {x}")
    return x


def _tensor(v, what: str) -> Tensor:
    if not isinstance(v, Tensor):
        try:
            v = torch.as_tensor(v)
        except Exception:
            raise InputError(f"expected {what} as a tensor, found {type(v).__name__}") from None
    if not torch.is_floating_point(v):
        v = v.float()
    if not (v.requires_grad and torch.is_grad_enabled()):
        v = v.detach()  # a trainable vector (requires grad, grad mode on) keeps its autograd link
    if v.numel() and not bool(torch.isfinite(v.detach()).all()):
        n = int((~torch.isfinite(v)).sum())
        raise InputError(f"expected {what} with finite values, found {n} NaN/inf entries; check how the "
                         "vector was computed (empty set? division by zero?)")
    return v


def _indices(v, what: str) -> tuple:
    if isinstance(v, (int,)) and not isinstance(v, bool):
        v = [v]
    try:
        out = tuple(int(i) for i in v)
    except (TypeError, ValueError):
        raise InputError(f"expected {what} as a list of indices, found {v!r:.60}") from None
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise InputError(f"expected {what} as distinct non-negative indices, found {list(out)}")
    return out


def _vector(v, what: str) -> Tensor:
    t = _tensor(v, what)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.shape[0] == 0:
        raise InputError(f"expected {what} of shape [d_model], found {tuple(t.shape)}")
    return t


def _basis(v, what: str) -> Tensor:
    """Rows of an orthonormal basis ``[k, d_model]``: one vector is normalised; several must already
    be orthonormal (say ``steerkit.orthonormalize(vectors)`` otherwise)."""
    t = _tensor(v, what)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] == 0 or t.shape[0] == 0:
        raise InputError(f"expected {what} of shape [d_model] or [k, d_model], found {tuple(t.shape)}")
    norms = t.norm(dim=-1)
    if bool((norms < 1e-12).any()):
        raise InputError(f"expected nonzero directions in {what}, found a zero vector")
    if t.shape[0] == 1:
        return t / norms.unsqueeze(-1)
    g = t.double() @ t.double().T
    err = float((g - torch.eye(t.shape[0], dtype=g.dtype)).abs().max())
    if err > ORTHO_TOL:
        raise InputError(f"expected an orthonormal basis in {what} (max |B B^T - I| <= {ORTHO_TOL}), found "
                         f"{err:.3g}; pass steerkit.orthonormalize(vectors) instead")
    return t


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

    ``positions`` (see :mod:`steerkit.positions`) limits it to some tokens; ``gate`` (add / project)
    makes it conditional per token; ``when`` (a :class:`When` of :class:`Condition` values, any operation)
    applies it only on the rows whose prompt fires the rule (CAST); ``preserve_norm`` rescales edited rows
    to their original norm; ``heads``
    (attention component sites; experts at ``mlp.hook_expert_out``) / ``neurons`` (MLP sites) limit it to
    those heads / experts / neurons, whose
    vectors are then ``d_head`` / ``len(neurons)`` wide. ``features`` is set by :func:`compile` only.

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
    features: Optional[Tensor] = None  # replace / patch after lowering: the features they write (bool [width])
    when: Optional[When] = None  # CAST: only on rows whose rule fires (decided on the prompt pass, then held)

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
        return None

    def config(self) -> SteerConfig:
        """This (kernel) intervention as one kernel configuration."""
        cfg = SteerConfig()
        if self.op == "add" and self.tensor is not None:
            cfg = SteerConfig(add=self.tensor.float(), add_scale=self.scale)
        elif self.op == "ablate" and self.tensor is not None:
            cfg = SteerConfig(basis=self.tensor.float(), strength=self.scale)
        elif self.op == "clamp" and self.tensor is not None:
            cfg = SteerConfig(basis=self.tensor.float(), strength=1.0, target=self.value)
        elif self.op == "project" and self.region is not None:
            cfg = SteerConfig(region=self.region, region_strength=self.scale)
        else:
            raise InputError(f"expected a kernel operation {KERNEL_OPS} with its tensor, found {self.op!r}")
        g = self.gate
        return cfg if g is None else cfg.with_gate(g.direction, g.threshold, g.mode)

    def __repr__(self):
        shape = "" if self.tensor is None else f", {tuple(self.tensor.shape)}"
        when = "" if self.when is None else f", when={self.when!r}"
        return f"Intervention({self.site!r}, {self.op}{shape}, scale={self.scale}, positions={self.positions!r}{when})"


Steering = Sequence[Intervention]


def from_config(site: str, cfg: SteerConfig, *, positions: PositionSpec = "all",
                preserve_norm: bool = False) -> list[Intervention]:
    """The interventions a kernel :class:`SteerConfig` stands for (basis, injection, region).

    Examples:
        >>> u = torch.zeros(64); u[0] = 1.0
        >>> cfg = SteerConfig(basis=u[None], strength=1.0, add=torch.ones(64), add_scale=2.0)
        >>> [(iv.op, iv.scale) for iv in from_config("blocks.1.hook_resid_post", cfg)]
        [('ablate', 1.0), ('add', 2.0)]
    """
    if not isinstance(cfg, SteerConfig):
        raise InputError(f"expected a steerkit.kernels.SteerConfig at {site!r}, found {type(cfg).__name__}; "
                         "build one with SteerConfig.injection(v, scale) etc.")
    gate = None
    if cfg.gate_direction is not None:
        gate = Gate(cfg.gate_direction, cfg.gate_threshold, cfg.gate_mode)
    out: list[Intervention] = []
    kw: dict = dict(positions=positions, preserve_norm=preserve_norm)
    if cfg.basis is not None:
        b = _tensor(cfg.basis, f"the basis at {site!r}")
        b = b if b.dim() == 2 else b[None]
        s = torch.as_tensor(cfg.strength, dtype=torch.float32).reshape(-1)
        if cfg.target is None:
            if s.numel() == 1:
                out.append(Intervention(site, "ablate", _basis(b, f"the basis at {site!r}"), float(s), **kw))
            else:
                for i in range(b.shape[0]):
                    out.append(Intervention(site, "ablate", _basis(b[i], f"the basis at {site!r}"), float(s[i]), **kw))
        else:
            if bool((s != 1).any()):
                raise InputError(f"expected strength 1 with a clamp target at {site!r}, found {s.tolist()}; "
                                 "a partial clamp is an ablation of strength s towards the target: split it")
            out.append(Intervention.clamp(site, b, torch.as_tensor(cfg.target, dtype=torch.float32), **kw))
    if cfg.add is not None:
        a, sc = add_terms(_tensor(cfg.add, f"the add vector at {site!r}"), cfg.add_scale, repr(site))
        for i in range(a.shape[0]):
            out.append(Intervention(site, "add", _vector(a[i], "the add vector"), float(sc[i]), gate=gate, **kw))
    if cfg.region is not None:
        out.append(Intervention(site, "project", None, float(cfg.region_strength), region=cfg.region, gate=gate, **kw))
    return out


def lower(steering, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
    """One steering (for every row) as a list of interventions: an :class:`Intervention`, a list of
    them, a ``{hook: SteerConfig | [SteerConfig, ...]}`` dict, or anything with
    ``to_interventions(facts, scale=..., override=...)`` (every stored artifact kind).

    Examples:
        >>> from steerkit.kernels import SteerConfig
        >>> steering = {"blocks.1.hook_resid_post": SteerConfig(add=torch.ones(64), add_scale=3.0)}
        >>> lower(steering, tiny.facts)
        [Intervention('blocks.1.hook_resid_post', add, (64,), scale=3.0, positions='all')]
    """
    if isinstance(steering, Intervention):
        return [steering]
    to = getattr(steering, "to_interventions", None)
    if to is not None:
        return list(to(facts, scale=scale, override=override))
    if scale != 1.0:
        raise InputError("expected scale= only with an artifact; put the scale in each intervention")
    if isinstance(steering, Mapping):
        out: list[Intervention] = []
        for h, c in steering.items():
            for cfg in (c if isinstance(c, (list, tuple)) else [c]):
                out += from_config(h, cfg)
        return out
    if isinstance(steering, (list, tuple)):
        out = []
        for i, s in enumerate(steering):
            if isinstance(s, Intervention):
                out.append(s)
            elif getattr(s, "to_interventions", None) is not None or isinstance(s, Mapping):
                out += lower(s, facts, override=override)
            else:
                raise InputError(f"expected interventions, artifacts or {{hook: SteerConfig}} dicts in the "
                                 f"steering, found {type(s).__name__} at index {i}")
        return out
    raise InputError(f"expected a steering: an Intervention, a list of them, a stored artifact or a "
                     f"{{hook: SteerConfig}} dict, found {type(steering).__name__}")


# =============================================================================== compiled programs
def _combine(parts: Sequence[Intervention], where: str) -> SteerConfig:
    """One kernel configuration doing all of ``parts`` (one row's kernel interventions at one site
    whose positions select a token): bases stacked (orthonormal together), injections summed, at
    most one region and one gate."""
    if len(parts) == 1:
        return parts[0].config()
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
    if bases:
        B = torch.cat(bases)
        err = float((B.double() @ B.double().T - torch.eye(B.shape[0], dtype=torch.float64)).abs().max())
        if err > ORTHO_TOL:
            raise InputError(f"expected the ablate / clamp directions applied together at {where} to be orthonormal "
                             f"(max |B B^T - I| = {err:.3g}), found overlapping ones; apply them at different "
                             "sites or pass one basis from steerkit.orthonormalize")
        kw.update(basis=B, strength=torch.cat(strengths), target=torch.cat(targets))
    if adds:
        kw.update(add=torch.cat(adds), add_scale=torch.cat(add_scales))
    if regions:
        kw["region"], kw["region_strength"] = regions[0]
    if gates:
        g = gates[0]
        kw.update(gate_direction=g.direction, gate_threshold=g.threshold, gate_mode=g.mode)
    return SteerConfig(**kw)


MaskOf = Callable[[PositionSpec], Optional[Tensor]]


def _spec_id(p: Intervention):
    """The key of ``p``'s spec in a site's kernel table: its positions and its rule (``when``)."""
    return spec_key(p.positions), None if p.when is None else p.when.key


class SiteProgram:
    """What one site does for a whole batch, compiled once (see the module docstring).

    ``groups``: row groups (one steering each: every row for a shared steering, one group per batch
    row or per served request otherwise). ``kernel``: the bound fused call over ONE table with, per
    group, a configuration for every non-empty subset of its distinct position specs (subset ``b`` of
    group ``g`` is row ``base[g] + b - 1``). ``steps``: torch operations with the groups they apply to.

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0)
        >>> program = compile([add], tiny.facts).programs["blocks.1.hook_resid_post"]
        >>> program.site, program.n_groups, program.table.n_configs
        ('blocks.1.hook_resid_post', 1, 1)
    """

    __slots__ = ("site", "n_groups", "kernel", "table", "specs", "bit_weight", "base", "steps", "simple",
                 "decode_fast", "preserve_norm", "whens", "conditions", "decisions")

    def __init__(self, site: str, per_group: Sequence[Sequence[Intervention]], *, d_model: int, device, dtype,
                 impl: str, conditions: Sequence[Condition] = (), decisions: Optional[Decisions] = None):
        self.site = site
        self.n_groups = len(per_group)
        # CAST: the conditions evaluated here (read-only) and the decisions every program of the steering shares
        self.conditions = tuple(conditions)
        self.decisions = decisions
        if (self.conditions or any(p.when is not None for g in per_group for p in g)) and decisions is None:
            raise InputError(f"expected the shared Decisions of a compiled steering at {site!r} (conditions), found "
                             "none; build programs with steerkit.interventions.compile")
        specs: dict = {}  # spec id -> (index, spec)
        kernel_parts: list[list[Intervention]] = [[p for p in g if p.op in KERNEL_OPS] for g in per_group]
        norm = {p.preserve_norm for g in kernel_parts for p in g}
        if len(norm) > 1:
            raise InputError(f"expected preserve_norm to be the same for every kernel intervention at {site!r}, "
                             "found both; apply them at different sites")
        self.preserve_norm = bool(norm and norm.pop())
        configs: list[SteerConfig] = []
        base: list[int] = []
        local_bits: list[dict] = []
        for gi, parts in enumerate(kernel_parts):
            local: dict = {}
            for p in parts:
                sid = _spec_id(p)
                if sid not in specs:
                    specs[sid] = (len(specs), (p.positions, p.when))
                local.setdefault(specs[sid][0], len(local))
            if len(local) > MAX_POSITION_SPECS:
                raise InputError(f"expected at most {MAX_POSITION_SPECS} different position specs among one row's "
                                 f"interventions at {site!r}, found {len(local)}; merge them (steerkit.AnyOf) or "
                                 "use other sites")
            base.append(len(configs))
            local_bits.append(local)
            for b in range(1, 1 << len(local)):
                chosen = [p for p in parts if b >> local[specs[_spec_id(p)][0]] & 1]
                configs.append(_combine(chosen, f"{site} (row group {gi})"))
        ordered = [s for _, s in sorted(specs.values(), key=lambda t: t[0])]
        self.specs = [pos for pos, _ in ordered]  # each spec: (positions, when); a rule ANDs the row's decision
        self.whens = [w for _, w in ordered]
        self.table = self.kernel = None
        if configs:
            try:
                self.table = SteerTable.from_configs(configs, d_model=d_model, device=device)
            except InputError as e:
                raise InputError(f"steering at {site!r}: {e}") from None
            self.kernel = bind_steer(self.table, device=device, dtype=dtype, impl=impl,
                                     preserve_norm=self.preserve_norm)
        bw = torch.zeros(self.n_groups, max(1, len(self.specs)), dtype=torch.long)
        for gi, local in enumerate(local_bits):
            for j, bit in local.items():
                bw[gi, j] = 1 << bit
        self.bit_weight = bw.to(device)
        self.base = torch.tensor(base or [0], dtype=torch.long, device=device)
        self.steps = []  # [(intervention, groups: Tensor[n_groups] bool | None for all)]
        order: dict = {}
        for gi, g in enumerate(per_group):
            for p in g:
                if p.op not in KERNEL_OPS:
                    order.setdefault(id(p), [p, set()])[1].add(gi)
        for p, gs in order.values():
            sel = None if len(gs) == self.n_groups else torch.tensor([i in gs for i in range(self.n_groups)],
                                                                        device=device)
            self.steps.append((p, sel))
        # one configuration, one spec for every row: the bound call alone (with the spec's mask)
        self.simple = self.n_groups == 1 and len(self.specs) == 1 and self.table is not None \
            and self.table.n_configs == 1
        # ... and a spec that selects every position of a decoding step: no mask at all there
        self.decode_fast = self.simple and not self.steps and self.whens[0] is None \
            and self.specs[0] in ("all", "generated")

    # --- run --------------------------------------------------------------------------
    def __call__(self, x: Float[Tensor, "batch pos d_model"], call) -> Optional[Tensor]:
        """The hook function of a local backend: ``x`` of one call with its :class:`~steerkit.hooks.SiteCall`."""
        run, kernel = call.run, self.kernel
        if self.decode_fast and kernel is not None and run is not None and call.start >= run.P:
            return kernel(x)  # a decoding step: every token, one configuration
        if self.n_groups > 1 and x.shape[0] != self.n_groups:
            raise InputError(f"expected a batch of {self.n_groups} rows (one per steering), found {x.shape[0]}")

        def mask_of(spec):
            if spec == "all" and run is None:
                return None
            return call.mask(spec, x.device)
        rule_of = None
        if self.decisions is not None:
            if run is None:
                raise InputError(f"expected conditional steering (when=) at {self.site!r} to run through "
                                 "SteerModel.forward / generate, found a direct call of the wrapped model; run it "
                                 "through the SteerModel")
            decisions, rid = self.decisions, run.run_id
            if call.start == 0:  # the pass holding the prompt: decide, then hold for the rest of the run
                prompt = call.mask("prompt", x.device)
                for c in self.conditions:
                    decisions.evaluate(c, x, prompt, rid)
            B, dev = int(x.shape[0]), x.device

            def rule_of(when):
                return decisions.rows(when, rid, B, dev)[:, None]
        groups = None
        if self.n_groups > 1:
            groups = torch.arange(self.n_groups, device=x.device)[:, None].expand(x.shape[0], x.shape[1])
        return self.apply(x, groups, mask_of, call.start, rule_of)

    def _mask(self, positions, when, mask_of: MaskOf, rule_of, lead) -> Optional[Tensor]:
        """The rows a spec selects: its positions AND, with a rule, the rows whose rule fires."""
        m = mask_of(positions)
        if when is None:
            return m
        if rule_of is None:
            raise InputError(f"expected a local run (sm.steer / sm.generate) for the conditional steering (when=) at "
                             f"{self.site!r}, found rows without condition decisions (a server step); conditions are "
                             "not supported there")
        r = rule_of(when).expand(lead)
        return r if m is None else m & r

    def kernel_rows(self, lead: tuple, device, groups: Optional[Tensor], mask_of: MaskOf,
                    rule_of: Optional[Callable] = None) -> Optional[tuple[Optional[Tensor], Optional[Tensor]]]:
        """Which rows of shape ``lead`` the fused kernel steers, and with which configuration of
        :attr:`table`: ``(active, row_config)``, ``None`` for either meaning every row / configuration
        0; ``None`` when it steers no row (arguments as for :meth:`apply`). What :meth:`apply` calls
        the kernel with, and what an engine writes into its steering slots.

        Examples:
            >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), positions="last")
            >>> program = compile([add], tiny.facts).programs["blocks.1.hook_resid_post"]
            >>> active, rc = program.kernel_rows((4,), "cpu", None, lambda spec: torch.tensor([0, 0, 0, 1]).bool())
            >>> active.tolist(), rc
            ([False, False, False, True], None)
        """
        if self.kernel is None:
            return None
        if self.simple:
            m = self._mask(self.specs[0], self.whens[0], mask_of, rule_of, lead)
            if m is None:
                return None, None
            return (m, None) if bool(m.any()) else None
        g = torch.zeros(lead, dtype=torch.long, device=device) if groups is None else groups
        owned = g >= 0
        gc = g.clamp_min(0)
        bits = torch.zeros(lead, dtype=torch.long, device=device)
        for j, spec in enumerate(self.specs):
            m = self._mask(spec, self.whens[j], mask_of, rule_of, lead)
            w = self.bit_weight[gc, j]
            bits += w if m is None else w * m
        active = owned & (bits > 0)
        if not bool(active.any()):
            return None
        return active, (self.base[gc] + bits - 1).clamp_min(0)

    def apply(self, h: Float[Tensor, "*rows d_model"], groups: Optional[Tensor], mask_of: MaskOf,
              start: int = 0, rule_of: Optional[Callable] = None) -> Optional[Tensor]:
        """``h`` steered (a new tensor), or ``None`` when nothing applies. ``groups``: each row's group
        (``h.shape[:-1]``, ``-1`` for rows no steering owns), ``None`` when every row is group 0.
        ``mask_of(spec)``: the rows a position spec selects (``None``: all of them). ``start``: the
        absolute position of ``h``'s first token (``[batch, pos, ..]`` of a local call; patch uses it).
        ``rule_of(when)``: the rows (broadcastable to ``h.shape[:-1]``) a :class:`When` selects; needed
        only when an intervention has one."""
        out = None
        lead = h.shape[:-1]
        if self.kernel is not None:
            rows = self.kernel_rows(lead, h.device, groups, mask_of, rule_of)
            if rows is not None:
                out = self.kernel(h, *rows)
        for p, sel in self.steps:
            m = self._mask(p.positions, p.when, mask_of, rule_of, lead)
            if sel is not None or groups is not None:  # only the rows of the groups that have it
                g = torch.zeros(h.shape[:-1], dtype=torch.long, device=h.device) if groups is None else groups
                mine = (g >= 0) & (True if sel is None else sel[g.clamp_min(0)])
                m = mine if m is None else m & mine
            if m is not None and not bool(m.any()):
                continue
            x = h if out is None else out
            if p.op == "replace" and p.tensor is not None:
                y = (p.scale * p.tensor.to(device=x.device, dtype=x.dtype)).expand_as(x)
            elif p.op == "patch" and p.tensor is not None:
                y = self._patched(p.tensor, x, m, start)
            elif p.fn is not None:
                y = p.fn(x)
                if not isinstance(y, Tensor) or y.shape != x.shape:
                    raise InputError(f"expected the intervention's fn at {self.site!r} to return a tensor of shape "
                                     f"{tuple(x.shape)}, found {getattr(y, 'shape', type(y).__name__)}")
            else:  # pragma: no cover - the constructors never build one
                raise InputError(f"expected a callable in the apply intervention at {self.site!r}, found None")
            if p.features is not None:
                y = torch.where(p.features.to(x.device), y, x)
            out = y if m is None else torch.where(m.unsqueeze(-1), y, x)
        return out

    def _patched(self, src: Tensor, x: Tensor, m: Optional[Tensor], start: int) -> Tensor:
        """``x`` with the source's rows at its positions (``[batch, T, width]`` from ``start``)."""
        if x.dim() != 3:
            raise InputError(f"expected patch at {self.site!r} in a local forward pass ([batch, pos, ..]), found "
                             f"rows of shape {tuple(x.shape)}; patch activations with sm.steer / sm.forward")
        if src.shape[1] != x.shape[-1]:
            raise InputError(f"expected the patch source at {self.site!r} to have {x.shape[-1]} features per position "
                             f"(this run), found {src.shape[1]}; was the source run of another length?")
        T, n = x.shape[1], src.shape[0]
        cover = max(0, min(T, n - start))
        if cover < T:
            sel = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if m is None else m
            if bool(sel[:, cover:].any()):
                raise InputError(f"expected the patch at {self.site!r} to select positions its source has (0.."
                                 f"{n - 1}), found position {start + cover} or later selected; give positions= "
                                 "within the source run (e.g. 'prompt')")
        y = x.clone()
        if cover:
            y[:, :cover] = src[start:start + cover].to(device=x.device, dtype=x.dtype)
        return y

    def __repr__(self):
        n = 0 if self.table is None else self.table.n_configs
        return (f"SiteProgram({self.site!r}, groups={self.n_groups}, configs={n}, torch_steps={len(self.steps)}, "
                f"kernel={self.kernel!r})")


@dataclasses.dataclass(frozen=True)
class CompiledSteering:
    """A steering compiled for one model: ``{site: SiteProgram}`` (``n_groups`` row groups).

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0)
        >>> compiled = tiny.compile([add, add.at("last")])
        >>> len(compiled), compiled.n_groups, list(compiled.programs)
        (1, 1, ['blocks.1.hook_resid_post'])
        >>> with tiny.hooks.install(compiled):  # what tiny.steer([add, add.at("last")]) does
        ...     _ = tiny.forward("hi", chat=False)
    """

    programs: Mapping[str, SiteProgram]
    n_groups: int
    interventions: tuple
    state: Optional[Decisions] = None  # the conditions' decisions (CAST), shared by the programs

    @property
    def conditions(self) -> tuple:
        """Every distinct :class:`Condition` this steering evaluates."""
        return () if self.state is None else self.state.conditions

    @property
    def decisions(self) -> dict:
        """``{condition: bool tensor [batch]}``: where each condition fired on the latest run (``{}``
        before any run, or without conditions)."""
        return {} if self.state is None else self.state.fired()

    @property
    def similarities(self) -> dict:
        """``{condition: float tensor [batch]}``: each row's similarity on the latest run."""
        return {} if self.state is None else self.state.similarities()

    def __iter__(self):
        return iter(self.programs.items())

    def __len__(self):
        return len(self.programs)


def _feature_blocks(p: Intervention, kind: str, facts: ModelFacts, key_len: Optional[int] = None) -> list[list[int]]:
    """The feature indices ``p.heads`` / ``p.neurons`` name at a site of ``kind``: one block per head
    (``d_head`` features; ``key_len`` for an attention matrix), or one block of neurons."""
    site = p.site
    if p.heads is not None:
        if kind not in HEAD_HOOKS + MATRIX_HOOKS + (EXPERT_OUT,):
            raise InputError(f"expected heads= at an attention component hook (attn.hook_q / k / v / z / "
                             f"attn_scores / pattern) or experts at mlp.hook_expert_out, found it at {site!r}; use "
                             "the per-head (per-expert) hooks")
        if kind in MATRIX_HOOKS:
            n, m = facts._dim("n_heads", site), int(key_len or 0)
        else:
            n, m = facts.units_at(kind, site)
        what = "experts" if kind == EXPERT_OUT else "heads"
        bad = [h for h in p.heads if h >= n]
        if bad:
            raise InputError(f"expected {what} in 0..{n - 1} at {site!r} ({n} {what}), found {bad}")
        return [list(range(h * m, (h + 1) * m)) for h in p.heads]
    if p.neurons is not None:
        if kind not in MLP_HOOKS:
            raise InputError(f"expected neurons= at an MLP hook (mlp.hook_pre / mlp.hook_post), found it at {site!r}")
        n = facts._dim("d_mlp", site)
        bad = [i for i in p.neurons if i >= n]
        if bad:
            raise InputError(f"expected neurons in 0..{n - 1} at {site!r} (d_mlp={n}), found {bad}")
        return [list(p.neurons)]
    return []


def _flat_source(p: Intervention, kind: str, facts: ModelFacts) -> Tensor:
    """A patch source as rows of features ``[pos, width]`` (an attention matrix ``[heads, q, k]`` as
    ``[q, heads * k]``)."""
    t = p.tensor
    assert t is not None
    if kind in MATRIX_HOOKS:
        if t.dim() != 3 or t.shape[0] != facts._dim("n_heads", p.site):
            raise InputError(f"expected the patch source at {p.site!r} as [n_heads, q_pos, k_pos] "
                             f"(n_heads={facts.n_heads}), found {tuple(t.shape)}")
        return t.transpose(0, 1).flatten(1)
    w = facts.width(kind, p.site)
    flat = t.flatten(1) if t.dim() > 2 else t
    if flat.dim() != 2 or flat.shape[1] != w:
        raise InputError(f"expected the patch source at {p.site!r} as [pos, ...] with {w} features per position, "
                         f"found {tuple(t.shape)}; take one row of a recording of this site, e.g. cache[hook][0]")
    return flat


def _natural(fn: Callable, kind: str, facts: ModelFacts, site: str) -> Callable:
    """``fn`` on the site's own shape, for the kernel's rows of features."""
    if kind in HEAD_HOOKS + (EXPERT_OUT,):
        H, dh = facts.units_at(kind, site)

        def on_heads(x: Tensor) -> Tensor:
            y = fn(x.unflatten(-1, (H, dh)))
            if not isinstance(y, Tensor) or y.shape[-2:] != (H, dh):
                raise InputError(f"expected the intervention's fn at {site!r} to return [.., {H}, {dh}] (its input's "
                                 f"shape), found {getattr(y, 'shape', type(y).__name__)}")
            return y.flatten(-2)
        return on_heads
    if kind in MATRIX_HOOKS:
        H = facts._dim("n_heads", site)

        def on_matrix(x: Tensor) -> Tensor:
            nat = x.unflatten(-1, (H, -1)).transpose(1, 2)
            y = fn(nat)
            if not isinstance(y, Tensor) or y.shape != nat.shape:
                raise InputError(f"expected the intervention's fn at {site!r} to return {tuple(nat.shape)} (its "
                                 f"input's shape), found {getattr(y, 'shape', type(y).__name__)}")
            return y.transpose(1, 2).flatten(-2)
        return on_matrix
    return fn


def _structured(p: Intervention, kind: str, facts: ModelFacts) -> Intervention:
    """``p`` at a site of ``kind`` with its heads / neurons lowered to full-width tensors or a feature
    mask, a patch source as rows of features, and an apply callable that sees the site's own shape."""
    if kind in MATRIX_HOOKS and p.op not in ("patch", "apply"):
        raise InputError(f"expected patch or apply at {p.site!r} (an attention matrix: its key axis grows as "
                         f"tokens are generated), found {p.op}; edit attn.hook_q / hook_k / hook_z for vector edits")
    rep: dict = {}
    if p.op == "patch":
        rep["tensor"] = _flat_source(p, kind, facts)
    if p.op == "apply" and p.fn is not None:
        rep["fn"] = _natural(p.fn, kind, facts, p.site)
    key_len = None
    if kind in MATRIX_HOOKS and p.op == "patch":
        key_len = rep["tensor"].shape[1] // facts._dim("n_heads", p.site)
    blocks = _feature_blocks(p, kind, facts, key_len)
    if blocks:
        w = key_len * facts._dim("n_heads", p.site) if key_len is not None else facts.width(kind, p.site)
        assert w is not None
        m = len(blocks[0])
        mask = torch.zeros(w, dtype=torch.bool)
        for b in blocks:
            mask[b] = True
        t = p.tensor
        if p.op in ("add", "replace") and t is not None:
            if t.shape[-1] != m:
                raise InputError(f"expected the {p.op} vector at {p.site!r} of shape [{m}] (one value per feature of "
                                 f"the chosen {'heads' if p.heads else 'neurons'}), found {tuple(t.shape)}")
            full = torch.zeros(w, dtype=t.dtype)
            for b in blocks:
                full[b] = t
            rep["tensor"] = full
        elif p.op in ("ablate", "clamp") and t is not None:
            if t.shape[-1] != m:
                raise InputError(f"expected the {p.op} directions at {p.site!r} of width {m} (the chosen "
                                 f"{'heads' if p.heads else 'neurons'}), found {tuple(t.shape)}")
            rows = torch.zeros(len(blocks) * t.shape[0], w, dtype=t.dtype)
            for i, b in enumerate(blocks):
                rows[i * t.shape[0]:(i + 1) * t.shape[0], b] = t
            rep["tensor"] = rows
            if p.op == "clamp" and p.value is not None:
                rep["value"] = p.value.repeat(len(blocks))
        if p.op in ("replace", "patch", "apply"):
            rep["features"] = mask
        rep.update(heads=None, neurons=None)
    return dataclasses.replace(p, **rep) if rep else p


def compile(steering: Union[Steering, Sequence[Optional[Steering]]], facts: ModelFacts, *, per_row: bool = False,
            device=None, dtype: torch.dtype = torch.float32, impl: str = "auto",
            positions: Optional[PositionSpec] = None, conditions: Sequence[Condition] = ()) -> CompiledSteering:
    """THE lowering step: interventions -> one :class:`SiteProgram` per site.

    ``steering``: a list of :class:`Intervention` (every row), or with ``per_row=True`` a list with one
    list (or ``None``) per row group. Sites are checked against ``facts`` (depth, resid_mid) and tensors
    against its ``d_model`` before anything is built. ``positions``, when given, replaces every
    intervention's own. ``impl`` and any :func:`steerkit.kernels.use_impl` in force are read here.
    ``device``: where the tables live, or a function of the site giving it (a model spread over
    devices: each site's tables on the device its activations are computed on).

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 2.0)
        >>> ablate = Intervention.ablate("blocks.3.hook_resid_post", torch.eye(64)[:2])
        >>> compiled = compile([add, ablate], tiny.facts)
        >>> sorted(compiled.programs), compiled.n_groups
        (['blocks.1.hook_resid_post', 'blocks.3.hook_resid_post'], 1)
        >>> compile([[add], None], tiny.facts, per_row=True).n_groups  # one steering per row
        2
    """
    groups: list[list[Intervention]]
    if per_row:
        if not isinstance(steering, (list, tuple)) or not steering:
            raise InputError("expected a non-empty list with one steering per row, found "
                             f"{type(steering).__name__}")
        groups = [list(g or []) for g in steering]
    else:
        groups = [list(steering)]  # type: ignore[arg-type]
    if positions is not None:
        positions = validate_positions(positions)
        groups = [[p.at(positions) for p in g] for g in groups]
    sites: dict[str, list[list[Intervention]]] = {}
    for gi, g in enumerate(groups):
        for p in g:
            if not isinstance(p, Intervention):
                raise InputError(f"expected Intervention values, found {type(p).__name__} (row group {gi})")
            kind = parse_hook(p.site, facts.n_layers, has_resid_mid=facts.has_resid_mid).kind
            p = _structured(p, kind, facts)
            d = p.d_model
            w = facts.width(kind, p.site)
            if d is not None and d != w:
                shape = tuple(p.tensor.shape) if p.tensor is not None else (d,)
                what = f"d_model={facts.d_model} of this model" if w == facts.d_model else f"the width of {kind}"
                raise InputError(f"expected the {p.op} vector of shape [{w}] ({what}) at {p.site!r}, found {shape}; "
                                 "was it computed on another model or at another site?")
            sites.setdefault(p.site, [[] for _ in groups])[gi].append(p)
    # CAST: every distinct condition (of a rule, or asked for alone) gets one evaluator at its site
    conds: dict = {}
    for c in list(conditions) + [c for g in groups for p in g if p.when is not None for c in p.when.conditions]:
        if not isinstance(c, Condition):
            raise InputError(f"expected steerkit.Condition values in conditions=, found {type(c).__name__}")
        if c not in conds:
            conds[c] = _check_condition(c, facts)
    if not sites and not conds:
        raise InputError("expected at least one intervention in the steering, found none")
    state = Decisions(tuple(conds)) if conds else None
    at_site: dict[str, list[Condition]] = {}
    for c in conds:
        at_site.setdefault(c.site, []).append(c)
        sites.setdefault(c.site, [[] for _ in groups])
    def device_of(site: str) -> torch.device:
        d = device(site) if callable(device) else device
        return torch.device("cpu") if d is None else torch.device(d)
    programs = {s: SiteProgram(s, per_group, d_model=facts.width(parse_hook(s, facts.n_layers).kind, s) or facts.d_model,
                               device=device_of(s), dtype=dtype, impl=impl, conditions=at_site.get(s, ()),
                               decisions=state if s in at_site or any(p.when is not None for g in per_group for p in g)
                               else None)
                for s, per_group in sites.items()}
    return CompiledSteering(programs, len(groups), tuple(tuple(g) for g in groups), state)


def _check_condition(c: Condition, facts: ModelFacts) -> Condition:
    """``c`` checked against the model: a site it has, with activations as wide as the direction."""
    kind = parse_hook(c.site, facts.n_layers, has_resid_mid=facts.has_resid_mid).kind
    if kind in MATRIX_HOOKS:
        raise InputError(f"expected a condition at a site with one vector per token (a residual, sub-layer or "
                         f"component hook), found the attention matrix {c.site!r}")
    w = facts.width(kind, c.site)
    if int(c.direction.shape[0]) != w:
        raise InputError(f"expected the condition direction at {c.site!r} of shape [{w}], found "
                         f"[{c.direction.shape[0]}]; was it fitted on another model or at another site?")
    return c


def server_mask_of(positions: Tensor, n_prompt: int) -> MaskOf:
    """``mask_of`` for rows of ONE request with absolute ``positions`` (contiguous, as a server feeds
    them) and a prompt of ``n_prompt`` tokens, in the position vocabulary of :mod:`steerkit.positions`.

    Examples:
        >>> mask_of = server_mask_of(torch.arange(0, 5), n_prompt=3)  # a prefill chunk of 5 tokens
        >>> mask_of("last").tolist(), mask_of("generated").tolist()
        ([False, False, True, False, False], [False, False, False, True, True])
        >>> mask_of("prompt").tolist()
        [True, True, True, False, False]
    """
    start, T = int(positions[0]), int(positions.shape[0])
    run = RunState(torch.ones(1, n_prompt, dtype=torch.long, device=positions.device))

    def mask_of(spec):
        m = chunk_mask(spec, run, start, T, 1, positions.device)
        return None if m is None else m[0]
    return mask_of
