"""espo_jax.rl: RL algorithms as pure JAX functions.

- `logprobs`: chunked per-token log-probs and entropies (never a full fp32 [B, T, V]).
- `losses`: GRPO, DAPO, GSPO, GSPO-token, ESPO; `policy_loss`, `default_loss_config`, `LOSSES`.
- `advantages`: GRPO, Dr. GRPO, RLOO, RL-ZVP, DAPO overlong penalty; `ADVANTAGES`.
- `reward_adjust`: tiered outcome/reward-model composition, judge verdicts, inversion rate.
"""
