"""arith_chains: worked solutions by hand, offline preparation into a tmp data_dir, determinism."""

import subprocess
import sys

import pytest

from espo_jax.data.arith_chains import (
    ArithChains,
    _in_test,
    arith_chains_config,
    cap_operands,
    hinted_problem,
    level_examples,
    problem_space,
    worked_solution,
)
from espo_jax.data.tfds_offline import prepare

# Two levels and small sizes keep preparation well under a second (reasoning-gym import aside).
CONFIG = arith_chains_config(levels=((2, 1), (3, 2)), train_per_level=60, test_per_level=20,
                             seed=3)


def _records(builder, split):
    ds = builder.as_data_source()[split]
    return [{k: (v.decode() if isinstance(v, bytes) else int(v)) for k, v in ds[i].items()}
            for i in range(len(ds))]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return prepare(ArithChains, tmp_path_factory.mktemp("a"), CONFIG)


def test_worked_solution_by_hand():
    # 57+87=144, 144-70=74, 74+12=86
    assert worked_solution("57 + 87 - 70 + 12") == ("57+87=144,144-70=74,74+12=86#86", 86)
    # 4-1=3, 3-7=-4: negative intermediate results keep their sign
    assert worked_solution("4 - 1 - 7") == ("4-1=3,3-7=-4#-4", -4)
    with pytest.raises(ValueError, match="not a chain"):
        worked_solution("4 -")
    with pytest.raises(ValueError, match="not a chain"):
        worked_solution("4 * 2")


def test_problem_space():
    assert problem_space(2, 1) == 10 * 10 * 2  # two 0-9 operands, one operator
    assert problem_space(3, 2) == 90**3 * 4  # 10-99 operands, two operators


def test_preparing_and_reading_never_import_tensorflow(tmp_path):
    """In a fresh interpreter: other tests in this process (summary writers) may import TF."""
    code = (f"import sys\n"
            f"from espo_jax.data.arith_chains import ArithChains, arith_chains_config\n"
            f"from espo_jax.data.tfds_offline import prepare\n"
            f"config = arith_chains_config(levels=((2, 1),), train_per_level=10, "
            f"test_per_level=5, seed=3)\n"
            f"source = prepare(ArithChains, {str(tmp_path)!r}, config).as_data_source()\n"
            f"assert source['train'][0]['prompt']\n"
            f"print('tensorflow' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False"  # (after tfds' own progress lines)


def test_prepares_offline(prepared):
    train, test = _records(prepared, "train"), _records(prepared, "test")
    # level 1 has 200 distinct problems; those hashed into test are enumerated independently
    level1_test = sum(_in_test(f"{a} {op} {b}", 10) for a in range(10) for b in range(10)
                      for op in "+-")
    assert len(train) == 60 + 60
    assert len(test) == min(20, level1_test) + 20
    for ex in train + test:
        terms = ex["prompt"].count("+") + ex["prompt"].count("-") + 1
        assert terms == ex["num_terms"] == (2 if ex["level"] == 1 else 3)
        assert ex["prompt_id"] == f"L{ex['level']}:{ex['prompt']}"
        assert ex["solution"].endswith("#" + ex["answer"])
        expr = ex["prompt"].rstrip("=")
        assert int(ex["answer"]) == eval(expr)  # noqa: S307  (digits and +/- only)
        assert len(ex["prompt"]) + len(ex["solution"]) <= 64
    # train and test are disjoint, and no problem repeats inside a split
    train_ids, test_ids = {e["prompt_id"] for e in train}, {e["prompt_id"] for e in test}
    assert len(train_ids) == len(train) and len(test_ids) == len(test)
    assert not train_ids & test_ids


def test_deterministic_across_preparations(prepared, tmp_path):
    again = prepare(ArithChains, tmp_path, CONFIG)
    assert _records(again, "train") == _records(prepared, "train")
    other_seed = arith_chains_config(levels=((2, 1), (3, 2)), train_per_level=60,
                                     test_per_level=20, seed=4)
    assert other_seed.name != CONFIG.name  # content-keyed names: no stale reuse
    assert level_examples(2, 3, 2, "train", other_seed) != level_examples(2, 3, 2, "train",
                                                                           CONFIG)


def test_small_level_is_exhausted_not_padded():
    # 2 one-digit terms: 200 distinct problems, about a tenth held out, so asking for 1000
    # training problems yields every non-test problem once.
    cfg = arith_chains_config(levels=((2, 1),), train_per_level=1000, test_per_level=1000)
    train = level_examples(1, 2, 1, "train", cfg)
    test = level_examples(1, 2, 1, "test", cfg)
    assert len(train) + len(test) == 200
    assert 100 < len(train) < 200 and len({e["prompt"] for e in train}) == len(train)


def test_validation_split_is_held_out_and_leaves_train_and_test_alone(tmp_path):
    levels = ((2, 1), (3, 1))
    with_val = arith_chains_config(levels=levels, train_per_level=50, test_per_level=30,
                                   validation_per_level=25)
    without = arith_chains_config(levels=levels, train_per_level=50, test_per_level=30)
    assert with_val.name != without.name
    builder = prepare(ArithChains, tmp_path, with_val)
    train, test, val = (_records(builder, s) for s in ("train", "test", "validation"))
    # Train and test are those of the config without a validation split, record for record
    # (TFDS stores a split shuffled by key).
    def by_id(records):
        return sorted(records, key=lambda e: e["prompt_id"])

    for split, got in (("train", train), ("test", test)):
        assert by_id(got) == by_id([e for lv, (t, d) in enumerate(levels, start=1)
                                    for e in level_examples(lv, t, d, split, without)])
    assert "validation" not in prepare(ArithChains, tmp_path / "b", without).as_data_source()
    # Level 1 holds out ~20 of its 200 problems: all go to test, none is left for validation.
    # Level 2 (3 one-digit terms, 4000 problems, ~400 held out): the 25 held-out problems that
    # follow the test split's 30 in generation order.
    level2_held_out = []
    for ex in level_examples(2, 3, 1, "test", arith_chains_config(
            levels=levels, train_per_level=0, test_per_level=55)):
        level2_held_out.append(ex["prompt_id"])
    assert sorted(e["prompt_id"] for e in val) == sorted(level2_held_out[30:])
    assert len(val) == 25
    ids = [{e["prompt_id"] for e in split} for split in (train, test, val)]
    assert not ids[0] & ids[2] and not ids[1] & ids[2]
    assert all(_in_test(e["prompt"].rstrip("=").replace("+", " + ").replace("-", " - "), 10)
               for e in val)


def test_hinted_problem_by_hand():
    # running values 4, 4+2 = 6, 6-7 = -1, -1-0 = -1; labels f, g, h, i from start 5
    assert hinted_problem("4 + 2 - 7 - 0", 5) == ("f4g+2h-7i-0=", "f4=4,g+2=6,h-7=-1,i-0=-1#-1",
                                                   -1)
    assert hinted_problem("9 - 9", 24)[:2] == ("y9z-9=", "y9=9,z-9=0#0")
    with pytest.raises(ValueError, match="no room"):
        hinted_problem("9 - 9", 25)  # z and beyond


def test_index_hints_dataset():
    cfg = arith_chains_config(levels=((2, 1), (5, 1)), train_per_level=80, test_per_level=0,
                              index_hints=True)
    assert cfg.name != arith_chains_config(levels=((2, 1), (5, 1)), train_per_level=80,
                                           test_per_level=0).name
    examples = level_examples(1, 2, 1, "train", cfg) + level_examples(2, 5, 1, "train", cfg)
    starts = set()
    for ex in examples:
        labels = [c for c in ex["prompt"] if c.isalpha()]
        assert len(labels) == ex["num_terms"]
        first = ord(labels[0])
        assert [ord(c) - first for c in labels] == list(range(len(labels)))  # consecutive
        starts.add(labels[0])
        expr = "".join(c for c in ex["prompt"].rstrip("=") if not c.isalpha())
        assert int(ex["answer"]) == eval(expr)  # noqa: S307  (digits and +/- only)
        # one step per term, each naming its term's label, in prompt order
        steps = ex["solution"].split("#")[0].split(",")
        assert [st[0] for st in steps] == labels
        assert steps[-1].endswith("=" + ex["answer"])
    assert len(starts) > 10  # start letters are spread over the alphabet


def test_capped_level_is_long_with_small_operands():
    assert cap_operands("7 + 8 - 3 - 9", 2) == "1 + 2 - 0 - 0"  # 7 % 3, 8 % 3, 3 % 3, 9 % 3
    assert problem_space(6, 1, 2) == 3**6 * 2**5
    cfg = arith_chains_config(levels=((6, 1, 2),), train_per_level=50, test_per_level=0,
                              index_hints=True)
    assert cfg.levels == ((6, 1, 2),)
    examples = level_examples(1, 6, 1, "train", cfg, max_operand=2)
    assert len(examples) == 50
    for ex in examples:
        digits = [int(c) for c in ex["prompt"] if c.isdigit()]
        assert len(digits) == 6 and max(digits) <= 2
        expr = "".join(c for c in ex["prompt"].rstrip("=") if not c.isalpha())
        assert int(ex["answer"]) == eval(expr)  # noqa: S307  (digits and +/- only)
    with pytest.raises(ValueError, match="max_operand must be >= 1"):
        arith_chains_config(levels=((6, 1, 0),))
    with pytest.raises(ValueError, match="a level is \\(terms, digits\\)"):
        arith_chains_config(levels=((6,),))


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="terms=1"):
        arith_chains_config(levels=((1, 1),))
    with pytest.raises(ValueError, match="test_modulus"):
        arith_chains_config(test_modulus=1)
