"""bench profile: its model is bench peers' model, ops are attributed to the right part, phase
and kind from the compiled HLO, and a real trace's times add up."""

import jax
import jax.numpy as jnp
import numpy as np

from espo_jax.bench import profile
from espo_jax.bench import profile_attribution as attribution
from espo_jax.bench.peers import hf_model_config
from espo_jax.models import hf_io


def test_peers_model_is_the_peers_benchmark_model():
    assert hf_io.config_from_hf(hf_model_config().to_dict()) == profile.PEERS_MODEL


def test_opcode_of_plain_and_tuple_types():
    assert attribution._opcode("f32[8,32]{1,0} dot(%a, %b), lhs_contracting_dims={1}") == "dot"
    assert attribution._opcode("(s32[], (f32[2]{0}, f32[])) while(%t), condition=%c") == "while"


def _loss(x, w, idx):
    with jax.named_scope("attn"):
        h = x @ w
    with jax.named_scope("moe"):
        y = jnp.sort(jnp.take(h, idx, axis=0), axis=0)
    return jnp.sum(y * y)


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(128, 128)), jnp.float32)
    return x, w, jnp.asarray(rng.integers(0, 256, 512), jnp.int32)


def test_ops_are_attributed_by_scope_direction_and_kind():
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1)))
    # compiled as bench profile's programs are: with XLA:CPU's fusion emitters, which the
    # suite's conftest turns off (without them the take's gradient is a loop of dynamic slices)
    _, text = attribution.compiled_text(grad, *_args(),
                                        compiler_options={"xla_cpu_use_fusion_emitters": True})
    table = attribution.hlo_instructions(text)
    found = {attribution.classify(n, oc, op) for n, (oc, op) in table.items()
             if oc not in attribution._NOT_LEAVES}
    # x @ w forward; dx = dh w^T and dw = x^T dh backward: all matmuls of the attn scope.
    assert ("attention", "forward", "matmul") in found
    assert ("attention", "backward", "matmul") in found
    kinds = {(part, kind) for part, _, kind in found}
    assert ("MoE routing and dispatch", "sort") in kinds
    # The take's gradient is a scatter-add into h's rows.
    assert any(part == "MoE routing and dispatch" and phase == "backward" and kind == "scatter"
               for part, phase, kind in found)


def test_a_traced_program_is_attributed_and_adds_up():
    args = _args()
    grad = jax.jit(jax.grad(_loss, argnums=(0, 1)))
    name, text = attribution.compiled_text(grad, *args)
    call = lambda: jax.block_until_ready(grad(*args))
    call()
    ops = attribution.traced_op_seconds(call, 2)
    assert any(module == name for module, _, _ in ops)
    figures = attribution.breakdown(ops, {name: text}, calls=2)
    parts = sum(sum(p.values()) for p in figures["by_part_ms"].values())
    kinds = sum(figures["by_kind_ms"].values())
    assert parts > 0 and abs(parts - kinds) < 1e-9
    assert abs(figures["thread_ms_per_call"] - kinds - figures["unattributed_ms"]
               - figures["other_programs_ms"]) < 1e-9
    assert figures["by_kind_ms"]["matmul"] > 0
    assert set(figures["by_part_ms"]) <= set(attribution.PARTS)


def test_generation_ops_are_attributed_to_the_programs_the_shards_run():
    """The engine runs its decode and prefill programs per shard (seqs / shards slots, one
    prefill call per shard, a decode state committed to the device); `generate_program`
    compiles both exactly so, so XLA runs the very programs whose text is read and every
    traced op of theirs is found there (compiled with an uncommitted state, the decode program
    was another compile whose copies had other names)."""
    from espo_jax.models import get_preset

    call, modules, _, tokens = profile.generate_program(get_preset("tiny"), 8, 16, 16)
    assert tokens == 8 * 16 and call() == tokens
    assert {name.split(".")[0] for name in modules} == {"jit__generate", "jit__prefill"}
    figures = attribution.breakdown(attribution.traced_op_seconds(call, 1), modules, calls=1)
    total = figures["thread_ms_per_call"]
    attributed = sum(sum(p.values()) for p in figures["by_part_ms"].values())
    # Zero by construction (the same executables); 1% leaves room for an op the runtime adds.
    assert figures["unattributed_ms"] <= 0.01 * total, figures
    # The rest is other programs: insert (one call per shard and prefill block), the decode
    # state's initialisation and the requests' keys, a fixed cost per call against 16 decode
    # steps of 4 slots per shard: measured 4-8% of the thread time on 2 cores (8-19% with 8
    # new tokens), so at least 80% belongs to decode and prefill with 2.5x margin.
    assert attributed >= 0.8 * total, figures
    assert {"attention", "MoE experts (matmuls)", "sampling"} <= set(figures["by_part_ms"])
