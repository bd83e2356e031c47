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
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

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


@dataclasses.dataclass(frozen=True, eq=False)
class LatentEdit:
    """Clamp some latents of an SAE to ``target`` (one value each) or to ``scale`` times their
    activation, writing the change through ``decoder`` (the SAE restricted to those latents, in order).
    ``encoder`` reads them: the same restricted SAE, or a TopK SAE's whole encoder with ``latents`` the
    indices to read. Build it with :meth:`of`.

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
    """

    encoder: SAEWeights
    decoder: SAEWeights
    latents: Optional[tuple[int, ...]] = None  # indices into a whole encoder (TopK); None: restricted to them
    target: Optional[Tensor] = None
    scale: Optional[float] = None

    @classmethod
    def of(cls, sae: Any, latents: Sequence[int] | int, *, value: Any = None,
           scale: Optional[float] = None) -> "LatentEdit":
        """The clamp of ``latents`` of ``sae`` (an autoencoder, not a transcoder) to ``value`` (a number,
        or one per latent) or to ``scale`` times their own activation (exactly one of the two)."""
        w = sae_weights(sae)
        if w.transcoder:
            raise InputError("expected an autoencoder to clamp latents at its own site, found a transcoder (its "
                             "latents write to another site); add its decoder rows there with "
                             "Intervention.sae_latent(..., mode='add') at the output site")
        idx = latent_indices(latents, w.d_sae)
        target, scale = clamp_target(value, scale, len(idx))
        # a TopK SAE's selection needs every pre-activation: it keeps the whole encoder, its restriction decodes
        whole = w.architecture == "topk"
        rows = w.restrict(list(idx))
        return cls(w if whole else rows, rows, idx if whole else None, target, scale)

    @property
    def d_in(self) -> int:
        return self.encoder.d_in

    def to(self, device: Any) -> "LatentEdit":
        """The same edit with its tensors on ``device``."""
        return dataclasses.replace(self, encoder=self.encoder.to(device), decoder=self.decoder.to(device),
                                   target=None if self.target is None else self.target.to(device))

    def __call__(self, x: Float[Tensor, "*rows d_in"]) -> Float[Tensor, "*rows d_in"]:
        f = self.encoder.encode(x) if self.latents is None else self.encoder.encode(x, list(self.latents))
        if self.target is not None:
            new = self.target.to(device=f.device, dtype=f.dtype).expand_as(f)
        else:
            new = f * float(self.scale or 0.0)
        # decode(new) - decode(f): b_dec and any skip connection cancel; a normalising SAE scales back by x
        delta = self.decoder.decode(new, x) - self.decoder.decode(f, x)
        return (x.to(delta.dtype) + delta.reshape(x.shape)).to(x.dtype)
