"""The matplotlib figure of a probe sweep, :meth:`SweepResult.plot`'s fallback where plotly is missing
(or with ``backend="matplotlib"``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

if TYPE_CHECKING:
    from ..sweep import SweepResult


def sweep_figure(res: "SweepResult", metric: str = "auroc", *, title: str):
    """``metric`` per layer, one line per position and method, with the AUROC's confidence band."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for (pos, m), rs in res.series().items():
        x = [r["layer"] for r in rs]
        ax.plot(x, [r[metric] for r in rs], marker="o", label=f"{m} @ {pos}")
        if metric == "auroc":
            ax.fill_between(x, [r["auroc_ci_low"] for r in rs], [r["auroc_ci_high"] for r in rs], alpha=0.2)
    ax.set_xlabel("layer")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.legend()
    return fig
