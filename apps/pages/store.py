"""The Store page: the store's artifacts with their layers, method, model, metrics and tags; the
selected one's provenance; an export in any format (:func:`steerkit.vectors.export`)."""
from __future__ import annotations

import io
import json
import tempfile
import zipfile
from pathlib import Path

from dash import Input, Output, State, dcc, html, no_update

from steerkit.vectors import FORMATS, export

from .common import Context, explain, note, ok, selected_row, warn

#: the file extension of each export format (others: ``.bin``)
EXTENSIONS = {"llama.cpp": ".gguf", "repeng": ".gguf", "easysteer": ".gguf", "easysteer-v1": ".gguf", "tlens": ".json",
              "svec": ".svec", "safetensors": ".safetensors"}


def table_row(c: Context, r: dict, with_layers: bool) -> dict:
    """One row of the table: an index row with its metrics and (``with_layers``: loading it) layers."""
    layers, metrics = "", ""
    try:
        meta = c.store.show(r["ref"]).get("meta", {})
        m = (meta.get("provenance") or {}).get("metrics") or {}
        metrics = ", ".join(f"{k}={v:.3g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in list(m.items())[:4])
        if with_layers:
            art = c.store.load(r["ref"])
            ls = getattr(art, "layers", None)
            ls = ls if ls is not None else ([art.layer] if getattr(art, "layer", None) is not None else [])
            layers = ",".join(map(str, ls))
    except Exception:  # noqa: BLE001
        pass
    return {"ref": r["ref"], "kind": r.get("kind"), "layers": layers, "method": r.get("method"),
            "model": r.get("model_name"), "metrics": metrics, "tags": ",".join(r.get("tags", [])),
            "created": (r.get("created_at") or r.get("saved_at") or "")[:19]}


def exported(c: Context, ref: str, fmt: str) -> tuple[bytes, str]:
    """The stored artifact ``ref`` exported as ``fmt``: the file's bytes and name (several files: a zip)."""
    art = c.store.load(ref)
    stem = ref.replace("@", "_v")
    with tempfile.TemporaryDirectory() as d:
        paths = export(art, fmt, Path(d) / f"{stem}{EXTENSIONS.get(fmt, '.bin')}", model=c.host.get())
        if len(paths) == 1:
            return Path(paths[0]).read_bytes(), Path(paths[0]).name
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            for p in paths:
                z.write(p, Path(p).name)
        return buf.getvalue(), f"{stem}_{fmt}.zip"


def register(app, c: Context) -> None:
    """Wire the Store page."""
    env = c.env

    @app.callback(Output("store-table", "data"), Output("store-path", "children"), Output("store-status", "children"),
                  Output("store-table", "selected_rows"),
                  Input("store-refresh", "n_clicks"), Input("url", "pathname"), Input("prof-dir-status", "children"),
                  State("store-table", "selected_rows"), State("store-table", "data"))
    def store_rows(_, path, __, selected, old_rows):
        label = f"store: {env.store_path}"
        # a refresh keeps the selected artifact selected (a reset selection made a later export fail)
        row = selected_row(selected, old_rows)
        sel_ref = row["ref"] if row else None
        try:
            rows = c.store.list() if Path(env.store_path).exists() else []
            out = [table_row(c, r, len(rows) <= 60) for r in rows[:300]]
            if not out:
                msg = note(["No artifacts in this store yet — save one from the Profiles page, or ",
                            html.Code("steerkit vectors import FILE --name NAME"), "."])
            else:
                msg = f"{len(out)} artifact versions."
            if out == (old_rows if isinstance(old_rows, list) else []):
                # unchanged: leave the table (and a selection made since this request left) alone
                return no_update, label, msg, no_update
            refs = [r["ref"] for r in out]
            return out, label, msg, ([refs.index(sel_ref)] if sel_ref in refs else [])
        except Exception as e:  # noqa: BLE001
            return [], label, explain(e), []

    @app.callback(Output("store-detail", "children"), Input("store-table", "selected_rows"), State("store-table", "data"))
    def store_detail(sel, data):
        row = selected_row(sel, data)
        if row is None:
            return "Select an artifact to see its provenance."
        try:
            return json.dumps(c.store.show(row["ref"]), indent=1, default=str)[:20000]
        except Exception as e:  # noqa: BLE001
            return f"could not read it: {e}"

    @app.callback(Output("download-export", "data"), Output("store-export-status", "children"),
                  Input("store-export", "n_clicks"), State("store-table", "selected_rows"), State("store-table", "data"),
                  State("store-format", "value"), prevent_initial_call=True)
    def store_export(_, sel, data, fmt):
        row = selected_row(sel, data)
        if row is None:
            return no_update, warn("Select an artifact in the table first.")
        if not fmt or not isinstance(fmt, str) or fmt not in FORMATS:
            return no_update, warn("Choose an export format from the list first.")
        try:
            blob, fname = exported(c, row["ref"], fmt)
            return dcc.send_bytes(blob, fname), ok(f"Exported {row['ref']} as {fmt} ({fname}, {len(blob)} bytes).")
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)
