"""The prompts of a generate job, read and checked as text before any process starts.

serve.prompts (a list of strings; an entry may be a list of token ids, serve.prompts='[[0,17,4]]') or serve.prompts_file (JSONL, one {"prompt": "...", "max_new_tokens": n
(optional)} per line; a prompt may also be a list of token ids, {"prompt": [0, 17, 4]}). Lines are split on "\\n" only: a U+2028 or a form feed inside a JSON string is part of the
prompt, not a line break. Every prompt must be valid Unicode that encodes to UTF-8 (a lone surrogate, which is what
an invalid byte on the command line becomes, is refused naming where it is), and every per-line max_new_tokens a
whole number within serve.max_new_tokens' range. Rejected values are quoted shortened (`dsaflow.errors.shown`).
A prompts file may be a link to the user's own file: it is an input the user names, read through the link.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from dsaflow.errors import ServeError, shown
from dsaflow.files import UnsafeFile, read_text

MAX_NEW_TOKENS_HI = 1 << 22  # dsaflow.config.schema.ServeConfig.max_new_tokens' upper bound


def unicode_problem(text: str) -> str:
    """Why `text` cannot be encoded as UTF-8 ('' when it can)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds {exc.object[exc.start : exc.end]!r} at character {exc.start}, which is not valid Unicode "
            "text (a lone surrogate: an invalid byte on the command line, or a broken \\ud800-style JSON escape)"
        )
    return ""


def _whole_number(digits: str):
    """JSON integers as ints, except beyond 30 digits (int() of thousands of digits is refused or slow): kept as
    text, so the range check names it."""
    return int(digits) if len(digits) <= 30 else digits


def token_ids(prompt) -> bool:
    """A prompt given as token ids: a non-empty list of whole numbers >= 0 (the vocabulary is checked later)."""
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt)
    )


def _checked(prompt, where: str):
    if token_ids(prompt):
        return prompt
    problem = unicode_problem(prompt)
    if problem:
        raise ServeError(f"{where} {problem}. Fix: give the prompt as UTF-8 text.")
    return prompt


def _inline(prompt, i: int):
    """serve.prompts[i] -> its text, or its token ids (a list of whole numbers >= 0, as a prompts file's). A
    number typed on the command line (serve.prompts=[123]) is the text "123"."""
    if isinstance(prompt, (str, int, float, bool)):
        return _checked(str(prompt), f"prompt {i}")
    ids = OmegaConf.to_container(prompt) if isinstance(prompt, (ListConfig, DictConfig)) else prompt
    ids = list(ids) if isinstance(ids, tuple) else ids
    if not token_ids(ids):
        raise ServeError(
            f"serve.prompts[{i}]={shown(str(ids))} is neither text nor a non-empty list of token ids (whole "
            "numbers >= 0). Fix: a string, or token ids as in serve.prompts='[[0,17,4]]'."
        )
    return ids


def load_requests(serve_cfg, answers: Optional[List[Optional[str]]] = None) -> List[Tuple[str, int, str]]:
    """serve.prompts or serve.prompts_file -> (prompt, max_new_tokens, where) per request, where = "prompt i" or
    "serve.prompts_file=<file> line n". Raises ServeError naming the prompt or line. `answers`, when given, receives
    each file line's optional "answer" as a string (None where it has none)."""
    given, path = list(serve_cfg.prompts or []), serve_cfg.prompts_file
    if given and path:
        raise ServeError(
            f"both serve.prompts ({len(given)} prompts) and serve.prompts_file={path} are set. Fix: give one of them."
        )
    if not given and not path:
        raise ServeError(
            'no prompts. Fix: set serve.prompts=["Hello","Once upon"] or serve.prompts_file=prompts.jsonl '
            '(one {"prompt": "..."} per line).'
        )
    if given:
        return [(_inline(p, i), serve_cfg.max_new_tokens, f"prompt {i}") for i, p in enumerate(given)]
    field = f"serve.prompts_file={path if len(str(path)) <= 200 else shown(str(path), 120)}"
    try:  # a regular file only (a FIFO or a folder is named as such, never waited on); the user's own link is fine
        text = read_text(os.path.realpath(path))
    except UnsafeFile as exc:
        raise ServeError(f"{field}: {exc}. Fix: point it at a JSONL file.") from None
    out = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{field} line {n}"
        try:
            row = json.loads(line, parse_int=_whole_number)
            if not (isinstance(row["prompt"], str) or token_ids(row["prompt"])):
                raise TypeError
            prompt, limit = row["prompt"], row.get("max_new_tokens", serve_cfg.max_new_tokens)
            answer = row.get("answer")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise ServeError(
                f'{where} is not a JSON object with a string "prompt": {shown(line)}. Fix: one {{"prompt": "..."}} '
                '(or {"prompt": [token ids]}) per line.'
            ) from None
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_NEW_TOKENS_HI:
            raise ServeError(
                f"{where}: max_new_tokens={shown(limit)} is not a whole number in [1, {MAX_NEW_TOKENS_HI}]. Fix: a "
                "whole number in that range, or drop the key (serve.max_new_tokens applies)."
            )
        out.append((_checked(prompt, where), limit, where))
        if answers is not None:
            answers.append(None if answer is None else str(answer))
    if not out:
        raise ServeError(f'{field} holds no prompts. Fix: add {{"prompt": "..."}} lines.')
    return out
