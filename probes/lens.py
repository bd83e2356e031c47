"""Reading the residual stream in vocabulary space: the logit lens and direct logit attribution.

- :func:`logit_lens` (nostalgebraist 2020): each layer's ``hook_resid_post`` at some positions,
  through the final norm and the unembedding, as if the model stopped there. At the last layer it
  is the model's own logits. A :class:`LensResult` holds the logits, each cell's top-k tokens and
  probabilities, ``to_json`` / ``from_json`` (the top-k tables) and ``plot``.
- :func:`vector_lens`: the same lens of one residual-space vector (a direction): its top and bottom tokens.
- :func:`direct_logit_attribution`: the final residual at one position is the sum of the
  embedding (``blocks.0.hook_resid_pre``), every ``hook_attn_out`` and every ``hook_mlp_out``; each
  attention output is the sum of its heads' ``z_h @ W_O[:, h]^T`` (``attn.hook_z`` and the head's
  columns of the output projection) plus the projection's bias. Every part's direct effect on the
  logit of ``answer`` (minus that of ``wrong``) goes through the final norm with the scale the run
  cached (``ln_final.hook_scale``), as TransformerLens's ``cache.apply_ln_to_stack`` does: each part
  is centred first for a LayerNorm, divided by the scale, multiplied by the norm's weight and
  projected on the unembedding direction ``W_U[answer] - W_U[wrong]``. The parts then sum to the
  logit difference minus the bias terms (the final norm's bias and the unembedding's bias, along
  that direction): ``embed + sum(attn) + sum(mlp) = logit_diff - bias``; :attr:`DLAResult.error` is
  what is left (float rounding; a warning is issued when it is not small).

The decomposition needs every sub-layer's output to reach the residual stream through a linear
map: where a norm follows the sub-layer (Gemma 2/3, OLMo 2) or the logits are soft-capped it does
not hold, and :func:`direct_logit_attribution` raises
:class:`~steerkit.errors.UnsupportedArchitectureError`.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError, UnsupportedArchitectureError

from .patching import Prompt, index_list, json_text, prompt_tokens, read_document, token_id, token_labels
from .plots.require import plotly_required

if TYPE_CHECKING:
    import numpy as np

    from steerkit.model import SteerModel

LENS_FORMAT = "steerkit.logit_lens/1"
DLA_FORMAT = "steerkit.dla/1"


def _softcap(sm: "SteerModel") -> Optional[float]:
    cap = getattr(sm.adapter.text_config(sm.hf_model), "final_logit_softcapping", None)
    return float(cap) if cap else None


def unembed(sm: "SteerModel", resid: Float[Tensor, "*rows d_model"]) -> Float[Tensor, "*rows vocab"]:
    """Logits of residual-stream vectors: the final norm (the adapter's definition of it) and the
    unembedding, float32, as the model computes them after its last block (with its logit
    soft-capping where it has one).

    The last block's output, unembedded, is the model's own logits.

    Examples:
        >>> from steerkit.probes.lens import unembed
        >>> with tiny.record("blocks.3.hook_resid_post") as cache:
        ...     logits = tiny("Hello world", chat=False)
        >>> lens = unembed(tiny, cache["blocks.3.hook_resid_post"])
        >>> tuple(lens.shape), bool(torch.allclose(lens, logits, atol=1e-4))
        ((1, 2, 49152), True)
    """
    n, _ = sm.adapter.final_norm_parts(sm.hf_model, resid)
    w, b = sm.adapter.final_norm_affine(sm.hf_model)
    out = n if w is None else n * w
    if b is not None:
        out = out + b
    head = sm.adapter.unembed_module(sm.hf_model)
    bias = getattr(head, "bias", None)
    logits = F.linear(out.to(head.weight.dtype), head.weight, bias).float()
    cap = _softcap(sm)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def vector_lens(sm: "SteerModel", v: Union[Float[Tensor, " d_model"], "np.ndarray"], k: int = 10
                ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """The logit lens of one residual-space vector (a direction, a mean difference): the ``k`` tokens with the
    highest and the ``k`` with the lowest logit of :func:`unembed` (the final norm, the unembedding and the
    model's logit soft-capping), each as ``(token, logit)``, highest first / lowest first.

    Examples:
        >>> from steerkit.probes.lens import vector_lens
        >>> v = tiny.hf_model.lm_head.weight[5099].detach()  # the unembedding row of " Mary"
        >>> top, bottom = vector_lens(tiny, v, k=3)
        >>> len(top), len(bottom), top[0][0], top[0][1] > top[1][1] > top[2][1], bottom[0][1] < bottom[1][1]
        (3, 3, ' Mary', True, True)
    """
    x = torch.as_tensor(v).to(device=sm.device, dtype=torch.float32).reshape(1, -1)
    if x.shape[1] != sm.d_model:
        raise InputError(f"expected a residual-space vector of {sm.d_model} numbers (d_model), found {x.shape[1]}")
    with torch.inference_mode():
        logits = unembed(sm, x)[0].cpu()
    k = min(int(k), logits.shape[0])
    top, bot = torch.topk(logits, k), torch.topk(-logits, k)

    def dec(i):
        return sm.tokenizer.decode([int(i)])
    return ([(dec(i), float(s)) for s, i in zip(top.values, top.indices)],
            [(dec(i), float(-s)) for s, i in zip(bot.values, bot.indices)])


# ----------------------------------------------------------------------------- logit lens
@dataclasses.dataclass(eq=False)
class LensResult:
    """The logit lens at ``layers`` x ``positions`` (absolute indices) of one prompt (``tokens``).

    ``logits`` ``[n_layers, n_pos, vocab]`` (``None`` after :meth:`from_json`); ``top_ids`` /
    ``top_probs`` ``[n_layers, n_pos, k]`` (softmax probabilities) and ``top_tokens`` (decoded).

    Examples:
        >>> from steerkit.probes import LensResult, logit_lens
        >>> res = logit_lens(tiny, "The capital of France is", layers=[1, 3], positions=None, top_k=2)
        >>> res, tuple(res.top_probs.shape), tuple(res.prob_of(tiny, " Paris").shape)
        (LensResult(layers=2, positions=[0, 1, 2, 3, 4], top_k=2), (2, 5, 2), (2, 5))
        >>> back = LensResult.from_json(res.to_json())  # the top-k tables; not the full logits
        >>> back.top_tokens == res.top_tokens, back.logits is None, type(res.plot()).__name__
        (True, True, 'Figure')
    """

    layers: list[int]
    positions: list[int]
    tokens: list[str]
    top_ids: Tensor
    top_probs: Tensor
    top_tokens: list[list[list[str]]]
    logits: Optional[Tensor] = None

    def __repr__(self):
        return (f"LensResult(layers={len(self.layers)}, positions={self.positions}, top_k={self.top_ids.shape[-1]})")

    def prob_of(self, sm: "SteerModel", token: Union[str, int]) -> Float[Tensor, "n_layers n_pos"]:
        """The probability of one token at every layer and position (needs ``logits``)."""
        if self.logits is None:
            raise InputError("expected a LensResult with logits, found one read from JSON (top-k only); rerun "
                             "logit_lens to get every token's probability")
        return self.logits.softmax(-1)[..., token_id(sm, token)]

    def to_dict(self) -> dict:
        return {"format": LENS_FORMAT, "layers": list(self.layers), "positions": list(self.positions),
                "tokens": list(self.tokens), "top_ids": self.top_ids.tolist(),
                "top_probs": self.top_probs.float().tolist(), "top_tokens": self.top_tokens}

    def to_json(self, path=None) -> str:
        """The top-k tables as JSON (written to ``path`` when given); the full logits are not stored."""
        return json_text(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path) -> "LensResult":
        return read_document(text_or_path, LENS_FORMAT, "logit lens", cls._from_dict)

    @classmethod
    def _from_dict(cls, d: dict) -> "LensResult":
        return cls(layers=[int(i) for i in d["layers"]], positions=[int(i) for i in d["positions"]],
                   tokens=[str(t) for t in d["tokens"]], top_ids=torch.tensor(d["top_ids"], dtype=torch.long),
                   top_probs=torch.tensor(d["top_probs"], dtype=torch.float32),
                   top_tokens=[[[str(t) for t in cell] for cell in row] for row in d["top_tokens"]])

    def plot(self, *, title: Optional[str] = None):
        """A plotly heatmap: layers down, positions across, each cell's top token written in it and
        coloured by its probability (:func:`steerkit.probes.plots.lens.lens_figure`)."""
        with plotly_required():
            from .plots import lens as figures
        return figures.lens_figure(self, title=title)


def logit_lens(sm: "SteerModel", prompt: Prompt, *, positions: Union[int, Sequence[int], None] = -1, top_k: int = 5,
               layers: Optional[Sequence[int]] = None, chat: bool = False) -> LensResult:
    """Each layer's ``hook_resid_post`` through the final norm and the unembedding (:func:`unembed`).

    ``positions``: indices into the prompt (``-1``: the last token; ``None``: every position);
    ``layers``: default all; ``top_k`` tokens per cell. ``prompt``: a string (without the chat
    template unless ``chat``), token ids or one-row ``Tokens``.

    The default model settles on " Paris" only in its last layers.

    Examples:
        >>> from steerkit.probes import logit_lens
        >>> res = logit_lens(sm, "The capital of France is", layers=[10, 20, 29], top_k=3)
        >>> [row[0][0] for row in res.top_tokens]  # the top token at the last position, per layer
        [' ', ' ', ' Paris']
        >>> (res.prob_of(sm, " Paris")[:, 0] > 0.5).tolist()
        [False, False, True]
    """
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise InputError(f"expected top_k as a positive int, found {top_k!r}")
    toks = prompt_tokens(sm, prompt, chat=chat)
    n_pos = int(toks.input_ids.shape[1])
    P = index_list(positions, n_pos, "positions", "position")
    L = index_list(layers, sm.n_layers, "layers", "layer")
    names = [f"blocks.{l}.hook_resid_post" for l in L]
    with sm.record(names, positions="all") as cache:
        sm.forward(toks)
    with torch.inference_mode():
        resid = torch.stack([cache[n][0, P] for n in names]).to(sm.device)  # [layers, pos, d_model]
        logits = unembed(sm, resid).cpu()
    k = min(top_k, logits.shape[-1])
    probs = logits.softmax(-1)
    top = probs.topk(k, dim=-1)
    dec = sm.tokenizer.decode
    top_tokens = [[[dec([int(i)]) for i in cell] for cell in row] for row in top.indices.tolist()]
    return LensResult(layers=L, positions=P, tokens=token_labels(sm, toks), top_ids=top.indices,
                      top_probs=top.values.float(), top_tokens=top_tokens, logits=logits)


# ----------------------------------------------------------------------------- direct logit attribution
@dataclasses.dataclass(eq=False)
class DLAResult:
    """Direct logit attribution at one ``position`` of one prompt, for ``answer`` (minus ``wrong``).

    ``embed`` (float), ``attn`` / ``mlp`` ``[n_layers]`` and ``heads`` ``[n_layers, n_heads]``: each
    part's direct contribution; ``attn_bias`` ``[n_layers]``: the output projections' biases
    (``attn[l] = heads[l].sum() + attn_bias[l]``); ``bias``: the final norm's and the unembedding's
    bias terms; ``logit_diff``: the model's own logit difference; ``scale``: the final norm's cached
    scale at the position. ``embed + attn.sum() + mlp.sum() + bias == logit_diff`` up to ``error``.

    Examples:
        >>> from steerkit.probes import DLAResult, direct_logit_attribution
        >>> res = direct_logit_attribution(tiny, "When Mary and John went out, John gave it to", " Mary", " John")
        >>> tuple(res.attn.shape), tuple(res.heads.shape), [name for name, _ in res.components()[:3]]
        ((4,), (4, 4), ['embed', 'L0 attn', 'L0 mlp'])
        >>> abs(res.error) < 1e-4, DLAResult.from_json(res.to_json()).heads.equal(res.heads)
        (True, True)
        >>> type(res.plot("heads")).__name__
        'Figure'
    """

    answer: str
    wrong: Optional[str]
    answer_id: int
    wrong_id: Optional[int]
    position: int
    tokens: list[str]
    embed: float
    attn: Tensor
    mlp: Tensor
    heads: Tensor
    attn_bias: Tensor
    bias: float
    logit_diff: float
    scale: float

    @property
    def total(self) -> float:
        """The parts' sum: ``embed + attn.sum() + mlp.sum()``."""
        return float(self.embed + self.attn.double().sum() + self.mlp.double().sum())

    @property
    def error(self) -> float:
        """``logit_diff - bias - total``: what the decomposition leaves (float rounding)."""
        return self.logit_diff - self.bias - self.total

    def components(self) -> list[tuple[str, float]]:
        """``[("embed", v), ("L0 attn", v), ("L0 mlp", v), ...]`` in the order the residual adds them."""
        out = [("embed", self.embed)]
        for l in range(len(self.attn)):
            out += [(f"L{l} attn", float(self.attn[l])), (f"L{l} mlp", float(self.mlp[l]))]
        return out

    def __repr__(self):
        what = f"{self.answer!r}" + (f" - {self.wrong!r}" if self.wrong is not None else "")
        return (f"DLAResult({what} at {self.position}: logit_diff={self.logit_diff:.4g}, parts={self.total:.4g}, "
                f"bias={self.bias:.4g}, error={self.error:.2g})")

    def to_dict(self) -> dict:
        return {"format": DLA_FORMAT, "answer": self.answer, "wrong": self.wrong, "answer_id": self.answer_id,
                "wrong_id": self.wrong_id, "position": self.position, "tokens": list(self.tokens),
                "embed": self.embed, "attn": self.attn.tolist(), "mlp": self.mlp.tolist(), "heads": self.heads.tolist(),
                "attn_bias": self.attn_bias.tolist(), "bias": self.bias, "logit_diff": self.logit_diff,
                "scale": self.scale}

    def to_json(self, path=None) -> str:
        """The result as JSON (written to ``path`` when given); :meth:`from_json` reads it back exactly."""
        return json_text(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path) -> "DLAResult":
        return read_document(text_or_path, DLA_FORMAT, "direct logit attribution", cls._from_dict)

    @classmethod
    def _from_dict(cls, d: dict) -> "DLAResult":
        return cls(answer=str(d["answer"]), wrong=None if d["wrong"] is None else str(d["wrong"]),
                   answer_id=int(d["answer_id"]), wrong_id=None if d["wrong_id"] is None else int(d["wrong_id"]),
                   position=int(d["position"]), tokens=[str(t) for t in d["tokens"]], embed=float(d["embed"]),
                   attn=torch.tensor(d["attn"], dtype=torch.float64), mlp=torch.tensor(d["mlp"], dtype=torch.float64),
                   heads=torch.tensor(d["heads"], dtype=torch.float64),
                   attn_bias=torch.tensor(d["attn_bias"], dtype=torch.float64), bias=float(d["bias"]),
                   logit_diff=float(d["logit_diff"]), scale=float(d["scale"]))

    def plot(self, kind: str = "components", *, title: Optional[str] = None):
        """A plotly figure: ``kind="components"`` a bar per part (embed, each layer's attn and mlp);
        ``kind="heads"`` a heatmap of the heads (layers down, heads across)
        (:func:`steerkit.probes.plots.lens.dla_figure`)."""
        with plotly_required():
            from .plots import lens as figures
        return figures.dla_figure(self, kind, title=title)


def _writers(sm: "SteerModel") -> list[tuple[Tensor, Optional[Tensor]]]:
    """Each layer's attention output projection (weight ``[d_model, n_heads * d_head]``, bias), after
    checking both sub-layers write the residual through a linear map."""
    out = []
    for l in range(sm.n_layers):
        try:
            o = sm.adapter.residual_writer(sm.hf_model, l, "attn")
            sm.adapter.residual_writer(sm.hf_model, l, "mlp")
        except UnsupportedArchitectureError as e:
            raise UnsupportedArchitectureError(
                f"expected each sub-layer of {sm.name!r} to write the residual stream through an output projection "
                f"(nn.Linear) for direct logit attribution, found otherwise at layer {l}: {e}") from None
        out.append((o.weight, o.bias))
    if _softcap(sm) is not None:
        raise UnsupportedArchitectureError(
            f"expected logits linear in the final residual for direct logit attribution, found soft-capped logits "
            f"(final_logit_softcapping={_softcap(sm)}) on {sm.name!r}; use the logit lens or patching instead")
    return out


def direct_logit_attribution(sm: "SteerModel", prompt: Prompt, answer: Union[str, int],
                             wrong: Union[str, int, None] = None, *, position: int = -1,
                             chat: bool = False) -> DLAResult:
    """Decompose the logit of ``answer`` (minus ``wrong``'s when given) at ``position`` into the direct
    contributions of the embedding, each attention and MLP output and each head (see the module
    docstring for the convention and the bias terms). ``answer`` / ``wrong``: one-token strings or ids.

    Raises :class:`~steerkit.errors.UnsupportedArchitectureError` on families where the decomposition
    does not hold (a norm after each sub-layer, soft-capped logits).

    The parts add up to the model's own logit difference.

    Examples:
        >>> from steerkit.probes import direct_logit_attribution
        >>> res = direct_logit_attribution(tiny, "When Mary and John went out, John gave it to", " Mary", " John")
        >>> abs(res.total + res.bias - res.logit_diff) < 1e-4, res.position, res.tokens[-1]
        (True, 10, ' to')
        >>> bool(torch.allclose(res.heads.sum(1) + res.attn_bias, res.attn, atol=1e-5))
        True
    """
    writers = _writers(sm)
    toks = prompt_tokens(sm, prompt, chat=chat)
    n_pos = int(toks.input_ids.shape[1])
    if isinstance(position, bool) or not isinstance(position, int):
        raise InputError(f"expected position as an int (-1: the last token), found {position!r}")
    p = index_list([position], n_pos, "position", "position")[0]
    a = token_id(sm, answer, "the answer")
    w = None if wrong is None else token_id(sm, wrong, "the wrong answer")
    L = sm.n_layers
    names = (["blocks.0.hook_resid_pre", "ln_final.hook_scale"]
             + [f"blocks.{l}.{k}" for l in range(L) for k in ("hook_attn_out", "hook_mlp_out", "attn.hook_z")])
    with sm.record(names, positions="all") as cache:
        logits = sm.forward(toks)
    logits = logits[0, p].double().cpu()
    diff = float(logits[a] - (logits[w] if w is not None else 0.0))

    head = sm.adapter.unembed_module(sm.hf_model)
    W_U = head.weight.detach().double().cpu()
    d = W_U[a] - (W_U[w] if w is not None else 0.0)
    nw, nb = sm.adapter.final_norm_affine(sm.hf_model)
    eff = d if nw is None else d * nw.detach().double().cpu()
    bias = 0.0 if nb is None else float(nb.detach().double().cpu() @ d)
    ub = getattr(head, "bias", None)
    if ub is not None:
        ub = ub.detach().double().cpu()
        bias += float(ub[a] - (ub[w] if w is not None else 0.0))
    scale = float(cache["ln_final.hook_scale"][0, p].reshape(()))
    centre = sm.adapter.norm.kind == "layer"

    def contrib(x: Tensor) -> Tensor:  # [..., d_model] -> [...]
        x = x.double().cpu()
        if centre:
            x = x - x.mean(-1, keepdim=True)
        return (x / scale) @ eff

    embed = float(contrib(cache["blocks.0.hook_resid_pre"][0, p]))
    attn = torch.stack([contrib(cache[f"blocks.{l}.hook_attn_out"][0, p]) for l in range(L)])
    mlp = torch.stack([contrib(cache[f"blocks.{l}.hook_mlp_out"][0, p]) for l in range(L)])
    heads, attn_bias = [], []
    for l, (W_O, b_O) in enumerate(writers):
        z = cache[f"blocks.{l}.attn.hook_z"][0, p].double().cpu()  # [n_heads, d_head]
        H, dh = z.shape
        if W_O.shape[1] != H * dh:
            raise UnsupportedArchitectureError(
                f"expected the attention output projection of layer {l} to read n_heads * d_head = {H * dh} features "
                f"(hook_z), found a weight of shape {tuple(W_O.shape)}; the per-head split does not apply here")
        Wo = W_O.detach().double().cpu().reshape(W_O.shape[0], H, dh)  # [d_model, heads, d_head]
        per_head = torch.einsum("hk,dhk->hd", z, Wo)  # [heads, d_model]
        heads.append(contrib(per_head))
        attn_bias.append(contrib(b_O.detach()) if b_O is not None else torch.zeros((), dtype=torch.float64))
    res = DLAResult(answer=sm.tokenizer.decode([a]), wrong=None if w is None else sm.tokenizer.decode([w]), answer_id=a,
                    wrong_id=w, position=p, tokens=token_labels(sm, toks), embed=embed, attn=attn, mlp=mlp,
                    heads=torch.stack(heads), attn_bias=torch.stack(attn_bias), bias=bias, logit_diff=diff,
                    scale=scale)
    tol = (1e-3 if sm.dtype == torch.float32 else 5e-2) * max(1.0, float(attn.abs().sum() + mlp.abs().sum()) + abs(embed))
    if abs(res.error) > tol:
        warnings.warn(f"direct logit attribution: the parts sum to {res.total + bias:.6g} with the bias terms, the "
                      f"model's logit difference is {diff:.6g} (error {res.error:.3g} > {tol:.3g}); the recorded "
                      "activations may not add up to the final residual on this model", stacklevel=2)
    return res
