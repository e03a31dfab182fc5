"""The environment of a test's subprocess: one CPU device, the suite's other XLA flags kept.

conftest gives the test process eight fake devices and compiles without LLVM's optimisation
passes (with XLA's elemental fusion emitters); a command run as a user would run it
(`python -m espo_jax.main ...`) sees one device, and compiles the same fast way.
"""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"
OPT_LEVEL = "--xla_backend_optimization_level"
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters"


def one_device_env(*, optimized: bool = False, **extra: str) -> dict:
    """os.environ without the fake device count, with `extra` set; `optimized` also drops
    conftest's compile settings (for a benchmark whose run time, not compile time, dominates)."""
    drop = (DEVICE_COUNT, OPT_LEVEL, FUSION_EMITTERS) if optimized else (DEVICE_COUNT,)
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(drop)]
    env.pop("XLA_FLAGS", None)
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(extra)
    return env
