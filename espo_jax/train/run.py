"""What every RL loop shares: `Run`, the set-up, resume order, warm start, evaluation and summary.

The single-process loop (`train.loop.SyncRun`) and the worker layout's learner
(`train.async_loop.AsyncRun`) subclass `Run` and write its `run()`: where a step's groups come
from and what happens between updates. Here: building the run (model, data, engines,
checkpointer, logs), restoring it in resume order (WORKDIR's checkpoint, its warm start,
`checkpoint.init_from`, scratch with the warm start), trimming logs a dead run wrote past its
checkpoint, the learner with its anchor and KL reference, the stopping rule (steps or token
budget), the per-step run totals and `consumed.jsonl`, and the final evaluation and
summary.json.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax

from espo_jax import distributed, run_setup, sharding, tasks
from espo_jax.rollout.engine import Engine
from espo_jax.train import checkpoint
from espo_jax.train import state as state_lib
from espo_jax.train.checkpoint import Checkpointer
from espo_jax.train.evaluate import evaluate
from espo_jax.train.learner import Learner
from espo_jax.train.metrics import MetricLogger, trim_jsonl
from espo_jax.train.samples import SampleLog
from espo_jax.train.warmstart import warm_seq_len, warm_start
from espo_jax.zve import accounting


def build_engine(setup, precision: str) -> Engine:
    """The run's rollout engine at `precision` (`rollout.*` sizes; the eval engine is fp32)."""
    c = setup.config.rollout
    sampling = run_setup.sampling_config(setup.config, (setup.tokenizer.eos_id,))
    return Engine(setup.model_config, sampling=sampling, max_slots=c.num_slots,
                  steps_per_sync=c.steps_per_sync, prefill_rows=c.prefill_rows,
                  max_cache_len=c.max_prompt_len + c.max_new_tokens, precision=precision,
                  shards=c.engine_shards)


def raise_failed_rewards(step: int, failed: float, limit: float) -> None:
    """Stops a run whose reward function failed too often (its checkpoint is saved first)."""
    raise RuntimeError(
        f"RL step {step}: the reward function failed (or timed out) on {failed:.0%} of the "
        f"step's responses, more than rollout.max_failed_reward_frac={limit}; the checkpoint "
        f"of step {step} is saved. Fix the reward function and rerun the same command to resume")


class Run:
    """What every loop shares: set-up, resume order, warm start, evaluation, summary.

    Subclasses implement `run()` and return `finish(state, meta)`; what they put in
    `extra_summary` goes into summary.json too."""

    extra_summary: dict = {}

    def __init__(self, config, workdir: str):
        self.t0 = time.time()
        self.config, self.workdir = config, workdir
        # Before any work: the checkpoint `_start` restores, and whether it fits the model.
        self.start_point = checkpoint.start_point(workdir, config.checkpoint.init_from)
        if self.start_point:
            checkpoint.check_params(*self.start_point, run_setup.abstract_params(config))
        self.setup = run_setup.build(config, workdir)
        self.logger = MetricLogger(workdir)
        self.buffer_dir = config.buffer.dir or os.path.join(workdir, "buffer")
        self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=config.checkpoint.keep)
        self.eval_engine = build_engine(self.setup, "fp32")
        self.decode = tasks.decoder(config, self.setup.tokenizer)
        self.outcome = tasks.outcome_fn(self.setup.task)
        self.samples = SampleLog(workdir, config, self.setup.tokenizer, self.decode, self.logger)

    # -- pieces -----------------------------------------------------------------------------
    def evaluate(self, params, prompts=None) -> dict:
        if jax.process_count() > 1:  # every process evaluates on its own devices
            params = distributed.gather_to_host(params)
        self.eval_engine.load_params(params)
        return evaluate(self.eval_engine, prompts or self.setup.eval_prompts, decode=self.decode,
                        outcome=self.outcome, pass_k=self.config.eval.pass_k,
                        rng=jax.random.key(self.config.seed + 1))

    def _initial_params(self):
        s = self.setup
        if s.hf_params is not None:
            return distributed.put_global(s.hf_params,
                                          sharding.param_shardings(s.model_config, s.mesh, s.rules))
        return sharding.init_sharded(s.model_config, s.mesh, s.rules,
                                     rng=jax.random.key(self.config.seed))

    def _new_state(self, params):
        # The schedule counts optimiser updates: updates_per_batch per RL step.
        tc = self.config.train
        tx = state_lib.make_optimizer(self.config.optim, tc.steps * tc.updates_per_batch)
        make = jax.jit(lambda p: state_lib.create_train_state(p, tx, jax.random.key(0)))
        return make(params)

    def _start(self):
        """Resume order: WORKDIR's latest checkpoint, then WORKDIR's warm-started policy, then
        `checkpoint.init_from`, then scratch (with the warm start)."""
        c = self.config
        state = self._new_state(self._initial_params())
        warm = Checkpointer(os.path.join(self.workdir, "warmstart"), keep=1, async_save=False)
        for ckpt in (self.ckpt, warm):
            if ckpt.latest_step() is not None:
                state, meta = ckpt.restore(state)
                meta = accounting.current_names(meta)  # a checkpoint of older code
                logging.info("resuming from %s at RL step %d", ckpt.directory, meta["rl_step"])
                self._trim_logs(meta["rl_step"] if ckpt is self.ckpt else 0)
                warm.close()
                self.t_rl = time.time()
                return state, meta
        self._trim_logs(None)
        meta = {"rl_step": 0, "generated_tokens": 0, "no_signal_tokens": 0, "offline_tokens": 0,
                "mismatch_sum": 0.0, "mismatch_n": 0, "cursor": None, "zve": None,
                "predictor": None, "warmstart": {}}
        if c.checkpoint.init_from:  # WORKDIR has none: start_point resolved init_from
            state, _ = Checkpointer(self.start_point[0], async_save=False).restore(state)
            state = self._new_state(state.params)
        elif c.warmstart.steps > 0:
            # Warm-start progress is measured on samples of its own (train) levels.
            warm_eval = run_setup.balanced_subset(self.setup.warm_prompts, c.eval.num_prompts,
                                                  c.seed)
            params, done = warm_start(
                self.setup, state.params,
                evaluate_fn=lambda p: self.evaluate(p, warm_eval),
                log=lambda step, m: self.logger.write(step, m, phase="warmstart"),
            )
            state = self._new_state(params)
            meta["warmstart_steps"] = done["warmstart/steps"]
            meta["warmstart_seconds"] = done["warmstart/seconds"]
        meta["warmstart"] = self.evaluate(state.params)
        self.logger.write(0, meta["warmstart"], phase="eval")
        logging.info("held-out accuracy before RL: %.3f on %d %s prompts",
                     meta["warmstart"]["eval/accuracy"], len(self.setup.eval_prompts),
                     self.config.eval.split)
        # The warm-started policy (RL step 0), kept apart from the RL checkpoints' retention: a
        # crash during RL never repeats the warm start, and other runs can start from it
        # (`--config.checkpoint.init_from=WORKDIR/warmstart`, e.g. the baselines).
        warm.save(0, state, meta)
        warm.close()
        self.t_rl = time.time()
        return state, meta

    def _trim_logs(self, step: int | None) -> None:
        """A run started again in its WORKDIR redoes what came after the checkpoint it resumes
        from (`step`: that RL checkpoint's step; 0: the warm-started policy; None: none):
        drops the rows a dead run logged past it from metrics.jsonl, samples.jsonl and
        consumed.jsonl, so that each step has its rows once, as in a run never interrupted.
        Kept: with any checkpoint, the warm start's rows and the evaluation before RL; with an
        RL checkpoint, every row up to `step` (step 0's offline pass runs after the warm-start
        checkpoint, so resuming from that one redoes it)."""
        if not distributed.is_primary():
            return

        def covered(row: dict) -> bool:
            if step is None:
                return False
            phase = row.get("phase")
            return (phase == "warmstart" or (phase == "eval" and row["step"] == 0)
                    or (step > 0 and row["step"] <= step))

        dropped = self.logger.trim(covered)
        for name in ("samples.jsonl", "consumed.jsonl"):
            dropped += trim_jsonl(os.path.join(self.workdir, name), covered)
        if dropped:
            logging.info("dropped %d log rows written after the checkpoint resumed from",
                         dropped)

    def finished(self, step: int, meta: dict) -> bool:
        """RL ends after `train.steps` steps, or (with `train.max_tokens` > 0) after the step at
        which the run's generated tokens (the sync loop's offline pass included; the async
        learner's count is the tokens it consumed) reach `train.max_tokens`: runs compared at an
        equal token budget stop at the same spend, whatever their losses make the samples."""
        budget = self.config.train.max_tokens
        spent = meta["generated_tokens"] + meta["offline_tokens"]
        return step >= self.config.train.steps or (budget > 0 and spent >= budget)

    def share_done(self, step: int, meta: dict) -> float:
        """How much of RL is behind after `step`: of its steps, or of the tokens its budget
        leaves after the offline pass when that is further along (what the progress bar and
        its eta show; 1 when `finished`)."""
        budget = self.config.train.max_tokens
        steps = step / self.config.train.steps
        if budget <= 0:
            return steps
        left = budget - meta["offline_tokens"]
        return max(steps, meta["generated_tokens"] / left if left > 0 else 1.0)

    def make_learner(self, state, meta) -> Learner:
        """The learner for `state`'s shardings, with the warm-start levels' worked solutions as
        its anchor when `train.anchor_coef` > 0; with `loss.kl_coef` > 0 its reference is the
        policy RL started from: `state` itself at RL step 0, else WORKDIR/warmstart (saved by
        `_start` before the first RL step, so a resumed run penalises against the same one)."""
        s = self.setup
        learner = Learner(self.config, s.model_config, s.mesh,
                          jax.tree.map(lambda x: x.sharding, state))
        if self.config.train.anchor_coef > 0:  # worked solutions, at most the RL row length
            learner.set_anchor(s.warm_prompts, s.tokenizer,
                               warm_seq_len(s.warm_prompts, s.tokenizer, learner.seq_len))
        if self.config.loss.kl_coef > 0:
            if meta["rl_step"] == 0:
                learner.set_reference(state.params)
            else:
                warm = Checkpointer(os.path.join(self.workdir, "warmstart"), keep=1,
                                    async_save=False)
                learner.set_reference(warm.restore(state)[0].params)
                warm.close()
        return learner

    def finish(self, state, meta) -> dict:
        final = self.evaluate(state.params)
        self.logger.write(meta["rl_step"], final, phase="eval")
        logging.info("held-out accuracy after %d RL steps: %.3f", meta["rl_step"],
                     final["eval/accuracy"])
        test = {}
        if self.setup.test_prompts:  # eval.final_test: chosen on validation, reported on test
            test = self.evaluate(state.params, self.setup.test_prompts)
            self.logger.write(meta["rl_step"], {k.replace("eval/", "test/"): v
                                                for k, v in test.items()}, phase="eval")
            logging.info("test accuracy after %d RL steps: %.3f on %d prompts", meta["rl_step"],
                         test["eval/accuracy"], len(self.setup.test_prompts))
        generated = meta["generated_tokens"] + meta["offline_tokens"]
        summary = {
            "warmstart_accuracy": meta["warmstart"].get("eval/accuracy", 0.0),
            "final_accuracy": final["eval/accuracy"],
            "steps": meta["rl_step"],
            "wall_seconds": time.time() - self.t0,
            # Of the warm start when it ran in this WORKDIR (0 when restored from init_from).
            "warmstart_steps": meta.get("warmstart_steps", 0),
            "warmstart_seconds": meta.get("warmstart_seconds", 0.0),
            # From the policy being ready to the end (offline pass, RL steps, evaluations) in
            # this process: a resumed run counts only its own part.
            "rl_seconds": time.time() - self.t_rl,
            "generated_tokens": generated,  # the offline pass's included
            # no_signal_token_frac and ..._with_offline: espo_jax.zve.accounting.
            **accounting.run_fractions(meta["generated_tokens"], meta["no_signal_tokens"],
                                       meta["offline_tokens"]),
            "mean_abs_logp_mismatch": meta["mismatch_sum"] / max(meta["mismatch_n"], 1),
            "skipped_updates": int(jax.device_get(state.skipped)),
            "warmstart": meta["warmstart"],
            "final": final,
            **({"test_accuracy": test["eval/accuracy"], "test": test} if test else {}),
            **self.extra_summary,
        }
        if distributed.is_primary():
            with open(os.path.join(self.workdir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
        self.ckpt.close()
        self.logger.close()
        return summary

    def log_consumed(self, step: int, groups, cursor: dict) -> None:
        """One line of `WORKDIR/consumed.jsonl` per RL step (0: the offline pass before RL):
        the learner's policy version when it read the step's groups (`step` - 1), the time,
        the reader's cursor after them, and every group read (worker, prompt id, the policy
        version that generated it). `python -m espo_jax.buffer inspect` reads it for the
        staleness at consumption (a resumed run's rows: `_trim_logs`)."""
        if distributed.is_primary():
            line = {"step": step, "learner_version": max(step - 1, 0), "time": time.time(),
                    "cursor": cursor, "groups": [
                        [g.meta.get("worker", "?"), str(g.prompt_id), int(g.policy_version)]
                        for g in groups]}
            with open(os.path.join(self.workdir, "consumed.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")

    def record_step(self, meta: dict, step: int, zmetrics: dict, lmetrics: dict) -> None:
        """Adds one RL step's token and mismatch counts to the run totals in `meta`."""
        meta["rl_step"] = step
        meta["generated_tokens"] += int(zmetrics.get("zve/tokens_generated", 0))
        meta["no_signal_tokens"] += int(zmetrics.get("zve/no_signal_tokens", 0))
        meta["mismatch_sum"] += lmetrics.get("mismatch/logp_abs_mean", 0.0)
        meta["mismatch_n"] += 1
