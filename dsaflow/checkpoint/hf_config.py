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
is a ConfigError naming it: silently ignoring it would compute another model. Every field is read through the
typed reader (config_json.py: JSON type and the schema's range, or a ConfigError naming file, key, value and what
is allowed), and num_hidden_layers is read and bounded (MAX_LAYERS) before any per-layer list is built.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsaflow.config.moe_schema import MoEConfig
from dsaflow.config.rope_schema import YarnConfig
from dsaflow.config.schema import ModelConfig
from dsaflow.errors import ConfigError
from dsaflow.files import UnsafeFile, read_json

from .config_json import REQUIRED, ConfigJson, schema_range, show
from .hf_folder import checkpoint_file

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
CONFIG_JSON = "config.json"
# eps of transformers' q_a_layernorm / kv_a_layernorm (RMSNorm default) and of the indexer's k_norm (LayerNorm)
HF_LATENT_NORM_EPS = 1e-6
HF_INDEX_NORM_EPS = 1e-6
MAX_INDEX_BYTES = 256 << 20  # an index of a 671B model is about 9 MB
MAX_CONFIG_BYTES = 1 << 20  # published config.json files are a few KiB
# The schema's bound on model.num_layers: far above every public model (DeepSeek-V3.2 has 61 layers, GLM-5 78), and
# read before any per-layer list is built, so `num_hidden_layers: 1000000000` is an error, not a hang.
MAX_LAYERS = schema_range(ModelConfig, "num_layers")[1]
LAYERS_WHY = (
    f" (dsaflow plans at most {MAX_LAYERS} layers, far above every public model: DeepSeek-V3.2 has 61, GLM-5 78)"
)

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
    # GLM-5.x: chained MTP draft steps reuse the first step's top-k. It changes which tokens are drafted, never what
    # the model computes or emits; dsaflow's draft chain runs the MTP layer's own indexer at every step
    "index_share_for_mtp_iteration",
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
OVERRIDABLE = ("hf_path", "max_seq_len", "index_topk", "index_fp8", "init_std")


@dataclass
class HFModel:
    """What config.json says: the family, the model, each layer's role (F runs its indexer, S shares) and how many
    multi-token-prediction layers follow the model's (`mtp_layers`, config.json's num_nextn_predict_layers). The
    model itself has none (model.mtp_layers=0): `apply_hf_model` turns them on when the checkpoint stores them."""

    family: str
    model: ModelConfig
    roles: str
    mtp_layers: int
    fp8_block: Optional[List[int]]  # [128, 128] for block-quantized FP8 weights, else None


def read_config_json(folder) -> Dict[str, Any]:
    """DIR/config.json as a dict: read under the checkpoint folder rule (hf_folder.py), bounded in size and nesting."""
    path = checkpoint_file(folder, CONFIG_JSON, "config.json", required=False)
    if path is None:
        raise ConfigError(
            f"model.hf_path={folder}: {Path(folder) / CONFIG_JSON} does not exist. Fix: point model.hf_path at a "
            "Hugging Face checkpoint folder (config.json, model.safetensors.index.json and its shards)."
        )
    try:
        data = read_json(path, max_bytes=MAX_CONFIG_BYTES)
    except UnsafeFile as exc:
        raise ConfigError(f"{exc}. Fix: restore the checkpoint's config.json.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object. Fix: restore the checkpoint's config.json.")
    return data


def _refuse(path, key, value, why: str) -> ConfigError:
    return ConfigError(
        f"{path}: {key}={show(value)} is not supported: {why}. Fix: use a DeepSeek-V3.2 or GLM-5.x checkpoint as "
        "published, or remove the field if it does not change the model."
    )


def _rope(cj: ConfigJson) -> tuple[float, Optional[YarnConfig]]:
    """(rope_theta, YaRN or None) from rope_parameters, else rope_scaling + rope_theta."""
    params = cj.section("rope_parameters") or cj.section("rope_scaling") or ConfigJson({}, cj.path, "rope_parameters.")
    theta_range = schema_range(ModelConfig, "rope_theta")
    theta = params.number("rope_theta", *theta_range[:2], None, *theta_range[2:])
    if theta is None:
        theta = cj.number("rope_theta", *theta_range[:2], 10000.0, *theta_range[2:])
    kind = params.value("rope_type", None) or params.value("type", "default")
    if not isinstance(kind, str):
        raise params.error("rope_type", kind, "'default' or 'yarn'")
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise _refuse(cj.path, "rope_type", kind, "dsaflow implements plain RoPE and YaRN")
    known = {f.name for f in dataclasses.fields(YarnConfig)} | {"rope_type", "type", "rope_theta"}
    extra = sorted(set(params.raw) - known)
    if extra:
        raise _refuse(cj.path, f"{params.prefix}{extra[0]}", params.raw[extra[0]], "not a YaRN field dsaflow knows")
    if "factor" not in params.raw:
        raise ConfigError(
            f"{cj.path}: {params.prefix}factor is missing: YaRN needs it (transformers refuses a YaRN config without "
            f"one). Fix: add {params.prefix}factor (the ratio of the extended to the original context, e.g. 40)."
        )
    positions = cj.schema_number("max_position_embeddings", ModelConfig, "max_seq_len", ModelConfig.max_seq_len)
    yarn = YarnConfig(
        original_max_position_embeddings=params.schema_number(
            "original_max_position_embeddings", YarnConfig, "original_max_position_embeddings", positions
        ),
        truncate=params.flag("truncate", True),
    )
    for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        setattr(yarn, name, params.schema_number(name, YarnConfig, name, getattr(yarn, name)))
    yarn.factor = params.schema_number("factor", YarnConfig, "factor", None)
    if yarn.factor is None:  # "factor": null is DeepSeek's convention for the ratio of the context lengths
        yarn.factor = positions / yarn.original_max_position_embeddings
    return theta, yarn


def indexer_roles(family: str, cj: ConfigJson, num_layers: int) -> str:
    """One F/S letter per layer, by transformers' rules (see the module docstring). `num_layers` is bounded."""
    if family == "deepseek_v32":
        return "F" * num_layers
    types = cj.words("indexer_types", ("full", "shared"), num_layers)
    if types is not None:
        return "".join("F" if t == "full" else "S" for t in types)
    pattern = cj.value("index_topk_pattern", None)
    if pattern is not None:
        letters = list(pattern) if isinstance(pattern, str) else pattern
        if not isinstance(letters, list) or len(letters) != num_layers or not all(x in ("F", "S") for x in letters):
            raise cj.error("index_topk_pattern", pattern, f"{num_layers} letters, each 'F' or 'S' (a string or list)")
        return "".join(letters)
    freq = cj.integer("index_topk_freq", 1, MAX_LAYERS, 1)
    offset = cj.integer("index_skip_topk_offset", 0, MAX_LAYERS, 2)
    return "".join("F" if max(i - offset + 1, 0) % freq == 0 else "S" for i in range(num_layers))


def hf_model(raw: dict, path="config.json", name: str = "hf") -> HFModel:
    """A parsed config.json -> HFModel; ConfigError naming any field of the wrong type, out of range, or one dsaflow
    cannot honour. The layer count is read and bounded first, before anything is built per layer."""
    cj = ConfigJson(raw, path)
    family = raw.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise ConfigError(
            f"{path}: model_type={show(family)} is not a family dsaflow reads. Fix: use a checkpoint of "
            f"{' or '.join(FAMILIES)} (DeepSeek-V3.2, GLM-5.x)."
        )
    unknown = sorted(set(raw) - _IGNORED - set(_SHAPES) - set(_MOE))
    if unknown:
        raise _refuse(path, unknown[0], raw[unknown[0]], "dsaflow does not know this field, so cannot honour it")
    layers = cj.integer("num_hidden_layers", 1, MAX_LAYERS, why=LAYERS_WHY)
    _check_fixed(cj)
    fields = {
        field: cj.schema_number(
            key, ModelConfig, field, getattr(ModelConfig, field) if key == "rms_norm_eps" else REQUIRED
        )
        for key, field in _SHAPES.items()
    }
    heads = fields["n_heads"]
    if cj.integer("num_key_value_heads", 1, None, heads) != heads:
        raise _refuse(
            path, "num_key_value_heads", raw["num_key_value_heads"], f"MLA expands one latent to all {heads} heads"
        )
    theta, yarn = _rope(cj)
    model = ModelConfig(
        name=name,
        **fields,
        index_rope_head_dim=fields["qk_rope_head_dim"],
        max_seq_len=cj.schema_number("max_position_embeddings", ModelConfig, "max_seq_len", ModelConfig.max_seq_len),
        rope_theta=theta,
        rope_scaling=yarn,
        latent_norm_eps=HF_LATENT_NORM_EPS,
        index_norm_eps=HF_INDEX_NORM_EPS,
        tie_embeddings=cj.flag("tie_word_embeddings", False),
        moe=_moe(cj, layers),
    )
    mtp = cj.integer("num_nextn_predict_layers", 0, MAX_LAYERS, 0)
    return HFModel(family, model, indexer_roles(family, cj, layers), mtp, _fp8_block(cj))


def _check_fixed(cj: ConfigJson) -> None:
    """Fields whose only value dsaflow computes (another would compute another model)."""
    for key, want in (("hidden_act", "silu"), ("scoring_func", "sigmoid")):
        if cj.has(key) and cj.raw[key] != want:
            raise _refuse(cj.path, key, cj.raw[key], f"the model dsaflow computes has {key}={want!r}")
    for key in ("attention_bias", "mlp_bias"):
        if cj.flag(key, False):
            raise _refuse(cj.path, key, True, f"the model dsaflow computes has {key}=false")
    if not cj.has("q_lora_rank"):
        raise _refuse(
            cj.path, "q_lora_rank", None, "the indexer reads MLA's compressed query, so q_lora_rank is needed"
        )


def _fp8_block(cj: ConfigJson) -> Optional[List[int]]:
    """[128, 128] for DeepSeek's block-quantized FP8 e4m3 (quantization_config), None without one."""
    quant = cj.section("quantization_config")
    if quant is None:
        return None
    why = "dsaflow reads FP8 e4m3 with 128x128 block scales and dynamic activation scaling"
    quant.text("quant_method", ("fp8",))
    quant.text("fmt", ("e4m3",), "e4m3")
    quant.text("activation_scheme", ("dynamic",), "dynamic")
    block = quant.value("weight_block_size")
    if block != [128, 128] or not all(type(b) is int for b in block):
        raise quant.error("weight_block_size", block, f"[128, 128] ({why})")
    return [128, 128]


def _moe(cj: ConfigJson, layers: int) -> Optional[MoEConfig]:
    if not cj.integer("n_routed_experts", 0, schema_range(MoEConfig, "n_routed_experts")[1], 0):
        return None
    moe = MoEConfig(
        **{field: cj.schema_number(key, MoEConfig, field, getattr(MoEConfig, field)) for key, field in _MOE.items()}
    )
    moe.norm_topk_prob = cj.flag("norm_topk_prob", True)
    types = cj.words("mlp_layer_types", ("dense", "sparse"), layers)
    if types is not None:
        moe.dense_layers = [i for i, t in enumerate(types) if t == "dense"]
    else:
        moe.first_k_dense = min(cj.integer("first_k_dense_replace", 0, None, 0), layers)
    return moe


def stored_mtp_layers(folder, hf: HFModel) -> int:
    """The MTP layers a model=hf run builds: config.json's num_nextn_predict_layers when the checkpoint stores
    their tensors (`model.layers.<num_hidden_layers>.*`) or holds no weights at all (a plan from config.json alone),
    else 0 with one line saying why (transformers' save_pretrained writes the count but drops the layers). Reads
    the index (or the single file's header) only: planning imports no torch."""
    names = None if hf.mtp_layers == 0 else _stored_names(Path(folder))
    first = f"model.layers.{hf.model.num_layers}."
    if names is None or any(n.startswith(first) for n in names):
        return hf.mtp_layers
    print(
        f"dsaflow: model.hf_path={folder}: config.json declares num_nextn_predict_layers={hf.mtp_layers}, but the "
        f"checkpoint holds no {first}* tensors: planned without multi-token prediction (model.mtp_layers=0).",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _stored_names(folder: Path) -> Optional[set]:
    """The tensor names of the checkpoint in `folder` (its index's weight_map, or the single file's header), or
    None when it holds no weights."""
    index = checkpoint_file(folder, "model.safetensors.index.json", "safetensors index", required=False)
    single = checkpoint_file(folder, "model.safetensors", "weights", required=False)
    try:
        if index is not None:
            weight_map = read_json(index, max_bytes=MAX_INDEX_BYTES).get("weight_map")
            return set(weight_map) if isinstance(weight_map, dict) else set()
        if single is not None:
            with open(single, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                return set(json.loads(f.read(min(size, MAX_INDEX_BYTES)))) - {"__metadata__"}
    except (UnsafeFile, ValueError, AttributeError, struct.error) as exc:
        raise ConfigError(
            f"model.hf_path={folder}: its weights index cannot be read ({exc}). Fix: download it again."
        ) from None
    return None


def apply_hf_model(cfg) -> None:
    """The compose hook: with `model.hf_path` set, config.json's model replaces the composed one (a ModelConfig
    field also set on the command line must agree, except those in OVERRIDABLE), and its layer roles become the
    index layout. Without hf_path it does nothing; `model=hf` without it is an error."""
    path = cfg.model.hf_path
    if path is None:
        if cfg.model.name == "hf":
            raise ConfigError("model=hf needs model.hf_path. Fix: add model.hf_path=DIR (a Hugging Face checkpoint).")
        return
    if cfg.model.name != "hf":
        raise ConfigError(
            f"model.hf_path={path} is set with model.name={cfg.model.name}: only model=hf takes its architecture "
            "and weights from a Hugging Face checkpoint, and the run (its folder name and config.yaml) would say "
            f"{cfg.model.name} while computing the checkpoint's model. Fix: add model=hf (name the run with "
            "track.run_name=...), or drop model.hf_path."
        )
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
    hf.model.mtp_layers = stored_mtp_layers(path, hf)
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
