"""MS-ZVE benchmark: generated tokens that give no gradient, stage by stage, at equal budget.

    python -m espo_jax.bench zve [--quick] [--out FILE.json]
    python -m espo_jax.bench zve --init_from WORKDIR [--prompts N] [--budget TOKENS] [--out F]

One policy, held fixed: the `small` model of the default experiment
(`experiments/arith_espo.py`) after its supervised warm start (restored from the orbax
checkpoints of a main-job WORKDIR with `--init_from`, else the experiment's warm start is run
here). `--quick` uses another model, the `tiny` one of the experiment's `:small` variant,
warm-started here on level 1 only; its `--init_from` must be a checkpoint of that model (a
`:small` run's WORKDIR), and a checkpoint of another model is refused by name before anything
runs. No learner updates happen, so every configuration samples from the same policy and
differences come from the stages alone. Configurations add the stages one at a time: plain GRPO
sampling (every prompt once per epoch, G samples), then + stage 0 offline prune, + 1 adaptive
samples, + 2 tie-break, + 3 RL-ZVP, + 4 online filter, + 5 retirement; a last one has every
stage but 3 (RL-ZVP), the setting in which the online filter acts (with RL-ZVP on, zero-variance
groups carry signal and stage 4 keeps them). Each runs `ZVEPipeline` steps (the main job's
driver) on the main job's engine and reward pool until it has generated the same budget of
tokens.

A generated token is a no-signal token (no gradient; `espo_jax.zve.accounting` defines each
figure) when its group is not trained on (dropped by the online filter) or is trained on with
all-equal rewards while RL-ZVP is off. Stage 0's offline samples are all no-signal tokens: they
estimate pass rates and are never trained on; they count against the budget of every
configuration with stage 0, so a budget the offline pass spends alone leaves nothing to compare
(`budget_warning` says so).
Generation is a deterministic function of the policy, the call number and the plan, so
configurations making the same request share one generation (`numbered`): one offline pass
serves every configuration with stage 0, and stages 2 and 3, which change rewards and
accounting but not what is sampled, cost no extra generation. The spending and its counts
(`Spend`, `spend_budget`, `numbered`, `engine_rollout`) live in `espo_jax.bench.zve_spend`;
this module holds the configurations, the policy, the table and the run.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping

import ml_collections

from espo_jax.bench import format_table
from espo_jax.bench.zve_spend import Spend, engine_rollout, numbered, spend_budget

STAGES = ("offline", "adaptive", "tie_break", "zvp", "online_filter", "retire")
LABELS = ("plain GRPO", "+0 offline prune", "+1 adaptive samples", "+2 tie-break",
          "+3 RL-ZVP", "+4 online filter", "+5 retirement")
# Full run: 100 of the experiment's RL prompts, 150k generated tokens per configuration, about
# 7 epochs over them (~8 min on 2 cores). Stage 0's pass costs up to k samples per prompt once,
# a step G per visit, so its share of the budget falls as 1 / epochs: ~7 epochs put it under 5%.
# Quick run: the `tiny` model, briefly warm-started on level 1.
FULL_PROMPTS, FULL_BUDGET = 100, 150_000
QUICK_PROMPTS, QUICK_BUDGET, QUICK_WARMSTART_STEPS = 16, 1_500, 60


NO_ZVP = "all but 3 (RL-ZVP)"


def stage_configs(base: ml_collections.ConfigDict
                  ) -> list[tuple[str, ml_collections.ConfigDict]]:
    """(label, zve config): stages[:i] on and the rest off for i = 0..6 (other fields `base`'s),
    then every stage but RL-ZVP: without it a zero-variance group has no signal, and the
    online filter drops it and refills (with RL-ZVP on, the filter keeps every group)."""
    out = []
    for i, label in enumerate((*LABELS, NO_ZVP)):
        c = base.copy_and_resolve_references()
        for j, stage in enumerate(STAGES):
            c[stage].enabled = (stage != "zvp") if label == NO_ZVP else j < i
        out.append((label, c))
    return out


def bench_config(quick: bool, prompts: int | None, init_from: str | None
                 ) -> ml_collections.ConfigDict:
    """The default experiment's config (`experiments/arith_espo.py`), sized for this benchmark."""
    from espo_jax import configs

    c = configs.experiment_config("arith_espo", "small" if quick else None)
    c.data.rl_prompts = prompts or (QUICK_PROMPTS if quick else FULL_PROMPTS)
    if quick:  # level 1 ("3+5=") only: a tiny model learns it in a few dozen steps
        c.data.train_levels = c.data.eval_levels = c.warmstart.levels = (1,)
        c.warmstart.steps, c.warmstart.batch_size = QUICK_WARMSTART_STEPS, 32
        c.warmstart.lr, c.warmstart.eval_every = 3e-3, QUICK_WARMSTART_STEPS
        c.rollout.precision = "fp32"  # shares the evaluation engine's compilations
    if init_from:
        root = os.path.abspath(init_from)
        ckpt = os.path.join(root, "checkpoints")
        from espo_jax.train.checkpoint import checkpoint_steps

        # A WORKDIR's RL checkpoints, else what `resolve_init_from` finds (its warm start).
        c.checkpoint.init_from = ckpt if checkpoint_steps(ckpt) else root
        if os.path.isdir(os.path.join(root, "data")):
            c.data.data_dir = os.path.join(root, "data")  # already prepared there
    return c


def _command(quick: bool) -> str:
    return "`bench zve --quick`" if quick else "`bench zve`"


def _experiment(quick: bool) -> str:
    return "experiments/arith_espo.py" + (":small" if quick else "")


def check_init_from(quick: bool, config: ml_collections.ConfigDict, given: str) -> None:
    """Raises `CommandLineError` unless `config.checkpoint.init_from` (from `--init_from
    given`) holds a checkpoint of `config`'s model; where it is one of the other mode's model
    (quick and full mode use different models), the error names both. Reads metadata only."""
    from espo_jax import run_setup
    from espo_jax.cli_errors import CommandLineError
    from espo_jax.train import checkpoint

    logging.disable(logging.INFO)  # its "starting from" line: the run logs it when it starts
    try:
        directory = checkpoint.resolve_init_from(config.checkpoint.init_from)
    except ValueError as e:
        raise CommandLineError(f"--init_from {given}: {e}") from e
    finally:
        logging.disable(logging.NOTSET)
    step = checkpoint.checkpoint_steps(directory)[-1]
    where = os.path.join(directory, str(step))
    try:
        checkpoint.check_params(directory, step, run_setup.abstract_params(config))
        return
    except ValueError as e:
        mismatch = e
    ours = (f"{_command(quick)} uses the `{config.model.preset}` model "
            f"({_experiment(quick)})")
    other = bench_config(not quick, None, None)
    try:
        checkpoint.check_params(directory, step, run_setup.abstract_params(other))
    except ValueError:
        raise CommandLineError(
            f"--init_from {given}: {where} fits neither the `{config.model.preset}` model "
            f"{_command(quick)} uses ({_experiment(quick)}) nor the `{other.model.preset}` one "
            f"of {_command(not quick)}: {mismatch}") from mismatch
    raise CommandLineError(
        f"--init_from {given}: {where} is a checkpoint of the `{other.model.preset}` model "
        f"({_experiment(not quick)}, the one {_command(not quick)} uses), but {ours}; "
        + ("leave out --quick, or give the WORKDIR of a run of experiments/arith_espo.py:small"
           if quick else "add --quick, or give the WORKDIR of a run of "
           "experiments/arith_espo.py")) from mismatch


def budget_warning(results: Mapping[str, Spend], budget_tokens: int) -> str | None:
    """Why `budget_tokens` compares no stages, or None: a configuration that ran no RL step
    (stage 0's offline pass spent the budget alone; its row is dashes) has nothing to show."""
    idle = [label for label, s in results.items() if s.steps == 0 and not s.stopped]
    if not idle:
        return None
    offline = max(s.offline_tokens for s in results.values())
    return (f"warning: --budget {budget_tokens} tokens is too small to compare the stages: "
            f"{len(idle)} of {len(results)} configurations ran no RL step ({', '.join(idle)}), "
            f"their rows are dashes: stage 0's offline pass ({offline} tokens) spent the budget "
            f"alone. Give several times {offline} tokens (by default {QUICK_BUDGET:,} with "
            f"--quick, {FULL_BUDGET:,} without).")


def measure(config: ml_collections.ConfigDict, workdir: str, budget_tokens: int,
            log: Callable[[str], None] = print) -> dict:
    """Warm-started (or restored) policy, then every cumulative configuration at one budget."""
    from espo_jax.train.checkpoint import Checkpointer
    from espo_jax.train.loop import SyncRun

    restored = ""
    if config.checkpoint.init_from:
        ckpt = Checkpointer(config.checkpoint.init_from, async_save=False)
        step = ckpt.latest_step()
        ckpt.close()
        if step is None:
            raise FileNotFoundError(
                f"no checkpoint in {config.checkpoint.init_from} yet (a main job saves its "
                f"first one at RL step checkpoint.every)")
        # The checkpoint's own name, not the machine's path to it.
        restored = f"{os.path.basename(os.path.normpath(config.checkpoint.init_from))} step {step}"
    run = SyncRun(config, workdir)
    try:
        t0 = time.perf_counter()
        # The main job's start: restore from checkpoint.init_from, else the warm start.
        state, meta = run._start()
        warm = meta["warmstart"]
        log(f"policy ready in {time.perf_counter() - t0:.0f} s "
            f"({restored or 'warm start run here'}): greedy accuracy "
            f"{warm.get('eval/accuracy', 0.0):.3f} on {len(run.setup.eval_prompts)} held-out "
            f"prompts")
        run.engine.load_params(state.params)
        c, mc = config, run.setup.model_config
        n_experts = mc.n_experts if mc.n_moe_layers else None
        offline = engine_rollout(run.engine, run.pool, seed=c.seed + 7, n_experts=n_experts,
                                 target_fn=run.target_fn)
        steps = engine_rollout(run.engine, run.pool, seed=c.seed, n_experts=n_experts,
                               target_fn=run.target_fn)
        offline_cache, step_cache = {}, {}
        results = {}
        for label, zcfg in stage_configs(c.zve):
            spend = spend_budget(run.setup.train_prompts, zcfg, numbered(steps, step_cache),
                                 budget_tokens=budget_tokens,
                                 groups_per_step=c.rollout.prompts_per_step,
                                 max_len=c.rollout.max_new_tokens, seed=c.seed,
                                 offline_rollout=numbered(offline, offline_cache))
            results[label] = spend
            log(f"{label}: {spend.steps} steps, {spend.tokens} tokens, no-signal token frac "
                f"with offline {100 * spend.no_signal_token_frac_with_offline:.1f}% "
                f"({spend.wall_s:.0f} s)")
        return {"results": results, "warmstart": warm, "restored_from": restored}
    finally:
        run.pool.close()
        run.ckpt.close()
        run.logger.close()


def _pct(num: float, den: float) -> str:
    return f"{100 * num / den:.1f}%" if den else "-"


def table(results: Mapping[str, Spend]) -> str:
    """One row per configuration ("-": no step ran, so there is nothing to divide). The
    zero-variance rate is by binary outcome, as the papers measure it, over the groups the
    steps generated and over those trained on; "zero-adv. trained tokens" is the share of the
    trained tokens whose advantages are all zero (tie-break and RL-ZVP lower it, not the rate);
    "no-signal token frac with offline" adds what the filter dropped and stage 0's samples, of
    every generated token (`espo_jax.zve.accounting`)."""
    rows = []
    for label, s in results.items():
        rows.append([label, s.steps, f"{s.tokens} ({s.offline_tokens})",
                     _pct(s.zero_variance_groups, s.groups),
                     _pct(s.trained_zero_variance_groups, s.trained_groups),
                     f"{s.zero_variance_rollouts} / {s.zero_variance_tokens}",
                     _pct(s.trained_zero_adv_tokens, s.trained_tokens),
                     _pct(s.no_signal_tokens + s.offline_tokens, s.tokens),
                     f"{1000 * s.signal_groups / max(s.tokens, 1):.2f}"
                     + (f" ({s.stopped})" if s.stopped else "")])
    return format_table(
        ["stages", "steps", "tokens (offline)", "ZV rate generated", "ZV rate trained",
         "rollouts / tokens in ZV groups", "zero-adv. trained tokens",
         "no-signal token frac with offline",
         "signal groups / 1k tokens"], rows)


def run(quick: bool, *, init_from: str | None = None, budget_tokens: int | None = None,
        prompts: int | None = None, workdir: str | None = None) -> dict:
    """Prints the table; returns its figures. See the module docstring."""

    from espo_jax import compile_cache

    compile_cache.enable()  # the main job's cache (espo_jax.main)
    config = bench_config(quick, prompts, init_from)
    if init_from:  # before any work: a checkpoint of this mode's model
        check_init_from(quick, config, init_from)
    budget = budget_tokens or (QUICK_BUDGET if quick else FULL_BUDGET)
    with tempfile.TemporaryDirectory(prefix="zve_bench_") as tmp:
        out = measure(config, workdir or tmp, budget)
    results = out["results"]
    print(f"\nMS-ZVE on arith_chains, {config.model.preset} model, policy held fixed "
          f"({out['restored_from'] or 'warm-started here'}; greedy accuracy "
          f"{out['warmstart'].get('eval/accuracy', 0.0):.3f}); {len(results)} configurations "
          f"x {budget} generated tokens, {config.data.rl_prompts} prompts, "
          f"{config.rollout.prompts_per_step} groups/step, G={config.zve.n_samples}\n")
    print(table(results))
    warning = budget_warning(results, budget)
    if warning:
        print(f"\n{warning}")
    return {"budget_tokens": budget, **({"warning": warning} if warning else {}),
            "prompts": config.data.rl_prompts,
            "model": config.model.preset, "restored_from": out["restored_from"],
            "warmstart": out["warmstart"], "levels": [list(lv) for lv in config.data.levels],
            "train_levels": list(config.data.train_levels),
            "zve": config.zve.to_dict(),
            "configurations": {k: v.figures() for k, v in results.items()}}

