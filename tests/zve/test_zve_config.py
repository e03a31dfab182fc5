"""MS-ZVE's config: every stage off by default, validation messages that name the field."""

import pytest

from espo_jax.zve.config import default_zve_config, validate_zve_config

STAGES = ("offline", "adaptive", "tie_break", "zvp", "online_filter", "retire")


def test_every_stage_is_off_by_default():
    cfg = default_zve_config()
    validate_zve_config(cfg)
    assert [cfg[s].enabled for s in STAGES] == [False] * 6


def test_config_validation_names_the_field():
    cfg = default_zve_config()
    cfg.tie_break.prefer = "cheaper"
    with pytest.raises(ValueError, match="'cheaper' is not one of \\('shorter', 'longer'\\)"):
        validate_zve_config(cfg)
    cfg = default_zve_config()
    cfg.adaptive.min_samples = 20
    with pytest.raises(ValueError, match="min_samples <= max_samples, got 20, 16"):
        validate_zve_config(cfg)
    cfg = default_zve_config()
    cfg.retire.reprobe_samples = 1
    with pytest.raises(ValueError, match="one sample cannot show variance"):
        validate_zve_config(cfg)
