"""A prompt's status in `PromptScheduler`, and the kinds of entries in an epoch's order."""

ACTIVE, RETIRED, PRUNED = "active", "retired", "pruned"  # PRUNED by stage 0, RETIRED by 5
NORMAL, PROBE = 0, 1  # a normal visit; a stage-5 re-probe of a retired (or pruned) prompt
