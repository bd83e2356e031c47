"""The refusal direction (Arditi et al. 2024, "Refusal in Language Models Is Mediated by a Single Direction").

Method, as published (reference code: github.com/andyrdt/refusal_direction):

1. **Refusal score** of a prompt: log-odds of the probability mass that the next-token
   distribution at the last prompt position puts on the model's refusal-start tokens
   (:func:`refusal_token_ids`, found from the tokenizer at run time; "I", "As" by default):
   ``log p_refuse - log(1 - p_refuse)`` with ``eps = 1e-8``, in float64.
2. **Filtering**: keep the harmful prompts the model refuses (score > 0) and the harmless prompts it
   does not (score < 0), when at least ``min_keep`` remain; otherwise keep the whole side and say so
   in the result's ``notes``.
3. **Candidates**: difference of means (harmful - harmless) of the residual stream at the input
   of every block (``blocks.{l}.hook_resid_pre``) and at every post-instruction position (the
   chat-template tokens after the instruction, :func:`post_instruction_positions`):
   ``[n_positions, n_layers, d_model]``.
4. **Selection** on validation prompts (:func:`select_direction`): for each candidate ``r``,
   *bypass score* = mean refusal score of harmful prompts with ``r`` ablated everywhere;
   *induce score* = mean refusal score of harmless prompts with the (unnormalised) candidate added
   at ``blocks.{l}.hook_resid_pre`` at every position; *KL* = mean KL(base || ablated) of the
   next-token distribution at the last position of harmless prompts. Candidates in the last 20%
   of layers, with KL > 0.1, with a negative induce score or with a NaN are discarded; the lowest
   bypass score wins. When *no* candidate passes (a small model that barely refuses: the induce
   score, an absolute log-odds, stays negative everywhere), ``fallback="relative"`` (the default)
   selects again with the induce rule relaxed to "addition raises the harmless refusal score above
   its baseline" (``induce > baseline``), keeps the layer and KL rules, and records this in
   ``Selection.rule`` and the result's notes; ``fallback=None`` raises instead, as the reference code
   would. ``lazy=True`` (the default) computes the bypass score of every candidate
   and the induce score and KL only in bypass order until one passes: the same winner as the
   exhaustive search, at about a third of the cost (``lazy=False`` fills the whole table).
   ``batched=True`` (the default) scores many candidates per forward pass: each row of a batch is
   one (candidate, prompt) pair with that candidate's own steering (a per-row steering list, one
   fused kernel call per site), rows sorted by prompt length; it fills the same table and selects
   the same candidate as ``batched=False`` (one candidate's edits per pass).
5. **Interventions**, each the artifact the method saves and its interventions (:mod:`.steering`):
   directional ablation ``x - r r^T x`` at the embedding output and every attention and MLP output at all
   positions (a ``DirectionSet`` acting everywhere, :func:`ablation_artifact`, :func:`ablation`); activation
   addition of the unnormalised direction at the selected layer's input (a ``SteeringVector``,
   :func:`addition_artifact`, :func:`addition`). The candidates are scored and the held-out prompts
   evaluated with exactly these, so what the method measures is what it stores; weight orthogonalisation (:func:`orthogonalize_weights`,
   :func:`save_orthogonalized`) that folds the ablation into the embedding, attention-output and
   MLP-output weights of a Llama-like model (:func:`steerkit.vectors.bake.bake_model`, the projection the
   GGUF export uses too) and saves a loadable Hugging Face folder.
6. **Evaluation**: refusal rate with a pluggable judge (:func:`substring_judge`, the common
   refusal-prefix list; any ``judge(prompts, completions) -> list[bool]``, e.g. a guard model)
   on greedy generations.

7. **Refusal probe** (:func:`refusal_probe`, saved as ``refusal-probe``): a harmful-vs-harmless
   logistic probe on ``resid_post`` whose position (the first generated token or a post-instruction
   template token, the last prompt token among them) and layer are chosen by cross-validation on its
   own train split (:func:`probe_splits`: every vendored train prompt; the vendored val prompts are
   held out); the provenance records the position, which :mod:`steerkit.probes.scoring` reads. The
   fits and the cross-validation are the project's probe stack (:mod:`steerkit.probes.linear`,
   :func:`steerkit.probes.sweep_activations`).
   :func:`first_token_probe` is the first-generated-token probe with judged generations (see the
   comment above it).

:func:`run` (``run(sm, RefusalConfig(...))``, with progress bars) and :func:`run_refusal` (with a
progress callback) run all of it; ``steerkit refusal`` is the command line. The
:class:`RefusalResult` gives its JSON report (``to_json``), a figure (``plot``) and the store
artifacts (``artifacts``).

Where each part lives (every name is re-exported here: ``from steerkit.probes.methods import refusal as R``):

* :mod:`.data` -- vendored instructions and splits, refusal tokens, post-instruction positions.
* :mod:`.score` -- last-position logits, refusal scores, KL.
* :mod:`.steering` -- the ablation and addition: the artifacts the method saves and their interventions.
* :mod:`.candidates` -- recorded ``resid_pre`` activations, filtering, difference of means.
* :mod:`.select` -- the candidate table and the selection rules (one candidate or many rows per pass).
* :mod:`.judge` -- greedy generations and the pluggable refusal judge.
* :mod:`.probe` -- the refusal probes.
* :mod:`.bake` -- weight orthogonalisation of the direction and its saved folder.
* :mod:`.result` -- :class:`ProbeResult`, :class:`RefusalResult` and the store artifacts; their figures are
  in :mod:`steerkit.probes.plots.refusal`.
* :mod:`.config` -- :class:`RefusalConfig`; :mod:`.method` -- :func:`run_refusal` and :func:`run`.
"""
from __future__ import annotations

from .bake import orthogonalize_weights, save_orthogonalized
from .candidates import filter_by_score, mean_diff, record_resid_pre
from .config import RefusalConfig, check_config
from .data import (DEFAULT_REFUSAL_WORDS, load_instructions, post_instruction_positions, probe_splits,
                   refusal_token_ids, sample_splits)
from .judge import REFUSAL_SUBSTRINGS, Judge, generate_batched, judge_refusals, substring_judge
from .method import run, run_refusal
from .probe import (LAST_PROMPT, best_row, first_token_activations, first_token_probe, heldout_auroc, probe_positions,
                    probe_rows, record_probe_activations, refusal_probe, select_probe_cell)
from .result import LABEL_KINDS, POSITIONS, ProbeResult, RefusalResult, direction_artifacts
from .score import EPS, kl_last, last_logits, refusal_score_from_logits, refusal_scores
from .select import (ACCELERATOR_SCORE_ROWS, Candidate, Selection, choose, discard_reason, score_rows,
                     select_direction)
from . import steering as _steering
from .steering import (ablation, ablation_artifact, ablation_interventions, addition, addition_artifact,
                       addition_interventions)

__all__ = [
    "DEFAULT_REFUSAL_WORDS", "REFUSAL_SUBSTRINGS", "EPS", "Judge", "ACCELERATOR_SCORE_ROWS",
    "POSITIONS", "LABEL_KINDS", "LAST_PROMPT",
    "load_instructions", "sample_splits", "probe_splits", "refusal_token_ids", "post_instruction_positions",
    "last_logits", "refusal_score_from_logits", "refusal_scores", "kl_last",
    "ablation", "addition", "ablation_interventions", "addition_interventions", "ablation_artifact",
    "addition_artifact",
    "record_resid_pre", "mean_diff", "filter_by_score",
    "Candidate", "discard_reason", "choose", "Selection", "score_rows", "select_direction",
    "orthogonalize_weights", "save_orthogonalized",
    "substring_judge", "judge_refusals", "generate_batched",
    "first_token_activations", "heldout_auroc", "ProbeResult", "probe_rows", "best_row", "first_token_probe",
    "probe_positions", "record_probe_activations", "select_probe_cell", "refusal_probe",
    "direction_artifacts", "RefusalConfig", "RefusalResult", "check_config", "run_refusal", "run",
]


def __getattr__(name: str):
    if name == "ABLATION_SITES":  # gone: the ablation acts where the saved DirectionSet does (it warns there)
        return _steering.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
