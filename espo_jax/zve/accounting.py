"""Token accounting: which generated tokens give the policy update a gradient, and one name for
each figure that counts them, the same in the per-step metrics, summary.json, the console,
`bench zve`, the plots and the READMEs.

A generated token is a **no-signal token** when the update gets no gradient from it:
  (a) its group is not trained on (stage 4's online filter dropped it);
  (b) its group is trained on with all-zero advantages (all rewards equal, and RL-ZVP off or
      not covering the group; `zve.metrics.step_metrics`);
  (c) stage 0's offline pass sampled it: those samples estimate pass rates, never trained on.

  zve/no_signal_tokens        per RL step: tokens of kinds (a) and (b) (`zve/no_signal_rollouts`
                              their rollouts); the offline pass is not a step
  zve/no_signal_token_frac    per RL step: zve/no_signal_tokens / zve/tokens_generated
  zve/trained_zero_adv_tokens per RL step: kind (b) alone, a part of zve/trained_tokens (the
                              share of trained tokens with zero advantage)
  no_signal_token_frac        per run (summary.json, `bench zve`): the RL steps' no-signal
                              tokens over the RL steps' generated tokens, (a) + (b) of all
                              steps; the per-step figure over the whole run
  no_signal_token_frac_with_offline
                              per run: (a) + (b) + (c) over every generated token, the offline
                              pass included (stage 0's cost of its pruning)

Before these names the same figures were "wasted": `wasted_token_fraction` (summary.json) was
`no_signal_token_frac_with_offline`, `zve/wasted_token_frac` was `zve/no_signal_token_frac`,
`zve/trained_no_grad_tokens` was `zve/trained_zero_adv_tokens`. Files written then (the stored
results of experiments/results/, older workdirs) keep their keys; `current_names` reads them
under the names above.
"""

from __future__ import annotations

from collections.abc import Mapping

# Former key -> current key, for summaries, metrics rows and checkpoint metadata.
RENAMED = {
    "wasted_token_fraction": "no_signal_token_frac_with_offline",
    "wasted_tokens": "no_signal_tokens",  # the run totals of a checkpoint: (a) + (b)
    "zve/wasted_token_frac": "zve/no_signal_token_frac",
    "zve/wasted_tokens": "zve/no_signal_tokens",
    "zve/wasted_rollouts": "zve/no_signal_rollouts",
    "zve/trained_no_grad_tokens": "zve/trained_zero_adv_tokens",
}


def current_names(record: Mapping) -> dict:
    """`record` (a summary, a metrics row, a checkpoint's run totals) with former keys under
    their current names; a key present under both names keeps the current one's value."""
    out = {RENAMED.get(k, k): v for k, v in record.items() if k not in RENAMED}
    for old, new in RENAMED.items():
        if old in record and new not in out:
            out[new] = record[old]
    return out


def run_fractions(generated_tokens: int, no_signal_tokens: int, offline_tokens: int
                  ) -> dict[str, float]:
    """The two per-run fractions from the RL steps' generated and no-signal tokens and the
    offline pass's tokens."""
    return {"no_signal_token_frac": no_signal_tokens / max(generated_tokens, 1),
            "no_signal_token_frac_with_offline": (no_signal_tokens + offline_tokens)
            / max(generated_tokens + offline_tokens, 1)}
