"""Data without downloads: byte tokenizer, synthetic retrieval task, text/`.bin` corpora, step-indexed batches."""

from .batches import IGNORE, BatchSource
from .corpus import CorpusError, TokenCorpus, load_tokens
from .retrieval import RetrievalSpec, retrieval_batch, retrieval_sample
from .tokenizer import ByteTokenizer

__all__ = [
    "BatchSource",
    "ByteTokenizer",
    "CorpusError",
    "IGNORE",
    "RetrievalSpec",
    "TokenCorpus",
    "load_tokens",
    "retrieval_batch",
    "retrieval_sample",
]
