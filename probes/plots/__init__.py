"""Plotly figures of the probes' and methods' results, one module per topic.

Each module imports plotly at its top (the ``app`` extra) and holds only figure code; the compute modules
import none of them at import time. A result's ``plot()`` method imports its figure module when called, so
everything else works without plotly.
"""
