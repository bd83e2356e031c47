"""The Circuits page in a real headless browser (Debian's chromium driven by Playwright).

Uses the server and page fixtures of tests/integration/test_app_browser.py (``python -m steerkit.apps`` with the
default model on a free 127.0.0.1 port). Saves random-weight ReLU transcoders of the default model's width into
the app's store, picks them on the Circuits page, computes the attribution graph of a prompt, hovers a feature node
(its description shows), reads every drawn feature over the texts ("Read the drawn features") and hovers a feature
again (its density and top contexts show, the firing token marked), clicks it (it is selected, its contexts are read
over the texts), pins two features, groups
them into a supernode, clamps it to zero and sees the logits change, and saves the clamp to the store (and loads it
back). No browser
console error is allowed.
"""
from __future__ import annotations

import pytest

from tests.integration import test_app_browser as browser
from tests.integration.test_app_browser import pick, shot, wait_text, wait_trace

# the fixtures of tests/integration/test_app_browser.py: the app on a free port, a page of headless chromium
server, browser_page = browser.server, browser.browser_page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

D_MODEL, N_LAYERS, D_SAE = 576, 30, 64  # the default model's residual width and blocks
PROMPT = "The capital of France is"


def save_transcoders(store_path):
    """Random ReLU transcoders of the default model's width, saved as ``browser-tc@1``."""
    import torch

    from steerkit.vectors import Provenance, Store, Transcoders
    g = torch.Generator().manual_seed(0)
    L, d, n = N_LAYERS, D_MODEL, D_SAE
    tc = Transcoders([torch.randn(n, d, generator=g) for _ in range(L)], [torch.full((n,), -1.0)] * L,
                     [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
                     provenance=Provenance(model_name="SmolLM2-135M-Instruct", d_model=d, n_layers=L))
    return Store(store_path).save("browser-tc", tc)


def feature_nodes(page):
    """The drawn feature nodes' indices, in the figure's order."""
    return page.evaluate("() => Array.from(document.querySelector('#circ-graph .js-plotly-plot')._fullData"
                         ".find(t => t.name === 'features').customdata)")


def node_point(page, node):
    """Scroll feature ``node`` to the middle of the window; its position there."""
    return page.evaluate("""(node) => {
        const gd = document.querySelector('#circ-graph .js-plotly-plot');
        const t = gd._fullData.find(t => t.name === 'features');
        const i = Array.from(t.customdata).indexOf(node);
        const xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        let box = gd.getBoundingClientRect();
        window.scrollBy(0, box.top + ya._offset + ya.l2p(t.y[i]) - window.innerHeight / 2);
        box = gd.getBoundingClientRect();
        return [box.left + xa._offset + xa.l2p(t.x[i]), box.top + ya._offset + ya.l2p(t.y[i])];
    }""", node)


def click_node(page, node):
    x, y = node_point(page, node)
    page.mouse.move(x, y)
    page.mouse.click(x, y)


def test_graph_hover_pin_group_intervene_and_save(server, browser_page):
    page, errors = browser_page
    assert save_transcoders(server["store"]) == "browser-tc@1"
    page.goto(server["url"] + "/circuits")
    page.wait_for_selector("#circ-run")
    pick(page, "circ-tc", f"browser-tc@1 (relu, {N_LAYERS} blocks, {D_SAE} features a block)")
    wait_text(page, "#circ-tc-status", "they fit")
    assert "⚠" not in page.inner_text("#circ-tc-status")

    # --- the graph: computed in the background, drawn with tokens along x and logits on top
    page.fill("#circ-prompt", PROMPT)
    page.fill("#circ-features", "48")
    page.fill("#circ-logits", "3")
    page.click("#circ-run")
    wait_text(page, "#circ-status", "edges kept; top logits")
    status = page.inner_text("#circ-status")
    assert "⚠" not in status, status
    wait_trace(page, "circ-graph", "features")
    ticks = page.evaluate("() => document.querySelector('#circ-graph .js-plotly-plot')._fullLayout.xaxis.ticktext")
    assert any("France" in t for t in ticks) and len(ticks) == 6, ticks  # the special token in front, 5 tokens
    logits = page.evaluate("() => document.querySelector('#circ-graph .js-plotly-plot')._fullData"
                           ".find(t => t.name === 'logits').text")
    assert len(logits) == 3 and all("%" in t for t in logits), logits
    nodes = feature_nodes(page)
    assert len(nodes) >= 2, nodes

    # --- hover a feature: its description; click it: selected, described, its contexts read
    x, y = node_point(page, nodes[0])
    page.mouse.move(x, y)
    page.wait_for_selector("#circ-graph .hoverlayer .hovertext", timeout=30_000)
    assert "feature" in page.text_content("#circ-graph .hoverlayer .hovertext")

    # --- read every drawn feature over the texts: a feature's hover then shows its density and top contexts
    page.click("#circ-hover-run")
    wait_text(page, "#circ-hover-status", "hover a feature node")
    status = page.inner_text("#circ-hover-status")
    assert "⚠" not in status and "drawn feature node" in status, status
    page.wait_for_function("() => document.querySelector('#circ-graph .js-plotly-plot')._fullData"
                           ".find(t => t.name === 'features').hovertext.every(h => h.includes('density'))",
                           timeout=browser.STEP_TIMEOUT_MS)
    fired = page.evaluate("() => { const t = document.querySelector('#circ-graph .js-plotly-plot')._fullData"
                          ".find(t => t.name === 'features'); return Array.from(t.customdata)"
                          ".filter((c, i) => t.hovertext[i].includes('\u00ab')); }")
    assert fired, "a drawn feature fires on the texts"
    page.mouse.move(1, 1)
    x, y = node_point(page, fired[0])
    page.mouse.move(x, y)
    page.wait_for_function("() => { const h = document.querySelector('#circ-graph .hoverlayer .hovertext');"
                           " return !!h && h.textContent.includes('density'); }", timeout=browser.STEP_TIMEOUT_MS)
    label = page.text_content("#circ-graph .hoverlayer .hovertext")
    assert "«" in label and "»" in label and "tokens)" in label, label
    shot(page, server, "circuits_hover")
    click_node(page, nodes[0])
    wait_text(page, "#circ-node-info", f"node {nodes[0]}:")
    assert "strongest inputs" in page.inner_text("#circ-node-info")
    wait_text(page, "#circ-report-status", "density")
    assert "⚠" not in page.inner_text("#circ-report-status")
    page.wait_for_selector("#circ-contexts .feat-context")
    wait_trace(page, "circ-graph", "selected")

    # --- pin two features and group them
    page.click("#circ-pin")
    wait_text(page, "#circ-pin-status", "1 pinned node")
    click_node(page, nodes[1])
    wait_text(page, "#circ-node-info", f"node {nodes[1]}:")
    label = page.inner_text("#circ-node-info b").split(":", 1)[1].strip()
    wait_text(page, "#circ-report-status", f"{label}: density")  # the contexts follow the selection
    page.click("#circ-pin")
    wait_text(page, "#circ-pin-status", "2 pinned nodes")
    wait_trace(page, "circ-graph", "pinned")
    page.fill("#circ-supernode-name", "pair")
    page.click("#circ-group")
    wait_text(page, "#circ-group-status", "Supernode 'pair': 2 features")
    wait_text(page, "#circ-pinned-list", "supernode 'pair'")

    # --- intervene: the supernode's features off at their positions; the logits change
    page.fill("#circ-scale", "0")
    page.click("#circ-int-run")
    wait_text(page, "#circ-int-status", "Supernode 'pair' (2 features scaled by 0 at their positions)")
    status = page.inner_text("#circ-int-status")
    assert "⚠" not in status and "top next token" in status, status
    wait_trace(page, "circ-effect", "logit change")
    changes = page.evaluate("() => Array.from(document.querySelector('#circ-effect .js-plotly-plot')._fullData"
                            ".find(t => t.name === 'logit change').y)")
    assert len(changes) == 3 and any(abs(c) > 1e-6 for c in changes), changes
    before, after = (page.evaluate(f"() => Array.from(document.querySelector('#circ-effect .js-plotly-plot')"
                                   f"._fullData.find(t => t.name === '{n}').y)") for n in ("before", "after"))
    assert before != after

    # --- save the clamp to the store; it loads as a latent clamp with the graph's provenance
    page.fill("#circ-save-name", "pair-off")
    page.click("#circ-save")
    wait_text(page, "#circ-save-status", "Saved supernode 'pair' as pair-off@1")
    from steerkit.vectors import Store
    clamp = Store(server["store"]).load("pair-off@1")
    assert clamp.kind == "latent_clamp" and len(clamp.provenance.method_params["nodes"]) == 2
    shot(page, server, "circuits")
    assert not errors, "browser console errors:\n" + "\n".join(errors)
