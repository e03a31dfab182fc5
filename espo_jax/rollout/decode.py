"""The pure, jit-compiled pieces of the rollout engine (`espo_jax.rollout.engine`).

- `prefill_jit(config, params, tokens_NxP, lengths_N) -> Prefix`: N prompts (one padded length
  P) through the model into their own KV caches; logits at each last token; routed experts.
- `init_state_jit(config, B, S, max_stop_tokens) -> DecodeState`: every slot free.
- `insert_jit(config, prefix, state, slots_R, rows_R, keys_R, slot_sampling) -> DecodeState`:
  prefix rows copied into decode slots (padding entries: slot >= B), their first tokens drawn
  (each cache entry along its mixer's slot axis, `models.cache_slot_axes`); one call
  admits every sample of an admission round that shares the prefix batch.
- `generate_jit(config, n_steps, params, state) -> (state, tokens [n_steps, B])`: n decode
  steps of every active slot (a `lax.scan`), recording tokens, log-probs and routed experts.

Static shapes: B decode slots, S = max cache length. Sampling settings live in the state per
slot (arrays), so changing them never recompiles. Module-level jits: engines with equal
(hashable) configs share compiled code.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from espo_jax import models
from espo_jax.choices import ENGINE_PRECISIONS
from espo_jax.models import quant, scan
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.sampling import sample

FP8_SCHEMES = {"fp8": "channel", "fp8_block": "block"}  # precision -> `quant` scale scheme
FREE, ACTIVE, DONE = 0, 1, 2  # slot phases


@flax.struct.dataclass
class Prefix:
    """N prefilled prompts of one padded length P: a `models.init_cache` of P slots."""

    cache: dict
    lengths_N: jax.Array  # int32, true prompt lengths
    tokens_NxP: jax.Array  # int32
    logits_NxV: jax.Array  # float32 at each prompt's last token
    experts_NxPxMxk: jax.Array  # int16, -1 at padding


@flax.struct.dataclass
class SlotSampling:
    """`SamplingConfig`s as arrays for `insert`: one entry per inserted row ([R], stop [R, N])."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new: jax.Array
    stop_N: jax.Array


@flax.struct.dataclass
class DecodeState:
    """Everything about the B decode slots; S = max_cache_len."""

    cache: dict  # per layer k [B, K, A, S], v [B, K, S, A], or MLA's latent [B, S, C] and
    # rope key [B, S, R], or a linear layer's conv windows and state (`models.init_cache`)
    cache_mask_BxS: jax.Array  # True = slot holds a real token of the row's sequence
    tokens_BxS: jax.Array  # prompt then sampled tokens
    logprobs_BxS: jax.Array  # at sampled positions
    experts_BxSxMxk: jax.Array  # int16, -1 = no routing
    pos_B: jax.Array  # position of the last token (the next one to feed)
    prompt_len_B: jax.Array
    phase_B: jax.Array  # FREE / ACTIVE / DONE
    keys_B: jax.Array  # per-sample PRNG keys
    temperature_B: jax.Array  # sampling settings per slot (arrays: changing them never
    top_k_B: jax.Array  # recompiles)
    top_p_B: jax.Array
    max_new_B: jax.Array
    stop_BxN: jax.Array  # stop token ids, -1 = unused entry
    busy_steps: jax.Array  # slot-steps spent decoding (for the idle-slot fraction)


def engine_params(params: dict, config: ModelConfig, precision: str) -> tuple[dict, ModelConfig]:
    """Learner parameters converted for the engine, and the engine's model config: its MoE
    dispatch is exact (capacity's dropped tokens would be samples the learner cannot score)
    and, for the dropless layouts, the looped one (the same forward, no weight copies)."""
    if precision not in ENGINE_PRECISIONS:
        raise ValueError(f"precision {precision!r} unknown; choose one of {ENGINE_PRECISIONS}")
    dispatch = ("dropless_loop" if config.dispatch in ("dropless", "capacity")
                else config.dispatch)
    # the engine's caches are per layer: a learner's scanned weights are read per layer too
    params, config = scan.unstack(params), config.replace(scan_layers=False)
    if precision == "bf16":
        cfg = config.replace(dtype="bfloat16", param_dtype="bfloat16", dispatch=dispatch)
        cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x
        return jax.tree.map(cast, params), cfg
    cfg = config.replace(dtype="float32", param_dtype="float32", dispatch=dispatch)
    params = jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
    )
    if precision in FP8_SCHEMES:
        params = quant.quantize_params(params, cfg, scheme=FP8_SCHEMES[precision])
    return params, cfg


# ---- pure, jit-compiled pieces ------------------------------------------------------------------
def _prefill(config: ModelConfig, params: dict, tokens_NxP: jax.Array, lengths_N: jax.Array):
    n, p = tokens_NxP.shape
    valid_NxP = jnp.arange(p)[None] < lengths_N[:, None]
    out = models.forward(
        config,
        params,
        tokens_NxP,
        attention_mask_BxT=valid_NxP,
        cache=models.init_cache(config, n, p),
        cache_mask_BxS=jnp.zeros((n, p), bool),
        return_logits=False,
        return_hidden=True,
    )
    last_N = jnp.maximum(lengths_N - 1, 0)
    h_NxD = jnp.take_along_axis(out.hidden, last_N[:, None, None], axis=1)[:, 0]
    logits_NxV = jnp.dot(h_NxD.astype(config.dtype), models.lm_head_kernel(config, params),
                         preferred_element_type=jnp.float32)
    experts = jnp.where(valid_NxP[:, :, None, None], out.routed_experts, -1)
    return Prefix(
        out.cache, lengths_N, tokens_NxP, logits_NxV.astype(jnp.float32),
        experts.astype(jnp.int16),
    )


def _insert(config: ModelConfig, prefix: Prefix, state: DecodeState, slots_R, rows_R, keys_R,
            sp: SlotSampling):
    """Row rows_R[r] of `prefix` into slot slots_R[r]; entries with slots_R[r] >= B (padding)
    write nothing. Slots must be distinct."""
    p, s = prefix.tokens_NxP.shape[1], state.tokens_BxS.shape[1]
    r = slots_R.shape[0]
    n_R = prefix.lengths_N[rows_R]

    def put(cache, x, axis):  # the prefix's P slots, or a fixed-size entry whole (axis None)
        at = (slots_R,) if axis is None else (slots_R, *[slice(None)] * (axis - 1), slice(p))
        return cache.at[at].set(x.astype(cache.dtype), mode="drop")

    cache = {layer: {n: put(state.cache[layer][n], prefix.cache[layer][n][rows_R], axis)
                     for n, axis in entries}
             for layer, entries in models.cache_slot_axes(config)}
    tok_R, lp_R = sample(
        prefix.logits_NxV[rows_R],
        jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_R, 0),
        sp.temperature,
        sp.top_k,
        sp.top_p,
    )
    in_prompt_RxP = jnp.arange(p)[None] < n_R[:, None]
    rows = jnp.arange(r)
    tokens_RxS = jnp.zeros((r, s), jnp.int32).at[:, :p].set(
        jnp.where(in_prompt_RxP, prefix.tokens_NxP[rows_R], 0))
    experts = jnp.full((r, *state.experts_BxSxMxk.shape[1:]), -1, jnp.int16).at[:, :p].set(
        prefix.experts_NxPxMxk[rows_R])
    done_R = jnp.any(tok_R[:, None] == sp.stop_N, axis=-1) | (sp.max_new <= 1)
    put = lambda x, v: x.at[slots_R].set(v, mode="drop")
    return state.replace(
        cache=cache,
        cache_mask_BxS=put(state.cache_mask_BxS, jnp.arange(s)[None] < n_R[:, None]),
        tokens_BxS=put(state.tokens_BxS, tokens_RxS.at[rows, n_R].set(tok_R)),
        logprobs_BxS=put(state.logprobs_BxS, jnp.zeros((r, s)).at[rows, n_R].set(lp_R)),
        experts_BxSxMxk=put(state.experts_BxSxMxk, experts),
        pos_B=put(state.pos_B, n_R),
        prompt_len_B=put(state.prompt_len_B, n_R),
        phase_B=put(state.phase_B, jnp.where(done_R, DONE, ACTIVE)),
        keys_B=put(state.keys_B, keys_R),
        temperature_B=put(state.temperature_B, sp.temperature),
        top_k_B=put(state.top_k_B, sp.top_k),
        top_p_B=put(state.top_p_B, sp.top_p),
        max_new_B=put(state.max_new_B, sp.max_new),
        stop_BxN=put(state.stop_BxN, sp.stop_N),
    )


def _init_state(config: ModelConfig, b: int, s: int, max_stop_tokens: int) -> DecodeState:
    zeros = lambda dt: jnp.zeros((b,), dt)
    return DecodeState(
        cache=models.init_cache(config, b, s),
        cache_mask_BxS=jnp.zeros((b, s), bool),
        tokens_BxS=jnp.zeros((b, s), jnp.int32),
        logprobs_BxS=jnp.zeros((b, s), jnp.float32),
        experts_BxSxMxk=jnp.full((b, s, config.n_moe_layers, config.top_k), -1, jnp.int16),
        pos_B=zeros(jnp.int32),
        prompt_len_B=zeros(jnp.int32),
        phase_B=zeros(jnp.int32),
        keys_B=jax.random.split(jax.random.key(0), b),
        temperature_B=zeros(jnp.float32),
        top_k_B=zeros(jnp.int32),
        top_p_B=jnp.ones((b,), jnp.float32),
        max_new_B=zeros(jnp.int32),
        stop_BxN=jnp.full((b, max_stop_tokens), -1, jnp.int32),
        busy_steps=jnp.zeros((), jnp.int32),
    )


def _decode_step(config: ModelConfig, params: dict, state: DecodeState):
    b, s = state.tokens_BxS.shape
    rows = jnp.arange(b)
    active_B = state.phase_B == ACTIVE
    out = models.forward(
        config,
        params,
        state.tokens_BxS[rows, state.pos_B][:, None],
        positions_BxT=state.pos_B[:, None],
        attention_mask_BxT=active_B[:, None],
        cache=state.cache,
        cache_mask_BxS=state.cache_mask_BxS,
    )
    fed_at = jnp.where(active_B, state.pos_B, s)  # s: dropped (inactive rows write nothing)
    n_generated_B = state.pos_B - state.prompt_len_B + 1
    keys_B = jax.vmap(jax.random.fold_in)(state.keys_B, n_generated_B)
    tok_B, lp_B = sample(
        out.logits[:, 0], keys_B, state.temperature_B, state.top_k_B, state.top_p_B
    )
    new_pos_B = state.pos_B + 1
    write_at = jnp.where(active_B, new_pos_B, s)
    stop_B = jnp.any(tok_B[:, None] == state.stop_BxN, axis=-1) | (
        n_generated_B + 1 >= state.max_new_B
    )
    new_state = state.replace(
        cache=out.cache,
        cache_mask_BxS=state.cache_mask_BxS.at[rows, fed_at].set(True, mode="drop"),
        tokens_BxS=state.tokens_BxS.at[rows, write_at].set(tok_B, mode="drop"),
        logprobs_BxS=state.logprobs_BxS.at[rows, write_at].set(lp_B, mode="drop"),
        experts_BxSxMxk=state.experts_BxSxMxk.at[rows, fed_at].set(
            out.routed_experts[:, 0].astype(jnp.int16), mode="drop"
        ),
        pos_B=jnp.where(active_B, new_pos_B, state.pos_B),
        phase_B=jnp.where(active_B & stop_B, DONE, state.phase_B),
        busy_steps=state.busy_steps + jnp.sum(active_B),
    )
    return new_state, jnp.where(active_B, tok_B, -1)


def _generate(config, n_steps: int, params: dict, state: DecodeState):
    step = functools.partial(_decode_step, config, params)
    return jax.lax.scan(lambda st, _: step(st), state, None, length=n_steps)


init_state_jit = jax.jit(_init_state, static_argnums=(0, 1, 2, 3))
prefill_jit = jax.jit(_prefill, static_argnums=0)
insert_jit = jax.jit(_insert, static_argnums=0, donate_argnums=(2,))
generate_jit = jax.jit(_generate, static_argnums=(0, 1), donate_argnums=(3,))
