"""Rewards: verifiers (`verifiers`), the overlapped scoring pool (`pool.RewardPool`) and reward
adjustment. Modules are imported by name; nothing heavy is imported here."""
