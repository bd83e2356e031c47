"""The Circuits page's hover reports: "Read the drawn features" reads every feature node the figure draws over the
texts of the contexts card (``circ-dataset`` / ``circ-texts``) at once (:func:`steerkit.apps.analysis.graph_contexts`,
:func:`steerkit.probes.feature_contexts`: one model pass per batch of texts for every block; a background job with
progress, cancel and the time limit, a reading cut short kept as it is), and the figure's hover then shows each
feature's density and its strongest contexts (:func:`steerkit.apps.figures.circuit_figure` with ``contexts=``). The
page keeps ``{"key": graph key, "contexts": result key}``; the graph's figure checks it against the graph kept on the
server (:func:`.circuits.hover_contexts`) before it uses it. A click still selects a node and reads its full report
below.
"""
from __future__ import annotations

from dash import Input, Output, State, no_update

from .. import analysis, figures
from .. import data as inputs
from ..runtime import cache_key, should_stop
from .circuits import current_run, graph_transcoders
from .common import Context, background, cached_reading, count, explain, key_of, ok, ticker


def register(app, c: Context) -> None:
    """Wire "Read the drawn features"."""
    host, env = c.host, c.env

    @app.callback(
        Output("circ-hover-key", "data"), Output("circ-hover-status", "children"),
        Input("circ-hover-run", "n_clicks"), State("circ-key", "data"), State("circ-tc", "value"),
        State("circ-dataset", "value"), State("circ-texts", "value"), **background("circ-hover", interval=500))
    def read_drawn(set_progress, _, data, ref, dataset, texts):
        """``analysis.graph_contexts`` on the loaded model: progress, cancel and the time limit between batches."""
        try:
            run = current_run(c, data)
            texts = inputs.feature_texts(dataset, texts)
            tc = graph_transcoders(c, run, ref)
            sm = host.get()
            top = figures.HOVER_CONTEXTS
            key = cache_key("circuit-hover", sm.name, ref, key_of(data), texts, top)
            read, hit, key, cut = cached_reading(host, key, lambda: analysis.graph_contexts(
                sm, tc, run, texts, top=top, progress=ticker(set_progress), should_stop=should_stop,
                deadline=env.deadline), env.deadline)
            return {"key": key_of(data), "contexts": key}, ok(
                f"Read {count(range(read.n_features), 'feature')} ({count(read.nodes, 'drawn feature node')}) over "
                f"{count(read.texts, 'text')}: hover a feature node for its density and top contexts; "
                + ("from the cache." if hit else f"computed in {read.seconds:.1f}s.") + cut)
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)
