"""The app's callbacks: :func:`register` wires every page of :mod:`steerkit.apps.pages` (one module a
page, each with its ``register(app, ctx)``) over one shared context.

Callbacks are thin: they read inputs, call :mod:`.data` (parsing, built-in contrasts), :mod:`.analysis`
(computations, through the model host's cache) and :mod:`.io` (saved results), and hand results to
:mod:`.figures`. No user input is evaluated; every failure becomes a message in the page
(:func:`explain`).

No request is trusted: every value a callback receives is checked where it is used (type, size,
count; the ``MAX_*`` limits of :mod:`.data`), picker values name only files of the results folder
(read through :class:`steerkit.storage.files.Folder` by :mod:`.io`) or models the picker listed, and model
work stops at the per-request time limit.
"""
from __future__ import annotations

from .pages import register
from .pages.common import explain, time_limit

__all__ = ["explain", "register", "time_limit"]
