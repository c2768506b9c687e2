"""Tiny random Hugging Face checkpoints of both DSA families (needs the dev extra: transformers, tokenizers).

    python scripts/hf_tiny_checkpoint.py --family glm_moe_dsa --out /tmp/tiny-glm [--fp8 /tmp/tiny-glm-fp8]
        [--moe-inter 128] [--mtp]

writes a random `GlmMoeDsaForCausalLM` (or `--family deepseek_v32`: `DeepseekV32ForCausalLM`) with save_pretrained in
bf16, sharded with its index, a small BPE tokenizer.json, and with --fp8 a block-quantized FP8 copy (e4m3 weights,
128x128 `weight_scale_inv`) holding a multi-token-prediction layer (`--mtp` adds one to the bf16 checkpoint too; the
released checkpoints' tensor names). The Hugging Face tests build their checkpoints with it.

DeepSeek-V3.2: 3 layers (layer 0 dense, 1-2 MoE), 8 experts in 4 groups (2 kept), 2 per token, YaRN (factor 4 over
64 positions, mscale_all_dim != mscale so both the cos/sin factor and the softmax mscale differ from 1).
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
        original_max_position_embeddings=64,
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


def make_model(family: str, seed: int = 0, **config):
    """A random transformers model of `family` (deepseek_v32 | glm_moe_dsa), fp32, eager attention, eval mode;
    `config`: config.json fields that replace COMMON's (moe_intermediate_size=128: expert blocks of FP8 copies
    that serve.weights=fp8 keeps as stored)."""
    from transformers import DeepseekV32ForCausalLM, GlmMoeDsaForCausalLM

    cfg = deepseek_config() if family == "deepseek_v32" else glm_config()
    for key, value in config.items():
        setattr(cfg, key, value)
    cls = DeepseekV32ForCausalLM if family == "deepseek_v32" else GlmMoeDsaForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    randomize(model, seed)
    return model.eval()


def save_checkpoint(family: str, folder: Path, seed: int = 0, **config) -> Path:
    """`make_model` saved with save_pretrained in bf16 (sharded, with its index) -> folder."""
    model = make_model(family, seed, **config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="40KB")
    return Path(folder)


def load_reference(folder: Path):
    """The transformers model of a saved checkpoint, in fp32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


TEXT = (
    "the quick brown fox jumps over the lazy dog while a sparse indexer picks the keys each query reads "
    "and the experts route every token to two of eight small networks in four groups"
)


def save_tokenizer(folder: Path, vocab_size: int = COMMON["vocab_size"]) -> None:
    """A small byte-level BPE tokenizer.json (ids below vocab_size, <bos> = 0 prepended, <eos> = 1), saved with
    transformers' PreTrainedTokenizerFast so that AutoTokenizer reads it too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<bos>", "<eos>"], initial_alphabet=sorted(set(TEXT)), min_frequency=1
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    assert tok.get_vocab_size() <= vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(folder)


def _keeps_precision(name: str, t: torch.Tensor) -> bool:
    """What DeepSeek's and GLM's FP8 checkpoints keep in bf16 / fp32: embeddings, lm_head, norms, the router,
    the indexer's weights_proj (and every 1-D tensor)."""
    keep = (
        "embed_tokens.weight",
        "lm_head.weight",
        "shared_head.head.weight",
        "mlp.gate.weight",
        "weights_proj.weight",
    )
    return t.dim() != 2 or name.endswith(keep)


def mtp_tensors(tensors: dict, num_layers: int, seed: int = 1) -> dict:
    """A multi-token-prediction layer (index num_layers) for a checkpoint's `tensors`, named as DeepSeek's and GLM's
    releases name it: a block copied from the last layer (MoE, with an indexer) with its weights perturbed, a copy
    of the embedding (`embed_tokens`) and of lm_head (`shared_head.head`), random enorm / hnorm /
    `shared_head.norm`, and a random eh_proj [dim, 2 dim]."""
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    out = {}
    for name, t in tensors.items():
        if name.startswith(last) and not name.endswith("_scale_inv"):
            noise = 0.05 * torch.randn(t.shape, generator=g) * t.float().abs().mean()
            out[mtp + name[len(last) :]] = (t.float() + noise).to(t.dtype)
    embed = tensors["model.embed_tokens.weight"]
    dim = embed.shape[1]
    out[mtp + "embed_tokens.weight"] = embed.clone()
    out[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for norm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        out[mtp + norm] = (1 + 0.1 * torch.randn(dim, generator=g)).to(embed.dtype)
    out[mtp + "eh_proj.weight"] = (torch.randn(dim, 2 * dim, generator=g) / (2 * dim) ** 0.5).to(embed.dtype)
    return out


def read_tensors(folder: Path) -> dict:
    """Every tensor of a sharded checkpoint folder, by name."""
    import json

    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name, shard in index.items():
        with safe_open(str(folder / shard), "pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


def add_mtp_layer(folder: Path, seed: int = 1) -> Path:
    """Add `mtp_tensors` to the bf16 checkpoint `folder` (save_pretrained drops MTP layers) as one more shard in
    its index, with num_nextn_predict_layers=1 in config.json."""
    import json

    from safetensors.torch import save_file

    raw = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    extra = mtp_tensors(read_tensors(folder), raw["num_hidden_layers"], seed)
    save_file({k: v.contiguous() for k, v in extra.items()}, str(folder / "model-mtp.safetensors"), {"format": "pt"})
    index["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    raw["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def write_fp8_copy(src: Path, dst: Path, mtp: bool = True) -> Path:
    """A block-quantized FP8 copy of the bf16 checkpoint `src` (e4m3 + 128x128 `weight_scale_inv`, the
    quantization_config of DeepSeek's releases), two shards with an index; `mtp` adds a multi-token-prediction
    layer (index num_layers, `mtp_tensors`) when `src` has none."""
    import json
    import shutil

    from safetensors.torch import save_file

    from dsaflow.ops.fp8_gemm import quantize_blocks_128

    dst.mkdir(parents=True)
    raw = json.loads((src / "config.json").read_text())
    tensors = read_tensors(src)
    n = raw["num_hidden_layers"]
    if mtp and not any(k.startswith(f"model.layers.{n}.") for k in tensors):
        tensors.update(mtp_tensors(tensors, n))
    out = {}
    for name, t in tensors.items():
        if _keeps_precision(name, t):
            out[name] = t
        else:
            out[name], out[name + "_scale_inv"] = quantize_blocks_128(t.float())
    names = sorted(out)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: out[k].contiguous() for k in keys}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    raw["num_nextn_predict_layers"] = 1 if mtp else 0
    (dst / "config.json").write_text(json.dumps(raw))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    return dst


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["deepseek_v32", "glm_moe_dsa"], default="glm_moe_dsa")
    parser.add_argument("--out", required=True, type=Path, help="the bf16 checkpoint folder (must not exist)")
    parser.add_argument("--fp8", type=Path, help="also write an FP8 block-quantized copy here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moe-inter",
        type=int,
        default=COMMON["moe_intermediate_size"],
        help="moe_intermediate_size; a multiple of 128 lets serve.weights=fp8 keep the FP8 copy's experts as stored",
    )
    parser.add_argument("--mtp", action="store_true", help="add an MTP layer to the bf16 checkpoint (add_mtp_layer)")
    args = parser.parse_args(argv)
    save_checkpoint(args.family, args.out, args.seed, moe_intermediate_size=args.moe_inter)
    save_tokenizer(args.out)
    if args.mtp:
        add_mtp_layer(args.out)
    print(f"wrote {args.family} to {args.out}")
    if args.fp8:
        write_fp8_copy(args.out, args.fp8)
        print(f"wrote its FP8 copy to {args.fp8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
