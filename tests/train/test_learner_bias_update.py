"""`Learner.update` on a DeepSeek-style policy (MLA, sigmoid group-limited router, a shared
expert, a dense first layer) from real engine rollouts: router replay keeps learner and sampler
in agreement, and with `router_bias_update_rate` > 0 each minibatch's update moves the
correction biases by DeepSeek's auxiliary-loss-free rule from its rows' expert loads (the
gradient never does: with the rate 0 they stay bitwise)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax import config_validation, configs, sharding
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models import router
from espo_jax.models.presets import get_preset
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.rollout.engine import Engine, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.tokenizer import CharTokenizer
from espo_jax.train import state as state_lib
from espo_jax.train.learner import Learner

RATE = 0.01
MODEL = get_preset("tiny").replace(
    n_layers=3, attention="mla", qk_norm=False, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=8, v_head_dim=16, router="sigmoid_group", n_group=2, topk_group=1,
    routed_scaling_factor=2.0, n_shared_experts=1, first_k_dense=1, aux_loss_coef=0.0,
    router_bias_update_rate=RATE)


@pytest.fixture(scope="module")
def setup():
    c = configs.default_config()
    c.model.preset = "tiny"
    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = 128
    c.rollout.prompts_per_step = 2
    c.zve.n_samples = 2
    c.rollout.max_prompt_len = 8
    c.rollout.max_new_tokens = 8
    c.train.updates_per_batch = 2  # one group per minibatch
    c.train.logprob_chunk = 16
    c.optim.warmup_steps = 0
    config_validation.validate(c, n_devices=jax.device_count())
    mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:1])
    params = sharding.init_sharded(MODEL, mesh, rng=jax.random.key(0))
    tx = state_lib.make_optimizer(c.optim, total_steps=10)
    make_state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    tok = CharTokenizer()
    engine = Engine(MODEL, jax.device_get(params), precision="fp32", max_slots=4,
                    max_cache_len=16,
                    sampling=SamplingConfig(max_new_tokens=8, stop_tokens=(tok.eos_id,)))
    requests = [Request(prompt_id="a", tokens=tok.encode("12+3=", add_bos=True)),
                Request(prompt_id="b", tokens=tok.encode("7-5=", add_bos=True))]
    generated = engine.generate_groups(requests, n_samples=2, rng=jax.random.key(3))
    groups = [RolloutGroup(prompt_id=g.prompt_id, prompt_tokens=g.prompt_tokens,
                           policy_version=0, sampler="jax-fp32", created_at=0.0,
                           responses=[Response(tokens=r.tokens, logprobs=r.logprobs,
                                               routed_experts=r.routed_experts,
                                               finish_reason=r.finish_reason, outcome=i == 0,
                                               reward=float(i == 0))
                                      for i, r in enumerate(g.responses)],
                           n_experts=MODEL.n_experts) for g in generated]
    rewards = [np.array([1.0, 0.0], np.float32)] * 2
    return c, mesh, params, make_state, state_shardings, groups, rewards


def _biases(params):
    return {i: np.asarray(params[f"layers_{i}"]["moe"]["router"]["e_score_correction_bias"])
            for i in MODEL.moe_layers}


def test_update_moves_biases_by_expert_load_and_replays_exactly(setup):
    c, mesh, params, make_state, state_shardings, groups, rewards = setup
    learner = Learner(c, MODEL, mesh, state_shardings)
    before = _biases(jax.device_get(params))
    # the expected biases: the rule applied after each minibatch to its rows' recorded loads
    expected = {f"layers_{i}": {"moe": {"router": {"e_score_correction_bias": jnp.asarray(b)}}}
                for i, b in before.items()}
    for parts in learner.update_batches(groups, rewards):
        routed = np.concatenate([b.routed_experts for b in parts])
        weights = np.concatenate([b.segment_ids > 0 for b in parts])
        expected = router.update_router_biases(MODEL, expected, jnp.asarray(routed),
                                               jnp.asarray(weights, jnp.float32))
    state, m = learner.update(make_state(params), groups, rewards)
    after = _biases(jax.device_get(state.params))
    moved = 0
    for i in MODEL.moe_layers:
        want = np.asarray(expected[f"layers_{i}"]["moe"]["router"]["e_score_correction_bias"])
        np.testing.assert_allclose(after[i], want, atol=1e-7)
        moved += int(np.sum(after[i] != before[i]))
    assert moved > 0
    assert int(state.step) == 2 and m["train/skipped_update"] == 0.0
    # the fp32 engine routed and scored with these weights; the learner replays its routing
    assert m["mismatch/logp_abs_max"] < 1e-3 and m["moe/routing_flip_rate"] == 0.0

    frozen = Learner(c, MODEL.replace(router_bias_update_rate=0.0), mesh, state_shardings)
    state, _ = frozen.update(make_state(params), groups, rewards)
    for i, b in _biases(jax.device_get(state.params)).items():
        np.testing.assert_array_equal(b, before[i])  # no gradient reaches the bias
