"""Public names that moved: the old place keeps working, and warns with the new one.

A module whose names moved keeps a module ``__getattr__`` that calls :func:`moved`; the new home is imported only
when an old name is asked for, so the old module imports nothing above its own layer.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any


def moved(old_module: str, name: str, new_module: str, new_name: str | None = None) -> Any:
    """``new_module.new_name`` (``new_name`` default: ``name``), for ``old_module.name``, with a
    ``DeprecationWarning`` that names the new place; dunder names are not moved (``AttributeError``).

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     fn = moved("steerkit.old_place", "dumps", "json")
        >>> fn({"a": 1}), str(w[0].message)
        ('{"a": 1}', 'steerkit.old_place.dumps is now json.dumps')
    """
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    target = getattr(importlib.import_module(new_module), new_name or name, None)
    if target is None:
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    warnings.warn(f"{old_module}.{name} is now {new_module}.{new_name or name}", DeprecationWarning, stacklevel=3)
    return target
