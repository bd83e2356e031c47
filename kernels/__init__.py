"""steerkit.kernels: fused edits of hidden states.

One call, :func:`fused_steer`, applies to the hidden states of a layer (rows =
tokens, d_model columns), per row and in this order, whichever of these are
asked for: directional ablation / clamping against an orthonormal basis (k <= 16)
with per-direction strength, a conditional gate, injection scaled by a per-layer
schedule weight, projection into a polyhedral region of a PCA subspace (m <= 32,
<= 32 half-spaces), and norm preservation. Rows carry an index into a table of
configurations (:class:`SteerTable`, built once from :class:`SteerConfig`s) and a
position mask.

Three layers per op, as in Liger-Kernel: the ``@triton.jit`` kernels in
``_triton.py``, their host launchers and the public functions in ``fused.py``, and
a pure-torch reference for each step in ``reference.py``, equal in meaning. The
choice is made once per call (``_backend.resolve_impl``: Triton on CUDA tensors,
torch elsewhere) and can be forced with ``impl=`` or :func:`use_impl`. Ablation
and injection have analytic backward passes (Triton kernel or torch), so vectors
can be optimised by gradient.
"""

from ._backend import HAS_TRITON, get_impl, interpret_mode, resolve_impl, set_impl, use_impl
from .config import (MAX_HALFSPACES, MAX_K, MAX_M, Region, SteerConfig, SteerConfigError, SteerTable,
                     orthonormalize)
from .fused import ablate, bind_steer, clamp, fused_steer, inject, project_region, table_from_tensors
from .reference import (DEFAULT_REGION_MAX_ITER, DEFAULT_REGION_TOL, fused_steer_ref,
                        solve_polyhedron_projection)

__all__ = [
    "fused_steer", "bind_steer", "ablate", "clamp", "inject", "project_region",
    "SteerConfig", "SteerTable", "Region", "SteerConfigError", "orthonormalize", "table_from_tensors",
    "fused_steer_ref", "solve_polyhedron_projection",
    "use_impl", "set_impl", "get_impl", "resolve_impl", "interpret_mode", "HAS_TRITON",
    "MAX_K", "MAX_M", "MAX_HALFSPACES", "DEFAULT_REGION_TOL", "DEFAULT_REGION_MAX_ITER",
]
