"""Weights-only tensor files in the safetensors format, read and written without pickle (and without the
`safetensors` package, which the format does not need).

Layout: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {str: str}}` (padded with
spaces to a multiple of 8), then the raw little-endian tensor bytes. Loading only parses JSON and copies bytes, so a
crafted file can be wrong but can never run code; every offset is checked against the file size.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
CODES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20


class SafetensorsError(ValueError):
    """A file that is not a well-formed safetensors file (message names the file and what is wrong)."""


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Optional[Dict[str, str]] = None) -> None:
    """Write `tensors` (CPU or GPU; copied to host) to `path`, atomically (temporary name, then rename)."""
    header: Dict[str, object] = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in CODES:
            raise SafetensorsError(f"{name}: dtype {t.dtype} has no safetensors code")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_header(path: str | os.PathLike) -> Tuple[Dict[str, dict], int]:
    """-> ({name: {"dtype", "shape", "data_offsets"}}, byte offset where the data starts). Checks every entry."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise SafetensorsError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, e in header.items():
        try:
            dtype = DTYPES[e["dtype"]]
            shape = [int(s) for s in e["shape"]]
            begin, end = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: entry {name!r} is malformed") from None
        numel = 1
        for s in shape:
            if s < 0:
                raise SafetensorsError(f"{path}: entry {name!r} has a negative dimension")
            numel *= s
        if not (0 <= begin <= end <= data_len) or end - begin != numel * dtype.itemsize:
            raise SafetensorsError(f"{path}: entry {name!r} has offsets [{begin}, {end}] that do not match its "
                                   f"shape {shape} or the file size")
    return header, 8 + n


def load_tensors(path: str | os.PathLike, names=None) -> Dict[str, torch.Tensor]:
    """{name: CPU tensor} for `names` (default: all) from a safetensors file."""
    header, start = read_header(path)
    out = {}
    with open(path, "rb") as f:
        for name in (header if names is None else names):
            e = header[name]
            begin, end = e["data_offsets"]
            f.seek(start + begin)
            buf = bytearray(f.read(end - begin))
            dtype = DTYPES[e["dtype"]]
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            out[name] = t.view(dtype).reshape(e["shape"]) if buf else torch.empty(e["shape"], dtype=dtype)
    return out
