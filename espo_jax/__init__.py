"""espo_jax: ESPO and multi-stage zero-variance elimination for MoE RL, in JAX."""

__version__ = "0.1.0"
