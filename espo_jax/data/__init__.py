"""espo_jax.data: prompt sources and multi-stage zero-variance elimination (MS-ZVE).

Datasets (TFDS builders, prepared offline as ArrayRecord, read with `as_data_source()`):
  arith_chains.ArithChains   synthetic +/- chains with levels and worked solutions
  math_jsonl.MathJsonl       local GSM8K / MATH style JSONL files
  prompts                    `arith_chains_source`, `math_jsonl_source`: tokenised prompt dicts

MS-ZVE (re-exported here; none of these import TensorFlow or JAX):
  default_zve_config   every stage's switch and setting
  PromptScheduler      stages 0 (offline pruning), 1 (adaptive samples), 5 (retirement)
  OnlineFilter         stage 4 (drop zero-variance groups, bounded refill)
  step_metrics         per-step `zve/...` scalars
  ZVEPipeline          all of it around a caller's rollout function (stage 2 shaping inside)
Stage 2 lives in `espo_jax.rewards.shaping`, stage 3 in `espo_jax.rl.advantages.rl_zvp`.
"""

from espo_jax.data.online_filter import OnlineFilter, filter_groups
from espo_jax.data.prompt_scheduler import PromptScheduler
from espo_jax.data.zve_config import default_zve_config, validate_zve_config
from espo_jax.data.zve_metrics import step_metrics
from espo_jax.data.zve_pipeline import ZVEPipeline

__all__ = [
    "OnlineFilter",
    "PromptScheduler",
    "ZVEPipeline",
    "default_zve_config",
    "filter_groups",
    "step_metrics",
    "validate_zve_config",
]
