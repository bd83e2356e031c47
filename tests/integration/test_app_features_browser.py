"""The Features page in a real headless browser (Debian's chromium driven by Playwright).

Uses the server and page fixtures of tests/integration/test_app_browser.py (``python -m steerkit.apps`` with the
default model on a free 127.0.0.1 port). Saves a random-weight SAE of the default model's width into the
app's store, picks it on the Features page, finds the latents that fire most on a text, clicks a row of
the table to select its latent, reads that latent over six texts, and sees the highlighted contexts and
the figure (histogram, logit effects, nearest latents), which downloads as HTML. No browser console error
is allowed.
"""
from __future__ import annotations

import pytest

from tests.integration import test_app_browser as browser
from tests.integration.test_app_browser import download, pick, shot, wait_text, wait_trace

# the fixtures of tests/integration/test_app_browser.py: the app on a free port, a page of headless chromium
server, browser_page = browser.server, browser.browser_page

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

D_MODEL, SITE, D_SAE = 576, "blocks.12.hook_resid_post", 256  # the default model's residual width
TEXT = "The cat sat on the mat because it was tired after the long walk."
TEXTS = [TEXT, "A dog chased the ball across the park.", "She poured a cup of coffee and read the news.",
         "The stock market fell sharply on Monday.", "Please translate this sentence into French.",
         "The recipe needs two eggs and a cup of flour."]


def save_sae(store_path):
    """A random ReLU SAE of the default model's width at ``SITE``, saved as ``browser-sae@1``."""
    import torch

    from steerkit.sae import SAEWeights
    from steerkit.vectors import SAE, Provenance, Store
    g = torch.Generator().manual_seed(0)
    W = torch.nn.functional.normalize(torch.randn(D_SAE, D_MODEL, generator=g), dim=-1)
    sae = SAE(SAEWeights(W.T.clone(), torch.zeros(D_SAE), W.clone(), torch.zeros(D_MODEL)), SITE,
              provenance=Provenance(model_name="SmolLM2-135M-Instruct", d_model=D_MODEL, n_layers=30))
    return Store(store_path).save("browser-sae", sae)


def test_find_a_latent_and_read_its_report(server, browser_page):
    page, errors = browser_page
    assert save_sae(server["store"]) == "browser-sae@1"
    page.goto(server["url"] + "/features")
    page.wait_for_selector("#feat-run")
    pick(page, "feat-sae", f"browser-sae@1 ({SITE}, {D_SAE} latents)")
    wait_text(page, "#feat-sae-status", "it fits")
    assert "⚠" not in page.inner_text("#feat-sae-status")

    # --- find: the table of the latents that fire most on the text
    page.fill("#feat-text", TEXT)
    page.fill("#feat-k", "5")
    page.click("#feat-find")
    wait_text(page, "#feat-find-status", "the 5 latents that fire most on these")
    assert "⚠" not in page.inner_text("#feat-find-status")
    cell = page.locator('#feat-table td[data-dash-column="latent"]')
    page.wait_for_function("() => document.querySelectorAll('#feat-table td[data-dash-column=\"latent\"]').length"
                           " === 5")
    latent = cell.nth(1).inner_text().strip()
    assert latent.isdigit() and 0 <= int(latent) < D_SAE
    cell.nth(1).click()  # a click on the row selects its latent
    page.wait_for_function("(v) => document.querySelector('#feat-latent').value === v", arg=latent)

    # --- report: the latent over six texts (the first the text it fired on)
    page.fill("#feat-texts", "\n".join(TEXTS))
    page.fill("#feat-top", "5")
    page.click("#feat-run")
    wait_text(page, "#feat-status", f"Latent {latent} of browser-sae@1 at {SITE}: density")
    status = page.inner_text("#feat-status")
    assert "⚠" not in status and "6 texts" in status, status
    page.wait_for_selector("#feat-contexts .feat-context")
    contexts = page.locator("#feat-contexts .feat-context")
    assert 1 <= contexts.count() <= 5
    assert contexts.first.locator("span[title]").count() > 1  # tokens, each with its activation on hover
    assert "density" in page.inner_text("#feat-contexts")
    wait_trace(page, "feat-figure", "activation")
    titles = page.evaluate("() => Array.from(document.querySelectorAll('#feat-figure .annotation-text'))"
                           ".map(a => a.textContent)")
    assert any("logit effect" in t for t in titles) and any("nearest latents" in t for t in titles), titles

    # --- the figure's download control
    assert page.locator("#dl-feat-figure").count() == 1
    html_path = server["root"] / "sae_feature.html"
    download(page, "#dl-feat-figure").save_as(html_path)
    assert f"latent {latent} at {SITE}" in html_path.read_text(encoding="utf-8")
    shot(page, server, "features")
    assert not errors, "browser console errors:\n" + "\n".join(errors)
