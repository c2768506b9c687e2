"""Checkpoint folders on disk: naming, manifests, verification, pruning, pinning, and a pickle-free read of DCP
metadata.

    <run_dir>/run_id                         a random id given to the run when its first checkpoint is saved
    <run_dir>/checkpoints/step-000100/       complete: renamed into place after every file and the manifest
                          .metadata           DCP's index (a pickle: read only through `safe_load_metadata`)
                          __<r>_0.distcp      DCP shards (model, optimiser, RNG of every rank)
                          model-rank<r>.safetensors   weights only, global keys: what serving loads
                          manifest.json       {"step", "run_id", "files": {name: {"size", "sha256"}}}, written last
    <run_dir>/checkpoints/.step-000100.partial/   a save in progress (or one a kill interrupted): never loaded

A checkpoint is good when its manifest lists every file as a regular file of the right size and hash (no links, no
FIFOs, nothing outside the folder) and its metadata passes the allow-listing unpickler. `newest_good_checkpoint`
skips bad ones, and ones of another run, with a message naming them, so resume falls back to the newest good one.
Pruning deletes only good checkpoints whose manifest carries this run's id, always keeping the newest good ones, and
never one that a reader has pinned (a shared `flock` on its manifest, held by serving while it loads weights).
No torch.distributed here: the parent uses it before anything starts.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import secrets
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from dsaflow.errors import CheckpointError
from dsaflow.files import MissingFile, UnsafeFile, atomic_write, open_regular, read_bytes, read_json, read_text
from dsaflow.rundir.folder import CKPT, MANIFEST, list_checkpoints

METADATA, RUN_ID = ".metadata", "run_id"
PARTIAL, DELETING = ".partial", ".deleting"
MAX_MANIFEST_BYTES = 16 << 20
MAX_METADATA_BYTES = 1 << 30
MAX_FILES = 100_000
_SHA = re.compile(r"^[0-9a-f]{64}$")


def partial_dir(final: Path) -> Path:
    return final.parent / f".{final.name}{PARTIAL}"


def read_run_id(run_dir: str | Path) -> Optional[str]:
    """The run's id, or None for a run dir that never saved a checkpoint."""
    try:
        text = read_text(Path(run_dir) / RUN_ID, inside=run_dir, max_bytes=256).strip()
    except UnsafeFile:
        return None
    return text if re.fullmatch(r"[0-9a-f]{16,64}", text) else None


def ensure_run_id(run_dir: str | Path) -> str:
    """The run's id, created (exclusively: two ranks or two saves agree on one) when missing."""
    found = read_run_id(run_dir)
    if found:
        return found
    path = Path(run_dir) / RUN_ID
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        found = read_run_id(run_dir)
        if found:
            return found
        raise CheckpointError(
            f"{path} exists but holds no run id (refused). Fix: remove it; it is recreated."
        ) from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16) + "\n")
    return read_run_id(run_dir)


def _sha256(path: Path, folder: Path) -> str:
    h = hashlib.sha256()
    fd = open_regular(path, inside=folder, max_bytes=None)
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, step: int, run_id: Optional[str] = None) -> None:
    folder = Path(folder)
    files = {}
    for e in sorted(os.scandir(folder), key=lambda e: e.name):
        if e.name != MANIFEST and not e.name.startswith(f".{MANIFEST}") and e.is_file(follow_symlinks=False):
            files[e.name] = {"size": e.stat(follow_symlinks=False).st_size, "sha256": _sha256(Path(e.path), folder)}
    atomic_write(folder / MANIFEST, json.dumps({"format": 1, "step": step, "run_id": run_id, "files": files}, indent=1))


def read_manifest(folder: Path) -> dict:
    """The manifest, checked for shape and bounds (names, sizes, hashes); raises CheckpointError."""
    try:
        manifest = read_json(folder / MANIFEST, inside=folder, max_bytes=MAX_MANIFEST_BYTES, max_depth=4)
    except UnsafeFile as exc:
        if not (folder / MANIFEST).exists() and not (folder / MANIFEST).is_symlink():
            raise CheckpointError(
                f"checkpoint {folder} has no {MANIFEST}: its save did not finish (or it predates manifests)"
            ) from None
        raise CheckpointError(f"checkpoint {folder}: {exc}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or METADATA not in files or len(files) > MAX_FILES:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is unreadable or lists no {METADATA}")
    for name, want in files.items():
        ok = (
            isinstance(want, dict)
            and "/" not in name
            and "\\" not in name
            and name not in ("", ".", "..")
            and len(name) <= 255
            and type(want.get("size")) is int
            and 0 <= want["size"] < 1 << 50
            and isinstance(want.get("sha256"), str)
            and _SHA.match(want["sha256"])
        )
        if not ok:
            raise CheckpointError(f"checkpoint {folder}: {MANIFEST} has a malformed entry for {name[:80]!r}")
    rid = manifest.get("run_id")
    if rid is not None and not (isinstance(rid, str) and len(rid) <= 64):
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} has a malformed run_id")
    return manifest


def verify_checkpoint(folder: str | Path, hashes: bool = True, metadata: bool = True) -> dict:
    """Raise CheckpointError (naming the folder and the reason) unless `folder` is a complete, intact checkpoint
    whose metadata is safe to read. Returns the manifest. hashes=False checks the files' sizes, not their sha256;
    metadata=False leaves DCP's metadata unread (both for reports, never before a load)."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} is not a folder (links are never followed)")
    manifest = read_manifest(folder)
    for name, want in manifest["files"].items():
        p = folder / name
        try:
            os.close(open_regular(p, inside=folder, max_bytes=None))
        except UnsafeFile as exc:
            what = "is missing" if not os.path.lexists(p) else f"is refused ({exc})"
            raise CheckpointError(f"checkpoint {folder}: file {name} listed in its manifest {what}") from None
        size = p.stat().st_size
        if size != want["size"]:
            raise CheckpointError(
                f"checkpoint {folder}: {name} is {size} bytes, the manifest says {want['size']} (truncated or replaced)"
            )
        if hashes and _sha256(p, folder) != want["sha256"]:
            raise CheckpointError(f"checkpoint {folder}: {name} does not match its sha256 in the manifest (corrupted)")
    if metadata:
        safe_load_metadata(folder / METADATA)
    return manifest


_HASHED: set = set()  # (folder, manifest mtime and size) whose every file matched its sha256 in this process


def _verify_once(folder: Path) -> dict:
    """verify_checkpoint, hashing each checkpoint's files once per process (later: sizes, manifest, metadata), so
    pruning at every save does not re-read every kept checkpoint."""
    try:
        st = os.lstat(folder / MANIFEST)
        key = (str(folder), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    manifest = verify_checkpoint(folder, hashes=key not in _HASHED)
    if key is not None:
        _HASHED.add(key)
    return manifest


def mark_hashed(folder: Path) -> None:
    """A checkpoint whose manifest was just computed from its files: no need to hash them again in this process."""
    st = os.lstat(Path(folder) / MANIFEST)
    _HASHED.add((str(folder), st.st_mtime_ns, st.st_size))


def good_checkpoints(
    run_dir: str | Path, report: Optional[Callable[[str], None]] = None, once: bool = False, quick: bool = False
):
    """(step, folder, manifest) of every good checkpoint of this run, newest first; bad ones and ones another run
    wrote are reported by name and skipped. once=True: hash each checkpoint once per process (pruning).
    quick=True: complete (renamed into place, manifest readable, every file at its size) is good enough; for a
    report right after the run wrote it, where hashing a large model's checkpoint again would take minutes."""
    rid = read_run_id(run_dir)
    for step, folder in list_checkpoints(run_dir):
        try:
            if quick:
                manifest = verify_checkpoint(folder, hashes=False, metadata=False)
            else:
                manifest = _verify_once(folder) if once else verify_checkpoint(folder)
        except CheckpointError as exc:
            if report is not None:
                report(f"skipping {exc}; trying an older checkpoint")
            continue
        if rid is not None and manifest.get("run_id") not in (None, rid):
            if report is not None:
                report(
                    f"skipping checkpoint {folder}: it belongs to another run (run id {manifest['run_id']}, this "
                    f"run is {rid}); trying an older checkpoint"
                )
            continue
        yield step, folder, manifest


def newest_good_checkpoint(
    run_dir: str | Path, report: Optional[Callable[[str], None]] = None, quick: bool = False
) -> Optional[Tuple[int, Path]]:
    """(step, folder) of the newest good checkpoint of this run, or None; every one skipped is reported by name.
    quick: see `good_checkpoints`."""
    for step, folder, _ in good_checkpoints(run_dir, report, quick=quick):
        return step, folder
    return None


def report_stderr(msg: str) -> None:
    print(f"dsaflow: {msg}", file=sys.stderr, flush=True)


class CheckpointGone(CheckpointError):
    """The checkpoint was removed (pruning by its run's rotation) before a reader could pin it."""


@contextmanager
def pinned(folder: Path):
    """Hold a shared lock on a checkpoint's manifest while reading it: pruning skips a pinned checkpoint. Raises
    CheckpointGone when the checkpoint is no longer there once locked (pruning renames it away while holding its
    own exclusive lock, so a lock taken after that is on a removed file)."""
    path = Path(folder) / MANIFEST
    try:
        fd = open_regular(path, inside=folder, max_bytes=MAX_MANIFEST_BYTES)
    except UnsafeFile as exc:
        if isinstance(exc, MissingFile) or not os.path.lexists(path):  # the folder itself is gone too
            raise CheckpointGone(f"checkpoint {folder} was removed (pruned) before it could be read") from None
        raise CheckpointError(f"checkpoint {folder}: {exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            still_there = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except OSError:
            still_there = False
        if not still_there:
            raise CheckpointGone(f"checkpoint {folder} was removed (pruned) while it was being opened")
        yield
    finally:
        os.close(fd)


def _try_exclusive(folder: Path) -> Optional[int]:
    """An fd holding an exclusive lock on the manifest, or None when a reader has pinned the checkpoint."""
    try:
        fd = open_regular(folder / MANIFEST, inside=folder, max_bytes=MAX_MANIFEST_BYTES)
    except UnsafeFile:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def remove_checkpoint(folder: Path) -> bool:
    """Rename out of the way (atomic: a kill never leaves a half-deleted step-N), then delete. False when pinned."""
    fd = _try_exclusive(folder)
    if fd is None:
        return False
    try:
        trash = folder.parent / f".{folder.name}{DELETING}-{secrets.token_hex(4)}"
        try:
            os.rename(folder, trash)
        except OSError:
            return False
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def prune(run_dir: str | Path, keep: int, report: Optional[Callable[[str], None]] = None) -> List[int]:
    """Keep the newest `keep` good checkpoints of this run; delete older good ones of this run (never a bad one,
    one of another run, or one a reader has pinned) and this run's leftover partial saves. Returns deleted steps."""
    rid = read_run_id(run_dir)
    if rid is None or keep < 1:
        return []
    ours = [(s, f) for s, f, m in good_checkpoints(run_dir, once=True) if m.get("run_id") == rid]
    deleted = [s for s, f in ours[keep:] if remove_checkpoint(f)]
    root = Path(run_dir) / CKPT
    for e in os.scandir(root):
        if (
            e.name.startswith(".")
            and (e.name.endswith(PARTIAL) or DELETING in e.name)
            and e.is_dir(follow_symlinks=False)
        ):
            shutil.rmtree(e.path, ignore_errors=True)
    return deleted


# --- DCP metadata without arbitrary unpickling ----------------------------------------------------------------------

_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
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
        data = read_bytes(path, inside=path.parent, max_bytes=MAX_METADATA_BYTES)
        md = _AllowListUnpickler(io.BytesIO(data)).load()
    except UnsafeFile as exc:
        raise CheckpointError(f"checkpoint {path.parent}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - any failure to build it means: not a metadata file we trust
        raise CheckpointError(
            f"checkpoint {path.parent}: {path.name} is not a DCP metadata file dsaflow can read safely ({exc}); it was "
            "not executed. Fix: use a checkpoint written by `dsaflow train`, never one from an untrusted source"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(md, Metadata) or not all(
        isinstance(v, TensorStorageMetadata) for v in md.state_dict_metadata.values()
    ):
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} does not describe tensors only; refused")
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise CheckpointError(
                f"checkpoint {path.parent}: {path.name} points at {rel!r} outside the folder; refused"
            )
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
