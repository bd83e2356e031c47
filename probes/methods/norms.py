"""Residual norm growth and attention drift (Eldenk et al.'s diagnostic).

* :func:`norm_profile` records the output of every block (``blocks.{l}.hook_resid_post``) at every
  real prompt token and returns a :class:`NormProfile`: per layer the mean and std of ``||h||`` over
  tokens, the same without the first token (the attention sink, whose norm is often an outlier),
  and the growth ratio between consecutive layers.
* :func:`attention_drift` generates greedily, then re-reads prompt + generated tokens in one
  teacher-forced pass that records ``blocks.{l}.attn.hook_pattern`` and ``hook_resid_post`` of every
  layer (causal attention makes query row ``q`` of that pass the attention of the generation step at
  position ``q``, to float rounding). Per layer and generation step it
  returns an :class:`AttentionDrift`: the attention mass (mean over heads and prompts) on the first
  real token (the sink), on the ``window`` most recent tokens, on the rest of the prompt and on
  older generated tokens (the four sum to one; a key counts once, in that order of priority), and
  the residual norm at the newest token.
* :func:`norm_chain` re-applies the model's blocks after the last one (``passes`` times through the
  whole stack: the last block's output enters block 0 again, :func:`steerkit.reuse.run_from`, with the
  real pass's mask and positions), recording every block's output through the hook manager: norm growth with
  depth beyond the model's own depth. A :class:`NormChain`.

All three results have ``to_dict()`` / ``to_json()`` and ``plot()`` (plotly figures).
:func:`run` (``run(sm, NormsConfig(...))``, ``steerkit norms``) computes the three on one prompt set
as a :class:`NormsResult`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from steerkit.errors import InputError
from steerkit.hooks.names import resid_post
from steerkit.reuse import run_cached, run_from

from ..plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def _prompt_list(prompts) -> list[str]:
    """``prompts`` as a non-empty list (a single string is one prompt)."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise InputError("expected at least one prompt, found none")
    return prompts


@dataclass
class NormProfile:
    """Per-layer residual norms (``blocks.{l}.hook_resid_post``) over every real prompt token, with and
    without each prompt's first token (the attention sink), from :func:`norm_profile`.

    Examples:
        >>> from steerkit.probes.methods.norms import norm_profile
        >>> prof = norm_profile(tiny, ["Hello there", "How are you?"])
        >>> prof.n_layers, prof.growth.shape, sorted(prof.to_json())[:3], type(prof.plot()).__name__
        (4, (3,), ['first', 'growth', 'mean'], 'Figure')
    """

    mean: np.ndarray  # [n_layers] mean ||h_l|| over all real prompt tokens
    std: np.ndarray  # [n_layers] its spread
    mean_no_first: np.ndarray  # [n_layers] without each prompt's first token
    first: np.ndarray  # [n_layers] mean norm at the first token
    n_tokens: int
    model_name: str = ""

    @property
    def n_layers(self) -> int:
        return int(len(self.mean))

    @property
    def spread(self) -> np.ndarray:
        return self.std

    @property
    def growth(self) -> np.ndarray:
        """``mean[l] / mean[l-1]`` for l >= 1 (length n_layers - 1)."""
        return self.mean[1:] / np.maximum(self.mean[:-1], 1e-12)

    def to_dict(self) -> dict:
        def f(a):
            return [float(x) for x in a]
        return {"model": self.model_name, "n_tokens": self.n_tokens, "mean": f(self.mean), "std": f(self.std),
                "mean_no_first": f(self.mean_no_first), "first": f(self.first), "growth": f(self.growth)}

    to_json = to_dict

    def plot(self, title: str | None = None):
        """A plotly ``Figure`` of the per-layer norms, log scale (:func:`steerkit.probes.plots.norms.profile_figure`)."""
        with plotly_required():
            from ..plots import norms as figures
        return figures.profile_figure(self, title)


def norm_profile(sm: "SteerModel", prompts: Sequence[str], *, batch_size: int = 16, chat: bool = True) -> NormProfile:
    """Per-layer residual norms of ``prompts`` on ``sm``.

    The default model's residual norm grows with depth, and its first token -- the attention sink -- carries
    a far larger norm than the others.

    Examples:
        >>> from steerkit.probes.methods.norms import norm_profile
        >>> prof = norm_profile(sm, ["What is the capital of France?", "List three prime numbers."])
        >>> bool(prof.mean[-1] > prof.mean[0]), bool(prof.first[15] > 5 * prof.mean_no_first[15])
        (True, True)
    """
    prompts = _prompt_list(prompts)
    names = resid_post(range(sm.n_layers))
    alls, firsts, rests = [[] for _ in names], [[] for _ in names], [[] for _ in names]
    for i in range(0, len(prompts), batch_size):
        with sm.record(names, positions="prompt") as cache:
            sm.forward(list(prompts[i:i + batch_size]), chat=chat)
        for j, n in enumerate(names):
            x, lens = cache[n].float(), cache.lengths(n)
            norms = x.norm(dim=-1)
            for r in range(x.shape[0]):
                v = norms[r, : int(lens[r])]
                alls[j].append(v)
                firsts[j].append(v[:1])
                rests[j].append(v[1:])
    def cat(ls):
        return torch.cat(ls) if ls else torch.zeros(0)
    A = [cat(a) for a in alls]
    R = [cat(a) for a in rests]
    F = [cat(a) for a in firsts]
    def mean_of(t):
        return float(t.mean()) if t.numel() else float("nan")
    return NormProfile(mean=np.array([mean_of(a) for a in A]),
                       std=np.array([float(a.std()) if a.numel() > 1 else 0.0 for a in A]),
                       mean_no_first=np.array([mean_of(a) for a in R]), first=np.array([mean_of(a) for a in F]),
                       n_tokens=int(A[0].numel()), model_name=getattr(sm, "name", ""))


# --------------------------------------------------------------------------- attention drift
@dataclass
class AttentionDrift:
    """Attention mass and residual norm per layer and generation step (step 0: the last prompt
    token, which produces the first new token; step s: the s-th generated token fed back).

    Examples:
        >>> from steerkit.probes.methods.norms import attention_drift
        >>> drift = attention_drift(tiny, ["Hello there"], max_new_tokens=3)
        >>> total = drift.sink + drift.recent + drift.prompt + drift.generated  # the mass adds up to one
        >>> drift.sink.shape, bool(np.allclose(total, 1, atol=1e-4))
        ((4, 3), True)
    """

    sink: np.ndarray  # [n_layers, n_steps] mass on the first real token
    recent: np.ndarray  # [n_layers, n_steps] mass on the `window` most recent tokens (query included)
    prompt: np.ndarray  # [n_layers, n_steps] mass on the other prompt tokens
    generated: np.ndarray  # [n_layers, n_steps] mass on older generated tokens
    norm: np.ndarray  # [n_layers, n_steps] mean ||h_l|| (block output) at the newest token
    window: int
    n_prompts: int
    rows_per_step: np.ndarray  # [n_steps] prompts still generating at each step
    model_name: str = ""

    @property
    def n_layers(self) -> int:
        return int(self.sink.shape[0])

    @property
    def n_steps(self) -> int:
        return int(self.sink.shape[1])

    def to_dict(self) -> dict:
        def f(a):
            return [[float(x) for x in row] for row in a]
        return {"model": self.model_name, "window": self.window, "n_prompts": self.n_prompts,
                "rows_per_step": [int(x) for x in self.rows_per_step], "sink": f(self.sink),
                "recent": f(self.recent), "prompt": f(self.prompt), "generated": f(self.generated),
                "norm": f(self.norm)}

    to_json = to_dict

    def plot(self, layers: Optional[Sequence[int]] = None, title: str | None = None):
        """A plotly ``Figure``: sink / prompt / recent / generated mass per step for a few layers (top),
        and the sink mass and the newest token's norm as layer x step heatmaps (bottom)
        (:func:`steerkit.probes.plots.norms.drift_figure`)."""
        with plotly_required():
            from ..plots import norms as figures
        return figures.drift_figure(self, layers, title)


@torch.inference_mode()
def attention_drift(sm: "SteerModel", prompts: Sequence[str], *, max_new_tokens: int = 32, window: int = 4,
                    chat: bool = True, batch_size: int = 8) -> AttentionDrift:
    """Attention mass on sink / prompt / recent / older generated tokens and the residual norm at the
    newest token, per layer and greedy generation step (see the module docstring).

    Examples:
        >>> from steerkit.probes.methods.norms import attention_drift
        >>> drift = attention_drift(tiny, ["Hello there", "Good night"], max_new_tokens=4, window=2)
        >>> drift.norm.shape, drift.n_prompts, drift.window, type(drift.plot()).__name__
        ((4, 4), 2, 2, 'Figure')
    """
    prompts = _prompt_list(prompts)
    if window < 1:
        raise InputError(f"expected a recent-token window >= 1, found {window}")
    L, S = sm.n_layers, max_new_tokens
    acc = {k: np.zeros((L, S)) for k in ("sink", "recent", "prompt", "generated", "norm")}
    count = np.zeros(S)
    names = resid_post(range(L))
    patterns = [f"blocks.{l}.attn.hook_pattern" for l in range(L)]
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        toks = sm.tokenize(chunk, chat=chat)
        gen = sm.generate(toks, max_new_tokens=max_new_tokens, return_tokens=True)
        rows = [toks.input_ids[b][toks.attention_mask[b].bool()].tolist() for b in range(len(chunk))]
        full = sm.pad([r + g for r, g in zip(rows, gen)])
        T = int(full.input_ids.shape[1])
        with sm.record(names + patterns, positions="all") as cache:
            sm.forward(full)
        for b in range(len(chunk)):
            P, g = len(rows[b]), len(gen[b])
            o = T - P - g  # left padding
            steps = min(g, S)  # step s: query at o + P - 1 + s
            if steps == 0:
                continue
            q = torch.arange(steps) + o + P - 1
            k = torch.arange(T)
            cat = torch.full((steps, T), -1, dtype=torch.long)  # 0 sink 1 recent 2 prompt 3 generated
            real = (k[None, :] >= o) & (k[None, :] <= q[:, None])
            cat[real & (k[None, :] >= o + P)] = 3
            cat[real & (k[None, :] < o + P)] = 2
            cat[real & (k[None, :] > q[:, None] - window)] = 1
            cat[:, o] = 0
            for l in range(L):
                # queries: the row's real tokens in order (query j at absolute position o + j); keys: absolute
                a = cache[patterns[l]][b].float().mean(0)[q - o]  # [steps, T], mean over heads
                for c, key in enumerate(("sink", "recent", "prompt", "generated")):
                    acc[key][l, :steps] += (a * (cat == c)).sum(-1).numpy()
                h = cache[names[l]][b]  # [n_real, d]: real tokens in order
                acc["norm"][l, :steps] += h[P - 1:P - 1 + steps].float().norm(dim=-1).numpy()
            count[:steps] += 1
    keep = count > 0
    mean = {k: v[:, keep] / count[keep] for k, v in acc.items()}
    return AttentionDrift(mean["sink"], mean["recent"], mean["prompt"], mean["generated"], mean["norm"], window,
                          len(prompts), count[keep].astype(int), getattr(sm, "name", ""))


# --------------------------------------------------------------------------- re-applied blocks
@dataclass
class NormChain:
    """Mean residual norm after every block application: ``passes`` x ``n_layers`` applications,
    the first pass being the model's own forward.

    Examples:
        >>> from steerkit.probes.methods.norms import norm_chain
        >>> chain = norm_chain(tiny, ["Hello there"], passes=2)
        >>> chain.norms.shape, chain.growth_per_pass.shape, type(chain.plot()).__name__
        ((8,), (1,), 'Figure')
    """

    norms: np.ndarray  # [passes * n_layers] mean ||h|| over real tokens without the first one
    first: np.ndarray  # [passes * n_layers] mean ||h|| at the first (sink) token
    n_layers: int
    passes: int
    model_name: str = ""

    @property
    def growth_per_pass(self) -> np.ndarray:
        """Norm at the end of each pass over the norm at the end of the previous one."""
        ends = self.norms[self.n_layers - 1::self.n_layers]
        return ends[1:] / np.maximum(ends[:-1], 1e-12)

    def to_dict(self) -> dict:
        def f(a):
            return [float(x) for x in a]
        return {"model": self.model_name, "n_layers": self.n_layers, "passes": self.passes,
                "norms": f(self.norms), "first": f(self.first), "growth_per_pass": f(self.growth_per_pass)}

    to_json = to_dict

    def plot(self, title: str | None = None):
        """A plotly ``Figure``: the norm along the re-applied blocks, each pass's start marked
        (:func:`steerkit.probes.plots.norms.chain_figure`)."""
        with plotly_required():
            from ..plots import norms as figures
        return figures.chain_figure(self, title)


@torch.inference_mode()
def norm_chain(sm: "SteerModel", prompts: Sequence[str], *, passes: int = 3, chat: bool = True) -> NormChain:
    """Run the prompts once, then push the last block's output through all blocks ``passes - 1`` more
    times, each block called with the arguments it got in the real pass (see the module docstring).

    The first pass is the model's own forward: its norms are the norm profile's.

    Examples:
        >>> from steerkit.probes.methods.norms import norm_chain, norm_profile
        >>> chain = norm_chain(tiny, ["Hello there", "How are you?"], passes=3)
        >>> prof = norm_profile(tiny, ["Hello there", "How are you?"])
        >>> len(chain.norms), bool(np.allclose(chain.norms[:4], prof.mean_no_first, rtol=1e-4))
        (12, True)
    """
    prompts = _prompt_list(prompts)
    if passes < 1:
        raise InputError(f"expected passes >= 1, found {passes}")
    L = sm.n_layers
    toks = sm.tokenize(prompts, chat=chat)
    real = toks.attention_mask.bool().clone()
    first_idx = real.float().argmax(1)  # left padding: the first real token of each row
    rest = real.clone()
    rest[torch.arange(len(prompts)), first_idx] = False
    outs: list = [None] * L

    def store(layer: int):
        def fn(x, call) -> None:
            outs[layer] = x.detach()
        return fn

    def stats(h):
        n = h.float().norm(dim=-1)
        return float(n[rest].mean()), float(n[torch.arange(len(prompts)), first_idx].mean())

    norms, firsts = [], []
    sites = [(sm.hooks.parse(name), store(l)) for l, name in enumerate(resid_post(range(L)))]
    with sm.hooks.register(sites, label="norm_chain: every block's output"):
        cache = run_cached(sm, toks, keep=1)  # the real pass: the blocks' inputs, keys and values
        for p in range(passes):
            if p:  # the last block's output enters block 0, every block run as in the real pass
                run_from(sm, 0, cache, resid=outs[-1], keep=1)
            if any(o is None for o in outs):
                raise InputError("expected every block to run once in the forward pass, found blocks that did not")
            for l in range(L):
                a, f0 = stats(outs[l])
                norms.append(a)
                firsts.append(f0)
    return NormChain(np.array(norms), np.array(firsts), L, passes, getattr(sm, "name", ""))


# --------------------------------------------------------------------------- the whole method
DEFAULT_PROMPTS = ("What is the capital of France?", "Write a haiku about rain.", "Explain photosynthesis briefly.",
                   "List three prime numbers.", "How do I boil an egg?", "Tell me a joke about cats.")


@dataclass
class NormsConfig:
    """``steerkit norms``: ``prompts`` (default :data:`DEFAULT_PROMPTS`); ``drift_tokens`` greedy tokens
    for the attention drift (0 skips it) with a recent-token ``window``; ``passes`` through the blocks
    for the re-applied-blocks chain (1 skips it).

    Examples:
        >>> from steerkit.probes.methods.norms import NormsConfig
        >>> cfg = NormsConfig(prompts=("Hello there",), drift_tokens=0, passes=1)  # the norm profile only
        >>> cfg.window, len(NormsConfig().prompts or ()), NormsConfig().drift_tokens
        (4, 0, 32)
    """

    prompts: Optional[tuple] = None
    drift_tokens: int = 32
    window: int = 4
    passes: int = 3


@dataclass
class NormsResult:
    """The norm profile, and the re-applied-blocks chain and attention drift when computed.

    Examples:
        >>> from steerkit.probes.methods import norms
        >>> res = norms.run(tiny, norms.NormsConfig(prompts=("Hello there",), drift_tokens=2, passes=2),
        ...                 progress=False)
        >>> list(res.to_json()), len(res.figures()), res.n_prompts
        (['norms', 'chain', 'drift'], 3, 1)
    """

    profile: NormProfile
    n_prompts: int
    chain: Optional[NormChain] = None
    drift: Optional[AttentionDrift] = None

    def to_json(self) -> dict:
        out = {"norms": self.profile.to_dict()}
        if self.chain is not None:
            out["chain"] = self.chain.to_dict()
        if self.drift is not None:
            out["drift"] = self.drift.to_dict()
        return out

    def figures(self) -> list:
        """Every figure: the profile, then the chain and the drift when computed."""
        return [self.profile.plot()] + [x.plot() for x in (self.chain, self.drift) if x is not None]

    def plot(self, title: str | None = None):
        """The norm profile's figure (:meth:`NormProfile.plot`; :meth:`figures` has all of them)."""
        return self.profile.plot(title)


def run(sm: "SteerModel", config: NormsConfig | None = None, *, progress: bool = True) -> NormsResult:
    """Norm profile, re-applied-blocks chain (``passes > 1``) and attention drift (``drift_tokens > 0``).

    Examples:
        >>> from steerkit.probes.methods import norms
        >>> res = norms.run(tiny, norms.NormsConfig(drift_tokens=0, passes=1), progress=False)
        >>> res.n_prompts, res.chain is None, res.drift is None, res.profile.n_layers
        (6, True, True, 4)
    """
    cfg = config or NormsConfig()
    prompts = _prompt_list(cfg.prompts if cfg.prompts is not None else DEFAULT_PROMPTS)
    steps = 1 + (cfg.passes > 1) + (cfg.drift_tokens > 0)
    with tqdm(total=steps, desc="norms", file=sys.stderr, disable=not progress) as bar:
        prof = norm_profile(sm, prompts)
        bar.update(1)
        chain = drift = None
        if cfg.passes > 1:
            chain = norm_chain(sm, prompts, passes=cfg.passes)
            bar.update(1)
        if cfg.drift_tokens > 0:
            drift = attention_drift(sm, prompts, max_new_tokens=cfg.drift_tokens, window=cfg.window)
            bar.update(1)
    return NormsResult(prof, len(prompts), chain, drift)
