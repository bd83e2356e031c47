"""Steering configurations applied through the fused kernel, one row at a time if asked.

A *steering spec* maps hook names to :class:`steerkit.kernels.SteerConfig`
(ablation / clamp against a basis, a conditional gate, injection, region
projection), e.g. ``{"blocks.12.hook_resid_post": SteerConfig.injection(v, 6.0)}``.
:func:`steer` registers, for every hook named by any spec, ONE hook function
that makes ONE :func:`~steerkit.kernels.fused_steer` call per forward step.
With a list of specs (one per batch row; ``None`` leaves a row alone), the
configurations are stacked once into a :class:`~steerkit.kernels.SteerTable`
per hook and each row carries its configuration index, so a batch of eight
sequences with eight different steerings costs one kernel call per layer,
not eight. Rows (or hooks) without a configuration get the identity.

``positions`` limits the edit to prompt or generated tokens, or any position
spec (see :mod:`steerkit.positions`); ``preserve_norm`` rescales edited rows
to their original norm. The kernel chooses Triton on CUDA and the torch
reference elsewhere.
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch

from .errors import InputError
from .positions import PositionSpec, validate_positions

SteeringSpec = Mapping[str, "object"]


def _as_specs(steering) -> tuple[list[Optional[SteeringSpec]], bool]:
    """``(specs, per_row)``: one spec for all rows, or a list with one per row."""
    if steering is None:
        return [], False
    if isinstance(steering, Mapping):
        return [steering], False
    if isinstance(steering, (list, tuple)):
        if not steering:
            raise InputError("expected a steering spec or a non-empty list of them (one per row), found []")
        for i, s in enumerate(steering):
            if s is not None and not isinstance(s, Mapping):
                raise InputError(f"expected row {i}'s steering to be a {{hook_name: SteerConfig}} dict or None, "
                                 f"found {type(s).__name__}")
        return list(steering), True
    raise InputError(f"expected steering as a {{hook_name: SteerConfig}} dict or a list of them, "
                     f"found {type(steering).__name__}")


def build_tables(sm, specs: Sequence[Optional[SteeringSpec]]) -> dict:
    """``{hook_name: (SteerTable, layer)}`` with one configuration per spec (identity where absent)."""
    from steerkit.kernels import SteerConfig, SteerConfigError, SteerTable

    hooks: list[str] = []
    for s in specs:
        for h in (s or {}):
            if h not in hooks:
                hooks.append(h)
    if not hooks:
        raise InputError("expected at least one hook name in the steering spec, found none")
    out = {}
    for h in hooks:
        site = sm.hooks.parse(h)
        cfgs = []
        for i, s in enumerate(specs):
            c = (s or {}).get(h)
            if c is None:
                c = SteerConfig.identity()
            elif not isinstance(c, SteerConfig):
                raise InputError(f"expected a steerkit.kernels.SteerConfig at {h!r} (row {i}), "
                                 f"found {type(c).__name__}; build one with SteerConfig.injection(v, scale) etc.")
            cfgs.append(c)
        try:
            table = SteerTable.from_configs(cfgs, d_model=sm.d_model, device=sm.device)
        except SteerConfigError as e:
            raise InputError(f"steering at {h!r}: {e}") from None
        out[h] = (table, site.layer)
    return out


def steer(sm, steering, *, positions: PositionSpec = "all", preserve_norm: bool = False,
          batch_size: int | None = None):
    """Register fused steering on ``sm``; returns a :class:`~steerkit.hooks.HookHandle` (use with ``with``).

    With a per-row list, every forward inside the scope must have exactly ``len(steering)`` rows.
    """
    from steerkit.kernels import bind_steer, fused_steer

    specs, per_row = _as_specs(steering)
    if not specs:
        raise InputError("expected a steering spec, found None")
    positions = validate_positions(positions)
    tables = build_tables(sm, specs)
    n_rows = len(specs) if per_row else None
    row_ids = torch.arange(len(specs), device=sm.device) if per_row else None
    pairs = []
    for h, (table, layer) in tables.items():
        # one configuration for every row and no layer schedule: the call bound once (bind_steer)
        bound = bind_steer(table, preserve_norm=preserve_norm) if n_rows is None and table.schedule is None else None

        def fn(x, call, table=table, layer=layer, bound=bound):
            if n_rows is not None and x.shape[0] != n_rows:
                raise InputError(f"expected a batch of {n_rows} rows (one per steering spec), found "
                                 f"{x.shape[0]}")
            mask = None if positions == "all" and call.run is None else call.mask(positions, x.device)
            if mask is not None and not bool(mask.any()):
                return None
            if bound is not None:
                return bound(x, mask)
            return fused_steer(x, table, row_config=row_ids, mask=mask,
                               layer=layer if table.schedule is not None else None,
                               preserve_norm=preserve_norm, validate=False)
        pairs.append((sm.hooks.parse(h), fn))
    return sm.hooks.register(pairs, label=f"steer {list(tables)}" + (" per-row" if per_row else ""))
