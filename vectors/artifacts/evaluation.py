"""The one place in :mod:`steerkit.vectors.artifacts` that runs a model: a CAST condition's decisions
and similarities on prompts (:meth:`ConditionVector.fires` / :meth:`~ConditionVector.similarities`).

Why a module of its own: the artifacts are values (tensors, checks, payloads, lowering to
``Intervention``) that need no model; evaluating a condition does forward passes, installs hooks and
shows a progress bar. It uses the compiled evaluator conditional steering runs
(``steerkit.interventions.compile_steering`` with the condition alone), so a condition fires here exactly when it
fires under ``sm.steer(conditional_steering)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from tqdm.auto import tqdm

from steerkit.interventions import compile_steering

from ..apply import check_against
from ..errors import VectorsError

if TYPE_CHECKING:
    from steerkit.model import SteerModel

    from .condition import ConditionVector


def condition_outcomes(cv: "ConditionVector", sm: "SteerModel", prompts: str | Iterable[str], *,
                       batch_size: int = 16, progress: bool = True) -> tuple[list[bool], list[float]]:
    """Whether ``cv`` fires on each prompt and each prompt's similarity, one forward pass per batch of
    ``batch_size`` prompts (with the chat template when ``cv.chat``); a progress bar over the batches
    when there are several and ``progress``.

    Examples:
        >>> from steerkit.vectors import ConditionVector
        >>> from steerkit.vectors.artifacts.evaluation import condition_outcomes
        >>> fired, sims = condition_outcomes(ConditionVector(torch.ones(64), layer=1, threshold=-1.0), tiny, ["Hello"])
        >>> fired, len(sims)
        ([True], 1)
    """
    rows = [prompts] if isinstance(prompts, str) else list(prompts)
    if not rows:
        raise VectorsError("expected at least one prompt to test the condition on, found none")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise VectorsError(f"expected batch_size as a positive int, found {batch_size!r:.60}")
    check_against(cv, sm.facts)
    cond = cv.to_condition()
    # the same compiled evaluator a conditional steering uses: a steering with this condition only
    compiled = compile_steering([], sm.facts, device=sm.device, dtype=sm.dtype, conditions=[cond])
    fired: list[bool] = []
    sims: list[float] = []
    with sm.hooks.install(compiled, label=f"condition {cond.site}"):
        starts = range(0, len(rows), batch_size)
        for i in tqdm(starts, desc="condition", disable=not progress or len(starts) < 2):
            sm.forward(rows[i:i + batch_size], chat=cv.chat)
            fired += [bool(b) for b in compiled.decisions[cond].tolist()]
            sims += [float(s) for s in compiled.similarities[cond].tolist()]
    return fired, sims
