"""espo_jax.rl: RL algorithms as pure JAX functions.

- `logprobs`: chunked per-token log-probs and entropies (never a full fp32 [B, T, V]).
- `losses`: GRPO, DAPO, GSPO, GSPO-token, ESPO; `policy_loss`, the registry `LOSSES` (name ->
  function, paper aggregation, paper clip settings).
- `tis`: truncated importance-sampling weights min(pi_old / pi_sampler, C) for `policy_loss`.
- `token_stats`: masked mean / min / max / quantiles of a per-token quantity (flat metrics).
- `loss_config`: the loss config section (`default_loss_config`, `paper_loss_config`, validation).
- `advantages`: GRPO, Dr. GRPO, RLOO, RL-ZVP, DAPO overlong penalty; `ADVANTAGES`.
"""
