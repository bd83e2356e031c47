"""The running explorer in a real headless browser (Debian's chromium driven by Playwright).

Starts ``python -m steerkit.apps`` on a free 127.0.0.1 port with the default model, a temporary
store and results folder, then: opens every page; computes a divergence profile for 3 pairs and
checks one point per layer; saves the peak layer's direction; steers with it and moves the
strength slider (the steered text must change); exports the stored vector and a figure; checks
that the Probes and Diagnostics pages show the "no results yet" message and light up once results
exist; checks that bad input gives a message, not a traceback; steers with a stored direction set
(ablated everywhere); screenshots every page (in the test's temp dir; set ``STEERKIT_SCREENSHOTS=DIR`` to keep copies); and asserts that no page logged a
browser console error.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _servers import free_port, stop, wait_until_up

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

try:
    import dash  # noqa: F401
except ImportError:  # pragma: no cover
    pytest.skip("the app extra (dash) is not installed: pip install -e '.[app]'", allow_module_level=True)
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover
    pytest.skip("playwright is not installed (pip install -e '.[test]'); scripts/test.sh installs it",
                allow_module_level=True)
if not os.access(CHROMIUM, os.X_OK):  # pragma: no cover
    pytest.skip(f"{CHROMIUM} is missing and could not be installed (scripts/test.sh runs apt-get install chromium "
                "as root)", allow_module_level=True)

STEP_TIMEOUT_MS = 240_000



def download(page, selector, timeout_ms=120_000, tries=2):
    """Click ``selector`` and return the download; click again once if the first click's download
    never starts. On failure the error lists the app's last callback responses (see ``browser_page``)."""
    from playwright.sync_api import TimeoutError as PWTimeout
    for attempt in range(tries):
        try:
            with page.expect_download(timeout=timeout_ms) as dl:
                page.click(selector)
            return dl.value
        except PWTimeout:
            if attempt == tries - 1:
                log = getattr(page, "_steerkit_callbacks", [])
                raise AssertionError(f"no download after clicking {selector} {tries} times; last callback "
                                     "responses:\n" + "\n".join(map(str, log[-40:]))) from None


@pytest.fixture(scope="module")
def server(scratch):
    root = scratch("app")
    store, results = root / "store", root / "results"
    results.mkdir()
    port = free_port()
    # the app is its own program: keep settings other tests put in this process's environment out
    # of it (TRITON_INTERPRET from the kernel tests, OMP_WAIT_POLICY from the llama.cpp tests: with
    # them the app server has been seen to hang during the store export; the cause is not known)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OMP_WAIT_POLICY")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    log = open(root / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "steerkit.apps", "--port", str(port), "--threads", "1",
                             "--store", str(store), "--results", str(results)], stdout=log, stderr=subprocess.STDOUT,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(proc, url + "/", root / "server.log", 300, "the app")
    yield {"url": url, "root": root, "store": store, "results": results, "log": root / "server.log"}
    stop(proc)
    log.close()


@pytest.fixture(scope="module")
def browser_page(server):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1300, "height": 1000}, accept_downloads=True)
        page = context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
        # a record of the app's callback round trips, for the message of a failed download
        page._steerkit_callbacks = []

        def on_response(r):
            if "_dash-update-component" not in r.url:
                return
            try:
                out = json.loads(r.request.post_data or "{}").get("output", "?")
            except ValueError:
                out = "?"
            try:
                body = r.body()
                size = len(body) if len(body) > 400 else body.decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 - body gone (navigation)
                size = -1
            page._steerkit_callbacks.append((time.strftime("%H:%M:%S"), r.status, str(out)[:90], size))
        page.on("response", on_response)
        page.set_default_timeout(STEP_TIMEOUT_MS)
        yield page, errors
        browser.close()


def shot(page, server, name):
    path = server["root"] / "screenshots" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    keep = os.environ.get("STEERKIT_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)
    return path


def wait_text(page, selector, text):
    page.wait_for_function("([s, t]) => { const e = document.querySelector(s); return e && e.innerText.includes(t); }",
                           arg=[selector, text], timeout=STEP_TIMEOUT_MS)


def trace_points(page, graph_id, trace_name):
    return page.evaluate("([g, n]) => { const d = document.querySelector('#' + g + ' .js-plotly-plot');"
                         " const t = d && d.data && d.data.find(t => t.name === n); return t ? t.x.length : -1; }",
                         [graph_id, trace_name])


def wait_trace(page, graph_id, trace_name):
    page.wait_for_function("([g, n]) => { const d = document.querySelector('#' + g + ' .js-plotly-plot');"
                           " return !!(d && d.data && d.data.some(t => t.name === n)); }",
                           arg=[graph_id, trace_name], timeout=STEP_TIMEOUT_MS)


def test_every_page_end_to_end(server, browser_page):
    page, errors = browser_page
    url = server["url"]

    # --- Profiles: 3 temporal pairs -> one point per layer, peak marked
    page.goto(url + "/profiles")
    page.wait_for_selector("#prof-run")
    page.fill("#prof-n", "3")
    page.click("#prof-run")
    wait_text(page, "#prof-status", "layers")
    assert "⚠" not in page.inner_text("#prof-status")
    wait_trace(page, "prof-graph", "relative divergence")
    n_layers = 30
    assert trace_points(page, "prof-graph", "relative divergence") == n_layers
    assert trace_points(page, "prof-graph", "cosine similarity") == n_layers
    assert trace_points(page, "prof-graph", "peak") == 1
    wait_trace(page, "prof-lens", "promoted")
    wait_trace(page, "prof-pairs", "relative divergence")
    assert trace_points(page, "prof-pairs", "relative divergence") == 3

    # the figure downloads as standalone HTML
    html_path = server["root"] / "profile.html"
    download(page, "#dl-prof-graph").save_as(html_path)
    text = html_path.read_text(encoding="utf-8")
    assert "relative divergence" in text and "plotly" in text.lower() and len(text) > 1_000_000  # plotly.js inlined

    # keep the direction: for the Steer page and in the store
    page.click("#prof-use-dir")
    wait_text(page, "#prof-dir-status", "Steer page")
    page.fill("#prof-save-name", "e2e-direction")
    page.click("#prof-save")
    wait_text(page, "#prof-dir-status", "e2e-direction@1")
    shot(page, server, "profiles")

    # --- Steer: generate, then move the strength slider -> the steered text changes
    page.click("#nav-steer")
    page.wait_for_selector("#steer-run")
    page.fill("#steer-max", "12")
    page.click("#steer-run")
    wait_text(page, "#steer-status", "layers")
    assert "⚠" not in page.inner_text("#steer-status")
    base1, steered1 = page.inner_text("#steer-base"), page.inner_text("#steer-steered")
    assert base1.strip() and steered1.strip()
    track = page.locator("#steer-strength .dash-slider-track").bounding_box()
    # strength 4 -> 14 (range -16..16): click the track at (14 + 16) / 32
    page.mouse.click(track["x"] + track["width"] * (30 / 32), track["y"] + track["height"] / 2)
    page.wait_for_function("(t) => { const s = document.querySelector('#steer-status');"
                           " return s && s.innerText.includes('layers') && !s.innerText.includes('+ 4 ×')"
                           " && document.querySelector('#steer-steered').innerText !== t; }", arg=steered1,
                           timeout=STEP_TIMEOUT_MS)
    steered2 = page.inner_text("#steer-steered")
    assert steered2 != steered1
    assert page.inner_text("#steer-base") == base1  # the baseline does not depend on the strength
    assert page.locator("#steer-steered span[title]").count() > 0  # tokens coloured by projection
    shot(page, server, "steer")

    # --- Store: the saved vector is listed; export it
    page.click("#nav-store")
    page.click("#store-refresh")
    wait_text(page, "#store-table", "e2e-direction@1")
    page.locator("#store-table input[type=radio]").first.check()
    wait_text(page, "#store-detail", "mean_difference")
    out = server["root"] / "export.safetensors"
    download(page, "#store-export").save_as(out)
    from steerkit.vectors import load_artifact
    v = load_artifact(out)
    assert len(v.layers) == 1 and v.d_model == 576
    wait_text(page, "#store-export-status", "Exported")
    shot(page, server, "store")

    # --- Probes: a clear message without results; the heatmap once a sweep exists
    page.click("#nav-probes")
    wait_text(page, "#probe-status", "No probe sweep results yet")
    sweep = {"name": "e2e", "layers": list(range(n_layers)), "positions": ["-2", "-1", "last"],
             "auroc": [[0.5 + 0.015 * l, 0.55 + 0.014 * l, 0.6 + 0.013 * l] for l in range(n_layers)],
             "ci_low": [[0.45 + 0.015 * l] * 3 for l in range(n_layers)],
             "ci_high": [[0.6 + 0.013 * l] * 3 for l in range(n_layers)]}
    (server["results"] / "e2e_sweep.json").write_text(json.dumps(sweep))
    page.click("#probe-rescan")
    wait_text(page, "#probe-status", "best AUROC")
    page.wait_for_selector("#probe-heatmap .js-plotly-plot .heatmaplayer, #probe-heatmap .js-plotly-plot .hm")
    shot(page, server, "probes")

    # --- Diagnostics: residual norm and sink attention per layer; MI when a result exists
    (server["results"] / "mi_e2e.json").write_text(json.dumps(
        {"mi": [0.1, 0.2, 0.9, 0.3, 0.2, 1.1, 0.4], "tokens": ["I", " think", " so", ",", " but", " wait", "."]}))
    page.click("#nav-diagnostics")
    page.click("#diag-run")
    wait_text(page, "#diag-status", "layers")
    wait_trace(page, "diag-norm", "mean ‖h‖ (pos ≥ 1)")
    assert trace_points(page, "diag-norm", "mean ‖h‖ (pos ≥ 1)") == n_layers
    wait_trace(page, "diag-sink", "mean over heads")
    assert trace_points(page, "diag-sink", "mean over heads") == n_layers
    wait_trace(page, "diag-mi", "peaks")
    shot(page, server, "diagnostics")

    assert not errors, "browser console errors:\n" + "\n".join(errors)


def trace_y(page, graph_id, trace_name):
    # _fullData: plotly.js's decoded traces (``data`` may hold y as base64 "bdata")
    return page.evaluate("([g, n]) => { const d = document.querySelector('#' + g + ' .js-plotly-plot');"
                         " const t = d && d._fullData && d._fullData.find(t => t.name === n);"
                         " return t ? Array.from(t.y) : null; }",
                         [graph_id, trace_name])


def pick(page, dropdown_id, label):
    page.click(f"#{dropdown_id}")
    page.get_by_role("dialog").get_by_text(label, exact=True).click()  # the open menu, not the current value


def compute_profile(page, url, contrast_label, n):
    """Run a profile for ``n`` pairs of a built-in contrast on a fresh Profiles page."""
    page.goto(url + "/profiles")
    page.wait_for_selector("#prof-run")
    pick(page, "prof-contrast", contrast_label)
    page.fill("#prof-n", str(n))
    page.click("#prof-run")
    wait_text(page, "#prof-status", "layers")
    status = page.inner_text("#prof-status")
    assert "⚠" not in status, status
    wait_trace(page, "prof-graph", "relative divergence")
    return status


def test_harmful_and_steered_contrasts(server, browser_page):
    """The two other built-in contrasts, end to end (after the first test saved e2e-direction@1)."""
    page, errors = browser_page
    status = compute_profile(page, server["url"], "Harmful vs harmless", 2)
    assert status.startswith("Harmful vs harmless: 2 pairs × 30 layers")
    assert trace_points(page, "prof-graph", "relative divergence") == 30
    rel = trace_y(page, "prof-graph", "relative divergence")
    assert all(r > 0 for r in rel)  # different prompts differ at every layer

    # steered vs unsteered: the same prompts, A steered with the Steer page's settings
    page.click("#nav-steer")
    pick(page, "steer-artifact", "e2e-direction@1 (steering_vector, mean_difference)")
    page.wait_for_function("() => document.querySelector('#steer-layers').value !== ''")
    layer = int(page.input_value("#steer-layers"))
    page.click("#nav-profiles")
    pick(page, "prof-contrast", "Steered vs unsteered (Steer page settings)")
    page.fill("#prof-n", "2")
    page.click("#prof-run")
    wait_text(page, "#prof-status", "Steered vs unsteered (Steer page settings): 2 pairs × 30 layers")
    assert "⚠" not in page.inner_text("#prof-status")
    page.wait_for_function("() => { const d = document.querySelector('#prof-graph .js-plotly-plot');"
                           " return d && d.layout && JSON.stringify(d.layout.title).includes('steered'); }")
    rel = trace_y(page, "prof-graph", "relative divergence")
    assert len(rel) == 30
    # the vector is added at the output of block `layer`: nothing differs before it, everything after
    assert all(r == 0 for r in rel[:layer]), rel[:layer]
    assert all(r > 0 for r in rel[layer:]), rel[layer:]
    shot(page, server, "profiles_steered")
    assert not errors, "browser console errors:\n" + "\n".join(errors)


def test_model_picker_switches_every_page(server, browser_page, tmp_path):
    """Load a tiny random model from a folder in the page, profile on it, then go back to the default."""
    from tiny_models import N_LAYERS, tiny_model
    folder = tmp_path / "tiny-llama"
    m, tok = tiny_model("llama")
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    page, errors = browser_page
    page.goto(server["url"] + "/profiles")
    page.wait_for_selector("#model-load")
    assert "SmolLM2" in page.inner_text("#model-label")
    # a folder that is not a model: a message, and the current model stays
    page.fill("#model-path", str(folder.parent / "nothing-here"))
    page.click("#model-load")
    wait_text(page, "#model-status", "stays loaded")
    assert "Traceback" not in page.inner_text("#model-status")
    page.fill("#model-path", str(folder))
    page.click("#model-load")
    wait_text(page, "#model-status", "Loaded tiny-llama")
    wait_text(page, "#model-label", f"{N_LAYERS} layers")
    pick(page, "prof-contrast", "Temporal reversal pairs")
    page.fill("#prof-n", "2")
    page.click("#prof-run")
    wait_text(page, "#prof-status", f"× {N_LAYERS} layers")
    page.wait_for_function("(n) => { const d = document.querySelector('#prof-graph .js-plotly-plot');"
                           " const t = d && d.data && d.data.find(t => t.name === 'relative divergence');"
                           " return t && t.x.length === n; }", arg=N_LAYERS)
    assert trace_points(page, "prof-graph", "probe AUROC") == -1  # the 30-layer sweep is another model's
    assert "tiny-llama" in page.inner_text("#model-pick")
    shot(page, server, "profiles_model_picker")
    # back to the embedded default, picked from the list
    pick(page, "model-pick", "HuggingFaceTB/SmolLM2-135M-Instruct (embedded default)")
    page.click("#model-load")
    wait_text(page, "#model-status", "Loaded HuggingFaceTB/SmolLM2-135M-Instruct")
    wait_text(page, "#model-label", "30 layers")
    assert not errors, "browser console errors:\n" + "\n".join(errors)


def test_bad_input_shows_a_message(server, browser_page):
    page, errors = browser_page
    page.goto(server["url"] + "/profiles")
    page.wait_for_selector("#prof-contrast")
    page.click("#prof-contrast")
    page.get_by_text("My own two prompt lists").click()
    page.fill("#prof-a", "one\ntwo\nthree")
    page.fill("#prof-b", "uno\ndos")
    page.click("#prof-run")
    wait_text(page, "#prof-status", "equal length")
    status = page.inner_text("#prof-status")
    assert "Traceback" not in status and "found 3 prompts in A and 2 in B" in status
    page.fill("#prof-a", "")
    page.fill("#prof-b", "")
    page.click("#prof-run")
    wait_text(page, "#prof-status", "non-empty")
    # a vector made for another model (fingerprint differs): a message on the Steer page
    import torch

    from steerkit.vectors import SteeringVector, Store
    other = SteeringVector.from_direction(torch.ones(576), 5)
    other.provenance = other.provenance.replace(model_name="someone/else", model_fingerprint="sk1:" + "0" * 24,
                                                d_model=576, n_layers=30)
    Store(server["store"]).save("wrong-model", other)
    page.goto(server["url"] + "/steer")
    page.wait_for_selector("#steer-run")
    pick(page, "steer-artifact", "wrong-model@1 (steering_vector, ?)")
    page.fill("#steer-layers", "5")
    page.click("#steer-run")
    wait_text(page, "#steer-status", "fingerprint differs")
    status = page.inner_text("#steer-status")
    assert "Traceback" not in status and "someone/else" in status
    # a non-local bind is refused without the explicit flag
    r = subprocess.run([sys.executable, "-m", "steerkit.apps", "--host", "0.0.0.0", "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--allow-remote" in r.stderr
    assert not errors, "browser console errors:\n" + "\n".join(errors)


def test_stored_direction_set_steers(server, browser_page):
    """A DirectionSet from the store (ablated everywhere: layers=None) steers on the Steer page."""
    import torch

    from steerkit.vectors import DirectionSet, Store
    page, errors = browser_page
    basis = torch.randn(2, 576, generator=torch.Generator().manual_seed(0))
    Store(server["store"]).save("e2e-ablation", DirectionSet.from_directions(basis, method="e2e"))
    page.goto(server["url"] + "/steer")
    page.wait_for_selector("#steer-run")
    pick(page, "steer-artifact", "e2e-ablation@1 (direction_set, e2e)")
    page.wait_for_function("() => document.querySelector('#steer-layers').value === 'all'")
    page.fill("#steer-max", "8")
    page.click("#steer-run")
    wait_text(page, "#steer-status", "e2e-ablation@1 (direction set, k=2) at every write")
    status = page.inner_text("#steer-status")
    assert "⚠" not in status and "v ablated" in status, status
    assert page.inner_text("#steer-base").strip() and page.inner_text("#steer-steered").strip()
    assert page.locator("#steer-steered span[title]").count() > 0  # tokens coloured by projection
    # the ablation leaves no component along the first basis vector in the steered row
    titles = page.locator("#steer-steered span[title]").evaluate_all("els => els.map(e => e.title)")
    assert all(abs(float(t)) < 1e-2 for t in titles), titles
    shot(page, server, "steer_direction_set")
    assert not errors, "browser console errors:\n" + "\n".join(errors)
