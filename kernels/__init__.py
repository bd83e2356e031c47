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
``_triton.py``, their host launchers and the public functions in ``fused.py`` (the
kernels' tiles in ``launch.py``, the configurations and tables in ``config.py``), and
a pure-torch reference for each step in ``reference.py``, equal in meaning. The
choice between them is made from the device (``_backend.resolve_impl``: Triton on
CUDA tensors, torch elsewhere): by :func:`fused_steer` at every call, and by
:func:`bind_steer` once, for a table a hook applies at every step. It can be forced
with ``impl=`` or :func:`use_impl` (read when the choice is made). The Triton kernel's
tiles come from :func:`launch_params`, or from a :class:`LaunchParams` passed as ``launch=``. Ablation and injection have analytic
backward passes (Triton kernel or torch), so vectors can be optimised by gradient.
"""
if __name__ != "steerkit.kernels":  # found as a top-level `kernels` from a checkout's root: steerkit/_rootnames.py
    import runpy
    runpy.run_path(f"{__path__[0]}/../steerkit/_rootnames.py")["hand_over"](__name__)
else:
    import warnings

    from ._backend import HAS_TRITON, get_impl, interpret_mode, resolve_impl, resolve_impl_for, use_impl
    from .config import (MAX_HALFSPACES, MAX_K, MAX_M, ORTHO_TOL, Polyhedron, SteerConfig, SteerConfigError, SteerTable,
                         orthonormalize, table_from_tensors)
    from .fused import BoundSteer, ablate, bind_steer, clamp, fused_steer, inject, project_region
    from .launch import LaunchParams, launch_params
    from .reference import (DEFAULT_REGION_MAX_ITER, DEFAULT_REGION_TOL, fused_steer_ref,
                            solve_polyhedron_projection)

    __all__ = [
        "fused_steer", "bind_steer", "BoundSteer", "ablate", "clamp", "inject", "project_region",
        "SteerConfig", "SteerTable", "Polyhedron", "SteerConfigError", "orthonormalize", "table_from_tensors",
        "fused_steer_ref", "solve_polyhedron_projection", "LaunchParams", "launch_params",
        "use_impl", "get_impl", "resolve_impl", "resolve_impl_for", "interpret_mode", "HAS_TRITON",
        "MAX_K", "MAX_M", "MAX_HALFSPACES", "ORTHO_TOL", "DEFAULT_REGION_TOL", "DEFAULT_REGION_MAX_ITER",
    ]


    def __getattr__(name: str):
        if name == "set_impl":  # the process-wide override is gone: every choice is a function of the device
            raise AttributeError("steerkit.kernels.set_impl was removed: the implementation is chosen from the device "
                                 "(resolve_impl_for); override it for a block of code with steerkit.kernels.use_impl")
        if name == "Region":  # the geometry's former name; steerkit.vectors.Region is the stored artifact
            warnings.warn("steerkit.kernels.Region is now steerkit.kernels.Polyhedron (steerkit.Polyhedron); "
                          "steerkit.vectors.Region is the stored region artifact", DeprecationWarning, stacklevel=2)
            return Polyhedron
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

