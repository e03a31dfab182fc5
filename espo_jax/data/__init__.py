"""espo_jax.data: prompt sources.

Datasets (TFDS builders, prepared offline as ArrayRecord, read with `as_data_source()`):
  arith_chains.ArithChains   synthetic +/- chains with levels and worked solutions
  math_jsonl.MathJsonl       local GSM8K / MATH style JSONL files
  prompts                    `arith_chains_source`, `math_jsonl_source`: tokenised prompt dicts
  jsonl                      user JSONL files, checked line by line

Multi-stage zero-variance elimination (MS-ZVE: which prompts to sample, how often, which groups
to train on) lives in `espo_jax.zve`.
"""
