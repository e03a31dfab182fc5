"""Rewards: verifiers of the binary outcome (`verifiers`), the scoring pool overlapped with
generation (`pool.RewardPool`), reward adjustment (`reward_adjust`: a correctness tier that a
reward-model score never crosses, judge verdicts) and the shaped rewards of MS-ZVE stage 2
(`shaping`). Modules are imported by name; nothing heavy is imported here."""
