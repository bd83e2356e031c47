"""Induction heads on repeated random tokens (Olsson et al. 2022, "In-context Learning and Induction
Heads"; the measurement of TransformerLens's tutorials).

Each input is a BOS token, then ``seq_len`` uniformly random token ids, then the same ``seq_len`` ids
again (``2 * seq_len + 1`` tokens). A model with induction heads predicts the repeated half from the
first: its loss there falls far below the loss on the first half, which no model can predict.

* :func:`repeated_tokens` builds the inputs (seeded).
* :func:`induction_scores` is TransformerLens's per-head score on one ``hook_pattern``: the mean of the
  diagonal at offset ``-(seq_len - 1)`` (query ``q`` attending to key ``q - seq_len + 1``: each token
  of the repeated half to the token after its earlier occurrence), averaged over the whole stripe as
  TransformerLens does.
* :func:`run` (``run(sm, InductionConfig(...))``, ``steerkit induction``) records
  ``blocks.{l}.attn.hook_pattern`` of the chosen layers through ``sm.record`` in batches, and returns
  an :class:`InductionResult`: the score of every head, the mean per-token loss at every position,
  the first-half / repeated-half losses and the top heads, with ``to_json()`` and ``plot()``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError

from ..plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def _pattern_name(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_pattern"


def _positive_int(v, what: str, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InputError(f"expected {what} as an int >= {low}, found {v!r}")
    return v


def repeated_tokens(n_seqs: int, seq_len: int, *, bos: int, low: int, high: int,
                    seed: int = 0) -> Int[Tensor, "n_seqs tokens"]:
    """``[n_seqs, 2 * seq_len + 1]`` token ids: ``bos``, then ``seq_len`` ids drawn uniformly from
    ``low..high-1`` (a ``torch.Generator`` seeded with ``seed``), then the same ids again.

    Examples:
        >>> from steerkit.probes.methods.induction import repeated_tokens
        >>> ids = repeated_tokens(2, 5, bos=1, low=100, high=20000)
        >>> tuple(ids.shape), ids[:, 0].tolist(), bool((ids[:, 1:6] == ids[:, 6:]).all())
        ((2, 11), [1, 1], True)
    """
    _positive_int(n_seqs, "the number of sequences")
    _positive_int(seq_len, "the sequence length", 2)
    if not 0 <= low < high:
        raise InputError(f"expected a token id range 0 <= low < high, found low={low}, high={high}")
    g = torch.Generator().manual_seed(int(seed))
    half = torch.randint(low, high, (n_seqs, seq_len), generator=g)
    return torch.cat([torch.full((n_seqs, 1), int(bos), dtype=torch.long), half, half], dim=1)


def induction_scores(pattern: Float[Tensor, "batch heads q_pos k_pos"], seq_len: int) -> Float[Tensor, "batch heads"]:
    """Per sequence and head: the mean of ``pattern``'s diagonal at offset ``-(seq_len - 1)``
    (TransformerLens's induction score; ``pattern`` as ``blocks.{l}.attn.hook_pattern`` records it).

    A head that attends from each repeated token to the token after its first copy.

    Examples:
        >>> from steerkit.probes.methods.induction import induction_scores
        >>> seq_len, n = 4, 9
        >>> pattern = torch.zeros(1, 2, n, n)
        >>> pattern[0, 0] = torch.eye(n)  # head 0 attends to itself
        >>> for q in range(seq_len - 1, n):
        ...     pattern[0, 1, q, q - seq_len + 1] = 1.0  # head 1: the induction offset
        >>> induction_scores(pattern, seq_len).tolist()
        [[0.0, 1.0]]
    """
    if pattern.dim() != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise InputError(f"expected an attention pattern [batch, heads, pos, pos], found shape {tuple(pattern.shape)}")
    if not 2 <= seq_len <= pattern.shape[-1]:
        raise InputError(f"expected seq_len in 2..{pattern.shape[-1]} for a pattern over {pattern.shape[-1]} "
                         f"positions, found {seq_len}")
    return pattern.float().diagonal(offset=1 - seq_len, dim1=-2, dim2=-1).mean(-1)


@dataclass
class InductionConfig:
    """``steerkit induction``: ``n_seqs`` random sequences of ``seq_len`` tokens (each repeated once,
    after a BOS token), drawn with ``seed`` from token ids ``vocab_low..vocab_high-1`` (TransformerLens's
    100..20000 by default, cut to the vocabulary); ``layers`` to score (``None``: all), ``batch_size``
    sequences per forward pass, ``top_k`` heads listed; ``bos``: the first token's id (``None``: the
    tokenizer's BOS, else its EOS).

    Examples:
        >>> from steerkit.probes.methods.induction import InductionConfig
        >>> cfg = InductionConfig(n_seqs=4, seq_len=20, layers=(0, 1))
        >>> cfg.n_seqs, cfg.seq_len, cfg.vocab_low, cfg.vocab_high
        (4, 20, 100, 20000)
    """

    n_seqs: int = 32
    seq_len: int = 50
    seed: int = 0
    layers: Optional[tuple] = None
    batch_size: int = 8
    top_k: int = 10
    vocab_low: int = 100
    vocab_high: int = 20000
    bos: Optional[int] = None


@dataclass
class InductionResult:
    """Induction scores ``[len(layers), n_heads]`` (rows: ``layers``) and the mean per-token loss
    ``[2 * seq_len]`` (entry ``t``: the loss of predicting token ``t + 1`` from the prefix up to ``t``,
    so ``loss[:seq_len]`` is the first half and ``loss[seq_len:]`` the repeated half).

    Examples:
        >>> from steerkit.probes.methods import induction
        >>> res = induction.run(tiny, induction.InductionConfig(n_seqs=2, seq_len=8), progress=False)
        >>> res.scores.shape, res.loss.shape, len(res.top_heads(3))
        ((4, 4), (16,), 3)
        >>> sorted(res.to_json())[:4], [type(f).__name__ for f in res.figures()]
        (['layers', 'loss', 'loss_drop', 'loss_first'], ['Figure', 'Figure'])
    """

    scores: np.ndarray
    layers: list
    loss: np.ndarray
    n_seqs: int
    seq_len: int
    seed: int
    top_k: int = 10
    model_name: str = ""

    @property
    def loss_first(self) -> float:
        """Mean loss over the first half (random tokens: about ``log(vocab range)``)."""
        return float(self.loss[: self.seq_len].mean())

    @property
    def loss_repeated(self) -> float:
        """Mean loss over the repeated half."""
        return float(self.loss[self.seq_len:].mean())

    @property
    def loss_drop(self) -> float:
        return self.loss_first - self.loss_repeated

    def top_heads(self, k: Optional[int] = None) -> list[tuple[int, int, float]]:
        """``(layer, head, score)`` of the ``k`` (default ``top_k``) highest-scoring heads, best first."""
        k = self.top_k if k is None else k
        flat = self.scores.reshape(-1)
        order = np.argsort(-flat, kind="stable")[:k]
        H = self.scores.shape[1]
        return [(int(self.layers[i // H]), int(i % H), float(flat[i])) for i in order]

    def to_dict(self) -> dict:
        return {"model": self.model_name, "n_seqs": self.n_seqs, "seq_len": self.seq_len, "seed": self.seed,
                "layers": [int(l) for l in self.layers],
                "scores": [[float(x) for x in row] for row in self.scores],
                "loss": [float(x) for x in self.loss], "loss_first": self.loss_first,
                "loss_repeated": self.loss_repeated, "loss_drop": self.loss_drop,
                "top_heads": [{"layer": l, "head": h, "score": s} for l, h, s in self.top_heads()]}

    to_json = to_dict

    def plot(self, title: str | None = None):
        """A plotly heatmap of the induction score per layer (down) and head (across)
        (:func:`steerkit.probes.plots.induction.score_figure`)."""
        with plotly_required():
            from ..plots import induction as figures
        return figures.score_figure(self, title)

    def loss_plot(self, title: str | None = None):
        """A plotly line of the mean per-token loss by position (the repeat starts at ``seq_len``)
        (:func:`steerkit.probes.plots.induction.loss_figure`)."""
        with plotly_required():
            from ..plots import induction as figures
        return figures.loss_figure(self, title)

    def figures(self) -> list:
        """The score heatmap and the loss curve."""
        return [self.plot(), self.loss_plot()]


def _check_config(sm: "SteerModel", cfg: InductionConfig) -> tuple[list[int], int, int, int]:
    """(layers, bos, low, high) for ``cfg`` on ``sm``."""
    _positive_int(cfg.n_seqs, "n_seqs")
    _positive_int(cfg.seq_len, "seq_len", 2)
    _positive_int(cfg.batch_size, "batch_size")
    _positive_int(cfg.top_k, "top_k")
    L = sm.n_layers
    if cfg.layers is None:
        layers = list(range(L))
    else:
        layers = list(cfg.layers)
        if not layers or any(isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < L for l in layers):
            raise InputError(f"expected layers as block indices in 0..{L - 1} (or None for all), found {cfg.layers!r}")
        if len(set(layers)) != len(layers):
            raise InputError(f"expected distinct layers, found repeats in {cfg.layers!r}")
    vocab = int(sm.adapter.unembed_module(sm.hf_model).weight.shape[0])
    high = min(int(cfg.vocab_high), vocab)
    low = int(cfg.vocab_low)
    if not 0 <= low < high - 1:
        raise InputError(f"expected vocab_low < vocab_high - 1 within the vocabulary (0..{vocab - 1}), found "
                         f"vocab_low={cfg.vocab_low}, vocab_high={cfg.vocab_high}; lower vocab_low")
    bos = cfg.bos
    if bos is None:
        tok = sm.tokenizer
        bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        if bos is None:
            raise InputError("expected a tokenizer with a BOS or EOS token to start the sequences, found neither; "
                             "pass InductionConfig(bos=<token id>)")
    if isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < vocab:
        raise InputError(f"expected bos as a token id in 0..{vocab - 1}, found {bos!r}")
    return layers, int(bos), low, high


def run(sm: "SteerModel", config: InductionConfig | None = None, *, progress: bool = True) -> InductionResult:
    """Induction scores of every head of the chosen layers and the per-token loss on repeated random
    sequences (see the module docstring); the patterns come from ``sm.record``.

    The default model copies the repeated half: its loss there falls by several nats, and its best heads
    score high.

    Examples:
        >>> from steerkit.probes.methods import induction
        >>> res = induction.run(sm, induction.InductionConfig(n_seqs=4, seq_len=20), progress=False)
        >>> res.loss_drop > 3, res.top_heads(1)[0][2] > 0.5
        (True, True)
    """
    cfg = config or InductionConfig()
    layers, bos, low, high = _check_config(sm, cfg)
    ids = repeated_tokens(cfg.n_seqs, cfg.seq_len, bos=bos, low=low, high=high, seed=cfg.seed)
    names = [_pattern_name(l) for l in layers]
    score_sum: Optional[Tensor] = None
    loss_sum = torch.zeros(2 * cfg.seq_len, dtype=torch.float64)
    batches = range(0, cfg.n_seqs, cfg.batch_size)
    for i in tqdm(batches, desc="induction", file=sys.stderr, disable=not progress):
        chunk = ids[i:i + cfg.batch_size]
        toks = sm.pad(chunk.tolist())
        with sm.record(names, positions="all") as cache:
            logits = sm.forward(toks)
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = chunk[:, 1:].to(logp.device)
        loss = -logp[:, :-1].gather(-1, target[..., None])[..., 0]  # [b, 2 * seq_len]
        loss_sum += loss.double().sum(0).cpu()
        per_layer = torch.stack([induction_scores(cache[n], cfg.seq_len).double().sum(0).cpu() for n in names])
        score_sum = per_layer if score_sum is None else score_sum + per_layer
    assert score_sum is not None
    return InductionResult(scores=(score_sum / cfg.n_seqs).float().numpy(), layers=layers,
                           loss=(loss_sum / cfg.n_seqs).float().numpy(), n_seqs=cfg.n_seqs, seq_len=cfg.seq_len,
                           seed=cfg.seed, top_k=cfg.top_k, model_name=getattr(sm, "name", ""))


def summary_lines(res: InductionResult, k: Optional[int] = None) -> list[str]:
    """Human-readable lines: the two losses and the top heads.

    Examples:
        >>> from steerkit.probes.methods import induction
        >>> res = induction.run(tiny, induction.InductionConfig(n_seqs=2, seq_len=8), progress=False)
        >>> lines = induction.summary_lines(res, k=2)
        >>> len(lines), lines[0].startswith("per-token loss: first half"), lines[1].startswith("  L")
        (3, True, True)
    """
    out = [f"per-token loss: first half {res.loss_first:.3f}, repeated half {res.loss_repeated:.3f} nats "
           f"(drop {res.loss_drop:.3f})"]
    out += [f"  L{l}H{h}: {s:.3f}" for l, h, s in res.top_heads(k)]
    return out


__all__ = ["InductionConfig", "InductionResult", "induction_scores", "repeated_tokens", "run", "summary_lines"]
