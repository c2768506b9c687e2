"""Load model weights (only) for serving from a training checkpoint written by `dsaflow train`.

Training checkpoints are torch.distributed.checkpoint folders whose model entries are `model.<global state-dict key>`
(dsaflow.train.checkpoint). The keys are global (`layers.5.attn.wkv_b.weight`), so a model trained with PP=N can be
served with any other stage split: each rank asks DCP for the keys of its own stages and nothing else (no optimiser,
no RNG).

`serve.checkpoint` may be a run dir (the latest complete checkpoint is used, and its config.yaml must describe the same
model) or one checkpoint folder (`<run_dir>/checkpoints/step-000300`).
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Dict

import torch

from .engine import ServeError
from dsaflow.run.rundir import CONFIG, latest_checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """A run dir -> its latest complete checkpoint folder; a checkpoint folder -> itself."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise ServeError(
            f"serve.checkpoint={path} is neither a checkpoint folder (no .metadata) nor a run dir holding a complete "
            f"checkpoint. Fix: point it at runs/<name> or runs/<name>/checkpoints/step-NNNNNN."
        )
    return found[1]


def check_same_model(model_cfg, checkpoint: Path) -> None:
    """If the checkpoint's run dir has a config.yaml, its model section must equal the serving model config."""
    run_dir = checkpoint.parent.parent
    if not (run_dir / CONFIG).is_file():
        return
    from dsaflow.config.compose import load_config

    trained = asdict(load_config(run_dir / CONFIG).model)
    serving = asdict(model_cfg)
    diff = [k for k in serving if k != "name" and trained.get(k) != serving[k]]
    if diff:
        pairs = ", ".join(f"model.{k}: trained {trained.get(k)!r} vs serving {serving[k]!r}" for k in diff[:4])
        raise ServeError(
            f"serve.checkpoint={checkpoint} was trained with a different model ({pairs}). Fix: serve with the "
            f"training run's model overrides (model={trained.get('name')} ...)."
        )


def load_model_weights(stages: Dict[int, torch.nn.Module], path: str | Path, model_cfg=None) -> Path:
    """Load the weights of `stages` ({stage index: StageModule}, on CPU) in place from a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    ckpt = resolve_checkpoint(path)
    if model_cfg is not None:
        check_same_model(model_cfg, ckpt)
    sd = {f"model.{k}": v for m in stages.values() for k, v in m.state_dict().items()}
    try:
        dcp.load(sd, checkpoint_id=str(ckpt))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps missing keys in several types
        raise ServeError(
            f"serve.checkpoint={path}: could not load this rank's weights from {ckpt} ({type(exc).__name__}: "
            f"{str(exc)[:300]}). Fix: serve with the same model and index layout the checkpoint was trained with "
            f"(S layers carry no indexer weights, so changing roles changes the keys)."
        ) from None
    return ckpt
