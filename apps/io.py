"""Readers of saved results: the probe sweeps and MI trajectories the probes and methods packages write.

* :func:`parse_sweep` / :func:`load_sweep` / :func:`find_sweeps` -> :class:`ProbeSweep`;
* :func:`parse_mi_all` / :func:`parse_mi` / :func:`load_mi_all` / :func:`load_mi` / :func:`find_mi`
  -> :class:`MIProfile`.

Files are read as text (at most ``MAX_RESULT_BYTES``) and parsed with :mod:`json` / :mod:`csv`;
nothing is evaluated.
"""
from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from steerkit.errors import InputError


@dataclass
class ProbeSweep:
    """A layer x position AUROC table (with optional confidence intervals) of one probe method."""

    layers: list[int]
    positions: list[str]
    auroc: np.ndarray
    ci_low: Optional[np.ndarray] = None
    ci_high: Optional[np.ndarray] = None
    name: str = ""
    model_name: str = ""
    method: str = ""
    #: every method the file holds (the table above is ``method``'s)
    methods: list[str] = field(default_factory=list)

    def best_per_layer(self) -> np.ndarray:
        return np.nanmax(self.auroc, axis=1)


MAX_RESULT_BYTES = 16 << 20

#: column names accepted for the confidence interval: steerkit.probes' ``auroc_ci_*`` and short forms
_CI_KEYS = (("auroc_ci_low", "auroc_ci_high"), ("ci_low", "ci_high"))


def _ci(r):
    for lo, hi in _CI_KEYS:
        if r.get(lo) not in (None, "") and r.get(hi) not in (None, ""):
            return float(r[lo]), float(r[hi])
    return None


def _site(r) -> str:
    """The hook site of a row without its layer: ``blocks.3.hook_resid_post`` -> ``hook_resid_post``."""
    h = str(r.get("hook") or "")
    return h.split(".", 2)[2] if h.startswith("blocks.") and h.count(".") >= 2 else h


def _grid(rows):
    sites = {_site(r) for r in rows}

    def pos(r):
        p = str(r.get("position", "last"))
        return f"{_site(r)}:{p}" if len(sites) > 1 else p

    layers = sorted({int(r["layer"]) for r in rows})
    positions = []
    for r in rows:
        if pos(r) not in positions:
            positions.append(pos(r))
    A = np.full((len(layers), len(positions)), np.nan)
    lo, hi = A.copy(), A.copy()
    has_ci = False
    for r in rows:
        i, j = layers.index(int(r["layer"])), positions.index(pos(r))
        A[i, j] = float(r["auroc"])
        ci = _ci(r)
        if ci is not None:
            lo[i, j], hi[i, j] = ci
            has_ci = True
    return layers, positions, A, (lo if has_ci else None), (hi if has_ci else None)


def _grid_sweep(obj: dict, name: str, model: str) -> ProbeSweep:
    A = np.asarray(obj["auroc"], dtype=np.float64)
    if A.ndim == 1:
        A = A[:, None]
    layers = [int(x) for x in obj.get("layers", range(A.shape[0]))]
    positions = [str(x) for x in obj.get("positions", range(A.shape[1]))]
    if A.shape != (len(layers), len(positions)):
        raise InputError(f"expected auroc of shape [{len(layers)} layers, {len(positions)} positions] "
                         f"in {name}, found {list(A.shape)}")
    lo = np.asarray(obj["ci_low"], dtype=np.float64).reshape(A.shape) if obj.get("ci_low") is not None else None
    hi = np.asarray(obj["ci_high"], dtype=np.float64).reshape(A.shape) if obj.get("ci_high") is not None else None
    m = str(obj.get("method", ""))
    return ProbeSweep(layers, positions, A, lo, hi, name=obj.get("name", name), model_name=model,
                      method=m, methods=[m] if m else [])


def parse_sweep(text: str, name: str = "sweep", method: Optional[str] = None) -> ProbeSweep:
    """A sweep table, in any of the forms the probes package and people write:

    * ``steerkit.probes``' own JSON (``SweepResult.to_json``: ``{"format": "steerkit.sweep/1", "meta",
      "rows": [{"layer", "hook", "position", "method", "auroc", "auroc_ci_low", "auroc_ci_high", ...}]}``)
      or CSV (``SweepResult.to_csv``);
    * a grid ``{"layers", "positions", "auroc": [[...]], "ci_low", "ci_high"}``;
    * a plain list of rows with ``layer``, ``auroc`` and optionally ``position``, ``ci_low``/``ci_high``.

    A table with several methods gives the grid of ``method`` (default: the method with the best
    mean AUROC); ``ProbeSweep.methods`` lists them all. Several hooks become ``hook:position`` columns."""
    s = text.strip()
    try:
        model = ""
        if s.startswith("{") or s.startswith("["):
            obj = json.loads(s)
            if isinstance(obj, dict):
                meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
                model = str(obj.get("model") or meta.get("model") or meta.get("model_name") or "")
                if "auroc" in obj and isinstance(obj["auroc"], list):
                    return _grid_sweep(obj, name, model)
            rows = obj.get("rows") if isinstance(obj, dict) else obj
            if not isinstance(rows, list) or not rows:
                raise InputError(f"expected sweep rows in {name}, found none")
        else:
            rows = list(csv.DictReader(io.StringIO(s)))
        if not rows or not all(isinstance(r, dict) and "layer" in r and "auroc" in r for r in rows):
            raise InputError(f"expected rows with 'layer' and 'auroc' (and optionally 'position', 'hook', 'method', "
                             f"'auroc_ci_low', 'auroc_ci_high') in {name}")
        methods: list[str] = []
        for r in rows:
            m = str(r.get("method") or "")
            if m not in methods:
                methods.append(m)
        if method is not None and method not in methods:
            raise InputError(f"expected one of the methods {methods} in {name}, found {method!r}")
        if method is None:
            def mean_auroc(m):
                v = [float(r["auroc"]) for r in rows if str(r.get("method") or "") == m]
                v = [x for x in v if not math.isnan(x)]
                return sum(v) / len(v) if v else -1.0
            method = max(methods, key=mean_auroc)
        layers, positions, A, lo, hi = _grid([r for r in rows if str(r.get("method") or "") == method])
        return ProbeSweep(layers, positions, A, lo, hi, name=name, model_name=model, method=method,
                          methods=[m for m in methods if m])
    except InputError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
        raise InputError(f"expected a probe sweep table in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


def _read_small(p: Path) -> str:
    if p.stat().st_size > MAX_RESULT_BYTES:
        raise InputError(f"expected a results file under {MAX_RESULT_BYTES >> 20} MiB, found {p.stat().st_size} bytes in {p}")
    return p.read_text(encoding="utf-8")


def find_sweeps(results_dir) -> list[Path]:
    """Sweep tables under ``results_dir``: ``*sweep*.json`` / ``*sweep*.csv`` (recursively, sorted)."""
    d = Path(results_dir) if results_dir else None
    if d is None or not d.is_dir():
        return []
    return sorted(p for p in d.rglob("*sweep*") if p.suffix in (".json", ".csv") and p.is_file())


def load_sweep(path, method: Optional[str] = None) -> ProbeSweep:
    p = Path(path)
    return parse_sweep(_read_small(p), name=p.stem, method=method)


@dataclass
class MIProfile:
    """Mutual information per generation step, with its peaks and the tokens there."""

    steps: list[int]
    mi: np.ndarray
    tokens: list[str] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    name: str = ""
    layer: Optional[int] = None
    #: what ``mi`` measures, for the axis title (``steerkit.probes.methods.mi`` estimates it with HSIC)
    measure: str = "MI"


def _mi_one(obj: dict, name: str) -> MIProfile:
    mi = np.asarray(obj["mi"], dtype=np.float64).reshape(-1)
    steps = [int(s) for s in obj.get("steps", range(len(mi)))]
    tokens = [str(t) for t in obj.get("tokens", [])]
    if len(steps) != len(mi) or (tokens and len(tokens) != len(mi)):
        raise InputError(f"expected steps/tokens as long as mi ({len(mi)}) in {name}")
    peaks = obj.get("peaks")
    if peaks is None:
        thr = mi.mean() + mi.std()
        peaks = [steps[i] for i in range(len(mi)) if mi[i] > thr and (i == 0 or mi[i] >= mi[i - 1])
                 and (i == len(mi) - 1 or mi[i] >= mi[i + 1])]
    layer = obj.get("layer")
    return MIProfile(steps, mi, tokens, [int(p) for p in peaks], name=str(obj.get("name", name)),
                     layer=None if layer is None else int(layer), measure=str(obj.get("measure", "MI")))


def parse_mi_all(text: str, name: str = "mi") -> list[MIProfile]:
    """Every MI trajectory in a result: one ``{"mi": [...], "steps", "tokens", "peaks", "layer"}``
    object, or the report of ``steerkit mi-peaks --report FILE`` (``{"model", "mi": [one
    such object per question]}``, MI estimated with HSIC)."""
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict) or "mi" not in obj:
            raise InputError(f"expected a JSON object with an 'mi' entry in {name}")
        if isinstance(obj["mi"], list) and obj["mi"] and all(isinstance(t, dict) for t in obj["mi"]):
            out = []
            for i, t in enumerate(obj["mi"]):
                p = _mi_one({**t, "measure": t.get("measure", "HSIC")}, name)
                p.name = f"{name} #{i}" + (f" (layer {p.layer})" if p.layer is not None else "")
                out.append(p)
            return out
        return [_mi_one(obj, name)]
    except InputError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
        raise InputError(f"expected an MI result JSON in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


def parse_mi(text: str, name: str = "mi") -> MIProfile:
    """The first MI trajectory of a result (see :func:`parse_mi_all`)."""
    return parse_mi_all(text, name)[0]


def find_mi(results_dir, limit: int = 200) -> list[Path]:
    """MI results under ``results_dir``: ``*.json`` files (recursively, sorted, at most ``limit``
    looked at) whose top level has an ``mi`` entry -- ``mi_*.json`` or a report of
    ``steerkit mi-peaks --report FILE``."""
    d = Path(results_dir) if results_dir else None
    if d is None or not d.is_dir():
        return []
    out = []
    for p in sorted(d.rglob("*.json"))[:limit]:
        if not p.is_file() or "sweep" in p.name or p.stat().st_size > MAX_RESULT_BYTES:
            continue
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(obj, dict) and "mi" in obj:
            out.append(p)
    return out


def load_mi_all(path) -> list[MIProfile]:
    p = Path(path)
    return parse_mi_all(_read_small(p), name=p.stem)


def load_mi(path) -> MIProfile:
    return load_mi_all(path)[0]
