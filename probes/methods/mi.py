"""MI peaks (Qian et al., NeurIPS 2025, "Demystifying reasoning dynamics with mutual information").

:func:`hsic_mi` is the paper's estimator (MI-Peaks ``estimate_mi_hsic`` / ``hsic_normalized_cca``):
each vector is reshaped to ``[-1, 1]`` (its coordinates are the samples), Gaussian kernel
``exp(-D / (2 sigma^2 * dim))`` on squared distances ``D``, right-centred ``K H``, and
``sum((Kx (Kx + eps m I)^-1) * (Ky (Ky + eps m I)^-1)^T)``, in float32 as the reference code.

:func:`mi_trajectory` generates greedily and, at every step t, estimates the MI between a layer's
output at the newest token and the representation of the reference solution (its last token at
the same layer, as MI-Peaks' ``reps[layer][0]`` of the reference pass); :func:`find_peaks` marks the
steps above ``mean + k * std``; :func:`peak_token_counts` pools the tokens at the peaks of many
trajectories (the paper's "thinking tokens" are the frequent ones).

The paper's two uses of thinking tokens are generation options of :mod:`steerkit.generation`:
representation recycling (``sm.generate(..., recycle=Recycle(layer, tokens))``: a step whose next
token is a thinking token is re-run with the block applied twice) and thinking-token continuation
(:func:`steerkit.generation.continue_thinking`). :func:`thinking_eval` compares them with plain
greedy decoding on arithmetic or GSM8K problems (accuracy with Wilson intervals, generated tokens,
recycled steps).

:func:`run` (``run(sm, MIConfig(...))``, ``steerkit mi-peaks``) computes the trajectories on GSM8K
questions, their peak tokens and optionally the thinking evaluation, as an :class:`MIResult`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from steerkit.storage.datafiles import read_jsonl
from steerkit.errors import InputError
from steerkit.generation import Recycle, continue_thinking, single_token_ids

from ..plots.require import plotly_required
from .region import EVAL_PROMPT, arithmetic_problems, gsm8k_problems, is_correct
from .temporal import wilson

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def _distmat(X: torch.Tensor) -> torch.Tensor:
    r = (X * X).sum(1).view(-1, 1)
    a = X @ X.T
    return (r.expand_as(a) - 2 * a + r.T.expand_as(a)).abs()


def _kernelmat(X: torch.Tensor, sigma: float) -> torch.Tensor:
    m = X.shape[0]
    H = torch.eye(m, dtype=X.dtype) - (1.0 / m) * torch.ones(m, m, dtype=X.dtype)
    Kx = torch.exp(-_distmat(X) / (2.0 * sigma * sigma * X.shape[1]))
    return Kx @ H


def hsic_mi(x, y, sigma: float = 50.0, eps: float = 1e-5, *, dtype=torch.float32) -> float:
    """Normalised HSIC estimate of the MI between ``x`` and ``y`` (vectors of equal length, or
    ``[m, d]`` sample matrices with equal ``m``).

    A vector shares more information with a noisy copy of itself than with noise.

    Examples:
        >>> from steerkit.probes.methods.mi import hsic_mi
        >>> x = torch.randn(64)
        >>> hsic_mi(x, x + 0.1 * torch.randn(64), sigma=1.0) > hsic_mi(x, torch.randn(64), sigma=1.0)
        True
    """
    x = torch.as_tensor(x).detach().to("cpu", dtype)
    y = torch.as_tensor(y).detach().to("cpu", dtype)
    if x.dim() == 1:
        x = x.reshape(-1, 1)
    if y.dim() == 1:
        y = y.reshape(-1, 1)
    if x.shape[0] != y.shape[0]:
        raise InputError(f"expected x and y with the same number of samples, found {x.shape[0]} and {y.shape[0]}")
    m = x.shape[0]
    Kxc, Kyc = _kernelmat(x, sigma), _kernelmat(y, sigma)
    I = torch.eye(m, dtype=dtype)
    Rx = Kxc @ torch.inverse(Kxc + eps * m * I)
    Ry = Kyc @ torch.inverse(Kyc + eps * m * I)
    return float((Rx * Ry.T).sum())


def find_peaks(values: Sequence[float], k: float = 2.0) -> list[int]:
    """Indices whose value exceeds ``mean + k * std`` (population std).

    Examples:
        >>> from steerkit.probes.methods.mi import find_peaks
        >>> find_peaks([1, 1, 1, 9, 1, 1, 1, 1]), find_peaks([1, 2, 3], k=5.0)
        ([3], [])
    """
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return []
    thr = v.mean() + k * v.std()
    return [int(i) for i in np.nonzero(v > thr)[0]]


@dataclass
class MITrajectory:
    """The MI between block ``layer``'s output at each generated token and a reference answer's
    representation, per generation step (``mi``), the decoded ``tokens`` and the ``peaks`` above
    mean + ``threshold_k`` std.

    Examples:
        >>> from steerkit.probes.methods.mi import MITrajectory
        >>> tr = MITrajectory(layer=20, mi=np.array([0.1, 0.2, 0.9, 0.1]), tokens=["So", ",", " Wait", " x"],
        ...                   peaks=[2])
        >>> tr.peak_tokens, tr.to_json()["peak_tokens"], type(tr.plot()).__name__
        ([' Wait'], [' Wait'], 'Figure')
    """

    layer: int
    mi: np.ndarray  # [steps]
    tokens: list[str]
    peaks: list[int]
    text: str = ""
    threshold_k: float = 2.0

    @property
    def peak_tokens(self) -> list[str]:
        return [self.tokens[i] for i in self.peaks]

    def to_dict(self) -> dict:
        return {"layer": self.layer, "mi": [float(x) for x in self.mi], "tokens": self.tokens, "peaks": self.peaks,
                "peak_tokens": self.peak_tokens, "text": self.text, "k": self.threshold_k}

    to_json = to_dict

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: MI per step, peaks marked with their tokens
        (:func:`steerkit.probes.plots.mi.trajectory_figure`)."""
        with plotly_required():
            from ..plots import mi as figures
        return figures.trajectory_figure(self, title)


def reference_rep(sm: "SteerModel", reference: str, layer: int, *, chat: bool = False) -> torch.Tensor:
    """The reference solution's representation: block ``layer``'s output at its last token.

    Examples:
        >>> from steerkit.probes.methods.mi import reference_rep
        >>> tuple(reference_rep(tiny, "The answer is 42.", layer=2).shape)
        (64,)
    """
    name = f"blocks.{layer}.hook_resid_post"
    with sm.record(name, positions="last") as cache:
        sm.forward([reference], chat=chat)
    return cache[name][0].float().cpu()


def mi_trajectory(sm: "SteerModel", prompt: str, reference: str, layer: int, *, max_new_tokens: int = 64, chat: bool = True,
                  k: float = 2.0, sigma: float = 50.0, eps: float = 1e-5) -> MITrajectory:
    """Greedy generation from ``prompt``; MI per step between block ``layer``'s output at the newest
    token and the reference representation. Step t's state is the one that produced token t (the
    last prompt token for t = 0, then each generated token).

    Examples:
        >>> from steerkit.probes.methods.mi import mi_trajectory
        >>> tr = mi_trajectory(tiny, "What is 2 + 3?", "2 + 3 = 5. The answer is 5.", layer=2, max_new_tokens=6)
        >>> tr.mi.shape, len(tr.tokens), tr.layer
        ((6,), 6, 2)
    """
    name = f"blocks.{layer}.hook_resid_post"
    ref = reference_rep(sm, reference, layer)
    with sm.record(name, positions="all") as cache:
        out = sm.generate([prompt], max_new_tokens=max_new_tokens, chat=chat, return_tokens=True)
    acts, pos = cache[name][0], cache.positions(name)[0]
    P = sm.tokenize([prompt], chat=chat).input_ids.shape[1]
    keep = pos >= P - 1
    states = acts[keep].float()
    ids = _new_ids(out)
    text = sm.tokenizer.decode(ids)
    tokens = [sm.tokenizer.decode([t]) for t in ids]
    n = min(len(tokens), states.shape[0])
    mi = np.array([hsic_mi(states[t], ref, sigma=sigma, eps=eps) for t in range(n)])
    return MITrajectory(layer, mi, tokens[:n], find_peaks(mi, k), text, k)


# The words the paper finds at MI peaks (reflection / transition tokens), as a default set.
THINKING_WORDS = ("So", "Wait", "Hmm", "Therefore", "Let", "Now", "Then", "First", "But")


def thinking_token_ids(tokenizer, words: Sequence[str] = THINKING_WORDS) -> tuple[list[int], list[str]]:
    """``(ids, dropped)``: the single-token forms (with and without a leading space) of ``words``, and
    the words that have no single-token form in this tokenizer.

    Examples:
        >>> from steerkit.probes.methods.mi import thinking_token_ids
        >>> ids, dropped = thinking_token_ids(tiny.tokenizer, ["Wait", "So"])
        >>> len(ids) >= 2, dropped, sorted({tiny.tokenizer.decode([i]).strip() for i in ids})
        (True, [], ['So', 'Wait'])
    """
    return single_token_ids(tokenizer, words)


def peak_token_counts(trajectories: Sequence[MITrajectory]) -> dict[str, int]:
    """How often each token (stripped) sits at an MI peak over ``trajectories``, most frequent first.

    Examples:
        >>> from steerkit.probes.methods.mi import MITrajectory, peak_token_counts
        >>> a = MITrajectory(20, np.zeros(3), [" Wait", " So", " Wait"], peaks=[0, 1, 2])
        >>> b = MITrajectory(20, np.zeros(2), [" x", "Wait"], peaks=[1])
        >>> peak_token_counts([a, b])
        {'Wait': 3, 'So': 1}
    """
    counts: dict[str, int] = {}
    for tr in trajectories:
        for t in tr.peak_tokens:
            counts[t.strip() or repr(t)] = counts.get(t.strip() or repr(t), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def thinking_eval(sm: "SteerModel", problems, *, layer: Optional[int] = None, words: Sequence[str] = THINKING_WORDS,
                  continue_with: Optional[str] = "Wait", max_new_tokens: int = 96, continue_tokens: int = 64,
                  batch_size: int = 8, progress=None, keep_texts: int = 3) -> dict:
    """Accuracy of greedy decoding, representation recycling at ``layer`` (default two thirds deep)
    on the thinking ``words``, and thinking-token continuation with ``continue_with`` (skipped when
    None), on ``problems`` (:class:`steerkit.probes.methods.region.Problem`, asked with its EVAL_PROMPT).

    Returns ``{condition: {"accuracy", "ci95", "n", "tokens_mean", ...}, "layer", "thinking_ids",
    "examples"}``; ``progress(n)`` is called per batch and condition.

    The mechanics on the tiny model, which cannot do arithmetic.

    Examples:
        >>> from steerkit.probes.methods.region import arithmetic_problems
        >>> from steerkit.probes.methods.mi import thinking_eval
        >>> out = thinking_eval(tiny, arithmetic_problems(2), max_new_tokens=4, continue_tokens=2)
        >>> out["layer"], out["n"], sorted(out["greedy"])
        (2, 2, ['accuracy', 'ci95', 'correct', 'tokens_mean'])
        >>> [c for c in ("greedy", "recycling", "continuation") if c in out]
        ['greedy', 'recycling', 'continuation']
    """
    problems = list(problems)
    if not problems:
        raise InputError("expected at least one problem, found none")
    layer = (2 * sm.n_layers) // 3 if layer is None else int(layer)
    ids, dropped = thinking_token_ids(sm.tokenizer, words)
    if not ids:
        raise InputError(f"expected at least one thinking word with a single-token form, found none in {list(words)}")
    prompts = [EVAL_PROMPT.format(question=p.question) for p in problems]
    tick = progress or (lambda n: None)
    texts: dict[str, list[str]] = {"greedy": [], "recycling": []}
    recycled = 0
    if continue_with:
        texts["continuation"] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        texts["greedy"] += sm.generate(chunk, max_new_tokens=max_new_tokens, chat=True)
        tick(1)
        rec = Recycle(layer=layer, tokens=ids)
        texts["recycling"] += sm.generate(chunk, max_new_tokens=max_new_tokens, chat=True, recycle=rec)
        recycled += len(rec.events)
        tick(1)
        if continue_with:
            c = continue_thinking(sm, chunk, continue_with, max_new_tokens=max_new_tokens,
                                  continue_tokens=continue_tokens, final_prompt=" The answer is", final_tokens=12,
                                  chat=True)
            texts["continuation"] += c.texts
            tick(1)
    out: dict = {"layer": layer, "thinking_ids": ids, "thinking_tokens": [sm.tokenizer.decode([t]) for t in ids],
                 "dropped_words": dropped, "n": len(problems), "recycled_steps": recycled}
    def tok(t):
        return len(sm.tokenizer.encode(t, add_special_tokens=False))
    for cond, ts in texts.items():
        if cond == "continuation":  # judge the answer given after the final prompt
            ok = [is_correct(t.rsplit(" The answer is", 1)[-1], p.answer) for t, p in zip(ts, problems)]
        else:
            ok = [is_correct(t, p.answer) for t, p in zip(ts, problems)]
        k = sum(ok)
        out[cond] = {"accuracy": k / len(ok), "correct": k, "ci95": list(wilson(k, len(ok))),
                     "tokens_mean": float(np.mean([tok(t) for t in ts]))}
    out["examples"] = [{"question": p.question, "answer": p.answer, **{c: texts[c][j] for c in texts}}
                       for j, p in enumerate(problems[:keep_texts])]
    return out


def _new_ids(out) -> list[int]:
    """Generated token ids of row 0 from ``generate(..., return_tokens=True)``."""
    if isinstance(out, tuple) and len(out) == 2:
        out = out[1]
    if isinstance(out, dict):
        out = out.get("tokens", out.get("ids"))
    x = out[0] if isinstance(out, (list, tuple)) else out
    if isinstance(x, torch.Tensor):
        x = x.reshape(-1).tolist()
    return [int(t) for t in x]


# --------------------------------------------------------------------------- the whole method
@dataclass
class MIConfig:
    """``steerkit mi-peaks``: MI trajectories on the first ``n`` rows of ``data`` (a question/answer jsonl;
    default: the vendored ``reasoning/gsm8k_test_first300.jsonl``) at ``layer`` (default two thirds deep),
    peaks above mean + ``k`` std. ``eval`` ("arith" or "gsm8k") also runs :func:`thinking_eval` on
    ``n_eval`` problems, recycling at ``recycle_layer`` (default ``layer``) on ``thinking_words``
    (default :data:`THINKING_WORDS`) and continuing with ``continue_with`` (empty: skipped).

    Examples:
        >>> from steerkit.probes.methods.mi import MIConfig
        >>> cfg = MIConfig(n=1, max_new_tokens=8, eval="arith", n_eval=2)
        >>> cfg.k, cfg.continue_with, cfg.layer is None  # None: two thirds deep
        (2.0, 'Wait', True)
    """

    data: Optional[str] = None
    n: int = 3
    layer: Optional[int] = None
    max_new_tokens: int = 96
    k: float = 2.0
    eval: Optional[str] = None
    n_eval: int = 30
    recycle_layer: Optional[int] = None
    thinking_words: Optional[tuple] = None
    continue_with: str = "Wait"
    eval_tokens: int = 96
    eval_batch_size: int = 8


@dataclass
class MIResult:
    """One :class:`MITrajectory` per question, the tokens at their peaks, and the thinking evaluation.

    Examples:
        >>> from steerkit.probes.methods import mi
        >>> res = mi.run(tiny, mi.MIConfig(n=2, max_new_tokens=5), progress=False)
        >>> res.layer, len(res.trajectories), sorted(res.to_json()), type(res.plot()).__name__
        (2, 2, ['mi', 'peak_tokens'], 'Figure')
    """

    layer: int
    trajectories: list = field(default_factory=list)
    thinking_eval: Optional[dict] = None
    eval_data: Optional[str] = None

    @property
    def peak_tokens(self) -> dict[str, int]:
        return peak_token_counts(self.trajectories)

    def to_json(self) -> dict:
        out = {"mi": [t.to_dict() for t in self.trajectories], "peak_tokens": self.peak_tokens}
        if self.thinking_eval is not None:
            out["thinking_eval"] = self.thinking_eval
        return out

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: MI per generation step, one line per question, peaks marked
        (:func:`steerkit.probes.plots.mi.result_figure`)."""
        with plotly_required():
            from ..plots import mi as figures
        return figures.result_figure(self, title)


def run(sm: "SteerModel", config: MIConfig | None = None, *, progress: bool = True) -> MIResult:
    """MI trajectories and their peaks on the questions; with ``config.eval``, :func:`thinking_eval`.

    One GSM8K question from the vendored data, a few generated tokens.

    Examples:
        >>> from steerkit.probes.methods import mi
        >>> res = mi.run(tiny, mi.MIConfig(n=1, max_new_tokens=6, layer=3), progress=False)
        >>> res.trajectories[0].layer, res.trajectories[0].mi.shape, res.thinking_eval is None
        (3, (6,), True)
    """
    cfg = config or MIConfig()
    if cfg.eval not in (None, "arith", "gsm8k"):
        raise InputError(f"expected eval None, 'arith' or 'gsm8k', found {cfg.eval!r}")
    rows = read_jsonl("reasoning/gsm8k_test_first300.jsonl", path=cfg.data, n=cfg.n, what="question/answer rows")
    layer = cfg.layer if cfg.layer is not None else (2 * sm.n_layers) // 3
    res = MIResult(layer, eval_data=cfg.eval)
    with tqdm(total=len(rows), desc="mi-peaks", file=sys.stderr, disable=not progress) as bar:
        for r in rows:
            q, a = r.get("question") or r.get("prompt"), r.get("answer") or r.get("solution")
            res.trajectories.append(mi_trajectory(sm, q, a, layer, max_new_tokens=cfg.max_new_tokens, k=cfg.k))
            bar.update(1)
    if cfg.eval:
        probs = arithmetic_problems(cfg.n_eval, seed=1) if cfg.eval == "arith" else gsm8k_problems(cfg.n_eval)
        words = list(cfg.thinking_words) if cfg.thinking_words else THINKING_WORDS
        rl = cfg.recycle_layer if cfg.recycle_layer is not None else layer
        bs = cfg.eval_batch_size
        steps = -(-len(probs) // bs) * (3 if cfg.continue_with else 2)
        with tqdm(total=steps, desc="thinking eval", file=sys.stderr, disable=not progress) as bar:
            res.thinking_eval = thinking_eval(sm, probs, layer=rl, words=words, continue_with=cfg.continue_with or None,
                                              max_new_tokens=cfg.eval_tokens, batch_size=bs, progress=bar.update)
    return res
