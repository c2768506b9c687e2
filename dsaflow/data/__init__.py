"""Data without downloads: byte tokenizer, synthetic retrieval task, text/`.bin` corpora, step-indexed batches.

The names below load on first use (PEP 562): the launcher's pre-launch checks read corpus sizes from `corpus`, and
importing `batches` would import torch into that parent process (about 2 s on a small CPU machine).
"""

from importlib import import_module

_WHERE = {
    "BatchSource": "batches",
    "IGNORE": "batches",
    "ByteTokenizer": "tokenizer",
    "CorpusError": "corpus",
    "TokenCorpus": "corpus",
    "load_tokens": "corpus",
    "RetrievalSpec": "retrieval",
    "retrieval_batch": "retrieval",
    "retrieval_sample": "retrieval",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
