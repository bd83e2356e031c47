"""SAE folders as sae-lens and sparsify write them, read into :class:`~steerkit.sae.SAEWeights` and written
back: safetensors and JSON only, never a pickle.

How it works
------------
*SAELens* (``cfg.json`` + ``sae_weights.safetensors``; sae-lens 6, and the flat ``cfg.json`` of sae-lens 5
and earlier): ``architecture`` ``standard`` (steerkit's ``relu``), ``jumprelu`` (BatchTopK SAEs are saved
so for inference), ``topk``, ``gated``, and the transcoders ``transcoder``, ``skip_transcoder``,
``jumprelu_transcoder``, ``jumprelu_skip_transcoder``. The site is the config's hook name
(``metadata.hook_name`` in sae-lens 6, ``hook_name`` / ``hook_point`` before), a transcoder's output
site ``metadata.hook_name_out``; TransformerLens names are steerkit's (:mod:`steerkit.hooks.names`), and
:func:`site_of_hook` maps the few that differ. On reading, as sae-lens's ``SAE.load_from_disk`` does: the
tensors are cast to the config's ``dtype``, ``log_threshold`` becomes ``threshold = exp(log_threshold)``,
``normalize_activations`` ``expected_average_only_in`` and ``covariance_whitening`` use the input as it
is (warned: their statistics are not in the folder), and a TopK SAE's ``rescale_acts_by_decoder_norm``
is folded into the weights (``W_dec / |W_dec|``, ``W_enc * |W_dec|``, ``b_enc * |W_dec|``: the same
activations).

*sparsify* (``cfg.json`` + ``sae.safetensors``, EleutherAI's ``SparseCoder.save_to_disk``): TopK SAEs
and transcoders, with an optional skip connection; ``encoder.weight`` ``[d_sae, d_in]`` is
``W_enc.T``. The folder is named after the module it hooks: ``layers.12`` (or GPT-2's ``h.12``) reads
``blocks.12.hook_resid_post`` (a transcoder: reads ``blocks.12.hook_resid_pre``, writes
``hook_resid_post``), ``layers.12.mlp`` writes ``blocks.12.hook_mlp_out`` (a transcoder: reads the MLP's
input ``blocks.12.mlp.hook_in``) and ``layers.12.self_attn`` ``blocks.12.hook_attn_out``
(:func:`sparsify_sites`); anything else needs ``site=``.

Every malformed folder (a missing file, an unreadable safetensors, a tensor missing or of the wrong
shape, an unknown architecture, a config field of the wrong type) raises :class:`SAEFormatError`
saying what was expected, what was found and what to do.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from steerkit.errors import HookNameError
from steerkit.hooks.names import BLOCK_HOOKS, parse
from steerkit.storage.documents import read_document
from steerkit.storage.files import atomic_folder

from .weights import SAEFormatError, SAEWeights

SAELENS_CONFIG, SAELENS_WEIGHTS = "cfg.json", "sae_weights.safetensors"
SPARSIFY_CONFIG, SPARSIFY_WEIGHTS = "cfg.json", "sae.safetensors"
FORMATS = ("saelens", "sparsify")
#: sae-lens's inference architectures steerkit reads -> (steerkit architecture, transcoder, skip connection)
SAELENS_ARCHITECTURES = {
    "standard": ("relu", False, False), "jumprelu": ("jumprelu", False, False), "topk": ("topk", False, False),
    "gated": ("gated", False, False), "transcoder": ("relu", True, False), "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False), "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
#: sae-lens's names of steerkit's dtypes (its cfg.json ``dtype``)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: TransformerLens hook kinds that are another name of a steerkit site (the TransformerBridge's aliases,
#: and HookedTransformer's ``hook_mlp_in``, a copy of ``hook_resid_mid`` that feeds the MLP)
TL_ALIASES = {"hook_in": "hook_resid_pre", "hook_out": "hook_resid_post", "attn.hook_out": "hook_attn_out",
              "mlp.hook_out": "hook_mlp_out", "ln2.hook_in": "hook_resid_mid", "hook_mlp_in": "hook_resid_mid"}
_ANY_LAYERS = 1 << 20  # a hook name is checked against a model later; here only its form
_MAX_CONFIG_BYTES = 16 << 20
_SPARSIFY_RE = re.compile(r"(?:layers|h)\.(0|[1-9][0-9]{0,5})(\.mlp|\.self_attn|\.attn)?\Z", re.ASCII)
_SAELENS_VERSION = "6.0.0"  # what a written cfg.json declares when its source did not say (6.x's layout)
#: the kinds of steerkit site that carry the residual stream's width (d_model)
D_MODEL_SITES = BLOCK_HOOKS + ("mlp.hook_in", "ln1.hook_normalized", "ln2.hook_normalized",
                               "ln_final.hook_normalized", "ln_final.hook_out")


@dataclasses.dataclass(frozen=True)
class SAEFolder:
    """What an SAE folder holds: the weights, the steerkit site it reads (``None``: the folder does not
    say), a transcoder's output site, the format and its ``cfg.json`` as read.

    Examples:
        >>> from steerkit.sae import SAEWeights, read_sae_folder, write_saelens
        >>> w = SAEWeights(torch.randn(64, 256), torch.zeros(256), torch.randn(256, 64), torch.zeros(64))
        >>> path = write_saelens(w, tmp_dir / "sae", site="blocks.2.hook_resid_post")
        >>> folder = read_sae_folder(path)
        >>> folder.format, folder.site, folder.weights == w, folder.config["architecture"]
        ('saelens', 'blocks.2.hook_resid_post', True, 'standard')
    """

    weights: SAEWeights
    format: str
    site: str | None
    output_site: str | None = None
    config: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- sites
def site_of_hook(name: Any, what: str = "hook name") -> str:
    """The steerkit site of a TransformerLens hook name (steerkit's own names pass unchanged, the aliases of
    :data:`TL_ALIASES` are mapped); :class:`SAEFormatError` for a name steerkit has no site for.

    Examples:
        >>> from steerkit.sae import site_of_hook
        >>> site_of_hook("blocks.6.hook_resid_pre"), site_of_hook("blocks.3.hook_mlp_in")
        ('blocks.6.hook_resid_pre', 'blocks.3.hook_resid_mid')
    """
    if isinstance(name, str):
        m = re.fullmatch(r"(blocks\.[0-9]+)\.(.+)", name, re.ASCII)
        if m and m.group(2) in TL_ALIASES:
            name = f"{m.group(1)}.{TL_ALIASES[m.group(2)]}"
    try:
        return parse(name, _ANY_LAYERS).name
    except HookNameError as e:
        raise SAEFormatError(f"expected the SAE's {what} to name a site steerkit has (docs/hook_names.md), "
                             f"found {name!r:.120} ({e}); pass site= with the steerkit hook name it reads") from None


def sparsify_sites(hookpoint: str, transcoder: bool) -> tuple[str, str | None]:
    """``(site, output_site)`` of a sparsify folder named ``hookpoint`` (see the module docstring);
    :class:`SAEFormatError` where the name says no steerkit site.

    Examples:
        >>> from steerkit.sae import sparsify_sites
        >>> sparsify_sites("layers.12", transcoder=False), sparsify_sites("layers.12", transcoder=True)
        (('blocks.12.hook_resid_post', None), ('blocks.12.hook_resid_pre', 'blocks.12.hook_resid_post'))
        >>> sparsify_sites("layers.3.mlp", transcoder=False), sparsify_sites("layers.3.mlp", transcoder=True)
        (('blocks.3.hook_mlp_out', None), ('blocks.3.mlp.hook_in', 'blocks.3.hook_mlp_out'))
    """
    m = _SPARSIFY_RE.fullmatch(hookpoint)
    hint = ("pass site= (and output_site= for a transcoder) with the steerkit hook names it reads and writes "
            "(docs/hook_names.md)")
    if not m:
        raise SAEFormatError(f"expected a sparsify folder named after its hookpoint ('layers.12', 'layers.12.mlp', "
                             f"'layers.12.self_attn'), found {hookpoint!r:.120}; {hint}")
    layer, module = m.group(1), m.group(2)
    if module is None:
        return ((f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.hook_resid_post") if transcoder
                else (f"blocks.{layer}.hook_resid_post", None))
    if transcoder and module == ".mlp":  # it reads the MLP's input (after the norm's weight) and predicts its output
        return f"blocks.{layer}.mlp.hook_in", f"blocks.{layer}.hook_mlp_out"
    if transcoder:
        raise SAEFormatError(f"expected site= for a transcoder at {hookpoint!r}: it reads the attention module's "
                             f"input (after the norm's weight), which steerkit has no hook for; {hint}")
    return f"blocks.{layer}.{'hook_mlp_out' if module == '.mlp' else 'hook_attn_out'}", None


def tl_hook_name(site: str) -> str:
    """The TransformerLens hook name of a steerkit site (the same name: steerkit's sites carry TransformerLens's
    names), checked.

    Examples:
        >>> from steerkit.sae import tl_hook_name
        >>> tl_hook_name("blocks.12.attn.hook_z")
        'blocks.12.attn.hook_z'
    """
    return site_of_hook(site, "site")


# ---------------------------------------------------------------------------------------------- files
def _read_config(path: Path) -> dict:
    if not path.exists():
        raise SAEFormatError(f"expected an SAE config at {path}, found none; an SAE folder holds cfg.json beside its "
                             "safetensors")
    cfg = read_document(path, "JSON", fmt="json", max_bytes=_MAX_CONFIG_BYTES, error=SAEFormatError)
    if not isinstance(cfg, dict):
        raise SAEFormatError(f"expected a JSON object in {path}, found {type(cfg).__name__}")
    return cfg


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise SAEFormatError(f"expected the SAE's weights at {path}, found {'a folder' if path.exists() else 'none'}; "
                             "copy the whole SAE folder")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise SAEFormatError(f"expected a readable safetensors file at {path}, found an unreadable one ({e}); "
                             "download it again") from None


def _field(cfg: dict, key: str, kind: type, default: Any, where: Path) -> Any:
    v = cfg.get(key, default)
    ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is int)
    if v is not None and not ok:
        raise SAEFormatError(f"expected {key!r} in {where} to be {kind.__name__}, found {v!r:.80}")
    return v


def _expect(tensors: dict, required: set[str], optional: set[str], where: Path, arch: str) -> None:
    keys = set(tensors)
    missing, extra = sorted(required - keys), sorted(keys - required - optional)
    if missing or extra:
        raise SAEFormatError(f"expected tensors {sorted(required)} in a {arch} SAE ({where}), found {sorted(keys)[:20]}"
                             f"{'; missing ' + ', '.join(missing) if missing else ''}"
                             f"{'; unexpected ' + ', '.join(extra) if extra else ''}")


def _build(where: Path, **kw: Any) -> SAEWeights:
    """SAEWeights from a folder's tensors, shape errors naming the folder, every value checked finite."""
    try:
        w = SAEWeights(**kw)
    except SAEFormatError as e:
        raise SAEFormatError(f"{e} (in {where})") from None
    w.check_finite()
    return w


def detect_format(path: str | os.PathLike) -> str:
    """``"saelens"`` or ``"sparsify"``: which SAE folder ``path`` is, by the weights file it holds.

    Examples:
        >>> from steerkit.sae import SAEWeights, detect_format, write_sparsify
        >>> w = SAEWeights(torch.randn(8, 32), torch.zeros(32), torch.randn(32, 8), torch.zeros(8), architecture="topk", k=4)
        >>> detect_format(write_sparsify(w, tmp_dir / "layers.1"))
        'sparsify'
    """
    p = Path(path)
    if not p.is_dir():
        raise SAEFormatError(f"expected an SAE folder (sae-lens: cfg.json + {SAELENS_WEIGHTS}; sparsify: cfg.json + "
                             f"{SPARSIFY_WEIGHTS}) at {p}, found {'a file' if p.exists() else 'nothing'}")
    if (p / SAELENS_WEIGHTS).exists():
        return "saelens"
    if (p / SPARSIFY_WEIGHTS).exists():
        return "sparsify"
    found = sorted(q.name for q in p.iterdir())[:10]
    raise SAEFormatError(f"expected {SAELENS_WEIGHTS} (sae-lens) or {SPARSIFY_WEIGHTS} (sparsify) in {p}, found "
                         f"{found or 'an empty folder'}; point at the folder that holds one SAE")


def read_sae_folder(path: str | os.PathLike, *, site: str | None = None,
                    output_site: str | None = None) -> SAEFolder:
    """Read a sae-lens or a sparsify folder (:func:`detect_format`); ``site`` / ``output_site`` replace
    what the folder says.

    Examples:
        >>> from steerkit.sae import SAEWeights, read_sae_folder, write_sparsify
        >>> w = SAEWeights(torch.randn(8, 32), torch.zeros(32), torch.randn(32, 8), torch.zeros(8), architecture="topk", k=4)
        >>> path = write_sparsify(w, tmp_dir / "layers.1")
        >>> read_sae_folder(path).site, read_sae_folder(path, site="blocks.1.hook_resid_pre").site
        ('blocks.1.hook_resid_post', 'blocks.1.hook_resid_pre')
    """
    fmt = detect_format(path)
    folder = read_saelens(path) if fmt == "saelens" else read_sparsify(path, site=site, output_site=output_site)
    if site is not None or output_site is not None:
        folder = dataclasses.replace(folder, site=site_of_hook(site, "site") if site is not None else folder.site,
                                     output_site=(site_of_hook(output_site, "output site") if output_site is not None
                                                  else folder.output_site))
    if folder.site is None:
        raise SAEFormatError(f"expected the SAE folder {path} to name the hook it reads, found none; pass site= "
                             "with the steerkit hook name (docs/hook_names.md)")
    if folder.weights.transcoder and folder.output_site is None:
        raise SAEFormatError(f"expected the transcoder in {path} to name the hook it writes, found none; pass "
                             "output_site=")
    return folder


# ---------------------------------------------------------------------------------------------- sae-lens
def _saelens_normalization(cfg: dict, where: Path) -> str:
    norm = cfg.get("normalize_activations", "none")
    if isinstance(norm, bool) or norm is None:  # sae-lens 5 and earlier: a flag
        norm = "expected_average_only_in" if norm else "none"
    if norm in ("expected_average_only_in", "covariance_whitening"):
        warnings.warn(f"{where}: normalize_activations={norm!r} needs statistics the folder does not hold; the "
                      "input is used as it is, as sae-lens's SAE.load_from_disk does", stacklevel=4)
        return "none"
    if norm not in ("none", "layer_norm", "constant_norm_rescale"):
        raise SAEFormatError(f"expected normalize_activations in ('none', 'layer_norm', 'constant_norm_rescale', "
                             f"'expected_average_only_in', 'covariance_whitening') in {where}, found {norm!r:.80}")
    return norm


def _saelens_architecture(cfg: dict, where: Path) -> tuple[str, int | None]:
    arch = _field(cfg, "architecture", str, "standard", where)
    act = cfg.get("activation_fn", cfg.get("activation_fn_str"))
    kwargs: dict = cfg["activation_fn_kwargs"] if isinstance(cfg.get("activation_fn_kwargs"), dict) else {}
    k = cfg.get("k")
    if "metadata" not in cfg and act == "topk" and kwargs.get("k") is not None:  # sae-lens 5
        arch, k = "topk", kwargs["k"]
    elif "metadata" not in cfg and arch == "standard" and act not in (None, "relu"):
        raise SAEFormatError(f"expected a ReLU activation in the sae-lens 5 config {where}, found "
                             f"activation_fn={act!r:.40}; steerkit reads ReLU, JumpReLU, TopK and gated SAEs")
    if arch in ("batchtopk", "matryoshka_batchtopk"):
        raise SAEFormatError(f"expected an inference SAE in {where}, found a {arch} training checkpoint; save it "
                             "with sae-lens's save_inference_model (a BatchTopK SAE runs at inference as JumpReLU)")
    if arch not in SAELENS_ARCHITECTURES:
        raise SAEFormatError(f"expected a sae-lens architecture in {sorted(SAELENS_ARCHITECTURES)} in {where}, found "
                             f"{arch!r:.60}; steerkit reads ReLU, JumpReLU, TopK and gated SAEs and transcoders")
    if arch == "topk" and (isinstance(k, bool) or not isinstance(k, int)):
        raise SAEFormatError(f"expected an integer k for the TopK SAE in {where}, found {k!r:.40}")
    return arch, k if arch == "topk" else None


def _saelens_tensors(tensors: dict, cfg: dict, where: Path) -> dict[str, torch.Tensor]:
    """The folder's state dict as sae-lens's loader leaves it: cast to cfg's dtype, ``log_threshold`` and
    an all-ones ``scaling_factor`` resolved."""
    dtype_name = cfg.get("dtype", "float32")
    dtype = DTYPES.get(str(dtype_name).removeprefix("torch."))
    if dtype is None:
        raise SAEFormatError(f"expected dtype in {sorted(DTYPES)} in {where}, found {dtype_name!r:.40}")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise SAEFormatError(f"expected floating-point SAE tensors in {where}, found {name} as {t.dtype}")
    tensors = {n: t.to(dtype) for n, t in tensors.items()}
    if "log_threshold" in tensors:
        tensors["threshold"] = torch.exp(tensors.pop("log_threshold"))
    if "scaling_factor" in tensors:
        sf = tensors.pop("scaling_factor")
        if not bool((sf == 1).all()):
            raise SAEFormatError(f"expected no finetuning scaling_factor other than ones in {where}, found one; "
                                 "sae-lens 6 no longer applies it: fold it into W_dec (W_dec * scaling_factor[:, None]) "
                                 "with sae-lens 5 first")
    return tensors


def read_saelens(path: str | os.PathLike) -> SAEFolder:
    """Read a sae-lens folder (``cfg.json`` + ``sae_weights.safetensors``); see the module docstring.

    Examples:
        >>> from steerkit.sae import SAEWeights, read_saelens, write_saelens
        >>> w = SAEWeights(torch.randn(64, 256), torch.zeros(256), torch.randn(256, 64), torch.zeros(64),
        ...                architecture="jumprelu", threshold=torch.full((256,), 0.1))
        >>> folder = read_saelens(write_saelens(w, tmp_dir / "sae", site="blocks.1.hook_mlp_out"))
        >>> folder.weights.architecture, folder.site, folder.config["metadata"]["hook_name"]
        ('jumprelu', 'blocks.1.hook_mlp_out', 'blocks.1.hook_mlp_out')
    """
    p = Path(path)
    where = p / SAELENS_CONFIG
    cfg = _read_config(where)
    meta = cfg.get("metadata") if "metadata" in cfg else cfg  # sae-lens 5 keeps the hook beside the weights' fields
    if not isinstance(meta, dict):
        raise SAEFormatError(f"expected 'metadata' in {where} to be an object, found {type(meta).__name__}")
    arch, k = _saelens_architecture(cfg, where)
    steer_arch, transcoder, skip = SAELENS_ARCHITECTURES[arch]
    if meta.get("hook_head_index", meta.get("hook_point_head_index")) is not None:
        raise SAEFormatError(f"expected an SAE on whole activations in {where}, found one on a single head "
                             "(hook_head_index); steerkit reads SAEs of every head at once (attn.hook_z)")
    hook = meta.get("hook_name", meta.get("hook_point"))
    site = None if hook is None else site_of_hook(hook, f"hook_name in {where}")
    hook_out = meta.get("hook_name_out")
    output_site = None if hook_out is None else site_of_hook(hook_out, f"hook_name_out in {where}")
    tensors = _saelens_tensors(_read_tensors(p / SAELENS_WEIGHTS), cfg, where)
    gates = {"b_gate", "b_mag", "r_mag"}
    required = {"W_enc", "W_dec", "b_dec"} | (gates if arch == "gated" else {"b_enc"})
    required |= {"threshold"} if steer_arch == "jumprelu" else set()
    required |= {"W_skip"} if skip else set()
    _expect(tensors, required, set(), where, arch)
    rescale = _field(cfg, "rescale_acts_by_decoder_norm", bool, False, where) if arch == "topk" else False
    apply_b_dec = _field(cfg, "apply_b_dec_to_input", bool, not transcoder, where)
    w = tensors.get("W_skip")
    weights = _build(where, W_enc=tensors["W_enc"], b_enc=tensors["b_gate" if arch == "gated" else "b_enc"],
                     W_dec=tensors["W_dec"], b_dec=tensors["b_dec"], architecture=steer_arch, k=k,
                     threshold=tensors.get("threshold"), b_mag=tensors.get("b_mag"), r_mag=tensors.get("r_mag"),
                     W_skip=None if w is None else w.T, apply_b_dec_to_input=apply_b_dec,
                     normalize_activations=_saelens_normalization(cfg, where),
                     flatten_heads=cfg.get("reshape_activations", "hook_z" if "hook_z" in str(hook) else "none") == "hook_z",
                     transcoder=transcoder)
    for key, want in (("d_in", weights.d_in), ("d_sae", weights.d_sae), ("d_out", weights.d_out)):
        got = _field(cfg, key, int, want, where)
        if got != want:
            raise SAEFormatError(f"expected {key}={got} (from {where}) to match the weights, found {key}={want} in "
                                 f"{SAELENS_WEIGHTS}; the config and the weights do not belong together")
    if rescale:
        weights = _fold_decoder_norm(weights, where)
    return SAEFolder(weights, "saelens", site, output_site, cfg)


def _fold_decoder_norm(w: SAEWeights, where: Path) -> SAEWeights:
    """A TopK SAE trained with ``rescale_acts_by_decoder_norm``, as plain weights with the same activations."""
    n = w.W_dec.norm(dim=-1)
    if not bool((n > 0).all()):
        raise SAEFormatError(f"expected nonzero decoder rows in the TopK SAE of {where} (rescale_acts_by_decoder_norm "
                             "divides by their norms), found a zero row")
    return dataclasses.replace(w, W_enc=w.W_enc * n, b_enc=w.b_enc * n, W_dec=w.W_dec / n[:, None])


# ---------------------------------------------------------------------------------------------- sparsify
def read_sparsify(path: str | os.PathLike, *, site: str | None = None,
                  output_site: str | None = None) -> SAEFolder:
    """Read a sparsify folder (``cfg.json`` + ``sae.safetensors``); the site comes from the folder's name
    (:func:`sparsify_sites`) unless ``site`` is given.

    Examples:
        >>> from steerkit.sae import SAEWeights, read_sparsify, write_sparsify
        >>> w = SAEWeights(torch.randn(8, 32), torch.zeros(32), torch.randn(32, 8), torch.zeros(8), architecture="topk", k=4)
        >>> folder = read_sparsify(write_sparsify(w, tmp_dir / "layers.5"))
        >>> folder.site, folder.weights.k, folder.config["transcode"]
        ('blocks.5.hook_resid_post', 4, False)
    """
    p = Path(path)
    where = p / SPARSIFY_CONFIG
    cfg = _read_config(where)
    act = _field(cfg, "activation", str, "topk", where)
    if act != "topk":
        raise SAEFormatError(f"expected a TopK sparse coder in {where}, found activation={act!r:.40}; steerkit reads "
                             "sparsify's TopK SAEs and transcoders")
    d_in = _field(cfg, "d_in", int, None, where)
    k = _field(cfg, "k", int, 32, where)
    transcoder = bool(_field(cfg, "transcode", bool, False, where))
    skip = bool(_field(cfg, "skip_connection", bool, False, where))
    n_latents = _field(cfg, "num_latents", int, 0, where) or (d_in or 0) * _field(cfg, "expansion_factor", int, 32, where)
    tensors = _read_tensors(p / SPARSIFY_WEIGHTS)
    _expect(tensors, {"encoder.weight", "encoder.bias", "W_dec", "b_dec"} | ({"W_skip"} if skip else set()), set(),
            where, "sparsify TopK")
    enc = tensors["encoder.weight"]
    if d_in is None or tuple(enc.shape) != (n_latents, d_in):
        raise SAEFormatError(f"expected encoder.weight of shape [num_latents={n_latents}, d_in={d_in}] (from {where}), "
                             f"found {tuple(enc.shape)}; the config and the weights do not belong together")
    skip_w = tensors.get("W_skip")
    weights = _build(where, W_enc=enc.T, b_enc=tensors["encoder.bias"], W_dec=tensors["W_dec"], b_dec=tensors["b_dec"],
                     architecture="topk", k=k, W_skip=None if skip_w is None else skip_w.T,
                     apply_b_dec_to_input=not transcoder, transcoder=transcoder)
    try:
        found_site, found_out = sparsify_sites(p.resolve().name, transcoder)
    except SAEFormatError:
        if site is None:
            raise
        found_site, found_out = site, output_site
    return SAEFolder(weights, "sparsify", found_site, found_out, cfg)


# ---------------------------------------------------------------------------------------------- writing
def _with_b_dec_applied(w: SAEWeights, apply: bool) -> SAEWeights:
    """The same SAE with ``apply_b_dec_to_input`` set to ``apply``: ``b_dec @ W_enc`` moves into the encoder's
    biases (the same pre-activations, up to rounding)."""
    if w.apply_b_dec_to_input == apply:
        return w
    sign = 1.0 if apply else -1.0
    shift: dict[str, Any] = {"b_enc": w.b_enc + sign * (w.b_dec @ w.W_enc)}
    if w.b_mag is not None and w.r_mag is not None:
        shift["b_mag"] = w.b_mag + sign * (w.b_dec @ (w.W_enc * w.r_mag.exp()))
    return dataclasses.replace(w, apply_b_dec_to_input=apply, **shift)


def _saelens_name(w: SAEWeights) -> str:
    if not w.transcoder:
        if w.W_skip is not None:
            raise SAEFormatError("expected an autoencoder without a skip connection for sae-lens (only its "
                                 "transcoders have one), found W_skip; save it as format='steerkit' or 'sparsify'")
        return {"relu": "standard"}.get(w.architecture, w.architecture)
    if w.architecture not in ("relu", "jumprelu"):
        raise SAEFormatError(f"expected a ReLU or JumpReLU transcoder for sae-lens, found a {w.architecture} one; "
                             "save it as format='steerkit' (or 'sparsify' for TopK)")
    base = "" if w.architecture == "relu" else "jumprelu_"
    return f"{base}{'skip_' if w.W_skip is not None else ''}transcoder"


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}


def write_saelens(weights: SAEWeights, path: str | os.PathLike, *, site: str, output_site: str | None = None,
                  metadata: dict | None = None, overwrite: bool = False) -> Path:
    """Write ``weights`` as a sae-lens 6 folder (``cfg.json`` + ``sae_weights.safetensors``) that
    ``sae_lens.SAE.load_from_disk`` reads; ``metadata`` (sae-lens's ``metadata``: ``model_name`` ...) is
    kept, its ``hook_name`` / ``hook_name_out`` set from ``site`` / ``output_site``. The folder appears
    whole or not at all; an existing one is an error unless ``overwrite``.

    Examples:
        >>> from steerkit.sae import SAEWeights, write_saelens
        >>> w = SAEWeights(torch.randn(64, 256), torch.zeros(256), torch.randn(256, 64), torch.zeros(64))
        >>> path = write_saelens(w, tmp_dir / "sae", site="blocks.2.hook_resid_post", metadata={"model_name": "tiny"})
        >>> sorted(q.name for q in path.iterdir())
        ['cfg.json', 'sae_weights.safetensors']
    """
    arch = _saelens_name(weights)
    if weights.transcoder:
        weights = _with_b_dec_applied(weights, False)  # sae-lens's transcoders never subtract b_dec
        if output_site is None:
            raise SAEFormatError("expected output_site= for a transcoder (sae-lens's hook_name_out), found none")
    meta = {**(metadata or {}), "hook_name": tl_hook_name(site)}
    if output_site is not None:
        meta["hook_name_out"] = tl_hook_name(output_site)
    meta.setdefault("sae_lens_version", _SAELENS_VERSION)
    cfg: dict[str, Any] = {
        "architecture": arch, "d_in": weights.d_in, "d_sae": weights.d_sae,
        "dtype": next(n for n, d in DTYPES.items() if d == weights.dtype), "device": "cpu",
        "apply_b_dec_to_input": weights.apply_b_dec_to_input, "normalize_activations": weights.normalize_activations,
        "reshape_activations": "hook_z" if weights.flatten_heads else "none", "metadata": meta,
    }
    if weights.architecture == "topk":
        cfg.update(k=weights.k, rescale_acts_by_decoder_norm=False)
    if weights.transcoder:
        cfg["d_out"] = weights.d_out
    tensors = weights.tensors()
    if weights.architecture == "gated":
        tensors["b_gate"] = tensors.pop("b_enc")
    if weights.W_skip is not None:
        tensors["W_skip"] = weights.W_skip.T
    return _write_folder(path, SAELENS_WEIGHTS, _contiguous(tensors), cfg, overwrite)


def write_sparsify(weights: SAEWeights, path: str | os.PathLike, *, config: dict | None = None,
                   overwrite: bool = False) -> Path:
    """Write a TopK ``weights`` as a sparsify folder (``cfg.json`` + ``sae.safetensors``) that
    ``SparseCoder.load_from_disk`` reads; ``config`` (a sparsify ``cfg.json`` as read) keeps its training
    fields. Name the folder after the hookpoint (``layers.12``): sparsify finds SAEs by it.

    Examples:
        >>> from steerkit.sae import SAEWeights, write_sparsify
        >>> w = SAEWeights(torch.randn(8, 32), torch.zeros(32), torch.randn(32, 8), torch.zeros(8), architecture="topk", k=4)
        >>> path = write_sparsify(w, tmp_dir / "layers.1")
        >>> sorted(q.name for q in path.iterdir())
        ['cfg.json', 'sae.safetensors']
    """
    why = ("a TopK SAE" if weights.architecture != "topk" else
           "no input normalisation" if weights.normalize_activations != "none" else
           "flat inputs (no attn.hook_z heads)" if weights.flatten_heads else
           "d_out == d_in" if weights.d_out != weights.d_in else None)
    if why:
        raise SAEFormatError(f"expected {why} for sparsify, found a {weights.architecture} SAE with d_in={weights.d_in}, "
                             f"d_out={weights.d_out}, normalize_activations={weights.normalize_activations!r}; save it "
                             "as format='saelens' or 'steerkit'")
    weights = _with_b_dec_applied(weights, not weights.transcoder)  # sparsify's rule: autoencoders subtract b_dec
    base = {k: v for k, v in (config or {}).items() if k in ("expansion_factor", "normalize_decoder", "multi_topk")}
    cfg = {"activation": "topk", "expansion_factor": max(1, weights.d_sae // weights.d_in), "normalize_decoder": True,
           "multi_topk": False, **base, "num_latents": weights.d_sae, "k": weights.k,
           "skip_connection": weights.W_skip is not None, "transcode": weights.transcoder, "d_in": weights.d_in}
    tensors = {"encoder.weight": weights.W_enc.T, "encoder.bias": weights.b_enc, "W_dec": weights.W_dec,
               "b_dec": weights.b_dec}
    if weights.W_skip is not None:
        tensors["W_skip"] = weights.W_skip.T
    return _write_folder(path, SPARSIFY_WEIGHTS, _contiguous(tensors), cfg, overwrite)


def _write_folder(path: str | os.PathLike, weights_file: str, tensors: dict[str, torch.Tensor], cfg: dict,
                  overwrite: bool) -> Path:
    for name, t in tensors.items():
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise SAEFormatError(f"expected finite SAE weights to write, found NaN or infinity in {name}")
    try:
        text = json.dumps(cfg, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise SAEFormatError(f"expected the SAE's config and metadata as finite JSON values, found: {e}") from None
    p = Path(path)
    with atomic_folder(p, if_exists="replace" if overwrite else "error") as tmp:
        save_file(tensors, str(tmp / weights_file))
        (tmp / "cfg.json").write_text(text, encoding="utf-8")
    return p

