"""The explorer's pages, one module each, every one with a ``register(app, ctx)`` that wires its
callbacks (``ctx``: the shared :class:`~steerkit.apps.pages.common.Context`):

* :mod:`.shell`: navigation, the model picker, the figures' HTML downloads;
* :mod:`.profiles`, :mod:`.probes`, :mod:`.steer`, :mod:`.patching`, :mod:`.attention`, :mod:`.tune`,
  :mod:`.features`, :mod:`.circuits` (its supernodes' clamps: :mod:`.circuits_steer`; its hover reports:
  :mod:`.circuits_hover`), :mod:`.store`,
  :mod:`.diagnostics`: the pages of the navigation bar, in its order.

A page reads its inputs, calls :mod:`steerkit.apps.analysis` (computations, through the model host's
cache) and :mod:`steerkit.apps.io` (saved results), and hands results to :mod:`steerkit.apps.figures`;
:mod:`.common` holds what they share.
"""
from __future__ import annotations

from . import (
    attention, circuits, circuits_hover, circuits_steer, diagnostics, features, patching, probes, profiles, shell, steer,
    store, tune,
)
from .common import Context

PAGE_MODULES = (shell, profiles, probes, steer, patching, attention, tune, features, circuits, circuits_steer,
                circuits_hover, store, diagnostics)


def register(app, env) -> Context:
    """Wire every page's callbacks over one :class:`Context` of ``env`` (the app's
    :class:`~steerkit.apps.app.AppEnv`)."""
    c = Context.of(env)
    for page in PAGE_MODULES:
        page.register(app, c)
    return c
