"""Moved: an SAE's sites on a model are :mod:`steerkit.saesites` (beside the model, above the interventions
they splice with). The names here still work and warn with the new place."""
from steerkit.deprecation import moved


def __getattr__(name: str):
    return moved(__name__, name, "steerkit.saesites")
