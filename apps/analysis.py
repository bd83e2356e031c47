"""Result objects and the computations behind the explorer's pages, over a :class:`steerkit.SteerModel`.

The app's callbacks call these functions, and so can a notebook. Each result is a dataclass that
the figure functions in :mod:`steerkit.apps.figures` turn into Plotly figures.

* :func:`divergence_profile` -> :class:`DivergenceProfile`: per layer, the relative divergence
  ``||h_l(a) - h_l(b)|| / ||h_l(a)||`` and the cosine of ``h_l(a)``, ``h_l(b)`` at the last prompt
  token, for every pair, plus the logit-lens top tokens of the mean difference at each layer.
* :func:`logit_lens`: the top and bottom tokens of a residual-space vector.
* :func:`steer_setting` -> :class:`SteerSetting`: the Steer page's settings as
  :class:`steerkit.Intervention` s (a stored artifact through its ``to_interventions``).
* :func:`steer_compare` -> :class:`SteerResult`: baseline and steered generations of one prompt in
  one batch with per-row steering (streamable), each token with its projection on the direction.
* :func:`layer_diagnostics` -> :class:`LayerDiagnostics`: residual norm and sink attention per layer.
* :func:`patching_run` -> :class:`PatchingRun`: activation and / or attribution patching of a clean
  into a corrupted prompt (:func:`steerkit.probes.activation_patching`), a layer x position or
  layer x head grid; :func:`head_detail` -> :class:`HeadDetail`: one head patched per position.
* :func:`attention_patterns` -> :class:`AttentionPatterns`: every head's ``attn.hook_pattern`` at a layer.
* :func:`tune_run` -> :class:`TuneRun`: :func:`steerkit.probes.tune.tune` over a layers x scales grid,
  one layer per call (progress, cancel and the time limit between layers), merged into one tune result.

Long computations take ``progress(done, total)`` and ``should_stop()`` callables; when
``should_stop()`` turns true they raise :class:`Cancelled` between batches (or tokens).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooknames import resid_post
from steerkit.interventions import Intervention
from steerkit.model import Tokens
from steerkit.positions import AnyOf
from steerkit.probes import PatchingResult, activation_patching, attribution_patching, logit_diff_metric
from steerkit.probes.tune import Rule, pareto_front, recommend
from steerkit.probes.tune import tune as probes_tune

from .data import (
    IOI_ANSWER, IOI_WRONG, MAX_ANSWER_CHARS, MAX_ATTN_CELLS, MAX_ATTN_TOKENS, MAX_DIAG_PROMPTS, MAX_PATCH_PROMPT_CHARS,
    MAX_PATCH_SITES, MAX_PATCH_TOKENS, PATCH_HOOKS, PATCH_METHODS, check_choice, check_int, check_pairs, check_text,
    parse_layers,
)

if TYPE_CHECKING:
    from steerkit.model import SteerModel


class Cancelled(Exception):
    """Raised inside a computation when its caller asked it to stop (a signal, not an error)."""


def _tick(progress, should_stop, done, total):
    if should_stop is not None and should_stop():
        raise Cancelled("cancelled")
    if progress is not None:
        progress(done, total)


# ============================================================================ model helpers
def _unembed_fn(sm: SteerModel):
    norm = sm.adapter.final_norm_module(sm.hf_model)
    unembed = sm.adapter.unembed_module(sm.hf_model)

    @torch.inference_mode()
    def f(v):
        x = torch.as_tensor(v, dtype=sm.dtype, device=sm.device).reshape(1, 1, -1)
        return unembed(norm(x)).reshape(-1).float().cpu()
    return f


def logit_lens(sm: SteerModel, v: Float[Tensor, " d_model"] | np.ndarray,
               k: int = 10) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Top and bottom ``k`` tokens of ``unembed(final_norm(v))`` for a residual-space vector ``v``."""
    logits = _unembed_fn(sm)(v)
    return _top_bottom(sm, logits, k)


def _top_bottom(sm: SteerModel, logits, k):
    k = min(k, logits.shape[0])
    top = torch.topk(logits, k)
    bot = torch.topk(-logits, k)

    def dec(i):
        return sm.tokenizer.decode([int(i)])
    return ([(dec(i), float(s)) for s, i in zip(top.values, top.indices)],
            [(dec(i), float(-s)) for s, i in zip(bot.values, bot.indices)])


# ============================================================================ divergence profile
@dataclass
class DivergenceProfile:
    """Per-layer divergence between paired prompts, at the last prompt token.

    ``rel[i, l] = ||h_l(a_i) - h_l(b_i)|| / ||h_l(a_i)||`` and ``cos[i, l] = cos(h_l(a_i), h_l(b_i))``
    (``h_l`` = ``blocks.{l}.hook_resid_post``). ``mean_diff[l]`` is the mean of ``h_l(a) - h_l(b)``
    over pairs; ``lens_top[l]`` / ``lens_bottom[l]`` its logit-lens top and bottom tokens.
    """

    layers: list[int]
    rel: np.ndarray
    cos: np.ndarray
    prompts_a: list[str] = field(default_factory=list)
    prompts_b: list[str] = field(default_factory=list)
    mean_diff: Optional[np.ndarray] = None
    lens_top: list = field(default_factory=list)
    lens_bottom: list = field(default_factory=list)
    model_name: str = ""
    contrast: str = "custom"
    seconds: float = 0.0

    def __post_init__(self):
        self.rel = np.asarray(self.rel, dtype=np.float64)
        self.cos = np.asarray(self.cos, dtype=np.float64)
        if self.rel.ndim != 2 or self.rel.shape != self.cos.shape or self.rel.shape[1] != len(self.layers):
            raise InputError(f"expected rel and cos of shape [n_pairs, {len(self.layers)}], found "
                             f"{self.rel.shape} and {self.cos.shape}")

    @property
    def n_pairs(self) -> int:
        return int(self.rel.shape[0])

    @property
    def rel_mean(self) -> np.ndarray:
        return self.rel.mean(0)

    @property
    def rel_std(self) -> np.ndarray:
        return self.rel.std(0)

    @property
    def cos_mean(self) -> np.ndarray:
        return self.cos.mean(0)

    @property
    def cos_std(self) -> np.ndarray:
        return self.cos.std(0)

    @property
    def peak_index(self) -> int:
        return int(np.argmax(self.rel_mean))

    @property
    def peak_layer(self) -> int:
        """The layer where the mean relative divergence is largest."""
        return int(self.layers[self.peak_index])

    def at_layer(self, layer: int) -> dict:
        """Per-pair values at one layer: ``{"rel": [...], "cos": [...], "a": [...], "b": [...]}``."""
        if layer not in self.layers:
            raise InputError(f"expected a layer in {self.layers[0]}..{self.layers[-1]}, found {layer}")
        j = self.layers.index(layer)
        return {"layer": layer, "rel": self.rel[:, j].tolist(), "cos": self.cos[:, j].tolist(),
                "a": list(self.prompts_a), "b": list(self.prompts_b)}

    def summary(self) -> dict:
        return {"model": self.model_name, "contrast": self.contrast, "n_pairs": self.n_pairs,
                "n_layers": len(self.layers), "peak_layer": self.peak_layer,
                "peak_rel": float(self.rel_mean[self.peak_index]), "seconds": round(self.seconds, 2)}


def divergence_profile(sm: SteerModel, prompts_a: Sequence[str], prompts_b: Sequence[str], *, batch_size: int = 8,
                       layers: Optional[Sequence[int]] = None, lens_k: int = 10, contrast: str = "custom",
                       edit_a: Optional[Callable] = None, progress=None, should_stop=None) -> DivergenceProfile:
    """The divergence profile of paired prompts on ``sm`` (see :class:`DivergenceProfile`).

    ``edit_a``: a context-manager factory applied while recording the A side (for a
    steered-vs-unsteered contrast, A and B are then the same prompts).
    """
    t0 = time.perf_counter()
    a, b = check_pairs(prompts_a, prompts_b)
    layers = list(range(sm.n_layers)) if layers is None else [int(l) for l in layers]
    hooks = resid_post(layers)
    n = len(a)
    batches = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    total = 2 * len(batches)
    ha, hb = [], []
    done = 0
    _tick(progress, should_stop, 0, total)
    for side, prompts, out in (("a", a, ha), ("b", b, hb)):
        for i, j in batches:
            ctx = edit_a() if (side == "a" and edit_a is not None) else contextlib.nullcontext()
            with ctx, sm.record(hooks, positions="last") as cache:
                sm.forward(prompts[i:j])
            out.append(cache.stack().float().cpu())  # [L, batch, d]
            done += 1
            _tick(progress, should_stop, done, total)
    HA = torch.cat(ha, 1)
    HB = torch.cat(hb, 1)
    diff = HA - HB
    rel = (diff.norm(dim=-1) / HA.norm(dim=-1).clamp_min(1e-12)).T.numpy()  # [n, L]
    cos = torch.nn.functional.cosine_similarity(HA, HB, dim=-1).T.numpy()
    mean_diff = diff.mean(1)  # [L, d]
    lens_top, lens_bottom = [], []
    if lens_k:
        f = _unembed_fn(sm)
        for l in range(len(layers)):
            t, bo = _top_bottom(sm, f(mean_diff[l]), lens_k)
            lens_top.append(t)
            lens_bottom.append(bo)
    return DivergenceProfile(layers=layers, rel=rel, cos=cos, prompts_a=a, prompts_b=b,
                             mean_diff=mean_diff.numpy(), lens_top=lens_top, lens_bottom=lens_bottom,
                             model_name=sm.name, contrast=contrast, seconds=time.perf_counter() - t0)


# ============================================================================ steering
OPERATIONS = ("add", "ablate", "clamp")


@dataclass
class SteerSetting:
    """What the Steer page applies: ``interventions`` for the steered row, the ``layers`` they act at,
    and where the per-token projection is read (``proj_hook``, on the unit direction ``unit``)."""

    interventions: list[Intervention]
    layers: list[int]
    operation: str
    strength: float
    proj_hook: str
    unit: Float[Tensor, " d_model"]
    #: ``True`` for a stored direction set ablated at every write into the residual stream
    everywhere: bool = False

    @property
    def proj_layer(self) -> int:
        return int(self.proj_hook.split(".")[1])


def _vectors(sm: SteerModel, direction, layers: list[int]) -> dict[int, Tensor]:
    if isinstance(direction, dict):
        dirs = {int(l): direction[l] for l in direction}
        missing = [l for l in layers if l not in dirs]
        if missing and len(dirs) == 1:
            v = next(iter(dirs.values()))
            dirs = {l: v for l in layers}
        elif missing:
            raise InputError(f"expected a direction for every chosen layer, found none for {missing} "
                             f"(the artifact has layers {sorted(dirs)})")
    else:
        dirs = {l: direction for l in layers}
    vecs = {}
    for l in layers:
        v = torch.as_tensor(np.asarray(dirs[l], dtype=np.float32)).reshape(-1)
        if v.shape[0] != sm.d_model:
            raise InputError(f"expected a direction of d_model={sm.d_model} (this model), found {v.shape[0]}; "
                             "the vector belongs to another model")
        if not torch.isfinite(v).all() or float(v.norm()) == 0:
            raise InputError(f"expected a finite, non-zero direction at layer {l}")
        vecs[l] = v
    return vecs


def steer_setting(sm: SteerModel, direction: Any, layers=None, *, operation: str = "add",
                  strength: float = 4.0) -> SteerSetting:
    """The interventions for one Steer-page setting.

    ``direction``: ``[d_model]`` (one for every layer), ``{layer: [d_model]}``, or a stored artifact
    with ``to_interventions`` and a ``basis`` (a :class:`steerkit.vectors.DirectionSet`).

    With vectors, ``operation`` is ``add`` (:meth:`Intervention.add`: ``h + strength * v``),
    ``ablate`` (:meth:`Intervention.ablate`: the component along ``v`` removed; strength unused) or
    ``clamp`` (:meth:`Intervention.clamp`: the projection on the unit direction becomes
    ``strength``), at ``blocks.{l}.hook_resid_post`` for each of ``layers`` (``"12"``, ``"10-14"``,
    ``"3,5,9"``, a list, ``"all"``; ``None``: the layers of a ``{layer: vector}`` direction).

    A direction set ablates its basis through ``to_interventions(sm.facts, scale=1.0)`` (checked
    against the model there); ``operation`` and ``strength`` do not apply. ``layers``: ``None`` or
    ``""`` keeps the artifact's own layers (``layers=None`` in the artifact: everywhere), ``"all"``
    ablates everywhere, anything else ablates at those layers. The projection is read on the first
    basis vector.
    """
    if hasattr(direction, "to_interventions") and hasattr(direction, "basis"):
        art = direction
        spec = "" if layers is None else layers
        if isinstance(spec, str) and spec.strip().lower() == "all":
            art = dataclasses.replace(art, layers=None)
        elif not (isinstance(spec, str) and not spec.strip()):
            art = dataclasses.replace(art, layers=parse_layers(spec, sm.n_layers))
        interventions = art.to_interventions(sm.facts, scale=1.0)
        everywhere = art.layers is None
        ls = list(range(sm.n_layers)) if everywhere else list(art.layers)
        basis = torch.as_tensor(art.basis).float()
        site = f"blocks.{ls[-1]}.{'hook_resid_post' if everywhere else art.hook_site}"
        return SteerSetting(interventions, ls, "ablate", 1.0, site, basis[0] / basis[0].norm(), everywhere)
    if operation not in OPERATIONS:
        raise InputError(f"expected operation in {OPERATIONS}, found {operation!r}")
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(float(strength)):
        raise InputError(f"expected a finite strength, found {strength!r}")
    s = float(strength)
    if layers is None or (isinstance(layers, str) and not layers.strip()):
        if not isinstance(direction, dict):
            raise InputError("expected layers to steer at (like '12', '10-14' or '3,5,9'), found none")
        layers = sorted(int(l) for l in direction)
    ls = parse_layers(layers, sm.n_layers)
    vecs = _vectors(sm, direction, ls)
    hook = "blocks.{}.hook_resid_post".format
    if operation == "add":
        ivs = [Intervention.add(hook(l), v, s) for l, v in vecs.items()]
    elif operation == "ablate":
        ivs = [Intervention.ablate(hook(l), v) for l, v in vecs.items()]
    else:
        ivs = [Intervention.clamp(hook(l), v, s) for l, v in vecs.items()]
    last = vecs[ls[-1]]
    return SteerSetting(ivs, ls, operation, s, hook(ls[-1]), last / last.norm())


@dataclass
class SteerResult:
    """Baseline and steered continuations of one prompt; per token, its projection on the direction.

    ``*_proj[k]`` is the projection on the unit direction of the residual at ``proj_layer`` (after
    the edits there) at the position that produced token ``k``: the last prompt token for ``k = 0``,
    generated token ``k - 1`` after that.
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

    @property
    def baseline_text(self) -> str:
        return "".join(self.baseline_tokens)

    @property
    def steered_text(self) -> str:
        return "".join(self.steered_tokens)


def steer_compare(sm: SteerModel, prompt: str, setting: SteerSetting, *, max_new_tokens: int = 32,
                  stream: Optional[Callable[[int, str], None]] = None, should_stop=None,
                  label: str = "", deadline: Optional[float] = None) -> SteerResult:
    """Generate ``prompt`` unsteered (row 0) and steered by ``setting`` (row 1) in one greedy batch.

    One per-row steering ``[None, setting.interventions]`` is installed for the batch
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
    toks: list[list[str]] = [[], []]
    end = None if deadline is None else time.monotonic() + float(deadline)
    late: list[bool] = []  # set when the deadline (not the caller) stopped the generation

    def on_token(row, token_id, text):
        if should_stop is not None and should_stop():
            raise Cancelled("cancelled")
        if end is not None and time.monotonic() > end:
            late.append(True)
            raise Cancelled("time limit")
        toks[row].append(sm.tokenizer.decode([int(token_id)]))
        if stream is not None:
            stream(row, text)

    stopped = False
    # the steering is registered before the record scope: at a shared site its hook runs first
    try:
        with sm.steer([None, setting.interventions], label="steer page (row 1)"), \
                sm.record(setting.proj_hook, positions=AnyOf("last", "generated")) as cache:
            sm.generate([prompt, prompt], max_new_tokens=max_new_tokens, stream=on_token)
    except Cancelled:
        if not late:
            raise
        stopped = True
    if not any(toks):
        projs = [[], []]
    else:
        h = cache[setting.proj_hook].float()
        proj = (h @ setting.unit.to(h.device)).cpu()
        projs = [proj[r, :len(toks[r])].tolist() for r in range(2)]
    return SteerResult(prompt=prompt, baseline_tokens=toks[0], steered_tokens=toks[1], baseline_proj=projs[0],
                       steered_proj=projs[1], layers=setting.layers, operation=setting.operation,
                       strength=setting.strength, proj_layer=setting.proj_layer, label=label,
                       everywhere=setting.everywhere, stopped_at_deadline=stopped)


# ============================================================================ diagnostics
@dataclass
class LayerDiagnostics:
    """Residual norm (mean over positions >= 1, and at position 0) and sink attention per layer.

    ``sink[l]`` is the attention mass on position 0, averaged over heads, query positions >= 1 and
    prompts; ``sink_heads[l, h]`` the same per head.
    """

    layers: list[int]
    resid_norm: np.ndarray
    resid_norm_pos0: np.ndarray
    sink: Optional[np.ndarray] = None
    sink_heads: Optional[np.ndarray] = None
    model_name: str = ""
    n_prompts: int = 0
    note: str = ""


def layer_diagnostics(sm: SteerModel, prompts: Sequence[str], *, progress=None,
                      should_stop=None) -> LayerDiagnostics:
    """Residual norms and sink attention of every layer over ``prompts`` (at most 64)."""
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise InputError("expected at least one prompt, found none")
    if len(prompts) > MAX_DIAG_PROMPTS:
        raise InputError(f"expected at most {MAX_DIAG_PROMPTS} prompts for diagnostics, found {len(prompts)}")
    L = sm.n_layers
    hooks = resid_post(range(L))
    norms, norms0, sink_heads = [], [], []
    total = 2 * len(prompts)
    note = ""
    _tick(progress, should_stop, 0, total)
    for i, p in enumerate(prompts):
        with sm.record(hooks, positions="all") as cache:
            sm.forward([p])
        h = cache.stack()[:, 0].float()  # [L, pos, d]
        n = h.norm(dim=-1)
        norms0.append(n[:, 0])
        norms.append(n[:, 1:].mean(1) if n.shape[1] > 1 else n[:, 0])
        _tick(progress, should_stop, 2 * i + 1, total)
        att = _attentions(sm, p)
        if att is None:
            note = "sink attention unavailable: this model does not return attention weights"
        else:
            a0 = torch.stack([a[0, :, 1:, 0].float().mean(-1) if a.shape[-2] > 1 else a[0, :, :, 0].float().mean(-1)
                              for a in att])  # [L, H]
            sink_heads.append(a0)
        _tick(progress, should_stop, 2 * i + 2, total)
    res = LayerDiagnostics(layers=list(range(L)), resid_norm=torch.stack(norms).mean(0).numpy(),
                           resid_norm_pos0=torch.stack(norms0).mean(0).numpy(), model_name=sm.name,
                           n_prompts=len(prompts), note=note)
    if sink_heads:
        sh = torch.stack(sink_heads).mean(0).numpy()
        res.sink_heads = sh
        res.sink = sh.mean(1)
    return res


def _attentions(sm: SteerModel, prompt):
    """Attention weights of every layer for one prompt (eager attention, switched back afterwards)."""
    hf = sm.hf_model
    toks = sm.tokenize([prompt])
    cfg = getattr(hf, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    switched = False
    try:
        if before not in (None, "eager") and hasattr(hf, "set_attn_implementation"):
            hf.set_attn_implementation("eager")
            switched = True
        with torch.inference_mode():
            out = hf(input_ids=toks.input_ids, attention_mask=toks.attention_mask, output_attentions=True,
                     use_cache=False)
        att = getattr(out, "attentions", None)
        if not att or any(a is None for a in att):
            return None
        return att
    finally:
        if switched:
            hf.set_attn_implementation(before)



# ============================================================================ patching
def _one_prompt(sm: SteerModel, text, what: str, max_tokens: int) -> tuple[Tokens, list[str]]:
    """One prompt (bounded text, bounded tokens) as one-row ``Tokens`` and its token labels."""
    text = check_text(text, what, MAX_PATCH_PROMPT_CHARS)
    if not text.strip():
        raise InputError(f"expected {what}, found nothing; type a prompt")
    toks = sm.tokenize([text], chat=False)
    n = int(toks.input_ids.shape[1])
    if n > max_tokens:
        raise InputError(f"expected {what} of at most {max_tokens} tokens, found {n}; shorten it")
    return toks, [sm.tokenizer.decode([int(i)]) for i in toks.input_ids[0].tolist()]


def _answer(value, what: str) -> str:
    value = check_text(value, what, MAX_ANSWER_CHARS)
    if not value:
        raise InputError(f"expected {what} as one token (like ' Mary', with its leading space), found nothing")
    return value


@dataclass
class PatchingRun:
    """The Patching page's result: a clean and a corrupted prompt, the logit difference ``answer -
    wrong`` at the last position as the metric, and the grid of ``hook`` patched one site at a time
    (``activation``, :func:`steerkit.probes.activation_patching`) and / or its gradient
    approximation (``attribution``, :func:`steerkit.probes.attribution_patching`), each a
    :class:`steerkit.probes.PatchingResult`. ``stopped_at_deadline``: the activation grid holds
    only the layers computed within the time limit (``layers_requested`` were asked for)."""

    clean: str
    corrupted: str
    answer: str
    wrong: str
    hook: str
    tokens: list[str]
    corrupted_tokens: list[str]
    layers_requested: list[int]
    activation: Optional[PatchingResult] = None
    attribution: Optional[PatchingResult] = None
    model_name: str = ""
    seconds: float = 0.0
    stopped_at_deadline: bool = False

    @property
    def results(self) -> dict[str, PatchingResult]:
        """The grids computed, by method (``activation`` first)."""
        return {m: r for m, r in (("activation", self.activation), ("attribution", self.attribution))
                if r is not None}

    @property
    def first(self) -> PatchingResult:
        return next(iter(self.results.values()))

    @property
    def clean_metric(self) -> float:
        return float(self.first.clean_metric)

    @property
    def corrupted_metric(self) -> float:
        return float(self.first.corrupted_metric)

    @property
    def by_head(self) -> bool:
        """The grid is layers x heads (``hook="z"``), else layers x positions."""
        return self.hook == "z"

    @property
    def can_normalize(self) -> bool:
        """The clean and corrupted metrics differ, so values can be shown as the restored fraction."""
        return abs(self.clean_metric - self.corrupted_metric) > 1e-6

    def columns(self) -> list[int]:
        """The grid's column indices: heads for ``z``, else positions."""
        r = self.first
        return list(r.heads or []) if self.by_head else list(r.positions)

    def grid(self, method: str, normalized: bool = False) -> np.ndarray:
        """One method's grid ``[layers, columns]`` in the units both methods share: the metric
        (attribution: the corrupted run's metric plus the predicted change), or with ``normalized``
        the fraction of the clean-vs-corrupted gap restored (1: as clean, 0: as corrupted)."""
        return _shown(self.results[method], normalized)

    def layer_values(self, layer: int, normalized: bool = False) -> dict[str, np.ndarray]:
        """Each grid's row at ``layer`` (a layer some grid holds), by method (units of :meth:`grid`)."""
        out = {}
        for m, r in self.results.items():
            if layer in r.layers:
                out[m] = self.grid(m, normalized)[r.layers.index(layer)]
        if not out:
            raise InputError(f"expected a layer of the grid ({self.layers_requested[0]}..{self.layers_requested[-1]}), "
                             f"found {layer}")
        return out


def _shown(r: PatchingResult, normalized: bool) -> np.ndarray:
    """A result's values as shown: normalised, or the metric (attribution: corrupted + change)."""
    if normalized:
        return r.normalized().values.double().numpy()
    v = r.values.double().numpy()
    return v + float(r.corrupted_metric) if r.method == "attribution" and not r.is_normalized else v


def _stack_results(parts: list[PatchingResult]) -> PatchingResult:
    """Activation-patching grids of consecutive layer chunks as one grid."""
    first = parts[0]
    return dataclasses.replace(first, values=torch.cat([p.values for p in parts], 0),
                               layers=[l for p in parts for l in p.layers])


def patching_run(sm: SteerModel, clean: str, corrupted: str, answer: str = IOI_ANSWER, wrong: str = IOI_WRONG,
                 hook: str = "resid_pre", *, layers=None, method: str = "activation", batch_size: int = 32,
                 progress=None, should_stop=None, deadline: Optional[float] = None) -> PatchingRun:
    """Patch ``clean`` into ``corrupted`` (prompts of equal token length) at every site of ``hook``
    (``PATCH_HOOKS``: ``resid_pre`` / ``attn_out`` / ``mlp_out`` per layer and position, ``z`` per layer
    and head) with the metric ``logits[answer] - logits[wrong]`` at the last position.

    ``layers``: a selection for :func:`~steerkit.apps.data.parse_layers` (``None``: all). ``method``:
    ``PATCH_METHODS``. Activation patching runs a few layers per call of
    :func:`steerkit.probes.activation_patching` (about ``batch_size`` patched rows per forward pass),
    so ``progress(done, total)`` advances and ``should_stop()`` cancels between them; past
    ``deadline`` seconds it stops with the layers it has (``stopped_at_deadline``).
    """
    t0 = time.perf_counter()
    end = None if deadline is None else time.monotonic() + float(deadline)
    hook = check_choice(hook, "a hook grid", PATCH_HOOKS)
    method = check_choice(method, "a method", PATCH_METHODS)
    ct, tokens = _one_prompt(sm, clean, "the clean prompt", MAX_PATCH_TOKENS)
    kt, ktokens = _one_prompt(sm, corrupted, "the corrupted prompt", MAX_PATCH_TOKENS)
    if len(tokens) != len(ktokens):
        raise InputError(f"expected the clean and corrupted prompts to have the same number of tokens (patching maps "
                         f"each position to the same position), found {len(tokens)} and {len(ktokens)}: "
                         f"{tokens!r} vs {ktokens!r}; change the corruption so that every token count stays (e.g. "
                         "swap one-token names)")
    answer, wrong = _answer(answer, "the answer"), _answer(wrong, "the wrong answer")
    metric = logit_diff_metric(sm, answer, wrong)
    ls = list(range(sm.n_layers)) if layers is None else parse_layers(layers, sm.n_layers)
    n_cols = int(sm.facts.n_heads) if hook == "z" else len(tokens)
    if len(ls) * n_cols > MAX_PATCH_SITES:
        raise InputError(f"expected a grid of at most {MAX_PATCH_SITES} cells, found {len(ls)} layers x {n_cols} "
                         f"{'heads' if hook == 'z' else 'positions'} = {len(ls) * n_cols}; choose fewer layers or a "
                         "shorter prompt")
    per_call = max(1, batch_size // n_cols)
    chunks = [ls[i:i + per_call] for i in range(0, len(ls), per_call)] if method != "attribution" else []
    total = len(chunks) + (method != "activation")
    done = 0
    _tick(progress, should_stop, 0, total)
    attribution = None
    if method != "activation":
        attribution = attribution_patching(sm, ct, kt, metric, hook, layers=ls, progress=False)
        done += 1
        _tick(progress, should_stop, done, total)
    parts: list[PatchingResult] = []
    stopped = False
    for chunk in chunks:
        if parts and end is not None and time.monotonic() > end:
            stopped = True
            break
        parts.append(activation_patching(sm, ct, kt, metric, hook, layers=chunk, batch_size=batch_size,
                                         progress=False))
        done += 1
        _tick(progress, should_stop, done, total)
    return PatchingRun(clean=clean, corrupted=corrupted, answer=answer, wrong=wrong, hook=hook, tokens=tokens,
                       corrupted_tokens=ktokens, layers_requested=ls,
                       activation=_stack_results(parts) if parts else None, attribution=attribution,
                       model_name=sm.name, seconds=time.perf_counter() - t0, stopped_at_deadline=stopped)


@dataclass
class HeadDetail:
    """One head of a ``z`` grid patched at each position separately (``hook="z_pos"``), by method:
    ``results[m].values`` is ``[1, n_pos, 1]``."""

    layer: int
    head: int
    tokens: list[str]
    results: dict[str, PatchingResult]

    def values(self, normalized: bool = False) -> dict[str, np.ndarray]:
        """Each method's values over positions (units of :meth:`PatchingRun.grid`)."""
        return {m: _shown(r, normalized).reshape(-1) for m, r in self.results.items()}


def head_detail(sm: SteerModel, run: PatchingRun, layer: int, head: int) -> HeadDetail:
    """Head ``head`` of layer ``layer`` (a cell of ``run``'s ``z`` grid) patched from the clean run at
    each position on its own, with the run's prompts, metric and methods."""
    if not run.by_head:
        raise InputError(f"expected a run of the z (heads) grid, found one of {run.hook}")
    n_heads = int(sm.facts.n_heads)
    layer = check_int(layer, "a layer", 0, sm.n_layers - 1)
    head = check_int(head, "a head", 0, n_heads - 1)
    if layer not in run.layers_requested:
        raise InputError(f"expected a layer of the grid {run.layers_requested}, found {layer}")
    metric = logit_diff_metric(sm, run.answer, run.wrong)
    ct, _ = _one_prompt(sm, run.clean, "the clean prompt", MAX_PATCH_TOKENS)
    kt, _ = _one_prompt(sm, run.corrupted, "the corrupted prompt", MAX_PATCH_TOKENS)
    out = {}
    for m in run.results:
        fn = activation_patching if m == "activation" else attribution_patching
        out[m] = fn(sm, ct, kt, metric, "z_pos", layers=[layer], heads=[head], progress=False)
    return HeadDetail(layer=layer, head=head, tokens=list(run.tokens), results=out)


# ============================================================================ attention patterns
@dataclass
class AttentionPatterns:
    """``blocks.{layer}.attn.hook_pattern`` of one prompt: ``pattern[h, q, k]`` is how much query
    position ``q`` of head ``h`` attends to key position ``k`` (rows sum to 1; zero above the diagonal)."""

    prompt: str
    layer: int
    tokens: list[str]
    pattern: np.ndarray
    model_name: str = ""

    @property
    def n_heads(self) -> int:
        return int(self.pattern.shape[0])


def attention_patterns(sm: SteerModel, prompt: str, layer: int) -> AttentionPatterns:
    """Every head's attention pattern at ``layer`` for ``prompt`` (recorded at ``attn.hook_pattern``)."""
    layer = check_int(layer, "a layer", 0, sm.n_layers - 1)
    toks, tokens = _one_prompt(sm, prompt, "the prompt", MAX_ATTN_TOKENS)
    n_heads = int(sm.facts.n_heads)
    if n_heads * len(tokens) ** 2 > MAX_ATTN_CELLS:
        raise InputError(f"expected at most {MAX_ATTN_CELLS} attention weights ({n_heads} heads x query x key), "
                         f"found {n_heads * len(tokens) ** 2}; shorten the prompt")
    site = f"blocks.{layer}.attn.hook_pattern"
    with sm.record([site], positions="all") as cache:
        sm.forward(toks)
    pattern = cache[site][0].float().cpu().numpy()  # [heads, q, k]
    return AttentionPatterns(prompt=prompt, layer=layer, tokens=tokens, pattern=pattern, model_name=sm.name)


# ============================================================================ tune
@dataclass
class TuneRun:
    """The Tune page's result: a tune result document (``result``, the JSON of
    :meth:`steerkit.probes.tune.TuneResult.to_json`) with where it came from (``source``: ``"computed"``
    or the saved file's name), the layers asked for and whether the time limit cut the grid short
    (``stopped_at_deadline``: ``result`` holds the layers finished by then).

    Examples:
        >>> from steerkit.apps.analysis import TuneRun
        >>> from steerkit.probes.tune import TuneResult
        >>> run = TuneRun(TuneResult.example().to_json(), source="example")
        >>> run.n_cells, run.recommended
        (6, {'layer': 5, 'scale': 2.0})
    """

    result: dict
    source: str = "computed"
    layers_requested: list = field(default_factory=list)
    stopped_at_deadline: bool = False
    seconds: float = 0.0

    @property
    def n_cells(self) -> int:
        return len(self.result["cells"])

    @property
    def recommended(self) -> Optional[dict]:
        return self.result.get("recommended")


def merge_tunes(parts: Sequence[dict]) -> dict:
    """Tune results of the same prompts, scales, concept and settings on different layers (one
    :func:`steerkit.probes.tune.tune` call each, as :meth:`TuneResult.to_json`) as one result over
    every layer: their cells in order, the Pareto front and the recommended cell found again over all
    of them (:func:`steerkit.probes.tune.pareto_front`, :func:`steerkit.probes.tune.recommend` with the
    first part's rule); the baseline is the first part's (greedy generation: the same in each).

    Examples:
        >>> from steerkit.apps.analysis import merge_tunes
        >>> from steerkit.probes.tune import TuneResult
        >>> doc = TuneResult.example().to_json()
        >>> one = lambda l: {**doc, "layers": [l], "cells": [c for c in doc["cells"] if c["layer"] == l]}
        >>> merged = merge_tunes([one(5), one(10)])
        >>> merged["layers"], merged["recommended"] == doc["recommended"]
        ([5, 10], True)
    """
    if not parts:
        raise InputError("expected at least one tune result to merge, found none")
    first = parts[0]
    cells = [dict(c) for p in parts for c in p["cells"]]
    for c, on_front in zip(cells, pareto_front(cells)):
        c["pareto"] = on_front
    layers = [l for p in parts for l in p["layers"]]
    return {**first, "layers": layers, "cells": cells, "recommended": recommend(cells, Rule.of(first.get("rule")))}


def tune_run(sm: SteerModel, artifact: Any, prompts: Sequence[str], *, layers: Sequence[int],
             scales: Sequence[float], concept: Any, neutral: Optional[Sequence[str]] = None,
             max_new_tokens: int = 16, normalize: Optional[str] = None, progress=None, should_stop=None,
             deadline: Optional[float] = None, **tune_kw) -> TuneRun:
    """:func:`steerkit.probes.tune.tune` of ``artifact`` on ``prompts`` over ``layers`` x ``scales``, one
    layer per call so that ``progress(done, total)`` advances and ``should_stop()`` cancels between
    layers, merged by :func:`merge_tunes`; past ``deadline`` seconds it stops with the layers it has
    (``stopped_at_deadline``). ``tune_kw`` goes to every call (``rule``, ``n_boot``, ``chat``, ...).

    Examples:
        >>> from steerkit.apps.analysis import tune_run
        >>> run = tune_run(tiny, torch.ones(tiny.d_model), ["Hi"], layers=[1, 2], scales=[0, 4], concept=["the"],
        ...                neutral=["Hello"], max_new_tokens=3, n_boot=20)
        >>> run.result["layers"], run.n_cells, run.stopped_at_deadline
        ([1, 2], 4, False)
    """
    t0 = time.perf_counter()
    end = None if deadline is None else time.monotonic() + float(deadline)
    layers = [int(l) for l in layers]
    if not layers:
        raise InputError("expected at least one layer to tune, found none")
    parts: list[dict] = []
    stopped = False
    _tick(progress, should_stop, 0, len(layers))
    for i, layer in enumerate(layers):
        if parts and end is not None and time.monotonic() > end:
            stopped = True
            break
        res = probes_tune(sm, artifact, prompts, layers=[layer], scales=list(scales), concept=concept,
                          neutral=None if neutral is None else list(neutral), max_new_tokens=max_new_tokens,
                          normalize=normalize, progress=False, **tune_kw)
        parts.append(res.to_json())
        _tick(progress, should_stop, i + 1, len(layers))
    return TuneRun(merge_tunes(parts), layers_requested=layers, stopped_at_deadline=stopped,
                   seconds=time.perf_counter() - t0)
