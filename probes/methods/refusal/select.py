"""Selection of the refusal direction among the candidates (the reference code's rules): every candidate's bypass
score, induce score and KL on the validation prompts, scored one candidate per pass or many (candidate, prompt)
rows per pass with a per-row steering, and the choice with its discard reasons.

An induce score adds the candidate at its layer only, so nothing below that block differs from the unsteered
model: on a backend that runs a range of blocks (:func:`steerkit.reuse.supports_run_from`) the harmless prompts
are run once unsteered and every induce pass starts at its candidates' layer from that run
(:class:`_HarmlessRun`). The bypass and KL scores ablate at every layer and run the whole model."""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.interventions import Intervention
from steerkit.reuse import RunCache, run_cached, run_from, supports_run_from

from .data import batches
from .score import kl_last, last_logits, refusal_score_from_logits, refusal_scores
from .steering import ablation, ablation_interventions, addition, addition_interventions

if TYPE_CHECKING:
    from steerkit.model import SteerModel

@dataclass
class Candidate:
    """One candidate direction: its position and layer, its three validation scores (``NaN``: not
    evaluated) and its ``status`` after selection (:func:`choose`).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> c = R.Candidate(pos=-1, layer=3, bypass=-2.5)
        >>> c.status, c.as_dict()["bypass"], R.discard_reason(c, n_layers=30) is None
        ('pending', -2.5, True)
    """
    pos: int  # negative index among the prompt tokens (-1: last)
    layer: int
    bypass: float = float("nan")
    induce: float = float("nan")
    kl: float = float("nan")
    status: str = "pending"  # pending | selected | discarded: <reason> | not evaluated

    def as_dict(self) -> dict:
        return asdict(self)


def discard_reason(c: Candidate, n_layers: int, *, prune_frac: float = 0.2, kl_max: float = 0.1,
                   induce_min: float = 0.0) -> Optional[str]:
    """Why the reference code would discard ``c`` (``None``: it passes). Unevaluated scores pass.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> R.discard_reason(R.Candidate(-1, 26, bypass=-3.0), n_layers=30)
        'in the last 20% of layers'
        >>> R.discard_reason(R.Candidate(-1, 10, bypass=-3.0, induce=1.0, kl=0.5), n_layers=30)
        'KL 0.5 > 0.1'
        >>> R.discard_reason(R.Candidate(-1, 10, bypass=-3.0, induce=1.0, kl=0.05), n_layers=30) is None
        True
    """
    if c.layer >= int(n_layers * (1.0 - prune_frac)):
        return f"in the last {prune_frac:.0%} of layers"
    if math.isnan(c.bypass):
        return "bypass score is NaN"
    if not math.isnan(c.kl) and c.kl > kl_max:
        return f"KL {c.kl:.3g} > {kl_max}"
    if not math.isnan(c.induce) and c.induce < induce_min:
        return f"induce score {c.induce:.3g} < {induce_min}"
    return None


def choose(cands: list[Candidate], n_layers: int, *, prune_frac: float = 0.2, kl_max: float = 0.1,
           induce_min: float = 0.0) -> Candidate:
    """The candidate with the lowest bypass score among those with every score evaluated and no
    discard reason. Sets ``status`` on every candidate. Raises when none passes.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> cands = [R.Candidate(-1, 2, bypass=-4.0, induce=-1.0, kl=0.01),
        ...          R.Candidate(-1, 5, bypass=-3.0, induce=0.5, kl=0.02),
        ...          R.Candidate(-1, 9, bypass=-5.0, induce=2.0, kl=0.01)]
        >>> R.choose(cands, n_layers=10).layer, [c.status for c in cands]
        (5, ['discarded: induce score -1 < 0.0', 'selected', 'discarded: in the last 20% of layers'])
    """
    best = None
    for c in cands:
        r = discard_reason(c, n_layers, prune_frac=prune_frac, kl_max=kl_max, induce_min=induce_min)
        if r is None and (math.isnan(c.induce) or math.isnan(c.kl)):
            c.status = "not evaluated"
            continue
        if r is not None:
            c.status = f"discarded: {r}"
            continue
        c.status = "eligible"
        if best is None or c.bypass < best.bypass:
            best = c
    if best is None:
        scored = sorted((c for c in cands if not math.isnan(c.bypass)), key=lambda c: c.bypass)[:8]
        top = "; ".join(f"pos {c.pos} layer {c.layer}: bypass {c.bypass:.3f} induce {c.induce:.3f} kl {c.kl:.3f}"
                        for c in scored)
        raise InputError("expected at least one candidate direction to pass the filters (not in the last "
                         f"{prune_frac:.0%} of layers, KL <= {kl_max}, induce >= {induce_min}), found none; "
                         f"loosen kl_max/induce_min or use more prompts. Lowest bypass scores: {top or 'none'}")
    best.status = "selected"
    return best


class _HarmlessRun:
    """The harmless prompts run once unsteered when it is made (:func:`~steerkit.reuse.run_cached`, in the chat
    template as :func:`last_logits` runs them; make it with no steering on the model), kept for the induce
    scores: a pass of some of its rows with candidates added at layer ``l`` or later starts at block ``l``
    from this run's residual stream (:func:`~steerkit.reuse.run_from`) and at the first position where one
    of its rows has a token (the positions before are padding in every row of the pass), and unembeds only
    the last position.

    Examples:
        >>> from steerkit.probes.methods.refusal.select import _HarmlessRun
        >>> from steerkit.probes.methods import refusal as R
        >>> run = _HarmlessRun(tiny, ["bake bread", "write a poem about the sea"])
        >>> v = torch.randn(64)
        >>> with R.addition(tiny, v, layer=1):
        ...     fast = run.last_logits(1, [1, 0])
        ...     full = R.last_logits(tiny, ["write a poem about the sea", "bake bread"])
        >>> torch.allclose(fast, full, atol=1e-4)
        True
    """

    def __init__(self, sm: "SteerModel", prompts: list[str]):
        self.sm = sm
        self.cache: RunCache = run_cached(sm, prompts, chat=True, keep=1)
        self.pad: list[int] = (self.cache.n_pos - self.cache.tokens.attention_mask.long().sum(1)).tolist()

    def last_logits(self, layer: int, rows: Sequence[int]) -> Float[Tensor, "rows vocab"]:
        """Next-token logits (float32, CPU) of prompts ``rows`` (indices, repeats allowed) under the edits in
        force, which must act at block ``layer`` or later."""
        start = min(self.pad[i] for i in rows)
        out = run_from(self.sm, int(layer), self.cache, start=start, rows=list(rows), keep=1)
        return out[:, -1].float().cpu()


class _RowScorer:
    """Scores (candidate, prompt) rows many per forward pass, each row with its own steering.

    A job is ``(kind, candidate)``: ``"bypass"`` (harmful prompts, candidate ablated: mean refusal score),
    ``"induce"`` (harmless prompts, candidate added at its layer: mean refusal score) or ``"kl"``
    (harmless prompts, candidate ablated: mean KL from the unsteered next-token distribution). Every
    job's rows go into one list, sorted by prompt length so a batch holds prompts of one length (little
    padding), and run ``batch_size`` rows per forward pass with a per-row steering list
    (:meth:`SteerModel.steer` with ``rows=``): one fused kernel call per hooked site for the whole batch.

    With ``harmless_run`` (a :class:`_HarmlessRun`), the ``induce`` rows go after the others, sorted by their
    candidate's layer (then by prompt length): a pass of induce rows only runs from the lowest layer among
    them, from the unsteered harmless run; a pass that holds both kinds (at most one per call) runs the
    whole model. The passes are as many, of as many rows, as without it."""

    def __init__(self, sm: "SteerModel", vec: Callable, harmful: list[str], harmless: list[str],
                 refusal_ids: Sequence[int], base_harmless: Tensor, batch_size: int,
                 harmless_run: Optional[_HarmlessRun] = None):
        self.sm, self.vec, self.ids, self.base, self.bs = sm, vec, list(refusal_ids), base_harmless, batch_size
        self.harmless_run = harmless_run
        self.prompts = {"bypass": harmful, "induce": harmless, "kl": harmless}
        self.lens = {p: int(sm.tokenize([p], chat=True).attention_mask.sum()) for p in dict.fromkeys(harmful + harmless)}
        self._ivs: dict = {}

    def steering(self, kind: str, c: Candidate) -> list[Intervention]:
        """The candidate's addition at its layer (``induce``) or its ablation everywhere (``bypass``, ``kl``)."""
        key = ("add" if kind == "induce" else "ablate", c.pos, c.layer)
        if key not in self._ivs:
            v = self.vec(c)
            self._ivs[key] = (addition_interventions(v, c.layer) if key[0] == "add"
                              else ablation_interventions(self.sm, v))
        return self._ivs[key]

    @torch.inference_mode()
    def run(self, jobs: Sequence[tuple[str, Candidate]], progress=None) -> dict:
        """``{(kind, pos, layer): mean score}`` of every job; ``progress(n)`` after each batch with the
        number of jobs it completed."""
        rows = [(j, i) for j, (kind, _) in enumerate(jobs) for i in range(len(self.prompts[kind]))]

        def by_length(r):
            return self.lens[self.prompts[jobs[r[0]][0]][r[1]]], self.prompts[jobs[r[0]][0]][r[1]], r[0]
        hr = self.harmless_run
        if hr is not None:  # the others as before, then the induce rows layer by layer
            rows = (sorted((r for r in rows if jobs[r[0]][0] != "induce"), key=by_length)
                    + sorted((r for r in rows if jobs[r[0]][0] == "induce"),
                             key=lambda r: (jobs[r[0]][1].layer,) + by_length(r)))
        else:
            rows.sort(key=by_length)
        vals: dict[tuple[int, int], float] = {}
        left = [len(self.prompts[k]) for k, _ in jobs]
        for chunk in batches(rows, self.bs):
            steer = [self.steering(*jobs[j]) for j, _ in chunk]
            prompts = [self.prompts[jobs[j][0]][i] for j, i in chunk]
            with self.sm.steer(rows=steer, label="refusal candidates per row"):
                if hr is not None and all(jobs[j][0] == "induce" for j, _ in chunk):
                    lg = hr.last_logits(min(jobs[j][1].layer for j, _ in chunk), [i for _, i in chunk])
                else:
                    lg = last_logits(self.sm, prompts, batch_size=len(chunk))
            score = refusal_score_from_logits(lg, self.ids)
            is_kl = [k for k, (j, _) in enumerate(chunk) if jobs[j][0] == "kl"]
            kl = dict(zip(is_kl, kl_last(self.base[[chunk[k][1] for k in is_kl]], lg[is_kl]).tolist())) if is_kl else {}
            done = 0
            for k, (j, i) in enumerate(chunk):
                vals[(j, i)] = float(kl[k]) if k in kl else float(score[k])
                left[j] -= 1
                done += left[j] == 0
            if progress is not None and done:
                progress(done)
        out = {}
        for j, (kind, c) in enumerate(jobs):  # the mean over the prompts in their order, in float64
            v = torch.tensor([vals[(j, i)] for i in range(len(self.prompts[kind]))], dtype=torch.float64)
            out[(kind, c.pos, c.layer)] = float(v.mean())
        return out


@dataclass
class Selection:
    """The outcome of :func:`select_direction`: every candidate (``[n_pos, n_layers, d_model]``), the
    scored ``table``, the ``best`` candidate, the baseline validation scores and the ``rule`` that chose.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> cands = torch.zeros(2, 4, 64)
        >>> cands[1, 2, 0] = 3.0
        >>> best = R.Candidate(-1, 2, bypass=-4.0, induce=0.5, kl=0.01, status="selected")
        >>> sel = R.Selection(cands, [-2, -1], [best], best, baseline_harmful=1.0, baseline_harmless=-2.0)
        >>> float(sel.direction.norm()), sel.rule
        (3.0, 'paper')
    """
    candidates: Float[Tensor, "n_pos n_layers d_model"]
    positions: list[int]
    table: list[Candidate]
    best: Candidate
    baseline_harmful: float
    baseline_harmless: float
    rule: str = "paper"  # "paper": induce >= induce_min; "relative": induce > baseline harmless (fallback)

    @property
    def direction(self) -> Float[Tensor, " d_model"]:
        return self.candidates[self.positions.index(self.best.pos), self.best.layer]


#: rows per forward pass of the batched candidate search on an accelerator (see :func:`score_rows`)
ACCELERATOR_SCORE_ROWS = 256


def score_rows(device, batch_size: int, rows: Optional[int] = None) -> int:
    """Rows per forward pass of the batched candidate search: ``rows`` when given, else ``batch_size`` on a
    CPU (where a pass of 16 rows of a small model already fills the cores and larger passes cost more per
    row, ``benchmarks/bench_batch_scaling.py``) and at least :data:`ACCELERATOR_SCORE_ROWS` on any other
    device (where a 16-row pass leaves it mostly idle: many candidates per pass).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> R.score_rows("cpu", 16), R.score_rows("cuda:0", 16), R.score_rows("cuda", 16, rows=64)
        (16, 256, 64)
    """
    if rows is not None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise InputError(f"expected rows per pass as an int >= 1 (or None for the device's default), found {rows!r}")
        return rows
    return batch_size if torch.device(device).type == "cpu" else max(batch_size, ACCELERATOR_SCORE_ROWS)


class _Scores:
    """A candidate's three validation scores, one candidate's steering per forward pass (``batch_size``
    prompts a pass). ``fill`` scores the table's candidates (bypass; with ``lazy=False`` also KL and induce);
    ``induce`` and ``kl`` are the lazy search's evaluations of one candidate. With ``reuse``, the induce
    passes start at the candidate's layer from one unsteered run of the harmless prompts (:class:`_HarmlessRun`)."""

    def __init__(self, sm: "SteerModel", candidates: Tensor, positions: list[int], harmful: list[str],
                 harmless: list[str], refusal_ids: Sequence[int], base_harmless: Tensor, batch_size: int,
                 reuse: bool = False):
        self.sm, self.candidates, self.positions = sm, candidates, positions
        self.harmful, self.harmless, self.ids, self.base, self.bs = harmful, harmless, refusal_ids, base_harmless, batch_size
        self.floor = 0.0  # the induce floor of the lazy search under way (a batched search looks ahead with it)
        self.harmless_run = _HarmlessRun(sm, harmless) if reuse else None

    def vec(self, c: Candidate) -> Tensor:
        return self.candidates[self.positions.index(c.pos), c.layer]

    def _mean_score(self, prompts: list[str]) -> float:
        return float(refusal_scores(self.sm, prompts, self.ids, batch_size=self.bs).mean())

    def _mean_kl(self) -> float:
        return float(kl_last(self.base, last_logits(self.sm, self.harmless, batch_size=self.bs)).mean())

    def fill(self, live: list[Candidate], *, lazy: bool, progress: Optional[Callable[[int], object]]) -> None:
        for c in live:
            if float(self.vec(c).norm()) != 0.0:  # a zero one (the embedding of a template token every prompt
                with ablation(self.sm, self.vec(c)):  # shares) keeps NaN scores: discarded, as in the reference
                    c.bypass = self._mean_score(self.harmful)
                    if not lazy:
                        c.kl = self._mean_kl()
                if not lazy:
                    self.induce(c)
            if progress is not None:
                progress(1)

    def induce(self, c: Candidate) -> None:
        if self.harmless_run is None:
            with addition(self.sm, self.vec(c), c.layer):
                c.induce = self._mean_score(self.harmless)
            return
        run = self.harmless_run
        with addition(self.sm, self.vec(c), c.layer):
            lg = torch.cat([run.last_logits(c.layer, part) for part in batches(list(range(len(self.harmless))),
                                                                                 self.bs)])
        c.induce = float(refusal_score_from_logits(lg, self.ids).mean())

    def kl(self, c: Candidate) -> None:
        with ablation(self.sm, self.vec(c)):
            c.kl = self._mean_kl()


class _BatchedScores(_Scores):
    """The same scores, many (candidate, prompt) rows per forward pass (:class:`_RowScorer`, ``per_pass`` rows):
    the lazy search's evaluations also score the next candidates in its order ahead, and the table takes only
    the scores the one-at-a-time search would have computed, so both fill the same table."""

    def __init__(self, sm: "SteerModel", candidates: Tensor, positions: list[int], harmful: list[str],
                 harmless: list[str], refusal_ids: Sequence[int], base_harmless: Tensor, per_pass: int,
                 reuse: bool = False):
        super().__init__(sm, candidates, positions, harmful, harmless, refusal_ids, base_harmless, per_pass, reuse)
        self.scorer = _RowScorer(sm, self.vec, harmful, harmless, refusal_ids, base_harmless, per_pass,
                                 self.harmless_run)
        self.ahead: dict = {}  # scores computed ahead of the search: written to the table only when it asks
        self.order: list[Candidate] = []  # the candidates the lazy search visits, in its order

    def fill(self, live: list[Candidate], *, lazy: bool, progress: Optional[Callable[[int], object]]) -> None:
        nonzero = [c for c in live if float(self.vec(c).norm()) != 0.0]
        if progress is not None and len(live) > len(nonzero):
            progress(len(live) - len(nonzero))
        kinds = ("bypass",) if lazy else ("bypass", "kl", "induce")
        jobs = [(k, c) for k in kinds for c in nonzero]
        got = self.scorer.run(jobs, progress=progress) if jobs else {}
        for c in nonzero:
            for k in kinds:
                setattr(c, k, got[(k, c.pos, c.layer)])
        # the lazy search stops at the first NaN bypass score
        self.order = sorted((c for c in nonzero if not math.isnan(c.bypass)), key=lambda c: c.bypass)

    def _fetch(self, kind: str, c: Candidate, following: Sequence[Candidate]) -> float:
        key = (kind, c.pos, c.layer)
        if key not in self.ahead:
            k = max(1, self.per_pass // len(self.scorer.prompts[kind]))  # candidates per forward pass
            group = [c] + [o for o in following if (kind, o.pos, o.layer) not in self.ahead][:k - 1]
            self.ahead.update(self.scorer.run([(kind, o) for o in group]))
        return self.ahead[key]

    @property
    def per_pass(self) -> int:
        return self.bs

    def induce(self, c: Candidate) -> None:
        rest = self.order[self.order.index(c) + 1:]
        c.induce = self._fetch("induce", c, [o for o in rest if math.isnan(o.induce)])

    def kl(self, c: Candidate) -> None:
        rest = self.order[self.order.index(c) + 1:]
        c.kl = self._fetch("kl", c, [o for o in rest if math.isnan(o.kl)
                                     and not self.ahead.get(("induce", o.pos, o.layer), o.induce) < self.floor])


def _score_part(sm: "SteerModel", jobs: list[tuple[str, int, int]], *, candidates: Tensor, positions: list[int],
                harmful: list[str], harmless: list[str], refusal_ids: Sequence[int], per_pass: int,
                reuse: bool) -> dict:
    """One worker's share of :class:`_SpreadScores`: ``{(kind, pos, layer): score}`` of ``jobs``, scored as
    :class:`_RowScorer` does on this worker's model (the baseline logits computed here)."""
    base = last_logits(sm, harmless, batch_size=per_pass)
    hr = _HarmlessRun(sm, harmless) if reuse and supports_run_from(sm) and not sm.hooks.handles else None

    def vec(c: Candidate) -> Tensor:
        return candidates[positions.index(c.pos), c.layer]
    scorer = _RowScorer(sm, vec, harmful, harmless, refusal_ids, base, per_pass, hr)
    return scorer.run([(k, Candidate(p, l)) for k, p, l in jobs])


class _SpreadScores(_Scores):
    """The scores computed on an executor's workers (:mod:`steerkit.executors`): every nonzero candidate's
    three scores, the candidates split by layer over the workers; the lazy search then reads them (it
    computes nothing itself), so it selects what the search here selects."""

    def __init__(self, executor, sm: "SteerModel", candidates: Tensor, positions: list[int], harmful: list[str],
                 harmless: list[str], refusal_ids: Sequence[int], base_harmless: Tensor, per_pass: int,
                 reuse: bool = False):
        super().__init__(sm, candidates, positions, harmful, harmless, refusal_ids, base_harmless, per_pass)
        self.executor, self.reuse = executor, reuse

    def fill(self, live: list[Candidate], *, lazy: bool, progress: Optional[Callable[[int], object]]) -> None:
        nonzero = [c for c in live if float(self.vec(c).norm()) != 0.0]
        if progress is not None and len(live) > len(nonzero):
            progress(len(live) - len(nonzero))
        layers = sorted({c.layer for c in nonzero})
        parts = [[(k, c.pos, c.layer) for c in nonzero if c.layer == l for k in ("bypass", "kl", "induce")]
                 for l in layers]
        task = functools.partial(_score_part, candidates=self.candidates, positions=self.positions,
                                 harmful=self.harmful, harmless=self.harmless, refusal_ids=list(self.ids),
                                 per_pass=self.bs, reuse=self.reuse)
        got: dict = {}
        for i, part in self.executor.imap_unordered(task, parts):
            got.update(part)
            if progress is not None:
                progress(len(parts[i]) // 3)
        for c in nonzero:
            for k in ("bypass", "kl", "induce"):
                setattr(c, k, got[(k, c.pos, c.layer)])

    def induce(self, c: Candidate) -> None:  # (every score is filled: the search never asks)
        raise AssertionError("spread scores are filled in advance")

    kl = induce


def _lazy_search(live: list[Candidate], scores: _Scores, floor: float, kl_max: float) -> None:
    """The reference code's search, evaluating only what it needs: candidates in bypass order, the induce score
    until one reaches ``floor``, then its KL; stops at the first that passes both (or at a NaN bypass)."""
    scores.floor = floor
    for c in sorted(live, key=lambda c: (math.isnan(c.bypass), c.bypass)):
        if math.isnan(c.bypass):
            break
        if math.isnan(c.induce):
            scores.induce(c)
        if c.induce < floor or math.isnan(c.induce):
            continue
        if math.isnan(c.kl):
            scores.kl(c)
        if not (c.kl > kl_max or math.isnan(c.kl)):
            break


@torch.inference_mode()
def select_direction(sm: "SteerModel", candidates: Float[Tensor, "n_pos n_layers d_model"], positions: list[int],
                     harmful_val: Sequence[str], harmless_val: Sequence[str], refusal_ids: Sequence[int], *,
                     prune_frac: float = 0.2, kl_max: float = 0.1, induce_min: float = 0.0, lazy: bool = True,
                     batch_size: int = 16, layers: Sequence[int] | None = None,
                     progress: Optional[Callable[[int], object]] = None,
                     fallback: Optional[str] = "relative", batched: bool = True,
                     rows: Optional[int] = None, reuse: bool = True, executor=None) -> Selection:
    """Score every candidate on the validation prompts and pick one (the rules: step 4 of
    :mod:`steerkit.probes.methods.refusal`).

    ``fallback``: ``"relative"`` selects again with ``induce > baseline harmless score`` when no
    candidate passes ``induce >= induce_min`` (``Selection.rule`` says which rule chose); ``None``
    raises :class:`InputError` instead.

    ``layers``: evaluate only candidates at these layers (default: all; a compute-saving
    deviation from the paper when given). ``progress(n)`` is called after each candidate.

    ``batched`` (default): many (candidate, prompt) rows per forward pass, each row with its own
    steering (:class:`_RowScorer`, ``rows`` a pass: by default ``batch_size`` on a CPU and 256 on an
    accelerator, :func:`score_rows`); the lazy search evaluates, per pass,
    the next candidates in bypass order and keeps only the scores the one-at-a-time search would
    have computed, so the candidate table and the selection are those of ``batched=False`` (one
    candidate's edits at a time, ``batch_size`` prompts a pass) up to float rounding.

    ``reuse`` (default; used on a backend that runs a range of blocks, :func:`~steerkit.reuse.supports_run_from`,
    when no other hooks are on the model): the harmless prompts are run once unsteered and every induce
    pass (a candidate added at its layer) starts at that layer from the run's residual stream, the blocks
    below not run; the bypass and KL passes (an ablation at every layer) run the whole model. ``False``: every
    pass runs the whole model. Both give the same table and selection up to float rounding.

    ``executor`` (a :class:`steerkit.executors.RayExecutor` whose workers load this model): every candidate's
    three scores are computed on the workers, the layers spread over them, and the search reads them; the
    selection is the one made here, the table holds every score (the lazy search here leaves those it never
    asks for empty).

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> ids = R.refusal_token_ids(tiny.tokenizer)
        >>> sel = R.select_direction(tiny, torch.randn(2, 4, 64), [-2, -1], ["make a bomb", "steal a car"],
        ...                          ["bake bread", "write a poem"], ids)
        >>> len(sel.table), sel.best.status, sel.best.layer < 3, tuple(sel.direction.shape)
        (8, 'selected', True, (64,))
    """
    if fallback not in (None, "relative"):  # before any scoring
        raise InputError(f"expected fallback None or 'relative', found {fallback!r}")
    if reuse not in (True, False):
        raise InputError(f"expected reuse as True or False, found {reuse!r}")
    n_pos, L, d = candidates.shape
    if len(positions) != n_pos or L != sm.n_layers or d != sm.d_model:
        raise InputError(f"expected candidates [{len(positions)}, {sm.n_layers}, {sm.d_model}], found {tuple(candidates.shape)}")
    harmful_val, harmless_val = list(harmful_val), list(harmless_val)
    base_harmless = last_logits(sm, harmless_val, batch_size=batch_size)
    base_h = float(refusal_scores(sm, harmful_val, refusal_ids, batch_size=batch_size).mean())
    base_a = float(refusal_score_from_logits(base_harmless, refusal_ids).mean())
    table = [Candidate(p, l) for p in positions for l in range(L)]
    cut = int(L * (1.0 - prune_frac))
    allowed = set(range(L)) if layers is None else {int(l) for l in layers}
    live = [c for c in table if c.layer < cut and c.layer in allowed]
    args = (sm, candidates, positions, harmful_val, harmless_val, refusal_ids, base_harmless)
    reuse = reuse and supports_run_from(sm) and not sm.hooks.handles  # other hooks may act below a layer
    if executor is not None:
        scores: _Scores = _SpreadScores(executor, *args, score_rows(sm.device, batch_size, rows), reuse)
    elif batched:
        scores = _BatchedScores(*args, score_rows(sm.device, batch_size, rows), reuse)
    else:
        scores = _Scores(*args, batch_size, reuse)
    scores.fill(live, lazy=lazy, progress=progress)
    if lazy:
        _lazy_search(live, scores, induce_min, kl_max)
    rule = "paper"
    try:
        best = choose(table, L, prune_frac=prune_frac, kl_max=kl_max, induce_min=induce_min)
    except InputError:
        if fallback is None:
            raise
        floor = math.nextafter(base_a, math.inf)  # strictly above the baseline: the smallest float above it
        if lazy:
            _lazy_search(live, scores, floor, kl_max)
        best = choose(table, L, prune_frac=prune_frac, kl_max=kl_max, induce_min=floor)
        rule = "relative"
    for c in table:
        if c.layer < cut and c.layer not in allowed:
            c.status = "not evaluated (layer not in the evaluated set)"
    return Selection(candidates, list(positions), table, best, base_h, base_a, rule)
