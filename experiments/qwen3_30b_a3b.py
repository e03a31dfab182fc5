"""ESPO on Qwen3-30B-A3B at the paper's scale: vLLM FP8 rollouts, sharded JAX learner.

The setting of arXiv 2512.00499 (ESPO on Qwen3-30B-A3B): lr 1e-6, G = 8 responses per prompt,
temperature 1.0, 128 prompts per rollout batch, 16k tokens (prompt + response), router replay
(R3) from the rollout engine's recorded routing, every MS-ZVE stage (arXiv 2512.07710).

Layout (`train.loop=async`): one learner job (JAX, `jax.distributed` over its hosts) and vLLM
FP8 rollout workers on other GPUs; they meet at WORKDIR/buffer and WORKDIR/weights on a shared
filesystem (`launch/slurm_vllm.sbatch`). The TPU variant runs the learner on a TPU slice
(`launch/tpu_multihost.sh`), workers on GPUs or TPUs sharing a bucket.

    # weights: huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir /models/Qwen3-30B-A3B
    # data: math JSONL {"problem", "answer"} per line (see espo_jax/data/math_jsonl.py)
    python -m espo_jax.main --config experiments/qwen3_30b_a3b.py:hf_path=/models/Qwen3-30B-A3B \\
        --workdir /shared/espo_qwen3_30b
    launch/slurm_vllm.sbatch          # the same on a cluster (learner node + vLLM nodes)
    launch/tpu_multihost.sh           # TPU slice: experiments/qwen3_30b_a3b.py:tpu

Measured: not yet run at full scale (no GPU or TPU run). On paper only: 30,532,122,624
parameters, 3,353,032,704 active (by hand and via `jax.eval_shape` in
tests/test_qwen3_30b_config.py).

One layer's gradient at 16384 tokens, compiled on CPU XLA both ways (5c05076, 2026-12-01;
experiments/results/attention_bench.json): 145.3 GiB of temporaries with full attention,
7.73 GiB with query chunks of 1024.

Compiled by XLA:TPU for 16 v5p chips (fsdp 2 x expert 8), `python -m espo_jax.bench aot
--config experiments/qwen3_30b_a3b.py:devices=16,expert=8 --topology v5p:2x2x4`
(experiments/results/aot_qwen3_30b_a3b.json): the whole update, its 48 layers scanned, peaks at
57.52 GiB per chip, 60.5% of HBM; the engine's decode call at 76.21 GiB, 80.2%.

Laptop-size variant (tiny MoE, arithmetic, JAX engine, sync loop; what the tests run):

    python -m espo_jax.main --config experiments/qwen3_30b_a3b.py:small --workdir /tmp/q30_small

Arguments (`:a=1,b=2`): small, tpu, hf_path, train_jsonl, test_jsonl, devices (learner devices:
8 GPUs, or the TPU slice's chips), expert (expert-parallel degree; the rest of the devices go
to fsdp), max_len (prompt + response tokens).

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - 1024 prompt tokens + 15360 response tokens = 16k; 4 updates per rollout batch (256
    responses each), one 16k sequence per device per micro-batch (gradient accumulation).
  - Mesh: fsdp over all learner devices; `:expert=N` makes the MoE layers expert parallel
    (the batch is split over data x fsdp x expert, tokens reach their experts' devices by
    all-to-all: `espo_jax.models.moe_ep`). float32 master parameters and Adam moments
    (compute in bf16): 12 bytes per parameter, 366 GB in all, 45.8 GB per device on 8 GPUs.
  - Memory at 16k: layers are rematerialised (`model.remat`) and attention runs over query
    chunks of 1024 (`model.attention_chunk`), whose [H, 1024, T] scores are recomputed in the
    backward pass instead of keeping [H, T, T] (32 x 16k^2 x 6 bytes = 52 GB per layer).
    `python -m espo_jax.bench attention` compiles one layer's gradient both ways (the figures
    under "Measured" above: CPU XLA's buffer assignment).
  - Constant lr after 10 warm-up steps; 500 RL steps; staleness limit 1 policy version.
"""

import os

from espo_jax import configs

scale = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "moe_scale_common.py"))

PRESET = "qwen3_30b_a3b"
VOCAB = 151936  # Qwen3 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(arg, **{**scale.ARGS, "tpu": False,
                                    "hf_path": "/models/Qwen3-30B-A3B"})
    devices = arg.devices or (32 if arg.tpu else 8)  # 8 GPUs; TPU v5p-64 has 32 chips
    c = scale.espo_config(arg, PRESET, VOCAB, devices)
    return scale.small(c, "tiny", arg) if arg.small else c
