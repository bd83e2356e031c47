"""steerkit.probes: finding directions in the residual stream.

This package will hold the direction finders (difference of means, PCA of
paired differences, logistic probes) with per-layer sweeps and their metrics,
and the published methods built on them: the refusal direction (Arditi et al.
2024), the first-token refusal probe, the hidden critique vector, the temporal
divergence profile with Temporal Activation Injection, the efficient-reasoning
region with QP projection, MI peaks and CAA. Every finder takes activations
recorded through :meth:`steerkit.SteerModel.record` and returns artifacts that
:mod:`steerkit.vectors` stores.
"""
