"""The hidden critique vector (Phan et al. 2026, "hidden critique ability" of reasoning models).

Reasoning models that make an arithmetic error and still reach the right final answer carry, in the
residual stream over the final-answer tokens, a trace of having noticed the error. The method contrasts
those *recoveries* with clean traces of the same questions and steers along the difference to change
how readily the model says a solution contains a wrong step.

* Data (:mod:`.critique_data`: :func:`arithmetic_traces`, :func:`trace_pairs`, re-exported here):
  templated multi-step arithmetic
  ("Start with 12. Add 7. Multiply by 3. ...") solved one step per line, clean or with one corrupted
  step whose written result is off by a nonzero amount; later steps compute correctly from the
  written (wrong) value, so the final answer as written is wrong, while :meth:`ArithTrace.recovered`
  is the same erroneous trace with the *right* final answer. Deterministic for a seed. The vendored
  GSM8K error prefixes (:func:`gsm8k_error_traces`; MIT, see ``steerkit/data/README.md``) are
  available as extra erroneous reasoning.
* Activations (:func:`critique_activations`): the output of block ``l``
  (``blocks.{l}.hook_resid_post``) averaged over the final-answer span -- the tokens of the answer
  sentence ``"The answer is N."`` appended after the reasoning (teacher-forced, chat-formatted
  question, the reasoning as the assistant's text).
* Vector (:func:`critique_vector`): ``v_l = mean(error traces with the right final answer) -
  mean(clean traces of the same questions)``, every layer, not normalised. Which error traces count
  as recoveries is decided by the model: given the erroneous steps, its greedy answer after
  ``"The answer is"`` equals the true one. A small model rarely recovers; when fewer than
  ``min_recoveries`` items recover (``contrast="auto"``), the contrast falls back to *error vs clean*:
  every corrupted trace as written (wrong final answer) against the clean traces. The contrast used is
  in :attr:`CritiqueResult.contrast` and the artifact's ``method_params``.
* Steering (:func:`steer_critique`): ``alpha * v_l`` added to block ``l``'s output at every position
  (one :meth:`steerkit.Intervention.add`).
* Evaluation (:func:`detection_eval`, :func:`critique_sweep`): the yes/no prompt "Is there a wrong
  step in this solution?" on erroneous and correct step sequences (held-out questions); the model's
  answer is ``logit("Yes") > logit("No")`` at the answer position (token ids from the tokenizer at run
  time). Error-detection F1 = harmonic mean of the accuracy on erroneous and on correct sequences,
  per alpha and layer (also the AUROC of the Yes-No margin, a threshold-free diagnostic that is not
  in the paper). :func:`logit_lens_tokens` reads the vector's top tokens through the final norm
  and the unembedding.

Deviations from the paper: a small non-reasoning model (default SmolLM2-135M-Instruct) instead of
reasoning models with their own traces; templated arithmetic traces (teacher-forced, not generated);
the contrast falls back to error-vs-clean where recoveries are too rare.

:func:`run` (``run(sm, CritiqueConfig(...))``, ``steerkit critique``) runs it all with a progress bar;
a :class:`CritiqueResult` (``to_json``, ``plot``, ``artifacts``).
"""
from __future__ import annotations

import re
import time
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.hooks.names import resid_post
from steerkit.interventions import Intervention
from steerkit.vectors import SteeringVector

from ..lens import vector_lens
from ..metrics import auroc
from ..plots.require import plotly_required
from .critique_data import ArithTrace, trace_pairs
from .critique_data import arithmetic_traces as arithmetic_traces
from .critique_data import check_step as check_step
from .critique_data import gsm8k_error_traces as gsm8k_error_traces
from .critique_data import make_trace as make_trace

if TYPE_CHECKING:
    from steerkit.model import SteerModel

METHOD = "critique-phan"
DETECT_QUESTION = "Is there a wrong step in this solution?"
SOLVE_PROMPT = "{question}\nSolve it step by step and finish with 'The answer is <number>.'"
DETECT_PROMPT = "{question}\n\nSolution:\n{solution}\n\n" + DETECT_QUESTION + " Answer Yes or No."
DEFAULT_ALPHAS = tuple(round(-1.0 + 0.2 * i, 1) for i in range(11))
CONTRASTS = ("auto", "recovery", "error")


# --------------------------------------------------------------------------- activations

def _hook(layer: int) -> str:
    return resid_post(layer)[0]


def _ids(sm: "SteerModel", text: str, first: bool) -> list:
    tok = sm.tokenizer
    chat = bool(getattr(tok, "chat_template", None))
    return tok(text, add_special_tokens=first and not chat)["input_ids"]


def _split(sm: "SteerModel", trace: ArithTrace, chat: bool) -> tuple[list, list]:
    """Token ids of (prompt + reasoning + newline) and of the answer sentence."""
    prefix = sm.format(SOLVE_PROMPT.format(question=trace.question), chat) + trace.reasoning + "\n"
    return _ids(sm, prefix, True), _ids(sm, trace.answer_sentence, False)


def _check_traces(traces, what: str) -> list:
    traces = list(traces)
    if not traces:
        raise InputError(f"expected at least one {what} trace, found none")
    bad = [t for t in traces if not isinstance(t, ArithTrace)]
    if bad:
        raise InputError(f"expected ArithTrace items as {what} traces, found {type(bad[0]).__name__}")
    return traces


def critique_activations(sm: "SteerModel", traces: Sequence[ArithTrace], *, layers: Sequence[int] | None = None,
                         chat: bool = True, batch_size: int = 16,
                         progress: Callable[[int], None] | None = None) -> Tensor:
    """``[n_traces, n_layers, d_model]`` (float32, CPU): block outputs averaged over the answer span.

    Examples:
        >>> from steerkit.probes.methods.critique import arithmetic_traces, critique_activations
        >>> tuple(critique_activations(tiny, arithmetic_traces(3)).shape)
        (3, 4, 64)
        >>> tuple(critique_activations(tiny, arithmetic_traces(3), layers=[1, 2]).shape)
        (3, 2, 64)
    """
    traces = _check_traces(traces, "input")
    layers = list(range(sm.n_layers)) if layers is None else [int(l) for l in layers]
    for l in layers:
        if not 0 <= l < sm.n_layers:
            raise InputError(f"expected layers in 0..{sm.n_layers - 1}, found {l}")
    names = [_hook(l) for l in layers]
    out = []
    for i in range(0, len(traces), batch_size):
        batch = traces[i:i + batch_size]
        parts = [_split(sm, t, chat) for t in batch]
        ids = [p + s for p, s in parts]
        toks = sm.pad(ids)
        P = toks.input_ids.shape[1]
        mask = torch.zeros(len(batch), P, dtype=torch.bool)
        for r, (_, s) in enumerate(parts):
            mask[r, P - len(s):] = True
        with sm.record(names, positions=mask.to(sm.device)) as cache:
            sm.forward(toks, chat=False)
        lens = torch.tensor([len(s) for _, s in parts], dtype=torch.float32)
        acts = torch.stack([cache[n].float().cpu().sum(1) / lens[:, None] for n in names], 1)
        out.append(acts)
        if progress:
            progress(len(batch))
    return torch.cat(out)


def model_answers(sm: "SteerModel", traces: Sequence[ArithTrace], *, chat: bool = True, batch_size: int = 16,
                  max_new_tokens: int = 8) -> list[int | None]:
    """The model's greedy final answer after each trace's steps and ``"The answer is"``.

    The random tiny model rarely writes a number: ``None`` then.

    Examples:
        >>> from steerkit.probes.methods.critique import arithmetic_traces
        >>> from steerkit.probes.methods.critique import model_answers
        >>> answers = model_answers(tiny, arithmetic_traces(2), max_new_tokens=3)
        >>> len(answers), all(a is None or isinstance(a, int) for a in answers)
        (2, True)
    """
    traces = _check_traces(traces, "input")
    out = []
    for i in range(0, len(traces), batch_size):
        batch = traces[i:i + batch_size]
        prompts = [sm.format(SOLVE_PROMPT.format(question=t.question), chat) + t.reasoning + "\nThe answer is"
                   for t in batch]
        texts = sm.generate(prompts, max_new_tokens=max_new_tokens, chat=False)
        for t in texts:
            m = re.match(r"\s*\$?\s*(-?\d[\d,]*)", t)
            out.append(int(m.group(1).replace(",", "")) if m else None)
    return out


@dataclass
class CritiqueVector:
    """``vectors[l]`` per layer (``[n_layers, d_model]``), the contrast used and its counts.

    Examples:
        >>> from steerkit.probes.methods.critique import critique_vector, trace_pairs
        >>> clean, corrupted = zip(*trace_pairs(3))
        >>> cv = critique_vector(tiny, clean, corrupted, contrast="error")
        >>> tuple(cv.vectors.shape), cv.contrast, cv.n_pos, cv.n_neg, cv.n_items
        ((4, 64), 'error', 3, 3, 3)
    """

    vectors: Tensor
    contrast: str
    n_pos: int
    n_neg: int
    n_recovered: int
    n_items: int


def vector_from_activations(pos: Tensor, neg: Tensor) -> Tensor:
    """``mean(pos) - mean(neg)`` over the first axis (not normalised).

    Examples:
        >>> from steerkit.probes.methods.critique import vector_from_activations
        >>> vector_from_activations(torch.tensor([[2.0, 0.0], [4.0, 0.0]]), torch.tensor([[1.0, 1.0]]))
        tensor([ 2., -1.])
    """
    pos, neg = torch.as_tensor(pos), torch.as_tensor(neg)
    if pos.shape[0] == 0 or neg.shape[0] == 0:
        raise InputError(f"expected both activation sets non-empty, found {pos.shape[0]} positive and "
                         f"{neg.shape[0]} negative rows")
    if pos.shape[1:] != neg.shape[1:]:
        raise InputError(f"expected activation sets of the same trailing shape, found {tuple(pos.shape[1:])} "
                         f"and {tuple(neg.shape[1:])}")
    return pos.float().mean(0) - neg.float().mean(0)


def critique_vector(sm: "SteerModel", clean: Sequence[ArithTrace], corrupted: Sequence[ArithTrace], *, contrast: str = "auto",
                    min_recoveries: int = 4, recovered: Sequence[bool] | None = None, chat: bool = True,
                    batch_size: int = 16, progress: Callable[[int], None] | None = None) -> CritiqueVector:
    """The critique vector at every layer from paired clean / corrupted traces of the same questions.

    ``contrast``: ``"recovery"`` (corrupted traces the model recovers on, written with the right final
    answer, minus the clean traces of those questions), ``"error"`` (every corrupted trace as written
    minus every clean trace) or ``"auto"`` (recovery when at least ``min_recoveries`` items recover,
    else error). ``recovered`` (one bool per item) skips asking the model which items it recovers on.

    ``recovered`` given, so the model is not asked.

    Examples:
        >>> from steerkit.probes.methods.critique import critique_vector, trace_pairs
        >>> clean, corrupted = zip(*trace_pairs(4))
        >>> cv = critique_vector(tiny, clean, corrupted, recovered=[True, False, True, False], min_recoveries=2)
        >>> cv.contrast, cv.n_recovered, cv.n_pos
        ('recovery', 2, 2)
    """
    clean, corrupted = _check_traces(clean, "clean"), _check_traces(corrupted, "corrupted")
    if len(clean) != len(corrupted):
        raise InputError(f"expected one clean trace per corrupted trace (same questions), found {len(clean)} "
                         f"clean and {len(corrupted)} corrupted")
    if contrast not in CONTRASTS:
        raise InputError(f"expected contrast in {CONTRASTS}, found {contrast!r}")
    for i, (c, e) in enumerate(zip(clean, corrupted)):
        if c.question != e.question or c.corrupted != -1 or e.corrupted < 0:
            raise InputError(f"expected pair {i} to be a clean and a corrupted trace of the same question, found "
                             f"corrupted indices {c.corrupted} and {e.corrupted}"
                             + ("" if c.question == e.question else " and different questions"))
    if recovered is None:
        if contrast == "error":
            recovered = [False] * len(clean)
        else:
            answers = model_answers(sm, corrupted, chat=chat, batch_size=batch_size)
            recovered = [a == e.true_answer for a, e in zip(answers, corrupted)]
    recovered = [bool(x) for x in recovered]
    if len(recovered) != len(clean):
        raise InputError(f"expected one recovered flag per item ({len(clean)}), found {len(recovered)}")
    n_rec = sum(recovered)
    used = contrast
    if contrast == "auto":
        used = "recovery" if n_rec >= max(1, min_recoveries) else "error"
    if used == "recovery":
        idx = [i for i, r in enumerate(recovered) if r]
        if not idx:
            raise InputError("expected at least one recovery (a corrupted trace the model still answers right) "
                             "for contrast='recovery', found none; use contrast='error' or 'auto'")
        pos_t = [corrupted[i].recovered() for i in idx]
        neg_t = [clean[i] for i in idx]
    else:
        pos_t, neg_t = list(corrupted), list(clean)
    pos = critique_activations(sm, pos_t, chat=chat, batch_size=batch_size, progress=progress)
    neg = critique_activations(sm, neg_t, chat=chat, batch_size=batch_size, progress=progress)
    return CritiqueVector(vector_from_activations(pos, neg), used, len(pos_t), len(neg_t), n_rec, len(clean))


# --------------------------------------------------------------------------- steering and evaluation

def steer_critique(sm: "SteerModel", vector, layer: int, alpha: float):
    """A handle adding ``alpha * vector`` to block ``layer``'s output at every position (use with ``with``).

    Examples:
        >>> from steerkit.probes.methods.critique import steer_critique
        >>> plain = tiny("Is this right?")
        >>> with steer_critique(tiny, torch.randn(64), layer=2, alpha=3.0):
        ...     steered = tiny("Is this right?")
        >>> bool((steered - plain).abs().max() > 0)
        True
    """
    if not 0 <= int(layer) < sm.n_layers:
        raise InputError(f"expected layer in 0..{sm.n_layers - 1}, found {layer}")
    v = torch.as_tensor(vector, dtype=torch.float32)
    return sm.steer(Intervention.add(_hook(int(layer)), v, float(alpha)), label=f"critique L{int(layer)} x{alpha:g}")


def yes_no_ids(tokenizer) -> tuple[int, int]:
    """Token ids of ``"Yes"`` and ``"No"`` (the first token of each), checked to differ.

    Examples:
        >>> from steerkit.probes.methods.critique import yes_no_ids
        >>> yes, no = yes_no_ids(tiny.tokenizer)
        >>> tiny.tokenizer.decode([yes]), tiny.tokenizer.decode([no])
        ('Yes', 'No')
    """
    y = tokenizer("Yes", add_special_tokens=False)["input_ids"]
    n = tokenizer("No", add_special_tokens=False)["input_ids"]
    if not y or not n or y[0] == n[0]:
        raise InputError(f"expected distinct first tokens for 'Yes' and 'No', found {y} and {n}")
    return int(y[0]), int(n[0])


def detection_prompt(trace: ArithTrace) -> str:
    """The error-detection question about ``trace``: the question, its steps and :data:`DETECT_QUESTION`.

    Examples:
        >>> from steerkit.probes.methods.critique import detection_prompt, make_trace
        >>> t = make_trace(0, corrupt=False)
        >>> p = detection_prompt(t)
        >>> p.startswith(t.question), p.endswith("Answer Yes or No."), t.steps[0] in p
        (True, True, True)
    """
    return DETECT_PROMPT.format(question=trace.question, solution=trace.reasoning)


def f1_score(acc_error: float, acc_correct: float) -> float:
    """Harmonic mean of the accuracies on erroneous and on correct sequences (0 when both are 0).

    Examples:
        >>> from steerkit.probes.methods.critique import f1_score
        >>> f1_score(1.0, 0.5), f1_score(0.0, 0.0)
        (0.6666666666666666, 0.0)
    """
    s = acc_error + acc_correct
    return 0.0 if s == 0 else 2.0 * acc_error * acc_correct / s


def detection_scores(pred_error: Sequence[bool], is_error: Sequence[bool]) -> dict:
    """Accuracy on erroneous (``is_error``) and correct sequences, and their harmonic mean ``f1``.

    Examples:
        >>> from steerkit.probes.methods.critique import detection_scores
        >>> d = detection_scores([True, True, False, True], [True, True, False, False])
        >>> d["acc_error"], d["acc_correct"], round(d["f1"], 3)
        (1.0, 0.5, 0.667)
    """
    p, y = np.asarray(pred_error, bool), np.asarray(is_error, bool)
    if p.shape != y.shape:
        raise InputError(f"expected one prediction per sequence, found {p.size} predictions for {y.size} sequences")
    if not y.any() or y.all():
        raise InputError(f"expected both erroneous and correct sequences, found {int(y.sum())} erroneous of {y.size}")
    acc_e, acc_c = float(p[y].mean()), float((~p[~y]).mean())
    return {"f1": f1_score(acc_e, acc_c), "acc_error": acc_e, "acc_correct": acc_c, "n_error": int(y.sum()),
            "n_correct": int((~y).sum())}


def yes_no_margins(sm: "SteerModel", traces: Sequence[ArithTrace], *, vector=None, layer: int | None = None,
                   alpha: float = 0.0, chat: bool = True, batch_size: int = 16) -> np.ndarray:
    """``logit(Yes) - logit(No)`` at the answer position of each detection prompt (steered when given).

    Examples:
        >>> from steerkit.probes.methods.critique import arithmetic_traces
        >>> from steerkit.probes.methods.critique import yes_no_margins
        >>> traces = arithmetic_traces(3)
        >>> plain = yes_no_margins(tiny, traces)
        >>> steered = yes_no_margins(tiny, traces, vector=torch.randn(64), layer=2, alpha=4.0)
        >>> plain.shape, bool(abs(plain - steered).max() > 0)
        ((3,), True)
    """
    traces = _check_traces(traces, "evaluation")
    yes, no = yes_no_ids(sm.tokenizer)
    out = []
    for i in range(0, len(traces), batch_size):
        batch = traces[i:i + batch_size]
        prompts = [detection_prompt(t) for t in batch]
        if vector is not None and alpha != 0.0:
            with steer_critique(sm, vector, layer, alpha):
                logits = sm.forward(prompts, chat=chat)[:, -1].float()
        else:
            logits = sm.forward(prompts, chat=chat)[:, -1].float()
        out.append((logits[:, yes] - logits[:, no]).cpu().numpy())
    return np.concatenate(out)


def detection_eval(sm: "SteerModel", traces: Sequence[ArithTrace], *, vector=None, layer: int | None = None,
                   alpha: float = 0.0, chat: bool = True, batch_size: int = 16) -> dict:
    """Error-detection scores (:func:`detection_scores`) with ``alpha * vector`` at block ``layer``.

    Examples:
        >>> from steerkit.probes.methods.critique import detection_eval, trace_pairs
        >>> traces = [t for pair in trace_pairs(2) for t in pair]  # two correct, two erroneous
        >>> d = detection_eval(tiny, traces)
        >>> d["n_error"], d["n_correct"], 0 <= d["f1"] <= 1, 0 <= d["auroc"] <= 1
        (2, 2, True, True)
    """
    traces = _check_traces(traces, "evaluation")
    m = yes_no_margins(sm, traces, vector=vector, layer=layer, alpha=alpha, chat=chat, batch_size=batch_size)
    y = [t.corrupted >= 0 for t in traces]
    d = detection_scores(m > 0, y)
    d["mean_margin"] = float(m.mean())
    d["auroc"] = auroc(np.asarray(y), m)  # threshold-free: do erroneous sequences get a higher Yes-No margin?
    return d


def critique_sweep(sm: "SteerModel", vectors: Tensor, traces: Sequence[ArithTrace], layers: Sequence[int] | None = None,
                   alphas: Sequence[float] = DEFAULT_ALPHAS, *, chat: bool = True, batch_size: int = 16,
                   progress: Callable[[int], None] | None = None) -> list[dict]:
    """Rows ``{layer, alpha, f1, acc_error, acc_correct, ...}`` over layers x alphas (``alpha = 0`` is
    the unsteered model, computed once).

    Examples:
        >>> from steerkit.probes.methods.critique import critique_sweep, critique_vector, trace_pairs
        >>> clean, corrupted = zip(*trace_pairs(2))
        >>> cv = critique_vector(tiny, clean, corrupted, contrast="error")
        >>> rows = critique_sweep(tiny, cv.vectors, list(clean + corrupted), layers=[1, 2], alphas=(0.0, 1.0))
        >>> [(r["layer"], r["alpha"]) for r in rows], rows[0]["f1"] == rows[2]["f1"]  # alpha 0: one baseline
        ([(1, 0.0), (1, 1.0), (2, 0.0), (2, 1.0)], True)
    """
    traces = _check_traces(traces, "evaluation")
    vectors = torch.as_tensor(vectors)
    layers = list(range(sm.n_layers)) if layers is None else [int(l) for l in layers]
    alphas = [float(a) for a in alphas]
    if not layers or not alphas:
        raise InputError(f"expected at least one layer and one alpha, found {len(layers)} and {len(alphas)}")
    if vectors.ndim != 2 or vectors.shape[0] != sm.n_layers:
        raise InputError(f"expected vectors [n_layers={sm.n_layers}, d_model], found {tuple(vectors.shape)}")
    base = None
    rows = []
    for l in layers:
        if not 0 <= l < sm.n_layers:
            raise InputError(f"expected layers in 0..{sm.n_layers - 1}, found {l}")
        for a in alphas:
            if a == 0.0:
                if base is None:
                    base = detection_eval(sm, traces, chat=chat, batch_size=batch_size)
                d = dict(base)
            else:
                d = detection_eval(sm, traces, vector=vectors[l], layer=l, alpha=a, chat=chat, batch_size=batch_size)
            rows.append({"layer": l, "alpha": a, **d})
            if progress:
                progress(1)
    return rows


def logit_lens_tokens(sm: "SteerModel", v, k: int = 10) -> dict:
    """Top and bottom ``k`` tokens of ``v`` through the final norm and the unembedding, soft-capped where the
    model caps its logits (:func:`steerkit.probes.lens.vector_lens`), as ``{"top": [...], "bottom": [...]}``.

    Examples:
        >>> from steerkit.probes.methods.critique import logit_lens_tokens
        >>> v = tiny.hf_model.lm_head.weight[5099].detach()  # the unembedding row of " Mary"
        >>> lens = logit_lens_tokens(tiny, v, k=3)
        >>> len(lens["top"]), len(lens["bottom"]), lens["top"][0][0]
        (3, 3, ' Mary')
    """
    top, bottom = vector_lens(sm, v, k)
    return {"top": top, "bottom": bottom}


# --------------------------------------------------------------------------- one run

@dataclass
class CritiqueResult:
    """Everything one run of the method produced (see :func:`run_critique`).

    Examples:
        >>> from steerkit.probes.methods.critique import run_critique
        >>> res = run_critique(tiny, n=4, layers=[2], alphas=(0.0, 1.0), contrast="error", lens_k=3)
        >>> res.best()["layer"], res.baseline()["alpha"], len(res.norms), type(res.plot()).__name__
        (2, 0.0, 4, 'Figure')
        >>> vec = res.artifacts(tiny)["critique-vector"]
        >>> vec.layers, store.save("critique", vec), res.to_json()["saved_layer"]
        ([2], 'critique@1', 2)
    """

    vectors: Tensor  # [n_layers, d_model]
    contrast: str
    n_pos: int
    n_neg: int
    n_recovered: int
    n_train: int
    layers: list
    alphas: list
    rows: list  # critique_sweep rows
    lens: dict = field(default_factory=dict)  # layer -> {"top", "bottom"}
    model_name: str = ""
    seconds: float = 0.0
    saved_layer: Optional[int] = None  # the layer :meth:`artifacts` saves (default: the best row's)
    seed: int = 0

    @property
    def norms(self) -> list:
        return [float(x) for x in self.vectors.norm(dim=-1)]

    def baseline(self) -> dict | None:
        r = [x for x in self.rows if x["alpha"] == 0.0]
        return r[0] if r else None

    def best(self) -> dict | None:
        """The row with the highest F1 (ties: the smaller |alpha|, then the earlier layer)."""
        if not self.rows:
            return None
        return max(self.rows, key=lambda r: (r["f1"], -abs(r["alpha"]), -r["layer"]))

    def to_dict(self) -> dict:
        return {"method": METHOD, "model": self.model_name, "contrast": self.contrast, "n_pos": self.n_pos,
                "n_neg": self.n_neg, "n_recovered": self.n_recovered, "n_train": self.n_train,
                "layers": list(self.layers), "alphas": list(self.alphas), "rows": self.rows, "norms": self.norms,
                "lens": {str(k): v for k, v in self.lens.items()}, "best": self.best(), "seconds": self.seconds}

    def to_json(self) -> dict:
        """:meth:`to_dict` with the saved layer."""
        return {**self.to_dict(), "saved_layer": self.artifact_layer()}

    def artifact_layer(self) -> int | None:
        if self.saved_layer is not None:
            return int(self.saved_layer)
        b = self.best()
        return None if b is None else int(b["layer"])

    def artifacts(self, sm: "SteerModel") -> dict:
        """``{"critique-vector": SteeringVector}`` at :meth:`artifact_layer` (:func:`to_artifact`)."""
        layer = self.artifact_layer()
        if layer is None:
            raise InputError("expected at least one evaluated row to choose the saved layer, found none; set "
                             "saved_layer")
        return {"critique-vector": to_artifact(sm, self, layer, seed=self.seed)}

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: error-detection F1 against alpha, one line per layer
        (:func:`steerkit.probes.plots.critique.f1_figure`)."""
        with plotly_required():
            from ..plots import critique as figures
        return figures.f1_figure(self, title)


def run_critique(sm: "SteerModel", n: int = 40, *, n_eval: int | None = None, layers: Sequence[int] | None = None,
                 alphas: Sequence[float] = DEFAULT_ALPHAS, contrast: str = "auto", min_recoveries: int = 4,
                 seed: int = 0, chat: bool = True, batch_size: int = 16, lens_k: int = 10,
                 progress: Callable[[int], None] | None = None) -> CritiqueResult:
    """Vector from ``n`` question pairs (seed ``seed``); detection F1 on ``n_eval`` (default ``n``) held-out
    questions (seed ``seed + 1``), half of them corrupted, over ``layers`` x ``alphas``.

    Examples:
        >>> from steerkit.probes.methods.critique import run_critique
        >>> res = run_critique(tiny, n=4, n_eval=4, layers=[1, 3], alphas=(0.0, 2.0), contrast="error", lens_k=2)
        >>> res.contrast, res.n_train, len(res.rows), sorted(res.lens)
        ('error', 4, 4, [1, 3])
    """
    if n < 1:
        raise InputError(f"expected n >= 1 training questions, found {n}")
    n_eval = n if n_eval is None else n_eval
    if n_eval < 2:
        raise InputError(f"expected n_eval >= 2 (erroneous and correct sequences), found {n_eval}")
    t0 = time.perf_counter()
    pairs = trace_pairs(n, seed)
    cv = critique_vector(sm, [c for c, _ in pairs], [e for _, e in pairs], contrast=contrast,
                         min_recoveries=min_recoveries, chat=chat, batch_size=batch_size, progress=progress)
    ev_pairs = trace_pairs(n_eval, seed + 1)
    ev = [e if i % 2 else c for i, (c, e) in enumerate(ev_pairs)]
    layers = list(range(sm.n_layers)) if layers is None else [int(l) for l in layers]
    rows = critique_sweep(sm, cv.vectors, ev, layers, alphas, chat=chat, batch_size=batch_size, progress=progress)
    lens = {l: logit_lens_tokens(sm, cv.vectors[l], lens_k) for l in layers} if lens_k else {}
    return CritiqueResult(cv.vectors, cv.contrast, cv.n_pos, cv.n_neg, cv.n_recovered, n, layers,
                          [float(a) for a in alphas], rows, lens, sm.name, time.perf_counter() - t0)


def to_artifact(sm: "SteerModel", result: CritiqueResult, layer: int, *, seed: int = 0):
    """The vector at ``layer`` as a ``SteeringVector`` with provenance (contrast, counts) and metrics.

    Examples:
        >>> from steerkit.probes.methods.critique import run_critique
        >>> from steerkit.probes.methods.critique import to_artifact
        >>> res = run_critique(tiny, n=4, layers=[2], alphas=(0.0,), contrast="error", lens_k=0)
        >>> vec = to_artifact(tiny, res, layer=3)
        >>> vec.layers, vec.provenance.method_params["contrast"]
        ([3], 'error')
    """
    if not 0 <= layer < result.vectors.shape[0]:
        raise InputError(f"expected layer in 0..{result.vectors.shape[0] - 1}, found {layer}")
    rows = [r for r in result.rows if r["layer"] == layer]
    return SteeringVector.from_direction(
        result.vectors[layer], layer, sm, method=METHOD,
        method_params={"contrast": result.contrast, "n_pos": result.n_pos, "n_neg": result.n_neg,
                       "n_recovered": result.n_recovered, "n_train": result.n_train, "seed": seed,
                       "span": "final-answer sentence", "hook": _hook(layer)},
        metrics={"rows": rows, "norm": result.norms[layer], "lens": result.lens.get(layer, {})})


# --------------------------------------------------------------------------- the method's config
@dataclass
class CritiqueConfig:
    """``steerkit critique``: ``n`` training questions (a clean and a corrupted trace each), ``n_eval``
    held-out step sequences (default ``n``), swept over ``layers`` (``None``: every 5th layer and the
    last, a subset to save CPU time; ``"all"``: every layer) x ``alphas``; ``layer``: the layer whose
    vector is saved (default: the layer of the best F1 among the swept ones).

    Examples:
        >>> from steerkit.probes.methods.critique import CritiqueConfig
        >>> CritiqueConfig().n, CritiqueConfig(layers=[3, 5]).swept_layers(30)
        (40, [3, 5])
    """

    n: int = 40
    n_eval: Optional[int] = None
    layers: Optional[object] = None  # None | "all" | a sequence of layer indices
    alphas: tuple = DEFAULT_ALPHAS
    contrast: str = "auto"
    min_recoveries: int = 4
    layer: Optional[int] = None
    batch_size: int = 16
    seed: int = 0

    def swept_layers(self, n_layers: int) -> list[int]:
        """The layers the sweep covers on a model with ``n_layers`` blocks."""
        if self.layers is None:
            return sorted(set(range(0, n_layers, 5)) | {n_layers - 1})
        if isinstance(self.layers, str):
            if self.layers != "all":
                raise InputError(f"expected layers None, 'all' or a list of layer indices, found {self.layers!r}")
            return list(range(n_layers))
        return [int(l) for l in self.layers]


def run(sm: "SteerModel", config: CritiqueConfig | None = None, *, progress: bool = True) -> CritiqueResult:
    """The whole method (:func:`run_critique`) with a progress bar; the result saves the vector of
    ``config.layer`` (default: the best F1's layer) through :meth:`CritiqueResult.artifacts`.

    Examples:
        >>> from steerkit.probes.methods import critique
        >>> cfg = critique.CritiqueConfig(n=4, n_eval=4, layers=[2], alphas=(0.0, 1.0), contrast="error", layer=2)
        >>> res = critique.run(tiny, cfg, progress=False)
        >>> res.artifact_layer(), sorted(res.artifacts(tiny))
        (2, ['critique-vector'])
    """
    cfg = config or CritiqueConfig()
    n_eval = cfg.n if cfg.n_eval is None else cfg.n_eval
    if cfg.n < 1 or n_eval < 2:
        raise InputError(f"expected n >= 1 and n_eval >= 2, found {cfg.n} and {n_eval}")
    layers = cfg.swept_layers(sm.n_layers)
    alphas = [float(a) for a in cfg.alphas]
    if cfg.layer is not None and cfg.layer not in layers:
        raise InputError(f"expected layer among the swept layers {layers}, found {cfg.layer}")
    total = 2 * cfg.n + len(layers) * len(alphas)  # traces recorded, then one step per (layer, alpha) row
    with tqdm(total=total, desc="critique", file=sys.stderr, disable=not progress) as bar:
        res = run_critique(sm, cfg.n, n_eval=n_eval, layers=layers, alphas=alphas, contrast=cfg.contrast,
                           min_recoveries=cfg.min_recoveries, seed=cfg.seed, batch_size=cfg.batch_size,
                           progress=bar.update)
    res.saved_layer, res.seed = cfg.layer, cfg.seed
    return res
