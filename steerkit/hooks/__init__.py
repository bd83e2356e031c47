"""Hooks and names: TransformerLens-style hook names (:mod:`.names`), token positions (:mod:`.positions`),
the scoped hook manager (:mod:`.manager`), and the attention / mixture-of-experts hooks that switch a
model's implementation while they exist (:mod:`.attention`, :mod:`.moe`, :mod:`.implswitch`)."""
