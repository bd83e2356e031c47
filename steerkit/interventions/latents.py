"""Editing a sparse autoencoder's latents at its site: :class:`LatentEdit`, what an
:meth:`Intervention.sae_latent <steerkit.Intervention.sae_latent>` clamp carries and runs.

A clamp sets chosen latents ``L`` of an SAE to targets and keeps what the SAE does not explain (its
error term): ``h' = h + decode(f_clamped) - decode(f)``, which for an SAE without input normalisation
is ``h + (f_clamped[L] - f[L]) @ W_dec[L]`` (Templeton et al. 2024's clamping). ``f[L]`` is read from
the activation as it arrives: a ReLU, JumpReLU or gated SAE reads only the columns of ``L`` (the
encoder restricted to them), a TopK SAE needs every pre-activation to know which ``k`` win and keeps
its whole encoder. The target is a value per latent (``value``) or the latent's own activation times
``scale``. The arithmetic runs in the SAE's dtype (float32 for a loaded SAE) and the result is rounded
once to the activation's dtype.

It runs as a torch step of the site's :class:`~steerkit.interventions.SiteProgram` (per row,
positions and conditions as every other step); an SAE latent *addition* is a plain ``add`` of the
decoder rows and runs in the fused kernel.

A *transcoder* reads one site and writes another (``blocks.{l}.mlp.hook_in`` -> ``blocks.{l}.hook_mlp_out``).
Its clamp is a two-site edit: the edit lives at the output site and names the input site as its ``source``;
the latents are encoded from the source's activation ``s`` of the same forward pass and the change
``decode(f_clamped, s) - decode(f, s)`` = ``(f_clamped - f) @ W_dec`` is added to the output site's
activation, so the MLP's real output (the transcoder's error term with it) stays and nothing is frozen.
:func:`~steerkit.interventions.compile_steering` gives the source site a program that stores its activation
(before that site's own edits) in the steering's one :class:`SiteReads`, which the output site's step reads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError
from steerkit.sae.weights import SAEWeights


def sae_weights(sae: Any) -> SAEWeights:
    """The :class:`~steerkit.sae.SAEWeights` of ``sae``: itself, or the ``weights`` of a stored
    :class:`steerkit.vectors.SAE`.

    Examples:
        >>> w = SAEWeights(torch.eye(4), torch.zeros(4), torch.eye(4), torch.zeros(4))
        >>> sae_weights(w) is w
        True
    """
    w = getattr(sae, "weights", sae)
    if not isinstance(w, SAEWeights):
        raise InputError(f"expected a sparse autoencoder (steerkit.load_sae(...) or a steerkit.sae.SAEWeights), "
                         f"found {type(sae).__name__}")
    return w


def latent_indices(latents: Any, d_sae: int) -> tuple[int, ...]:
    """``latents`` (an index or a sequence of distinct indices) checked against ``d_sae``.

    Examples:
        >>> latent_indices(3, 8), latent_indices([5, 1], 8)
        ((3,), (5, 1))
    """
    seq = [latents] if isinstance(latents, int) or (isinstance(latents, Tensor) and latents.dim() == 0) \
        else list(latents)
    try:
        idx = tuple(int(i) for i in seq)
    except (TypeError, ValueError):
        raise InputError(f"expected latent indices (an int or a list of ints), found {latents!r:.80}") from None
    if not idx:
        raise InputError("expected at least one latent index, found none")
    bad = [i for i in idx if not 0 <= i < d_sae]
    if bad:
        raise InputError(f"expected latent indices in 0..{d_sae - 1} (this SAE has d_sae={d_sae}), found {bad[:10]}")
    if len(set(idx)) != len(idx):
        raise InputError(f"expected distinct latent indices, found {list(idx)}; give each latent once")
    return idx


def clamp_target(value: Any, scale: Any, n: int) -> tuple[Optional[Tensor], Optional[float]]:
    """A clamp's target for ``n`` latents: exactly one of ``value`` (a finite number, or one per latent) as a
    float32 tensor ``[n]``, or ``scale`` (a finite multiple of their own activations) as a float.

    Examples:
        >>> clamp_target(2.0, None, 3)
        (tensor([2., 2., 2.]), None)
        >>> clamp_target(None, 0, 2)
        (None, 0.0)
    """
    if (value is None) == (scale is None):
        raise InputError("expected exactly one of value= (the latents' new activations) or scale= (a multiple "
                         f"of their own activations) for a clamp, found {'both' if value is not None else 'neither'}")
    if value is not None:
        t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        if t.numel() == 1:
            t = t.expand(n).clone()
        if t.numel() != n or not bool(torch.isfinite(t).all()):
            raise InputError(f"expected one finite clamp value per latent ({n}), found {value!r:.80}")
        return t, None
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not torch.isfinite(torch.tensor(float(scale))):
        raise InputError(f"expected scale= as a finite number, found {scale!r:.80}")
    return None, float(scale)


class SiteReads:
    """The activations a compiled steering's two-site latent edits read: the one store shared by the
    :class:`~steerkit.interventions.SiteProgram` values of a :class:`~steerkit.interventions.CompiledSteering`.
    ``readers``: ``{source site: the sites whose edits read it}``.

    A source site's program :meth:`put` s its activation as it arrives (before its own edits); a reading site's
    program :meth:`get` s the oldest one it has not read yet and :meth:`release` s it once it ran (whether or not a
    step read it); an entry goes when every reader has released it. The entries of a source are kept in order: a
    server that steers several requests with one compiled steering calls each site's program once per request, in
    the same request order at every site, so each request's output rows read its own input rows. A local pass
    stores one activation per source: its program :meth:`drop` s what an interrupted pass left before storing.

    Examples:
        >>> reads = SiteReads({"blocks.0.mlp.hook_in": ("blocks.0.hook_mlp_out",)})
        >>> reads.put("blocks.0.mlp.hook_in", torch.ones(3, 4))   # request 1's rows
        >>> reads.put("blocks.0.mlp.hook_in", torch.zeros(2, 4))  # request 2's rows
        >>> reads.get("blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out", (3,)).sum().item()
        12.0
        >>> reads.release("blocks.0.hook_mlp_out")
        >>> tuple(reads.get("blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out", (2,)).shape)
        (2, 4)
        >>> reads.release("blocks.0.hook_mlp_out")
        >>> len(reads)
        0
        >>> reads.get("blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out", (2,))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        steerkit.errors.InputError: expected the activation of 'blocks.0.mlp.hook_in' from the same forward pass ...
    """

    #: the most activations of one source kept unread (a reader that never runs would hold them all)
    MAX_UNREAD = 256

    __slots__ = ("readers", "_sources_of", "_held")

    def __init__(self, readers: Mapping[str, Sequence[str]]):
        self.readers = {s: tuple(dict.fromkeys(r)) for s, r in readers.items()}
        self._sources_of: dict[str, list[str]] = {}
        for s, targets in self.readers.items():
            for t in targets:
                self._sources_of.setdefault(t, []).append(s)
        self._held: dict[str, list[tuple[Tensor, set]]] = {}  # source -> [(activation, readers still to read it)]

    @property
    def sources(self) -> tuple[str, ...]:
        """The sites whose activations are stored."""
        return tuple(self.readers)

    def sources_of(self, site: str) -> tuple[str, ...]:
        """The sources the edits at ``site`` read."""
        return tuple(self._sources_of.get(site, ()))

    def put(self, source: str, h: Tensor) -> None:
        """Keep ``h``, the activation of ``source`` as it arrives (a copy: later in-place writes do not reach it)."""
        if source not in self.readers:
            return
        queue = self._held.setdefault(source, [])
        if len(queue) >= self.MAX_UNREAD:
            raise InputError(f"expected the edits at {list(self.readers[source])} to read the activations of "
                             f"{source!r}, found {len(queue)} unread; every site of a compiled steering must run "
                             "in each pass (hook both sites)")
        queue.append((h.clone(), set(self.readers[source])))

    def _entry(self, source: str, site: str) -> Optional[tuple[Tensor, set]]:
        return next((e for e in self._held.get(source, ()) if site in e[1]), None)

    def get(self, source: str, site: str, lead: Sequence[int]) -> Tensor:
        """The activation of ``source`` in this pass, for an edit at ``site`` whose rows have shape ``lead``."""
        entry = self._entry(source, site)
        if entry is None:
            raise InputError(f"expected the activation of {source!r} from the same forward pass before the edit at "
                             f"{site!r} reads it, found none; the source site must run before {site!r} in every pass "
                             "(a transcoder's input site precedes its output site in the same block)")
        h = entry[0]
        if tuple(h.shape[:-1]) != tuple(lead):
            raise InputError(f"expected the activation of {source!r} with the rows of {site!r} {tuple(lead)}, found "
                             f"{tuple(h.shape[:-1])}; both sites must see the same tokens in one pass")
        return h

    def release(self, site: str) -> None:
        """``site``'s program ran: it is done with the oldest activation of each source it reads."""
        for source in self._sources_of.get(site, ()):
            entry = self._entry(source, site)
            if entry is not None:
                entry[1].discard(site)
                if not entry[1]:
                    queue = self._held[source]
                    queue.remove(entry)
                    if not queue:
                        del self._held[source]

    def drop(self, source: str) -> None:
        """Forget the activations of ``source`` still held (a local pass starts: one that was interrupted left them)."""
        self._held.pop(source, None)

    def clear(self) -> None:
        """Forget every stored activation."""
        self._held.clear()

    def __len__(self) -> int:
        """How many activations are held (none between passes)."""
        return sum(len(q) for q in self._held.values())

    def __repr__(self) -> str:
        return f"SiteReads({self.readers!r}, held={len(self)})"


@dataclasses.dataclass(frozen=True, eq=False)
class LatentEdit:
    """Clamp some latents of an SAE to ``target`` (one value each) or to ``scale`` times their
    activation, writing the change through ``decoder`` (the SAE restricted to those latents, in order).
    ``encoder`` reads them: the same restricted SAE, or a TopK SAE's whole encoder with ``latents`` the
    indices to read. ``source``: the site the encoder reads when it is not the edit's own (a transcoder's
    input site; ``None``: its own site). Build it with :meth:`of`.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> w = SAEWeights(torch.randn(8, 32, generator=g), torch.zeros(32), torch.randn(32, 8, generator=g),
        ...                torch.zeros(8))
        >>> edit = LatentEdit.of(w, [3], value=5.0)
        >>> x = torch.randn(2, 8, generator=g)
        >>> y = edit(x)
        >>> want = x + (5.0 - w.encode(x)[:, 3:4]) * w.W_dec[3]
        >>> torch.allclose(y, want, atol=1e-5), edit.d_in
        (True, 8)

        A transcoder reads one site and writes another: its edit encodes ``source_x`` and adds the change to ``x``.

        >>> tc = SAEWeights(torch.randn(8, 32, generator=g), torch.zeros(32), torch.randn(32, 6, generator=g),
        ...                 torch.zeros(6), apply_b_dec_to_input=False, transcoder=True)
        >>> edit = LatentEdit.of(tc, [3, 5], scale=0.0, source="blocks.0.mlp.hook_in")
        >>> s, out = torch.randn(2, 8, generator=g), torch.randn(2, 6, generator=g)
        >>> torch.allclose(edit(out, s), out - tc.encode(s)[:, [3, 5]] @ tc.W_dec[[3, 5]], atol=1e-5), edit.d_out
        (True, 6)
    """

    encoder: SAEWeights
    decoder: SAEWeights
    latents: Optional[tuple[int, ...]] = None  # indices into a whole encoder (TopK); None: restricted to them
    target: Optional[Tensor] = None
    scale: Optional[float] = None
    source: Optional[str] = None  # the site the encoder reads (a transcoder's input); None: the edit's own

    @classmethod
    def of(cls, sae: Any, latents: Sequence[int] | int, *, value: Any = None,
           scale: Optional[float] = None, source: Optional[str] = None) -> "LatentEdit":
        """The clamp of ``latents`` of ``sae`` to ``value`` (a number, or one per latent) or to ``scale`` times
        their own activation (exactly one of the two). An autoencoder reads the edit's own site; a transcoder
        needs ``source=``, the site it reads (the edit then lives at the site it writes)."""
        w = sae_weights(sae)
        if w.transcoder and source is None:
            raise InputError("expected source= (the site a transcoder reads, e.g. 'blocks.3.mlp.hook_in') to clamp its "
                             "latents at the site it writes, found a transcoder without one; or add its decoder rows "
                             "with Intervention.sae_latent(..., mode='add') at the output site")
        if source is not None and not w.transcoder:
            raise InputError(f"expected a transcoder for an edit that reads another site (source={source!r}), found "
                             "an autoencoder, which reads and writes its own site; leave source= out")
        if source is not None and (not isinstance(source, str) or not source):
            raise InputError(f"expected source= as a hook name, found {source!r:.80}")
        idx = latent_indices(latents, w.d_sae)
        target, scale = clamp_target(value, scale, len(idx))
        # a TopK SAE's selection needs every pre-activation: it keeps the whole encoder, its restriction decodes
        whole = w.architecture == "topk"
        rows = w.restrict(list(idx))
        return cls(w if whole else rows, rows, idx if whole else None, target, scale, source)

    @property
    def d_in(self) -> int:
        """The width the encoder reads (at ``source`` where there is one)."""
        return self.encoder.d_in

    @property
    def d_out(self) -> int:
        """The width the edit writes: its site's (``d_in`` for an autoencoder)."""
        return self.decoder.d_out

    def to(self, device: Any) -> "LatentEdit":
        """The same edit with its tensors on ``device``."""
        return dataclasses.replace(self, encoder=self.encoder.to(device), decoder=self.decoder.to(device),
                                   target=None if self.target is None else self.target.to(device))

    def __call__(self, x: Float[Tensor, "*rows d_out"], source_x: Optional[Float[Tensor, "*rows d_in"]] = None
                 ) -> Float[Tensor, "*rows d_out"]:
        """``x`` with the clamp's change added; the latents are read from ``x`` (an autoencoder) or from
        ``source_x``, the source site's activation on the same rows (a transcoder; required then)."""
        if self.source is not None and source_x is None:
            raise InputError(f"expected the activation of {self.source!r} (source_x) for a transcoder's clamp, found "
                             "none; compile it with steerkit.interventions.compile_steering, which reads it")
        s = x if self.source is None else source_x
        assert s is not None
        f = self.encoder.encode(s) if self.latents is None else self.encoder.encode(s, list(self.latents))
        if self.target is not None:
            new = self.target.to(device=f.device, dtype=f.dtype).expand_as(f)
        else:
            new = f * float(self.scale or 0.0)
        # decode(new) - decode(f): b_dec and any skip connection cancel; a normalising SAE scales back by its input
        delta = self.decoder.decode(new, s) - self.decoder.decode(f, s)
        return (x.to(delta.dtype) + delta.reshape(x.shape)).to(x.dtype)
