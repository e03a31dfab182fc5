"""The run wiring (`espo_jax.run_setup`): preset overrides, and the run's choices applied to
Hugging Face weights too."""

import numpy as np

from espo_jax import configs


def _small():
    c = configs.default_config()
    configs.apply_small(c)
    return c


def test_model_overrides_apply_only_when_set():
    from espo_jax.run_setup import preset_model_config

    c = _small()
    assert preset_model_config(c).rope_theta == 1e6  # the tiny preset keeps Qwen3's base
    c.model.rope_theta = 1e4
    assert preset_model_config(c).rope_theta == 1e4
    assert preset_model_config(c).d_model == 64  # the rest of the preset is untouched
    assert preset_model_config(c).aux_loss_coef == 1e-3
    c.model.aux_loss_coef = 0.0  # 0 switches the load-balancing loss off; < 0 keeps the preset's
    assert preset_model_config(c).aux_loss_coef == 0.0


def test_run_choices_apply_to_hugging_face_weights(tmp_path):
    """Dispatch, remat, attention chunk and the aux-loss weight are the run's choice also when
    the architecture comes from a Hugging Face config.json (which knows none of them)."""
    import jax

    from espo_jax.models import get_preset, hf_io, init_params
    from espo_jax.run_setup import load_model

    tiny_params = jax.jit(init_params, static_argnums=0)(get_preset("tiny"), jax.random.key(0))
    hf_io.save_pretrained(get_preset("tiny"), tiny_params, str(tmp_path))
    c = _small()
    c.model.hf_path = str(tmp_path)
    c.model.dispatch, c.model.remat, c.model.attention_chunk = "ragged", True, 64
    c.model.aux_loss_coef = 0.0
    model_config, params = load_model(c)
    assert (model_config.dispatch, model_config.remat, model_config.attention_chunk,
            model_config.aux_loss_coef) == ("ragged", True, 64, 0.0)
    assert model_config.d_model == get_preset("tiny").d_model
    np.testing.assert_array_equal(params["embed"]["embedding"],
                                  tiny_params["embed"]["embedding"])


def test_workers_share_the_prompts_without_overlap():
    import pytest

    from espo_jax.run_setup import worker_share

    prompts = [{"prompt_id": f"p{i}"} for i in range(5)]
    shares = [[p["prompt_id"] for p in worker_share(prompts, i, 2)] for i in range(2)]
    assert shares == [["p0", "p2", "p4"], ["p1", "p3"]]  # disjoint, all five covered
    with pytest.raises(ValueError, match="worker 5 of 6: no training prompts .* has 5"):
        worker_share(prompts, 5, 6)
