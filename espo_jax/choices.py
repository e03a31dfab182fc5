"""Choices that config validation, the learner and the rollout workers share, each defined once
here so that a worker validating a config imports nothing of the learner (`train`)."""

REPLAY_MODES = ("r3", "r2", "off")  # train.replay: recorded routes, the learner's own, none
MOMENT_DTYPES = ("float32", "bfloat16")  # optim.moment_dtype
