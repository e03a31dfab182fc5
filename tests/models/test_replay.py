"""Router replay: recorded experts reproduce a forward exactly, forced experts change it, the
sentinel -1 routes normally, and the router still gets gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.models import forward, get_preset, router

TINY = get_preset("tiny")


# All calls here pass `routed_experts` (the sentinel -1 where routing is free), so each config
# compiles one forward; shapes match the other model tests' (2, 12) to share compilations.
NO_REPLAY = jnp.full((2, 12, 2, 2), -1, jnp.int32)


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(11), (2, 12), 0, TINY.vocab_size)


@pytest.mark.parametrize("norm", [True, False])
def test_replay_reproduces_logits_exactly(fwd, tiny_params, tokens, norm):
    cfg = TINY.replace(norm_topk_prob=norm)
    first = fwd(cfg, tiny_params, tokens, routed_experts_BxTxMxk=NO_REPLAY)
    again = fwd(cfg, tiny_params, tokens, routed_experts_BxTxMxk=first.routed_experts)
    np.testing.assert_array_equal(again.logits, first.logits)
    np.testing.assert_array_equal(again.routed_experts, first.routed_experts)


def test_forced_experts_change_logits_and_are_reported(fwd, tiny_params, tokens):
    first = fwd(TINY, tiny_params, tokens, routed_experts_BxTxMxk=NO_REPLAY)
    # every token's k=2 experts shifted by +3 (mod 8): a different set for every token
    forced = (first.routed_experts + 3) % TINY.n_experts
    out = fwd(TINY, tiny_params, tokens, routed_experts_BxTxMxk=forced)
    np.testing.assert_array_equal(out.routed_experts, forced)
    assert np.abs(out.logits - first.logits).max() > 1e-3
    # the router logits of layer 0 see the same input, so they are unchanged
    np.testing.assert_array_equal(out.router_logits[0], first.router_logits[0])


def test_sentinel_routes_normally_per_token(fwd, tiny_params, tokens):
    first = fwd(TINY, tiny_params, tokens)  # no routed_experts at all
    forced = (first.routed_experts + 3) % TINY.n_experts
    # row 0: sentinel everywhere (route normally); row 1: forced
    replay = forced.at[0].set(-1)
    out = fwd(TINY, tiny_params, tokens, routed_experts_BxTxMxk=replay)
    np.testing.assert_array_equal(out.logits[0], first.logits[0])
    np.testing.assert_array_equal(out.routed_experts[0], first.routed_experts[0])
    np.testing.assert_array_equal(out.routed_experts[1], forced[1])


def test_replayed_gate_weights_by_hand():
    # probs = [.1, .2, .3, .4]; replay experts (0, 1): weights .1, .2, renormalised 1/3, 2/3
    logits = jnp.log(jnp.array([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]]))
    replay = jnp.array([[0, 1], [-1, -1]])
    idx, w = router.select_experts(logits, 2, True, replay)
    np.testing.assert_array_equal(idx, [[0, 1], [3, 2]])
    np.testing.assert_allclose(w, [[1 / 3, 2 / 3], [4 / 7, 3 / 7]], rtol=1e-6)
    idx, w = router.select_experts(logits, 2, False, replay)
    np.testing.assert_allclose(w, [[0.1, 0.2], [0.4, 0.3]], rtol=1e-6)
    # an id outside [0, E) anywhere in a row also means "route normally" for that row
    idx, _ = router.select_experts(logits, 2, True, jnp.array([[0, 4], [1, -1]]))
    np.testing.assert_array_equal(idx, [[3, 2], [3, 2]])


@pytest.mark.parametrize("norm", [True, False])
def test_router_gradient_is_nonzero_under_replay(tiny_params, tokens, norm, jit):
    cfg = TINY.replace(norm_topk_prob=norm, aux_loss_coef=0.0)  # gradient only via the gates
    replay = jnp.broadcast_to(jnp.array([2, 5]), (2, 12, 2, 2))  # experts 2 and 5 everywhere

    def loss(router_kernel):
        p = dict(tiny_params)
        p["layers_1"] = {**p["layers_1"], "moe": {**p["layers_1"]["moe"],
                                                  "router": {"kernel": router_kernel}}}
        out = forward(cfg, p, tokens, routed_experts_BxTxMxk=replay)
        logp = jax.nn.log_softmax(out.logits)
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1))

    g = jit(jax.grad(loss))(tiny_params["layers_1"]["moe"]["router"]["kernel"])
    assert np.isfinite(g).all()
    assert np.abs(g).max() > 1e-6
    # With norm_topk_prob the gates are exp(l_i) / (exp(l_2) + exp(l_5)): they depend on the
    # replayed experts' logits only, so the other router columns get zero gradient (up to
    # float rounding of the softmax normaliser, which cancels analytically). Without it the
    # gates are softmax over all 8 logits, so every column gets gradient.
    others = np.array([e not in (2, 5) for e in range(8)])
    g_used, g_others = np.abs(g[:, ~others]).max(), np.abs(g[:, others]).max()
    assert g_used > 1e-6
    if norm:
        assert g_others < 1e-6 * g_used
    else:
        assert g_others > 1e-3 * g_used
