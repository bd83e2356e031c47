"""A sparse autoencoder's weights and its inference math: :class:`SAEWeights`.

How it works
------------
An SAE reads an activation ``x`` ``[..., d_in]`` and writes latents ``f`` ``[..., d_sae]``:

1. the input is cast to the weights' dtype; an SAE on ``attn.hook_z`` (``flatten_heads``) flattens
   ``[..., n_heads, d_head]`` into ``[..., d_in]`` (a flat ``[..., d_in]`` is taken as it is);
2. ``normalize_activations`` (sae-lens's runtime normalisation): ``"layer_norm"`` centres ``x`` and
   divides by its standard deviation (unbiased, ``+ 1e-5``), ``"constant_norm_rescale"`` scales ``x``
   to norm ``sqrt(d_in)``; ``"none"`` leaves it;
3. ``apply_b_dec_to_input`` subtracts ``b_dec`` (sae-lens's flag; sparsify's autoencoders always do,
   its transcoders never);
4. the pre-activation ``pre = x @ W_enc + b_enc`` goes through the architecture's activation:

   * ``"relu"`` (sae-lens's ``standard``): ``relu(pre)``;
   * ``"jumprelu"``: ``relu(pre) * (pre > threshold)``; a BatchTopK SAE runs at inference as this, with
     one threshold for every latent (sae-lens saves it so);
   * ``"topk"``: the ``k`` largest entries of ``pre`` through a ReLU, zeros elsewhere (sparsify's TopK,
     a ReLU before the selection, gives the same values);
   * ``"gated"``: ``(pre > 0) * relu(x @ (W_enc * exp(r_mag)) + b_mag)`` (``b_enc`` is the gate's bias,
     sae-lens's ``b_gate``).

Decoding is ``f @ W_dec + b_dec`` ``[..., d_out]``, plus ``x @ W_skip`` where there is a skip connection,
then the inverse of step 2 (it needs the input ``x`` the latents came from). A *transcoder* reads one
site and predicts another (``d_out`` may differ from ``d_in``); an autoencoder reconstructs its input,
and its error term ``x - decode(encode(x), x)`` is what the reconstruction misses, so
``x == decode(encode(x), x) + error(x)``.

The values equal sae-lens's ``SAE.encode`` / ``decode`` and sparsify's ``SparseCoder.encode`` / ``decode``
on the same weights (``tests/integration/test_sae_lens.py``, ``tests/core/test_sae.py``); TopK's ``rescale_acts_by_decoder_norm``
of sae-lens is folded into the weights when a folder is read (:mod:`steerkit.sae.formats`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from steerkit.errors import InputError

#: the encoders :class:`SAEWeights` knows
ARCHITECTURES = ("relu", "jumprelu", "topk", "gated")
#: sae-lens's runtime normalisations of the input (inverted on the output)
NORMALIZATIONS = ("none", "layer_norm", "constant_norm_rescale")
#: the tensors an SAE may hold, in the order they are stored; the first four always
TENSOR_NAMES = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "b_mag", "r_mag", "W_skip")
_LN_EPS = 1e-5


class SAEFormatError(InputError):
    """An SAE's weights or folder are malformed (a missing file or tensor, a wrong shape, an unknown
    architecture), or an SAE cannot be written in the format asked for. The message says what was
    expected, what was found and what to do.

    Examples:
        >>> from steerkit.sae import SAEFormatError, SAEWeights
        >>> try:
        ...     SAEWeights(torch.zeros(4, 8), torch.zeros(8), torch.zeros(8, 4), torch.zeros(4), architecture="abs")
        ... except SAEFormatError as e:
        ...     print(str(e)[:60])
        expected an SAE architecture in ('relu', 'jumprelu', 'topk',
    """


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class SAEWeights:
    """The weights of a sparse autoencoder or transcoder, and its inference: :meth:`encode`,
    :meth:`decode`, :meth:`reconstruct`, :meth:`error` (see the module docstring for the math).

    ``W_enc`` ``[d_in, d_sae]``, ``b_enc`` ``[d_sae]``, ``W_dec`` ``[d_sae, d_out]``, ``b_dec`` ``[d_out]``;
    ``threshold`` ``[d_sae]`` (JumpReLU), ``k`` (TopK), ``b_mag`` / ``r_mag`` ``[d_sae]`` (gated),
    ``W_skip`` ``[d_in, d_out]`` (a skip connection: ``x @ W_skip`` is added to the output).
    ``transcoder``: the SAE reads one site and predicts another. Every tensor has one dtype and one
    device; the constructor checks shapes, not values (:meth:`check_finite` reads every value).

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> g = torch.Generator().manual_seed(0)
        >>> W = torch.randn(16, 64, generator=g)
        >>> sae = SAEWeights(W, torch.zeros(64), W.T.clone(), torch.zeros(16), architecture="topk", k=4)
        >>> x = torch.randn(3, 16, generator=g)
        >>> f = sae.encode(x)
        >>> f.shape, (f != 0).sum(-1).tolist()
        (torch.Size([3, 64]), [4, 4, 4])
        >>> torch.allclose(sae.decode(f) + sae.error(x), x, atol=1e-5)
        True
    """

    W_enc: Float[Tensor, "d_in d_sae"]
    b_enc: Float[Tensor, " d_sae"]
    W_dec: Float[Tensor, "d_sae d_out"]
    b_dec: Float[Tensor, " d_out"]
    architecture: str = "relu"
    k: int | None = None
    threshold: Float[Tensor, " d_sae"] | None = None
    b_mag: Float[Tensor, " d_sae"] | None = None
    r_mag: Float[Tensor, " d_sae"] | None = None
    W_skip: Float[Tensor, "d_in d_out"] | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    flatten_heads: bool = False
    transcoder: bool = False

    def __post_init__(self) -> None:
        for name in TENSOR_NAMES:
            t = getattr(self, name)
            if t is not None and not (isinstance(t, Tensor) and t.is_floating_point()):
                found = t.dtype if isinstance(t, Tensor) else type(t).__name__
                raise SAEFormatError(f"expected {name} as a floating-point torch.Tensor, found {found}")
        if self.architecture not in ARCHITECTURES:
            raise SAEFormatError(f"expected an SAE architecture in {ARCHITECTURES}, found {self.architecture!r}; "
                                 "steerkit reads ReLU, JumpReLU, TopK and gated SAEs")
        if self.normalize_activations not in NORMALIZATIONS:
            raise SAEFormatError(f"expected normalize_activations in {NORMALIZATIONS}, found "
                                 f"{self.normalize_activations!r}")
        self._check_shapes()
        self._check_options()
        tensors = list(self.tensors().values())
        kinds = {(t.dtype, t.device) for t in tensors}
        if len(kinds) != 1:
            raise SAEFormatError(f"expected every SAE tensor in one dtype on one device, found "
                                 f"{sorted(str(k) for k in kinds)}; move them with .to(...) first")

    def _check_shapes(self) -> None:
        if self.W_enc.ndim != 2 or self.W_dec.ndim != 2:
            raise SAEFormatError(f"expected W_enc [d_in, d_sae] and W_dec [d_sae, d_out], found "
                                 f"{_shape(self.W_enc)} and {_shape(self.W_dec)}")
        d_in, d_sae = _shape(self.W_enc)
        d_out = int(self.W_dec.shape[1])
        want = {"b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,), "threshold": (d_sae,),
                "b_mag": (d_sae,), "r_mag": (d_sae,), "W_skip": (d_in, d_out)}
        for name, shape in want.items():
            t = getattr(self, name)
            if t is not None and _shape(t) != shape:
                raise SAEFormatError(f"expected {name} of shape {shape} for an SAE with W_enc [d_in={d_in}, "
                                     f"d_sae={d_sae}], found {_shape(t)}; the tensors do not belong together")
        if d_in < 1 or d_sae < 1 or d_out < 1:
            raise SAEFormatError(f"expected nonempty SAE weights, found d_in={d_in}, d_sae={d_sae}, d_out={d_out}")

    def _check_options(self) -> None:
        arch, d_sae = self.architecture, self.d_sae
        needs = {"jumprelu": ("threshold",), "gated": ("b_mag", "r_mag")}.get(arch, ())
        extra = [n for n in ("threshold", "b_mag", "r_mag") if getattr(self, n) is not None and n not in needs]
        missing = [n for n in needs if getattr(self, n) is None]
        if missing or extra:
            raise SAEFormatError(f"expected a {arch} SAE to hold {list(needs) or 'no extra tensors'}, found "
                                 f"{'no ' + ', '.join(missing) if missing else ''}"
                                 f"{' and ' if missing and extra else ''}{'also ' + ', '.join(extra) if extra else ''}")
        if arch == "topk":
            if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= d_sae:
                raise SAEFormatError(f"expected a TopK SAE's k as an integer in 1..{d_sae} (d_sae), found {self.k!r}")
        elif self.k is not None:
            raise SAEFormatError(f"expected k only for a TopK SAE, found k={self.k!r} on a {arch} SAE")
        if not self.transcoder and self.d_out != self.d_in:
            raise SAEFormatError(f"expected an autoencoder to reconstruct its input (d_out == d_in), found d_in="
                                 f"{self.d_in}, d_out={self.d_out}; a map between widths is a transcoder "
                                 "(transcoder=True)")
        if self.apply_b_dec_to_input and self.d_out != self.d_in:
            raise SAEFormatError(f"expected apply_b_dec_to_input=False where b_dec [{self.d_out}] cannot be "
                                 f"subtracted from the input [{self.d_in}], found True")
        if self.transcoder and self.normalize_activations != "none":
            raise SAEFormatError("expected normalize_activations='none' for a transcoder (its output lives at "
                                 f"another site, so the input's normalisation cannot be undone there), found "
                                 f"{self.normalize_activations!r}")

    # ------------------------------------------------------------------ sizes and moves
    @property
    def d_in(self) -> int:
        """The width the SAE reads (``n_heads * d_head`` for an SAE on ``attn.hook_z``)."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """The number of latents."""
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        """The width the SAE writes (``d_in`` for an autoencoder)."""
        return int(self.W_dec.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def tensors(self) -> dict[str, Tensor]:
        """The tensors this SAE holds, by :data:`TENSOR_NAMES` (absent ones left out)."""
        return {n: t for n in TENSOR_NAMES if (t := getattr(self, n)) is not None}

    def options(self) -> dict[str, Any]:
        """Everything but the tensors, as JSON-able values (``SAEWeights(**tensors, **options)`` rebuilds it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in TENSOR_NAMES}

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> "SAEWeights":
        """A new :class:`SAEWeights` with ``fn`` applied to every tensor."""
        mapped: dict[str, Any] = {n: fn(t) for n, t in self.tensors().items()}
        return dataclasses.replace(self, **mapped)

    def to(self, *args: Any, **kwargs: Any) -> "SAEWeights":
        """A new :class:`SAEWeights` with every tensor moved / cast like ``Tensor.to``."""
        return self.map_tensors(lambda t: t.to(*args, **kwargs))

    def check_finite(self) -> None:
        """Raise :class:`SAEFormatError` naming the first tensor with a NaN or an infinity."""
        for name, t in self.tensors().items():
            if t.numel() and not bool(torch.isfinite(t).all()):
                raise SAEFormatError(f"expected finite values in the SAE's {name}, found NaN or infinity; the "
                                     "weights are corrupted")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SAEWeights):
            return NotImplemented
        a, b = self.tensors(), other.tensors()
        return (self.options() == other.options() and a.keys() == b.keys()
                and all(a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
                        and bool(torch.equal(a[n].cpu(), b[n].cpu())) for n in a))

    __hash__ = None  # type: ignore[assignment]

    # ------------------------------------------------------------------ inference
    def _input(self, x: Tensor) -> Tensor:
        x = x.to(self.dtype)
        if self.flatten_heads and x.ndim >= 2 and x.shape[-1] != self.d_in:  # [..., n_heads, d_head]
            x = x.flatten(-2)
        if x.shape[-1] != self.d_in:
            raise InputError(f"expected activations [..., {self.d_in}] for this SAE"
                             f"{' (or [..., n_heads, d_head] flattened to it)' if self.flatten_heads else ''}, "
                             f"found shape {_shape(x)}; pass the activations of the site it reads")
        return x

    def _norm_in(self, x: Tensor) -> Tensor:
        if self.normalize_activations == "layer_norm":
            x = x - x.mean(dim=-1, keepdim=True)
            return x / (x.std(dim=-1, keepdim=True) + _LN_EPS)
        if self.normalize_activations == "constant_norm_rescale":
            return x * ((self.d_in ** 0.5) / x.norm(dim=-1, keepdim=True))
        return x

    def _norm_out(self, y: Tensor, x: Tensor | None) -> Tensor:
        if self.normalize_activations == "none":
            return y
        if x is None:
            raise InputError(f"expected the input x to decode with an SAE that normalises it "
                             f"({self.normalize_activations!r}): the output is scaled back by x's statistics; "
                             "call decode(f, x)")
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            return y * (x - mu).std(dim=-1, keepdim=True) + mu
        return y / ((self.d_in ** 0.5) / x.norm(dim=-1, keepdim=True))

    def _prepared(self, x: Tensor) -> Tensor:
        """The input after steps 1-3 (cast, flattened, normalised, ``b_dec`` subtracted)."""
        h = self._norm_in(self._input(x))
        return h - self.b_dec if self.apply_b_dec_to_input else h

    def pre_acts(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_sae"]:
        """The pre-activation ``x' @ W_enc + b_enc`` (``x'``: the input after steps 1-3), ``[..., d_sae]``.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> sae = SAEWeights(torch.eye(4), torch.full((4,), -1.0), torch.eye(4), torch.zeros(4))
            >>> sae.pre_acts(torch.tensor([3.0, 0.5, 0.0, 1.0]))
            tensor([ 2.0000, -0.5000, -1.0000,  0.0000])
        """
        return self._prepared(x) @ self.W_enc + self.b_enc

    def encode(self, x: Float[Tensor, "... d_in"],
               latents: Sequence[int] | Tensor | None = None) -> Float[Tensor, "... n"]:
        """The latents' activations ``[..., d_sae]``; with ``latents`` (indices), only those ``[..., len]``
        (ReLU, JumpReLU and gated SAEs then read only those latents' encoder columns; a TopK SAE needs
        every pre-activation to know which ``k`` win).

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> sae = SAEWeights(torch.eye(4), torch.zeros(4), torch.eye(4), torch.zeros(4),
            ...                  architecture="jumprelu", threshold=torch.full((4,), 0.5))
            >>> x = torch.tensor([3.0, 0.4, -2.0, 1.0])
            >>> sae.encode(x), sae.encode(x, latents=[3, 0])
            (tensor([3., 0., 0., 1.]), tensor([1., 3.]))
        """
        if latents is None:
            h = self._prepared(x)
            return self._activate(h @ self.W_enc + self.b_enc, h)
        if self.architecture == "topk":
            return self.encode(x)[..., self._indices(latents)]
        return self.restrict(latents).encode(x)

    def _indices(self, latents: Sequence[int] | Tensor) -> Tensor:
        idx = torch.as_tensor(latents, dtype=torch.long, device=self.device).reshape(-1)
        if not idx.numel() or not (0 <= int(idx.min()) and int(idx.max()) < self.d_sae):
            raise InputError(f"expected latent indices in 0..{self.d_sae - 1}, found {idx.tolist()[:10]}")
        return idx

    def restrict(self, latents: Sequence[int] | Tensor) -> "SAEWeights":
        """The SAE of only ``latents`` (in that order): their encoder columns, biases, thresholds and decoder
        rows. A ReLU, JumpReLU or gated SAE's restriction encodes those latents as the whole SAE does; a
        TopK SAE's choice needs every pre-activation (``encode(x, latents)`` reads the whole one), so its
        restriction (``k`` capped at the count) serves to decode.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> sae = SAEWeights(torch.eye(4), torch.zeros(4), 2 * torch.eye(4), torch.zeros(4))
            >>> part = sae.restrict([3, 1])
            >>> part.d_sae, part.encode(torch.tensor([1.0, 2.0, 3.0, 4.0])), part.W_dec[0]
            (2, tensor([4., 2.]), tensor([0., 0., 0., 2.]))
        """
        idx = self._indices(latents)
        pick: dict[str, Any] = {n: (t[:, idx] if n == "W_enc" else t[idx]) for n, t in self.tensors().items()
                                if n in ("W_enc", "b_enc", "threshold", "b_mag", "r_mag", "W_dec")}
        if self.k is not None:
            pick["k"] = min(self.k, int(idx.numel()))
        return dataclasses.replace(self, **pick)

    def _activate(self, pre: Tensor, h: Tensor) -> Tensor:
        if self.architecture == "relu":
            return torch.relu(pre)
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if self.architecture == "topk":
            assert self.k is not None
            values, indices = torch.topk(pre, k=self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        assert self.r_mag is not None and self.b_mag is not None
        magnitude = torch.relu(h @ (self.W_enc * self.r_mag.exp()) + self.b_mag)
        return (pre > 0).to(pre.dtype) * magnitude

    def decode(self, f: Float[Tensor, "... d_sae"], x: Float[Tensor, "... d_in"] | None = None
               ) -> Float[Tensor, "... d_out"]:
        """``f @ W_dec + b_dec`` ``[..., d_out]``, plus ``x @ W_skip`` with a skip connection, scaled back by
        ``x``'s statistics where the SAE normalises its input. ``x`` (the input the latents came from) is
        needed only for those two; an SAE on ``attn.hook_z`` returns the flat ``[..., d_in]``.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> sae = SAEWeights(torch.eye(3), torch.zeros(3), 2 * torch.eye(3), torch.ones(3))
            >>> sae.decode(torch.tensor([1.0, 0.0, 0.5]))
            tensor([3., 1., 2.])
        """
        y = f.to(self.dtype) @ self.W_dec + self.b_dec
        if self.W_skip is not None:
            if x is None:
                raise InputError("expected the input x to decode with an SAE that has a skip connection "
                                 "(x @ W_skip is part of its output); call decode(f, x)")
            y = y + self._input(x) @ self.W_skip
        return self._norm_out(y, None if x is None else self._input(x))

    def reconstruct(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """``decode(encode(x), x)``: the autoencoder's reconstruction of ``x`` (a transcoder's prediction
        of its output site).

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> sae = SAEWeights(torch.eye(3), torch.zeros(3), torch.eye(3), torch.zeros(3))
            >>> sae.reconstruct(torch.tensor([1.0, -2.0, 0.5]))  # the ReLU drops the negative part
            tensor([1.0000, 0.0000, 0.5000])
        """
        return self.decode(self.encode(x), x)

    def error(self, x: Float[Tensor, "... d_in"], target: Float[Tensor, "... d_out"] | None = None
              ) -> Float[Tensor, "... d_out"]:
        """What the reconstruction misses: ``target - reconstruct(x)``, ``target`` defaulting to ``x``
        for an autoencoder (a transcoder needs the activations of the site it predicts).

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> sae = SAEWeights(torch.eye(3), torch.zeros(3), torch.eye(3), torch.zeros(3))
            >>> x = torch.tensor([1.0, -2.0, 0.5])
            >>> sae.error(x), torch.equal(sae.reconstruct(x) + sae.error(x), x)
            (tensor([ 0., -2.,  0.]), True)
        """
        if target is None:
            if self.transcoder:
                raise InputError("expected target= (the activations of the site a transcoder predicts) for its "
                                 "error term, found none")
            target = x
        y = self.reconstruct(x)
        if self.flatten_heads and target.shape[-1] != y.shape[-1]:
            target = target.flatten(-2)
        return target.to(self.dtype) - y
