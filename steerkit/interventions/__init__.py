"""Interventions: the one value every way of steering lowers to, and the one step that compiles them.

An :class:`Intervention` says, at one site (a hook name), what to do to the activations: ``add`` a
vector, ``ablate`` an orthonormal basis, ``clamp`` projections to values, ``replace`` with a vector,
``patch`` in the values of another run, ``project`` into a polyhedral region, ``apply`` any callable, or
clamp a sparse autoencoder's ``latent`` activations with its error term kept;
optionally behind a conditional ``gate``, at some ``positions``, for some attention ``heads`` (experts at
``mlp.hook_expert_out``) or MLP ``neurons``, with norm preservation. A list of interventions is a *steering*.

Sites with structure (TransformerLens's component hooks) are seen by the kernel as rows of their
features: ``[.., heads, d_head]`` flattened to ``heads * d_head`` (per-expert outputs ``[.., n_experts,
d_model]`` the same way, an expert standing for a head), attention matrices
``[batch, heads, q, k]`` as ``[batch, q, heads * k]`` (positions select queries). ``heads=`` /
``neurons=`` are lowered by :func:`compile` to full-width tensors (a ``d_head`` vector placed at each
chosen head; a basis embedded head by head, which stays orthonormal) or to a feature mask (replace,
patch); an ``apply`` callable gets the natural shape.

Everything that steers lowers to interventions: keyword calls (``sm.edit(hook, add=v)``), kernel
specs (``{hook: SteerConfig}``), stored artifacts (``artifact.to_interventions(facts)``), a vLLM
request's spec, the app's Steer page and the published methods.

:func:`compile_steering` is the one lowering step: it turns the interventions of a batch (one steering for
every row, or one per row) into a :class:`CompiledSteering`, one :class:`SiteProgram` per site,
made once at registration: per site ONE kernel table holding every configuration a row can need
(the combination of that row's kernel interventions whose positions select a token), the fused call
bound once (:func:`steerkit.kernels.bind_steer`, the implementation chosen then), and the torch
steps (``replace`` / ``apply``). At run time a program only builds masks and row indices:

- local backends (hf, tlens, nnsight) call ``program(x, call)`` from their hook functions;
- the vLLM worker calls ``program.apply(h, groups, mask_of)`` on the flattened rows of a step.

Order at one site: the kernel's operations (ablate / clamp, gate, add, region, norm preservation),
then ``replace`` and ``apply`` in the order giv

The package, one concern a module: :mod:`~steerkit.interventions.facts` (:class:`ModelFacts`, its one
builder), :mod:`~steerkit.interventions.values` (:class:`Intervention`, :class:`Gate`),
:mod:`~steerkit.interventions.conditions` (CAST: :class:`Condition`, :class:`When`, :class:`Decisions`,
the one decision accumulator), :mod:`~steerkit.interventions.latents` (:class:`LatentEdit`: a sparse
autoencoder's latents clamped, what :meth:`Intervention.sae_latent` carries, a transcoder's across two sites
through the steering's one :class:`SiteReads`), :mod:`~steerkit.interventions.lower` (:class:`Steerable`, :func:`lower`, :func:`from_config`),
:mod:`~steerkit.interventions.program` (:func:`compile_steering`, :class:`SiteProgram`, :class:`CompiledSteering`)
and :mod:`~steerkit.interventions.server` (:func:`server_mask_of`). Every name is importable from
``steerkit.interventions``; so are the kernels' names the layers above use (:data:`MAX_HALFSPACES`,
:data:`MAX_M`, :class:`SteerConfigError`, :func:`orthonormalize`, :data:`ORTHO_TOL`, :class:`Polyhedron`):
only this package and :mod:`steerkit.serving` import :mod:`steerkit.kernels`.
"""
from __future__ import annotations

# what the layers above take from the kernels, through the core (only the core and serving import kernels)
from steerkit.kernels import MAX_HALFSPACES as MAX_HALFSPACES, MAX_M as MAX_M  # noqa: E401
from steerkit.kernels import ORTHO_TOL as ORTHO_TOL, Polyhedron as Polyhedron, SteerConfig as SteerConfig
from steerkit.kernels import SteerConfigError as SteerConfigError, SteerTable as SteerTable
from steerkit.kernels import bind_steer as bind_steer, orthonormalize as orthonormalize

from steerkit.interventions.conditions import (CONDITION_AGGREGATES, CONDITION_COMPARATORS, CONDITION_MEASURES, RULE_MODES, Condition,
                         Decisions, When, aggregate_rows, condition_similarity)
from steerkit.interventions.facts import ModelFacts
from steerkit.interventions.latents import LatentEdit, SiteReads, clamp_target, latent_indices, sae_weights
from steerkit.interventions.lower import Steerable, from_config, lower
from steerkit.interventions.program import (MAX_POSITION_SPECS, CompiledSteering, MaskOf, SiteProgram, TorchStep,
                                           compile as compile, compile_steering)
from steerkit.interventions.server import server_mask_of
from steerkit.interventions.values import KERNEL_OPS, OPS, Gate, Intervention, Op, Steering, kernel_config

__all__ = ["ModelFacts", "Intervention", "Gate", "Op", "OPS", "KERNEL_OPS", "Steering", "Condition", "When",
           "Decisions", "CONDITION_AGGREGATES", "CONDITION_COMPARATORS", "CONDITION_MEASURES", "RULE_MODES",
           "aggregate_rows", "condition_similarity", "Steerable", "lower", "from_config", "compile_steering",
           "kernel_config", "CompiledSteering", "TorchStep",
           "SiteProgram", "MaskOf", "MAX_POSITION_SPECS", "server_mask_of", "LatentEdit", "SiteReads", "clamp_target", "latent_indices",
           "sae_weights"]
