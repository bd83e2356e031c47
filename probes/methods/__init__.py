"""steerkit.probes.methods: the published methods built on the tools in :mod:`steerkit.probes`.

Each method module exposes a config dataclass and ``run(sm, config, *, progress=True) -> result``
(tqdm bars on stderr unless ``progress=False``); the result has ``to_json() -> dict``
(JSON-serialisable), ``plot()`` (a plotly Figure, drawn by the method's figure module in :mod:`steerkit.probes.plots`, imported when called) and, for the methods
that save vectors, ``artifacts(sm) -> {store name: artifact}``. :data:`REGISTRY` maps the CLI verb of
each method (``steerkit refusal``, ``steerkit mi-peaks``, ...) to its :class:`Method`.

* :mod:`.refusal` -- the refusal direction and the first-token refusal probe (Arditi et al. 2024).
* :mod:`.temporal` -- temporal divergence profile and injection (Shin et al.).
* :mod:`.norms` -- residual norm growth and attention drift (Eldenk et al.).
* :mod:`.mi` -- MI (HSIC) per generation step and its peaks (Qian et al. 2025).
* :mod:`.caa` -- Contrastive Activation Addition (Rimsky et al. 2024).
* :mod:`.region` -- the concise-reasoning region (Hou et al.).
* :mod:`.critique` -- the hidden critique vector (Phan et al.).
* :mod:`.induction` -- induction heads on repeated random tokens (Olsson et al. 2022).
* :mod:`.ioi` -- indirect-object identification by activation patching (Wang et al. 2022).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import caa, critique, induction, ioi, mi, norms, refusal, region, temporal


@dataclass(frozen=True)
class Method:
    """One published method: ``name`` is its CLI verb, ``summary`` a one-line description with the paper,
    ``config`` the config dataclass ``run`` takes, ``run(sm, config, *, progress=True) -> result``.

    Examples:
        >>> from steerkit.probes.methods import REGISTRY
        >>> sorted(REGISTRY)[:4]
        ['caa', 'critique', 'induction', 'ioi']
        >>> m = REGISTRY["induction"]
        >>> m.config.__name__, m.run.__module__
        ('InductionConfig', 'steerkit.probes.methods.induction')
    """

    name: str
    summary: str
    config: type
    run: Callable[..., Any]


REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("refusal", "the refusal direction and the first-token refusal probe (Arditi et al. 2024, \"Refusal in "
           "Language Models Is Mediated by a Single Direction\")", refusal.RefusalConfig, refusal.run),
    Method("temporal", "temporal divergence profile and Temporal Activation Injection (Shin et al., \"Before It "
           "Fades\")", temporal.TemporalConfig, temporal.run),
    Method("norms", "residual norm growth, re-applied blocks and attention drift (Eldenk et al.)",
           norms.NormsConfig, norms.run),
    Method("mi-peaks", "MI (HSIC) per generation step and its peaks (Qian et al. 2025, \"Demystifying reasoning "
           "dynamics with mutual information\")", mi.MIConfig, mi.run),
    Method("caa", "Contrastive Activation Addition vector and its evaluation (Rimsky et al. 2024)",
           caa.CAAConfig, caa.run),
    Method("region", "concise-reasoning region and its projection (Hou et al., \"Efficient reasoning via "
           "constrained optimization in latent space\")", region.RegionConfig, region.run),
    Method("critique", "hidden critique vector and error-detection F1 (Phan et al.)", critique.CritiqueConfig,
           critique.run),
    Method("induction", "induction scores of every head and the loss drop on repeated random tokens (Olsson et al. "
           "2022, \"In-context Learning and Induction Heads\")", induction.InductionConfig, induction.run),
    Method("ioi", "indirect-object identification: activation patching of resid_pre and head outputs (Wang et al. "
           "2022, \"Interpretability in the Wild\")", ioi.IOIConfig, ioi.run),
)}

__all__ = ["Method", "REGISTRY", "caa", "critique", "induction", "ioi", "mi", "norms", "refusal", "region", "temporal"]
