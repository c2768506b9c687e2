"""Byte-level tokenizer: token id = byte value, vocab 256, no special tokens.

Why bytes: no download, no training, every text round-trips, and the retrieval task reads naturally in logs.
"""

from __future__ import annotations

from typing import Iterable, List

import numpy as np

VOCAB_SIZE = 256


class ByteTokenizer:
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """text -> uint8 [N]."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")
