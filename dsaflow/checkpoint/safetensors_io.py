"""Weights-only tensor files in the safetensors format, through the `safetensors` package, checked against our own
bounds first.

Layout: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the raw
tensor bytes. Loading never runs code; before the package sees a file, `read_header` checks it ourselves: a regular
file (no link, no FIFO) inside its folder, a header of bounded length and nesting, known dtypes, at most
`MAX_DIMS` non-negative dimensions, and offsets that tile the data exactly as the shapes say. A file that fails is
a `SafetensorsError` naming the file and what is wrong.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as _package_save_file

from dsaflow.errors import CheckpointError
from dsaflow.files import UnsafeFile, atomic_write_with, open_regular, parse_json

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Hugging Face checkpoints add FP8: e4m3 weights with block scales; e5m2 is named here only so that a checkpoint
# holding it is refused by what it is (hf_weights.py checks each tensor's dtype against the model)
HF_DTYPES = {**DTYPES, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 << 20
MAX_DIMS = 8
MAX_ENTRIES = 1_000_000


class SafetensorsError(CheckpointError):
    """A file that is not a well-formed safetensors file (message names the file and what is wrong)."""


def save_file(
    tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Optional[Dict[str, str]] = None
) -> None:
    """Write `tensors` (CPU or GPU; copied to host) to `path` atomically (exclusive temporary file, rename)."""
    host: Dict[str, torch.Tensor] = {}
    seen = set()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in DTYPES.values():
            raise SafetensorsError(f"{name}: dtype {t.dtype} has no safetensors code")
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if key in seen:  # tied weights share storage; the format stores each name's own bytes
            t = t.clone()
        seen.add(key)
        host[name] = t
    atomic_write_with(path, lambda tmp: _package_save_file(host, str(tmp), metadata=dict(metadata or {})))


def read_header(path: str | os.PathLike, dtypes: Mapping[str, torch.dtype] = DTYPES) -> Tuple[Dict[str, dict], int]:
    """-> ({name: {"dtype", "shape", "data_offsets"}}, byte offset where the data starts). Checks every entry;
    `dtypes`: the dtype codes accepted (HF_DTYPES for a Hugging Face checkpoint)."""
    path = Path(path)
    try:
        fd = open_regular(path, inside=path.parent, max_bytes=None)
    except UnsafeFile as exc:
        raise SafetensorsError(str(exc)) from None
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        text = f.read(n)
    try:
        header = parse_json(text, f"{path}: header", max_depth=3)
    except UnsafeFile as exc:
        raise SafetensorsError(str(exc)) from None
    if not isinstance(header, dict) or len(header) > MAX_ENTRIES:
        raise SafetensorsError(f"{path}: header is not a JSON object of at most {MAX_ENTRIES} entries")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    data_len = size - 8 - n
    spans = []
    for name, e in header.items():
        ok = (
            isinstance(e, dict)
            and e.get("dtype") in dtypes
            and isinstance(e.get("shape"), list)
            and len(e["shape"]) <= MAX_DIMS
            and all(type(s) is int and 0 <= s < 1 << 48 for s in e["shape"])
            and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2
            and all(type(x) is int for x in e["data_offsets"])
        )
        if not ok:
            raise SafetensorsError(
                f"{path}: entry {name[:80]!r} is malformed (dtype one of {sorted(dtypes)}, at most "
                f"{MAX_DIMS} non-negative dimensions, two integer offsets)"
            )
        numel = 1
        for s in e["shape"]:
            numel *= s
        begin, end = e["data_offsets"]
        if not (0 <= begin <= end <= data_len) or end - begin != numel * dtypes[e["dtype"]].itemsize:
            raise SafetensorsError(
                f"{path}: entry {name[:80]!r} has offsets [{begin}, {end}] that do not match its "
                f"shape {e['shape']} or the file size"
            )
        spans.append((begin, end))
    pos = 0
    for begin, end in sorted(spans):  # the format's own rule: the tensors tile the data, no gaps, no overlaps
        if begin != pos:
            raise SafetensorsError(f"{path}: tensor data overlaps or leaves a gap at byte {pos}")
        pos = end
    if pos != data_len:
        raise SafetensorsError(f"{path}: {data_len - pos} bytes after the last tensor")
    return header, 8 + n


def load_tensors(path: str | os.PathLike, names=None) -> Dict[str, torch.Tensor]:
    """{name: CPU tensor} for `names` (default: all) from a safetensors file checked by `read_header`."""
    header, _ = read_header(path)
    wanted = list(header if names is None else names)
    unknown = [k for k in wanted if k not in header]
    if unknown:
        raise SafetensorsError(f"{path}: has no tensor {unknown[0]!r}")
    out = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in wanted:
                out[name] = f.get_tensor(name).clone()  # own the bytes: no mapping of the file outlives this call
    except (SafetensorError, OSError) as exc:
        raise SafetensorsError(f"{path}: {exc}") from None
    return out
