"""The Circuits page's supernodes at work: the picked supernode clamped on the graph's own prompt
(:func:`steerkit.apps.analysis.supernode_effect`, :func:`steerkit.probes.intervene_graph`: a background job), its
effect drawn (:func:`steerkit.apps.figures.effect_figure`: the top next tokens before and after, each logit target's
change), and the clamp saved to the store (:func:`steerkit.apps.analysis.supernode_artifact`,
:func:`steerkit.probes.supernode_clamp`: a :class:`steerkit.vectors.LatentClamp` that ``sm.steer`` and a served
request apply like any artifact). The clamp steers through its own ``to_interventions``, as every stored artifact
does; the page holds no formula of its own.
"""
from __future__ import annotations

from dash import Input, Output, State, no_update

from steerkit.errors import InputError
from steerkit.probes import GraphIntervention

from .. import analysis, figures
from ..data import MAX_SUPERNODE_NAME_CHARS, check_text
from ..runtime import cache_key
from .circuits import checked_groups, current_run, graph_transcoders, own
from .common import MAX_NAME_CHARS, Context, background, count, explain, key_of, ok


def supernode_of(c: Context, data, groups, name):
    """``(graph, supernode name, its nodes)``: the picked supernode of the page's state, checked against the graph
    kept on the server."""
    run = current_run(c, data)
    name = check_text(name, "a supernode", MAX_SUPERNODE_NAME_CHARS).strip()
    for g in checked_groups(run, own(groups, data, "groups", [])):
        if g["name"] == name:
            return run, name, g["nodes"]
    raise InputError(f"expected a supernode of this graph, found {name!r:.80}; pin features and group them first")


def effect_text(effect: GraphIntervention) -> str:
    """The intervention in a sentence: the top next token before and after, each target's logit change."""
    b, a = effect.top()[0], effect.top(after=True)[0]
    targets = "; ".join(f"{c['token']!r} {c['logit_change']:+.3f} (p {c['prob_before']:.3f} -> {c['prob_after']:.3f})"
                        for c in effect.target_changes())
    return (f"top next token {b['token']!r} ({b['prob']:.1%}) -> {a['token']!r} ({a['prob']:.1%}); "
            f"logit targets: {targets}")


def register(app, c: Context) -> None:
    """Wire the intervention on a supernode and its saving."""
    host = c.host

    @app.callback(
        Output("circ-effect-key", "data"), Output("circ-int-status", "children"),
        Input("circ-int-run", "n_clicks"), State("circ-key", "data"), State("circ-supernode", "value"),
        State("circ-supernodes", "data"), State("circ-mode", "value"), State("circ-scale", "value"),
        State("circ-tc", "value"), **background("circ-int", interval=400))
    def intervene(set_progress, _, data, name, groups, mode, amount, ref):
        """``analysis.supernode_effect``: the graph's prompt with the supernode's features clamped."""
        try:
            run, name, nodes = supernode_of(c, data, groups, name)
            tc = graph_transcoders(c, run, ref)
            sm = host.get()
            key = cache_key("circuit-effect", sm.name, key_of(data), nodes, mode, amount)
            effect, hit = host.cached(key, lambda: analysis.supernode_effect(sm, tc, run, nodes, mode=mode,
                                                                             amount=amount))
            how = f"scaled by {effect.amount:g}" if effect.how == "scale" else f"set to {effect.amount:g}"
            return {"key": key, "name": name}, ok(f"Supernode {name!r} ({count(nodes, 'feature')} {how} at their "
                                                  f"positions): {effect_text(effect)}" + (" (from the cache)" if hit
                                                                                          else ""))
        except Exception as e:  # noqa: BLE001
            return no_update, explain(e)

    @app.callback(Output("circ-effect", "figure"), Input("circ-effect-key", "data"))
    def draw_effect(data):
        effect = host.result(key_of(data))
        if not isinstance(effect, GraphIntervention):
            return figures.empty_figure("Group pinned features into a supernode and press Compute.")
        name = data.get("name") if isinstance(data, dict) and isinstance(data.get("name"), str) else ""
        return figures.effect_figure(effect, f"supernode {name[:MAX_SUPERNODE_NAME_CHARS]!r} clamped")

    @app.callback(Output("circ-save-status", "children"), Input("circ-save", "n_clicks"),
                  State("circ-save-name", "value"), State("circ-key", "data"), State("circ-supernode", "value"),
                  State("circ-supernodes", "data"), State("circ-mode", "value"), State("circ-scale", "value"),
                  State("circ-positions", "value"), State("circ-tc", "value"), prevent_initial_call=True)
    def save(_, store_name, data, name, groups, mode, amount, positions, ref):
        """``analysis.supernode_artifact`` saved to the store."""
        try:
            store_name = check_text(store_name, "a store name", MAX_NAME_CHARS).strip()
            if not store_name:
                raise InputError("expected a store name for the clamp, found nothing; type one")
            run, name, nodes = supernode_of(c, data, groups, name)
            tc = graph_transcoders(c, run, ref)
            clamp = analysis.supernode_artifact(tc, run, nodes, mode=mode, amount=amount, positions=positions)
            saved = c.store.save(store_name, clamp)
            where = "wherever its features fire" if positions == "all" else "at its nodes' positions"
            return ok(f"Saved supernode {name!r} as {saved}: a latent clamp of {count(nodes, 'feature')} over "
                      f"{count(clamp.parts, 'part')} (one per block and positions), acting {where}; "
                      f"sm.steer(store.load({saved!r})) applies it.")
        except Exception as e:  # noqa: BLE001
            return explain(e)
