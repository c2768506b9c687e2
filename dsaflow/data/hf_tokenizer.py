"""A Hugging Face checkpoint's tokenizer.json through the `tokenizers` library, with the ByteTokenizer's interface.

`checkpoint_tokenizer(path)` is the tokenizer of a `model=hf` run: the checkpoint's tokenizer.json, resolved and
checked by the caller (dsaflow.checkpoint.hf_folder.tokenizer_json, which refuses a folder without one); without a
path (no model.hf_path) it is the byte tokenizer (ids 0..255). Encoding adds what the tokenizer's post-processor adds (a BOS token for
DeepSeek's and GLM's), as `AutoTokenizer` does by default; decoding skips nothing, so special tokens show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np

from dsaflow.errors import ConfigError

from .tokenizer import ByteTokenizer


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception types for a bad file
            raise ConfigError(
                f"{path} is not a tokenizer.json the tokenizers library reads ({exc}). Fix: restore it."
            ) from None
        self.path = path
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text).ids

    def encode_array(self, text: str) -> np.ndarray:
        """text -> int64 [N] (a vocabulary beyond uint16 fits)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def checkpoint_tokenizer(tokenizer_json: Optional[Path]):
    """HFTokenizer of the file `tokenizer_json` (a path the checkpoint folder rule resolved), or ByteTokenizer for
    None (a model without a Hugging Face checkpoint)."""
    return HFTokenizer(Path(tokenizer_json)) if tokenizer_json is not None else ByteTokenizer()
