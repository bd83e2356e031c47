"""Which token positions a record or an edit applies to.

A forward pass (or one step of generation) processes a *chunk* of positions
``[start, start + T)`` of a padded batch. :class:`RunState` knows the prompt's
attention mask (``[batch, P]``, left or right padded), so every hook can turn a
position spec into a boolean mask ``[batch, T]`` over the chunk it sees:

==================  =========================================================
spec                positions selected (padding is never selected)
==================  =========================================================
``"all"``           every real token, prompt and generated
``"prompt"``        real prompt tokens
``"generated"``     generated tokens (absolute index >= P)
``"last"``          the last real prompt token of each row
``int`` / list      indices among the real prompt tokens (negative: from the
                    end, ``-1`` is the last prompt token)
``range``/``slice`` the same, as a range
bool tensor         ``[batch, P]`` mask over the padded prompt
==================  =========================================================
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch
from torch import Tensor

from .errors import InputError

PositionSpec = Union[str, int, list, tuple, range, slice, Tensor]
_NAMED = ("all", "prompt", "generated", "last")


@dataclass
class RunState:
    """What a forward pass or a generation run is processing.

    ``attention_mask`` is the prompt's mask ``[batch, P]``; positions at or past
    ``P`` are generated tokens. ``run_id`` changes with every run so hooks can
    reset their own position counters.
    """

    attention_mask: Tensor
    run_id: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return int(self.attention_mask.shape[0])

    @property
    def prompt_len(self) -> int:
        return int(self.attention_mask.shape[1])

    def real_index(self) -> Tensor:
        """``[batch, P]`` index of each prompt token among the real ones (-1 on padding)."""
        if "ri" not in self._cache:
            m = self.attention_mask.long()
            self._cache["ri"] = torch.where(m.bool(), m.cumsum(1) - 1, torch.full_like(m, -1))
        return self._cache["ri"]

    def n_real(self) -> Tensor:
        if "nr" not in self._cache:
            self._cache["nr"] = self.attention_mask.long().sum(1)
        return self._cache["nr"]

    def last_index(self) -> Tensor:
        """``[batch]`` absolute index of the last real prompt token of each row."""
        if "li" not in self._cache:
            P = self.prompt_len
            ar = torch.arange(P, device=self.attention_mask.device).expand_as(self.attention_mask)
            self._cache["li"] = torch.where(self.attention_mask.bool(), ar, torch.full_like(ar, -1)).amax(1)
        return self._cache["li"]


def validate_positions(spec: PositionSpec) -> PositionSpec:
    """Check a spec early (at registration) so errors surface before any hook runs."""
    if isinstance(spec, str):
        if spec not in _NAMED:
            raise InputError(f"expected positions to be one of {_NAMED}, an int, a list of ints, a range "
                             f"or a bool mask, found the string {spec!r}")
        return spec
    if isinstance(spec, bool):
        raise InputError("expected positions to be a spec, found a bool; use 'all' or a mask tensor")
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise InputError(f"expected a list of ints as positions, found {spec!r}")
        return list(spec)
    if isinstance(spec, (range, slice)):
        return spec
    if isinstance(spec, Tensor):
        if spec.dtype != torch.bool or spec.dim() != 2:
            raise InputError(f"expected a bool mask [batch, prompt_len] as positions, found "
                             f"dtype {spec.dtype} with shape {tuple(spec.shape)}")
        return spec
    raise InputError(f"expected a position spec ({_NAMED}, int, list, range, slice or bool mask), "
                     f"found {type(spec).__name__}")


def chunk_mask(spec: PositionSpec, run: RunState | None, start: int, T: int, B: int,
               device: torch.device) -> Tensor | None:
    """Boolean ``[B, T]`` mask for the chunk ``[start, start+T)``; ``None`` means every position.

    Without a :class:`RunState` (the model was called directly, not through
    :class:`~steerkit.SteerModel`), every position of the call is a real prompt
    token and the chunk is the whole prompt.
    """
    if run is None:
        am = torch.ones(B, start + T, dtype=torch.long, device=device)
        run = RunState(am)
    P = run.prompt_len
    if start >= P and isinstance(spec, str):  # a decoding step: every position is a generated token
        if spec in ("all", "generated"):
            return None
        key = ("none", B, T, device)
        if key not in run._cache:
            run._cache[key] = torch.zeros(B, T, dtype=torch.bool, device=device)
        return run._cache[key]
    # every hook of one step asks for the same mask: compute it once per (spec, chunk)
    key = ("mask", spec if isinstance(spec, (str, int)) else id(spec), start, T, B, device)
    if key in run._cache:
        return run._cache[key]
    out = _chunk_mask(spec, run, start, T, B, device)
    run._cache[key] = out
    return out


def _chunk_mask(spec: PositionSpec, run: RunState, start: int, T: int, B: int,
                device: torch.device) -> Tensor | None:
    P = run.prompt_len
    abspos = torch.arange(start, start + T, device=device)  # [T]
    in_prompt = abspos < P
    am = run.attention_mask.to(device)
    # real[b, t]: the position holds a real token
    pm = torch.zeros(B, T, dtype=torch.bool, device=device)
    idx_p = abspos.clamp(max=P - 1)
    pm = am[:, idx_p].bool() & in_prompt.unsqueeze(0)
    gen = (~in_prompt).unsqueeze(0).expand(B, T)
    if isinstance(spec, str):
        if spec == "all":
            if bool(gen.all()) or (bool(in_prompt.all()) and bool(pm.all())):
                return None
            return pm | gen
        if spec == "prompt":
            return pm
        if spec == "generated":
            return gen.clone()
        if spec == "last":
            return abspos.unsqueeze(0) == run.last_index().to(device).unsqueeze(1)
    if isinstance(spec, Tensor):
        if spec.shape != run.attention_mask.shape:
            raise InputError(f"expected a position mask of shape {tuple(run.attention_mask.shape)} "
                             f"(batch, padded prompt length), found {tuple(spec.shape)}")
        return spec.to(device)[:, idx_p] & pm
    # index-like specs: indices among the real prompt tokens
    ri = run.real_index().to(device)[:, idx_p]  # [B, T]
    nr = run.n_real().to(device).unsqueeze(1)  # [B, 1]
    if isinstance(spec, (slice, range)):
        sl = slice(spec.start, spec.stop, spec.step) if isinstance(spec, range) else spec
        out = torch.zeros(B, T, dtype=torch.bool, device=device)
        for b in range(B):
            n = int(nr[b, 0])
            wanted = torch.tensor(list(range(*sl.indices(n))), dtype=torch.long, device=device)
            if wanted.numel():
                out[b] = pm[b] & torch.isin(ri[b], wanted)
        return out
    out = torch.zeros(B, T, dtype=torch.bool, device=device)
    for i in spec:
        target = nr + i if i < 0 else torch.full_like(nr, i)
        out |= pm & (ri == target)
    return out
