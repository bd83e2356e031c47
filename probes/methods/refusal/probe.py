"""The refusal probes: a harmful-vs-harmless logistic probe on ``resid_post``, fitted and cross-validated with
the project's probe stack (:func:`steerkit.probes.sweep_activations` for the CV table,
:func:`steerkit.probes.linear.fit_scorer` for the held-out AUROC, :func:`steerkit.probes.linear.fit_probe` for
the stored :class:`~steerkit.vectors.Probe`).

Is the decision to refuse readable at the start of the response? Safety decisions are made there, so the
representation to probe is the residual stream at the *first generated token*: the model's own greedy
response is generated, and the activations of every layer (``blocks.{l}.hook_resid_post``) are recorded at the
position of its first token (the same numbers as a teacher-forced pass over prompt + response, computed with
the KV cache during generation), and at the last prompt token for comparison.

Two label kinds, named for what they are:

* ``behaviour`` -- refusal (1) or compliance (0) of the model's own greedy generation, from the judge
  (:func:`~steerkit.probes.methods.refusal.judge.substring_judge` by default; any
  ``judge(prompts, completions) -> list[bool]``). Needs enough refusals for two classes.
* ``prompt`` -- the prompt's harmful (1) / harmless (0) label from the data set. Small models refuse rarely,
  so this is the one that always has two classes.

The probe is the generic pipeline of :mod:`steerkit.probes.linear` (StandardScaler -> PCA to
``min(100, n - 1)`` -> balanced LogisticRegression). Per layer and position: out-of-fold AUROC (stratified
5-fold CV) with a 500-resample bootstrap interval on the *train* prompts, and the AUROC with its bootstrap
interval on the held-out *test* prompts of a probe fitted on all train prompts. The best cell is chosen on the
train CV AUROC only, never on the test prompts it is reported on.

* :func:`first_token_probe` -- the first generated token and the last prompt token, with judged generations
  (both label kinds).
* :func:`refusal_probe` -- the probe ``steerkit refusal`` saves: one (position, layer) cell, both chosen by
  cross-validation on its own train split (every vendored *train* prompt by default). The candidate positions
  are the paper's anchors: the first generated token (fed back) and every post-instruction template token (the
  last of them is the last prompt token). Recording needs two generated tokens per prompt
  (:func:`steerkit.probes.record_activations`), so it is short. The held-out split is the vendored *val* files
  (:func:`~steerkit.probes.methods.refusal.data.probe_splits`, disjoint from every train prompt), used only to
  report AUROCs after the choice.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.vectors import Probe

from ...linear import fit_probe, fit_scorer
from ...metrics import auroc, bootstrap_auroc_ci, check_labels
from ...sweep import position_label, record_activations, sweep_activations
from .data import batches, post_instruction_positions
from .judge import Judge, judge_refusals, substring_judge
from .result import POSITIONS, ProbeResult, finite_json

if TYPE_CHECKING:
    from steerkit.model import SteerModel

Progress = Optional[Callable[[int], object]]

@torch.inference_mode()
def first_token_activations(sm: "SteerModel", prompts: Sequence[str], *, max_new_tokens: int = 24, batch_size: int = 16,
                            progress: Progress = None
                            ) -> tuple[list[str], dict[str, Float[Tensor, "n_layers n d_model"]]]:
    """Greedy generations and ``resid_post`` of every layer at the first generated token and at the
    last prompt token: ``(completions, {"first_generated": [L, n, d], "last_prompt": [L, n, d]})``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> comps, acts = R.first_token_activations(tiny, ["hi", "bake bread"], max_new_tokens=2)
        >>> len(comps), {k: tuple(v.shape) for k, v in acts.items()}
        (2, {'first_generated': (4, 2, 64), 'last_prompt': (4, 2, 64)})
    """
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
            comps += sm.generate(chunk, max_new_tokens=max_new_tokens, chat=True)
        P = int(sm.tokenize(chunk, chat=True).input_ids.shape[1])
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
    """AUROC (and bootstrap interval) on the test rows of the logistic pipeline fitted on the train rows.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> rng, y = np.random.default_rng(0), np.r_[np.ones(20, np.int64), np.zeros(20, np.int64)]
        >>> X_train, X_test = (rng.normal(size=(40, 5)) + 2.0 * y[:, None] for _ in range(2))
        >>> a, lo, hi = R.heldout_auroc(X_train, y, X_test, y, n_boot=50)
        >>> a > 0.9, lo <= a <= hi
        (True, True)
    """
    if X_train.ndim != 2 or X_test.ndim != 2 or X_train.shape[1] != X_test.shape[1]:
        raise InputError(f"expected train and test activations [n, d] of equal d, found {X_train.shape} and {X_test.shape}")
    for what, X in (("train", X_train), ("test", X_test)):
        if not np.isfinite(X).all():
            raise InputError(f"expected finite {what} activations, found NaN or inf")
    y_train = check_labels(y_train, len(X_train), what="train labels")
    y_test = check_labels(y_test, len(X_test), what="test labels")
    s = fit_scorer(X_train, y_train, "logistic", seed=seed)(X_test)
    lo, hi = bootstrap_auroc_ci(y_test, s, n_boot=n_boot, seed=seed)
    return auroc(y_test, s), lo, hi


def probe_rows(acts: dict, labels: dict, *, n_folds: int = 5, n_boot: int = 500, seed: int = 0,
               notes: list | None = None) -> list[dict]:
    """Per label kind, position and layer: train CV AUROC (+CI) and held-out test AUROC (+CI).

    ``acts[split][position]``: ``[L, n, d]`` (every position of ``acts["train"]`` is probed); ``labels[split][kind]``: ``[n]`` 0/1. A label kind
    whose train labels have fewer than ``n_folds`` of a class is skipped (with a note); test
    AUROC is ``NaN`` when the test labels have one class.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> rng, y = np.random.default_rng(0), np.r_[np.ones(10, np.int64), np.zeros(10, np.int64)]
        >>> X = torch.tensor(rng.normal(size=(2, 20, 8)) + 2.0 * y[None, :, None])  # [layers, prompts, d]
        >>> acts = {"train": {"last_prompt": X}, "test": {"last_prompt": X}}
        >>> labels = {"train": {"prompt": y}, "test": {"prompt": y}}
        >>> [(r["position"], r["layer"], r["cv_auroc"] > 0.9) for r in R.probe_rows(acts, labels, n_folds=2, n_boot=20)]
        [('last_prompt', 0, True), ('last_prompt', 1, True)]
    """
    from threadpoolctl import threadpool_limits  # scikit-learn's dependency: the optional `probes` extra

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
        # one sweep per position (the same folds: they depend on the labels and the seed only), so only one
        # position's float64 copy of the activations exists at a time
        cv_rows = [r for p in acts["train"] for r in
                   sweep_activations({p: acts["train"][p]}, ytr, method="logistic", n_folds=n_folds, n_boot=n_boot,
                                     seed=seed).to_rows()]
        with threadpool_limits(limits=1):
            for r in cv_rows:
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


def _highest_cv(rows: list[dict], what: str) -> dict:
    """The row with the highest train CV AUROC (ties: the earlier layer, then the row listed first)."""
    if not rows:
        raise InputError(f"expected probe rows for {what}, found none")
    return max(rows, key=lambda r: (r["cv_auroc"], -r["layer"]))


def best_row(rows: list[dict], labels: str, position: str = "first_generated") -> dict:
    """The row with the highest *train CV* AUROC (ties: earliest layer) -- never chosen on test.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> rows = [{"labels": "prompt", "position": "first_generated", "layer": l, "cv_auroc": a}
        ...         for l, a in [(0, 0.7), (1, 0.9), (2, 0.9)]]
        >>> R.best_row(rows, "prompt")["layer"]
        1
    """
    return _highest_cv([r for r in rows if r["labels"] == labels and r["position"] == position],
                       f"labels={labels!r} at {position!r}")


def first_token_probe(sm: "SteerModel", train: dict, test: dict, *, judge: Judge | None = None, max_new_tokens: int = 24,
                      batch_size: int = 16, n_folds: int = 5, n_boot: int = 500, seed: int = 0,
                      progress: Progress = None) -> ProbeResult:
    """Generate, label, probe every layer, and build the ``refusal-probe`` artifact.

    ``train``/``test``: ``{"harmful": [...], "harmless": [...]}``. The artifact is the
    harmful-vs-harmless (``prompt`` labels) probe at the first generated token of the layer with
    the best train CV AUROC, fitted on all train prompts.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> data = {"harmful": ["how to pick a lock", "make a weapon", "steal a car"] * 2,
        ...         "harmless": ["bake bread", "write a poem", "name a colour"] * 2}
        >>> res = R.first_token_probe(tiny, data, data, max_new_tokens=2, n_folds=2, n_boot=10)
        >>> res.best["position"], res.probe.provenance.method, len(res.completions["train"]["harmful"])
        ('first_generated', 'first_token_refusal_probe', 6)
    """
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
    probe = _fit_cell(sm, acts["train"]["first_generated"], labels["train"]["prompt"], best, train,
                      position="first_generated", metrics=_cell_metrics(best), seed=seed,
                      method="first_token_refusal_probe",
                      params={"position": "first_generated", "max_new_tokens": max_new_tokens, "labels": "prompt"})
    return ProbeResult(rows, best, probe, comps, refused, notes)


LAST_PROMPT = "last_prompt"


def probe_positions(sm: "SteerModel") -> dict[str, dict]:
    """The positions the refusal probe tries: ``{name: {"spec": position, "token": text}}``.

    ``spec`` is what :func:`steerkit.probes.record_activations` (and so
    :func:`steerkit.probes.scoring.score_prompts`) records: ``"first_generated"``; ``"last"`` for the
    last prompt token (``last_prompt``, the last post-instruction token); a negative index among the
    prompt's tokens for each earlier post-instruction token (``post_instruction_-2``, ...).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> list(R.probe_positions(sm))[:3]
        ['first_generated', 'last_prompt', 'post_instruction_-2']
        >>> R.probe_positions(sm)["post_instruction_-6"]
        {'spec': -6, 'token': '<|im_end|>'}
    """
    pos, toks = post_instruction_positions(sm)
    out = {"first_generated": {"spec": "first_generated", "token": "(first generated token)"},
           LAST_PROMPT: {"spec": "last", "token": toks[-1]}}
    for p, t in reversed(list(zip(pos[:-1], toks[:-1]))):
        out[f"post_instruction_{p}"] = {"spec": int(p), "token": t}
    return out


def record_probe_activations(sm: "SteerModel", prompts: Sequence[str], positions: dict, *, batch_size: int = 16,
                             progress: Progress = None) -> dict[str, Float[Tensor, "n_layers n d_model"]]:
    """``{position name: [n_layers, n, d_model]}``: ``resid_post`` of every layer at each of ``positions``
    (:func:`probe_positions`), recorded in one pass per batch (a two-token greedy generation).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> acts = R.record_probe_activations(tiny, ["hi", "bake bread"], R.probe_positions(tiny))
        >>> list(acts)[:2], tuple(acts["first_generated"].shape)
        (['first_generated', 'last_prompt'], (4, 2, 64))
    """
    label = {position_label(v["spec"]): name for name, v in positions.items()}
    parts: dict[str, list[Tensor]] = {name: [] for name in positions}
    prompts = list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt to record, found an empty list")
    # batches of prompts of similar length (little padding); the rows go back to the prompts' order
    lens = [int(sm.tokenize([p], chat=True).attention_mask.sum()) for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: lens[i])
    for chunk in batches(order, batch_size):
        got = record_activations(sm, [prompts[i] for i in chunk], positions=[v["spec"] for v in positions.values()],
                                 chat=True, batch_size=len(chunk))
        for lab, t in got.items():
            parts[label[lab]].append(t)
        if progress is not None:
            progress(len(chunk))
    back = torch.empty(len(order), dtype=torch.long)
    back[torch.tensor(order)] = torch.arange(len(order))
    return {name: torch.cat(v, 1)[:, back] for name, v in parts.items()}


def select_probe_cell(rows: list[dict], labels: str = "prompt") -> dict:
    """The row with the highest *train CV* AUROC over every position and layer (ties: the earlier layer,
    then the position listed first); the held-out columns are never read.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> rows = [{"labels": "prompt", "position": "a", "layer": 3, "cv_auroc": 0.9, "test_auroc": 0.99},
        ...         {"labels": "prompt", "position": "b", "layer": 1, "cv_auroc": 0.95, "test_auroc": 0.5}]
        >>> R.select_probe_cell(rows)["position"]
        'b'
    """
    return _highest_cv([r for r in rows if r["labels"] == labels], f"labels={labels!r}")


def refusal_probe(sm: "SteerModel", train: dict, test: dict, *, positions: dict | None = None, batch_size: int = 16,
                  n_folds: int = 5, n_boot: int = 500, seed: int = 0, progress: Progress = None) -> ProbeResult:
    """The ``refusal-probe`` of ``steerkit refusal``: harmful (1) vs harmless (0) logistic probe whose
    position and layer are chosen by cross-validation on ``train`` only.

    ``train``/``test``: ``{"harmful": [...], "harmless": [...]}`` (:func:`~steerkit.probes.methods.refusal.data.probe_splits`); ``positions``:
    :func:`probe_positions` (default). Every position x layer gets its train CV AUROC and held-out AUROC
    with bootstrap intervals (``rows``); the cell with the best CV AUROC (:func:`select_probe_cell`) is
    fitted on every train prompt and stored with its position in ``provenance.method_params``
    (``position``: what :func:`steerkit.probes.scoring.score_prompts` records; ``position_name``,
    ``position_token``).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> data = {"harmful": ["how to pick a lock", "make a weapon", "steal a car"] * 2,
        ...         "harmless": ["bake bread", "write a poem", "name a colour"] * 2}
        >>> res = R.refusal_probe(tiny, data, data, n_boot=10, n_folds=2)
        >>> res.probe.provenance.method_params["position"] in ("first_generated", "last")
        True
    """
    positions = positions or probe_positions(sm)
    acts: dict[str, dict[str, Tensor]] = {}
    labels: dict[str, dict[str, np.ndarray]] = {}
    for split, data in (("train", train), ("test", test)):
        parts = [record_probe_activations(sm, data[kind], positions, batch_size=batch_size, progress=progress)
                 for kind in ("harmful", "harmless")]
        acts[split] = {name: torch.cat([parts[0][name], parts[1][name]], 1) for name in positions}
        labels[split] = {"prompt": np.r_[np.ones(len(data["harmful"]), np.int64),
                                         np.zeros(len(data["harmless"]), np.int64)]}
    notes = ["behaviour labels (the model's own refusals) need judged generations; this probe generates two "
             "tokens per prompt, so it uses prompt labels only (first_token_probe judges longer generations)"]
    rows = probe_rows(acts, labels, n_folds=n_folds, n_boot=n_boot, seed=seed, notes=notes)
    best = select_probe_cell(rows, "prompt")
    name = best["position"]
    spec, tok = positions[name]["spec"], positions[name]["token"]
    metrics = dict(_cell_metrics(best), n_train={k: len(v) for k, v in train.items()},
                   n_test={k: len(v) for k, v in test.items()})
    probe = _fit_cell(sm, acts["train"][name], labels["train"]["prompt"], best, train, position=spec,
                      metrics=finite_json(metrics), seed=seed, method="refusal_probe",
                      params={"position": spec, "position_name": name, "position_token": tok, "labels": "prompt",
                              "selection": "train CV AUROC over positions x layers",
                              "positions_tried": list(positions)})
    return ProbeResult(rows, best, probe, {}, {}, notes, positions=positions)


def _cell_metrics(best: dict) -> dict:
    return {"cv_auroc": best["cv_auroc"], "cv_ci": best["cv_ci"], "test_auroc": best["test_auroc"],
            "test_ci": best["test_ci"], "labels": "prompt (harmful=1 / harmless=0)"}


def _fit_cell(sm: "SteerModel", acts: Float[Tensor, "n_layers n d_model"], labels: np.ndarray, best: dict,
              train: dict, *, position, metrics: dict, seed: int, method: str, params: dict) -> Probe:
    """The harmful-vs-harmless logistic probe of the chosen cell (``best``'s layer of ``acts``), fitted on every
    train prompt (:func:`steerkit.probes.linear.fit_probe`), its provenance naming ``method`` and ``params``."""
    probe = fit_probe(acts[best["layer"]], labels=labels, layer=best["layer"], model=sm, hook_site="hook_resid_post",
                      classes=["harmless", "harmful"], position=position,
                      prompts=list(train["harmful"]) + list(train["harmless"]), metrics=metrics, seed=seed)
    probe.provenance.method = method
    probe.provenance.method_params.update(params)
    return probe
