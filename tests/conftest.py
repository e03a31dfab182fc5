"""Test set-up shared by every module.

Eight fake CPU devices (set before JAX is imported) so sharding tests run anywhere, and a
persistent compilation cache outside the repository so repeated CI runs compile once.
"""

import os

# Appended to a user's own XLA_FLAGS (the sharding tests would otherwise skip); a device count
# set there is kept.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
# The tests' programs are small and compiled once each: LLVM's optimisation passes cost more
# compile time than they save at run time (tests/train/test_precision.py with an empty cache:
# 81 s with them, 61 s without, 2-core AMD EPYC Zen 4, 2026-12-07). The benchmark a test runs
# for its run time (`bench real`) keeps them (helpers/env.py); a user's own level is kept.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests run on the CPU; with libtpu installed (the `tpu` extra, for `bench aot`) JAX would
# also try a TPU backend in every process, and the processes would contend for libtpu's lock.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # a user's own cache directory wins
    jax.config.update("jax_compilation_cache_dir",
                      os.path.expanduser("~/.cache/espo_jax/jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
