"""Shared fixtures of the model tests: one jitted forward and init for the whole session
(compiled once per config and input shapes), the tiny preset's parameters, and random
parameters for variant configs without compiling their init.

Compilation dominates these tests on CPU, so every jit here uses XLA's backend optimisation
level 0 (about half the compile time; the tiny models run in milliseconds either way)."""

import functools

import jax
import numpy as np
import pytest

from espo_jax.models import forward, get_preset, init_params

TINY = get_preset("tiny")
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@pytest.fixture(scope="session")
def jit():
    """`jax.jit` with fast-compile options."""
    return functools.partial(jax.jit, compiler_options=FAST_COMPILE)


@pytest.fixture(scope="session")
def fwd(jit):
    return jit(forward, static_argnums=0,
               static_argnames=("return_hidden", "return_logits", "deterministic"))


@pytest.fixture(scope="session")
def init(jit):
    return jit(init_params, static_argnums=0)


@pytest.fixture(scope="session")
def tiny_params(init):
    return init(TINY, jax.random.key(0))


@pytest.fixture(scope="session")
def random_params():
    """params(config, seed): N(0, 0.02) weights and N(1, 0.1) norm scales of the right tree,
    made with numpy from `jax.eval_shape` (no compilation)."""

    def make(config, seed=0):
        rng = np.random.default_rng(seed)
        abstract = jax.eval_shape(lambda r: init_params(config, r), jax.random.key(0))

        def leaf(path, x):
            if getattr(path[-1], "key", None) == "scale":
                return (1.0 + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
            return (0.02 * rng.standard_normal(x.shape)).astype(np.float32)

        return jax.tree_util.tree_map_with_path(leaf, abstract)

    return make
