"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before steerkit.kernels imports its kernels (it does
so lazily, at the first launch), so it is set here, at collection.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
