"""Model benchmark: train-step throughput and MFU of the JAX model against transformers + torch.

`python -m espo_jax.bench model [--quick] [--out FILE.json]`

For each preset (`tiny`, `small`), in one process:
- JAX: `jax.jit` train step (fp32, default dispatch), loss = next-token cross-entropy +
  `ModelOutput.aux_loss`, AdamW (optax); tokens/s = B*T / median step time.
- MFU = achieved model FLOP/s / peak FLOP/s, the peak being the median rate of a large fp32
  `jnp.dot` (n x n x n, 2 n^3 FLOPs) measured in the same process. Model FLOPs per token use the
  PaLM (arXiv 2204.02311, App. B) convention: 6 * N + 12 * L * H * A * T, where N counts the
  weights a token multiplies (attention projections, router, its top-k experts, shared expert,
  dense MLPs, LM head; not the embedding lookup) and the second term is the attention
  score/value matmuls (forward + backward, no causal discount).
- torch: the same weights exported with `hf_io.save_pretrained` and loaded by transformers
  `AutoModelForCausalLM` (its default attention and experts implementations), trained with
  `torch.optim.AdamW` on the same tokens with loss = cross-entropy + router_aux_loss_coef * aux.
  The step-0 losses of both are reported: they agree, which shows it is the same model.
- Steps are timed alternately (JAX, torch, JAX, ...) and the medians taken, so that load from
  other processes on a shared machine hits both sides alike.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from espo_jax.bench import format_table, median_time
from espo_jax.bench.peer_process import torch_train_stepper
from espo_jax.models import ModelConfig, forward, get_preset, hf_io, init_params
from espo_jax.models.flops import param_count, train_flops_per_token
from espo_jax.train import step as step_lib

PRESETS = ("tiny", "small")
LEARNING_RATE = 1e-4


def peak_matmul_flops(n: int, repeats: int, dtype: str = "float32") -> float:
    """Median FLOP/s of a [n, n] @ [n, n] `jnp.dot` in `dtype` (2 n^3 FLOPs); below fp32 with
    fp32 sums out, as the models ask for their products (`layers.matmul`: XLA:CPU's bf16
    kernels give fp32; a bf16-out dot runs a slower path)."""
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    out = jnp.promote_types(dtype, jnp.float32)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=out))
    seconds = median_time(lambda: dot(a, b).block_until_ready(), repeats)
    return 2 * n**3 / seconds


def _jax_loss(config: ModelConfig, params: dict, tokens_BxT: jax.Array) -> jax.Array:
    out = forward(config, params, tokens_BxT)
    logp_BxTxV = jax.nn.log_softmax(out.logits[:, :-1])
    nll = -jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1)
    return jnp.mean(nll) + out.aux_loss


def jax_train_step(config: ModelConfig, opt: optax.GradientTransformation, params: dict,
                   opt_state: Any, tokens_BxT: jax.Array) -> tuple[dict, Any, jax.Array]:
    """One AdamW step on the next-token loss; returns (params, opt_state, loss)."""
    loss, grads = jax.value_and_grad(functools.partial(_jax_loss, config))(params, tokens_BxT)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _jax_stepper(config: ModelConfig, params: dict, tokens: np.ndarray,
                 threads: int = 1) -> tuple[Any, dict]:
    """A blocking `step()` of the jitted JAX train step, and facts of its first (compiling) call.

    `threads` > 1: as the learner runs an update with `train.grad_threads`: the rows in that
    many equal parts, their gradients computed at once, each by its own thread, then one AdamW
    update with their mean (the same next-token loss: equal parts of a token mean; the router
    aux loss is each part's own)."""
    start = time.perf_counter()
    opt = optax.adamw(LEARNING_RATE)
    options = step_lib.compiler_options()  # the learner's XLA options
    state = {"params": jax.tree.map(jnp.array, params)}
    state["opt"] = opt.init(state["params"])
    tokens = jnp.asarray(tokens)
    if threads == 1:
        step = jax.jit(functools.partial(jax_train_step, config, opt), donate_argnums=(0, 1),
                       compiler_options=options)

        def run() -> float:
            state["params"], state["opt"], loss = step(state["params"], state["opt"], tokens)
            return float(loss)  # blocks until the step is done
    else:
        grad = jax.jit(jax.value_and_grad(functools.partial(_jax_loss, config)),
                       compiler_options=options)

        @functools.partial(jax.jit, donate_argnums=(0, 1), compiler_options=options)
        def apply(params, opt_state, parts):
            loss = sum(p[0] for p in parts) / len(parts)
            grads = jax.tree.map(lambda *g: sum(g) / len(g), *(p[1] for p in parts))
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        pool = ThreadPoolExecutor(threads)
        row_parts = jnp.split(tokens, threads)
        jax.block_until_ready(grad(state["params"], row_parts[0]))  # compiled here, not twice

        def run() -> float:
            p = state["params"]
            parts = list(pool.map(lambda t: jax.block_until_ready(grad(p, t)), row_parts))
            state["params"], state["opt"], loss = apply(p, state["opt"], parts)
            return float(loss)

    loss0 = run()
    return run, {"loss0": loss0, "compile_s": time.perf_counter() - start}


def _torch_stepper(config: ModelConfig, params: dict, tokens: np.ndarray) -> tuple[Any, dict]:
    """The same for transformers + torch, on the weights exported with `hf_io.save_pretrained`."""
    with tempfile.TemporaryDirectory() as path:
        hf_io.save_pretrained(config, params, path, dtype="float32")
        return torch_train_stepper(path, tokens, LEARNING_RATE)


def interleaved_medians(fns: dict[str, Any], repeats: int, block: int = 1) -> dict[str, float]:
    """Median seconds of each fn, timed in alternation (a, b, a, b, ...) so that both see the
    same machine load; on a shared CPU this keeps the ratio steadier than two separate runs.
    With `block` > 1 each fn runs that many times in a row per turn (`repeats` in all, a
    multiple of `block`): back to back, as a training run's steps run."""
    if repeats % block:
        raise ValueError(f"repeats {repeats} is not a multiple of block {block}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats // block):
        for name, fn in fns.items():
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_step_medians(steps: dict[str, tuple], repeats: int) -> dict[str, float]:
    """Median seconds of each decode step `step(params, x, cache) -> (y, cache)`, `steps`
    mapping a name to (step, params, x, cache): each compiled and warmed up first, then timed
    alternately (`interleaved_medians`), its cache donated back to it as a decode loop's is."""
    fns, state = {}, {}
    for name, (step, params, x, cache) in steps.items():
        y, state[name] = step(params, x, cache)
        y.block_until_ready()

        def fn(name=name, step=step, params=params, x=x):
            y, state[name] = step(params, x, state[name])
            jax.block_until_ready((y, state[name]))

        fns[name] = fn
    return interleaved_medians(fns, repeats)


def run(quick: bool) -> dict:
    batch, seq = (4, 64) if quick else (8, 256)
    repeats = 3 if quick else 9
    peak = peak_matmul_flops(1024 if quick else 2048, 3 if quick else 10)
    tokens = np.random.default_rng(0).integers(0, 128, (batch, seq), dtype=np.int32)
    rows, figures = [], {"batch": batch, "seq_len": seq, "repeats": repeats,
                         "peak_matmul_flops": peak, "presets": {}}
    for name in PRESETS:
        config = get_preset(name)
        if config.vocab_size < 128:
            raise ValueError(f"preset {name} has vocab {config.vocab_size} < 128 used here")
        params = jax.tree.map(np.asarray, init_params(config, jax.random.key(0)))
        jax_step, jx = _jax_stepper(config, params, tokens)
        torch_step, th = _torch_stepper(config, params, tokens)
        secs = interleaved_medians({"jax": jax_step, "torch": torch_step}, repeats)
        jx["step_s"], th["step_s"] = secs["jax"], secs["torch"]
        flops_tok = train_flops_per_token(config, seq)
        n_tok = batch * seq
        fig = {
            "params": param_count(config), "active_params": param_count(config, active=True),
            "train_flops_per_token": flops_tok, "dispatch": config.dispatch,
            "jax_tokens_per_s": n_tok / jx["step_s"], "torch_tokens_per_s": n_tok / th["step_s"],
            "jax_mfu": flops_tok * n_tok / jx["step_s"] / peak,
            "torch_mfu": flops_tok * n_tok / th["step_s"] / peak,
            "jax_loss0": jx["loss0"], "torch_loss0": th["loss0"],
            "jax_compile_s": jx["compile_s"], "torch_attn": th["attn_impl"],
            "torch_experts": th["experts_impl"], "torch_threads": th["torch_threads"],
        }
        fig["jax_over_torch"] = fig["jax_tokens_per_s"] / fig["torch_tokens_per_s"]
        figures["presets"][name] = fig
        rows.append([name, f"{fig['params'] / 1e6:.2f}M / {fig['active_params'] / 1e6:.2f}M",
                     f"{batch}x{seq}", round(fig["jax_tokens_per_s"]),
                     f"{100 * fig['jax_mfu']:.2f}%", round(fig["torch_tokens_per_s"]),
                     f"{100 * fig['torch_mfu']:.2f}%", f"{fig['jax_over_torch']:.2f}x",
                     f"{fig['jax_loss0']:.5f} / {fig['torch_loss0']:.5f}"])
    figures["load_average"] = os.getloadavg()
    print(f"peak fp32 jnp.dot: {peak / 1e9:.1f} GFLOP/s; devices: {jax.devices()[0].platform} "
          f"x{len(jax.devices())}; cpus: {os.cpu_count()}, load average "
          f"{figures['load_average'][0]:.1f}; torch: attention {th['attn_impl']}, experts "
          f"{th['experts_impl']}, {th['torch_threads']} threads; medians of {repeats} steps")
    print(format_table(
        ["preset", "params (total / active)", "B x T", "JAX tok/s", "JAX MFU", "torch tok/s",
         "torch MFU", "JAX / torch", "step-0 loss JAX / torch"], rows))
    return figures
