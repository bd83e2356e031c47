"""What the SAE tests share: a relative difference, a random SAE of each architecture, and where sae-lens's own
environment is (``.venv-saelens``, or ``STEERKIT_SAELENS_PYTHON``)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from steerkit.sae import SAEWeights

ROOT = Path(__file__).resolve().parents[2]
SAELENS_PY = Path(os.environ.get("STEERKIT_SAELENS_PYTHON") or ROOT / ".venv-saelens" / "bin" / "python")
NO_SAELENS = f"no sae-lens environment at {SAELENS_PY}: scripts/setup.sh creates it (sae-lens==6.54.*)"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference ``|a - b| / |b|`` (Frobenius, in float64)."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def random_sae(d: int, arch: str, seed: int = 0, d_sae: int = 1024) -> SAEWeights:
    """A random ``arch`` SAE (``topk`` with k 24, ``jumprelu`` with random thresholds, ``relu``) on ``d`` inputs."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d, d_sae, generator=g) / d ** 0.5
    extra: dict = {"topk": {"k": 24}, "jumprelu": {"threshold": torch.rand(d_sae, generator=g) * 0.5},
                   "relu": {}}[arch]
    return SAEWeights(W, torch.randn(d_sae, generator=g) * 0.1, W.T.clone() / 2, torch.randn(d, generator=g) * 0.1,
                      architecture=arch, **extra)
