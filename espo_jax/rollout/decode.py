"""The pure, jit-compiled pieces of the rollout engine (`espo_jax.rollout.engine`).

- `prefill_jit(config, params, tokens_1xP, length) -> Prefix`: a prompt through the model into
  its own KV cache; logits at its last token; its routed experts.
- `insert_jit(prefix, state, slot, key, slot_sampling) -> DecodeState`: the prefix copied into
  decode slot `slot`, its first token drawn.
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
from espo_jax.models import quant
from espo_jax.models.config import ModelConfig
from espo_jax.rollout.sampling import sample

PRECISIONS = ("fp32", "bf16", "fp8")
FREE, ACTIVE, DONE = 0, 1, 2  # slot phases


@flax.struct.dataclass
class Prefix:
    """A prefilled prompt: its KV cache [1, P, K, A] per layer (P = padded length)."""

    cache: dict
    length: jax.Array  # int32 [], true prompt length
    tokens_P: jax.Array  # int32 [P]
    logits_V: jax.Array  # float32 [V] at the last prompt token
    experts_PxMxk: jax.Array  # int16, -1 at padding


@flax.struct.dataclass
class SlotSampling:
    """A `SamplingConfig` as arrays, for `insert`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new: jax.Array
    stop_N: jax.Array


@flax.struct.dataclass
class DecodeState:
    """Everything about the B decode slots; S = max_cache_len."""

    cache: dict  # per layer k, v [B, S, K, A]
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
    """Learner parameters converted for the engine, and the engine's model config."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} unknown; choose one of {PRECISIONS}")
    dispatch = "dropless" if config.dispatch == "capacity" else config.dispatch
    if precision == "bf16":
        cfg = config.replace(dtype="bfloat16", param_dtype="bfloat16", dispatch=dispatch)
        cast = lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x
        return jax.tree.map(cast, params), cfg
    cfg = config.replace(dtype="float32", param_dtype="float32", dispatch=dispatch)
    params = jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
    )
    if precision == "fp8":
        params = quant.quantize_params(params, cfg)
    return params, cfg


# ---- pure, jit-compiled pieces ------------------------------------------------------------------
def _prefill(config: ModelConfig, params: dict, tokens_1xP: jax.Array, length: jax.Array):
    p = tokens_1xP.shape[1]
    valid_1xP = jnp.arange(p)[None] < length
    out = models.forward(
        config,
        params,
        tokens_1xP,
        attention_mask_BxT=valid_1xP,
        cache=models.init_cache(config, 1, p),
        cache_mask_BxS=jnp.zeros((1, p), bool),
        return_logits=False,
        return_hidden=True,
    )
    h_D = jax.lax.dynamic_index_in_dim(out.hidden[0], length - 1, keepdims=False)
    logits_V = jnp.dot(h_D.astype(config.dtype), models.lm_head_kernel(config, params))
    experts = jnp.where(valid_1xP[0, :, None, None], out.routed_experts[0], -1)
    return Prefix(
        out.cache, length, tokens_1xP[0], logits_V.astype(jnp.float32), experts.astype(jnp.int16)
    )


def _insert(prefix: Prefix, state: DecodeState, slot, key, sp: SlotSampling):
    p, s = prefix.tokens_P.shape[0], state.tokens_BxS.shape[1]
    n = prefix.length
    cache = jax.tree.map(
        lambda c, new: jax.lax.dynamic_update_slice(c, new.astype(c.dtype), (slot, 0, 0, 0)),
        state.cache,
        prefix.cache,
    )
    tok, lp = sample(
        prefix.logits_V[None],
        jax.random.fold_in(key, 0)[None],
        sp.temperature[None],
        sp.top_k[None],
        sp.top_p[None],
    )
    in_prompt_P = jnp.arange(p) < n
    tokens_S = jnp.zeros(s, jnp.int32).at[:p].set(jnp.where(in_prompt_P, prefix.tokens_P, 0))
    experts = (
        jnp.full(state.experts_BxSxMxk.shape[1:], -1, jnp.int16).at[:p].set(prefix.experts_PxMxk)
    )
    done = jnp.any(tok[0] == sp.stop_N) | (sp.max_new <= 1)
    return state.replace(
        cache=cache,
        cache_mask_BxS=state.cache_mask_BxS.at[slot].set(jnp.arange(s) < n),
        tokens_BxS=state.tokens_BxS.at[slot].set(tokens_S.at[n].set(tok[0])),
        logprobs_BxS=state.logprobs_BxS.at[slot].set(jnp.zeros(s).at[n].set(lp[0])),
        experts_BxSxMxk=state.experts_BxSxMxk.at[slot].set(experts),
        pos_B=state.pos_B.at[slot].set(n),
        prompt_len_B=state.prompt_len_B.at[slot].set(n),
        phase_B=state.phase_B.at[slot].set(jnp.where(done, DONE, ACTIVE)),
        keys_B=state.keys_B.at[slot].set(key),
        temperature_B=state.temperature_B.at[slot].set(sp.temperature),
        top_k_B=state.top_k_B.at[slot].set(sp.top_k),
        top_p_B=state.top_p_B.at[slot].set(sp.top_p),
        max_new_B=state.max_new_B.at[slot].set(sp.max_new),
        stop_BxN=state.stop_BxN.at[slot].set(sp.stop_N),
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


prefill_jit = jax.jit(_prefill, static_argnums=0)
insert_jit = jax.jit(_insert, donate_argnums=(1,))
generate_jit = jax.jit(_generate, static_argnums=(0, 1), donate_argnums=(3,))
