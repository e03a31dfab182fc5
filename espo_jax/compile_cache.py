"""The persistent compilation cache every entry point uses.

`python -m espo_jax.main`, the rollout workers and the benchmarks keep compiled programs in
`~/.cache/espo_jax/jax_cache`, so a second run (or a second process of one run: workers, resumed
jobs) reads them instead of compiling. JAX's own environment variables win:
JAX_COMPILATION_CACHE_DIR (another directory) and JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
(which programs are worth a file; the test suite sets 0, so the programs its many processes
share are compiled once).
"""

import os

DEFAULT_DIR = os.path.join("~", ".cache", "espo_jax", "jax_cache")
MIN_COMPILE_TIME_S = 1.0  # programs compiled faster than this are not written


def enable() -> str:
    """Turns the cache on (idempotent); returns its directory."""
    import jax

    if jax.config.jax_compilation_cache_dir is None:  # JAX_COMPILATION_CACHE_DIR sets it
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(DEFAULT_DIR))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    return jax.config.jax_compilation_cache_dir
