"""steerkit.sae: sparse autoencoders (and transcoders) as weights and inference math, and the folders
sae-lens and sparsify write.

* :mod:`.weights` -- :class:`SAEWeights`: ``W_enc`` / ``b_enc`` / ``W_dec`` / ``b_dec`` and each
  architecture's extra tensors (ReLU, JumpReLU, TopK, gated; transcoders and skip connections), with
  :meth:`~SAEWeights.encode`, :meth:`~SAEWeights.decode`, :meth:`~SAEWeights.reconstruct` and
  :meth:`~SAEWeights.error` in steerkit's own torch code.
* :mod:`.formats` -- :func:`read_sae_folder` / :func:`write_saelens` / :func:`write_sparsify`: sae-lens
  (``cfg.json`` + ``sae_weights.safetensors``) and sparsify (``cfg.json`` + ``sae.safetensors``) folders,
  and the hook site each reads (:func:`site_of_hook`, :func:`sparsify_sites`).

The stored artifact, with its site, provenance and model check, is :class:`steerkit.vectors.SAE`
(``steerkit.load_sae``); this package is the part the core itself runs.
"""
from steerkit.sae.formats import (D_MODEL_SITES, FORMATS, SAELENS_ARCHITECTURES, SAEFolder, detect_format,
                                  read_sae_folder, read_saelens, read_sparsify, site_of_hook, sparsify_sites,
                                  tl_hook_name, write_saelens, write_sparsify)
from steerkit.sae.weights import ARCHITECTURES, NORMALIZATIONS, TENSOR_NAMES, SAEFormatError, SAEWeights

__all__ = [
    "SAEWeights", "SAEFormatError", "ARCHITECTURES", "NORMALIZATIONS", "TENSOR_NAMES",
    "SAEFolder", "read_sae_folder", "read_saelens", "read_sparsify", "write_saelens", "write_sparsify",
    "detect_format", "site_of_hook", "sparsify_sites", "tl_hook_name", "FORMATS", "SAELENS_ARCHITECTURES",
    "D_MODEL_SITES",
]
