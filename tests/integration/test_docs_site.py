"""The documentation site builds with ``mkdocs build --strict`` (no broken link, no missing reference, no
docstring griffe cannot read, docs/cli.md current), and its generated references hold the public names."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from steerkit.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).with_name("mkdocs")  # .venv's mkdocs (the `docs` extra)


def _top_level_verbs() -> list[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    raise AssertionError("steerkit's parser has no subcommands")


@pytest.fixture(scope="module")
def site(scratch) -> Path:
    assert MKDOCS.exists(), f"expected mkdocs next to {sys.executable} (the `docs` extra); run scripts/setup.sh"
    out = scratch("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _page(site: Path, name: str) -> str:
    path = site / name / "index.html"
    assert path.is_file(), f"expected the page {name}/ in the built site"
    return path.read_text(encoding="utf-8")


@pytest.mark.slow
def test_api_pages_document_the_public_names(site):
    anchors = {  # mkdocstrings gives every documented object an anchor of its dotted path
        "api/steerkit": ["steerkit.load_model", "steerkit.SteerModel", "steerkit.Intervention", "steerkit.SteerkitError"],
        "api/interventions": ["steerkit.interventions.Intervention", "steerkit.interventions.compile_steering"],
        "api/hooks": ["steerkit.hooks.manager.HookHandle", "steerkit.hooks.manager.ActivationCache"],
        "api/attention": ["steerkit.hooks.attention"],
        "api/quantize": ["steerkit.loading.quantize"],
        "api/probes": ["steerkit.probes.patching.activation_patching", "steerkit.probes.patching.attribution_patching",
                       "steerkit.probes.lens.logit_lens", "steerkit.probes.tune.tune", "steerkit.probes.train.train_bipo",
                       "steerkit.probes.condition.fit_condition", "steerkit.probes.contrast.contrast_pairs"],
        "api/methods": ["steerkit.probes.methods.REGISTRY", "steerkit.probes.methods.refusal",
                        "steerkit.probes.methods.ioi"],
        "api/vectors": ["steerkit.vectors.SteeringVector", "steerkit.vectors.Store", "steerkit.vectors.export"],
        "api/kernels": ["steerkit.kernels.fused_steer", "steerkit.kernels.bind_steer"],
        "api/serving": ["steerkit.serving.parse_spec", "steerkit.serving.request_body"],
    }
    for page, names in anchors.items():
        html = _page(site, page)
        for name in names:
            assert f'id="{name}"' in html, f"expected {name} documented on {page}/"


@pytest.mark.slow
def test_cli_page_lists_every_verb(site):
    html = _page(site, "cli")
    verbs = _top_level_verbs()
    assert len(verbs) >= 10
    for verb in verbs:
        assert f"<code>steerkit {verb}</code>" in html, f"expected a section for `steerkit {verb}` on the CLI page"
        assert f"usage: steerkit {verb}" in html, f"expected the help of `steerkit {verb}` on the CLI page"


@pytest.mark.slow
def test_pages_in_the_nav_are_built(site):
    for page in ["installation", "concepts", "app", "serving", "exports", "RESULTS", "reproductions/refusal",
                 "ARCHITECTURE", "BENCHMARKS", "SECURITY", "tutorials", "tutorials/06_tuning", "tuning", "training",
                 "reproductions/cast", "reproductions/bipo"]:
        _page(site, page)
    app = _page(site, "app")
    assert "screenshots/patching.png" in app
    assert (site / "screenshots" / "patching.png").is_file()


def test_cli_reference_is_current():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
