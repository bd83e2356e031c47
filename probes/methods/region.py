"""Efficient reasoning by projection onto a concise region (Hou et al., "Efficient reasoning via
constrained optimization in latent space").

Verbose and concise step-by-step solutions leave the residual stream in different places at the
points where a new reasoning step starts. The method fits a polyhedron around the concise states and,
while the model reasons, moves the state at each new step to the closest point of that polyhedron.

* Features (:func:`region_features`): the output of block ``l`` (``blocks.{l}.hook_resid_post``,
  default ``l = 2 * n_layers // 3``) at the *step-boundary tokens* of a solution: the tokens that
  begin a blank line. :func:`step_boundaries` finds them in the tokenizer at run time: every token
  whose text (after ``\\r\\n`` -> ``\\n``) holds ``"\\n\\n"`` with no letter or digit before it
  (``"\\n\\n"``, ``"\\n\\n   "``, ``" \\n\\n"``, ``".\\n\\n"``, ``"\\n\\nThe"``), and -- since
  byte-level BPE models often write a paragraph break as two ``"\\n"`` tokens -- the second of two
  tokens that spell a blank line together (a token ending in a single newline, then a token
  starting with one). Solutions are recorded teacher-forced after one common prompt
  (:data:`EVAL_PROMPT`), so the two classes differ only in the text of the solution.
* Fit (:func:`fit_region`): centre by the mean of all points, PCA to ``n_components`` (10)
  dimensions; KMeans on the verbose points (``n_clusters`` = 8, fewer when there are fewer than
  ``min_cluster_size`` points per cluster); one linear SVM per cluster separating the concise points
  (0) from that cluster (1); half-space ``w_k . z <= c_k`` with ``c_k = max(q90(w_k . z_concise),
  w_k . mean(z_concise))``. The result is a :class:`steerkit.vectors.Region` (store-able; its
  ``project`` solves the same QP as the fused kernel).
* Steering (:func:`steer_region`): at the last prompt token and at every generated token whose
  *input* token is a step boundary, ``z = P (h - mean)``, ``z*`` = the closest point of the
  polyhedron, ``h += s P^T (z* - z)`` (``s = 1``): the region artifact steers through its own
  ``to_interventions`` (one ``project`` intervention at its site, one fused-kernel call per step) with
  the position spec ``AnyOf("last", TokenMatch(..., within="generated"))`` (:func:`steering_positions`).
* Data (:mod:`.problems`, its names re-exported here): templated multi-step arithmetic word problems
  (:func:`arithmetic_problems`) and the vendored first 300 GSM8K test problems (:func:`gsm8k_problems`). Verbose and concise solutions come from the
  model itself (:data:`VERBOSE_PROMPT` / :data:`CONCISE_PROMPT`); the correct ones are kept
  (:func:`parse_answer` reads the final number; :func:`select_solutions` falls back to the answered
  ones when too few are correct), and re-paragraphed one step per sentence or line, each followed by
  a blank line (:func:`segment_steps`) before recording, since short solutions rarely contain one.
  :func:`region_eval` compares generated tokens and accuracy with and without projection.
* :func:`run` (``run(sm, RegionConfig(...))``, ``steerkit region``) builds the problems, fits and
  evaluates (:func:`run_region`) with a progress bar; a :class:`RegionResult`.
"""
from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.interventions import MAX_HALFSPACES, MAX_M, Intervention, ModelFacts
from steerkit.model import Tokens
from steerkit.hooks.positions import AnyOf, TokenMatch
from steerkit.vectors import Region
from steerkit.vectors.provenance import Provenance, prompts_hash

from ..plots.require import plotly_required
from .problems import ANSWER_RE, STYLES, Problem, is_correct, parse_answer, segment_steps, trim_solution
from .problems import CONCISE_PROMPT as CONCISE_PROMPT, VERBOSE_PROMPT as VERBOSE_PROMPT
from .problems import EVAL_PROMPT, arithmetic_problems, gsm8k_problems
from .temporal import wilson

if TYPE_CHECKING:
    from steerkit.model import SteerModel

METHOD = "region-hou"


# --------------------------------------------------------------------------- step boundaries
_ALNUM = re.compile(r"[^\W_]", re.UNICODE)


@dataclass(frozen=True)
class StepBoundaries:
    """Token ids at which a new reasoning step begins: ``single`` tokens that hold a blank line
    themselves, and pairs ``(first, second)`` that spell one together (the second token is the
    boundary).

    Examples:
        >>> from steerkit.probes.methods.region import step_boundaries
        >>> b = step_boundaries(tiny.tokenizer)
        >>> ids = tiny.tokenizer("Step one.\\n\\nStep two.", add_special_tokens=False)["input_ids"]
        >>> sum(b.mask(ids)), type(b.spec()).__name__  # single tokens or pairs
        (1, 'AnyOf')
    """

    single: tuple[int, ...]
    first: tuple[int, ...]
    second: tuple[int, ...]

    def spec(self, within: str = "generated"):
        """The position spec selecting the boundary tokens (``within`` all | prompt | generated)."""
        parts = []
        if self.single:
            parts.append(TokenMatch(self.single, within=within))
        if self.first and self.second:
            parts.append(TokenMatch(self.first, self.second, within=within))
        if not parts:
            raise InputError("expected the tokenizer to have step-boundary tokens (a blank line), found none")
        return parts[0] if len(parts) == 1 else AnyOf(*parts)

    def mask(self, ids: Sequence[int]) -> list[bool]:
        """Which positions of the token list ``ids`` are step boundaries (a reference for tests)."""
        s, f, sc = set(self.single), set(self.first), set(self.second)
        return [t in s or (i > 0 and ids[i - 1] in f and t in sc) for i, t in enumerate(ids)]


def step_boundaries(tokenizer) -> StepBoundaries:
    """The step-boundary tokens of ``tokenizer`` (every vocabulary entry decoded once; cached per tokenizer
    and vocabulary size).

    Examples:
        >>> from steerkit.probes.methods.region import step_boundaries
        >>> b = step_boundaries(tiny.tokenizer)
        >>> "\\n\\n" in [tiny.tokenizer.decode([i]) for i in b.single], step_boundaries(tiny.tokenizer) is b
        (True, True)
    """
    return _boundaries(tokenizer, len(tokenizer))


@functools.lru_cache(maxsize=8)
def _boundaries(tokenizer, size: int) -> StepBoundaries:
    single, first, second = [], [], []
    for i in range(size):
        try:
            s = tokenizer.decode([i])
        except Exception:  # ids the tokenizer cannot decode
            continue
        if not s or "\n" not in s:
            continue
        s = s.replace("\r\n", "\n").replace("\r", "\n")
        j = s.find("\n\n")
        if j >= 0 and not _ALNUM.search(s[:j]):
            single.append(i)
            continue
        body = s.rstrip(" \t")
        if body.endswith("\n") and s.count("\n") == 1 and not _ALNUM.search(body):
            first.append(i)
        if s.lstrip(" \t").startswith("\n"):
            second.append(i)
    return StepBoundaries(tuple(single), tuple(first), tuple(second))


def steering_positions(tokenizer, *, last: bool = True):
    """``AnyOf("last", <generated step-boundary tokens>)``: where :func:`steer_region` edits.

    Examples:
        >>> from steerkit.probes.methods.region import steering_positions
        >>> steering_positions(tiny.tokenizer).specs[0], type(steering_positions(tiny.tokenizer, last=False)).__name__
        ('last', 'AnyOf')
    """
    b = step_boundaries(tokenizer).spec("generated")
    return AnyOf("last", b) if last else b


# --------------------------------------------------------------------------- features
def default_layer(n_layers: int) -> int:
    """Two thirds deep: ``2 * n_layers // 3``.

    Examples:
        >>> from steerkit.probes.methods.region import default_layer
        >>> default_layer(30), default_layer(4)
        (20, 2)
    """
    return (2 * int(n_layers)) // 3


def _hook(layer: int) -> str:
    return f"blocks.{int(layer)}.hook_resid_post"


@torch.inference_mode()
def region_features(sm: "SteerModel", texts: Sequence, layer: Optional[int] = None, *, prompts: Optional[Sequence[str]] = None,
                    chat: bool = True, batch_size: int = 8, return_counts: bool = False):
    """``[n_points, d_model]`` (float32, CPU): block ``layer``'s output at the step-boundary tokens of
    ``texts``, recorded teacher-forced.

    With ``prompts`` (one per text), each input is ``sm.format(prompt, chat)`` followed by the text
    (a string, or the generated token ids), and only boundaries inside the text count; without, each
    text is a whole input (tokenized with ``chat``) and every boundary counts. ``return_counts`` also
    returns the number of points of each text.

    Examples:
        >>> from steerkit.probes.methods.region import region_features
        >>> texts = ["3 * 4 = 12.\\n\\n2 + 12 = 14.\\n\\nThe answer is 14.\\n\\n", "The answer is 14.\\n\\n"]
        >>> feats, counts = region_features(tiny, texts, layer=2, prompts=["What is 2 + 3 * 4?"] * 2,
        ...                                 return_counts=True)
        >>> tuple(feats.shape), counts
        ((4, 64), [3, 1])
    """
    texts = list(texts)
    if prompts is not None and len(prompts) != len(texts):
        raise InputError(f"expected one prompt per text ({len(texts)}), found {len(prompts)}")
    layer = default_layer(sm.n_layers) if layer is None else int(layer)
    if not 0 <= layer < sm.n_layers:
        raise InputError(f"expected a layer in 0..{sm.n_layers - 1}, found {layer}")
    name = _hook(layer)
    spec = step_boundaries(sm.tokenizer).spec("all")
    tok = sm.tokenizer
    feats, counts = [], []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i:i + batch_size]
        if prompts is None:
            if not all(isinstance(t, str) for t in chunk):
                raise InputError("expected texts as strings when no prompts are given")
            toks = sm.tokenize(chunk, chat=chat)
            starts = [0] * len(chunk)
        else:
            ids, starts = [], []
            for p, t in zip(prompts[i:i + batch_size], chunk):
                pid = tok(sm.format(p, chat), add_special_tokens=not (chat and getattr(tok, "chat_template", None)))["input_ids"]
                rid = tok(t, add_special_tokens=False)["input_ids"] if isinstance(t, str) else [int(x) for x in t]
                ids.append(list(pid) + list(rid))
                starts.append(len(pid))
            toks = sm.pad(ids)
            P = toks.input_ids.shape[1]
            lens = toks.attention_mask.sum(1).tolist()
            starts = [P - int(n) + s for n, s in zip(lens, starts)]  # absolute index of the text's first token
        with sm.record(name, positions=spec) as cache:
            sm.forward(Tokens(toks.input_ids, toks.attention_mask), chat=False)
        x, pos = cache[name], cache.positions(name)
        for r in range(len(chunk)):
            keep = pos[r] >= max(starts[r], 0)
            keep &= pos[r] >= 0
            feats.append(x[r][keep.to(x.device)].float().cpu())
            counts.append(int(keep.sum()))
    out = torch.cat(feats) if feats else torch.zeros(0, sm.d_model)
    return (out, counts) if return_counts else out


# --------------------------------------------------------------------------- fit
def _np64(x, what: str) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().double().numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise InputError(f"expected {what} as a matrix [n, d_model], found shape {a.shape}")
    if not np.isfinite(a).all():
        raise InputError(f"expected finite {what} features, found NaN or inf")
    return a


def fit_region(concise, verbose, *, n_components: int = 10, n_clusters: int = 8, layer: Optional[int] = None,
               quantile: float = 0.9, min_cluster_size: int = 5, C: float = 1.0, seed: int = 0, model=None,
               hook_site: str = "hook_resid_post", prompts: Optional[Sequence[str]] = None,
               metrics: Optional[dict] = None):
    """Fit the concise region: a :class:`steerkit.vectors.Region` from concise and verbose feature
    matrices ``[n, d_model]`` (tensors or arrays).

    PCA (``n_components``, at most the rank) on all points centred by their mean; KMeans with
    ``min(n_clusters, n_verbose // min_cluster_size)`` (at least 1) clusters on the verbose points; per
    cluster a linear SVM (``LinearSVC``, balanced classes) of concise (0) vs that cluster (1), giving a
    unit normal ``w_k``; offset ``c_k = max(quantile_q(w_k . z_concise), w_k . mean(z_concise))``.
    ``layer`` (default two thirds of ``model``'s depth, or 0 without a model), ``model`` and ``prompts``
    go into the provenance; the fit's numbers are in ``region.provenance.metrics``.

    Concise points near the origin, verbose ones shifted along the first axis.

    Examples:
        >>> from steerkit.probes.methods.region import fit_region
        >>> concise = torch.randn(40, 64)
        >>> verbose = torch.randn(40, 64) + 6 * torch.eye(64)[0]
        >>> region = fit_region(concise, verbose, n_components=4, n_clusters=2, model=tiny)
        >>> region.layer, tuple(region.projection.shape), region.provenance.metrics["concise_inside"] > 0.5
        (2, (4, 64), True)
        >>> float(region.contains(verbose).float().mean()) < 0.1
        True
    """
    from sklearn.cluster import KMeans
    from sklearn.svm import LinearSVC


    Xc, Xv = _np64(concise, "concise"), _np64(verbose, "verbose")
    if Xc.shape[1] != Xv.shape[1]:
        raise InputError(f"expected concise and verbose features of the same width, found {Xc.shape[1]} and {Xv.shape[1]}")
    if len(Xc) < 2 or len(Xv) < 2:
        raise InputError(f"expected at least 2 concise and 2 verbose points, found {len(Xc)} and {len(Xv)}")
    if not 1 <= n_components <= MAX_M:
        raise InputError(f"expected n_components in 1..{MAX_M} (the kernel's subspace limit), found {n_components}")
    if not 1 <= n_clusters <= MAX_HALFSPACES:
        raise InputError(f"expected n_clusters in 1..{MAX_HALFSPACES} (the kernel's half-space limit), found {n_clusters}")
    if not 0.0 < quantile <= 1.0:
        raise InputError(f"expected quantile in (0, 1], found {quantile}")
    X = np.concatenate([Xc, Xv])
    mean = X.mean(0)
    _, S, Vt = np.linalg.svd(X - mean, full_matrices=False)
    rank = int((S > S[0] * 1e-10).sum()) if S.size and S[0] > 0 else 0
    m = min(int(n_components), rank)
    if m < 1:
        raise InputError("expected features that vary, found identical points")
    P = Vt[:m]
    P = P * np.sign(P[np.arange(m), np.abs(P).argmax(1)])[:, None]  # deterministic signs
    Zc, Zv = (Xc - mean) @ P.T, (Xv - mean) @ P.T
    k = max(1, min(int(n_clusters), len(Zv) // max(1, int(min_cluster_size))))
    labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(Zv) if k > 1 else np.zeros(len(Zv), int)
    normals, offsets, per = [], [], []
    for j in range(k):
        Zj = Zv[labels == j]
        if len(Zj) == 0:
            continue
        Xj = np.concatenate([Zc, Zj])
        y = np.r_[np.zeros(len(Zc)), np.ones(len(Zj))]
        svm = LinearSVC(C=C, class_weight="balanced", max_iter=20000, random_state=seed).fit(Xj, y)
        w = svm.coef_[0]
        nw = float(np.linalg.norm(w))
        if not np.isfinite(nw) or nw < 1e-12:
            continue
        w = w / nw
        sc = Zc @ w
        c = max(float(np.quantile(sc, quantile)), float(Zc.mean(0) @ w))
        normals.append(w)
        offsets.append(c)
        per.append({"cluster": j, "size": int(len(Zj)), "svm_train_acc": float(svm.score(Xj, y)),
                    "verbose_outside": float(((Zj @ w) > c).mean())})
    if not normals:
        raise InputError("expected at least one separating half-space, found none (are the classes identical?)")
    W, c = np.stack(normals), np.asarray(offsets)
    inside_c = ((Zc @ W.T) <= c + 1e-12).all(1)
    inside_v = ((Zv @ W.T) <= c + 1e-12).all(1)
    ev = (S[:m] ** 2).sum() / max(float((S ** 2).sum()), 1e-300)
    met = {"n_concise": int(len(Xc)), "n_verbose": int(len(Xv)), "n_components": int(m), "n_clusters": int(len(W)),
           "explained_variance": float(ev), "concise_inside": float(inside_c.mean()),
           "verbose_inside": float(inside_v.mean()), "clusters": per, **(metrics or {})}
    params = {"n_components": int(n_components), "n_clusters": int(n_clusters), "quantile": float(quantile),
              "min_cluster_size": int(min_cluster_size), "C": float(C), "seed": int(seed)}
    if layer is None:
        layer = default_layer(model.n_layers) if model is not None and getattr(model, "n_layers", None) else 0
    kw = dict(method=METHOD, method_params=params, prompts_hash=prompts_hash(prompts), metrics=met,
              hook_site=hook_site, operation="read")
    prov = Provenance.from_model(model, **kw) if model is not None else Provenance(d_model=int(X.shape[1]), **kw)
    f32 = torch.float32
    return Region(mean=torch.tensor(mean, dtype=f32), projection=torch.tensor(P, dtype=f32),
                  normals=torch.tensor(W, dtype=f32), offsets=torch.tensor(c, dtype=f32), layer=int(layer),
                  hook_site=hook_site, provenance=prov)


# --------------------------------------------------------------------------- steering
def region_spec(region: Region, strength: float = 1.0, facts: Optional[ModelFacts] = None) -> list[Intervention]:
    """The projection into ``region`` as interventions, ``region.to_interventions(facts, scale=strength)``
    (checked against the model's ``facts``, e.g. ``sm.facts``): one ``project`` at
    ``blocks.{layer}.{hook_site}``, for :meth:`SteerModel.steer` / ``generate(steering=)`` (``rows=`` / ``steer_rows=`` with
    one such list per row steers each row its own way). :func:`steer_region` adds the method's positions.

    Examples:
        >>> from steerkit.probes.methods.region import fit_region, region_spec
        >>> region = fit_region(torch.randn(20, 64), torch.randn(20, 64) + 4, n_components=2, n_clusters=1, model=tiny)
        >>> [(iv.site, iv.op, iv.scale) for iv in region_spec(region, 0.5, tiny.facts)]
        [('blocks.2.hook_resid_post', 'project', 0.5)]
    """
    if facts is None:
        raise InputError("expected the model's facts to check the region against (region_spec(region, strength, "
                         "sm.facts)), found none; or steer with the region itself: sm.steer(region, strength)")
    return region.to_interventions(facts, scale=float(strength))


def steer_region(sm: "SteerModel", region: Region, strength: float = 1.0, *, positions=None, override: bool = False):
    """Register the projection on ``sm`` (a handle; use with ``with``): at the last prompt token and at
    generated step-boundary tokens (``positions`` overrides), ``h += s P^T (z* - z)`` at the region's
    layer, through the fused kernel: ``sm.steer(region, strength, positions=...)``, which checks the
    region against the model first.

    Examples:
        >>> from steerkit.probes.methods.region import fit_region, steer_region
        >>> region = fit_region(torch.randn(20, 64), torch.randn(20, 64) + 4, n_components=2, n_clusters=1, model=tiny)
        >>> with steer_region(tiny, region):
        ...     texts = tiny.generate(["What is 2 + 3?"], max_new_tokens=4)
        >>> len(texts)
        1
    """
    pos = steering_positions(sm.tokenizer) if positions is None else positions
    return sm.steer(region, float(strength), positions=pos, override=override)


# --------------------------------------------------------------------------- solving / evaluating
@dataclass
class Solution:
    """One generated solution: its text (trimmed for training styles), token ids, whether it is correct,
    and whether it ended before ``max_new_tokens``.

    Examples:
        >>> from steerkit.probes.methods.region import Problem, Solution
        >>> s = Solution(Problem("What is 2 + 3?", 5.0), "eval", "2 + 3 = 5. The answer is 5.", [17, 42, 7],
        ...              correct=True, finished=True)
        >>> s.n_tokens, s.correct
        (3, True)
    """

    problem: Problem
    style: str
    text: str
    tokens: list[int] = field(repr=False)
    correct: bool
    finished: bool

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def solve(sm: "SteerModel", problems: Sequence[Problem], style: str = "eval", *, max_new_tokens: int = 96, batch_size: int = 16,
          region=None, strength: float = 1.0, chat: bool = True, progress: Optional[Callable[[int], None]] = None
          ) -> list[Solution]:
    """Greedy solutions of ``problems`` with the ``style`` prompt (``"verbose"``, ``"concise"`` or
    ``"eval"``), with the region projection when ``region`` is given. Verbose/concise texts are trimmed
    after their first answer statement.

    Examples:
        >>> from steerkit.probes.methods.region import arithmetic_problems
        >>> from steerkit.probes.methods.region import solve
        >>> sols = solve(tiny, arithmetic_problems(2), "concise", max_new_tokens=5)
        >>> len(sols), sols[0].style, all(s.n_tokens <= 5 for s in sols)
        (2, 'concise', True)
    """
    if style not in STYLES:
        raise InputError(f"expected style in {sorted(STYLES)}, found {style!r}")
    tpl = STYLES[style]
    out: list[Solution] = []
    for i in range(0, len(problems), batch_size):
        batch = list(problems[i:i + batch_size])
        prompts = [tpl.format(question=p.question) for p in batch]
        if region is not None:
            with steer_region(sm, region, strength):
                toks = sm.generate(prompts, max_new_tokens=max_new_tokens, chat=chat, return_tokens=True)
        else:
            toks = sm.generate(prompts, max_new_tokens=max_new_tokens, chat=chat, return_tokens=True)
        for p, t in zip(batch, toks):
            text = sm.tokenizer.decode(t, skip_special_tokens=True)
            finished = len(t) < max_new_tokens
            if style != "eval":
                text = trim_solution(text)
            out.append(Solution(p, style, text, list(t), is_correct(text, p.answer), finished))
        if progress:
            progress(len(batch))
    return out


def _boot_ci(x: np.ndarray, n_boot: int = 2000, seed: int = 0) -> list[float]:
    if len(x) < 2:
        return [float("nan"), float("nan")]
    g = np.random.default_rng(seed)
    means = x[g.integers(0, len(x), (n_boot, len(x)))].mean(1)
    return [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]


def summarize(sols: Sequence[Solution]) -> dict:
    """Mean generated tokens (bootstrap 95% interval), accuracy (Wilson 95%), fraction finished.

    Examples:
        >>> from steerkit.probes.methods.region import Problem, Solution
        >>> from steerkit.probes.methods.region import summarize
        >>> p = Problem("What is 2 + 3?", 5.0)
        >>> sols = [Solution(p, "eval", "The answer is 5.", [1] * 6, True, True),
        ...         Solution(p, "eval", "The answer is 6.", [1] * 10, False, False)]
        >>> s = summarize(sols)
        >>> s["n"], s["tokens_mean"], s["accuracy"], s["finished"]
        (2, 8.0, 0.5, 0.5)
    """
    n = len(sols)
    t = np.array([s.n_tokens for s in sols], float)
    k = sum(s.correct for s in sols)
    return {"n": n, "tokens_mean": float(t.mean()) if n else float("nan"), "tokens_ci95": _boot_ci(t),
            "accuracy": k / n if n else float("nan"), "accuracy_ci95": list(wilson(k, n)),
            "finished": float(np.mean([s.finished for s in sols])) if n else float("nan")}


def region_eval(sm: "SteerModel", problems: Sequence[Problem], region, *, strength: float = 1.0, max_new_tokens: int = 96,
                batch_size: int = 16, progress=None, keep_texts: int = 3) -> dict:
    """Generated tokens and accuracy on ``problems`` (the :data:`EVAL_PROMPT`) without and with the
    projection; ``paired_token_diff`` is projected minus baseline per problem (bootstrap 95%).

    Examples:
        >>> from steerkit.probes.methods.region import arithmetic_problems, fit_region, region_eval
        >>> region = fit_region(torch.randn(20, 64), torch.randn(20, 64) + 4, n_components=2, n_clusters=1, model=tiny)
        >>> out = region_eval(tiny, arithmetic_problems(2), region, max_new_tokens=4)
        >>> out["baseline"]["n"], out["projected"]["n"], sorted(out["paired_token_diff"])
        (2, 2, ['ci95', 'mean'])
    """
    base = solve(sm, problems, "eval", max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress)
    proj = solve(sm, problems, "eval", max_new_tokens=max_new_tokens, batch_size=batch_size, region=region,
                 strength=strength, progress=progress)
    d = np.array([b.n_tokens - a.n_tokens for a, b in zip(base, proj)], float)
    both = sum(a.correct and b.correct for a, b in zip(base, proj))
    return {"baseline": summarize(base), "projected": summarize(proj), "strength": float(strength),
            "paired_token_diff": {"mean": float(d.mean()) if len(d) else float("nan"), "ci95": _boot_ci(d)},
            "correct_both": int(both),
            "examples": [{"question": a.problem.question, "answer": a.problem.answer, "baseline": a.text,
                          "projected": b.text} for a, b in list(zip(base, proj))[:keep_texts]],
            "_solutions": (base, proj)}


@dataclass
class RegionResult:
    """Everything one run of the method produced (see :func:`run_region`).

    Examples:
        >>> from steerkit.probes.methods.region import RegionResult, fit_region
        >>> region = fit_region(torch.randn(20, 64), torch.randn(20, 64) + 4, n_components=2, n_clusters=1, model=tiny)
        >>> res = RegionResult(region, layer=2, n_train=10, n_verbose_kept=10, n_concise_kept=10,
        ...                    n_points={"concise": 20, "verbose": 20})
        >>> res.to_json()["fit"]["n_concise"], res.to_json()["eval"] is None
        (20, True)
        >>> store.save("region-concise", res.artifacts(tiny)["region-concise"])
        'region-concise@1'
    """

    region: object
    layer: int
    n_train: int
    n_verbose_kept: int
    n_concise_kept: int
    n_points: dict
    eval: Optional[dict] = None
    train_summary: dict = field(default_factory=dict)
    selection: dict = field(default_factory=dict)  # style -> how its solutions were kept

    def to_dict(self) -> dict:
        ev = None if self.eval is None else {k: v for k, v in self.eval.items() if not k.startswith("_")}
        return {"layer": self.layer, "n_train": self.n_train, "n_verbose_kept": self.n_verbose_kept,
                "n_concise_kept": self.n_concise_kept, "selection": self.selection, "n_points": self.n_points,
                "fit": dict(self.region.provenance.metrics), "train": self.train_summary, "eval": ev}

    to_json = to_dict

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: mean generated tokens and accuracy of the training solutions (verbose,
        concise) and, with an evaluation, of the held-out ones (baseline, projected)
        (:func:`steerkit.probes.plots.region.result_figure`)."""
        with plotly_required():
            from ..plots import region as figures
        return figures.result_figure(self, title=title)

    def artifacts(self, sm: "SteerModel") -> dict:
        """``{"region-concise": Region}``, with the held-out evaluation in its provenance metrics."""
        reg = self.region
        if self.eval:
            reg.provenance.metrics["eval"] = {k: self.eval[k] for k in ("baseline", "projected", "paired_token_diff")
                                              if k in self.eval}
        return {"region-concise": reg}


def select_solutions(sols: Sequence[Solution], keep: str = "correct", min_kept: int = 8) -> tuple[list[Solution], str]:
    """The solutions to fit on and how they were chosen: ``keep="correct"`` keeps the correct ones, and
    falls back to the *answered* ones (an answer statement, or finished with a number) when fewer than ``min_kept`` are
    correct (a small model solves few problems); ``"answered"`` / ``"all"`` skip the correctness test.

    Examples:
        >>> from steerkit.probes.methods.region import Problem, Solution
        >>> from steerkit.probes.methods.region import select_solutions
        >>> p = Problem("What is 2 + 3?", 5.0)
        >>> sols = [Solution(p, "eval", "The answer is 5.", [1], True, True),
        ...         Solution(p, "eval", "The answer is 6.", [1], False, True),
        ...         Solution(p, "eval", "hmm", [1], False, False)]
        >>> kept, rule = select_solutions(sols, min_kept=1)
        >>> len(kept), rule
        (1, 'correct')
        >>> kept, rule = select_solutions(sols, min_kept=2)  # too few correct: the answered ones
        >>> len(kept), rule
        (2, 'answered (fallback: 1 correct < min_kept=2)')
    """
    if keep not in ("correct", "answered", "all"):
        raise InputError(f"expected keep in ('correct', 'answered', 'all'), found {keep!r}")
    answered = [x for x in sols if ANSWER_RE.search(x.text) or (x.finished and parse_answer(x.text) is not None)]
    if keep == "all":
        return list(sols), "all"
    if keep == "answered":
        return answered, "answered"
    correct = [x for x in sols if x.correct]
    if len(correct) >= min_kept:
        return correct, "correct"
    return answered, f"answered (fallback: {len(correct)} correct < min_kept={min_kept})"


def run_region(sm: "SteerModel", train: Sequence[Problem], test: Sequence[Problem] = (), *, layer: Optional[int] = None,
               n_components: int = 10, n_clusters: int = 8, strength: float = 1.0, max_new_tokens: int = 96,
               train_max_new_tokens: int = 96, batch_size: int = 16, seed: int = 0, keep: str = "correct",
               min_kept: int = 8, segment: bool = True, progress=None) -> RegionResult:
    """The whole method: verbose and concise solutions of ``train`` by the model, the kept ones'
    (:func:`select_solutions`) features after :data:`EVAL_PROMPT` (texts re-paragraphed by
    :func:`segment_steps` when ``segment``), the fitted region, and (when ``test`` is given) the
    evaluation.

    The mechanics on a few short solutions of the default model, all of them kept; the method itself fits on
    40 problems and evaluates on 30 held-out ones.

    Examples:
        >>> from steerkit.probes.methods.region import arithmetic_problems, run_region
        >>> res = run_region(sm, arithmetic_problems(2), n_components=2, n_clusters=1, keep="all",
        ...                  train_max_new_tokens=12)
        >>> res.layer, res.n_verbose_kept, res.selection["verbose"], res.n_points["concise"] >= 2
        (20, 2, 'all', True)
    """
    layer = default_layer(sm.n_layers) if layer is None else int(layer)
    sols = {s: solve(sm, train, s, max_new_tokens=train_max_new_tokens, batch_size=batch_size, progress=progress)
            for s in ("verbose", "concise")}
    chosen = {s: select_solutions(v, keep, min_kept) for s, v in sols.items()}
    keep_ = {s: c[0] for s, c in chosen.items()}
    feats = {}
    for s, v in keep_.items():
        if not v:
            raise InputError(f"expected at least one kept {s} solution to fit the region, found none "
                             f"(of {len(sols[s])}, rule {chosen[s][1]!r}); use more or easier problems")
        feats[s] = region_features(sm, [segment_steps(x.text) if segment else x.text for x in v], layer,
                                   prompts=[EVAL_PROMPT.format(question=x.problem.question) for x in v],
                                   batch_size=max(1, batch_size // 2))
    region = fit_region(feats["concise"], feats["verbose"], n_components=n_components, n_clusters=n_clusters,
                        layer=layer, seed=seed, model=sm, prompts=[p.question for p in train],
                        metrics={"n_train_problems": len(train)})
    res = RegionResult(region, layer, len(train), len(keep_["verbose"]), len(keep_["concise"]),
                       {s: int(f.shape[0]) for s, f in feats.items()},
                       train_summary={s: summarize(v) for s, v in sols.items()},
                       selection={s: c[1] for s, c in chosen.items()})
    if test:
        res.eval = region_eval(sm, test, region, strength=strength, max_new_tokens=max_new_tokens,
                               batch_size=batch_size, progress=progress)
    return res


@dataclass
class RegionConfig:
    """``steerkit region``: ``n_train`` training and ``n_test`` held-out problems (0: fit only) from
    ``data`` ("arith": templated arithmetic of ``level``; "gsm8k": the vendored problems, test ones from
    the end of the file; "mix": half of each); the rest as :func:`run_region`.

    Examples:
        >>> from steerkit.probes.methods.region import RegionConfig
        >>> cfg = RegionConfig(data="mix", n_train=4, n_test=2)
        >>> cfg.level, cfg.keep, cfg.n_components
        ('easy', 'correct', 10)
    """

    data: str = "arith"
    level: str = "easy"
    n_train: int = 40
    n_test: int = 30
    layer: Optional[int] = None
    n_components: int = 10
    n_clusters: int = 8
    strength: float = 1.0
    max_new_tokens: int = 96
    train_max_new_tokens: int = 96
    keep: str = "correct"
    min_kept: int = 8
    batch_size: int = 16
    seed: int = 0


def config_problems(config: RegionConfig) -> tuple[list[Problem], list[Problem]]:
    """``(train, test)`` problems of ``config`` (test never repeats a training question).

    Examples:
        >>> from steerkit.probes.methods.region import RegionConfig, config_problems
        >>> train, test = config_problems(RegionConfig(data="mix", n_train=4, n_test=2))
        >>> [p.source for p in train], [p.source for p in test]
        (['gsm8k', 'gsm8k', 'arith', 'arith'], ['gsm8k', 'arith'])
    """
    cfg = config
    if cfg.data not in ("arith", "gsm8k", "mix"):
        raise InputError(f"expected data in ('arith', 'gsm8k', 'mix'), found {cfg.data!r}")
    if cfg.n_train < 2 or cfg.n_test < 0:
        raise InputError(f"expected n_train >= 2 and n_test >= 0, found {cfg.n_train} and {cfg.n_test}")
    if cfg.data != "arith" and cfg.n_train + cfg.n_test > 300:
        raise InputError(f"expected n_train + n_test <= 300 (the vendored GSM8K problems), found "
                         f"{cfg.n_train + cfg.n_test}")

    def problems(n, seed, offset, exclude=()):
        if n == 0:
            return []
        n_g = {"arith": 0, "gsm8k": n, "mix": n // 2}[cfg.data]
        out = gsm8k_problems(n_g, offset=offset) if n_g else []
        return out + arithmetic_problems(n - n_g, seed=seed, level=cfg.level, exclude=exclude)
    train = problems(cfg.n_train, cfg.seed, 0)
    test = problems(cfg.n_test, cfg.seed + 1, 300 - cfg.n_test, exclude=[p.question for p in train])
    return train, test


def run(sm: "SteerModel", config: RegionConfig | None = None, *, progress: bool = True) -> RegionResult:
    """The whole method on the problems of ``config`` (:func:`config_problems`, :func:`run_region`).

    Examples:
        >>> from steerkit.probes.methods import region
        >>> cfg = region.RegionConfig(n_train=2, n_test=0, n_components=2, n_clusters=1, keep="all",
        ...                           train_max_new_tokens=12)
        >>> res = region.run(sm, cfg, progress=False)  # (a few short solutions; see run_region)
        >>> res.layer, res.eval is None, res.n_train
        (20, True, 2)
    """
    cfg = config or RegionConfig()
    train, test = config_problems(cfg)
    with tqdm(total=2 * len(train) + 2 * len(test), desc="region", file=sys.stderr, disable=not progress) as bar:
        return run_region(sm, train, test, layer=cfg.layer, n_components=cfg.n_components,
                          n_clusters=cfg.n_clusters, strength=cfg.strength, max_new_tokens=cfg.max_new_tokens,
                          train_max_new_tokens=cfg.train_max_new_tokens, batch_size=cfg.batch_size, seed=cfg.seed,
                          keep=cfg.keep, min_kept=cfg.min_kept, progress=bar.update)
