"""Model loading: finding and loading a model (:mod:`.resolve`), the architecture adapters, the only place
that knows module paths (:mod:`.adapters`), weight-only quantisation (:mod:`.quantize`), fingerprints
(:mod:`.fingerprint`) and export as a plain Hugging Face folder (:mod:`.export_hf`)."""
