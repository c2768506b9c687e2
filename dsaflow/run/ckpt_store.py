"""Checkpoint folders on disk: naming, manifests, verification, pruning, and a pickle-free read of DCP metadata.

    <run_dir>/checkpoints/step-000100/       complete: renamed into place after every file and the manifest
                          .metadata           DCP's index (a pickle: read only through `safe_load_metadata`)
                          __<r>_0.distcp      DCP shards (model, optimiser, RNG of every rank)
                          model-rank<r>.safetensors   weights only, global keys: what serving loads
                          manifest.json       {"step", "files": {name: {"size", "sha256"}}}, written last
    <run_dir>/checkpoints/.step-000100.partial/   a save in progress (or one a kill interrupted): never loaded

A checkpoint is good when its manifest lists every file with the right size and hash and its metadata passes the
allow-listing unpickler. `newest_good_checkpoint` skips bad ones with a message naming them, so resume falls back to
the newest good one. No torch.distributed here: the parent uses it before anything starts.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from dsaflow.errors import CheckpointError

CKPT, MANIFEST, METADATA = "checkpoints", "manifest.json", ".metadata"
PREFIX, PARTIAL, DELETING = "step-", ".partial", ".deleting"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CKPT / f"{PREFIX}{step:06d}"


def partial_dir(final: Path) -> Path:
    return final.parent / f".{final.name}{PARTIAL}"


def list_checkpoints(run_dir: str | Path) -> List[Tuple[int, Path]]:
    """Complete-looking checkpoint folders (step-NNNNNN), newest first; partial saves are not listed."""
    root = Path(run_dir) / CKPT
    out = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit():
                out.append((int(d.name[len(PREFIX):]), d))
    return sorted(out, reverse=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, step: int) -> None:
    files = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format": 1, "step": step, "files": files}, indent=1))
    os.replace(tmp, folder / MANIFEST)


def verify_checkpoint(folder: str | Path, hashes: bool = True) -> dict:
    """Raise CheckpointError (naming the folder and the reason) unless `folder` is a complete, intact checkpoint
    whose metadata is safe to read. Returns the manifest."""
    folder = Path(folder)
    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: its save did not finish (or it predates "
                              "manifests)")
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and METADATA in files
    except (ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable or lists no {METADATA}") from None
    for name, want in files.items():
        p = folder / name
        if os.sep in name or name in ("", ".", "..") or not p.is_file():
            raise CheckpointError(f"checkpoint {folder}: file {name} listed in its manifest is missing")
        if p.stat().st_size != want.get("size"):
            raise CheckpointError(f"checkpoint {folder}: {name} is {p.stat().st_size} bytes, the manifest says "
                                  f"{want.get('size')} (truncated or replaced)")
        if hashes and _sha256(p) != want.get("sha256"):
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its sha256 in the manifest (corrupted)")
    safe_load_metadata(folder / METADATA)
    return manifest


def newest_good_checkpoint(run_dir: str | Path, report: Optional[Callable[[str], None]] = None) -> Optional[Tuple[int, Path]]:
    """(step, folder) of the newest good checkpoint, or None; every bad one skipped is reported by name."""
    for step, folder in list_checkpoints(run_dir):
        try:
            verify_checkpoint(folder)
            return step, folder
        except CheckpointError as exc:
            if report is not None:
                report(f"skipping {exc}; trying an older checkpoint")
    return None


def report_stderr(msg: str) -> None:
    print(f"dsaflow: {msg}", file=sys.stderr, flush=True)


def prune(run_dir: str | Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints; remove older ones and leftover partial saves. A checkpoint is first
    renamed out of the way (atomic), so a kill during the removal never leaves a half-deleted `step-N`."""
    root = Path(run_dir) / CKPT
    for _, folder in list_checkpoints(run_dir)[keep:]:
        trash = folder.parent / f".{folder.name}{DELETING}"
        try:
            os.rename(folder, trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    if root.is_dir():
        for d in root.iterdir():
            if d.name.startswith(".") and d.name.endswith((PARTIAL, DELETING)):
                shutil.rmtree(d, ignore_errors=True)


# --- DCP metadata without arbitrary unpickling ----------------------------------------------------------------------

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
              "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _AllowListUnpickler(pickle.Unpickler):
    """Builds only the dataclasses DCP's metadata is made of, torch dtypes and torch.Size (the way
    `torch.load(weights_only=True)` restricts what it builds). BytesStorageMetadata is refused on purpose: DCP
    loads byte entries with `torch.load(weights_only=False)`, and dsaflow never saves any."""

    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype):
                return obj
        raise pickle.UnpicklingError(f"refusing to build {module}.{name}")


def safe_load_metadata(path: str | Path):
    """DCP's `.metadata` through the allow-listing unpickler; raises CheckpointError for anything else, and for
    storage entries that point outside the checkpoint folder."""
    path = Path(path)
    try:
        data = path.read_bytes()
        md = _AllowListUnpickler(io.BytesIO(data)).load()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path.parent} has no {METADATA}") from None
    except Exception as exc:  # noqa: BLE001 - any failure to build it means: not a metadata file we trust
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is not a DCP metadata file dsaflow can read safely ({exc}); it was "
            "not executed. Fix: use a checkpoint written by `dsaflow train`, never one from an untrusted source"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(md, Metadata) or not all(isinstance(v, TensorStorageMetadata) for v in md.state_dict_metadata.values()):
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} does not describe tensors only; refused")
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise CheckpointError(f"checkpoint {path.parent}: {path.name} points at {rel!r} outside the folder; refused")
    return md


def safe_reader(folder: str | Path):
    """A DCP FileSystemReader whose metadata goes through `safe_load_metadata` (tensor shards are read by DCP with
    `torch.load(weights_only=True)`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            md = safe_load_metadata(Path(folder) / METADATA)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = getattr(self, "load_id", None)
            return md

    return SafeFileSystemReader(str(folder))
