"""A Hugging Face config.json (DeepSeek-V3.2 `deepseek_v32`, GLM-5.x `glm_moe_dsa`) as dsaflow's ModelConfig + layout.

`model=hf model.hf_path=DIR` composes the model from DIR/config.json (`apply_hf_model`, the compose hook), so that
`dsaflow plan model=hf model.hf_path=DIR pipeline=pp8` plans the real model without reading a weight:
- shapes: hidden_size -> dim, num_attention_heads -> n_heads, the MLA ranks and head dims as named, the indexer's
  index_n_heads / index_head_dim / index_topk (its rotary slice is qk_rope_head_dim, like MLA's);
- MoE (`model.moe`): n_routed_experts, num_experts_per_tok, moe_intermediate_size, n_shared_experts, n_group,
  topk_group, norm_topk_prob, routed_scaling_factor; mlp_layer_types (else first_k_dense_replace) the dense layers;
- RoPE: rope_parameters (or rope_theta + rope_scaling), `default` or `yarn` (model.rope_scaling);
- norms: rms_norm_eps for the block norms; the q/kv latent RMSNorms and the indexer's key LayerNorm use 1e-6
  (transformers builds them with that eps whatever rms_norm_eps says);
- layer roles: `indexer_types` (full / shared) wins, else `index_topk_pattern` (F / S), else layer i is F iff
  max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0 (defaults 1 and 2); DeepSeek-V3.2: all F.
  Shared layers carry no indexer weights, so a model with any implies `index.promote=false`.
A field whose value dsaflow cannot honour (another activation, attention bias, another RoPE type, an unknown key)
is a ConfigError naming it: silently ignoring it would compute another model.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsaflow.config.moe_schema import MoEConfig
from dsaflow.config.rope_schema import YarnConfig
from dsaflow.config.schema import ModelConfig
from dsaflow.errors import ConfigError

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
CONFIG_JSON = "config.json"
# eps of transformers' q_a_layernorm / kv_a_layernorm (RMSNorm default) and of the indexer's k_norm (LayerNorm)
HF_LATENT_NORM_EPS = 1e-6
HF_INDEX_NORM_EPS = 1e-6

# Keys that change nothing we compute (metadata, generation, training-only or serving-only knobs).
_IGNORED = {
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "initializer_range",
    "attention_dropout",
    "output_router_logits",
    "router_aux_loss_coef",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "moe_layer_freq",
    "topk_method",
    "num_key_value_heads",
    "head_dim",
    "qk_head_dim",
    "layer_types",
    "num_nextn_predict_layers",
    "pretraining_tp",
    "quantization_config",
    "scale_fmt",
    "_name_or_path",
    "tie_word_embeddings",
    "rope_interleave",
    "index_topk_freq",
    "index_skip_topk_offset",
    "index_topk_pattern",
    "indexer_types",
    "mlp_layer_types",
    "first_k_dense_replace",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "max_position_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "scoring_func",
    "norm_topk_prob",
    "generation_config",
    "partial_rotary_factor",
    "use_qk_norm",
}
_SHAPES = {  # config.json key -> ModelConfig field
    "num_hidden_layers": "num_layers", "hidden_size": "dim", "num_attention_heads": "n_heads",
    "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "intermediate_size": "inter_dim",
    "vocab_size": "vocab_size", "rms_norm_eps": "norm_eps",
}  # fmt: skip
_MOE = {  # config.json key -> MoEConfig field
    "n_routed_experts": "n_routed_experts", "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_inter_dim", "n_shared_experts": "n_shared_experts", "n_group": "n_group",
    "topk_group": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
}  # fmt: skip
# fields a user may still override on top of config.json (everything else would describe another model)
OVERRIDABLE = ("name", "hf_path", "max_seq_len", "index_topk", "index_fp8", "init_std")


@dataclass
class HFModel:
    """What config.json says: the family, the model, each layer's role (F runs its indexer, S shares) and how many
    multi-token-prediction layers follow the model's (their tensors are skipped)."""

    family: str
    model: ModelConfig
    roles: str
    mtp_layers: int
    fp8_block: Optional[List[int]]  # [128, 128] for block-quantized FP8 weights, else None


def read_config_json(folder) -> Dict[str, Any]:
    path = Path(folder) / CONFIG_JSON
    if not path.is_file():
        raise ConfigError(
            f"model.hf_path={folder}: {path} does not exist. Fix: point model.hf_path at a Hugging Face checkpoint "
            "folder (config.json, model.safetensors.index.json and its shards)."
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}). Fix: restore the checkpoint's config.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object. Fix: restore the checkpoint's config.json.")
    return data


def _refuse(path, key, value, why: str) -> ConfigError:
    return ConfigError(
        f"{path}: {key}={value!r} is not supported: {why}. Fix: use a DeepSeek-V3.2 or GLM-5.x checkpoint as "
        "published, or remove the field if it does not change the model."
    )


def _rope(path, raw: dict) -> tuple[float, Optional[YarnConfig]]:
    params = raw.get("rope_parameters") or dict(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        raise _refuse(path, "rope_type", kind, "dsaflow implements plain RoPE and YaRN")
    known = {f.name for f in dataclasses.fields(YarnConfig)} | {"rope_type", "type", "rope_theta"}
    extra = sorted(set(params) - known)
    if extra:
        raise _refuse(path, f"rope_parameters.{extra[0]}", params[extra[0]], "not a YaRN field dsaflow knows")
    yarn = YarnConfig(**{k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta")})
    if yarn.factor is None:  # DeepSeek's convention: the ratio of the context lengths
        yarn.factor = raw["max_position_embeddings"] / yarn.original_max_position_embeddings
    return float(theta), yarn


def indexer_roles(family: str, raw: dict, num_layers: int) -> str:
    """One F/S letter per layer, by transformers' rules (see the module docstring)."""
    if family == "deepseek_v32":
        return "F" * num_layers
    types = raw.get("indexer_types")
    if types is not None:
        bad = [t for t in types if t not in ("full", "shared")]
        if bad or len(types) != num_layers:
            raise ConfigError(
                f"indexer_types={types}: needs {num_layers} entries, each 'full' or 'shared'. Fix: correct config.json."
            )
        return "".join("F" if t == "full" else "S" for t in types)
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        roles = "".join(pattern) if not isinstance(pattern, str) else pattern
        if len(roles) != num_layers or set(roles) - {"F", "S"}:
            raise ConfigError(
                f"index_topk_pattern={pattern!r}: needs {num_layers} letters F or S. Fix: correct config.json."
            )
        return roles
    freq = max(int(raw.get("index_topk_freq", 1) or 1), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return "".join("F" if max(i - offset + 1, 0) % freq == 0 else "S" for i in range(num_layers))


def hf_model(raw: dict, path="config.json", name: str = "hf") -> HFModel:
    """A parsed config.json -> HFModel; ConfigError naming any field dsaflow cannot honour."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ConfigError(
            f"{path}: model_type={family!r} is not a family dsaflow reads. Fix: use a checkpoint of "
            f"{' or '.join(FAMILIES)} (DeepSeek-V3.2, GLM-5.x)."
        )
    unknown = sorted(set(raw) - _IGNORED - set(_SHAPES) - set(_MOE))
    if unknown:
        raise _refuse(path, unknown[0], raw[unknown[0]], "dsaflow does not know this field, so cannot honour it")
    for key, want in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("scoring_func", "sigmoid"),
    ):
        if key in raw and raw[key] != want:
            raise _refuse(path, key, raw[key], f"the model dsaflow computes has {key}={want!r}")
    if raw.get("q_lora_rank") is None:
        raise _refuse(path, "q_lora_rank", None, "the indexer reads MLA's compressed query, so q_lora_rank is needed")
    heads, kv_heads = raw.get("num_attention_heads"), raw.get("num_key_value_heads", raw.get("num_attention_heads"))
    if kv_heads != heads:
        raise _refuse(path, "num_key_value_heads", kv_heads, f"MLA expands one latent to all {heads} heads")
    missing = [k for k in _SHAPES if k not in raw and k != "rms_norm_eps"]
    if missing:
        raise ConfigError(f"{path} has no {missing[0]}. Fix: restore the checkpoint's config.json.")
    theta, yarn = _rope(path, raw)
    fields = {field: raw[key] for key, field in _SHAPES.items() if key in raw}
    model = ModelConfig(
        name=name,
        **fields,
        index_rope_head_dim=raw["qk_rope_head_dim"],
        max_seq_len=int(raw.get("max_position_embeddings", ModelConfig.max_seq_len)),
        rope_theta=theta,
        rope_scaling=yarn,
        latent_norm_eps=HF_LATENT_NORM_EPS,
        index_norm_eps=HF_INDEX_NORM_EPS,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        moe=_moe(raw),
    )
    quant = raw.get("quantization_config")
    fp8_block = None
    if quant is not None:
        if quant.get("quant_method") != "fp8" or list(quant.get("weight_block_size") or []) != [128, 128]:
            raise _refuse(path, "quantization_config", quant, "dsaflow reads FP8 e4m3 with 128x128 block scales")
        fp8_block = [128, 128]
    return HFModel(family, model, indexer_roles(family, raw, model.num_layers), _mtp(raw), fp8_block)


def _moe(raw: dict) -> Optional[MoEConfig]:
    if not raw.get("n_routed_experts"):
        return None
    n = raw["num_hidden_layers"]
    moe = MoEConfig(**{field: raw[key] for key, field in _MOE.items() if key in raw})
    moe.norm_topk_prob = bool(raw.get("norm_topk_prob", True))
    types = raw.get("mlp_layer_types")
    if types is not None:
        moe.dense_layers = [i for i, t in enumerate(types) if t == "dense"]
    else:
        moe.first_k_dense = min(int(raw.get("first_k_dense_replace", 0)), n)
    return moe


def _mtp(raw: dict) -> int:
    return int(raw.get("num_nextn_predict_layers", 0) or 0)


def apply_hf_model(cfg) -> None:
    """The compose hook: with `model.hf_path` set, config.json's model replaces the composed one (a ModelConfig
    field also set on the command line must agree, except those in OVERRIDABLE), and its layer roles become the
    index layout. Without hf_path it does nothing; `model=hf` without it is an error."""
    path = cfg.model.hf_path
    if path is None:
        if cfg.model.name == "hf":
            raise ConfigError("model=hf needs model.hf_path. Fix: add model.hf_path=DIR (a Hugging Face checkpoint).")
        return
    hf = hf_model(read_config_json(path), Path(path) / CONFIG_JSON, name=cfg.model.name)
    default = ModelConfig()
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(cfg.model, f.name), getattr(hf.model, f.name)
        if f.name in OVERRIDABLE:
            if mine != getattr(default, f.name):
                setattr(hf.model, f.name, mine)
        elif mine != getattr(default, f.name) and mine != theirs:
            raise ConfigError(
                f"model.{f.name}={mine} conflicts with {Path(path) / CONFIG_JSON}, which sets {theirs}. Fix: drop "
                f"the model.{f.name} override (with model.hf_path the checkpoint decides the architecture)."
            )
    hf.model.hf_path = str(path)
    cfg.model = hf.model
    if "S" not in hf.roles:
        return
    index = cfg.index
    if index.pattern is not None or index.freq is not None or cfg.layout is not None:
        raise ConfigError(
            f"model.hf_path={path}: config.json fixes the layer roles ({hf.roles.count('F')} F layers), but "
            "index.pattern / index.freq / layout also set them. Fix: drop the index= / layout= overrides (stage "
            "boundaries go in pipeline.boundaries)."
        )
    index.name, index.pattern = "hf", hf.roles
    if index.promote:
        index.promote = False
        print(
            f"dsaflow: model.hf_path: the checkpoint {path} has no indexer weights on its S layers (config.json's "
            "shared layers), so it is planned with index.promote=false: stages start on F, or the indices cross with "
            "pipeline.cross_stage_indices=true.",
            file=sys.stderr,
            flush=True,
        )
