"""The step machinery every method shares: gradient caching (:mod:`.grad_cache`), the per-batch
seeding of model-side randomness (:mod:`.step_rng`) and its per-sample keys (:mod:`.sample_rng`),
the divergence guard (:mod:`.divergence`) and the EMA teacher update (:mod:`.ema`)."""
