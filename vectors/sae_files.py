"""Loading sparse autoencoders: :func:`load_sae` reads a sae-lens folder, a sparsify folder, steerkit's own
SAE file or a store reference into one :class:`~steerkit.vectors.SAE` (``steerkit.load_sae`` is this
function).

How it works
------------
A folder is read by :func:`steerkit.sae.read_sae_folder` (safetensors and JSON, never a pickle; the site
from the sae-lens config's hook name or the sparsify folder's name, or ``site=``); its ``cfg.json`` is kept
in the provenance (``method_params["config"]``, with ``method_params["format"]``), so that saving back to
the same format keeps sae-lens's metadata and sparsify's training fields. A file is steerkit's own
(:meth:`SAE.save`), read by :func:`~steerkit.vectors.import_artifact`; anything else that is not a path is a
store reference (``name@N``). With ``model``, the SAE is checked against it (:meth:`SAE.check`: its sites
exist, their widths are the SAE's, and for a steerkit SAE the model's fingerprint is the one it was made
for) and a folder's SAE records the model's name, depth, width and fingerprint.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from steerkit.interventions import ModelFacts
from steerkit.sae import read_sae_folder

from .artifacts import SAE
from .errors import UnsafeNameError, VectorsError
from .exports import import_artifact
from .provenance import Provenance
from .safety import MAX_FILE_BYTES
from .store import Store, parse_ref


def _model_provenance(prov: Provenance, model: Any) -> Provenance:
    """``prov`` with the model's name, depth, width and fingerprint."""
    if isinstance(model, dict):
        model = ModelFacts.from_dict(model)
    if isinstance(model, ModelFacts):
        facts = dict(model_name=model.name, model_fingerprint=model.fingerprint, d_model=model.d_model,
                     n_layers=model.n_layers)
    else:
        p = Provenance.from_model(model)
        facts = dict(model_name=p.model_name, model_fingerprint=p.model_fingerprint, model_arch=p.model_arch,
                     d_model=p.d_model, n_layers=p.n_layers)
    return prov.replace(**facts)


def load_sae(path: str | os.PathLike, site: str | None = None, *, output_site: str | None = None, model: Any = None,
             override: bool = False, store: Store | None = None, max_bytes: int = MAX_FILE_BYTES) -> SAE:
    """An SAE from a sae-lens folder, a sparsify folder, a steerkit SAE file or a store reference (see the
    module docstring). ``site`` / ``output_site``: the steerkit hook names it reads / a transcoder writes,
    replacing what the folder says. ``model`` (a SteerModel, a Hugging Face model or
    :class:`steerkit.ModelFacts`): check the SAE against it (``override=True``: a fingerprint mismatch
    warns instead).

    Examples:
        >>> from steerkit.sae import SAEWeights, write_saelens
        >>> w = SAEWeights(torch.randn(64, 256), torch.zeros(256), torch.randn(256, 64), torch.zeros(64))
        >>> folder = write_saelens(w, tmp_dir / "sae", site="blocks.2.hook_resid_post", metadata={"model_name": "tiny"})
        >>> sae = steerkit.load_sae(folder, model=tiny)
        >>> sae.site, sae.architecture, sae.provenance.model_fingerprint == tiny.fingerprint()
        ('blocks.2.hook_resid_post', 'relu', True)
        >>> steerkit.load_sae(sae.save(tmp_dir / "sae.safetensors")) == sae
        True
    """
    p = Path(path)
    if p.is_dir():
        folder = read_sae_folder(p, site=site, output_site=output_site)
        meta: dict = folder.config["metadata"] if isinstance(folder.config.get("metadata"), dict) else folder.config
        name = meta.get("model_name")
        assert folder.site is not None  # read_sae_folder names it or raises
        prov = Provenance(model_name=name if isinstance(name, str) else None, method=f"imported:{folder.format}",
                          method_params={"format": folder.format, "config": folder.config}, operation="encode")
        if model is not None:  # a folder names no fingerprint: it records the model's, then the sites are checked
            prov = _model_provenance(prov, model)
        sae = SAE(folder.weights, folder.site, folder.output_site, provenance=prov)
        if model is not None:
            sae.check(model)
        return sae
    if p.is_file():
        sae = import_artifact(p, max_bytes=max_bytes)
    else:
        sae = stored_artifact(path, store, "an SAE folder, a steerkit SAE file")
    sae = of_kind(sae, SAE, "an SAE", path)
    if site is not None or output_site is not None:  # the constructor checks both names
        sae = dataclasses.replace(sae, site=site or sae.site, output_site=output_site or sae.output_site)
    if model is not None:
        sae.check(model, override=override)
    return sae


def stored_artifact(source: Any, store: Any, what: str) -> Any:
    """The artifact a store reference (``name@N``) names, for a ``source`` that is not a file or folder; ``what``
    says what else the caller looked for (the message when ``source`` is not a reference either).

    Examples:
        >>> from steerkit.vectors import SteeringVector
        >>> ref = store.save("v", SteeringVector.from_direction(torch.ones(64), 1, tiny, method="demo"))
        >>> stored_artifact(ref, store, "an SAE folder").kind
        'steering_vector'
        >>> stored_artifact("no/such/folder", store, "an SAE folder")
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.VectorsError: expected an SAE folder or a store reference (name@N) at 'no/such/folder', found nothing there; check the path
    """
    try:
        parse_ref(str(source))
    except UnsafeNameError:
        raise VectorsError(f"expected {what} or a store reference (name@N) at {str(source)!r:.200}, found nothing "
                           "there; check the path") from None
    return (store or Store()).load(str(source))


def of_kind(artifact: Any, cls: type, what: str, source: Any) -> Any:
    """``artifact``, checked to be a ``cls`` (``what``: its name in the message).

    Examples:
        >>> from steerkit.vectors import SAE, SteeringVector
        >>> v = SteeringVector.from_direction(torch.ones(64), 1, tiny, method="demo")
        >>> of_kind(v, SteeringVector, "a vector", "v@1") is v
        True
        >>> of_kind(v, SAE, "an SAE", "v@1")
        Traceback (most recent call last):
        ...
        steerkit.vectors.errors.VectorsError: expected an SAE at 'v@1', found a steering_vector; load other artifacts with steerkit.vectors.load_artifact
    """
    if not isinstance(artifact, cls):
        raise VectorsError(f"expected {what} at {str(source)!r:.200}, found a "
                           f"{getattr(artifact, 'kind', type(artifact).__name__)}; load other artifacts with "
                           "steerkit.vectors.load_artifact")
    return artifact
