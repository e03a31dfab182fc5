"""bench peers' other side: TRL's `GRPOTrainer`, transformers `generate` and a torch train step,
in a process of their own, under glibc's allocator defaults.

espo_jax's entry points run under glibc's huge-page tunable (`espo_jax.host_memory`); TRL,
transformers and torch users run with glibc's defaults, and the tunable slows TRL's step on the
2-core CPU (experiments/results/README.md, "Huge pages"). So `bench peers` runs each side as its
users do: espo_jax in the benchmark's process, the peers in this child, started with the
tunable taken out of `GLIBC_TUNABLES` (`host_memory.without_huge_pages`). The two sides still
alternate, one request at a time over a pipe: while one side runs, the other waits on a read.

Protocol: one JSON object a line. The parent writes requests to the child's stdin; the child
answers on its stdout, which carries nothing else (the libraries' own prints go to stderr).
- {"op": "load", "model_dir", "gen_prompts", "gen_new", "train_tokens", "lr"}: builds the
  generator and the train step on the saved model; answers the torch step's first loss and
  torch's settings.
- {"op": "generate"} / {"op": "train"}: one call; answers {"ok": true} when it is done.
- {"op": "trl", "model_dir", "prompts", "steps", "out_dir", "lr", "new_tokens", "samples"}: runs
  `GRPOTrainer` (`trl_grpo_seconds`); after each step it sends {"step_s": seconds} and waits
  for {"op": "continue"}; at the end it answers {"seconds": [...], "trl_threads": n}.
A request that fails is answered {"error": traceback} and the child exits with status 1.

This module imports neither jax nor espo_jax's JAX code, so the child holds no XLA runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def even_fraction(ids) -> float:
    """The GRPO workload's reward: the fraction of even token ids in a response."""
    ids = np.asarray(ids)
    return float(np.mean(ids % 2 == 0)) if ids.size else 0.0


# ---- the peers' own code, on a saved transformers model -----------------------------------------
def hf_generator(model_dir: str, prompts: list[list[int]], new_tokens: int
                 ) -> tuple[Callable[..., np.ndarray], int]:
    """`generate(sample=True)`: HF `generate` of exactly `new_tokens` per prompt (no end token),
    sampled at temperature 1 or greedy; returns the new tokens [N, new_tokens]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.as_tensor(np.array(prompts), dtype=torch.long)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)

    def generate(sample: bool = True) -> np.ndarray:
        with torch.no_grad():
            if sample:
                out = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     **kw)
            else:
                out = model.generate(ids, do_sample=False, **kw)
        return out[:, ids.shape[1]:].numpy()

    return generate, torch.get_num_threads()


def torch_train_stepper(model_dir: str, tokens: np.ndarray, lr: float
                        ) -> tuple[Callable[[], float], dict]:
    """Next-token loss + router aux loss, backward and AdamW on `tokens` with transformers +
    torch; returns the step (its loss) and the first step's loss (the step also warms up)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)

    def run() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels=tokens, output_router_logits=True).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    loss0 = run()
    return run, {"loss0": loss0, "attn_impl": model.config._attn_implementation,
                 "experts_impl": model.config._experts_implementation,
                 "torch_threads": torch.get_num_threads()}


def trl_grpo_seconds(model_dir: str, prompts: list[str], steps: int, out_dir: str, lr: float,
                     new_tokens: int, samples: int,
                     between: Callable[[float], object] | None = None
                     ) -> tuple[list[float], dict]:
    """Per-step seconds of TRL's GRPOTrainer on the workload (first step included): `prompts`
    each sampled `samples` times, `new_tokens` completion tokens, GRPO loss, beta 0, one AdamW
    step per batch. `between(seconds)`, if given, runs after each step has been timed (outside
    the timed window)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepTimer(TrainerCallback):
        """Each optimizer step's wall seconds (generation, reward, loss, backward, update)."""

        def __init__(self):
            self.seconds: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self._t)
            if between is not None:
                between(self.seconds[-1])

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = datasets.Dataset.from_dict({"prompt": prompts * (steps + 1)})

    def reward(completions, completion_ids, **kwargs):
        return [even_fraction(ids) for ids in completion_ids]

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
    return timer.seconds, {"trl_threads": torch.get_num_threads()}


# ---- the child ----------------------------------------------------------------------------------
def serve(requests, reply) -> None:
    """Answers `requests` (lines) on `reply` until the requests end (see the module docstring)."""
    send = lambda obj: (reply.write(json.dumps(obj) + "\n"), reply.flush())
    peers: dict[str, Any] = {}
    for line in requests:
        req = json.loads(line)
        op = req["op"]
        if op == "load":
            peers["generate"], _ = hf_generator(req["model_dir"], req["gen_prompts"],
                                                req["gen_new"])
            peers["generate"]()  # warm-up
            peers["train"], info = torch_train_stepper(req["model_dir"],
                                                       np.asarray(req["train_tokens"]), req["lr"])
            send(info)
        elif op in ("generate", "train"):
            peers[op]()
            send({"ok": True})
        elif op == "trl":
            def between(step_s: float) -> None:
                send({"step_s": step_s})
                answer = json.loads(requests.readline() or "{}")
                if answer.get("op") != "continue":
                    raise RuntimeError(f"expected 'continue' between TRL steps, got {answer}")

            seconds, info = trl_grpo_seconds(
                req["model_dir"], req["prompts"], req["steps"], req["out_dir"], req["lr"],
                req["new_tokens"], req["samples"], between=between)
            send({"seconds": seconds, **info})
        else:
            raise ValueError(f"unknown request {op!r}")


class PeerProcess:
    """The parent's handle on the child: `request(op, **fields)` sends one request and returns
    its answer; `trl(between, **fields)` runs TRL, calling `between()` after each of its steps."""

    def __init__(self, environ: Mapping[str, str]):
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "espo_jax.bench.peer_process"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=dict(environ), text=True, bufsize=1)

    def _ended(self) -> RuntimeError:
        return RuntimeError(f"the peer process ended (status {self._proc.wait()}) without an "
                            f"answer; its stderr is above")

    def _send(self, obj: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(obj) + "\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            raise self._ended() from None

    def _answer(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise self._ended()
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the peer process failed:\n{answer['error']}")
        return answer

    def request(self, op: str, **fields) -> dict:
        self._send({"op": op, **fields})
        return self._answer()

    def trl(self, between: Callable[[], object], **fields) -> dict:
        self._send({"op": "trl", **fields})
        while "step_s" in (answer := self._answer()):
            between()
            self._send({"op": "continue"})
        return answer

    def close(self) -> None:
        """Ends the child (end of its requests; killed if it has not exited a minute later)."""
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                pipe.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self._proc.kill()
        self.close()


def main() -> int:
    reply = os.fdopen(os.dup(1), "w")  # answers only; the libraries' prints go to stderr
    os.dup2(2, 1)
    try:
        serve(sys.stdin, reply)
    except BaseException:
        reply.write(json.dumps({"error": traceback.format_exc()}) + "\n")
        reply.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
