"""The map between the parameter tree of `espo_jax.models` and Hugging Face tensor names, and
the shape of every leaf a `ModelConfig` implies.

`param_map(config)` lists one entry per parameter leaf (a Gated DeltaNet layer: one per subtree)
with the HF names it is stored under and the two functions that convert between the layouts:
HF `nn.Linear` weights are [out, in], our kernels [in, out]; per-expert HF weights
(`mlp.experts.{j}.{proj}.weight`) are our stacked [E, D, F] / [E, F, D] arrays. Reading
(`hf_io.from_pretrained`) and writing (`hf_io.save_pretrained`) both walk this one map and check
each leaf against `expected_shapes`, so the two directions cannot disagree on a name or a shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from espo_jax.models import hf_deepseek, hf_qwen3_next
from espo_jax.models.config import ModelConfig

# ---- the name map ------------------------------------------------------------------------------
# One entry per parameter leaf: (path in params, HF tensor names, to_hf, from_hf). `to_hf` maps our
# array to the list of HF arrays (one per name); `from_hf` maps an HF-array getter to ours.
Getter = Callable[[str], np.ndarray]


def _linear(path: tuple[str, ...], name: str, bias: bool = False) -> list[tuple]:
    """An HF `nn.Linear` ([out, in] weight, optional bias) <-> our [in, out] kernel."""
    w = name + ".weight"
    out = [(path + ("kernel",), [w], lambda x: [x.T], lambda get: get(w).T)]
    if bias:
        out.append(_copy(path + ("bias",), name + ".bias"))
    return out


def _copy(path: tuple[str, ...], name: str) -> tuple:
    return (path, [name], lambda w: [w], lambda get: get(name))


def _experts(path: tuple[str, ...], prefix: str, proj: str, n_experts: int) -> tuple:
    """A stacked expert weight <-> per-expert HF Linear weights (`{prefix}.{j}.{proj}.weight`)."""
    names = [f"{prefix}.{j}.{proj}.weight" for j in range(n_experts)]
    return (path, names, lambda w: [w[j].T for j in range(n_experts)],
            lambda get: np.stack([get(n).T for n in names]))


def param_map(config: ModelConfig, model_type: str = "qwen3_next") -> list[tuple]:
    """The full map between our parameter tree and HF tensor names for `config`. A Gated
    DeltaNet layer is one entry for its whole subtree (`hf_qwen3_next.linear_entry`; its
    input projections are laid out by `model_type`)."""
    entries = [_copy(("embed", "embedding"), "model.embed_tokens.weight")]
    for i in range(config.n_layers):
        p, hf = f"layers_{i}", f"model.layers.{i}"
        entries.append(_copy((p, "attn_norm", "scale"), f"{hf}.input_layernorm.weight"))
        entries.append(_copy((p, "mlp_norm", "scale"), f"{hf}.post_attention_layernorm.weight"))
        if config.layer_type(i) == "linear_attention":
            entries.append(hf_qwen3_next.linear_entry(config, (p, "linear_attn"),
                                                      f"{hf}.linear_attn", model_type))
        elif config.attention == "mla":
            entries += _mla_entries(config, (p, "attn"), f"{hf}.self_attn")
        gqa = config.attention == "gqa" and config.layer_type(i) == "full_attention"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")[4 * (not gqa):]:
            bias = config.qkv_bias and proj != "o_proj"
            entries += _linear((p, "attn", proj), f"{hf}.self_attn.{proj}", bias)
        if config.qk_norm and gqa:
            for norm in ("q_norm", "k_norm"):
                entries.append(_copy((p, "attn", norm, "scale"), f"{hf}.self_attn.{norm}.weight"))
        if config.is_moe_layer(i):
            m = (p, "moe")
            entries += _linear(m + ("router",), f"{hf}.mlp.gate")
            if config.router == "sigmoid_group":
                entries.append(_copy(m + ("router", "e_score_correction_bias"),
                                     f"{hf}.mlp.gate.e_score_correction_bias"))
            for ours, proj in (("wi_gate", "gate_proj"), ("wi_up", "up_proj"), ("wo", "down_proj")):
                entries.append(_experts(m + (ours,), f"{hf}.mlp.experts", proj, config.n_experts))
            if config.shared_expert_d_ff:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    name = f"{hf}.mlp.shared_expert.{proj}"
                    entries += _linear(m + ("shared_expert", proj), name)
                entries += _linear(m + ("shared_expert_gate",), f"{hf}.mlp.shared_expert_gate")
            if config.n_shared_experts:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    entries += _linear(m + ("shared_experts", proj),
                                       f"{hf}.mlp.shared_experts.{proj}")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                entries += _linear((p, "mlp", proj), f"{hf}.mlp.{proj}")
    entries.append(_copy(("final_norm", "scale"), "model.norm.weight"))
    if not config.tie_embeddings:
        entries += _linear(("lm_head",), "lm_head")
    return entries


def _mla_entries(config: ModelConfig, path: tuple[str, ...], hf: str) -> list[tuple]:
    """An MLA layer's tensors (`espo_jax.models.mla`; transformers `DeepseekV3Attention`)."""
    q = (("q_a_proj", "q_a_proj"), ("q_b_proj", "q_b_proj")) if config.q_lora_rank else (
        ("q_proj", "q_proj"),)
    entries = []
    for ours, theirs in q + (("kv_a_proj", "kv_a_proj_with_mqa"), ("kv_b_proj", "kv_b_proj"),
                             ("o_proj", "o_proj")):
        entries += _linear(path + (ours,), f"{hf}.{theirs}")
    norms = (("q_a_norm", "q_a_layernorm"),) if config.q_lora_rank else ()
    for ours, theirs in norms + (("kv_a_norm", "kv_a_layernorm"),):
        entries.append(_copy(path + (ours, "scale"), f"{hf}.{theirs}.weight"))
    return entries


# ---- the parameter tree and the shapes it must have ------------------------------------------
def set_leaf(tree: dict, path: tuple[str, ...], value: Any) -> None:
    """Puts `value` at `path` in a nested dict, making the dicts on the way."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_leaf(tree: Any, path: tuple[str, ...]) -> Any:
    """The value at `path` in a nested dict (params, or shardings shaped like them)."""
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            raise KeyError(f"params has no entry {'/'.join(path)}")
        tree = tree[key]
    return tree


def leaves_of(path: tuple[str, ...], tree: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(leaf path, array) of a value `from_hf` gives: one array, or a subtree of them."""
    if isinstance(tree, dict):
        for key, sub in tree.items():
            yield from leaves_of(path + (key,), sub)
    else:
        yield path, tree


def expected_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Shape of every parameter leaf implied by `config` (the model contract)."""
    c = config
    d, h, k, a = c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.head_dim
    e, f, fs = c.n_experts, c.d_expert, c.shared_expert_d_ff
    kernels = {"q_proj": (d, h * (2 if c.attn_output_gate else 1)), "k_proj": (d, k),
               "v_proj": (d, k), "o_proj": (h, d)}
    mla = hf_deepseek.mla_shapes(c) if c.attention == "mla" else {}
    out: dict[tuple[str, ...], tuple[int, ...]] = {}
    for ours, *_ in param_map(config):
        leaf, parent = ours[-1], ours[-2] if len(ours) > 1 else ""
        if leaf == "linear_attn":
            for name, shape in hf_qwen3_next.linear_shapes(c).items():
                out[ours + tuple(name.split("/"))] = shape
            continue
        if ours[1:2] == ("attn",) and parent in mla:
            shape = mla[parent]
        elif leaf == "e_score_correction_bias":
            shape = (e,)
        elif ours[0] == "embed":
            shape = (c.vocab_size, d)
        elif ours[0] == "lm_head":
            shape = (d, c.vocab_size)
        elif leaf == "scale":
            shape = (a,) if parent in ("q_norm", "k_norm") else (d,)
        elif parent in kernels:
            shape = kernels[parent] if leaf == "kernel" else (kernels[parent][1],)
        elif leaf in ("wi_gate", "wi_up"):
            shape = (e, d, f)
        elif leaf == "wo":
            shape = (e, f, d)
        elif parent == "router":
            shape = (d, e)
        elif parent == "shared_expert_gate":
            shape = (d, 1)
        else:  # gate/up/down of the dense MLP or the shared expert
            hidden = {"shared_expert": fs, "shared_experts": f * c.n_shared_experts}.get(
                ours[2] if len(ours) > 3 else "", c.d_ff)
            shape = (hidden, d) if parent == "down_proj" else (d, hidden)
        out[ours] = shape
    return out
