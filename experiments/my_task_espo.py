"""ESPO on a task of your own (`my_task.py` beside this file): the `small` MoE, a short warm
start on the 1- and 2-digit sums, then RL on all three levels.

    python -m espo_jax.main --config experiments/my_task_espo.py --workdir /tmp/my_task

Any task function works the same way from the command line:

    python -m espo_jax.main --config experiments/my_task_espo.py --workdir /tmp/t \\
        --config.task=experiments/my_task.py:task --config.task_args='{"size": 1000}'
"""

import os

from espo_jax import configs


def get_config(arg: str | None = None):
    c = configs.default_config()
    c.task = os.path.join(os.path.dirname(os.path.abspath(__file__)), "my_task.py") + ":task"
    c.loss.name = "espo"
    c.loss.vocab_size = 128  # |V| of the `small` preset (character tokenizer)
    c.rollout.max_prompt_len = 9  # bos + "999+999="
    c.rollout.max_new_tokens = 6  # "1998" + eos
    c.rollout.prompts_per_step = 32
    c.zve.n_samples = 8
    c.warmstart.steps = 300
    c.warmstart.lr = 2e-3
    c.warmstart.eval_every = 100
    c.train.steps = 40
    c.optim.lr = 3e-4
    c.eval.num_prompts = 150
    c.eval.every = 20
    c.eval.pass_k = 0
    c.checkpoint.every = 20
    if arg == "small":
        configs.apply_small(c)
    return c
