"""TRL's `GRPOTrainer` as a benchmark's peer side (run in `peer_process`'s child).

`trl_grpo_seconds` runs GRPOTrainer as its users run it (fp32 on the CPU, HF `generate`, one
AdamW step per generation batch, no reference model) and times each optimizer step with a
callback, from `on_step_begin` to `on_step_end`, and its parts through the reward function,
which TRL calls once per step between generation and loss: generation (prompt tokenisation and
`generate`) ends when the reward is called, the reward when it returns, the update (old and new
log-probs, loss, backward, AdamW) at the step's end.

Two workloads: bench peers' (plain-text prompts, reward = the fraction of even token ids) and
bench real's (chat questions "What is a + b + c?", which TRL renders with the model's chat
template as it does any conversational prompt; reward 1 when the last integer of the answer is
the sum). The reward functions are the ones espo_jax's side scores with.

This module imports neither jax nor espo_jax's JAX code.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import numpy as np

_INTEGER = re.compile(r"-?\d+")


def even_fraction(ids) -> float:
    """bench peers' reward: the fraction of even token ids in a response."""
    ids = np.asarray(ids)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


def chain_sum_reward(text: str, answer: int) -> float:
    """bench real's reward: 1 when the last integer in `text` is `answer` (commas inside a
    number ignored, as in "1,234"), else 0."""
    found = _INTEGER.findall(text.replace(",", ""))
    return float(bool(found) and int(found[-1]) == int(answer))


def trl_grpo_seconds(model_dir: str, prompts: list[str], steps: int, out_dir: str, lr: float,
                     new_tokens: int, samples: int,
                     between: Callable[[float], object] | None = None,
                     answers: list[int] | None = None) -> tuple[list[float], dict]:
    """Per-step seconds of TRL's GRPOTrainer (first step included): `prompts` each sampled
    `samples` times, at most `new_tokens` completion tokens, temperature 1 without top-k /
    top-p, GRPO loss, beta 0, one AdamW step per batch. Without `answers`, `prompts` are plain
    text and the reward is `even_fraction`; with them, `prompts` are user questions and the
    reward `chain_sum_reward`. `between(seconds)`, if given, runs after each step has been timed
    (outside the timed window). The dict holds torch's threads, each step's parts
    (`generation_s`, `reward_s`, `update_s`, `completion_tokens`, `reward_mean`) and, with
    answers, the first prompt's token ids as TRL rendered them."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    parts: list[dict] = []
    clock = {"begin": 0.0, "reward_in": 0.0, "reward_out": 0.0}

    class StepTimer(TrainerCallback):
        """Each optimizer step's wall seconds (generation, reward, loss, backward, update)."""

        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            clock["begin"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            end = time.perf_counter()
            self.seconds.append(end - clock["begin"])
            parts[-1].update(generation_s=clock["reward_in"] - clock["begin"],
                             reward_s=clock["reward_out"] - clock["reward_in"],
                             update_s=end - clock["reward_out"])
            if between is not None:
                between(self.seconds[-1])

    def timed(score: Callable[..., list[float]]):
        def reward(completions, completion_ids, **kwargs):
            clock["reward_in"] = time.perf_counter()
            values = score(completions, completion_ids, **kwargs)
            clock["reward_out"] = time.perf_counter()
            parts.append({"completion_tokens": int(sum(len(c) for c in completion_ids)),
                          "reward_mean": float(np.mean(values))})
            return values
        return reward

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    info: dict = {"trl_threads": torch.get_num_threads()}
    if answers is None:
        data = datasets.Dataset.from_dict({"prompt": prompts * (steps + 1)})
        reward = timed(lambda completions, completion_ids, **kw: [
            even_fraction(ids) for ids in completion_ids])
    else:
        chats = [[{"role": "user", "content": q}] for q in prompts]
        data = datasets.Dataset.from_dict({"prompt": chats * (steps + 1),
                                           "answer": list(answers) * (steps + 1)})
        reward = timed(lambda completions, completion_ids, answer, **kw: [
            chain_sum_reward(c[-1]["content"], a) for c, a in zip(completions, answer,
                                                                   strict=True)])
        info["prompt_ids"] = list(tokenizer.apply_chat_template(
            chats[0], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=1, max_steps=steps, per_device_train_batch_size=len(prompts) * samples,
        gradient_accumulation_steps=1, num_generations=samples,
        max_completion_length=new_tokens, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
        num_iterations=1, loss_type="grpo", learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=False,
        dataloader_num_workers=0, shuffle_dataset=False, log_completions=False,
        disable_tqdm=True, seed=0,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    info["parts"] = parts
    return timer.seconds, info
