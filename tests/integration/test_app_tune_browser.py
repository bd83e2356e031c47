"""The Tune page in a real headless browser (Debian's chromium driven by Playwright).

Uses the server and page fixtures of tests/integration/test_app_browser.py (``python -m steerkit.apps`` with the
default model on a free 127.0.0.1 port). Loads a saved tune result (the hand-made ``RESULT`` of
tests/apps/test_app_tune.py) from the results folder, sees the recommended cell's generations next to the
baseline's, clicks a heatmap cell and a point of the trade-off curves and sees theirs, downloads the
heatmap as HTML; then tunes a direction saved from the Profiles page (harmful vs harmless mean
difference) over three layers x three scales on the default model in the page. No browser console
error is allowed.
"""
from __future__ import annotations

import json

import pytest

from tests.integration import test_app_browser as browser
from tests.integration.test_app_browser import download, pick, shot, wait_text, wait_trace
from tests.integration.test_app_patching_browser import click_cell
from tests.apps.test_app_tune import RESULT

# the fixtures of tests/integration/test_app_browser.py: the app on a free port, a page of headless chromium
server, browser_page = browser.server, browser.browser_page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def table_text(page):
    return page.inner_text("#tune-table")


def test_load_a_saved_tune_and_click_its_cells(server, browser_page):
    page, errors = browser_page
    (server["results"] / "hand_tune.json").write_text(json.dumps(RESULT), encoding="utf-8")
    page.goto(server["url"] + "/tune")
    page.wait_for_selector("#tune-run")
    pick(page, "tune-file", "hand_tune.json")
    wait_text(page, "#tune-file-status", "hand_tune.json: 2 layers × 3 scales on 2 prompts")
    assert "⚠" not in page.inner_text("#tune-file-status")
    wait_trace(page, "tune-tradeoff", "recommended")
    wait_trace(page, "tune-heatmap", "recommended")
    # the recommended cell is selected first: its generations next to the baseline's, one row per prompt
    wait_text(page, "#tune-cell-status", "Layer 2, scale 2 (recommended, on the Pareto front)")
    wait_text(page, "#tune-table", "We danced at a wedding.")
    text = table_text(page)
    assert "Tell me about your weekend." in text and "I went hiking." in text and "Breakfast for the bride." in text
    # a heatmap cell: layer 1 (row 0), scale 4 (column 2)
    click_cell(page, "tune-heatmap", 2, 0)
    wait_text(page, "#tune-cell-status", "Layer 1, scale 4")
    wait_text(page, "#tune-table", "wedding wedding wedding")
    assert "love love love" in table_text(page)
    # a point of the trade-off curves: layer 1 at scale 2 (KL 0.3, concept 0.5)
    click_cell(page, "tune-tradeoff", 0.3, 0.5)
    wait_text(page, "#tune-cell-status", "Layer 1, scale 2")
    wait_text(page, "#tune-table", "A wedding in the hills.")
    html_path = server["root"] / "tune_heatmap.html"
    download(page, "#dl-tune-heatmap").save_as(html_path)
    assert "per layer and scale" in html_path.read_text(encoding="utf-8")
    shot(page, server, "tune")
    assert not errors, "browser console errors:\n" + "\n".join(errors)


def test_tune_a_stored_direction_on_the_default_model(server, browser_page):
    """The computed path end to end, kept small (one layer x two scales, one prompt, six tokens)."""
    page, errors = browser_page
    browser.compute_profile(page, server["url"], "Harmful vs harmless", 2)
    page.fill("#prof-save-name", "refusal-dir")
    page.click("#prof-save")
    wait_text(page, "#prof-dir-status", "refusal-dir@1")
    page.click("#nav-tune")
    page.wait_for_selector("#tune-run")
    pick(page, "tune-artifact", "refusal-dir@1 (steering_vector, mean_difference)")
    page.wait_for_function("() => /^\\d+-\\d+$/.test(document.querySelector('#tune-layers').value)")
    lo, hi = map(int, page.input_value("#tune-layers").split("-"))
    assert hi - lo == 4 or lo == 0 or hi == 29  # the five layers around the vector's own layer
    layer = (lo + hi) // 2 if hi - lo == 4 else lo
    page.fill("#tune-layers", str(layer))
    page.fill("#tune-scales", "0, 4")
    page.fill("#tune-max", "6")
    page.fill("#tune-prompts", "Tell me about your weekend.")
    page.fill("#tune-neutral", "What is the capital of France?")
    page.fill("#tune-words", "sorry, cannot, can't, unable")
    page.click("#tune-run")
    wait_text(page, "#tune-status", "refusal-dir@1: 1 layer × 2 scales on 1 prompt;")
    status = page.inner_text("#tune-status")
    assert "⚠" not in status, status
    page.wait_for_function("() => { const d = document.querySelector('#tune-heatmap .js-plotly-plot');"
                           " return d && d._fullData && d._fullData.some(t => t.type === 'heatmap'"
                           " && t.z.length === 1 && t.z[0].length === 2); }")
    wait_trace(page, "tune-tradeoff", f"layer {layer}")
    wait_text(page, "#tune-cell-status", f"Layer {layer}, scale ")
    wait_text(page, "#tune-table", "Tell me about your weekend.")
    shot(page, server, "tune_computed")
    assert not errors, "browser console errors:\n" + "\n".join(errors)
