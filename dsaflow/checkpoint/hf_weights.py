"""Weights in from a Hugging Face checkpoint folder: each rank reads only its stages' tensors.

`load_hf_weights(stages, folder, model_cfg)` finds every tensor the stages need through
`model.safetensors.index.json` (or the one `model.safetensors`), checks them all before reading any (the shard
exists and opens, the name is there, the shape is config.json's, an FP8 weight has its scale), then reads them
memory-mapped (`safetensors.safe_open`) and copies them into the stages:
- bf16 / fp32 tensors as they are (cast to the stage's dtype by the copy);
- FP8 e4m3 weights times their 128x128 block scales `<name>_scale_inv` ([ceil(rows/128), ceil(cols/128)] fp32),
  dequantized in fp32 and then cast to the stage's dtype;
- per-expert tensors stacked into the packed experts (dsaflow/checkpoint/hf_names.py, with the RoPE row orders).
Tensors of the multi-token-prediction layers (layer index >= num_layers) are skipped, with one line saying so.
Any problem is a CheckpointError naming the file and the tensor; the stages are untouched then.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import torch

from dsaflow.config.fp8_policy import FP8_BLOCK
from dsaflow.errors import CheckpointError

from .hf_config import hf_model, read_config_json
from .hf_names import Source, hf_source, layer_of

INDEX_JSON = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FP8 = (torch.float8_e4m3fn,)


@dataclass
class HFIndex:
    """Where each tensor of a checkpoint lives: name -> shard path."""

    folder: Path
    where: Dict[str, Path]
    index_file: Path
    bytes_read: int = 0
    _open: Dict[Path, object] = field(default_factory=dict)

    @classmethod
    def read(cls, folder) -> HFIndex:
        folder = Path(folder)
        index = folder / INDEX_JSON
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a safetensors index ({exc}). Fix: restore the file.") from None
            return cls(folder, {k: folder / v for k, v in weight_map.items()}, index)
        single = folder / SINGLE_FILE
        if single.is_file():
            return cls(folder, {k: single for k in _open(single).keys()}, single)
        raise CheckpointError(
            f"{folder} holds neither {INDEX_JSON} nor {SINGLE_FILE}. Fix: point at a Hugging Face checkpoint folder."
        )

    def handle(self, name: str):
        """The open shard that holds tensor `name`."""
        path = self.where[name]
        if path not in self._open:
            if not path.is_file():
                raise CheckpointError(
                    f"{self.index_file} puts tensor {name} in the shard {path.name}, which is missing from "
                    f"{self.folder}. Fix: download the whole checkpoint again."
                )
            self._open[path] = _open(path, name)
        return self._open[path]

    def shape(self, name: str) -> tuple:
        return tuple(self.handle(name).get_slice(name).get_shape())

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name` in fp32 (FP8 dequantized), then in `dtype`."""
        f = self.handle(name)
        try:
            t = f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for short or bad files
            raise CheckpointError(
                f"{self.where[name]}: tensor {name} cannot be read ({exc}); the file is truncated or corrupt. Fix: "
                "download that shard again."
            ) from None
        self.bytes_read += t.numel() * t.element_size()
        if t.dtype in _FP8:
            scale = self.tensor(name + "_scale_inv", torch.float32)
            return dequantize_fp8(t, scale).to(dtype)
        return t.to(dtype)


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


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """w e4m3 [rows, cols], scale_inv fp32 [ceil(rows/128), ceil(cols/128)] -> fp32 [rows, cols]."""
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return w.float() * s


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (e4m3 [rows, cols], fp32 scale_inv [ceil(rows/128), ceil(cols/128)]): one scale per
    128x128 block, amax / 448, as DeepSeek's FP8 checkpoints store it (tests write such copies)."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view(br * FP8_BLOCK, bc * FP8_BLOCK)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def _check(index: HFIndex, key: str, src: Source) -> None:
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
        f = index.handle(name)
        if f.get_slice(name).get_dtype() == "F8_E4M3" and name + "_scale_inv" not in index.where:
            raise CheckpointError(
                f"{index.where[name]}: FP8 tensor {name} has no {name}_scale_inv in {index.index_file}. Fix: "
                "download the whole checkpoint again (FP8 weights need their block scales)."
            )


def _sources(stages: Dict[int, torch.nn.Module], folder, model_cfg):
    """(index, {key: Source}, {key: stage tensor}) after checking every tensor's presence, shape and scale."""
    hf = hf_model(read_config_json(folder), Path(folder) / "config.json")
    index = HFIndex.read(folder)
    wanted: Dict[str, torch.Tensor] = {k: v for m in stages.values() for k, v in m.state_dict().items()}
    sources: Dict[str, Source] = {}
    for key, t in wanted.items():
        src = hf_source(key, tuple(t.shape), model_cfg, hf.family)
        if src is None:
            raise CheckpointError(f"{key} has no Hugging Face counterpart in {hf.family}. Fix: a bug; report it.")
        _check(index, key, src)
        sources[key] = src
    return index, sources, wanted


def check_hf_weights(stages: Dict[int, torch.nn.Module], folder, model_cfg) -> None:
    """What `load_hf_weights` checks before reading (file headers only; the stages may live on the meta device)."""
    _sources(stages, folder, model_cfg)


def load_hf_weights(stages: Dict[int, torch.nn.Module], folder, model_cfg, report=None) -> int:
    """Load `stages` ({stage index: StageModule}) in place from the Hugging Face checkpoint `folder`; returns the
    bytes read from disk (this rank's). Raises CheckpointError (nothing loaded) on any bad input."""
    index, sources, wanted = _sources(stages, folder, model_cfg)
    mtp = sorted({n for n in index.where if (layer_of(n) or 0) >= model_cfg.num_layers})
    if mtp:
        layers = sorted({layer_of(n) for n in mtp})
        (report or _stderr)(
            f"dsaflow: {folder}: skipping {len(mtp)} tensors of the multi-token-prediction layer(s) {layers} "
            "(dsaflow decodes one token per step)."
        )
    loaded: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, src in sources.items():
            dtype = wanted[key].dtype
            loaded[key] = src.to_ours([index.tensor(n, torch.float32) for n in src.names]).to(dtype)
        for key, t in loaded.items():  # every tensor read and checked: only now touch the stages
            wanted[key].copy_(t)
    return index.bytes_read


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
