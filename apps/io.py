"""Readers of saved results: the probe sweeps and MI trajectories the probes and methods packages write.

* :func:`parse_sweep` / :func:`load_sweep` / :func:`find_sweeps` -> :class:`ProbeSweep`;
* :func:`parse_mi_all` / :func:`parse_mi` / :func:`load_mi_all` / :func:`load_mi` / :func:`find_mi`
  -> :class:`MIProfile`;
* :func:`parse_tune` / :func:`read_tune` / :func:`scan_tunes` / :func:`load_tune`: the result JSON of
  ``steerkit.probes.tune`` (``TuneResult.to_json()``), checked and bounded; :func:`tune_cell` finds
  one cell of it.

Every file is read through :class:`steerkit.storage.files.Folder` (no ``..``, no absolute path, no
symbolic link, only regular files of at most ``MAX_RESULT_BYTES``, never blocking on a FIFO or a
device) and parsed with :mod:`json` / :mod:`csv`; nothing is evaluated. The app names a result by
its path relative to the results folder (:func:`scan_sweeps`, :func:`scan_mi`,
:func:`read_sweep`, :func:`read_mi_all`); a name that is not a readable results file of that
folder gets one message, the same whether or not something exists there (:func:`not_a_result`).
Tables and trajectories are bounded (``MAX_SWEEP_*``, ``MAX_MI_*`` in :mod:`.data`) before any
grid is built.
"""
from __future__ import annotations

import csv
import io
import itertools
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional

import numpy as np

from steerkit.errors import InputError
from steerkit.storage import jsontext
from steerkit.storage.files import Folder
from steerkit.probes.tune import FORMAT as TUNE_FORMAT
from steerkit.probes.tune import METRICS as TUNE_METRICS

from .data import (
    MAX_FIELD_CHARS, MAX_MI_STEPS, MAX_MI_TRAJECTORIES, MAX_RESULT_BYTES, MAX_RESULT_DEPTH, MAX_RESULT_FILES,
    MAX_SCAN_BYTES, MAX_SWEEP_LAYERS, MAX_SWEEP_METHODS, MAX_SWEEP_POSITIONS, MAX_SWEEP_ROWS,
    MAX_TUNE_GENERATION_CHARS, MAX_TUNE_RESULT_CELLS, MAX_TUNE_RESULT_LAYERS, MAX_TUNE_RESULT_PROMPTS,
    MAX_TUNE_RESULT_SCALES,
)


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

    keys = [(int(r["layer"]), pos(r)) for r in rows]
    layers = sorted({k[0] for k in keys})
    positions = list(dict.fromkeys(k[1] for k in keys))
    _check_grid(len(layers), len(positions), "the sweep table")
    li = {l: i for i, l in enumerate(layers)}
    pj = {p: j for j, p in enumerate(positions)}
    A = np.full((len(layers), len(positions)), np.nan)
    lo, hi = A.copy(), A.copy()
    has_ci = False
    for r, (l, p) in zip(rows, keys):
        i, j = li[l], pj[p]
        A[i, j] = float(r["auroc"])
        ci = _ci(r)
        if ci is not None:
            lo[i, j], hi[i, j] = ci
            has_ci = True
    return layers, positions, A, (lo if has_ci else None), (hi if has_ci else None)


def _check_grid(n_layers: int, n_positions: int, name: str) -> None:
    if n_layers > MAX_SWEEP_LAYERS or n_positions > MAX_SWEEP_POSITIONS:
        raise InputError(f"expected a sweep of at most {MAX_SWEEP_LAYERS} layers x {MAX_SWEEP_POSITIONS} positions "
                         f"in {name}, found {n_layers} layers x {n_positions} positions")


def _grid_sweep(obj: dict, name: str, model: str) -> ProbeSweep:
    rows = obj["auroc"]
    _check_grid(len(rows), max((len(r) for r in rows if isinstance(r, list)), default=1), name)
    A = np.asarray(rows, dtype=np.float64)
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
    if not isinstance(text, str):
        raise InputError(f"expected a probe sweep table as text in {name}, found {type(text).__name__}")
    if len(text) > MAX_RESULT_BYTES:
        raise InputError(f"expected a sweep table of at most {MAX_RESULT_BYTES >> 20} MiB in {name}, found "
                         f"{len(text)} characters")
    s = text.strip()
    try:
        model = ""
        if s.startswith("{") or s.startswith("["):
            obj = jsontext.loads(s)
            if isinstance(obj, dict):
                meta = obj.get("meta") if isinstance(obj.get("meta"), dict) else {}
                model = str(obj.get("model") or meta.get("model") or meta.get("model_name") or "")
                if "auroc" in obj and isinstance(obj["auroc"], list):
                    return _grid_sweep(obj, name, model)
            rows = obj.get("rows") if isinstance(obj, dict) else obj
            if not isinstance(rows, list) or not rows:
                raise InputError(f"expected sweep rows in {name}, found none")
        else:
            rows = list(itertools.islice(csv.DictReader(io.StringIO(s)), MAX_SWEEP_ROWS + 1))
        if not rows or not all(isinstance(r, dict) and "layer" in r and "auroc" in r for r in rows):
            raise InputError(f"expected rows with 'layer' and 'auroc' (and optionally 'position', 'hook', 'method', "
                             f"'auroc_ci_low', 'auroc_ci_high') in {name}")
        if len(rows) > MAX_SWEEP_ROWS:
            raise InputError(f"expected a sweep table of at most {MAX_SWEEP_ROWS} rows in {name}, found {len(rows)}")
        methods = list(dict.fromkeys(str(r.get("method") or "") for r in rows))
        if len(methods) > MAX_SWEEP_METHODS:
            raise InputError(f"expected at most {MAX_SWEEP_METHODS} methods in {name}, found {len(methods)}")
        if method is not None and method not in methods:
            raise InputError(f"expected one of the methods {methods} in {name}, found {str(method)[:80]!r}")
        if method is None:
            sums: dict[str, list[float]] = {m: [0.0, 0] for m in methods}
            for r in rows:
                x = float(r["auroc"])
                if not math.isnan(x):
                    acc = sums[str(r.get("method") or "")]
                    acc[0] += x
                    acc[1] += 1
            method = max(methods, key=lambda m: sums[m][0] / sums[m][1] if sums[m][1] else -1.0)
        layers, positions, A, lo, hi = _grid([r for r in rows if str(r.get("method") or "") == method])
        return ProbeSweep(layers, positions, A, lo, hi, name=name, model_name=model, method=method,
                          methods=[m for m in methods if m])
    except InputError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError, csv.Error) as e:
        raise InputError(f"expected a probe sweep table in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


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
    if not isinstance(obj["mi"], list) or len(obj["mi"]) > MAX_MI_STEPS:
        raise InputError(f"expected 'mi' as a list of at most {MAX_MI_STEPS} numbers in {name}")
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
    if not isinstance(text, str) or len(text) > MAX_RESULT_BYTES:
        raise InputError(f"expected an MI result of at most {MAX_RESULT_BYTES >> 20} MiB of text in {name}")
    try:
        obj = jsontext.loads(text)
        if not isinstance(obj, dict) or "mi" not in obj:
            raise InputError(f"expected a JSON object with an 'mi' entry in {name}")
        if isinstance(obj["mi"], list) and obj["mi"] and all(isinstance(t, dict) for t in obj["mi"]):
            if len(obj["mi"]) > MAX_MI_TRAJECTORIES:
                raise InputError(f"expected at most {MAX_MI_TRAJECTORIES} MI trajectories in {name}, found "
                                 f"{len(obj['mi'])}")
            out = []
            for i, t in enumerate(obj["mi"]):
                p = _mi_one({**t, "measure": t.get("measure", "HSIC")}, name)
                p.name = f"{name} #{i}" + (f" (layer {p.layer})" if p.layer is not None else "")
                out.append(p)
            return out
        return [_mi_one(obj, name)]
    except InputError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        raise InputError(f"expected an MI result JSON in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None


def parse_mi(text: str, name: str = "mi") -> MIProfile:
    """The first MI trajectory of a result (see :func:`parse_mi_all`)."""
    return parse_mi_all(text, name)[0]


# ============================================================================ files
class NotAResult(InputError):
    """A picker value that is not a readable results file of the app's folder."""


def not_a_result(what: str = "results file") -> NotAResult:
    """The one message for a name that is not a readable results file of the folder: the same for a
    missing file, a file elsewhere, a link, a FIFO, a device, a folder or an oversize file, so the
    answer tells nothing about what exists outside the results."""
    return NotAResult(f"expected a {what} of this app (a name from the list, relative to the results folder), "
                      "found something else; press Rescan and pick one from the list")


SWEEP_SUFFIXES = (".json", ".csv")


def is_sweep_name(rel: str) -> bool:
    n = PurePosixPath(rel).name
    return "sweep" in n and PurePosixPath(n).suffix in SWEEP_SUFFIXES


def is_mi_name(rel: str) -> bool:
    n = PurePosixPath(rel).name
    return "sweep" not in n and n.endswith(".json")


def _folder(results_dir) -> Optional[Folder]:
    if results_dir is None or results_dir == "":
        return None
    return results_dir if isinstance(results_dir, Folder) else Folder(results_dir)


def walk(folder: Folder, *, limit: int = MAX_RESULT_FILES, depth: int = MAX_RESULT_DEPTH) -> Iterator[str]:
    """Relative (``/``-separated) names of the regular files below ``folder``, sorted, at most
    ``limit`` entries looked at and ``depth`` folders deep; symbolic links are never followed and
    nothing but regular files is listed."""
    seen = 0
    stack: list[tuple[str, int]] = [("", 0)]
    out: list[str] = []
    while stack:
        rel, d = stack.pop()
        try:
            names = folder.listdir(rel)
        except (OSError, InputError):
            continue
        for n in names:
            seen += 1
            if seen > limit:
                return iter(sorted(out))
            child = f"{rel}/{n}" if rel else n
            try:
                st = folder.lstat(child)
            except (OSError, InputError):
                continue
            if st is None:
                continue
            if stat.S_ISDIR(st.st_mode):
                if d + 1 < depth:
                    stack.append((child, d + 1))
            elif stat.S_ISREG(st.st_mode):
                out.append(child)
    return iter(sorted(out))


def read_result(folder: Folder, rel, what: str = "results file") -> str:
    """The text of the results file ``rel`` (relative to ``folder``); :func:`not_a_result` for any
    name that is not a regular file there (no ``..``, no absolute path, no link, no FIFO or device,
    at most ``MAX_RESULT_BYTES``), the same message whether or not something exists."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_FIELD_CHARS:
        raise not_a_result(what)
    try:
        data = folder.read_bytes(rel, MAX_RESULT_BYTES)
    except (OSError, InputError, ValueError):  # ConfinementError is a PermissionError (an OSError)
        raise not_a_result(what) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"expected a UTF-8 text file in {PurePosixPath(rel).name}, found binary data") from None


def scan_sweeps(results_dir) -> list[str]:
    """Names (relative to ``results_dir``) of its sweep tables: ``*sweep*.json`` / ``*sweep*.csv``."""
    f = _folder(results_dir)
    return [] if f is None else [r for r in walk(f) if is_sweep_name(r)]


def read_sweep(results_dir, rel, method: Optional[str] = None) -> ProbeSweep:
    """The sweep ``rel`` of ``results_dir`` (a name from :func:`scan_sweeps`)."""
    f = _folder(results_dir)
    if f is None or not isinstance(rel, str) or not is_sweep_name(rel):
        raise not_a_result("sweep table")
    return parse_sweep(read_result(f, rel, "sweep table"), name=PurePosixPath(rel).stem, method=method)


def scan_mi(results_dir, limit: int = 200) -> list[tuple[str, int]]:
    """``(name, number of trajectories)`` of the MI results under ``results_dir``: ``*.json``
    files (at most ``limit`` looked at, at most ``MAX_SCAN_BYTES`` read) whose top level has an
    ``mi`` entry -- ``mi_*.json`` or a report of ``steerkit mi-peaks --report FILE``."""
    f = _folder(results_dir)
    if f is None:
        return []
    out, budget = [], MAX_SCAN_BYTES
    for rel in [r for r in walk(f) if is_mi_name(r)][:limit]:
        st = f.lstat(rel)
        if st is None or st.st_size > min(MAX_RESULT_BYTES, budget):
            continue
        budget -= st.st_size
        try:
            obj = jsontext.loads(f.read_bytes(rel, MAX_RESULT_BYTES))
        except (OSError, InputError, ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and "mi" in obj:
            m = obj["mi"]
            n = len(m) if isinstance(m, list) and m and all(isinstance(t, dict) for t in m) else 1
            out.append((rel, min(n, MAX_MI_TRAJECTORIES)))
    return out


def read_mi_all(results_dir, rel) -> list[MIProfile]:
    """Every trajectory of the MI result ``rel`` of ``results_dir`` (a name from :func:`scan_mi`)."""
    f = _folder(results_dir)
    if f is None or not isinstance(rel, str) or not is_mi_name(rel):
        raise not_a_result("MI result")
    return parse_mi_all(read_result(f, rel, "MI result"), name=PurePosixPath(rel).stem)


# --- by path, for notebooks and scripts (the file's own folder confines the read) -------------
def _split(path) -> tuple[Folder, str]:
    p = Path(os.fspath(path))
    return Folder(p.parent), p.name


def find_sweeps(results_dir) -> list[Path]:
    """Sweep tables under ``results_dir``: ``*sweep*.json`` / ``*sweep*.csv`` (recursively, sorted)."""
    if not results_dir:
        return []
    return [Path(results_dir) / r for r in scan_sweeps(results_dir)]


def load_sweep(path, method: Optional[str] = None) -> ProbeSweep:
    f, name = _split(path)
    try:
        data = f.read_bytes(name, MAX_RESULT_BYTES)
    except FileNotFoundError:
        raise InputError(f"expected a sweep table at {path}, found nothing there") from None
    return parse_sweep(data.decode("utf-8", errors="replace"), name=Path(name).stem, method=method)


def find_mi(results_dir, limit: int = 200) -> list[Path]:
    """MI results under ``results_dir`` (see :func:`scan_mi`)."""
    if not results_dir:
        return []
    return [Path(results_dir) / r for r, _ in scan_mi(results_dir, limit)]


def load_mi_all(path) -> list[MIProfile]:
    f, name = _split(path)
    try:
        data = f.read_bytes(name, MAX_RESULT_BYTES)
    except FileNotFoundError:
        raise InputError(f"expected an MI result at {path}, found nothing there") from None
    return parse_mi_all(data.decode("utf-8", errors="replace"), name=Path(name).stem)


def load_mi(path) -> MIProfile:
    return load_mi_all(path)[0]


# ============================================================================ tune results
def is_tune_name(rel: str) -> bool:
    """A tune result's file name: ``*tune*.json``.

    Examples:
        >>> from steerkit.apps.io import is_tune_name
        >>> is_tune_name("runs/refusal_tune.json"), is_tune_name("mi_tune.csv"), is_tune_name("a_sweep.json")
        (True, False, False)
    """
    n = PurePosixPath(rel).name
    return "tune" in n and n.endswith(".json")


def _finite(x) -> bool:
    """``x`` is a finite int or float (not a bool; an int too large for a float is not)."""
    try:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:
        return False


def _number(value, what: str, name: str, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"expected {what} as a number in {name}, found {str(value)[:40]!r}")
    return value


def _texts(value, what: str, name: str, n: int) -> None:
    if not isinstance(value, list) or len(value) != n or not all(isinstance(t, str) for t in value):
        raise InputError(f"expected {what} as a list of {n} texts (one per prompt) in {name}, found "
                         f"{type(value).__name__}" + (f" of {len(value)}" if isinstance(value, list) else ""))
    for t in value:
        if len(t) > MAX_TUNE_GENERATION_CHARS:
            raise InputError(f"expected generations of at most {MAX_TUNE_GENERATION_CHARS} characters in {name}, "
                             f"found {len(t)}")


def check_tune(obj, name: str = "tune") -> dict:
    """``obj`` checked as a tune result (the JSON of ``steerkit.probes.tune.TuneResult.to_json()``):
    ``layers``, ``scales``, ``prompts``, a ``baseline`` with one generation per prompt, ``cells`` (one
    per layer x scale, each with ``layer``, ``scale``, the metrics ``concept`` / ``perplexity`` /
    ``kl`` / ``repetition``, ``concept_ci``, ``pareto`` and one generation per prompt) and an optional
    ``recommended`` ``{"layer", "scale"}`` naming a cell. Every list is bounded (``MAX_TUNE_RESULT_*``).
    Returns ``obj`` itself; any problem is an :class:`InputError` naming it.

    Examples:
        >>> from steerkit.apps.io import check_tune
        >>> cell = {"layer": 3, "scale": 2.0, "concept": 0.8, "concept_ci": [0.7, 0.9], "perplexity": 12.0,
        ...         "kl": 0.4, "repetition": 0.1, "pareto": True, "generations": ["Hi!"]}
        >>> res = {"format": "steerkit.tune/1", "layers": [3], "scales": [2.0], "prompts": ["Say hi."], "cells": [cell],
        ...        "baseline": {"generations": ["Hello."]}, "recommended": {"layer": 3, "scale": 2.0}}
        >>> check_tune(res)["recommended"]
        {'layer': 3, 'scale': 2.0}
        >>> check_tune({**res, "cells": [{**cell, "layer": 9}]})
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected cells at the result's layers [3] and scales [2.0] in tune, found a cell at layer 9, scale 2.0
    """
    if not isinstance(obj, dict):
        raise InputError(f"expected a tune result (a JSON object with layers, scales, prompts, baseline and cells) "
                         f"in {name}, found {type(obj).__name__}")
    if obj.get("format") != TUNE_FORMAT:
        raise InputError(f"expected a tune result of format {TUNE_FORMAT!r} (TuneResult.to_json) in {name}, found "
                         f"format {str(obj.get('format'))[:40]!r}")
    missing = [k for k in ("layers", "scales", "prompts", "baseline", "cells") if k not in obj]
    if missing:
        raise InputError(f"expected a tune result with layers, scales, prompts, baseline and cells in {name}, found "
                         f"no {', '.join(missing)}; save one with TuneResult.save or steerkit.probes.tune")
    layers, scales, prompts, cells = obj["layers"], obj["scales"], obj["prompts"], obj["cells"]
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_TUNE_RESULT_LAYERS \
            or not all(isinstance(l, int) and not isinstance(l, bool) and 0 <= l < 100_000 for l in layers):
        raise InputError(f"expected 'layers' as 1 to {MAX_TUNE_RESULT_LAYERS} layer numbers in {name}, found "
                         f"{str(layers)[:60]!r}")
    if not isinstance(scales, list) or not 0 < len(scales) <= MAX_TUNE_RESULT_SCALES:
        raise InputError(f"expected 'scales' as 1 to {MAX_TUNE_RESULT_SCALES} numbers in {name}, found "
                         f"{str(scales)[:60]!r}")
    for x in scales:
        if _number(x, "a scale", name, allow_none=False) != x or not _finite(x):
            raise InputError(f"expected finite scales in {name}, found {str(x)[:40]}")
    if not isinstance(prompts, list) or not 0 < len(prompts) <= MAX_TUNE_RESULT_PROMPTS:
        raise InputError(f"expected 'prompts' as 1 to {MAX_TUNE_RESULT_PROMPTS} texts in {name}, found "
                         f"{str(prompts)[:60]!r}")
    _texts(prompts, "'prompts'", name, len(prompts))
    n = len(prompts)
    base = obj["baseline"]
    if not isinstance(base, dict):
        raise InputError(f"expected 'baseline' as an object with the unsteered generations in {name}, found "
                         f"{type(base).__name__}")
    _texts(base.get("generations"), "the baseline's generations", name, n)
    if _number(base.get("concept"), "the baseline's concept", name) is not None and not _finite(base["concept"]):
        raise InputError(f"expected the baseline's concept as a finite number in {name}")
    if not isinstance(cells, list) or not 0 < len(cells) <= min(MAX_TUNE_RESULT_CELLS, len(layers) * len(scales)):
        raise InputError(f"expected 'cells' as 1 to {len(layers) * len(scales)} objects (layers x scales) in {name}, "
                         f"found {str(cells)[:60]!r}"[:300])
    lset, sset = set(layers), set(scales)
    seen = set()
    for c in cells:
        if not isinstance(c, dict):
            raise InputError(f"expected every cell as an object in {name}, found {type(c).__name__}")
        l, s = c.get("layer"), c.get("scale")
        if l not in lset or s not in sset or isinstance(l, bool) or isinstance(s, bool):
            raise InputError(f"expected cells at the result's layers {layers[:8]} and scales {scales[:8]} in {name}, "
                             f"found a cell at layer {str(l)[:20]}, scale {str(s)[:20]}")
        if (l, s) in seen:
            raise InputError(f"expected one cell per layer and scale in {name}, found layer {l}, scale {s} twice")
        seen.add((l, s))
        for k in TUNE_METRICS:
            if _number(c.get(k), f"the cell's {k}", name) is not None and not _finite(c[k]):
                raise InputError(f"expected the cell's {k} as a finite number or null in {name}, found "
                                 f"{str(c[k])[:40]}")
        ci = c.get("concept_ci")
        if not isinstance(ci, list) or len(ci) != 2 or not all(_finite(x) for x in ci + [c.get("concept")]):
            raise InputError(f"expected every cell's concept as a finite number with its concept_ci as [low, high] in "
                             f"{name}, found {str(c.get('concept'))[:20]} and {str(ci)[:40]}")
        if not isinstance(c.get("pareto", False), bool):
            raise InputError(f"expected a cell's 'pareto' as true or false in {name}, found {str(c.get('pareto'))[:20]!r}")
        _texts(c.get("generations"), f"the generations of the cell at layer {l}, scale {s}", name, n)
    rec = obj.get("recommended")
    if rec is not None and (not isinstance(rec, dict) or (rec.get("layer"), rec.get("scale")) not in seen):
        raise InputError(f"expected 'recommended' as the layer and scale of one of its cells in {name}, found "
                         f"{str(rec)[:60]!r}")
    return obj


def parse_tune(text, name: str = "tune") -> dict:
    """A tune result from JSON text (at most ``MAX_RESULT_BYTES``), checked by :func:`check_tune`.

    Examples:
        >>> from steerkit.apps.io import parse_tune
        >>> parse_tune("[1, 2]")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a tune result (a JSON object with layers, scales, prompts, baseline and cells) in tune, found list
    """
    if not isinstance(text, str) or len(text) > MAX_RESULT_BYTES:
        raise InputError(f"expected a tune result of at most {MAX_RESULT_BYTES >> 20} MiB of JSON text in {name}")
    try:
        obj = jsontext.loads(text)
    except (ValueError, RecursionError) as e:
        raise InputError(f"expected a tune result as JSON in {name}, could not read it ({type(e).__name__}: "
                         f"{str(e)[:120]})") from None
    return check_tune(obj, name)


def scan_tunes(results_dir) -> list[str]:
    """Names (relative to ``results_dir``) of its tune results: ``*tune*.json`` regular files.

    Examples:
        >>> import json
        >>> from steerkit.apps.io import scan_tunes
        >>> _ = (tmp_dir / "refusal_tune.json").write_text("{}")
        >>> _ = (tmp_dir / "notes.txt").write_text("")
        >>> scan_tunes(tmp_dir)
        ['refusal_tune.json']
    """
    f = _folder(results_dir)
    return [] if f is None else [r for r in walk(f) if is_tune_name(r)]


def read_tune(results_dir, rel) -> dict:
    """The tune result ``rel`` of ``results_dir`` (a name from :func:`scan_tunes`), read through
    :class:`steerkit.storage.files.Folder`: a name that is not a regular ``*tune*.json`` file inside the
    folder (``..``, an absolute path, a link, a FIFO) gets :func:`not_a_result`.

    Examples:
        >>> from steerkit.apps.io import read_tune
        >>> read_tune(tmp_dir, "../elsewhere_tune.json")
        Traceback (most recent call last):
        ...
        steerkit.apps.io.NotAResult: expected a tune result of this app (a name from the list, relative to the results folder), found something else; press Rescan and pick one from the list
    """
    f = _folder(results_dir)
    if f is None or not isinstance(rel, str) or not is_tune_name(rel):
        raise not_a_result("tune result")
    return parse_tune(read_result(f, rel, "tune result"), name=PurePosixPath(rel).name)


def load_tune(path) -> dict:
    """The tune result at ``path`` (read through its own folder: no link, no FIFO), checked.

    Examples:
        >>> from steerkit.apps.io import load_tune
        >>> load_tune(tmp_dir / "none_tune.json")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected a tune result at ..., found nothing there
    """
    f, name = _split(path)
    try:
        data = f.read_bytes(name, MAX_RESULT_BYTES)
    except FileNotFoundError:
        raise InputError(f"expected a tune result at {path}, found nothing there") from None
    return parse_tune(data.decode("utf-8", errors="replace"), name=name)


def tune_cell(result: dict, layer, scale) -> Optional[dict]:
    """The cell of a (checked) tune result at ``layer`` and ``scale`` (scales compared to 1e-9), or
    ``None``.

    Examples:
        >>> from steerkit.apps.io import tune_cell
        >>> res = {"cells": [{"layer": 3, "scale": 2.0, "kl": 0.4}, {"layer": 3, "scale": 4.0, "kl": 1.1}]}
        >>> tune_cell(res, 3, 4)["kl"], tune_cell(res, 5, 4)
        (1.1, None)
    """
    if isinstance(layer, bool) or not isinstance(layer, (int, float)) or not _finite(scale) \
            or not isinstance(result, dict):
        return None
    for c in result.get("cells") or ():
        if c.get("layer") == layer and abs(float(c.get("scale")) - float(scale)) <= 1e-9 * max(1.0, abs(scale)):
            return c
    return None
