"""ESPO on Qwen3.5-35B-A3B (35B, 3B active): the hybrid linear-attention MoE family (Gated
DeltaNet + gated attention) with the real-scale recipe of `moe_scale_common.py`.

The ESPO recipe of experiments/qwen3_30b_a3b.py (arXiv 2512.00499: lr 1e-6, G = 8, temperature
1.0, 128 prompts per rollout batch, 16k tokens, router replay R3, every MS-ZVE stage) on the
`qwen35_35b_a3b` preset (`espo_jax/models/presets.py`): 40 layers, every 4th full attention
(16 / 2 heads of 256, a quarter rotated, sigmoid output gate), the others Gated DeltaNet (16 key
heads x 128, 32 value heads x 128, conv 4); 256 experts of 512, top 8, a sigmoid-gated shared
expert of 512; zero-centred RMSNorms. The numbers are transformers' Qwen3_5MoeTextConfig
defaults with rope_theta 1e7 and a 262144-token context. The published checkpoint is the
multimodal `qwen3_5_moe`: `hf_io` reads its text model and skips the vision tower and the
multi-token-prediction layer.

    # weights: huggingface-cli download Qwen/Qwen3.5-35B-A3B --local-dir /models/Qwen3.5-35B-A3B
    python -m espo_jax.main --config experiments/qwen35_moe.py:hf_path=/models/Qwen3.5-35B-A3B \\
        --workdir /shared/espo_qwen35
    launch/slurm_vllm.sbatch          # learner nodes + vLLM nodes on a cluster

Measured: not run at full scale (no GPU run; the vLLM export and FP8 sampling of this family
are not exercised by launch/gpu_check.sh). On paper: 34,660,610,688 parameters, 3,454,988,928
active per token (embeddings included; `models.flops.param_count`). Logits of random tiny
models within 1e-4 of transformers 5.24 (tests/models/test_qwen3_next.py). A linear layer's
decode cache is 2,146,304 bytes per slot whatever the length (bf16 conv windows, fp32 state;
`gated_deltanet`), against 4 KiB per token for a full-attention layer's bf16 keys and values.
Train-inference mismatch on the tiny random family (experts x4; 32 responses of 24 tokens;
2026-12-05, 2-core AMD EPYC): a bf16 engine's mean |dlogp| 8.9e-3 without router replay, 2.1e-3
with R3 (9.2e-2 -> 2.2e-3 at the tokens whose routing flipped); FP8 weights 2.8e-2 -> 1.2e-2
(tests/rollout/test_engine_qwen3_next.py).
Per device on the 16-device learner mesh (fsdp 2 x expert 8; `espo_jax.bench.aot.state_bytes`,
tests/test_scale_configs.py), from abstract arrays on 16 fake CPU devices (2026-12-07):
  - float32 master parameters: 8,669,501,952 bytes (8.07 GiB): experts and the rest / 16 (fsdp x
    expert); norms, conv kernels, A_log and dt_bias whole
  - AdamW state (two float32 moments): 17,339,003,912 bytes (16.15 GiB)
  - the whole update (every layer, its micro-batches, the state donated) as XLA:TPU compiles
    it: `python -m espo_jax.bench aot --config experiments/qwen35_moe.py --topology v5p-32`
    (experiments/results/aot_qwen35_moe.json): 74.89 GiB per chip at peak, 78.8% of a v5p's
    HBM; the engine's decode call 23.28 GiB.

Laptop-size variant (tiny random Qwen3.5-MoE: linear and full layers, grouped value heads,
chunks of 8; arithmetic, JAX engine, sync loop, packed rows sharing prompts; what the tests
run):

    python -m espo_jax.main --config experiments/qwen35_moe.py:small --workdir /tmp/qwen35_small

Arguments (`:a=1,b=2`): small, hf_path, train_jsonl, test_jsonl, devices (learner devices: 16,
2 nodes of 8 GPUs), expert (expert-parallel degree, 8: 32 experts per device), max_len.

Choices where the papers are silent (each can be overridden with `--config.x.y=...`):
  - `moe_scale_common`'s (1024 prompt + 15360 response tokens, 4 updates per rollout batch,
    one 16k sequence per batch shard per micro-batch, constant lr after 10 warm-up steps).
"""

import os

from espo_jax import configs

scale = configs.import_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "moe_scale_common.py"))

PRESET = "qwen35_35b_a3b"
VOCAB = 248320  # Qwen3.5 tokenizer |V| (ESPO's log|V|)


def get_config(arg: str | None = None):
    arg = configs.parse_arg(arg, **{**scale.ARGS, "expert": 8,
                                    "hf_path": "/models/Qwen3.5-35B-A3B"})
    c = scale.espo_config(arg, PRESET, VOCAB, arg.devices or 16)
    if arg.small:  # packed rows with shared prompts here (one micro-batch): the Gated
        # DeltaNet's segment resets and prefix continuations run
        c = scale.small(c, "tiny_qwen35_moe", arg)
        c.train.pack = True
    return c
