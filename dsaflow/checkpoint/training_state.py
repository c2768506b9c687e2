"""Checkpoints with torch.distributed.checkpoint (DCP): every rank saves its own stages, collectively.

State of a rank (flat keys, so DCP never mistakes two ranks' tensors for replicas of one another):
    model.<global param/buffer name>      StageModule keys are global (`layers.5.attn.wkv_b.weight`)
    optim.main.<name>.{exp_avg,exp_avg_sq,step}, optim.indexer.<name>.{...}
    rng.rank<r>.cpu / rng.rank<r>.cuda   RNG streams of this rank
    step                                  replicated: completed steps (the data position: batches are indexed by step)
The lr schedule is a pure function of the step, so the step restores it too.

A save writes into `.step-NNNNNN.partial/` (DCP shards, then every rank's weights-only `model-rank<r>.safetensors`),
then the first rank writes the manifest (sizes and sha256 of every file), renames the folder into place and prunes
to the newest `train.keep_checkpoints` good checkpoints of this run. A kill at any point leaves at most a partial
folder that nothing loads; a failed save (disk full) removes its partial folder and says so. A good checkpoint is
never rewritten; a bad folder of the same step is replaced once the new save verifies. Loading verifies the
manifest and reads DCP metadata through the allow-listing unpickler of `store` (no code from a checkpoint file
ever runs).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from dsaflow.checkpoint.safetensors_io import save_file
from dsaflow.checkpoint.store import (
    DELETING,
    ensure_run_id,
    mark_hashed,
    partial_dir,
    prune,
    read_run_id,
    safe_reader,
    verify_checkpoint,
    write_manifest,
)
from dsaflow.errors import CheckpointError
from dsaflow.files import explain_os_error

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def _optim_state(opt: torch.optim.Optimizer, params: Sequence[nn.Parameter], names, prefix: str, fill: bool):
    """{prefix.<name>.<key>: tensor}; with fill=True missing state is created as zeros (a load template)."""
    out: Dict[str, torch.Tensor] = {}
    for p in params:
        st = opt.state.get(p)
        if not st:
            if not fill:
                continue
            # fused AdamW (CUDA) keeps its step counter on the parameter's device, the default one on the host
            step_device = p.device if opt.defaults.get("fused") else "cpu"
            st = {
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
                "step": torch.zeros((), dtype=torch.float32, device=step_device),
            }
            opt.state[p] = st
        for k in ADAM_KEYS:
            out[f"{prefix}.{names[p]}.{k}"] = st[k]
    return out


def rank_state(modules: Sequence[nn.Module], opt, rank: int, step: int, for_load: bool) -> Dict[str, object]:
    """One rank's flat state dict (see the module docstring). opt: the rank's optimisers (dsaflow.train.optim's
    RankOptim: `main`, `indexer`, their params and `names`), or None for the weights only."""
    sd: Dict[str, object] = {"step": torch.tensor(step, dtype=torch.int64)}
    for m in modules:
        for k, v in m.state_dict().items():
            sd[f"model.{k}"] = v
    if opt is not None:  # None: weights only (serving exports, tests)
        sd.update(_optim_state(opt.main, opt.main_params, opt.names, "optim.main", for_load))
        sd.update(_optim_state(opt.indexer, opt.indexer_params, opt.names, "optim.indexer", for_load))
    sd[f"rng.rank{rank}.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        sd[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return sd


def _barrier(group) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _is_first(group) -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group=group) == 0


def _existing_is_good(path: Path) -> bool:
    """A folder of this step already exists: keep it if it is a good checkpoint of this run."""
    if not os.path.lexists(path):
        return False
    try:
        manifest = verify_checkpoint(path)
    except CheckpointError:
        return False
    return manifest.get("run_id") in (None, read_run_id(path.parent.parent))


def _save_failed(tmp: Path, step: int, exc: BaseException) -> CheckpointError:
    shutil.rmtree(tmp, ignore_errors=True)
    inner = exc
    for failure in getattr(exc, "failures", {}).values():  # DCP wraps each rank's error
        inner = failure[0] if isinstance(failure, tuple) else failure
        break
    why = explain_os_error(inner) if isinstance(inner, OSError) else f"{type(inner).__name__}: {str(inner)[:200]}"
    return CheckpointError(
        f"could not save the checkpoint of step {step} in {tmp.parent} ({why}); the partial save was removed, so "
        f"nothing half-written is left and the newest good checkpoint is unchanged. Fix: free disk space (or fix "
        f"the folder's permissions), then continue with train.resume=true"
    )


def save_checkpoint(
    path: Path, modules, opt, rank: int, step: int, group=None, keep: Optional[int] = None, state=None
) -> bool:
    """Collective: every rank of the pipeline calls it with its own stages. Returns False (and writes nothing)
    when a good checkpoint of this run already exists at `path`: a good checkpoint is never rewritten. A folder
    of this step that is not good (corrupted, another run's) is replaced, and only once the new save verifies.
    state: the rank's `rank_state` with plain (gathered) tensors, when the caller built it (data parallelism:
    gathered from the dp shards); None = built here from `modules` and `opt`."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    path = Path(path)
    if _existing_is_good(path):  # every rank decides before the first barrier, so all agree
        return False
    tmp = partial_dir(path)
    run_id = None
    if _is_first(group):
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            run_id = ensure_run_id(path.parent.parent)
        except OSError as exc:
            raise _save_failed(tmp, step, exc) from None
    _barrier(group)
    try:
        sd = state if state is not None else rank_state(modules, opt, rank, step, for_load=False)
        dcp.save(sd, checkpoint_id=str(tmp), process_group=group)
        weights = {k[len("model.") :]: v for k, v in sd.items() if k.startswith("model.")}
        save_file(weights, tmp / f"model-rank{rank}.safetensors", {"step": str(step), "format": "dsaflow-weights"})
    except (OSError, CheckpointException) as exc:
        raise _save_failed(tmp, step, exc) from None
    _barrier(group)
    if _is_first(group):
        try:
            write_manifest(tmp, step, run_id)  # hashes the files as they are on disk
            verify_checkpoint(tmp, hashes=False)  # every listed file a regular file of its size; metadata safe
            if os.path.lexists(path):  # a bad folder of this step: out of the way only now that the new one is good
                trash = path.parent / f".{path.name}{DELETING}"
                shutil.rmtree(trash, ignore_errors=True)
                os.rename(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, path)
            mark_hashed(path)
        except (OSError, CheckpointError) as exc:
            raise _save_failed(tmp, step, exc) from None
        if keep:
            prune(path.parent.parent, keep)
    _barrier(group)
    return True


def _first_failure(exc: BaseException) -> str:
    """The first underlying error of a DCP CheckpointException (one line), else the exception itself."""
    for inner, _ in getattr(exc, "failures", {}).values():
        if isinstance(inner, CheckpointError):
            return str(inner)
        return f"{type(inner).__name__}: {str(inner)[:300]}"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def load_checkpoint(path: Path, modules, opt, rank: int, group=None) -> int:
    """Collective. Loads model + optimiser + RNG in place; returns the completed step to continue from.
    `path` was verified (manifest, safe metadata) by the caller; the metadata is read safely again here."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    from torch.distributed.tensor import DTensor, distribute_tensor

    sd = rank_state(modules, opt, rank, 0, for_load=True)
    # stages sharded over dp (FSDP2): load whole tensors (checkpoints hold whole stages, whatever parallel.dp
    # wrote them), then keep this rank's shard; gathering the templates is collective over the dp group
    sharded = {k: v for k, v in sd.items() if isinstance(v, DTensor)}
    sd.update({k: v.full_tensor() for k, v in sharded.items()})
    try:
        dcp.load(sd, storage_reader=safe_reader(path), process_group=group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every failure of any rank
        raise CheckpointError(
            f"could not load {path}: {_first_failure(exc)}. Fix: resume with the run's own "
            "config.yaml, or start a new run_dir"
        ) from None
    # model.* entries are the modules' own tensors: loaded in place. Optimiser state tensors were installed in
    # opt.state by the template, also loaded in place. Sharded ones take their shard of the whole tensor read.
    # RNG needs an explicit set.
    with torch.no_grad():
        for k, dt in sharded.items():
            mine = distribute_tensor(sd[k], dt.device_mesh, dt.placements, src_data_rank=None)
            dt.to_local().copy_(mine.to_local())
    torch.set_rng_state(sd[f"rng.rank{rank}.cpu"])
    if f"rng.rank{rank}.cuda" in sd:
        torch.cuda.set_rng_state(sd[f"rng.rank{rank}.cuda"])
    return int(sd["step"])


__all__ = ["load_checkpoint", "rank_state", "save_checkpoint", "verify_checkpoint"]
