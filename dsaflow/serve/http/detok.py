"""Incremental detokenization for streaming: text grows as tokens arrive, and a character whose bytes span several
tokens is sent only once all of them are in (a byte-level tokenizer decodes an unfinished UTF-8 sequence to U+FFFD).

The text of tokens [read, n) is the decode of a short window [prefix, n) minus the decode of [prefix, read), where
[prefix, read) are the tokens sent last time: a tokenizer may decode a token differently at the start of a sequence
(sentencepiece's leading space), so each step decodes the previous piece as context before the new tokens. When the window's decode ends in U+FFFD, the last character may
still be incomplete: nothing is sent until the next token (or the end, `flush`, which sends whatever is left).
"""

from __future__ import annotations

from typing import List

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: List[int] = []
        self.prefix = 0  # the window starts here
        self.read = 0  # tokens before this one have been sent as text

    def add(self, token: int) -> str:
        """One more token -> the text it completes ('' while a character is unfinished)."""
        self.ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        """The end of the stream: any text still held back (an unfinished character as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if len(text) <= len(before) or (text.endswith(REPLACEMENT) and not final):
            return ""
        new = text[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)  # the window starts where a whole character ended
        return new
