"""Which weights `serve.weights=fp8` stores in FP8, by parameter name: the one definition the planner's byte count
and the model's FP8 modules share.

FP8 (e4m3, 1 byte, plus one fp32 scale per 128x128 block of each 2-D matrix; a packed expert tensor [E, rows, cols]
is E matrices):
    attention   attn.wq_a, attn.wq_b, attn.wkv_a, attn.wkv_b, attn.wo
                (Hugging Face: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj)
    indexer     attn.indexer.wq_b, attn.indexer.wk
    dense MLP   mlp.w1, mlp.w3, mlp.w2 (gate_proj, up_proj, down_proj)
    shared      mlp.shared_experts.w1, w3, w2
    routed      mlp.experts.gate_up_proj [E, 2I, D], mlp.experts.down_proj [E, D, I]
fp32: the router, mlp.gate.weight and its selection bias mlp.gate.e_score_correction_bias (dsaflow.model.moe.Router
keeps both in fp32 under any dtype: routing decisions are sensitive to rounding).
The serve dtype (bf16 on a GPU): everything else, i.e. the token embedding, the LM head, every norm's weight and bias
(the indexer's k_norm included) and the indexer's weights_proj.

This mirrors the released FP8 checkpoints of DeepSeek-V3.2 and GLM-5: their `*_scale_inv` tensors sit beside exactly
these projections, and their indexer weights_proj, norms, embedding and head are bf16. One difference of layout: the
model packs each expert's gate and up projections into one [2I, D] matrix, so its block grid is ceil(2I/128) rows of
blocks where the checkpoints have 2 * ceil(I/128); the two agree whenever moe_inter_dim is a multiple of 128, as in
every released model.

Names are the model's own (`StageModule.named_parameters()`, and its persistent buffers); a layer's names are
`layers.<i>.<suffix>`, the rules below match the suffix.
"""

from __future__ import annotations

import math
import re
from typing import Sequence, Tuple

FP8_BLOCK = 128  # rows and columns of the weight block one fp32 scale covers
FP8_BYTES = 1  # e4m3
SCALE_BYTES = 4  # fp32 scale per block
FP32_BYTES = 4

FP8 = "fp8"
FP32 = "fp32"
SERVE_DTYPE = "serve dtype"
WEIGHT_FORMATS = ("bf16", FP8)  # the values of serve.weights

# a layer's parameters stored in FP8 (suffixes after `layers.<i>.`)
FP8_LAYER_WEIGHTS = frozenset(
    {
        "attn.wq_a.weight",
        "attn.wq_b.weight",
        "attn.wkv_a.weight",
        "attn.wkv_b.weight",
        "attn.wo.weight",
        "attn.indexer.wq_b.weight",
        "attn.indexer.wk.weight",
        "mlp.w1.weight",
        "mlp.w3.weight",
        "mlp.w2.weight",
        "mlp.shared_experts.w1.weight",
        "mlp.shared_experts.w3.weight",
        "mlp.shared_experts.w2.weight",
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    }
)
# a layer's tensors kept in fp32 whatever the format
FP32_LAYER_WEIGHTS = frozenset({"mlp.gate.weight", "mlp.gate.e_score_correction_bias"})

_LAYER = re.compile(r"^layers\.\d+\.(.+)$")


def layer_suffix(name: str) -> str:
    """'layers.12.attn.wo.weight' -> 'attn.wo.weight'; a name outside the layers (embed.weight) as it is."""
    m = _LAYER.match(name)
    return m.group(1) if m else name


def is_fp8_weight(name: str) -> bool:
    """Whether the parameter `name` (the model's full name or a layer suffix) is stored in FP8 under
    serve.weights=fp8."""
    return layer_suffix(name) in FP8_LAYER_WEIGHTS


def weight_format(name: str, weights: str = FP8) -> str:
    """How the tensor `name` is stored when serving with serve.weights=`weights` (bf16 | fp8): FP8, FP32 (the router)
    or SERVE_DTYPE (bf16 on a GPU, fp32 with serve.dtype=fp32)."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    suffix = layer_suffix(name)
    if suffix in FP32_LAYER_WEIGHTS:
        return FP32
    if weights == FP8 and suffix in FP8_LAYER_WEIGHTS:
        return FP8
    return SERVE_DTYPE


def fp8_scale_count(shape: Sequence[int]) -> int:
    """fp32 scales of an FP8 tensor of `shape`: [rows, cols] has ceil(rows/128) x ceil(cols/128); a packed
    [E, rows, cols] has E times that (one grid per expert)."""
    if len(shape) < 2:
        raise ValueError(f"an FP8 weight is a matrix or a stack of them, got shape {tuple(shape)}")
    *stack, rows, cols = shape
    return math.prod(stack) * math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)


def stored_bytes(name: str, shape: Sequence[int], weights: str = FP8, width: int = 2) -> int:
    """Bytes the tensor `name` of `shape` takes when serving with serve.weights=`weights`: FP8 = 1 byte per element
    plus its block scales, FP32 = 4, the serve dtype = `width` (2 for bf16)."""
    fmt = weight_format(name, weights)
    numel = math.prod(shape)
    if fmt == FP8:
        return numel * FP8_BYTES + fp8_scale_count(shape) * SCALE_BYTES
    return numel * (FP32_BYTES if fmt == FP32 else width)


def total_stored_bytes(named_shapes: Sequence[Tuple[str, Sequence[int]]], weights: str = FP8, width: int = 2) -> int:
    """`stored_bytes` summed over (name, shape) pairs."""
    return sum(stored_bytes(n, s, weights, width) for n, s in named_shapes)
