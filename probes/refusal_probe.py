"""The first-token refusal probe: is the decision to refuse readable at the start of the response?

Safety decisions are made at the start of the response, so the representation to probe is the
residual stream at the *first generated token*: the model's own greedy response is generated,
and the activations of every layer (``blocks.{l}.hook_resid_post``) are recorded at the
position of its first token (the same numbers as a teacher-forced pass over prompt + response,
computed with the KV cache during generation), and at the last prompt token for comparison.

Two label kinds, named for what they are:

* ``behaviour`` -- refusal (1) or compliance (0) of the model's own greedy generation, from the
  judge (:func:`steerkit.probes.refusal.substring_judge` by default; any
  ``judge(prompts, completions) -> list[bool]``). Needs enough refusals for two classes.
* ``prompt`` -- the prompt's harmful (1) / harmless (0) label from the data set. Small models
  refuse rarely, so this is the one that always has two classes.

The probe is the generic pipeline of :mod:`steerkit.probes.linear` (StandardScaler -> PCA to
``min(100, n - 1)`` -> balanced LogisticRegression). Per layer and position: out-of-fold AUROC
(stratified 5-fold CV) with a 500-resample bootstrap interval on the *train* prompts
(:func:`steerkit.probes.sweep_activations`), and the AUROC with its bootstrap interval on the
held-out *test* prompts of a probe fitted on all train prompts. The best layer is chosen on the
train CV AUROC only, never on the test prompts it is reported on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from steerkit.errors import InputError

POSITIONS = ("first_generated", "last_prompt")
LABEL_KINDS = ("prompt", "behaviour")


@torch.inference_mode()
def first_token_activations(sm, prompts: Sequence[str], *, max_new_tokens: int = 24, batch_size: int = 16,
                            progress=None):
    """Greedy generations and ``resid_post`` of every layer at the first generated token and at the
    last prompt token: ``(completions, {"first_generated": [L, n, d], "last_prompt": [L, n, d]})``."""
    if max_new_tokens < 2:
        raise InputError(f"expected max_new_tokens >= 2 (the first generated token must be fed back), "
                         f"found {max_new_tokens}")
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt, found an empty list")
    names = [f"blocks.{l}.hook_resid_post" for l in range(sm.n_layers)]
    comps: list[str] = []
    first, last = [], []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        with sm.record(names, positions="generated") as gen, sm.record(names, positions="last") as lst:
            comps += sm.generate(chunk, max_new_tokens=max_new_tokens)
        P = int(sm.tokenize(chunk).input_ids.shape[1])
        for n in names:
            pos = gen.positions(n)
            if not bool((pos[:, 0] == P).all()):
                raise InputError(f"expected the first generated position {P} in every row, found {pos[:, 0].tolist()}")
        first.append(torch.stack([gen[n][:, 0] for n in names]).float().cpu())
        last.append(torch.stack([lst[n] for n in names]).float().cpu())
        if progress is not None:
            progress(len(chunk))
    return comps, {"first_generated": torch.cat(first, 1), "last_prompt": torch.cat(last, 1)}


def heldout_auroc(X_train: np.ndarray, y_train: np.ndarray, X_test: np.ndarray, y_test: np.ndarray, *,
                  n_boot: int = 500, seed: int = 0) -> tuple[float, float, float]:
    """AUROC (and bootstrap interval) on the test rows of the logistic pipeline fitted on the train rows."""
    from .linear import fit_logistic
    from .metrics import auroc, bootstrap_auroc_ci, check_labels
    if X_train.ndim != 2 or X_test.ndim != 2 or X_train.shape[1] != X_test.shape[1]:
        raise InputError(f"expected train and test activations [n, d] of equal d, found {X_train.shape} and {X_test.shape}")
    for what, X in (("train", X_train), ("test", X_test)):
        if not np.isfinite(X).all():
            raise InputError(f"expected finite {what} activations, found NaN or inf")
    y_train = check_labels(y_train, len(X_train), what="train labels")
    y_test = check_labels(y_test, len(X_test), what="test labels")
    pipe = fit_logistic(X_train, labels=y_train, seed=seed)
    s = pipe.decision_function(X_test)
    lo, hi = bootstrap_auroc_ci(y_test, s, n_boot=n_boot, seed=seed)
    return auroc(y_test, s), lo, hi


@dataclass
class ProbeResult:
    rows: list[dict]
    best: dict
    probe: object  # steerkit.vectors.Probe: harmful-vs-harmless at the first generated token, best layer
    completions: dict
    refused: dict
    notes: list[str] = field(default_factory=list)

    def table(self, labels: str = "prompt", position: str = "first_generated") -> list[dict]:
        return [r for r in self.rows if r["labels"] == labels and r["position"] == position]


def probe_rows(acts: dict, labels: dict, *, n_folds: int = 5, n_boot: int = 500, seed: int = 0,
               notes: list | None = None) -> list[dict]:
    """Per label kind, position and layer: train CV AUROC (+CI) and held-out test AUROC (+CI).

    ``acts[split][position]``: ``[L, n, d]``; ``labels[split][kind]``: ``[n]`` 0/1. A label kind
    whose train labels have fewer than ``n_folds`` of a class is skipped (with a note); test
    AUROC is ``NaN`` when the test labels have one class.
    """
    from threadpoolctl import threadpool_limits

    from .sweep import sweep_activations
    notes = notes if notes is not None else []
    rows: list[dict] = []
    for kind in labels["train"]:
        ytr, yte = np.asarray(labels["train"][kind]), np.asarray(labels["test"][kind])
        cnt = np.bincount(ytr.astype(np.int64), minlength=2)
        if cnt.min() < n_folds:
            notes.append(f"{kind} labels: train has {cnt[1]} positive / {cnt[0]} negative (< {n_folds} of a class "
                         "for 5-fold CV); no probe for this label kind")
            continue
        test_ok = len(np.unique(yte)) == 2
        if not test_ok:
            notes.append(f"{kind} labels: the test prompts have one class only; no held-out AUROC")
        cv = sweep_activations({p: acts["train"][p] for p in POSITIONS}, ytr, method="logistic", n_folds=n_folds,
                               n_boot=n_boot, seed=seed)
        with threadpool_limits(limits=1):
            for r in cv.to_rows():
                p, l = r["position"], int(r["layer"])
                row = {"labels": kind, "position": p, "layer": l, "cv_auroc": r["auroc"],
                       "cv_ci": [r["auroc_ci_low"], r["auroc_ci_high"]], "cv_balanced_accuracy": r["balanced_accuracy"],
                       "n_train_pos": int(ytr.sum()), "n_train_neg": int((1 - ytr).sum()),
                       "n_test_pos": int(yte.sum()), "n_test_neg": int((1 - yte).sum()),
                       "test_auroc": float("nan"), "test_ci": [float("nan"), float("nan")]}
                if test_ok:
                    a, lo, hi = heldout_auroc(acts["train"][p][l].numpy().astype(np.float64), ytr,
                                              acts["test"][p][l].numpy().astype(np.float64), yte,
                                              n_boot=n_boot, seed=seed)
                    row["test_auroc"], row["test_ci"] = a, [lo, hi]
                rows.append(row)
    return rows


def best_row(rows: list[dict], labels: str, position: str = "first_generated") -> dict:
    """The row with the highest *train CV* AUROC (ties: earliest layer) -- never chosen on test."""
    cand = [r for r in rows if r["labels"] == labels and r["position"] == position]
    if not cand:
        raise InputError(f"expected probe rows for labels={labels!r} at {position!r}, found none")
    return max(cand, key=lambda r: (r["cv_auroc"], -r["layer"]))


def first_token_probe(sm, train: dict, test: dict, *, judge=None, max_new_tokens: int = 24, batch_size: int = 16,
                      n_folds: int = 5, n_boot: int = 500, seed: int = 0, progress=None) -> ProbeResult:
    """Generate, label, probe every layer, and build the ``refusal-probe`` artifact.

    ``train``/``test``: ``{"harmful": [...], "harmless": [...]}``. The artifact is the
    harmful-vs-harmless (``prompt`` labels) probe at the first generated token of the layer with
    the best train CV AUROC, fitted on all train prompts.
    """
    from .linear import fit_logistic, pipeline_to_probe
    from .refusal import judge_refusals, substring_judge
    judge = judge or substring_judge
    acts, labels, comps, refused = {}, {}, {}, {}
    for split, data in (("train", train), ("test", test)):
        comps[split], refused[split], parts = {}, {}, []
        for kind in ("harmful", "harmless"):
            c, a = first_token_activations(sm, data[kind], max_new_tokens=max_new_tokens, batch_size=batch_size,
                                           progress=progress)
            comps[split][kind] = c
            refused[split][kind] = judge_refusals(judge, data[kind], c)
            parts.append(a)
        acts[split] = {p: torch.cat([parts[0][p], parts[1][p]], 1) for p in POSITIONS}
        nh, na = len(data["harmful"]), len(data["harmless"])
        labels[split] = {"prompt": np.r_[np.ones(nh, np.int64), np.zeros(na, np.int64)],
                         "behaviour": np.asarray(refused[split]["harmful"] + refused[split]["harmless"], np.int64)}
    notes: list[str] = []
    rows = probe_rows(acts, labels, n_folds=n_folds, n_boot=n_boot, seed=seed, notes=notes)
    best = best_row(rows, "prompt")
    l = best["layer"]
    X = acts["train"]["first_generated"][l].numpy().astype(np.float64)
    pipe = fit_logistic(X, labels=labels["train"]["prompt"], seed=seed)
    metrics = {"cv_auroc": best["cv_auroc"], "cv_ci": best["cv_ci"], "test_auroc": best["test_auroc"],
               "test_ci": best["test_ci"], "labels": "prompt (harmful=1 / harmless=0)"}
    probe = pipeline_to_probe(pipe, l, sm, hook_site="hook_resid_post", classes=["harmless", "harmful"],
                              position="first_generated", prompts=list(train["harmful"]) + list(train["harmless"]),
                              metrics=metrics)
    probe.provenance.method = "first_token_refusal_probe"
    probe.provenance.method_params.update({"position": "first_generated", "max_new_tokens": max_new_tokens,
                                           "labels": "prompt"})
    return ProbeResult(rows, best, probe, comps, refused, notes)
