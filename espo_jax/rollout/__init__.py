"""espo_jax.rollout: the generation side of the pipeline.

The embedded JAX engine (`engine.Engine`, its jitted pieces in `decode`, continuous batching in
`batching`), sampling, length-aware scheduling, generation with overlapped scoring (`generate`),
the rollout worker (`worker_loop`: one loop for every sampler of `sampler`, the JAX engine's
`JaxSampler` and vLLM's `vllm_worker.VllmSampler`; its status, stop and flow control in
`worker_status`; `worker` and `vllm_cli` the two command lines, the flags both take in
`worker_flags`), vLLM output conversion and the JetStream adapter. What workers
write and the learner reads is the `espo_jax.buffer` contract. Import the submodule you need:
this package imports nothing (worker processes start fast).
"""
