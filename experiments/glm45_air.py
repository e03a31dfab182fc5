"""ESPO on GLM-4.5-Air (106B, 12B active) at the paper's settings: vLLM FP8 rollouts, a sharded
JAX learner.

The ESPO recipe of experiments/qwen3_30b_a3b.py (arXiv 2512.00499: lr 1e-6, G = 8, temperature
1.0, 128 prompts per rollout batch, 16k tokens, router replay R3, every MS-ZVE stage) on the
GLM-4.5-Air architecture (`glm45_air` preset, `espo_jax/models/presets.py`): 46 layers, the first
dense (10944 hidden), GQA 96 / 8 heads of 128 with half of each head rotated and a q/k/v bias,
128 routed experts of 1408 top-8 (sigmoid router, correction bias, no groups, scale 1), one
shared expert, |V| 151552. Sources: transformers' Glm4MoeConfig defaults, which its docstring
gives as GLM-4.5-Air's; head_dim 128, `attention_bias` true and rope_theta 1e6 from
zai-org/GLM-4.5-Air's config.json (also slime's glm4.5-106B-A12B launch script: --kv-channels
128, --add-qkv-bias, --rotary-base 1000000, --rotary-percent 0.5, 1 dense + 45 MoE layers).

    # weights: huggingface-cli download zai-org/GLM-4.5-Air --local-dir /models/GLM-4.5-Air
    python -m espo_jax.main --config experiments/glm45_air.py:hf_path=/models/GLM-4.5-Air \\
        --workdir /shared/espo_glm45_air
    launch/slurm_vllm.sbatch          # learner nodes + vLLM nodes on a cluster

Measured: not run at full scale (no GPU run). On paper: 106,852,251,264 parameters,
13,424,129,664 active per token, 12,182,615,808 without the embeddings (published: 106B / 12B;
`models.flops.param_count`, the same as `jax.eval_shape`'s).
Per device on the 32-device learner mesh (fsdp 32; `espo_jax.bench.aot.state_bytes`,
tests/test_scale_configs.py), from abstract arrays on 32 fake CPU devices (2026-12-07):
  - float32 master parameters: 13,360,585,216 bytes (12.44 GiB): all / 32 but norms,
    q/k/v biases and correction biases (whole)
  - AdamW state (two bf16 moments; float32 ones would not fit 32 chips): 13,360,585,224
    bytes (12.44 GiB)
  - the whole update (every layer, its micro-batches, the state donated) as XLA:TPU compiles
    it on 32 v5p chips, expert parallel: `python -m espo_jax.bench aot --config
    experiments/glm45_air.py:expert=8 --topology v5p-64` (experiments/results/aot_glm45_air.json):
    80.90 GiB per chip at peak, 85.2% of HBM: it fits (experiments/results/README.md, "Fit on
    TPU", says what took it from 117.82 GiB); the engine's decode call 78.19 GiB.

Laptop-size variant (tiny random GLM-4.5 of the same family: partial rotary, q/k/v bias, sigmoid
router with a shared expert and a dense first layer; arithmetic, JAX engine, sync loop):

    python -m espo_jax.main --config experiments/glm45_air.py:small --workdir /tmp/glm_small

Arguments (`:a=1,b=2`): small, hf_path, train_jsonl, test_jsonl, devices (learner devices: 32,
4 nodes of 8 GPUs), expert (expert-parallel degree, 1; the rest of the devices go to fsdp),
max_len (prompt + response tokens).

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - 1024 prompt tokens + 15360 response tokens; 4 updates per rollout batch (256 responses
    each), one 16k sequence per device per micro-batch: 256 / 32 = 8 micro-batches.
  - Mesh fsdp 32: 128 experts' weights split on their model dimension like every weight;
    `:expert=8` makes the MoE layers expert parallel (all-to-all token exchanges; the batch
    and the dense weights then split over fsdp x expert, so nothing is computed twice).
  - The correction bias is frozen (`model.router_bias_update_rate` 0), the load-balancing loss
    off (the published config trains with the bias).
  - Memory (`fit_memory`): bf16 Adam moments, query chunks of 256 (`model.attention_chunk`),
    expert exchanges of 1024 tokens (`model.ep_chunk`).
  - Constant lr after 10 warm-up steps; 500 RL steps; staleness limit 1 policy version.
"""

import os

from espo_jax import configs

scale = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "moe_scale_common.py"))

PRESET = "glm45_air"
VOCAB = 151552  # GLM-4.5 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(arg, **{**scale.ARGS, "hf_path": "/models/GLM-4.5-Air"})
    c = scale.espo_config(arg, PRESET, VOCAB, arg.devices or 32)
    fit_memory(c)
    return scale.small(c, "tiny_glm45", arg) if arg.small else c


def fit_memory(c) -> None:
    """What brings the update under 90% of a v5p chip on 32 chips (`bench aot`, the docstring):
    bf16 Adam moments (DeepSeek-V3's choice, arXiv 2412.19437, "Low-Precision Optimizer
    States"; float32 moments are 12.44 GiB more per chip), query chunks of 256 and expert
    exchanges of 1024 tokens."""
    c.optim.moment_dtype = "bfloat16"
    c.model.attention_chunk = 256
    c.model.ep_chunk = 1024
