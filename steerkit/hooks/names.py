"""Canonical hook names (TransformerLens style) and helpers to build them.

``blocks.{l}.hook_resid_pre``, ``blocks.{l}.hook_resid_mid``,
``blocks.{l}.hook_resid_post``, ``blocks.{l}.hook_attn_out``,
``blocks.{l}.hook_mlp_out``, and three at the final norm, with TransformerLens's
values: ``ln_final.hook_scale`` (the norm's scale, ``[batch, pos, 1]``:
``sqrt(mean(x^2) + eps)`` for RMSNorm, ``sqrt(var(x) + eps)`` for LayerNorm; it
can be recorded, not edited), ``ln_final.hook_normalized`` (the normalised stream
before the norm's weight and bias) and ``ln_final.hook_out`` (the norm's output,
what the unembedding reads). Inside each block, TransformerLens's component hooks
(:data:`COMPONENT_HOOKS`): ``attn.hook_q`` / ``hook_z`` ``[batch, pos, n_heads, d_head]`` (the query
projection before rotary; the input of the output projection), ``attn.hook_k`` / ``hook_v``
``[batch, pos, n_kv_heads, d_head]``, ``attn.hook_attn_scores`` / ``hook_pattern``
``[batch, n_heads, q_pos, k_pos]`` (scaled scores, the dtype's lowest value where a query does not
attend; the probabilities), ``mlp.hook_pre`` / ``hook_post`` ``[batch, pos, d_mlp]`` (the gate's pre-activation; the
down projection's input, i.e. the neuron activations), ``mlp.hook_in`` ``[batch, pos, d_model]`` (the MLP's
input: the pre-MLP norm's output, after its weight, TransformerBridge's name; what a transcoder reads) and
``ln1`` / ``ln2`` ``.hook_scale`` (record only) / ``.hook_normalized`` (the pre-attention / pre-MLP norm,
as at the final norm, before its weight). In a sparse
mixture-of-experts block, :data:`MOE_HOOKS`: ``mlp.hook_router_logits`` ``[batch, pos, n_experts]`` (the
router's logits; an edit re-routes: the top-k experts and their weights are recomputed from the edited
logits by the family's rule), ``mlp.hook_expert_weights`` / ``hook_expert_indices`` ``[batch, pos, top_k]``
(record only; the indices int64) and ``mlp.hook_expert_out`` ``[batch, pos, n_experts, d_model]`` (each
expert's weighted contribution, zero for experts a token does not use; their sum, plus the shared
expert's where the family has one, is what the block adds). While a sparse autoencoder is attached at a
site (``sm.attach_sae``), sub-sites of it carry sae-lens's names (:data:`SAE_SUB_HOOKS`; an autoencoder's
handle lists the four of :data:`SAE_HOOKS`, a transcoder's those of :data:`TRANSCODER_HOOKS`):
``{site}.hook_sae_input`` ``[batch, pos, d_in]`` (the activation as the SAE reads it, in the SAE's dtype),
``{site}.hook_sae_acts_pre`` / ``hook_sae_acts_post`` ``[batch, pos, d_sae]`` (the pre-activations, the
latents), ``{site}.hook_sae_output`` ``[batch, pos, d_out]`` (the decoded output: an autoencoder's
reconstruction, a transcoder's prediction of the site it writes), and for an autoencoder
``{site}.hook_sae_recons`` and ``{site}.hook_sae_error`` ``[batch, pos, d_in]`` (the reconstruction and what it
misses); they are recorded, not edited. Layers are 0-based block indices;
``hook_resid_post`` of block ``l`` is the output of that block, which is also
``hook_resid_pre`` of block ``l + 1``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Literal, Optional, Union, overload

from steerkit.errors import HookNameError, InputError
from steerkit.storage.naming import is_index

BLOCK_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
#: attention internals: per-head ``[batch, pos, heads, d_head]`` and ``[batch, n_heads, q_pos, k_pos]``
ATTN_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_attn_scores", "attn.hook_pattern",
              "attn.hook_z")
HEAD_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z")
KV_HOOKS = ("attn.hook_k", "attn.hook_v")
MATRIX_HOOKS = ("attn.hook_attn_scores", "attn.hook_pattern")
#: MLP neurons ``[batch, pos, d_mlp]``
MLP_HOOKS = ("mlp.hook_pre", "mlp.hook_post")
#: the MLP's input ``[batch, pos, d_model]`` (after the pre-MLP norm's weight; a sparse block's input too)
MLP_IN = "mlp.hook_in"
#: the pre-attention (ln1) and pre-MLP (ln2) norms
NORM_HOOKS = ("ln1.hook_scale", "ln1.hook_normalized", "ln2.hook_scale", "ln2.hook_normalized")
COMPONENT_HOOKS = ATTN_HOOKS + (MLP_IN,) + MLP_HOOKS + NORM_HOOKS
#: a sparse mixture-of-experts block: router logits ``[batch, pos, n_experts]``, the routing
#: ``[batch, pos, top_k]`` and each expert's weighted output ``[batch, pos, n_experts, d_model]``
MOE_HOOKS = ("mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices", "mlp.hook_expert_out")
ROUTER_LOGITS, EXPERT_WEIGHTS, EXPERT_INDICES, EXPERT_OUT = MOE_HOOKS
#: the routing a router chose: recorded, not edited (edit the router logits instead)
ROUTING_HOOKS = (EXPERT_WEIGHTS, EXPERT_INDICES)
#: the final norm's hooks, in the order the norm computes them; each is also its Site's ``kind``
FINAL_HOOKS = ("ln_final.hook_scale", "ln_final.hook_normalized", "ln_final.hook_out")
FINAL_SCALE, FINAL_NORMALIZED, FINAL_OUT = FINAL_HOOKS
#: the final norm's output (what the unembedding reads)
FINAL_HOOK = FINAL_OUT
#: an attached sparse autoencoder's sub-sites, sae-lens's names: ``{site}.hook_sae_input`` ... (see the module
#: docstring); valid only while an SAE is attached at ``site``
SAE_HOOKS = ("hook_sae_input", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error")
SAE_INPUT, SAE_ACTS, SAE_RECONS, SAE_ERROR = SAE_HOOKS
#: the pre-activations and the decoded output (an autoencoder's reconstruction, a transcoder's prediction)
SAE_ACTS_PRE, SAE_OUTPUT = "hook_sae_acts_pre", "hook_sae_output"
#: every sub-site kind an attached SAE or transcoder may have
SAE_SUB_HOOKS = SAE_HOOKS + (SAE_ACTS_PRE, SAE_OUTPUT)
#: an attached transcoder's sub-sites (it predicts another site: no reconstruction or error of its own input)
TRANSCODER_HOOKS = (SAE_INPUT, SAE_ACTS, SAE_ACTS_PRE, SAE_OUTPUT)
#: the kinds of site an SAE can be attached to: rows of features ``[batch, pos, features]`` (attention heads
#: flattened), which an edit may replace
SAE_HOST_HOOKS = BLOCK_HOOKS + HEAD_HOOKS + MLP_HOOKS + (MLP_IN, "ln1.hook_normalized", "ln2.hook_normalized",
                                                        FINAL_NORMALIZED, FINAL_OUT)
#: hook kinds (:attr:`Site.kind`) that can be recorded but not edited: the norms' scales, the routing and an
#: attached SAE's sub-sites
RECORD_ONLY = (FINAL_SCALE, "ln1.hook_scale", "ln2.hook_scale") + ROUTING_HOOKS + SAE_SUB_HOOKS
_BLOCK_KINDS = BLOCK_HOOKS + COMPONENT_HOOKS + MOE_HOOKS
_RE = re.compile(r"blocks\.(-?[0-9]+)\.((?:attn\.|mlp\.|ln1\.|ln2\.)?hook_[a-z_]+)\Z", re.ASCII)
_SAE_RE = re.compile(r"(.+)\.(hook_sae_[a-z_]+)\Z", re.ASCII)


def record_only_error(name: str) -> InputError:
    """The error for an edit at a hook of :data:`RECORD_ONLY`.

    Examples:
        >>> print(record_only_error("blocks.3.ln1.hook_scale"))  # doctest: +ELLIPSIS
        expected edits at hooks that can be edited, found one at 'blocks.3.ln1.hook_scale', which can only be recorded (a norm's scale); edit 'blocks.3.ln1.hook_normalized' instead
    """
    where = name.rsplit(".", 1)[0]
    if name.endswith(SAE_SUB_HOOKS):
        return InputError(f"expected edits at hooks that can be edited, found one at {name!r}, an attached SAE's "
                          f"sub-site, which can only be recorded; edit its latents with "
                          f"Intervention.sae_latent({where!r}, sae, latents, value=...), or splice the SAE in with "
                          "sm.attach_sae(sae, splice=True)")
    if name.endswith(ROUTING_HOOKS):
        return InputError(f"expected edits at hooks that can be edited, found one at {name!r}, which can only be "
                          f"recorded (the routing the router chose); edit '{where}.hook_router_logits' instead, "
                          "which re-routes every token")
    return InputError(f"expected edits at hooks that can be edited, found one at {name!r}, which can only be "
                      f"recorded (a norm's scale); edit '{where}.hook_normalized' instead")


@dataclass(frozen=True)
class Site:
    """A parsed hook name: ``kind`` is one of BLOCK_HOOKS, COMPONENT_HOOKS or MOE_HOOKS (``layer`` set) or one of
    FINAL_HOOKS (the full name, ``layer`` None).

    Examples:
        >>> s = parse("blocks.12.attn.hook_z", n_layers=30)
        >>> s.kind, s.layer, s.block_index
        ('attn.hook_z', 12, 12)
        >>> parse("ln_final.hook_out", n_layers=30)
        Site(name='ln_final.hook_out', kind='ln_final.hook_out', layer=None)
    """

    name: str
    kind: str
    layer: int | None

    @property
    def parent(self) -> str | None:
        """The site an attached SAE's sub-site belongs to (``blocks.3.hook_resid_post`` for
        ``blocks.3.hook_resid_post.hook_sae_acts_post``); ``None`` for every other site."""
        return self.name[: -len(self.kind) - 1] if self.kind in SAE_SUB_HOOKS else None

    @property
    def block_index(self) -> int:
        """``layer`` of a block hook; :class:`HookNameError` for an ``ln_final`` hook, which has no block."""
        if self.layer is None:
            raise HookNameError(f"expected a block hook name such as 'blocks.0.hook_resid_post', which names a "
                                f"layer, found {self.name!r}, which names none; use a block hook here")
        return self.layer


def parse(name: str, n_layers: int, *, has_resid_mid: bool = True, sae_sites: Collection[str] = ()) -> Site:
    """Parse and check a hook name against a model with ``n_layers`` blocks. ``sae_sites``: the sites an SAE
    is attached to, whose :data:`SAE_SUB_HOOKS` sub-sites are then valid names.

    Examples:
        >>> parse("blocks.3.hook_resid_post.hook_sae_acts_post", 4, sae_sites={"blocks.3.hook_resid_post"})
        Site(name='blocks.3.hook_resid_post.hook_sae_acts_post', kind='hook_sae_acts_post', layer=3)
        >>> parse("blocks.3.hook_resid_post.hook_sae_acts_post", 4)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.HookNameError: expected an SAE attached at 'blocks.3.hook_resid_post' for ...
        >>> parse("blocks.3.hook_resid_post", n_layers=4)
        Site(name='blocks.3.hook_resid_post', kind='hook_resid_post', layer=3)
        >>> parse("blocks.3.hook_resid_mid", n_layers=4, has_resid_mid=False)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.HookNameError: 'blocks.3.hook_resid_mid': this model runs attention and MLP in parallel, ...
    """
    if not isinstance(name, str):
        raise HookNameError(f"expected a hook name string such as 'blocks.0.hook_resid_post', "
                            f"found {type(name).__name__} {name!r}")
    if name in FINAL_HOOKS:
        return Site(name, name, None)
    sub = _SAE_RE.match(name) if ".hook_sae_" in name else None
    if sub:
        return _parse_sae(name, sub.group(1), sub.group(2), n_layers, has_resid_mid, sae_sites)
    m = _RE.match(name)
    if not m or m.group(2) not in _BLOCK_KINDS:
        raise HookNameError(
            f"expected a hook name of the form 'blocks.{{layer}}.{{{'|'.join(_BLOCK_KINDS)}}}' or "
            f"one of {', '.join(repr(n) for n in FINAL_HOOKS)} (the layer in ASCII digits without a leading "
            f"zero), found {name!r:.120}; list them with sm.hook_names()")
    g = m.group(1)
    if not g.startswith("-") and not is_index(g):
        raise HookNameError(f"expected the layer in {name!r} as ASCII digits without a leading zero (e.g. "
                            f"'blocks.1.hook_resid_post'), found {g!r}")
    layer = int(g)
    if not 0 <= layer < n_layers:
        raise HookNameError(f"expected a layer in 0..{n_layers - 1} for this model ({n_layers} blocks), "
                            f"found {layer} in {name!r}")
    if m.group(2) == "hook_resid_mid" and not has_resid_mid:
        raise HookNameError(f"{name!r}: this model runs attention and MLP in parallel, so there is no "
                            "resid_mid; use hook_resid_pre/hook_resid_post, hook_attn_out or hook_mlp_out")
    return Site(name, m.group(2), layer)


def _parse_sae(name: str, host: str, kind: str, n_layers: int, has_resid_mid: bool, sae_sites: Collection[str]) -> Site:
    """An attached SAE's sub-site ``{host}.{kind}``, checked: a known kind, a valid host, an SAE there."""
    if kind not in SAE_SUB_HOOKS:
        raise HookNameError(f"expected an SAE sub-site {' or '.join(repr(f'{host}.{k}') for k in SAE_SUB_HOOKS)}, "
                            f"found {name!r:.120}")
    try:
        site = parse(host, n_layers, has_resid_mid=has_resid_mid)
    except HookNameError as e:
        raise HookNameError(f"expected '{{site}}.{kind}' with a hook name as the site, found {name!r:.120}: {e}") from None
    if site.kind not in SAE_HOST_HOOKS:
        raise HookNameError(f"expected an SAE sub-site of a site that holds rows of features ({', '.join(SAE_HOST_HOOKS)}), "
                            f"found {name!r}; no SAE can be attached at {host!r}")
    if host not in sae_sites:
        raise HookNameError(f"expected an SAE attached at {host!r} for {name!r}, found "
                            f"{'none' if not sae_sites else 'SAEs at ' + ', '.join(sorted(sae_sites))}; an SAE's "
                            "sub-sites exist only while one is attached there: sm.attach_sae(sae) (its own site) "
                            "or sm.attach_sae(sae, site=...)")
    return Site(name, kind, site.layer)


def sae_names(site: str) -> list[str]:
    """The :data:`SAE_HOOKS` sub-sites of ``site`` (sae-lens's names).

    Examples:
        >>> sae_names("blocks.3.hook_resid_post")[1]
        'blocks.3.hook_resid_post.hook_sae_acts_post'
    """
    return [f"{site}.{k}" for k in SAE_HOOKS]


def all_names(n_layers: int, *, has_resid_mid: bool = True,
              components: Iterable[str] | Callable[[int], Iterable[str]] = ()) -> list[str]:
    """Every hook name of a model: the residual and sub-layer hooks of each block, then the final
    norm's; ``components`` adds those COMPONENT_HOOKS / MOE_HOOKS kinds to each block, or, as a function
    of the layer, the kinds that block has (a model mixing dense and sparse blocks).

    Examples:
        >>> names = all_names(2, components=["attn.hook_pattern"])
        >>> len(names), names[:3], names[-1]
        (15, ['blocks.0.hook_resid_pre', 'blocks.0.hook_resid_mid', 'blocks.0.hook_resid_post'], 'ln_final.hook_out')
        >>> len(all_names(2, has_resid_mid=False))
        11
    """
    kinds = [k for k in BLOCK_HOOKS if has_resid_mid or k != "hook_resid_mid"]

    def comp(l: int) -> list[str]:
        have = set(components(l) if callable(components) else components)
        return [k for k in COMPONENT_HOOKS + MOE_HOOKS if k in have]
    fixed = None if callable(components) else comp(0)
    return [f"blocks.{l}.{k}" for l in range(n_layers) for k in kinds + (fixed if fixed is not None else comp(l))] \
        + list(FINAL_HOOKS)


def resid_post(layers: int | Iterable[int]) -> list[str]:
    """The ``hook_resid_post`` names (each block's output) of a layer or a range of layers.

    Examples:
        >>> resid_post(range(10, 13))
        ['blocks.10.hook_resid_post', 'blocks.11.hook_resid_post', 'blocks.12.hook_resid_post']
        >>> resid_post(5)
        ['blocks.5.hook_resid_post']
    """
    return layer_names(layers, "hook_resid_post")


def resid_pre(layers: int | Iterable[int]) -> list[str]:
    """The ``hook_resid_pre`` names (each block's input) of a layer or a range of layers.

    Examples:
        >>> resid_pre([0, 29])
        ['blocks.0.hook_resid_pre', 'blocks.29.hook_resid_pre']
    """
    return layer_names(layers, "hook_resid_pre")


def layer_names(layers: int | Iterable[int], kind: str = "hook_resid_post") -> list[str]:
    """Hook names of one kind over a layer or a range of layers.

    Examples:
        >>> layer_names(range(2), "attn.hook_pattern")
        ['blocks.0.attn.hook_pattern', 'blocks.1.attn.hook_pattern']
        >>> layer_names(3, "mlp.hook_post")
        ['blocks.3.mlp.hook_post']
    """
    if kind not in _BLOCK_KINDS:
        raise HookNameError(f"expected a hook kind in {_BLOCK_KINDS}, found {kind!r}")
    if isinstance(layers, int):
        layers = [layers]
    return [f"blocks.{int(l)}.{kind}" for l in layers]


#: the widest layer range a list may name: no model has more blocks, and a wider range (``0-99999999999``)
#: would be built as a list before any model could refuse it
MAX_LAYER_RANGE = 4096
LAYERS_HELP = "like 6,10-14 or all"


def _layer_index(text: str, spec: str, what: str) -> int:
    if not is_index(text):
        raise InputError(f"expected {what} as comma-separated 0-based layer indices and ranges ({LAYERS_HELP}), "
                         f"found {spec!r:.80} ({text!r:.20} is not a layer index)")
    return int(text)


def _layers_of_text(spec: str, what: str, n_layers: Optional[int]) -> list[int]:
    out: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part.startswith("-"):
            raise InputError(f"expected {what} as 0-based layer indices (>= 0), found {part!r:.40}")
        if "-" in part:
            a, _, b = part.partition("-")
            lo, hi = _layer_index(a.strip(), spec, what), _layer_index(b.strip(), spec, what)
            if hi < lo:
                raise InputError(f"expected a layer range A-B with A <= B in {what}, found {part!r:.40}; write "
                                 f"{hi}-{lo}")
            if n_layers is not None and hi >= n_layers:  # checked before the range is built
                raise _beyond(what, n_layers, f"the range {part!r:.40}")
            if hi - lo >= MAX_LAYER_RANGE:
                raise InputError(f"expected ranges of at most {MAX_LAYER_RANGE} layers in {what}, found {part!r:.40}; "
                                 "name the model's layers, or all")
            out += range(lo, hi + 1)
        else:
            out.append(_layer_index(part, spec, what))
    return out


@overload
def parse_layers(spec: Union[str, int, Iterable[int]], n_layers: int, *, what: str = ...) -> list[int]: ...
@overload
def parse_layers(spec: Union[str, int, Iterable[int]], n_layers: None = ..., *,
                 what: str = ...) -> Union[list[int], Literal["all"]]: ...
def parse_layers(spec: Union[str, int, Iterable[int]], n_layers: Optional[int] = None, *,
                 what: str = "layers") -> Union[list[int], Literal["all"]]:
    """A layer selection as sorted, distinct 0-based block indices: the one reader of the layer lists users
    type (the command line's ``--layers`` and ``--hooks KIND:...``, the app's layer boxes).

    ``spec``: text of comma-separated indices and ranges ``A-B`` (both ends included: ``"6,10-14"``),
    ``"all"``, one int, or a list of ints. With ``n_layers`` every layer must be below it and ``"all"`` is
    ``0 .. n_layers - 1``; without it (no model loaded yet) ``"all"`` comes back as ``"all"``. ``what`` names
    the input in the errors (:class:`~steerkit.errors.InputError`: what was expected, what was found).

    Examples:
        >>> parse_layers("6,10-14")
        [6, 10, 11, 12, 13, 14]
        >>> parse_layers("all", 4), parse_layers("all"), parse_layers([3, 1, 3], 4)
        ([0, 1, 2, 3], 'all', [1, 3])
        >>> parse_layers("2-40", 30, what="--layers")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected --layers below 30 (the model's 30 layers are 0-29), found the range '2-40'; choose among them
    """
    if isinstance(spec, str) and spec.strip().lower() == "all":
        return "all" if n_layers is None else list(range(n_layers))
    if isinstance(spec, str):
        layers = _layers_of_text(spec, what, n_layers)
    elif isinstance(spec, int) and not isinstance(spec, bool):
        layers = [spec]
    elif isinstance(spec, (list, tuple, range)):
        if len(spec) > MAX_LAYER_RANGE:
            raise InputError(f"expected at most {MAX_LAYER_RANGE} layers in {what}, found a list of {len(spec)}")
        if not all(isinstance(l, int) and not isinstance(l, bool) for l in spec):
            raise InputError(f"expected {what} as a list of layer indices (ints), found {list(spec)!r:.80}")
        layers = list(spec)
    else:
        raise InputError(f"expected {what} as text ({LAYERS_HELP}), an int or a list of ints, found "
                         f"{type(spec).__name__}")
    if not layers:
        raise InputError(f"expected at least one layer in {what} ({LAYERS_HELP}), found {spec!r:.80}")
    if min(layers) < 0:
        raise InputError(f"expected {what} as 0-based layer indices (>= 0), found {min(layers)}")
    bad = sorted({l for l in layers if n_layers is not None and l >= n_layers})
    if n_layers is not None and bad:
        found = str(bad[0]) if len(bad) == 1 else f"{bad[0]}-{bad[-1]}" if len(bad) == bad[-1] - bad[0] + 1 else \
            ", ".join(map(str, bad[:8]))
        raise _beyond(what, n_layers, found)
    return sorted(set(layers))


def _beyond(what: str, n_layers: int, found: str) -> InputError:
    return InputError(f"expected {what} below {n_layers} (the model's {n_layers} layers are 0-{n_layers - 1}), "
                      f"found {found}; choose among them")
