"""dsaflow state-dict keys <-> Hugging Face tensor names of DeepSeek-V3.2 and GLM-5.x, with the layout changes.

Per layer `i` (prefix `model.layers.i.`):
  attn_norm / ffn_norm            input_layernorm / post_attention_layernorm
  attn.wq_a, q_norm, wq_b         self_attn.q_a_proj, q_a_layernorm, q_b_proj       (wq_b: rope rows permuted)
  attn.wkv_a, kv_norm, wkv_b, wo  self_attn.kv_a_proj_with_mqa (rope rows permuted), kv_a_layernorm, kv_b_proj, o_proj
  attn.indexer.{wq_b, wk, k_norm, weights_proj}   self_attn.indexer.* (GLM: rope rows permuted)
  mlp.w1 / w3 / w2                mlp.gate_proj / up_proj / down_proj               (dense layers)
  mlp.gate.weight, mlp.gate.e_score_correction_bias                                 (the same names)
  mlp.experts.gate_up_proj [E, 2I, D]   mlp.experts.{e}.gate_proj, up_proj [I, D] each, stacked (gate rows first)
  mlp.experts.down_proj [E, D, I]       mlp.experts.{e}.down_proj [D, I], stacked
  mlp.shared_experts.w1 / w3 / w2       mlp.shared_experts.gate_proj / up_proj / down_proj
Top level: embed <- model.embed_tokens, norm <- model.norm, head <- lm_head (tied: model.embed_tokens).
MTP layer `i` (i >= num_hidden_layers, `mtp.i.` here, `model.layers.i.` there): its block as any layer, and
  embed / enorm / hnorm / eh_proj / head_norm   embed_tokens / enorm / hnorm / eh_proj / shared_head.norm
  (the checkpoints also store `shared_head.head`, a copy of lm_head: `mtp_head_copies` names it)

RoPE layouts. dsaflow rotates half-split pairs (x[j], x[j + R/2]). Hugging Face's MLA (both families) and GLM's
indexer rotate interleaved pairs (x[2j], x[2j + 1]) and write the result half-split. Reordering the rotary rows of
the projections that produce q and k (evens first, then odds) makes dsaflow's half-split rotation produce exactly
Hugging Face's rotated vectors; GLM's indexer key also passes a LayerNorm first, whose weight and bias follow the
same order (its mean and variance do not depend on the order). DeepSeek-V3.2's indexer is half-split already.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

_LAYER = re.compile(r"^(?:layers|mtp)\.(\d+)\.(.+)$")
_MTP_OWN = {  # an MTP layer's own tensors beside its block: dsaflow suffix -> Hugging Face suffix
    "embed.weight": "embed_tokens.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "head_norm.weight": "shared_head.norm.weight",
}
MTP_HEAD = "shared_head.head.weight"  # an MTP layer's copy of lm_head in the checkpoints (ours is the head itself)
_SIMPLE = {  # dsaflow suffix -> Hugging Face suffix, tensors as they are
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.indexer.weights_proj.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}


def half_split_order(rope_dim: int) -> torch.Tensor:
    """[rope_dim] int64: the interleaved rows in half-split order (0, 2, 4, ..., 1, 3, 5, ...)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def permute_rope_rows(t: torch.Tensor, block: int, start: int, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """t [rows, ...] seen as [rows // block, block, ...]: rows start .. start + rope_dim of each block reordered from
    interleaved to half-split (inverse=True: back). Returns a new tensor."""
    order = half_split_order(rope_dim)
    if inverse:
        order = torch.argsort(order)
    out = t.reshape(t.shape[0] // block, block, *t.shape[1:]).clone()
    out[:, start : start + rope_dim] = out[:, start : start + rope_dim][:, order]
    return out.reshape(t.shape)


@dataclass
class Source:
    """The Hugging Face tensors of one dsaflow key: their names and shapes, and how to build (`to_ours`) or split
    (`to_theirs`) our tensor."""

    names: List[str]
    shapes: List[Tuple[int, ...]]
    to_ours: Callable[[List[torch.Tensor]], torch.Tensor]
    to_theirs: Callable[[torch.Tensor], List[torch.Tensor]]


def _same(name: str, shape) -> Source:
    return Source([name], [tuple(shape)], lambda ts: ts[0], lambda t: [t])


def _rope_rows(name: str, shape, block: int, start: int, rope_dim: int) -> Source:
    return Source(
        [name],
        [tuple(shape)],
        lambda ts: permute_rope_rows(ts[0], block, start, rope_dim),
        lambda t: [permute_rope_rows(t, block, start, rope_dim, inverse=True)],
    )


def hf_source(key: str, shape, cfg, family: str) -> Optional[Source]:
    """The Source of dsaflow key `key` (its tensor's shape `shape`) for a model `cfg` (ModelConfig) of `family`
    (deepseek_v32 | glm_moe_dsa); None for a key with no Hugging Face counterpart."""
    if key == "embed.weight":
        return _same("model.embed_tokens.weight", shape)
    if key == "norm.weight":
        return _same("model.norm.weight", shape)
    if key == "head.weight":
        return _same("model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight", shape)
    m = _LAYER.match(key)
    if m is None:
        return None
    i, rest = int(m.group(1)), m.group(2)
    p = f"model.layers.{i}."
    R = cfg.qk_rope_head_dim
    if key.startswith("mtp.") and rest in _MTP_OWN:
        return _same(p + _MTP_OWN[rest], shape)
    if rest in _SIMPLE:
        return _same(p + _SIMPLE[rest], shape)
    if rest == "attn.wq_b.weight":
        return _rope_rows(p + "self_attn.q_b_proj.weight", shape, cfg.qk_nope_head_dim + R, cfg.qk_nope_head_dim, R)
    if rest == "attn.wkv_a.weight":
        return _rope_rows(p + "self_attn.kv_a_proj_with_mqa.weight", shape, shape[0], cfg.kv_lora_rank, R)
    if rest.startswith("attn.indexer."):
        name = p + "self_attn." + rest[len("attn.") :]
        if family != "glm_moe_dsa":  # DeepSeek-V3.2's indexer rotates half-split pairs already
            return _same(name, shape)
        block = cfg.index_head_dim if rest == "attn.indexer.wq_b.weight" else shape[0]
        return _rope_rows(name, shape, block, 0, cfg.index_rope_head_dim)
    if rest == "mlp.experts.gate_up_proj":
        E, two_i, D = shape
        names = [p + f"mlp.experts.{e}.{w}_proj.weight" for e in range(E) for w in ("gate", "up")]
        return Source(
            names,
            [(two_i // 2, D)] * len(names),
            lambda ts: torch.stack([torch.cat(ts[2 * e : 2 * e + 2]) for e in range(E)]),
            lambda t: [half for e in range(E) for half in t[e].chunk(2)],
        )
    if rest == "mlp.experts.down_proj":
        E, D, inter = shape
        names = [p + f"mlp.experts.{e}.down_proj.weight" for e in range(E)]
        return Source(names, [(D, inter)] * E, torch.stack, lambda t: list(t.unbind(0)))
    return None


def layer_of(hf_name: str) -> Optional[int]:
    """The layer index in a Hugging Face tensor name (`model.layers.N.`), else None."""
    m = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return int(m.group(1)) if m else None


def mtp_head_copies(cfg) -> List[str]:
    """The Hugging Face names of the MTP layers' copies of lm_head (`model.layers.i.shared_head.head.weight`):
    our MTP layers read the model's head, so a load checks each copy equals lm_head and an export writes it."""
    return [f"model.layers.{i}.{MTP_HEAD}" for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)]
