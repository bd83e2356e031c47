"""Reading and attributing a sparse autoencoder's latents.

* :func:`feature_report` -- what one latent is, as sae-dashboard and Neuronpedia show it: its
  top-activating contexts over a text set (the token that fires and the tokens around it, with every
  activation), its activation density and histogram, its logit effects (``W_U @ W_dec[latent]``: the
  tokens it pushes up and down, no final norm, as sae-dashboard computes them) and its nearest
  decoder neighbours (cosine of decoder rows). A :class:`FeatureReport` plots (plotly) and renders its
  contexts as HTML with the tokens highlighted.
* :func:`top_latents` -- which latents fire most on one text (peak and mean activation, where they peak).
* :func:`latent_attribution` -- attribution patching over the SAE's latents (Syed et al. 2023, Marks et
  al. 2024): ``(f_clean - f_corrupted) * d metric / d f`` at the corrupted run, with the SAE spliced in
  and its error term kept, summed over positions; checked against activation patching of the top
  latents (each latent set to its clean values at every position, error kept, through
  ``Intervention.patch``): the Pearson r and whether the top latent by attribution is among the top 3
  by patching (:class:`LatentAttribution`).
"""
from __future__ import annotations

import dataclasses
import heapq
import html
import numbers
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from tqdm.auto import tqdm

from steerkit import Intervention
from steerkit.errors import InputError
from steerkit.interventions import latent_indices, sae_weights

from .patching import Metric, Prompt, _metric_value, prompt_tokens
from .plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel


def _site(sae: Any, site: Optional[str]) -> str:
    own = getattr(sae, "site", None)
    if site is None and not isinstance(own, str):
        raise InputError("expected the SAE's site: a stored SAE (steerkit.load_sae) carries it, or pass site=")
    if site is not None and isinstance(own, str) and own != site:
        raise InputError(f"expected the SAE's own site, found the SAE at {own!r} and site={site!r}")
    return site or own


# ----------------------------------------------------------------------------- the report
@dataclasses.dataclass(eq=False)
class FeatureReport:
    """One latent read over a text set (see :func:`feature_report`).

    ``contexts``: the top-activating contexts, best first, each ``{"doc", "position", "value", "tokens",
    "acts", "index"}`` (``index``: the firing token within ``tokens``); ``density``: the share of tokens
    where the latent is active; ``values``: its nonzero activations (for the histogram); ``top_logits`` /
    ``bottom_logits``: ``(token, logit effect)``; ``neighbours``: ``(latent, cosine)`` of decoder rows.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import feature_report
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> rep = feature_report(tiny, SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64)), 3,
        ...                      ["one two", "three four five"], site="blocks.1.hook_resid_post", progress=False)
        >>> rep.latent, rep.n_tokens, rep.contexts_html().startswith("<div"), sorted(rep.to_dict())[:3]  # first tokens not counted
        (3, 3, True, ['bottom_logits', 'contexts', 'density'])
    """

    latent: int
    site: str
    n_tokens: int
    density: float
    values: Tensor
    contexts: list[dict]
    top_logits: list[tuple[str, float]]
    bottom_logits: list[tuple[str, float]]
    neighbours: list[tuple[int, float]]

    def __repr__(self):
        return (f"FeatureReport(latent={self.latent}, site={self.site!r}, density={self.density:.4g}, "
                f"tokens={self.n_tokens}, contexts={len(self.contexts)})")

    def to_dict(self) -> dict:
        """The report as plain JSON-able data (the activations as a list)."""
        d = dataclasses.asdict(self)
        d["values"] = self.values.tolist()
        return d

    def contexts_html(self) -> str:
        """The contexts as HTML, each token shaded by its activation (the firing one outlined)."""
        peak = max((c["value"] for c in self.contexts), default=0.0) or 1.0
        rows = []
        for c in self.contexts:
            spans = []
            for j, (t, a) in enumerate(zip(c["tokens"], c["acts"])):
                alpha = max(0.0, min(1.0, a / peak))
                edge = "outline:1px solid #c00;" if j == c["index"] else ""
                spans.append(f'<span title="{a:.3f}" style="background:rgba(255,120,0,{alpha:.2f});{edge}">'
                             f"{html.escape(t)}</span>")
            rows.append(f"<div><b>{c['value']:.2f}</b> &nbsp;{''.join(spans)}</div>")
        return (f"<div style='font-family:monospace;white-space:pre-wrap'><p>latent {self.latent} at {self.site}: "
                f"density {self.density:.3g}</p>{''.join(rows)}</div>")

    def _repr_html_(self) -> str:
        return self.contexts_html()

    def plot(self, *, title: Optional[str] = None):
        """A plotly figure: the activation histogram, the logit effects (top and bottom tokens) and the
        nearest decoder neighbours (:func:`steerkit.probes.plots.sae.feature_figure`)."""
        with plotly_required():
            from .plots import sae as figures
        return figures.feature_figure(self, title=title)


def _unembedding(sm: "SteerModel") -> Tensor:
    return sm.adapter.unembed_module(sm.hf_model).weight.detach()


def _logit_effects(sm: "SteerModel", row: Tensor, k: int) -> tuple[list, list]:
    eff = _unembedding(sm).float() @ row.to(sm.device).float()
    top, bottom = eff.topk(k), (-eff).topk(k)
    dec = sm.tokenizer.decode
    return ([(dec([int(i)]), float(v)) for v, i in zip(top.values, top.indices)],
            [(dec([int(i)]), -float(v)) for v, i in zip(bottom.values, bottom.indices)])


def _neighbours(W_dec: Tensor, latent: int, k: int) -> list[tuple[int, float]]:
    rows = torch.nn.functional.normalize(W_dec.float(), dim=-1)
    cos = rows @ rows[latent]
    cos[latent] = -2.0
    best = cos.topk(min(k, max(0, rows.shape[0] - 1)))
    return [(int(i), float(v)) for v, i in zip(best.values, best.indices)]


# ----------------------------------------------------------------------------- reading latents over texts
class _Tally:
    """One latent read over texts as they come (the one reading :func:`feature_report` and :func:`feature_contexts`
    share): the ``top`` strongest activations, at most one per text, in a min-heap of ``(value, doc, position)``
    with each kept text's window of ``context`` tokens before and ``after`` tokens after; the tokens counted and
    those where the latent is active; its nonzero activations when ``keep_values``."""

    def __init__(self, top: int, context: int, after: int, keep_values: bool):
        self.top, self.context, self.after = top, context, after
        self.best: list[tuple[float, int, int]] = []
        self.windows: dict[int, tuple[list[int], list[float], int]] = {}  # doc -> (token ids, activations, index)
        self.n_active = self.n_tokens = 0
        self.values: Optional[list[Tensor]] = [] if keep_values else None

    def add(self, doc: int, ids: list[int], a: Tensor, counted: Tensor, peak: float, where: int) -> None:
        """Text ``doc`` (its token ids ``ids``): the latent's activations ``a`` ``[n]``, those of its counted tokens
        ``counted`` and where among all its tokens the counted ones peak (``peak`` at ``where``)."""
        active = counted > 0
        self.n_tokens += counted.numel()
        self.n_active += int(active.sum())
        if self.values is not None:
            self.values.append(counted[active])
        if peak > 0 and (len(self.best) < self.top or peak > self.best[0][0]):
            item = (peak, doc, where)
            if len(self.best) < self.top:
                heapq.heappush(self.best, item)
            else:
                self.windows.pop(heapq.heapreplace(self.best, item)[1], None)
            lo, hi = max(0, where - self.context), min(len(ids), where + self.after + 1)
            self.windows[doc] = (ids[lo:hi], a[lo:hi].tolist(), where - lo)

    def contexts(self, decode) -> list[dict]:
        """The kept contexts, strongest first (see :class:`FeatureReport`)."""
        out = []
        for v, doc, p in sorted(self.best, reverse=True):
            ids, acts, index = self.windows[doc]
            out.append({"doc": doc, "position": p, "value": v, "tokens": [decode([t]) for t in ids], "acts": acts,
                        "index": index})
        return out


def _texts(dataset: Any) -> list[str]:
    texts = [] if isinstance(dataset, str) else list(dataset)
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise InputError("expected the dataset as a non-empty list of non-empty texts, found "
                         f"{type(dataset).__name__} with {len(texts)} items")
    return texts


def _counts(ones: dict[str, Any], zeros: dict[str, Any]) -> None:
    """Each of ``ones`` a whole number >= 1, each of ``zeros`` >= 0."""
    def whole(v: Any, lo: int) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= lo
    if not all(whole(v, 1) for v in ones.values()) or not all(whole(v, 0) for v in zeros.values()):
        found = ", ".join(repr(v)[:20] for v in [*ones.values(), *zeros.values()])
        raise InputError(f"expected {', '.join(ones)} >= 1 and {', '.join(zeros)} >= 0 (whole numbers), found {found}")


def _encoded(w: Any, x: Tensor, latents: Sequence[int]) -> Tensor:
    """The activations of ``latents`` ``[..., len(latents)]``, each computed as a read of that latent alone computes
    it (its own encoder column: a matrix product's rounding depends on how many columns it has, so a latent reads the
    same alone and among others); a TopK SAE encodes every latent once (it needs them all to pick its ``k``)."""
    if w.architecture == "topk":
        return w.encode(x)[..., list(latents)]
    return torch.stack([w.encode(x, [i])[..., 0] for i in latents], dim=-1)


def _scan(sm: "SteerModel", reads: dict[str, tuple[Any, tuple[int, ...]]], texts: list[str], *, top: int,
          context: int, after: int, batch_size: int, chat: bool, keep_values: bool,
          bar: Any) -> dict[tuple[str, int], _Tally]:
    """The one reading of latents over texts: per batch of ``batch_size`` texts one forward pass recording every
    site of ``reads`` (``{site: (SAEWeights, latents)}``), the listed latents encoded at every token, each text's
    first token not counted (unless it is the only one: the attention sink, see :func:`top_latents`); one
    :class:`_Tally` per ``(site, latent)``."""
    tallies = {(site, i): _Tally(top, context, after, keep_values) for site, (_, ls) in reads.items() for i in ls}
    for s in range(0, len(texts), batch_size):
        part = texts[s:s + batch_size]
        toks = sm.tokenize(part, chat=chat)
        with sm.record(list(reads), positions="all", device="cpu") as cache:
            sm.forward(toks)
        row_ids: dict[int, list[int]] = {}  # a row's token ids, the same at every site
        for site, (w, latents) in reads.items():
            f = _encoded(w, cache[site].to(w.device), latents).float().cpu()  # [b, T, len(latents)]
            lengths, where = cache.lengths(site), cache.positions(site)  # a row's tokens: where it is not padding
            for r, n in enumerate(lengths.tolist()):
                a = f[r, :n]
                skip = 1 if n > 1 else 0  # the first token: the attention sink (see top_latents)
                peaks, at = a[skip:].max(0)
                if r not in row_ids:
                    row_ids[r] = toks.input_ids[r].cpu()[where[r, :n]].tolist()
                for j, (peak, p) in enumerate(zip(peaks.tolist(), (at + skip).tolist())):
                    tallies[(site, latents[j])].add(s + r, row_ids[r], a[:, j], a[skip:, j], peak, p)
        bar.update(len(part))
    bar.close()
    return tallies


@dataclasses.dataclass(eq=False)
class LatentContexts:
    """One latent read over a text set (see :func:`feature_contexts`): ``site``, ``latent``, ``contexts`` (its
    top-activating contexts, best first, as :attr:`FeatureReport.contexts`), ``n_active`` (the counted tokens
    where it is active) and ``n_tokens`` (the tokens counted); ``density`` is their ratio.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import feature_contexts
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> sae = SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64))
        >>> got = feature_contexts(tiny, {"blocks.1.hook_resid_post": (sae, [3])}, ["one two", "three four"],
        ...                        progress=False)[("blocks.1.hook_resid_post", 3)]
        >>> got.latent, got.n_tokens, got.density == got.n_active / got.n_tokens  # first tokens not counted
        (3, 2, True)
    """

    site: str
    latent: int
    contexts: list[dict]
    n_active: int
    n_tokens: int

    @property
    def density(self) -> float:
        """The share of counted tokens where the latent is active."""
        return self.n_active / max(1, self.n_tokens)

    def __repr__(self):
        return (f"LatentContexts(site={self.site!r}, latent={self.latent}, density={self.density:.4g}, "
                f"tokens={self.n_tokens}, contexts={len(self.contexts)})")


def feature_contexts(sm: "SteerModel", reads: Any, dataset: Sequence[str], *, top: int = 3, context: int = 8,
                     after: int = 3, batch_size: int = 16, chat: bool = False,
                     progress: bool = True) -> dict[tuple[str, int], LatentContexts]:
    """Many latents, at one site or several, read over the texts ``dataset`` in one pass per batch: ``reads`` maps
    a site to ``(sae, latents)`` (an SAE, :class:`steerkit.sae.SAEWeights` or a stored one at that site, and the
    latents to read there, distinct indices); each batch of ``batch_size`` texts (raw text unless ``chat``) runs the
    model once, recording every site, and encodes only the listed latents. Per ``(site, latent)``: its ``top``
    strongest contexts, at most one per text, each with ``context`` tokens before and ``after`` after, and its
    density, exactly as :func:`feature_report` reads one latent (the same loop; each text's first token not
    counted unless it is the only one) -- without the logit effects, decoder neighbours and histogram.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import feature_contexts, feature_report
        >>> g = torch.Generator().manual_seed(0)
        >>> sae = SAEWeights(torch.randn(64, 128, generator=g) / 8, torch.zeros(128),
        ...                  torch.randn(128, 64, generator=g) / 8, torch.zeros(64))
        >>> texts = ["the cat sat", "a dog ran far", "hello"]
        >>> a, b = "blocks.0.hook_resid_post", "blocks.2.hook_resid_post"
        >>> got = feature_contexts(tiny, {a: (sae, [5, 9]), b: (sae, [5])}, texts, top=2, progress=False)
        >>> sorted(got)
        [('blocks.0.hook_resid_post', 5), ('blocks.0.hook_resid_post', 9), ('blocks.2.hook_resid_post', 5)]
        >>> one = feature_report(tiny, sae, 5, texts, site=b, top=2, progress=False)
        >>> got[(b, 5)].contexts == one.contexts, got[(b, 5)].density == one.density
        (True, True)
    """
    if not isinstance(reads, dict) or not reads:
        raise InputError(f"expected reads as a non-empty dict of site -> (sae, latents), found {type(reads).__name__}"
                         f"{' (empty)' if isinstance(reads, dict) else ''}")
    plan: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for site, pair in reads.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InputError(f"expected reads[{str(site)[:80]!r}] as a pair (sae, latents), found "
                             f"{type(pair).__name__}")
        sae, latents = pair
        site = _site(sae, site if isinstance(site, str) else None)
        if site in plan:
            raise InputError(f"expected each site once in reads, found {site!r} twice")
        w = sae_weights(sae)
        plan[site] = (w, latent_indices(latents, w.d_sae))
    texts = _texts(dataset)
    _counts({"top": top, "batch_size": batch_size}, {"context": context, "after": after})
    n = sum(len(ls) for _, ls in plan.values())
    bar = tqdm(total=len(texts), desc=f"{n} latents", unit="text", disable=not progress, leave=False)
    tallies = _scan(sm, plan, texts, top=top, context=context, after=after, batch_size=batch_size, chat=chat,
                    keep_values=False, bar=bar)
    return {key: LatentContexts(key[0], key[1], t.contexts(sm.tokenizer.decode), t.n_active, t.n_tokens)
            for key, t in tallies.items()}


def feature_report(sm: "SteerModel", sae: Any, latent: int, dataset: Sequence[str], *, site: Optional[str] = None,
                   top: int = 20, context: int = 8, after: int = 3, k_logits: int = 10, k_neighbours: int = 10,
                   batch_size: int = 16, chat: bool = False, progress: bool = True) -> FeatureReport:
    """Read latent ``latent`` of ``sae`` over the texts ``dataset``: run the model on them (batches of
    ``batch_size``, raw text unless ``chat``), encode the SAE's site at every token, and keep the
    ``top`` strongest activations, at most one per text, each with ``context`` tokens before and
    ``after`` tokens after it; the density and histogram over every token; each text's first token is not
    counted (unless it is the only one), as in :func:`top_latents`; the logit effects
    (``k_logits`` tokens each way) and the ``k_neighbours`` nearest latents by decoder cosine.
    :func:`feature_contexts` reads many latents, at several sites, the same way in one pass.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import feature_report
        >>> g = torch.Generator().manual_seed(0)
        >>> sae = SAEWeights(torch.randn(64, 128, generator=g) / 8, torch.zeros(128),
        ...                  torch.randn(128, 64, generator=g) / 8, torch.zeros(64))
        >>> rep = feature_report(tiny, sae, 5, ["the cat sat", "a dog ran far", "hello"], site="blocks.2.hook_resid_post",
        ...                      top=2, progress=False)
        >>> len(rep.contexts), 0 <= rep.density <= 1, len(rep.top_logits), len(rep.neighbours)
        (2, True, 10, 10)
        >>> rep.contexts[0]["value"] >= rep.contexts[1]["value"]
        True
    """
    w = sae_weights(sae)
    site = _site(sae, site)
    (latent,) = latent_indices(latent, w.d_sae)
    texts = _texts(dataset)
    _counts({"top": top, "batch_size": batch_size, "k_logits": k_logits, "k_neighbours": k_neighbours},
            {"context": context, "after": after})
    bar = tqdm(total=len(texts), desc=f"latent {latent}", unit="text", disable=not progress, leave=False)
    t = _scan(sm, {site: (w, (latent,))}, texts, top=top, context=context, after=after, batch_size=batch_size,
              chat=chat, keep_values=True, bar=bar)[(site, latent)]
    vals = torch.cat(t.values) if t.values else torch.zeros(0)
    top_l, bottom_l = _logit_effects(sm, w.W_dec[latent], k_logits)
    return FeatureReport(latent, site, t.n_tokens, float(vals.numel() / max(1, t.n_tokens)), vals,
                         t.contexts(sm.tokenizer.decode), top_l, bottom_l, _neighbours(w.W_dec, latent, k_neighbours))


@dataclasses.dataclass(eq=False)
class TopLatents:
    """The latents that fire most on one text (see :func:`top_latents`): ``rows``, strongest first, each
    ``{"latent", "max", "mean", "count", "position", "token"}`` (its peak activation, its mean over the counted
    tokens, on how many of them it is active, and where it peaks: an index into ``tokens``); ``tokens``: the
    text's tokens, the first included (it is not counted, see :func:`top_latents`).

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import top_latents
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> hits = top_latents(tiny, SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64)), "one two three",
        ...                    site="blocks.1.hook_resid_post", k=3)
        >>> len(hits.rows), hits.rows[0]["max"] >= hits.rows[-1]["max"], sorted(hits.rows[0])
        (3, True, ['count', 'latent', 'max', 'mean', 'position', 'token'])
    """

    site: str
    text: str
    tokens: list[str]
    rows: list[dict]

    def __repr__(self):
        top = ", ".join(f"{r['latent']}:{r['max']:.3g}" for r in self.rows[:5])
        return f"TopLatents(site={self.site!r}, tokens={len(self.tokens)}, top=[{top}])"

    def to_dict(self) -> dict:
        """The result as plain JSON-able data (what ``steerkit sae find --json`` prints)."""
        return dataclasses.asdict(self)


def top_latents(sm: "SteerModel", sae: Any, text: str, *, k: int = 10, site: Optional[str] = None,
                chat: bool = False) -> TopLatents:
    """The ``k`` latents of ``sae`` with the highest peak activation on ``text`` (raw text unless ``chat``),
    with their mean activation, how many tokens they fire on and the token where they peak (see
    :class:`TopLatents`); a latent that fires nowhere is never listed.

    The text's first token is not counted (unless it is the only one): it is where the model's attention sink
    sits, a BOS token or, in a model without one, the first word, with a residual stream far larger than the
    other tokens' (SmolLM2-135M-Instruct at block 12: a norm of about 22,700 against about 150), so the latents
    that fire there fire on the first token of every text and would head every list.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import top_latents
        >>> g = torch.Generator().manual_seed(0)
        >>> sae = SAEWeights(torch.randn(64, 128, generator=g) / 8, torch.zeros(128),
        ...                  torch.randn(128, 64, generator=g) / 8, torch.zeros(64))
        >>> hits = top_latents(tiny, sae, "the cat sat on the mat", site="blocks.2.hook_resid_post", k=5)
        >>> [r["latent"] for r in hits.rows] == [r["latent"] for r in sorted(hits.rows, key=lambda r: -r["max"])]
        True
    """
    w = sae_weights(sae)
    site = _site(sae, site)
    if not isinstance(text, str) or not text:
        raise InputError(f"expected a non-empty text, found {text!r:.80}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"expected k as an int >= 1, found {k!r}")
    toks = sm.tokenize([text], chat=chat)
    with sm.record(site, positions="all", device="cpu") as cache:
        sm.forward(toks)
    n = int(cache.lengths(site)[0])
    skip = 1 if n > 1 else 0  # the first token: the attention sink (see above)
    f = w.encode(cache[site][0, skip:n].to(w.device)).float().cpu()  # [T - skip, d_sae]
    peak, where = f.max(0)
    where = where + skip
    order = [int(i) for i in peak.argsort(descending=True)[:k] if float(peak[i]) > 0]
    ids = toks.input_ids[0, :n].tolist()
    words = [sm.tokenizer.decode([t]) for t in ids]
    rows = [{"latent": i, "max": float(peak[i]), "mean": float(f[:, i].mean()), "count": int((f[:, i] > 0).sum()),
             "position": int(where[i]), "token": words[int(where[i])]} for i in order]
    return TopLatents(site, text, words, rows)


# ----------------------------------------------------------------------------- attribution
@dataclasses.dataclass(eq=False)
class LatentAttribution:
    """Attribution patching over an SAE's latents (see :func:`latent_attribution`).

    ``values`` ``[d_sae]``: each latent's predicted change of the metric, summed over positions
    (``per_position`` ``[pos, d_sae]``); ``clean_metric`` / ``corrupted_metric``; ``check``: for the
    ``checked`` latents with the largest ``|values|``, ``patching`` (the metric's change when the latent
    takes its clean values at every position), ``pearson_r`` between the two, and ``top_in_top3``.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import latent_attribution
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> res = latent_attribution(tiny, SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64)), "a b c",
        ...                          "a b d", lambda logits: logits[0, -1, 5] - logits[0, -1, 6],
        ...                          site="blocks.1.hook_resid_post", check=4)
        >>> len(res.top(3)), len(res.patching), res.pearson_r is not None
        (3, 4, True)
    """

    values: Float[Tensor, " d_sae"]
    per_position: Float[Tensor, "pos d_sae"]
    clean_metric: float
    corrupted_metric: float
    checked: list[int]
    patching: list[float]
    pearson_r: Optional[float]
    top_in_top3: Optional[bool]

    def top(self, k: int = 10) -> list[tuple[int, float]]:
        """The ``k`` latents with the largest ``|values|``, as ``(latent, value)``."""
        idx = self.values.abs().topk(min(k, self.values.numel())).indices
        return [(int(i), float(self.values[i])) for i in idx]

    def plot(self, *, title: Optional[str] = None):
        """A plotly scatter of attribution against patching for the checked latents
        (:func:`steerkit.probes.plots.sae.attribution_figure`)."""
        with plotly_required():
            from .plots import sae as figures
        return figures.attribution_figure(self, title=title)


def _spliced(sm: "SteerModel", w, site: str, toks, delta: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """The logits of ``toks`` with the SAE spliced at ``site`` (error kept) and ``delta`` added to its
    latents, and the latents read there ``[pos, d_sae]``."""
    seen: dict[str, Tensor] = {}

    def fn(h: Tensor) -> Tensor:
        f = w.encode(h.to(w.dtype)).detach()
        seen["f"] = f[0]
        if delta is None:
            return h
        return h + (w.decode(f + delta.to(f), h) - w.decode(f, h)).to(h.dtype)
    with sm.steer(Intervention.apply(site, fn)):
        logits = sm.forward(toks, grad=delta is not None)
    return logits, seen["f"]


def latent_attribution(sm: "SteerModel", sae: Any, clean: Prompt, corrupted: Prompt, metric: Metric, *,
                       site: Optional[str] = None, check: int = 20, batch_size: int = 8,
                       chat: bool = False) -> LatentAttribution:
    """Attribution patching over the latents of ``sae`` between a clean and a corrupted prompt of the same
    length: the gradient of ``metric(logits)`` with respect to the latents at the corrupted run (the SAE
    spliced in with its error term kept, so the run is the model's own) times ``f_clean - f_corrupted``,
    per position and summed. With ``check`` > 0 the ``check`` latents of largest ``|attribution|`` are
    also patched for real (each set to its clean values at every position, error kept, ``batch_size`` at
    a time as one steering per row) to report how well the approximation ranks them.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import latent_attribution, logit_diff_metric
        >>> g = torch.Generator().manual_seed(0)
        >>> sae = SAEWeights(torch.randn(64, 128, generator=g) / 8, torch.zeros(128),
        ...                  torch.randn(128, 64, generator=g) / 8, torch.zeros(64))
        >>> res = latent_attribution(tiny, sae, "the cat sat on", "the dog sat on", logit_diff_metric(tiny, "a", "b"),
        ...                          site="blocks.2.hook_resid_post", check=5)
        >>> tuple(res.values.shape), len(res.checked), len(res.patching)
        ((128,), 5, 5)
    """
    w = sae_weights(sae)
    site = _site(sae, site)
    c_toks, k_toks = prompt_tokens(sm, clean, "the clean prompt", chat=chat), \
        prompt_tokens(sm, corrupted, "the corrupted prompt", chat=chat)
    if c_toks.input_ids.shape != k_toks.input_ids.shape:
        raise InputError(f"expected the clean and corrupted prompts to have the same number of tokens, found "
                         f"{c_toks.input_ids.shape[1]} and {k_toks.input_ids.shape[1]}; align them (e.g. swap one "
                         "name for another of one token)")
    if check < 0 or batch_size < 1:
        raise InputError(f"expected check >= 0 and batch_size >= 1, found {check}, {batch_size}")
    with torch.no_grad():
        clean_logits, f_clean = _spliced(sm, w, site, c_toks, None)
    clean_metric = float(_metric_value(metric, clean_logits[0:1].float()))
    delta = torch.zeros(k_toks.input_ids.shape[1], w.d_sae, dtype=w.dtype, device=w.device, requires_grad=True)
    with torch.enable_grad():
        logits, f_corr = _spliced(sm, w, site, k_toks, delta)
        m = _metric_value(metric, logits[0:1].float(), grad=True)
        (grad,) = torch.autograd.grad(m, [delta])
    per_pos = ((f_clean.to(grad) - f_corr.to(grad)) * grad).float().cpu()
    values = per_pos.sum(0)
    checked = [int(i) for i in values.abs().topk(min(check, w.d_sae)).indices] if check else []
    patching = _patch_latents(sm, w, site, k_toks, f_clean, f_corr, checked, metric, float(m.detach()),
                              batch_size)
    r = top3 = None
    if len(checked) >= 2:
        a, p = values[checked].double(), torch.tensor(patching, dtype=torch.float64)
        r = float(torch.corrcoef(torch.stack([a, p]))[0, 1])
        top3 = checked[0] in [checked[i] for i in p.abs().topk(min(3, len(checked))).indices.tolist()]
    return LatentAttribution(values, per_pos, clean_metric, float(m.detach()), checked, patching, r, top3)


def _patch_latents(sm: "SteerModel", w, site: str, toks, f_clean: Tensor, f_corr: Tensor, latents: list[int],
                   metric: Metric, base: float, batch_size: int) -> list[float]:
    """The metric's change when each latent takes its clean values at every position (error kept)."""
    if not latents:
        return []
    with sm.record(site) as cache, torch.no_grad():
        sm.forward(toks)
    h = cache[site][0].to(w.dtype)  # [pos, d]: the corrupted run's activations
    out: list[float] = []
    for s in range(0, len(latents), batch_size):
        part = latents[s:s + batch_size]
        rows = []
        for i in part:
            f_new = f_corr.clone()
            f_new[:, i] = f_clean[:, i]
            src = h + w.decode(f_new.to(w.dtype), h) - w.decode(f_corr.to(w.dtype), h)
            rows.append([Intervention.patch(site, src)])
        batch = sm.pad([toks.input_ids[0].tolist()] * len(part))
        with torch.no_grad(), sm.steer(rows=rows):
            logits = sm.forward(batch)
        out += [float(_metric_value(metric, logits[j:j + 1].float())) - base for j in range(len(part))]
    return out
