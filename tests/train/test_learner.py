"""The learner: advantages per group, RL-ZVP token advantages, skipped non-finite updates, and
`Learner.update` on real rollouts of the embedded engine (tiny MoE, 2 data shards)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.fp32 import fp32_bound

from espo_jax import config_validation, configs, sharding
from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.models.presets import get_preset
from espo_jax.rl.advantages import ADVANTAGES, rl_zvp, zvp_signs
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.rollout import mismatch
from espo_jax.rollout.engine import Engine, Request
from espo_jax.rollout.sampling import SamplingConfig
from espo_jax.tokenizer import CharTokenizer
from espo_jax.train import state as state_lib
from espo_jax.train.advantages import group_advantages, trained_responses
from espo_jax.train.batch import RLBatch
from espo_jax.train.learner import Learner
from espo_jax.train.step import token_advantages
from espo_jax.zve import UnscoredGroupError

# The records' own `reward` (the reward function's): the learner must not read it, it trains on
# the rewards it is given (MS-ZVE's).
RECORD_REWARD = -5.0


def _group(outcomes, pid="p", tokens_per_response=3):
    responses = [
        Response(tokens=np.full(tokens_per_response, 5), logprobs=np.zeros(tokens_per_response),
                 outcome=o, reward=RECORD_REWARD)
        for o in outcomes
    ]
    return RolloutGroup(prompt_id=pid, prompt_tokens=np.array([1, 4]), policy_version=0,
                        sampler="test", created_at=0.0, responses=responses)


def _rewards(rows):
    return [np.asarray(r, np.float32) for r in rows]


# ---- advantages -----------------------------------------------------------------------------
def test_group_advantages_grpo_and_zero_variance_signs():
    rewards = _rewards([
        [1.0, 0.0, 0.0, 1.0],  # mixed, G=4
        [1.0, 1.0, 1.0],  # all correct, G=3
        [0.0, 0.0],  # all wrong, G=2
        [1.0, 0.9],  # all correct, tie broken by a length term: not ZV
        [1.0],  # a single response
    ])
    groups = [_group(o) for o in ([1, 0, 0, 1], [1, 1, 1], [0, 0], [1, 1], [1])]
    adv, sign = group_advantages(groups, rewards, "grpo", use_zvp=True)
    # Mixed: mean 0.5, std 0.5 -> (r - 0.5) / (0.5 + 1e-6) = +-0.999998.
    a = 0.5 / (0.5 + 1e-6)
    # Tie-broken: mean 0.95, std 0.05 -> +-0.05 / (0.05 + 1e-6) = +-0.99998.
    b = 0.05 / (0.05 + 1e-6)
    np.testing.assert_allclose(
        adv, [a, -a, -a, a, 0, 0, 0, 0, 0, b, -b, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sign, [0, 0, 0, 0, 1, 1, 1, -1, -1, 0, 0, 1])
    assert adv.dtype == np.float32 and sign.dtype == np.float32
    # zve.zvp.wrong_groups=False: only all-correct groups get RL-ZVP; all-wrong ones keep 0.
    adv_c, sign_c = group_advantages(groups, rewards, "grpo", use_zvp=True, zvp_wrong=False)
    np.testing.assert_array_equal(sign_c, [0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(adv_c, adv)
    _, sign_off = group_advantages(groups, rewards, "grpo", use_zvp=False)
    np.testing.assert_array_equal(sign_off, np.zeros(12))
    # RLOO on the mixed group: G/(G-1) * (r - mean) = 4/3 * +-0.5 = +-2/3.
    adv_rloo, _ = group_advantages(groups[:1], rewards[:1], "rloo", use_zvp=False)
    np.testing.assert_allclose(adv_rloo, [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    empty_adv, empty_sign = group_advantages([], [], "grpo", use_zvp=True)
    assert empty_adv.shape == empty_sign.shape == (0,)
    with pytest.raises(ValueError, match="4 reward arrays for 5 groups"):
        group_advantages(groups, rewards[:4], "grpo", use_zvp=True)
    with pytest.raises(ValueError, match="3 responses but rewards of shape \\(2,\\)"):
        group_advantages(groups[1:2], rewards[2:3], "grpo", use_zvp=True)


def _failed(outcomes, failed, pid="p"):
    """A group whose responses `failed` (indices) had their reward call fail or time out: what
    the rollout side records, outcome False and the index in `meta["reward_failed"]`."""
    g = _group([False if i in failed else o for i, o in enumerate(outcomes)], pid)
    g.meta["reward_failed"] = list(failed)
    return g


def test_group_advantages_leave_failed_rewards_out():
    # Each group's last reward (0.0, the pool's `failed_reward`) is a failed call.
    groups = [_failed([1, 1, 0], [2]), _failed([1, 0, 0], [2]), _failed([0, 0, 0], [0, 1, 2]),
              _failed([0, 0, 0], [2])]
    rewards = _rewards([[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0]])
    adv, sign = group_advantages(groups, rewards, "grpo", use_zvp=True)
    # [1, 1, failed] is GRPO's [1, 1]: zero variance -> A = 0, RL-ZVP all-correct sign +1 (GRPO
    # over [1, 1, 0] would give the correct answers 0.707 and the failed call -1.414).
    # [1, 0, failed] is GRPO's [1, 0]: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 1e-6).
    # Every call failed: no outcome, A = 0 and no sign (not an all-wrong group's -1).
    # [0, 0, failed]: the known outcomes are all wrong -> sign -1 on those two only.
    a = 0.5 / (0.5 + 1e-6)
    np.testing.assert_allclose(adv, [0, 0, 0, a, -a, 0, 0, 0, 0, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(sign, [1, 1, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0])
    _, sign_c = group_advantages(groups, rewards, "grpo", use_zvp=True, zvp_wrong=False)
    np.testing.assert_array_equal(sign_c, [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(trained_responses(groups),
                                  [1, 1, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0])
    # Dr. GRPO and RLOO over the scored responses of [1, 0, 1, failed]: mean 2/3, so
    # r - 2/3 = [1/3, -2/3, 1/3] and RLOO (G = 3 scored) 3/2 of that = [0.5, -1, 0.5].
    mixed, mixed_r = [_failed([1, 0, 1, 0], [3])], _rewards([[1, 0, 1, 0]])
    dr, _ = group_advantages(mixed, mixed_r, "dr_grpo", use_zvp=False)
    np.testing.assert_allclose(dr, [1 / 3, -2 / 3, 1 / 3, 0], rtol=1e-6)
    rl, _ = group_advantages(mixed, mixed_r, "rloo", use_zvp=False)
    np.testing.assert_allclose(rl, [0.5, -1, 0.5, 0], rtol=1e-6)
    # One scored response: no baseline (A = 0, as a group of one), and RLOO does not raise.
    one, one_sign = group_advantages([_failed([1, 0], [1])], _rewards([[1, 0]]), "rloo",
                                     use_zvp=True)
    np.testing.assert_array_equal(one, [0, 0])
    np.testing.assert_array_equal(one_sign, [1, 0])


def _previous_group_advantages(groups, rewards, name, use_zvp, zvp_wrong=True):
    """`group_advantages` as it was before failed reward calls were left out (every response
    scored): the reference the unchanged default experiment is held to."""
    advs, signs = [], []
    for g, group_rewards in zip(groups, rewards, strict=True):
        rewards_g = np.asarray(group_rewards, np.float32)
        outcomes = np.array([bool(r.outcome) for r in g.responses])
        adv = (np.asarray(ADVANTAGES[name](rewards_g[None]))[0] if len(rewards_g) > 1
               else np.zeros(1))
        advs.append(adv)
        sign = float(zvp_signs(rewards_g[None], outcomes[None], zvp_wrong)[0]) if use_zvp else 0.0
        signs.append(np.full(len(rewards_g), sign, np.float32))
    return np.concatenate(advs).astype(np.float32), np.concatenate(signs)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_advantages_without_failures_are_bitwise_the_previous_ones(name):
    rng = np.random.default_rng(7)
    groups, rewards = [], []
    for i in range(40):
        n = int(rng.integers(2 if name == "rloo" else 1, 7))
        outcomes = rng.integers(0, 2, n) if i % 3 else np.full(n, i % 2)  # some zero-variance
        shaped = outcomes - rng.uniform(0, 0.2, n) * (i % 4 == 1)  # some tie-broken
        groups.append(_group(list(outcomes), pid=str(i)))
        if i % 2:  # an empty list: what a group with no failed call may carry
            groups[-1].meta["reward_failed"] = []
        rewards.append(np.asarray(shaped, np.float32))
    for use_zvp, wrong in ((True, True), (True, False), (False, True)):
        adv, sign = group_advantages(groups, rewards, name, use_zvp, wrong)
        ref_adv, ref_sign = _previous_group_advantages(groups, rewards, name, use_zvp, wrong)
        assert adv.dtype == ref_adv.dtype and sign.dtype == ref_sign.dtype
        np.testing.assert_array_equal(adv, ref_adv)
        np.testing.assert_array_equal(sign, ref_sign)
    assert trained_responses(groups).all()


def _rl_batch(adv, sign, entropy, mask):
    b, t = np.shape(mask)
    z = jnp.zeros((b, t))
    return RLBatch(tokens=z.astype(jnp.int32), positions=z.astype(jnp.int32),
                   targets=z.astype(jnp.int32), segment_ids=(z + 1).astype(jnp.int32),
                   loss_mask=jnp.asarray(mask, jnp.float32),
                   advantages=jnp.asarray(adv, jnp.float32), zv_sign=jnp.asarray(sign, jnp.float32),
                   behaviour_logp=z, routed_experts=None, old_entropy=jnp.asarray(entropy))


_token_adv = jax.jit(token_advantages, static_argnums=1)


def test_token_advantages_rl_zvp_by_hand():
    entropy = [[0.3, 0.3, 0.3, 0.3], [0.5, 1.0, 2.0, 9.0], [0.5, 1.0, 2.0, 9.0]]
    mask = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    batch = _rl_batch([0.7, 0.0, 0.0], [0, 1, -1], entropy, mask)
    out = np.asarray(_token_adv(batch, 0.1)) * np.asarray(mask)
    # Row 0 (not zero-variance): its sequence advantage on every token.
    # Row 1 (all correct): alpha * H = 0.1 * [0.5, 1, 2]; the masked 9.0 does not count.
    # Row 2 (all wrong): -alpha * (max H - H) with max H = 2 over the response:
    #   -0.1 * [1.5, 1.0, 0.0].
    np.testing.assert_allclose(out, [[0.7, 0.7, 0, 0], [0.05, 0.1, 0.2, 0],
                                     [-0.15, -0.1, 0.0, 0]], atol=1e-7)
    # alpha = 0 (stage 3 off): sequence advantages everywhere, zero-variance rows get 0.
    off = np.asarray(_token_adv(batch, 0.0)) * np.asarray(mask)
    np.testing.assert_allclose(off, [[0.7, 0.7, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])


def test_negative_scale_shrinks_only_negative_token_advantages():
    entropy = [[0.3, 0.3, 0.3, 0.3], [0.5, 1.0, 2.0, 9.0], [0.5, 1.0, 2.0, 9.0]]
    mask = [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    batch = _rl_batch([-0.7, 0.4, 0.0], [0, 0, -1], entropy, mask)
    scaled = jax.jit(token_advantages, static_argnums=(1, 2))
    # Row 0 (-0.7) and row 2's RL-ZVP all-wrong advantages -0.1 * (2 - H) = [-0.15, -0.1, 0]
    # are negative: scaled by 0.5. Row 1 (+0.4) is unchanged.
    half = np.asarray(scaled(batch, 0.1, 0.5)) * np.asarray(mask)
    np.testing.assert_allclose(half, [[-0.35, -0.35, 0, 0], [0.4, 0.4, 0.4, 0],
                                      [-0.075, -0.05, 0.0, 0]], atol=1e-7)
    only_pos = np.asarray(scaled(batch, 0.1, 0.0)) * np.asarray(mask)
    np.testing.assert_allclose(only_pos, [[0, 0, 0, 0], [0.4, 0.4, 0.4, 0], [0, 0, 0, 0]],
                               atol=1e-7)


def test_token_advantages_agree_with_rl_zvp():
    # N = 4 groups of G = 3 (equal sizes, as rl_zvp needs): mixed, all correct, all wrong, and
    # all correct with tie-broken rewards (not zero-variance).
    rewards = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 0], [1.0, 0.95, 0.9]], np.float32)
    outcomes = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 0], [1, 1, 1]], np.float32)
    rng = np.random.default_rng(0)
    entropy = rng.uniform(0.0, 3.0, (4, 3, 7)).astype(np.float32)
    lengths = rng.integers(1, 8, (4, 3))
    mask = (np.arange(7) < lengths[..., None]).astype(np.float32)
    groups = [_group(list(o.astype(int)), pid=str(i)) for i, o in enumerate(outcomes)]
    adv, sign = group_advantages(groups, list(rewards), "grpo", use_zvp=True)
    np.testing.assert_array_equal(sign, np.repeat([0, 1, -1, 0], 3))
    ours = _token_adv(_rl_batch(adv, sign, entropy.reshape(12, 7), mask.reshape(12, 7)), 0.25)
    ref = rl_zvp(rewards, outcomes, entropy, mask, 0.25)
    np.testing.assert_allclose(np.asarray(ours) * mask.reshape(12, 7),
                               np.asarray(ref).reshape(12, 7), rtol=1e-5, atol=1e-6)


# ---- apply_gradients ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_state():
    optim = configs.default_config().optim
    optim.warmup_steps = 0  # the first update uses the peak lr (1e-3)
    tx = state_lib.make_optimizer(optim, total_steps=10)
    params = {"w": jnp.ones((2, 2)), "b": jnp.zeros((2,))}
    return state_lib.create_train_state(params, tx, jax.random.key(0))


_apply = jax.jit(state_lib.apply_gradients)


def test_apply_gradients_update_by_hand(small_state):
    grads = {"w": jnp.array([[1.0, -2.0], [3.0, -4.0]]), "b": jnp.array([0.5, -0.5])}
    new, skipped = _apply(small_state, grads, jnp.float32(1.0))
    # Global-norm clipping rescales but keeps signs; Adam's first bias-corrected step is
    # m / sqrt(v) = g / |g| = sign(g), so p' = p - lr * sign(g) with lr = 1e-3.
    np.testing.assert_allclose(new.params["w"], [[0.999, 1.001], [0.999, 1.001]], atol=1e-6)
    np.testing.assert_allclose(new.params["b"], [-0.001, 0.001], atol=1e-6)
    assert int(skipped) == 0 and int(new.skipped) == 0 and int(new.step) == 1


@pytest.mark.parametrize("bad", ["nan_grad", "inf_grad", "nan_loss"])
def test_apply_gradients_skips_non_finite(small_state, bad):
    # Advance once so the optimiser moments are non-zero: "unchanged" then means something.
    good = {"w": jnp.full((2, 2), 0.5), "b": jnp.array([1.0, 2.0])}
    state, _ = _apply(small_state, good, jnp.float32(1.0))
    before = jax.device_get((state.params, state.opt_state))
    grads = dict(good)
    loss = jnp.float32(1.0)
    if bad == "nan_grad":
        grads["b"] = jnp.array([1.0, jnp.nan])
    elif bad == "inf_grad":
        grads["w"] = good["w"].at[0, 1].set(jnp.inf)
    else:
        loss = jnp.float32(jnp.nan)
    new, skipped = _apply(state, grads, loss)
    after = jax.device_get((new.params, new.opt_state))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(x, y)  # bitwise: NaN-free, so equality is exact
    assert int(skipped) == 1 and int(new.skipped) == 1
    assert int(new.step) == 2  # the step counter still advances
    # A finite update afterwards proceeds from the untouched state.
    newer, skipped = _apply(new, good, jnp.float32(1.0))
    assert int(skipped) == 0 and int(newer.skipped) == 1
    assert not np.array_equal(jax.device_get(newer.params["w"]), before[0]["w"])


# ---- Learner.update on real engine rollouts -------------------------------------------------
def _learner_config():
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
    c.mesh.data = 2  # rows sharded over 2 devices
    c.zve.zvp.enabled = True
    c.optim.warmup_steps = 0
    c.optim.lr = 1e-2
    config_validation.validate(c, n_devices=jax.device_count())
    return c


@pytest.fixture(scope="module")
def learner_setup():
    c = _learner_config()
    model_config = get_preset("tiny")
    mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:2])
    params = sharding.init_sharded(model_config, mesh, rng=jax.random.key(0))
    tx = state_lib.make_optimizer(c.optim, total_steps=10)
    make_state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    learner = Learner(c, model_config, mesh, state_shardings)
    tok = CharTokenizer()
    engine = Engine(model_config, jax.device_get(params), precision="fp32", max_slots=4,
                    max_cache_len=16,
                    sampling=SamplingConfig(max_new_tokens=8, stop_tokens=(tok.eos_id,)))
    requests = [Request(prompt_id="a", tokens=tok.encode("12+3=", add_bos=True)),
                Request(prompt_id="b", tokens=tok.encode("7-5=", add_bos=True))]
    generated = engine.generate_groups(requests, n_samples=2, rng=jax.random.key(3))
    return learner, params, make_state, generated


def _groups(generated, rewards, logp_shift=0.0):
    """(groups, rewards): what `Learner.update` takes. The records carry `RECORD_REWARD`."""
    out = []
    for gen, rs in zip(generated, rewards, strict=True):
        responses = [Response(tokens=r.tokens, logprobs=r.logprobs + logp_shift,
                              routed_experts=r.routed_experts, finish_reason=r.finish_reason,
                              outcome=bool(rw == 1.0), reward=RECORD_REWARD)
                     for r, rw in zip(gen.responses, rs, strict=True)]
        out.append(RolloutGroup(prompt_id=gen.prompt_id, prompt_tokens=gen.prompt_tokens,
                                policy_version=0, sampler="jax-fp32", created_at=0.0,
                                responses=responses, n_experts=8))
    return out, _rewards(rewards)


def _host(tree):
    return [np.array(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_update_changes_params_and_reports_mismatch(learner_setup):
    learner, params, make_state, generated = learner_setup
    state = make_state(params)
    before = _host(state.params)
    # Group "a" has contrast; group "b" is all-correct (zero-variance: RL-ZVP advantages).
    state, m = learner.update(state, *_groups(generated, [[1.0, 0.0], [1.0, 1.0]]))
    after = _host(state.params)
    assert any(not np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    assert all(np.isfinite(x).all() for x in after)
    assert int(state.step) == 2 and int(state.skipped) == 0  # 2 minibatches, 2 updates
    assert m["train/skipped_update"] == 0.0 and np.isfinite(m["train/loss"])
    # The fp32 engine computed the behaviour log-probs with the same weights and (replayed)
    # routing: learner and sampler agree to float rounding, and no token flips its experts.
    assert m["mismatch/logp_abs_mean"] < 1e-4
    assert m["mismatch/logp_abs_max"] < 1e-3
    assert abs(m["mismatch/kl_k3"]) < 1e-6
    for key in ("moe/routing_flip_rate", "moe/routing_flip_rate/layer_0",
                "moe/routing_flip_rate/layer_1"):
        assert m[key] == 0.0, key
    assert m["entropy/mean"] > 0.0


def test_update_refuses_an_unscored_group_before_any_work(learner_setup):
    learner, _, _, generated = learner_setup
    compiled = set(learner._compiled)
    groups, rewards = _groups(generated, [[1.0, 0.0], [1.0, 1.0]])
    groups[1].meta["worker"] = "rollout-1"
    groups[1].responses[0].outcome = None
    # No state: the check comes before packing, transfers and compilation.
    with pytest.raises(UnscoredGroupError, match="group for prompt 'b' from sampler 'jax-fp32' "
                                                 r"\(worker 'rollout-1'\) has 1 unscored"):
        learner.update(None, groups, rewards)
    assert set(learner._compiled) == compiled


def test_minibatches_without_failures_are_bitwise_the_previous_ones(learner_setup):
    # Nothing failed: every array of every minibatch is what packing the previous advantages
    # (no `trained` mask) gives, so the default experiment's numbers do not change.
    learner, _, _, generated = learner_setup
    groups, rewards = _groups(generated, [[1.0, 0.0], [1.0, 1.0]])
    ref_adv, ref_sign = _previous_group_advantages(groups, rewards, "grpo", use_zvp=True)
    flat = [(g.prompt_tokens, r) for g in groups for r in g.responses]
    for k, batch in enumerate(learner.minibatches(groups, rewards)):
        sl = slice(2 * k, 2 * k + 2)  # 2 rows per minibatch
        ref = learner.pack([p for p, _ in flat[sl]], [r.tokens for _, r in flat[sl]],
                           [r.logprobs for _, r in flat[sl]],
                           [r.routed_experts for _, r in flat[sl]], ref_adv[sl], ref_sign[sl])
        for name in batch.__dataclass_fields__:
            x, y = getattr(batch, name), getattr(ref, name)
            assert (x is None) == (y is None), name
            if isinstance(x, int):  # static (`RLBatch.shards`)
                assert x == y, name
            elif x is not None:
                assert x.dtype == y.dtype, name
                np.testing.assert_array_equal(x, y, err_msg=name)
        assert np.asarray(batch.loss_mask).sum() > 0


def test_update_leaves_failed_rewards_out_of_the_loss(learner_setup):
    learner, params, make_state, generated = learner_setup
    # Without the MoE aux loss a failed response's tokens (still run by the model) have no
    # gradient path left: the updates compare exactly to ones without those responses.
    c = learner.config
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    model_config = dataclasses.replace(learner.model_config, aux_loss_coef=0.0)
    lrn = Learner(c, model_config, learner.mesh, state_shardings)

    def first_update(batch):
        batch = jax.device_put(batch, lrn.batch_sharding)
        batch, m_old = lrn._old_pass(params, batch)
        _, m = lrn._train_step(make_state(params), batch, None)
        return {k: float(v) for k, v in {**m_old, **m}.items()}

    # Group "b" = [wrong, failed]: its known outcomes are all wrong (RL-ZVP sign -1 on b0 only);
    # read as wrong, the failed call would have made b0's advantage +1.
    groups, rewards = _groups(generated, [[1.0, 0.0], [0.0, 1.0]])
    groups[1].responses[1].outcome = False
    groups[1].meta["reward_failed"] = [1]
    rewards[1] = np.array([0.0, 0.0], np.float32)
    batches = lrn.minibatches(groups, rewards)
    mask = np.asarray(batches[1].loss_mask)
    order = np.asarray(batches[1].zv_sign)
    assert sorted(order.tolist()) == [-1.0, 0.0]  # b0 signed, b1 not
    n_b0 = len(generated[1].responses[0].tokens)
    assert sorted(mask.sum(axis=1).tolist()) == [0.0, n_b0]  # b1's row all zero
    np.testing.assert_array_equal(np.asarray(batches[1].advantages), [0.0, 0.0])
    # The same minibatch with group "b" = [b0] alone (b1 not in the batch at all).
    alone = RolloutGroup(prompt_id="b", prompt_tokens=groups[1].prompt_tokens, policy_version=0,
                         sampler="jax-fp32", created_at=0.0, responses=groups[1].responses[:1],
                         n_experts=8)
    ref = lrn.minibatches([alone], [np.zeros(1, np.float32)])[0]
    got, want = first_update(batches[1]), first_update(ref)
    assert got["pg/loss"] != 0.0 and got["train/grad_norm"] > 0.0
    for key in ("pg/loss", "train/loss", "train/grad_norm", "entropy/mean", "mismatch/tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-9), key
    # Every call of group "b" failed: nothing of it trains (no loss, no gradient, no sign).
    groups[1].responses[0].outcome = False
    groups[1].meta["reward_failed"] = [0, 1]
    dead = lrn.minibatches(groups, rewards)[1]
    for field in ("loss_mask", "advantages", "zv_sign"):
        assert not np.asarray(getattr(dead, field)).any(), field
    m = first_update(dead)
    assert m["pg/loss"] == 0.0 and m["train/grad_norm"] == 0.0
    # `Learner.update` counts what it left out (group "a" trained as before).
    _, m = learner.update(make_state(params), groups, rewards)
    assert m["train/masked_failed_responses"] == 2.0 and np.isfinite(m["train/loss"])
    _, m = learner.update(make_state(params), *_groups(generated, [[1.0, 0.0], [0.0, 1.0]]))
    assert m["train/masked_failed_responses"] == 0.0


def test_update_mismatch_metrics_measure_a_known_shift(learner_setup):
    learner, params, make_state, generated = learner_setup
    # Behaviour log-probs 0.1 above the learner's on every response token:
    # |delta| = 0.1; log(pi_sampler / pi_learner) = 0.1, so the k3 KL estimate is
    # exp(-0.1) - 1 + 0.1 = 0.0048374 and the importance weight is exp(-0.1) = 0.904837.
    _, m = learner.update(make_state(params),
                          *_groups(generated, [[1.0, 0.0], [0.0, 1.0]], logp_shift=0.1))
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.1, abs=1e-4)
    assert m["mismatch/logp_abs_max"] == pytest.approx(0.1, abs=1e-3)
    assert m["mismatch/kl_k3"] == pytest.approx(0.0048374, abs=2e-5)
    assert m["mismatch/is_weight_max"] == pytest.approx(0.904837, abs=1e-3)
    # Benchmarks and the GPU check measure the same groups with the same function and names.
    groups, _ = _groups(generated, [[1.0, 0.0], [0.0, 1.0]], logp_shift=0.1)
    measured = mismatch.measure_mismatch(get_preset("tiny"), jax.device_get(params), groups,
                                         replay=True)
    assert set(measured) <= set(m)
    for key in ("mismatch/logp_abs_mean", "mismatch/logp_abs_max", "mismatch/kl_k3",
                "mismatch/is_weight_max", "mismatch/tokens", "moe/routing_flip_rate",
                "moe/routing_flip_rate/layer_1"):
        assert measured[key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), key


def test_worker_layout_reports_mismatch_apart_for_stale_groups(learner_setup):
    """In the worker layout `mismatch/*` is over the on-policy groups (staleness 0) and
    `mismatch_stale/*` over the stale ones: here group "b" is on-policy with its behaviour
    log-probs 0.1 above the learner's, "a" one version old with 0.3 above."""
    _, params, make_state, generated = learner_setup
    c = _learner_config()
    c.train.loop = "async"
    mesh = sharding.make_mesh(c.mesh, devices=jax.devices()[:2])
    state = make_state(params)
    learner = Learner(c, get_preset("tiny"), mesh, jax.tree.map(lambda x: x.sharding, state))
    stale, _ = _groups(generated[:1], [[1.0, 0.0]], logp_shift=0.3)
    fresh, _ = _groups(generated[1:], [[0.0, 1.0]], logp_shift=0.1)
    groups = [dataclasses.replace(stale[0], policy_version=4),
              dataclasses.replace(fresh[0], policy_version=5)]
    _, m = learner.update(state, groups, _rewards([[1.0, 0.0], [0.0, 1.0]]), policy_version=5)
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.1, abs=1e-4)
    assert m["mismatch_stale/logp_abs_mean"] == pytest.approx(0.3, abs=1e-4)
    # every response token counted once, on one side
    tokens = [sum(len(r.tokens) for r in g.responses) for g in groups]
    assert (m["mismatch_stale/tokens"], m["mismatch/tokens"]) == (tokens[0], tokens[1])
    assert 0 <= m["moe_stale/routing_flip_rate"] <= 1 and "moe/routing_flip_rate" in m


def test_update_skips_a_nan_minibatch(learner_setup):
    learner, params, make_state, generated = learner_setup
    state = make_state(params)
    before = _host((state.params, state.opt_state))
    # A NaN reward makes group "b"'s advantages (its whole minibatch) NaN: that update is
    # skipped and counted; group "a"'s minibatch still updates.
    state, m = learner.update(state, *_groups(generated, [[1.0, 0.0], [np.nan, 1.0]]))
    assert int(state.skipped) == 1 and int(state.step) == 2
    assert m["train/skipped_update"] == 0.5  # mean over the 2 minibatches
    assert any(not np.array_equal(x, y)
               for x, y in zip(before, _host((state.params, state.opt_state)), strict=True))
    # Every minibatch NaN: parameters and optimiser state stay bitwise as they were.
    before = _host((state.params, state.opt_state))
    state, m = learner.update(state, *_groups(generated, [[np.nan, 0.0], [np.nan, 1.0]]))
    assert int(state.skipped) == 3 and m["train/skipped_update"] == 1.0
    for x, y in zip(before, _host((state.params, state.opt_state)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_replay_modes(learner_setup):
    learner, params, make_state, generated = learner_setup
    c = learner.config
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    learners = {"r3": learner}
    for mode in ("r2", "off"):
        cm = c.copy_and_resolve_references()
        cm.train.replay = mode
        learners[mode] = Learner(cm, learner.model_config, learner.mesh, state_shardings)
    rewards = [[1.0, 0.0], [0.0, 1.0]]

    def first_update(mode, groups):
        """Metrics of the old-policy pass and the first optimiser update (both at `params`:
        later minibatches start from parameters that Adam's first step, lr * g / |g|, has
        moved by +-lr wherever float noise flips the sign of a near-zero gradient)."""
        lrn = learners[mode]
        batch = jax.device_put(lrn.minibatches(*groups)[0], lrn.batch_sharding)
        batch, m_old = lrn._old_pass(params, batch)
        _, m = lrn._train_step(make_state(params), batch, None)
        return {k: float(v) for k, v in {**m_old, **m}.items()}

    # True recordings: the fp32 engine routed exactly as the learner does, so replaying them
    # (r3), replaying the learner's own old routing (r2) or routing live (off) train alike.
    m3 = first_update("r3", _groups(generated, rewards))
    for mode in ("r2", "off"):
        m = first_update(mode, _groups(generated, rewards))
        for key in ("train/loss", "train/grad_norm", "pg/loss"):
            assert m[key] == pytest.approx(m3[key], rel=1e-5, abs=1e-9), (mode, key)
    # Recordings forced to experts {0, 1} at every token: the flip rate reports the
    # disagreement, and only r3 trains through the forced experts.
    forced = _groups(generated, rewards)
    for g in forced[0]:
        for r in g.responses:
            r.routed_experts = np.where(r.routed_experts >= 0, np.array([0, 1], np.int16), -1)
    f3, f2 = first_update("r3", forced), first_update("r2", forced)
    assert m3["moe/routing_flip_rate"] == 0.0 and f3["moe/routing_flip_rate"] > 0.5
    assert f3["mismatch/logp_abs_mean"] > 10 * m3["mismatch/logp_abs_mean"]
    assert f3["train/grad_norm"] != pytest.approx(m3["train/grad_norm"], rel=1e-3)
    for key in ("train/loss", "train/grad_norm"):  # r2 ignores the recordings
        assert f2[key] == pytest.approx(m3[key], rel=1e-5, abs=1e-9), key


def test_single_minibatch_update_fuses_the_old_policy_pass(learner_setup):
    # A rollout batch of one minibatch takes one update at the old parameters, so the update's
    # own forward supplies the old log-probs: the same loss, gradient and mismatch metrics as
    # the separate old-policy pass followed by the update, one forward fewer.
    learner, params, make_state, generated = learner_setup
    c = learner.config.copy_and_resolve_references()
    c.train.updates_per_batch = 1
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    lrn = Learner(c, learner.model_config, learner.mesh, state_shardings)
    # Contrast in group "a", an all-correct group "b" (RL-ZVP reads the old entropies), and a
    # behaviour log-prob shift the mismatch metrics must see.
    groups = _groups(generated, [[1.0, 0.0], [1.0, 1.0]], logp_shift=0.05)
    batch = jax.device_put(lrn.minibatches(*groups)[0], lrn.batch_sharding)
    batch, m_old = lrn._old_pass(params, batch)
    _, m_sep = lrn._train_step(make_state(params), batch, None)
    expected = {k: float(v) for k, v in {**m_old, **m_sep}.items()}
    state, m = lrn.update(make_state(params), *groups)
    assert int(state.step) == 1 and {name for name, _ in lrn._compiled} == {"fused_step"}
    for key in ("train/loss", "train/grad_norm", "pg/loss", "mismatch/logp_abs_mean",
                "mismatch/logp_abs_max", "mismatch/kl_k3", "entropy/mean",
                "moe/routing_flip_rate"):
        assert m[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert m["mismatch/logp_abs_mean"] == pytest.approx(0.05, abs=1e-4)
    # XLA's memory report of the compiled update: its arguments hold the train state, at least
    # parameters plus Adam's two moments in fp32.
    n_params = sum(x.size for x in jax.tree.leaves(params))
    report = lrn.memory_report["fused_step"]
    assert report["argument"] >= 3 * 4 * n_params and report["temp"] > 0


@pytest.mark.parametrize("updates,anchor", [(1, True), (2, False)])
def test_grad_threads_update_as_one_program(learner_setup, updates, anchor):
    # On a one-device mesh, train.grad_threads = 2 splits each update's rows (and the anchor's)
    # in two parts whose gradients two threads compute at once, joined by weight: the update one
    # program makes (fused: one minibatch of 4 rows, with the supervised anchor's 4 worked
    # solutions; updates=2: two minibatches of 2 after an old-policy pass).
    learner, params, make_state, generated = learner_setup
    mesh_config = learner.config.mesh.copy_and_resolve_references()
    mesh_config.data = 1
    mesh = sharding.make_mesh(mesh_config, devices=jax.devices()[:1])
    one_device = jax.device_put(jax.device_get(params), sharding.replicated(mesh))
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(one_device))
    groups = _groups(generated, [[1.0, 0.0], [0.0, 1.0]], logp_shift=0.05)
    runs = {}
    for threads in (1, 2):
        c = learner.config.copy_and_resolve_references()
        c.mesh.data, c.train.grad_threads, c.train.updates_per_batch = 1, threads, updates
        c.train.anchor_coef, c.train.anchor_rows = (0.5, 4) if anchor else (0.0, 0)
        # No MoE aux loss: it is each part's own router statistics (as with micro-batches).
        lrn = Learner(c, learner.model_config.replace(aux_loss_coef=0.0), mesh, state_shardings)
        assert lrn.grad_threads == threads and (lrn._pool is not None) == (threads > 1)
        if anchor:  # worked solutions of different lengths: the halves weigh differently
            tok = CharTokenizer()
            lrn.set_anchor([{"prompt_id": f"p{i}", "tokens": tok.encode(f"{i}+{i}=", add_bos=True),
                             "solution": f"{i}+{i}={2 * i}#{2 * i}"} for i in (3, 40, 400, 5)],
                           tok, 32)
        state, m = lrn.update(make_state(one_device), *groups)
        runs[threads] = (_host(state.params), m, {name for name, _ in lrn._compiled})
    (p1, m1, names1), (p2, m2, names2) = runs[1], runs[2]
    assert names2 == ({"fused_part", "anchor_part", "apply_parts"} if updates == 1
                      else {"old_pass", "part", "apply_parts"})
    assert names1 == ({"fused_step"} if updates == 1 else {"old_pass", "train_step"})
    for key in ("train/loss", "pg/loss", "train/grad_norm", "mismatch/logp_abs_max",
                "mismatch/kl_k3") + (("anchor/nll",) if anchor else ()):
        assert m2[key] == pytest.approx(m1[key], rel=1e-4, abs=1e-6), key
    assert m2["mismatch/logp_abs_mean"] == pytest.approx(0.05, abs=1e-4)
    # Adam's first steps move each weight by about lr = 1e-2 either way: the same moves.
    for a, b in zip(p1, p2, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-3)


def test_old_policy_pass_runs_the_forward_only_dispatch(learner_setup):
    """The passes without a gradient run the looped dropless dispatch (the default, and what
    `ModelConfig.forward_only` makes of the gathered one): the old log-probs, entropies and
    metrics are the gathered dispatch's, the routing exactly. Two programs summing the experts'
    products in different orders: logits within the fp32 bound (helpers/fp32.py) of 2 layers x
    the longest reduction (d_ff 128) x eps x max |logit|; a log-prob z_t - lse(z) and an entropy
    lse(z) - sum p z move by at most twice the logits' largest change."""
    import functools

    from espo_jax.models import forward
    from espo_jax.train import step as step_lib

    learner, params, _, generated = learner_setup
    config = learner.model_config
    assert config.dispatch == "dropless_loop"
    assert config.replace(dispatch="dropless").forward_only().dispatch == "dropless_loop"
    groups = _groups(generated, [[1.0, 0.0], [1.0, 1.0]], logp_shift=0.05)
    batch = jax.device_put(learner.minibatches(*groups)[0], learner.batch_sharding)
    looped, m_looped = learner._old_pass(params, batch)
    gathered, m_gathered = jax.jit(functools.partial(
        step_lib.old_policy_pass, model_config=config.replace(dispatch="dropless"),
        replay=learner.config.train.replay, chunk_size=learner.config.train.logprob_chunk),
        compiler_options=step_lib.compiler_options())(params, batch)
    logits = jax.jit(lambda p, b: forward(config, p, b.tokens, positions_BxT=b.positions,
                                          segment_ids_BxT=b.segment_ids).logits)(params, batch)
    reduction = max(config.d_model, config.d_ff, config.d_expert, batch.tokens.shape[1])
    bound = 2 * fp32_bound(config.n_layers, reduction, np.max(np.abs(logits)))
    np.testing.assert_allclose(looped.old_logp, gathered.old_logp, atol=bound, rtol=0)
    np.testing.assert_allclose(looped.old_entropy, gathered.old_entropy, atol=bound, rtol=0)
    np.testing.assert_array_equal(looped.old_routed_experts, gathered.old_routed_experts)
    assert m_looped.keys() == m_gathered.keys()
    for k in m_looped:  # means, maxima and exp of the log-probs: within the bound, relatively
        a, b = float(m_looped[k]), float(m_gathered[k])
        assert abs(a - b) <= bound * max(1.0, abs(b)), (k, a, b)


def _response_logp(model_config, params, group, j):
    """Teacher-forced log-prob of response j of `group` under `params` (fp32, own routing)."""
    from espo_jax.train.step import sequence_logprobs

    prompt, resp = list(group.prompt_tokens), list(group.responses[j].tokens)
    full = prompt + resp
    tokens = jnp.asarray([full[:-1]], jnp.int32)
    targets = jnp.asarray([full[1:]], jnp.int32)
    positions = jnp.arange(len(full) - 1, dtype=jnp.int32)[None]
    # one program (run op by op, a forward compiles each of its ~300 ops on its own)
    logp, _, _ = jax.jit(sequence_logprobs, static_argnums=(0, 6))(
        model_config, params, tokens, positions, targets, None, 16)
    return float(jnp.sum(logp[0, len(prompt) - 1:]))


def _scored_response(model_config, params, prompt, text):
    """A Response whose tokens are `text` + eos, with the behaviour log-probs and routed experts
    the fp32 engine would record for them (teacher-forced; the last token is never fed, -1)."""
    from espo_jax.models import forward

    tokens = CharTokenizer().encode(text, add_eos=True)
    seq = jnp.asarray([list(prompt) + tokens], jnp.int32)
    out = jax.jit(forward, static_argnums=0)(model_config, params, seq)
    logp = jax.nn.log_softmax(out.logits[0, :-1].astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp, seq[0, 1:, None], axis=-1)[len(prompt) - 1:, 0]
    experts = np.array(out.routed_experts[0], np.int16)
    experts[-1] = -1
    return Response(tokens=tokens, logprobs=np.asarray(logp), routed_experts=experts,
                    finish_reason="stop")


def test_update_moves_probability_towards_the_rewarded_response(learner_setup):
    # The direction of the policy gradient, end to end: in group "a" response 0 is right and
    # response 1 wrong (GRPO advantages +1 / -1); one update must raise the log-probability of
    # the first and lower that of the second. The two responses are written, not sampled, so
    # they differ from their first token on (two equal samples would carry no contrast).
    learner, params, make_state, generated = learner_setup
    model_config = get_preset("tiny")
    host = jax.device_get(params)
    prompt = generated[0].prompt_tokens
    a = dataclasses.replace(generated[0], responses=[
        _scored_response(model_config, host, prompt, text) for text in ("15", "9")])
    groups = _groups([a, generated[1]], [[1.0, 0.0], [0.0, 1.0]])
    before = [_response_logp(model_config, params, a, j) for j in (0, 1)]
    state, _ = learner.update(make_state(params), *groups)
    after = [_response_logp(model_config, state.params, a, j) for j in (0, 1)]
    assert after[0] > before[0] and after[1] < before[1], (before, after)


def test_kl_penalty_pulls_towards_the_reference(learner_setup):
    learner, params, make_state, generated = learner_setup
    c = learner.config.copy_and_resolve_references()
    c.loss.kl_coef = 1.0
    c.zve.zvp.enabled = False  # with no contrast in any group, only the KL term has a gradient
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    lrn = Learner(c, learner.model_config, learner.mesh, state_shardings)
    flat = _groups(generated, [[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="set_reference"):
        lrn.update(make_state(params), *flat)
    lrn.set_reference(params)

    def kl_at(p):
        batch = jax.device_put(lrn.minibatches(*flat)[0], lrn.batch_sharding)
        batch, _ = lrn._old_pass(p, batch)
        batch = lrn._ref_pass(lrn.ref_params, batch)
        _, m = lrn._train_step(make_state(p), batch, None)
        return float(m["kl/mean"])

    assert abs(kl_at(params)) < 1e-6  # the policy is its own reference
    # Two policy-gradient updates at lr 1e-2 (the plain learner) move the policy away...
    state, _ = learner.update(make_state(params), *_groups(generated, [[1.0, 0.0], [0.0, 1.0]]))
    moved = jax.tree.map(lambda x: x + 0, state.params)
    kl_moved = kl_at(moved)
    assert kl_moved > 1e-4
    # ...and updates with the KL term alone bring it back (k3 estimate of KL(pi || ref)). Adam
    # at lr 1e-2 may overshoot in its first updates; six bring it well inside a quarter.
    state = make_state(moved)
    for _ in range(6):
        state, m = lrn.update(state, *flat)
    assert kl_at(state.params) < 0.25 * kl_moved


def test_anchor_teaches_worked_solutions_during_rl(learner_setup):
    # train.anchor_coef: each update adds the cross-entropy of worked solutions. With no contrast
    # in any group (and RL-ZVP off) the RL gradient is zero, so the anchor alone must lower the
    # solutions' NLL; the rows drawn depend only on (seed, optimiser step).
    learner, params, make_state, generated = learner_setup
    c = learner.config.copy_and_resolve_references()
    c.train.anchor_coef = 1.0
    c.train.anchor_rows = 2
    c.zve.zvp.enabled = False
    tok = CharTokenizer()
    prompts = [{"prompt_id": f"p{i}", "tokens": tok.encode(f"{i}+{i}=", add_bos=True),
                "solution": f"{i}+{i}={2 * i}#{2 * i}"} for i in range(4)]
    state_shardings = jax.tree.map(lambda x: x.sharding, make_state(params))
    lrn = Learner(c, learner.model_config, learner.mesh, state_shardings)
    flat = _groups(generated, [[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="set_anchor"):
        lrn.update(make_state(params), *flat)
    with pytest.raises(ValueError, match="warmstart.levels"):
        lrn.set_anchor([], tok, 16)
    lrn.set_anchor(prompts, tok, 16)
    first = lrn.anchor_batch(0)
    np.testing.assert_array_equal(first["tokens"], lrn.anchor_batch(0)["tokens"])
    assert first["tokens"].shape == (2, 16) and first["mask"].sum() > 0
    state, m0 = lrn.update(make_state(params), *flat)
    assert int(state.step) == 2 and m0["anchor/nll"] > 0
    for _ in range(3):
        state, m = lrn.update(state, *flat)
    assert m["anchor/nll"] < 0.8 * m0["anchor/nll"], (m0["anchor/nll"], m["anchor/nll"])
    assert learner.anchor_batch(0) is None  # anchor_coef 0: no rows, the step ignores it


def test_overlong_buffer_adds_dapo_penalty_before_advantages(learner_setup):
    learner = learner_setup[0]
    # One group, equal rewards, responses of 3 and 8 tokens (max_new_tokens 8). Buffer 4: the
    # soft limit is 8 - 4 = 4, so length 3 gets 0 and length 8 gets (4 - 8) / 4 = -1.
    responses = [Response(tokens=np.full(n, 5, np.int32), logprobs=np.zeros(n, np.float32),
                          routed_experts=None, finish_reason="length", outcome=True, reward=1.0)
                 for n in (3, 8)]
    group = RolloutGroup(prompt_id="p", prompt_tokens=np.array([1, 7], np.int32),
                         policy_version=0, sampler="jax-fp32", created_at=0.0,
                         responses=responses, n_experts=None)
    rewards = [np.array([1.0, 1.0], np.float32)]
    try:
        plain = learner.minibatches([group], rewards)[0]
        learner.config.advantage.overlong_buffer = 4
        punished = learner.minibatches([group], rewards)[0]
    finally:
        learner.config.advantage.overlong_buffer = 0
    def by_length(batch):  # the batch's rows are in its own order: key them by response length
        lengths = np.asarray(batch.loss_mask).sum(axis=1)
        adv = np.asarray(batch.advantages)
        return {int(n): float(a) for n, a in zip(lengths, adv, strict=True) if n}

    assert by_length(plain) == {3: 0.0, 8: 0.0}
    # Rewards 1 + 0 and 1 - 1: GRPO advantages (r - mean) / std = +1, -1.
    got = by_length(punished)
    assert got == {3: pytest.approx(1.0, abs=1e-5), 8: pytest.approx(-1.0, abs=1e-5)}
