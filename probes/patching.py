"""Activation patching and attribution patching between a clean and a corrupted prompt.

Both compare two prompts of equal token length (say the IOI pair "When Mary and John went to the
store, John gave a drink to" / the names swapped) through a ``metric`` of the logits (say
:func:`logit_diff_metric` ``" Mary" - " John"`` at the last position):

- :func:`activation_patching`: the clean run's activations at one hook kind are recorded once for
  every layer, then patched into the corrupted run ONE site at a time (a layer and a position, a
  layer and a head, ...), TransformerLens's convention: ``values[l, p] = metric(logits of the
  corrupted run with site (l, p) patched from the clean run)``. Patches are batched: each forward
  pass runs the corrupted prompt once per row, every row with its own patch (a per-row steering of
  :class:`steerkit.Intervention.patch`), ``batch_size`` rows at a time.
- :func:`attribution_patching`: the first-order approximation of the same grid from one clean run
  and one corrupted run with gradients (Nanda 2023): ``values[l, p] = ((clean - corrupted) *
  d metric / d activation).sum(features)`` at each site (summed over positions for whole-head or
  whole-neuron sites).

Hook kinds (``hook=``) and the grid each gives (``values``):

==============  ============================  =====================================================
hook            values                        one site
==============  ============================  =====================================================
``resid_pre``   ``[n_layers, n_pos]``         ``blocks.{l}.hook_resid_pre`` at one position
``resid_mid``   ``[n_layers, n_pos]``         ``blocks.{l}.hook_resid_mid`` at one position
``resid_post``  ``[n_layers, n_pos]``         ``blocks.{l}.hook_resid_post`` at one position
``attn_out``    ``[n_layers, n_pos]``         ``blocks.{l}.hook_attn_out`` at one position
``mlp_out``     ``[n_layers, n_pos]``         ``blocks.{l}.hook_mlp_out`` at one position
``z``           ``[n_layers, n_heads]``       one head of ``blocks.{l}.attn.hook_z``, every position
``z_pos``       ``[n_layers, n_pos, n_heads]``  one head of ``attn.hook_z`` at one position
``mlp_post``    ``[n_layers, n_pos]``, or     ``blocks.{l}.mlp.hook_post`` at one position, or one
                ``[n_layers, n_neurons]``     neuron at every position with ``neurons=[...]``
==============  ============================  =====================================================

A :class:`PatchingResult` holds the grid with its labels, the clean and corrupted metrics, and
``normalized()`` / ``to_json()`` / ``from_json()`` / ``plot()``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, TypeVar, Union

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.hooks.names import layer_names
from steerkit.interventions import Intervention
from steerkit.model import Tokens
from steerkit.reuse import Pack, run_cached, run_from, run_packed, supports_run_from
from steerkit.storage import jsontext

from .plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel

#: hook kinds of :func:`activation_patching`: the hook name inside a block, and the grid's axes
HOOKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "resid_pre": ("hook_resid_pre", ("layer", "pos")),
    "resid_mid": ("hook_resid_mid", ("layer", "pos")),
    "resid_post": ("hook_resid_post", ("layer", "pos")),
    "attn_out": ("hook_attn_out", ("layer", "pos")),
    "mlp_out": ("hook_mlp_out", ("layer", "pos")),
    "z": ("attn.hook_z", ("layer", "head")),
    "z_pos": ("attn.hook_z", ("layer", "pos", "head")),
    "mlp_post": ("mlp.hook_post", ("layer", "pos")),
}
METHODS = ("activation", "attribution")
FORMAT = "steerkit.patching/1"

Metric = Callable[[Float[Tensor, "1 pos vocab"]], Tensor]
Prompt = Union[str, Tokens, Sequence[int], Tensor]
T = TypeVar("T")


# ----------------------------------------------------------------------------- prompts and tokens
def prompt_tokens(sm: "SteerModel", prompt: Prompt, what: str = "the prompt", *, chat: bool = False) -> Tokens:
    """One unpadded prompt as :class:`~steerkit.model.Tokens` ``[1, pos]``: a string (tokenized with the
    chat template when ``chat``), token ids (a list or a 1-D / ``[1, pos]`` tensor) or ``Tokens`` of one row.

    Examples:
        >>> from steerkit.probes.patching import prompt_tokens
        >>> toks = prompt_tokens(tiny, "When Mary and John went to the store")
        >>> tuple(toks.input_ids.shape), prompt_tokens(tiny, toks.input_ids[0].tolist()).input_ids.equal(toks.input_ids)
        ((1, 8), True)
    """
    if isinstance(prompt, Tokens):
        toks = prompt
    elif isinstance(prompt, str):
        if not prompt:
            raise InputError(f"expected {what} as a non-empty string, found an empty one")
        toks = sm.tokenize([prompt], chat=chat)
    elif isinstance(prompt, Tensor) or (isinstance(prompt, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in prompt)):
        ids = torch.as_tensor(prompt)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InputError(f"expected {what} as token ids [pos] (at least one), found a tensor of dtype "
                             f"{ids.dtype} with shape {tuple(ids.shape)}")
        toks = sm.pad([ids.tolist()])
    else:
        raise InputError(f"expected {what} as a string, token ids or steerkit Tokens of one row, found "
                         f"{type(prompt).__name__} {prompt!r:.80}")
    if toks.input_ids.dim() != 2 or toks.input_ids.shape[0] != 1:
        raise InputError(f"expected {what} as ONE prompt, found a batch of shape {tuple(toks.input_ids.shape)}; "
                         "pass the prompts one at a time")
    if toks.input_ids.shape[1] == 0:
        raise InputError(f"expected {what} to have at least one token, found none")
    if not bool(toks.attention_mask.bool().all()):
        raise InputError(f"expected {what} without padding, found {int((toks.attention_mask == 0).sum())} "
                         "padding positions; pass the prompt alone")
    return toks


def token_labels(sm: "SteerModel", toks: Tokens) -> list[str]:
    """Each token of a one-row prompt decoded on its own.

    Examples:
        >>> from steerkit.probes.patching import prompt_tokens, token_labels
        >>> token_labels(tiny, prompt_tokens(tiny, "When Mary and John"))
        ['When', ' Mary', ' and', ' John']
    """
    return [sm.tokenizer.decode([int(i)]) for i in toks.input_ids[0].tolist()]


def token_id(sm: "SteerModel", token: Union[str, int], what: str = "the token") -> int:
    """A vocabulary id: an int as given (checked against the vocabulary), or a string that is ONE token
    (``" Mary"``, with its leading space where the tokenizer has one).

    Examples:
        >>> from steerkit.probes.patching import token_id
        >>> token_id(tiny, " Mary"), token_id(tiny, 5099)
        (5099, 5099)
        >>> token_id(tiny, " Maryland and")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected the token ' Maryland and' to be one token, found 2: ...
    """
    vocab = int(sm.adapter.unembed_module(sm.hf_model).weight.shape[0])
    if isinstance(token, bool):
        raise InputError(f"expected {what} as a token string or id, found the bool {token}")
    if isinstance(token, int):
        if not 0 <= token < vocab:
            raise InputError(f"expected {what} as a token id in 0..{vocab - 1}, found {token}")
        return token
    if isinstance(token, str):
        ids = sm.tokenizer(token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            pieces = [sm.tokenizer.decode([i]) for i in ids]
            raise InputError(f"expected {what} {token!r} to be one token, found {len(ids)}: {pieces!r}; pass a "
                             "single token (mind the leading space, e.g. ' Mary') or its id")
        return int(ids[0])
    raise InputError(f"expected {what} as a token string or id, found {type(token).__name__} {token!r:.80}")


def logit_diff_metric(sm: "SteerModel", answer: Union[str, int], wrong: Union[str, int], *,
                      position: int = -1) -> Metric:
    """``metric(logits) = logits[0, position, answer] - logits[0, position, wrong]`` (a scalar tensor;
    the last position by default). ``answer`` / ``wrong``: one-token strings or token ids.

    Examples:
        >>> from steerkit.probes import logit_diff_metric
        >>> metric = logit_diff_metric(tiny, " Mary", " John")
        >>> logits = torch.zeros(1, 3, tiny.tokenizer.vocab_size)
        >>> logits[0, -1, 5099] = 2.5  # " Mary"
        >>> float(metric(logits)), metric.__name__
        (2.5, "logit_diff[' Mary' - ' John']")
    """
    a, w = token_id(sm, answer, "the answer"), token_id(sm, wrong, "the wrong answer")
    if isinstance(position, bool) or not isinstance(position, int):
        raise InputError(f"expected the metric's position as an int (-1: the last), found {position!r}")

    def metric(logits: Float[Tensor, "1 pos vocab"]) -> Tensor:
        return logits[0, position, a] - logits[0, position, w]

    metric.__name__ = f"logit_diff[{answer!r} - {wrong!r}]"
    metric.positions = (position,)  # type: ignore[attr-defined]  # the positions it reads (see activation_patching)
    return metric


def _metric_value(metric: Metric, logits: Tensor, grad: bool = False) -> Tensor:
    out = metric(logits)
    if not isinstance(out, Tensor):
        if isinstance(out, (int, float)) and not isinstance(out, bool) and not grad:
            return torch.tensor(float(out))
        raise InputError(f"expected the metric to return a scalar tensor, found {type(out).__name__}"
                         + ("; attribution patching needs a tensor that depends on the logits" if grad else ""))
    if out.numel() != 1:
        raise InputError(f"expected the metric to return a scalar tensor, found shape {tuple(out.shape)}; reduce "
                         "it (e.g. .mean()) or use logit_diff_metric(sm, answer, wrong)")
    out = out.reshape(())
    if not bool(torch.isfinite(out.detach())):
        raise InputError(f"expected a finite metric, found {float(out)}")
    return out


# ----------------------------------------------------------------------------- the result
@dataclasses.dataclass(eq=False)
class PatchingResult:
    """A patching grid: ``values`` over ``axes`` (``("layer", "pos")``, ``("layer", "head")``,
    ``("layer", "pos", "head")`` or ``("layer", "neuron")``), indexed by ``layers`` / ``positions`` /
    ``heads`` / ``neurons`` (absolute indices); ``tokens`` the clean prompt's tokens (every position);
    ``clean_metric`` / ``corrupted_metric`` the metric of the unpatched runs. ``is_normalized``: the
    values are ``(v - corrupted) / (clean - corrupted)`` (:meth:`normalized`).

    Examples:
        >>> from steerkit.probes import PatchingResult
        >>> res = PatchingResult(values=torch.tensor([[4.0, -2.0], [1.0, 2.5]]), hook="resid_pre", method="activation",
        ...                      layers=[0, 1], positions=[0, 1], heads=None, tokens=["A", " B"], clean_metric=4.0,
        ...                      corrupted_metric=-2.0)
        >>> res.axes, res.normalized().values.tolist()
        (('layer', 'pos'), [[1.0, 0.0], [0.5, 0.75]])
        >>> PatchingResult.from_json(res.to_json()).values.equal(res.values), type(res.plot()).__name__
        (True, 'Figure')
    """

    values: Tensor
    hook: str
    method: str
    layers: list[int]
    positions: list[int]
    heads: Optional[list[int]]
    tokens: list[str]
    clean_metric: float
    corrupted_metric: float
    neurons: Optional[list[int]] = None
    is_normalized: bool = False

    @property
    def axes(self) -> tuple[str, ...]:
        if self.neurons is not None:
            return ("layer", "neuron")
        return HOOKS[self.hook][1]

    def __repr__(self):
        return (f"PatchingResult(hook={self.hook!r}, method={self.method!r}, values{tuple(self.values.shape)} over "
                f"{self.axes}, clean={self.clean_metric:.4g}, corrupted={self.corrupted_metric:.4g}"
                + (", normalized" if self.is_normalized else "") + ")")

    def normalized(self) -> "PatchingResult":
        """The values as the fraction of the clean-vs-corrupted gap they restore:
        ``(v - corrupted_metric) / (clean_metric - corrupted_metric)`` (1: as clean, 0: as corrupted).
        Attribution values are differences already, so they are divided by the gap only."""
        if self.is_normalized:
            return self
        gap = self.clean_metric - self.corrupted_metric
        if abs(gap) < 1e-12:
            raise InputError(f"expected different clean and corrupted metrics to normalise by, found both "
                             f"{self.clean_metric:.6g}; choose a prompt pair the metric tells apart")
        base = 0.0 if self.method == "attribution" else self.corrupted_metric
        return dataclasses.replace(self, values=(self.values.double() - base).div(gap).float(), is_normalized=True)

    # --- storage -----------------------------------------------------------------
    def to_dict(self) -> dict:
        if not bool(torch.isfinite(self.values).all()):
            raise InputError("expected finite patching values to store, found NaN/inf; check the metric")
        return {"format": FORMAT, "hook": self.hook, "method": self.method, "axes": list(self.axes),
                "shape": list(self.values.shape), "values": self.values.float().tolist(),
                "layers": list(self.layers), "positions": list(self.positions),
                "heads": None if self.heads is None else list(self.heads),
                "neurons": None if self.neurons is None else list(self.neurons), "tokens": list(self.tokens),
                "clean_metric": self.clean_metric, "corrupted_metric": self.corrupted_metric,
                "is_normalized": self.is_normalized}

    def to_json(self, path=None) -> str:
        """The result as JSON (written to ``path`` when given); :meth:`from_json` reads it back exactly."""
        return json_text(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path) -> "PatchingResult":
        """A result from :meth:`to_json`'s text or a path to it."""
        res = read_document(text_or_path, FORMAT, "patching", cls._from_dict)
        if res.hook not in HOOKS or res.method not in METHODS:
            raise InputError(f"expected hook in {tuple(HOOKS)} and method in {METHODS}, found {res.hook!r} / "
                             f"{res.method!r}")
        return res

    @classmethod
    def _from_dict(cls, d: dict) -> "PatchingResult":
        values = torch.tensor(d["values"], dtype=torch.float32).reshape(d["shape"])
        return cls(values=values, hook=str(d["hook"]), method=str(d["method"]),
                   layers=[int(i) for i in d["layers"]], positions=[int(i) for i in d["positions"]],
                   heads=None if d["heads"] is None else [int(i) for i in d["heads"]],
                   tokens=[str(t) for t in d["tokens"]], clean_metric=float(d["clean_metric"]),
                   corrupted_metric=float(d["corrupted_metric"]),
                   neurons=None if d.get("neurons") is None else [int(i) for i in d["neurons"]],
                   is_normalized=bool(d.get("is_normalized", False)))

    # --- plotting ----------------------------------------------------------------
    def labelled_grid(self) -> tuple[list[str], list[str], Tensor]:
        """(x labels, y labels, the 2-D grid) of the heatmap."""
        pos = [f"{p} {self.tokens[p]!r}" if 0 <= p < len(self.tokens) else str(p) for p in self.positions]
        layers = [f"L{l}" for l in self.layers]
        v = self.values
        if self.neurons is not None:
            return [f"N{n}" for n in self.neurons], layers, v
        if self.hook == "z":
            return [f"H{h}" for h in (self.heads or [])], layers, v
        if self.hook == "z_pos":  # one row per (layer, head)
            rows = [f"L{l}H{h}" for l in self.layers for h in (self.heads or [])]
            return pos, rows, v.permute(0, 2, 1).reshape(len(rows), len(self.positions))
        return pos, layers, v

    def plot(self, *, title: Optional[str] = None):
        """A plotly heatmap (diverging, centred at 0): layers down, positions (with their tokens) or
        heads across; rows ``L{l}H{h}`` by positions for ``z_pos``
        (:func:`steerkit.probes.plots.patching.patching_figure`)."""
        with plotly_required():
            from .plots import patching as figures
        return figures.patching_figure(self, title=title)


def json_document(text_or_path, fmt: str, what: str) -> dict:
    """The JSON object of a saved result (its text or a path to it), checked to be of format ``fmt``.

    Examples:
        >>> from steerkit.probes.patching import json_document
        >>> _ = (tmp_dir / "r.json").write_text('{"format": "steerkit.patching/1", "hook": "z"}')
        >>> json_document(tmp_dir / "r.json", "steerkit.patching/1", "patching")["hook"]
        'z'
        >>> json_document('{"format": "other"}', "steerkit.patching/1", "patching")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a steerkit patching JSON (format 'steerkit.patching/1'), found 'other'
    """
    if isinstance(text_or_path, Path) or not str(text_or_path).lstrip().startswith("{"):
        p = Path(text_or_path)
        if not p.is_file():
            raise InputError(f"expected {what} JSON text or a path to a file holding it, found {str(p)!r:.120}")
        text_or_path = p.read_text(encoding="utf-8")
    try:
        d = jsontext.loads(text_or_path)
    except json.JSONDecodeError as e:
        raise InputError(f"expected {what} JSON, found text that does not parse ({e})") from None
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise InputError(f"expected a steerkit {what} JSON (format {fmt!r}), found "
                         f"{str(d.get('format') if isinstance(d, dict) else d)[:80]!r}")
    return d


def read_document(text_or_path, fmt: str, what: str, build: Callable[[dict], T]) -> T:
    """``build`` of the saved result's JSON object (:func:`json_document`); a field missing or of the
    wrong type is an :class:`~steerkit.errors.InputError` naming the result.

    Examples:
        >>> from steerkit.probes.patching import read_document
        >>> read_document('{"format": "f/1", "n": "3"}', "f/1", "demo", lambda d: int(d["n"]))
        3
        >>> read_document('{"format": "f/1"}', "f/1", "demo", lambda d: int(d["n"]))
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a complete steerkit demo JSON, found a malformed one (KeyError('n'))
    """
    d = json_document(text_or_path, fmt, what)
    try:
        return build(d)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"expected a complete steerkit {what} JSON, found a malformed one ({e!r:.120})") from None


def json_text(d: dict, path=None) -> str:
    """``d`` as strict JSON (no NaN or infinity), written to ``path`` when given; returns the text.

    Examples:
        >>> from steerkit.probes.patching import json_text
        >>> json_text({"layers": [0, 1], "score": 0.5})
        '{"layers": [0, 1], "score": 0.5}'
        >>> try:
        ...     json_text({"score": float("nan")})
        ... except ValueError as e:
        ...     print("refused:", "not JSON compliant" in str(e))
        refused: True
    """
    text = json.dumps(d, allow_nan=False)
    if path is not None:
        Path(path).write_text(text, encoding="utf-8")
    return text


# ----------------------------------------------------------------------------- the grid
@dataclasses.dataclass
class _Plan:
    kind: str
    sites: list[str]  # one hook name per layer in ``layers``
    layers: list[int]
    positions: list[int]
    heads: Optional[list[int]]
    neurons: Optional[list[int]]
    shape: tuple[int, ...]
    clean: Tokens
    corrupted: Tokens
    tokens: list[str]


def index_list(v, n: int, what: str, axis: str) -> list[int]:
    """Indices into an axis of size ``n`` (negative from the end), absolute, in the order given.

    Examples:
        >>> from steerkit.probes.patching import index_list
        >>> index_list([0, -1], 30, "layers", "layer"), index_list(None, 3, "heads", "head")
        ([0, 29], [0, 1, 2])
    """
    if v is None:
        return list(range(n))
    if isinstance(v, range):
        v = list(v)
    if isinstance(v, int) and not isinstance(v, bool):
        v = [v]
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise InputError(f"expected {what} as a list of ints (or None for all {n}), found {v!r:.80}")
    if not v:
        raise InputError(f"expected at least one {axis} in {what}, found an empty list; pass None for all {n}")
    out = []
    for i in v:
        if not -n <= i < n:
            raise InputError(f"expected {what} in {-n}..{n - 1} ({n} {axis}s), found {i}")
        out.append(i % n)
    if len(set(out)) != len(out):
        raise InputError(f"expected distinct {what}, found repeats in {list(v)}")
    return out


def _plan(sm: "SteerModel", clean: Prompt, corrupted: Prompt, hook: str, layers, positions, heads, neurons,
          chat: bool) -> _Plan:
    if hook not in HOOKS:
        raise InputError(f"expected hook in {tuple(HOOKS)}, found {hook!r}")
    if hook == "resid_mid" and not sm.hooks.has_resid_mid:
        raise InputError("expected hook='resid_mid' only on models with sequential blocks, found parallel ones "
                         "(no resid_mid); patch resid_pre, attn_out or mlp_out instead")
    c = prompt_tokens(sm, clean, "the clean prompt", chat=chat)
    k = prompt_tokens(sm, corrupted, "the corrupted prompt", chat=chat)
    n_pos = int(c.input_ids.shape[1])
    if int(k.input_ids.shape[1]) != n_pos:
        raise InputError(f"expected the clean and corrupted prompts to have the same number of tokens, found "
                         f"{n_pos} and {int(k.input_ids.shape[1])}; patching maps position to position, so choose "
                         "a corruption that keeps every token count (e.g. swap one-token names)")
    L = index_list(layers, sm.n_layers, "layers", "layer")
    kind = HOOKS[hook][0]
    if hook == "z" and positions is not None:
        raise InputError("expected positions=None with hook='z' (each head is patched at every position), found "
                         f"{positions!r}; use hook='z_pos' for heads at single positions")
    if neurons is not None and hook != "mlp_post":
        raise InputError(f"expected neurons= only with hook='mlp_post', found it with {hook!r}")
    if neurons is not None and positions is not None:
        raise InputError("expected positions=None with neurons= (each neuron is patched at every position), found "
                         f"{positions!r}")
    if heads is not None and hook not in ("z", "z_pos"):
        raise InputError(f"expected heads= only with hook='z' or 'z_pos', found it with {hook!r}")
    P = index_list(positions, n_pos, "positions", "position") if hook != "z" and neurons is None else list(range(n_pos))
    H = index_list(heads, int(sm.facts.n_heads), "heads", "head") if hook in ("z", "z_pos") else None
    N = index_list(neurons, int(sm.facts.d_mlp), "neurons", "neuron") if neurons is not None else None
    if hook == "z":
        shape: tuple[int, ...] = (len(L), len(H or []))
    elif hook == "z_pos":
        shape = (len(L), len(P), len(H or []))
    elif N is not None:
        shape = (len(L), len(N))
    else:
        shape = (len(L), len(P))
    return _Plan(kind, layer_names(L, kind), L, P, H, N, shape, c, k, token_labels(sm, c))


@dataclasses.dataclass(frozen=True)
class _Cell:
    """One patched run of the grid: ``index`` into the values, the block and site, the positions written
    (``None``: every position), and the heads or neurons (``None``: the whole activation)."""

    index: tuple
    layer: int
    site: str
    positions: Optional[tuple[int, ...]]
    heads: Optional[tuple[int, ...]] = None
    neurons: Optional[tuple[int, ...]] = None

    @property
    def first(self) -> int:
        """The first position the patch changes."""
        return 0 if self.positions is None else min(self.positions)

    def intervention(self, src: Tensor) -> Intervention:
        return Intervention.patch(self.site, src, positions="all" if self.positions is None else list(self.positions),
                                  heads=None if self.heads is None else list(self.heads),
                                  neurons=None if self.neurons is None else list(self.neurons))


def _cells(plan: _Plan) -> list[_Cell]:
    """Every patched run of the grid, layer-major."""
    out = []
    for li, (site, layer) in enumerate(zip(plan.sites, plan.layers)):
        if plan.heads is not None and plan.kind == "attn.hook_z" and len(plan.shape) == 2:
            out += [_Cell((li, hi), layer, site, None, heads=(h,)) for hi, h in enumerate(plan.heads)]
        elif plan.heads is not None:
            out += [_Cell((li, pi, hi), layer, site, (p,), heads=(h,)) for pi, p in enumerate(plan.positions)
                    for hi, h in enumerate(plan.heads)]
        elif plan.neurons is not None:
            out += [_Cell((li, ni), layer, site, None, neurons=(n,)) for ni, n in enumerate(plan.neurons)]
        else:
            out += [_Cell((li, pi), layer, site, (p,)) for pi, p in enumerate(plan.positions)]
    return out


def _check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"expected batch_size as a positive int (patches per forward pass), found {batch_size!r}")
    return batch_size


def _record_clean(sm: "SteerModel", plan: _Plan, metric: Metric) -> tuple[dict[str, Tensor], float]:
    """The clean run's activations at every site of the plan (without the batch axis) and its metric."""
    with sm.record(plan.sites, positions="all") as cache:
        logits = sm.forward(plan.clean)
    acts = {s: cache[s][0] for s in plan.sites}
    return acts, float(_metric_value(metric, logits[0:1].float()))


def activation_patching(sm: "SteerModel", clean: Prompt, corrupted: Prompt, metric: Metric, hook: str = "resid_pre",
                        *, layers: Optional[Sequence[int]] = None, positions: Optional[Sequence[int]] = None,
                        heads: Optional[Sequence[int]] = None, neurons: Optional[Sequence[int]] = None,
                        batch_size: int = 32, progress: bool = True, chat: bool = False,
                        reuse: Optional[bool] = None, executor=None) -> PatchingResult:
    """Patch the clean run's activations into the corrupted run one site at a time (see the module
    docstring for the hooks and grids); ``values[...] = metric(patched logits)``.

    ``clean`` / ``corrupted``: one prompt each (a string, tokenized without the chat template unless
    ``chat``; token ids; or one-row ``Tokens``), of equal token length. ``metric(logits)``: a scalar
    tensor from the logits ``[1, pos, vocab]`` of one run (e.g. :func:`logit_diff_metric`).
    ``layers`` / ``positions`` / ``heads`` / ``neurons`` restrict the grid (default: all layers,
    positions and heads; neurons only on request with ``hook="mlp_post"``). ``batch_size`` patched
    runs share one forward pass (each row of the batch its own patch); ``progress`` shows a tqdm bar.

    ``reuse`` (default: on the ``hf`` backend): a patch at block ``l`` and position ``p`` changes nothing
    below block ``l`` or before position ``p``, so each patched run starts from the corrupted run's
    residual at block ``l`` and its keys and values before ``p``: it runs only blocks ``l ..`` over
    positions ``p ..``, about a quarter of a full pass averaged over a ``resid_pre`` grid. Up to
    ``batch_size`` patched runs share a pass in layer-major order, from the lowest block among them, laid
    end to end in one sequence (:func:`steerkit.reuse.run_packed`); whole-sequence patches (``hook="z"``, ``neurons=``) reuse the
    blocks below only. ``reuse=False``: every patched run is a full forward pass (the only way on the
    ``tlens`` and ``nnsight`` backends). Both give the same grid (within float rounding, 1e-5 in
    float32). A metric that reads only the last positions says so with a ``positions`` attribute of
    negative ints (:func:`logit_diff_metric` does); only those positions are unembedded.

    ``executor`` (a :class:`steerkit.executors.RayExecutor` whose workers load this model): each layer's row
    of the grid is computed on a worker (the metric travels to it: a function of the logits, such as
    :func:`logit_diff_metric`'s) and the rows are put together here.

    Indirect object identification in the default model: which name to say moves from the second " John"
    (position 9) to the last position between layers 12 and 24.

    Examples:
        >>> from steerkit.probes import activation_patching, logit_diff_metric
        >>> clean = "When Mary and John went to the store, John gave a drink to"
        >>> corrupted = "When Mary and John went to the store, Mary gave a drink to"
        >>> res = activation_patching(sm, clean, corrupted, logit_diff_metric(sm, " Mary", " John"),
        ...                           layers=[0, 12, 24], positions=[9, -1], progress=False)
        >>> res.clean_metric > 0 > res.corrupted_metric, res.tokens[9]
        (True, ' John')
        >>> (res.normalized().values > 0.5).tolist()  # rows: layers 0, 12, 24; columns: positions 9, 13
        [[True, False], [True, False], [False, True]]
    """
    batch_size = _check_batch_size(batch_size)
    plan = _plan(sm, clean, corrupted, hook, layers, positions, heads, neurons, chat)
    if reuse is None:
        reuse = supports_run_from(sm)
    elif reuse and not supports_run_from(sm):
        raise InputError(f"expected reuse=True only on the 'hf' backend (it runs a range of blocks), found backend "
                         f"{sm.backend_name!r}; pass reuse=None or False")
    if executor is not None:
        return _patching_spread(executor, plan, dict(clean=clean, corrupted=corrupted, metric=metric, hook=hook,
                                                     positions=positions, heads=heads, neurons=neurons,
                                                     batch_size=batch_size, chat=chat, reuse=reuse), progress)
    clean_acts, clean_metric = _record_clean(sm, plan, metric)
    cells = _cells(plan)
    values = torch.zeros(plan.shape, dtype=torch.float32)
    tail = _metric_tail(metric, plan.corrupted.input_ids.shape[1])
    with tqdm(total=len(cells), desc=f"patching {hook}", disable=not progress, leave=False) as bar:
        if reuse:
            corrupted_metric = _grid_packed(sm, plan, metric, cells, clean_acts, values, batch_size, tail, bar)
        else:
            corrupted_metric = _grid_full(sm, plan, metric, cells, clean_acts, values, batch_size, tail, bar)
    return PatchingResult(values=values, hook=hook, method="activation", layers=plan.layers,
                          positions=plan.positions, heads=plan.heads, tokens=plan.tokens, clean_metric=clean_metric,
                          corrupted_metric=corrupted_metric, neurons=plan.neurons)


def _patching_layer(sm: "SteerModel", layer: int, **options) -> PatchingResult:
    return activation_patching(sm, layers=[layer], progress=False, **options)


def _patching_spread(executor, plan: _Plan, options: dict, progress: bool) -> PatchingResult:
    """:func:`activation_patching` with each layer's row on a worker of ``executor``, the rows stacked here."""
    task = functools.partial(_patching_layer, **options)
    rows: dict[int, PatchingResult] = {}
    with tqdm(total=len(plan.layers), desc=f"patching {options['hook']}", unit="layer", disable=not progress,
              leave=False) as bar:
        for i, res in executor.imap_unordered(task, plan.layers):
            rows[i] = res
            bar.update(1)
    first = rows[0]
    return PatchingResult(values=torch.cat([rows[i].values for i in range(len(plan.layers))]), hook=first.hook,
                          method="activation", layers=plan.layers, positions=first.positions, heads=first.heads,
                          tokens=first.tokens, clean_metric=first.clean_metric,
                          corrupted_metric=first.corrupted_metric, neurons=first.neurons)


def _metric_tail(metric: Metric, n_pos: int) -> int:
    """How many last positions the metric reads: those its ``positions`` attribute names when all count
    from the end (as :func:`logit_diff_metric`'s do), else every position."""
    pos = getattr(metric, "positions", None)
    if isinstance(pos, (list, tuple)) and pos and all(isinstance(p, int) and -n_pos <= p < 0 for p in pos):
        return -min(pos)
    return n_pos


def _grid_full(sm: "SteerModel", plan: _Plan, metric: Metric, cells: list[_Cell], clean_acts: dict[str, Tensor],
               values: Tensor, batch_size: int, tail: int, bar) -> float:
    """Every cell a row of a full forward pass over the corrupted prompt, ``batch_size`` rows per pass.
    Returns the corrupted metric."""
    ids, mask = plan.corrupted.input_ids, plan.corrupted.attention_mask
    for i0 in range(0, len(cells), batch_size):
        chunk = cells[i0:i0 + batch_size]
        rows = len(chunk)
        toks = Tokens(ids.expand(rows, -1).contiguous(), mask.expand(rows, -1).contiguous())
        with sm.steer(rows=[[c.intervention(clean_acts[c.site])] for c in chunk], label=f"patch {plan.kind} x{rows}"):
            logits = sm.forward(toks, logits_to_keep=tail)
        for i, c in enumerate(chunk):
            values[c.index] = float(_metric_value(metric, logits[i:i + 1].float()))
        bar.update(rows)
    return float(_metric_value(metric, sm.forward(plan.corrupted, logits_to_keep=tail)[0:1].float()))


def _grid_packed(sm: "SteerModel", plan: _Plan, metric: Metric, cells: list[_Cell], clean_acts: dict[str, Tensor],
                 values: Tensor, batch_size: int, tail: int, bar) -> float:
    """Every cell run from the corrupted run's residual at its block and its keys and values before the
    first position it changes. ``batch_size`` cells share a pass in layer-major order, starting at the
    lowest block among them (a cell of a later block recomputes the corrupted run up to its own block),
    packed end to end (:func:`steerkit.reuse.run_packed`), or as rows of one pass when every one of them
    patches from the first position on (:func:`steerkit.reuse.run_from`). Returns the corrupted metric."""
    with sm.record(plan.sites, positions="all") as rec:
        run = run_cached(sm, plan.corrupted)
    corrupted_acts = {s: rec[s][0] for s in plan.sites}
    n_pos = run.n_pos
    want = list(range(n_pos - tail, n_pos))
    for i0 in range(0, len(cells), batch_size):  # layer-major: a pass starts at the lowest block of its cells
        chunk = cells[i0:i0 + batch_size]
        layer = min(c.layer for c in chunk)
        if all(c.first == 0 for c in chunk):  # whole-sequence patches: one row each
            rows = [[c.intervention(clean_acts[c.site])] for c in chunk]
            with sm.steer(rows=rows, label=f"patch {plan.kind} x{len(chunk)}"):
                logits = run_from(sm, layer, run, rows=[0] * len(chunk), keep=tail)
        else:
            pack = Pack.of([c.first for c in chunk], n_pos)
            steering = _packed_patch(pack, chunk, clean_acts, corrupted_acts)
            with sm.steer(steering, label=f"patch {plan.kind} packed x{len(chunk)}"):
                logits = run_packed(sm, layer, run, pack, positions=want)
        for i, c in enumerate(chunk):
            values[c.index] = float(_metric_value(metric, logits[i:i + 1].float()))
        bar.update(len(chunk))
    return float(_metric_value(metric, run.logits[0:1, n_pos - tail:].float()))


def _packed_patch(pack: Pack, cells: list[_Cell], clean: dict[str, Tensor], corrupted: dict[str, Tensor]
                  ) -> list[Intervention]:
    """Patches of the packed run writing every cell's clean values at its own segment's positions, one per
    site. Where a cell patches some heads or neurons only, the others are written with the corrupted
    run's values, which the packed run computes there anyway (nothing before the patch differs from the
    corrupted run), so the cells of a site share one position spec."""
    qpos = pack.positions()
    by_site: dict[str, tuple[Tensor, list[int]]] = {}
    for i, c in enumerate(cells):
        if c.site not in by_site:
            cor = corrupted[c.site].to(clean[c.site])
            by_site[c.site] = (torch.cat([cor, cor[qpos.to(cor.device)]], 0), [])
        packed, at = by_site[c.site]
        src = clean[c.site]
        for p in range(pack.starts[i], pack.n_pos) if c.positions is None else c.positions:
            k = pack.index(i, p)
            if c.heads is not None:
                packed[k, list(c.heads)] = src[p, list(c.heads)]
            elif c.neurons is not None:
                packed[k, ..., list(c.neurons)] = src[p, ..., list(c.neurons)]
            else:
                packed[k] = src[p]
            at.append(k)
    return [Intervention.patch(site, packed, positions=at) for site, (packed, at) in by_site.items()]


def attribution_patching(sm: "SteerModel", clean: Prompt, corrupted: Prompt, metric: Metric, hook: str = "resid_pre",
                         *, layers: Optional[Sequence[int]] = None, positions: Optional[Sequence[int]] = None,
                         heads: Optional[Sequence[int]] = None, neurons: Optional[Sequence[int]] = None,
                         batch_size: int = 32, progress: bool = True, chat: bool = False) -> PatchingResult:
    """The linear approximation of :func:`activation_patching`'s grid from two forward passes and one
    backward pass: ``values[site] = ((clean - corrupted) * d metric / d activation).sum(features)`` at
    the corrupted run (summed over positions for ``hook="z"`` and for ``neurons``), i.e. the predicted
    CHANGE of the metric (add ``corrupted_metric`` to compare with activation patching's values).

    Same arguments as :func:`activation_patching` (``batch_size`` is accepted and unused: one backward
    pass covers every site). The gradient comes from ``sm.forward(tokens, grad=True)`` with a zero
    offset ``Intervention.apply(site, lambda h: h + delta)`` at each site (``torch.autograd.grad`` of
    the metric with respect to the offsets; the model's parameters get no ``.grad``).

    The same grid as :func:`activation_patching`'s example; the approximation is close late in the model,
    where the metric is nearly linear in the residual stream.

    Examples:
        >>> from steerkit.probes import attribution_patching, logit_diff_metric
        >>> clean = "When Mary and John went to the store, John gave a drink to"
        >>> corrupted = "When Mary and John went to the store, Mary gave a drink to"
        >>> res = attribution_patching(sm, clean, corrupted, logit_diff_metric(sm, " Mary", " John"),
        ...                            layers=[0, 12, 24], positions=[9, -1], progress=False)
        >>> res.method, round(float(res.normalized().values[2, 1]), 1)
        ('attribution', 1.0)
    """
    _check_batch_size(batch_size)
    plan = _plan(sm, clean, corrupted, hook, layers, positions, heads, neurons, chat)
    clean_acts, clean_metric = _record_clean(sm, plan, metric)
    deltas: dict[str, Tensor] = {}
    corr: dict[str, Tensor] = {}

    def offset(site: str, delta: Tensor):
        def fn(h: Tensor) -> Tensor:
            corr[site] = h.detach()[0].clone()
            return h + delta.to(h.dtype)
        return fn

    steering = []
    for site in plan.sites:
        deltas[site] = torch.zeros(clean_acts[site].shape, dtype=torch.float32, device=sm.device, requires_grad=True)
        steering.append(Intervention.apply(site, offset(site, deltas[site])))
    bar = tqdm(total=2, desc=f"attribution {hook}", disable=not progress, leave=False)
    with torch.enable_grad():
        with sm.steer(steering, label=f"attribution {hook}"):
            logits = sm.forward(plan.corrupted, grad=True)
        bar.update(1)
        m = _metric_value(metric, logits[0:1].float(), grad=True)
        if not m.requires_grad:
            raise InputError("expected the metric to depend on the logits (a tensor with a gradient), found a "
                             "constant; compute it from the logits with torch operations")
        # only the offsets' gradients: nothing accumulates in the model's parameters' .grad
        grads = dict(zip(plan.sites, torch.autograd.grad(m, [deltas[s] for s in plan.sites], allow_unused=True)))
    bar.update(1)
    bar.close()
    corrupted_metric = float(m.detach())
    values = torch.zeros(plan.shape, dtype=torch.float32)
    for li, site in enumerate(plan.sites):
        g = grads[site]
        if g is None or site not in corr:
            raise InputError(f"expected a gradient at {site!r}, found none; the metric does not depend on this site")
        a = ((clean_acts[site].to(g) - corr[site].to(g)) * g).double().cpu()  # [pos, ...features]
        if plan.kind == "attn.hook_z":
            a = a.sum(-1)  # [pos, heads]
            if len(plan.shape) == 2:
                values[li] = a.sum(0)[plan.heads].float()
            else:
                values[li] = a[plan.positions][:, plan.heads].float()
        elif plan.neurons is not None:
            values[li] = a.sum(0)[plan.neurons].float()
        else:
            values[li] = a.sum(-1)[plan.positions].float()
    return PatchingResult(values=values, hook=hook, method="attribution", layers=plan.layers,
                          positions=plan.positions, heads=plan.heads, tokens=plan.tokens, clean_metric=clean_metric,
                          corrupted_metric=corrupted_metric, neurons=plan.neurons)
