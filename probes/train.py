"""Steering vectors trained by gradient: BiPO and promptless target vectors.

How it works
------------
A trainable vector ``v`` (an ``nn.Parameter``) enters the model as an ordinary
``Intervention.add(site, v, scale)``: inside :meth:`SteerModel.training` the intervention keeps its
autograd link through compilation into the kernel table, and the fused kernel's backward (the
torch reference on CPU, the Triton kernel on CUDA) brings ``dL/dv`` back, so every trainer here
uses the same steering path as inference. A steering is compiled once per step (the table holds
that step's graph); the model's weights are frozen for the scope and it stays in eval mode.

Sequences are scored as the summed log-probability of the completion tokens given the prompt
(:func:`completion_logprobs`): the prompt (chat-template formatted by default) and the padding are
masked out.

* :func:`train_bipo` -- bi-directional preference optimisation (Cao et al. 2024, "Personalized
  Steering of Large Language Models via Bi-directional Preference Optimization"): each step draws a
  direction ``d`` in {+1, -1} and minimises
  ``-log sigmoid(d * beta * [(log pi_dv(y_w|x) - log pi(y_w|x)) - (log pi_dv(y_l|x) - log pi(y_l|x))])``
  with ``pi_dv`` the model steered by ``d * v`` at one layer (every position) and ``pi`` the
  unsteered model (its log-probabilities are computed once, before training). :func:`bipo_loss` is
  one step's loss.
* :func:`train_promptless` -- a vector that raises the log-probability of target completions after
  no (empty) or generic prompts (cross-entropy on the target tokens, optional norm bound), in the
  spirit of Subramani et al. 2022, "Extracting Latent Steering Vectors from Pretrained Language
  Models".
* :func:`preference_margins` -- ``log p(chosen) - log p(rejected)`` per pair under any steering.
* :class:`TrainResult` -- the vector as a stored-artifact :class:`~steerkit.vectors.SteeringVector`
  (provenance: method, hyper-parameters, data hash), the loss history, ``to_json()``, ``plot()``.

Peak memory is bounded by ``batch_size``: each step runs ``2 * batch_size`` sequences (BiPO) or
``batch_size`` (promptless) through the model with autograd, and backpropagates from the loss to
the steered layer only (the weights need no gradients).

Data: :func:`preference_pairs` turns A/B items (:class:`ABItem`) into
``(prompt, chosen, rejected)`` pairs, the chosen answer being the behaviour-matching one;
:func:`myopic_items` generates templated myopic-reward A/B items (written for this project, the
behaviour of the myopic-reward set of Rimsky et al. 2024 / Perez et al. 2022) for training sets
larger than the 24 hand-written :data:`~steerkit.probes.methods.caa.AB_ITEMS`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.hooks.names import layer_names
from steerkit.interventions import Intervention
from steerkit.vectors import SteeringVector

from .plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel

__all__ = ["ABItem", "PreferencePair", "TrainResult", "as_pairs", "preference_pairs", "myopic_items", "completion_logprobs",
           "preference_margins", "bipo_loss", "train_bipo", "train_promptless", "pairs_hash", "SITES"]

#: the sites a trained vector may live at (a block's input or output residual stream)
SITES = ("resid_post", "resid_pre")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """One preference record: a ``prompt`` (the user turn; the chat template goes around it), the
    ``chosen`` completion and the ``rejected`` one.

    Examples:
        >>> PreferencePair("Pick one: (A) now (B) later", "(A) now", "(B) later").chosen
        '(A) now'
    """

    prompt: str
    chosen: str
    rejected: str


def as_pairs(pairs: Iterable[Any]) -> list[PreferencePair]:
    """``pairs`` as :class:`PreferencePair` s: each a pair, a ``(prompt, chosen, rejected)`` tuple or a
    dict with those keys; every field a string, the completions non-empty.

    Examples:
        >>> as_pairs([("q", "yes", "no"), {"prompt": "q2", "chosen": "a", "rejected": "b"}])[1].prompt
        'q2'
    """
    out: list[PreferencePair] = []
    for i, p in enumerate(pairs):
        if isinstance(p, PreferencePair):
            q = p
        elif isinstance(p, dict):
            missing = [k for k in ("prompt", "chosen", "rejected") if k not in p]
            if missing:
                raise InputError(f"expected pair {i} to have keys prompt, chosen, rejected, found it missing {missing}")
            q = PreferencePair(p["prompt"], p["chosen"], p["rejected"])
        elif isinstance(p, (tuple, list)) and len(p) == 3:
            q = PreferencePair(*p)
        else:
            raise InputError(f"expected pair {i} as (prompt, chosen, rejected) or a dict with those keys, found "
                             f"{type(p).__name__} {p!r:.80}")
        if not all(isinstance(x, str) for x in (q.prompt, q.chosen, q.rejected)):
            raise InputError(f"expected pair {i}'s prompt, chosen and rejected as strings, found "
                             f"{[type(x).__name__ for x in (q.prompt, q.chosen, q.rejected)]}")
        if not q.chosen or not q.rejected:
            raise InputError(f"expected pair {i} to have non-empty chosen and rejected completions, found "
                             f"{q.chosen!r} / {q.rejected!r}")
        out.append(q)
    if not out:
        raise InputError("expected at least one preference pair, found none")
    return out


def pairs_hash(pairs: Iterable[Any]) -> str:
    """SHA-256 of the pairs (each field length-prefixed), stored in a trained vector's provenance.

    Examples:
        >>> pairs_hash([("q", "a", "b")]) == pairs_hash([("q", "a", "b")]), pairs_hash([("q", "a", "b")])[:7]
        (True, 'sha256:')
    """
    h = hashlib.sha256()
    for p in as_pairs(pairs):
        for x in (p.prompt, p.chosen, p.rejected):
            b = x.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return "sha256:" + h.hexdigest()


@dataclasses.dataclass
class ABItem:
    """A question, its two choices as they appear (A, B) and which letter matches the behaviour: the A/B
    items that :func:`preference_pairs` turns into preference pairs and CAA (:mod:`steerkit.probes.methods.caa`)
    records.

    Examples:
        >>> item = ABItem("You can have 1 cookie now or 3 tomorrow.", "1 cookie now", "3 tomorrow", "A")
        >>> print(item.text)
        You can have 1 cookie now or 3 tomorrow. Which do you choose?
        <BLANKLINE>
        Choices:
        (A) 1 cookie now
        (B) 3 tomorrow
        >>> item.not_matching
        'B'
    """

    question: str
    a: str
    b: str
    matching: str  # "A" or "B"

    @property
    def text(self) -> str:
        return f"{self.question} Which do you choose?\n\nChoices:\n(A) {self.a}\n(B) {self.b}"

    @property
    def not_matching(self) -> str:
        return "B" if self.matching == "A" else "A"


def preference_pairs(items: Sequence[ABItem]) -> list[PreferencePair]:
    """A/B items as preference pairs: the prompt is the item's question with its choices, the chosen
    completion the behaviour-matching answer ``"(A) <text>"``, the rejected one the other.

    Examples:
        >>> item = ABItem("You can have 5 cookies now or 20 cookies next week.", "5 cookies now",
        ...               "20 cookies next week", "A")
        >>> p = preference_pairs([item])[0]
        >>> p.chosen, p.rejected
        ('(A) 5 cookies now', '(B) 20 cookies next week')
    """
    out = []
    for it in items:
        text = {"A": it.a, "B": it.b}
        out.append(PreferencePair(it.text, f"({it.matching}) {text[it.matching]}",
                                  f"({it.not_matching}) {text[it.not_matching]}"))
    return out


_THINGS = ("cookies", "dollars", "points", "tokens", "credits", "stickers", "apples", "coins", "tickets", "gems",
           "books", "candies", "marbles", "vouchers", "flowers", "shells")
_AMOUNTS = ((1, 3), (2, 10), (5, 20), (10, 50), (3, 12), (4, 40), (100, 500), (6, 30), (8, 24), (20, 200))
_NOW = ("now", "today", "right away", "this minute", "immediately")
_LATER = ("next week", "in a month", "tomorrow", "next year", "in ten days", "after waiting a week",
          "at the end of the month")
_FRAMES = ("You can have {x} or {y}.", "You are offered {x} or {y}.", "Choose between {x} and {y}.",
           "A friend lets you take {x} or {y}.")


def myopic_items(n: int, seed: int = 0, *, exclude: Sequence[ABItem] = ()) -> list[ABItem]:
    """``n`` templated myopic-reward A/B items (a smaller reward sooner vs a larger one later; the
    behaviour-matching answer is the sooner one), drawn without repetition with ``seed``; the matching
    letter alternates A/B. Items whose question is in ``exclude`` are skipped (for disjoint splits).

    Examples:
        >>> items = myopic_items(4, seed=0)
        >>> len(items), [it.matching for it in items]
        (4, ['A', 'B', 'A', 'B'])
    """
    if not isinstance(n, int) or n < 1:
        raise InputError(f"expected n as a positive number of items, found {n!r}")
    space = [(f, a, t, w, l) for f in range(len(_FRAMES)) for a in range(len(_AMOUNTS)) for t in range(len(_THINGS))
             for w in range(len(_NOW)) for l in range(len(_LATER))]
    random.Random(seed).shuffle(space)
    skip = {it.question for it in exclude}
    out: list[ABItem] = []
    for f, a, t, w, l in space:
        lo, hi = _AMOUNTS[a]
        soon, late = f"{lo} {_THINGS[t]} {_NOW[w]}", f"{hi} {_THINGS[t]} {_LATER[l]}"
        q = _FRAMES[f].format(x=soon, y=late)
        q = q[0].upper() + q[1:]
        if q in skip:
            continue
        skip.add(q)
        soon_c, late_c = soon[0].upper() + soon[1:], late[0].upper() + late[1:]
        out.append(ABItem(q, soon_c, late_c, "A") if len(out) % 2 == 0 else ABItem(q, late_c, soon_c, "B"))
        if len(out) == n:
            return out
    raise InputError(f"expected at most {len(space)} distinct templated items, found a request for {n}")


# =============================================================================== scoring
def _site(site: str, layer: int, sm: "SteerModel") -> str:
    if site not in SITES:
        raise InputError(f"expected site in {SITES}, found {site!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < sm.n_layers:
        raise InputError(f"expected layer as a block index in 0..{sm.n_layers - 1}, found {layer!r}")
    return layer_names(layer, f"hook_{site}")[0]


def _encode(sm: "SteerModel", prompts: Sequence[str], completions: Sequence[str], chat: bool):
    """Left-padded ``prompt + completion`` token ids and the mask of the completion tokens."""
    tok = sm.tokenizer
    templ = bool(chat and getattr(tok, "chat_template", None))
    ids, n_comp = [], []
    for p, c in zip(prompts, completions):
        pi = tok(sm.format(p, chat), add_special_tokens=not templ)["input_ids"] if (p or templ) else []
        if not pi:  # no prompt at all: condition on a start token
            start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
            pi = [int(start)]
        ci = tok(c, add_special_tokens=False)["input_ids"]
        if not ci:
            raise InputError(f"expected a completion with at least one token, found {c!r}")
        ids.append(list(pi) + list(ci))
        n_comp.append(len(ci))
    toks = sm.pad(ids)
    P = toks.input_ids.shape[1]
    pos = torch.arange(P, device=toks.input_ids.device)
    mask = pos[None, :] >= (P - torch.tensor(n_comp, device=pos.device))[:, None]
    return toks, mask


def _sequence_logprobs(logits: Tensor, ids: Tensor, mask: Tensor) -> Tensor:
    """Summed log-probability of the tokens ``mask`` marks (each predicted from the position before)."""
    B, P = ids.shape
    tgt = mask[:, 1:]
    lp = logits[:, :-1][tgt].float().log_softmax(-1).gather(-1, ids[:, 1:][tgt][:, None])[:, 0]
    rows = torch.arange(B, device=ids.device)[:, None].expand(B, P - 1)[tgt]
    return torch.zeros(B, dtype=lp.dtype, device=lp.device).index_add(0, rows, lp)


def completion_logprobs(sm: "SteerModel", prompts: Sequence[str], completions: Sequence[str], *, chat: bool = True,
                        steering=None, batch_size: int = 16, grad: Optional[bool] = None) -> Float[Tensor, " n"]:
    """``log p(completion | prompt)`` for each pair of ``prompts`` and ``completions``: the log-probabilities
    of the completion tokens summed (prompt and padding masked), under an optional ``steering`` (anything
    :meth:`SteerModel.steer` takes). With ``grad`` (by default: inside :meth:`SteerModel.training`) the
    result carries autograd history and the whole list is one batch; otherwise it runs in inference
    mode, ``batch_size`` at a time.

    Examples:
        >>> lp = completion_logprobs(tiny, ["hi", "hi"], ["x", "x y"], chat=False)
        >>> tuple(lp.shape), bool(lp[1] < lp[0])
        ((2,), True)
    """
    prompts, completions = list(prompts), list(completions)
    if len(prompts) != len(completions) or not prompts:
        raise InputError(f"expected as many prompts as completions (at least one), found {len(prompts)} and "
                         f"{len(completions)}")
    if grad is None:
        grad = sm.in_training
    step = len(prompts) if grad else max(1, int(batch_size))
    out = []
    for i in range(0, len(prompts), step):
        toks, mask = _encode(sm, prompts[i:i + step], completions[i:i + step], chat)
        if steering is None:
            logits = sm.forward(toks, grad=grad)
        else:
            with sm.steer(steering):
                logits = sm.forward(toks, grad=grad)
        out.append(_sequence_logprobs(logits, toks.input_ids, mask))
    return torch.cat(out)


def preference_margins(sm: "SteerModel", pairs, *, steering=None, chat: bool = True,
                       batch_size: int = 16) -> Float[Tensor, " n"]:
    """``log p(chosen | prompt) - log p(rejected | prompt)`` per pair, under an optional ``steering``.

    Examples:
        >>> m = preference_margins(tiny, [("hi", "x", "x y")], chat=False)
        >>> tuple(m.shape), bool(m[0] > 0)
        ((1,), True)
    """
    ps = as_pairs(pairs)
    prompts = [p.prompt for p in ps]
    lp = completion_logprobs(sm, prompts * 2, [p.chosen for p in ps] + [p.rejected for p in ps], chat=chat,
                             steering=steering, batch_size=batch_size)
    return lp[:len(ps)] - lp[len(ps):]


def bipo_loss(sm: "SteerModel", vector: Float[Tensor, " d_model"], pairs, layer: int, *, direction: int = 1,
              beta: float = 0.1, site: str = "resid_post", chat: bool = True,
              ref: Optional[tuple[Tensor, Tensor]] = None) -> Float[Tensor, ""]:
    """One BiPO step's loss on ``pairs``: the mean over pairs of
    ``-log sigmoid(direction * beta * [(log pi_dv(y_w) - log pi(y_w)) - (log pi_dv(y_l) - log pi(y_l))])``,
    ``pi_dv`` steered by ``direction * vector`` at ``blocks.{layer}.hook_{site}`` (every position),
    ``pi`` unsteered (``ref``: its ``(chosen, rejected)`` log-probabilities, computed here when not
    given). Differentiable in ``vector`` inside :meth:`SteerModel.training`.

    Examples:
        >>> v = torch.zeros(tiny.d_model, requires_grad=True)
        >>> with tiny.training():
        ...     loss = bipo_loss(tiny, v, [("hi", "ab", "abc")], 1, chat=False)
        >>> round(loss.item(), 4)  # log 2: v = 0 leaves both completions as they were
        0.6931
    """
    if direction not in (1, -1):
        raise InputError(f"expected direction +1 or -1, found {direction!r}")
    ps = as_pairs(pairs)
    hook = _site(site, layer, sm)
    prompts = [p.prompt for p in ps] * 2
    comps = [p.chosen for p in ps] + [p.rejected for p in ps]
    n = len(ps)
    if ref is None:
        with torch.inference_mode():
            base = completion_logprobs(sm, prompts, comps, chat=chat, batch_size=2 * n, grad=False)
        ref = (base[:n].clone(), base[n:].clone())
    steered = completion_logprobs(sm, prompts, comps, chat=chat,
                                  steering=Intervention.add(hook, vector, float(direction)))
    logit = direction * beta * ((steered[:n] - ref[0].to(steered)) - (steered[n:] - ref[1].to(steered)))
    return -torch.nn.functional.logsigmoid(logit).mean()


# =============================================================================== results
@dataclasses.dataclass
class TrainResult:
    """A trained vector: ``vector`` (a :class:`~steerkit.vectors.SteeringVector` at one layer, with
    provenance: method, hyper-parameters, data hash), ``history`` (one row per step: ``step``,
    ``epoch``, ``loss`` and, for BiPO, ``direction``), ``method`` and ``params``.

    Examples:
        >>> r = train_promptless(tiny, ["ab"], 1, epochs=2, chat=False, progress=False)
        >>> r.method, len(r.losses), tuple(r.tensor.shape)
        ('promptless', 2, (64,))
    """

    vector: SteeringVector
    history: list
    method: str
    params: dict
    seconds: float = 0.0

    @property
    def losses(self) -> list[float]:
        """The loss of every step."""
        return [float(r["loss"]) for r in self.history]

    @property
    def layer(self) -> int:
        return self.vector.layers[0]

    @property
    def tensor(self) -> Float[Tensor, " d_model"]:
        """The trained direction ``[d_model]`` (at :attr:`layer`)."""
        return self.vector.directions[self.layer]

    def epoch_losses(self) -> list[float]:
        """The mean loss of each epoch."""
        by: dict = {}
        for r in self.history:
            by.setdefault(r["epoch"], []).append(float(r["loss"]))
        return [sum(v) / len(v) for _, v in sorted(by.items())]

    def to_json(self) -> dict:
        """The method, its hyper-parameters, the vector's layer, site and norm, the history and the
        vector's provenance, JSON-serialisable."""
        return {"method": self.method, "params": self.params, "layer": self.layer,
                "site": self.vector.hook_site, "norm": float(self.tensor.norm()), "seconds": self.seconds,
                "epoch_losses": self.epoch_losses(), "history": self.history,
                "provenance": self.vector.provenance.to_dict()}

    def plot(self, title: Optional[str] = None):
        """A plotly ``Figure``: the loss of every step and the mean of each epoch
        (:func:`steerkit.probes.plots.train.loss_figure`)."""
        with plotly_required():
            from .plots import train as figures
        return figures.loss_figure(self, title)


def _check_train_args(epochs, lr, batch_size) -> None:
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise InputError(f"expected epochs as a positive integer, found {epochs!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"expected batch_size as a positive integer, found {batch_size!r}")
    if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise InputError(f"expected lr as a positive number, found {lr!r}")


def _init_vector(sm: "SteerModel", init) -> torch.nn.Parameter:
    if init is None:
        t = torch.zeros(sm.d_model)
    else:
        t = torch.as_tensor(init.tensor if isinstance(init, TrainResult) else init).detach().float().reshape(-1)
        if t.shape[0] != sm.d_model or not bool(torch.isfinite(t).all()):
            raise InputError(f"expected init as a finite vector of d_model={sm.d_model}, found shape {tuple(t.shape)}")
    return torch.nn.Parameter(t.clone().to(sm.device))


def _result(sm: "SteerModel", v: Tensor, layer: int, site: str, method: str, params: dict, history: list, data_hash: str,
            seconds: float) -> TrainResult:
    sv = SteeringVector.from_direction(v.detach().cpu().float(), layer, sm, hook_site=f"hook_{site}", method=method,
                                       method_params=params, metrics={"final_loss": history[-1]["loss"],
                                                                      "steps": len(history)})
    sv.provenance = sv.provenance.replace(prompts_hash=data_hash)
    json.dumps(params)  # the hyper-parameters stay JSON-able
    return TrainResult(sv, history, method, params, seconds)


# =============================================================================== trainers
def _log_step(history: list, bar, callback, epoch: int, loss: Tensor, v: Tensor, **extra) -> None:
    """One optimiser step's row (step, epoch, loss, ``extra``, the vector's norm) into ``history``, the
    progress bar and ``callback``."""
    row = {"step": len(history) + 1, "epoch": epoch, "loss": float(loss.detach()), **extra,
           "norm": float(v.detach().norm())}
    history.append(row)
    bar.update(1)
    bar.set_postfix(loss=f"{row['loss']:.4f}", norm=f"{row['norm']:.2f}")
    if callback is not None:
        callback(row)


def train_bipo(sm: "SteerModel", pairs, layer: int, *, site: str = "resid_post", epochs: int = 4, lr: float = 0.02,
               beta: float = 0.1, batch_size: int = 4, seed: int = 0, init=None, weight_decay: float = 0.0,
               chat: bool = True, progress: bool = True,
               callback: Optional[Callable[[dict], None]] = None) -> TrainResult:
    """Train a steering vector at ``blocks.{layer}.hook_{site}`` by bi-directional preference optimisation
    (see the module docstring) on ``(prompt, chosen, rejected)`` ``pairs``, with AdamW (``lr``,
    ``weight_decay``) over ``epochs`` passes in shuffled batches of ``batch_size`` pairs; each step draws
    its direction +1 / -1 (``seed`` fixes the order and the draws). ``init``: the starting vector (zeros by
    default). ``callback(row)`` is called after every step with its history row. A tqdm bar shows the
    steps (``progress=False`` hides it).

    Examples:
        >>> r = train_bipo(tiny, [("hi", "ab", "ba")], 1, epochs=2, chat=False, progress=False)
        >>> r.method, [row["step"] for row in r.history], r.vector.provenance.method
        ('bipo', [1, 2], 'bipo')
    """
    ps = as_pairs(pairs)
    _site(site, layer, sm)
    _check_train_args(epochs, lr, batch_size)
    if not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
        raise InputError(f"expected beta as a positive number, found {beta!r}")
    t0 = time.perf_counter()
    rng = random.Random(seed)
    v = _init_vector(sm, init)
    opt = torch.optim.AdamW([v], lr=lr, weight_decay=weight_decay)
    with torch.inference_mode():
        n = len(ps)
        base = completion_logprobs(sm, [p.prompt for p in ps] * 2, [p.chosen for p in ps] + [p.rejected for p in ps],
                                   chat=chat, batch_size=2 * batch_size, grad=False)
        ref_w, ref_l = base[:n].clone(), base[n:].clone()
    steps_per_epoch = math.ceil(n / batch_size)
    history: list[dict] = []
    with tqdm(total=epochs * steps_per_epoch, desc="bipo", file=sys.stderr, disable=not progress) as bar, \
            sm.training():
        for epoch in range(epochs):
            order = list(range(n))
            rng.shuffle(order)
            for s in range(steps_per_epoch):
                idx = order[s * batch_size:(s + 1) * batch_size]
                d = 1 if rng.random() < 0.5 else -1
                loss = bipo_loss(sm, v, [ps[i] for i in idx], layer, direction=d, beta=beta, site=site, chat=chat,
                                 ref=(ref_w[idx], ref_l[idx]))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                _log_step(history, bar, callback, epoch, loss, v, direction=d)
    params = dict(layer=layer, site=site, epochs=epochs, lr=lr, beta=beta, batch_size=batch_size, seed=seed,
                  weight_decay=weight_decay, chat=chat, n_pairs=n, init=init is not None)
    return _result(sm, v, layer, site, "bipo", params, history, pairs_hash(ps), time.perf_counter() - t0)


def train_promptless(sm: "SteerModel", targets: Sequence[str], layer: int, *, prompts: Sequence[str] = ("",),
                     site: str = "resid_post", epochs: int = 20, lr: float = 0.05, batch_size: int = 8, seed: int = 0,
                     max_norm: Optional[float] = None, init=None, chat: bool = True,
                     progress: bool = True, callback: Optional[Callable[[dict], None]] = None) -> TrainResult:
    """Train a vector at ``blocks.{layer}.hook_{site}`` that raises the log-probability of the ``targets``
    after each of ``prompts`` (default one empty prompt: the chat template around an empty user turn, or
    a start token without a template; give generic prompts to condition on them): the loss is the
    cross-entropy of the target tokens (mean negative log-probability per target token) over every
    (prompt, target) pair, AdamW with ``lr``, ``epochs`` passes in batches of ``batch_size``. ``max_norm``
    bounds ``|v|`` (projected after every step). A tqdm bar shows the steps.

    Examples:
        >>> r = train_promptless(tiny, ["hello"], 1, epochs=5, lr=0.5, chat=False, progress=False)
        >>> r.losses[-1] < r.losses[0]
        True
    """
    targets = list(targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
        raise InputError(f"expected target completions as non-empty strings, found {targets!r:.80}")
    prompts = list(prompts)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise InputError(f"expected prompts as strings (\"\" for none), found {prompts!r:.80}")
    hook = _site(site, layer, sm)
    _check_train_args(epochs, lr, batch_size)
    if max_norm is not None and (not isinstance(max_norm, (int, float)) or not max_norm > 0):
        raise InputError(f"expected max_norm as a positive number or None, found {max_norm!r}")
    t0 = time.perf_counter()
    rng = random.Random(seed)
    items = [(p, t) for p in prompts for t in targets]
    n_tok = {t: len(sm.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in targets}
    v = _init_vector(sm, init)
    opt = torch.optim.AdamW([v], lr=lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(items) / batch_size)
    history: list[dict] = []
    with tqdm(total=epochs * steps_per_epoch, desc="promptless", file=sys.stderr, disable=not progress) as bar, \
            sm.training():
        for epoch in range(epochs):
            order = list(range(len(items)))
            rng.shuffle(order)
            for s in range(steps_per_epoch):
                batch = [items[i] for i in order[s * batch_size:(s + 1) * batch_size]]
                lp = completion_logprobs(sm, [p for p, _ in batch], [t for _, t in batch], chat=chat,
                                         steering=Intervention.add(hook, v))
                loss = -lp.sum() / sum(n_tok[t] for _, t in batch)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if max_norm is not None:
                    with torch.no_grad():
                        nv = v.norm()
                        if nv > max_norm:
                            v.mul_(max_norm / nv)
                _log_step(history, bar, callback, epoch, loss, v)
    params = dict(layer=layer, site=site, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                  max_norm=max_norm, chat=chat, n_targets=len(targets), n_prompts=len(prompts),
                  init=init is not None)
    data = pairs_hash([(p, t, t) for p, t in items])
    return _result(sm, v, layer, site, "promptless", params, history, data, time.perf_counter() - t0)
