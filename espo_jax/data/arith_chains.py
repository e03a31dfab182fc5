"""`arith_chains`: synthetic +/- chains with difficulty levels, as a TFDS builder (ArrayRecord).

A prompt is the bare expression, a worked solution folds it left one step at a time, and the
final answer follows a `#`:

    prompt    "57+87-70+12="
    solution  "57+87=144,144-70=74,74+12=86#86"

Every step has the same shape (two operands, one operator), so a model warm-started on the easy
levels can extend the pattern to longer chains and wider operands under RL. At the default levels
the longest example (prompt + solution) is 51 characters, short enough for a character-level
model.

With `index_hints=True` every term carries a letter label (consecutive letters from a start letter
drawn per problem), and the solution is a list of running values, one per term, each naming the
term it adds:

    prompt    "f4g+2h-7i-0="
    solution  "f4=4,g+2=6,h-7=-1,i-0=-1#-1"

The labels are index hints in the sense of Zhou et al. (2023, "What algorithms can transformers
learn?"): the next label is the successor of the last one, and the term to fetch can be found by
matching its label in the prompt instead of counting positions. Measured with the `small` model
warm-started on chains of 2-4 terms: without hints it solves none of the 6-term chains, with
hints 5-6% (it still finds the first term by distance); see the README's results.

Problems come from `reasoning-gym`'s `chain_sum` generator (seeded: item i of a level is drawn
with `random.Random(level_seed + i)`); only its expression is used, because its question text
("State the final answer to the following arithmetic problem: ...") is 60 characters of
boilerplate that a character model would have to read on every prompt. Train and the held-out
splits are disjoint by construction: a problem is held out when a hash of its expression falls
in 1 / `test_modulus` of the hash space; duplicates inside a split are dropped. Of the held-out
problems of a level, in generation order, the first `test_per_level` form the test split and
the next `validation_per_level` the validation split (where hyperparameters are chosen), so
adding a validation split changes neither train nor test. Small levels (2 one-digit terms: 200
distinct problems, ~20 held out) therefore yield fewer examples than asked for, and their
validation split may be empty.

Preparation is offline and needs no TensorFlow; read with `builder.as_data_source()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import tensorflow_datasets as tfds

from espo_jax.data.tfds_offline import OfflineBuilder

# (number of terms, digits per operand) for levels 1..5.
DEFAULT_LEVELS = ((2, 1), (3, 1), (2, 2), (3, 2), (4, 2))
# Draw budget: 20 per wanted example (at least 20k), at most 10x the problem space (which then
# is all but certainly exhausted: a given problem is missed with probability ~e^-10). Drawing
# stops as soon as a split has what it asked for.
_DRAWS_PER_EXAMPLE = 20
_LEVEL_SEED_STRIDE = 1_000_003  # keeps the seed ranges (level_seed + i) of levels apart
_LABELS = "abcdefghijklmnopqrstuvwxyz"  # index hints: consecutive letters from a drawn start


@dataclasses.dataclass(eq=False, kw_only=True)
class ArithChainsConfig(tfds.core.BuilderConfig):
    """Levels and sizes. Build it with `arith_chains_config(...)` so the name encodes the content
    (the prepared directory is keyed by the name: two contents must never share one)."""

    levels: tuple[tuple[int, ...], ...] = DEFAULT_LEVELS
    train_per_level: int = 2000
    test_per_level: int = 200
    test_modulus: int = 10  # 1 in test_modulus distinct problems is held out (test, validation)
    seed: int = 0
    index_hints: bool = False  # letter labels on terms (see the module docstring)
    validation_per_level: int = 0  # held-out problems after the test split's (0: no split)


def arith_chains_config(
    levels: tuple[tuple[int, ...], ...] = DEFAULT_LEVELS,
    train_per_level: int = 2000,
    test_per_level: int = 200,
    test_modulus: int = 10,
    seed: int = 0,
    index_hints: bool = False,
    validation_per_level: int = 0,
) -> ArithChainsConfig:
    """A config whose name is a digest of its fields, so each content has its own directory.

    A level is (terms, digits) or (terms, digits, max_operand): the third caps every operand
    (a drawn operand v becomes v % (max_operand + 1)), e.g. (6, 1, 2) is a long chain of small
    numbers: the length of a hard level with the arithmetic of an easy one."""
    levels = tuple(tuple(int(x) for x in lv) for lv in levels)
    for lv in levels:
        if len(lv) not in (2, 3):
            raise ValueError(f"arith_chains: a level is (terms, digits) or (terms, digits, "
                             f"max_operand), got {lv}")
        terms, digits = lv[:2]
        if terms < 2 or digits < 1:
            raise ValueError(f"arith_chains: a level needs >= 2 terms and >= 1 digit, got "
                             f"(terms={terms}, digits={digits})")
        if len(lv) == 3 and lv[2] < 1:
            raise ValueError(f"arith_chains: max_operand must be >= 1, got {lv}")
        if index_hints and terms > len(_LABELS):
            raise ValueError(f"arith_chains: index_hints label at most {len(_LABELS)} terms, "
                             f"a level has {terms}")
    if min(train_per_level, test_per_level, validation_per_level) < 0:
        raise ValueError(f"arith_chains: sizes must be >= 0, got train_per_level="
                         f"{train_per_level}, test_per_level={test_per_level}, "
                         f"validation_per_level={validation_per_level}")
    if test_modulus < 2:
        raise ValueError(f"arith_chains: test_modulus must be >= 2, got {test_modulus}")
    fields = dict(levels=levels, train_per_level=train_per_level, test_per_level=test_per_level,
                  test_modulus=test_modulus, seed=seed)
    # Absent when off, so the names of existing prepared datasets do not change.
    if index_hints:
        fields["index_hints"] = True
    if validation_per_level:
        fields["validation_per_level"] = validation_per_level
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    return ArithChainsConfig(name=f"c{digest}", description=json.dumps(fields), **fields)


def worked_solution(expression: str) -> tuple[str, int]:
    """`"4 - 1 - 7"` -> (`"4-1=3,3-7=-4#-4"`, -4): left fold, one step per operator."""
    terms = _terms(expression)
    values = _running_values(terms)
    steps = [f"{values[i - 1]}{op}{term}={values[i]}" for i, (op, term) in enumerate(terms)
             if i > 0]
    return ",".join(steps) + f"#{values[-1]}", values[-1]


def _terms(expression: str) -> list[tuple[str, str]]:
    """`"4 - 1 + 7"` -> `[("", "4"), ("-", "1"), ("+", "7")]`."""
    parts = expression.split()
    if len(parts) < 3 or len(parts) % 2 == 0 or any(op not in "+-" for op in parts[1::2]):
        raise ValueError(f"arith_chains: not a chain of binary +/- terms: {expression!r}")
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2], strict=True))


def _running_values(terms: list[tuple[str, str]]) -> list[int]:
    """The value of the chain after each term: `[("", "4"), ("-", "1")]` -> `[4, 3]`."""
    values, value = [], 0
    for op, term in terms:
        value = value - int(term) if op == "-" else value + int(term)
        values.append(value)
    return values


def hinted_problem(expression: str, start: int) -> tuple[str, str, int]:
    """`("4 + 2 - 7 - 0", 5)` -> (`"f4g+2h-7i-0="`, `"f4=4,g+2=6,h-7=-1,i-0=-1#-1"`, -1):
    the prompt and solution with index hints (labels from letter `start`)."""
    terms = _terms(expression)
    if not 0 <= start <= len(_LABELS) - len(terms):
        raise ValueError(f"hinted_problem: start {start} leaves no room for {len(terms)} labels")
    labelled = [(label, op, term) for label, (op, term) in zip(_LABELS[start:], terms,
                                                               strict=False)]
    values = _running_values(terms)
    prompt = "".join(f"{label}{op}{term}" for label, op, term in labelled) + "="
    steps = [f"{label}{op}{term}={v}" for (label, op, term), v in zip(labelled, values,
                                                                        strict=True)]
    return prompt, ",".join(steps) + f"#{values[-1]}", values[-1]


def _hint_start(expression: str, terms: int, seed: int) -> int:
    digest = hashlib.sha1(f"{seed}:{expression}".encode()).hexdigest()
    return int(digest[:8], 16) % (len(_LABELS) - terms + 1)


def problem_space(terms: int, digits: int, max_operand: int | None = None) -> int:
    """Number of distinct chains: operand values (0-9 for one digit, else no leading zero; 0 to
    max_operand when capped) to the power of terms, times the operator choices."""
    values = 10 if digits == 1 else 9 * 10 ** (digits - 1)
    if max_operand is not None:
        values = min(values, max_operand + 1)
    return values**terms * 2 ** (terms - 1)


def cap_operands(expression: str, max_operand: int) -> str:
    """`("7 + 8 - 3", 2)` -> `"1 + 2 - 0"`: every operand v becomes v % (max_operand + 1)."""
    return " ".join(p if p in "+-" else str(int(p) % (max_operand + 1))
                    for p in expression.split())


def _in_test(expression: str, modulus: int) -> bool:
    return int(hashlib.sha1(expression.encode()).hexdigest()[:8], 16) % modulus == 0


def level_examples(level: int, terms: int, digits: int, split: str,
                   config: ArithChainsConfig, max_operand: int | None = None) -> list[dict]:
    """The examples of one level and split, in generation order (deterministic)."""
    # reasoning-gym imports all its task families (~3 s): only preparation pays for it.
    from reasoning_gym.arithmetic.chain_sum import ChainSumConfig, ChainSumDataset

    # Held-out problems in generation order: test takes the first test_per_level, validation
    # the next validation_per_level.
    skip = config.test_per_level if split == "validation" else 0
    wanted = {"train": config.train_per_level, "test": config.test_per_level,
              "validation": config.validation_per_level}[split] + skip
    gen = ChainSumDataset(ChainSumConfig(
        min_terms=terms, max_terms=terms, min_digits=digits, max_digits=digits,
        allow_negation=False, seed=(config.seed * 100 + level) * _LEVEL_SEED_STRIDE,
        size=min(10 * problem_space(terms, digits, max_operand),
                 max(wanted * _DRAWS_PER_EXAMPLE, 20_000))))
    out, seen = [], set()
    for i in range(len(gen) if wanted else 0):
        expression = gen[i]["metadata"]["expression"]
        if max_operand is not None:
            expression = cap_operands(expression, max_operand)
        if expression in seen or _in_test(expression, config.test_modulus) != (split != "train"):
            continue
        seen.add(expression)
        if len(seen) <= skip:
            continue
        if config.index_hints:
            prompt, solution, value = hinted_problem(
                expression, _hint_start(expression, terms, config.seed))
        else:
            prompt = expression.replace(" ", "") + "="
            solution, value = worked_solution(expression)
        # our fold must agree with reasoning-gym's answer (its own, uncapped expression)
        if max_operand is None and str(value) != gen[i]["answer"]:
            raise AssertionError(f"arith_chains: {expression} folds to {value}, "
                                 f"reasoning-gym says {gen[i]['answer']}")
        out.append(dict(prompt_id=f"L{level}:{prompt}", prompt=prompt, solution=solution,
                        answer=str(value), level=level, num_terms=terms, num_digits=digits))
        if len(out) == wanted - skip:
            break
    return out


class ArithChains(OfflineBuilder):
    """Synthetic arithmetic chains; see the module docstring."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    BUILDER_CONFIGS = [arith_chains_config()]

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict({
                "prompt_id": tfds.features.Text(),
                "prompt": tfds.features.Text(),
                "solution": tfds.features.Text(),
                "answer": tfds.features.Text(),
                "level": np.int32,
                "num_terms": np.int32,
                "num_digits": np.int32,
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        splits = ("train", "test") + (("validation",) if self.builder_config.validation_per_level
                                      else ())
        return {split: self._generate_examples(split) for split in splits}

    def _generate_examples(self, split: str):
        for level, (terms, digits, *cap) in enumerate(self.builder_config.levels, start=1):
            for ex in level_examples(level, terms, digits, split, self.builder_config,
                                     max_operand=cap[0] if cap else None):
                yield ex["prompt_id"], ex
