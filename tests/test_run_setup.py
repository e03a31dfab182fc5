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


def test_the_vocabulary_is_checked_before_the_weights_are_read(tmp_path, monkeypatch):
    """A Hugging Face checkpoint whose vocabulary the tokenizer overflows is refused from its
    config.json: no tensor of it is read (nor any prompt prepared)."""
    import jax
    import pytest

    from espo_jax import run_setup
    from espo_jax.models import get_preset, hf_io, init_params
    from espo_jax.tokenizer import CharTokenizer

    small_vocab = get_preset("tiny", vocab_size=32)
    assert CharTokenizer().vocab_size > 32
    hf_io.save_pretrained(small_vocab, init_params(small_vocab, jax.random.key(0)),
                          str(tmp_path))
    c = _small()
    c.model.hf_path = str(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("read before the vocabulary check")

    monkeypatch.setattr(hf_io, "from_pretrained", refuse)
    monkeypatch.setattr(run_setup, "prompt_sets", refuse)
    with pytest.raises(ValueError, match=f"tokenizer has {CharTokenizer().vocab_size} ids but "
                                         "the model's vocab_size is 32"):
        run_setup.build(c, str(tmp_path / "run"))
