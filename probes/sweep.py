"""Layer x position sweeps of probes and directions, on activations recorded once.

How it works
------------
1. :func:`record_activations` runs the prompts through the model once (batched, chat template
   by default), with one record scope per requested position on every requested hook: an
   ``int`` is an index among the prompt's real tokens (``-1`` = last, ``-2`` = the one
   before...), ``"last"`` is the last prompt token, ``"mean"`` averages every prompt token and
   ``"first_generated"`` is the model's greedy first response token (via ``sm.generate``).
   It returns ``{position: Tensor[n_hooks, n, d_model]}`` (float32, on the CPU).
2. :func:`sweep_activations` evaluates every (hook/layer, position, method) cell with the same
   folds: out-of-fold scores from K-fold cross-validation (stratified over samples, or over
   contrast pairs when ``paired=True`` or a paired method -- ``pca_diff``/``pca_center`` -- is
   in the sweep), the AUROC of those pooled out-of-fold scores, the balanced accuracy of
   out-of-fold predictions made with a Youden threshold chosen on each fold's *training*
   scores only, and a stratified bootstrap percentile interval (``n_boot`` resamples) of the
   AUROC (the scores are resampled, the probes are not refitted). Direction methods score
   ``(x - midpoint) . v`` with the midpoint of the training folds' class means, so pooled
   out-of-fold scores share one scale.
3. The result is a :class:`SweepResult`: a tidy table with one row per layer, position and
   method that saves (``to_csv``, ``to_json``), reloads (``from_json``), prints (``table``),
   picks its ``best`` cell, plots (``plot``: :mod:`.plots.sweep`, plotly, imported when called, else matplotlib) and fits
   a stored :class:`~steerkit.vectors.Probe` on every sample at any cell (``fit``).

:func:`sweep` is the one-call entry point on a model: ``sweep(sm, prompts, labels, hooks=...,
positions=..., method=...)`` records then sweeps (``sweep(sm, *labels_for(pos, neg), ...)`` for two
prompt sets); :func:`sweep_activations` sweeps activations already recorded (``[layer, n, d_model]`` or
a ``{position: tensor}`` dict) with their labels.
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooks.names import resid_post
from steerkit.model import Tokens
from steerkit.vectors.provenance import prompts_hash

from .directions import PAIRED_METHODS, pair_indices
from .linear import METHODS, fit_probe, fit_scorer
from .metrics import (auroc, balanced_accuracy, bootstrap_auroc_ci, check_labels, make_folds,
                      youden_threshold)

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["record_activations", "sweep_activations", "sweep", "labels_for", "SweepResult", "cross_validate",
           "CVResult", "position_label"]

COLUMNS = ("layer", "hook", "position", "method", "auroc", "auroc_ci_low", "auroc_ci_high", "balanced_accuracy",
           "n_pos", "n_neg", "n_folds")


NAMED_POSITIONS = ("last", "mean", "first_generated")


def position_label(p) -> str:
    """The label of a position in sweep results (``"last"``, ``"mean"``, ``"first_generated"`` or an int as
    text); :class:`~steerkit.errors.InputError` for anything else.

    Examples:
        >>> from steerkit.probes.sweep import position_label
        >>> position_label(-1), position_label("mean")
        ('-1', 'mean')
    """
    if isinstance(p, bool) or not isinstance(p, (int, str)) or (isinstance(p, str) and p not in NAMED_POSITIONS
                                                                   and not p.lstrip("-").isdigit()):
        raise InputError(f"expected a position in {NAMED_POSITIONS} or an int (index among the prompt's tokens, "
                         f"-1 = last), found {p!r}")
    return str(p)


@torch.inference_mode()
def record_activations(sm: "SteerModel", prompts: Sequence[str], *, hooks: str | Iterable[str] | None = None,
                       positions: Sequence[int | str] = ("last",), chat: bool = True, batch_size: int = 16
                       ) -> dict[str, Float[Tensor, "hook n d_model"]]:
    """Record ``hooks`` (default: every block's ``hook_resid_post``) in one pass; one tensor per position.

    Each forward runs under one record scope per position (``"last"``, a single token index, or
    ``"prompt"`` for ``"mean"``), so only the requested tokens are kept (``"mean"`` keeps a
    batch's prompt tokens until it has averaged them). ``"first_generated"`` is the model's own
    greedy first response token, fed back: the batch is then run through ``sm.generate`` for two
    tokens instead of one forward (the other positions are recorded from the same pass; a
    causal model's activation there does not depend on later tokens). Returns float32
    ``{position: [hook, n, d]}``.

    Examples:
        >>> from steerkit.probes import record_activations
        >>> acts = record_activations(tiny, ["Hello there", "Good night"], hooks=["blocks.1.hook_resid_post",
        ...                           "blocks.3.hook_resid_post"], positions=["last", "mean", -2])
        >>> {p: tuple(a.shape) for p, a in acts.items()}
        {'last': (2, 2, 64), 'mean': (2, 2, 64), '-2': (2, 2, 64)}
    """
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to record, found an empty list")
    if isinstance(positions, (str, int)):
        positions = [positions]
    labels = list(dict.fromkeys(position_label(p) for p in positions))
    if not labels:
        raise InputError("expected at least one position, found none")
    names = sm.hooks._names(hooks if hooks is not None else resid_post(range(sm.n_layers)))
    specs = {p: ("prompt" if p == "mean" else "last" if p == "last" else "generated" if p == "first_generated"
                 else [int(p)]) for p in labels}
    out: dict[str, list[Tensor]] = {p: [] for p in labels}
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b:b + batch_size]
        toks = sm.tokenize(batch, chat=chat)
        with contextlib.ExitStack() as stack:
            caches = {p: stack.enter_context(sm.record(names, positions=spec, device="cpu"))
                      for p, spec in specs.items() if p != "first_generated"}
            logits = sm.forward(toks, logits_to_keep=1)
        if "first_generated" in specs:  # the greedy first token fed after the prompt (EOS included)
            first = logits[:, -1].argmax(-1, keepdim=True).to(toks.input_ids.device)
            fed = Tokens(torch.cat([toks.input_ids, first], 1),
                         torch.cat([toks.attention_mask, torch.ones_like(first)], 1))
            with sm.record(names, positions="last", device="cpu") as caches["first_generated"]:
                sm.forward(fed)
        for p, cache in caches.items():
            if p in ("last", "first_generated"):
                t = torch.stack([cache[n] for n in names])  # [hook, batch, d]
            else:
                lengths = cache.lengths(names[0])
                if p != "mean" and bool((lengths == 0).any()):
                    r = int((lengths == 0).nonzero()[0, 0])
                    n_tok = len(sm.tokenize(batch[r], chat=chat).input_ids[0])
                    raise InputError(f"expected prompt {b + r} to have a token at position {p}, found only "
                                     f"{n_tok} tokens; use positions within every prompt's length (negative "
                                     "indices count from the end)")
                full = torch.stack([cache[n] for n in names])  # [hook, batch, n_max, d], zero padded
                if p == "mean":
                    t = full.sum(2) / lengths.to(full.dtype).clamp_min(1)[None, :, None]
                else:
                    t = full[:, :, 0]
            out[p].append(t.float())
    return {p: torch.cat(v, 1) for p, v in out.items()}


@dataclasses.dataclass
class CVResult:
    """Out-of-fold results of one cell: ``scores``/``pred`` per sample, one ``threshold`` per fold.

    Examples:
        >>> from steerkit.probes import cross_validate
        >>> y = np.r_[np.ones(10, int), np.zeros(10, int)]
        >>> cv = cross_validate(np.random.default_rng(0).normal(size=(20, 8)) + y[:, None], y, "diffmean",
        ...                     folds=np.arange(20) % 2)
        >>> cv.scores.shape, cv.pred.shape, cv.thresholds.shape
        ((20,), (20,), (2,))
    """

    scores: np.ndarray
    pred: np.ndarray
    thresholds: np.ndarray
    folds: np.ndarray


def cross_validate(X: Float[np.ndarray, "n d"], y, method: str, folds, *, seed: int = 0) -> CVResult:
    """Out-of-fold scores of ``method``; each fold's Youden threshold comes from its training rows only.

    Examples:
        >>> from steerkit.probes import auroc, cross_validate
        >>> from steerkit.probes.metrics import make_folds
        >>> y = np.r_[np.ones(20, int), np.zeros(20, int)]
        >>> X = np.random.default_rng(0).normal(size=(40, 16)) + 3 * y[:, None] * np.eye(16)[0]
        >>> cv = cross_validate(X, y, "logistic", make_folds(y, 4))
        >>> auroc(y, cv.scores) > 0.8, sorted(set(cv.folds.tolist()))
        (True, [0, 1, 2, 3])
    """
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y)
    folds = np.asarray(folds)
    K = int(folds.max()) + 1
    scores = np.zeros(len(y))
    pred = np.zeros(len(y), dtype=np.int64)
    thr = np.zeros(K)
    for k in range(K):
        te, tr = folds == k, folds != k
        if len(np.unique(y[tr])) < 2:
            raise InputError(f"expected both classes in the training rows of fold {k}, found one; use more "
                             "prompts of each class or fewer folds")
        score = fit_scorer(X[tr], y[tr], method, seed=seed)
        thr[k] = youden_threshold(y[tr], score(X[tr]))
        scores[te] = score(X[te])
        pred[te] = scores[te] > thr[k]
    return CVResult(scores, pred, thr, folds)


def _normalize_acts(acts, position: str = "given") -> dict[str, np.ndarray]:
    if isinstance(acts, Mapping):
        items = list(acts.items())
    else:
        items = [(position, acts)]
    out = {}
    for p, a in items:
        if isinstance(a, Tensor):
            a = a.detach().to("cpu", torch.float64).numpy()
        a = np.asarray(a, dtype=np.float64)
        if a.ndim == 2:
            a = a[None]
        if a.ndim != 3:
            raise InputError(f"expected activations of shape [layer, n_samples, d_model], found {a.shape} at "
                             f"position {p!r}")
        out[str(p)] = a
    shapes = {a.shape for a in out.values()}
    if len(shapes) != 1:
        raise InputError(f"expected every position's activations to have the same shape, found {sorted(shapes)}")
    return out


def sweep_activations(acts: Float[Tensor, "layer n d_model"] | Float[np.ndarray, "layer n d_model"] | Mapping,
                      labels, *, method: str | Sequence[str] = "logistic", layers: Sequence[int] | None = None,
                      hooks: Sequence[str] | None = None, n_folds: int = 5, n_boot: int = 500, seed: int = 0,
                      meta: dict | None = None, paired: bool | None = None, folds=None,
                      n_threads: int | None = 1, position: str = "given") -> "SweepResult":
    """Sweep every layer x position x method of ``acts`` (``[layer, n, d]`` or ``{position: [layer, n, d]}``).

    ``labels``: one 0/1 label per sample (the ``n`` axis). ``position``: the position label the rows
    of a bare ``[layer, n, d]`` array get (a dict names its positions itself).

    ``paired``: fold over contrast pairs (the k-th positive with the k-th negative) rather than
    over samples. ``None`` (default) pairs only when a paired method is in the sweep; pass
    ``True`` for contrast-pair data with any method, because splitting a pair between training
    and test folds lets the partner in the training fold drag the held-out prompt towards the
    wrong class mean (out-of-fold AUROCs then fall *below* 0.5 wherever the prompt identity
    dominates the activations). ``folds``: a fold id per sample to use instead (overrides
    ``n_folds``/``paired``; keep pairs together yourself). ``n_threads`` caps the BLAS/OpenMP
    threads while fitting (default 1: thousands of small
    fits run fastest single-threaded, and on shared machines much faster); ``None`` leaves them.

    Only layer 1 of three carries the label.

    Examples:
        >>> from steerkit.probes import sweep_activations
        >>> y = np.r_[np.ones(12, int), np.zeros(12, int)]
        >>> acts = torch.randn(3, 24, 16)
        >>> acts[1, :, 0] += 3 * torch.from_numpy(y)
        >>> res = sweep_activations(acts, y, method=["diffmean", "logistic"], n_folds=3, n_boot=50)
        >>> len(res), res.best()["layer"], res.best()["auroc"] > 0.9
        (6, 1, True)
    """
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=n_threads):
        return _sweep_activations(acts, labels, method=method, layers=layers, hooks=hooks, n_folds=n_folds,
                                  n_boot=n_boot, seed=seed, meta=meta, paired=paired, folds=folds,
                                  position=str(position))


def _sweep_activations(acts, labels, *, method, layers, hooks, n_folds, n_boot, seed, meta, paired, folds,
                       position) -> "SweepResult":
    if labels is None:
        raise InputError("expected sweep_activations(acts, labels, ...) with one 0/1 label per sample, found "
                         "labels=None")
    A = _normalize_acts(acts, position)
    L, n, d = next(iter(A.values())).shape
    y = check_labels(labels.cpu().numpy() if isinstance(labels, Tensor) else labels, n)
    for p, a in A.items():
        if not np.isfinite(a).all():
            bad = np.where(~np.isfinite(a).all(axis=(0, 2)))[0]
            raise InputError(f"expected finite activations, found NaN or inf at position {p!r} in samples "
                             f"{bad[:10].tolist()}; drop or re-record those prompts")
    methods = [method] if isinstance(method, str) else list(method)
    for m in methods:
        if m not in METHODS:
            raise InputError(f"expected methods in {METHODS}, found {m!r}")
    layers = list(range(L)) if layers is None else [int(l) for l in layers]
    if len(layers) != L:
        raise InputError(f"expected {L} layer indices (one per row of the activations), found {len(layers)}")
    hooks = list(hooks) if hooks is not None else [f"blocks.{l}.hook_resid_post" for l in layers]
    if len(hooks) != L:
        raise InputError(f"expected {L} hook names (one per row of the activations), found {len(hooks)}")
    groups = None
    needs_pairs = [m for m in methods if m in PAIRED_METHODS]
    if paired is False and needs_pairs:
        raise InputError(f"expected paired=True or None with the paired methods {needs_pairs}, found paired=False")
    if paired or needs_pairs:
        pi, ni = pair_indices(y)
        groups = np.empty(n, dtype=np.int64)
        groups[pi] = np.arange(len(pi))
        groups[ni] = np.arange(len(ni))
    unit = "given" if folds is not None else "pair" if groups is not None else "sample"
    if folds is None:
        folds = make_folds(y, n_folds, groups=groups, seed=seed)
    else:
        folds = np.asarray(folds.cpu().numpy() if isinstance(folds, Tensor) else folds).astype(np.int64)
        if folds.shape != (n,) or folds.min() < 0:
            raise InputError(f"expected folds as {n} non-negative fold ids (one per sample), found shape "
                             f"{folds.shape}")
        n_folds = int(folds.max()) + 1
    rows = []
    for li, (layer, hook) in enumerate(zip(layers, hooks)):
        for p, a in A.items():
            for m in methods:
                cv = cross_validate(a[li], y, m, folds, seed=seed)
                au = auroc(y, cv.scores)
                lo, hi = bootstrap_auroc_ci(y, cv.scores, n_boot=n_boot, seed=seed)
                rows.append({"layer": layer, "hook": hook, "position": p, "method": m, "auroc": au,
                             "auroc_ci_low": lo, "auroc_ci_high": hi,
                             "balanced_accuracy": balanced_accuracy(y, cv.pred), "n_pos": int(y.sum()),
                             "n_neg": int((1 - y).sum()), "n_folds": n_folds})
    info = {"n_boot": n_boot, "seed": seed, "n_folds": n_folds, "fold_unit": unit,
            "methods": methods, "positions": list(A), **(meta or {})}
    return SweepResult(rows, info, _acts=A, _labels=y, _layers=layers, _hooks=hooks)


def labels_for(pos: Sequence[str], neg: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """``(pos + neg, labels)``: the prompts of two sets and their 0/1 labels (1 = ``pos``), for
    ``sweep(sm, *labels_for(pos, neg), ...)``.

    Examples:
        >>> from steerkit.probes import labels_for
        >>> prompts, labels = labels_for(["I love it", "Great!"], ["I hate it"])
        >>> prompts, labels.tolist()
        (['I love it', 'Great!', 'I hate it'], [1, 1, 0])
    """
    for what, xs in (("pos", pos), ("neg", neg)):
        if isinstance(xs, str):
            raise InputError(f"expected a list of {what} prompts, found a single string; wrap it in a list")
    pos, neg = list(pos), list(neg)
    return pos + neg, np.r_[np.ones(len(pos), np.int64), np.zeros(len(neg), np.int64)]


def _is_acts(x) -> bool:
    return isinstance(x, (Tensor, np.ndarray, Mapping))


def sweep(sm: "SteerModel", prompts: Sequence[str], labels=None, *, hooks=None,
          positions: Sequence[int | str] = ("last",), method: str | Sequence[str] = "logistic", n_folds: int = 5,
          n_boot: int = 500, seed: int = 0, chat: bool = True, batch_size: int = 16, paired: bool | None = None,
          n_threads: int | None = 1) -> "SweepResult":
    """Record ``prompts`` once and sweep every hook x position x method against ``labels`` (one 0/1 per prompt).

    ``sweep(sm, prompts, labels, hooks=..., positions=[-1, "mean"], method="logistic")``; for two prompt
    sets, ``sweep(sm, *labels_for(pos, neg), ...)``. Activations already recorded go to
    :func:`sweep_activations`.

    Sentiment is linearly readable in the default model's middle layers.

    Examples:
        >>> from steerkit.probes import labels_for, sweep
        >>> happy = ["I loved this film, it was wonderful.", "What a great and happy day!",
        ...          "The food was delicious, thank you!", "This is the best news ever.",
        ...          "I am so glad you came.", "Everything went perfectly."]
        >>> sad = ["I hated this film, it was awful.", "What a terrible and sad day.",
        ...        "The food was disgusting, never again.", "This is the worst news ever.",
        ...        "I am so upset you left.", "Everything went wrong."]
        >>> res = sweep(sm, *labels_for(happy, sad), hooks=["blocks.15.hook_resid_post"], n_folds=3, n_boot=100)
        >>> best = res.best()
        >>> best["layer"], best["method"], best["auroc"] > 0.8
        (15, 'logistic', True)
        >>> res.fit().provenance.model_name  # the best cell as a stored probe
        'HuggingFaceTB/SmolLM2-135M-Instruct'
    """
    if _is_acts(sm) or _is_acts(prompts):
        found = sm if _is_acts(sm) else prompts
        raise InputError(f"expected sweep(sm, prompts, labels, ...) with a model and a list of prompts, found "
                         f"{type(found).__name__} activations; sweep recorded activations with "
                         "sweep_activations(acts, labels, ...)")
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise InputError(f"expected a list of prompts, found {type(prompts).__name__}; wrap a single prompt in "
                         "a list")
    prompts = list(prompts)
    if labels is None or isinstance(labels, str) or (
            isinstance(labels, Sequence) and any(isinstance(x, str) for x in labels)):
        raise InputError("expected sweep(sm, prompts, labels, ...) with one 0/1 label per prompt, found "
                         f"{'no labels' if labels is None else 'prompts (strings) as labels'}; for two prompt sets "
                         "call sweep(sm, *labels_for(pos, neg), ...)")
    names = sm.hooks._names(hooks if hooks is not None else resid_post(range(sm.n_layers)))
    layers = [sm.hooks.parse(h).layer for h in names]
    if any(l is None for l in layers):
        layers = list(range(len(names)))
    y = check_labels(labels.cpu().numpy() if isinstance(labels, Tensor) else labels, len(prompts))
    acts = record_activations(sm, prompts, hooks=names, positions=positions, chat=chat, batch_size=batch_size)
    meta = {"model": sm.name, "chat": chat, "prompts_hash": prompts_hash(prompts)}
    res = sweep_activations(acts, y, method=method, layers=layers, hooks=names, n_folds=n_folds,
                            n_boot=n_boot, seed=seed, meta=meta, paired=paired, n_threads=n_threads)
    res._model = sm
    res._prompts = prompts
    return res


@dataclasses.dataclass
class SweepResult:
    """A tidy table: one row per layer, position and method (columns :data:`COLUMNS`) plus ``meta``.

    Examples:
        >>> from steerkit.probes import SweepResult, sweep_activations
        >>> y = np.r_[np.ones(10, int), np.zeros(10, int)]
        >>> acts = torch.randn(2, 20, 8)
        >>> acts[1, :, 0] += 3 * torch.from_numpy(y)
        >>> res = sweep_activations(acts, y, method="diffmean", n_folds=2, n_boot=50)
        >>> print(res.table().splitlines()[0])
        layer position     method  auroc        95% CI bal_acc
        >>> SweepResult.from_json(res.to_json()).rows == res.rows, res.save(tmp_dir / "sweep.csv").name
        (True, 'sweep.csv')
        >>> res.fit().layer, type(res.plot()).__name__  # a probe at the best cell; a plotly figure
        (1, 'Figure')
    """

    rows: list[dict]
    meta: dict = dataclasses.field(default_factory=dict)
    _acts: dict | None = dataclasses.field(default=None, repr=False)
    _labels: np.ndarray | None = dataclasses.field(default=None, repr=False)
    _layers: list | None = dataclasses.field(default=None, repr=False)
    _hooks: list | None = dataclasses.field(default=None, repr=False)
    _model: Any = dataclasses.field(default=None, repr=False)
    _prompts: list | None = dataclasses.field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self):
        return iter(self.to_rows())

    def to_rows(self) -> list[dict]:
        return [dict(r) for r in self.rows]

    def select(self, *, method: str | None = None, position=None) -> list[dict]:
        pos = None if position is None else str(position)
        return [dict(r) for r in self.rows if (method is None or r["method"] == method)
                and (pos is None or r["position"] == pos)]

    def best(self, metric: str = "auroc", *, method: str | None = None, position=None) -> dict:
        """The row with the highest ``metric`` (ties: the earliest layer)."""
        rows = self.select(method=method, position=position)
        if not rows:
            raise InputError(f"expected rows for method={method!r}, position={position!r}, found none; "
                             f"methods {self.meta.get('methods')}, positions {self.meta.get('positions')}")
        if metric not in rows[0]:
            raise InputError(f"expected a metric among {list(rows[0])}, found {metric!r}")
        return max(rows, key=lambda r: (r[metric], -r["layer"]))

    def pivot(self, metric: str = "auroc", *, method: str | None = None) -> tuple[list[int], list[str], np.ndarray]:
        """``(layers, positions, values [layer, position])`` of one method (default: the first)."""
        method = method or self.rows[0]["method"]
        layers = sorted({r["layer"] for r in self.rows})
        positions = list(dict.fromkeys(r["position"] for r in self.rows))
        v = np.full((len(layers), len(positions)), np.nan)
        for r in self.rows:
            if r["method"] == method:
                v[layers.index(r["layer"]), positions.index(r["position"])] = r[metric]
        return layers, positions, v

    # --- saving -----------------------------------------------------------------
    def to_csv(self, path=None) -> str:
        """The table as CSV (written to ``path`` when given); returns the text."""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in self.rows:
            w.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in r.items()})
        text = buf.getvalue()
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    def to_json(self, path=None) -> str:
        """``{"meta": ..., "rows": [...]}`` as JSON (written to ``path`` when given); returns the text."""
        text = json.dumps({"format": "steerkit.sweep/1", "meta": self.meta, "rows": self.rows}, indent=1,
                          allow_nan=False, default=str)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_json(cls, text_or_path) -> "SweepResult":
        p = Path(text_or_path) if not str(text_or_path).lstrip().startswith("{") else None
        data = json.loads(p.read_text(encoding="utf-8") if p is not None else text_or_path)
        if not isinstance(data, dict) or data.get("format") != "steerkit.sweep/1":
            raise InputError(f"expected a steerkit sweep JSON (format 'steerkit.sweep/1'), found "
                             f"{str(data)[:80]!r}")
        return cls(list(data["rows"]), dict(data.get("meta", {})))

    def save(self, path) -> Path:
        """Save by suffix: ``.csv``, ``.json``, or ``.html`` / ``.png`` / ``.svg`` (the plot)."""
        p = Path(path)
        if p.suffix == ".csv":
            self.to_csv(p)
        elif p.suffix == ".json":
            self.to_json(p)
        elif p.suffix in (".html", ".png", ".svg", ".pdf"):
            fig = self.plot()
            if hasattr(fig, "write_html"):
                fig.write_html(str(p)) if p.suffix == ".html" else fig.write_image(str(p))
            else:
                if p.suffix == ".html":
                    raise InputError("expected plotly to write .html, found only matplotlib; save .png or .svg")
                fig.savefig(p)
        else:
            raise InputError(f"expected a .csv, .json, .html, .png, .svg or .pdf path, found {p.name!r}")
        return p

    def table(self, metric: str = "auroc") -> str:
        """A plain-text table (one line per row)."""
        head = f"{'layer':>5} {'position':>8} {'method':>10} {'auroc':>6} {'95% CI':>13} {'bal_acc':>7}"
        lines = [head]
        for r in self.rows:
            lines.append(f"{r['layer']:>5} {r['position']:>8} {r['method']:>10} {r['auroc']:6.3f} "
                         f"[{r['auroc_ci_low']:.3f},{r['auroc_ci_high']:.3f}] {r['balanced_accuracy']:7.3f}")
        return "\n".join(lines)

    # --- plotting ---------------------------------------------------------------
    def series(self) -> dict[tuple[str, str], list[dict]]:
        """The rows of each ``(position, method)``, sorted by layer: one line of :meth:`plot` each."""
        series: dict[tuple[str, str], list[dict]] = {}
        for r in self.rows:
            series.setdefault((r["position"], r["method"]), []).append(r)
        return {k: sorted(rs, key=lambda r: r["layer"]) for k, rs in series.items()}

    def plot(self, metric: str = "auroc", *, backend: str | None = None, title: str | None = None):
        """A figure of ``metric`` per layer, one line per position and method (with the AUROC CI band).

        Returns a plotly ``Figure`` (preferred; the Dash app reuses it) or a matplotlib ``Figure``
        when plotly is missing; ``backend="plotly"``/``"matplotlib"`` forces one
        (:mod:`steerkit.probes.plots.sweep`, :mod:`steerkit.probes.plots.sweep_matplotlib`).
        """
        title = title or f"{metric} per layer" + (f" ({self.meta['model']})" if self.meta.get("model") else "")
        if backend in (None, "plotly"):
            try:
                from .plots import sweep as figures
            except ImportError:
                if backend == "plotly":
                    raise InputError("expected plotly to be installed for backend='plotly', found it missing; "
                                     "pip install plotly") from None
            else:
                return figures.sweep_figure(self, metric, title=title)
        try:
            from .plots import sweep_matplotlib
        except ImportError:
            raise InputError("expected plotly or matplotlib to plot, found neither; pip install plotly") from None
        return sweep_matplotlib.sweep_figure(self, metric, title=title)

    # --- fitting the chosen cell --------------------------------------------------
    def fit(self, layer: int | None = None, position=None, method: str | None = None, *,
            classes=("negative", "positive")):
        """Fit a stored-array :class:`~steerkit.vectors.Probe` on every sample at one cell (default: ``best()``)."""
        if self._acts is None:
            raise InputError("expected a sweep that still holds its activations, found one loaded from disk; "
                             "re-run the sweep or fit with steerkit.probes.fit_probe")
        if layer is None or position is None or method is None:
            b = self.best(method=method, position=position)
            layer = b["layer"] if layer is None else layer
            position = b["position"] if position is None else position
            method = b["method"] if method is None else method
        position = str(position)
        if position not in self._acts or layer not in self._layers:
            raise InputError(f"expected a layer in {self._layers} and a position in {list(self._acts)}, found "
                             f"{layer!r}, {position!r}")
        li = self._layers.index(layer)
        hook = self._hooks[li]
        if not hook.startswith("blocks."):
            raise InputError(f"expected a block hook (blocks.L.hook_...) to store a probe, found {hook!r}; a "
                             "Probe artifact is applied at a layer's hook site")
        site = hook.split(".", 2)[-1]
        metrics = {k: v for k, v in next(r for r in self.rows if r["layer"] == layer and r["position"] == position
                                         and r["method"] == method).items()
                   if k in ("auroc", "auroc_ci_low", "auroc_ci_high", "balanced_accuracy", "n_folds")}
        pos_val = int(position) if position.lstrip("-").isdigit() else position
        return fit_probe(self._acts[position][li], labels=self._labels, layer=layer, method=method,
                         model=self._model, hook_site=site, classes=classes, position=pos_val,
                         chat=bool(self.meta.get("chat", True)), prompts=self._prompts,
                         metrics={f"cv_{k}": v for k, v in metrics.items()})
