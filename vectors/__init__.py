"""steerkit.vectors: steering artifacts as plain values, their store and their exports.

How it fits together
--------------------
* :mod:`.artifacts` -- the artifact kinds, a package of one module per concern: ``vector``
  (:class:`SteeringVector` with operation ``"add"`` or ``"clamp"``, :class:`LayerSchedule`),
  ``directions`` (:class:`DirectionSet`, :class:`Probe`), ``region`` (:class:`Region`, a
  :class:`steerkit.Polyhedron` -- the kernels' geometry class -- stored with a layer and a provenance),
  ``condition`` / ``conditional`` (CAST's :class:`ConditionVector` and :class:`ConditionalSteering` of
  :class:`ConditionalRule` values), ``payload`` (the stored form), ``evaluation`` (the one part that
  runs a model: a condition's decisions on prompts), ``sae`` (:class:`SAE`: a sparse autoencoder or
  transcoder at a hook site), ``transcoders`` (:class:`Transcoders`: a transcoder per block, what attribution
  graphs trace through), ``latent`` (:class:`LatentClamp`: a clamp of an SAE's latents, or of transcoder
  features over several blocks (:class:`ClampPart`), what a server request names). Each kind holds tensors and a :class:`Provenance`
  (:mod:`.provenance`, which also holds :func:`model_fingerprint`).
* :mod:`.sae_files` -- :func:`load_sae` (``steerkit.load_sae``): sae-lens and sparsify folders, steerkit SAE
  files and store references as an :class:`SAE`.
* :mod:`.transcoder_files` -- :func:`load_transcoders` (``steerkit.load_transcoders``): circuit-tracer's, sparsify's
  and sae-lens's transcoder folders, steerkit files and store references as :class:`Transcoders`; circuit-tracer's
  layout written back.
* :mod:`.plots` -- the artifacts' figures (plotly, the ``app`` extra; imported by ``plot()`` when called).
* :mod:`.store` -- :class:`Store`, a crash-safe, concurrent, versioned folder of artifacts
  (``name@N``, tags, ``latest``).
* :mod:`.safety` -- bounded, pickle-free readers (safetensors, GGUF, JSON) and atomic writes.
* :mod:`.exports` -- :func:`export` / :func:`import_artifact` for llama.cpp, repeng, EasySteer,
  TransformerLens specs, IBM ``.svec`` and safetensors; :func:`load_artifact` reads any of
  them or a store reference.
* :mod:`.apply` -- :func:`check_compatible`: an artifact against a model, before it steers
  (every artifact lowers itself with ``to_interventions(facts)``; ``sm.steer(artifact)`` applies it).
* :mod:`.gguf_models` -- float32 copies of quantised model GGUFs and weight-orthogonalised
  GGUFs that deploy directional ablation to llama.cpp.
* :mod:`.llamacpp` -- a thin runner over ``llama-cpp-python`` (optional extra ``llamacpp``)
  used to prove the exports numerically.

Layer convention everywhere: layer ``l`` is the 0-based block index and a vector at ``l`` acts
on the block's output (``blocks.{l}.hook_resid_post``), as llama.cpp's ``direction.{l}``.
"""
if __name__ != "steerkit.vectors":  # found as a top-level `vectors` from a checkout's root: steerkit/_rootnames.py
    import runpy
    runpy.run_path(f"{__path__[0]}/../steerkit/_rootnames.py")["hand_over"](__name__)
else:
    from .apply import check_against, check_compatible, facts_of, fingerprint_of
    from .artifacts import (ARTIFACT_KINDS, SAE, ClampPart, ConditionalSteering, ConditionVector, DirectionSet, LatentClamp, LayerSchedule,
                            Probe, Region, ConditionalRule, SteeringVector, Transcoders)
    from .errors import (
        ArtifactFormatError, ExportError, ModelMismatchError, PathExistsError, StoreError, UnsafeNameError, VectorsError,
    )
    from .exports import FORMATS, easysteer_request, export, import_artifact, load_artifact, save_artifact
    from .gguf_models import write_dequantized_gguf, write_orthogonalized_gguf
    from .provenance import LAYER_BASE, SCHEMA_VERSION, Provenance, model_fingerprint, prompts_hash
    from .sae_files import load_sae
    from .transcoder_files import load_transcoders
    from .store import Store, parse_ref

    __all__ = [
        "SteeringVector", "DirectionSet", "Probe", "Region", "LayerSchedule", "ConditionVector", "ConditionalSteering",
        "ConditionalRule", "SAE", "LatentClamp", "ClampPart", "load_sae", "Transcoders", "load_transcoders", "ARTIFACT_KINDS",
        "Provenance", "model_fingerprint", "prompts_hash", "LAYER_BASE", "SCHEMA_VERSION",
        "Store", "parse_ref", "export", "import_artifact", "load_artifact", "save_artifact", "easysteer_request",
        "FORMATS", "check_compatible", "check_against", "facts_of", "fingerprint_of", "write_dequantized_gguf", "write_orthogonalized_gguf",
        "VectorsError", "ArtifactFormatError", "UnsafeNameError", "ModelMismatchError", "ExportError", "StoreError",
        "PathExistsError",
    ]
