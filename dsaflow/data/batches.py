"""Batches for training and evaluation, a pure function of (data config, seed, step).

A batch is `(inputs, targets)`:
    inputs  int64 [B, T]     token ids
    targets int64 [B, 3, T]  row 0: next-token targets for the LM loss (-100 = ignored)
                             row 1: answer targets for retrieval accuracy (-100 = not an answer position)
                             row 2: which query each answer position belongs to (-1 = none, -2 = a trained
                                    byte of the retrieval filler's repeated run, `data.copy_len`)
Both are split along dim 0 into microbatches by the pipeline schedule. Because batch `step` never depends on what
came before, resuming at step k continues exactly, on any pipeline layout.

torch loads with the first batch, not with this module: the launcher's parent builds a BatchSource to check the data
(`check_first_batch`) before anything launches, and importing torch there would cost about 2 s on a small CPU
machine for checks that need only numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import numpy as np

if TYPE_CHECKING:
    import torch

from .corpus import CorpusError, TokenCorpus, load_split_tokens
from .retrieval import COPY, RetrievalSpec, retrieval_batch
from .tokenizer import ByteTokenizer

IGNORE = -100
TRAIN, VAL = 0, 1


def encode_text(tokenizer, data: np.ndarray, split_at):
    """uint8 bytes [N] (and where held-out bytes start, or None) -> int64 token ids (and where held-out ids start):
    each part decoded as UTF-8 and encoded by `tokenizer` whole, in memory."""
    parts = [data] if split_at is None else [data[:split_at], data[split_at:]]
    ids = [np.asarray(tokenizer.encode(bytes(p).decode("utf-8", errors="replace")), dtype=np.int64) for p in parts]
    return np.concatenate(ids), (None if split_at is None else len(ids[0]))


class BatchSource:
    """`batch(step)` for training, `val_batch(i)` for evaluation (a fixed held-out set)."""

    def __init__(self, data_cfg, seq_len: int, batch_size: int, seed: int, vocab_size: int, tokenizer=None):
        """tokenizer: for data.kind=text, a tokenizer with `encode(str)` (a checkpoint's tokenizer.json,
        dsaflow.data.hf_tokenizer); None = bytes."""
        self.cfg, self.seq_len, self.batch_size, self.seed = data_cfg, seq_len, batch_size, seed
        self.kind = data_cfg.kind
        self.has_answers = self.kind == "retrieval"
        _refuse_unused(data_cfg)
        subword = self.kind == "text" and tokenizer is not None and not isinstance(tokenizer, ByteTokenizer)
        if self.kind == "retrieval":
            self.spec = RetrievalSpec(
                seq_len,
                data_cfg.num_pairs,
                data_cfg.key_len,
                data_cfg.value_len,
                data_cfg.num_queries,
                data_cfg.distinct_queries,
                data_cfg.copy_len,
                data_cfg.copy_chars == "mixed",
            )
            self.spec.check()
            self.corpus = None
        else:  # text | bin (the schema's DataKind)
            if not data_cfg.path:
                raise CorpusError(
                    f"data.kind={self.kind} needs data.path. Fix: set data.path to a "
                    f"{'text file or folder' if self.kind == 'text' else 'nanoGPT .bin token file'}."
                )
            by_files = data_cfg.split == "files"
            tokens, split_at = load_split_tokens(
                self.kind,
                data_cfg.path,
                data_cfg.suffixes,
                data_cfg.exclude,
                data_cfg.val_fraction if by_files else None,
            )
            if subword:
                tokens, split_at = encode_text(tokenizer, tokens, split_at)
            self.corpus = TokenCorpus(tokens, seq_len, data_cfg.val_fraction, data_cfg.path, split_at)
        self.vocab_size = vocab_size
        # byte tokens: eval reports bits per byte (loss / ln 2)
        self.bytes = self.kind == "text" and not subword

    def _raw(self, split: int, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """-> tokens int64 [B, T + 1], query ids int64 [B, T + 1] (-1 where no answer), as numpy arrays; raises
        CorpusError for a token id outside the vocabulary."""
        if self.corpus is None:
            tokens, qid = retrieval_batch(self.spec, self.seed, split, step, self.batch_size)
            tokens, qid = tokens.astype(np.int64), qid.astype(np.int64)
        else:
            tokens = self.corpus.batch(self.seed, split, step, self.batch_size)
            qid = np.full_like(tokens, -1)
        if int(tokens.max()) >= self.vocab_size:
            raise CorpusError(
                f"data.path={self.cfg.path} holds token id {int(tokens.max())} >= model.vocab_size={self.vocab_size}. "
                "Fix: raise model.vocab_size to the tokenizer's vocabulary."
            )
        return tokens, qid

    def _make(self, split: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        import torch

        raw, qid = (torch.from_numpy(a) for a in self._raw(split, step))
        inputs, nxt, qid = raw[:, :-1].contiguous(), raw[:, 1:], qid[:, 1:]
        answers = torch.where(qid >= 0, nxt, torch.full_like(nxt, IGNORE))
        if self.has_answers and self.cfg.loss_on == "answer":  # the answers, and the repeated run's bytes if any
            lm = torch.where((qid >= 0) | (qid == COPY), nxt, torch.full_like(nxt, IGNORE))
        else:
            lm = nxt.clone()
        return inputs, torch.stack([lm, answers, qid], dim=1).contiguous()

    def check_first_batch(self) -> None:
        """Make batch 0's token ids (numpy only, no torch) and check them and the whole corpus against the
        vocabulary: what the launcher's parent checks before a worker starts. Raises CorpusError."""
        self._raw(TRAIN, 0)
        self.check_vocab()

    def check_vocab(self) -> None:
        """Every token of a text/.bin corpus lies inside the vocabulary (the parent checks the whole file once,
        instead of a worker finding a bad id at some later step)."""
        if self.corpus is None:
            return
        top = int(np.max(self.corpus.tokens)) if len(self.corpus.tokens) else 0
        if top >= self.vocab_size:
            where = int(np.argmax(np.asarray(self.corpus.tokens) >= self.vocab_size))
            raise CorpusError(
                f"data.path={self.cfg.path} holds token id {top} (first out-of-vocabulary id at token {where}) >= "
                f"model.vocab_size={self.vocab_size}. Fix: raise model.vocab_size to the tokenizer's vocabulary."
            )

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._make(TRAIN, step)

    def val_batch(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._make(VAL, i)


def _refuse_unused(d) -> None:
    """Options of one data kind set for another would be accepted and ignored: name them instead."""
    unused = []
    if d.kind != "text":
        unused += [f"data.split={d.split}"] if d.split != "tail" else []
        unused += [f"data.suffixes={list(d.suffixes)}"] if d.suffixes is not None else []
        unused += [f"data.exclude={list(d.exclude)}"] if d.exclude else []
    if d.kind != "retrieval" and d.distinct_queries:
        unused.append("data.distinct_queries=true")
    if d.kind != "retrieval" and d.copy_len:
        unused.append(f"data.copy_len={d.copy_len}")
    if d.copy_chars != "filler" and d.kind != "retrieval":
        unused.append(f"data.copy_chars={d.copy_chars}")
    elif d.copy_chars != "filler" and not d.copy_len:
        raise CorpusError(
            f"data.copy_chars={d.copy_chars} picks the bytes of the repeated run, but data.copy_len=0 repeats none. "
            "Fix: set data.copy_len (e.g. data.copy_len=24), or drop data.copy_chars."
        )
    if unused:
        raise CorpusError(
            f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing with data.kind={d.kind}. Fix: drop "
            f"{'it' if len(unused) == 1 else 'them'}, or use the data kind {'it belongs' if len(unused) == 1 else 'they belong'} to."
        )
    if d.kind == "text" and d.suffixes is not None:
        bad = [s for s in d.suffixes if not (isinstance(s, str) and s.startswith(".") and len(s) > 1)]
        if bad or not d.suffixes:
            raise CorpusError(
                f"data.suffixes={list(d.suffixes)}: each must be a file suffix with its dot, e.g. .py, and at least "
                "one is needed. Fix: e.g. data.suffixes=[.py], or leave it unset for .txt/.md/.text."
            )
