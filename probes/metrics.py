"""Metrics for probes: AUROC, Youden thresholds, balanced accuracy, bootstrap intervals, CV folds.

How it works
------------
* :func:`auroc` is the Mann-Whitney statistic computed from average ranks (ties count one
  half), so it equals ``sklearn.metrics.roc_auc_score`` exactly; :func:`auroc_rows` does the
  same for many rows of scores at once (used by the bootstrap).
* :func:`youden_threshold` picks, on the scores it is given (the *training* folds' scores in
  a cross-validation), the cut that maximises Youden's J = TPR - FPR over the midpoints
  between consecutive distinct scores (plus "everything positive" / "everything negative").
  A score ``s`` is predicted positive when ``s > threshold``.
* :func:`bootstrap_auroc_ci` resamples positives and negatives separately (a stratified
  bootstrap, so no resample ever lacks a class), ``n_boot`` times with a seeded generator,
  and returns the percentile interval of the AUROC.
* :func:`make_folds` assigns each sample a fold id: stratified K-fold over samples, or, when
  ``groups`` (pair ids) are given, K-fold over groups so that both members of a contrast
  pair always fall in the same fold (the paired PCA methods need whole pairs).
"""
from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int

from steerkit.errors import InputError

__all__ = ["auroc", "auroc_rows", "youden_threshold", "balanced_accuracy", "bootstrap_auroc_ci", "make_folds",
           "check_labels"]


def check_labels(y, n: int | None = None, *, what: str = "labels") -> np.ndarray:
    """``y`` as a 0/1 int array; errors on a single class, wrong length or non-binary values.

    Examples:
        >>> from steerkit.probes.metrics import check_labels
        >>> check_labels([True, False, True]).tolist()
        [1, 0, 1]
        >>> check_labels([1, 1, 1])
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected both classes in labels, found only class 1; ...
    """
    y = np.asarray(y)
    if y.ndim != 1:
        raise InputError(f"expected {what} as a 1-D array, found shape {y.shape}")
    if n is not None and y.shape[0] != n:
        raise InputError(f"expected {n} {what} (one per sample), found {y.shape[0]}; check that the "
                         "activations and labels come from the same prompts")
    if y.dtype == bool:
        y = y.astype(np.int64)
    vals = set(np.unique(y).tolist())
    if not vals <= {0, 1}:
        raise InputError(f"expected binary {what} (0 = negative, 1 = positive), found values {sorted(vals)[:10]}")
    if len(vals) < 2:
        raise InputError(f"expected both classes in {what}, found only class {vals.pop() if vals else None!r}; "
                         "a probe needs positive and negative examples")
    return y.astype(np.int64)


def rankdata(x, axis: int = -1) -> np.ndarray:
    """Ranks from 1 along ``axis``, tied values given the mean of their ranks (``scipy.stats.rankdata``'s
    default method, without needing scipy).

    Examples:
        >>> rankdata([0.5, 0.1, 0.5, 0.9]).tolist()
        [2.5, 1.0, 2.5, 4.0]
        >>> rankdata(np.array([[3.0, 1.0], [1.0, 1.0]]), axis=1).tolist()
        [[2.0, 1.0], [1.5, 1.5]]
    """
    a = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    n = a.shape[-1]
    flat = a.reshape(-1, n)
    order = np.argsort(flat, axis=1, kind="mergesort")
    s = np.take_along_axis(flat, order, 1)
    pos = np.broadcast_to(np.arange(n), s.shape)
    first = np.ones(s.shape, dtype=bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]  # a tie group starts here
    last = np.ones(s.shape, dtype=bool)
    last[:, :-1] = first[:, 1:]  # a tie group ends here
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=1)
    end = np.minimum.accumulate(np.where(last, pos, n)[:, ::-1], axis=1)[:, ::-1]
    ranks = np.empty(s.shape)
    np.put_along_axis(ranks, order, (start + end) / 2 + 1, 1)
    return np.moveaxis(ranks.reshape(a.shape), -1, axis)


def auroc(y: Int[np.ndarray, " n"], scores: Float[np.ndarray, " n"]) -> float:
    """Area under the ROC curve (probability a random positive outscores a random negative).

    Examples:
        >>> from steerkit.probes import auroc
        >>> auroc([1, 1, 0, 0], [0.9, 0.4, 0.5, 0.1])  # 3 of the 4 (pos, neg) pairs are ordered right
        0.75
    """
    y = np.asarray(y).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise InputError(f"expected both classes to compute an AUROC, found {n_pos} positives and {n_neg} negatives")
    r = rankdata(s)
    return float((r[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auroc_rows(pos_scores: Float[np.ndarray, "b n_pos"], neg_scores: Float[np.ndarray, "b n_neg"]
               ) -> Float[np.ndarray, " b"]:
    """AUROC of each row: positives' scores in ``pos_scores[i]``, negatives' in ``neg_scores[i]``.

    Examples:
        >>> from steerkit.probes.metrics import auroc_rows
        >>> auroc_rows(np.array([[0.9, 0.4], [1.0, 2.0]]), np.array([[0.5, 0.1], [3.0, 4.0]])).tolist()
        [0.75, 0.0]
    """
    n_pos, n_neg = pos_scores.shape[1], neg_scores.shape[1]
    r = rankdata(np.concatenate([pos_scores, neg_scores], axis=1), axis=1)
    return (r[:, :n_pos].sum(1) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def youden_threshold(y: Int[np.ndarray, " n"], scores: Float[np.ndarray, " n"]) -> float:
    """The cut maximising TPR - FPR on these scores; predict positive when ``score > threshold``.

    Candidates are the midpoints between consecutive distinct scores, and one below the
    minimum / above the maximum; ties in J go to the lowest such cut.

    Examples:
        >>> from steerkit.probes import youden_threshold
        >>> round(youden_threshold([0, 0, 1, 1], [0.1, 0.3, 0.6, 0.8]), 3)
        0.45
    """
    y = np.asarray(y).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    order = np.argsort(s, kind="stable")
    ys = y[order]
    u, first = np.unique(s[order], return_index=True)
    cand = np.concatenate([[u[0] - 1.0], (u[:-1] + u[1:]) / 2, [u[-1] + 1.0]])
    k = np.concatenate([first, [len(s)]])  # cut j predicts positive the sorted rows k[j]:
    cum_pos = np.concatenate([[0], np.cumsum(ys)])
    cum_neg = np.concatenate([[0], np.cumsum(~ys)])
    n_pos, n_neg = cum_pos[-1], cum_neg[-1]
    tpr = (n_pos - cum_pos[k]) / max(int(n_pos), 1)
    fpr = (n_neg - cum_neg[k]) / max(int(n_neg), 1)
    return float(cand[int(np.argmax(tpr - fpr))])


def balanced_accuracy(y: Int[np.ndarray, " n"], pred: Int[np.ndarray, " n"]) -> float:
    """Mean of the true-positive and true-negative rates.

    Examples:
        >>> from steerkit.probes import balanced_accuracy
        >>> balanced_accuracy([1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0])  # TPR 0.5, TNR 1.0
        0.75
    """
    y = np.asarray(y).astype(bool)
    p = np.asarray(pred).astype(bool)
    return float(0.5 * ((p & y).sum() / y.sum() + (~p & ~y).sum() / (~y).sum()))


def bootstrap_auroc_ci(y: Int[np.ndarray, " n"], scores: Float[np.ndarray, " n"], *, n_boot: int = 500,
                       alpha: float = 0.05, seed: int = 0) -> tuple[float, float]:
    """Percentile ``1 - alpha`` interval of the AUROC over a stratified bootstrap of the samples.

    Examples:
        >>> from steerkit.probes import auroc, bootstrap_auroc_ci
        >>> y = np.r_[np.ones(30, int), np.zeros(30, int)]
        >>> scores = y + np.random.default_rng(0).normal(size=60)
        >>> lo, hi = bootstrap_auroc_ci(y, scores, n_boot=200)
        >>> lo < auroc(y, scores) < hi, round(hi - lo, 1)
        (True, 0.3)
    """
    y = np.asarray(y).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    if n_boot < 1:
        raise InputError(f"expected n_boot >= 1, found {n_boot}")
    rng = np.random.default_rng(seed)
    sp, sn = s[y], s[~y]
    ip = rng.integers(0, len(sp), size=(n_boot, len(sp)))
    ineg = rng.integers(0, len(sn), size=(n_boot, len(sn)))
    a = auroc_rows(sp[ip], sn[ineg])
    lo, hi = np.quantile(a, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def make_folds(y: Int[np.ndarray, " n"], n_folds: int = 5, *, groups: Int[np.ndarray, " n"] | None = None,
               seed: int = 0) -> Int[np.ndarray, " n"]:
    """A fold id in ``[0, n_folds)`` per sample: stratified K-fold, or K-fold over ``groups``.

    Examples:
        >>> from steerkit.probes.metrics import make_folds
        >>> y = np.array([1, 1, 1, 0, 0, 0])
        >>> folds = make_folds(y, n_folds=3)
        >>> sorted(folds[y == 1].tolist()), sorted(folds[y == 0].tolist())  # each fold gets one of each class
        ([0, 1, 2], [0, 1, 2])
        >>> pairs = make_folds(y, n_folds=3, groups=np.array([0, 1, 2, 0, 1, 2]))
        >>> bool((pairs[:3] == pairs[3:]).all())  # a contrast pair stays in one fold
        True
    """
    y = np.asarray(y)
    if n_folds < 2:
        raise InputError(f"expected n_folds >= 2 for cross-validation, found {n_folds}")
    folds = np.full(len(y), -1, dtype=np.int64)
    if groups is not None:
        groups = np.asarray(groups)
        ug = np.unique(groups)
        if len(ug) < n_folds:
            raise InputError(f"expected at least n_folds={n_folds} pairs for paired cross-validation, found "
                             f"{len(ug)}; add prompts or pass a smaller n_folds")
        from sklearn.model_selection import KFold
        for k, (_, te) in enumerate(KFold(n_folds, shuffle=True, random_state=seed).split(ug)):
            folds[np.isin(groups, ug[te])] = k
        return folds
    counts = np.bincount(y.astype(np.int64), minlength=2)
    if counts.min() < n_folds:
        raise InputError(f"expected at least n_folds={n_folds} samples of each class for stratified "
                         f"cross-validation, found {counts[1]} positive and {counts[0]} negative; add prompts "
                         "or pass a smaller n_folds")
    from sklearn.model_selection import StratifiedKFold
    for k, (_, te) in enumerate(StratifiedKFold(n_folds, shuffle=True, random_state=seed).split(np.zeros(len(y)), y)):
        folds[te] = k
    return folds
