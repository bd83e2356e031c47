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
``range``           the indices it holds (``range(-3, 0)``: the last three)
``slice``           Python slice semantics over each row's real prompt tokens
bool tensor         ``[batch, P]`` mask over the padded prompt
:class:`TokenMatch` positions whose input token (with the tokens before it)
                    matches a pattern of token-id sets, within ``"all"``,
                    ``"prompt"`` or ``"generated"`` positions
:class:`AnyOf`      the union of several specs, e.g.
                    ``AnyOf("last", TokenMatch(ids, within="generated"))``
==================  =========================================================

Integer positions (``int``, list, ``range``) index each row's real prompt tokens, so an index
``i`` exists in a row of ``n`` real tokens when ``-n <= i < n``. In a batch of prompts of
different lengths an index may exist in the longer rows only: the shorter rows then get nothing
at it, and a :class:`PositionRangeWarning` says so. An index that exists in NO row of the batch
(``99999``, or ``range(100, 200)`` on short prompts) is an :class:`~steerkit.errors.InputError`
naming the valid range and the prompt lengths, raised by the forward pass (or generation step)
that asked for it, for records and edits alike. The check runs once per run, on the first chunk
that covers prompt positions; decoding steps never repeat it. It applies to runs that know their
prompt (``RunState.check_positions``, on for every :class:`~steerkit.SteerModel` forward and
generation); a server's per-request masks and direct calls of the wrapped model keep the
select-nothing behaviour, so one request cannot fail a batch step it shares with others.

Token patterns need the token ids of the run: :meth:`RunState.chunk_ids` reads them
from the prompt ids given to the run and from the tokens the generation loop feeds
back (:meth:`RunState.append_tokens`).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor

from steerkit.errors import InputError, SteerkitError

#: the named position specs, the one list of them (every other spec is indices, a range, a slice, a mask or a
#: token pattern): what :func:`validate_positions`, the command line, the vLLM request and record specs and the
#: stored latent clamps accept by name
POSITION_NAMES = ("all", "prompt", "generated", "last")
_WITHIN = ("all", "prompt", "generated")
#: prompt-token indices a plain position list may hold
MAX_PLAIN_INDICES = 1 << 16


class TokenMatch:
    """Positions whose input token matches a pattern of token-id sets.

    ``TokenMatch(ids)`` selects every position holding a token in ``ids``;
    ``TokenMatch(prev_ids, ids)`` also needs the token before it in ``prev_ids``
    (two tokens that together spell, e.g., ``"\\n\\n"``), and so on for longer
    patterns: the last set is for the position itself. ``within`` restricts the
    match to ``"all"`` real tokens, ``"prompt"`` tokens or ``"generated"`` tokens.
    Padding never matches, and a pattern never reaches back into padding.

    Examples:
        >>> run = RunState(torch.ones(1, 5, dtype=torch.long), input_ids=torch.tensor([[7, 3, 7, 9, 3]]))
        >>> chunk_mask(TokenMatch([7]), run, 0, 5, 1, "cpu").tolist()
        [[True, False, True, False, False]]
        >>> chunk_mask(TokenMatch([7], [3, 9]), run, 0, 5, 1, "cpu").tolist()  # a 3 or a 9 right after a 7
        [[False, True, False, True, False]]
    """

    def __init__(self, *pattern: Iterable[int], within: str = "all"):
        if not pattern:
            raise InputError("expected at least one set of token ids in TokenMatch, found none")
        sets = []
        for i, ids in enumerate(pattern):
            if isinstance(ids, int) and not isinstance(ids, bool):
                ids = [ids]
            try:
                s = sorted({int(t) for t in ids})
            except (TypeError, ValueError):
                raise InputError(f"expected token ids (ints) in set {i} of TokenMatch, found {ids!r:.100}") from None
            if not s:
                raise InputError(f"expected a non-empty set of token ids at index {i} of TokenMatch, found none")
            sets.append(tuple(s))
        if within not in _WITHIN:
            raise InputError(f"expected within to be one of {_WITHIN}, found {within!r}")
        self.pattern: tuple[tuple[int, ...], ...] = tuple(sets)
        self.within = within
        self._t: dict = {}

    def ids(self, i: int, device) -> Tensor:
        key = (i, device)
        if key not in self._t:
            self._t[key] = torch.tensor(self.pattern[i], dtype=torch.long, device=device)
        return self._t[key]

    def __repr__(self):
        sets = ", ".join(f"<{len(s)} ids>" if len(s) > 4 else repr(set(s)) for s in self.pattern)
        return f"TokenMatch({sets}, within={self.within!r})"


class AnyOf:
    """The union of position specs (each validated like a spec of its own).

    Examples:
        >>> run = RunState(torch.tensor([[0, 1, 1, 1]]))  # one left-padded prompt of 3 tokens
        >>> chunk_mask(AnyOf("last", 0), run, 0, 4, 1, "cpu").tolist()
        [[False, True, False, True]]
    """

    def __init__(self, *specs):
        if not specs:
            raise InputError("expected at least one position spec in AnyOf, found none")
        self.specs = tuple(validate_positions(s) for s in specs)

    def __repr__(self):
        return f"AnyOf{self.specs!r}"


class PositionRangeWarning(SteerkitError, UserWarning):
    """Integer positions that exist in some rows of a batch but not in its shorter prompts.

    Examples:
        >>> import warnings
        >>> run = RunState(torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))  # prompts of 4 and 2 tokens
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     check_index_range([3], run)
        >>> [w.category.__name__ for w in caught]
        ['PositionRangeWarning']
    """


PositionSpec = Union[str, int, list, tuple, range, slice, Tensor, TokenMatch, AnyOf]


def selects_generated(spec: PositionSpec) -> bool:
    """Whether ``spec`` can select generated positions (a record then wants the last sampled token fed).

    Examples:
        >>> selects_generated("all"), selects_generated("last"), selects_generated(range(3))
        (True, False, False)
        >>> selects_generated(AnyOf("prompt", TokenMatch([5], within="generated")))
        True
    """
    if isinstance(spec, str):
        return spec in ("all", "generated")
    if isinstance(spec, TokenMatch):
        return spec.within in ("all", "generated")
    if isinstance(spec, AnyOf):
        return any(selects_generated(s) for s in spec.specs)
    return False



def plain_positions(x: Any, what: str = "positions", *, error: type[Exception] = InputError,
                    max_indices: int = MAX_PLAIN_INDICES) -> Union[str, list[int]]:
    """A position spec in the plain form a file, a request or a command line carries: one of
    :data:`POSITION_NAMES`, or a non-empty list of at most ``max_indices`` prompt-token indices (ints; negative
    ones count from the end of the prompt). Anything else raises ``error`` (an
    :class:`~steerkit.errors.InputError` unless the caller names its own subclass of a steerkit error).

    Examples:
        >>> plain_positions("last"), plain_positions((0, -1))
        ('last', [0, -1])
        >>> plain_positions("first")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected positions as one of 'all', 'prompt', 'generated', 'last' or a list of prompt token indices, found 'first'...
    """
    names = ", ".join(map(repr, POSITION_NAMES))
    if isinstance(x, str):
        if x not in POSITION_NAMES:
            raise error(f"expected {what} as one of {names} or a list of prompt token indices, found {x!r:.40}; "
                        "write an index list as [0, -1]")
        return x
    if not isinstance(x, (list, tuple)):
        raise error(f"expected {what} as one of {names} or a list of prompt token indices, found "
                    f"{type(x).__name__}")
    if not x or len(x) > max_indices:
        raise error(f"expected {what} as a list of 1 to {max_indices} prompt token indices, found {len(x)}; use "
                    "'prompt' for every prompt token")
    bad = [i for i in x if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise error(f"expected prompt token indices as integers in {what}, found {bad[0]!r:.40}")
    return [int(i) for i in x]


def positions_from_text(text: str, what: str = "positions") -> Union[str, list[int]]:
    """:func:`plain_positions` of typed text: a name of :data:`POSITION_NAMES` or comma-separated token indices
    (``"0,-1"``).

    Examples:
        >>> positions_from_text(" last "), positions_from_text("0, -1")
        ('last', [0, -1])
        >>> positions_from_text("0,x", "--positions")
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected --positions as one of all, prompt, generated, last or comma-separated token indices such as 0,-1, found '0,x' ('x' is not an integer)
    """
    t = text.strip()
    if t in POSITION_NAMES:
        return t
    out = []
    for x in (p.strip() for p in t.split(",")):
        if not re.fullmatch(r"-?(?:0|[1-9][0-9]{0,8})", x, re.ASCII):
            raise InputError(f"expected {what} as one of {', '.join(POSITION_NAMES)} or comma-separated token indices "
                             f"such as 0,-1, found {text!r:.80} ({x!r:.20} is not an integer)")
        out.append(int(x))
    return plain_positions(out, what)


@dataclass
class RunState:
    """What a forward pass or a generation run is processing.

    ``attention_mask`` is the prompt's mask ``[batch, P]``; positions at or past
    ``P`` are generated tokens. ``run_id`` changes with every run so hooks can
    reset their own position counters.

    Examples:
        >>> run = RunState(torch.tensor([[0, 1, 1], [1, 1, 1]]))  # left padded: 2 and 3 real tokens
        >>> run.prompt_len, run.batch, run.last_index().tolist(), run.n_real().tolist()
        (3, 2, [2, 2], [2, 3])
        >>> run.real_index().tolist()
        [[-1, 0, 1], [0, 1, 2]]
    """

    attention_mask: Tensor
    run_id: int = 0
    input_ids: Optional[Tensor] = None  # [batch, P] prompt token ids, when known (token-pattern specs)
    # Absolute start of the chunk the next forward processes, when the caller says so (a generation
    # loop that re-runs a step, e.g. representation recycling); None: each site counts for itself.
    chunk_start: Optional[int] = None
    generating: bool = False  # a generation loop runs (it feeds generated tokens after the prompt)
    # [batch] bool: the rows whose token the current decoding step feeds is a generated one (a row that ended
    # with EOS or a stop string is fed padding while others go on); None: every row (set so by the loop when
    # no row has ended, so hooks read it without a device sync)
    live: Optional[Tensor] = None
    # refuse integer positions that no row has (check_index_range); None: when the run knows its prompt ids,
    # as every SteerModel.forward/generate run does. A server's per-request masks leave it off: one request's
    # positions must not fail the batch step they share.
    check_positions: Optional[bool] = None
    _cache: dict = field(default_factory=dict, repr=False)
    _fed: list = field(default_factory=list, repr=False)  # [(start, ids [batch, t])] fed after the prompt

    def __post_init__(self):
        self.P = int(self.attention_mask.shape[1])  # prompt length, read by hooks at every call
        if self.check_positions is None:
            self.check_positions = self.input_ids is not None

    def append_tokens(self, ids: Tensor) -> None:
        """Record the token ids ``[batch, t]`` the next step feeds (they follow everything so far)."""
        if self.input_ids is None:
            return
        start = self.prompt_len + sum(int(c.shape[1]) for _, c in self._fed)
        self._fed.append((start, ids.reshape(self.batch, -1)))

    def chunk_ids(self, start: int, T: int, device) -> Tensor:
        """``[batch, T]`` input token ids at positions ``[start, start + T)`` (pattern lookback included)."""
        if self.input_ids is None:
            raise InputError("expected the run's token ids for a token-pattern position spec, found none; "
                             "run the model through SteerModel.forward/generate")
        for s0, c in reversed(self._fed):  # a decoding step: the chunk is the latest fed token(s)
            if s0 <= start and start + T <= s0 + c.shape[1]:
                return c[:, start - s0:start - s0 + T].to(device)
            if s0 + c.shape[1] <= start:
                break
        full = torch.cat([self.input_ids.to(device)] + [c.to(device) for _, c in self._fed], 1)
        if start + T > full.shape[1] or start < 0:
            raise InputError(f"expected token ids for positions {start}..{start + T - 1}, found {full.shape[1]} "
                             "known ids; feed generated tokens with RunState.append_tokens")
        return full[:, start:start + T]

    @property
    def batch(self) -> int:
        return int(self.attention_mask.shape[0])

    @property
    def prompt_len(self) -> int:
        return self.P

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
    """Check a spec early (at registration) so errors surface before any hook runs.

    Examples:
        >>> validate_positions(-1), validate_positions(range(-3, 0)), validate_positions("last")
        ([-1], range(-3, 0), 'last')
        >>> validate_positions("first")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected positions to be one of ('all', 'prompt', 'generated', 'last'), ...
    """
    if isinstance(spec, str):
        if spec not in POSITION_NAMES:
            raise InputError(f"expected positions to be one of {POSITION_NAMES}, an int, a list of ints, a range "
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
    if isinstance(spec, (range, slice, TokenMatch, AnyOf)):
        return spec
    if isinstance(spec, Tensor):
        if spec.dtype != torch.bool or spec.dim() != 2:
            raise InputError(f"expected a bool mask [batch, prompt_len] as positions, found "
                             f"dtype {spec.dtype} with shape {tuple(spec.shape)}")
        return spec
    raise InputError(f"expected a position spec ({POSITION_NAMES}, int, list, range, slice, bool mask, TokenMatch "
                     f"or AnyOf), found {type(spec).__name__}")


def chunk_mask(spec: PositionSpec, run: RunState | None, start: int, T: int, B: int,
               device: torch.device) -> Tensor | None:
    """Boolean ``[B, T]`` mask for the chunk ``[start, start+T)``; ``None`` means every position.

    Without a :class:`RunState` (the model was called directly, not through
    :class:`~steerkit.SteerModel`), every position of the call is a real prompt
    token and the chunk is the whole prompt.

    Examples:
        >>> run = RunState(torch.tensor([[0, 1, 1, 1]]))  # a prompt of 3 real tokens after 1 pad
        >>> chunk_mask("last", run, 0, 4, 1, "cpu").tolist(), chunk_mask([0, -1], run, 0, 4, 1, "cpu").tolist()
        ([[False, False, False, True]], [[False, True, False, True]])
        >>> chunk_mask("generated", run, 4, 1, 1, "cpu") is None  # a decoding step: every position
        True
        >>> chunk_mask("prompt", run, 4, 1, 1, "cpu").tolist()
        [[False]]
    """
    if run is None:
        am = torch.ones(B, start + T, dtype=torch.long, device=device)
        run = RunState(am)
    P = run.prompt_len
    live = run.live if start >= P else None
    if start >= P and isinstance(spec, str):  # a decoding step: every position is a generated token
        if spec in ("all", "generated"):  # but not the padding fed to rows that have ended
            return None if live is None else live.to(device)[:, None].expand(B, T)
        key = ("none", B, T, device)
        if key not in run._cache:
            run._cache[key] = torch.zeros(B, T, dtype=torch.bool, device=device)
        return run._cache[key]
    # every hook of one step asks for the same mask: compute it once per (spec, chunk)
    mask_key = ("mask", spec_key(spec), start, T, B, device)
    hit = run._cache.get(mask_key)
    if hit is not None:  # (an id-keyed entry holds its spec, so that id cannot be reused meanwhile)
        return hit[1]
    out = _chunk_mask(spec, run, start, T, B, device)
    if live is not None:
        out = live.to(device)[:, None].expand(B, T) if out is None else out & live.to(device)[:, None]
    run._cache[mask_key] = (spec, out)  # the spec is kept: an id-keyed entry can never match a new object
    return out


def spec_key(spec):
    """A cache key for ``spec``: its value where it has a simple one, else its identity.

    Examples:
        >>> spec_key("last"), spec_key([0, -1]), spec_key(range(2))
        ('last', ('idx', 0, -1), ('range', 0, 2, 1))
    """
    if isinstance(spec, (str, int)):
        return spec
    if isinstance(spec, (range, slice)):
        return (type(spec).__name__, spec.start, spec.stop, spec.step)
    if isinstance(spec, (list, tuple)) and all(isinstance(i, int) for i in spec):
        return ("idx",) + tuple(spec)
    return ("id", id(spec))


def _token_mask(spec: TokenMatch, run: RunState, start: int, T: int, B: int, device) -> Tensor:
    n = len(spec.pattern)
    lo = max(0, start - (n - 1))
    ids = run.chunk_ids(lo, start + T - lo, device)  # [B, lookback + T]
    P = run.prompt_len
    absall = torch.arange(lo, start + T, device=device)
    am = run.attention_mask.to(device)
    real = torch.ones(B, absall.shape[0], dtype=torch.bool, device=device)
    inp = absall < P
    if bool(inp.any()):
        real[:, inp] = am[:, absall[inp]].bool()
    off = start - lo
    out = torch.ones(B, T, dtype=torch.bool, device=device)
    for j in range(n):  # set j is for the token (n - 1 - j) places before the position
        back = n - 1 - j
        if off - back < 0:  # the pattern reaches before the sequence start for the first positions
            pad = torch.zeros(B, back - off, dtype=torch.bool, device=device)
            seg = slice(0, T - (back - off))
            hit = torch.isin(ids[:, seg], spec.ids(j, device)) & real[:, seg]
            out &= torch.cat([pad, hit], 1)
        else:
            seg = slice(off - back, off - back + T)
            out &= torch.isin(ids[:, seg], spec.ids(j, device)) & real[:, seg]
    scope = _chunk_mask(spec.within, run, start, T, B, device)
    return out if scope is None else out & scope


def _chunk_mask(spec: PositionSpec, run: RunState, start: int, T: int, B: int,
                device: torch.device) -> Tensor | None:
    if isinstance(spec, TokenMatch):
        return _token_mask(spec, run, start, T, B, device)
    if isinstance(spec, AnyOf):
        out = torch.zeros(B, T, dtype=torch.bool, device=device)
        for s in spec.specs:
            m = _chunk_mask(s, run, start, T, B, device)
            if m is None:
                return None
            out = out | m
        return out
    P = run.prompt_len
    abspos = torch.arange(start, start + T, device=device)  # [T]
    in_prompt = abspos < P
    am = run.attention_mask.to(device)
    # real[b, t]: the position holds a real token
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
    if isinstance(spec, range):  # the indices it holds, like a list: range(-3, 0) is [-3, -2, -1]
        spec = list(spec)
    if isinstance(spec, slice):  # Python slice semantics over each row's real prompt tokens
        sl = spec
        out = torch.zeros(B, T, dtype=torch.bool, device=device)
        for b in range(B):
            n = int(nr[b, 0])
            wanted = torch.tensor(list(range(*sl.indices(n))), dtype=torch.long, device=device)
            if wanted.numel():
                out[b] = pm[b] & torch.isin(ri[b], wanted)
        return out
    if not isinstance(spec, (list, tuple)):
        raise InputError(f"expected a position spec ({POSITION_NAMES}, a list of ints, a range, a slice, a bool mask, "
                         f"TokenMatch or AnyOf), found {spec!r}; check it with validate_positions first")
    if start < P and run.check_positions:
        check_index_range(spec, run)
    out = torch.zeros(B, T, dtype=torch.bool, device=device)
    for i in spec:
        target = nr + i if i < 0 else torch.full_like(nr, i)
        out |= pm & (ri == target)
    return out


def _fmt_indices(idx: list[int]) -> str:
    return str(idx) if len(idx) <= 8 else f"[{', '.join(map(str, idx[:8]))}, ... ({len(idx)} indices)]"


def check_index_range(spec: Iterable[int], run: RunState) -> None:
    """Refuse integer positions that exist in no row of ``run``'s prompt batch; warn about those that
    exist in the longer rows only (see the module docstring). Checked once per run and spec.

    Examples:
        >>> run = RunState(torch.ones(2, 4, dtype=torch.long))  # two prompts of 4 tokens
        >>> check_index_range([0, -1], run)
        >>> check_index_range([10], run)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected token positions in [-4, 3] (indices among the real prompt tokens, ...
    """
    idx = list(spec)
    key = ("range-ok", tuple(idx))
    if key in run._cache:
        return
    lengths = [int(n) for n in run.n_real().tolist()]
    longest, shortest = max(lengths), min(lengths)
    nowhere = [i for i in idx if not -longest <= i < longest]
    shown = lengths if len(lengths) <= 16 else f"{lengths[:16]} ... ({len(lengths)} prompts)"
    if nowhere:
        raise InputError(
            f"expected token positions in [{-longest}, {longest - 1}] (indices among the real prompt tokens, "
            f"negative from the end), found {_fmt_indices(nowhere)}, which no prompt of this batch has "
            f"(prompt lengths in tokens: {shown}); use indices within the prompts' lengths, or 'last' / 'prompt'")
    short = sorted({i for i in idx if not -shortest <= i < shortest})
    if short:
        warnings.warn(f"token positions {_fmt_indices(short)} lie beyond the shorter prompts of this batch "
                      f"(prompt lengths in tokens: {shown}); those rows get nothing at them",
                      PositionRangeWarning, stacklevel=2)
    run._cache[key] = True
