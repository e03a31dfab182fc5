"""Rollout buffer throughput, and what reading costs the learner per train step.

    python -m espo_jax.bench buffer [--quick]

A realistic group: G=16 responses of 512 tokens after a 128-token prompt, routing recorded for
8 MoE layers x top-2 over prompt + response (uint8 on disk), random log-probs (`--quick`: a
32 + 128-token group). Measured on local disk (a temporary directory):
- encode / decode of one group (in memory);
- BufferWriter: write + shard finish (close, fsync, rename), 64 groups per shard, with zstd:3
  and uncompressed (the default) shards side by side;
- BufferReader: a fresh reader reading the whole directory;
- the learner's read per train step: `reader.read(B)` for B groups, against one jitted train
  step of the `small` model on the same batch (B*G rows of prompt + response tokens; B = 8, or
  1 with `--quick`): forward, cross-entropy + aux loss, grad, plain SGD. The real learner step
  also recomputes the old policy (one more forward), so this step time is a lower bound and the
  fraction an upper bound.
MB are 10^6 bytes of encoded records.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time

import numpy as np

from espo_jax.bench import format_table, median_time
from espo_jax.buffer import BufferReader, BufferWriter
from espo_jax.buffer.records import Response, RolloutGroup, decode, encode

G, MOE_LAYERS, TOP_K, N_EXPERTS = 16, 8, 2, 64


def realistic_group(k: int, rng: np.random.Generator, prompt: int, response: int) -> RolloutGroup:
    """Group k: G responses of `response` tokens after a `prompt`-token prompt, with routing."""
    responses = []
    for _ in range(G):
        routed = rng.integers(0, N_EXPERTS, size=(prompt + response, MOE_LAYERS, TOP_K))
        routed[-1] = -1  # the last sampled token has no routing
        responses.append(
            Response(
                tokens=rng.integers(0, 150_000, size=response),
                logprobs=-rng.exponential(size=response),
                routed_experts=routed,
                finish_reason="length",
                outcome=bool(rng.integers(2)),
                reward=float(rng.random()),
                reward_components={"correct": 1.0, "length": -0.05},
            )
        )
    return RolloutGroup(
        prompt_id=f"bench-{k}",
        prompt_tokens=rng.integers(0, 150_000, size=prompt),
        policy_version=k // 8,
        sampler="jax-fp8",
        created_at=time.time(),
        rewarded_at=time.time(),
        meta={"dataset": "bench", "answer": "42"},
        responses=responses,
        n_experts=N_EXPERTS,
    )


def train_step_seconds(rows: int, length: int, repeats: int) -> float:
    """Median seconds of one jitted small-model train step on [rows, length] tokens."""
    import jax
    import jax.numpy as jnp

    from espo_jax.models import forward, get_preset, init_params

    config = get_preset("small")
    params = init_params(config, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (rows, length), 0, config.vocab_size)

    def loss_fn(params, tokens_BxT):
        out = forward(config, params, tokens_BxT[:, :-1])
        logp_BxTxV = jax.nn.log_softmax(out.logits.astype(jnp.float32))
        nll = -jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1).mean()
        return nll + out.aux_loss

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params, tokens_BxT):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BxT)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), loss

    state = {"params": params}

    def run():
        state["params"], loss = step(state["params"], tokens)
        jax.block_until_ready(loss)

    return median_time(run, repeats=repeats, warmup=1)


def io_rows(groups: list[RolloutGroup], compression: str, repeats: int, dirs: list[str]) -> list:
    """Write and read rows (groups/s, MB/s, ms/group) for one shard compression."""
    n = len(groups)
    mb = sum(len(encode(g)) for g in groups) / 1e6

    def write_all():
        directory = tempfile.mkdtemp(prefix="espo_bench_buffer_")
        dirs.append(directory)
        with BufferWriter(
            directory, "bench", max_records_per_shard=64, compression=compression
        ) as w:
            for g in groups:
                w.write(g)

    write = median_time(write_all, repeats=repeats)
    directory = dirs[-1]

    def read_all():
        got = BufferReader(directory).read(n, timeout_s=0)
        assert len(got) == n, f"read {len(got)} of {n} groups"

    read = median_time(read_all, repeats=repeats)
    return [
        [
            f"BufferWriter.write + shard finish ({compression})",
            n / write,
            mb / write,
            write / n * 1e3,
        ],
        [f"BufferReader.read, fresh reader ({compression})", n / read, mb / read, read / n * 1e3],
    ]


def run(quick: bool) -> dict:
    # quick: a short group and one group per step (under a minute on a loaded 2-core CPU).
    # full: the realistic group and a realistic learner batch of 8 groups x 16 = 128 rows.
    prompt, response = (32, 128) if quick else (128, 512)
    n_groups, groups_per_step = (32, 1) if quick else (256, 8)
    repeats = 3 if quick else 5
    rng = np.random.default_rng(0)
    groups = [realistic_group(k, rng, prompt, response) for k in range(n_groups)]
    blob = encode(groups[0])
    group_mb = len(blob) / 1e6
    enc = median_time(lambda: encode(groups[0]), repeats=20)
    dec = median_time(lambda: decode(blob), repeats=20)
    dirs: list[str] = []
    rows = [
        ["encode (memory)", 1 / enc, group_mb / enc, enc * 1e3],
        ["decode (memory)", 1 / dec, group_mb / dec, dec * 1e3],
    ]
    rows += io_rows(groups, "zstd:3", repeats, dirs)
    rows += io_rows(groups, "uncompressed", repeats, dirs)  # the default; dirs[-1] is this one
    reader = BufferReader(dirs[-1])
    step_reads = []
    for _ in range(n_groups // groups_per_step):
        start = time.perf_counter()
        assert len(reader.read(groups_per_step, timeout_s=0)) == groups_per_step
        step_reads.append(time.perf_counter() - start)
    read_per_step = float(np.median(step_reads))
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)
    step_rows, length = groups_per_step * G, prompt + response
    step = train_step_seconds(step_rows, length, repeats=1 if quick else 3)

    print(
        f"group: G={G}, prompt {prompt} + response {response} tokens, routing {MOE_LAYERS} MoE "
        f"layers x top-{TOP_K} ({N_EXPERTS} experts, uint8): {group_mb * 1e3:.0f} kB encoded; "
        f"{n_groups} groups, 64 per shard, local disk"
    )
    print(format_table(["operation", "groups/s", "MB/s", "ms/group"], rows))
    print()
    batch = f"{groups_per_step} groups x {G} = {step_rows} rows x {length} tokens"
    fraction = read_per_step / step
    print(
        format_table(
            ["learner batch", "read ms/step", "small train step ms", "read / step"],
            [[batch, read_per_step * 1e3, step * 1e3, f"{fraction:.3%}"]],
        )
    )
    return {
        "group_bytes": len(blob),
        "table": [
            dict(zip(("operation", "groups_per_s", "mb_per_s", "ms_per_group"), r, strict=True))
            for r in rows
        ],
        "groups_per_step": groups_per_step,
        "step_tokens": [step_rows, length],
        "read_s_per_step": read_per_step,
        "train_step_s": step,
        "read_fraction_of_step": fraction,
    }
