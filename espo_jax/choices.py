"""Choices that config validation, the learner and the rollout workers share, each defined once
here so that a worker validating a config imports nothing of the learner (`train`)."""

REPLAY_MODES = ("r3", "r2", "off")  # train.replay: recorded routes, the learner's own, none
MOMENT_DTYPES = ("float32", "bfloat16")  # optim.moment_dtype
# rollout.precision: the embedded engine's weights (rollout/decode.py)
ENGINE_PRECISIONS = ("fp32", "bf16", "fp8", "fp8_block")
VLLM_QUANTIZATIONS = ("fp8", "none")  # rollout.vllm.quantization ("none": the weights' dtype)
VLLM_RELOADS = ("auto", "inplace", "rebuild")  # rollout.vllm.reload (rollout/vllm_worker.py)
VLLM_DTYPES = ("bfloat16", "float16", "float32", "auto")  # rollout.vllm.dtype
BUILTIN_DATA = ("arith_chains", "math_jsonl")  # data.name's built-in tasks (task_loading.py)
