"""steerkit.apps: the local visual explorer (Plotly Dash).

Start it with ``steerkit app`` or ``python -m steerkit.apps`` (127.0.0.1:8050 by default).
Pages: Profiles (layer-wise divergence of paired prompts, per-pair values, logit lens), Probes
(saved AUROC sweeps), Steer (baseline vs steered generations, streamed, tokens coloured by their
projection), Store (artifacts, provenance, exports) and Diagnostics (residual norm, sink attention,
MI per step). Modules: :mod:`.data` (built-in contrast sets, prompt and layer parsing),
:mod:`.analysis` (result dataclasses and the computations over a model), :mod:`.io` (readers of saved
sweep and MI results), :mod:`.figures` (pure figure functions, usable in notebooks), :mod:`.layout`,
:mod:`.callbacks`, :mod:`.runtime` (model host, threaded background-callback manager) and :mod:`.app`
(``create_app`` / ``run``).
"""
