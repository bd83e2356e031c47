"""Result objects and the computations behind the explorer's pages.

Everything here is plain Python over a :class:`steerkit.SteerModel`: the app's callbacks call
these functions, and so can a notebook. Each result is a dataclass that the figure functions in
:mod:`steerkit.apps.figures` turn into Plotly figures.

* :func:`divergence_profile` -> :class:`DivergenceProfile`: per layer, the relative divergence
  ``||h_l(a) - h_l(b)|| / ||h_l(a)||`` and the cosine of ``h_l(a)``, ``h_l(b)`` at the last prompt
  token, for every pair, plus the logit-lens top tokens of the mean difference at each layer.
* :func:`temporal_pairs`, :func:`refusal_pairs`: the built-in contrasts.
* :func:`steer_compare` -> :class:`SteerResult`: baseline and steered generations of one prompt in
  one batch (streamable), each token with its projection on the steering direction.
* :func:`layer_diagnostics` -> :class:`LayerDiagnostics`: residual norm and sink attention per layer.
* :func:`load_sweep` / :func:`find_sweeps` -> :class:`ProbeSweep`; :func:`load_mi` /
  :func:`find_mi` -> :class:`MIProfile`: results written by the probes and methods packages.

Long computations take ``progress(done, total)`` and ``should_stop()`` callables; when
``should_stop()`` turns true they raise :class:`Cancelled` between batches.
"""
from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from steerkit.errors import InputError

MAX_PAIRS = 512
MAX_PROMPT_CHARS = 4000


class Cancelled(Exception):
    """Raised inside a computation when its caller asked it to stop."""


def _tick(progress, should_stop, done, total):
    if should_stop is not None and should_stop():
        raise Cancelled("cancelled")
    if progress is not None:
        progress(done, total)


# ============================================================================ prompt lists
def parse_prompt_text(text: str, what: str = "prompts") -> list[str]:
    """Prompts from pasted or uploaded text: a JSON list, JSON lines, or one prompt per line.

    Never evaluates anything: JSON is parsed with :func:`json.loads`, everything else is plain text.
    """
    if not isinstance(text, str):
        raise InputError(f"expected {what} as text, found {type(text).__name__}")
    s = text.strip()
    if not s:
        return []
    keys = ("prompt", "instruction", "text", "question")

    def pick(o, where):
        if isinstance(o, str):
            return o
        if isinstance(o, dict):
            for k in keys:
                if isinstance(o.get(k), str):
                    return o[k]
        raise InputError(f"expected a string or an object with one of {keys} in {what} at {where}, "
                         f"found {str(o)[:60]!r}")

    out: list[str]
    if s.startswith("["):
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise InputError(f"expected a JSON list of prompts in {what}, found invalid JSON ({e.msg} at line "
                             f"{e.lineno})") from None
        if not isinstance(data, list):
            raise InputError(f"expected a JSON list in {what}, found {type(data).__name__}")
        out = [pick(o, f"item {i}") for i, o in enumerate(data)]
    elif s.startswith("{"):
        out = []
        for i, line in enumerate(s.splitlines()):
            if line.strip():
                try:
                    out.append(pick(json.loads(line), f"line {i + 1}"))
                except json.JSONDecodeError as e:
                    raise InputError(f"expected one JSON object per line in {what}, found invalid JSON on line "
                                     f"{i + 1} ({e.msg})") from None
    else:
        out = [l.strip() for l in s.splitlines() if l.strip()]
    for i, p in enumerate(out):
        if len(p) > MAX_PROMPT_CHARS:
            raise InputError(f"expected prompts of at most {MAX_PROMPT_CHARS} characters in {what}, found "
                             f"{len(p)} in prompt {i + 1}")
    return out


def check_pairs(a: Sequence[str], b: Sequence[str]) -> tuple[list[str], list[str]]:
    """Two prompt lists of equal, non-zero length (at most ``MAX_PAIRS``)."""
    a, b = list(a or []), list(b or [])
    if not a or not b:
        raise InputError(f"expected two non-empty prompt lists, found {len(a)} prompts in A and {len(b)} in B")
    if len(a) != len(b):
        raise InputError(f"expected two lists of equal length (prompt i of A pairs with prompt i of B), "
                         f"found {len(a)} prompts in A and {len(b)} in B")
    if len(a) > MAX_PAIRS:
        raise InputError(f"expected at most {MAX_PAIRS} pairs, found {len(a)}")
    return a, b


_EVENTS = [
    "woke up", "made coffee", "read the news", "took a shower", "walked the dog", "answered emails",
    "went to the market", "cooked lunch", "called my sister", "fixed the bike", "watched a film",
    "wrote a letter", "cleaned the kitchen", "planted tomatoes", "paid the bills", "went for a run",
    "met a friend", "baked bread", "painted the fence", "fell asleep",
]
_FRAMES = [
    "Yesterday I {0}, then I {1}, and after that I {2}. What did I do last?",
    "First I {0}. Next I {1}. Finally I {2}. In what order did things happen?",
    "On Sunday I {0}, later I {1}, and in the evening I {2}. Summarise my day.",
]


def temporal_events(n: int, n_events: int = 3, seed: int = 0) -> list[list[str]]:
    """``n`` ordered event lists of ``n_events`` distinct events (deterministic for a seed)."""
    if n < 1:
        raise InputError(f"expected at least one pair, found n={n}")
    if not 2 <= n_events <= len(_EVENTS):
        raise InputError(f"expected 2..{len(_EVENTS)} events per list, found {n_events}")
    rng = random.Random(seed)
    return [rng.sample(_EVENTS, n_events) for _ in range(n)]


def render_events(events: Sequence[str], frame: int = 0) -> str:
    ev = list(events)
    if len(ev) == 3:
        return _FRAMES[frame % len(_FRAMES)].format(*ev)
    return "I " + ", then I ".join(ev) + ". What did I do last?"


def temporal_pairs(n: int = 8, n_events: int = 3, seed: int = 0) -> tuple[list[str], list[str]]:
    """Temporal reversal pairs: ``a[i]`` tells events in order, ``b[i]`` the same events reversed."""
    evs = temporal_events(n, n_events, seed)
    a = [render_events(e, i) for i, e in enumerate(evs)]
    b = [render_events(list(reversed(e)), i) for i, e in enumerate(evs)]
    return a, b


def refusal_pairs(n: int = 8, split: str = "train") -> tuple[list[str], list[str]]:
    """Harmful (a) vs harmless (b) instructions from the data shipped with steerkit."""
    root = Path(__file__).resolve().parent.parent / "steerkit" / "data" / "refusal"
    try:
        import steerkit
        root = Path(steerkit.__file__).resolve().parent / "data" / "refusal"
    except Exception:  # pragma: no cover
        pass
    def read(kind):
        p = root / f"{kind}_{split}.json"
        if not p.is_file():
            raise InputError(f"expected the shipped prompt list at {p}, found nothing there")
        return [o["instruction"] for o in json.loads(p.read_text(encoding="utf-8"))]
    a, b = read("harmful"), read("harmless")
    n = min(n, len(a), len(b))
    return a[:n], b[:n]


# ============================================================================ model helpers
def _unembed_fn(sm):
    import torch
    norm = sm.adapter.final_norm_module(sm.hf_model)
    unembed = sm.adapter.unembed_module(sm.hf_model)

    @torch.inference_mode()
    def f(v):
        x = torch.as_tensor(v, dtype=sm.dtype, device=sm.device).reshape(1, 1, -1)
        return unembed(norm(x)).reshape(-1).float().cpu()
    return f


def logit_lens(sm, v, k: int = 10) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Top and bottom ``k`` tokens of ``unembed(final_norm(v))`` for a residual-space vector ``v``."""
    logits = _unembed_fn(sm)(v)
    return _top_bottom(sm, logits, k)


def _top_bottom(sm, logits, k):
    import torch
    k = min(k, logits.shape[0])
    top = torch.topk(logits, k)
    bot = torch.topk(-logits, k)
    dec = lambda i: sm.tokenizer.decode([int(i)])
    return ([(dec(i), float(s)) for s, i in zip(top.values, top.indices)],
            [(dec(i), float(-s)) for s, i in zip(bot.values, bot.indices)])


# ============================================================================ divergence profile
@dataclass
class DivergenceProfile:
    """Per-layer divergence between paired prompts, at the last prompt token.

    ``rel[i, l] = ||h_l(a_i) - h_l(b_i)|| / ||h_l(a_i)||`` and ``cos[i, l] = cos(h_l(a_i), h_l(b_i))``
    (``h_l`` = ``blocks.{l}.hook_resid_post``). ``mean_diff[l]`` is the mean of ``h_l(a) - h_l(b)``
    over pairs; ``lens_top[l]`` / ``lens_bottom[l]`` its logit-lens top and bottom tokens.
    """

    layers: list[int]
    rel: np.ndarray
    cos: np.ndarray
    prompts_a: list[str] = field(default_factory=list)
    prompts_b: list[str] = field(default_factory=list)
    mean_diff: Optional[np.ndarray] = None
    lens_top: list = field(default_factory=list)
    lens_bottom: list = field(default_factory=list)
    model_name: str = ""
    contrast: str = "custom"
    seconds: float = 0.0

    def __post_init__(self):
        self.rel = np.asarray(self.rel, dtype=np.float64)
        self.cos = np.asarray(self.cos, dtype=np.float64)
        if self.rel.ndim != 2 or self.rel.shape != self.cos.shape or self.rel.shape[1] != len(self.layers):
            raise InputError(f"expected rel and cos of shape [n_pairs, {len(self.layers)}], found "
                             f"{self.rel.shape} and {self.cos.shape}")

    @property
    def n_pairs(self) -> int:
        return int(self.rel.shape[0])

    @property
    def rel_mean(self) -> np.ndarray:
        return self.rel.mean(0)

    @property
    def rel_std(self) -> np.ndarray:
        return self.rel.std(0)

    @property
    def cos_mean(self) -> np.ndarray:
        return self.cos.mean(0)

    @property
    def cos_std(self) -> np.ndarray:
        return self.cos.std(0)

    @property
    def peak_index(self) -> int:
        return int(np.argmax(self.rel_mean))

    @property
    def peak_layer(self) -> int:
        """The layer where the mean relative divergence is largest."""
        return int(self.layers[self.peak_index])

    def at_layer(self, layer: int) -> dict:
        """Per-pair values at one layer: ``{"rel": [...], "cos": [...], "a": [...], "b": [...]}``."""
        if layer not in self.layers:
            raise InputError(f"expected a layer in {self.layers[0]}..{self.layers[-1]}, found {layer}")
        j = self.layers.index(layer)
        return {"layer": layer, "rel": self.rel[:, j].tolist(), "cos": self.cos[:, j].tolist(),
                "a": list(self.prompts_a), "b": list(self.prompts_b)}

    def summary(self) -> dict:
        return {"model": self.model_name, "contrast": self.contrast, "n_pairs": self.n_pairs,
                "n_layers": len(self.layers), "peak_layer": self.peak_layer,
                "peak_rel": float(self.rel_mean[self.peak_index]), "seconds": round(self.seconds, 2)}


def divergence_profile(sm, prompts_a: Sequence[str], prompts_b: Sequence[str], *, batch_size: int = 8,
                       layers: Optional[Sequence[int]] = None, lens_k: int = 10, contrast: str = "custom",
                       edit_a: Optional[Callable] = None, progress=None, should_stop=None) -> DivergenceProfile:
    """The divergence profile of paired prompts on ``sm`` (see :class:`DivergenceProfile`).

    ``edit_a``: a context-manager factory applied while recording the A side (for a
    steered-vs-unsteered contrast, A and B are then the same prompts).
    """
    import time

    import torch

    import steerkit
    t0 = time.perf_counter()
    a, b = check_pairs(prompts_a, prompts_b)
    layers = list(range(sm.n_layers)) if layers is None else [int(l) for l in layers]
    hooks = steerkit.resid_post(layers)
    n = len(a)
    batches = [(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    total = 2 * len(batches)
    ha, hb = [], []
    done = 0
    _tick(progress, should_stop, 0, total)
    for side, prompts, out in (("a", a, ha), ("b", b, hb)):
        for i, j in batches:
            ctx = edit_a() if (side == "a" and edit_a is not None) else _null()
            with ctx, sm.record(hooks, positions="last") as cache:
                sm.forward(prompts[i:j])
            out.append(cache.stack().float().cpu())  # [L, batch, d]
            done += 1
            _tick(progress, should_stop, done, total)
    HA = torch.cat(ha, 1)
    HB = torch.cat(hb, 1)
    diff = HA - HB
    rel = (diff.norm(dim=-1) / HA.norm(dim=-1).clamp_min(1e-12)).T.numpy()  # [n, L]
    cos = torch.nn.functional.cosine_similarity(HA, HB, dim=-1).T.numpy()
    mean_diff = diff.mean(1)  # [L, d]
    lens_top, lens_bottom = [], []
    if lens_k:
        f = _unembed_fn(sm)
        for l in range(len(layers)):
            t, bo = _top_bottom(sm, f(mean_diff[l]), lens_k)
            lens_top.append(t)
            lens_bottom.append(bo)
    return DivergenceProfile(layers=layers, rel=rel, cos=cos, prompts_a=a, prompts_b=b,
                             mean_diff=mean_diff.numpy(), lens_top=lens_top, lens_bottom=lens_bottom,
                             model_name=sm.name, contrast=contrast, seconds=time.perf_counter() - t0)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ============================================================================ steering
@dataclass
class SteerResult:
    """Baseline and steered continuations of one prompt; per token, its projection on the direction.

    ``*_proj[k]`` is the projection on the unit direction of the residual (at ``proj_layer``, after
    the edit) at the position that produced token ``k``.
    """

    prompt: str
    baseline_tokens: list[str]
    steered_tokens: list[str]
    baseline_proj: list[float]
    steered_proj: list[float]
    layers: list[int]
    operation: str
    strength: float
    proj_layer: int
    label: str = ""

    @property
    def baseline_text(self) -> str:
        return "".join(self.baseline_tokens)

    @property
    def steered_text(self) -> str:
        return "".join(self.steered_tokens)


OPERATIONS = ("add", "ablate", "clamp")


def parse_layers(spec, n_layers: int) -> list[int]:
    """``"12"``, ``"10-14"``, ``"3,5,9"`` (or a list of ints) -> sorted layers below ``n_layers``."""
    if isinstance(spec, (list, tuple)):
        out = [int(x) for x in spec]
    else:
        s = str(spec or "").strip()
        if not s:
            raise InputError("expected layers like '12', '10-14' or '3,5,9', found nothing")
        out = []
        for part in s.split(","):
            part = part.strip()
            try:
                if "-" in part:
                    x, y = part.split("-", 1)
                    out += list(range(int(x), int(y) + 1))
                else:
                    out.append(int(part))
            except ValueError:
                raise InputError(f"expected layers like '12', '10-14' or '3,5,9', found {s[:40]!r}") from None
    bad = [l for l in out if not 0 <= l < n_layers]
    if bad or not out:
        raise InputError(f"expected layers in 0..{n_layers - 1}, found {bad or out}")
    return sorted(set(out))


def steer_compare(sm, prompt: str, direction, layers: Sequence[int], *, operation: str = "add",
                  strength: float = 4.0, max_new_tokens: int = 32, stream=None, should_stop=None,
                  label: str = "") -> SteerResult:
    """Generate ``prompt`` unsteered (row 0) and steered (row 1) in one greedy batch.

    ``direction``: ``[d_model]`` (one for every layer) or ``{layer: [d_model]}``. ``operation``:
    ``add`` (``h + strength * v``), ``ablate`` (remove the component along ``v``; strength unused)
    or ``clamp`` (the projection on the unit direction becomes ``strength``). ``stream(row, text)``
    is called as tokens arrive.
    """
    import torch

    if operation not in OPERATIONS:
        raise InputError(f"expected operation in {OPERATIONS}, found {operation!r}")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("expected a prompt, found an empty one")
    if not math.isfinite(float(strength)):
        raise InputError(f"expected a finite strength, found {strength}")
    layers = parse_layers(layers, sm.n_layers)
    if isinstance(direction, dict):
        dirs = {int(l): direction[l] for l in direction}
        missing = [l for l in layers if l not in dirs]
        if missing and len(dirs) == 1:
            v = next(iter(dirs.values()))
            dirs = {l: v for l in layers}
        elif missing:
            raise InputError(f"expected a direction for every chosen layer, found none for {missing} "
                             f"(the artifact has layers {sorted(dirs)})")
    else:
        dirs = {l: direction for l in layers}
    vecs = {}
    for l in layers:
        v = torch.as_tensor(np.asarray(dirs[l], dtype=np.float32)).reshape(-1)
        if v.shape[0] != sm.d_model:
            raise InputError(f"expected a direction of d_model={sm.d_model} (this model), found {v.shape[0]}; "
                             "the vector belongs to another model")
        if not torch.isfinite(v).all() or float(v.norm()) == 0:
            raise InputError(f"expected a finite, non-zero direction at layer {l}")
        vecs[l] = v.to(sm.device, sm.dtype)
    proj_layer = layers[-1]
    unit = vecs[proj_layer] / vecs[proj_layer].norm()
    last_proj = [0.0, 0.0]
    s = float(strength)

    def make_fn(v, capture):
        u = v / v.norm()

        def fn(x):
            y = x.clone()
            r = y[1]
            if operation == "add":
                r = r + s * v
            elif operation == "ablate":
                r = r - (r @ u).unsqueeze(-1) * u
            else:
                r = r + (s - r @ u).unsqueeze(-1) * u
            y[1] = r
            if capture:
                p = (y[:, -1] @ unit).float().cpu().tolist()
                last_proj[0], last_proj[1] = p[0], p[1]
            return y
        return fn

    toks = [[], []]
    projs = [[], []]
    texts = ["", ""]

    def on_token(row, token_id, text):
        if should_stop is not None and should_stop():
            raise Cancelled("cancelled")
        toks[row].append(sm.tokenizer.decode([int(token_id)]))
        projs[row].append(last_proj[row])
        texts[row] = text
        if stream is not None:
            stream(row, text)

    per_hook = {f"blocks.{l}.hook_resid_post": make_fn(vecs[l], l == proj_layer) for l in layers}
    with sm.edit_op("fn", per_hook):
        sm.generate([prompt, prompt], max_new_tokens=int(max_new_tokens), stream=on_token)
    return SteerResult(prompt=prompt, baseline_tokens=toks[0], steered_tokens=toks[1], baseline_proj=projs[0],
                       steered_proj=projs[1], layers=layers, operation=operation, strength=s,
                       proj_layer=proj_layer, label=label)


# ============================================================================ diagnostics
@dataclass
class LayerDiagnostics:
    """Residual norm (mean over positions >= 1, and at position 0) and sink attention per layer.

    ``sink[l]`` is the attention mass on position 0, averaged over heads, query positions >= 1 and
    prompts; ``sink_heads[l, h]`` the same per head.
    """

    layers: list[int]
    resid_norm: np.ndarray
    resid_norm_pos0: np.ndarray
    sink: Optional[np.ndarray] = None
    sink_heads: Optional[np.ndarray] = None
    model_name: str = ""
    n_prompts: int = 0
    note: str = ""


def layer_diagnostics(sm, prompts: Sequence[str], *, progress=None, should_stop=None) -> LayerDiagnostics:
    import torch

    import steerkit
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise InputError("expected at least one prompt, found none")
    if len(prompts) > 64:
        raise InputError(f"expected at most 64 prompts for diagnostics, found {len(prompts)}")
    L = sm.n_layers
    hooks = steerkit.resid_post(range(L))
    norms, norms0, sinks, sink_heads = [], [], [], []
    total = 2 * len(prompts)
    note = ""
    _tick(progress, should_stop, 0, total)
    for i, p in enumerate(prompts):
        with sm.record(hooks, positions="all") as cache:
            sm.forward([p])
        h = cache.stack()[:, 0].float()  # [L, pos, d]
        n = h.norm(dim=-1)
        norms0.append(n[:, 0])
        norms.append(n[:, 1:].mean(1) if n.shape[1] > 1 else n[:, 0])
        _tick(progress, should_stop, 2 * i + 1, total)
        att = _attentions(sm, p)
        if att is None:
            note = "sink attention unavailable: this model does not return attention weights"
        else:
            a0 = torch.stack([a[0, :, 1:, 0].float().mean(-1) if a.shape[-2] > 1 else a[0, :, :, 0].float().mean(-1)
                              for a in att])  # [L, H]
            sink_heads.append(a0)
        _tick(progress, should_stop, 2 * i + 2, total)
    res = LayerDiagnostics(layers=list(range(L)), resid_norm=torch.stack(norms).mean(0).numpy(),
                           resid_norm_pos0=torch.stack(norms0).mean(0).numpy(), model_name=sm.name,
                           n_prompts=len(prompts), note=note)
    if sink_heads:
        sh = torch.stack(sink_heads).mean(0).numpy()
        res.sink_heads = sh
        res.sink = sh.mean(1)
    return res


def _attentions(sm, prompt):
    """Attention weights of every layer for one prompt (eager attention, switched back afterwards)."""
    import torch
    hf = sm.hf_model
    toks = sm.tokenize([prompt])
    cfg = getattr(hf, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    switched = False
    try:
        if before not in (None, "eager") and hasattr(hf, "set_attn_implementation"):
            hf.set_attn_implementation("eager")
            switched = True
        with torch.inference_mode():
            out = hf(input_ids=toks.input_ids, attention_mask=toks.attention_mask, output_attentions=True,
                     use_cache=False)
        att = getattr(out, "attentions", None)
        if not att or any(a is None for a in att):
            return None
        return att
    finally:
        if switched:
            hf.set_attn_implementation(before)


# ============================================================================ saved results
@dataclass
class ProbeSweep:
    """A layer x position AUROC table (with optional confidence intervals) of one probe method."""

    layers: list[int]
    positions: list[str]
    auroc: np.ndarray
    ci_low: Optional[np.ndarray] = None
    ci_high: Optional[np.ndarray] = None
    name: str = ""
    model_name: str = ""
    method: str = ""
    #: every method the file holds (the table above is ``method``'s)
    methods: list[str] = field(default_factory=list)

    def best_per_layer(self) -> np.ndarray:
        return np.nanmax(self.auroc, axis=1)


MAX_RESULT_BYTES = 16 << 20

#: column names accepted for the confidence interval: steerkit.probes' ``auroc_ci_*`` and short forms
_CI_KEYS = (("auroc_ci_low", "auroc_ci_high"), ("ci_low", "ci_high"))


def _ci(r):
    for lo, hi in _CI_KEYS:
        if r.get(lo) not in (None, "") and r.get(hi) not in (None, ""):
            return float(r[lo]), float(r[hi])
    return None


def _site(r) -> str:
    """The hook site of a row without its layer: ``blocks.3.hook_resid_post`` -> ``hook_resid_post``."""
    h = str(r.get("hook") or "")
    return h.split(".", 2)[2] if h.startswith("blocks.") and h.count(".") >= 2 else h


def _grid(rows):
    sites = {_site(r) for r in rows}

    def pos(r):
        p = str(r.get("position", "last"))
        return f"{_site(r)}:{p}" if len(sites) > 1 else p

    layers = sorted({int(r["layer"]) for r in rows})
    positions = []
    for r in rows:
        if pos(r) not in positions:
            positions.append(pos(r))
    A = np.full((len(layers), len(positions)), np.nan)
    lo, hi = A.copy(), A.copy()
    has_ci = False
    for r in rows:
        i, j = layers.index(int(r["layer"])), positions.index(pos(r))
        A[i, j] = float(r["auroc"])
        ci = _ci(r)
        if ci is not None:
            lo[i, j], hi[i, j] = ci
            has_ci = True
    return layers, positions, A, (lo if has_ci else None), (hi if has_ci else None)


def _grid_sweep(obj: dict, name: str, model: str) -> ProbeSweep:
    A = np.asarray(obj["auroc"], dtype=np.float64)
    if A.ndim == 1:
        A = A[:, None]
    layers = [int(x) for x in obj.get("layers", range(A.shape[0]))]
    positions = [str(x) for x in obj.get("positions", range(A.shape[1]))]
    if A.shape != (len(layers), len(positions)):
        raise InputError(f"expected auroc of shape [{len(layers)} layers, {len(positions)} positions] "
                         f"in {name}, found {list(A.shape)}")
    lo = np.asarray(obj["ci_low"], dtype=np.float64).reshape(A.shape) if obj.get("ci_low") is not None else None
    hi = np.asarray(obj["ci_high"], dtype=np.float64).reshape(A.shape) if obj.get("ci_high") is not None else None
    m = str(obj.get("method", ""))
    return ProbeSweep(layers, positions, A, lo, hi, name=obj.get("name", name), model_name=model,
                      method=m, methods=[m] if m else [])


def parse_sweep(text: str, name: str = "sweep", method: Optional[str] = None) -> ProbeSweep:
    """A sweep table, in any of the forms the probes package and people write:

    * ``steerkit.probes``' own JSON (``SweepResult.to_json``: ``{"format": "steerkit.sweep/1", "meta",
      "rows": [{"layer", "hook", "position", "method", "auroc", "auroc_ci_low", "auroc_ci_high", ...}]}``)
      or CSV (``SweepResult.to_csv``);
    * a grid ``{"layers", "positions", "auroc": [[...]], "ci_low", "ci_high"}``;
    * a plain list of rows with ``layer``, ``auroc`` and optionally ``position``, ``ci_low``/``ci_high``.

    A table with several methods gives the grid of ``method`` (default: the method with the best
    mean AUROC); ``ProbeSweep.methods`` lists them all. Several hooks become ``hook:position`` columns."""
    s = text.strip()
    try:
        model = ""
        if s.startswith("{") or s.startswith("["):
            obj = json.loads(s)
            if isinstance(obj, dict):
                meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
                model = str(obj.get("model") or meta.get("model") or meta.get("model_name") or "")
                if "auroc" in obj and isinstance(obj["auroc"], list):
                    return _grid_sweep(obj, name, model)
            rows = obj.get("rows") if isinstance(obj, dict) else obj
            if not isinstance(rows, list) or not rows:
                raise InputError(f"expected sweep rows in {name}, found none")
        else:
            rows = list(csv.DictReader(io.StringIO(s)))
        if not rows or not all(isinstance(r, dict) and "layer" in r and "auroc" in r for r in rows):
            raise InputError(f"expected rows with 'layer' and 'auroc' (and optionally 'position', 'hook', 'method', "
                             f"'auroc_ci_low', 'auroc_ci_high') in {name}")
        methods: list[str] = []
        for r in rows:
            m = str(r.get("method") or "")
            if m not in methods:
                methods.append(m)
        if method is not None and method not in methods:
            raise InputError(f"expected one of the methods {methods} in {name}, found {method!r}")
        if method is None:
            def mean_auroc(m):
                v = [float(r["auroc"]) for r in rows if str(r.get("method") or "") == m]
                v = [x for x in v if not math.isnan(x)]
                return sum(v) / len(v) if v else -1.0
            method = max(methods, key=mean_auroc)
        layers, positions, A, lo, hi = _grid([r for r in rows if str(r.get("method") or "") == method])
        return ProbeSweep(layers, positions, A, lo, hi, name=name, model_name=model, method=method,
                          methods=[m for m in methods if m])
    except InputError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
        raise InputError(f"expected a probe sweep table in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


def _read_small(p: Path) -> str:
    if p.stat().st_size > MAX_RESULT_BYTES:
        raise InputError(f"expected a results file under {MAX_RESULT_BYTES >> 20} MiB, found {p.stat().st_size} bytes in {p}")
    return p.read_text(encoding="utf-8")


def find_sweeps(results_dir) -> list[Path]:
    """Sweep tables under ``results_dir``: ``*sweep*.json`` / ``*sweep*.csv`` (recursively, sorted)."""
    d = Path(results_dir) if results_dir else None
    if d is None or not d.is_dir():
        return []
    return sorted(p for p in d.rglob("*sweep*") if p.suffix in (".json", ".csv") and p.is_file())


def load_sweep(path, method: Optional[str] = None) -> ProbeSweep:
    p = Path(path)
    return parse_sweep(_read_small(p), name=p.stem, method=method)


@dataclass
class MIProfile:
    """Mutual information per generation step, with its peaks and the tokens there."""

    steps: list[int]
    mi: np.ndarray
    tokens: list[str] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    name: str = ""
    layer: Optional[int] = None
    #: what ``mi`` measures, for the axis title (``steerkit.probes.mi`` estimates it with HSIC)
    measure: str = "MI"


def _mi_one(obj: dict, name: str) -> MIProfile:
    mi = np.asarray(obj["mi"], dtype=np.float64).reshape(-1)
    steps = [int(s) for s in obj.get("steps", range(len(mi)))]
    tokens = [str(t) for t in obj.get("tokens", [])]
    if len(steps) != len(mi) or (tokens and len(tokens) != len(mi)):
        raise InputError(f"expected steps/tokens as long as mi ({len(mi)}) in {name}")
    peaks = obj.get("peaks")
    if peaks is None:
        thr = mi.mean() + mi.std()
        peaks = [steps[i] for i in range(len(mi)) if mi[i] > thr and (i == 0 or mi[i] >= mi[i - 1])
                 and (i == len(mi) - 1 or mi[i] >= mi[i + 1])]
    layer = obj.get("layer")
    return MIProfile(steps, mi, tokens, [int(p) for p in peaks], name=str(obj.get("name", name)),
                     layer=None if layer is None else int(layer), measure=str(obj.get("measure", "MI")))


def parse_mi_all(text: str, name: str = "mi") -> list[MIProfile]:
    """Every MI trajectory in a result: one ``{"mi": [...], "steps", "tokens", "peaks", "layer"}``
    object, or the report of ``steerkit mi-peaks --report FILE`` (``{"model", "mi": [one
    such object per question]}``, MI estimated with HSIC)."""
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict) or "mi" not in obj:
            raise InputError(f"expected a JSON object with an 'mi' entry in {name}")
        if isinstance(obj["mi"], list) and obj["mi"] and all(isinstance(t, dict) for t in obj["mi"]):
            out = []
            for i, t in enumerate(obj["mi"]):
                p = _mi_one({**t, "measure": t.get("measure", "HSIC")}, name)
                p.name = f"{name} #{i}" + (f" (layer {p.layer})" if p.layer is not None else "")
                out.append(p)
            return out
        return [_mi_one(obj, name)]
    except InputError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
        raise InputError(f"expected an MI result JSON in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


def parse_mi(text: str, name: str = "mi") -> MIProfile:
    """The first MI trajectory of a result (see :func:`parse_mi_all`)."""
    return parse_mi_all(text, name)[0]


def find_mi(results_dir, limit: int = 200) -> list[Path]:
    """MI results under ``results_dir``: ``*.json`` files (recursively, sorted, at most ``limit``
    looked at) whose top level has an ``mi`` entry -- ``mi_*.json`` or a report of
    ``steerkit mi-peaks --report FILE``."""
    d = Path(results_dir) if results_dir else None
    if d is None or not d.is_dir():
        return []
    out = []
    for p in sorted(d.rglob("*.json"))[:limit]:
        if not p.is_file() or "sweep" in p.name or p.stat().st_size > MAX_RESULT_BYTES:
            continue
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict) and "mi" in obj:
            out.append(p)
    return out


def load_mi_all(path) -> list[MIProfile]:
    p = Path(path)
    return parse_mi_all(_read_small(p), name=p.stem)


def load_mi(path) -> MIProfile:
    return load_mi_all(path)[0]
