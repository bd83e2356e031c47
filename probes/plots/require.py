"""The error a figure raises when plotly, the ``app`` extra, is missing.

The compute modules import their figure module inside ``plot()`` (plotly is optional); this module holds
no figure and imports no plotting library, so they import it at their top.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from steerkit.errors import InputError

PLOTLY_MISSING = "expected plotly to be installed to plot, found it missing; pip install plotly"


def missing_plotly(e: ImportError) -> bool:
    """Whether ``e`` says plotly itself is not installed (not some other broken import).

    Examples:
        >>> from steerkit.probes.plots.require import missing_plotly
        >>> missing_plotly(ModuleNotFoundError("No module named 'plotly'", name="plotly.graph_objects"))
        True
        >>> missing_plotly(ImportError("cannot import name 'x' from 'dash'", name="dash"))
        False
    """
    return (getattr(e, "name", None) or "").split(".")[0] == "plotly"


@contextmanager
def plotly_required() -> Iterator[None]:
    """Import a figure module inside it: a missing plotly becomes an :class:`~steerkit.errors.InputError`
    that says how to install it (any other import error passes through).

    Examples:
        >>> from steerkit.probes.plots.require import plotly_required
        >>> try:
        ...     with plotly_required():
        ...         raise ModuleNotFoundError("No module named 'plotly'", name="plotly")
        ... except Exception as e:
        ...     print(type(e).__name__, e)
        InputError expected plotly to be installed to plot, found it missing; pip install plotly
    """
    try:
        yield
    except ImportError as e:
        if missing_plotly(e):
            raise InputError(PLOTLY_MISSING) from None
        raise
