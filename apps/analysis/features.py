"""The Features page's computations over a sparse autoencoder's latents: :func:`find_latents` -> the
latents that fire most on one text (:func:`steerkit.probes.top_latents`), and :func:`feature_run` ->
:class:`FeatureRun`, one latent read over a set of texts (:func:`steerkit.probes.feature_report`, one
batch of texts per call so that progress, cancel and the time limit act between batches), the calls
merged into one report by :func:`merge_reports` (their contexts by :func:`merge_contexts`, which the Circuits page's
reading of every drawn feature shares); :func:`report_texts` and :func:`text_chunks`, the texts
a report reads, one chunk per call (:func:`.common.read_chunks`)."""
from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from steerkit.errors import InputError
from steerkit.interventions import sae_weights
from steerkit.probes import FeatureReport, TopLatents, feature_report, top_latents

from ..data import (
    MAX_FEATURE_CONTEXTS, MAX_FEATURE_DOC_CHARS, MAX_FEATURE_K, MAX_FEATURE_TEXT_CHARS, MAX_FEATURE_TEXTS,
    bounded_prompts, check_int, check_text,
)
from .common import read_chunks

if TYPE_CHECKING:
    from steerkit.model import SteerModel

def find_latents(sm: SteerModel, sae: Any, text, k=10) -> TopLatents:
    """The ``k`` latents of ``sae`` (a stored :class:`steerkit.vectors.SAE`, read at its own site) that fire
    most on ``text``: :func:`steerkit.probes.top_latents` after the page's bounds (a text of at most
    ``MAX_FEATURE_TEXT_CHARS`` characters, ``k`` from 1 to ``MAX_FEATURE_K``).

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.vectors import SAE
        >>> from steerkit.apps.analysis import find_latents
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> sae = SAE(SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64)), "blocks.1.hook_resid_post")
        >>> hits = find_latents(tiny, sae, "one two three", k=3)
        >>> len(hits.rows), hits.site
        (3, 'blocks.1.hook_resid_post')
        >>> find_latents(tiny, sae, "one", k=51)
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a number of latents from 1 to 50, found '51'
    """
    text = check_text(text, "the text", MAX_FEATURE_TEXT_CHARS)
    if not text.strip():
        raise InputError("expected a text to read the latents on, found nothing; type one")
    k = check_int(k, "a number of latents", 1, MAX_FEATURE_K)
    return top_latents(sm, sae, text, k=k)


@dataclass
class FeatureRun:
    """The Features page's result: ``report`` (a :class:`steerkit.probes.FeatureReport` of latent
    ``report.latent`` over ``texts``), the SAE's store reference ``sae``, the number of texts asked for
    (``n_texts``) and whether the time limit cut the reading short (``stopped_at_deadline``: ``texts``
    holds the texts read by then).

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.vectors import SAE
        >>> from steerkit.apps.analysis import feature_run
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> sae = SAE(SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64)), "blocks.1.hook_resid_post")
        >>> run = feature_run(tiny, sae, 3, ["one two", "three four five"], top=2)
        >>> run.report.latent, run.n_texts, run.n_read, run.stopped_at_deadline
        (3, 2, 2, False)
    """

    report: FeatureReport
    texts: list[str]
    n_texts: int
    sae: str = ""
    model_name: str = ""
    seconds: float = 0.0
    stopped_at_deadline: bool = False

    @property
    def n_read(self) -> int:
        """How many texts the report read."""
        return len(self.texts)


def merge_contexts(parts: Sequence[list[dict]], sizes: Sequence[int], top: int) -> list[dict]:
    """The top contexts of one latent read over consecutive slices of a text set (``parts[i]``: at most ``top``
    contexts of ``sizes[i]`` texts, as :func:`steerkit.probes.feature_report` or
    :func:`steerkit.probes.feature_contexts` keep them) as one reading of the whole set keeps them: the strongest
    ``top``, one per text, texts numbered across the set, best first.

    Examples:
        >>> from steerkit.apps.analysis import merge_contexts
        >>> a = [{"doc": 1, "position": 2, "value": 3.0}, {"doc": 0, "position": 1, "value": 1.0}]
        >>> b = [{"doc": 0, "position": 4, "value": 2.0}]
        >>> [(c["doc"], c["value"]) for c in merge_contexts([a, b], [2, 1], 2)]
        [(1, 3.0), (2, 2.0)]
    """
    best: list[tuple[float, int, int]] = []  # the min-heap of the one reading: (value, doc, position)
    by_doc: dict[int, dict] = {}
    offset = 0
    for contexts, size in zip(parts, sizes):
        for c in sorted(contexts, key=lambda c: c["doc"]):  # in reading order, as the one call sees them
            doc = offset + int(c["doc"])
            item = (float(c["value"]), doc, int(c["position"]))
            if len(best) < top or item[0] > best[0][0]:
                (heapq.heappush if len(best) < top else heapq.heapreplace)(best, item)
                by_doc[doc] = {**c, "doc": doc}
        offset += int(size)
    return [by_doc[doc] for _, doc, _ in sorted(best, reverse=True)]


def merge_reports(parts: Sequence[FeatureReport], sizes: Sequence[int], top: int) -> FeatureReport:
    """Reports of one latent over consecutive slices of a text set (``sizes[i]`` texts in ``parts[i]``, each
    with at most ``top`` contexts) as the report over the whole set, as one call of
    :func:`steerkit.probes.feature_report` gives it: the contexts kept as its heap keeps them (the
    strongest ``top``, one per text, texts numbered across the set), the density over every token, the
    activations in order; the logit effects and decoder neighbours are the first part's (the same in each).

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.probes import feature_report
        >>> from steerkit.apps.analysis import merge_reports
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> sae = SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64))
        >>> texts = ["one two", "three four five", "six", "seven eight"]
        >>> read = lambda ts: feature_report(tiny, sae, 3, ts, site="blocks.1.hook_resid_post", top=2, batch_size=2,
        ...                                  progress=False)
        >>> whole, merged = read(texts), merge_reports([read(texts[:2]), read(texts[2:])], [2, 2], 2)
        >>> merged.contexts == whole.contexts, merged.density == whole.density, merged.n_tokens == whole.n_tokens
        (True, True, True)
    """
    if not parts or len(parts) != len(sizes):
        raise InputError(f"expected one size per report to merge, found {len(parts)} reports and {len(sizes)} sizes")
    first = parts[0]
    contexts = merge_contexts([rep.contexts for rep in parts], sizes, top)
    n_tokens = sum(p.n_tokens for p in parts)
    values = torch.cat([p.values.reshape(-1) for p in parts]) if parts else torch.zeros(0)
    return dataclasses.replace(first, n_tokens=n_tokens, density=float(values.numel() / max(1, n_tokens)),
                               values=values, contexts=contexts)


def report_texts(texts: Any) -> list[str]:
    """``texts`` as a report reads them (the Features page's and the Circuits page's): a list of texts, the blank
    ones dropped, 1 to ``MAX_FEATURE_TEXTS`` of at most ``MAX_FEATURE_DOC_CHARS`` characters.

    Examples:
        >>> from steerkit.apps.analysis import report_texts
        >>> report_texts(["a b", "  ", "c"])
        ['a b', 'c']
        >>> report_texts("a b")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected the texts as a list of texts, found str
    """
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise InputError("expected the texts as a list of texts, found "
                         f"{type(texts).__name__ if not isinstance(texts, (list, tuple)) else 'other values in it'}")
    texts = bounded_prompts([t for t in texts if t.strip()], "the texts of a report", MAX_FEATURE_TEXTS,
                            MAX_FEATURE_DOC_CHARS)
    if not texts:
        raise InputError("expected at least one text to read the latent on, found none; paste some or pick a "
                         "built-in set")
    return texts


def text_chunks(texts: list[str], batch_size: Any) -> list[list[str]]:
    """``texts`` in consecutive chunks of ``batch_size`` (1 to ``MAX_FEATURE_TEXTS``): one call each, so that
    progress, cancel and the time limit act between them.

    Examples:
        >>> from steerkit.apps.analysis import text_chunks
        >>> text_chunks(["a", "b", "c"], 2)
        [['a', 'b'], ['c']]
    """
    batch_size = check_int(batch_size, "a batch size", 1, MAX_FEATURE_TEXTS)
    return [texts[i:i + batch_size] for i in range(0, len(texts), batch_size)]


def feature_run(sm: SteerModel, sae: Any, latent, texts: Sequence[str], *, top=20, batch_size: int = 16,
                progress=None, should_stop=None, deadline: Optional[float] = None, ref: str = "") -> FeatureRun:
    """Latent ``latent`` of ``sae`` (0 to ``d_sae - 1``) read over ``texts`` (1 to ``MAX_FEATURE_TEXTS``, each
    at most ``MAX_FEATURE_DOC_CHARS`` characters) with its ``top`` strongest contexts (1 to
    ``MAX_FEATURE_CONTEXTS``): :func:`steerkit.probes.feature_report` on ``batch_size`` texts per call, so
    that ``progress(done, total)`` advances and ``should_stop()`` cancels between calls, merged by
    :func:`merge_reports`; past ``deadline`` seconds it stops with the texts it has read
    (``stopped_at_deadline``). ``ref``: the SAE's store reference, kept with the result.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.vectors import SAE
        >>> from steerkit.apps.analysis import feature_run
        >>> W = torch.nn.functional.normalize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), dim=-1)
        >>> sae = SAE(SAEWeights(W.T.clone(), torch.zeros(32), W, torch.zeros(64)), "blocks.1.hook_resid_post")
        >>> ticks = []
        >>> run = feature_run(tiny, sae, 5, ["a b", "c d", "e f"], batch_size=2, progress=lambda d, t: ticks.append(d))
        >>> ticks, len(run.report.contexts) <= 3
        ([0, 1, 2], True)
        >>> feature_run(tiny, sae, 32, ["a b"])
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a latent from 0 to 31, found '32'
    """
    t0 = time.perf_counter()
    latent = check_int(latent, "a latent", 0, sae_weights(sae).d_sae - 1)
    top = check_int(top, "a number of contexts", 1, MAX_FEATURE_CONTEXTS)
    texts = report_texts(texts)
    chunks = text_chunks(texts, batch_size)
    parts, stopped = read_chunks(chunks, lambda chunk: feature_report(sm, sae, latent, chunk, top=top,
                                                                      batch_size=len(chunk), progress=False),
                                 progress=progress, should_stop=should_stop, deadline=deadline)
    report = merge_reports(parts, [len(c) for c in chunks[:len(parts)]], top)
    return FeatureRun(report, texts=texts[:sum(len(c) for c in chunks[:len(parts)])], n_texts=len(texts), sae=ref,
                      model_name=sm.name, seconds=time.perf_counter() - t0, stopped_at_deadline=stopped)
