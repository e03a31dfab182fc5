"""The sigmoid group-limited router (DeepSeek-V3, GLM-4.5): its rule by hand, router replay (R3)
through a whole model (a tiny MLA model with shared experts and a dense first layer), the
gradients under replay, and the auxiliary-loss-free bias update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.models import forward, get_preset, init_params, router

CONFIG = get_preset("tiny").replace(
    n_layers=3, attention="mla", qk_norm=False, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True, router="sigmoid_group",
    n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense=1,
    router_bias_update_rate=0.01)
B, T = 2, 10


def _logit(p):
    return np.log(p / (1 - p)).astype(np.float32)


# scores s = sigmoid(logits) = [0.9, 0.2, 0.6, 0.7]; with the bias [0, 0.5, 0, 0] the choice
# values are [0.9, 0.7, 0.6, 0.7]. Groups {0, 1} and {2, 3}: biased sums 1.6 and 1.3, so group 0
# and its two experts 0 and 1. Gates from the unbiased scores: [0.9, 0.2] / 1.1 * 2 =
# [1.63636, 0.36364]. Without the bias the sums are 1.1 and 1.3: experts 3 and 2, gates
# [0.7, 0.6] / 1.3 * 2 = [1.07692, 0.92308].
LOGITS = _logit(np.array([[0.9, 0.2, 0.6, 0.7]]))
BIAS = np.array([0.0, 0.5, 0.0, 0.0], np.float32)


def _select(bias, replay=None, norm=True):
    return router.select_sigmoid_group(jnp.asarray(LOGITS), jnp.asarray(bias), 2, 2, 1, norm,
                                       2.0, None if replay is None else jnp.asarray(replay))


def test_rule_by_hand():
    idx, gates, own = _select(BIAS)
    np.testing.assert_array_equal(np.sort(idx[0]), [0, 1])
    order = np.argsort(idx[0])
    np.testing.assert_allclose(gates[0][order], [0.9 / 1.1 * 2, 0.2 / 1.1 * 2], rtol=1e-6)
    np.testing.assert_array_equal(own, idx)
    idx0, gates0, _ = _select(0 * BIAS)
    np.testing.assert_array_equal(idx0[0], [3, 2])
    np.testing.assert_allclose(gates0[0], [0.7 / 1.3 * 2, 0.6 / 1.3 * 2], rtol=1e-6)
    # raw gates: the scores times the scaling factor
    np.testing.assert_allclose(_select(BIAS, norm=False)[1][0][order], [1.8, 0.4], rtol=1e-6)


def test_replay_pins_experts_and_gates_are_their_unbiased_scores():
    # recorded [2, 0]: gates [0.6, 0.9] / 1.5 * 2 = [0.8, 1.2]; the own choice stays [0, 1]
    idx, gates, own = _select(BIAS, replay=np.array([[2, 0]]))
    np.testing.assert_array_equal(idx[0], [2, 0])
    np.testing.assert_allclose(gates[0], [0.8, 1.2], rtol=1e-6)
    np.testing.assert_array_equal(np.sort(own[0]), [0, 1])
    # the sentinel routes by the rule
    np.testing.assert_array_equal(_select(BIAS, replay=np.array([[-1, -1]]))[0], _select(BIAS)[0])


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(0)
    abstract = jax.eval_shape(lambda r: init_params(CONFIG, r), jax.random.key(0))

    def leaf(path, x):
        name = getattr(path[-1], "key", None)
        if name == "scale":
            return (1.0 + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
        if name == "e_score_correction_bias":
            return (0.3 * rng.standard_normal(x.shape)).astype(np.float32)
        std = 1.0 if path[-2].key == "router" else 0.1
        return (std * rng.standard_normal(x.shape)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(leaf, abstract)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (B, T)))
    fwd = jax.jit(lambda p, r: forward(CONFIG, p, tokens, routed_experts_BxTxMxk=r))
    return params, tokens, fwd


def test_replay_of_own_routing_reproduces_the_forward_exactly(setup):
    params, _, fwd = setup
    live = fwd(params, None)
    assert CONFIG.moe_layers == (1, 2) and live.routed_experts.shape == (B, T, 2, 2)
    replayed = fwd(params, live.own_experts)
    np.testing.assert_array_equal(np.asarray(replayed.logits), np.asarray(live.logits))
    np.testing.assert_array_equal(replayed.routed_experts, live.routed_experts)
    # other experts pinned: different logits, reported as used; the first MoE layer's own
    # choice is unchanged (its inputs are; later layers see the forced layers' outputs)
    forced = (live.routed_experts + 1) % CONFIG.n_experts
    out = fwd(params, forced)
    np.testing.assert_array_equal(out.routed_experts, forced)
    np.testing.assert_array_equal(out.own_experts[:, :, 0], live.own_experts[:, :, 0])
    assert float(jnp.max(jnp.abs(out.logits - live.logits))) > 1e-3
    flips = router.routing_flip_rate(out.own_experts, out.routed_experts)
    np.testing.assert_allclose(flips, [1.0, 1.0])


def test_replay_gradients_reach_the_router_kernel_never_the_bias(setup):
    params, tokens, fwd = setup
    forced = (fwd(params, None).routed_experts + 1) % CONFIG.n_experts
    probe = jax.random.normal(jax.random.key(1), (B, T, CONFIG.vocab_size))

    def loss(p):
        out = forward(CONFIG, p, tokens, routed_experts_BxTxMxk=forced)
        return jnp.sum(out.logits * probe)

    grads = jax.jit(jax.grad(loss))(params)
    for i in CONFIG.moe_layers:
        g = grads[f"layers_{i}"]["moe"]["router"]
        assert float(jnp.max(jnp.abs(g["kernel"]))) > 1e-6
        assert float(jnp.max(jnp.abs(g["e_score_correction_bias"]))) == 0.0
        assert float(jnp.max(jnp.abs(grads[f"layers_{i}"]["moe"]["shared_experts"]["up_proj"][
            "kernel"]))) > 1e-6
    assert float(jnp.max(jnp.abs(grads["layers_0"]["attn"]["kv_b_proj"]["kernel"]))) > 1e-6


def test_aux_loss_free_bias_update():
    # loads [3, 1, 2, 2], mean 2: the overloaded expert 0 down, the idle expert 1 up, the rest
    # unchanged
    bias = router.update_correction_bias(jnp.zeros(4), jnp.array([3.0, 1.0, 2.0, 2.0]), 0.01)
    np.testing.assert_allclose(bias, [-0.01, 0.01, 0.0, 0.0])
    # through params: tokens (b, t) route to experts of the layers; the padding token is skipped
    c = get_preset("tiny").replace(n_layers=2, router="sigmoid_group", n_experts=4, top_k=1,
                                   first_k_dense=1, router_bias_update_rate=0.1)
    params = {"layers_1": {"moe": {"router": {"e_score_correction_bias": jnp.zeros(4),
                                              "kernel": jnp.ones((64, 4))}}}}
    routed = jnp.array([[[[0]], [[0]], [[1]], [[3]]]])  # [1, 4, 1, 1]: loads 2, 1, 0, 1
    weights = jnp.array([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding: loads 2, 1, 0, 0
    new = router.update_router_biases(c, params, routed, weights)
    np.testing.assert_allclose(new["layers_1"]["moe"]["router"]["e_score_correction_bias"],
                               [-0.1, -0.1, 0.1, 0.1])  # mean load 0.75
    assert router.update_router_biases(c.replace(router_bias_update_rate=0.0), params,
                                       routed) is params  # the default: frozen
