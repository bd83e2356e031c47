"""Conditional activation steering (CAST, Lee et al. 2024) as one artifact: :class:`ConditionalSteering`,
rules (:class:`ConditionalRule`) "if these :class:`ConditionVector` values fire, apply this behaviour",
each decided per row on the prompt. A behaviour is a :class:`SteeringVector`, a :class:`DirectionSet`
or a :class:`Region` (:data:`BEHAVIOR_KINDS`); the rules lower to the behaviours' interventions, each
given the rule's :class:`steerkit.When`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from steerkit.interventions import Intervention, ModelFacts, When

from ..apply import check_against
from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance
from .base import _Artifact, _fields, checked_from_payload
from .condition import ConditionVector
from .directions import DirectionSet
from .region import Region
from .vector import SteeringVector

BEHAVIOR_KINDS = ("steering_vector", "direction_set", "region")
RULE_MODES = ("any", "all")
#: the kinds nested in a stored conditional steering: its conditions and its behaviours
NESTED_KINDS: dict[str, type[_Artifact]] = {c.kind: c for c in (ConditionVector, SteeringVector, DirectionSet, Region)}


@dataclasses.dataclass(eq=False)
class ConditionalRule:
    """One rule of a :class:`ConditionalSteering`: apply ``behavior`` (a steering artifact) on rows where
    ``"any"`` / ``"all"`` of ``conditions`` fire (the opposite with ``negate``).

    Examples:
        >>> from steerkit.vectors import ConditionVector, ConditionalRule, SteeringVector
        >>> c1 = ConditionVector(torch.ones(64), layer=1, threshold=0.2)
        >>> c2 = ConditionVector(-torch.ones(64), layer=2, threshold=0.1)
        >>> r = ConditionalRule([c1, c2], SteeringVector.from_direction(torch.ones(64), layer=3), mode="all")
        >>> len(r.conditions), r.mode, r.negate
        (2, 'all', False)
    """

    conditions: list
    behavior: Any
    mode: str = "any"
    negate: bool = False

    def __post_init__(self) -> None:
        cs = [self.conditions] if isinstance(self.conditions, ConditionVector) else self.conditions
        if not isinstance(cs, (list, tuple)) or not cs or not all(isinstance(c, ConditionVector) for c in cs):
            raise VectorsError(f"expected a rule's conditions as one or more ConditionVector values, found "
                               f"{self.conditions!r:.100}")
        self.conditions = list(cs)
        if getattr(self.behavior, "kind", None) not in BEHAVIOR_KINDS:
            raise VectorsError(f"expected a rule's behavior as a steering artifact ({', '.join(BEHAVIOR_KINDS)}), "
                               f"found {type(self.behavior).__name__}")
        if self.mode not in RULE_MODES:
            raise VectorsError(f"expected a rule mode in {RULE_MODES}, found {self.mode!r:.60}")
        if not isinstance(self.negate, bool):
            raise VectorsError(f"expected negate as a bool, found {self.negate!r:.60}")
        widths = {c.d_model for c in self.conditions} | {self.behavior.d_model}
        if len(widths) != 1:
            raise ModelMismatchError(f"expected the conditions and the behavior of a rule to have one d_model, "
                                     f"found {sorted(widths)}")

    def when(self) -> When:
        """The :class:`steerkit.When` this rule lowers to."""
        return When(tuple(c.to_condition() for c in self.conditions), self.mode, self.negate)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConditionalRule):
            return NotImplemented
        return ((self.mode, self.negate) == (other.mode, other.negate) and len(self.conditions) == len(other.conditions)
                and all(a == b for a, b in zip(self.conditions, other.conditions)) and self.behavior == other.behavior)

    __hash__ = None  # type: ignore[assignment]


class ConditionalSteering(_Artifact):
    """Conditional activation steering (CAST, Lee et al. 2024) as one artifact: rules "if these
    conditions fire, apply this behaviour", each decided per row on the prompt and held for the whole
    generation. ``ConditionalSteering(condition=c, behavior=v)`` is one rule;
    ``ConditionalSteering(rules=[ConditionalRule([c1, c2], v1, mode="any"), ConditionalRule([c3], v2)])`` several.
    ``sm.steer(cs)`` / ``sm.generate(..., steering=cs)`` apply it; ``cs * k`` scales every behaviour.

    Examples:
        >>> from steerkit.vectors import ConditionalSteering, ConditionVector, SteeringVector
        >>> cv = ConditionVector(torch.ones(64), layer=1, threshold=-1.0)  # fires on every prompt
        >>> cs = ConditionalSteering(condition=cv, behavior=SteeringVector.from_direction(torch.ones(64), layer=2))
        >>> ivs = cs.to_interventions(tiny.facts)  # the behaviour's interventions, each with the rule's when
        >>> len(ivs), ivs[0].when is not None
        (1, True)
        >>> with tiny.steer(cs) as handle:
        ...     logits = tiny("Hello")
        >>> bool(list(handle.decisions.values())[0].all())  # the row fired: it was steered
        True
    """

    kind: ClassVar[str] = "conditional_steering"

    def __init__(self, condition: ConditionVector | list | None = None, behavior: Any = None, *,
                 rules: list | None = None, mode: str = "any", negate: bool = False,
                 provenance: Provenance | None = None):
        if rules is not None and (condition is not None or behavior is not None):
            raise VectorsError("expected either condition= and behavior= (one rule) or rules=[...], found both")
        if rules is None:
            if condition is None or behavior is None:
                raise VectorsError("expected condition= and behavior= (or rules=[ConditionalRule(...), ...]), found "
                                   f"condition={type(condition).__name__}, behavior={type(behavior).__name__}")
            rules = [ConditionalRule(condition if isinstance(condition, list) else [condition], behavior, mode, negate)]
        if not isinstance(rules, (list, tuple)) or not rules or not all(isinstance(r, ConditionalRule) for r in rules):
            raise VectorsError(f"expected rules as a non-empty list of ConditionalRule values, found {rules!r:.100}")
        self.rules: list[ConditionalRule] = list(rules)
        widths = {r.behavior.d_model for r in self.rules}
        if len(widths) != 1:
            raise ModelMismatchError(f"expected every rule of a conditional steering to have one d_model, found "
                                     f"{sorted(widths)}")
        if provenance is None:
            p = self.rules[0].behavior.provenance
            provenance = Provenance(model_name=p.model_name, model_fingerprint=p.model_fingerprint,
                                    model_arch=p.model_arch, d_model=self.d_model, n_layers=p.n_layers, method="cast")
        if not isinstance(provenance, Provenance):
            raise VectorsError(f"expected a Provenance, found {type(provenance).__name__}")
        if provenance.d_model is not None and provenance.d_model != self.d_model:
            raise ModelMismatchError(f"expected a conditional steering of d_model={provenance.d_model} (from the "
                                     f"provenance), found {self.d_model}")
        self.provenance = provenance.replace(operation="conditional")

    @property
    def d_model(self) -> int:
        return int(self.rules[0].behavior.d_model)

    @property
    def conditions(self) -> list[ConditionVector]:
        """Every condition of every rule, in order (repeats removed)."""
        out: list[ConditionVector] = []
        for r in self.rules:
            out += [c for c in r.conditions if not any(c == o for o in out)]
        return out

    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
        """Every rule's behaviour lowered (``behavior.to_interventions``, with ``scale``) and given the
        rule's ``when``; every nested artifact is checked against ``facts`` first."""
        check_against(self, facts, override=override)
        out: list[Intervention] = []
        for r in self.rules:
            for c in r.conditions:
                check_against(c, facts, override=override)
            when = r.when()
            out += [dataclasses.replace(iv, when=when)
                    for iv in r.behavior.to_interventions(facts, scale=scale, override=override)]
        return out

    def _map_rules(self, behavior_fn, tensor_fn=None) -> "ConditionalSteering":
        rules = [ConditionalRule([c._map_tensors(tensor_fn) if tensor_fn else c for c in r.conditions], behavior_fn(r.behavior),
                      r.mode, r.negate) for r in self.rules]
        return ConditionalSteering(rules=rules, provenance=self.provenance)

    def _map_tensors(self, fn) -> "ConditionalSteering":
        return self._map_rules(lambda b: b._map_tensors(fn), fn)

    def _scaled(self, op) -> "ConditionalSteering":
        def scale(b):
            y = op(b)
            if y is NotImplemented:
                raise VectorsError(f"expected behaviours that scale (steering vectors), found a {b.kind}")
            return y
        return self._map_rules(scale)

    def __mul__(self, k: float) -> "ConditionalSteering":
        if not isinstance(k, (int, float, np.floating, np.integer)) or isinstance(k, bool):
            return NotImplemented
        return self._scaled(lambda b: b.__mul__(k))

    __rmul__ = __mul__

    def __truediv__(self, k: float) -> "ConditionalSteering":
        if not isinstance(k, (int, float, np.floating, np.integer)) or isinstance(k, bool):
            return NotImplemented
        return self._scaled(lambda b: b.__truediv__(k))

    def __neg__(self) -> "ConditionalSteering":
        return self._scaled(lambda b: b.__neg__() if hasattr(b, "__neg__") else NotImplemented)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ConditionalSteering):
            return NotImplemented
        return (len(self.rules) == len(other.rules) and all(a == b for a, b in zip(self.rules, other.rules))
                and self.provenance == other.provenance)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self):
        rules = "; ".join(f"if {r.mode}({', '.join(c.site for c in r.conditions)}){' negated' if r.negate else ''} "
                          f"then {r.behavior.kind}" for r in self.rules)
        return f"ConditionalSteering({rules})"

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors: dict[str, Tensor] = {}
        rules = []
        for i, r in enumerate(self.rules):
            conds = []
            for j, c in enumerate(r.conditions):
                t, m = c.to_payload()
                tensors.update({f"rule.{i}.condition.{j}.{k}": v for k, v in t.items()})
                conds.append(m)
            t, m = r.behavior.to_payload()
            tensors.update({f"rule.{i}.behavior.{k}": v for k, v in t.items()})
            rules.append({"mode": r.mode, "negate": r.negate, "conditions": conds, "behavior": m})
        return tensors, {"kind": self.kind, "fields": {"rules": rules}, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "ConditionalSteering":
        fields = _fields(meta, cls.kind)
        specs = fields.get("rules")
        if not isinstance(specs, list) or not specs or len(specs) > 1000:
            raise ArtifactFormatError(f"expected 'rules' as a non-empty list in a {cls.kind}, found {specs!r:.100}")
        used: set = set()

        def nested(prefix: str, m: Any, kinds: tuple) -> Any:
            if not isinstance(m, dict) or m.get("kind") not in kinds:
                raise ArtifactFormatError(f"expected a nested artifact of kind {kinds} at {prefix!r}, found "
                                          f"{(m.get('kind') if isinstance(m, dict) else m)!r:.100}")
            sub = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            used.update(prefix + k for k in sub)
            return checked_from_payload(NESTED_KINDS[m["kind"]], sub, m)

        rules = []
        for i, spec in enumerate(specs):
            if not isinstance(spec, dict) or set(spec) != {"mode", "negate", "conditions", "behavior"}:
                raise ArtifactFormatError(f"expected rule {i} as {{mode, negate, conditions, behavior}}, found "
                                          f"{spec!r:.100}")
            cs = spec["conditions"]
            if not isinstance(cs, list) or not cs or len(cs) > 1000:
                raise ArtifactFormatError(f"expected rule {i}'s conditions as a non-empty list, found {cs!r:.100}")
            conds = [nested(f"rule.{i}.condition.{j}.", m, (ConditionVector.kind,)) for j, m in enumerate(cs)]
            behavior = nested(f"rule.{i}.behavior.", spec["behavior"], BEHAVIOR_KINDS)
            try:
                rules.append(ConditionalRule(conds, behavior, spec["mode"], spec["negate"]))
            except VectorsError as e:
                raise ArtifactFormatError(f"expected a valid rule {i}, found: {e}") from None
        extra = sorted(set(tensors) - used)
        if extra:
            raise ArtifactFormatError(f"expected only rule.N.condition.M.* and rule.N.behavior.* tensors in a {cls.kind}, "
                                      f"found {extra[:10]}")
        return cls(rules=rules, provenance=Provenance.from_dict(meta.get("provenance", {})))

