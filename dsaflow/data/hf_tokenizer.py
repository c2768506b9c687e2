"""A Hugging Face checkpoint's tokenizer.json through the `tokenizers` library, with the ByteTokenizer's interface.

`checkpoint_tokenizer(hf_path)` is the tokenizer of a `model=hf` run: DIR/tokenizer.json when the checkpoint ships
one, else the byte tokenizer (ids 0..255). Encoding adds what the tokenizer's post-processor adds (a BOS token for
DeepSeek's and GLM's), as `AutoTokenizer` does by default; decoding skips nothing, so special tokens show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, List, Optional

import numpy as np

from dsaflow.errors import ConfigError

from .tokenizer import ByteTokenizer

TOKENIZER_JSON = "tokenizer.json"


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


def checkpoint_tokenizer(hf_path: Optional[str]):
    """HFTokenizer of hf_path/tokenizer.json, or ByteTokenizer when there is no such file (or no hf_path)."""
    if hf_path and (Path(hf_path) / TOKENIZER_JSON).is_file():
        return HFTokenizer(Path(hf_path) / TOKENIZER_JSON)
    return ByteTokenizer()
