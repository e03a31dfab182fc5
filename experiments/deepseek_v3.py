"""ESPO on DeepSeek-V3 (671B, 37B active) at the paper's settings: vLLM FP8 rollouts from the
published block-FP8 weights, a sharded JAX learner with expert parallelism over 256 experts.

The ESPO recipe of experiments/qwen3_30b_a3b.py (arXiv 2512.00499: lr 1e-6, G = 8, temperature
1.0, 128 prompts per rollout batch, 16k tokens, router replay R3, every MS-ZVE stage) on the
DeepSeek-V3 architecture (`deepseek_v3` preset, `espo_jax/models/presets.py`): 61 layers, the
first 3 dense, multi-head latent attention (q_lora_rank 1536, kv_lora_rank 512, 128 heads of
128 + 64 rope dims, values 128), YaRN factor 40 over 4096 tokens, 256 routed experts top-8 in
8 groups searched 4 at a time, one shared expert, gates scaled by 2.5. The numbers are
transformers' DeepseekV3Config defaults (V3's config.json) plus its rope_scaling.

    # weights: huggingface-cli download deepseek-ai/DeepSeek-V3 --local-dir /models/DeepSeek-V3
    python -m espo_jax.main --config experiments/deepseek_v3.py:hf_path=/models/DeepSeek-V3 \\
        --workdir /shared/espo_dsv3
    launch/slurm_vllm.sbatch          # learner nodes + vLLM nodes on a cluster

Measured: not run at full scale (no GPU run). On paper: 671,026,419,200 parameters,
37,552,297,472 active per token (embeddings included; `models.flops.param_count`, the same as
`jax.eval_shape`'s; published: 671B / 37B, the multi-token-prediction layer not counted).
Per device on the 256-device learner mesh (fsdp 32 x expert 8; `espo_jax.bench.aot.state_bytes`,
tests/test_scale_configs.py), from abstract arrays on 256 fake CPU devices (2026-12-07):
  - float32 master parameters: 10,852,647,936 bytes (10.11 GiB): experts / 256, the rest / 256 but
    the MLA up-projections' low-rank side (/ 32), norms and correction biases whole
  - AdamW state (two bf16 moments, as DeepSeek-V3 trained): 10,852,647,944 bytes (10.11 GiB)
  - the whole update (every layer, its micro-batches, the state donated) as XLA:TPU compiles
    it: `python -m espo_jax.bench aot --config experiments/deepseek_v3.py --topology v5p-512`
    (experiments/results/aot_deepseek_v3.json): 81.52 GiB per chip at peak, 85.8% of HBM: it
    fits (experiments/results/README.md, "Fit on TPU", says what took it from 113.78 GiB); the
    engine's decode call 47.92 GiB.

Laptop-size variant (tiny random DeepSeek-V3 of the same family: MLA, YaRN, groups, shared
expert, dense first layer; arithmetic, JAX engine, sync loop; what the tests run):

    python -m espo_jax.main --config experiments/deepseek_v3.py:small --workdir /tmp/dsv3_small

Arguments (`:a=1,b=2`): small, hf_path, train_jsonl, test_jsonl, devices (learner devices:
256, 32 nodes of 8 GPUs), expert (expert-parallel degree, 8: one node's GPUs hold all 256
experts' shards; the rest of the devices go to fsdp), max_len (prompt + response tokens).

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - 1024 prompt tokens + 15360 response tokens; 4 updates per rollout batch (256 responses
    each), one 16k sequence per batch shard per micro-batch: 256 rows over the 256 batch
    shards, one micro-batch.
  - Mesh fsdp 32 x expert 8: the batch is split over all 256 devices (data x fsdp x expert);
    the MoE layers are expert parallel (all-to-all over the 8 devices of an expert group,
    `espo_jax.models.moe_ep`).
  - The correction bias is frozen (`model.router_bias_update_rate` 0) and the load-balancing
    loss off (DeepSeek's config: auxiliary-loss-free).
  - Memory: bf16 Adam moments (DeepSeek-V3's own), query chunks of 256
    (`model.attention_chunk`), expert exchanges of 1024 tokens (`model.ep_chunk`).
  - Constant lr after 10 warm-up steps; 500 RL steps; staleness limit 1 policy version.
"""

import os

from espo_jax import configs

scale = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "moe_scale_common.py"))

PRESET = "deepseek_v3"
VOCAB = 129280  # DeepSeek-V3 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(arg, **{**scale.ARGS, "expert": 8,
                                    "hf_path": "/models/DeepSeek-V3"})
    c = scale.espo_config(arg, PRESET, VOCAB, arg.devices or 256)
    # bf16 Adam moments, as DeepSeek-V3 trained (arXiv 2412.19437, "Low-Precision Optimizer
    # States")
    c.optim.moment_dtype = "bfloat16"
    c.model.attention_chunk = 256  # 128 heads: [128, 256, 16k] float32 scores, 2 GiB a chunk
    c.model.ep_chunk = 1024  # dropless buffers of 8 x 1024 x 8 rows
    return scale.small(c, "tiny_deepseek_v3", arg) if arg.small else c
