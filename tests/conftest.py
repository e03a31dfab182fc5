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
# At that level XLA:CPU's older elemental fusion emitters compile faster than its MLIR ones:
# the tiny learner's update (tests/train/test_learner.py's set-up, 7 programs) compiles in 5.5 s
# instead of 8.4 s, its set-up's 12 programs in 3.9 s instead of 5.6 s (2-core AMD EPYC Zen 1,
# 2026-12-07). With LLVM's passes on it is the other way round (28.0 s against 13.3 s), so
# `one_device_env(optimized=True)` drops both flags.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests run on the CPU; with libtpu installed (the `tpu` extra, for `bench aot`) JAX would
# also try a TPU backend in every process, and the processes would contend for libtpu's lock.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# The persistent compilation cache (a user's own directory wins), as environment variables so
# that every process a test starts (runs, workers, notebooks, launch scripts) shares it. Every
# program is written, however fast it compiled: the suite's processes compile the same small
# programs (a tiny model's initialisation, its eager ops) again and again.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.expanduser(os.path.join("~", ".cache", "espo_jax", "jax_cache")))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402, F401

# The README's command runs the suite with `-n 2 --dist loadscope --no-loadscope-reorder`: each
# module is one unit of work on one worker, so its module fixtures (a two-process training run, a
# converted checkpoint) and the programs its tests share compile once, not once per worker. Units
# go to whichever worker is free in collection order, so the modules that take longest with an
# empty compilation cache start first and the two workers finish together (longest first, then
# the rest in file order). Module totals, 2-core AMD EPYC (Zen 1), empty cache, 2026-12-07, in s:
# 400 395 288 224 201 183 183 168 152 132 118 106 105 103 94 91 86 82 69 68.
LONGEST_FIRST = (
    "models/test_smollm2.py", "test_experiments.py", "bench/test_real_bench.py",
    "train/test_worker_layout.py", "train/test_packing.py", "train/test_learner.py",
    "train/test_precision.py", "models/test_moe_ep.py", "train/test_resume.py",
    "bench/test_bench_cli.py", "models/test_scan.py", "test_main.py", "test_distributed.py",
    "bench/test_peers_bench.py", "rollout/test_engine_qwen3_next.py", "models/test_model.py",
    "models/test_gated_deltanet.py", "bench/test_device_check.py", "test_loss_seeds.py",
    "test_prompt_len.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(
        item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
