"""Indirect-object identification (IOI) by activation patching (Wang et al. 2022, "Interpretability in
the Wild"; the setting of TransformerLens's exploratory-analysis demo).

A template such as ``"When{IO} and{S} went to the store,{S2} gave a drink to"`` is filled with a name
pair: the clean prompt repeats the subject (``S2 = S``) and the model should continue with the
indirect object ``IO``; the corrupted prompt names the indirect object again (``S2 = IO``), which
makes ``S`` the answer. The two prompts differ in the one ``S2`` token. The metric is the logit
difference ``logit(IO) - logit(S)`` at the last position: positive on clean prompts, negative on
corrupted ones.

:func:`run` (``run(sm, IOIConfig(...))``, ``steerkit ioi``) patches every pair with
:func:`steerkit.probes.activation_patching`: ``resid_pre`` at every layer and position, and ``z``
(each head of ``attn.hook_z`` at every position). Grids are aggregated over pairs by averaging the
raw metric values and the clean / corrupted metrics, then normalising once
(``(v - corrupted) / (clean - corrupted)``: 1 = the clean behaviour restored, 0 = as corrupted):
``resid_pre`` per template (one position axis per template), ``z`` over every pair, and two
position-free curves over every pair: the restored fraction at the ``S2`` token and at the last
token, per layer. An :class:`IOIResult` holds them as normalised
:class:`~steerkit.probes.PatchingResult` grids, with ``to_json()`` and ``plot()`` (heatmaps).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from tqdm import tqdm

from steerkit.errors import InputError

from ..patching import PatchingResult, activation_patching, logit_diff_metric, token_id
from ..plots.require import plotly_required

if TYPE_CHECKING:
    from steerkit.model import SteerModel

#: templates: ``{IO}`` / ``{S}`` the two names (introduced in either order), ``{S2}`` the second
#: mention (``S`` in the clean prompt, ``IO`` in the corrupted one); the answer follows the last word
TEMPLATES: tuple[str, ...] = (
    "When{IO} and{S} went to the store,{S2} gave a drink to",
    "When{S} and{IO} went to the park,{S2} gave a ball to",
    "After{IO} and{S} went to the office,{S2} handed a letter to",
    "Then,{S} and{IO} had a long argument, and afterwards{S2} said to",
)
#: (indirect object, subject) name pairs; each name is one token after a space in most BPE vocabularies
NAMES: tuple[tuple[str, str], ...] = ((" Mary", " John"), (" Tom", " Sarah"), (" Alice", " Mark"),
                                      (" James", " Anna"))
HOOKS = ("resid_pre", "z")


@dataclass
class IOIConfig:
    """``steerkit ioi``: ``templates`` (each with ``{IO}``, ``{S}`` and ``{S2}`` once; names are
    inserted as given, leading space included) filled with every ``(IO, S)`` pair of ``names``;
    ``hooks`` patched (``resid_pre`` and / or ``z``); ``batch_size`` patched runs per forward pass.

    Examples:
        >>> from steerkit.probes.methods.ioi import IOIConfig
        >>> cfg = IOIConfig(templates=("When{IO} and{S} went to the store,{S2} gave a drink to",),
        ...                 names=((" Mary", " John"),), hooks=("z",))
        >>> len(IOIConfig().templates), len(IOIConfig().names), cfg.hooks
        (4, 4, ('z',))
    """

    templates: tuple = TEMPLATES
    names: tuple = NAMES
    hooks: tuple = HOOKS
    batch_size: int = 32


@dataclass
class IOIPair:
    """One IOI prompt pair: the ``clean`` prompt (S repeated), the ``corrupted`` one (IO repeated) that
    differs from it at token ``s2_pos`` only, and their logit differences once :func:`run` measured them.

    Examples:
        >>> from steerkit.probes.methods.ioi import IOIPair
        >>> p = IOIPair(0, " Mary", " John", "When Mary and John left, John thanked",
        ...             "When Mary and John left, Mary thanked", s2_pos=6)
        >>> p.io, p.s, p.clean_metric != p.clean_metric  # NaN until measured
        (' Mary', ' John', True)
    """

    template: int
    io: str
    s: str
    clean: str
    corrupted: str
    s2_pos: int
    clean_metric: float = float("nan")
    corrupted_metric: float = float("nan")


@dataclass
class IOIResult:
    """``resid_pre``: one normalised grid ``[n_layers, n_pos]`` per template (the token labels of its
    first pair); ``z``: the normalised ``[n_layers, n_heads]`` grid over every pair; ``s2_curve`` /
    ``end_curve`` ``[n_layers]``: the restored fraction when ``resid_pre`` is patched at the S2 token /
    at the last token, over every pair. ``pairs``: every prompt pair with its clean and corrupted
    logit differences.

    Examples:
        >>> from steerkit.probes.methods import ioi
        >>> cfg = ioi.IOIConfig(templates=(ioi.TEMPLATES[0],), names=((" Mary", " John"),), hooks=("z",))
        >>> res = ioi.run(tiny, cfg, progress=False)
        >>> len(res.pairs), res.z.axes, tuple(res.z.values.shape), len(res.top_heads(3))
        (1, ('layer', 'head'), (4, 4), 3)
        >>> sorted(res.to_json())[:3], type(res.plot()).__name__
        (['clean_accuracy', 'clean_logit_diff', 'corrupted_logit_diff'], 'Figure')
    """

    pairs: list
    resid_pre: list
    z: Optional[PatchingResult]
    s2_curve: Optional[np.ndarray]
    end_curve: Optional[np.ndarray]
    model_name: str = ""

    @property
    def clean_logit_diff(self) -> float:
        return float(np.mean([p.clean_metric for p in self.pairs]))

    @property
    def corrupted_logit_diff(self) -> float:
        return float(np.mean([p.corrupted_metric for p in self.pairs]))

    @property
    def clean_accuracy(self) -> float:
        """Fraction of clean prompts where the IO logit beats the S logit."""
        return float(np.mean([p.clean_metric > 0 for p in self.pairs]))

    def top_heads(self, k: int = 10) -> list[tuple[int, int, float]]:
        """``(layer, head, restored fraction)`` of the ``k`` heads with the largest ``|value|`` in ``z``."""
        if self.z is None:
            return []
        v = self.z.values.numpy()
        flat = v.reshape(-1)
        order = np.argsort(-np.abs(flat), kind="stable")[:k]
        H = v.shape[1]
        return [(int(self.z.layers[i // H]), int(self.z.heads[i % H]), float(flat[i])) for i in order]

    def to_dict(self) -> dict:
        def curve(c):
            return None if c is None else [float(x) for x in c]
        return {"model": self.model_name,
                "pairs": [{"template": p.template, "io": p.io, "s": p.s, "clean": p.clean, "corrupted": p.corrupted,
                           "s2_pos": p.s2_pos, "clean_logit_diff": p.clean_metric,
                           "corrupted_logit_diff": p.corrupted_metric} for p in self.pairs],
                "clean_logit_diff": self.clean_logit_diff, "corrupted_logit_diff": self.corrupted_logit_diff,
                "clean_accuracy": self.clean_accuracy,
                "resid_pre": [r.to_dict() for r in self.resid_pre],
                "z": None if self.z is None else self.z.to_dict(),
                "s2_curve": curve(self.s2_curve), "end_curve": curve(self.end_curve),
                "top_heads": [{"layer": l, "head": h, "value": v} for l, h, v in self.top_heads()]}

    to_json = to_dict

    def figures(self) -> list:
        """One heatmap per ``resid_pre`` grid (per template), then the ``z`` heatmap."""
        out = [r.plot(title=f"IOI template {i}: patching resid_pre (restored fraction of the logit difference)")
               for i, r in enumerate(self.resid_pre)]
        if self.z is not None:
            out.append(self.z.plot(title="IOI: patching each head's z (restored fraction, every pair)"))
        return out

    def plot(self, title: str | None = None):
        """A plotly figure with two heatmaps side by side: ``resid_pre`` of the first template and
        ``z`` over every pair (whichever were computed) (:func:`steerkit.probes.plots.ioi.ioi_figure`)."""
        with plotly_required():
            from ..plots import ioi as figures
        return figures.ioi_figure(self, title)


def ioi_pairs(sm: "SteerModel", templates=TEMPLATES, names=NAMES) -> list[IOIPair]:
    """Every (template, name pair) as an :class:`IOIPair`, checked: each name is one token, and the clean
    and corrupted prompts tokenize to the same length and differ in exactly one token (S2).

    Examples:
        >>> from steerkit.probes.methods.ioi import ioi_pairs
        >>> pairs = ioi_pairs(tiny, templates=("When{IO} and{S} went to the store,{S2} gave a drink to",),
        ...                   names=((" Mary", " John"), (" Tom", " Sarah")))
        >>> len(pairs), pairs[0].clean, pairs[0].s2_pos
        (2, 'When Mary and John went to the store, John gave a drink to', 9)
    """
    templates, names = tuple(templates), tuple(names)
    if not templates or not names:
        raise InputError(f"expected at least one template and one name pair, found {len(templates)} and {len(names)}")
    for t in templates:
        if not isinstance(t, str) or any(t.count("{" + k + "}") != 1 for k in ("IO", "S", "S2")):
            raise InputError(f"expected each template to hold {{IO}}, {{S}} and {{S2}} once, found {t!r:.120}")
    out = []
    for ti, t in enumerate(templates):
        for pair in names:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)
                    and pair[0] != pair[1]):
                raise InputError(f"expected each name pair as two different strings (IO, S), found {pair!r:.80}")
            io, s = pair
            token_id(sm, io, "the IO name")
            token_id(sm, s, "the S name")
            clean = t.format(IO=io, S=s, S2=s)
            corrupted = t.format(IO=io, S=s, S2=io)
            a = sm.tokenize([clean], chat=False).input_ids[0]
            b = sm.tokenize([corrupted], chat=False).input_ids[0]
            diff = (a != b).nonzero().flatten().tolist() if a.shape == b.shape else None
            if diff is None or len(diff) != 1:
                raise InputError(f"expected the clean and corrupted prompts of template {ti} with {io!r}/{s!r} to "
                                 f"differ in one token of equal-length prompts, found {len(a)} vs {len(b)} tokens"
                                 + ("" if diff is None else f" differing at {diff}")
                                 + "; choose names that are single tokens in context")
            out.append(IOIPair(ti, io, s, clean, corrupted, int(diff[0])))
    return out


def _aggregate(results: list[PatchingResult]) -> PatchingResult:
    """The mean raw grid and mean clean / corrupted metrics of same-shaped results, normalised once."""
    first = results[0]
    values = torch.stack([r.values.double() for r in results]).mean(0).float()
    agg = PatchingResult(values=values, hook=first.hook, method=first.method, layers=list(first.layers),
                         positions=list(first.positions), heads=first.heads, tokens=list(first.tokens),
                         clean_metric=float(np.mean([r.clean_metric for r in results])),
                         corrupted_metric=float(np.mean([r.corrupted_metric for r in results])))
    return agg.normalized()


def _check_config(cfg: IOIConfig) -> None:
    hooks = tuple(cfg.hooks)
    if not hooks or any(h not in HOOKS for h in hooks) or len(set(hooks)) != len(hooks):
        raise InputError(f"expected hooks as distinct entries of {HOOKS}, found {cfg.hooks!r}")
    if isinstance(cfg.batch_size, bool) or not isinstance(cfg.batch_size, int) or cfg.batch_size < 1:
        raise InputError(f"expected batch_size as an int >= 1, found {cfg.batch_size!r}")


def run(sm: "SteerModel", config: IOIConfig | None = None, *, progress: bool = True, executor=None) -> IOIResult:
    """Activation patching of ``resid_pre`` and ``z`` on every IOI prompt pair (see the module
    docstring), aggregated into normalised grids. ``executor`` (a :class:`steerkit.executors.RayExecutor`
    whose workers load this model): each grid's layers run on its workers
    (:func:`~steerkit.probes.activation_patching`'s ``executor``).

    One template and one name pair on the tiny model; the default config on ``sm`` patches 16 pairs, minutes
    of work.

    Examples:
        >>> from steerkit.probes.methods import ioi
        >>> cfg = ioi.IOIConfig(templates=(ioi.TEMPLATES[0],), names=((" Mary", " John"),))
        >>> res = ioi.run(tiny, cfg, progress=False)
        >>> [r.axes for r in res.resid_pre], res.s2_curve.shape, res.end_curve.shape
        ([('layer', 'pos')], (4,), (4,))
        >>> round(float(res.resid_pre[0].values[0, 9]), 3)  # patching S2 before block 0 restores everything
        1.0
    """
    cfg = config or IOIConfig()
    _check_config(cfg)
    pairs = ioi_pairs(sm, cfg.templates, cfg.names)
    per_template: dict[int, list[PatchingResult]] = {}
    z_all: list[PatchingResult] = []
    s2_raw, end_raw, cleans, corrs = [], [], [], []
    for p in tqdm(pairs, desc="ioi", file=sys.stderr, disable=not progress):
        metric = logit_diff_metric(sm, p.io, p.s)
        if "resid_pre" in cfg.hooks:
            r = activation_patching(sm, p.clean, p.corrupted, metric, "resid_pre", batch_size=cfg.batch_size,
                                    progress=False, executor=executor)
            per_template.setdefault(p.template, []).append(r)
            s2_raw.append(r.values[:, p.s2_pos].double())
            end_raw.append(r.values[:, -1].double())
            p.clean_metric, p.corrupted_metric = r.clean_metric, r.corrupted_metric
        if "z" in cfg.hooks:
            r = activation_patching(sm, p.clean, p.corrupted, metric, "z", batch_size=cfg.batch_size, progress=False,
                                    executor=executor)
            z_all.append(r)
            p.clean_metric, p.corrupted_metric = r.clean_metric, r.corrupted_metric
        cleans.append(p.clean_metric)
        corrs.append(p.corrupted_metric)
    resid = [_aggregate(per_template[t]) for t in sorted(per_template)]
    z = _aggregate(z_all) if z_all else None
    s2_curve = end_curve = None
    if s2_raw:
        gap = float(np.mean(cleans) - np.mean(corrs))
        if abs(gap) < 1e-12:
            raise InputError("expected different mean clean and corrupted logit differences, found equal ones; the "
                             "model does not tell the prompts apart")
        base = float(np.mean(corrs))
        s2_curve = ((torch.stack(s2_raw).mean(0) - base) / gap).float().numpy()
        end_curve = ((torch.stack(end_raw).mean(0) - base) / gap).float().numpy()
    return IOIResult(pairs, resid, z, s2_curve, end_curve, getattr(sm, "name", ""))


def summary_lines(res: IOIResult, k: int = 8) -> list[str]:
    """Human-readable lines: the logit differences, the S2 / last-token curves and the top heads.

    Examples:
        >>> from steerkit.probes.methods import ioi
        >>> cfg = ioi.IOIConfig(templates=(ioi.TEMPLATES[0],), names=((" Mary", " John"),), hooks=("z",))
        >>> lines = ioi.summary_lines(ioi.run(tiny, cfg, progress=False), k=2)
        >>> len(lines), lines[0].startswith("1 prompt pairs: clean logit diff"), lines[1].startswith("  z L")
        (3, True, True)
    """
    out = [f"{len(res.pairs)} prompt pairs: clean logit diff {res.clean_logit_diff:.3f} (IO > S in "
           f"{res.clean_accuracy:.0%}), corrupted {res.corrupted_logit_diff:.3f}"]
    if res.s2_curve is not None:
        out.append("  resid_pre restored at S2:   " + " ".join(f"{x:.2f}" for x in res.s2_curve))
        out.append("  resid_pre restored at last: " + " ".join(f"{x:.2f}" for x in res.end_curve))
    for l, h, v in res.top_heads(k):
        out.append(f"  z L{l}H{h}: {v:+.3f}")
    return out


__all__ = ["HOOKS", "IOIConfig", "IOIPair", "IOIResult", "NAMES", "TEMPLATES", "ioi_pairs", "run", "summary_lines"]
