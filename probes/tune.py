"""Tuning a steering direction: which layer, how strong, and what does it break?

:func:`tune` runs a grid of cells, one per (layer, scale), on a set of prompts and measures, for each
cell, how much of the concept the steered generations show and what the steering costs:

* **concept** (higher is more of the concept), the mean over prompts of a per-generation score, with a
  bootstrap percentile interval (``concept_ci``, 95 % by default) over prompts. The score comes from

  - a stored :class:`~steerkit.vectors.Probe`: its decision value (a logistic probe's probability of its
    positive class ``probe.classes[-1]``, other probes' raw score) on the activations of the prompt plus
    the steered completion re-run through the UNSTEERED model, at the probe's own layer and hook site
    and at its position (``"last"``: the last token of the completion; ``"mean"``: the mean over the
    completion's tokens; ``"first_generated"``: the first completion token; an ``int``: an index among
    the row's real tokens, prompt and completion, ``-1`` the last); a row with an empty completion
    reads its last prompt token;
  - a callable ``fn(prompts, completions) -> scores`` (one finite number per generation);
  - substring rules: ``{"contains": [...], "absent": [...]}`` (a generation scores 1 when it contains
    at least one ``contains`` string and none of the ``absent`` ones, else 0; case-insensitive unless
    ``"case": True``), or a list of strings / one string (``contains`` only).

* **perplexity**: ``exp`` of the mean negative log-likelihood of the cell's completion tokens (every
  token of every completion of the cell, pooled) under the UNSTEERED model; ``None`` when every
  completion of the cell is empty. The rule reads the
  ratio to the baseline's perplexity (``ppl_ratio``).
* **kl**: the next-token KL divergence ``KL(unsteered || steered)`` in nats at the last position of each
  ``neutral`` prompt (the distribution of the first response token), averaged over the neutral prompts.
* **repetition**: the fraction of the cell's generations that are *degenerate*: a generation of
  completion tokens ``t`` has ``m = len(t) - n + 1`` token n-grams (``n = 3`` by default); its repeated
  n-gram share is ``1 - distinct / m`` (0 when ``m < 1``), and it is degenerate when that share is above
  ``repetition_bound`` (0.5 by default).

What a scale means: the cell at ``(l, s)`` is the artifact at layer ``l`` alone, steered through its
own ``to_interventions(sm.facts, scale=s)`` (its site, positions and operation kept). For a
:class:`~steerkit.vectors.SteeringVector` (operation ``"add"``) that adds ``s * v_l`` at
``blocks.{l}.{hook_site}`` at the vector's positions (every position when it has none; ``v_l`` its
direction at layer ``l``, or its one direction at every grid layer when it has only one; the vector's
own ``scale`` and schedule are not used: the grid's scale replaces them); a raw tensor ``[d_model]`` is
such a vector (:meth:`~steerkit.vectors.SteeringVector.from_direction`, at its default site
``hook_resid_post``); a :class:`~steerkit.vectors.DirectionSet` ablates its basis at
``blocks.{l}.{hook_site}`` with strength ``s`` (1 removes the span's component, 0 does nothing).
``normalize="unit"`` divides added vectors by their norm first (a scale is then a length in the residual
stream); ``normalize="resid"`` also multiplies by the layer's mean residual norm over the prompts' tokens
(a scale is then a fraction of a typical residual vector: ``s = 0.5`` adds half of one). Scale 0 is the
unsteered model: such cells reuse the baseline.

Batched: the prompts are tokenized once; every generation of every cell (and the baseline, generated once)
is one row of a per-row steering (``sm.generate(tokens, steer_rows=[...])``, ``batch_size`` rows per call);
the perplexity comes from unsteered passes in which each prompt's KV cache is computed once and shared
by every row that continues it (each row feeds only its completion; with a probe concept, which reads
activations along the whole row, one forward of prompt plus completion per row), and the KL from
per-row steered forwards of the neutral prompts (only the last position unembedded).

What is computed once and reused (on a model whose backend runs a range of blocks, the ``hf`` one:
:func:`steerkit.reuse.supports_run_from`, with no other hooks on it; ``reuse=False`` turns it off): a
cell's steering acts at its layer, so nothing below that block differs from the unsteered model. The
prompts are run once unsteered (:func:`steerkit.reuse.run_cached`, ``batch_size`` prompts a pass), and
each generate call's prompt pass starts at the lowest layer among its rows' cells from that run's
residual stream (:func:`steerkit.generation.generate_from`; the decoding steps run the whole model, since
the generated tokens differ); the neutral prompts too, the KL's steered passes then running from that
layer (:func:`steerkit.reuse.run_from`) and the unsteered distribution coming from the same run. Rows are
grouped so that the cells of one layer share a call (the grid is layer-major). The scores, generations
and selection are those of full passes up to float rounding. TransformerLens and nnsight models run full
passes.

What :func:`tune` returns, the Pareto front, the rule and the JSON schema are in
:mod:`steerkit.probes.tune_result` (its names are re-exported here); the figures in
:mod:`steerkit.probes.plots.tune`.
"""
from __future__ import annotations

import contextlib
import functools
import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import HookNameError, InputError
from steerkit.generation import continuation_logprobs, generate_from
from steerkit.interventions import Intervention, ModelFacts
from steerkit.model import Tokens
from steerkit.reuse import run_cached, run_from, supports_run_from
from steerkit.vectors import DirectionSet, Probe, SteeringVector
from steerkit.vectors import ModelMismatchError, check_compatible

from .tune_result import DAMAGES, FORMAT, METRICS, OBJECTIVES, Rule, TuneResult, bootstrap_mean_ci, pareto_front
from .plots.require import plotly_required
from .tune_result import _finite_or_none, _is_num, recommend, repetition_share

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["tune", "TuneResult", "Rule", "pareto_front", "recommend", "repetition_share", "bootstrap_mean_ci",
           "NEUTRAL_PROMPTS", "FORMAT", "METRICS", "DAMAGES", "OBJECTIVES"]
#: the figures, reachable here by their old names (plotly is imported on first use): they live in
#: :mod:`steerkit.probes.plots.tune`
_FIGURES = ("tradeoff_figure", "heatmap_figure")
NORMALIZE = (None, "unit", "resid")

#: neutral prompts for the next-token KL when none are given
NEUTRAL_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain how a rainbow forms.",
    "Write a short email asking a colleague for a meeting.",
    "What is 12 times 7?",
    "Name a few common kitchen tools.",
    "How do I boil an egg?",
    "Summarize the water cycle in two sentences.",
)


def __getattr__(name: str):
    if name in _FIGURES:
        with plotly_required():
            from .plots import tune as figures
        return getattr(figures, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")



# ----------------------------------------------------------------------------- what a cell does
@dataclasses.dataclass(frozen=True)
class _Source:
    """The artifact as the grid uses it: a steering vector (``"add"``) or a direction set (``"ablate"``); the
    cell at ``(layer, scale)`` is the artifact at that layer alone (:meth:`at`), lowered by its own
    ``to_interventions``."""

    artifact: Union[SteeringVector, DirectionSet]
    label: str

    @property
    def op(self) -> str:
        return "ablate" if isinstance(self.artifact, DirectionSet) else "add"

    @property
    def site(self) -> str:
        return self.artifact.hook_site

    def own_layers(self) -> list[int]:
        """The vector's layers when it has several directions (a grid's default), else none."""
        a = self.artifact
        return list(a.directions) if isinstance(a, SteeringVector) and len(a.directions) > 1 else []

    def tensor(self, layer: int) -> Tensor:
        """The direction the cell at ``layer`` adds (a vector's own at that layer, or its only one), or the
        basis it ablates."""
        a = self.artifact
        if isinstance(a, DirectionSet):
            return a.basis.float()
        dirs = a.directions
        if len(dirs) == 1:
            return next(iter(dirs.values())).float()
        if layer not in dirs:
            raise InputError(f"expected the artifact to have a direction at every grid layer, found none at layer "
                             f"{layer} (it has layers {sorted(dirs)}); pass layers= among those, or a vector with "
                             "one direction (used at every layer)")
        return dirs[layer].float()

    def at(self, layer: int) -> Union[SteeringVector, DirectionSet]:
        """The artifact at ``layer`` alone: a vector's direction there at scale 1 without a schedule (the
        grid's scale replaces them), or the direction set ablated there only."""
        a = self.artifact
        if isinstance(a, DirectionSet):
            return dataclasses.replace(a, basis=a.basis.float(), layers=[layer])
        return dataclasses.replace(a, directions={layer: self.tensor(layer)}, scale=1.0, schedule=None)

    def interventions(self, facts: ModelFacts, layer: int, scale: float, override: bool) -> list[Intervention]:
        """What the cell ``(layer, scale)`` applies."""
        return self.at(layer).to_interventions(facts, scale=scale, override=override)


def _source(sm: "SteerModel", artifact, override: bool) -> _Source:
    if isinstance(artifact, (Tensor, np.ndarray)):
        t = torch.as_tensor(artifact).detach().float().cpu()
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1 or t.shape[0] != sm.d_model:
            raise InputError(f"expected a direction tensor of shape [d_model={sm.d_model}], found {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()) or float(t.norm()) == 0.0:
            raise InputError("expected a nonzero direction with finite values, found zeros or NaN/inf")
        return _Source(SteeringVector.from_direction(t, 0, sm), f"tensor [d_model={sm.d_model}]")
    if not isinstance(artifact, (SteeringVector, DirectionSet)):
        raise InputError(f"expected the artifact as a SteeringVector, a DirectionSet or a direction tensor [d_model], "
                         f"found {type(artifact).__name__}; load a stored one with Store().load(name)")
    try:
        check_compatible(artifact, sm, override=override)
    except ModelMismatchError as e:
        raise InputError(f"{e}") from None
    if isinstance(artifact, DirectionSet):
        return _Source(artifact, f"direction_set (k={artifact.k})")
    if artifact.operation != "add":
        raise InputError(f"expected a steering vector with operation 'add' to tune, found {artifact.operation!r}; "
                         "tune its direction as a tensor (vec.directions[layer]) instead")
    return _Source(artifact, f"steering_vector ({artifact.provenance.method or 'unnamed'}, layers "
                              f"{list(artifact.directions)})")


# ----------------------------------------------------------------------------- the concept score
@dataclasses.dataclass(frozen=True)
class _Concept:
    kind: str  # "probe" | "callable" | "substring"
    label: str
    probe: Optional[Probe] = None
    fn: Optional[Callable] = None
    contains: tuple = ()
    absent: tuple = ()
    case: bool = False

    def substring_score(self, text: str) -> float:
        t = text if self.case else text.lower()
        norm = (lambda s: s) if self.case else (lambda s: s.lower())
        hit = not self.contains or any(norm(w) in t for w in self.contains)
        return 1.0 if hit and not any(norm(w) in t for w in self.absent) else 0.0


def _words(v, what: str) -> tuple:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(w, str) and w for w in v):
        raise InputError(f"expected {what} as a list of non-empty strings, found {v!r:.80}")
    return tuple(v)


def _concept(sm: "SteerModel", concept, override: bool) -> _Concept:
    if isinstance(concept, Probe):
        try:
            check_compatible(concept, sm, override=override)
        except ModelMismatchError as e:
            raise InputError(f"{e}") from None
        if concept.weight.shape[0] != 1:
            raise InputError(f"expected a binary probe with one output, found {concept.weight.shape[0]} outputs")
        pos = (concept.provenance.method_params or {}).get("position", "last")
        if not (pos in ("last", "mean", "first_generated") or (isinstance(pos, int) and not isinstance(pos, bool))
                or (isinstance(pos, str) and pos.lstrip("-").isdigit())):
            raise InputError(f"expected the probe's position as 'last', 'mean', 'first_generated' or an int, "
                             f"found {pos!r}")
        name = concept.classes[-1] if concept.classes else "positive"
        what = "probability" if concept.probe_kind == "logistic" else "score"
        return _Concept("probe", f"probe {concept.probe_kind} at blocks.{concept.layer}.{concept.hook_site}, "
                                 f"position {pos}: {what} of {name!r}", probe=concept)
    if isinstance(concept, Mapping):
        extra = sorted(set(concept) - {"contains", "absent", "case"})
        if extra or not ({"contains", "absent"} & set(concept)):
            raise InputError(f"expected substring rules as {{'contains': [...], 'absent': [...], 'case': bool}}, "
                             f"found keys {sorted(concept)}")
        c = _Concept("substring", "", contains=_words(concept.get("contains", []) or [], "'contains'")
                     if concept.get("contains") else (),
                     absent=_words(concept.get("absent"), "'absent'") if concept.get("absent") else (),
                     case=bool(concept.get("case", False)))
        if not c.contains and not c.absent:
            raise InputError("expected at least one 'contains' or 'absent' string in the substring rules, found none")
        return dataclasses.replace(c, label=f"contains any of {list(c.contains)}, none of {list(c.absent)}"
                                           + (" (case-sensitive)" if c.case else ""))
    if isinstance(concept, (str, list, tuple)):
        words = _words(concept, "the concept substrings")
        return _Concept("substring", f"contains any of {list(words)}, none of []", contains=words)
    if callable(concept):
        return _Concept("callable", f"callable {getattr(concept, '__name__', type(concept).__name__)}", fn=concept)
    raise InputError(f"expected concept= as a Probe, a callable fn(prompts, completions) -> scores, substring rules "
                     f"{{'contains': [...], 'absent': [...]}} or a list of substrings, found {type(concept).__name__}")


def _probe_row(probe: Probe, acts: Tensor, n_prompt: int, n_real: int) -> Tensor:
    """The activation the probe reads in one row of the scoring forward (``acts``: its real tokens)."""
    pos = (probe.provenance.method_params or {}).get("position", "last")
    n_gen = n_real - n_prompt
    if pos == "last" or (pos in ("mean", "first_generated") and n_gen == 0):
        return acts[n_real - 1]
    if pos == "mean":
        return acts[n_prompt:n_real].mean(0)
    if pos == "first_generated":
        return acts[n_prompt]
    i = int(pos)
    if not -n_real <= i < n_real:
        raise InputError(f"expected the probe's position {i} inside every scored row, found a row of {n_real} tokens")
    return acts[i % n_real]


def _callable_scores(fn, prompts: list[str], completions: list[str]) -> list[float]:
    out = fn(list(prompts), list(completions))
    try:
        arr = np.asarray(out, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise InputError(f"expected the concept callable to return numbers, found {type(out).__name__}") from None
    if arr.shape[0] != len(prompts):
        raise InputError(f"expected the concept callable to return one score per generation ({len(prompts)}), "
                         f"found {arr.shape[0]}")
    if not bool(np.isfinite(arr).all()):
        raise InputError("expected finite concept scores from the callable, found NaN/inf")
    return arr.tolist()


# ----------------------------------------------------------------------------- argument checks
def _prompt_list(prompts, what: str) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError(f"expected {what} as a non-empty list of strings, found {prompts!r:.80}")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p.strip():
            raise InputError(f"expected {what} as non-empty strings, found {p!r:.60} at index {i}")
    return list(prompts)


def _int_arg(v, what: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise InputError(f"expected {what} as an int >= {minimum}, found {v!r}")
    return int(v)


def _layers(sm: "SteerModel", layers, src: _Source) -> list[int]:
    if layers is None:
        have = src.own_layers()
        if not have:
            raise InputError("expected layers=[...] (the grid's layers), found None; the artifact has one direction, "
                             "so say where to try it, e.g. layers=[6, 10, 14]")
        layers = have
    if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
        layers = [layers]
    if isinstance(layers, range):
        layers = list(layers)
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(l, numbers.Integral) and not isinstance(l, bool) for l in layers):
        raise InputError(f"expected layers as a non-empty list of ints, found {layers!r:.80}")
    out = [int(l) for l in layers]
    bad = [l for l in out if not 0 <= l < sm.n_layers]
    if bad:
        raise InputError(f"expected layers in 0..{sm.n_layers - 1}, found {bad}")
    if len(set(out)) != len(out):
        raise InputError(f"expected distinct layers, found repeats in {out}")
    return out


def _scales(scales) -> list[float]:
    if _is_num(scales):
        scales = [scales]
    if not isinstance(scales, (list, tuple, np.ndarray)) or len(scales) == 0 or not all(_is_num(s) for s in scales):
        raise InputError(f"expected scales as a non-empty list of numbers, found {scales!r:.80}")
    out = [float(s) for s in scales]
    if not all(math.isfinite(s) for s in out):
        raise InputError(f"expected finite scales, found {out}")
    if len(set(out)) != len(out):
        raise InputError(f"expected distinct scales, found repeats in {out}")
    return out


# ----------------------------------------------------------------------------- the runs
def _chunks(n: int, size: int):
    for i in range(0, n, size):
        yield range(i, min(i + size, n))


def _prompt_ids(toks: Tokens) -> list[list[int]]:
    return [toks.input_ids[b][toks.attention_mask[b].bool()].tolist() for b in range(len(toks))]


def _resid_norms(sm: "SteerModel", site_of: Mapping[int, str], ids: list[list[int]], batch_size: int
                 ) -> dict[int, float]:
    """Each grid layer's mean residual norm at its steered site (``site_of[layer]``) over the prompts' tokens
    (each row's first token, an attention sink with an outsized norm, left out)."""
    layers, sites = list(site_of), list(site_of.values())
    tot = {s: 0.0 for s in sites}
    cnt = 0
    for rows in _chunks(len(ids), batch_size):
        with sm.record(sites, positions="all", device="cpu") as cache:
            sm.forward(sm.pad([ids[i] for i in rows]))
        lens = cache.lengths(sites[0])
        keep = torch.arange(cache[sites[0]].shape[1])[None, :]
        m = (keep >= 1) & (keep < lens[:, None])
        cnt += int(m.sum())
        for s in sites:
            tot[s] += float(cache[s].float().norm(dim=-1)[m].sum())
    if cnt == 0:
        raise InputError("expected prompts of at least two tokens to measure residual norms, found shorter ones")
    return {l: tot[s] / cnt for l, s in zip(layers, sites)}


@dataclasses.dataclass
class _Rows:
    """Every generation of a tune: row ``r`` is prompt ``prompt[r]`` under cell ``cell[r]`` (None: baseline)."""

    prompt: list
    cell: list
    tokens: list  # completion token ids per row
    texts: list


def _generate_rows(sm: "SteerModel", ids: list[list[int]], plan: list, steer_of, *, max_new_tokens: int,
                   batch_size: int, batched: bool, bar, start_of: Optional[Mapping] = None) -> _Rows:
    """Generate every row of ``plan`` ((prompt index, cell index or None) pairs). Batched: the rows in plan
    order (baseline, then the cells layer by layer), ``batch_size`` rows a call with a per-row steering;
    else one call per cell (the baseline is a cell), the cell's steering on every row.

    ``start_of`` (cell index -> the first block its steering acts at): the prompts run once unsteered,
    ``batch_size`` at a time (:func:`~steerkit.reuse.run_cached`), and each call on them starts its
    prompt pass at the lowest first block of its rows (the last block when no row is steered,
    :func:`~steerkit.generation.generate_from`). Without it every call runs the whole prompt."""
    toks: list = [None] * len(plan)
    for part, rc in _prompt_groups(sm, ids, batch_size, start_of is not None):
        local = {p: i for i, p in enumerate(part)}
        for rows in _calls(plan, [r for r, (p, _) in enumerate(plan) if p in local], batch_size, batched):
            cells = [plan[r][1] for r in rows]
            with _steering(sm, cells, steer_of, batched, f"tune generate x{len(rows)}"):
                if rc is None:
                    out = sm.generate(sm.pad([ids[plan[r][0]] for r in rows]), max_new_tokens=max_new_tokens,
                                      return_tokens=True)
                else:
                    out = generate_from(sm, _first_block(sm, cells, start_of), rc, [local[plan[r][0]] for r in rows],
                                        max_new_tokens=max_new_tokens, return_tokens=True)
            for r, t in zip(rows, out):
                toks[r] = list(t)
            bar.update(len(rows))
    return _texts(sm, plan, toks)


def _prompt_groups(sm: "SteerModel", ids: list[list[int]], batch_size: int, cached: bool):
    """``(prompt indices, RunCache or None)``: every prompt in one group without a cache, else groups of
    ``batch_size`` prompts, each run once unsteered (only the last position's logits kept)."""
    if not cached:
        yield range(len(ids)), None
        return
    for part in _chunks(len(ids), batch_size):
        yield part, run_cached(sm, sm.pad([ids[p] for p in part]), keep=1)


def _calls(plan: list, rows: list[int], batch_size: int, by_row: bool) -> list[list[int]]:
    """``rows`` of ``plan`` (items ``(prompt, cell)``) split into calls of at most ``batch_size``: in
    order (``by_row``: each row steered its own way), or cell by cell."""
    if by_row:
        return [[rows[i] for i in ch] for ch in _chunks(len(rows), batch_size)]
    by_cell: dict = {}
    for r in rows:
        by_cell.setdefault(plan[r][1], []).append(r)
    return [[rs[i] for i in ch] for rs in by_cell.values() for ch in _chunks(len(rs), batch_size)]


def _steering(sm: "SteerModel", cells: list, steer_of, by_row: bool, label: str):
    """The steering scope of one call over rows of ``cells`` (None: unsteered): per row, or the one cell's."""
    if all(c is None for c in cells):
        return contextlib.nullcontext()
    if by_row:
        return sm.steer(rows=[None if c is None else steer_of(c) for c in cells], label=label)
    return sm.steer(steer_of(cells[0]), label=label)


def _first_block(sm: "SteerModel", cells: list, start_of: Mapping) -> int:
    """The lowest first block of ``cells``' steerings (the last block when none is steered)."""
    return min((start_of[c] for c in cells if c is not None), default=sm.n_layers - 1)


def _texts(sm: "SteerModel", plan: list, toks: list) -> _Rows:
    texts = [sm.tokenizer.decode(t, skip_special_tokens=True) for t in toks]
    return _Rows([p for p, _ in plan], [c for _, c in plan], toks, texts)


def _start_layers(sm: "SteerModel", ivs: Mapping) -> Optional[dict]:
    """Each steered cell's first block: the lowest block among its interventions' sites and their
    conditions' sites (the last block for a site after every block); ``None`` when a site is not a hook
    name of this model (the full passes then report it)."""
    out = {}
    for c, group in ivs.items():
        layers = []
        for iv in group:
            sites = [iv.site] + ([k.site for k in iv.when.conditions] if getattr(iv, "when", None) is not None else [])
            for site in sites:
                try:
                    layer = sm.hooks.parse(site).layer
                except HookNameError:
                    return None
                layers.append(sm.n_layers - 1 if layer is None else int(layer))
        out[c] = min(layers, default=sm.n_layers - 1)
    return out


def _score_rows(sm: "SteerModel", ids: list[list[int]], rows: _Rows, probe: Optional[Probe], *, batch_size: int,
                bar) -> tuple[list[float], list[int], list]:
    """Unsteered forwards of prompt + completion: per row the completion's summed NLL, its token count and
    (with a probe) the probe's input activation. Without a probe, each prompt's KV cache is computed once
    and every row feeds only its completion (:func:`~steerkit.generation.continuation_logprobs`); a probe
    reads activations along the whole row, so its rows go through one full forward each."""
    count = [len(t) for t in rows.tokens]
    if probe is None:
        lps = continuation_logprobs(sm, ids, list(zip(rows.prompt, rows.tokens)), batch_size=batch_size,
                                    progress=bar.update)
        return [float(-lp.double().sum()) for lp in lps], count, [None] * len(lps)
    vocab = int(sm.adapter.unembed_module(sm.hf_model).weight.shape[0])
    seqs = [ids[p] + t for p, t in zip(rows.prompt, rows.tokens)]
    longest = max(len(s) for s in seqs)
    size = max(1, min(batch_size, (1 << 27) // max(1, longest * vocab)))
    nll: list[float] = [0.0] * len(seqs)
    acts: list = [None] * len(seqs)
    hook = f"blocks.{probe.layer}.{probe.hook_site}"
    for part in _chunks(len(seqs), size):
        batch = sm.pad([seqs[r] for r in part])
        with sm.record([hook], positions="all", device="cpu") as cache:
            logits = sm.forward(batch)
        rec = cache[hook]
        P = batch.input_ids.shape[1]
        for i, r in enumerate(part):
            k = count[r]
            if k:
                lp = torch.log_softmax(logits[i, P - k - 1:P - 1].float(), dim=-1)
                tgt = batch.input_ids[i, P - k:].to(lp.device)
                nll[r] = float(-lp.gather(-1, tgt[:, None]).sum())
            acts[r] = _probe_row(probe, rec[i], len(ids[rows.prompt[r]]), len(seqs[r]))
        bar.update(len(part))
    return nll, count, acts


def _kl_cells(sm: "SteerModel", neutral_ids: list[list[int]], cells: list, steer_of, *, batch_size: int,
              batched: bool, bar, start_of: Optional[Mapping] = None) -> dict:
    """``KL(unsteered || steered)`` at the last position, averaged over the neutral prompts, per cell index.
    The neutral prompts go in groups of ``batch_size``; each group's unsteered distributions come from one
    pass, then its (cell, prompt) rows: batched, cell by cell ``batch_size`` rows a pass with a per-row
    steering; else one pass per cell. ``start_of`` (cell index -> the first block its steering acts at):
    the unsteered pass is kept (:func:`~steerkit.reuse.run_cached`) and every steered pass runs from the
    lowest first block of its rows (:func:`~steerkit.reuse.run_from`); without it every pass is a full
    forward. Only the last position is unembedded."""
    n = len(neutral_ids)
    kl_sum = {c: 0.0 for c in cells}
    for part in _chunks(n, batch_size):
        toks = sm.pad([neutral_ids[j] for j in part])
        rc = run_cached(sm, toks, keep=1) if start_of is not None else None
        base = torch.log_softmax((sm.forward(toks, logits_to_keep=1) if rc is None else rc.logits)[:, -1].float(), -1)
        bar.update(len(part))
        plan = [(i, c) for c in cells for i in range(len(part))]  # (prompt, cell), cell by cell
        for rows in _calls(plan, list(range(len(plan))), batch_size, batched):
            row_cells = [plan[r][1] for r in rows]
            with _steering(sm, row_cells, steer_of, batched, f"tune kl x{len(rows)}"):
                if rc is None:
                    logits = sm.forward(sm.pad([neutral_ids[part[plan[r][0]]] for r in rows]), logits_to_keep=1)
                else:
                    logits = run_from(sm, _first_block(sm, row_cells, start_of), rc, rows=[plan[r][0] for r in rows],
                                      keep=1)
            lq = torch.log_softmax(logits[:, -1].float(), dim=-1)
            for k, r in enumerate(rows):
                i, c = plan[r]
                kl_sum[c] += float((base[i].exp() * (base[i] - lq[k])).sum())
            bar.update(len(rows))
    return {c: max(0.0, kl_sum[c] / n) for c in cells}


def tune(sm: "SteerModel", artifact, prompts: Sequence[str], *, layers: Optional[Sequence[int]] = None,
         scales: Sequence[float] = (0.0, 2.0, 4.0, 8.0), concept, neutral: Optional[Sequence[str]] = None,
         max_new_tokens: int = 32, batch_size: int = 64, rule: Union[Rule, Mapping, None] = None,
         n_boot: int = 1000, alpha: float = 0.05, seed: int = 0, normalize: Optional[str] = None,
         chat: bool = True, repetition_n: int = 3, repetition_bound: float = 0.5, batched: bool = True,
         override: bool = False, progress: bool = True, reuse: bool = True, executor=None) -> TuneResult:
    """Steer ``prompts`` with ``artifact`` at every ``layers`` x ``scales`` cell; score the concept and the
    damage of each cell, find the Pareto front and recommend a cell (the module docstring defines every
    score, the scale, the front and the rule).

    ``artifact``: a :class:`~steerkit.vectors.SteeringVector` (``"add"``), a
    :class:`~steerkit.vectors.DirectionSet` or a direction tensor ``[d_model]``. ``layers``: the grid's
    layers (default: the vector's own layers, when it has several). ``scales``: the strengths (0 is the
    unsteered baseline). ``concept``: a :class:`~steerkit.vectors.Probe`, a callable
    ``fn(prompts, completions) -> scores`` or substring rules (``{"contains": [...], "absent": [...]}`` or
    a list of strings). ``neutral``: prompts for the KL (default :data:`NEUTRAL_PROMPTS`). Generations are
    greedy, ``max_new_tokens`` long at most, with the chat template when ``chat``; ``batch_size`` rows share
    one generate / forward call. ``rule``: a :class:`Rule` or a dict of its fields. ``n_boot`` / ``alpha`` /
    ``seed``: the concept's bootstrap interval. ``normalize``: ``None`` (the vector as it is), ``"unit"``
    or ``"resid"`` (see the module docstring). ``batched=False`` runs each cell as its own
    ``sm.generate`` / forward calls with the cell's steering on every row (the reference the batched path
    equals). ``override`` skips the artifact's model check; ``progress`` shows a tqdm bar over rows.
    ``reuse`` (on a model whose backend runs a range of blocks, :func:`~steerkit.reuse.supports_run_from`, and
    no other hooks on it): steered passes start at the cell's layer from an unsteered pass (the module
    docstring); ``False`` runs every pass through the whole model. Both give the same result up to float
    rounding. ``executor`` (a :class:`steerkit.executors.RayExecutor` whose workers load this model): each
    layer's cells (with the unsteered baseline) run on a worker, and the cells are merged here, the Pareto
    front and the recommendation taken over all of them; the same result up to float rounding.

    Examples:
        >>> from steerkit.probes import tune
        >>> v = torch.ones(tiny.d_model)
        >>> res = tune(tiny, v, ["Hi", "Tell me a joke"], layers=[1, 2], scales=[0, 4], concept=["the"],
        ...            neutral=["Hello"], max_new_tokens=4, n_boot=50, progress=False)
        >>> len(res.cells), res.cell(1, 0.0)["kl"], res.cell(2, 4.0)["kl"] > 0
        (4, 0.0, True)
    """
    prompts = _prompt_list(prompts, "prompts")
    neutral = _prompt_list(list(NEUTRAL_PROMPTS) if neutral is None else neutral, "neutral prompts")
    max_new_tokens = _int_arg(max_new_tokens, "max_new_tokens", 1)
    batch_size = _int_arg(batch_size, "batch_size", 1)
    n_boot = _int_arg(n_boot, "n_boot", 1)
    repetition_n = _int_arg(repetition_n, "repetition_n", 1)
    seed = _int_arg(seed, "seed", 0)
    if not _is_num(alpha) or not 0.0 < float(alpha) < 1.0:
        raise InputError(f"expected alpha in (0, 1) (0.05: a 95% interval), found {alpha!r}")
    if not _is_num(repetition_bound) or not 0.0 <= float(repetition_bound) < 1.0:
        raise InputError(f"expected repetition_bound in [0, 1), found {repetition_bound!r}")
    if normalize not in NORMALIZE:
        raise InputError(f"expected normalize in {NORMALIZE}, found {normalize!r}")
    if chat not in (True, False) or batched not in (True, False) or reuse not in (True, False):
        raise InputError(f"expected chat, batched and reuse as True or False, found {chat!r} / {batched!r} / "
                         f"{reuse!r}")
    rule = Rule.of(rule)
    src = _source(sm, artifact, override)
    layers = _layers(sm, layers, src)
    scales = _scales(scales)
    for l in layers:
        src.tensor(l)  # every grid layer has a direction
    con = _concept(sm, concept, override)
    if normalize is not None and src.op == "ablate":
        raise InputError(f"expected normalize=None with a DirectionSet (its scale is the ablation strength), found "
                         f"{normalize!r}")
    if executor is not None:
        opts = dict(scales=scales, concept=concept, neutral=neutral, max_new_tokens=max_new_tokens,
                    batch_size=batch_size, rule=rule, n_boot=n_boot, alpha=alpha, seed=seed, normalize=normalize,
                    chat=chat, repetition_n=repetition_n, repetition_bound=repetition_bound, batched=batched,
                    override=override, progress=False, reuse=reuse)
        return _tune_spread(executor, artifact, prompts, layers, rule, opts, progress)

    ids = _prompt_ids(sm.tokenize(prompts, chat=chat))
    neutral_ids = _prompt_ids(sm.tokenize(neutral, chat=chat))
    grid, ivs, resid = _grid(sm, src, layers, scales, ids, normalize=normalize, batch_size=batch_size,
                             override=override)
    steered, steer_of = list(ivs), ivs.__getitem__
    # other hooks on the model may act below a cell's layer: then every pass runs the whole model
    start_of = _start_layers(sm, ivs) if reuse and supports_run_from(sm) and not sm.hooks.handles else None
    plan = [(p, None) for p in range(len(prompts))] + [(p, c) for c in steered for p in range(len(prompts))]
    n_kl = len(neutral) * (1 + len(steered))
    with tqdm(total=2 * len(plan) + n_kl, desc="tune", unit="row", disable=not progress, leave=False) as bar:
        bar.set_postfix_str("generate")
        rows = _generate_rows(sm, ids, plan, steer_of, max_new_tokens=max_new_tokens, batch_size=batch_size,
                              batched=batched, bar=bar, start_of=start_of)
        bar.set_postfix_str("score")
        nll, count, acts = _score_rows(sm, ids, rows, con.probe, batch_size=batch_size, bar=bar)
        bar.set_postfix_str("kl")
        kl = _kl_cells(sm, neutral_ids, steered, steer_of, batch_size=batch_size, batched=batched, bar=bar,
                       start_of=start_of)

    scores = _concept_scores(con, rows, acts, prompts)
    by_cell: dict = {}
    for r, c in enumerate(rows.cell):
        by_cell.setdefault(c, []).append(r)

    def summary(rs: list[int]) -> dict:
        sc = [float(scores[r]) for r in rs]
        tok = sum(count[r] for r in rs)
        ppl = math.exp(sum(nll[r] for r in rs) / tok) if tok else None
        rep = float(np.mean([repetition_share(rows.tokens[r], repetition_n) > repetition_bound for r in rs]))
        lo, hi = bootstrap_mean_ci(sc, n_boot=n_boot, alpha=float(alpha), seed=seed)
        return {"generations": [rows.texts[r] for r in rs], "concept": float(np.mean(sc)), "concept_ci": [lo, hi],
                "scores": sc, "perplexity": _finite_or_none(ppl), "repetition": rep}

    baseline = summary(by_cell[None])
    cells = [_cell(l, s, summary(by_cell[i]) if i in by_cell else dict(baseline), baseline, kl.get(i, 0.0))
             for i, (l, s) in enumerate(grid)]
    for c, p in zip(cells, pareto_front(cells)):
        c["pareto"] = p
    settings = {"artifact": src.label, "model": sm.name, "max_new_tokens": max_new_tokens, "batch_size": batch_size,
                "n_boot": n_boot, "alpha": float(alpha), "seed": seed, "normalize": normalize, "chat": chat,
                "repetition_n": repetition_n, "repetition_bound": float(repetition_bound), "concept": con.label,
                "site": src.site, "operation": src.op, "batched": batched,
                "resid_norms": None if resid is None else {str(l): v for l, v in resid.items()}}
    return TuneResult(layers=tuple(layers), scales=tuple(scales), prompts=tuple(prompts), neutral=tuple(neutral),
                      baseline=baseline, cells=tuple(cells), recommended=recommend(cells, rule), rule=rule,
                      concept_kind=con.kind, settings=settings)


def _tune_layer(sm: "SteerModel", layer: int, *, artifact, prompts: list[str], **options) -> TuneResult:
    return tune(sm, artifact, prompts, layers=[layer], **options)


def _tune_spread(executor, artifact, prompts: list[str], layers: list[int], rule: Rule, options: dict,
                 progress: bool) -> TuneResult:
    """:func:`tune` with each layer's cells on a worker of ``executor``; the cells merged in grid order."""
    task = functools.partial(_tune_layer, artifact=artifact, prompts=prompts, **options)
    parts: dict[int, TuneResult] = {}
    with tqdm(total=len(layers), desc="tune", unit="layer", disable=not progress, leave=False) as bar:
        for i, res in executor.imap_unordered(task, layers):
            parts[i] = res
            bar.update(1)
    ordered = [parts[i] for i in range(len(layers))]
    cells = [dict(c) for res in ordered for c in res.cells]
    for c, p in zip(cells, pareto_front(cells)):
        c["pareto"] = p
    first = ordered[0]
    norms = {k: v for res in ordered for k, v in (res.settings.get("resid_norms") or {}).items()}
    settings = {**first.settings, "resid_norms": norms or None}
    return TuneResult(layers=tuple(layers), scales=first.scales, prompts=first.prompts, neutral=first.neutral,
                      baseline=first.baseline, cells=tuple(cells), recommended=recommend(cells, rule), rule=rule,
                      concept_kind=first.concept_kind, settings=settings)


def _grid(sm: "SteerModel", src: _Source, layers: list[int], scales: list[float], ids: list[list[int]], *,
          normalize: Optional[str], batch_size: int, override: bool) -> tuple[list, dict, Optional[dict]]:
    """The grid's ``(layer, scale)`` cells (layer-major), each steered cell's interventions by cell index
    (the artifact at its layer, lowered at the cell's scale times the normalisation factor) and, with
    ``normalize="resid"``, the layers' residual norms at the steered sites."""
    facts = sm.facts
    resid = None
    if normalize == "resid":
        sites = {l: src.interventions(facts, l, 1.0, override)[0].site for l in layers}
        resid = _resid_norms(sm, sites, ids, batch_size)

    def factor(layer: int) -> float:
        if normalize is None or src.op == "ablate":
            return 1.0
        f = 1.0 / float(src.tensor(layer).norm())
        return f * resid[layer] if resid is not None else f

    grid = [(l, s) for l in layers for s in scales]
    ivs = {i: src.interventions(facts, l, s * factor(l), override) for i, (l, s) in enumerate(grid) if s != 0.0}
    return grid, ivs, resid


def _concept_scores(con: _Concept, rows: _Rows, acts: list, prompts: list[str]) -> list[float]:
    """Each row's concept score (the module docstring)."""
    if con.kind == "probe" and con.probe is not None:
        probe = con.probe
        s = probe.decision_function(torch.stack(acts).float())[:, 0].double()
        return (torch.sigmoid(s) if probe.probe_kind == "logistic" else s).tolist()
    if con.kind == "callable":
        return _callable_scores(con.fn, [prompts[p] for p in rows.prompt], rows.texts)
    return [con.substring_score(t) for t in rows.texts]


def _cell(layer: int, scale: float, m: dict, baseline: dict, kl: float) -> dict:
    """One cell of the result from its summary ``m`` (the baseline's for a scale-0 cell)."""
    ppl, bppl = m["perplexity"], baseline["perplexity"]
    ratio = None if ppl is None or bppl is None or bppl == 0 else ppl / bppl
    return {"layer": layer, "scale": scale, "concept": m["concept"], "concept_ci": m["concept_ci"],
            "scores": m["scores"], "perplexity": ppl, "ppl_ratio": _finite_or_none(ratio), "kl": kl,
            "repetition": m["repetition"], "pareto": False, "generations": m["generations"]}
