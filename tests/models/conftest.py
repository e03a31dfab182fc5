"""Shared fixtures of the model tests: one jitted forward and init (compiled once per config
and input shapes for the whole session) and the tiny preset's parameters."""

import jax
import pytest

from espo_jax.models import forward, get_preset, init_params

TINY = get_preset("tiny")


@pytest.fixture(scope="session")
def fwd():
    return jax.jit(forward, static_argnums=0,
                   static_argnames=("return_hidden", "return_logits", "deterministic"))


@pytest.fixture(scope="session")
def init():
    return jax.jit(init_params, static_argnums=0)


@pytest.fixture(scope="session")
def tiny_params(init):
    return init(TINY, jax.random.key(0))
