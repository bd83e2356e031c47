"""Fitting CAST conditions (Lee et al. 2024, "Programming Refusal with Conditional Activation Steering").

How it works
------------
:func:`fit_condition` takes prompts that should make a condition fire (``matching_prompts``) and
prompts that should not (``other_prompts``) and returns a :class:`steerkit.vectors.ConditionVector`:

1. ONE batched recording pass (a progress bar over the batches) records the site (``resid_pre`` by
   default: the input of block ``l``, where IBM's CAST reads its condition) at every candidate layer
   at once, and aggregates each prompt's tokens (``"mean"`` over the real prompt tokens, or the
   ``"last"`` one) with :func:`steerkit.interventions.aggregate_rows`, the function the compiled
   evaluator calls.
2. Per layer, the condition direction is found from the two sets by
   :func:`steerkit.probes.find_direction` (``pca_center`` by default: pairs the i-th matching prompt
   with the i-th other prompt, so the sets must be as long; ``diffmean`` for unpaired sets).
3. Each prompt's similarity at each layer is
   :func:`steerkit.interventions.condition_similarity` (CAST's ``cos(h, tanh(P h))`` or the
   cosine), the function the compiled evaluator calls, and the grid layer x threshold x comparator
   is searched for the best F1 (the matching prompts are the positive class), as IBM's
   ``find_best_condition_point`` does. Ties go to the lowest layer, then the first comparator given;
   the threshold is the middle of the best F1 plateau (the widest margin on the training prompts).

The F1 of every cell stays in the artifact's report (``report["grid"]``), with ``plot()`` (a heatmap
layer x threshold per comparator) and ``to_json()``. :func:`condition_confusion` scores a condition on
held-out prompts through the compiled evaluator (``ConditionVector.fires``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from steerkit.errors import InputError
from steerkit.interventions import CONDITION_AGGREGATES, CONDITION_COMPARATORS, CONDITION_MEASURES
from steerkit.interventions import aggregate_rows, condition_similarity
from steerkit.vectors import ConditionVector, Provenance, prompts_hash

from .directions import DIRECTION_METHODS, find_direction

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["CONDITION_SITES", "fit_condition", "condition_confusion", "f1_grid"]

#: the residual sites a condition can be fitted at (``blocks.{l}.hook_{site}``)
CONDITION_SITES = ("resid_pre", "resid_mid", "resid_post")
N_THRESHOLDS = 201


def _prompts(p, what: str) -> list[str]:
    if isinstance(p, str):
        raise InputError(f"expected {what} as a list of prompts, found one string; wrap it in a list")
    out = list(p) if p is not None else []
    if not out or not all(isinstance(x, str) and x for x in out):
        raise InputError(f"expected {what} as a non-empty list of non-empty strings, found "
                         f"{len(out)} items{' with a non-string or empty one' if out else ''}")
    return out


def f1_grid(sims: torch.Tensor, labels: torch.Tensor, thresholds: torch.Tensor,
            comparators: Sequence[str] = ("above", "below")) -> dict[str, torch.Tensor]:
    """Confusion counts and F1 of every comparator x layer x threshold: ``sims`` ``[layers, n]``
    (float32, as the evaluator computes them), ``labels`` ``[n]`` (1 = should fire), ``thresholds``
    ``[k]``. Returns ``{"f1", "tp", "fp", "fn", "tn"}``, each ``[comparators, layers, k]``.

    Examples:
        >>> g = f1_grid(torch.tensor([[0.1, 0.9]]), torch.tensor([0, 1]), torch.tensor([0.5]))
        >>> g["f1"].flatten()  # "above" 0.5 separates them, "below" does not
        tensor([1., 0.], dtype=torch.float64)
    """
    y = labels.bool()
    thr = thresholds.to(torch.float32)
    out: dict[str, list] = {k: [] for k in ("f1", "tp", "fp", "fn", "tn")}
    for c in comparators:
        if c not in CONDITION_COMPARATORS:
            raise InputError(f"expected comparators in {CONDITION_COMPARATORS}, found {c!r}")
        pred = sims[:, None, :] > thr[None, :, None] if c == "above" else sims[:, None, :] < thr[None, :, None]
        tp = (pred & y).sum(-1)
        fp = (pred & ~y).sum(-1)
        fn = (~pred & y).sum(-1)
        tn = (~pred & ~y).sum(-1)
        den = (2 * tp + fp + fn).double()
        out["f1"].append(torch.where(den > 0, 2 * tp.double() / den.clamp_min(1), torch.zeros_like(den)))
        for k, v in (("tp", tp), ("fp", fp), ("fn", fn), ("tn", tn)):
            out[k].append(v)
    return {k: torch.stack(v) for k, v in out.items()}


def fit_condition(sm: "SteerModel", matching_prompts: Iterable[str], other_prompts: Iterable[str], *,
                  layers: Optional[Iterable[int]] = None, site: str = "resid_pre", method: str = "pca_center",
                  thresholds: Optional[Iterable[float]] = None, comparators: Sequence[str] = ("above", "below"),
                  aggregate: str = "mean", measure: str = "cast", chat: bool = True, batch_size: int = 16,
                  progress: bool = True) -> ConditionVector:
    """Fit a CAST condition: a direction per layer from the two prompt sets, then the grid search
    layer x threshold x comparator for the best F1 (see the module docstring). ``layers``: the
    candidate blocks (default every block but the first, as IBM searches); ``site``: one of
    :data:`CONDITION_SITES` (default ``"resid_pre"``, the block's input); ``thresholds``: the grid
    (default 201 values spanning every similarity seen).

    Examples:
        >>> from steerkit.probes import fit_condition
        >>> food = ["How do I bake bread?", "Best pasta sauce?", "How to roast potatoes?", "A soup recipe?"]
        >>> other = ["How do I fix a bike?", "What is gravity?", "Who wrote Hamlet?", "How do tides work?"]
        >>> cv = fit_condition(tiny, food, other, layers=[1, 2], progress=False)
        >>> cv.site.endswith("hook_resid_pre"), tuple(cv.report["grid"].shape), cv.report["f1"] > 0.5
        (True, (2, 2, 201), True)
    """
    pos, neg = _prompts(matching_prompts, "matching_prompts"), _prompts(other_prompts, "other_prompts")
    if site not in CONDITION_SITES:
        raise InputError(f"expected site in {CONDITION_SITES}, found {site!r}")
    if method not in DIRECTION_METHODS:
        raise InputError(f"expected method in {DIRECTION_METHODS}, found {method!r}")
    if aggregate not in CONDITION_AGGREGATES:
        raise InputError(f"expected aggregate in {CONDITION_AGGREGATES}, found {aggregate!r}")
    if measure not in CONDITION_MEASURES:
        raise InputError(f"expected measure in {CONDITION_MEASURES}, found {measure!r}")
    comps = list(comparators)
    if not comps or len(set(comps)) != len(comps) or any(c not in CONDITION_COMPARATORS for c in comps):
        raise InputError(f"expected distinct comparators from {CONDITION_COMPARATORS}, found {comps!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"expected batch_size as a positive int, found {batch_size!r:.60}")
    if site == "resid_mid" and not sm.hooks.has_resid_mid:
        raise InputError(f"expected a model with hook_resid_mid for site='resid_mid', found {sm.name!r} without it "
                         "(parallel blocks); use 'resid_pre' or 'resid_post'")
    ls = list(range(1, sm.n_layers) if sm.n_layers > 1 else [0]) if layers is None else list(layers)
    if not ls or len(set(ls)) != len(ls) or any(isinstance(l, bool) or not isinstance(l, int) or not
                                                0 <= l < sm.n_layers for l in ls):
        raise InputError(f"expected distinct layers in 0..{sm.n_layers - 1}, found {ls!r:.100}")
    hooks = [f"blocks.{l}.hook_{site}" for l in ls]
    prompts = pos + neg
    labels = torch.tensor([1] * len(pos) + [0] * len(neg))

    # 1. one batched recording pass, every layer at once, each prompt aggregated as the evaluator does
    per_layer: list[list[torch.Tensor]] = [[] for _ in ls]
    starts = range(0, len(prompts), batch_size)
    for i in tqdm(starts, desc="condition: recording", disable=not progress, total=len(starts)):
        with sm.record(hooks, positions="prompt") as cache:
            sm.forward(prompts[i:i + batch_size], chat=chat)
        for j, h in enumerate(hooks):
            x, n = cache[h], cache.lengths(h)
            mask = torch.arange(x.shape[1])[None, :] < n[:, None]
            per_layer[j].append(aggregate_rows(x, mask.to(x.device), aggregate).cpu())
    H = [torch.cat(p) for p in per_layer]  # [n, d] per layer

    # 2. a direction per layer; 3. every prompt's similarity by the evaluator's formula
    dirs, sims = [], []
    for Hl in H:
        u = find_direction(Hl[labels == 1], Hl[labels == 0], method=method).vector.float()
        u = u / u.norm()
        dirs.append(u)
        sims.append(condition_similarity(Hl, u, measure))
    S = torch.stack(sims)  # [layers, n] float32
    if thresholds is None:
        lo, hi = float(S.min()), float(S.max())
        thr = torch.linspace(lo, hi, N_THRESHOLDS, dtype=torch.float64)
    else:
        try:
            thr = torch.tensor([float(t) for t in thresholds], dtype=torch.float64)
        except (TypeError, ValueError):
            raise InputError(f"expected thresholds as numbers, found {thresholds!r:.100}") from None
        if thr.numel() == 0 or not bool(torch.isfinite(thr).all()):
            raise InputError("expected a non-empty list of finite thresholds, found none or NaN/inf")
    thr = thr.to(torch.float32)  # the evaluator compares float32 similarities
    grid = f1_grid(S, labels, thr, comps)
    f1 = grid["f1"]  # [comparators, layers, k]

    # the best cell: lowest layer, first comparator, middle of the threshold plateau
    best = float(f1.max())
    if best <= 0:
        raise InputError("expected some layer and threshold to separate the prompt sets, found F1 = 0 everywhere; "
                         "check the prompts (matching first, then other) or widen layers / thresholds")
    hit = (f1 >= best - 1e-12)
    li = int(hit.any(0).any(-1).nonzero()[0])
    ci = int(hit[:, li].any(-1).nonzero()[0])
    row = hit[ci, li]
    k0 = int(row.nonzero()[0])
    k1 = k0
    while k1 + 1 < row.numel() and bool(row[k1 + 1]):
        k1 += 1
    k = (k0 + k1) // 2
    threshold = float(thr[k])
    counts = {n: int(grid[n][ci, li, k]) for n in ("tp", "fp", "fn", "tn")}
    tp, fp, fn, tn = counts["tp"], counts["fp"], counts["fn"], counts["tn"]
    metrics = {"f1": float(f1[ci, li, k]), "precision": tp / (tp + fp) if tp + fp else 0.0,
               "recall": tp / (tp + fn) if tp + fn else 0.0, "accuracy": (tp + tn) / len(prompts)}
    report = {**metrics, "confusion": counts, "n_matching": len(pos), "n_other": len(neg), "layers": ls,
              "thresholds": [float(t) for t in thr.tolist()], "comparators": comps, "grid": f1.double(),
              "method": method, "site": site}
    prov = Provenance.from_model(sm, method=method, method_params={"site": site, "aggregate": aggregate,
                                                                   "measure": measure, "chat": chat},
                                 prompts_hash=prompts_hash(prompts), metrics=dict(metrics), operation="condition")
    return ConditionVector(dirs[li], layer=ls[li], threshold=threshold, comparator=comps[ci], aggregate=aggregate,
                           measure=measure, hook_site=f"hook_{site}", chat=chat, report=report, provenance=prov)


def condition_confusion(cv: ConditionVector, sm: "SteerModel", matching_prompts: Iterable[str],
                        other_prompts: Iterable[str], *, batch_size: int = 16, progress: bool = True) -> dict:
    """``{tp, fp, fn, tn, f1, precision, recall, accuracy}`` of ``cv`` on labelled prompts, decided by
    the compiled evaluator (:meth:`ConditionVector.fires`): e.g. a held-out split.

    Examples:
        >>> from steerkit.probes import condition_confusion
        >>> from steerkit.vectors import ConditionVector
        >>> always = ConditionVector(torch.ones(64), layer=1, threshold=-1.0)
        >>> r = condition_confusion(always, tiny, ["a soup recipe?"], ["what is gravity?"])
        >>> r["tp"], r["fp"], r["fn"], r["tn"], r["recall"]
        (1, 1, 0, 0, 1.0)
    """
    pos, neg = _prompts(matching_prompts, "matching_prompts"), _prompts(other_prompts, "other_prompts")
    fired = np.array(cv.fires(sm, pos + neg, batch_size=batch_size, progress=progress), dtype=bool)
    y = np.array([True] * len(pos) + [False] * len(neg))
    tp, fp = int((fired & y).sum()), int((fired & ~y).sum())
    fn, tn = int((~fired & y).sum()), int((~fired & ~y).sum())
    return {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "f1": 2 * tp / (2 * tp + fp + fn) if tp else 0.0,
            "precision": tp / (tp + fp) if tp + fp else 0.0, "recall": tp / (tp + fn) if tp + fn else 0.0,
            "accuracy": (tp + tn) / len(y)}
