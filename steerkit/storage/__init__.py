"""Files and data: crash-safe writes and the one confinement helper (:mod:`.files`), the vendored data sets
(:mod:`.datafiles`), recorded activation data sets (:mod:`.dataset`) and the rules for names users type
(:mod:`.naming`)."""
