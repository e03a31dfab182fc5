"""Shared by the tests of espo_jax.rl: one jitted loss-and-gradient per (config, shapes)."""

import functools

import jax
import pytest

from espo_jax.rl import losses


@functools.cache
def _compiled(config_json: str, has: tuple[str, ...]):
    import ml_collections

    cfg = ml_collections.ConfigDict(__import__("json").loads(config_json))

    def f(logp, old, adv, mask, extra):
        return losses.policy_loss(logp, old, adv, mask, cfg, **dict(zip(has, extra, strict=True)))

    return jax.jit(jax.value_and_grad(f, has_aux=True))


def run_loss(cfg, logp, old, adv, mask, **kw):
    """(loss, metrics, d loss / d logp), compiled once per config and set of optional inputs."""
    has = tuple(sorted(k for k, v in kw.items() if v is not None))
    fn = _compiled(cfg.to_json(), has)
    (loss, metrics), grad = fn(logp, old, adv, mask, tuple(kw[k] for k in has))
    return loss, metrics, grad


@pytest.fixture(name="run_loss")
def _run_loss_fixture():
    return run_loss
