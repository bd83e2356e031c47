"""What a request asks for: the steering spec, its parsing, its cache salt, and its resolution into
per-site kernel configurations.

A request carries one entry in ``SamplingParams.extra_args`` (the OpenAI-compatible server fills
``extra_args`` from the body's ``vllm_xargs``, whose values must be flat, so the spec travels as
a JSON string)::

    extra_args = {"steerkit": '{"artifacts": [{"ref": "happy@1", "scale": 1.0}]}'}

The spec (a JSON object; a ``dict`` works too offline)::

    {"artifacts": [{"ref": "name@version", "scale": 1.0}, ...],        # from the steerkit store
     "ops": [{"op": "add", "layers": [15], "vector": [...], "scale": 4.0,
              "positions": "all" | "prompt" | "generated" | "last" | [absolute positions]},
             {"op": "ablate", "layers": [10], "vectors": [[...], ...]},  # orthonormalised here
             {"op": "clamp", "layers": [10], "vector": [...], "value": 2.0}],
     "override": false}                                                 # fingerprint mismatch -> warning

:func:`parse_spec` validates the shape of a spec (no model or store needed: it runs in the server's
front end for every request). :func:`resolve` turns a parsed spec into ``{site: [SiteOp]}`` with
sites ``("resid_post", l)``, ``("attn_out", l)``, ``("mlp_out", l)`` and ``("embed", 0)``,
using the same translation of artifacts as ``SteerModel.steer`` (``vectors.apply.edits_for``), so
a request steers a row exactly like steerkit's own generation steers it. :func:`salt` gives the
prefix-cache salt that keeps KV computed under one steering away from requests with another.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Optional, Sequence, Union

import torch

KEY = "steerkit"
MAX_ARTIFACTS = 32
MAX_OPS = 64
MAX_FLOATS = 1 << 17  # inline numbers per request (a 4096-wide model: 32 vectors)
MAX_SPEC_CHARS = 4 << 20
POSITION_RULES = ("all", "prompt", "generated", "last")
INLINE_OPS = ("add", "ablate", "clamp")


class SpecError(ValueError):
    """A steering spec that cannot be applied; the message says what was expected and found."""


@dataclasses.dataclass(frozen=True)
class ArtifactRef:
    ref: str
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class InlineOp:
    op: str
    layers: tuple[int, ...]
    vectors: tuple[tuple[float, ...], ...]
    scale: float = 1.0
    value: float = 0.0
    positions: Union[str, tuple[int, ...]] = "all"


@dataclasses.dataclass(frozen=True)
class Spec:
    artifacts: tuple[ArtifactRef, ...] = ()
    ops: tuple[InlineOp, ...] = ()
    override: bool = False

    @property
    def empty(self) -> bool:
        return not self.artifacts and not self.ops

    def canonical(self) -> str:
        """A stable text of the spec: equal specs, equal text (the cache and salt key)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------------------ parsing
def _num(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise SpecError(f"expected a number for {what}, found {type(x).__name__} {str(x)[:40]!r}")
    x = float(x)
    if not math.isfinite(x):
        raise SpecError(f"expected a finite number for {what}, found {x}")
    return x


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, int) and not (isinstance(x, float) and x.is_integer()):
        raise SpecError(f"expected an integer for {what}, found {str(x)[:40]!r}")
    return int(x)


def _positions(x: Any, what: str) -> Union[str, tuple[int, ...]]:
    if x is None:
        return "all"
    if isinstance(x, str):
        if x not in POSITION_RULES:
            raise SpecError(f"expected positions in {POSITION_RULES} or a list of token positions for {what}, "
                            f"found {x!r}")
        return x
    if isinstance(x, (list, tuple)) and len(x) <= 65536:
        ps = tuple(_int(p, f"{what} positions") for p in x)
        if any(p < 0 for p in ps):
            raise SpecError(f"expected absolute token positions >= 0 for {what}, found {min(ps)} (negative "
                            "positions count from the end, which a server does not know while generating)")
        return ps
    raise SpecError(f"expected positions as one of {POSITION_RULES} or a list of ints for {what}, found "
                    f"{type(x).__name__}")


def parse_spec(value: Any) -> Spec:
    """Validate a request's ``extra_args["steerkit"]`` (a JSON string or a dict) into a :class:`Spec`."""
    if isinstance(value, Spec):
        return value
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_SPEC_CHARS:
            raise SpecError(f"expected a steering spec under {MAX_SPEC_CHARS} characters, found {len(value)}")
        try:
            value = json.loads(value)
        except ValueError as e:
            raise SpecError(f"expected the steering spec as a JSON object, could not parse it ({e})") from None
    if not isinstance(value, dict):
        raise SpecError(f"expected the steering spec as a JSON object with 'artifacts' and/or 'ops', found "
                        f"{type(value).__name__}")
    unknown = set(value) - {"artifacts", "ops", "override", "v"}
    if unknown:
        raise SpecError(f"expected only the keys artifacts, ops, override in the steering spec, found {sorted(unknown)}")
    arts = value.get("artifacts") or []
    if not isinstance(arts, list) or len(arts) > MAX_ARTIFACTS:
        raise SpecError(f"expected 'artifacts' as a list of at most {MAX_ARTIFACTS} {{ref, scale}} objects, found "
                        f"{type(arts).__name__}{' of ' + str(len(arts)) if isinstance(arts, list) else ''}")
    refs = []
    for i, a in enumerate(arts):
        if isinstance(a, str):
            a = {"ref": a}
        if not isinstance(a, dict) or not isinstance(a.get("ref"), str) or not a["ref"] or len(a["ref"]) > 200:
            raise SpecError(f"expected artifacts[{i}] as {{\"ref\": \"name@version\", \"scale\": number}}, found {str(a)[:80]}")
        extra = set(a) - {"ref", "scale"}
        if extra:
            raise SpecError(f"expected only ref and scale in artifacts[{i}], found {sorted(extra)}")
        refs.append(ArtifactRef(a["ref"], _num(a.get("scale", 1.0), f"artifacts[{i}].scale")))
    ops_in = value.get("ops") or []
    if not isinstance(ops_in, list) or len(ops_in) > MAX_OPS:
        raise SpecError(f"expected 'ops' as a list of at most {MAX_OPS} objects")
    ops, n_floats = [], 0
    for i, o in enumerate(ops_in):
        what = f"ops[{i}]"
        if not isinstance(o, dict):
            raise SpecError(f"expected {what} as an object, found {type(o).__name__}")
        extra = set(o) - {"op", "layers", "layer", "vector", "vectors", "scale", "value", "positions"}
        if extra:
            raise SpecError(f"expected only op, layers, vector(s), scale, value, positions in {what}, found {sorted(extra)}")
        op = o.get("op")
        if op not in INLINE_OPS:
            raise SpecError(f"expected {what}.op in {INLINE_OPS}, found {op!r} (regions and schedules come from "
                            "stored artifacts)")
        layers = o.get("layers", [o["layer"]] if "layer" in o else None)
        if not isinstance(layers, list) or not layers:
            raise SpecError(f"expected {what}.layers as a non-empty list of block indices, found {layers!r}")
        layers = tuple(_int(l, f"{what}.layers") for l in layers)
        vecs = o.get("vectors", [o["vector"]] if "vector" in o else None)
        if not isinstance(vecs, list) or not vecs or not all(isinstance(v, list) and v for v in vecs):
            raise SpecError(f"expected {what}.vector as a list of numbers (or .vectors as a list of them)")
        if op != "ablate" and len(vecs) != 1:
            raise SpecError(f"expected one vector for {what} ({op}), found {len(vecs)}")
        n_floats += sum(len(v) for v in vecs)
        if n_floats > MAX_FLOATS:
            raise SpecError(f"expected at most {MAX_FLOATS} inline numbers per request, found more; save large "
                            "vectors to the store and name them in 'artifacts'")
        if len({len(v) for v in vecs}) != 1:
            raise SpecError(f"expected {what}'s vectors of one length, found lengths {sorted({len(v) for v in vecs})}")
        vt = tuple(tuple(_num(x, f"{what}.vector") for x in v) for v in vecs)
        ops.append(InlineOp(op, layers, vt, scale=_num(o.get("scale", 1.0), f"{what}.scale"),
                            value=_num(o.get("value", 0.0), f"{what}.value"),
                            positions=_positions(o.get("positions"), what)))
    override = value.get("override", False)
    if not isinstance(override, (bool, int)):
        raise SpecError(f"expected 'override' as true or false, found {override!r}")
    return Spec(tuple(refs), tuple(ops), bool(override))


def salt(spec: Union[Spec, Any], user_salt: Optional[str] = None) -> str:
    """The prefix-cache salt of a steered request: equal specs share cached KV, others never do."""
    s = parse_spec(spec)
    h = hashlib.sha256(s.canonical().encode()).hexdigest()[:32]
    return f"{user_salt}-steerkit-{h}" if user_salt else f"steerkit-{h}"


# ------------------------------------------------------------------------------ request helpers
def request_args(*refs: Union[str, dict], scale: Union[float, Sequence[float]] = 1.0,
                 ops: Optional[list] = None, override: bool = False) -> dict:
    """``SamplingParams.extra_args`` (or the body's ``vllm_xargs``) for steering with stored artifacts.

    ``request_args("happy@1", scale=1.0)``; several: ``request_args("a@1", "b@2", scale=[1.0, 0.5])``
    or ``request_args({"a@1": 1.0, "b@2": 0.5})``; inline operations through ``ops=[...]`` (see the
    module docstring). Validates the spec here, so a typo fails in the client."""
    arts: list[dict] = []
    for r in refs:
        if isinstance(r, dict):
            arts += [{"ref": k, "scale": float(v)} for k, v in r.items()]
        else:
            arts.append({"ref": r})
    plain = [a for a in arts if "scale" not in a]
    scales = list(scale) if isinstance(scale, (list, tuple)) else [scale] * len(plain)
    if len(scales) != len(plain):
        raise SpecError(f"expected one scale per artifact ({len(plain)}), found {len(scales)}")
    for a, s in zip(plain, scales):
        a["scale"] = float(s)
    spec = {"artifacts": arts}
    if ops:
        spec["ops"] = ops
    if override:
        spec["override"] = True
    parse_spec(spec)
    return {KEY: json.dumps(spec, separators=(",", ":"))}


def request_body(model: str, *refs: Union[str, dict], prompt: Optional[str] = None,
                 messages: Optional[list] = None, scale: Union[float, Sequence[float]] = 1.0,
                 ops: Optional[list] = None, override: bool = False, **params: Any) -> dict:
    """A request body for vLLM's OpenAI-compatible server (``/v1/completions`` with ``prompt``,
    ``/v1/chat/completions`` with ``messages``) that steers with the named artifacts. Sets
    ``vllm_xargs`` and a ``cache_salt`` (the server also salts steered requests itself)."""
    if (prompt is None) == (messages is None):
        raise SpecError("expected exactly one of prompt= (completions) or messages= (chat completions)")
    body: dict[str, Any] = {"model": model, **params}
    if prompt is not None:
        body["prompt"] = prompt
    else:
        body["messages"] = messages
    if refs or ops:
        xargs = request_args(*refs, scale=scale, ops=ops, override=override)
        body["vllm_xargs"] = {**body.get("vllm_xargs", {}), **xargs}
        body["cache_salt"] = salt(xargs[KEY])
    return body


# ------------------------------------------------------------------------------ resolution
@dataclasses.dataclass
class SiteOp:
    """One operation at one site: a kernel configuration and the positions it applies to."""

    config: Any  # steerkit.kernels.SteerConfig
    positions: Union[str, tuple[int, ...]] = "all"
    #: ablate/clamp rows, for combining several operations at one site
    kind: str = "add"


@dataclasses.dataclass
class Resolved:
    """A spec turned into operations per site, ready for the planner (see ``plan.py``)."""

    key: str
    sites: dict  # {(kind, layer): [SiteOp]}
    notes: list = dataclasses.field(default_factory=list)
    _combined: dict = dataclasses.field(default_factory=dict, repr=False)

    def combined(self, site, bits: int):
        """One kernel configuration for the operations of ``site`` whose bit is set in ``bits``."""
        hit = self._combined.get((site, bits))
        if hit is None:
            ops = [op for j, op in enumerate(self.sites[site]) if bits >> j & 1]
            hit = self._combined[(site, bits)] = combine([op.config for op in ops], where=f"{site[0]} {site[1]}")
        return hit


def combine(configs: list, where: str = ""):
    """One ``SteerConfig`` doing all of ``configs`` in the kernel's order (ablate/clamp, add, region).

    Injections are summed; ablation and clamp directions are stacked (they must be orthonormal
    together, as the kernel projects on all of them at once); at most one region."""
    from steerkit.kernels import SteerConfig
    if len(configs) == 1:
        return configs[0]
    bases, strengths, targets, adds, add_scales, regions = [], [], [], [], [], []
    for c in configs:
        if c.basis is not None:
            k = c.basis.shape[0]
            bases.append(c.basis.float())
            strengths.append(torch.as_tensor(c.strength, dtype=torch.float32).expand(k))
            targets.append(torch.zeros(k) if c.target is None else torch.as_tensor(c.target, dtype=torch.float32).expand(k))
        if c.add is not None:
            a = c.add.float() if c.add.dim() == 2 else c.add.float()[None]
            adds.append(a)
            add_scales.append(torch.as_tensor(c.add_scale, dtype=torch.float32).expand(a.shape[0]))
        if c.region is not None:
            regions.append(c.region)
    if len(regions) > 1:
        raise SpecError(f"expected at most one region per site, found {len(regions)} at {where}")
    kw: dict[str, Any] = {}
    if bases:
        B = torch.cat(bases)
        gram = B @ B.T
        if (gram - torch.eye(B.shape[0])).abs().max() > 1e-3:
            raise SpecError(f"expected the ablate/clamp directions applied together at {where} to be orthonormal, "
                            "found overlapping ones; apply them at different layers or orthogonalise them first")
        kw.update(basis=B, strength=torch.cat(strengths), target=torch.cat(targets))
    if adds:
        kw.update(add=torch.cat(adds), add_scale=torch.cat(add_scales))
    if regions:
        kw["region"] = regions[0]
    return SteerConfig(**kw)


def _site_of(hook: str, n_layers: int) -> tuple[str, int]:
    from steerkit.hooknames import parse
    try:
        s = parse(hook, n_layers)
    except Exception as e:  # noqa: BLE001 - HookNameError
        raise SpecError(str(e)) from None
    if s.kind == "hook_resid_post":
        return ("resid_post", s.layer)
    if s.kind == "hook_resid_pre":
        return ("embed", 0) if s.layer == 0 else ("resid_post", s.layer - 1)
    if s.kind in ("hook_attn_out", "hook_mlp_out"):
        return (s.kind[5:], s.layer)
    raise SpecError(f"expected a site the vLLM plugin can edit (hook_resid_pre/post, hook_attn_out, hook_mlp_out), "
                    f"found {hook!r}")


def artifact_ops(art: Any, scale: float, n_layers: int) -> list[tuple[tuple[str, int], SiteOp]]:
    """The operations of a stored artifact, as ``SteerModel.steer(art, scale)`` applies them."""
    from steerkit.kernels import SteerConfig
    from steerkit.vectors import Region
    from steerkit.vectors.apply import edits_for
    if isinstance(art, Region):
        to_kernel = getattr(art, "to_kernel", None)
        if to_kernel is None:
            raise SpecError("expected a Region artifact with to_kernel(); update steerkit")
        return [(_site_of(f"blocks.{art.layer}.{art.hook_site}", n_layers),
                 SiteOp(SteerConfig(region=to_kernel(strength=float(scale))), "all", "region"))]
    try:
        edits = edits_for(art, n_layers, scale)
    except Exception as e:  # noqa: BLE001 - VectorsError: not appliable
        raise SpecError(str(e)) from None
    out = []
    for op, per_hook, kw in edits:
        pos = kw.get("positions", "all")
        pos = _positions(list(pos) if isinstance(pos, (list, tuple)) else pos, "the artifact")
        for hook, t in per_hook.items():
            t = t.detach().float().cpu()
            if op == "add":
                cfg, kind = SteerConfig.injection(t, float(kw.get("scale", 1.0))), "add"
            elif op == "clamp":
                cfg, kind = SteerConfig.clamp(t, float(kw.get("value", 0.0))), "clamp"
            elif op == "ablate":
                cfg, kind = SteerConfig.ablation(t if t.dim() == 2 else t[None]), "ablate"
            else:  # pragma: no cover - edits_for only makes these three
                raise SpecError(f"expected add, clamp or ablate from the artifact, found {op}")
            out.append((_site_of(hook, n_layers), SiteOp(cfg, pos, kind)))
    return out


def inline_ops(op: InlineOp, d_model: int, n_layers: int) -> list[tuple[tuple[str, int], SiteOp]]:
    from steerkit.kernels import SteerConfig
    from steerkit.kernels.config import orthonormalize
    V = torch.tensor(op.vectors, dtype=torch.float32)
    if V.shape[1] != d_model:
        raise SpecError(f"expected inline vectors of d_model={d_model}, found length {V.shape[1]}")
    bad = [l for l in op.layers if not 0 <= l < n_layers]
    if bad:
        raise SpecError(f"expected layers in 0..{n_layers - 1}, found {bad}")
    if op.op == "add":
        cfg = SteerConfig.injection(V[0], op.scale)
    elif op.op == "clamp":
        n = V[0].norm()
        if n == 0:
            raise SpecError("expected a non-zero clamp direction, found the zero vector")
        cfg = SteerConfig.clamp(V[0] / n, op.value)
    else:
        if V.shape[0] > 16:
            raise SpecError(f"expected at most 16 ablation directions, found {V.shape[0]}")
        cfg = SteerConfig.ablation(orthonormalize(V))
    return [(("resid_post", l), SiteOp(cfg, op.positions, op.op)) for l in op.layers]


def resolve(spec: Spec, *, store: Any, facts: dict, check: bool = True) -> Resolved:
    """Load the spec's artifacts from ``store`` and turn everything into operations per site.

    ``facts``: the served model's ``{"name", "d_model", "n_layers", "fingerprint"}``; with
    ``check`` every artifact is checked against them (``override`` in the spec turns a fingerprint
    or depth mismatch into a note)."""
    import warnings

    from steerkit.vectors.apply import check_against
    d_model, n_layers = int(facts["d_model"]), int(facts["n_layers"])
    sites: dict = {}
    notes: list = []
    for a in spec.artifacts:
        try:
            art = store.load(a.ref)
        except Exception as e:  # noqa: BLE001 - unknown name, unsafe name, damaged file
            raise SpecError(f"expected an artifact {a.ref!r} in the store {getattr(store, 'root', store)}, could not "
                            f"load it: {e}") from None
        if check:
            try:
                with warnings.catch_warnings(record=True):
                    warnings.simplefilter("always")
                    notes += check_against(art, facts, override=spec.override)
            except Exception as e:  # noqa: BLE001 - ModelMismatchError
                raise SpecError(f"artifact {a.ref!r} does not fit the served model: {e}") from None
        for site, op in artifact_ops(art, a.scale, n_layers):
            sites.setdefault(site, []).append(op)
    for op in spec.ops:
        for site, sop in inline_ops(op, d_model, n_layers):
            sites.setdefault(site, []).append(sop)
    from steerkit.kernels import SteerTable
    for site, ops in sites.items():  # fail now, in the front end, not inside the server's forward pass
        if len(ops) > 30:
            raise SpecError(f"expected at most 30 operations at one site, found {len(ops)} at {site}")
        try:
            SteerTable.from_configs([combine([o.config for o in ops], where=f"{site[0]} {site[1]}")], d_model=d_model)
        except SpecError:
            raise
        except ValueError as e:  # SteerConfigError: shapes, orthonormality, region sizes
            raise SpecError(f"steering at {site[0]} {site[1]} is not valid: {e}") from None
    return Resolved(spec.canonical(), sites, notes)
