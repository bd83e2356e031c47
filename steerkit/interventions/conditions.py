"""Conditional steering (CAST, Lee et al. 2024): :class:`Condition`, :class:`When` and
:class:`Decisions`, the one accumulator of prompt activations into each row's decision.

A condition is decided from the activations of a row's prompt at its site, aggregated over the prompt
tokens. A local run (``sm.generate``) sees the whole prompt in one pass; a server sees it in one or
several prefill chunks. Both feed :meth:`Decisions.observe` chunk by chunk (one chunk for a local run),
keyed by an owner (a run's id, a served request's id), and both read the decisions back through it.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Hashable, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError

from steerkit.interventions.checks import _number, _vector

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
    return _finish(*_chunk(x, mask, aggregate), aggregate)


def _chunk(x: Float[Tensor, "batch pos width"], mask: Optional[Tensor], aggregate: str
           ) -> tuple[Float[Tensor, "batch width"], Tensor]:
    """One chunk's part of :func:`aggregate_rows`: per row the sum of the selected positions
    (``"mean"``) or the last selected one (``"last"``; position 0 where none is), and how many
    positions were selected (``[batch]``)."""
    x = x.float()
    B, T = int(x.shape[0]), int(x.shape[1])
    m = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask.to(x.device).bool()
    w = m.to(x.dtype)
    n = w.sum(1)
    if aggregate == "mean":
        return (x * w.unsqueeze(-1)).sum(1), n
    idx = torch.where(m, torch.arange(T, device=x.device).expand(B, T), torch.full_like(m, -1, dtype=torch.long))
    last = idx.amax(1).clamp_min(0)
    return x[torch.arange(B, device=x.device), last], n


def _finish(value: Tensor, n: Tensor, aggregate: str) -> Tensor:
    """The aggregate from :func:`_chunk`'s running value and count."""
    return value / n.clamp_min(1.0).unsqueeze(-1) if aggregate == "mean" else value


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
    """THE accumulator of CAST decisions: each condition's decision for each owner's rows, taken from
    the owner's prompt activations chunk by chunk (:meth:`observe`) and held once decided.

    An owner is a local run (``sm.generate``: its run id, its batch rows, the whole prompt in one
    chunk, :meth:`evaluate`) or a served request (its id, one row, its prompt in one or several prefill
    chunks: :class:`steerkit.serving.plan.RequestConditions`). Per (owner, condition) it keeps the
    running aggregate of the prompt positions seen (the sum and count for ``"mean"``, the latest row
    for ``"last"``) and decides when the chunk holding the prompt's last token arrives. A compiled
    steering's programs share one (:attr:`CompiledSteering.state`).

    Examples:
        >>> c = Condition("blocks.1.hook_resid_post", torch.ones(64), 0.0, measure="cosine")
        >>> d = Decisions([c])
        >>> x = torch.stack([torch.ones(3, 64), -torch.ones(3, 64)])  # [batch 2, pos 3, d_model]
        >>> d.evaluate(c, x, None, run_id=0)
        >>> d.fired()[c].tolist(), [round(s, 3) for s in d.similarities()[c].tolist()]
        ([True, False], [1.0, -1.0])
        >>> d.observe("req", c, x[:1, :2], None, first=True, last=False)  # a prompt in two chunks
        >>> d.selected("req", When(c)) is None  # undecided
        True
        >>> d.observe("req", c, x[:1, 2:], None, first=False, last=True)
        >>> d.selected("req", When(c)).tolist()
        [True]
    """

    def __init__(self, conditions: Sequence[Condition] = ()):
        self.conditions = tuple(conditions)
        self._open: dict = {}  # (owner, condition key) -> (running sum or last row [B, W], positions seen [B])
        self._done: dict = {}  # (owner, condition key) -> (similarity [B], fired [B])
        self._latest: dict = {}  # condition key -> the owner of its latest decision

    def observe(self, owner: Hashable, c: Condition, x: Float[Tensor, "batch pos width"], mask: Optional[Tensor], *,
                first: bool = True, last: bool = True) -> None:
        """Take one chunk of ``owner``'s prompt activations at ``c``'s site (``mask``: ``[batch, pos]``
        bool, the prompt positions of the chunk; ``None``: all). ``first``: the chunk starts the prompt
        (a fresh aggregate); ``last``: it holds the prompt's last token (decide now). A decided
        (owner, condition) is held: later chunks change nothing."""
        key = (owner, c.key)
        if key in self._done:
            return
        value, n = _chunk(x, mask, c.aggregate)
        prev = None if first else self._open.get(key)
        if prev is not None:
            value = prev[0] + value if c.aggregate == "mean" else torch.where((n > 0).unsqueeze(-1), value, prev[0])
            n = prev[1] + n
        if not last:
            self._open[key] = (value, n)
            return
        self._open.pop(key, None)
        sim = condition_similarity(_finish(value, n, c.aggregate), c.direction, c.measure).detach()
        self._done[key] = (sim, c.fires(sim))
        self._latest[c.key] = owner

    def evaluate(self, c: Condition, x: Tensor, mask: Optional[Tensor], run_id) -> None:
        """A local run's decision for ``c``: its whole prompt in one chunk (``x`` ``[batch, pos, width]``,
        ``mask`` its prompt tokens); earlier runs' decisions are dropped."""
        self.keep([run_id])
        self._done.pop((run_id, c.key), None)
        self.observe(run_id, c, x, mask)

    def selected(self, owner: Hashable, when: When) -> Optional[Tensor]:
        """``[batch]`` bool: ``owner``'s rows ``when`` selects; ``None`` while one of its conditions is
        undecided for ``owner``."""
        fired = []
        for c in when.conditions:
            d = self._done.get((owner, c.key))
            if d is None:
                return None
            fired.append(d[1])
        return when.rule(fired)

    def rows(self, when: When, run_id, B: int, device) -> Tensor:
        """``[B]`` bool: the rows ``when`` selects on run ``run_id`` (none where a condition is undecided)."""
        sel = self.selected(run_id, when)
        if sel is None or int(sel.shape[0]) != B:
            return torch.zeros(B, dtype=torch.bool, device=device)
        return sel.to(device)

    def similarity(self, owner: Hashable, c: Condition) -> Optional[Tensor]:
        """``[batch]``: ``owner``'s similarity for ``c`` (``None`` while undecided)."""
        d = self._done.get((owner, c.key))
        return None if d is None else d[0]

    def _latest_of(self, i: int) -> dict:
        out = {}
        for c in self.conditions:
            d = self._done.get((self._latest.get(c.key), c.key))
            if d is not None:
                out[c] = d[i]
        return out

    def fired(self) -> dict:
        """``{condition: bool tensor [batch]}`` of the latest decision of each condition."""
        return self._latest_of(1)

    def similarities(self) -> dict:
        """``{condition: float tensor [batch]}``, as :meth:`fired`."""
        return self._latest_of(0)

    def owners(self) -> set:
        """The owners with a decision taken or under way."""
        return {o for o, _ in self._open} | {o for o, _ in self._done}

    def keep(self, live) -> None:
        """Drop the entries of owners not in ``live`` (finished requests, earlier runs)."""
        live = set(live)
        for d in (self._open, self._done):
            for k in [k for k in d if k[0] not in live]:
                del d[k]
