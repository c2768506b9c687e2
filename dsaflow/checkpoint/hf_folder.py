"""What a Hugging Face checkpoint folder may contain: the one rule every file read from `model.hf_path` obeys.

The rule: a file of the checkpoint is named relative to the folder (config.json, a shard named by
`model.safetensors.index.json`, a tokenizer file), and after following every symbolic link it must be a regular file
inside the checkpoint's *root*:
- for a plain folder, the root is the folder itself (links between its own files are fine);
- for a snapshot of the Hugging Face cache, `.../models--ORG--NAME/snapshots/REV/`, whose files are links to
  `../../blobs/HASH`, the root is the repo folder `models--ORG--NAME/`, so the cache's own layout works.
An absolute name, a `../` name or a link that leads anywhere else (a secret, /proc, another model, a FIFO) is
refused with a CheckpointError naming the file, where it leads and the fix; nothing of it is read or copied.

`checkpoint_file(folder, name)` applies the rule and returns the resolved path, which callers then open with
O_NOFOLLOW (dsaflow.files), so the path checked is the path read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

from dsaflow.errors import CheckpointError, shown
from dsaflow.files import explain_os_error, kind_of

HF_CACHE_REPO_PREFIX = "models--"
RULE = (
    "a checkpoint's files must resolve, after following links, inside its folder (or, for a snapshot of the "
    "Hugging Face cache, inside its repo folder models--*/)"
)


def checkpoint_root(folder) -> Path:
    """The folder every file of checkpoint `folder` must resolve into (see the module docstring)."""
    try:
        real = Path(folder).resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        why = explain_os_error(exc) if isinstance(exc, OSError) else "is a loop of symbolic links"
        raise CheckpointError(
            f"model.hf_path={folder} {why}. Fix: point model.hf_path at a Hugging Face checkpoint folder."
        ) from None
    if not real.is_dir():
        raise CheckpointError(f"model.hf_path={folder} is not a folder. Fix: point it at a checkpoint folder.")
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(HF_CACHE_REPO_PREFIX):
        return real.parent.parent
    return real


def checkpoint_file(folder, name, what: str = "file", required: bool = True) -> Optional[Path]:
    """The resolved path of the checkpoint file `name` (a relative path, as config.json or an index names it),
    checked against the rule. A missing file: CheckpointError when `required`, else None."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        raise CheckpointError(
            f"{folder}: the {what} {shown(name, 300) if isinstance(name, str) else repr(name)[:80]} is not a file name "
            f"relative to the checkpoint folder; {RULE}. Fix: restore the checkpoint as published."
        )
    root = checkpoint_root(folder)
    given = Path(folder) / name
    if not os.path.lexists(given):
        if not required:
            return None
        raise CheckpointError(f"{given} ({what}) does not exist. Fix: download the whole checkpoint again.")
    try:
        real = given.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        why = explain_os_error(exc) if isinstance(exc, OSError) else "is a loop of symbolic links"
        raise CheckpointError(f"{given} ({what}) {why}. Fix: download the whole checkpoint again.") from None
    if not real.is_relative_to(root):
        raise CheckpointError(
            f"{given} ({what}) leads to {real}, outside {root}: {RULE}, so it is neither read nor copied. Fix: "
            "replace the link or index entry with the checkpoint's own file."
        )
    mode = os.stat(real).st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{given} ({what}) is {kind_of(mode)}, not a regular file. Fix: restore the file.")
    return real


TOKENIZER_JSON = "tokenizer.json"


def tokenizer_json(hf_path) -> Optional[Path]:
    """The resolved tokenizer.json of checkpoint folder `hf_path` (None without an hf_path), checked against the
    rule. A folder without one is refused: its weights' ids mean nothing in bytes, so there is no fallback."""
    if not hf_path:
        return None
    path = checkpoint_file(hf_path, TOKENIZER_JSON, "tokenizer", required=False)
    if path is None:
        raise CheckpointError(
            f"model.hf_path={hf_path} has no {TOKENIZER_JSON}: model=hf turns prompts and training text into the "
            "checkpoint's own token ids with it, and bytes would mean nothing to its weights. Fix: put the "
            f"checkpoint's {TOKENIZER_JSON} into {hf_path} (e.g. `huggingface-cli download ORG/NAME "
            f"{TOKENIZER_JSON} --local-dir {hf_path}`), or point model.hf_path at the whole checkpoint folder."
        )
    return path
