"""vLLM request outputs -> generations and rollout records, with the JAX engine's conventions.

`request_output_to_generations` gives the `batching.GenerationGroup` a sampler returns (what
`vllm_worker.VllmSampler` hands the worker loop to score); `request_output_to_group` the same
as an unscored `RolloutGroup` (recorded outputs, launch/gpu_check.py). Pure functions on any
object with vLLM's attribute names; this module never imports vLLM, so it runs (and is tested)
where vLLM is not installed, and a recorded output can be replayed offline.

What vLLM returns (vllm 0.32.0, `vllm/outputs.py` and `vllm/v1/engine/output_processor.py`,
github.com/vllm-project/vllm at commit 003d3ee22261b7937258b7531aee00e10393f1d6):
- `RequestOutput.prompt_token_ids`: list[int] [P]; `.outputs`: one `CompletionOutput` per
  sample (`SamplingParams(n=G)` gives G of them, `.index` 0..G-1).
- `CompletionOutput.token_ids`: [T] sampled ids; `.logprobs`: a list (or `FlatLogprobs`, which
  indexes the same way) of T dicts `{token_id: Logprob(logprob=...)}`; with
  `SamplingParams(logprobs=0)` each dict holds just the sampled token. `.finish_reason`:
  "stop" | "length" | "abort" | "error" | "repetition", None while unfinished.
- `CompletionOutput.routed_experts` (with `LLM(enable_return_routed_experts=True)`): one numpy
  array `[P + T - 1, moe_layers, top_k]`, dtype uint8 when experts <= 256 else uint16 (the
  routed-experts capturer, `model_executor/layers/fused_moe/routed_experts_capturer.py`). Its
  layer axis is indexed by decoder layer id: the capturer's buffer has `num_hidden_layers`
  columns and each MoE layer writes its own (`capture(layer_id, topk_ids)`), so a model with
  dense layers (DeepSeek-V3's and GLM-4.5's `first_k_dense_replace`) gets all-zero columns for
  them; `moe_layer_ids` picks the MoE layers' columns, the M axis the learner replays. It
  covers the prompt and every generated token that was fed forward: the aux-output connector
  (`distributed/aux_output_connector/connector.py`, `take_output`) stops at
  `num_tokens - 1`, because the last sampled token never went through the model. Only the
  final (finished) output carries it; None otherwise or when capture is off.
- Older releases (the v0.21 "routed experts replay" docs) split it: `RequestOutput.
  prompt_routed_experts` `[P, moe_layers, top_k]` shared by the samples, and per completion
  `routed_experts` for the generated tokens only (int16). Both layouts are accepted here; the
  split one is recognised by the `prompt_routed_experts` attribute on the request output.

Records store `[P + T, moe_layers, top_k]` int16 with -1 where a position has no routing: like
the JAX engine (`espo_jax.rollout.engine`), the last sampled token's row is -1 unless vLLM
returned it. Routing that was requested but came back None raises `RoutingMissingError`
instead of producing a record the learner would replay without routing.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from espo_jax.buffer.records import Response, RolloutGroup
from espo_jax.rollout.batching import Generation, GenerationGroup

# vLLM finish reasons -> record finish reasons. "error" is vLLM's retryable internal failure:
# never recorded (the request must be re-run). "repetition" (opt-in repetition detection) cut the
# response short for the engine's reasons, not the model's: recorded as "abort".
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "abort"}


class VllmOutputError(ValueError):
    """A vLLM output cannot become a record; the message says which field and why."""


class RoutingMissingError(VllmOutputError):
    """Routing capture was requested but vLLM returned no routed experts."""


ROUTING_MISSING_HINT = (
    "vLLM returned routed_experts=None although routing capture was requested. Check that "
    "the LLM was built with enable_return_routed_experts=True, that it runs Model Runner V2 "
    "(VLLM_USE_V2_MODEL_RUNNER=1; it needs Triton, so no CPU build), that prefix caching is on "
    "(the default; the routing store is keyed by KV block hash), that the model is an MoE, and "
    "that the output is the final one of the request (streamed partial outputs carry none)."
)


def request_output_to_generations(
    output: Any,
    *,
    request_index: int = 0,
    prompt_id: Hashable,
    n_experts: int | None,
    moe_layers: int | None = None,
    top_k: int | None = None,
    expect_routing: bool = True,
    n_samples: int | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> GenerationGroup:
    """The `batching.GenerationGroup` of one finished vLLM `RequestOutput` (one prompt, its G
    samples in `index` order): what a sampler returns (`vllm_worker.VllmSampler`).

    Args:
      output: a `vllm.RequestOutput` or any object with the same attributes (module doc).
      request_index, prompt_id: copied into the group.
      n_experts: experts per MoE layer of the model (None for a dense model: no routing kept).
      moe_layers, top_k: when given, the routing's trailing shape must be [moe_layers, top_k].
      expect_routing: routing capture was requested; a sample without it raises
        `RoutingMissingError`. With False, routing is kept when present and None otherwise.
      n_samples: when given, the number of completions the request asked for (`n`).
      moe_layer_ids: when given, the decoder layer ids of the MoE layers, ascending: routing
        with a column per decoder layer (vLLM's capturer, module doc) keeps these columns only;
        routing with exactly len(moe_layer_ids) columns is taken as already per MoE layer.

    Raises:
      VllmOutputError (or its subclass RoutingMissingError) naming the field and the numbers.
    """
    prompt = _token_array(getattr(output, "prompt_token_ids", None), "prompt_token_ids")
    if prompt.size == 0:
        raise VllmOutputError("prompt_token_ids is empty: records need the prompt tokens")
    completions = sorted(getattr(output, "outputs", None) or [], key=lambda c: c.index)
    if not completions:
        raise VllmOutputError("request output has no completions (outputs is empty)")
    if n_samples is not None and len(completions) != n_samples:
        raise VllmOutputError(f"request output has {len(completions)} completions for "
                              f"n={n_samples} samples")
    if expect_routing and n_experts is None:
        raise VllmOutputError("expect_routing=True needs n_experts (None means a dense model)")
    split = hasattr(output, "prompt_routed_experts")
    prompt_routing = getattr(output, "prompt_routed_experts", None) if split else None
    responses = []
    for c in completions:
        where = f"outputs[{c.index}]"
        tokens = _token_array(c.token_ids, f"{where}.token_ids")
        routed = None
        if n_experts is not None and (expect_routing or c.routed_experts is not None):
            routed = _routing(
                c.routed_experts, prompt_routing, split, len(prompt), len(tokens),
                n_experts=n_experts, moe_layers=moe_layers, top_k=top_k, where=where,
                moe_layer_ids=moe_layer_ids,
            )
        responses.append(
            Generation(
                tokens=tokens,
                logprobs=sampled_logprobs(c.logprobs, tokens, where),
                routed_experts=routed,
                finish_reason=_finish_reason(c.finish_reason, where),
            )
        )
    return GenerationGroup(request_index, prompt_id, prompt, responses)


def request_output_to_group(
    output: Any,
    *,
    prompt_id: str | int,
    policy_version: int,
    sampler: str,
    n_experts: int | None,
    moe_layers: int | None = None,
    top_k: int | None = None,
    expect_routing: bool = True,
    created_at: float | None = None,
    meta: dict[str, Any] | None = None,
    moe_layer_ids: Sequence[int] | None = None,
) -> RolloutGroup:
    """The (unscored) `RolloutGroup` of one finished vLLM `RequestOutput`: the conversion of
    `request_output_to_generations`, with `policy_version`, `sampler`, `created_at` (default
    now) and `meta` copied in, checked as a record (`RolloutGroup.validate`)."""
    gen = request_output_to_generations(
        output, prompt_id=prompt_id, n_experts=n_experts, moe_layers=moe_layers, top_k=top_k,
        expect_routing=expect_routing, moe_layer_ids=moe_layer_ids)
    group = RolloutGroup(
        prompt_id=prompt_id,
        prompt_tokens=gen.prompt_tokens,
        policy_version=policy_version,
        sampler=sampler,
        created_at=time.time() if created_at is None else created_at,
        meta=dict(meta or {}),
        responses=[Response(tokens=r.tokens, logprobs=r.logprobs,
                            routed_experts=r.routed_experts, finish_reason=r.finish_reason)
                   for r in gen.responses],
        n_experts=n_experts,
    )
    try:
        group.validate()
    except ValueError as e:
        raise VllmOutputError(f"converted group is invalid: {e}") from None
    return group


def sampled_logprobs(logprobs: Any, tokens: np.ndarray, where: str = "output") -> np.ndarray:
    """float32 [T]: the log-prob vLLM recorded for each sampled token (logprobs=0 or more)."""
    if logprobs is None:
        raise VllmOutputError(
            f"{where}.logprobs is None: sample with SamplingParams(logprobs=0) so vLLM returns "
            "the sampled tokens' log-probs (the behaviour log-probs of the record)"
        )
    if len(logprobs) != len(tokens):
        raise VllmOutputError(
            f"{where}: {len(logprobs)} log-prob positions for {len(tokens)} sampled tokens"
        )
    out = np.empty(len(tokens), np.float32)
    for t, (token, entry) in enumerate(zip(tokens.tolist(), logprobs, strict=True)):
        if not entry or token not in entry:
            raise VllmOutputError(
                f"{where}.logprobs[{t}] has no entry for the sampled token {token} "
                f"(keys {sorted(entry) if entry else []})"
            )
        value = entry[token]
        out[t] = getattr(value, "logprob", value)
    if not np.all(np.isfinite(out)):
        bad = int(np.flatnonzero(~np.isfinite(out))[0])
        raise VllmOutputError(f"{where}.logprobs[{bad}] is {out[bad]} (not finite)")
    return out


def _token_array(ids: Any, name: str) -> np.ndarray:
    if ids is None:
        raise VllmOutputError(f"{name} is None")
    arr = np.asarray(list(ids))
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0):
        raise VllmOutputError(f"{name} must be non-negative integers, got dtype {arr.dtype}")
    return arr.astype(np.int32)


def _finish_reason(reason: Any, where: str) -> str:
    reason = None if reason is None else str(reason)
    if reason is None:
        raise VllmOutputError(f"{where}.finish_reason is None: the request is not finished")
    if reason not in _FINISH_REASONS:
        raise VllmOutputError(
            f"{where}.finish_reason {reason!r} cannot be recorded "
            f"(known: {sorted(_FINISH_REASONS)}; 'error' requests must be re-run)"
        )
    return _FINISH_REASONS[reason]


def _routing(
    routed: Any,
    prompt_routed: Any,
    split: bool,
    p: int,
    t: int,
    *,
    n_experts: int,
    moe_layers: int | None,
    top_k: int | None,
    where: str,
    moe_layer_ids: Sequence[int] | None = None,
) -> np.ndarray:
    """int16 [P + T, M, k] from either vLLM layout, -1 on rows vLLM did not return."""
    if routed is None or (split and prompt_routed is None):
        missing = f"{where}.routed_experts" if routed is None else "prompt_routed_experts"
        raise RoutingMissingError(f"{missing} is None. {ROUTING_MISSING_HINT}")
    parts = [(np.asarray(prompt_routed), "prompt_routed_experts")] if split else []
    parts.append((np.asarray(routed), f"{where}.routed_experts"))
    for i, (arr, name) in enumerate(parts):
        if arr.ndim != 3:
            raise VllmOutputError(f"{name} has shape {arr.shape}, expected [tokens, layers, top_k]")
        parts[i] = (_moe_columns(arr, moe_layer_ids, name), name)
    for arr, name in parts:
        if arr.size and arr.dtype.kind not in "iu":
            raise VllmOutputError(f"{name} must hold integer expert ids, got {arr.dtype}")
        expected_tail = (moe_layers or arr.shape[1], top_k or arr.shape[2])
        if arr.shape[1:] != expected_tail or arr.shape[1:] != parts[0][0].shape[1:]:
            raise VllmOutputError(
                f"{name} has [layers, top_k] = {arr.shape[1:]}, expected {expected_tail}"
            )
        if arr.size and (arr.min() < 0 or arr.max() >= n_experts):
            raise VllmOutputError(
                f"{name} values [{arr.min()}, {arr.max()}] outside [0, n_experts={n_experts})"
            )
    if split:
        prompt_arr, gen = parts[0][0], parts[1][0]
        if prompt_arr.shape[0] != p:
            raise VllmOutputError(
                f"prompt_routed_experts has {prompt_arr.shape[0]} rows for a {p}-token prompt"
            )
        if gen.shape[0] not in (max(t - 1, 0), t):
            raise VllmOutputError(
                f"{where}.routed_experts has {gen.shape[0]} rows for {t} generated tokens "
                f"(expected {t - 1} or {t})"
            )
        rows = np.concatenate([prompt_arr, gen], axis=0)
    else:
        rows = parts[0][0]
        if rows.shape[0] not in (max(p + t - 1, 0), p + t):
            raise VllmOutputError(
                f"{where}.routed_experts has {rows.shape[0]} rows; with a {p}-token prompt and "
                f"{t} generated tokens vLLM returns {p + t - 1} (all but the last token) or "
                f"{p + t}. A request with routed_experts_prompt_start > 0 is not supported."
            )
    full = np.full((p + t, *rows.shape[1:]), -1, np.int16)
    full[: rows.shape[0]] = rows
    return full


def _moe_columns(arr: np.ndarray, moe_layer_ids: Sequence[int] | None, name: str) -> np.ndarray:
    """`arr` [N, L, k] with one column per decoder layer -> [N, M, k], the MoE layers' columns
    (`moe_layer_ids`; the others must be all 0, as vLLM leaves them); an array with M columns
    already is returned as it is."""
    if moe_layer_ids is None or arr.shape[1] == len(moe_layer_ids):
        return arr
    ids = list(moe_layer_ids)
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or arr.shape[1] <= ids[-1]:
        raise VllmOutputError(
            f"{name} has {arr.shape[1]} layer columns: neither one per MoE layer "
            f"({len(ids)}) nor one per decoder layer holding the MoE layers {ids}"
        )
    dense = np.delete(arr, ids, axis=1)
    if dense.size and dense.any():  # the capturer leaves layers that route nothing at 0
        routed = sorted(set(range(arr.shape[1])) - set(ids))
        routed = [j for j, col in zip(routed, np.moveaxis(dense, 1, 0), strict=True) if col.any()]
        raise VllmOutputError(f"{name} has expert ids in decoder layers {routed}, which the "
                              f"model's config makes dense (MoE layers: {ids})")
    return arr[:, ids]


# ---- recorded outputs: plain JSON-able dicts, replayable without vLLM ---------------------------
def output_to_dict(output: Any) -> dict[str, Any]:
    """A JSON-able copy of a vLLM `RequestOutput` (the fields the conversion reads)."""

    def arr(x: Any) -> dict | None:
        if x is None:
            return None
        x = np.asarray(x)
        return {"shape": list(x.shape), "values": x.ravel().tolist()}

    d: dict[str, Any] = {
        "prompt_token_ids": [int(i) for i in output.prompt_token_ids],
        "outputs": [
            {
                "index": int(c.index),
                "token_ids": [int(i) for i in c.token_ids],
                "logprobs": None if c.logprobs is None else [
                    {str(k): float(getattr(v, "logprob", v)) for k, v in e.items()}
                    for e in c.logprobs
                ],
                "finish_reason": None if c.finish_reason is None else str(c.finish_reason),
                "routed_experts": arr(c.routed_experts),
            }
            for c in output.outputs
        ],
    }
    if hasattr(output, "prompt_routed_experts"):
        d["prompt_routed_experts"] = arr(output.prompt_routed_experts)
    return d


def output_from_dict(d: Mapping[str, Any]) -> SimpleNamespace:
    """An object with `RequestOutput`'s attribute names from `output_to_dict`'s dict."""

    def arr(x: Mapping[str, Sequence] | None) -> np.ndarray | None:
        return None if x is None else np.asarray(x["values"], np.int64).reshape(x["shape"])

    outputs = [
        SimpleNamespace(
            index=c["index"],
            token_ids=list(c["token_ids"]),
            logprobs=None if c["logprobs"] is None else [
                {int(k): SimpleNamespace(logprob=v) for k, v in e.items()} for e in c["logprobs"]
            ],
            finish_reason=c["finish_reason"],
            routed_experts=arr(c["routed_experts"]),
        )
        for c in d["outputs"]
    ]
    out = SimpleNamespace(prompt_token_ids=list(d["prompt_token_ids"]), outputs=outputs)
    if "prompt_routed_experts" in d:
        out.prompt_routed_experts = arr(d["prompt_routed_experts"])
    return out
