"""Weights out: a dsaflow model as a Hugging Face checkpoint that transformers 5.x loads with `from_pretrained`.

`write_hf_checkpoint(state_dict, model_cfg, out_dir)` writes config.json, the tensors in sharded safetensors with
`model.safetensors.index.json`, and the tokenizer files of `model.hf_path` when it has them. The family:
- a model whose every layer carries an indexer -> `deepseek_v32` (or the family model.hf_path came from);
- a model with layers that carry none (S layers trained with index sharing) -> `glm_moe_dsa`, those layers marked
  "shared" in `indexer_types` (transformers' GLM reuses the previous full layer's top-k there, as our S layers do).
Tensor names and RoPE row orders are hf_names.py's, run backwards; tensors keep the dtype they were stored in. The
MTP layers (model.mtp_layers) are written as `model.layers.<num_layers + k>.*` with num_nextn_predict_layers, each
with its `shared_head.head` (the model's head).
The tokenizer files are read under the checkpoint folder rule (hf_folder.py): one that leads outside model.hf_path
is refused, never copied. out_dir is claimed atomically (created, or taken empty, then CLAIM created exclusively
in it), so of two exports into one folder the second exits 2; everything is checked before out_dir is touched,
and a failure while writing removes what the export wrote.
A model transformers' classes cannot express is refused (ConfigError, exit 2) naming the field: a dense MLP model
(no family has one), an indexer rotary width other than MLA's.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional

import torch

from dsaflow.config.moe_schema import is_moe_layer
from dsaflow.config.rope_schema import YarnConfig
from dsaflow.errors import CheckpointError, ConfigError
from dsaflow.files import UnsafeFile, atomic_write, explain_os_error, read_bytes

from .hf_config import HF_INDEX_NORM_EPS, HF_LATENT_NORM_EPS, hf_model, read_config_json
from .hf_folder import checkpoint_file
from .hf_names import hf_source, mtp_head_copies
from .safetensors_io import save_file

SHARD_BYTES = 2 << 30
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json of the largest vocabularies is tens of MB
CLAIM = ".dsaflow-export-in-progress"  # created exclusively in out_dir while an export writes it
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
_INDEXER = re.compile(r"^layers\.(\d+)\.attn\.indexer\.")


def indexer_layers(state_dict: Dict[str, torch.Tensor]) -> set:
    return {int(m.group(1)) for m in map(_INDEXER.match, state_dict) if m}


def export_family(model_cfg, full: set, hf_files=None) -> str:
    if len(full) < model_cfg.num_layers:
        return "glm_moe_dsa"
    if hf_files:
        return hf_model(read_config_json(hf_files)).family
    return "deepseek_v32"


def hf_config_json(model_cfg, family: str, full: set) -> dict:
    """config.json of the exported model (see the module docstring for what is refused)."""
    m, moe = model_cfg, model_cfg.moe
    if moe is None:
        raise ConfigError(
            f"model.name={m.name} has dense MLPs only (model.moe is null): neither Hugging Face family "
            f"(deepseek_v32, glm_moe_dsa) has such a model, so there is nothing transformers could load. Fix: export "
            "a model trained with model.moe set (e.g. model=tiny_moe)."
        )
    if m.index_rope_head_dim != m.qk_rope_head_dim:
        raise ConfigError(
            f"model.index_rope_head_dim={m.index_rope_head_dim} differs from model.qk_rope_head_dim="
            f"{m.qk_rope_head_dim}: transformers rotates the indexer's first qk_rope_head_dim dims. Fix: export "
            "a model trained with equal rotary widths."
        )
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        y: YarnConfig = m.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": y.factor, "beta_fast": y.beta_fast}
        rope.update(beta_slow=y.beta_slow, original_max_position_embeddings=y.original_max_position_embeddings)
        rope.update({k: v for k, v in (("mscale", y.mscale), ("mscale_all_dim", y.mscale_all_dim)) if v is not None})
        if y.attention_factor is not None:
            rope["attention_factor"] = y.attention_factor
        rope["truncate"] = y.truncate
    out = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": m.vocab_size,
        "hidden_size": m.dim,
        "intermediate_size": m.inter_dim,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "index_n_heads": m.index_n_heads,
        "index_head_dim": m.index_head_dim,
        "index_topk": m.index_topk,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": m.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "n_routed_experts": moe.n_routed_experts,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "moe_intermediate_size": moe.moe_inter_dim,
        "n_shared_experts": moe.n_shared_experts,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "mlp_layer_types": ["sparse" if is_moe_layer(m, i) else "dense" for i in range(m.num_layers)],
        "num_nextn_predict_layers": m.mtp_layers,
        "bos_token_id": None,
        "eos_token_id": None,
        "dtype": "float32",
    }
    if family == "glm_moe_dsa":
        out["indexer_types"] = ["full" if i in full else "shared" for i in range(m.num_layers)]
    return out


def _norm_notes(model_cfg) -> List[str]:
    """Where transformers' fixed eps differs from the model's (its outputs then differ at that rounding)."""
    latent = model_cfg.norm_eps if model_cfg.latent_norm_eps is None else model_cfg.latent_norm_eps
    notes = []
    if latent != HF_LATENT_NORM_EPS:
        notes.append(f"q/kv latent RMSNorm eps {latent:g} (transformers: {HF_LATENT_NORM_EPS:g})")
    if model_cfg.index_norm_eps != HF_INDEX_NORM_EPS:
        notes.append(f"indexer key LayerNorm eps {model_cfg.index_norm_eps:g} (transformers: {HF_INDEX_NORM_EPS:g})")
    return notes


def write_hf_checkpoint(
    state_dict: Dict[str, torch.Tensor], model_cfg, out_dir, report=None, hf_files: Optional[Path] = None
) -> Path:
    """state_dict: the whole model's (dsaflow keys) -> out_dir (created, or an empty folder; claimed atomically, so
    a second export into it exits 2). Everything is checked and gathered before out_dir is touched; a failure while
    writing removes what this export wrote. hf_files: the folder holding model.hf_path's config.json and tokenizer
    files (a run's copy once the folder is gone, dsaflow.checkpoint.hf_run_copy); model.hf_path by default."""
    out = Path(out_dir)
    full = indexer_layers(state_dict)
    hf_files = hf_files or model_cfg.hf_path
    family = export_family(model_cfg, full, hf_files)
    config = hf_config_json(model_cfg, family, full)
    tensors: Dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if key == "head.weight" and model_cfg.tie_embeddings:
            continue
        src = hf_source(key, tuple(t.shape), model_cfg, family)
        if src is None:
            raise ConfigError(f"{key} has no Hugging Face counterpart in {family}. Fix: a bug; report it.")
        for name, part in zip(src.names, src.to_theirs(t.detach().cpu())):
            tensors[name] = part.contiguous()
    for name in mtp_head_copies(model_cfg):  # each MTP layer's `shared_head.head`: the model's head, as stored
        tensors[name] = tensors[
            "lm_head.weight" if not model_cfg.tie_embeddings else "model.embed_tokens.weight"
        ].clone()
    say = report or (lambda msg: print(msg, file=sys.stderr, flush=True))
    extras = tokenizer_files(hf_files, say)
    created = claim_out_dir(out)
    written: List[Path] = []
    try:
        weight_map = _write_shards(tensors, out, written)
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = weight_map
        extras = {"model.safetensors.index.json": json.dumps(index, indent=2).encode(), **extras}
        extras["config.json"] = json.dumps(config, indent=2).encode()
        for name, data in extras.items():
            written.append(out / name)
            atomic_write(out / name, data)
    except BaseException:
        _remove(out, written, created)
        raise
    os.unlink(out / CLAIM)
    notes = _norm_notes(model_cfg)
    if notes:
        say(f"dsaflow: export: transformers builds these norms with its own eps: {'; '.join(notes)}.")
    say(f"dsaflow: exported {len(tensors)} tensors as {family} to {out}")
    return out


def tokenizer_files(hf_path, say) -> Dict[str, bytes]:
    """{name: bytes} of the tokenizer files of `hf_path` (none without one), each read under the checkpoint folder
    rule (hf_folder.py): a file that leads outside the folder is refused, never copied."""
    if not hf_path:
        return {}
    if not os.path.isdir(hf_path):
        say(
            f"dsaflow: export: model.hf_path={hf_path} is not a folder on this machine, so the export has no "
            "tokenizer files. Fix: copy tokenizer.json (and tokenizer_config.json) from the original checkpoint."
        )
        return {}
    found = {}
    for name in TOKENIZER_FILES:
        path = checkpoint_file(hf_path, name, "tokenizer file", required=False)
        if path is not None:
            try:
                found[name] = read_bytes(path, max_bytes=MAX_TOKENIZER_BYTES)
            except UnsafeFile as exc:
                raise CheckpointError(f"model.hf_path={hf_path}: {exc}. Fix: restore {name}.") from None
    return found


def claim_out_dir(out: Path) -> bool:
    """Make `out` this export's, atomically: create it (or take it empty), create CLAIM in it exclusively, then
    check it holds nothing else. A second export racing for the same folder fails one of these steps and exits 2.
    Returns whether `out` was created here."""
    if out.is_symlink():
        raise ConfigError(f"export.out_dir={out} is a symbolic link. Fix: name a new folder.")
    try:
        created = _make_folder(out)
        fd = os.open(out / CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    except FileExistsError:
        raise ConfigError(
            f"export.out_dir={out} is being written by another export (it holds {CLAIM}). Fix: name a new folder "
            f"(or, if no export is running, remove {out / CLAIM})."
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"export.out_dir={out} {explain_os_error(exc)}. Fix: name a new folder you can write."
        ) from None
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    others = sorted(n for n in os.listdir(out) if n != CLAIM)
    if others:
        os.unlink(out / CLAIM)
        raise ConfigError(f"export.out_dir={out} is not empty (it holds {others[0]}). Fix: name a new folder.")
    return created


def _make_folder(out: Path) -> bool:
    """mkdir `out` (and its missing parents); True when created here, False when it is a folder already."""
    try:
        os.mkdir(out)
        return True
    except FileNotFoundError:
        os.makedirs(out.parent, exist_ok=True)
        return _make_folder(out)
    except FileExistsError:
        if not out.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder") from None
        return False


def _remove(out: Path, written: List[Path], created: bool) -> None:
    """Undo a failed export: the files it wrote, its claim, and `out` itself when it made it."""
    for path in [*written, out / CLAIM]:
        try:
            os.unlink(path)
        except OSError:
            pass
    if created:
        try:
            os.rmdir(out)
        except OSError:
            pass


def _write_shards(tensors: Dict[str, torch.Tensor], out: Path, written: List[Path]) -> Dict[str, str]:
    shards: List[List[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        written.append(out / file)
        save_file({n: tensors[n] for n in names}, out / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    return weight_map
