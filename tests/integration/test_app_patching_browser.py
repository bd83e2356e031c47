"""The Patching and Attention pages in a real headless browser (Debian's chromium driven by Playwright).

Uses the server and page fixtures of tests/integration/test_app_browser.py (``python -m steerkit.apps`` with the
default model on a free 127.0.0.1 port). On the Patching page: runs the IOI default (" Mary" vs
" John", names swapped) on three layers of the resid_pre grid, waits for the heatmap, clicks a cell
and sees that layer's values over the 14 positions; downloads the heatmap as HTML; runs the z
(heads) grid on one layer, clicks a head and sees it patched at each position. On the Attention
page: one head's pattern with token labels on both axes, then every head as small multiples. No
browser console error is allowed.
"""
from __future__ import annotations

import pytest

from tests.integration import test_app_browser as browser
from tests.integration.test_app_browser import download, pick, shot, trace_points, wait_text, wait_trace

# the fixtures of tests/integration/test_app_browser.py: the app on a free port, a page of headless chromium
server, browser_page = browser.server, browser.browser_page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N_TOKENS = 14  # the IOI prompt's tokens in the default model


def click_cell(page, graph_id, x, y, axis=""):
    """Click the heatmap cell at data coordinates ``(x, y)`` of subplot axis ``axis`` ("" or "2")."""
    page.locator(f"#{graph_id}").scroll_into_view_if_needed()
    px, py = page.evaluate(
        "([g, x, y, a]) => { const d = document.querySelector('#' + g + ' .js-plotly-plot');"
        " const r = d.getBoundingClientRect(); const xa = d._fullLayout['xaxis' + a], ya = d._fullLayout['yaxis' + a];"
        " return [r.left + xa._offset + xa.l2p(x), r.top + ya._offset + ya.l2p(y)]; }", [graph_id, x, y, axis])
    page.mouse.click(px, py)


def heatmap_axes(page, graph_id, name):
    return page.evaluate("([g, n]) => { const d = document.querySelector('#' + g + ' .js-plotly-plot');"
                         " const t = d && d._fullData && d._fullData.find(t => t.name === n);"
                         " return t ? [Array.from(t.x), Array.from(t.y)] : null; }", [graph_id, name])


def ticktext(page, graph_id, axis):
    return page.evaluate("([g, a]) => Array.from(document.querySelector('#' + g + ' .js-plotly-plot')"
                         "._fullLayout[a].ticktext || [])", [graph_id, axis])


def test_patching_and_attention_pages(server, browser_page):
    page, errors = browser_page
    page.goto(server["url"] + "/patching")
    page.wait_for_selector("#patch-run")
    assert "Mary and John" in page.input_value("#patch-clean")
    assert page.input_value("#patch-answer") == " Mary" and page.input_value("#patch-wrong") == " John"

    # --- resid_pre on three layers: the heatmap, then a click shows that layer over positions
    page.fill("#patch-layers", "20-22")
    page.click("#patch-run")
    wait_text(page, "#patch-status", f"resid_pre: 3 layers × {N_TOKENS} positions")
    status = page.inner_text("#patch-status")
    assert "⚠" not in status, status
    wait_trace(page, "patch-heatmap", "activation")
    x, y = heatmap_axes(page, "patch-heatmap", "activation")
    assert x == list(range(N_TOKENS)) and y == [20, 21, 22]
    labels = ticktext(page, "patch-heatmap", "xaxis")
    assert labels[1] == "1 ' Mary'" and labels[3] == "3 ' John'"
    click_cell(page, "patch-heatmap", N_TOKENS - 1, 21)
    wait_text(page, "#patch-detail-status", f"Layer 21: resid_pre patched at each of {N_TOKENS} positions")
    wait_trace(page, "patch-detail", "activation")
    assert trace_points(page, "patch-detail", "activation") == N_TOKENS
    assert ticktext(page, "patch-detail", "xaxis")[1] == "1 ' Mary'"
    html_path = server["root"] / "patching.html"
    download(page, "#dl-patch-heatmap").save_as(html_path)
    text = html_path.read_text(encoding="utf-8")
    assert "activation patching" in text and "plotly" in text.lower()
    shot(page, server, "patching")

    # --- the z grid (heads) on one layer: a click patches that head at each position
    pick(page, "patch-hook", "z: attention heads (layer x head)")
    page.fill("#patch-layers", "21")
    page.click("#patch-run")
    wait_text(page, "#patch-status", "z: 1 layer × 9 heads")
    assert "⚠" not in page.inner_text("#patch-status")
    page.wait_for_function("() => { const d = document.querySelector('#patch-heatmap .js-plotly-plot');"
                           " return d && d._fullData"
                           " && d._fullData.some(t => t.name === 'activation' && t.x.length === 9); }")
    click_cell(page, "patch-heatmap", 3, 21)
    wait_text(page, "#patch-detail-status", f"Head L21H3 patched at each of {N_TOKENS} positions separately")
    page.wait_for_function("(n) => { const d = document.querySelector('#patch-detail .js-plotly-plot');"
                           " return d && d.layout && JSON.stringify(d.layout.title).includes('L21H3'); }", arg=N_TOKENS)
    assert trace_points(page, "patch-detail", "activation") == N_TOKENS
    shot(page, server, "patching_heads")

    # --- Attention: one head with token labels on both axes, then every head of the layer
    page.click("#nav-attention")
    page.wait_for_selector("#attn-run")
    page.fill("#attn-head", "3")
    page.press("#attn-head", "Enter")
    page.fill("#attn-layer", "5")
    page.press("#attn-layer", "Enter")
    wait_text(page, "#attn-status", f"Layer 5: 9 heads × {N_TOKENS} tokens")
    wait_trace(page, "attn-pattern", "L5H3")
    xt, yt = ticktext(page, "attn-pattern", "xaxis"), ticktext(page, "attn-pattern", "yaxis")
    assert xt == yt and len(xt) == N_TOKENS and xt[1] == "1 ' Mary'"
    shot(page, server, "attention")
    page.click("#attn-view input[value=all]")
    page.wait_for_function("() => { const d = document.querySelector('#attn-pattern .js-plotly-plot');"
                           " return d && d.data && d.data.length === 9; }")
    download(page, "#dl-attn-pattern").save_as(server["root"] / "attention.html")
    assert "L5H8" in (server["root"] / "attention.html").read_text(encoding="utf-8")
    shot(page, server, "attention_all_heads")
    assert not errors, "browser console errors:\n" + "\n".join(errors)
