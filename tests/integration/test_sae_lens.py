"""steerkit's SAE inference against sae-lens's own, both ways.

sae-lens 6 pins TransformerLens < 4 and cannot live beside steerkit's TransformerLens 4, so it has an
environment of its own, ``.venv-saelens`` (``scripts/setup.sh`` makes it with the ``engines`` extras;
``STEERKIT_SAELENS_PYTHON`` points elsewhere). ``tests/support/sae_lens_driver.py`` runs there: it builds sae-lens
SAEs of every architecture steerkit reads with fixed seeds, saves them with sae-lens's own ``save_model``
and writes its ``encode`` / ``decode`` of fixed inputs; this side loads the folders with
``steerkit.load_sae`` and compares. Then the other way: steerkit's ``save(format="saelens")`` folders are
loaded by ``sae_lens.SAE.load_from_disk`` there, and its outputs compared with steerkit's here.
Tensors cross as safetensors files in a temporary folder.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import steerkit
from sae_weights import NO_SAELENS, SAELENS_PY, rel

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "support" / "sae_lens_driver.py"
#: name -> (architecture steerkit reads it as, site, output site)
EXPECTED = {
    "standard": ("relu", "blocks.1.hook_resid_post", None),
    "standard_layer_norm": ("relu", "blocks.1.hook_resid_post", None),
    "standard_hook_z": ("relu", "blocks.1.attn.hook_z", None),
    "jumprelu": ("jumprelu", "blocks.0.hook_mlp_out", None),
    "jumprelu_norm_rescale": ("jumprelu", "blocks.1.hook_resid_post", None),
    "topk": ("topk", "blocks.1.hook_resid_post", None),
    "topk_rescaled": ("topk", "blocks.1.hook_resid_pre", None),
    "gated": ("gated", "blocks.1.hook_resid_post", None),
    "skip_transcoder": ("relu", "blocks.1.hook_resid_mid", "blocks.1.hook_mlp_out"),
    "batchtopk": ("jumprelu", "blocks.1.hook_resid_post", None),
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
if not SAELENS_PY.exists():  # pragma: no cover
    pytest.skip(NO_SAELENS, allow_module_level=True)


def driver(mode: str, out: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    r = subprocess.run([str(SAELENS_PY), str(DRIVER), mode, str(out)], capture_output=True, text=True, timeout=500,
                       cwd=out, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout


def outputs(sae, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the driver writes for sae-lens: the latents, and the decoder's output (a transcoder's prediction
    with its skip connection, flat for an SAE on attn.hook_z)."""
    f = sae.encode(x)
    return {"x": x, "f": f, "y": sae.decode(f, x)}


@pytest.fixture(scope="module")
def built(scratch):
    out = scratch("saelens")
    driver("build", out)
    return out


def _compare(ours: dict, theirs: dict, name: str, tol: float = 1e-5) -> None:
    assert theirs["f"].shape == ours["f"].shape, name
    assert rel(ours["f"], theirs["f"]) < tol, (name, rel(ours["f"], theirs["f"]))
    y = theirs["y"].flatten(-2) if name.endswith("hook_z") else theirs["y"]
    assert rel(ours["y"], y) < tol, (name, rel(ours["y"], y))
    assert 0 < int((theirs["f"] != 0).sum()) < theirs["f"].numel(), name  # latents fire, not all of them


def test_saelens_folders_load_with_equal_outputs(built):
    names = sorted(p.name for p in (built / "saelens").iterdir())
    assert names == sorted(EXPECTED)
    for name in names:
        sae = steerkit.load_sae(built / "saelens" / name)
        assert (sae.architecture, sae.site, sae.output_site) == EXPECTED[name], name
        theirs = load_file(built / "io" / f"{name}.safetensors")
        with torch.no_grad():
            _compare(outputs(sae, theirs["x"]), theirs, name)
        assert sae.provenance.model_name == "tiny-llama" and sae.provenance.method == "imported:saelens"


def test_steerkit_saelens_folders_load_in_saelens(built):
    """steerkit's save(format="saelens") of each SAE, after a change to every weight (so nothing is read back from
    the original folder), loads in sae-lens with equal outputs."""
    out = built / "back_trip"
    (out / "steerkit_io").mkdir(parents=True)
    ours = {}
    for seed, name in enumerate(sorted(EXPECTED)):
        sae = steerkit.load_sae(built / "saelens" / name)
        g = torch.Generator().manual_seed(seed)
        sae = sae._map_tensors(lambda t, g=g: t + 0.05 * torch.randn(t.shape, generator=g))
        sae.save(out / "steerkit" / name, "saelens")
        x = load_file(built / "io" / f"{name}.safetensors")["x"] * 1.5
        with torch.no_grad():
            ours[name] = outputs(sae, x)
        save_file({"x": x.contiguous()}, out / "steerkit_io" / f"{name}.safetensors")
    printed = driver("load", out)
    for name in sorted(EXPECTED):
        _compare(ours[name], load_file(out / "back" / f"{name}.safetensors"), name)
    # sae-lens reads them as the architectures it saved (a folded TopK stays TopK, BatchTopK is JumpReLU)
    assert "skip_transcoder SkipTranscoder skip_transcoder" in printed and "batchtopk JumpReLUSAE jumprelu" in printed
