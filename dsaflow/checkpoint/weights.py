"""Load model weights (only) from a checkpoint written by `dsaflow train`, without unpickling anything: for serving
(`serve.checkpoint`), search (`search.checkpoint`) and a training run that starts from another's weights
(`train.init_from`).

Every checkpoint folder holds, next to its DCP shards, one weights-only `model-rank<r>.safetensors` per training rank
with global state-dict keys (`layers.5.attn.wkv_b.weight`; dsaflow.checkpoint.training_state). Serving reads those files
only: a model trained with PP=N can be served with any other stage split (each rank takes the keys of its own
stages), and a crafted checkpoint can be wrong but can never run code. The folder's manifest (sizes, sha256) is
checked first; a run dir falls back past bad checkpoints to the newest good one, naming each it skips. Only the
weight files the manifest lists are read, as regular files inside the checkpoint folder (a stray or planted
`model-rank*.safetensors`, a link or a FIFO is never opened), and the checkpoint is pinned while it is read, so a
training run pruning its checkpoints meanwhile skips it.

`serve.checkpoint` may be a run dir (its newest good checkpoint is used, and its config.yaml must describe the same
model) or one checkpoint folder (`<run_dir>/checkpoints/step-000300`). `export_weights` writes one merged
safetensors file for sharing.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Dict

import torch

from dsaflow.checkpoint.safetensors_io import SafetensorsError, load_tensors, read_header, save_file
from dsaflow.checkpoint.store import newest_good_checkpoint, pinned, report_stderr, verify_checkpoint
from dsaflow.errors import CheckpointError, PlanError, ServeError
from dsaflow.outputs import check_output_file
from dsaflow.rundir.folder import CONFIG, MANIFEST

WEIGHTS = re.compile(r"^model-rank\d{1,6}\.safetensors$")
WEIGHTLESS_MODEL_FIELDS = ("index_topk", "index_fp8")  # no weight depends on them: train.init_from may change them


def resolve_checkpoint(path: str | Path, report=report_stderr, field: str = "serve.checkpoint") -> Path:
    """A run dir -> its newest good checkpoint folder; a checkpoint folder -> itself once verified. `field`: the
    config field that named the path, for the messages."""
    p = Path(path)
    if os.path.lexists(p / MANIFEST) or os.path.lexists(p / ".metadata"):
        try:
            verify_checkpoint(p)
        except CheckpointError as exc:
            raise ServeError(
                f"{field}={path}: {exc}. Fix: use another checkpoint folder, or the run dir "
                "(its newest good checkpoint is picked)."
            ) from None
        return p
    found = newest_good_checkpoint(p, report)
    if found is None:
        raise ServeError(
            f"{field}={path} is neither a checkpoint folder nor a run dir holding a good checkpoint. Fix: "
            f"point it at runs/<name> or runs/<name>/checkpoints/step-NNNNNN."
        )
    return found[1]


def check_same_model(model_cfg, checkpoint: Path, field: str = "serve.checkpoint", free=()) -> None:
    """If the checkpoint's run dir has a config.yaml, its model section must equal `model_cfg` but for the fields
    in `free` (those no weight depends on, such as model.index_topk)."""
    run_dir = checkpoint.parent.parent
    if not os.path.lexists(run_dir / CONFIG):
        return
    from dsaflow.config.compose import load_config

    trained = {
        k: str(v) if isinstance(v, str) else v
        for k, v in dataclasses.asdict(load_config(run_dir / CONFIG).model).items()
    }
    serving = dataclasses.asdict(model_cfg)
    diff = [k for k in serving if k != "name" and k not in free and trained.get(k) != serving[k]]
    if diff:
        pairs = ", ".join(f"model.{k}: trained {trained.get(k)!r} vs now {serving[k]!r}" for k in diff[:4])
        raise ServeError(
            f"{field}={checkpoint} was trained with a different model ({pairs}). Fix: use the training run's model "
            f"overrides (model={trained.get('name')} ...)."
        )


def weight_files(ckpt: Path, field: str = "serve.checkpoint") -> Dict[str, Path]:
    """{global key: safetensors file holding it} over the model-rank*.safetensors files the manifest lists."""
    try:
        listed = sorted(n for n in verify_checkpoint(ckpt, hashes=False)["files"] if WEIGHTS.match(n))
    except CheckpointError as exc:
        raise ServeError(f"{field}={ckpt}: {exc}. Fix: use another checkpoint.") from None
    if not listed:
        raise ServeError(
            f"{field}={ckpt} lists no model-rank*.safetensors weights in its manifest. Fix: use "
            "a checkpoint written by this version of `dsaflow train`."
        )
    where: Dict[str, Path] = {}
    for name in listed:
        f = ckpt / name
        try:
            header, _ = read_header(f)
        except (SafetensorsError, OSError) as exc:
            raise ServeError(f"{field}={ckpt}: {exc}. Fix: use another checkpoint.") from None
        for k in header:
            if k in where:
                raise ServeError(
                    f"{field}={ckpt}: {k} is in both {where[k].name} and {name}; refused. "
                    "Fix: use a checkpoint written by `dsaflow train`."
                )
            where[k] = f
    return where


def load_model_weights(
    stages: Dict[int, torch.nn.Module], path: str | Path, model_cfg=None, field: str = "serve.checkpoint", free=()
) -> Path:
    """Load the weights of `stages` ({stage index: StageModule}, any device) in place from a checkpoint's
    safetensors. Weights the checkpoint holds and the stages lack (the indexer of a layer that is S here) are not
    read; a weight the stages need and the checkpoint lacks is an error. field / free: see `check_same_model`."""
    ckpt = resolve_checkpoint(path, field=field)
    if model_cfg is not None:
        check_same_model(model_cfg, ckpt, field, free)
    try:
        with pinned(ckpt):
            verify_checkpoint(ckpt)  # again, under the pin: what was verified is what is read
            _load_into(stages, f"{field}={path}", ckpt, field)
    except CheckpointError as exc:
        if isinstance(exc, ServeError):
            raise
        raise ServeError(f"{field}={path}: {exc}. Fix: use another checkpoint.") from None
    return ckpt


def _load_into(stages, named: str, ckpt: Path, field: str) -> None:
    where = weight_files(ckpt, field)
    wanted = {k: v for m in stages.values() for k, v in m.state_dict().items()}
    missing = [k for k in wanted if k not in where]
    if missing:
        raise ServeError(
            f"{named}: {ckpt} has no weights for {missing[:3]} ({len(missing)} missing). Fix: use the model and an "
            f"index layout whose F layers were F in training (S layers carry no indexer weights, so a layer the "
            f"checkpoint trained as S cannot become F)."
        )
    by_file: Dict[Path, list] = {}
    for k in wanted:
        by_file.setdefault(where[k], []).append(k)
    with torch.no_grad():
        for f, keys in by_file.items():
            for k, t in load_tensors(f, keys).items():
                if t.shape != wanted[k].shape:
                    raise ServeError(
                        f"{named}: {k} is {list(t.shape)} in {f.name} but the model has "
                        f"{list(wanted[k].shape)}. Fix: use the training run's model."
                    )
                wanted[k].copy_(t)


def export_weights(path: str | Path, out: str | Path) -> Path:
    """One safetensors file with every model weight of a checkpoint (or a run dir's newest good one)."""
    check_output_file("OUT", str(out))  # never into a run dir or a checkpoint (dsaflow.outputs)
    ckpt = resolve_checkpoint(path)
    check_output_file("OUT", str(out), {"the checkpoint": str(ckpt)})
    tensors = {}
    with pinned(ckpt):
        for f in sorted(set(weight_files(ckpt).values())):
            tensors.update(load_tensors(f))
    save_file(tensors, out, {"format": "dsaflow-weights", "source": str(ckpt)})
    return Path(out)


def main(argv=None) -> int:
    """`python -m dsaflow.checkpoint.weights export CKPT_OR_RUN_DIR OUT.safetensors`."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "export":
        print("usage: python -m dsaflow.checkpoint.weights export CKPT_OR_RUN_DIR OUT.safetensors", file=sys.stderr)
        return 2
    try:
        print(export_weights(args[1], args[2]))
    except PlanError as exc:  # a ServeError, CheckpointError, or an OUT refused by dsaflow.outputs
        print(f"dsaflow: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
