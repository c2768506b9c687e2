"""Weights in from a Hugging Face checkpoint folder: each rank reads only its stages' tensors.

`load_hf_weights(stages, folder, model_cfg)` finds every tensor the stages need through
`model.safetensors.index.json` (or the one `model.safetensors`), checks them all before reading any, then reads
them memory-mapped (`safetensors.safe_open`) and copies them into the stages. The checks (`check_hf_weights`, run
by the parent before any worker starts; headers and FP8 scales only):
- every file, the index's shards included, obeys the checkpoint folder rule (hf_folder.py);
- every weight_map value is a file name; each shard's header is well formed (safetensors_io.read_header) and holds
  the tensors the index puts in it;
- each tensor has config.json's shape and a dtype the model reads: BF16, F16 or F32 (cast, the same number), or,
  in a checkpoint with an FP8 quantization_config, a 2-D F8_E4M3 weight whose `<name>_scale_inv` is a float
  [ceil(rows/128), ceil(cols/128)] of finite, positive values (an integer, e5m2 or unscaled e4m3 tensor would load
  as other numbers).
The loads:
- bf16 / fp32 tensors as they are (cast to the stage's dtype by the copy);
- FP8 e4m3 weights times their 128x128 block scales `<name>_scale_inv` ([ceil(rows/128), ceil(cols/128)] fp32),
  dequantized in fp32 and then cast to the stage's dtype;
- per-expert tensors stacked into the packed experts (dsaflow/checkpoint/hf_names.py, with the RoPE row orders);
- into a stage with FP8 weights (serve.weights=fp8, dsaflow.model.fp8_weights): an FP8 tensor's e4m3 bytes and
  its scales as stored, only moved (rows permuted, experts stacked; `stored_fp8`), a bf16 one quantized per
  128x128 block. The model's 128-row blocks must each come from one block of the file: true of every released
  checkpoint; a packed gate/up whose moe_intermediate_size is not a multiple of 128 is refused (named).
Multi-token-prediction layers (layer index >= num_layers, config.json's num_nextn_predict_layers of them) load into
the last stage's MTP layers (model.mtp_layers; hf_names.py); their `shared_head.head`, a copy of lm_head, must equal
lm_head. Layers config.json declares but the model does not build are skipped with one line; a tensor of a layer
beyond those config.json declares is refused.
Any problem is a CheckpointError naming the file and the tensor; the stages are untouched then.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from dsaflow.config.fp8_policy import FP8_BLOCK
from dsaflow.errors import CheckpointError
from dsaflow.files import UnsafeFile, read_json
from dsaflow.ops.fp8_gemm import dequantize_blocks_128, quantize_blocks_128

from .config_json import show
from .hf_config import hf_model, read_config_json
from .hf_folder import checkpoint_file
from .hf_names import Source, hf_source, layer_of, mtp_head_copies
from .safetensors_io import HF_DTYPES, read_header

INDEX_JSON = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FP8 = (torch.float8_e4m3fn,)
FLOAT_CODES = ("BF16", "F16", "F32")  # tensors the model reads by casting: any of these is the same number
MAX_INDEX_BYTES = 256 << 20  # an index of a 671B model is about 9 MB
SCALE = "_scale_inv"  # an FP8 weight's block scales: `<weight name>_scale_inv`, in the file and in our FP8 modules


@dataclass
class HFIndex:
    """Where each tensor of a checkpoint lives (name -> shard path as the folder names it) and, per shard, the
    path it resolves to under the folder rule (hf_folder.py; None for a shard that is missing)."""

    folder: Path
    where: Dict[str, Path]
    index_file: Path
    real: Dict[Path, Optional[Path]] = field(default_factory=dict)
    bytes_read: int = 0
    _open: Dict[Path, object] = field(default_factory=dict)
    _headers: Dict[Path, dict] = field(default_factory=dict)

    @classmethod
    def read(cls, folder) -> HFIndex:
        folder = Path(folder)
        index = checkpoint_file(folder, INDEX_JSON, "safetensors index", required=False)
        if index is not None:
            return cls._from_weight_map(folder, _weight_map(folder / INDEX_JSON, index))
        single = checkpoint_file(folder, SINGLE_FILE, "weights", required=False)
        if single is not None:
            found = cls(folder, {}, folder / SINGLE_FILE, {folder / SINGLE_FILE: single})
            found.where = {k: folder / SINGLE_FILE for k in found.header(folder / SINGLE_FILE)}
            return found
        raise CheckpointError(
            f"{folder} holds neither {INDEX_JSON} nor {SINGLE_FILE}. Fix: point at a Hugging Face checkpoint folder."
        )

    @classmethod
    def _from_weight_map(cls, folder: Path, weight_map: Dict[str, str]) -> HFIndex:
        """Every shard the index names is checked against the folder rule here, before anything is opened."""
        found = cls(folder, {}, folder / INDEX_JSON)
        for name, file in weight_map.items():
            given = folder / file
            if given not in found.real:
                found.real[given] = checkpoint_file(
                    folder, file, f"shard of tensor {name} in {INDEX_JSON}", required=False
                )
            found.where[name] = given
        return found

    def shard(self, name: str) -> Path:
        """The resolved path of the shard holding tensor `name` (CheckpointError when the shard is missing)."""
        given = self.where[name]
        if self.real.get(given) is None:
            raise CheckpointError(
                f"{self.index_file} puts tensor {name} in the shard {given.name}, which is missing from "
                f"{self.folder}. Fix: download the whole checkpoint again."
            )
        return self.real[given]

    def header(self, given: Path, name: str = "") -> dict:
        """{tensor: {"dtype", "shape", "data_offsets"}} of the shard `given` (read for tensor `name`), checked by
        read_header."""
        if given not in self._headers:
            try:
                self._headers[given] = read_header(self.real[given], HF_DTYPES)[0]
            except CheckpointError as exc:
                holds = f", which holds tensor {name}" if name else ""
                raise CheckpointError(
                    f"{exc} (the shard {given.name}{holds}); the file is truncated, corrupt or not safetensors. Fix: "
                    "download it again."
                ) from None
        return self._headers[given]

    def entry(self, name: str) -> dict:
        """Tensor `name`'s header entry; CheckpointError when its shard lacks it."""
        self.shard(name)
        entry = self.header(self.where[name], name).get(name)
        if entry is None:
            raise CheckpointError(
                f"{self.index_file} lists tensor {name} in {self.where[name]}, which holds no such tensor. Fix: "
                "download the whole checkpoint again (index and shards from the same revision)."
            )
        return entry

    def handle(self, name: str):
        """The open shard that holds tensor `name`."""
        path = self.shard(name)
        if path not in self._open:
            self._open[path] = _open(path, name)
        return self._open[path]

    def shape(self, name: str) -> tuple:
        return tuple(self.entry(name)["shape"])

    def is_fp8(self, name: str) -> bool:
        return self.entry(name)["dtype"] == "F8_E4M3"

    def stored(self, name: str, count: bool = True) -> torch.Tensor:
        """The tensor `name` as the file holds it (an FP8 one stays e4m3); `count`: add its bytes to bytes_read."""
        f = self.handle(name)
        try:
            t = f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for short or bad files
            raise CheckpointError(
                f"{self.where[name]}: tensor {name} cannot be read ({exc}); the file is truncated or corrupt. Fix: "
                "download that shard again."
            ) from None
        if count:
            self.bytes_read += t.numel() * t.element_size()
        return t

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name` in fp32 (FP8 dequantized), then in `dtype`."""
        t = self.stored(name)
        if t.dtype in _FP8:
            scale = self.tensor(name + SCALE, torch.float32)
            return dequantize_blocks_128(t, scale).to(dtype)
        return t.to(dtype)


def _weight_map(shown_path: Path, path: Path) -> Dict[str, str]:
    """The index's weight_map {tensor name: shard file name}, every key and value a string."""
    try:
        raw = read_json(path, max_bytes=MAX_INDEX_BYTES)
    except UnsafeFile as exc:
        raise CheckpointError(f"{shown_path}: {exc}. Fix: restore the checkpoint's {INDEX_JSON}.") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{shown_path} has no weight_map object (found {show(weight_map)}). Fix: restore the checkpoint's "
            f"{INDEX_JSON}."
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(
                f"{shown_path}: weight_map[{show(name)}]={show(file)} is not a shard file name (a string such as "
                '"model-00001-of-00002.safetensors"). Fix: restore the checkpoint\'s index.'
            )
    return weight_map


def _open(path: Path, name: str = ""):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # noqa: BLE001 - a truncated header or data section
        holds = f" (it holds tensor {name})" if name else ""
        raise CheckpointError(
            f"{path} is not a readable safetensors file{holds}: {exc}; it is truncated or corrupt. Fix: download "
            "it again."
        ) from None


def _check(index: HFIndex, key: str, src: Source, fp8_checkpoint: bool) -> None:
    """Each tensor of `src` is in its shard with config.json's shape and a dtype the model reads (FP8 ones with
    block scales of the right shape, dtype and finite positive values): headers and scales only."""
    for name, shape in zip(src.names, src.shapes):
        if name not in index.where:
            raise CheckpointError(
                f"{index.index_file}: tensor {name} (for {key}) is not in the checkpoint. Fix: use a checkpoint of "
                "the model config.json describes, downloaded whole."
            )
        have = index.shape(name)
        if have != tuple(shape):
            raise CheckpointError(
                f"{index.where[name]}: tensor {name} is {list(have)} but config.json implies {list(shape)}. Fix: "
                "use the config.json that came with these weights."
            )
        dtype = index.entry(name)["dtype"]
        fp8_ok = fp8_checkpoint and len(shape) == 2
        if dtype not in FLOAT_CODES and not (dtype == "F8_E4M3" and fp8_ok):
            expected = "BF16, F16 or F32" + (", or F8_E4M3 with 128x128 block scales" if fp8_ok else "")
            if dtype == "F8_E4M3" and not fp8_checkpoint:
                expected += " (F8_E4M3 needs config.json's quantization_config, which this checkpoint lacks)"
            raise CheckpointError(
                f"{index.where[name]}: tensor {name} is stored as {dtype}, but the model reads it as {expected}; "
                f"its bytes would load as other numbers. Fix: use the checkpoint as published (bf16, or DeepSeek's "
                "FP8 e4m3 release with its config.json)."
            )
        if dtype == "F8_E4M3":
            _check_scale(index, name, have)


def _check_scale(index: HFIndex, name: str, weight_shape: tuple) -> None:
    """The block scales of FP8 weight `name` [rows, cols]: [ceil(rows/128), ceil(cols/128)], floating, finite, > 0."""
    scale = name + SCALE
    if scale not in index.where:
        raise CheckpointError(
            f"{index.where[name]}: FP8 tensor {name} has no {scale} in {index.index_file}. Fix: download the whole "
            "checkpoint again (FP8 weights need their block scales)."
        )
    want = [math.ceil(n / FP8_BLOCK) for n in weight_shape]
    entry = index.entry(scale)
    if entry["dtype"] not in FLOAT_CODES or entry["shape"] != want:
        raise CheckpointError(
            f"{index.where[scale]}: {scale} is {entry['dtype']} {entry['shape']}, but the block scales of "
            f"{name} {list(weight_shape)} are F32 (or BF16 / F16) {want}: one per 128x128 block. Fix: use the "
            "checkpoint as published."
        )
    values = index.stored(scale, count=False).float()
    bad = ~(torch.isfinite(values) & (values > 0))
    if bad.any():
        at = [int(i) for i in bad.nonzero()[0]]
        raise CheckpointError(
            f"{index.where[scale]}: {scale} holds {values[tuple(at)].item()} at block {at}; block scales must be "
            "finite and positive (a NaN, inf, zero or negative scale makes its block's weights NaN, inf or 0). "
            "Fix: use the checkpoint as published."
        )


def _sources(stages: Dict[int, torch.nn.Module], folder, model_cfg):
    """(index, {key: Source}, {key: stage tensor}) after checking every tensor's presence, shape and scale."""
    hf = hf_model(read_config_json(folder), Path(folder) / "config.json")
    fp8_checkpoint = hf.fp8_block is not None
    index = HFIndex.read(folder)
    declared = hf.model.num_layers + hf.mtp_layers
    stray = sorted((n for n in index.where if (layer_of(n) or 0) >= declared), key=lambda n: (layer_of(n), n))
    if stray:
        raise CheckpointError(
            f"{index.where[stray[0]]}: tensor {stray[0]} belongs to layer {layer_of(stray[0])}, but config.json "
            f"declares {hf.model.num_layers} layers and num_nextn_predict_layers={hf.mtp_layers} multi-token-"
            f"prediction layer(s) after them. Fix: use the config.json that came with these weights."
        )
    wanted: Dict[str, torch.Tensor] = {k: v for m in stages.values() for k, v in m.state_dict().items()}
    sources: Dict[str, Source] = {}
    for key, t in wanted.items():
        if key.endswith(SCALE) and wanted.get(key[: -len(SCALE)], t).dtype in _FP8:
            continue  # an FP8 weight's scales: read with the weight (`fp8_pair`)
        src = hf_source(key, tuple(t.shape), model_cfg, hf.family)
        if src is None:
            raise CheckpointError(f"{key} has no Hugging Face counterpart in {hf.family}. Fix: a bug; report it.")
        _check(index, key, src, fp8_checkpoint)
        sources[key] = src
    return index, sources, wanted


def check_hf_weights(stages: Dict[int, torch.nn.Module], folder, model_cfg) -> None:
    """What `load_hf_weights` checks before reading (file headers only; the stages may live on the meta device)."""
    _sources(stages, folder, model_cfg)


def load_hf_weights(stages: Dict[int, torch.nn.Module], folder, model_cfg, report=None) -> int:
    """Load `stages` ({stage index: StageModule}) in place from the Hugging Face checkpoint `folder`; returns the
    bytes read from disk (this rank's). Raises CheckpointError (nothing loaded) on any bad input."""
    index, sources, wanted = _sources(stages, folder, model_cfg)
    built = model_cfg.num_layers + model_cfg.mtp_layers
    skipped = sorted({n for n in index.where if (layer_of(n) or 0) >= built})
    if skipped:
        layers = sorted({layer_of(n) for n in skipped})
        (report or _stderr)(
            f"dsaflow: {folder}: skipping {len(skipped)} tensors of the multi-token-prediction layer(s) {layers} "
            f"(the model builds {model_cfg.mtp_layers} of them: model.mtp_layers)."
        )
    loaded: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, src in sources.items():
            dtype = wanted[key].dtype
            if dtype in _FP8:
                loaded[key], loaded[key + SCALE] = fp8_pair(index, key, src)
                continue
            loaded[key] = src.to_ours([index.tensor(n, torch.float32) for n in src.names]).to(dtype)
        _check_mtp_heads(index, loaded, model_cfg)
        for key, t in loaded.items():  # every tensor read and checked: only now touch the stages
            wanted[key].copy_(t)
    return index.bytes_read


def _check_mtp_heads(index: HFIndex, loaded: Dict[str, torch.Tensor], model_cfg) -> None:
    """Our MTP layers read the model's head: each stored copy (`shared_head.head`) must equal lm_head bit for bit,
    or the checkpoint's MTP layer would predict with a head we do not have."""
    head = loaded.get("head.weight")
    if head is None:
        return
    for name in mtp_head_copies(model_cfg):
        if name not in index.where:
            continue
        copy = index.tensor(name, torch.float32).to(head.dtype)
        if not torch.equal(copy, head):
            raise CheckpointError(
                f"{index.where[name]}: {name} differs from lm_head.weight, but dsaflow's MTP layers predict with the "
                "model's own head (as DeepSeek-V3 trains them). Fix: use the checkpoint as published."
            )


def fp8_pair(index: HFIndex, key: str, src: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """Our FP8 tensor `key` and its scales from the file: e4m3 tensors as stored (`stored_fp8`), bf16 / fp32
    ones quantized per 128x128 block from their values. Raises CheckpointError for a mix of both."""
    fp8 = [index.is_fp8(n) for n in src.names]
    if all(fp8):
        return stored_fp8(index, key, src)
    if any(fp8):
        raise CheckpointError(
            f"{index.index_file}: {key} gathers {src.names[fp8.index(True)]} (FP8) and {src.names[fp8.index(False)]} "
            "(not FP8). Fix: a checkpoint whose tensors are all FP8 or all bf16."
        )
    return quantize_blocks_128(src.to_ours([index.tensor(n, torch.float32) for n in src.names]))


def stored_fp8(index: HFIndex, key: str, src: Source) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 tensors of `src` moved into our layout bit for bit (rows permuted, experts stacked, as raw bytes),
    and each of our 128-row blocks' scales taken from the file's block its rows come from. The layouts only move
    whole rows, so a block's scale carries over exactly when all its rows come from one block of the file."""
    w8 = src.to_ours([index.stored(n).view(torch.uint8) for n in src.names]).view(torch.float8_e4m3fn)
    # which file block (numbered over the sources in order) each of our rows comes from: the same layout change
    # applied to a column of row-block ids
    ids, offset = [], 0
    for shape in src.shapes:
        ids.append((torch.arange(shape[0]) // FP8_BLOCK + offset).unsqueeze(1))
        offset += math.ceil(shape[0] / FP8_BLOCK)
    rows = src.to_ours(ids).squeeze(-1)  # [..., N]
    N = rows.shape[-1]
    pad = -N % FP8_BLOCK  # a last partial block: its missing rows repeat its last one
    rows = torch.cat([rows, rows[..., -1:].expand(*rows.shape[:-1], pad)], dim=-1) if pad else rows
    blocks = rows.view(*rows.shape[:-1], -1, FP8_BLOCK)
    first = blocks[..., 0]  # [..., NB]
    if (blocks != first.unsqueeze(-1)).any():
        raise CheckpointError(
            f"{index.folder}: {key} packs rows of {src.names[0]} and its neighbours into one 128-row block from "
            f"different FP8 blocks of the file (shapes {src.shapes[0]}: rows not a multiple of 128), so the "
            "stored e4m3 values cannot keep their scales. Fix: serve.weights=bf16 for this checkpoint, or its "
            "bf16 copy with serve.weights=fp8 (quantized at load)."
        )
    scales = torch.cat([index.stored(n + "_scale_inv").float() for n in src.names])  # [sum of row blocks, KB]
    return w8, scales[first]


def hf_tensor_names(stages: Dict[int, torch.nn.Module], model_cfg, family: str) -> List[str]:
    """The Hugging Face tensor names the stages read (for tests and reports)."""
    return [
        n
        for m in stages.values()
        for k, t in m.state_dict().items()
        for n in hf_source(k, tuple(t.shape), model_cfg, family).names
    ]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
