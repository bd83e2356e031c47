"""steerkit.probes: finding directions in the residual stream.

How it fits together
--------------------
* :mod:`.directions` -- direction finders on recorded activations (two labelled sets or one
  set with labels): :func:`diff_of_means`, :func:`pca_diff` and :func:`pca_center` (repeng's
  definitions), :func:`find_direction` -> :class:`Direction`, oriented so the positive class
  projects higher.
* :mod:`.contrast` -- contrastive prompt sets built from personas, system prompts and multi-turn
  templates with suffixes truncated at every token (:func:`contrast_pairs`, :func:`persona_pairs`),
  rendered with the model's chat template (:func:`render`) and recorded as ``(pos, neg)`` for the
  finders (:func:`contrast_activations`, :func:`contrast_direction`).
* :mod:`.linear` -- the logistic probe (``StandardScaler -> PCA -> LogisticRegression``,
  balanced) and every probe as a pickle-free :class:`steerkit.vectors.Probe`
  (:func:`fit_probe`, :func:`pipeline_to_probe`, :func:`probe_scores`).
* :mod:`.metrics` -- AUROC, Youden thresholds, balanced accuracy, bootstrap intervals, folds.
* :mod:`.sweep` -- :func:`sweep` (``sweep(sm, prompts, labels, ...)``): record once, then
  cross-validate every layer x position x method; :func:`sweep_activations` on recorded
  activations; a tidy :class:`SweepResult` that saves, plots and fits the chosen cell.
* :mod:`.scoring` -- :func:`score_prompts`: a stored probe scores new prompts.
* :mod:`.condition` -- :func:`fit_condition`: a CAST condition (Lee et al. 2024) fitted from two prompt
  sets (a direction per layer, then the layer x threshold x comparator grid searched for F1) as a
  :class:`steerkit.vectors.ConditionVector`; :func:`condition_confusion` scores it on held-out prompts.
* :mod:`.patching` -- :func:`activation_patching` (clean activations patched into a corrupted run one
  site at a time, many sites per forward pass) and :func:`attribution_patching` (its gradient
  approximation) over residual, sub-layer, head and neuron sites, :func:`logit_diff_metric`, and a
  :class:`PatchingResult` that normalises, saves and plots.
* :mod:`.train` -- steering vectors trained by gradient through the fused kernel's backward:
  :func:`train_bipo` (bi-directional preference optimisation, Cao et al. 2024) and
  :func:`train_promptless` (target completions), :func:`preference_margins`, :class:`TrainResult`.
* :mod:`.tune` -- :func:`tune`: a layer x strength grid for an artifact or a direction, each cell
  scored on the concept (a probe, a judge callable or substring rules, with bootstrap intervals) and
  on what it breaks (perplexity under the unsteered model, next-token KL on neutral prompts,
  repetition), with its Pareto front and a recommended cell by a stated :class:`Rule`
  (:class:`TuneResult`).
* :mod:`.lens` -- :func:`logit_lens` (each layer's residual through the final norm and the
  unembedding, :class:`LensResult`) and :func:`direct_logit_attribution` (the logit difference split
  into embedding, attention, MLP and head contributions, :class:`DLAResult`).
* :mod:`.sae_train` -- :func:`train_sae`: a TopK sparse autoencoder trained with EleutherAI's sparsify (the
  ``sae`` extra) on the loaded model, run only up to the SAE's layer, on :mod:`.sae_corpus`'s text (the
  vendored public-domain corpus or the user's), written as sparsify's folder and read back as a
  :class:`steerkit.vectors.SAE` (:class:`SAETrainResult`); :mod:`.transcoder_train` -- :func:`train_transcoders`:
  a TopK transcoder for every chosen block in one pass, checkpointed and resumable
  (:class:`TranscoderTrainResult`); :mod:`.sae_metrics` -- L0, explained variance,
  dead latents and CE loss recovered (:func:`reconstruction_metrics`, :func:`transcoder_metrics` for a replacement
  model); :mod:`.sae_eval` -- :func:`sae_eval`:
  sae-lens's evaluation (L0, explained variance, CE loss recovered) of an SAE on prompts, through the SAE's
  hook sites (``sm.attach_sae``); :mod:`.sae_features` -- :func:`feature_report` (a latent's top contexts, density,
  logit effects and decoder neighbours, :class:`FeatureReport`), :func:`feature_contexts` (many latents' top
  contexts and densities, at several sites, in one pass per batch: :class:`~.sae_features.LatentContexts`),
  :func:`top_latents` (the latents that fire most on a text) and :func:`latent_attribution` (attribution
  patching over the latents, checked against activation patching, :class:`LatentAttribution`).
* :mod:`.attribution` -- :func:`attribution_graph`: a prompt traced through a model's transcoders
  (:class:`steerkit.vectors.Transcoders`) as circuit-tracer does, its replacement model written out and
  transposed; :mod:`.graph` -- the :class:`Graph` it returns (circuit-tracer's fields and node order),
  :func:`prune_graph`, :func:`compute_graph_scores` and :meth:`Graph.to_json`; :mod:`.graph_json` -- that
  frontend file (circuit-tracer's, checked against Neuronpedia's schema); :mod:`.graph_rows` -- where a graph's
  rows are kept while it is computed (in memory, or a temporary file with ``offload=``);
  :mod:`.attribution_batch` -- :func:`attribution_graphs`: many prompts' pruned graphs (:class:`PrunedGraph`), here
  or on Ray workers that load a :class:`CircuitSpec` once, and the features that recur across them
  (:class:`AttributionGraphs`); :mod:`.circuits` -- from a graph to a
  steering: :func:`supernode_clamp` (some feature nodes as a stored :class:`steerkit.vectors.LatentClamp` over
  their blocks, the transcoders' two-site clamps, at any prompt's positions or the nodes' own) and
  :func:`intervene_graph` (the graph's prompt run with them clamped: the top logits and each target's change,
  :class:`GraphIntervention`).
* ``steerkit probe fit|score|sweep`` (:mod:`steerkit.cli.probes`) wraps these; ``steerkit sae train``
  (:mod:`steerkit.cli.sae`) wraps :func:`train_sae` and, with ``--transcoder``, :func:`train_transcoders`.

The published methods built on these tools live in :mod:`steerkit.probes.methods` (the refusal
direction of Arditi et al. 2024 in :mod:`.methods.refusal`, the concise-reasoning region of Hou et
al. in :mod:`.methods.region`, ...), each with a config dataclass and ``run(sm, config)``, listed in
:data:`steerkit.probes.methods.REGISTRY`; their results save artifacts that :mod:`steerkit.vectors`
stores. ``import steerkit.probes`` does not import them (``steerkit.probes.methods`` loads on first use); their
names, which this package exported before, still work here and warn with their module
(``steerkit.probes.caa_vector`` is ``steerkit.probes.methods.caa.caa_vector``, :data:`METHOD_NAMES`).
"""
if __name__ != "steerkit.probes":  # found as a top-level `probes` from a checkout's root: steerkit/_rootnames.py
    import runpy
    runpy.run_path(f"{__path__[0]}/../steerkit/_rootnames.py")["hand_over"](__name__)
else:
    import importlib

    from steerkit.deprecation import moved

    from .directions import DIRECTION_METHODS, Direction, diff_of_means, find_direction, pca_center, pca_diff
    from .contrast import (SENTENCE_STARTERS, ContrastPair, contrast_activations, contrast_direction, contrast_pairs,
                           persona_pairs, render, render_messages, truncated_suffixes)
    from .linear import (METHODS, direction_to_probe, fit_logistic, fit_probe, logistic_pipeline, pipeline_to_probe,
                         probe_direction, probe_scores)
    from .metrics import auroc, balanced_accuracy, bootstrap_auroc_ci, youden_threshold
    from .scoring import score_prompts
    from .patching import PatchingResult, activation_patching, attribution_patching, logit_diff_metric
    from .lens import DLAResult, LensResult, direct_logit_attribution, logit_lens
    from .tune import Rule, TuneResult, tune
    from .sweep import SweepResult, cross_validate, labels_for, record_activations, sweep, sweep_activations
    from .condition import CONDITION_SITES, condition_confusion, f1_grid, fit_condition
    from .sae_corpus import CorpusChunks, read_corpus, split_chunks, token_chunks
    from .sae_metrics import ce_loss_recovered, dead_latents, explained_variance, l0, next_token_ce, reconstruction_metrics, transcoder_metrics
    from .sae_eval import sae_eval, special_token_ids
    from .sae_train import SAETrainResult, sae_layer, train_sae
    from .transcoder_train import TranscoderTrainResult, train_transcoders
    from .sae_features import (FeatureReport, LatentAttribution, TopLatents, feature_contexts, feature_report,
                               latent_attribution, top_latents)
    from .train import (ABItem, PreferencePair, TrainResult, as_pairs, bipo_loss, completion_logprobs, myopic_items,
                        pairs_hash, preference_margins, preference_pairs, train_bipo, train_promptless)
    from .graph import Graph, LogitTarget, PruneResult, compute_graph_scores, prune_graph
    from .attribution import attribution_graph
    from .attribution_batch import AttributionGraphs, CircuitSpec, PrunedGraph, attribution_graphs
    from .circuits import GraphIntervention, intervene_graph, supernode_clamp

    __all__ = [
        "DIRECTION_METHODS", "METHODS", "Direction", "diff_of_means", "pca_diff", "pca_center", "find_direction",
        "logistic_pipeline", "fit_logistic", "pipeline_to_probe", "direction_to_probe", "fit_probe", "probe_scores",
        "probe_direction", "auroc", "balanced_accuracy", "bootstrap_auroc_ci", "youden_threshold", "sweep", "labels_for",
        "sweep_activations", "record_activations", "cross_validate", "SweepResult", "score_prompts",
        "PatchingResult", "activation_patching", "attribution_patching", "logit_diff_metric",
        "LensResult", "logit_lens", "DLAResult", "direct_logit_attribution",
        "ContrastPair", "contrast_pairs", "persona_pairs", "truncated_suffixes", "render", "render_messages",
        "contrast_activations", "contrast_direction", "SENTENCE_STARTERS",
        "ABItem", "PreferencePair", "TrainResult", "as_pairs", "bipo_loss", "completion_logprobs", "myopic_items",
        "pairs_hash", "preference_margins", "preference_pairs", "train_bipo", "train_promptless",
        "tune", "TuneResult", "Rule",
        "CONDITION_SITES", "fit_condition", "condition_confusion", "f1_grid",
        "train_sae", "SAETrainResult", "sae_layer", "read_corpus", "token_chunks", "split_chunks", "CorpusChunks",
        "l0", "explained_variance", "next_token_ce", "ce_loss_recovered", "dead_latents", "reconstruction_metrics",
        "transcoder_metrics", "train_transcoders", "TranscoderTrainResult",
        "sae_eval", "special_token_ids", "feature_report", "FeatureReport", "feature_contexts", "latent_attribution",
        "LatentAttribution",
        "top_latents", "TopLatents",
        "attribution_graph", "Graph", "LogitTarget", "PruneResult", "prune_graph", "compute_graph_scores",
        "attribution_graphs", "AttributionGraphs", "PrunedGraph", "CircuitSpec",
        "supernode_clamp", "intervene_graph", "GraphIntervention",
    ]

    #: subpackages reachable as attributes (``steerkit.probes.methods``), imported on first use: the published
    #: methods load only when asked for
    SUBPACKAGES = ("methods", "plots")

    #: the published methods' names that ``steerkit.probes`` exported before, by their module under
    #: :mod:`steerkit.probes.methods`: ``steerkit.probes.<name>`` still works and warns with that place
    METHOD_NAMES = {
        "temporal": ("OrderItem", "Profile", "TemporalPair", "choice_accuracy", "choose_beta", "injection_spec",
                     "linear_decay", "order_questions", "per_input_taus", "profile_from_states", "steer_injection",
                     "temporal_pairs", "temporal_profile"),
        "norms": ("AttentionDrift", "NormChain", "NormProfile", "attention_drift", "norm_chain", "norm_profile"),
        "mi": ("THINKING_WORDS", "MITrajectory", "find_peaks", "hsic_mi", "mi_trajectory", "peak_token_counts",
               "thinking_eval", "thinking_token_ids"),
        "caa": ("AB_ITEMS", "after_instruction", "caa_activations", "caa_eval", "caa_vector", "matching_prob"),
        "region": ("CONCISE_PROMPT", "EVAL_PROMPT", "VERBOSE_PROMPT", "Problem", "RegionResult", "Solution",
                   "StepBoundaries", "arithmetic_problems", "fit_region", "gsm8k_problems", "parse_answer",
                   "region_eval", "region_features", "region_spec", "run_region", "steer_region", "step_boundaries",
                   "steering_positions"),
        "induction": ("InductionConfig", "InductionResult", "induction_scores", "repeated_tokens"),
        "ioi": ("IOIConfig", "IOIPair", "IOIResult", "ioi_pairs"),
        "critique": ("ArithTrace", "CritiqueResult", "CritiqueVector", "arithmetic_traces", "critique_activations",
                     "critique_sweep", "critique_vector", "detection_eval", "detection_scores", "f1_score",
                     "gsm8k_error_traces", "logit_lens_tokens", "run_critique", "steer_critique", "trace_pairs"),
    }
    _MOVED = {name: f"steerkit.probes.methods.{module}" for module, names in METHOD_NAMES.items() for name in names}

    def __getattr__(name: str):
        """The subpackages (:data:`SUBPACKAGES`) on first use, and the published methods' names with a
        ``DeprecationWarning`` naming their module (:data:`METHOD_NAMES`).

        Examples:
            >>> import warnings
            >>> import steerkit.probes as probes
            >>> probes.methods.REGISTRY["caa"].name
            'caa'
            >>> with warnings.catch_warnings(record=True) as w:
            ...     warnings.simplefilter("always")
            ...     fn = probes.caa_vector
            >>> fn is probes.methods.caa.caa_vector, str(w[0].message)
            (True, 'steerkit.probes.caa_vector is now steerkit.probes.methods.caa.caa_vector')
        """
        if name in SUBPACKAGES:
            return importlib.import_module(f"{__name__}.{name}")
        if name in _MOVED:
            return moved(__name__, name, _MOVED[name])
        if name == "inject":  # renamed steer_injection
            return moved(__name__, name, "steerkit.probes.methods.temporal", "steer_injection")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(SUBPACKAGES))
