"""steerkit.apps: the local visual explorer (Plotly Dash).

Start it with ``steerkit app`` or ``python -m steerkit.apps`` (127.0.0.1:8050 by default).
Pages: Profiles (layer-wise divergence of paired prompts, per-pair values, logit lens), Probes
(saved AUROC sweeps), Steer (baseline vs steered generations, streamed, tokens coloured by their
projection), Patching (activation / attribution patching of a clean into a corrupted prompt as a
layer x position or layer x head heatmap, with each cell's per-position detail), Attention (a
prompt's attention patterns at a layer, one head or all), Tune (a stored direction over a grid of
layers x scales with ``steerkit.probes.tune``, or a saved tune result: trade-off curves, a metric
heatmap, a cell's generations next to the baseline's), Features (a stored sparse autoencoder's latents: the
ones that fire most on a text, one latent's top contexts, density, logit effects and nearest latents over a
set of texts), Circuits (the pruned attribution graph of a prompt through stored transcoders, a feature node's
contexts, pinned features grouped into supernodes, clamped and saved), Store (artifacts, provenance, exports) and
Diagnostics (residual norm, sink attention, MI per step). Modules: :mod:`.data` (built-in contrast sets, prompt and layer parsing),
:mod:`.analysis` (result dataclasses and the computations over a model, one module per page), :mod:`.io`
(readers of saved sweep and MI results), :mod:`.figures` (pure figure functions, usable in notebooks;
with :mod:`.figures_circuits`, the modules that import plotly), :mod:`.layout`, :mod:`.pages` (one module per page, each wiring
its callbacks), :mod:`.callbacks` (wires every page), :mod:`.runtime` (model host, threaded
background-callback manager) and :mod:`.app` (``create_app`` / ``run``).

The app trusts no request: it answers only requests whose ``Host`` / ``Origin`` name the local
machine (or an ``--allowed-host``), reads files only through :class:`steerkit.storage.files.Folder`
inside its results folder, loads only the models its picker listed or a path typed into the model
box, and bounds every value a request carries (the ``MAX_*`` limits of :mod:`.data`) and the time
of model work per request.
"""
if __name__ != "steerkit.apps":  # found as a top-level `apps` from a checkout's root: steerkit/_rootnames.py
    import runpy
    runpy.run_path(f"{__path__[0]}/../steerkit/_rootnames.py")["hand_over"](__name__)
