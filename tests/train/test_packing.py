"""Sequence packing: the learner's loss, gradients, log-probs and routing are those of one row
per sequence, for every loss, with router replay, fused and after an old-policy pass; so are
they with a prompt's responses sharing one copy of it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from espo_jax.bench.packing import sequences
from espo_jax.models import get_preset, init_params
from espo_jax.rl.loss_config import paper_loss_config
from espo_jax.rl.losses import LOSSES
from espo_jax.train import step as step_lib
from espo_jax.train.accumulation import join_parts
from espo_jax.train.batch import pack_sequences

CONFIG = get_preset("tiny")
SEQ_LEN, ROWS = 24, 16


def _sequences(seed=0):
    """12 prompt + response pairs of mixed lengths (some response-less), recorded routing of
    distinct experts on every token but the last, behaviour log-probs near the policy's."""
    return sequences(CONFIG, 12, prompt_len=(1, 6), response_len=(0, SEQ_LEN), max_len=SEQ_LEN,
                     seed=seed)


def _batches():
    args = _sequences()
    kw = dict(rows=ROWS, seq_len=SEQ_LEN, pad_id=0, moe_shape=(CONFIG.n_moe_layers,
                                                               CONFIG.top_k))
    return (jax.tree.map(jnp.asarray, pack_sequences(*args, **kw, pack=False)),
            jax.tree.map(jnp.asarray, pack_sequences(*args, **kw, pack=True)))


@pytest.fixture(scope="module")
def setup():
    return init_params(CONFIG, jax.random.key(0)), _batches()


def test_packing_fills_fewer_rows_and_keeps_every_token(setup):
    _, (padded, packed) = setup
    # Mixed lengths: the 12 sequences' tokens fit in fewer rows than one row each.
    n_tokens = int(np.sum(np.asarray(padded.segment_ids) > 0))
    assert packed.tokens.shape[0] < 12 <= padded.tokens.shape[0]
    assert int(np.sum(np.asarray(packed.segment_ids) > 0)) == n_tokens
    # The unpack map takes each sequence's inputs, targets and routing back to its own row.
    flat = np.asarray(packed.unpack)
    has = flat < packed.tokens.size
    for name in ("tokens", "targets"):
        got = np.asarray(getattr(packed, name)).reshape(-1)[np.where(has, flat, 0)]
        np.testing.assert_array_equal(np.where(has, got, 0),
                                      np.where(has, np.asarray(getattr(padded, name)), 0))
    routed = np.asarray(packed.routed_experts).reshape(-1, CONFIG.n_moe_layers, CONFIG.top_k)
    np.testing.assert_array_equal(routed[flat[has]], np.asarray(padded.routed_experts)[has])
    np.testing.assert_array_equal(has, np.asarray(padded.segment_ids) > 0)


def test_sequences_of_one_length_stay_one_per_row():
    """Sequences of 24 inputs (SEQ_LEN), two to a packed row of 48: 16 of them fill 8 rows,
    the 384 positions of one row each, so the batch is not packed (the same work on rows half
    as long); 12 of them fill 6 rows (288 positions against 384) and are packed."""
    def batch(n):
        args = sequences(CONFIG, n, prompt_len=(4, 4), response_len=(21, 21), max_len=SEQ_LEN + 1)
        return pack_sequences(*args, rows=ROWS, seq_len=SEQ_LEN, pad_id=0, pack=True,
                              moe_shape=(CONFIG.n_moe_layers, CONFIG.top_k))
    full, twelve = batch(16), batch(12)
    assert full.unpack is None and full.tokens.shape == (ROWS, SEQ_LEN)
    assert int(np.sum(full.segment_ids > 0)) == 16 * SEQ_LEN
    assert twelve.unpack is not None and twelve.tokens.shape == (6, 2 * SEQ_LEN)


def _assert_gradients_close(got, want):
    """Every gradient within 1e-5 of the largest gradient entry of `want`."""
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    scale = max(float(jnp.max(jnp.abs(g))) for g in flat_want)
    for a, b in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)


def _loss_fn(loss_name, replay, fused):
    """`rl_loss(params, batch)` of the paper's `loss_name` config on CONFIG, with its grads."""
    loss_config = paper_loss_config(loss_name)
    loss_config.vocab_size = CONFIG.vocab_size
    fn = functools.partial(step_lib.rl_loss, model_config=CONFIG, replay=replay, chunk_size=8,
                           loss_config=loss_config, zvp_alpha=0.0, fused=fused)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _loss_and_grads(old_params, params, batch, loss_name, replay, fused):
    if not fused:
        batch, _ = jax.jit(functools.partial(step_lib.old_policy_pass, model_config=CONFIG,
                                             replay=replay, chunk_size=8))(old_params, batch)
    (loss, metrics), grads = _loss_fn(loss_name, replay, fused)(params, batch)
    return loss, metrics, grads


# Every aggregation (ESPO's group mean, DAPO's token mean, the sequence means) and every
# ratio level (token, sequence, ESPO's entropy groups), fused and after an old-policy pass.
CASES = [("espo", "r3", True), ("dapo", "r3", True), ("gspo", "r3", True),
         ("espo", "r2", False), ("gspo_token", "off", False), ("grpo", "off", False)]


def test_the_cases_cover_every_loss():
    assert {name for name, _, _ in CASES} == set(LOSSES)


@pytest.mark.parametrize("loss_name,replay,fused", CASES)
def test_packed_loss_and_gradients_equal_the_padded_ones(setup, loss_name, replay, fused):
    params, (padded, packed) = setup
    # Off the fused path the loss is taken at perturbed parameters: ratios depart from 1.
    at = params if fused else jax.tree.map(lambda p: p * 1.05, params)
    loss_a, m_a, g_a = _loss_and_grads(params, at, padded, loss_name, replay, fused)
    loss_b, m_b, g_b = _loss_and_grads(params, at, packed, loss_name, replay, fused)
    assert np.isfinite(float(loss_a)) and abs(float(loss_a)) > 1e-6
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5, atol=1e-7)
    for key in ("pg/loss", "moe/aux_loss"):
        np.testing.assert_allclose(float(m_b[key]), float(m_a[key]), rtol=1e-5, atol=1e-7)
    _assert_gradients_close(g_b, g_a)


@pytest.mark.parametrize("loss_name,replay,fused", [CASES[0], CASES[3]])
def test_packed_over_data_shards_gathers_on_each_device(setup, loss_name, replay, fused):
    """Packed for 4 data shards (each shard's 4 sequences in its own rows, its index maps
    within them, `RLBatch.shards`) and run on a 4-device data mesh: the loss and gradients of
    one row per sequence, and the sequences' outputs are gathered where they are, with no
    all-to-all between the devices (global indices resharded the hidden states for it)."""
    params, (padded, _) = setup
    args = _sequences()
    packed = pack_sequences(*args, rows=ROWS, seq_len=SEQ_LEN, pad_id=0, n_shards=4,
                            moe_shape=(CONFIG.n_moe_layers, CONFIG.top_k), pack=True,
                            head_len=SEQ_LEN)
    assert packed.shards == 4 and packed.tokens.shape[0] % 4 == 0
    block = packed.tokens.size // 4
    assert np.asarray(packed.unpack).max() == block  # local: at most the "none" index
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    packed = jax.device_put(jax.tree.map(jnp.asarray, packed), rows)
    at = params if fused else jax.tree.map(lambda p: p * 1.05, params)
    loss_a, _, g_a = _loss_and_grads(params, at, padded, loss_name, replay, fused)
    loss_b, _, g_b = _loss_and_grads(params, at, packed, loss_name, replay, fused)
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5, atol=1e-7)
    _assert_gradients_close(g_b, g_a)
    hlo = _loss_fn(loss_name, replay, True).lower(at, packed).compile().as_text()
    assert "all-to-all" not in hlo


# ESPO's group mean (fused), DAPO's token mean, a sequence mean after an old-policy pass.
@pytest.mark.parametrize("loss_name,replay,fused", [CASES[0], CASES[1], CASES[-1]])
def test_parts_join_to_the_whole_batch(setup, loss_name, replay, fused):
    # An update's rows in two parts of unequal weight (8 and 4 of the 12 sequences, each packed
    # on its own), their gradients joined by weight (`train.grad_threads`): the loss, gradients
    # and metrics of the whole batch. The MoE aux loss is each part's own (router statistics
    # over its tokens), so it is switched off here.
    params, _ = setup
    config = CONFIG.replace(aux_loss_coef=0.0)
    args = _sequences()
    kw = dict(seq_len=SEQ_LEN, pad_id=0, moe_shape=(CONFIG.n_moe_layers, CONFIG.top_k),
              pack=True)
    whole = jax.tree.map(jnp.asarray, pack_sequences(*args, rows=ROWS, **kw))
    parts = [jax.tree.map(jnp.asarray, pack_sequences(
        *[[a[i] for i in idx] if isinstance(a, list) else a[idx] for a in args],
        rows=ROWS // 2, **kw)) for idx in (np.arange(8), np.arange(8, 12))]
    loss_config = paper_loss_config(loss_name)
    loss_config.vocab_size = CONFIG.vocab_size
    at = params if fused else jax.tree.map(lambda p: p * 1.05, params)
    kw = dict(model_config=config, replay=replay, chunk_size=8)

    @jax.jit
    def part_grads(batch):
        if not fused:
            batch, _ = step_lib.old_policy_pass(params, batch, **kw)
        return step_lib.rl_part_gradients(at, batch, loss_config=loss_config, zvp_alpha=0.0,
                                          n_micro=1, fused=fused, **kw)

    loss_a, g_a, m_a, w_a = part_grads(whole)
    loss_b, g_b, m_b = jax.jit(join_parts)([part_grads(p) for p in parts])
    w_parts = [float(part_grads(p)[3]) for p in parts]
    assert w_parts[0] != w_parts[1] and sum(w_parts) == pytest.approx(float(w_a))
    assert abs(float(loss_a)) > 1e-6
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5, atol=1e-7)
    # The loss, extremes and counts are the whole batch's (other means are weighted by the
    # loss's weights: token means of a row-mean loss are as micro-batches report them).
    for key in [k for k in m_a if k in ("pg/loss", "pg/num_tokens", "mismatch/tokens")
                or k.endswith("max") or "/max_" in k]:
        np.testing.assert_allclose(float(m_b[key]), float(m_a[key]), rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    _assert_gradients_close(g_b, g_a)


def _grouped_sequences():
    """16 sequences: 5 prompts with 4, 4, 3, 3 and 2 responses. Within a prompt the prompt's
    routing is the same, except for the last response of the second prompt (that one cannot
    share it); the fifth prompt is one token (nothing to share); one response is empty.
    Responses of at most 9 tokens: a prompt and its responses fit one packed row of 48."""
    prompts, responses, blogps, routings, adv, signs = sequences(
        CONFIG, 16, prompt_len=(5, 9), response_len=(0, 9), max_len=SEQ_LEN, seed=3)
    sizes = [4, 4, 3, 3, 2]
    first = np.repeat(np.cumsum([0] + sizes[:-1]), sizes)
    for i, f in enumerate(first):
        p = prompts[f][:1] if f == 14 else prompts[f]
        route = np.concatenate([routings[f][:len(p) - 1], routings[i][len(prompts[i]) - 1:]])
        r = responses[i][:SEQ_LEN + 1 - len(p)]
        route = route[:len(p) + len(r)]
        route[-1] = -1
        prompts[i], responses[i], routings[i] = p, r, route
        blogps[i] = blogps[i][:len(r)]
    routings[7][0, 0, 0] = (routings[7][0, 0, 0] + 1) % CONFIG.n_experts  # not the same
    responses[9] = responses[9][:0]
    blogps[9], routings[9] = blogps[9][:0], routings[9][:len(prompts[9])]
    return prompts, responses, blogps, routings, adv, signs


@pytest.fixture(scope="module")
def shared_setup():
    args = _grouped_sequences()
    kw = dict(rows=ROWS, seq_len=SEQ_LEN, pad_id=0, moe_shape=(CONFIG.n_moe_layers,
                                                               CONFIG.top_k))
    return (init_params(CONFIG, jax.random.key(0)),
            [jax.tree.map(jnp.asarray, pack_sequences(*args, **kw, pack=pack, share_prompts=share))
             for pack, share in ((False, True), (True, False), (True, True))])


def test_shared_prompts_are_computed_once(shared_setup):
    """The shared batch holds each prompt's first P - 1 inputs once per group (prompts 1, 3
    and 4: 3 + 2 + 2 copies saved; prompt 2's 3 responses that share; not the fifth, a
    one-token prompt) and maps every sequence's inputs, targets and routing back."""
    _, (padded, packed, shared) = shared_setup  # padded: one row per sequence, same order
    args = _grouped_sequences()
    plens = [len(p) for p in args[0]]
    saved = 3 * (plens[0] - 1) + 2 * (plens[4] - 1) + 2 * (plens[8] - 1) + 2 * (plens[11] - 1)
    n_packed = int(np.sum(np.asarray(packed.segment_ids) > 0))
    assert int(np.sum(np.asarray(shared.segment_ids) > 0)) == n_packed - saved
    # the aux-loss weights count each shared token once per response
    assert float(np.sum(shared.token_weights)) == n_packed
    flat = np.asarray(shared.unpack)
    has = flat < shared.tokens.size
    np.testing.assert_array_equal(has, np.asarray(padded.segment_ids) > 0)
    for name in ("tokens", "targets", "positions"):
        got = np.asarray(getattr(shared, name)).reshape(-1)[np.where(has, flat, 0)]
        np.testing.assert_array_equal(np.where(has, got, 0),
                                      np.where(has, np.asarray(getattr(padded, name)), 0))
    routed = np.asarray(shared.routed_experts).reshape(-1, CONFIG.n_moe_layers, CONFIG.top_k)
    np.testing.assert_array_equal(routed[flat[has]], np.asarray(padded.routed_experts)[has])


@pytest.mark.parametrize("loss_name,replay,fused", [CASES[0], CASES[3], CASES[-1]])
def test_shared_prompt_loss_and_gradients_equal_the_padded_ones(shared_setup, loss_name,
                                                                 replay, fused):
    """ESPO fused with R3, ESPO with R2 after an old-policy pass, GRPO without replay: the
    loss, the aux loss, the routing flip rate and the gradients of one row per sequence."""
    params, (padded, _, shared) = shared_setup
    at = params if fused else jax.tree.map(lambda p: p * 1.05, params)
    loss_a, m_a, g_a = _loss_and_grads(params, at, padded, loss_name, replay, fused)
    loss_b, m_b, g_b = _loss_and_grads(params, at, shared, loss_name, replay, fused)
    assert abs(float(loss_a)) > 1e-6
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5, atol=1e-7)
    keys = ["pg/loss", "moe/aux_loss"] + (["moe/routing_flip_rate"] if fused else [])
    for key in keys:
        np.testing.assert_allclose(float(m_b[key]), float(m_a[key]), rtol=1e-5, atol=1e-7,
                                   err_msg=key)
    _assert_gradients_close(g_b, g_a)


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
@pytest.mark.parametrize("loss_name,replay,fused", [CASES[0], CASES[3]])
def test_head_at_the_responses_only_changes_nothing(shared_setup, layout, loss_name, replay,
                                                    fused):
    """`head_len`: the vocabulary projection only at each sequence's response targets (K of
    them per sequence, the longest response here) gives the loss, metrics and gradients of the
    projection at every position, in each layout, fused and after an old-policy pass; its
    [B, K] positions are exactly the response tokens (unpacked: row b's columns; packed: the
    flat positions `unpack` gives them)."""
    params = shared_setup[0]
    args = _grouped_sequences()
    k = max(len(r) for r in args[1])
    pack, share = {"padded": (False, False), "packed": (True, False),
                   "shared": (True, True)}[layout]
    kw = dict(rows=ROWS, seq_len=SEQ_LEN, pad_id=0, pack=pack, share_prompts=share,
              moe_shape=(CONFIG.n_moe_layers, CONFIG.top_k))
    every = jax.tree.map(jnp.asarray, pack_sequences(*args, **kw))
    head = jax.tree.map(jnp.asarray, pack_sequences(*args, **kw, head_len=k))
    assert every.head_index is None and head.head_index.shape == (ROWS, k)
    # The head's positions: a response's targets in order, then nothing (K, or R * W packed).
    mask = np.asarray(head.loss_mask) > 0
    used = np.asarray(head.head_unpack) < k
    np.testing.assert_array_equal(used, mask)  # every response here is trained
    index = np.asarray(head.head_index)
    rows, cols = np.nonzero(mask)
    slots = np.asarray(head.head_unpack)[rows, cols]
    want = np.asarray(head.unpack)[rows, cols] if pack else cols
    np.testing.assert_array_equal(index[rows, slots], want)
    assert int(np.sum(np.asarray(head.head_unpack) < k)) == sum(len(r) for r in args[1])
    at = params if fused else jax.tree.map(lambda p: p * 1.05, params)
    loss_a, m_a, g_a = _loss_and_grads(params, at, every, loss_name, replay, fused)
    loss_b, m_b, g_b = _loss_and_grads(params, at, head, loss_name, replay, fused)
    assert abs(float(loss_a)) > 1e-6
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5, atol=1e-7)
    for key in m_a:
        np.testing.assert_allclose(float(m_b[key]), float(m_a[key]), rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    _assert_gradients_close(g_b, g_a)
