"""The Hugging Face files a run was prepared from, kept in the run dir, so the run outlives its model.hf_path.

A `dsaflow train model=hf` run copies config.json and the tokenizer files of model.hf_path into
`<run_dir>/hf_files/` when the run dir is created (inside the run dir's atomic creation: all or nothing). The
weights are not copied: the run's own checkpoints hold them. Whatever later reads those files for the run (resume,
generate serve.checkpoint=RUN, export) reads them from model.hf_path while that folder exists, and from the run's
copy once it is gone (`hf_files_folder`); a run with neither is refused naming both and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

from dsaflow.errors import CheckpointError
from dsaflow.files import UnsafeFile, read_bytes

from .hf_folder import TOKENIZER_JSON, checkpoint_file, tokenizer_json

RUN_COPY = "hf_files"
CONFIG_JSON = "config.json"
COPIED = (CONFIG_JSON, TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
MAX_COPIED_BYTES = 256 << 20  # tokenizer.json of the largest vocabularies is tens of MB


def run_copy_files(hf_path) -> Dict[str, bytes]:
    """{RUN_COPY/name: bytes} of the files a run keeps of checkpoint folder `hf_path` (config.json and
    tokenizer.json required, the other tokenizer files when present), each read under the folder rule."""
    found = {}
    for name in COPIED:
        if name == TOKENIZER_JSON:
            path = tokenizer_json(hf_path)  # refuses a folder without one, naming the fix
        else:
            path = checkpoint_file(hf_path, name, "file to keep in the run dir", required=name == CONFIG_JSON)
        if path is None:
            continue
        try:
            found[f"{RUN_COPY}/{name}"] = read_bytes(path, max_bytes=MAX_COPIED_BYTES)
        except UnsafeFile as exc:
            raise CheckpointError(f"model.hf_path={hf_path}: {exc}. Fix: restore {name}.") from None
    return found


def hf_files_folder(hf_path, run_dir: Optional[os.PathLike]) -> Optional[Path]:
    """Where the config.json and tokenizer files of a run's model are read: model.hf_path while it exists, else
    the run's copy (<run_dir>/hf_files). None without an hf_path. Neither there: CheckpointError."""
    if not hf_path:
        return None
    if os.path.lexists(hf_path) or run_dir is None:
        return Path(hf_path)  # the folder rule judges it (a dangling link, a file) with its own message
    copy = Path(run_dir) / RUN_COPY
    if (copy / TOKENIZER_JSON).is_file() and not copy.is_symlink():
        return copy
    raise CheckpointError(
        f"model.hf_path={hf_path} does not exist, and the run {run_dir} keeps no copy of its tokenizer "
        f"({copy} is missing: the run was prepared without one). Fix: restore the checkpoint folder at {hf_path} "
        "(its config.json and tokenizer.json are enough)."
    )
