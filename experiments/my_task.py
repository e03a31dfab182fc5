"""A task of your own, as a researcher writes one: prompts, splits and a ten-line reward.

Sums of two numbers with 1, 2 or 3 digits (levels 1-3), as text the character tokenizer reads.
The prompts carry their answers as `solution`, so the supervised warm start and the anchor can
use them; RL trains on all three levels. The config beside it
(`my_task_espo.py`) points `config.task` at `task` below; any module works the same way
(`--config.task=package.module:function` with `--config.task_args='{"size": 500}'`).
"""

import random
import re

from espo_jax.tasks import Task


def reward(prompt: dict, text: str) -> bool:
    """Right when the last number in the completion is the sum: the outcome MS-ZVE filters on
    (return a float for a shaped reward, or {"reward": r, "outcome": ok, ...})."""
    numbers = re.findall(r"-?\d+", text)
    return bool(numbers) and numbers[-1] == prompt["answer"]


def task(size: int = 3000, seed: int = 0) -> Task:
    """`size` training prompts, 300 validation and 300 test; no sum is in two splits."""
    rng = random.Random(seed)
    pairs = set()
    while len(pairs) < size + 600:
        digits = rng.randint(1, 3)
        pairs.add((rng.randrange(10 ** (digits - 1), 10**digits),
                   rng.randrange(10 ** (digits - 1), 10**digits), digits))
    pairs = sorted(pairs)
    rng.shuffle(pairs)
    prompts = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": d,
                "solution": str(a + b), "prompt_id": f"{a}+{b}"} for a, b, d in pairs]
    train = prompts[:size]
    return Task(reward=reward, train=train, validation=prompts[size:size + 300],
                test=prompts[size + 300:])
