"""Result objects and the computations behind the explorer's pages, over a :class:`steerkit.SteerModel`,
one module per page.

The app's page modules (:mod:`steerkit.apps.pages`) call these functions, and so can a notebook. Each
result is a dataclass that the figure functions in :mod:`steerkit.apps.figures` turn into Plotly
figures; nothing here imports a plotting library.

* :mod:`.profile`: :func:`divergence_profile` -> :class:`DivergenceProfile`: per layer, the relative
  divergence ``||h_l(a) - h_l(b)|| / ||h_l(a)||`` and the cosine of ``h_l(a)``, ``h_l(b)`` at the last
  prompt token, for every pair, plus the logit-lens top tokens of the mean difference at each layer.
* :mod:`.common`: :class:`Cancelled` and the helpers the computations share. The logit lens of a
  residual-space vector (its top and bottom tokens) is :func:`steerkit.probes.lens.vector_lens`; its old name
  here, ``logit_lens``, still works and warns.
* :mod:`.steering`: :func:`steer_setting` -> :class:`SteerSetting`, the Steer page's settings as
  :class:`steerkit.Intervention` s, always through an artifact's own ``to_interventions`` (a direction
  that is not stored is built into one by :func:`direction_artifacts`); :func:`steer_compare` ->
  :class:`SteerResult`: baseline and steered generations of one prompt in one batch with per-row
  steering (streamable), each token with its projection on the direction.
* :mod:`.diagnostics`: :func:`layer_diagnostics` -> :class:`LayerDiagnostics`: residual norm and sink
  attention per layer.
* :mod:`.patching`: :func:`patching_run` -> :class:`PatchingRun`: activation and / or attribution
  patching of a clean into a corrupted prompt (:func:`steerkit.probes.activation_patching`), a layer x
  position or layer x head grid; :func:`head_detail` -> :class:`HeadDetail`: one head patched per position.
* :mod:`.attention`: :func:`attention_patterns` -> :class:`AttentionPatterns`: every head's
  ``attn.hook_pattern`` at a layer.
* :mod:`.tune`: :func:`tune_run` -> :class:`TuneRun`: :func:`steerkit.probes.tune.tune` over a layers x
  scales grid, one layer per call (progress, cancel and the time limit between layers), merged into one
  tune result.
* :mod:`.features`: :func:`find_latents` -> :class:`steerkit.probes.TopLatents` (the latents of a stored SAE
  that fire most on a text) and :func:`feature_run` -> :class:`FeatureRun`:
  :func:`steerkit.probes.feature_report` of one latent over a set of texts, one batch of texts per call
  (progress, cancel and the time limit between batches, :func:`read_chunks`), merged into one report by
  :func:`merge_reports`.

* :mod:`.circuits`: :func:`circuit_run` -> :class:`CircuitRun`: the attribution graph of a prompt through
  stored transcoders (:func:`steerkit.probes.attribution_graph`, progress and cancel between batches of rows),
  pruned, with the nodes and edges a figure draws (:class:`CircuitNode`); :func:`node_report`: a feature node's
  report through its block's transcoder as an SAE (``Transcoders.layer_sae``), the Features page's
  :func:`feature_run`; :func:`graph_contexts` -> :class:`GraphContexts`: every drawn feature node's top contexts
  and density at once (:func:`steerkit.probes.feature_contexts`, one pass per batch for every block), which the
  figure's hover shows; :func:`supernode_effect` (``steerkit.probes.intervene_graph``) and
  :func:`supernode_artifact` (``steerkit.probes.supernode_clamp``): a supernode clamped, and saved.

Long computations take ``progress(done, total)`` and ``should_stop()`` callables; when
``should_stop()`` turns true they raise :class:`Cancelled` between batches (or tokens).
"""
from __future__ import annotations

import time  # noqa: F401 - the computations' clock (``time.monotonic``), patched by tests through this name

from .attention import AttentionPatterns, attention_patterns
from .circuits import (
    CircuitNode, CircuitRun, GraphContexts, circuit_run, describe_node, drawn, graph_contexts, node_report,
    pinned_nodes, supernode_artifact, supernode_effect,
)
from . import common as _common
from .common import Cancelled, read_chunks
from .diagnostics import LayerDiagnostics, layer_diagnostics
from .features import (
    FeatureRun, feature_run, find_latents, merge_contexts, merge_reports, report_texts, text_chunks,
)
from .patching import HeadDetail, PatchingRun, head_detail, patching_run
from .profile import DivergenceProfile, divergence_profile
from .steering import (
    OPERATIONS, STEERABLE, SteerResult, SteerSetting, artifact_interventions, direction_artifacts, steer_compare,
    steer_setting,
)
from .tune import TuneRun, merge_tunes, tune_run

__all__ = [
    "AttentionPatterns", "Cancelled", "CircuitNode", "CircuitRun", "circuit_run", "describe_node", "drawn",
    "node_report", "pinned_nodes", "supernode_artifact", "supernode_effect", "GraphContexts", "graph_contexts",
    "DivergenceProfile", "FeatureRun", "HeadDetail", "LayerDiagnostics", "merge_contexts", "read_chunks",
    "report_texts", "text_chunks",
    "OPERATIONS", "PatchingRun", "STEERABLE", "SteerResult", "SteerSetting", "TuneRun", "artifact_interventions",
    "attention_patterns", "direction_artifacts", "divergence_profile", "feature_run", "find_latents", "head_detail",
    "layer_diagnostics", "merge_reports", "merge_tunes", "patching_run", "steer_compare",
    "steer_setting", "tune_run",
]


def __getattr__(name: str):
    if name == "logit_lens":  # renamed steerkit.probes.lens.vector_lens (it warns there)
        return _common.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
