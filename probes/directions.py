"""Direction finders on recorded activations: difference of means, ``pca_diff``, ``pca_center``.

How it works
------------
Every finder takes the activations of one hook as two labelled sets (``pos``, ``neg``:
``[n, d_model]`` each) or one set with ``labels`` (1 = positive class). Inputs may be torch
tensors or numpy arrays; the maths runs in float64 numpy and results come back as float64
torch tensors. NaN/inf activations, a single class, or mismatched widths are errors.

* ``diffmean``: ``mean(pos) - mean(neg)`` (returned unnormalised by :func:`diff_of_means`).
* ``pca_diff`` (RepE / repeng): the first principal component of the paired differences
  ``pos_i - neg_i``. As in repeng (``sklearn.decomposition.PCA`` fitted on the differences),
  the differences are centred first, so the component is the axis along which the pairs'
  differences *vary* most; a perfectly constant shift is removed by that centring.
* ``pca_center`` (repeng): each pair is centred on its own midpoint ``c_i = (pos_i + neg_i)/2``
  and the first principal component of the stacked ``pos_i - c_i`` and ``neg_i - c_i`` is
  taken; this keeps the mean difference (the rows are symmetric around zero).

The paired methods pair the i-th positive with the i-th negative (in the order given, or in
order of appearance when ``labels`` are given) and need equal counts. Unlike repeng, which
flips the sign when most pairs project the wrong way, every direction here is oriented so
that the positive class projects higher *on average*: ``(mean(pos) - mean(neg)) . v > 0``.

:class:`Direction` bundles a unit vector with the class means; ``score(x)`` is the signed
distance ``(x - midpoint) . v`` (positive means "positive side"), ``to_steering_vector`` and
``to_probe`` turn it into :mod:`steerkit.vectors` artifacts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.vectors import Probe, Provenance, SteeringVector, prompts_hash

from .metrics import check_labels

__all__ = ["DIRECTION_METHODS", "Direction", "diff_of_means", "pca_diff", "pca_center", "find_direction",
           "as_matrix", "split_xy", "pair_indices"]

DIRECTION_METHODS = ("diffmean", "pca_diff", "pca_center")
PAIRED_METHODS = ("pca_diff", "pca_center")
DEFAULT_CLASSES = ("negative", "positive")
ArrayLike = Tensor | np.ndarray | Sequence


def as_matrix(x: Any, what: str = "activations") -> np.ndarray:
    """``x`` as a finite float64 ``[n, d]`` numpy array, or a clear error.

    Examples:
        >>> from steerkit.probes.directions import as_matrix
        >>> as_matrix(torch.ones(3, 4)).dtype, as_matrix([[1, 2]]).shape
        (dtype('float64'), (1, 2))
        >>> as_matrix(torch.ones(2, 3, 4))
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected activations of shape [n_samples, d_model], found shape (2, 3, 4); ...
    """
    if isinstance(x, Tensor):
        x = x.detach().to("cpu", torch.float64).numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise InputError(f"expected {what} of shape [n_samples, d_model], found shape {x.shape}; record one "
                         "hook at one position (e.g. positions='last') or index the cache first")
    if x.shape[0] == 0:
        raise InputError(f"expected at least one sample in {what}, found none")
    if not np.isfinite(x).all():
        bad = np.where(~np.isfinite(x).all(1))[0]
        raise InputError(f"expected finite {what}, found NaN or inf in rows {bad[:10].tolist()}; check the "
                         "recording (e.g. float16 overflow) and drop or re-record those prompts")
    return x


def split_xy(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """``(X [n, d], y [n])`` from two sets (positives first) or one set with ``labels``.

    Examples:
        >>> from steerkit.probes.directions import split_xy
        >>> X, y = split_xy(torch.ones(2, 4), torch.zeros(3, 4))
        >>> X.shape, y.tolist()
        ((5, 4), [1, 1, 0, 0, 0])
    """
    if neg is None and labels is None:
        raise InputError("expected two sets (pos, neg) or one set with labels=..., found only one set")
    if neg is not None and labels is not None:
        raise InputError("expected either (pos, neg) or (X, labels=...), found both neg and labels")
    if labels is not None:
        X = as_matrix(pos)
        if isinstance(labels, Tensor):
            labels = labels.cpu().numpy()
        return X, check_labels(labels, X.shape[0])
    P, N = as_matrix(pos, "positive activations"), as_matrix(neg, "negative activations")
    if P.shape[1] != N.shape[1]:
        raise InputError(f"expected positive and negative activations of the same width, found d_model "
                         f"{P.shape[1]} and {N.shape[1]}; record both sets at the same hook")
    return np.concatenate([P, N]), np.concatenate([np.ones(len(P), np.int64), np.zeros(len(N), np.int64)])


def pair_indices(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(pos_idx, neg_idx)`` pairing the k-th positive with the k-th negative.

    Examples:
        >>> from steerkit.probes.directions import pair_indices
        >>> pos_idx, neg_idx = pair_indices(np.array([1, 0, 1, 0]))
        >>> pos_idx.tolist(), neg_idx.tolist()
        ([0, 2], [1, 3])
    """
    pi, ni = np.where(y == 1)[0], np.where(y == 0)[0]
    if len(pi) != len(ni):
        raise InputError(f"expected as many positives as negatives for a paired method (pca_diff, pca_center), "
                         f"found {len(pi)} and {len(ni)}; pass contrast pairs, or use method='diffmean' or "
                         "'logistic' for unpaired sets")
    return pi, ni


def _top_component(train: np.ndarray) -> np.ndarray:
    """First principal component of ``train`` (rows centred, as sklearn's PCA does)."""
    c = train - train.mean(0, keepdims=True)
    _, s, vt = np.linalg.svd(c, full_matrices=False)
    if s.size == 0 or s[0] <= 1e-12 * max(1.0, float(np.abs(train).max())):
        raise InputError("expected the training rows to vary, found (numerically) identical rows; a principal "
                         "component is undefined -- use method='diffmean'")
    return vt[0]


def _orient(v: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    gap = (X[y == 1].mean(0) - X[y == 0].mean(0)) @ v
    return -v if gap < 0 else v


def _direction_np(X: np.ndarray, y: np.ndarray, method: str) -> np.ndarray:
    """Unit direction (oriented) of ``method`` on float64 arrays."""
    if method == "diffmean":
        v = X[y == 1].mean(0) - X[y == 0].mean(0)
        n = np.linalg.norm(v)
        if n == 0:
            raise InputError("expected different class means, found identical ones; the classes are not "
                             "separable along any mean direction")
        return v / n
    if method not in PAIRED_METHODS:
        raise InputError(f"expected a direction method in {DIRECTION_METHODS}, found {method!r}")
    pi, ni = pair_indices(y)
    if method == "pca_diff":
        v = _top_component(X[pi] - X[ni])
    else:
        c = (X[pi] + X[ni]) / 2
        v = _top_component(np.concatenate([X[pi] - c, X[ni] - c]))
    return _orient(v, X, y)


def diff_of_means(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None
                  ) -> Float[Tensor, " d_model"]:
    """``mean(pos) - mean(neg)``, unnormalised (float64).

    Examples:
        >>> from steerkit.probes import diff_of_means
        >>> diff_of_means(torch.tensor([[3.0, 1.0], [5.0, 1.0]]), torch.tensor([[0.0, 1.0]]))
        tensor([4., 0.], dtype=torch.float64)
    """
    X, y = split_xy(pos, neg, labels=labels)
    return torch.from_numpy(X[y == 1].mean(0) - X[y == 0].mean(0))


def pca_diff(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None
             ) -> Float[Tensor, " d_model"]:
    """Unit first principal component of the (centred) paired differences, positive side up.

    Pairs that differ along axis 0 by varying amounts.

    Examples:
        >>> from steerkit.probes import pca_diff
        >>> neg = torch.randn(8, 16)
        >>> pos = neg + torch.linspace(1, 4, 8)[:, None] * torch.eye(16)[0]
        >>> v = pca_diff(pos, neg)
        >>> round(float(v[0]), 3), round(float(v.norm()), 3)
        (1.0, 1.0)
    """
    X, y = split_xy(pos, neg, labels=labels)
    return torch.from_numpy(_direction_np(X, y, "pca_diff"))


def pca_center(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None
               ) -> Float[Tensor, " d_model"]:
    """Unit first principal component of pair-centred activations, positive side up.

    Each pair straddles its own centre along axis 0.

    Examples:
        >>> from steerkit.probes import pca_center
        >>> centre = 5 * torch.randn(8, 16)
        >>> gap = (2.0 * torch.eye(16)[0]) + 0.1 * torch.randn(8, 16)
        >>> v = pca_center(centre + gap, centre - gap)
        >>> bool(v[0] > 0.99)
        True
    """
    X, y = split_xy(pos, neg, labels=labels)
    return torch.from_numpy(_direction_np(X, y, "pca_center"))


@dataclasses.dataclass
class Direction:
    """A unit direction with the class means it was found from.

    ``vector`` ``[d_model]`` has unit norm; ``score(x) = (x - midpoint) . vector``.

    Examples:
        >>> from steerkit.probes import find_direction
        >>> d = find_direction(torch.randn(20, 64) + 2 * torch.eye(64)[3], torch.randn(20, 64))
        >>> d.method, round(float(d.vector.norm()), 3), d.separation > 1
        ('diffmean', 1.0, True)
        >>> (d.score(torch.stack([2 * torch.eye(64)[3], -2 * torch.eye(64)[3]])) > 0).tolist()
        [True, False]
        >>> v = d.to_steering_vector(layer=2, model=tiny)  # the class-mean gap as a steering vector
        >>> v.layers, round(float(v.directions[2].norm()), 3) == round(d.separation, 3)
        ([2], True)
    """

    vector: Float[Tensor, " d_model"]
    method: str
    pos_mean: Float[Tensor, " d_model"]
    neg_mean: Float[Tensor, " d_model"]

    @property
    def midpoint(self) -> Float[Tensor, " d_model"]:
        return (self.pos_mean + self.neg_mean) / 2

    @property
    def separation(self) -> float:
        """Gap between the class means along the direction (positive by construction)."""
        return float((self.pos_mean - self.neg_mean) @ self.vector)

    def score(self, x: Float[Tensor, "n d_model"] | np.ndarray) -> Float[Tensor, " n"]:
        X = torch.from_numpy(as_matrix(x))
        return (X - self.midpoint) @ self.vector

    def to_steering_vector(self, layer: int | Iterable[int], model: Any = None, *,
                           hook_site: str = "hook_resid_post", scale: float = 1.0, prompts=None,
                           metrics: dict | None = None, position=None):
        """A :class:`~steerkit.vectors.SteeringVector`: the unit direction times the class-mean gap
        along it (for ``diffmean`` that is exactly ``mean(pos) - mean(neg)``)."""
        return SteeringVector.from_direction(
            (self.vector * self.separation).float(), layer, model, scale=scale, hook_site=hook_site,
            method=self.method, method_params={"position": position}, prompts=prompts, metrics=metrics)

    def to_probe(self, layer: int, model: Any = None, **kw):
        """A :class:`~steerkit.vectors.Probe` scoring ``(x - midpoint) . v`` (see :func:`direction_to_probe`)."""
        return direction_to_probe(self, layer, model, **kw)


def find_direction(pos: ArrayLike, neg: ArrayLike | None = None, *, labels: ArrayLike | None = None,
                   method: str = "diffmean") -> Direction:
    """Fit ``method`` (one of :data:`DIRECTION_METHODS`) and return a :class:`Direction`.

    The default model's residual stream separates happy from sad prompts.

    Examples:
        >>> from steerkit.probes import find_direction, record_activations
        >>> happy = ["What a wonderful day!", "I love this song.", "Great news, I passed!"]
        >>> sad = ["What an awful day.", "I hate this song.", "Bad news, I failed."]
        >>> acts = record_activations(sm, happy + sad, hooks=["blocks.15.hook_resid_post"])["last"][0]
        >>> d = find_direction(acts[:3], acts[3:])
        >>> tuple(d.vector.shape), (d.score(acts) > 0).tolist()
        ((576,), [True, True, True, False, False, False])
    """
    if method not in DIRECTION_METHODS:
        raise InputError(f"expected a direction method in {DIRECTION_METHODS}, found {method!r}; for the "
                         "logistic probe use steerkit.probes.fit_probe")
    X, y = split_xy(pos, neg, labels=labels)
    v = _direction_np(X, y, method)
    return Direction(torch.from_numpy(v), method, torch.from_numpy(X[y == 1].mean(0)),
                     torch.from_numpy(X[y == 0].mean(0)))


def _provenance(model: Any, method: str, params: dict, prompts, metrics: dict | None, hook_site: str, d: int):
    kw = dict(method=method, method_params=dict(params), prompts_hash=prompts_hash(prompts),
              metrics=dict(metrics or {}), hook_site=hook_site, operation="read")
    return Provenance.from_model(model, **kw) if model is not None else Provenance(d_model=d, **kw)


def direction_to_probe(direction: Direction, layer: int, model: Any = None, *, hook_site: str = "hook_resid_post",
                       classes: Sequence[str] = DEFAULT_CLASSES, position=None, chat: bool = True,
                       prompts: Iterable[str] | None = None, metrics: dict | None = None):
    """Store a direction as a linear :class:`~steerkit.vectors.Probe` scoring ``(x - midpoint) . v``.

    Examples:
        >>> from steerkit.probes import direction_to_probe, find_direction
        >>> pos, neg = torch.randn(10, 64) + torch.eye(64)[0], torch.randn(10, 64)
        >>> d = find_direction(pos, neg)
        >>> probe = direction_to_probe(d, layer=2, model=tiny)
        >>> probe.layer, probe.probe_kind, probe.classes
        (2, 'diffmean', ['negative', 'positive'])
        >>> bool(torch.allclose(probe.decision_function(pos.double())[:, 0], d.score(pos)))
        True
    """
    v = direction.vector.double()
    b = -(direction.midpoint.double() @ v)
    params = {"position": position, "chat": chat, "separation": direction.separation}
    prov = _provenance(model, direction.method, params, prompts, metrics, hook_site, int(v.shape[0]))
    return Probe(v[None, :].clone(), b.reshape(1), layer=int(layer), classes=list(classes), hook_site=hook_site,
                 probe_kind=direction.method, provenance=prov)
