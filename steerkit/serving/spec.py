"""What a request asks for: the steering spec, its parsing, its cache salt, and its resolution into
interventions (:class:`steerkit.Intervention`), the one value every way of steering lowers to.

A request carries one entry in ``SamplingParams.extra_args`` (the OpenAI-compatible server fills
``extra_args`` from the body's ``vllm_xargs``, whose values must be flat, so the spec travels as
a JSON string)::

    extra_args = {"steerkit": '{"artifacts": [{"ref": "happy@1", "scale": 1.0}]}'}

The spec (a JSON object; a ``dict`` works too offline)::

    {"artifacts": [{"ref": "name@version", "scale": 1.0}, ...],        # from the steerkit store
     "ops": [{"op": "add", "layers": [15], "vector": [...], "scale": 4.0,   # or "layers": "6,10-14"
              "positions": "all" | "prompt" | "generated" | "last" | [prompt token indices]},
             {"op": "ablate", "layers": [10], "vectors": [[...], ...]},  # orthonormalised here
             {"op": "clamp", "layers": [10], "vector": [...], "value": 2.0}],
     "override": false}                                                 # fingerprint mismatch -> warning

Positions are those of :mod:`steerkit.hooks.positions`: ``"all"``, ``"prompt"``, ``"generated"``,
``"last"`` (the last prompt token), or ints: indices among the prompt tokens, negative ones counting
from the end of the prompt (``-1`` is the last prompt token). An index outside a request's prompt
selects nothing for that request: the spec is validated before the prompt is tokenized, and one
request's steps are shared with others, so a server cannot refuse it mid-batch (steerkit's own
``forward`` / ``generate`` raise for an index no prompt of the batch has). Inline ops act at
``blocks.{l}.hook_resid_post``.

:func:`parse_spec` validates the shape of a spec (no model or store needed: it runs in the server's
front end for every request). :func:`resolve` turns a parsed spec into interventions: stored
artifacts lower themselves (``artifact.to_interventions(facts, ...)``, exactly what
``SteerModel.steer`` compiles), inline ops through the :class:`~steerkit.Intervention`
constructors; sites are made canonical for the server (``blocks.{l}.hook_resid_pre`` with ``l > 0``
is ``blocks.{l-1}.hook_resid_post``, for the edits and for the CAST conditions of a
:class:`~steerkit.vectors.ConditionalSteering` alike) and the whole steering is compiled, once, by
:func:`steerkit.interventions.compile_steering` (the compile every path runs), so a spec that cannot run fails in the
front end, not inside the server's forward pass; the :class:`Resolved` keeps that compiled steering. :func:`salt` gives the
prefix-cache salt that keeps KV computed under one steering away from requests with another.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import warnings
from typing import Any, Optional, Sequence, Union

import torch

from steerkit.deprecation import moved
from steerkit.errors import HookNameError, InputError, SteerkitError
from steerkit.hooks.names import parse as parse_hook, parse_layers
from steerkit.interventions import CompiledSteering, Intervention, ModelFacts, Steerable, When, compile_steering
from steerkit.kernels import orthonormalize
from steerkit.hooks.positions import POSITION_NAMES, AnyOf, TokenMatch, plain_positions
from steerkit.storage import jsontext

KEY = "steerkit"
#: set by the plugin's front end on a request whose steering is conditional (CAST): the engine core then
#: gives it a prefix-cache salt of its own, since its decision reads every token of its prompt
CAST_KEY = "steerkit_cast"
MAX_ARTIFACTS = 32
MAX_OPS = 64
MAX_FLOATS = 1 << 17  # inline numbers per request (a 4096-wide model: 32 vectors)
MAX_SPEC_CHARS = 4 << 20
MAX_LAYERS = 1024  # distinct block indices per inline op
MAX_POSITIONS = 1 << 16  # prompt-token indices per request, each op's list counted once per layer it acts at
INLINE_OPS = ("add", "ablate", "clamp")


def __getattr__(name: str) -> Any:
    if name == "NAMED_POSITIONS":  # the one list of position names is the core's
        return moved(__name__, name, "steerkit.hooks.positions", "POSITION_NAMES")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class SpecError(InputError):
    """A steering spec that cannot be applied; the message says what was expected and found.

    Examples:
        >>> try:
        ...     parse_spec("not json")
        ... except ValueError as e:
        ...     print(type(e).__name__, isinstance(e, steerkit.InputError))
        SpecError True
    """


@dataclasses.dataclass(frozen=True)
class ArtifactRef:
    """A stored artifact a request steers with (``name@version``) and its scale.

    Examples:
        >>> parse_spec({"artifacts": [{"ref": "happy@1", "scale": 0.5}]}).artifacts
        (ArtifactRef(ref='happy@1', scale=0.5),)
    """

    ref: str
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class InlineOp:
    """An operation written into the request (``add``, ``ablate`` or ``clamp`` at
    ``blocks.{l}.hook_resid_post`` of each of ``layers``), as :func:`parse_spec` validated it.

    Examples:
        >>> spec = parse_spec({"ops": [{"op": "add", "layers": [1, 2], "vector": [1.0] * 64, "scale": 4.0,
        ...                             "positions": "generated"}]})
        >>> op = spec.ops[0]
        >>> op.op, op.layers, len(op.vectors[0]), op.scale, op.positions
        ('add', (1, 2), 64, 4.0, 'generated')
    """

    op: str
    layers: tuple[int, ...]
    vectors: tuple[tuple[float, ...], ...]
    scale: float = 1.0
    value: float = 0.0
    positions: Union[str, tuple[int, ...]] = "all"


@dataclasses.dataclass(frozen=True)
class Spec:
    """A request's parsed steering: stored artifacts, inline operations, and whether a fingerprint
    mismatch is only a note (``override``).

    Examples:
        >>> spec = parse_spec({"artifacts": [{"ref": "happy@1"}]})
        >>> spec.empty, Spec().empty
        (False, True)
        >>> spec.canonical()
        '{"artifacts":[{"ref":"happy@1","scale":1.0}],"ops":[],"override":false}'
    """

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
    p = plain_positions(x, f"{what} positions", error=SpecError, max_indices=MAX_POSITIONS)
    return p if isinstance(p, str) else tuple(p)


def _layer_text(text: str, what: str) -> list[int]:
    if len(text) > 4 * MAX_LAYERS:
        raise SpecError(f"expected {what} of at most {4 * MAX_LAYERS} characters, found {len(text)}")
    try:
        layers = parse_layers(text, what=what)
    except InputError as e:
        raise SpecError(str(e)) from None
    if layers == "all":
        raise SpecError(f"expected {what} to name block indices (like \"6,10-14\"), found \"all\"; a request is "
                        "checked before the model is known, so name its layers")
    return layers


def parse_spec(value: Any) -> Spec:
    """Validate a request's ``extra_args["steerkit"]`` (a JSON string or a dict) into a :class:`Spec`.

    Examples:
        >>> parse_spec('{"artifacts": [{"ref": "happy@1", "scale": 2}]}')
        Spec(artifacts=(ArtifactRef(ref='happy@1', scale=2.0),), ops=(), override=False)
    """
    if isinstance(value, Spec):
        return value
    if isinstance(value, (str, bytes)):
        if len(value) > MAX_SPEC_CHARS:
            raise SpecError(f"expected a steering spec under {MAX_SPEC_CHARS} characters, found {len(value)}")
        try:
            value = jsontext.loads(value)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply to decode
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
    ops, n_floats, n_positions = [], 0, 0
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
        if isinstance(layers, str):
            layers = _layer_text(layers, f"{what}.layers")
        if not isinstance(layers, list) or not layers:
            raise SpecError(f"expected {what}.layers as a non-empty list of block indices (or text like "
                            f"\"6,10-14\"), found {layers!r:.80}")
        if len(layers) > MAX_LAYERS:
            raise SpecError(f"expected {what}.layers as at most {MAX_LAYERS} distinct block indices, found {len(layers)}")
        layers = tuple(_int(l, f"{what}.layers") for l in layers)
        if len(set(layers)) != len(layers):
            raise SpecError(f"expected {what}.layers without repeats, found {len(layers) - len(set(layers))} repeated; "
                            "name each block once (a larger scale steers harder)")
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
        positions = _positions(o.get("positions"), what)
        n_positions += len(positions) * len(layers) if isinstance(positions, tuple) else 0
        if n_positions > MAX_POSITIONS:
            raise SpecError(f"expected at most {MAX_POSITIONS} prompt-token indices per request (each op's positions "
                            f"times its layers), found more by {what}; name fewer, or use \"prompt\" or \"all\"")
        ops.append(InlineOp(op, layers, vt, scale=_num(o.get("scale", 1.0), f"{what}.scale"),
                            value=_num(o.get("value", 0.0), f"{what}.value"), positions=positions))
    override = value.get("override", False)
    if not isinstance(override, (bool, int)):
        raise SpecError(f"expected 'override' as true or false, found {override!r}")
    return Spec(tuple(refs), tuple(ops), bool(override))


def salt(spec: Union[Spec, Any], user_salt: Optional[str] = None) -> str:
    """The prefix-cache salt of a steered request: equal specs share cached KV, others never do.

    Examples:
        >>> a = salt('{"artifacts": [{"ref": "happy@1"}]}')
        >>> a.startswith("steerkit-"), a == salt({"artifacts": [{"ref": "happy@1", "scale": 1.0}]})
        (True, True)
        >>> a == salt({"artifacts": [{"ref": "sad@1"}]})
        False
        >>> salt({"artifacts": [{"ref": "happy@1"}]}, user_salt="alice") == "alice-" + a
        True
    """
    s = parse_spec(spec)
    h = hashlib.sha256(s.canonical().encode()).hexdigest()[:32]
    return f"{user_salt}-steerkit-{h}" if user_salt else f"steerkit-{h}"


# ------------------------------------------------------------------------------ request helpers
def request_args(*refs: Union[str, dict], scale: Union[float, Sequence[float]] = 1.0,
                 ops: Optional[list] = None, override: bool = False) -> dict:
    """``SamplingParams.extra_args`` (or the body's ``vllm_xargs``) for steering with stored artifacts.

    ``request_args("happy@1", scale=1.0)``; several: ``request_args("a@1", "b@2", scale=[1.0, 0.5])``
    or ``request_args({"a@1": 1.0, "b@2": 0.5})``; inline operations through ``ops=[...]`` (see the
    module docstring). Validates the spec here, so a typo fails in the client.

    Examples:
        >>> request_args("happy@1", "calm@2", scale=[1.0, 0.5])
        {'steerkit': '{"artifacts":[{"ref":"happy@1","scale":1.0},{"ref":"calm@2","scale":0.5}]}'}
    """
    arts: list[dict] = []
    for r in refs:
        if isinstance(r, dict):
            arts += [{"ref": k, "scale": float(v)} for k, v in r.items()]
        else:
            arts.append({"ref": r})
    plain = [a for a in arts if "scale" not in a]
    scales: list = list(scale) if isinstance(scale, (list, tuple)) else [scale] * len(plain)
    if len(scales) != len(plain):
        raise SpecError(f"expected one scale per artifact ({len(plain)}), found {len(scales)}")
    for a, s in zip(plain, scales):
        a["scale"] = float(s)
    spec: dict[str, Any] = {"artifacts": arts}
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
    ``vllm_xargs`` and a ``cache_salt`` (the server also salts steered requests itself).

    Examples:
        >>> body = request_body("my-model", "happy@1", prompt="Hello", max_tokens=16)
        >>> sorted(body)
        ['cache_salt', 'max_tokens', 'model', 'prompt', 'vllm_xargs']
        >>> body["vllm_xargs"] == request_args("happy@1"), body["cache_salt"] == salt(body["vllm_xargs"]["steerkit"])
        (True, True)
    """
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
#: the sites the vLLM plugin hooks (``blocks.0.hook_resid_pre`` is the embedding output)
SERVER_SITES = ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
#: the sites it reads and never edits (the MLP's input, which a transcoder's clamp encodes), beside those
SERVER_READ_SITES = ("mlp.hook_in",)
MAX_PER_SITE = 30


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A spec as interventions at canonical server sites, ready for the planner (see ``plan.py``).
    ``key``: the spec's canonical text (equal specs, equal steering).

    Examples:
        >>> spec = parse_spec({"ops": [{"op": "add", "layers": [0, 3], "vector": [0.1] * 64}]})
        >>> r = resolve(spec, store=store, facts=tiny.facts)
        >>> r.sites, len(r.interventions), r.key == spec.canonical()
        (('blocks.0.hook_resid_post', 'blocks.3.hook_resid_post'), 2, True)
    """

    key: str
    interventions: tuple  # tuple[Intervention, ...]
    notes: tuple = ()
    #: the steering compiled once, where :func:`resolve` was asked to (None: no intervention)
    compiled: Optional[CompiledSteering] = dataclasses.field(default=None, compare=False, repr=False)

    @functools.cached_property
    def sites(self) -> tuple:
        """The sites the interventions act at, in first-use order."""
        return tuple(dict.fromkeys(iv.site for iv in self.interventions))

    @functools.cached_property
    def conditions(self) -> tuple:
        """The CAST conditions the interventions' rules (``when``) read, each once, in first-use order."""
        return tuple(dict.fromkeys(c for iv in self.interventions if iv.when is not None for c in iv.when.conditions))

    @functools.cached_property
    def condition_sites(self) -> tuple:
        """The sites those conditions are evaluated at."""
        return tuple(dict.fromkeys(c.site for c in self.conditions))


def _facts(facts: Union[ModelFacts, dict]) -> ModelFacts:
    if isinstance(facts, ModelFacts):
        return facts
    if isinstance(facts, dict):
        try:
            return ModelFacts.from_dict(facts)
        except InputError as e:
            raise SpecError(f"the served model's facts: {e}") from None
    raise SpecError(f"expected the served model's facts as steerkit.ModelFacts, found {type(facts).__name__}")


def _server_positions(spec, where: str) -> None:
    """Refuse position specs a server cannot evaluate (it sees no token ids and no padded batch)."""
    if isinstance(spec, AnyOf):
        for s in spec.specs:
            _server_positions(s, where)
    elif isinstance(spec, TokenMatch):
        raise SpecError(f"expected positions a server can evaluate at {where} ({POSITION_NAMES}, prompt token "
                        f"indices, ranges, slices), found a token pattern {spec!r}; steer with it in steerkit itself")
    elif isinstance(spec, torch.Tensor):
        raise SpecError(f"expected positions a server can evaluate at {where} ({POSITION_NAMES}, prompt token "
                        "indices, ranges, slices), found a bool mask over a padded batch")


def canonical_site(iv: Intervention, facts: ModelFacts) -> Intervention:
    """``iv`` at the site the server hooks for its tensor: ``blocks.{l}.hook_resid_pre`` with ``l > 0``
    is ``blocks.{l-1}.hook_resid_post``; a site the plugin cannot hook raises :class:`SpecError`. The site a
    transcoder's clamp reads (its ``latent.source``) may also be one the plugin only reads
    (:data:`SERVER_READ_SITES`: ``blocks.{l}.mlp.hook_in``).

    Examples:
        >>> canonical_site(Intervention.add("blocks.2.hook_resid_pre", torch.ones(64)), tiny.facts).site
        'blocks.1.hook_resid_post'
        >>> canonical_site(Intervention.add("blocks.2.attn.hook_z", torch.ones(64)), tiny.facts)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.serving.spec.SpecError: expected a site the vLLM plugin can edit ...
    """
    site = _server_site(iv.site, facts, "edit")
    _server_positions(iv.positions, repr(iv.site))
    latent = iv.latent
    if latent is not None and latent.source is not None:  # a transcoder's clamp: the site it encodes, read only
        source = _server_site(latent.source, facts, "read a transcoder's input at", SERVER_SITES + SERVER_READ_SITES)
        if source != latent.source:
            latent = dataclasses.replace(latent, source=source)
            iv = dataclasses.replace(iv, latent=latent)
    when = iv.when
    if when is not None:  # CAST: each condition read where the server hooks its tensor too
        conds = []
        for c in when.conditions:
            cs = _server_site(c.site, facts, "read a condition at")
            conds.append(c if cs == c.site else dataclasses.replace(c, site=cs))
        when = When(tuple(conds), when.mode, when.negate)
    return iv if (site, when) == (iv.site, iv.when) else dataclasses.replace(iv, site=site, when=when)


def _server_site(site: str, facts: ModelFacts, what: str, kinds: tuple = SERVER_SITES) -> str:
    """The canonical server site of ``site`` among ``kinds`` (see :func:`canonical_site`)."""
    try:
        s = parse_hook(site, facts.n_layers, has_resid_mid=facts.has_resid_mid)
    except HookNameError as e:
        raise SpecError(str(e)) from None
    if s.kind not in kinds:
        raise SpecError(f"expected a site the vLLM plugin can {what} (blocks.{{l}}.{{{'|'.join(kinds)}}}), "
                        f"found {site!r}")
    if s.kind == "hook_resid_pre" and s.layer is not None and s.layer > 0:
        return f"blocks.{s.layer - 1}.hook_resid_post"
    return site


def artifact_interventions(art: Any, ref: str, scale: float, facts: ModelFacts, *, override: bool,
                           check: bool) -> tuple[list[Intervention], list[str]]:
    """What a stored artifact does (``art.to_interventions``, checked against ``facts``), with the
    warnings of its check as notes. ``check=False`` applies it whatever its fingerprint says.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> v = SteeringVector.from_direction(torch.randn(64), layer=1, model=tiny, scale=2.0)
        >>> ivs, notes = artifact_interventions(v, "v@1", 1.0, tiny.facts, override=False, check=True)
        >>> [(iv.site, iv.op) for iv in ivs], notes
        ([('blocks.1.hook_resid_post', 'add')], [])
    """
    if not isinstance(art, Steerable):
        raise SpecError(f"expected artifact {ref!r} to be a kind that steers (a vector, direction set, region, "
                        "conditional steering or latent clamp), "
                        f"found {type(art).__name__}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ivs = art.to_interventions(facts, scale=scale, override=override if check else True)
        except SteerkitError as e:  # ModelMismatchError, VectorsError, InputError
            raise SpecError(f"artifact {ref!r} does not fit the served model: {e}") from None
    notes = [str(w.message) for w in caught] if check else []
    return list(ivs), notes


def inline_interventions(op: InlineOp, facts: ModelFacts) -> list[Intervention]:
    """An inline op as interventions at ``blocks.{l}.hook_resid_post`` for each of its layers.

    Examples:
        >>> op = InlineOp("ablate", (1,), ((1.0,) + (0.0,) * 63, (1.0, 1.0) + (0.0,) * 62))
        >>> [(iv.site, iv.op, tuple(iv.tensor.shape)) for iv in inline_interventions(op, tiny.facts)]
        [('blocks.1.hook_resid_post', 'ablate', (2, 64))]
    """
    d_model, n_layers = facts.d_model, facts.n_layers
    V = torch.tensor(op.vectors, dtype=torch.float32)
    if V.shape[1] != d_model:
        raise SpecError(f"expected inline vectors of d_model={d_model}, found length {V.shape[1]}")
    bad = [l for l in op.layers if not 0 <= l < n_layers]
    if bad:
        raise SpecError(f"expected layers in 0..{n_layers - 1}, found {bad}")
    pos = list(op.positions) if isinstance(op.positions, tuple) else op.positions
    sites = [f"blocks.{l}.hook_resid_post" for l in op.layers]
    try:
        if op.op == "add":
            return [Intervention.add(s, V[0], op.scale, positions=pos) for s in sites]
        if op.op == "clamp":
            if float(V[0].norm()) == 0.0:
                raise SpecError("expected a non-zero clamp direction, found the zero vector")
            return [Intervention.clamp(s, V[0], op.value, positions=pos) for s in sites]
        if V.shape[0] > 16:
            raise SpecError(f"expected at most 16 ablation directions, found {V.shape[0]}")
        B = orthonormalize(V)
        if B.shape[0] == 0:
            raise SpecError("expected non-zero ablation directions, found only zero vectors")
        return [Intervention.ablate(s, B, positions=pos) for s in sites]
    except SpecError:
        raise
    except InputError as e:
        raise SpecError(f"inline {op.op} at layers {list(op.layers)} is not valid: {e}") from None


def compile_request(interventions: Sequence[Intervention], facts: ModelFacts, *, device="cpu",
                    dtype: torch.dtype = torch.float32) -> CompiledSteering:
    """A request's interventions compiled once (:func:`steerkit.interventions.compile_steering`), on ``device`` in
    ``dtype``; whatever the compile refuses is a :class:`SpecError` naming where.

    Examples:
        >>> compile_request([Intervention.add("blocks.1.hook_resid_post", torch.ones(64))], tiny.facts).n_groups
        1
        >>> compile_request([Intervention.add("blocks.1.hook_resid_post", torch.ones(32))], tiny.facts)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.serving.spec.SpecError: the steering is not valid: expected the add vector of shape [64] ...
    """
    per_site: dict[str, int] = {}
    for iv in interventions:
        per_site[iv.site] = per_site.get(iv.site, 0) + 1
    for site, n in per_site.items():
        if n > MAX_PER_SITE:
            raise SpecError(f"expected at most {MAX_PER_SITE} operations at one site, found {n} at {site!r}")
    try:
        return compile_steering(list(interventions), facts, device=device, dtype=dtype)
    except (InputError, HookNameError) as e:  # shapes, orthonormality, gates, regions, positions
        raise SpecError(f"the steering is not valid: {e}") from None


def resolve(spec: Spec, *, store: Any, facts: Union[ModelFacts, dict], check: bool = True, device="cpu",
            dtype: torch.dtype = torch.float32) -> Resolved:
    """Load the spec's artifacts from ``store``, turn everything into interventions at canonical
    server sites (see the module docstring) and compile them once (:func:`compile_request`) on ``device`` in
    ``dtype``: the :class:`Resolved` carries the compiled steering.

    ``facts``: the served model's :class:`~steerkit.ModelFacts` (or a ``{"name", "d_model",
    "n_layers", "fingerprint"}`` dict); with ``check`` every artifact is checked against them
    (``override`` in the spec turns a fingerprint or depth mismatch into a note); ``check=False``
    (the worker: the front end has checked) applies them as they are.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> ref = store.save("happy", SteeringVector.from_direction(torch.randn(64), layer=2, model=tiny, scale=4.0))
        >>> r = resolve(parse_spec(request_args(ref)["steerkit"]), store=store, facts=tiny.facts)
        >>> ref, r.sites, [iv.op for iv in r.interventions], r.notes
        ('happy@1', ('blocks.2.hook_resid_post',), ['add'], ())
    """
    facts = _facts(facts)
    ivs: list[Intervention] = []
    notes: list[str] = []
    for a in spec.artifacts:
        try:
            art = store.load(a.ref)
        except Exception as e:  # noqa: BLE001 - unknown name, unsafe name, damaged file
            # the answer goes to the client: the store's place on the server's disk is not named
            root = str(getattr(store, "root", "") or "")
            why = str(e).replace(root, "the server's store") if root else str(e)
            raise SpecError(f"expected an artifact {a.ref!r} in the server's store, could not load it: {why}") from None
        got, n = artifact_interventions(art, a.ref, a.scale, facts, override=spec.override, check=check)
        ivs += got
        notes += n
    for op in spec.ops:
        ivs += inline_interventions(op, facts)
    ivs = [canonical_site(iv, facts) for iv in ivs]
    compiled = compile_request(ivs, facts, device=device, dtype=dtype) if ivs else None
    return Resolved(spec.canonical(), tuple(ivs), tuple(notes), compiled)
