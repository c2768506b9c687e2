"""The serving KV cache's storage format (`serve.kv_dtype`), in bytes: the one definition the planner's memory table,
the cache allocation and the kernels share. Pure Python (the planner imports it).

bf16 (default): per token and layer the latent row (kv_lora_rank + qk_rope_head_dim) and, on F layers, the indexer
key (index_head_dim), in the serve dtype.

fp8 (DeepSeek's layout, FlashMLA's 656 bytes per token at V3.2's dims): one packed byte row per token,
    latent      [kv_lora_rank e4m3 | kv_lora_rank / block fp32 scales | qk_rope_head_dim bf16]
    indexer key [index_head_dim e4m3 | 1 fp32 scale]                                 (F layers only)
with block = 128 (or the whole latent when kv_lora_rank < 128). Each scale is amax / 448 of its block (1 for a block
of zeros), and a value is stored as round-to-nearest-even(x / scale) in e4m3 (3 mantissa bits): dsaflow.ops.kv_fp8
holds the rounding, its reference and its kernels. The RoPE part stays bf16 because the positions' rotation is
sensitive to rounding and is only 64 of 576 dims.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("bf16", "fp8")  # the values of serve.kv_dtype
FP8 = "fp8"
SCALE_BLOCK = 128  # e4m3 values per fp32 scale of the latent
SCALE_BYTES = 4
ROPE_BYTES = 2  # bf16


@dataclass(frozen=True)
class Fp8RowFormat:
    """One packed FP8 cache row: `width` e4m3 values in blocks of `block`, one fp32 scale per block, then `rope` bf16
    values. Byte offsets: values [0, width), scales [width, scale_end), rope [scale_end, nbytes)."""

    width: int
    block: int
    rope: int = 0

    @property
    def blocks(self) -> int:
        return self.width // self.block

    @property
    def scale_end(self) -> int:
        return self.width + SCALE_BYTES * self.blocks

    @property
    def nbytes(self) -> int:
        return self.scale_end + ROPE_BYTES * self.rope


def latent_format(m) -> Fp8RowFormat:
    """The FP8 latent row of a model config: kv_lora_rank e4m3 in blocks of 128 (the whole latent if narrower), the
    RoPE dims bf16. V3.2: 512 + 4 x 4 + 64 x 2 = 656 bytes."""
    return Fp8RowFormat(m.kv_lora_rank, min(SCALE_BLOCK, m.kv_lora_rank), m.qk_rope_head_dim)


def index_key_format(m) -> Fp8RowFormat:
    """The FP8 indexer key row: index_head_dim e4m3 and one fp32 scale. V3.2: 128 + 4 = 132 bytes."""
    return Fp8RowFormat(m.index_head_dim, m.index_head_dim)


def fp8_kv_problem(m) -> str | None:
    """None if serve.kv_dtype=fp8 can store this model's caches, else what does not fit the packed layout (the scales
    are read as fp32 at 4-byte aligned offsets, and each scale covers a whole block)."""
    C, D = m.kv_lora_rank, m.index_head_dim
    if C % 4 or C % min(SCALE_BLOCK, C):
        return f"model.kv_lora_rank={C} must be a multiple of 4, and of {SCALE_BLOCK} when above {SCALE_BLOCK}"
    if D % 4:
        return f"model.index_head_dim={D} must be a multiple of 4"
    return None


def kv_bytes_per_token(m, role: str, kv_dtype: str, width: int) -> int:
    """Cache bytes per token of one layer of `role` (F keeps an indexer key, S does not) with serve.kv_dtype=`kv_dtype`
    and a serve dtype `width` bytes wide (bf16 caches are stored in the serve dtype)."""
    if kv_dtype == FP8:
        return latent_format(m).nbytes + (index_key_format(m).nbytes if role == "F" else 0)
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    return (latent + (m.index_head_dim if role == "F" else 0)) * width
