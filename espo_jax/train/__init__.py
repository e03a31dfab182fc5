"""espo_jax.train."""
