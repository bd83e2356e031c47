"""Lowering to interventions, and interventions to what a site's kernel sees.

:class:`Steerable` is what every steerable kind implements (``to_interventions(facts, *, scale, override)``);
:func:`lower` turns one steering (interventions, a steerable value, or a list of them, composed) into a list of
:class:`~steerkit.interventions.Intervention`;
:func:`from_config` reads a kernel configuration back as interventions. The private helpers below
lower ``heads=`` / ``neurons=``, patch sources and ``apply`` callables to the rows of features a site's
kernel sees (:func:`steerkit.interventions.compile_steering` calls them).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Mapping, Optional, Protocol, runtime_checkable

import torch
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooks.names import EXPERT_OUT, HEAD_HOOKS, MATRIX_HOOKS, MLP_HOOKS, RECORD_ONLY
from steerkit.hooks.names import parse as parse_hook
from steerkit.kernels import SteerConfig
from steerkit.kernels.config import add_terms
from steerkit.hooks.positions import PositionSpec

from steerkit.interventions.checks import _basis, _tensor, _vector
from steerkit.interventions.conditions import Condition
from steerkit.interventions.facts import ModelFacts
from steerkit.interventions.values import Gate, Intervention


def from_config(site: str, cfg: SteerConfig, *, positions: PositionSpec = "all",
                preserve_norm: bool = False) -> list[Intervention]:
    """The interventions a kernel :class:`SteerConfig` stands for (basis, injection, region).

    Examples:
        >>> u = torch.zeros(64); u[0] = 1.0
        >>> cfg = SteerConfig(basis=u[None], strength=1.0, add=torch.ones(64), add_scale=2.0)
        >>> [(iv.op, iv.scale) for iv in from_config("blocks.1.hook_resid_post", cfg)]
        [('ablate', 1.0), ('add', 2.0)]
    """
    if not isinstance(cfg, SteerConfig):
        raise InputError(f"expected a steerkit.kernels.SteerConfig at {site!r}, found {type(cfg).__name__}; "
                         "build one with SteerConfig.injection(v, scale) etc.")
    gate = None
    if cfg.gate_direction is not None:
        gate = Gate(cfg.gate_direction, cfg.gate_threshold, cfg.gate_mode)
    out: list[Intervention] = []
    kw: dict = dict(positions=positions, preserve_norm=preserve_norm)
    if cfg.basis is not None:
        b = _tensor(cfg.basis, f"the basis at {site!r}")
        b = b if b.dim() == 2 else b[None]
        s = torch.as_tensor(cfg.strength, dtype=torch.float32).reshape(-1)
        if cfg.target is None:
            if s.numel() == 1:
                out.append(Intervention(site, "ablate", _basis(b, f"the basis at {site!r}"), float(s), **kw))
            else:
                for i in range(b.shape[0]):
                    out.append(Intervention(site, "ablate", _basis(b[i], f"the basis at {site!r}"), float(s[i]), **kw))
        else:
            if bool((s != 1).any()):
                raise InputError(f"expected strength 1 with a clamp target at {site!r}, found {s.tolist()}; "
                                 "a partial clamp is an ablation of strength s towards the target: split it")
            out.append(Intervention.clamp(site, b, torch.as_tensor(cfg.target, dtype=torch.float32), **kw))
    if cfg.add is not None:
        a, sc = add_terms(_tensor(cfg.add, f"the add vector at {site!r}"), cfg.add_scale, repr(site))
        for i in range(a.shape[0]):
            out.append(Intervention(site, "add", _vector(a[i], "the add vector"), float(sc[i]), gate=gate, **kw))
    if cfg.region is not None:
        out.append(Intervention(site, "project", None, float(cfg.region_strength), region=cfg.region, gate=gate, **kw))
    return out


@runtime_checkable
class Steerable(Protocol):
    """What every steerable kind implements (every stored artifact that steers, and anything of a user's):
    what it does to a model with these :class:`~steerkit.interventions.ModelFacts`, as interventions,
    ``scale`` multiplying its effect, ``override`` turning a fingerprint or depth mismatch into a warning.

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> vec = SteeringVector.from_direction(torch.ones(64), layer=1, model=tiny)
        >>> isinstance(vec, Steerable), vec.to_interventions(tiny.facts, scale=2.0)[0].scale
        (True, 2.0)
    """

    def to_interventions(self, facts: ModelFacts, *, scale: float = 1.0,
                         override: bool = False) -> list[Intervention]: ...


def lower(steering, facts: ModelFacts, *, scale: float = 1.0, override: bool = False) -> list[Intervention]:
    """One steering (for every row) as a list of interventions: an :class:`Intervention`, a list of
    them, a :class:`Steerable` (every stored artifact kind), or (deprecated, it warns) a
    ``{hook: SteerConfig | [SteerConfig, ...]}`` dict of the kernel's configurations.

    Examples:
        >>> add = Intervention.add("blocks.1.hook_resid_post", torch.ones(64), 3.0)
        >>> lower([add], tiny.facts)
        [Intervention('blocks.1.hook_resid_post', add, (64,), scale=3.0, positions='all')]
    """
    if isinstance(steering, Intervention):
        return [steering]
    if isinstance(steering, Steerable):
        return list(steering.to_interventions(facts, scale=scale, override=override))
    if scale != 1.0:
        raise InputError("expected scale= only with an artifact; put the scale in each intervention")
    if isinstance(steering, Mapping):
        warnings.warn("a {hook: SteerConfig} steering is the kernel's format and is deprecated: pass "
                      "steerkit.Intervention values (steerkit.interventions.from_config converts one)",
                      DeprecationWarning, stacklevel=2)
        out: list[Intervention] = []
        for h, c in steering.items():
            for cfg in (c if isinstance(c, (list, tuple)) else [c]):
                out += from_config(h, cfg)
        return out
    if isinstance(steering, (list, tuple)):
        out = []
        for i, s in enumerate(steering):
            if isinstance(s, Intervention):
                out.append(s)
            elif isinstance(s, (Steerable, Mapping)):
                out += lower(s, facts, override=override)
            else:
                raise InputError(f"expected interventions, artifacts or {{hook: SteerConfig}} dicts in the "
                                 f"steering, found {type(s).__name__} at index {i}")
        return out
    raise InputError(f"expected a steering: an Intervention, a list of them, a stored artifact or a "
                     f"{{hook: SteerConfig}} dict, found {type(steering).__name__}")


def _feature_blocks(p: Intervention, kind: str, facts: ModelFacts, key_len: Optional[int] = None) -> list[list[int]]:
    """The feature indices ``p.heads`` / ``p.neurons`` name at a site of ``kind``: one block per head
    (``d_head`` features; ``key_len`` for an attention matrix), or one block of neurons."""
    site = p.site
    if p.heads is not None:
        if kind not in HEAD_HOOKS + MATRIX_HOOKS + (EXPERT_OUT,):
            raise InputError(f"expected heads= at an attention component hook (attn.hook_q / k / v / z / "
                             f"attn_scores / pattern) or experts at mlp.hook_expert_out, found it at {site!r}; use "
                             "the per-head (per-expert) hooks")
        if kind in MATRIX_HOOKS:
            n, m = facts._dim("n_heads", site), int(key_len or 0)
        else:
            n, m = facts.units_at(kind, site)
        what = "experts" if kind == EXPERT_OUT else "heads"
        bad = [h for h in p.heads if h >= n]
        if bad:
            raise InputError(f"expected {what} in 0..{n - 1} at {site!r} ({n} {what}), found {bad}")
        return [list(range(h * m, (h + 1) * m)) for h in p.heads]
    if p.neurons is not None:
        if kind not in MLP_HOOKS:
            raise InputError(f"expected neurons= at an MLP hook (mlp.hook_pre / mlp.hook_post), found it at {site!r}")
        n = facts._dim("d_mlp", site)
        bad = [i for i in p.neurons if i >= n]
        if bad:
            raise InputError(f"expected neurons in 0..{n - 1} at {site!r} (d_mlp={n}), found {bad}")
        return [list(p.neurons)]
    return []


def _flat_source(p: Intervention, kind: str, facts: ModelFacts) -> Tensor:
    """A patch source as rows of features ``[pos, width]`` (an attention matrix ``[heads, q, k]`` as
    ``[q, heads * k]``)."""
    t = p.tensor
    assert t is not None
    if kind in MATRIX_HOOKS:
        if t.dim() != 3 or t.shape[0] != facts._dim("n_heads", p.site):
            raise InputError(f"expected the patch source at {p.site!r} as [n_heads, q_pos, k_pos] "
                             f"(n_heads={facts.n_heads}), found {tuple(t.shape)}")
        return t.transpose(0, 1).flatten(1)
    w = facts.width(kind, p.site)
    flat = t.flatten(1) if t.dim() > 2 else t
    if flat.dim() != 2 or flat.shape[1] != w:
        raise InputError(f"expected the patch source at {p.site!r} as [pos, ...] with {w} features per position, "
                         f"found {tuple(t.shape)}; take one row of a recording of this site, e.g. cache[hook][0]")
    return flat


def _natural(fn: Callable, kind: str, facts: ModelFacts, site: str) -> Callable:
    """``fn`` on the site's own shape, for the kernel's rows of features."""
    if kind in HEAD_HOOKS + (EXPERT_OUT,):
        H, dh = facts.units_at(kind, site)

        def on_heads(x: Tensor) -> Tensor:
            y = fn(x.unflatten(-1, (H, dh)))
            if not isinstance(y, Tensor) or y.shape[-2:] != (H, dh):
                raise InputError(f"expected the intervention's fn at {site!r} to return [.., {H}, {dh}] (its input's "
                                 f"shape), found {getattr(y, 'shape', type(y).__name__)}")
            return y.flatten(-2)
        return on_heads
    if kind in MATRIX_HOOKS:
        H = facts._dim("n_heads", site)

        def on_matrix(x: Tensor) -> Tensor:
            nat = x.unflatten(-1, (H, -1)).transpose(1, 2)
            y = fn(nat)
            if not isinstance(y, Tensor) or y.shape != nat.shape:
                raise InputError(f"expected the intervention's fn at {site!r} to return {tuple(nat.shape)} (its "
                                 f"input's shape), found {getattr(y, 'shape', type(y).__name__)}")
            return y.transpose(1, 2).flatten(-2)
        return on_matrix
    return fn


def _structured(p: Intervention, kind: str, facts: ModelFacts) -> tuple[Intervention, Optional[Tensor]]:
    """``p`` at a site of ``kind`` with its heads / neurons lowered to full-width tensors, a patch source as
    rows of features, and an apply callable that sees the site's own shape; and for ``replace`` / ``patch`` /
    ``apply`` limited to heads or neurons the features it writes (bool ``[width]``, else ``None``)."""
    if kind in MATRIX_HOOKS and p.op not in ("patch", "apply"):
        raise InputError(f"expected patch or apply at {p.site!r} (an attention matrix: its key axis grows as "
                         f"tokens are generated), found {p.op}; edit attn.hook_q / hook_k / hook_z for vector edits")
    rep: dict = {}
    features = None
    if p.op == "patch":
        rep["tensor"] = _flat_source(p, kind, facts)
    if p.op == "apply" and p.fn is not None:
        rep["fn"] = _natural(p.fn, kind, facts, p.site)
    key_len = None
    if kind in MATRIX_HOOKS and p.op == "patch":
        key_len = rep["tensor"].shape[1] // facts._dim("n_heads", p.site)
    blocks = _feature_blocks(p, kind, facts, key_len)
    if blocks:
        w = key_len * facts._dim("n_heads", p.site) if key_len is not None else facts.width(kind, p.site)
        assert w is not None
        m = len(blocks[0])
        mask = torch.zeros(w, dtype=torch.bool)
        for b in blocks:
            mask[b] = True
        t = p.tensor
        if p.op in ("add", "replace") and t is not None:
            if t.shape[-1] != m:
                raise InputError(f"expected the {p.op} vector at {p.site!r} of shape [{m}] (one value per feature of "
                                 f"the chosen {'heads' if p.heads else 'neurons'}), found {tuple(t.shape)}")
            full = torch.zeros(w, dtype=t.dtype)
            for b in blocks:
                full[b] = t
            rep["tensor"] = full
        elif p.op in ("ablate", "clamp") and t is not None:
            if t.shape[-1] != m:
                raise InputError(f"expected the {p.op} directions at {p.site!r} of width {m} (the chosen "
                                 f"{'heads' if p.heads else 'neurons'}), found {tuple(t.shape)}")
            rows = torch.zeros(len(blocks) * t.shape[0], w, dtype=t.dtype)
            for i, b in enumerate(blocks):
                rows[i * t.shape[0]:(i + 1) * t.shape[0], b] = t
            rep["tensor"] = rows
            if p.op == "clamp" and p.value is not None:
                rep["value"] = p.value.repeat(len(blocks))
        if p.op in ("replace", "patch", "apply"):
            features = mask
        rep.update(heads=None, neurons=None)
    return (dataclasses.replace(p, **rep) if rep else p), features


def _check_condition(c: Condition, facts: ModelFacts) -> Condition:
    """``c`` checked against the model: a site it has, with activations as wide as the direction."""
    kind = parse_hook(c.site, facts.n_layers, has_resid_mid=facts.has_resid_mid).kind
    if kind in MATRIX_HOOKS:
        raise InputError(f"expected a condition at a site with one vector per token (a residual, sub-layer or "
                         f"component hook), found the attention matrix {c.site!r}")
    w = facts.width(kind, c.site)
    if int(c.direction.shape[0]) != w:
        raise InputError(f"expected the condition direction at {c.site!r} of shape [{w}], found "
                         f"[{c.direction.shape[0]}]; was it fitted on another model or at another site?")
    return c


def _check_source(p: Intervention, facts: ModelFacts) -> Optional[str]:
    """The site ``p``'s latent edit reads (``None``: its own), checked against the model: a site it has that holds
    rows of features as wide as the encoder reads."""
    if p.latent is None or p.latent.source is None:
        return None
    source = p.latent.source
    try:
        kind = parse_hook(source, facts.n_layers, has_resid_mid=facts.has_resid_mid).kind
    except (KeyError, ValueError) as e:  # HookNameError, InputError
        raise InputError(f"expected the source of the latent edit at {p.site!r} to be a site of this model, found "
                         f"{source!r}: {e}") from None
    if kind in MATRIX_HOOKS or kind in RECORD_ONLY:
        raise InputError(f"expected the source of the latent edit at {p.site!r} to hold one vector per token (a "
                         f"residual, sub-layer or component hook), found {source!r}")
    w = facts.width(kind, source)
    if w is not None and w != p.latent.d_in:
        raise InputError(f"expected the transcoder at {p.site!r} to read {w} features at {source!r}, found "
                         f"d_in={p.latent.d_in}; was it made for another model or another site?")
    return source
