"""Attention of a packed pass computed as a batch of whole sequences, so it rounds as a full pass does.

A packed pass (:func:`steerkit.reuse.run_packed`) lays continuations of one cached sequence end to end:
segment ``i`` holds positions ``s_i .. T-1`` and attends to the cached keys of positions before
``s_i`` and to its own. One attention call over the packed row with a block mask gives the right
values, but a longer key axis sums its terms in another order than a full pass does, and the
difference grows through the layers above (about 1e-5 in the logits of the default model).

Here each segment becomes one row of a batch of ``T`` positions instead: its keys and values are the
cached ones before ``s_i`` and its own after, in position order, exactly the ``T`` keys a full pass
of the patched sequence has; its queries are its own at positions ``s_i ..`` and zeros before (those
rows are computed and dropped). The model's own attention function then runs on that batch with the
mask a full pass gets (``None`` for causal SDPA, so the same kernel runs), and the real rows are
gathered back into the packed order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from jaxtyping import Bool, Int
from torch import Tensor, nn


@dataclass(frozen=True)
class Segments:
    """Where a packed pass's queries and keys sit in a batch of whole sequences: row ``i`` is segment
    ``i``. ``queries[i, p]``: the packed query at position ``p`` (clamped where ``real`` is False);
    ``real[i, p]``: the segment has a query there (``p >= s_i``); ``keys[i, p]``: the key of position
    ``p`` in the key axis of the packed pass (the cached positions, then the packed ones).

    Examples:
        >>> s = Segments.of([1], n_pos=2)  # one segment: position 1 after a cached position 0
        >>> s.queries.tolist(), s.real.tolist(), s.keys.tolist()
        ([[0, 0]], [[False, True]], [[0, 2]])
    """

    queries: Int[Tensor, "segments pos"]
    real: Bool[Tensor, "segments pos"]
    keys: Int[Tensor, "segments pos"]

    @classmethod
    def of(cls, starts: list[int], n_pos: int) -> "Segments":
        """The layout of segments starting at ``starts`` over ``n_pos`` cached positions, laid end to end.

        Examples:
            >>> s = Segments.of([2, 0], n_pos=3)
            >>> s.queries.tolist(), s.real.tolist(), s.keys.tolist()
            ([[0, 0, 0], [1, 2, 3]], [[False, False, True], [True, True, True]], [[0, 1, 3], [4, 5, 6]])
        """
        pos = torch.arange(n_pos)[None, :]
        start = torch.tensor(starts)[:, None]
        lengths = n_pos - start
        offset = lengths.cumsum(0) - lengths
        real = pos >= start
        local = offset + pos - start
        return cls(local.clamp(min=0).masked_fill(~real, 0), real, torch.where(real, n_pos + local, pos))

    def to(self, device) -> "Segments":
        """The layout on ``device`` (where the packed pass runs: moved once, not per layer)."""
        return Segments(self.queries.to(device), self.real.to(device), self.keys.to(device))


def _mask(attention_mask: Optional[Tensor], seg: Segments, sdpa: bool, dtype: torch.dtype) -> Optional[Tensor]:
    """The packed pass's mask (``[1, 1, packed, keys]``, bool or additive) taken at each segment's
    queries and keys: ``[segments, 1, T, T]``, the causal pattern on the rows that are not real;
    ``None`` where that is the plain causal mask and the attention is SDPA (a full pass of unpadded
    rows passes none: SDPA runs causal)."""
    T = seg.real.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.real.device).tril()
    if attention_mask is None:
        m = causal.expand(len(seg.real), T, T)
    else:
        m = attention_mask[0, 0][seg.queries[:, :, None], seg.keys[:, None, :]]
        if m.dtype != torch.bool:  # additive: 0 where a query attends
            m = m > torch.finfo(m.dtype).min / 2
        m = torch.where(seg.real[:, :, None], m, causal)
    if sdpa:
        return None if bool(torch.equal(m, causal.expand_as(m))) else m[:, None]
    # eager attention adds its mask, 0 where a query attends and the dtype's lowest value elsewhere
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)[:, None]


def attend(fn: Callable, module: nn.Module, seg: Segments, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Optional[Tensor], sdpa: bool, **kwargs) -> tuple[Tensor, None]:
    """``fn`` (the model's attention function: ``(module, q, k, v, mask, **kwargs) -> (out [b, q, heads,
    d], weights)``) over the packed row ``query [1, heads, packed, d]``, ``key`` / ``value [1, kv_heads,
    T + packed, d]`` as a batch of one whole sequence per segment; returns ``[1, packed, heads, d]``.

    Examples:
        >>> def sdpa(m, q, k, v, mask, **kw):  # causal where no mask is given, as transformers' SDPA does
        ...     out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        ...     return out.transpose(1, 2), None
        >>> T, seg = 3, Segments.of([0, 2], n_pos=3)  # the whole sequence, then position 2 again
        >>> q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, T + 4, 8), torch.randn(1, 2, T + 4, 8)
        >>> out, _ = attend(sdpa, None, seg, q, k, v, None, sdpa=True)
        >>> whole, _ = sdpa(None, q[:, :, :3], k[:, :, 3:6], v[:, :, 3:6], None)  # segment 0 alone
        >>> tuple(out.shape), torch.allclose(out[:, :3], whole)
        ((1, 4, 2, 8), True)
    """
    if query.shape[0] != 1:
        raise ValueError(f"expected one packed row, found a batch of {query.shape[0]}")
    q = query[0][:, seg.queries].transpose(0, 1).masked_fill(~seg.real[:, None, :, None], 0)
    k = key[0][:, seg.keys].transpose(0, 1)
    v = value[0][:, seg.keys].transpose(0, 1)
    out, _ = fn(module, q, k, v, _mask(attention_mask, seg, sdpa, query.dtype), **kwargs)
    return out[seg.real][None], None
