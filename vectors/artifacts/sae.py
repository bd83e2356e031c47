"""The stored sparse autoencoder: :class:`SAE`, an SAE's (or a transcoder's) weights
(:class:`steerkit.sae.SAEWeights`, whose torch code encodes and decodes) placed at a hook site with a
provenance. It loads from sae-lens and sparsify folders (:func:`steerkit.load_sae`), saves back to both
and to steerkit's own file, and lives in the store like every artifact (safetensors, never a pickle).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, ClassVar, Sequence

from jaxtyping import Float
from torch import Tensor

from steerkit.hooks.names import parse
from steerkit.interventions import ModelFacts
from steerkit.sae import D_MODEL_SITES, SAEFormatError, SAEWeights, site_of_hook, write_saelens, write_sparsify
from steerkit.sae.weights import TENSOR_NAMES
from steerkit.storage.files import atomic_write_bytes

from ..apply import check_against, facts_of
from ..errors import ArtifactFormatError, ModelMismatchError, VectorsError
from ..provenance import Provenance
from ..safety import check_output_file
from .base import _Artifact, _expect_keys, _fields, _str_field, payload_file_bytes

#: where :meth:`SAE.save` writes: steerkit's one-file artifact, a sae-lens folder, a sparsify folder
SAE_SAVE_FORMATS = ("steerkit", "saelens", "sparsify")
_OPTION_TYPES: dict[str, tuple[type, ...]] = {
    "architecture": (str,), "k": (int, type(None)), "apply_b_dec_to_input": (bool,), "normalize_activations": (str,),
    "flatten_heads": (bool,), "transcoder": (bool,)}


def _facts(model: Any) -> ModelFacts:
    if isinstance(model, ModelFacts):
        return model
    if isinstance(model, dict):
        return ModelFacts.from_dict(model)
    return facts_of(model)


@dataclasses.dataclass(eq=False)
class SAE(_Artifact):
    """A sparse autoencoder (or transcoder) at a hook site: ``weights`` (:class:`steerkit.sae.SAEWeights`)
    read ``site`` (a hook name such as ``blocks.12.hook_resid_post``); a transcoder's reconstruction
    belongs at ``output_site``. :meth:`encode`, :meth:`decode`, :meth:`reconstruct` and :meth:`error` are
    the weights' (steerkit's own torch code); :meth:`check` checks it against a model, :meth:`save` writes
    it as a steerkit file, a sae-lens folder or a sparsify folder.

    Examples:
        >>> from steerkit.sae import SAEWeights
        >>> from steerkit.vectors import SAE, Provenance
        >>> g = torch.Generator().manual_seed(0)
        >>> W = torch.randn(64, 256, generator=g) / 8
        >>> sae = SAE(SAEWeights(W, torch.zeros(256), W.T.clone(), torch.zeros(64), architecture="topk", k=8),
        ...           site="blocks.2.hook_resid_post", provenance=Provenance.from_model(tiny))
        >>> sae.d_sae, sae.layer, sae.site, sae.check(tiny)
        (256, 2, 'blocks.2.hook_resid_post', [])
        >>> x = torch.randn(5, 64, generator=g)
        >>> (sae.encode(x) != 0).sum(-1).tolist()
        [8, 8, 8, 8, 8]
        >>> store.save("sae", sae), store.load("sae@1") == sae
        ('sae@1', True)
    """

    weights: SAEWeights
    site: str
    output_site: str | None = None
    provenance: Provenance = dataclasses.field(default_factory=lambda: Provenance(operation="encode"))
    kind: ClassVar[str] = "sae"

    def __post_init__(self) -> None:
        if not isinstance(self.weights, SAEWeights):
            raise VectorsError(f"expected weights as a steerkit.sae.SAEWeights, found {type(self.weights).__name__}; "
                               "read a folder with steerkit.load_sae")
        self.site = site_of_hook(self.site, "site")
        if self.output_site is not None:
            self.output_site = site_of_hook(self.output_site, "output site")
        if self.weights.transcoder != (self.output_site is not None):
            raise VectorsError(f"expected output_site exactly for a transcoder, found transcoder="
                               f"{self.weights.transcoder} with output_site={self.output_site!r}; a transcoder "
                               "names the site it predicts, an autoencoder writes where it reads")
        kind = parse(self.site, 1 << 20).kind
        prov = self.provenance.replace(hook_site=kind, operation="encode")
        if kind in D_MODEL_SITES:
            if prov.d_model is None:
                prov = prov.replace(d_model=self.weights.d_in)
            elif prov.d_model != self.weights.d_in:
                raise ModelMismatchError(f"expected an SAE at {self.site} to read d_model={prov.d_model} (from the "
                                         f"provenance), found d_in={self.weights.d_in}; it does not belong to that model")
        layer = self.layer
        if prov.n_layers is not None and layer is not None and layer >= prov.n_layers:
            raise ModelMismatchError(f"expected the SAE's layer below n_layers={prov.n_layers}, found {self.site}")
        self.provenance = prov

    # ---- what it is
    @property
    def layer(self) -> int | None:
        """The block whose hook the SAE reads (``None`` at the final norm)."""
        return parse(self.site, 1 << 20).layer

    @property
    def layers(self) -> list[int]:
        return [] if self.layer is None else [self.layer]

    @property
    def d_in(self) -> int:
        return self.weights.d_in

    @property
    def d_sae(self) -> int:
        """The number of latents."""
        return self.weights.d_sae

    @property
    def d_out(self) -> int:
        return self.weights.d_out

    @property
    def architecture(self) -> str:
        return self.weights.architecture

    @property
    def d_model(self) -> int:
        """The model's residual width where known (the provenance's), else 0."""
        return self.provenance.d_model or 0

    def summary(self) -> dict:
        return {**super().summary(), "site": self.site, "output_site": self.output_site, "d_sae": self.d_sae,
                "architecture": self.architecture}

    # ---- inference: the weights' own
    def encode(self, x: Float[Tensor, "... d_in"], latents: Sequence[int] | Tensor | None = None
               ) -> Float[Tensor, "... n"]:
        """:meth:`steerkit.sae.SAEWeights.encode`: the latents' activations ``[..., d_sae]`` (``[..., len(latents)]``).

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE
            >>> sae = SAE(SAEWeights(torch.eye(4), torch.zeros(4), torch.eye(4), torch.zeros(4)), "blocks.0.hook_resid_post")
            >>> sae.encode(torch.tensor([1.0, -1.0, 2.0, 0.0]), latents=[2])
            tensor([2.])
        """
        return self.weights.encode(x, latents)

    def decode(self, f: Float[Tensor, "... d_sae"], x: Float[Tensor, "... d_in"] | None = None
               ) -> Float[Tensor, "... d_out"]:
        """:meth:`steerkit.sae.SAEWeights.decode`: ``f @ W_dec + b_dec`` (``x``: the input the latents came
        from, needed by a skip connection or an input normalisation).

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE
            >>> sae = SAE(SAEWeights(torch.eye(2), torch.zeros(2), torch.eye(2), torch.ones(2)), "blocks.0.hook_resid_post")
            >>> sae.decode(torch.tensor([2.0, 0.0]))
            tensor([3., 1.])
        """
        return self.weights.decode(f, x)

    def reconstruct(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """:meth:`steerkit.sae.SAEWeights.reconstruct`: ``decode(encode(x), x)``.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE
            >>> sae = SAE(SAEWeights(torch.eye(2), torch.zeros(2), torch.eye(2), torch.zeros(2)), "blocks.0.hook_resid_post")
            >>> sae.reconstruct(torch.tensor([2.0, -1.0]))
            tensor([2., 0.])
        """
        return self.weights.reconstruct(x)

    def error(self, x: Float[Tensor, "... d_in"], target: Float[Tensor, "... d_out"] | None = None
              ) -> Float[Tensor, "... d_out"]:
        """:meth:`steerkit.sae.SAEWeights.error`: what the reconstruction misses (``x == reconstruct(x) + error(x)``).

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE
            >>> sae = SAE(SAEWeights(torch.eye(2), torch.zeros(2), torch.eye(2), torch.zeros(2)), "blocks.0.hook_resid_post")
            >>> sae.error(torch.tensor([2.0, -1.0]))
            tensor([ 0., -1.])
        """
        return self.weights.error(x, target)

    # ---- against a model
    def check(self, model: Any, *, override: bool = False) -> list[str]:
        """Check the SAE against ``model`` (a SteerModel, a Hugging Face model, :class:`steerkit.ModelFacts` or
        their dict): its sites exist there (:class:`ModelMismatchError` otherwise), the widths it reads and
        writes are the sites' (never overridable), and the model's depth and fingerprint are the
        provenance's (``override=True`` turns those into warnings). Returns the notes also issued as warnings.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE, ModelMismatchError
            >>> w = SAEWeights(torch.randn(128, 512), torch.zeros(512), torch.randn(512, 128), torch.zeros(128))
            >>> sae = SAE(w, "blocks.1.mlp.hook_post", provenance=Provenance.from_model(tiny))
            >>> sae.check(tiny)  # tiny's MLP is 128 wide
            []
            >>> try:
            ...     SAE(w, "blocks.1.hook_resid_post").check(tiny)
            ... except ModelMismatchError as e:
            ...     print(str(e)[:62])
            expected an SAE at blocks.1.hook_resid_post to read 64 feature
        """
        facts = _facts(model)
        for site, width, what in ((self.site, self.d_in, "read"), (self.output_site, self.d_out, "write")):
            if site is None:
                continue
            try:
                s = parse(site, facts.n_layers, has_resid_mid=facts.has_resid_mid)
            except (KeyError, ValueError) as e:  # HookNameError, InputError
                raise ModelMismatchError(f"expected the SAE's {site} to exist on {facts.name!r}, found: {e}") from None
            want = facts.width(s.kind, site)
            if want != width:
                raise ModelMismatchError(f"expected an SAE at {site} to {what} {want} features on {facts.name!r}, "
                                         f"found {width}; it was made for another model or another site (not even "
                                         "override=True applies it)")
        view = self if self.provenance.d_model is not None else dataclasses.replace(
            self, provenance=self.provenance.replace(d_model=facts.d_model))
        return check_against(view, facts, override=override, stacklevel=3)

    # ---- files
    def save(self, path: str | os.PathLike, format: str = "steerkit", *, overwrite: bool = False) -> Path:
        """Write the SAE: ``"steerkit"`` -- one safetensors file (``steerkit.load_sae`` and the store read it
        back exactly); ``"saelens"`` -- a folder ``sae_lens.SAE.load_from_disk`` reads; ``"sparsify"`` -- a
        folder ``SparseCoder.load_from_disk`` reads (TopK only; name it after the hookpoint, ``layers.12``).
        A folder appears whole or not at all; an existing one is an error unless ``overwrite``.

        Examples:
            >>> from steerkit.sae import SAEWeights
            >>> from steerkit.vectors import SAE
            >>> w = SAEWeights(torch.randn(64, 256), torch.zeros(256), torch.randn(256, 64), torch.zeros(64), architecture="topk", k=8)
            >>> sae = SAE(w, "blocks.3.hook_resid_post")
            >>> [sae.save(tmp_dir / name, fmt).name for name, fmt in
            ...  [("sae.safetensors", "steerkit"), ("sae-lens", "saelens"), ("layers.3", "sparsify")]]
            ['sae.safetensors', 'sae-lens', 'layers.3']
            >>> steerkit.load_sae(tmp_dir / "layers.3").weights == w
            True
        """
        if format not in SAE_SAVE_FORMATS:
            raise VectorsError(f"expected format in {SAE_SAVE_FORMATS}, found {format!r}")
        source = self.provenance.method_params.get("format")
        config = self.provenance.method_params.get("config")
        config = config if isinstance(config, dict) and source == format else {}
        if format == "saelens":
            meta = dict(config.get("metadata") or {}) if isinstance(config.get("metadata"), dict) else {}
            if self.provenance.model_name:
                meta.setdefault("model_name", self.provenance.model_name)
            return write_saelens(self.weights, path, site=self.site, output_site=self.output_site, metadata=meta,
                                 overwrite=overwrite)
        if format == "sparsify":
            return write_sparsify(self.weights, path, config=config, overwrite=overwrite)
        p = check_output_file(path, "SAE file")
        if p.exists() and not overwrite:
            raise VectorsError(f"expected no file at {p}, found one; pass overwrite=True to replace it")
        atomic_write_bytes(p, payload_file_bytes(*self.to_payload()))
        return p

    # ---- payload
    def _map_tensors(self, fn) -> "SAE":
        return dataclasses.replace(self, weights=self.weights.map_tensors(fn))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SAE):
            return NotImplemented
        return (self.weights == other.weights and (self.site, self.output_site) == (other.site, other.output_site)
                and self.provenance == other.provenance)

    __hash__ = None  # type: ignore[assignment]

    def to_payload(self) -> tuple[dict[str, Tensor], dict]:
        tensors = {n: t.detach().cpu().contiguous() for n, t in self.weights.tensors().items()}
        fields = {"site": self.site, "output_site": self.output_site, "weights": self.weights.options()}
        return tensors, {"kind": self.kind, "fields": fields, "provenance": self.provenance.to_dict()}

    @classmethod
    def from_payload(cls, tensors: dict[str, Tensor], meta: dict) -> "SAE":
        fields = _fields(meta, cls.kind)
        _expect_keys(tensors, set(TENSOR_NAMES[:4]), set(TENSOR_NAMES[4:]), cls.kind)
        options = fields.get("weights")
        if not isinstance(options, dict) or set(options) != set(_OPTION_TYPES):
            raise ArtifactFormatError(f"expected the SAE's weight options {sorted(_OPTION_TYPES)}, found "
                                      f"{sorted(options) if isinstance(options, dict) else type(options).__name__}")
        for key, types in _OPTION_TYPES.items():
            v = options[key]
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                raise ArtifactFormatError(f"expected the SAE's {key} as {' or '.join(t.__name__ for t in types)}, "
                                          f"found {v!r:.80}")
        out = fields.get("output_site")
        if out is not None and not isinstance(out, str):
            raise ArtifactFormatError(f"expected the SAE's output_site as a string, found {out!r:.80}")
        try:
            parts: dict[str, Any] = {**tensors, **options}
            weights = SAEWeights(**parts)
            weights.check_finite()
        except SAEFormatError as e:
            raise ArtifactFormatError(f"expected a valid SAE payload, found: {e}") from None
        return cls(weights, _str_field(fields, "site", ""), out, provenance=Provenance.from_dict(meta.get("provenance", {})))
