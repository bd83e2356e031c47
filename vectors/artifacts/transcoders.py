"""Transcoders as one artifact: :class:`Transcoders`, a per-layer set or a cross-layer transcoder.

How it works
------------
A transcoder replaces an MLP: its features read the MLP's input and write what the MLP adds to the residual
stream. :class:`Transcoders` holds one for every block ``l`` of a model, reading ``blocks.{l}.{input_hook}``
(``mlp.hook_in`` by default: the MLP's input after the norm's weight; ``hook_resid_mid`` and
``ln2.hook_normalized`` are the other inputs transcoders are trained on) and writing
``blocks.{l}.{output_hook}`` (``hook_mlp_out``). The tensors are laid out as circuit-tracer lays them out, one
row per feature:

- ``W_enc[l]`` ``[d_sae, d_model]``, ``b_enc[l]`` ``[d_sae]``: the pre-activation is
  ``x @ W_enc[l].T + b_enc[l]``;
- the activation, one for the set: ``"relu"``; ``"jumprelu"`` -- ``pre * (pre > threshold[l])`` (circuit-tracer's
  JumpReLU; a threshold is never below zero for the transcoders sae-lens trains, where this equals
  ``relu(pre) * (pre > threshold)``); ``"topk"`` -- the ``k`` largest pre-activations, through a ReLU
  (sparsify's TopK);
- a per-layer transcoder (``cross_layer=False``): ``W_dec[l]`` ``[d_sae, d_model]``, and the output is
  ``f @ W_dec[l] + b_dec[l]``, plus ``x @ W_skip[l].T`` where there is a skip connection (``W_skip[l]``
  ``[d_model, d_model]``, circuit-tracer's and sparsify's orientation);
- a cross-layer transcoder (``cross_layer=True``): the features of block ``s`` write into every block
  ``l >= s``: ``W_dec[s]`` ``[d_sae, n_layers - s, d_model]``, and block ``l``'s output is
  ``b_dec[l] + sum over s <= l of f_s @ W_dec[s][:, l - s]``.

:meth:`layer_weights` gives block ``l``'s transcoder as a :class:`steerkit.sae.SAEWeights` (``transcoder=True``) and
:meth:`layer_sae` as a stored :class:`~steerkit.vectors.SAE` at its two sites; :meth:`clamp` is a clamp of some of its
latents, a two-site :class:`steerkit.Intervention` (encode at the input site, add ``(f' - f) @ W_dec[l]`` at the
output site, the MLP's real output kept; :mod:`steerkit.interventions.latents`).

:meth:`encode` / :meth:`decode` take and return every layer at once (``[n_layers, ..., width]``, as
circuit-tracer's ``TranscoderSet`` and ``CrossLayerTranscoder`` do); :meth:`encode_layer` one layer.
:func:`steerkit.load_transcoders` reads circuit-tracer's, sparsify's and sae-lens's files into this class,
:meth:`save` writes steerkit's own file or circuit-tracer's layout, and the store keeps it like every
artifact (safetensors, never a pickle).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
import torch.nn.functional as F
import yaml
from jaxtyping import Float
from safetensors.torch import save_file
from torch import Tensor

from steerkit.hooks.names import BLOCK_HOOKS, MLP_IN, parse
from steerkit.hooks.positions import PositionSpec
from steerkit.interventions import Intervention
from steerkit.sae import SAEWeights
from steerkit.storage.files import atomic_folder, atomic_write_bytes

from ..apply import check_against
from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance
from ..safety import check_output_file
from .base import _Artifact, _fields, payload_file_bytes
from .sae import SAE, _facts

#: the activations a transcoder set may have
TRANSCODER_ACTIVATIONS = ("relu", "jumprelu", "topk")
#: the sites (kinds of a block's hook) a transcoder may read and write: the residual stream's width
TRANSCODER_SITES = BLOCK_HOOKS + (MLP_IN, "ln2.hook_normalized")
#: where :meth:`Transcoders.save` writes: steerkit's one-file artifact, circuit-tracer's folder
TRANSCODER_SAVE_FORMATS = ("steerkit", "circuit-tracer")
#: the config file of circuit-tracer's transcoder folders
CIRCUIT_TRACER_CONFIG = "config.yaml"
_PER_LAYER = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


@dataclasses.dataclass(eq=False)
class Transcoders(_Artifact):
    """A transcoder for every block of a model: a per-layer set or a cross-layer transcoder (see the module
    docstring for the layout and the math). :meth:`encode` / :meth:`decode` run them, :meth:`check` checks
    them against a model, :meth:`save` writes them; :func:`steerkit.probes.attribution_graph` traces a prompt
    through them.

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> g = torch.Generator().manual_seed(0)
        >>> L, d, n = tiny.n_layers, tiny.d_model, 256
        >>> tc = Transcoders([torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(n)] * L,
        ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L,
        ...                  activation="topk", k=16, provenance=Provenance.from_model(tiny))
        >>> tc.n_layers, tc.d_sae, tc.sites(2), tc.check(tiny)
        (4, 256, ('blocks.2.mlp.hook_in', 'blocks.2.hook_mlp_out'), [])
        >>> x = torch.randn(L, 5, d, generator=g)  # every layer's input
        >>> f = tc.encode(x)
        >>> tuple(f.shape), (f[0] != 0).sum(-1).tolist(), tuple(tc.decode(f).shape)
        ((4, 5, 256), [16, 16, 16, 16, 16], (4, 5, 64))
        >>> store.save("tc", tc), store.load("tc@1") == tc
        ('tc@1', True)
    """

    W_enc: list[Tensor]
    b_enc: list[Tensor]
    W_dec: list[Tensor]
    b_dec: list[Tensor]
    activation: str = "relu"
    threshold: list[Tensor] | None = None
    k: int | None = None
    W_skip: list[Tensor] | None = None
    input_hook: str = MLP_IN
    output_hook: str = "hook_mlp_out"
    cross_layer: bool = False
    scan: str | None = None
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="encode"))
    kind: ClassVar[str] = "transcoders"

    def __post_init__(self) -> None:
        for name in _PER_LAYER:
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, Tensor):  # a stacked tensor: one entry per layer
                v = list(v.unbind(0))
            if not isinstance(v, (list, tuple)) or not all(isinstance(t, Tensor) and t.is_floating_point() for t in v):
                raise VectorsError(f"expected {name} as a list of floating-point tensors, one per layer, found "
                                   f"{type(v).__name__}")
            setattr(self, name, [t.detach() for t in v])
        self._check_structure()
        self._check_options()
        prov = self.provenance.replace(hook_site=self.input_hook, operation="encode")
        if prov.d_model is None:
            prov = prov.replace(d_model=self.d_model)
        elif prov.d_model != self.d_model:
            raise ModelMismatchError(f"expected transcoders reading d_model={prov.d_model} (from the provenance), "
                                     f"found {self.d_model}; they do not belong to that model")
        if prov.n_layers is None:
            prov = prov.replace(n_layers=self.n_layers)
        self.provenance = prov

    def _check_structure(self) -> None:
        n = len(self.W_enc)
        if n < 1:
            raise VectorsError("expected transcoders for at least one block, found none")
        for name in _PER_LAYER:
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise VectorsError(f"expected {name} for each of the {n} blocks, found {len(v)}")
        d = int(self.W_enc[0].shape[-1]) if self.W_enc[0].ndim == 2 else 0
        kinds = set()
        for l in range(n):
            d_sae = int(self.W_enc[l].shape[0])
            dec = (d_sae, n - l, d) if self.cross_layer else (d_sae, d)
            want = {"W_enc": (d_sae, d), "b_enc": (d_sae,), "W_dec": dec, "b_dec": (d,), "threshold": (d_sae,),
                    "W_skip": (d, d)}
            for name, shape in want.items():
                v = getattr(self, name)
                if v is not None and _shape(v[l]) != shape:
                    raise VectorsError(f"expected {name}[{l}] of shape {shape} for a {'cross-layer' if self.cross_layer else 'per-layer'} "
                                       f"transcoder of {n} blocks with W_enc[{l}] [d_sae={d_sae}, d_model={d}], found "
                                       f"{_shape(v[l])}; the tensors do not belong together")
                if v is not None:
                    kinds.add((v[l].dtype, v[l].device))
            if d_sae < 1 or d < 1:
                raise VectorsError(f"expected nonempty transcoders, found d_sae={d_sae}, d_model={d} at block {l}")
        if len(kinds) != 1:
            raise VectorsError(f"expected every transcoder tensor in one dtype on one device, found "
                               f"{sorted(str(k) for k in kinds)}; move them with .to(...) first")
        if self.cross_layer and self.W_skip is not None:
            raise VectorsError("expected no skip connection on a cross-layer transcoder (circuit-tracer's files hold "
                               "none), found W_skip")

    def _check_options(self) -> None:
        if self.activation not in TRANSCODER_ACTIVATIONS:
            raise VectorsError(f"expected an activation in {TRANSCODER_ACTIVATIONS}, found {self.activation!r}")
        if (self.threshold is not None) != (self.activation == "jumprelu"):
            raise VectorsError(f"expected threshold exactly for a JumpReLU transcoder, found "
                               f"{'one' if self.threshold is not None else 'none'} on a {self.activation} one")
        if self.activation == "topk":
            small = min(int(w.shape[0]) for w in self.W_enc)
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= small:
                raise VectorsError(f"expected a TopK transcoder's k as an integer in 1..{small} (d_sae), found {self.k!r}")
        elif self.k is not None:
            raise VectorsError(f"expected k only for a TopK transcoder, found k={self.k!r} on a {self.activation} one")
        for what, kind in (("input_hook", self.input_hook), ("output_hook", self.output_hook)):
            if kind not in TRANSCODER_SITES:
                raise VectorsError(f"expected {what} as one of {TRANSCODER_SITES} (the kind of a block's hook), found "
                                   f"{kind!r:.80}")
        if self.scan is not None and not isinstance(self.scan, str):
            raise VectorsError(f"expected scan as a string, found {type(self.scan).__name__}")

    # ---- what it is
    @property
    def n_layers(self) -> int:
        """The number of blocks (one transcoder, or one encoder, per block)."""
        return len(self.W_enc)

    @property
    def layers(self) -> list[int]:
        return list(range(self.n_layers))

    @property
    def d_model(self) -> int:
        """The residual stream's width, which the transcoders read and write."""
        return int(self.W_enc[0].shape[1])

    @property
    def d_sae(self) -> int:
        """Features per block (the widest block's, where they differ)."""
        return max(int(w.shape[0]) for w in self.W_enc)

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc[0].dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc[0].device

    @property
    def skip_connection(self) -> bool:
        """Whether each transcoder adds ``x @ W_skip.T`` to its output."""
        return self.W_skip is not None

    def sites(self, layer: int) -> tuple[str, str]:
        """``(input site, output site)`` of block ``layer``'s transcoder.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.zeros(8, 4)], [torch.zeros(8)], [torch.zeros(8, 4)], [torch.zeros(4)],
            ...                  input_hook="hook_resid_mid")
            >>> tc.sites(0)
            ('blocks.0.hook_resid_mid', 'blocks.0.hook_mlp_out')
        """
        if not 0 <= layer < self.n_layers:
            raise VectorsError(f"expected a block in 0..{self.n_layers - 1}, found {layer}")
        return f"blocks.{layer}.{self.input_hook}", f"blocks.{layer}.{self.output_hook}"

    def summary(self) -> dict:
        return {**super().summary(), "n_layers": self.n_layers, "d_sae": self.d_sae, "activation": self.activation,
                "cross_layer": self.cross_layer, "input_hook": self.input_hook, "output_hook": self.output_hook}

    # ---- inference
    def activate(self, pre: Float[Tensor, "... d_sae"], layer: int) -> Float[Tensor, "... d_sae"]:
        """Block ``layer``'s activation applied to pre-activations ``pre``.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.zeros(3, 2)], [torch.zeros(3)], [torch.zeros(3, 2)], [torch.zeros(2)],
            ...                  activation="jumprelu", threshold=[torch.tensor([0.5, 0.5, 2.0])])
            >>> tc.activate(torch.tensor([1.0, 0.2, 1.0]), 0)
            tensor([1., 0., 0.])
        """
        if self.activation == "relu":
            return F.relu(pre)
        if self.activation == "jumprelu":
            assert self.threshold is not None
            return (pre * (pre > self.threshold[layer])).to(pre)
        assert self.k is not None
        values, idx = torch.topk(pre, k=self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, idx, values.relu())

    def encode_layer(self, x: Float[Tensor, "... d_model"], layer: int, *, apply_activation_function: bool = True
                     ) -> Float[Tensor, "... d_sae"]:
        """Block ``layer``'s features of its input ``x`` (``apply_activation_function=False``: the pre-activations).

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.eye(2)], [torch.tensor([0.0, -1.0])], [torch.eye(2)], [torch.zeros(2)])
            >>> tc.encode_layer(torch.tensor([3.0, 0.5]), 0), tc.encode_layer(torch.tensor([3.0, 0.5]), 0,
            ...                                                               apply_activation_function=False)
            (tensor([3., 0.]), tensor([ 3.0000, -0.5000]))
        """
        if not 0 <= layer < self.n_layers:
            raise VectorsError(f"expected a block in 0..{self.n_layers - 1}, found {layer}")
        pre = F.linear(x.to(self.dtype), self.W_enc[layer], self.b_enc[layer])
        return self.activate(pre, layer) if apply_activation_function else pre

    def encode(self, x: Float[Tensor, "n_layers ... d_model"]) -> Float[Tensor, "n_layers ... d_sae"]:
        """Every block's features: ``x[l]`` is block ``l``'s input (``[n_layers, ..., d_model]``).

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.eye(2)] * 2, [torch.zeros(2)] * 2, [torch.eye(2)] * 2, [torch.zeros(2)] * 2)
            >>> tc.encode(torch.tensor([[1.0, -1.0], [-2.0, 2.0]]))
            tensor([[1., 0.],
                    [0., 2.]])
        """
        if len(x) != self.n_layers:
            raise VectorsError(f"expected the inputs of all {self.n_layers} blocks ([n_layers, ..., d_model]), found "
                               f"{len(x)}")
        return torch.stack([self.encode_layer(x[l], l) for l in range(self.n_layers)])

    def decode(self, f: Float[Tensor, "n_layers ... d_sae"] | Sequence[Tensor],
               x: Float[Tensor, "n_layers ... d_model"] | None = None) -> Float[Tensor, "n_layers ... d_model"]:
        """Every block's output from every block's features ``f`` (``x``: the inputs they came from, which a
        skip connection needs); a cross-layer transcoder sums the features of every block at or below.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> dec = [torch.ones(2, 2, 3), torch.ones(2, 1, 3)]  # block 0 writes blocks 0 and 1
            >>> tc = Transcoders([torch.eye(3)[:2]] * 2, [torch.zeros(2)] * 2, dec, [torch.zeros(3)] * 2,
            ...                  cross_layer=True)
            >>> tc.decode(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
            tensor([[1., 1., 1.],
                    [3., 3., 3.]])
        """
        if len(f) != self.n_layers:
            raise VectorsError(f"expected the features of all {self.n_layers} blocks, found {len(f)}")
        if self.skip_connection and x is None:
            raise VectorsError("expected x (each block's input) to decode with a skip connection, found none")
        out = []
        for l in range(self.n_layers):
            if self.cross_layer:
                y = self.b_dec[l] + sum(f[s].to(self.dtype) @ self.W_dec[s][:, l - s] for s in range(l + 1))
            else:
                y = f[l].to(self.dtype) @ self.W_dec[l] + self.b_dec[l]
                if self.W_skip is not None:
                    assert x is not None
                    y = y + F.linear(x[l].to(self.dtype), self.W_skip[l])
            out.append(y)
        return torch.stack(out)

    def skip(self, x: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... d_model"]:
        """Block ``layer``'s skip connection of its input ``x`` (``x @ W_skip[layer].T``; zeros without one).

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.eye(2)], [torch.zeros(2)], [torch.eye(2)], [torch.zeros(2)],
            ...                  W_skip=[2 * torch.eye(2)])
            >>> tc.skip(torch.tensor([1.0, 3.0]), 0)
            tensor([2., 6.])
        """
        if self.W_skip is None:
            return torch.zeros_like(x, dtype=self.dtype)
        return F.linear(x.to(self.dtype), self.W_skip[layer])

    # ---- one layer as an SAE, and its clamp
    def written(self, layer: int) -> list[int]:
        """The blocks block ``layer``'s features write: its own for a per-layer set, every block from ``layer`` on for a
        cross-layer transcoder.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> dec = [torch.ones(2, 3 - l, 4) for l in range(3)]
            >>> clt = Transcoders([torch.eye(4)[:2]] * 3, [torch.zeros(2)] * 3, dec, [torch.zeros(4)] * 3, cross_layer=True)
            >>> clt.written(1)
            [1, 2]
        """
        self.sites(layer)  # the layer's range
        return list(range(layer, self.n_layers)) if self.cross_layer else [layer]

    def layer_weights(self, layer: int, *, written: int | None = None) -> SAEWeights:
        """Block ``layer``'s transcoder as :class:`steerkit.sae.SAEWeights` (``transcoder=True``): ``W_enc[l].T``,
        ``b_enc[l]``, ``W_dec[l]``, ``b_dec[l]``, the threshold (JumpReLU) or ``k`` (TopK), ``W_skip[l].T``; its
        ``encode`` equals :meth:`encode_layer`. A cross-layer transcoder's features write several blocks: ``written``
        (one of :meth:`written`) names the block whose part of the decoder (``W_dec[l][:, written - l]``) and bias it
        holds; required there. A JumpReLU threshold below zero (circuit-tracer's ``pre * (pre > t)`` then passes
        negative values, which :class:`~steerkit.sae.SAEWeights`' ``relu(pre) * (pre > t)`` does not) is refused.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.eye(2)], [torch.tensor([0.0, -1.0])], [2 * torch.eye(2)], [torch.zeros(2)])
            >>> w = tc.layer_weights(0)
            >>> w.transcoder, w.encode(torch.tensor([3.0, 0.5])), tc.encode_layer(torch.tensor([3.0, 0.5]), 0)
            (True, tensor([3., 0.]), tensor([3., 0.]))
        """
        blocks = self.written(layer)
        if written is None and self.cross_layer:
            raise VectorsError(f"expected written= (one of the blocks {blocks} that block {layer}'s features write) for "
                               "a cross-layer transcoder, found none; its features write every later block")
        out = layer if written is None else written
        if out not in blocks:
            raise VectorsError(f"expected written= one of the blocks {blocks} that block {layer}'s features write, "
                               f"found {written!r}")
        thr = None if self.threshold is None else self.threshold[layer]
        if thr is not None and bool((thr < 0).any()):
            raise VectorsError(f"expected JumpReLU thresholds of at least 0 at block {layer} (below 0, pre * (pre > t) "
                               f"passes negative activations), found {int((thr < 0).sum())} below 0")
        dec = self.W_dec[layer][:, out - layer] if self.cross_layer else self.W_dec[layer]
        return SAEWeights(self.W_enc[layer].T, self.b_enc[layer], dec, self.b_dec[out],
                          architecture=self.activation, k=self.k, threshold=thr,
                          W_skip=None if self.W_skip is None else self.W_skip[layer].T.contiguous(),
                          apply_b_dec_to_input=False, transcoder=True)

    def layer_sae(self, layer: int, *, written: int | None = None) -> SAE:
        """Block ``layer``'s transcoder as a stored :class:`~steerkit.vectors.SAE` reading its input site and writing its
        output site (:meth:`sites`; a cross-layer transcoder's: block ``written``'s), with the set's provenance
        (:meth:`layer_weights` for the weights).

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.eye(2)] * 2, [torch.zeros(2)] * 2, [torch.eye(2)] * 2, [torch.zeros(2)] * 2)
            >>> sae = tc.layer_sae(1)
            >>> sae.site, sae.output_site, sae.weights.transcoder
            ('blocks.1.mlp.hook_in', 'blocks.1.hook_mlp_out', True)
        """
        weights = self.layer_weights(layer, written=written)
        site = self.sites(layer)[0]
        out = self.sites(layer if written is None else written)[1]
        return SAE(weights, site, out, provenance=self.provenance)

    def clamp(self, layer: int, latents: int | Sequence[int], value: Any = None, scale: float | None = None,
              positions: PositionSpec = "all") -> Intervention:
        """Clamp ``latents`` of block ``layer``'s transcoder to ``value`` (a number, or one per latent) or to ``scale``
        times their own activation (exactly one): a two-site :class:`steerkit.Intervention` at the output site that
        encodes at the input site in the same pass and adds ``(f' - f) @ W_dec[layer]``, so the MLP's real output
        stays (nothing is frozen); at ``positions``, per row like every intervention (``sm.steer(rows=[...])``).
        ``scale=0`` turns the features off where they fire. A cross-layer transcoder's features write several
        blocks: :meth:`clamp_layers` gives their clamp, one intervention per block.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> g = torch.Generator().manual_seed(0)
            >>> L, d, n = tiny.n_layers, tiny.d_model, 64
            >>> tc = Transcoders([torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(n)] * L,
            ...                  [torch.randn(n, d, generator=g) / 8 for _ in range(L)], [torch.zeros(d)] * L)
            >>> clamp = tc.clamp(2, [5, 9], value=3.0, positions="last")
            >>> clamp
            Intervention('blocks.2.hook_mlp_out', latent, scale=1.0, positions='last', source='blocks.2.mlp.hook_in')
            >>> sites = ["blocks.2.mlp.hook_in", "blocks.2.hook_mlp_out"]
            >>> with tiny.record(sites) as plain:
            ...     _ = tiny.forward("hello world", chat=False)
            >>> with tiny.steer(clamp), tiny.record(sites) as cache:
            ...     _ = tiny.forward("hello world", chat=False)
            >>> x, y = plain[sites[0]][0, -1], plain[sites[1]][0, -1]
            >>> want = y + (3.0 - tc.encode_layer(x, 2)[[5, 9]]) @ tc.W_dec[2][[5, 9]]
            >>> torch.allclose(cache[sites[1]][0, -1], want, atol=1e-5)
            True
        """
        if self.cross_layer:
            raise VectorsError(f"expected a per-layer transcoder set for one clamp, found a cross-layer transcoder (block "
                               f"{layer}'s features write blocks {self.written(layer)}); use "
                               "Transcoders.clamp_layers, one intervention per block written")
        return self.clamp_layers(layer, latents, value=value, scale=scale, positions=positions)[0]

    def clamp_layers(self, layer: int, latents: int | Sequence[int], value: Any = None, scale: float | None = None,
                     positions: PositionSpec = "all") -> list[Intervention]:
        """The clamp of :meth:`clamp` as one two-site intervention per block the features write (:meth:`written`): for a
        cross-layer transcoder each block ``l >= layer`` gets ``(f' - f) @ W_dec[layer][:, l - layer]``, the features
        read at block ``layer``'s input site in the same pass; for a per-layer set, the one clamp.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> L, d = tiny.n_layers, tiny.d_model
            >>> dec = [torch.randn(16, L - l, d) / 8 for l in range(L)]
            >>> clt = Transcoders([torch.randn(16, d) / 8] * L, [torch.zeros(16)] * L, dec, [torch.zeros(d)] * L,
            ...                   cross_layer=True)
            >>> [(iv.site, iv.latent.source) for iv in clt.clamp_layers(2, [3], scale=0.0)]
            [('blocks.2.hook_mlp_out', 'blocks.2.mlp.hook_in'), ('blocks.3.hook_mlp_out', 'blocks.2.mlp.hook_in')]
        """
        source = self.sites(layer)[0]
        return [Intervention.sae_latent(self.sites(out)[1], self.layer_weights(layer, written=out), latents,
                                        value=value, scale=scale, positions=positions, source=source)
                for out in self.written(layer)]

    def fingerprint(self) -> str:
        """A hash of the transcoders' options and every weight (16 hex digits): which transcoders an artifact made
        with them (a :class:`~steerkit.vectors.LatentClamp` of a graph's features) was made with.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.eye(2)], [torch.zeros(2)], [torch.eye(2)], [torch.zeros(2)])
            >>> len(tc.fingerprint()), tc.fingerprint() == tc.clone().fingerprint()
            (16, True)
        """
        options = [self.activation, self.k, self.input_hook, self.output_hook, self.cross_layer, self.scan]
        h = hashlib.sha256(json.dumps(options).encode())
        for name, t in self.tensors().items():
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    # ---- against a model
    def check(self, model: Any, *, override: bool = False) -> list[str]:
        """Check the transcoders against ``model`` (a SteerModel, a Hugging Face model, :class:`steerkit.ModelFacts`
        or their dict): one for each of its blocks, reading and writing sites it has, of its width
        (:class:`ModelMismatchError` otherwise, never overridable); its fingerprint the provenance's
        (``override=True`` warns instead). Returns the notes also issued as warnings.

        Examples:
            >>> from steerkit.vectors import ModelMismatchError, Transcoders
            >>> tc = Transcoders([torch.zeros(8, 64)] * 3, [torch.zeros(8)] * 3, [torch.zeros(8, 64)] * 3,
            ...                  [torch.zeros(64)] * 3)
            >>> try:
            ...     tc.check(tiny)  # tiny has 4 blocks
            ... except ModelMismatchError as e:
            ...     print(str(e)[:58])
            expected a transcoder for each of the model's 4 blocks, fo
        """
        facts = _facts(model)
        if self.n_layers != facts.n_layers:
            raise ModelMismatchError(f"expected a transcoder for each of the model's {facts.n_layers} blocks, found "
                                     f"{self.n_layers} on {facts.name!r}; they were made for another model")
        if self.d_model != facts.d_model:
            raise ModelMismatchError(f"expected transcoders of d_model={facts.d_model} for {facts.name!r}, found "
                                     f"{self.d_model}; they were made for another model (not even override=True "
                                     "applies them)")
        for site in self.sites(0):
            try:
                parse(site, facts.n_layers, has_resid_mid=facts.has_resid_mid)
            except (KeyError, ValueError) as e:  # HookNameError, InputError
                raise ModelMismatchError(f"expected the transcoders' site {site} to exist on {facts.name!r}, found: "
                                         f"{e}") from None
        return check_against(self, facts, override=override, stacklevel=3)

    # ---- files
    def save(self, path: str | os.PathLike, format: str = "steerkit", *, overwrite: bool = False) -> Path:
        """Write the transcoders: ``"steerkit"`` -- one safetensors file (``steerkit.load_transcoders`` and the
        store read it back exactly); ``"circuit-tracer"`` -- a folder in circuit-tracer's cache layout
        (``config.yaml`` beside ``layer_{l}.safetensors``, or ``W_enc_{l}`` / ``W_dec_{l}.safetensors`` for a
        cross-layer transcoder), ReLU and JumpReLU only, which circuit-tracer 0.5 loads. A folder appears whole
        or not at all; an existing one is an error unless ``overwrite``.

        Examples:
            >>> from steerkit.vectors import Transcoders
            >>> tc = Transcoders([torch.randn(8, 64)] * 4, [torch.zeros(8)] * 4, [torch.randn(8, 64)] * 4,
            ...                  [torch.zeros(64)] * 4, activation="jumprelu", threshold=[torch.full((8,), 0.1)] * 4)
            >>> folder = tc.save(tmp_dir / "tc", "circuit-tracer")
            >>> sorted(p.name for p in folder.iterdir())[:3]
            ['config.yaml', 'layer_0.safetensors', 'layer_1.safetensors']
            >>> steerkit.load_transcoders(folder).W_dec[2].equal(tc.W_dec[2])
            True
        """
        if format not in TRANSCODER_SAVE_FORMATS:
            raise VectorsError(f"expected format in {TRANSCODER_SAVE_FORMATS}, found {format!r}")
        if format == "circuit-tracer":
            return _write_circuit_tracer(self, path, overwrite=overwrite)
        p = check_output_file(path, "transcoders file")
        if p.exists() and not overwrite:
            raise VectorsError(f"expected no file at {p}, found one; pass overwrite=True to replace it")
        atomic_write_bytes(p, payload_file_bytes(*self.to_payload()))
        return p

    # ---- payload
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor by its stored name (``W_enc.{l}``, ``b_enc.{l}``, ``W_dec.{l}``, ``b_dec.{l}``, and
        ``threshold.{l}`` / ``W_skip.{l}`` where present)."""
        out: dict[str, Tensor] = {}
        for name in _PER_LAYER:
            v = getattr(self, name)
            for l, t in enumerate(v or []):
                out[f"{name}.{l}"] = t
        return out

    def _map_tensors(self, fn) -> "Transcoders":
        mapped: dict[str, Any] = {name: None if getattr(self, name) is None else [fn(t) for t in getattr(self, name)]
                                  for name in _PER_LAYER}
        return dataclasses.replace(self, **mapped)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Transcoders):
            return NotImplemented
        a, b = self.tensors(), other.tensors()
        same = (self.activation, self.k, self.input_hook, self.output_hook, self.cross_layer, self.scan) == \
            (other.activation, other.k, other.input_hook, other.output_hook, other.cross_layer, other.scan)
        return (same and a.keys() == b.keys() and self.provenance == other.provenance
                and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
                        and bool(torch.equal(a[n].cpu(), b[n].cpu())) for n in a))

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {n: t.detach().cpu().contiguous() for n, t in self.tensors().items()}
        fields = {"n_layers": self.n_layers, "activation": self.activation, "k": self.k, "input_hook": self.input_hook,
                  "output_hook": self.output_hook, "cross_layer": self.cross_layer, "scan": self.scan}
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "Transcoders":
        fields = _fields(meta, cls.kind)
        n = fields.get("n_layers")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 100_000:
            raise ArtifactFormatError(f"expected the transcoders' n_layers as an integer in 1..100000, found {n!r:.40}")
        types = {"activation": (str,), "k": (int, type(None)), "input_hook": (str,), "output_hook": (str,),
                 "cross_layer": (bool,), "scan": (str, type(None))}
        for key, allowed in types.items():
            v = fields.get(key)
            if not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed):
                raise ArtifactFormatError(f"expected the transcoders' {key} as {' or '.join(t.__name__ for t in allowed)}, "
                                          f"found {v!r:.80}")
        want = {f"{name}.{l}" for name in ("W_enc", "b_enc", "W_dec", "b_dec") for l in range(n)}
        optional = {f"{name}.{l}" for name in ("threshold", "W_skip") for l in range(n)}
        keys = set(tensors)
        if want - keys or keys - want - optional:
            raise ArtifactFormatError(f"expected the tensors of {n} blocks (W_enc.l, b_enc.l, W_dec.l, b_dec.l, optional "
                                      f"threshold.l, W_skip.l), found {sorted(keys)[:12]}")
        for t in tensors.values():
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise ArtifactFormatError("expected finite values in the transcoders, found NaN or infinity")

        def per_layer(name: str) -> list[Tensor] | None:
            if f"{name}.0" not in tensors:
                return None
            return [tensors[f"{name}.{l}"] for l in range(n)]
        try:
            return cls(per_layer("W_enc") or [], per_layer("b_enc") or [], per_layer("W_dec") or [],
                       per_layer("b_dec") or [], activation=fields["activation"], threshold=per_layer("threshold"),
                       k=fields["k"], W_skip=per_layer("W_skip"), input_hook=fields["input_hook"],
                       output_hook=fields["output_hook"], cross_layer=fields["cross_layer"], scan=fields["scan"],
                       provenance=Provenance.from_dict(meta.get("provenance", {})))
        except VectorsError as e:
            if isinstance(e, ArtifactFormatError):
                raise
            raise ArtifactFormatError(f"expected a valid transcoders payload, found: {e}") from None


def _write_circuit_tracer(tc: Transcoders, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """``tc`` in circuit-tracer's cache layout at ``path`` (:meth:`Transcoders.save` with ``format="circuit-tracer"``):
    ``config.yaml`` and ``layer_{l}.safetensors`` (``W_enc``, ``W_dec``, ``b_enc``, ``b_dec``,
    ``activation_function.threshold`` for JumpReLU, ``W_skip``), or a cross-layer transcoder's ``W_enc_{l}`` /
    ``W_dec_{l}.safetensors``, which ``circuit_tracer.utils.caching.load_transcoders_from_cache`` reads. ReLU and
    JumpReLU only: circuit-tracer 0.5 loads no other."""
    if tc.activation not in ("relu", "jumprelu"):
        raise VectorsError(f"expected ReLU or JumpReLU transcoders for circuit-tracer's layout (circuit-tracer 0.5 loads "
                           f"no other), found {tc.activation}; save them as format='steerkit'")
    p = Path(path)
    if p.exists() and not overwrite:
        raise VectorsError(f"expected no folder at {p}, found one; pass overwrite=True to replace it")
    cfg = {"model_kind": "cross_layer_transcoder" if tc.cross_layer else "transcoder_set",
           "feature_input_hook": tc.input_hook, "feature_output_hook": tc.output_hook, "scan": tc.scan}
    cpu = tc.to("cpu")
    with atomic_folder(p, if_exists="replace" if overwrite else "error") as tmp:
        (tmp / CIRCUIT_TRACER_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=True), encoding="utf-8")
        for l in range(tc.n_layers):
            thr = None if cpu.threshold is None else cpu.threshold[l].contiguous()
            if tc.cross_layer:
                enc = {f"W_enc_{l}": cpu.W_enc[l], f"b_enc_{l}": cpu.b_enc[l], f"b_dec_{l}": cpu.b_dec[l]}
                if thr is not None:
                    enc[f"threshold_{l}"] = thr
                save_file({k: v.contiguous() for k, v in enc.items()}, str(tmp / f"W_enc_{l}.safetensors"))
                save_file({f"W_dec_{l}": cpu.W_dec[l].contiguous()}, str(tmp / f"W_dec_{l}.safetensors"))
                continue
            layer = {"W_enc": cpu.W_enc[l], "W_dec": cpu.W_dec[l], "b_enc": cpu.b_enc[l], "b_dec": cpu.b_dec[l]}
            if thr is not None:
                layer["activation_function.threshold"] = thr
            if cpu.W_skip is not None:
                layer["W_skip"] = cpu.W_skip[l]
            save_file({k: v.contiguous() for k, v in layer.items()}, str(tmp / f"layer_{l}.safetensors"))
    return p
