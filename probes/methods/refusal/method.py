"""The whole refusal method: :func:`run_refusal` (with a progress callback) and :func:`run` (tqdm bars), stage by
stage: data, recording and filtering, candidates, selection, evaluation on held-out prompts, the probe."""
from __future__ import annotations

import contextlib
import math
import sys
from collections import Counter
from typing import TYPE_CHECKING, Callable, Optional

from tqdm import tqdm

from .candidates import filter_by_score, mean_diff, record_resid_pre
from .config import RefusalConfig, check_config
from .data import post_instruction_positions, probe_splits, refusal_token_ids, sample_splits
from .judge import Judge, generate_batched, judge_refusals, substring_judge
from .probe import refusal_probe
from .result import ProbeResult, RefusalResult, direction_artifacts
from .score import last_logits, refusal_score_from_logits, refusal_scores
from .select import select_direction

if TYPE_CHECKING:
    from steerkit.model import SteerModel
    from steerkit.vectors import DirectionSet, SteeringVector

StageProgress = Callable[[str, int, int], object]  # progress(stage, n_done_increment, total)


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ..., ``11th``, ``12th``, ``13th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def run_refusal(sm: "SteerModel", config: RefusalConfig | None = None, *, judge: Judge = substring_judge,
                progress: Optional[StageProgress] = None,
                log: Callable[[str], None] = lambda s: None, executor=None) -> RefusalResult:
    """Run the whole method on ``sm``: data, filtering, candidates, selection, evaluation, probe.

    ``progress(stage, n_done_increment, total)``: optional progress callback. ``executor`` (a
    :class:`steerkit.executors.RayExecutor` whose workers load this model): the candidates are scored on its
    workers (:func:`select_direction`); every other stage runs here on ``sm``.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> cfg = R.RefusalConfig(n_train=4, n_val=2, n_test=2, max_new_tokens=4, min_keep=1, probe=False,
        ...                       n_positions=2)
        >>> stages = []
        >>> res = R.run_refusal(tiny, cfg, progress=lambda stage, n, total: stages.append(stage))
        >>> list(dict.fromkeys(stages)), res.positions, sorted(res.metrics["refusal_rate"])[:2]
        (['record train', 'select', 'generate test'], [-2, -1], ['harmful_test_ablated', 'harmful_test_baseline'])
    """
    cfg = config or RefusalConfig()
    tick = _ticker(progress)
    data = sample_splits(cfg.n_train, cfg.n_val, cfg.n_test, cfg.seed)
    rid = refusal_token_ids(sm.tokenizer, cfg.refusal_words)
    rtoks = [sm.tokenizer.decode([i]) for i in rid]
    positions, ptoks, notes = _candidate_positions(sm, cfg)
    log(f"refusal tokens {rtoks} ids {rid}; post-instruction positions {positions} {ptoks}")
    acts, keep = _record_and_filter(sm, cfg, data, positions, rid, notes, tick)
    idx = {k: [i for i, p in enumerate(data["train"][k]) if p in set(keep[("train", k)])] for k in acts}
    cands = mean_diff(acts["harmful"][idx["harmful"]], acts["harmless"][idx["harmless"]])  # [n_pos, L, d]
    cut = int(sm.n_layers * (1 - cfg.prune_frac))
    sel = select_direction(sm, cands, positions, keep[("val", "harmful")], keep[("val", "harmless")], rid,
                           prune_frac=cfg.prune_frac, kl_max=cfg.kl_max, induce_min=cfg.induce_min, lazy=cfg.lazy,
                           fallback=cfg.fallback, batched=cfg.batched, rows=cfg.score_rows,
                           batch_size=cfg.batch_size, layers=range(0, sm.n_layers, cfg.layer_step),
                           progress=tick("select", len(positions) * len(range(0, cut, cfg.layer_step))),
                           executor=executor)
    b = sel.best
    if sel.rule == "relative":
        notes.append(f"no candidate passed the paper's induce >= {cfg.induce_min:g} rule (the harmless refusal "
                     f"score stays below it with every candidate added); selected with the relaxed rule "
                     f"induce > baseline harmless score ({sel.baseline_harmless:.3f}), KL and layer rules unchanged")
    log(f"selected layer {b.layer} position {b.pos}: bypass {b.bypass:.3f} induce {b.induce:.3f} kl {b.kl:.4f}")
    saved = direction_artifacts(sm, sel, metrics={})  # what the result saves, built before it is measured
    rate, score, samples = _evaluate(sm, cfg, data["test"], rid, saved, judge, tick)
    probe_res = _probe(sm, cfg, tick, log) if cfg.probe else None
    first = {kind: _first_tokens(sm, data["test"][kind], cfg.batch_size) for kind in ("harmful", "harmless")}
    metrics = {
        "layer": b.layer, "position": b.pos, "position_token": ptoks[positions.index(b.pos)],
        "bypass": b.bypass, "induce": b.induce, "kl": b.kl, "selection_rule": sel.rule,
        "baseline_harmful_val": sel.baseline_harmful, "baseline_harmless_val": sel.baseline_harmless,
        "direction_norm": float(sel.direction.norm()), "refusal_rate": rate, "refusal_score": score,
        "refusal_tokens": rtoks, "refusal_ids": rid, "n_candidates": len(sel.table),
        "n_evaluated_bypass": sum(1 for c in sel.table if not math.isnan(c.bypass)),
        "n_evaluated_induce": sum(1 for c in sel.table if not math.isnan(c.induce)),
        "n_kept": {f"{s}_{k}": len(keep[(s, k)]) for (s, k) in keep},
    }
    return RefusalResult(sel, rid, rtoks, positions, ptoks, notes, metrics, samples, first, probe_res,
                         prompts={s: dict(v) for s, v in data.items()}, config=cfg)


def _ticker(progress: Optional[StageProgress]) -> Callable[[str, int], Optional[Callable[[int], object]]]:
    """``tick(stage, total)``: a ``progress(n)`` callback for one stage of ``progress(stage, n, total)`` (or
    ``None``)."""
    if progress is None:
        return lambda stage, total: None
    return lambda stage, total: (lambda n: progress(stage, n, total))


def _candidate_positions(sm: "SteerModel", cfg: RefusalConfig) -> tuple[list[int], list[str], list[str]]:
    """The post-instruction positions the candidates are taken at (the last ``n_positions`` when set), their
    tokens, and the notes that say what the config restricted."""
    positions, ptoks = post_instruction_positions(sm)
    notes: list[str] = []
    if cfg.n_positions is not None and cfg.n_positions < len(positions):
        positions, ptoks = positions[-cfg.n_positions:], ptoks[-cfg.n_positions:]
        notes.append(f"candidates restricted to the last {cfg.n_positions} post-instruction positions")
    if cfg.layer_step > 1:
        notes.append(f"candidates evaluated at every {_ordinal(cfg.layer_step)} layer only")
    return positions, ptoks, notes


def _record_and_filter(sm: "SteerModel", cfg: RefusalConfig, data: dict, positions: list[int], rid: list[int],
                       notes: list[str], tick: Callable) -> tuple[dict, dict]:
    """The train activations of each side (their refusal scores from the same passes) and the prompts kept
    by the filter on each split and side: ``({kind: acts}, {(split, kind): prompts})``; notes appended."""
    acts, scores = {}, {}
    for kind in ("harmful", "harmless"):
        acts[kind], scores[kind] = record_resid_pre(sm, data["train"][kind], positions, rid,
                                                    batch_size=cfg.batch_size,
                                                    progress=tick("record train", 2 * cfg.n_train))
    for kind in ("harmful", "harmless"):
        lg = last_logits(sm, data["val"][kind], batch_size=cfg.batch_size)
        scores[f"{kind}_val"] = refusal_score_from_logits(lg, rid)
    keep = {}
    for kind, refuses in (("harmful", True), ("harmless", False)):
        for split, key in (("train", kind), ("val", f"{kind}_val")):
            kept, note = filter_by_score(data[split][kind], scores[key], refuses=refuses, min_keep=cfg.min_keep)
            keep[(split, kind)] = kept
            notes.append(f"{kind} {split}: {note}")
    return acts, keep


def _evaluate(sm: "SteerModel", cfg: RefusalConfig, test: dict, rid: list[int],
              saved: tuple[SteeringVector, DirectionSet], judge: Judge, tick: Callable) -> tuple[dict, dict, dict]:
    """Refusal scores and judged greedy generations of the held-out test prompts: harmful ones at baseline and
    with the saved ablation (``saved``: :func:`direction_artifacts`), harmless ones at baseline and with the
    saved addition: ``(rate, score, samples)``."""
    added, ablated = saved
    rate, score, samples = {}, {}, {}
    gtick = tick("generate test", 4 * cfg.n_test)
    for kind, cond in (("harmful", "baseline"), ("harmful", "ablated"), ("harmless", "baseline"),
                       ("harmless", "added")):
        prompts = test[kind]
        ctx = (contextlib.nullcontext() if cond == "baseline" else
               sm.steer(ablated if cond == "ablated" else added, label=f"refusal: the saved {cond} steering"))
        with ctx:
            score[f"{kind}_test_{cond}"] = float(refusal_scores(sm, prompts, rid, batch_size=cfg.batch_size).mean())
            comps = generate_batched(sm, prompts, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                     progress=gtick)
        verdict = judge_refusals(judge, prompts, comps)
        rate[f"{kind}_test_{cond}"] = sum(verdict) / len(verdict)
        samples[f"{kind}_test_{cond}"] = [{"prompt": p, "completion": c, "refusal": r}
                                          for p, c, r in list(zip(prompts, comps, verdict))[:cfg.n_samples]]
    return rate, score, samples


def _probe(sm: "SteerModel", cfg: RefusalConfig, tick: Callable, log: Callable[[str], None]) -> ProbeResult:
    """The refusal probe on its own split: the vendored train files (CV) and val files (held out)."""
    ptrain, ptest = probe_splits(cfg.probe_n_train, cfg.probe_n_test, cfg.seed)
    n_probe = sum(len(v) for v in (*ptrain.values(), *ptest.values()))
    res = refusal_probe(sm, ptrain, ptest, batch_size=cfg.batch_size, seed=cfg.seed,
                        progress=tick("record probe train+held-out (2 tokens)", n_probe))
    pb = res.best
    log(f"refusal probe: {pb['position']} layer {pb['layer']}: train CV AUROC {pb['cv_auroc']:.3f}, "
        f"held-out AUROC {pb['test_auroc']:.3f}")
    return res


def _first_tokens(sm: "SteerModel", prompts: list[str], batch_size: int) -> dict[str, int]:
    """How often each token is the first of the greedy reply (the argmax of the next-token distribution),
    most frequent first."""
    counts = Counter(sm.tokenizer.decode([t]) for t in last_logits(sm, prompts, batch_size=batch_size).argmax(-1).tolist())
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


class _Bars:
    """``progress(stage, n, total)`` as one tqdm bar per stage on stderr."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.bar, self.stage = enabled, None, None

    def __call__(self, stage: str, n: int, total: int) -> None:
        if not self.enabled:
            return
        if stage != self.stage:
            self.close()
            self.bar = tqdm(total=total, desc=stage, file=sys.stderr, leave=True)
            self.stage = stage
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run(sm: "SteerModel", config: RefusalConfig | None = None, *, progress: bool = True,
        judge: Judge = substring_judge, log: Callable[[str], None] | None = None, executor=None) -> RefusalResult:
    """The whole method (:func:`run_refusal`) with a tqdm bar per stage on stderr (``progress=False``:
    none) and ``log`` lines (default: stderr when ``progress``); ``executor`` as there.

    Examples:
        >>> from steerkit.probes.methods import refusal as R
        >>> cfg = R.RefusalConfig(n_train=4, n_val=2, n_test=2, max_new_tokens=4, min_keep=1, probe=False,
        ...                       n_positions=2)
        >>> res = R.run(tiny, cfg, progress=False)  # progress=True: a tqdm bar per stage
        >>> res.metrics["layer"] < 3, res.metrics["position"] in (-2, -1), sorted(res.artifacts(tiny))
        (True, True, ['refusal-ablation', 'refusal-direction'])
    """
    cfg = check_config(config or RefusalConfig())
    if log is None:
        log = (lambda s: print(s, file=sys.stderr)) if progress else (lambda s: None)
    bars = _Bars(progress)
    try:
        return run_refusal(sm, cfg, judge=judge, progress=bars, log=log, executor=executor)
    finally:
        bars.close()
