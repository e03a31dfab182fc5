"""espo_jax.rollout: the generation side of the pipeline.

The embedded JAX engine (`engine.Engine`, its jitted pieces in `decode`, continuous batching in
`batching`), sampling, length-aware scheduling, generation with overlapped scoring (`generate`),
the rollout worker (`worker`: one loop for every sampler of `sampler`, the JAX engine's
`JaxSampler` and vLLM's `vllm_worker.VllmSampler`; `vllm_cli` the vLLM command line; the flags
both take in `worker_flags`), vLLM output conversion and the JetStream adapter. What workers
write and the learner reads is the `espo_jax.buffer` contract. Import the submodule you need:
this package imports nothing (worker processes start fast).
"""
