"""The per-step samples (`espo_jax.train.samples`): which groups, their text, reward, outcome,
advantage and kept flag, in `samples.jsonl` and TensorBoard's text tab. The end-to-end runs
(`tests/test_experiments.py`, `tests/train/test_worker_layout.py`) check them after real steps."""

import json
import math
import time

import numpy as np
import pytest
from helpers.zve_groups import make_group

from espo_jax import configs
from espo_jax.buffer.text import OUTCOMES, markdown_table, outcome_labels
from espo_jax.tokenizer import CharTokenizer
from espo_jax.train.metrics import MetricLogger
from espo_jax.train.samples import COLUMNS, SampleLog, step_samples
from espo_jax.zve.groups import ScoredGroup

TOK = CharTokenizer()


def _text_group(pid, prompt, completions, outcomes, meta=None):
    g = make_group(outcomes, lengths=[len(TOK.encode(c)) for c in completions], pid=pid)
    g.prompt_tokens = np.array(TOK.encode(prompt), np.int32)
    for r, c in zip(g.responses, completions, strict=True):
        r.tokens = np.array(TOK.encode(c), np.int32)
    g.meta.update(meta or {})
    return g


def _config(k=2):
    c = configs.default_config()
    c.log.samples_per_step = k
    c.advantage.name = "grpo"
    c.zve.zvp.enabled = False
    return c


def test_rows_hold_text_reward_outcome_advantage_and_the_filters_choice():
    mixed = _text_group("a", "1+2=", ["3", "4", "5", "3"], [1, 0, 0, 1])
    flat = _text_group("b", "2+2=", ["4", "4"], [1, 1])
    third = _text_group("c", "3+3=", ["6"], [1])
    # The online filter kept `mixed` (with tie-broken rewards) and dropped the all-correct one.
    batch = [ScoredGroup(mixed, np.array([1.0, 0.0, 0.25, 1.0], np.float32))]
    rows = step_samples(7, [mixed, flat, third], batch, 2, _config(), TOK.decode, TOK.decode)
    assert len(rows) == 4 + 2  # the first two groups, every response; `third` not chosen
    assert [(r["group"], r["sample"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (0, 3),
                                                           (1, 0), (1, 1)]
    assert {r["step"] for r in rows} == {7}
    a = rows[:4]
    assert [r["prompt"] for r in a] == ["1+2="] * 4
    assert [r["completion"] for r in a] == ["3", "4", "5", "3"]
    assert [r["outcome"] for r in a] == ["correct", "wrong", "wrong", "correct"]
    assert [r["reward"] for r in a] == [1.0, 0.0, 0.0, 1.0]  # the reward function's
    assert [r["train_reward"] for r in a] == [1.0, 0.0, 0.25, 1.0]  # MS-ZVE's
    # GRPO of [1, 0, .25, 1]: mean .5625, std sqrt(((.4375^2) * 2 + .5625^2 + .3125^2) / 4)
    # = sqrt(.2265625) = .47599; A = (R - .5625) / .47599.
    std = math.sqrt((2 * 0.4375**2 + 0.5625**2 + 0.3125**2) / 4)
    assert [r["advantage"] for r in a] == pytest.approx(
        [(x - 0.5625) / std for x in (1.0, 0.0, 0.25, 1.0)], abs=1e-5)
    assert all(r["kept"] and not r["zero_variance"] and r["length"] == 1 for r in a)
    b = rows[4:]
    assert all(not r["kept"] and r["zero_variance"] for r in b)
    assert all(r["train_reward"] is None and r["advantage"] is None for r in b)
    json.dumps(rows)  # JSON-able as written


def test_outcome_labels_tell_errors_and_timeouts_from_wrong_answers():
    g = _text_group("a", "1+2=", ["3", "x", "", "4"], [1, 0, 0, 0],
                    meta={"reward_failed": [1, 2], "reward_timed_out": [2]})
    assert outcome_labels(g) == ["correct", "error", "timeout", "wrong"]
    assert set(outcome_labels(g)) <= set(OUTCOMES)
    # A failed response is out of its group's advantages: [correct, wrong] alone, GRPO +-1.
    rows = step_samples(1, [g], [ScoredGroup(g, np.array([1, 0, 0, 0], np.float32))], 1,
                        _config(), TOK.decode, TOK.decode)
    assert [r["advantage"] for r in rows] == pytest.approx([1.0, 0.0, 0.0, -1.0], abs=1e-5)


def test_markdown_cells_escape_pipes_and_newlines():
    table = markdown_table([{"a": "x|y\nz", "b": None, "c": 0.123456}], ["a", "b", "c"])
    assert table.splitlines() == ["| a | b | c |", "|---|---|---|", "| x\\|y\\nz | - | 0.1235 |"]


def test_sample_log_writes_jsonl_and_a_tensorboard_text_table(tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    logger = MetricLogger(str(tmp_path))
    log = SampleLog(str(tmp_path), _config(k=1), TOK, TOK.decode, logger)
    groups = [_text_group("a", "1+2=", ["3", "4"], [1, 0]),
              _text_group("b", "2+2=", ["4", "5"], [1, 0])]
    batch = [ScoredGroup(g, np.array([1, 0], np.float32)) for g in groups]
    for step in (1, 2):
        log.write(step, groups, batch)
    logger.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt_id"], r["completion"]) for r in rows] == [
        (1, "a", "3"), (1, "a", "4"), (2, "a", "3"), (2, "a", "4")]
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"),
                                                size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("samples/rl")
    assert [e.step for e in texts] == [1, 2]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert table.splitlines()[0] == "| " + " | ".join(COLUMNS) + " |"
    assert "| 0 | a | True | 1 | wrong | 0 | 0 | -1 | 1 | 1+2= | 4 |" in table

    off = SampleLog(str(tmp_path / "off"), _config(k=0), TOK, TOK.decode, logger)
    assert off.write(1, groups, batch) == []
    assert not (tmp_path / "off" / "samples.jsonl").exists()


class _Sampler:
    """A `rollout.sampler.Sampler` whose responses are the texts of `COMPLETIONS`."""

    sampler_name, n_experts, last_stats = "scripted", None, {}

    def generate_groups(self, requests, *, rng, admission="fifo", predictor=None, on_group=None):
        from espo_jax.rollout.batching import Generation, GenerationGroup

        out = []
        for i, r in enumerate(requests):
            gens = [Generation(tokens=np.array(TOK.encode(c), np.int32),
                               logprobs=np.zeros(len(c), np.float32), routed_experts=None,
                               finish_reason="stop") for c in COMPLETIONS]
            group = GenerationGroup(i, r.prompt_id, np.asarray(r.tokens, np.int32), gens)
            on_group(group)
            out.append(group)
        return out


COMPLETIONS = ["3", "4", "raise", "sleep"]


def _reward(text, answer):
    if text == "raise":
        raise RuntimeError("broken verifier")
    if text == "sleep":
        time.sleep(1.0)
    return text == answer


def test_a_timed_out_reward_call_is_labelled_timeout_through_the_record(tmp_path):
    import jax

    from espo_jax.buffer.records import decode, encode
    from espo_jax.rewards.pool import RewardPool
    from espo_jax.rollout.generate import generate_scored_groups

    pool = RewardPool(_reward, num_workers=2, timeout_s=0.3, backend="thread",
                      detokenize=TOK.decode)
    try:
        prompt = {"prompt_id": "p", "tokens": TOK.encode("1+2="), "answer": "3"}
        [group] = generate_scored_groups(_Sampler(), pool, [(prompt, len(COMPLETIONS))],
                                         rng=jax.random.key(0), policy_version=0,
                                         n_experts=None, target_fn=lambda p: p["answer"])
    finally:
        pool.close()
    back = decode(encode(group))  # what the learner reads from the buffer
    assert outcome_labels(back) == ["correct", "wrong", "error", "timeout"]
