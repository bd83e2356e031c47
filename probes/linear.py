"""The logistic-regression probe, and every probe as a pickle-free :class:`~steerkit.vectors.Probe`.

How it works
------------
:func:`logistic_pipeline` is a scikit-learn ``Pipeline``: ``StandardScaler`` ->
``PCA(n_components=min(100, n_samples - 1, d_model))`` -> ``LogisticRegression(
class_weight="balanced")`` (L2, ``C=1``; solved with ``newton-cholesky``, which minimises the same
objective as the default ``lbfgs`` but is several times faster on these <=100 features).
:func:`fit_logistic` fits it on two labelled sets (or one set with
labels; 1 = positive class), so its decision function is higher for the positive class.

:func:`pipeline_to_probe` stores the fitted pipeline as arrays in a ``Probe`` artifact (no
pickle): the scaler's ``mean``/``scale``, the PCA ``components`` as ``projection``, and the
classifier's ``weight``/``bias``. The PCA's own mean is folded into the bias
(``bias' = bias - weight @ components @ pca_mean``), so the artifact's
``decision_function(x) = (((x - mean) / scale) @ projection.T) @ weight.T + bias'`` equals the
pipeline's ``decision_function`` (float64; differences are rounding, ~1e-12).
:func:`direction_to_probe` stores a :class:`~steerkit.probes.directions.Direction` the same
way (``weight = v``, ``bias = -midpoint . v``). :func:`probe_scores` evaluates any stored probe.

:func:`fit_scorer` is the uniform "fit on training rows, return a scoring function" used by the
cross-validation in :mod:`steerkit.probes.sweep`; :func:`fit_probe` fits any method and returns
the artifact directly.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError

from steerkit.vectors import Probe

from .directions import (DEFAULT_CLASSES, DIRECTION_METHODS, ArrayLike, _direction_np, _provenance,
                         as_matrix, direction_to_probe, find_direction, split_xy)

__all__ = ["METHODS", "logistic_pipeline", "fit_logistic", "pipeline_to_probe", "direction_to_probe",
           "probe_scores", "probe_direction", "fit_probe", "fit_scorer"]

METHODS = (*DIRECTION_METHODS, "logistic")


def logistic_pipeline(n_samples: int, d_model: int, *, C: float = 1.0, max_components: int = 100, seed: int = 0):
    """The unfitted pipeline: StandardScaler -> PCA(min(max_components, n-1, d)) -> balanced LogisticRegression.

    Examples:
        >>> from steerkit.probes import logistic_pipeline
        >>> pipe = logistic_pipeline(n_samples=40, d_model=576)
        >>> [name for name, _ in pipe.steps], pipe.named_steps["pca"].n_components
        (['scaler', 'pca', 'logreg'], 39)
    """
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    k = max(1, min(max_components, n_samples - 1, d_model))
    return Pipeline([
        ("scaler", StandardScaler()),
        ("pca", PCA(n_components=k, svd_solver="full")),
        ("logreg", LogisticRegression(C=C, class_weight="balanced", solver="newton-cholesky", max_iter=1000,
                                       random_state=seed)),
    ])


def _fit_pipeline(X: np.ndarray, y: np.ndarray, *, C: float = 1.0, seed: int = 0):
    if len(X) < 3:
        raise InputError(f"expected at least 3 samples to fit a logistic probe, found {len(X)}")
    pipe = logistic_pipeline(len(X), X.shape[1], C=C, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=UserWarning)  # convergence chatter on separable data
        pipe.fit(X, y)
    return pipe


def fit_logistic(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None,
                 C: float = 1.0, seed: int = 0):
    """Fit the logistic pipeline (positive class = 1); returns the sklearn ``Pipeline``.

    Examples:
        >>> from steerkit.probes import fit_logistic
        >>> pos, neg = torch.randn(20, 64) + torch.eye(64)[0], torch.randn(20, 64) - torch.eye(64)[0]
        >>> pipe = fit_logistic(pos, neg)
        >>> pipe.predict(np.stack([3 * np.eye(64)[0], -3 * np.eye(64)[0]])).tolist()
        [1, 0]
    """
    X, y = split_xy(pos, neg, labels=labels)
    return _fit_pipeline(X, y, C=C, seed=seed)


def pipeline_to_probe(pipe, layer: int, model: Any = None, *, hook_site: str = "hook_resid_post",
                      classes: Sequence[str] = DEFAULT_CLASSES, position=None, chat: bool = True,
                      prompts: Iterable[str] | None = None, metrics: dict | None = None):
    """Store a fitted logistic pipeline as a :class:`~steerkit.vectors.Probe` (arrays only).

    The stored arrays reproduce sklearn's decision values.

    Examples:
        >>> from steerkit.probes import fit_logistic, pipeline_to_probe, probe_scores
        >>> X = torch.randn(30, 64)
        >>> pipe = fit_logistic(X[:15] + 0.5, X[15:])
        >>> probe = pipeline_to_probe(pipe, layer=2, model=tiny)
        >>> bool(np.allclose(probe_scores(probe, X), pipe.decision_function(X.numpy()), atol=1e-6))
        True
    """
    try:
        sc, pca, lr = pipe.named_steps["scaler"], pipe.named_steps["pca"], pipe.named_steps["logreg"]
    except (AttributeError, KeyError):
        raise InputError("expected a pipeline from steerkit.probes.logistic_pipeline (steps scaler, pca, logreg), "
                         f"found {pipe!r:.200}") from None
    if not hasattr(lr, "coef_"):
        raise InputError("expected a fitted pipeline, found an unfitted one; call .fit(X, y) first")
    if getattr(pca, "whiten", False):
        raise InputError("expected a PCA without whitening, found whiten=True; the artifact cannot express it")
    comps = np.asarray(pca.components_, dtype=np.float64)
    w = np.asarray(lr.coef_, dtype=np.float64)
    b = np.asarray(lr.intercept_, dtype=np.float64) - w @ (comps @ np.asarray(pca.mean_, dtype=np.float64))
    mean = np.asarray(sc.mean_, dtype=np.float64) if sc.mean_ is not None else None
    scale = np.asarray(sc.scale_, dtype=np.float64) if sc.scale_ is not None else None
    params = {"position": position, "chat": chat, "n_components": int(comps.shape[0]), "C": float(lr.C),
              "class_weight": "balanced", "pipeline": "StandardScaler>PCA>LogisticRegression"}
    prov = _provenance(model, "logistic", params, prompts, metrics, hook_site, comps.shape[1])
    return Probe(torch.from_numpy(w), torch.from_numpy(b), layer=int(layer), classes=list(classes),
                 mean=None if mean is None else torch.from_numpy(mean),
                 scale=None if scale is None else torch.from_numpy(scale),
                 projection=torch.from_numpy(comps), hook_site=hook_site, probe_kind="logistic", provenance=prov)


def probe_scores(probe, x: Float[Tensor, "n d_model"] | np.ndarray) -> Float[np.ndarray, " n"]:
    """Decision values (logits; higher = positive class) of a stored probe, in float64.

    Examples:
        >>> from steerkit.probes import fit_probe, probe_scores
        >>> probe = fit_probe(torch.randn(20, 64) + torch.eye(64)[0], torch.randn(20, 64), layer=2)
        >>> scores = probe_scores(probe, torch.stack([4 * torch.eye(64)[0], -4 * torch.eye(64)[0]]))
        >>> scores.dtype, (scores > 0).tolist()
        (dtype('float64'), [True, False])
    """
    X = torch.from_numpy(as_matrix(x))
    if X.shape[1] != probe.d_model:
        raise InputError(f"expected activations of width d_model={probe.d_model} for this probe, found "
                         f"{X.shape[1]}; the probe was made for another model or hook")
    s = probe.decision_function(X)
    if s.shape[-1] != 1:
        raise InputError(f"expected a binary probe with one output, found {s.shape[-1]} outputs")
    return s[:, 0].numpy()


def probe_direction(probe) -> Float[Tensor, " d_model"]:
    """The probe's decision direction in activation space (unit norm): ``d score / d x``.

    Examples:
        >>> from steerkit.probes import fit_probe, probe_direction
        >>> probe = fit_probe(torch.randn(20, 64) + 3 * torch.eye(64)[5], torch.randn(20, 64), layer=2,
        ...                   method="diffmean")
        >>> v = probe_direction(probe)
        >>> round(float(v.norm()), 3), int(v.abs().argmax())
        (1.0, 5)
    """
    w = probe.weight.double()[0]
    if probe.projection is not None:
        w = w @ probe.projection.double()
    if probe.scale is not None:
        w = w / probe.scale.double()
    return w / w.norm()


def fit_scorer(X: np.ndarray, y: np.ndarray, method: str, *, seed: int = 0, C: float = 1.0
               ) -> Callable[[np.ndarray], np.ndarray]:
    """Fit ``method`` on ``(X, y)`` and return ``score(Z) -> [n]`` (higher = positive class).

    Examples:
        >>> from steerkit.probes.linear import fit_scorer
        >>> X = np.r_[np.random.default_rng(0).normal(size=(20, 8)) + 2, np.random.default_rng(1).normal(size=(20, 8))]
        >>> y = np.r_[np.ones(20, int), np.zeros(20, int)]
        >>> score = fit_scorer(X, y, "diffmean")
        >>> (score(np.array([np.full(8, 2.0), np.zeros(8)])) > 0).tolist()
        [True, False]
    """
    if method == "logistic":
        return _fit_pipeline(X, y, C=C, seed=seed).decision_function
    if method in DIRECTION_METHODS:
        v = _direction_np(X, y, method)
        mid = (X[y == 1].mean(0) + X[y == 0].mean(0)) / 2
        return lambda Z: (Z - mid) @ v
    raise InputError(f"expected a method in {METHODS}, found {method!r}")


def fit_probe(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None, layer: int,
              method: str = "logistic", model: Any = None, hook_site: str = "hook_resid_post",
              classes: Sequence[str] = DEFAULT_CLASSES, position=None, chat: bool = True, prompts=None,
              metrics: dict | None = None, C: float = 1.0, seed: int = 0):
    """Fit ``method`` and return it as a stored-array :class:`~steerkit.vectors.Probe`.

    Examples:
        >>> from steerkit.probes import fit_probe
        >>> pos, neg = torch.randn(20, 64) + torch.eye(64)[0], torch.randn(20, 64)
        >>> probe = fit_probe(pos, neg, layer=2, model=tiny, classes=["calm", "angry"])
        >>> probe.probe_kind, probe.layer, probe.classes, tuple(probe.projection.shape)
        ('logistic', 2, ['calm', 'angry'], (39, 64))
        >>> store.save("anger-probe", probe)
        'anger-probe@1'
    """
    if method == "logistic":
        pipe = fit_logistic(pos, neg, labels=labels, C=C, seed=seed)
        return pipeline_to_probe(pipe, layer, model, hook_site=hook_site, classes=classes, position=position,
                                 chat=chat, prompts=prompts, metrics=metrics)
    if method not in DIRECTION_METHODS:
        raise InputError(f"expected a method in {METHODS}, found {method!r}")
    d = find_direction(pos, neg, labels=labels, method=method)
    return direction_to_probe(d, layer, model, hook_site=hook_site, classes=classes, position=position, chat=chat,
                              prompts=prompts, metrics=metrics)
