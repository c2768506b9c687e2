"""`dsaflow export export.checkpoint=RUN_DIR export.out_dir=OUT`: a trained run's model as a Hugging Face checkpoint.

The weights are the run's newest good checkpoint (or the checkpoint folder given), read from its weights-only
safetensors (dsaflow.checkpoint.weights: manifest checked, nothing unpickled) while the checkpoint is pinned, so a
training run's rotation cannot delete it mid-read (one it pruned first is replaced by the next newest); the model is
the run dir's config.yaml.
dsaflow.checkpoint.hf_export writes config.json, the sharded safetensors and the index (and the tokenizer of
model.hf_path, if the run started from a Hugging Face checkpoint, or of the run's copy once that folder is gone).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

from dsaflow.checkpoint.hf_export import write_hf_checkpoint
from dsaflow.checkpoint.hf_run_copy import hf_files_folder
from dsaflow.checkpoint.safetensors_io import load_tensors
from dsaflow.checkpoint.store import CheckpointGone, pinned
from dsaflow.checkpoint.weights import resolve_checkpoint, weight_files
from dsaflow.errors import CheckpointError, ConfigError
from dsaflow.outputs import check_output_dir
from dsaflow.rundir.folder import CONFIG

KEYS = ("export.checkpoint", "export.out_dir")
ROTATION_RETRIES = 3  # a run dir whose newest checkpoint is pruned while being opened: take the next newest


def parse_export_args(args: List[str]) -> dict:
    """['export.checkpoint=RUN', 'export.out_dir=OUT'] -> {"checkpoint": RUN, "out_dir": OUT}."""
    got = {}
    for a in args:
        key, eq, value = a.partition("=")
        if key not in KEYS or not eq or not value:
            raise ConfigError(
                f"{a!r} is not an export option. Fix: dsaflow export export.checkpoint=RUN_DIR export.out_dir=OUT."
            )
        got[key.split(".", 1)[1]] = value
    missing = [k for k in KEYS if k.split(".", 1)[1] not in got]
    if missing:
        raise ConfigError(f"{missing[0]} is not set. Fix: dsaflow export export.checkpoint=RUN_DIR export.out_dir=OUT.")
    return got


def export_hf(checkpoint: str, out_dir: str) -> Path:
    """Write the model of `checkpoint` (a run dir or one of its checkpoint folders) to `out_dir`."""
    check_output_dir("export.out_dir", out_dir)  # never into a run dir or a checkpoint (dsaflow.outputs)
    for attempt in range(ROTATION_RETRIES + 1):
        ckpt = resolve_checkpoint(checkpoint, field="export.checkpoint")
        try:
            model_cfg, tensors = _read_pinned(checkpoint, ckpt, out_dir)
            hf_files = hf_files_folder(model_cfg.hf_path, ckpt.parent.parent)  # the run's copy once it is gone
            break
        except CheckpointGone as exc:
            if Path(checkpoint) == ckpt or attempt == ROTATION_RETRIES:  # a folder named itself: nothing newer
                raise CheckpointError(
                    f"export.checkpoint={checkpoint}: {exc}. Fix: export a checkpoint the run keeps (train.keep), "
                    "or export the run dir once it has stopped."
                ) from None
    return write_hf_checkpoint(tensors, model_cfg, out_dir, hf_files=hf_files)


def _read_pinned(checkpoint: str, ckpt: Path, out_dir: str):
    """(model config, {dsaflow key: tensor}) of checkpoint folder `ckpt`, read while it is pinned, so the run's
    rotation cannot remove it mid-read (CheckpointGone when it already did)."""
    from dsaflow.config.compose import load_config

    with pinned(ckpt):
        config = ckpt.parent.parent / CONFIG
        if not os.path.lexists(config):
            raise ConfigError(
                f"export.checkpoint={checkpoint}: {config} is missing, so the model the weights belong to is "
                "unknown. Fix: export from inside the training run dir (RUN_DIR/checkpoints/step-N)."
            )
        model_cfg = load_config(config).model
        inputs = {"export.checkpoint": str(ckpt), "model.hf_path": model_cfg.hf_path}
        check_output_dir("export.out_dir", out_dir, inputs)
        tensors = {}
        for f in sorted(set(weight_files(ckpt, "export.checkpoint").values())):
            tensors.update(load_tensors(f))
    return model_cfg, tensors


def main(args: List[str]) -> int:
    opts = parse_export_args(args)
    print(export_hf(opts["checkpoint"], opts["out_dir"]))
    return 0
