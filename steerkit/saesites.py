"""A sparse autoencoder attached at a hook site: its latents as hook sites, and the splice.

``sm.attach_sae(sae)`` (:meth:`steerkit.SteerModel.attach_sae`) registers one hook at the SAE's site and
returns its :class:`SAEHandle` (a context manager, removed on exit, also after an exception). While it is
attached, sub-sites of the site are hook names, sae-lens's (:data:`~steerkit.hooks.names.SAE_SUB_HOOKS`):

===============================  =============================  =================================================
name                             shape                          value
===============================  =============================  =================================================
``{site}.hook_sae_input``        ``[batch, pos, d_in]``         the activation as the SAE reads it: in the SAE's
                                                                dtype, attention heads flattened
``{site}.hook_sae_acts_pre``     ``[batch, pos, d_sae]``        the pre-activations, ``sae.pre_acts(x)``
``{site}.hook_sae_acts_post``    ``[batch, pos, d_sae]``        the latents, ``sae.encode(x)``
``{site}.hook_sae_output``       ``[batch, pos, d_out]``        the decoded output, ``sae.decode(f, x)``
``{site}.hook_sae_recons``       ``[batch, pos, d_in]``         the reconstruction, ``sae.decode(f, x)``
``{site}.hook_sae_error``        ``[batch, pos, d_in]``         what it misses, ``x - recons``
===============================  =============================  =================================================

A transcoder (``sm.attach_sae`` of a transcoder ``SAE``, or ``sm.attach_transcoders(tc, layers=...)`` for the
blocks of a :class:`steerkit.vectors.Transcoders`, one :class:`TranscodersHandle`) is attached at the site it
reads (``blocks.{l}.mlp.hook_in``); its sub-sites are :data:`~steerkit.hooks.names.TRANSCODER_HOOKS`: the input,
the pre-activations, the latents and ``hook_sae_output``, its prediction of the site it writes (it reconstructs
nothing at its own site, so ``hook_sae_recons`` / ``hook_sae_error`` are refused there).

``sm.record`` reads them like any site (positions, forward passes and KV-cached generation, the
sharded dataset of :func:`steerkit.recording.record_dataset`): a record of sub-sites subscribes its
cache to the SAE's hook, which runs the SAE on the rows the cache's positions select, and only then
(a hook nobody subscribed to returns at once). The SAE reads the activation as it arrives at its hook:
after the edits at the site that were registered before it, before those registered after it; the
values are steerkit's own :class:`~steerkit.sae.SAEWeights` code (equal to sae-lens's ``SAE.encode``,
``tests/integration/test_sae_lens.py``), computed without autograd, in the SAE's dtype.

The splice (``sm.attach_sae(sae, splice=True)``) runs the model with the reconstruction in place of the
activation (``keep_error=True``: the reconstruction plus the error term, sae-lens's ``use_error_term``,
which leaves the activation's value as it was). It is an edit like every other: an
:meth:`Intervention.apply <steerkit.Intervention.apply>` (:func:`splice_intervention`) installed through
``sm.steer`` right after the SAE's hook, so it composes with other steerings at the site and the
sub-sites still read the activation the splice replaced. The handle removes both.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from steerkit.errors import InputError
from steerkit.hooks.manager import ActivationCache, HookHandle, HookManager, SiteCall
from steerkit.hooks.names import (SAE_ACTS, SAE_ACTS_PRE, SAE_ERROR, SAE_HOOKS, SAE_HOST_HOOKS, SAE_INPUT, SAE_OUTPUT,
                                  SAE_RECONS, TRANSCODER_HOOKS, Site)
from steerkit.hooks.positions import PositionSpec
from steerkit.interventions import Intervention
from steerkit.sae.weights import SAEWeights


def sae_parts(sae: Any, site: Optional[str] = None) -> tuple[SAEWeights, str]:
    """``(weights, site)`` of ``sae``: a :class:`~steerkit.sae.SAEWeights` (``site`` then required), or
    anything with a ``weights`` attribute holding one and a ``site`` attribute naming its hook (the stored
    :class:`steerkit.vectors.SAE`, read duck-typed: the core does not import the vectors layer). ``site``
    must then be the SAE's own or ``None``.

    Examples:
        >>> w = SAEWeights(torch.eye(4), torch.zeros(4), torch.eye(4), torch.zeros(4))
        >>> sae_parts(w, "blocks.0.hook_resid_post")[1]
        'blocks.0.hook_resid_post'
    """
    weights = getattr(sae, "weights", sae)
    if not isinstance(weights, SAEWeights):
        raise InputError(f"expected a sparse autoencoder (steerkit.load_sae(...) or a steerkit.sae.SAEWeights), "
                         f"found {type(sae).__name__}")
    own = getattr(sae, "site", None)
    if own is not None and not isinstance(own, str):
        raise InputError(f"expected the SAE's site as a hook name, found {type(own).__name__}")
    if own is not None and site is not None and site != own:
        raise InputError(f"expected the SAE's own site {own!r}, found site={site!r}; an SAE's latents mean "
                         "something only where it was trained: leave site= out")
    site = site if site is not None else own
    if site is None:
        raise InputError("expected site= (a hook name such as 'blocks.3.hook_resid_post') for an SAEWeights, which "
                         "does not know where it reads, found none; or load the SAE with steerkit.load_sae")
    return weights, site


class SAEHandle(HookHandle):
    """An SAE attached at ``site``: the handle of its hook (and of its splice). ``with`` removes it; while
    it is attached the site's :data:`~steerkit.hooks.names.SAE_HOOKS` sub-sites can be recorded.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> w = SAEWeights(torch.randn(64, 256, generator=g) / 8, torch.zeros(256),
        ...                torch.randn(256, 64, generator=g) / 8, torch.zeros(64))
        >>> site = "blocks.1.hook_resid_post"
        >>> with tiny.attach_sae(w, site) as h, tiny.record([site, h.names[1]], positions="last") as cache:
        ...     _ = tiny.forward("hello world", chat=False)
        >>> torch.equal(cache[h.names[1]], w.encode(cache[site])), h.names[1]
        (True, 'blocks.1.hook_resid_post.hook_sae_acts_post')
        >>> h.active, tiny.hook_count()
        (False, 0)
    """

    weights: SAEWeights
    site: str
    #: the handle of the splice's steering (``None`` without a splice)
    splice: Optional[HookHandle] = None
    keep_error: bool = False
    _subs: list

    @property
    def names(self) -> list[str]:
        """The main sub-sites' names: an autoencoder's (:data:`~steerkit.hooks.names.SAE_HOOKS`): input, latents,
        reconstruction, error; a transcoder's (:data:`~steerkit.hooks.names.TRANSCODER_HOOKS`): input, latents,
        pre-activations, prediction. ``{site}.hook_sae_acts_pre`` and ``{site}.hook_sae_output`` can be recorded
        for an autoencoder too."""
        kinds = TRANSCODER_HOOKS if self.weights.transcoder else SAE_HOOKS
        return [f"{self.site}.{k}" for k in kinds]

    def subscribe(self, cache: ActivationCache, names: Sequence[str]) -> Callable[[], None]:
        """Feed ``cache`` the sub-sites ``names`` on every pass; returns the function that stops it."""
        if self.weights.transcoder:
            bad = [n for n in names if n.rsplit(".", 1)[1] not in TRANSCODER_HOOKS]
            if bad:
                raise InputError(f"expected a transcoder's sub-sites {[f'{self.site}.{k}' for k in TRANSCODER_HOOKS]}, "
                                 f"found {bad}; a transcoder predicts another site: record its prediction "
                                 f"({self.site}.{SAE_OUTPUT}) and that site, whose difference is its error")
        entry = (cache, tuple(names))
        self._subs.append(entry)

        def stop() -> None:
            if entry in self._subs:
                self._subs.remove(entry)
        return stop

    def __call__(self, x: Tensor, call: SiteCall) -> None:
        """The hook at the site: for each subscribed cache, the SAE on the rows its positions select."""
        if not self._subs:
            return None
        flat = SiteCall(call.start, call.T, call.B, call.run)  # rows of features: no per-head shape to restore
        with torch.no_grad():
            for cache, names in list(self._subs):
                b, t = cache._selected(call, x.device)
                rows = x.reshape(-1, x.shape[-1]) if b is None else x[b, t]
                parts = self.compute(rows, {n.rsplit(".", 1)[1] for n in names})
                for name in names:
                    cache._keep(name, b, t, parts[name.rsplit(".", 1)[1]], flat)
        return None

    def compute(self, rows: Tensor, kinds: set[str]) -> dict[str, Tensor]:
        """The sub-sites ``kinds`` of ``rows`` ``[n, d_in]``: ``{kind: [n, width]}`` (only what they need)."""
        w = self.weights
        x = rows.to(w.dtype)
        out = {SAE_INPUT: x}
        if SAE_ACTS_PRE in kinds:
            out[SAE_ACTS_PRE] = w.pre_acts(x)
        if kinds - {SAE_INPUT, SAE_ACTS_PRE}:
            out[SAE_ACTS] = f = w.encode(x)
            if kinds & {SAE_RECONS, SAE_ERROR, SAE_OUTPUT}:
                out[SAE_RECONS] = out[SAE_OUTPUT] = y = w.decode(f, x)
                if SAE_ERROR in kinds:
                    out[SAE_ERROR] = x - y
        return out

    def fingerprint(self) -> str:
        """A hash of the SAE's options and every weight (16 hex digits), which a dataset's manifest keeps."""
        h = hashlib.sha256(json.dumps(self.weights.options(), sort_keys=True).encode())
        for name, t in self.weights.tensors().items():
            h.update(name.encode())
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    def facts(self) -> dict:
        """What a dataset's manifest says of this SAE."""
        w = self.weights
        return {"d_sae": w.d_sae, "d_in": w.d_in, "architecture": w.architecture, "sha256": self.fingerprint()}

    def __repr__(self) -> str:
        splice = "" if self.splice is None else f", splice=True, keep_error={self.keep_error}"
        return f"SAEHandle({self.site!r}, d_sae={self.weights.d_sae}{splice}, active={self.active})"


class TranscodersHandle(HookHandle):
    """The transcoders of some blocks attached at their input sites (``sm.attach_transcoders``): one
    :class:`SAEHandle` per block in :attr:`layers`; ``with`` (or :meth:`remove`) removes them all. While attached,
    each block's :data:`~steerkit.hooks.names.TRANSCODER_HOOKS` sub-sites can be recorded (:meth:`names`).

    Examples:
        >>> from steerkit.vectors import Provenance, Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d = tiny.n_layers, tiny.d_model
        >>> tc = Transcoders([torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(32)] * L,
        ...                  [torch.randn(32, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  provenance=Provenance.from_model(tiny))
        >>> with tiny.attach_transcoders(tc, layers=[1, 2]) as h, tiny.record(["blocks.2.mlp.hook_in", h.names(2)[1]]) as c:
        ...     _ = tiny.forward("hello world", chat=False)
        >>> h.layers, h.names(2)[1]
        ([1, 2], 'blocks.2.mlp.hook_in.hook_sae_acts_post')
        >>> torch.allclose(c[h.names(2)[1]], tc.encode_layer(c["blocks.2.mlp.hook_in"], 2))
        True
        >>> h.active, tiny.hook_count()
        (False, 0)
    """

    handles: dict

    @classmethod
    def of(cls, manager: HookManager, handles: dict, label: str) -> "TranscodersHandle":
        """One handle over ``handles`` (``{layer: SAEHandle}``): removing it removes them all."""
        h = cls([x.remove for x in handles.values()], manager, label)
        h.handles = dict(handles)
        return h

    @property
    def layers(self) -> list[int]:
        """The blocks whose transcoders are attached."""
        return list(self.handles)

    def names(self, layer: int) -> list[str]:
        """Block ``layer``'s sub-sites: input, latents, pre-activations, prediction (:attr:`SAEHandle.names`)."""
        if layer not in self.handles:
            raise InputError(f"expected one of the attached blocks {self.layers}, found {layer!r}")
        return self.handles[layer].names

    def __repr__(self) -> str:
        return f"TranscodersHandle(layers={self.layers}, active={self.active})"


def attach(manager: HookManager, weights: SAEWeights, site: Site) -> SAEHandle:
    """Register the hook of an SAE at ``site`` (one SAE per site) and make its sub-sites valid names: what
    :meth:`steerkit.SteerModel.attach_sae` does once it has checked the SAE against the model.

    Examples:
        >>> w = SAEWeights(torch.eye(64), torch.zeros(64), torch.eye(64), torch.zeros(64))
        >>> with attach(tiny.hooks, w, tiny.hooks.parse("blocks.0.hook_mlp_out")) as h:
        ...     print(tiny.hooks.parse(h.names[1]).kind, list(tiny.hooks.saes))
        hook_sae_acts_post ['blocks.0.hook_mlp_out']
        >>> tiny.hooks.saes
        {}
    """
    if site.kind not in SAE_HOST_HOOKS:
        raise InputError(f"expected an SAE at a site that holds rows of features ({', '.join(SAE_HOST_HOOKS)}), "
                         f"found {site.name!r}")
    if site.name in manager.saes:
        raise InputError(f"expected one SAE at {site.name!r}, found one attached already ({manager.saes[site.name]!r});"
                         " remove its handle first (h.remove(), or leave its with block)")
    tap: list[SAEHandle] = []

    def hook(x: Tensor, call: SiteCall) -> None:
        return tap[0](x, call)
    h = manager.register([(site, hook)], label=f"sae at {site.name}", cls=SAEHandle)
    assert isinstance(h, SAEHandle)
    h.weights, h.site, h._subs = weights, site.name, []
    tap.append(h)
    manager.saes[site.name] = h
    h._removers.append(lambda: manager.saes.pop(site.name, None))  # removed first (removers run in reverse)
    return h


def splice_intervention(weights: SAEWeights, site: str, *, keep_error: bool = False,
                        positions: PositionSpec = "all") -> Intervention:
    """The edit that runs the model with the SAE's reconstruction in place of the activation at ``site``
    (``keep_error``: plus the error term, which restores the activation's value) at ``positions``: an
    :meth:`Intervention.apply <steerkit.Intervention.apply>`, computed in the SAE's dtype and rounded once to
    the activation's.

    Examples:
        >>> w = SAEWeights(torch.eye(64)[:, :32], torch.zeros(32), torch.eye(64)[:32], torch.zeros(64))
        >>> splice = splice_intervention(w, "blocks.1.hook_resid_post")
        >>> with tiny.steer(splice), tiny.record("blocks.1.hook_resid_post") as cache:
        ...     _ = tiny.forward("hi", chat=False)
        >>> h = cache["blocks.1.hook_resid_post"]  # the first 32 features kept where positive, the rest 0
        >>> bool((h[..., 32:] == 0).all()), bool((h >= 0).all())
        (True, True)
    """
    def fn(h: Tensor) -> Tensor:
        x = h.flatten(-2) if h.shape[-1] != weights.d_in and weights.flatten_heads else h
        x = x.to(weights.dtype)
        y = weights.decode(weights.encode(x), x)
        if keep_error:
            y = y + (x - y)
        return y.to(h.dtype).reshape(h.shape)
    return Intervention.apply(site, fn, positions=positions)
