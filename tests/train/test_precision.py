"""Mixed precision as the learner trains at scale: float32 master parameters whatever the
checkpoint's dtype, compute in the model's dtype (bf16), gradients accumulated over micro-batches
in float32, AdamW moments float32 (bf16 as an option), rollout weights published in the compute
dtype. A scale experiment's update (its dtype, loss, replay and micro-batches; tiny shapes) runs."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from espo_jax import configs
from espo_jax.bench.packing import sequences
from espo_jax.models import get_preset, init_params
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.run_setup import MASTER_DTYPE, preset_model_config, runtime_overrides
from espo_jax.train import state as state_lib
from espo_jax.train import step as step_lib
from espo_jax.train.accumulation import accumulate_gradients
from espo_jax.train.async_loop import rollout_weights
from espo_jax.train.batch import pack_sequences

BF16 = get_preset("tiny", dtype="bfloat16")  # param_dtype float32: the masters
SEQ_LEN, ROWS = 24, 8
EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)  # 2^-7


def _batch(config, rows=ROWS, seed=0):
    args = sequences(config, rows, prompt_len=(2, 6), response_len=(4, SEQ_LEN),
                     max_len=SEQ_LEN, seed=seed)
    return jax.tree.map(jnp.asarray, pack_sequences(
        *args, rows=rows, seq_len=SEQ_LEN, pad_id=0,
        moe_shape=(config.n_moe_layers, config.top_k), pack=False))


def _optim(**kw) -> ml_collections.ConfigDict:
    optim = configs.default_config().optim
    optim.update(warmup_steps=0, final_lr_frac=1.0, **kw)
    return optim


def _grad_kw(config, n_micro):
    loss_config = paper_loss_config("espo")
    loss_config.vocab_size = config.vocab_size
    return dict(model_config=config, loss_config=loss_config, replay="r3", chunk_size=8,
                zvp_alpha=0.0, n_micro=n_micro, fused=True)


def test_master_dtype_is_every_runs_parameter_dtype():
    """Every run's learner holds float32 parameters, a bf16 preset's (a scale experiment's)
    included; its compute dtype stays bf16."""
    c = configs.experiment_config("qwen3_30b_a3b")
    model = preset_model_config(c)
    assert get_preset(c.model.preset).param_dtype == "bfloat16"
    assert (model.param_dtype, model.dtype) == (MASTER_DTYPE, "bfloat16") == ("float32",
                                                                               "bfloat16")


def test_bf16_micro_batches_trace_and_equal_one_micro_batch():
    """bf16 compute over 2 micro-batches (the carry float32 from the start: a bf16 carry with a
    float32 result is what lax.scan refuses) equals the whole batch in one, in float32
    gradients. The two programs round the same bf16 products with batch shapes of 4 and 8 rows,
    so an activation may land one bf16 ulp apart: through 2 layers the gradients' norm differs
    by at most ~2 x 2 eps_bf16 of itself (eps_bf16 = 2^-7)."""
    params = init_params(BF16, jax.random.key(0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    batch = _batch(BF16)
    grads = {n: jax.jit(functools.partial(step_lib.rl_part_gradients, **_grad_kw(BF16, n)))(
        params, batch) for n in (1, 2)}
    (loss_1, g_1, _, _), (loss_2, g_2, _, _) = grads[1], grads[2]
    assert {x.dtype for x in jax.tree.leaves(g_2)} == {jnp.dtype(jnp.float32)}
    norm = lambda t: float(jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2)  # noqa: E731
                                        for x in jax.tree.leaves(t))))
    assert norm(g_1) > 0
    diff = norm(jax.tree.map(jnp.subtract, g_1, g_2))
    assert diff <= 4 * EPS_BF16 * norm(g_1), (diff, norm(g_1))
    assert abs(float(loss_1) - float(loss_2)) <= 4 * EPS_BF16 * max(abs(float(loss_1)), 1e-3)


def test_bf16_parameters_micro_batches_trace():
    """The crash the scale configs had: bf16 parameters, 2 micro-batches (the old carry started
    bf16 and came back float32). The accumulated gradients are float32."""
    config = BF16.replace(param_dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    _, grads, _, _ = jax.jit(functools.partial(step_lib.rl_part_gradients,
                                               **_grad_kw(config, 2)))(params, _batch(config))
    assert {x.dtype for x in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def _moves(config, optim, steps=20):
    """The parameters after `steps` AdamW updates at `optim.lr` from the same float32 init (cast
    to `config.param_dtype`), the RL loss recomputed each step; and the final opt state."""
    params = jax.tree.map(lambda x: x.astype(config.param_dtype),
                          init_params(config.replace(param_dtype="float32"), jax.random.key(0)))
    tx = state_lib.make_optimizer(optim, total_steps=steps)
    state = state_lib.create_train_state(params, tx, jax.random.key(0))
    step = jax.jit(functools.partial(step_lib.rl_train_step, **_grad_kw(config, 1)))
    batch = _batch(config)
    for _ in range(steps):
        state, metrics = step(state, batch)
        assert float(metrics["train/skipped_update"]) == 0.0
    return params, state


def test_lr_1e_6_moves_the_master_weights():
    """20 steps at the paper's lr 1e-6: with bf16 compute the float32 masters move as the fp32
    learner's do (Adam's step is ~lr per element whatever the gradient's scale, so each moves by
    up to 20 lr; bf16 gradients change the steps' sizes little); bf16 moments move them too. Kept
    in bf16, the weights of the matrices (init scale 0.02, bf16 spacing 2^-13 ~ 1.2e-4 there,
    60x a step) mostly do not move at all."""
    optim = _optim(lr=1e-6)
    start, fp32 = _moves(get_preset("tiny"), optim)
    _, master = _moves(BF16, optim)
    _, narrow_moments = _moves(BF16, _optim(lr=1e-6, moment_dtype="bfloat16"))
    assert {x.dtype for x in jax.tree.leaves(narrow_moments.opt_state)
            if x.ndim} == {jnp.dtype(jnp.bfloat16)}

    def delta(state):
        return np.concatenate([np.ravel(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                               for a, b in zip(jax.tree.leaves(state.params),
                                               jax.tree.leaves(start), strict=True)])

    ref = delta(fp32)
    moving = ref != 0  # not the embedding rows of absent tokens, nor experts no token chose
    # Adam's step is about lr per element at most (Kingma & Ba, section 2.1; the bias
    # corrections let a step exceed it a little while the moments warm up)
    assert np.mean(moving) > 0.9 and np.max(np.abs(ref)) <= 20 * 1e-6 * 1.2
    for state in (master, narrow_moments):
        got = delta(state)
        assert np.mean(got[moving] == 0) < 0.01
        # the same direction and size as the fp32 learner's, up to the bf16 gradients' noise
        cos = float(got @ ref / np.linalg.norm(got) / np.linalg.norm(ref))
        assert cos > 0.9 and abs(np.linalg.norm(got) / np.linalg.norm(ref) - 1) < 0.1

    _, old = _moves(BF16.replace(param_dtype="bfloat16"), optim)
    start_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), start)
    unchanged = np.concatenate([np.ravel(np.asarray(a) == np.asarray(b)) for a, b in zip(
        jax.tree.leaves(old.params), jax.tree.leaves(start_bf16), strict=True)])
    assert np.mean(unchanged[moving]) > 0.9, np.mean(unchanged[moving])


def test_rollout_weights_are_the_compute_dtype():
    """A published version holds bf16 weights for a bf16 model (the sigmoid router's
    correction bias float32, as checkpoints hold it); an fp32 model's are its own."""
    config = get_preset("tiny_deepseek_v3", dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    pub_config, pub = rollout_weights(config, params)
    assert pub_config.param_dtype == "bfloat16"
    flat = jax.tree_util.tree_flatten_with_path(pub)[0]
    for path, x in flat:
        want = (jnp.float32 if jax.tree_util.keystr(path).endswith("['e_score_correction_bias']")
                else jnp.bfloat16)
        assert x.dtype == want, jax.tree_util.keystr(path)
    assert any(x.dtype == jnp.float32 for _, x in flat)
    same_config, same = rollout_weights(get_preset("tiny"), params)
    assert same_config.param_dtype == "float32"
    assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(params),
                                      strict=True))


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "glm45_air"])
def test_scale_experiment_update_runs(name):
    """The experiment's update as it runs it (bf16 compute on float32 masters, its loss, R3
    replay, its micro-batches: one row each, as on one data shard; its optimiser past the
    warm-up), on its family at tiny size (the `:small` variant's preset): finite, and the
    parameters move at its lr 1e-6."""
    c = configs.experiment_config(name)
    tiny = configs.experiment_config(name, "small").model.preset
    config = get_preset(tiny, **runtime_overrides(c), dtype=get_preset(c.model.preset).dtype)
    assert (config.dtype, config.param_dtype) == ("bfloat16", "float32")
    n_micro = c.train.micro_batches
    assert n_micro > 1
    params = init_params(config, jax.random.key(0))
    optim = c.optim.copy_and_resolve_references()
    optim.warmup_steps = 0  # its lr from the first update (the warm-up starts at 0)
    tx = state_lib.make_optimizer(optim, total_steps=c.train.steps)
    state = state_lib.create_train_state(params, tx, jax.random.key(0))
    loss_config = c.loss.copy_and_resolve_references()
    loss_config.vocab_size = config.vocab_size
    step = jax.jit(functools.partial(
        step_lib.rl_train_step, model_config=config, loss_config=loss_config,
        replay=c.train.replay, chunk_size=8, zvp_alpha=0.0, n_micro=n_micro, fused=True))
    new, metrics = step(state, _batch(config, rows=n_micro))
    assert float(metrics["train/skipped_update"]) == 0.0
    assert np.isfinite(float(metrics["train/loss"])) and float(metrics["train/grad_norm"]) > 0
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new.params),
                                                      jax.tree.leaves(params), strict=True)]
    assert np.mean(moved) > 0.9


@pytest.mark.parametrize("preset, micro", [("tiny_glm45", (1, 2)), ("tiny_deepseek_v3", (2,)),
                                           ("tiny_qwen35_moe", (2,))])
def test_micro_batches_differentiate_the_compute_dtype_copy(preset, micro):
    """Over micro-batches the learner differentiates the leaves the model reads only in bf16
    cast once (`precision.compute_params`), so no float32 gradient of the experts is held per
    micro-batch. The forward on the cast copy is the forward on the masters bit for bit (a leaf
    read in float32, such as the router's kernel, cast by mistake would change the loss), and
    each gradient is the same bf16 product: the accumulated float32 gradients are the masters'
    up to one bf16 rounding of each micro-batch's product, |d| <= u_bf16 (|w1 g1| + |w2 g2|)
    with u_bf16 = 2^-8, bounded here by n u_bf16 max|g| per leaf over n micro-batches; one
    micro-batch differentiates the cast copy too (GLM: its q/k/v biases are cast)."""
    from espo_jax.models import precision

    config = get_preset(preset, dtype="bfloat16")
    params = init_params(config, jax.random.key(0))
    cast = precision.compute_params(config, params)
    flat = {jax.tree_util.keystr(p): x.dtype for p, x in
            jax.tree_util.tree_flatten_with_path(cast)[0]}
    assert {d for k, d in flat.items() if "'router'" in k} == {jnp.dtype(jnp.float32)}
    assert {d for k, d in flat.items() if k.endswith(("['wi_gate']", "['wo']"))} == {
        jnp.dtype(jnp.bfloat16)}
    assert flat["['embed']['embedding']"] == jnp.float32
    batch = _batch(config)
    kw = _grad_kw(config, 2)
    loss_fn = functools.partial(step_lib.rl_loss, **{k: v for k, v in kw.items()
                                                      if k != "n_micro"})
    accumulate = jax.jit(lambda p, model_config, n: accumulate_gradients(
        loss_fn, p, batch, n, model_config=model_config)[:2], static_argnums=(1, 2))
    u = 2.0 ** -8
    for n in micro:
        (loss_ref, g_ref), (loss_cast, g_cast) = (accumulate(params, None, n),
                                                  accumulate(params, config, n))
        assert float(loss_cast) == float(loss_ref)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g_cast))
        for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_ref)[0],
                                jax.tree.leaves(g_cast), strict=True):
            a = np.asarray(a)
            np.testing.assert_allclose(np.asarray(b), a, rtol=0, atol=n * u * np.abs(a).max(),
                                       err_msg=f"{n} micro-batches {jax.tree_util.keystr(path)}")
