"""One learner process of the multi-host test (`tests/test_distributed.py`).

    XLA_FLAGS=--xla_force_host_platform_device_count=N [ESPO_COORDINATOR=host:port
    ESPO_NUM_PROCESSES=P ESPO_PROCESS_ID=i] \
    python tests/helpers/distributed_proc.py WORKDIR OUT_PREFIX

Joins the JAX system from the ESPO_* environment (`espo_jax.distributed.initialize`), builds
the mesh data=2 x expert=4 over all 8 global devices, initialises the tiny MoE sharded, trains
2 learner updates (`Learner.update`) on fixed synthetic rollout groups, saves an orbax
checkpoint (every process) and restores it into a zeroed state, and checks `put_batch`
against `jax.device_put`, `put_global` against the sharded init, and that `broadcast_groups` /
`broadcast_bytes` deliver process 0's data. Process 0 writes OUT_PREFIX.npz (the trained parameters,
gathered to the host) and every process writes OUT_PREFIX.<process>.json (what it saw).
"""

import json
import os
import sys
import time

T0 = time.time()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

from espo_jax import compile_cache, distributed  # noqa: E402

compile_cache.enable()

SPEC = distributed.initialize()  # before any computation

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from espo_jax import config_validation, configs, sharding  # noqa: E402
from espo_jax.buffer.records import Response, RolloutGroup  # noqa: E402
from espo_jax.models.presets import get_preset  # noqa: E402
from espo_jax.rl.loss_config import paper_loss_config  # noqa: E402
from espo_jax.train import state as state_lib  # noqa: E402
from espo_jax.train.checkpoint import Checkpointer  # noqa: E402
from espo_jax.train.learner import Learner  # noqa: E402


def make_config():
    c = configs.apply_small(configs.default_config())
    c.loss = paper_loss_config("espo")
    c.loss.vocab_size = 128  # the tiny preset's |V|
    c.mesh.data, c.mesh.expert = 2, 4
    c.optim.lr, c.optim.warmup_steps = 1e-2, 0  # large steps: parameters visibly move
    c.train.steps = 2
    c.rollout.max_prompt_len = 32  # no task sizes it here (run_setup.build does in a run)
    return c


def make_groups(seed: int, n_groups: int = 4, g: int = 4) -> list[RolloutGroup]:
    """Deterministic scored groups with routing for the tiny model (2 MoE layers, 8 experts,
    top 2); every group has mixed outcomes, so every advantage is non-zero."""
    rng = np.random.default_rng(seed)
    groups = []
    for k in range(n_groups):
        prompt = rng.integers(1, 99, size=int(rng.integers(4, 10)))
        responses = []
        for j in range(g):
            t = int(rng.integers(3, 16))
            e0 = rng.integers(0, 8, size=(len(prompt) + t, 2, 1))
            e1 = (e0 + rng.integers(1, 8, size=e0.shape)) % 8  # two distinct experts
            outcome = j % 2
            responses.append(Response(
                tokens=rng.integers(1, 99, size=t),
                logprobs=-rng.uniform(0.1, 3.0, size=t).astype(np.float32),
                routed_experts=np.concatenate([e0, e1], axis=-1),
                outcome=outcome, reward=float(outcome),
            ))
        groups.append(RolloutGroup(prompt_id=f"p{k}", prompt_tokens=prompt, policy_version=0,
                                   sampler="test-fp32", created_at=0.0, responses=responses,
                                   n_experts=8))
    return groups


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


def main(workdir: str, out_prefix: str) -> None:
    times = {"import_s": time.time() - T0}
    t = time.time()
    config = make_config()
    config_validation.validate(config, n_devices=jax.device_count())
    model_config = get_preset("tiny")
    mesh = sharding.make_mesh(config.mesh)
    tx = state_lib.make_optimizer(config.optim, config.train.steps)
    make_state = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))
    state = make_state(sharding.init_sharded(model_config, mesh, rng=jax.random.key(0)))
    distributed.sync("built")  # before the first collective (see `distributed.sync`)
    initial = distributed.gather_to_host(state.params)
    learner = Learner(config, model_config, mesh, jax.tree.map(lambda x: x.sharding, state))

    # put_batch (each process transfers its own rows) == device_put (all rows, checked equal
    # on every process), and the rows this process feeds.
    groups = make_groups(1)
    host_batch = learner.minibatches(groups, [g.rewards for g in groups])[0]
    via_put = distributed.gather_to_host(distributed.put_batch(host_batch, learner.batch_sharding))
    via_device_put = distributed.gather_to_host(jax.device_put(host_batch,
                                                               learner.batch_sharding))
    rows = distributed.process_rows(learner.batch_sharding, learner.rows_per_update)
    put_equal = all(np.array_equal(a, b) and np.array_equal(a, h) for a, b, h in zip(
        jax.tree.leaves(via_put), jax.tree.leaves(via_device_put), jax.tree.leaves(host_batch),
        strict=True))

    times["setup_s"], t = time.time() - t, time.time()
    # Process 0's groups and bytes reach every process (chunked: 2500 bytes in 1000-byte
    # chunks); host weights placed with put_global equal the sharded init.
    sent = make_groups(3)
    got = distributed.broadcast_groups(sent if distributed.is_primary() else None)
    payload = bytes(range(250)) * 10
    got_bytes = distributed.broadcast_bytes(payload if distributed.is_primary() else None,
                                            chunk_bytes=1000)
    placed = distributed.put_global(initial, jax.tree.map(lambda x: x.sharding, state.params))
    placed_equal = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(initial), jax.tree.leaves(distributed.gather_to_host(placed)),
        strict=True))
    placed_sharded = all(x.sharding == y.sharding for x, y in zip(
        jax.tree.leaves(placed), jax.tree.leaves(state.params), strict=True))

    losses = []
    for seed in (1, 2):
        distributed.sync(f"update{seed}")
        groups = make_groups(seed)
        state, metrics = learner.update(state, groups, [g.rewards for g in groups])
        losses.append(metrics["train/loss"])
    trained = flat(distributed.gather_to_host(state.params))
    start = flat(initial)
    moved = max(float(np.max(np.abs(trained[k] - start[k]))) for k in trained)

    times["train_s"], t = time.time() - t, time.time()
    distributed.sync("checkpoint")
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=2)
    ckpt.save(2, state, {"rl_step": 2, "note": "two-process"})
    ckpt.wait()
    zeros = jax.jit(lambda s: jax.tree.map(jnp.zeros_like, s),
                    out_shardings=jax.tree.map(lambda x: x.sharding, state))
    fresh = zeros(state)  # restored values must come from the checkpoint
    restored, meta = ckpt.restore(fresh)
    ckpt.close()
    back = flat(distributed.gather_to_host(restored.params))
    restore_max_diff = max(float(np.max(np.abs(back[k] - trained[k]))) for k in trained)
    moments_equal = all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(distributed.gather_to_host(restored.opt_state)),
        jax.tree.leaves(distributed.gather_to_host(state.opt_state)), strict=True))

    times["checkpoint_s"] = time.time() - t
    info = {
        "times": times,
        "mode": SPEC.mode, "process_index": jax.process_index(),
        "process_count": jax.process_count(), "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(), "is_primary": distributed.is_primary(),
        "rows": [rows.start, rows.stop], "put_batch_equal": put_equal, "losses": losses,
        "moved_from_init": moved, "restore_max_diff": restore_max_diff,
        "restored_moments_equal": moments_equal, "groups_equal": got == sent,
        "bytes_equal": got_bytes == payload, "put_global_equal": placed_equal,
        "put_global_sharded": placed_sharded,
        "restored_step": int(distributed.gather_to_host(restored.step)), "meta": meta,
        "expert_shard_shape": list(
            state.params["layers_0"]["moe"]["wi_gate"].addressable_shards[0].data.shape),
    }
    with open(f"{out_prefix}.{jax.process_index()}.json", "w") as f:
        json.dump(info, f)
    if distributed.is_primary():
        np.savez(f"{out_prefix}.npz", **trained)
    distributed.sync("done")


if __name__ == "__main__":
    main(*sys.argv[1:3])
