"""Tiles of the Triton kernels: :class:`LaunchParams` (rows per program, columns per chunk, warps) and
the defaults :func:`launch_params` chooses for the forward kernel (the backward kernel's come from
``_bwd_launch_params``). The launchers that use them are in :mod:`steerkit.kernels.fused`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SteerConfigError


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------- launch settings
@dataclass(frozen=True)
class LaunchParams:
    """Tiles of the forward kernel: ``block_r`` rows per program, swept over d in ``block_d``
    columns (a power of two), ``num_warps`` warps; ``norm_fast`` allows the norm rescale to take
    |x|^2 from the first pass's dot products where the table allows it (False: always the exact
    extra pass). Pass one as ``fused_steer(..., launch=LaunchParams(...))`` to override
    :func:`launch_params`.

    Examples:
        >>> LaunchParams(block_d=256, block_r=16)
        LaunchParams(block_d=256, block_r=16, num_warps=4, norm_fast=True)
        >>> LaunchParams(block_d=300, block_r=16)
        Traceback (most recent call last):
        ...
        steerkit.kernels.config.SteerConfigError: LaunchParams.block_d must be a positive power of two; found 300.
    """

    block_d: int
    block_r: int
    num_warps: int = 4
    norm_fast: bool = True

    def __post_init__(self):
        for name in ("block_d", "block_r", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise SteerConfigError(
                    f"LaunchParams.{name} must be a positive power of two; found {v!r}."
                )


def launch_params(d: int, k: int, dtype: torch.dtype, region: bool, interpret: bool = False) -> LaunchParams:
    """The forward kernel's tiles for ``d`` columns, ``k`` padded directions (1 without a basis),
    hidden states of ``dtype``, with or without a region step, on a GPU or (``interpret``) under
    Triton's CPU interpreter.

    Defaults from the H200 sweep in docs/reproductions/kernels.md (bf16, and the same for float16 and float32):
    16 x 512, 4 warps for k <= 8; 16 x 128, 8 warps for more directions, whose per-chunk basis
    vectors cost registers; 4 rows per program with a region (its solver keeps per-row state in
    registers). The interpreter pays per op, not per element: one chunk per row, 32 rows.

    Examples:
        >>> launch_params(576, 1, torch.bfloat16, region=False)
        LaunchParams(block_d=512, block_r=16, num_warps=4, norm_fast=True)
        >>> launch_params(4096, 16, torch.bfloat16, region=False).num_warps, launch_params(576, 1, torch.float32, True).block_r
        (8, 4)
    """
    del dtype  # the sweep found no dtype that wants other tiles
    if interpret:
        return LaunchParams(block_d=_next_pow2(d), block_r=4 if region else 32, num_warps=4)
    return LaunchParams(block_d=min(_next_pow2(d), 512 if k <= 8 else 128), block_r=4 if region else 16,
                        num_warps=8 if k > 8 else 4)


def _bwd_launch_params(d: int, interpret: bool) -> LaunchParams:
    """Tiles of the backward kernel, which holds whole rows: ``block_d >= d``."""
    block_d = _next_pow2(d)
    block_r = 32 if interpret else max(1, min(16, 16384 // block_d))
    tile = block_r * block_d
    return LaunchParams(block_d=block_d, block_r=block_r,
                        num_warps=4 if tile <= 4096 else 8 if tile <= 8192 else 16, norm_fast=False)


def triton_cdiv(a: int, b: int) -> int:
    """Ceiling division for positive ints: how many tiles of ``b`` cover ``a``.

    Examples:
        >>> triton_cdiv(576, 512), triton_cdiv(512, 512)
        (2, 1)
    """
    return (a + b - 1) // b
