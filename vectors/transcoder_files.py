"""Loading transcoders: :func:`load_transcoders` (``steerkit.load_transcoders``) reads the files people have into one
:class:`~steerkit.vectors.Transcoders`, and :func:`write_circuit_tracer` writes circuit-tracer's layout back.

What it reads
-------------
- **circuit-tracer's transcoder folders**: a ``config.yaml`` (``model_kind``: ``transcoder_set`` or
  ``cross_layer_transcoder``; ``feature_input_hook`` / ``feature_output_hook``, TransformerLens names such as
  ``mlp.hook_in`` / ``hook_mlp_out``, which are steerkit's; an optional ``scan``) beside

  * ``layer_{l}.safetensors`` as ``TranscoderSet.to_safetensors`` writes them (its cache folder): ``W_enc``
    ``[d_sae, d_model]``, ``W_dec``, ``b_enc``, ``b_dec``, ``activation_function.threshold`` for JumpReLU (none for
    ReLU) and an optional ``W_skip``; other files are ignored;
  * or, its Hub layout, a list ``transcoders:`` of per-layer files: ``hf://owner/repo/path`` URIs (downloaded
    through ``huggingface_hub``'s cache, which ``HF_HUB_OFFLINE=1`` reads only) or paths, relative to the folder
    of the config; the files are circuit-tracer's safetensors, GemmaScope's ``.npz`` (``W_enc`` ``[d_model, d_sae]``,
    ``threshold``) or GemmaScope 2's safetensors (``w_enc``, ``w_dec``, ``threshold``, optional
    ``affine_skip_connection``), read as circuit-tracer reads them;
  * or ``W_enc_{l}.safetensors`` (``W_enc_{l}``, ``b_enc_{l}``, ``b_dec_{l}``, optional ``threshold_{l}``) and
    ``W_dec_{l}.safetensors`` (``W_dec_{l}`` ``[d_sae, n_layers - l, d_model]``): its cross-layer transcoder's
    files (also without a ``config.yaml``, reading ``hook_resid_mid`` and writing ``hook_mlp_out`` as circuit-tracer
    assumes then).

  A layer whose file has no threshold is a ReLU, which is the JumpReLU with threshold 0: a set mixing the two
  is read as JumpReLU.
- **a Hub reference** ``owner/repo[/subfolder][@revision]``: that folder of the repository, downloaded (only the
  ``config.yaml`` and the weights) into ``huggingface_hub``'s cache; its ``scan`` is named as circuit-tracer
  names it, ``owner/repo[//subfolder][@revision]`` (what Neuronpedia's graphs of those transcoders carry).
- **sparsify and sae-lens transcoder folders**: a folder of one sub-folder per block, each what sparsify
  (``layers.{l}.mlp``: ``cfg.json`` + ``sae.safetensors``, a TopK transcoder with or without a skip connection,
  reading ``blocks.{l}.mlp.hook_in`` and writing ``blocks.{l}.hook_mlp_out``) or sae-lens (``cfg.json`` +
  ``sae_weights.safetensors``, a ``transcoder`` / ``skip_transcoder`` / ``jumprelu_transcoder`` /
  ``jumprelu_skip_transcoder``) writes, read by :func:`steerkit.sae.read_sae_folder`.
- **steerkit's own file** (:meth:`Transcoders.save`) and **a store reference** ``name@N``.

Every ``config.yaml`` and ``cfg.json`` goes through the one bounded reader of :mod:`steerkit.storage.documents`
(PyYAML's safe loader, no aliases, bounded size and depth); weights are safetensors (read with ``safetensors``,
its header validated by steerkit's bounded reader, each file's size checked first, and memory-mapped, so the rows no
prompt uses are never read) or ``.npz`` without pickles. Nothing runs code.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from huggingface_hub import hf_hub_download, snapshot_download
from torch import Tensor

from steerkit.errors import HookNameError
from steerkit.sae import SAEFormatError, read_sae_folder, site_of_hook
from steerkit.storage.documents import read_document

from .artifacts.transcoders import CIRCUIT_TRACER_CONFIG as _CONFIG
from .artifacts.transcoders import TRANSCODER_SITES, Transcoders
from .errors import ArtifactFormatError, UnsafeNameError, VectorsError
from .exports import import_artifact
from .provenance import Provenance
from .safety import MAX_FILE_BYTES, map_safetensors
from .sae_files import _model_provenance, of_kind, stored_artifact
from .store import Store

#: the largest single weights file read (the decoder of a large cross-layer transcoder is several GiB)
MAX_WEIGHTS_BYTES = 64 << 30
_MODEL_KINDS = ("transcoder_set", "cross_layer_transcoder")
_LAYER_FILE = re.compile(r"layer_(0|[1-9][0-9]{0,5})\.safetensors\Z", re.ASCII)
_ENC_FILE = re.compile(r"W_enc_(0|[1-9][0-9]{0,5})\.safetensors\Z", re.ASCII)
_HUB_REF = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)((?:/[A-Za-z0-9._-]+)*)(?:@([A-Za-z0-9._/-]+))?\Z",
                      re.ASCII)


# ---------------------------------------------------------------------------------------------- small helpers
def _kind(hook: Any, what: str, where: Any) -> str:
    """The steerkit kind of a circuit-tracer (TransformerLens) hook such as ``mlp.hook_in`` or ``mlp.hook_out``."""
    if not isinstance(hook, str):
        raise ArtifactFormatError(f"expected {what} in {where} as a hook name such as 'mlp.hook_in', found {hook!r:.80}")
    try:
        kind = site_of_hook(f"blocks.0.{hook}", what).split(".", 2)[2]
    except (SAEFormatError, HookNameError) as e:
        raise ArtifactFormatError(f"expected {what} in {where} to name a site steerkit has, found {hook!r:.80} ({e})") from None
    if kind not in TRANSCODER_SITES:
        raise ArtifactFormatError(f"expected {what} in {where} as one of {TRANSCODER_SITES}, found {hook!r:.80}")
    return kind


def _check_size(path: Path, max_bytes: int) -> None:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ArtifactFormatError(f"expected the transcoder weights at {path}, found none ({e.strerror}); copy the "
                                  "whole folder") from None
    if not path.is_file():
        raise ArtifactFormatError(f"expected a weights file at {path}, found a folder or something else")
    if size > max_bytes:
        raise ArtifactFormatError(f"expected at most {max_bytes} bytes in {path}, found {size}; raise max_bytes if "
                                  "you trust it")


def _read_weights(path: Path, max_bytes: int) -> dict[str, Tensor]:
    """The tensors of a safetensors file (validated and memory-mapped: :func:`steerkit.vectors.safety.map_safetensors`)
    or an ``.npz`` (no pickles), its size checked first."""
    _check_size(path, max_bytes)
    if path.suffix == ".npz":
        return _read_npz(path, max_bytes)
    try:  # memory-mapped: the decoder rows of the features a prompt never activates are never read
        return map_safetensors(path, "transcoder weights", max_bytes=max_bytes)
    except OSError as e:
        raise ArtifactFormatError(f"expected a readable safetensors file at {path}, found an unreadable one ({e}); "
                                  "download it again") from None


def _read_npz(path: Path, max_bytes: int) -> dict[str, Tensor]:
    """The float arrays of an ``.npz`` (a zip of ``.npy`` files): at most 64 of them, their unpacked sizes bounded,
    no object arrays (``allow_pickle=False``)."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if len(infos) > 64 or sum(i.file_size for i in infos) > max_bytes:
                raise ArtifactFormatError(f"expected at most 64 arrays of at most {max_bytes} bytes in {path}, found "
                                          f"{len(infos)} of {sum(i.file_size for i in infos)}")
            out = {}
            for info in infos:
                if not info.filename.endswith(".npy"):
                    raise ArtifactFormatError(f"expected only .npy arrays in {path}, found {info.filename!r:.80}")
                with z.open(info) as f:
                    arr = np.lib.format.read_array(f, allow_pickle=False)
                out[info.filename[:-4]] = torch.from_numpy(np.array(arr, dtype=np.float32))
            return out
    except (ValueError, OSError, KeyError, zipfile.BadZipFile) as e:
        raise ArtifactFormatError(f"expected an .npz of float arrays at {path}, found an unreadable one ({e})") from None


def _take(tensors: dict[str, Tensor], required: set[str], optional: set[str], where: Path) -> dict[str, Tensor]:
    keys = set(tensors)
    missing, extra = sorted(required - keys), sorted(keys - required - optional)
    if missing or extra:
        raise ArtifactFormatError(f"expected the tensors {sorted(required)} (optional {sorted(optional)}) in {where}, "
                                  f"found {sorted(keys)[:12]}; it is not circuit-tracer's transcoder layout")
    bad = [k for k, t in tensors.items() if not t.is_floating_point()]
    if bad:
        raise ArtifactFormatError(f"expected floating-point tensors in {where}, found {bad[0]} as {tensors[bad[0]].dtype}")
    return tensors


# ---------------------------------------------------------------------------------------------- circuit-tracer
def _layer_file(path: Path, max_bytes: int) -> dict[str, Tensor | None]:
    """One layer's weights in circuit-tracer's orientation, from its own, GemmaScope's or GemmaScope 2's files."""
    t = _read_weights(path, max_bytes)
    if path.suffix == ".npz":  # GemmaScope: W_enc [d_model, d_sae]
        t = _take(t, {"W_enc", "W_dec", "b_enc", "b_dec", "threshold"}, set(), path)
        return {"W_enc": t["W_enc"].T.contiguous(), "W_dec": t["W_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"],
                "threshold": t["threshold"], "W_skip": None}
    if "w_enc" in t:  # GemmaScope 2
        t = _take(t, {"w_enc", "w_dec", "b_enc", "b_dec", "threshold"}, {"affine_skip_connection"}, path)
        skip = t.get("affine_skip_connection")
        return {"W_enc": t["w_enc"].T.contiguous(), "W_dec": t["w_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"],
                "threshold": t["threshold"], "W_skip": None if skip is None else skip.T.contiguous()}
    t = _take(t, {"W_enc", "W_dec", "b_enc", "b_dec"}, {"activation_function.threshold", "W_skip"}, path)
    return {"W_enc": t["W_enc"], "W_dec": t["W_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"],
            "threshold": t.get("activation_function.threshold"), "W_skip": t.get("W_skip")}


def _assemble(layers: list[dict[str, Tensor | None]], *, input_hook: str, output_hook: str, scan: str | None,
              where: Path, cross_layer: bool = False) -> Transcoders:
    """:class:`Transcoders` from per-layer dicts; ReLU layers of a set with JumpReLU ones get threshold 0."""
    def col(name: str) -> list[Tensor]:
        return [layer[name] for layer in layers]  # type: ignore[misc]
    has_thr = [layer["threshold"] is not None for layer in layers]
    has_skip = [layer.get("W_skip") is not None for layer in layers]
    threshold = None
    if any(has_thr):
        threshold = [t if t is not None else torch.zeros_like(b) for t, b in zip(col("threshold"), col("b_enc"))]
    skip = None
    if any(has_skip):
        d = int(layers[0]["b_dec"].shape[0])  # type: ignore[union-attr]
        skip = [s if s is not None else torch.zeros(d, d, dtype=b.dtype) for s, b in zip(col("W_skip"), col("b_dec"))]
    dtypes = {t.dtype for layer in layers for t in layer.values() if t is not None}
    dtype = torch.float32 if len(dtypes) > 1 else dtypes.pop()

    def conv(ts: Any) -> Any:
        return None if ts is None else [t.to(dtype) for t in ts]
    try:
        return Transcoders(conv(col("W_enc")), conv(col("b_enc")), conv(col("W_dec")), conv(col("b_dec")),
                           activation="jumprelu" if threshold is not None else "relu", threshold=conv(threshold),
                           W_skip=conv(skip), input_hook=input_hook, output_hook=output_hook, cross_layer=cross_layer,
                           scan=scan, provenance=Provenance(method="imported:circuit-tracer", operation="encode"))
    except VectorsError as e:
        raise ArtifactFormatError(f"expected the transcoders in {where} to belong together, found: {e}") from None


def _hub_file(uri: str) -> Path:
    """A file named by an ``hf://owner/repo/path[?revision=...]`` URI, through huggingface_hub's cache."""
    m = re.fullmatch(r"hf://([^/]+/[^/?]+)/([^?]+)(?:\?revision=([^&]+))?", uri)
    if not m:
        raise ArtifactFormatError(f"expected an hf://owner/repo/path URI, found {uri!r:.200}")
    try:
        return Path(hf_hub_download(repo_id=m.group(1), filename=m.group(2), revision=m.group(3)))
    except Exception as e:  # huggingface_hub's many errors: offline, missing, gated
        raise ArtifactFormatError(f"expected to fetch {uri} from the Hub or its cache, found an error: {e}") from None


def _config(folder: Path) -> dict:
    cfg = read_document(folder / _CONFIG, "transcoder config", fmt="yaml", max_bytes=1 << 20,
                        error=ArtifactFormatError)
    if not isinstance(cfg, dict):
        raise ArtifactFormatError(f"expected a mapping in {folder / _CONFIG}, found {type(cfg).__name__}")
    kind = cfg.get("model_kind")
    if kind not in _MODEL_KINDS:
        raise ArtifactFormatError(f"expected model_kind in {_MODEL_KINDS} in {folder / _CONFIG}, found {kind!r:.80}")
    scan = cfg.get("scan")
    if scan is not None and not isinstance(scan, (str, list)):
        raise ArtifactFormatError(f"expected scan as a string in {folder / _CONFIG}, found {type(scan).__name__}")
    return cfg


def _numbered(folder: Path, pattern: re.Pattern) -> list[Path]:
    """The files of ``folder`` matching ``pattern`` (numbered from 0), in order; the numbers must run 0..n-1."""
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := pattern.match(p.name))}
    if sorted(found) != list(range(len(found))):
        raise ArtifactFormatError(f"expected files numbered 0..{len(found) - 1} in {folder} ({pattern.pattern}), found "
                                  f"{sorted(found)[:20]}; every block needs one")
    return [found[i] for i in range(len(found))]


def read_circuit_tracer(folder: str | os.PathLike, *, input_hook: str | None = None, output_hook: str | None = None,
                        max_bytes: int = MAX_WEIGHTS_BYTES) -> Transcoders:
    """Transcoders from one of circuit-tracer's folders (see the module docstring): its cache folder or Hub layout
    (``config.yaml``), or the bare files of a per-layer set or a cross-layer transcoder. ``input_hook`` /
    ``output_hook`` replace the config's hooks (circuit-tracer's TransformerLens names).

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> from steerkit.vectors.transcoder_files import read_circuit_tracer
        >>> tc = Transcoders([torch.randn(8, 64)] * 4, [torch.zeros(8)] * 4, [torch.randn(8, 64)] * 4,
        ...                  [torch.zeros(64)] * 4, scan="tiny-relu")
        >>> back = read_circuit_tracer(tc.save(tmp_dir / "tc", "circuit-tracer"))
        >>> back.activation, back.scan, back.W_enc[3].equal(tc.W_enc[3])
        ('relu', 'tiny-relu', True)
    """
    p = Path(folder)
    cfg = _config(p) if (p / _CONFIG).is_file() else {}
    enc_files = _numbered(p, _ENC_FILE) if cfg.get("model_kind") != "transcoder_set" else []
    cross = cfg.get("model_kind") == "cross_layer_transcoder" or (not cfg and bool(enc_files))
    default_in = "hook_resid_mid" if cross and not cfg else "mlp.hook_in"
    where = p / _CONFIG if cfg else p
    hooks: dict[str, Any] = {"input_hook": _kind(input_hook or cfg.get("feature_input_hook", default_in), "feature_input_hook", where),
             "output_hook": _kind(output_hook or cfg.get("feature_output_hook", "hook_mlp_out"), "feature_output_hook",
                                  where)}
    scan = cfg.get("scan")
    scan = "-".join(str(s) for s in scan) if isinstance(scan, list) else scan
    if cross:
        if not enc_files:
            raise ArtifactFormatError(f"expected W_enc_0.safetensors ... in {p} for a cross-layer transcoder, found none")
        layers = [_clt_layer(p, l, len(enc_files), max_bytes) for l in range(len(enc_files))]
        return _assemble(layers, scan=scan, where=p, cross_layer=True, **hooks)
    listed = cfg.get("transcoders")
    if listed is not None:
        if not isinstance(listed, list) or not listed or not all(isinstance(x, str) for x in listed):
            raise ArtifactFormatError(f"expected transcoders: as a list of file paths or hf:// URIs in {where}, found "
                                      f"{listed!r:.120}")
        files = [_hub_file(x) if x.startswith("hf://") else (p / x) for x in listed]
    else:
        files = _numbered(p, _LAYER_FILE)
        if not files:
            raise ArtifactFormatError(f"expected layer_0.safetensors ... (or a transcoders: list in {_CONFIG}) in {p}, "
                                      "found none; it is not a circuit-tracer transcoder folder")
    layers = [_layer_file(f, max_bytes) for f in files]
    return _assemble(layers, scan=scan, where=p, **hooks)


def _clt_layer(folder: Path, l: int, n: int, max_bytes: int) -> dict[str, Tensor | None]:
    enc = _read_weights(folder / f"W_enc_{l}.safetensors", max_bytes)
    enc = _take(enc, {f"W_enc_{l}", f"b_enc_{l}", f"b_dec_{l}"}, {f"threshold_{l}"}, folder / f"W_enc_{l}.safetensors")
    dec = _read_weights(folder / f"W_dec_{l}.safetensors", max_bytes)
    dec = _take(dec, {f"W_dec_{l}"}, set(), folder / f"W_dec_{l}.safetensors")
    W_dec = dec[f"W_dec_{l}"]
    if W_dec.ndim != 3 or int(W_dec.shape[1]) != n - l:
        raise ArtifactFormatError(f"expected W_dec_{l} of shape [d_sae, {n - l}, d_model] (block {l} of {n} writes every "
                                  f"block from {l} on), found {tuple(W_dec.shape)}")
    thr = enc.get(f"threshold_{l}")
    return {"W_enc": enc[f"W_enc_{l}"], "b_enc": enc[f"b_enc_{l}"], "b_dec": enc[f"b_dec_{l}"], "W_dec": W_dec,
            "threshold": None if thr is None else thr.reshape(-1), "W_skip": None}


def write_circuit_tracer(tc: Transcoders, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``tc`` in circuit-tracer's cache layout: ``tc.save(path, "circuit-tracer")``
    (:meth:`Transcoders.save <steerkit.vectors.Transcoders.save>`), which ``read_circuit_tracer`` and circuit-tracer's
    ``load_transcoders_from_cache`` read back.

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> from steerkit.vectors.transcoder_files import write_circuit_tracer
        >>> tc = Transcoders([torch.randn(8, 64)] * 4, [torch.zeros(8)] * 4, [torch.randn(8, 64)] * 4,
        ...                  [torch.zeros(64)] * 4)
        >>> print((write_circuit_tracer(tc, tmp_dir / "tc") / "config.yaml").read_text().strip())
        feature_input_hook: mlp.hook_in
        feature_output_hook: hook_mlp_out
        model_kind: transcoder_set
        scan: null
    """
    return tc.save(path, "circuit-tracer", overwrite=overwrite)


# ---------------------------------------------------------------------------------------------- sparsify / sae-lens
def read_sae_transcoders(folder: str | os.PathLike) -> Transcoders:
    """Transcoders from a folder of sparsify or sae-lens transcoder folders, one per block (each read by
    :func:`steerkit.sae.read_sae_folder`; their sites name the blocks).

    Examples:
        >>> from steerkit.sae import SAEWeights, write_sparsify
        >>> from steerkit.vectors.transcoder_files import read_sae_transcoders
        >>> for l in range(2):
        ...     w = SAEWeights(torch.randn(64, 32), torch.zeros(32), torch.randn(32, 64), torch.zeros(64),
        ...                    architecture="topk", k=4, transcoder=True, apply_b_dec_to_input=False)
        ...     _ = write_sparsify(w, tmp_dir / "tcs" / f"layers.{l}.mlp")
        >>> tc = read_sae_transcoders(tmp_dir / "tcs")
        >>> tc.n_layers, tc.activation, tc.k, tc.sites(1)
        (2, 'topk', 4, ('blocks.1.mlp.hook_in', 'blocks.1.hook_mlp_out'))
    """
    p = Path(folder)
    subs = sorted(s for s in p.iterdir() if s.is_dir() and (s / "cfg.json").is_file())
    if not subs:
        raise ArtifactFormatError(f"expected one sparsify or sae-lens transcoder folder per block in {p} (each with a "
                                  "cfg.json), found none")
    by_layer: dict[int, Any] = {}
    kinds = set()
    for s in subs:
        try:
            f = read_sae_folder(s)
        except SAEFormatError as e:
            raise ArtifactFormatError(f"expected a transcoder folder at {s}, found: {e}") from None
        if not f.weights.transcoder or f.output_site is None:
            raise ArtifactFormatError(f"expected a transcoder (it reads one site, writes another) at {s}, found an "
                                      "autoencoder")
        assert f.site is not None  # read_sae_folder names it or raises
        layer, in_kind = f.site.split(".", 2)[1:]
        out_layer, out_kind = f.output_site.split(".", 2)[1:]
        if out_layer != layer or int(layer) in by_layer:
            raise ArtifactFormatError(f"expected one transcoder per block, reading and writing the same block, found "
                                      f"{f.site} -> {f.output_site} at {s}")
        kinds.add((in_kind, out_kind, f.weights.architecture, f.weights.k))
        by_layer[int(layer)] = f.weights
    if len(kinds) != 1 or sorted(by_layer) != list(range(len(by_layer))):
        raise ArtifactFormatError(f"expected transcoders of one kind for blocks 0..{len(by_layer) - 1} in {p}, found "
                                  f"blocks {sorted(by_layer)[:20]} and kinds {sorted(map(str, kinds))[:4]}")
    in_kind, out_kind, arch, k = kinds.pop()
    if arch not in ("relu", "jumprelu", "topk") or in_kind not in TRANSCODER_SITES or out_kind not in TRANSCODER_SITES:
        raise ArtifactFormatError(f"expected ReLU, JumpReLU or TopK transcoders between sites of the residual stream's "
                                  f"width in {p}, found {arch} ones from {in_kind} to {out_kind}")
    layers = [by_layer[l] for l in range(len(by_layer))]
    return Transcoders(**_from_sae_weights(layers), activation=arch, k=k, input_hook=in_kind, output_hook=out_kind,
                       provenance=Provenance(method="imported:sae-folders", operation="encode"))


def _from_sae_weights(layers: list) -> dict[str, Any]:
    """circuit-tracer's orientation of :class:`steerkit.sae.SAEWeights`: ``b_dec`` folded out of the input, a
    JumpReLU's threshold at least 0 (where ``relu(pre) * (pre > t)`` is ``pre * (pre > t)``)."""
    out: dict[str, Any] = {"W_enc": [], "b_enc": [], "W_dec": [], "b_dec": [], "threshold": None, "W_skip": None}
    for w in layers:
        b_enc = w.b_enc - w.b_dec @ w.W_enc if w.apply_b_dec_to_input else w.b_enc
        out["W_enc"].append(w.W_enc.T.contiguous())
        out["b_enc"].append(b_enc)
        out["W_dec"].append(w.W_dec)
        out["b_dec"].append(w.b_dec)
        if w.threshold is not None:
            out["threshold"] = (out["threshold"] or []) + [w.threshold.clamp_min(0)]
        if w.W_skip is not None:
            out["W_skip"] = (out["W_skip"] or []) + [w.W_skip.T.contiguous()]
    return out


# ---------------------------------------------------------------------------------------------- the entry point
def _hub_folder(ref: str) -> tuple[Path, str]:
    """The local folder of a Hub reference ``owner/repo[/subfolder][@revision]`` (config and weights only) and its
    ``scan`` as circuit-tracer names it: ``owner/repo[//subfolder][@revision]``."""
    m = _HUB_REF.fullmatch(ref)
    if not m:
        raise VectorsError(f"expected a transcoder folder, a steerkit file, a store reference (name@N) or a Hub "
                           f"reference owner/repo[/subfolder][@revision], found {ref!r:.200}")
    repo, sub, rev = m.group(1), m.group(2).strip("/"), m.group(3)
    if ".." in sub.split("/"):
        raise UnsafeNameError(f"expected a Hub subfolder without '..', found {sub!r}")
    prefix = f"{sub}/" if sub else ""
    try:
        local = snapshot_download(repo, revision=rev, allow_patterns=[f"{prefix}{_CONFIG}", f"{prefix}*.safetensors",
                                                                      f"{prefix}*.npz"])
    except Exception as e:  # huggingface_hub's many errors: offline, missing, gated
        raise VectorsError(f"expected to fetch the transcoders {ref} from the Hub or its cache, found an error: {e}") from None
    scan = f"{repo}//{sub}" if sub else repo
    return (Path(local) / sub if sub else Path(local)), (f"{scan}@{rev}" if rev else scan)


def load_transcoders(source: str | os.PathLike, model: Any = None, *, input_hook: str | None = None,
                     output_hook: str | None = None, override: bool = False, store: Store | None = None,
                     max_bytes: int = MAX_FILE_BYTES) -> Transcoders:
    """Transcoders from any of the sources of the module docstring: a circuit-tracer folder (cache folder, Hub
    layout, cross-layer files), a Hub reference, a folder of sparsify or sae-lens transcoder folders, a steerkit
    file or a store reference. ``model`` (a SteerModel, a Hugging Face model or :class:`steerkit.ModelFacts`):
    check them against it (:meth:`Transcoders.check`; ``override=True``: a fingerprint mismatch warns), and record
    its name, depth, width and fingerprint where the files name no model. ``input_hook`` / ``output_hook`` replace
    a circuit-tracer folder's hooks; ``max_bytes`` bounds a steerkit file.

    Examples:
        >>> from steerkit.vectors import Transcoders
        >>> tc = Transcoders([torch.randn(16, 64)] * 4, [torch.zeros(16)] * 4, [torch.randn(16, 64)] * 4,
        ...                  [torch.zeros(64)] * 4, activation="jumprelu", threshold=[torch.full((16,), 0.2)] * 4)
        >>> loaded = steerkit.load_transcoders(tc.save(tmp_dir / "ct", "circuit-tracer"), model=tiny)
        >>> loaded.provenance.model_fingerprint == tiny.fingerprint(), loaded.W_enc[1].equal(tc.W_enc[1])
        (True, True)
        >>> steerkit.load_transcoders(loaded.save(tmp_dir / "tc.safetensors")) == loaded
        True
    """
    p = Path(source)
    if p.is_dir():
        if (p / _CONFIG).is_file() or any(_LAYER_FILE.match(x.name) or _ENC_FILE.match(x.name) for x in p.iterdir()):
            tc = read_circuit_tracer(p, input_hook=input_hook, output_hook=output_hook)
        else:
            tc = read_sae_transcoders(p)
    elif p.is_file():
        tc = import_artifact(p, max_bytes=max_bytes)
    elif "/" in str(source):
        folder, scan = _hub_folder(str(source))
        tc = read_circuit_tracer(folder, input_hook=input_hook, output_hook=output_hook)
        tc.scan = scan  # circuit-tracer's name for transcoders from the Hub, which Neuronpedia's graphs carry
    else:
        tc = stored_artifact(source, store, "a transcoder folder, a steerkit file, a Hub reference")
    tc = of_kind(tc, Transcoders, "transcoders", source)
    if model is not None:
        if tc.provenance.model_fingerprint is None and tc.provenance.model_name is None:
            tc.provenance = _model_provenance(tc.provenance, model).replace(hook_site=tc.input_hook, operation="encode")
        tc.check(model, override=override)
    return tc
