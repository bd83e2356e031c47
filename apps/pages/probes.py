"""The Probes page: the layer x position AUROC heatmap of a saved probe sweep of the results folder
(or an uploaded sweep table), per method."""
from __future__ import annotations

import numpy as np
from dash import Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

from steerkit.errors import InputError

from .. import figures
from .. import io as saved
from .common import Context, decode_upload, explain, name_of, note, ok, uploaded


def register(app, c: Context) -> None:
    """Wire the Probes page."""
    env = c.env

    @app.callback(Output("probe-file", "options"), Output("probe-file", "value"),
                  Input("url", "pathname"), Input("probe-rescan", "n_clicks"), Input("probe-upload-data", "data"),
                  State("probe-file", "value"))
    def probe_files(path, _, upload, current):
        opts = [{"label": rel, "value": rel} for rel in saved.scan_sweeps(env.results_path)]
        try:
            up = uploaded(upload)
        except InputError:
            up = None
        if up:
            opts.insert(0, {"label": f"uploaded: {up[0]}", "value": "upload"})
        values = [o["value"] for o in opts]
        if ctx.triggered_id == "probe-upload-data" and up:
            return opts, "upload"
        return opts, current if current in values else (values[0] if values else None)

    @app.callback(Output("probe-upload-data", "data"), Output("probe-status", "children", allow_duplicate=True),
                  Input("probe-upload", "contents"), State("probe-upload", "filename"), prevent_initial_call=True)
    def probe_upload(contents, filename):
        try:
            text = decode_upload(contents, filename)
            saved.parse_sweep(text, name_of(filename))
            return {"name": name_of(filename), "text": text}, no_update
        except PreventUpdate:
            raise
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("probe-heatmap", "figure"), Output("probe-status", "children"),
                  Output("probe-method", "options"), Output("probe-method", "value"),
                  Input("probe-file", "value"), Input("probe-method", "value"), State("probe-upload-data", "data"))
    def probe_heatmap(value, method, upload):
        if not value:
            msg = note(["No probe sweep results yet — run ", html.Code("steerkit probe sweep --pos P --neg N "
                        f"--out {env.results_path}/NAME_sweep.json"), " (or save a ", html.Code("steerkit.probes"),
                        " sweep with ", html.Code(".save('..._sweep.json')"), ") under ", html.Code(env.results_path),
                        ", or upload a sweep table here."])
            return figures.empty_figure("No probe sweep yet"), msg, [], None
        try:
            method = method if ctx.triggered_id == "probe-method" else None
            if method is not None and not isinstance(method, str):
                raise InputError(f"expected a method name, found {type(method).__name__}")
            up = uploaded(upload) if value == "upload" else None
            if up is not None:
                sw = saved.parse_sweep(up[1], up[0], method=method)
            else:
                sw = saved.read_sweep(env.results_path, value, method=method)
            best = sw.best_per_layer()
            i = int(np.nanargmax(best))
            opts = [{"label": m, "value": m} for m in sw.methods]
            what = f" ({sw.method})" if sw.method else ""
            return (figures.probe_heatmap(sw), ok(f"{sw.name}{what}: {len(sw.layers)} layers × {len(sw.positions)} "
                                                  f"positions; best AUROC {best[i]:.3f} at layer {sw.layers[i]}."),
                    opts, sw.method or None)
        except Exception as e:  # noqa: BLE001
            return figures.empty_figure("Could not read this sweep"), explain(e), [], None
