"""Tiny random transformers models of both DSA families, saved as Hugging Face checkpoints for the hf tests.

DeepSeek-V3.2: 3 layers (layer 0 dense, 1-2 MoE), 8 experts in 4 groups (2 kept), 2 per token, YaRN (factor 4 over
16 positions, mscale_all_dim != mscale so both the cos/sin factor and the softmax mscale differ from 1).
GLM-5.x: 8 layers whose roles come from index_topk_freq=3 / index_skip_topk_offset=2 (FFSSFSSF), 8 experts in 2
groups (1 kept), plain RoPE, rms_norm_eps 1e-5. Both: index_topk 8 (prompts are longer), 16 indexer heads (so that
an all-zero score tie, every head's relu at 0, is rare). Weights are random at sizes that keep activations O(1),
every norm weight and bias random too (a wrong permutation of k_norm shows).
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=12,
    qk_nope_head_dim=8,
    index_topk=8,
    index_head_dim=16,
    index_n_heads=16,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    routed_scaling_factor=1.5,
    bos_token_id=0,
    eos_token_id=1,
)


def deepseek_config():
    from transformers import DeepseekV32Config

    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        mscale=1.0,
        mscale_all_dim=0.8,
        beta_fast=32,
        beta_slow=1,
    )
    return DeepseekV32Config(num_hidden_layers=3, n_group=4, topk_group=2, rope_parameters=yarn, **COMMON)


def glm_config():
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        num_hidden_layers=8,
        n_group=2,
        topk_group=1,
        rms_norm_eps=1e-5,
        index_topk_freq=3,
        index_skip_topk_offset=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        **COMMON,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1 and name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def make_model(family: str, seed: int = 0):
    """A random transformers model of `family` (deepseek_v32 | glm_moe_dsa), fp32, eager attention, eval mode."""
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    cfg = deepseek_config() if family == "deepseek_v32" else glm_config()
    cls = DeepseekV32ForCausalLM if family == "deepseek_v32" else GlmMoeDsaForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    randomize(model, seed)
    return model.eval()


def save_checkpoint(family: str, folder: Path, seed: int = 0) -> Path:
    """`make_model` saved with save_pretrained in bf16 (sharded, with its index) -> folder."""
    model = make_model(family, seed).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="40KB")
    return Path(folder)


def load_reference(folder: Path):
    """The transformers model of a saved checkpoint, in fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
