"""The learner: rollout groups in, optimiser updates out.

`Learner.update(state, groups, rewards)` turns a rollout batch (the groups and, parallel to
them, each group's float32 rewards: MS-ZVE's, `espo_jax.zve`; the records are not read for
rewards) into fixed-shape minibatches (advantages on the host, per group, so groups may have
different sizes; a response whose reward call failed or timed out is left out of its group's
advantages and of the loss, `group_advantages`), runs the old-policy pass on all of them
(router replay, mismatch metrics), then one optimiser update per minibatch. A rollout batch
that fits one minibatch skips the separate old-policy pass: its only update runs at the old
parameters, so the update's own forward gives the old log-probs (`step.rl_loss(fused=True)`;
one forward of the batch less per step). The update steps are jitted with explicit shardings
and donation of the train state, and compiled ahead of time on their first inputs
(`jit(...).lower(...).compile()`), logging XLA's memory report (`Learner.memory_report`).

With `train.grad_threads` = n > 1 each update's rows are split into n parts balanced by tokens
(each packed on its own), the parts' gradients computed at once, each by its own host thread
(`step.rl_part_gradients`), and joined by their weights in one update (`step.rl_apply_parts`):
the update of all the rows, as micro-batches give it. On a CPU, XLA runs many of a program's
ops on one core at a time; two programs at once keep both cores busy (the default update on a
2-core AMD EPYC: gradients 1012-1089 -> 850-900 ms). Only a one-device, one-process mesh
splits its updates so; a larger mesh already runs each device's rows at once.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import ml_collections
import numpy as np

from espo_jax import console, distributed, mesh_rules, sharding
from espo_jax.buffer.records import RolloutGroup
from espo_jax.train import step as step_lib
from espo_jax.train.advantages import config_advantages, trained_responses
from espo_jax.train.batch import RLBatch, balanced_parts, pack_sequences, prompt_keys, rl_seq_len
from espo_jax.train.state import TrainState
from espo_jax.train.warmstart import sft_batch
from espo_jax.zve.groups import require_scored


def memory_report(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled executable, in bytes ({} where not reported)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {f.removesuffix("_size_in_bytes"): int(getattr(analysis, f)) for f in fields
            if hasattr(analysis, f)}


class Learner:
    """Holds the compiled old-policy pass and update step for one model and config."""

    def __init__(self, config: ml_collections.ConfigDict, model_config, mesh, state_shardings):
        self.config = config
        self.model_config = model_config
        self.mesh = mesh
        self.rows = config.rollout.prompts_per_step * config.zve.n_samples
        self.rows_per_update = self.rows // config.train.updates_per_batch
        # Parts only where one process drives one device (module docstring): a larger mesh
        # already runs each device's rows at once.
        self.grad_threads = (config.train.grad_threads if mesh.devices.size == 1
                             and jax.process_count() == 1 else 1)
        self.rows_per_part = self.rows_per_update // self.grad_threads
        self._pool = (ThreadPoolExecutor(self.grad_threads, thread_name_prefix="grad-part")
                      if self.grad_threads > 1 else None)
        self.seq_len = rl_seq_len(config)
        # a prompt's responses behind one copy of it (packed rows only)
        self.share_prompts = bool(config.train.pack and config.train.get("share_prompts", False))
        # the worker layout's mismatch metrics apart for stale and on-policy rows (`update`)
        self.split_stale = config.train.loop == "async"
        self.n_data_shards = mesh_rules.batch_shards(config.mesh)
        self.moe_shape = (
            (model_config.n_moe_layers, model_config.top_k) if model_config.n_moe_layers else None
        )
        self.rules = mesh_rules.rules_from_config(config.mesh)
        rows_sharding = sharding.batch_sharding(mesh, self.rules)
        replicated = sharding.replicated(mesh)
        self.batch_sharding = rows_sharding
        kw = dict(
            model_config=model_config,
            replay=config.train.replay,
            chunk_size=config.train.logprob_chunk,
        )
        batch_shardings = jax.tree.map(lambda _: rows_sharding, self._example_batch())
        # The passes without a gradient run the forward-only dispatch (the same outputs).
        frozen_kw = {**kw, "model_config": model_config.forward_only()}
        options = step_lib.compiler_options(model_config)
        self._old_pass = jax.jit(  # run through `_run_parts` (compiled under the rules)
            functools.partial(step_lib.old_policy_pass, **frozen_kw),
            in_shardings=(state_shardings.params, batch_shardings),
            out_shardings=None, compiler_options=options,
        )
        self.ref_params = None  # the KL penalty's reference policy (`set_reference`)
        self._anchor = None  # worked solutions of the supervised anchor (`set_anchor`)
        self._ref_pass = self._under_rules(jax.jit(
            functools.partial(step_lib.reference_pass, **frozen_kw),
            in_shardings=(state_shardings.params, None),  # the batch as put (after old pass)
            out_shardings=None, compiler_options=options,
        ))
        # A copy in new buffers: the train step donates the state, the reference must outlive it.
        self._copy = jax.jit(lambda tree: jax.tree.map(lambda x: x + 0, tree),
                             in_shardings=(state_shardings.params,),
                             out_shardings=state_shardings.params)
        step_kw = dict(
            loss_config=config.loss,
            zvp_alpha=config.zve.zvp.alpha if config.zve.zvp.enabled else 0.0,
            negative_scale=config.advantage.negative_scale,
            n_micro=config.train.micro_batches,
            anchor_coef=config.train.anchor_coef,
            **kw,
        )
        self._train_step, self._fused_step = (
            jax.jit(
                functools.partial(step_lib.rl_train_step, fused=fused, **step_kw),
                in_shardings=(state_shardings, None, None),
                out_shardings=(state_shardings, replicated),
                donate_argnums=(0,), compiler_options=options,
            )
            for fused in (False, True)
        )
        part_kw = {k: v for k, v in step_kw.items() if k != "anchor_coef"}
        self._part_grads, self._fused_part_grads = (
            jax.jit(
                functools.partial(step_lib.rl_part_gradients, fused=fused, **part_kw),
                in_shardings=(state_shardings.params, None),
                out_shardings=(replicated, state_shardings.params, replicated, replicated),
                compiler_options=options,
            )
            for fused in (False, True)
        )
        self._anchor_part_grads = jax.jit(
            functools.partial(step_lib.sft_part_gradients, model_config=model_config,
                              chunk_size=config.train.logprob_chunk),
            in_shardings=(state_shardings.params, None),
            out_shardings=(replicated, state_shardings.params, replicated, replicated),
            compiler_options=options,
        )
        self._apply_parts = jax.jit(
            functools.partial(step_lib.rl_apply_parts, anchor_coef=config.train.anchor_coef),
            in_shardings=(state_shardings, None, None),
            out_shardings=(state_shardings, replicated),
            donate_argnums=(0,), compiler_options=options,
        )
        self._bias_update = None  # DeepSeek's auxiliary-loss-free balancing, when configured
        if model_config.router == "sigmoid_group" and model_config.router_bias_update_rate:
            self._bias_update = jax.jit(
                functools.partial(step_lib.router_bias_update, model_config=model_config),
                in_shardings=(state_shardings, None), out_shardings=state_shardings,
                donate_argnums=(0,), compiler_options=options,
            )
        self._compiled: dict[tuple, object] = {}  # (name, input shapes) -> executable
        self.memory_report: dict[str, dict[str, int]] = {}  # per compiled update step

    def set_anchor(self, prompts: Sequence[dict], tokenizer, seq_len: int) -> None:
        """Worked solutions for the supervised anchor (`train.anchor_coef` > 0): each update
        draws `train.anchor_rows` of them, seeded by `config.seed` and the optimiser step (so a
        resumed run draws the same ones)."""
        if not prompts:
            raise ValueError("train.anchor_coef > 0 needs worked solutions: warmstart.levels "
                             "selects no prompts")
        self._anchor = (list(prompts), tokenizer, seq_len)

    def anchor_batch(self, opt_step: int) -> dict | None:
        """The anchor rows of optimiser update `opt_step` (None when the anchor is off)."""
        if self.config.train.anchor_coef <= 0:
            return None
        if self._anchor is None:
            raise ValueError("train.anchor_coef > 0: call Learner.set_anchor(prompts, ...) "
                             "before update")
        prompts, tokenizer, seq_len = self._anchor
        rows = self.config.train.anchor_rows or self.config.warmstart.batch_size
        rng = np.random.default_rng([self.config.seed, opt_step])
        idx = rng.integers(0, len(prompts), size=rows)
        return sft_batch(prompts, idx, tokenizer, seq_len)

    def set_reference(self, params) -> None:
        """Fixes the reference policy of the KL penalty (`loss.kl_coef` > 0): the policy RL
        started from. The learner keeps its own copy."""
        self.ref_params = self._copy(params)

    def _under_rules(self, fn):
        """`fn` traced under the run's logical-axis rules (`config.mesh.rules`): the model's
        activation constraints act on this learner's mesh. jit keeps its first trace, so the
        rules must be set on every call that may trace."""

        @functools.wraps(fn)
        def call(*args):
            with sharding.activation_sharding(self.mesh, self.rules):
                return fn(*args)

        return call

    def _executable(self, name: str, fn, *args):
        """`fn`'s ahead-of-time executable for `args`, compiled (and its memory report logged)
        on the first call with the shapes of `args[1]` (the batch, or an update's parts), traced
        under the logical-axis rules; unpacked batches keep one shape (one compile), packed ones
        a few (`batch.PACK_BUCKETS`). `memory_report[name]` is that of the latest shape compiled."""
        key = (name, tuple(np.shape(x) for x in jax.tree.leaves(args[1])))
        exe = self._compiled.get(key)
        if exe is None:
            start = time.time()
            with sharding.activation_sharding(self.mesh, self.rules):
                exe = fn.lower(*args).compile()
            self._compiled[key] = exe
            self.memory_report[name] = report = memory_report(exe)
            shape = args[1].tokens.shape if isinstance(args[1], RLBatch) else "its inputs"
            logging.info("compiled %s for %s in %.1f s; memory (bytes): %s", name, shape,
                         time.time() - start, report or "not reported by this backend",
                         extra=console.FILE_ONLY)
        return exe

    def _run_compiled(self, name: str, fn, *args):
        """`fn(*args)` through its ahead-of-time executable (`_executable`)."""
        return self._executable(name, fn, *args)(*args)

    def _run_parts(self, calls: Sequence[tuple]) -> list:
        """`fn(head, part)` for every (name, fn, head, part) of `calls`: at once on the
        learner's threads (each waiting for its result there) when it has them, in order
        otherwise. Compiled first, here: threads never compile."""
        exes = [(self._executable(name, fn, head, part), head, part)
                for name, fn, head, part in calls]
        if self._pool is None:
            return [exe(head, part) for exe, head, part in exes]
        futures = [self._pool.submit(lambda e, h, p: jax.block_until_ready(e(h, p)), *x)
                   for x in exes]
        return [f.result() for f in futures]

    def _example_batch(self) -> RLBatch:
        return self.pack([], [], [], [], np.zeros(0), np.zeros(0),
                         stale=np.zeros(0, bool) if self.split_stale else None)

    def pack(self, prompts, responses, blogps, routings, adv, signs,
             rows: int | None = None, trained: np.ndarray | None = None,
             stale: np.ndarray | None = None) -> RLBatch:
        return pack_sequences(
            prompts, responses, blogps, routings, adv, signs, rows=rows or self.rows_per_update,
            trained=trained, stale=stale, seq_len=self.seq_len, pad_id=0,
            n_shards=self.n_data_shards,
            moe_shape=self.moe_shape, pack=self.config.train.pack,
            pack_len=self.config.train.pack_len, share_prompts=self.share_prompts,
            head_len=self.config.rollout.max_new_tokens,
        )

    def _chunks(self, groups: Sequence[RolloutGroup], rewards: Sequence[np.ndarray],
                policy_version: int | None = None):
        """Each minibatch's responses as (pairs of prompt and response, advantages, RL-ZVP
        signs, `trained_responses`, stale flags or None), `rows_per_update` responses at a time
        (advantages from `rewards`, one float32 array per group; with `advantage.overlong_buffer`
        > 0 DAPO's overlong penalty is added to them first). In the worker layout
        (`split_stale`) a group older than `policy_version`, the learner's, is stale (None:
        none is); elsewhere the batches carry no staleness."""
        adv, signs = config_advantages(groups, rewards, self.config)
        trained = trained_responses(groups)
        stale = None  # the worker layout's batches say which responses are stale (all or none)
        if self.split_stale:
            stale = np.array([policy_version is not None and g.policy_version < policy_version
                              for g in groups for _ in g.responses], bool)
        flat = [(g.prompt_tokens, r) for g in groups for r in g.responses]
        for start in range(0, max(len(flat), 1), self.rows_per_update):
            chunk = flat[start : start + self.rows_per_update]
            sl = slice(start, start + len(chunk))
            yield chunk, adv[sl], signs[sl], trained[sl], None if stale is None else stale[sl]

    def _pack_chunk(self, chunk, adv, signs, trained, stale, rows: int) -> RLBatch:
        return self.pack([p for p, _ in chunk], [r.tokens for _, r in chunk],
                         [r.logprobs for _, r in chunk], [r.routed_experts for _, r in chunk],
                         adv, signs, rows=rows, trained=trained, stale=stale)

    def minibatches(self, groups: Sequence[RolloutGroup], rewards: Sequence[np.ndarray],
                    policy_version: int | None = None) -> list[RLBatch]:
        """Fixed-shape minibatches of `rows_per_update` rows holding every response of `groups`
        (`_chunks`: advantages from `rewards`, staleness against `policy_version`)."""
        return [self._pack_chunk(*chunk, self.rows_per_update)
                for chunk in self._chunks(groups, rewards, policy_version)]

    def update_batches(self, groups: Sequence[RolloutGroup], rewards: Sequence[np.ndarray],
                       policy_version: int | None = None) -> list[list[RLBatch]]:
        """Per minibatch (`minibatches`), its `train.grad_threads` parts of `rows_per_part`
        rows, its responses split between them by tokens (`batch.balance_rows`: the parts'
        gradients take about as long); one part, the minibatch itself, without threads."""
        if self.grad_threads == 1:
            return [[b] for b in self.minibatches(groups, rewards, policy_version)]
        out = []
        for chunk, adv, signs, trained, stale in self._chunks(groups, rewards, policy_version):
            lengths = [len(p) + len(r.tokens) for p, r in chunk]
            keys = (prompt_keys([p for p, _ in chunk], [r.routed_experts for _, r in chunk])
                    if self.share_prompts else None)  # a prompt's responses in one part
            out.append([self._pack_chunk([chunk[i] for i in idx], adv[idx], signs[idx],
                                         trained[idx], None if stale is None else stale[idx],
                                         self.rows_per_part)
                        for idx in balanced_parts(lengths, self.grad_threads,
                                                  self.rows_per_part, keys)])
        return out

    def update(self, state: TrainState, groups: Sequence[RolloutGroup],
               rewards: Sequence[np.ndarray], policy_version: int | None = None):
        """Old-policy pass over the whole rollout batch, then one update per minibatch (a
        batch of one minibatch: one fused update, see the module docstring). `rewards`: one
        float32 array per group (MS-ZVE's, `zve.groups_and_rewards`). A group with an
        unscored response raises `zve.UnscoredGroupError` before anything runs. A response
        whose reward call failed is left out of the loss (`trained_responses`,
        `group_advantages`); `train/masked_failed_responses` counts them. `policy_version`
        (the worker layout): the learner's, so the mismatch metrics split the groups an older
        policy sampled from the others (`step.old_policy_metrics`).

        Returns the new state and the metrics (means over minibatches, as numpy scalars)."""
        require_scored(groups)
        masked_failed = int(np.sum(~trained_responses(groups)))
        # Each process transfers only the rows of its own devices (the same on one process).
        batches = [[distributed.put_batch(b, self.batch_sharding) for b in parts]
                   for parts in self.update_batches(groups, rewards, policy_version)]
        kl = self.config.loss.kl_coef > 0
        if kl and self.ref_params is None:
            raise ValueError("loss.kl_coef > 0 needs the reference policy: call "
                             "Learner.set_reference(params) before update")
        fused = len(batches) == 1  # the only update runs at the old parameters
        prepared, metrics = [], []
        for parts in batches:
            if not fused:
                passed = self._run_parts([("old_pass", self._old_pass, state.params, b)
                                          for b in parts])
                parts = [b for b, _ in passed]
                metrics += [m for _, m in passed]
            if kl:
                parts = [self._ref_pass(self.ref_params, b) for b in parts]
            prepared.append(parts)
        step0 = int(jax.device_get(state.step)) if self.config.train.anchor_coef > 0 else 0
        for i, parts in enumerate(prepared):
            anchor = self.anchor_batch(step0 + i)
            if self.grad_threads == 1:
                if anchor is not None:
                    anchor = distributed.put_batch(anchor, self.batch_sharding)
                name, step_fn = (("fused_step", self._fused_step) if fused
                                 else ("train_step", self._train_step))
                state, m = self._run_compiled(name, step_fn, state, parts[0], anchor)
            else:
                # The anchor's rows in as many parts, computed on the same threads.
                anchors = [] if anchor is None else [
                    distributed.put_batch({k: v[j::self.grad_threads] for k, v in anchor.items()},
                                          self.batch_sharding)
                    for j in range(self.grad_threads)]
                name, grads_fn = (("fused_part", self._fused_part_grads) if fused
                                  else ("part", self._part_grads))
                out = self._run_parts(
                    [(name, grads_fn, state.params, b) for b in parts]
                    + [("anchor_part", self._anchor_part_grads, state.params, a)
                       for a in anchors])
                rl, anchor_out = out[:len(parts)], out[len(parts):]
                state, m = self._run_compiled("apply_parts", self._apply_parts, state,
                                              tuple(rl), tuple(anchor_out) or None)
            if self._bias_update is not None:  # after the step, from its rows' expert loads
                state = self._run_compiled("bias_update", self._bias_update, state, tuple(parts))
            metrics.append(m)
        merged: dict[str, list] = {}
        for m in jax.device_get(metrics):
            for k, v in m.items():
                merged.setdefault(k, []).append(np.asarray(v))
        # Over the update's parts: maxima stay maxima, token counts add up, the mismatch
        # figures weigh each part by its tokens of their kind (in the worker layout a part may
        # hold no on-policy or no stale group), the rest average.
        weights = {kind: np.asarray(merged.get(f"mismatch{kind}/tokens", [0.0]), np.float64)
                   for kind in ("", "_stale")}

        def combine(k, v):
            if k.endswith("_max"):
                return np.max(v)
            if k.startswith(("mismatch/tokens", "mismatch_stale/tokens")):
                return np.sum(v)
            kind = "_stale" if k.startswith(("mismatch_stale/", "moe_stale/")) else ""
            if kind or k.startswith(("mismatch/", "moe/routing_flip_rate")):
                w = weights[kind]
                return np.sum(np.asarray(v, np.float64) * w) / max(np.sum(w), 1.0)
            return np.mean(v)

        out = {k: float(combine(k, v)) for k, v in merged.items()}
        out["train/masked_failed_responses"] = float(masked_failed)
        if out.get("train/skipped_update", 0) > 0:
            logging.warning("non-finite loss or gradient: %d update(s) skipped",
                            int(sum(merged["train/skipped_update"])))
        return state, out
