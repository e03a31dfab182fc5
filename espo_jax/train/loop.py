"""The single-process on-policy loop: engine -> buffer -> learner, alternating.

Each RL step: MS-ZVE picks prompts and sample counts; the embedded engine (FP8 weights when
configured) generates them with rewards scored in an overlapped pool; the groups go through the
rollout buffer (ArrayRecord shards) and come back through the reader with its exactly-once
cursor; MS-ZVE filters them; the learner recomputes old log-probs with router replay and
updates; the engine gets the new weights in memory. Everything random derives from
`config.seed` and the step, so a run killed and resumed from its checkpoint ends bitwise equal
to one that was never interrupted. What the loops share (set-up, resume, evaluation, summary)
is `train.run.Run`.
"""

from __future__ import annotations

import logging
import os
import time

import jax

from espo_jax import console, tasks
from espo_jax.buffer import BufferReader, BufferWriter
from espo_jax.buffer.shards import list_shards
from espo_jax.rewards.pool import RewardPool
from espo_jax.rollout import scheduling
from espo_jax.rollout.generate import generate_scored_groups
from espo_jax.train.metrics import rollout_metrics
from espo_jax.train.run import Run, build_engine, raise_failed_rewards
from espo_jax.zve import (
    ZVEPipeline,
    failed_reward_fraction,
    groups_and_rewards,
    require_scored,
)


def discard_unread(buffer_dir: str, cursor: dict | None) -> int:
    """Deletes shards written after `cursor` (by a run that died before its next checkpoint):
    the resumed run regenerates exactly those groups, so they must not be read twice."""
    streams = (cursor or {}).get("streams", {})
    removed = 0
    for shard in list_shards(buffer_dir):
        pos = streams.get(shard.stream)
        if pos is None or shard.index >= pos[0]:
            os.remove(os.path.join(buffer_dir, shard.name))
            removed += 1
    return removed


class SyncRun(Run):
    """The default single-process loop; `run()` returns the summary dict."""

    def __init__(self, config, workdir: str):
        super().__init__(config, workdir)
        self.engine = build_engine(self.setup, config.rollout.precision)
        reward, self.target_fn = tasks.reward_fn(self.setup.task)
        self.pool = RewardPool(reward, num_workers=config.rollout.reward_workers,
                               timeout_s=config.rollout.reward_timeout_s,
                               backend=config.rollout.reward_backend, detokenize=self.decode)

    def run(self) -> dict:
        c, s = self.config, self.setup
        state, meta = self._start()
        learner = self.make_learner(state, meta)
        removed = discard_unread(self.buffer_dir, meta["cursor"]) if os.path.isdir(
            self.buffer_dir) else 0
        if removed:
            logging.info("discarded %d buffer shards written after the last checkpoint", removed)
        writer = BufferWriter(self.buffer_dir, "sync")
        reader = BufferReader(self.buffer_dir, cursor=meta["cursor"],
                              retention="keep" if c.buffer.keep_consumed else "delete")
        zve = ZVEPipeline(s.train_prompts, c.zve, seed=c.seed, max_len=c.rollout.max_new_tokens)
        predictor = (scheduling.LengthPredictor.from_state_dict(meta["predictor"])
                     if meta["predictor"] else scheduling.LengthPredictor())
        if meta["zve"]:
            zve.load_state_dict(meta["zve"])
        n_experts = s.model_config.n_experts if s.model_config.n_moe_layers else None
        step = meta["rl_step"]
        rounds = [0]
        generated: list = []  # this step's groups, every round (failed-reward check)

        def rollout(plan):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), step), rounds[0])
            rounds[0] += 1
            groups = generate_scored_groups(
                self.engine, self.pool, plan, rng=key, policy_version=step,
                n_experts=n_experts, admission="longest_first", predictor=predictor,
                target_fn=self.target_fn, task=s.task.name)
            for g in groups:
                writer.write(g)
                predictor.observe(g.prompt_id, [r.length for r in g.responses])
            writer.flush()
            read = reader.read(len(groups), timeout_s=60.0, policy_version=step)
            if len(read) != len(groups):
                raise RuntimeError(f"buffer returned {len(read)} of {len(groups)} groups; "
                                   f"reader errors: {list(reader.errors)[-3:]}")
            require_scored(read)
            generated.extend(read)
            return read

        if step == 0 and c.zve.offline.enabled and not self.finished(step, meta):
            self.engine.load_params(state.params)
            _, m = zve.offline_prune(rollout)
            meta["offline_tokens"] += int(m.get("zve/offline_tokens", 0))
            self.logger.write(0, m, phase="rl")
            self.log_consumed(0, generated, reader.cursor)
        progress = console.Progress("RL", c.train.steps)
        while not self.finished(step, meta):
            t_step = time.time()
            rounds[0] = 0
            generated.clear()
            self.engine.load_params(state.params)
            batch, zmetrics = zve.step(c.rollout.prompts_per_step, rollout)
            groups, rewards = groups_and_rewards(batch)
            t_update = time.time()
            state, lmetrics = learner.update(state, groups, rewards)
            t_done = time.time()
            step += 1
            self.record_step(meta, step, zmetrics, lmetrics)
            done = self.finished(step, meta)
            failed = failed_reward_fraction(generated)
            metrics = {**zmetrics, **lmetrics, **self.pool.metrics(),
                       **rollout_metrics(groups, rewards), "reward/failed_frac": failed,
                       "time/step_s": t_done - t_step, "time/rollout_s": t_update - t_step,
                       "time/update_s": t_done - t_update}
            if c.eval.every and step % c.eval.every == 0 and not done:
                metrics.update(self.evaluate(state.params))
            self.logger.write(step, metrics, phase="rl")
            self.samples.write(step, generated, batch)
            self.log_consumed(step, generated, reader.cursor)
            logging.info("RL step %d/%d: rollout acc %.3f, zv frac %.2f, %.1f s", step,
                         c.train.steps, metrics["rollout/accuracy"],
                         zmetrics.get("zve/zero_variance_frac_before", 0.0), metrics["time/step_s"],
                         extra=console.FILE_ONLY)
            progress.update(step, {"rollout acc": metrics["rollout/accuracy"],
                                   "zv frac": zmetrics.get("zve/zero_variance_frac_before", 0.0),
                                   "s/step": metrics["time/step_s"],
                                   **({"held-out acc": metrics["eval/accuracy"]}
                                      if "eval/accuracy" in metrics else {})},
                            frac=self.share_done(step, meta))
            too_many_failed = failed > c.rollout.max_failed_reward_frac
            if step % c.checkpoint.every == 0 or done or too_many_failed:
                meta.update(cursor=reader.cursor, zve=zve.state_dict(),
                            predictor=predictor.state_dict())
                self.ckpt.save(step, state, meta)
                self.ckpt.wait()
                reader.commit(meta["cursor"])
            if too_many_failed:
                raise_failed_rewards(step, failed, c.rollout.max_failed_reward_frac)
        writer.close()
        reader.close()
        self.pool.close()
        return self.finish(state, meta)


def run_sync(config, workdir: str) -> dict:
    return SyncRun(config, workdir).run()


