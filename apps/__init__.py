"""steerkit.apps: the local visual explorer.

This package will hold a Plotly Dash app for layer-wise divergence profiles,
probe sweeps and live steering, built from layout factories, thin callbacks and
pure figure functions (``steerkit.apps.figures``) that also work in notebooks.
"""
