"""The OpenAI request bodies `dsaflow serve` accepts, checked field by field, and its error JSON.

A request becomes a `Sampling` (what the engine and the stream need) or an `ApiError` whose message names the field.
Fields OpenAI defines that this server does not implement are refused when set to anything but their neutral value
(never accepted and ignored); a field OpenAI does not define is refused too, so a typo never passes silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

MAX_STOPS = 4  # as OpenAI: at most four stop strings
MAX_SEED = (1 << 63) - 1


class ApiError(Exception):
    """An error a client gets as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }

    def __init__(self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> Dict[str, Any]:
        kind = self.TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


@dataclass
class Sampling:
    """One request's generation settings, checked. prompt: token ids (completions: the client's text encoded, or its
    ids; chat: the rendered template encoded)."""

    model: str
    prompt: List[int]
    max_tokens: Optional[int]  # None: what the context leaves (`fit`)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # top-1: the sampled token's log-probability and the most likely token's
    chat: bool = False  # a /v1/chat/completions request (its prompt is the rendered messages)


def _bad(name: str, want: str, value: Any) -> ApiError:
    return ApiError(400, f"'{name}' must be {want}, got {type(value).__name__} {_short(value)}.", name)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(body: dict, name: str, lo: int, hi: int, default: Optional[int]) -> Optional[int]:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, "an integer", v)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must lie in [{lo}, {hi}], got {v}.", name)
    return v


def _number(body: dict, name: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, "a number", v)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        left = "(" if lo_open else "["
        raise ApiError(400, f"'{name}' must lie in {left}{lo:g}, {hi:g}], got {v}.", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return v


def _stops(body: dict) -> List[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > MAX_STOPS:
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOPS} of them", v)
    return v


def _token_ids(v: Any, name: str, vocab: int) -> List[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(name, "a list of token ids", v)
    bad = [t for t in v if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"'{name}' holds token id {bad[0]}, outside the vocabulary [0, {vocab}).", name)
    return v


# fields OpenAI defines that this server does not implement: refused unless left at these neutral values
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
}
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
}
COMPLETION_FIELDS = COMMON | {"prompt"} | set(NEUTRAL)
CHAT_FIELDS = COMMON | {"messages", "top_logprobs", "max_completion_tokens"} | set(NEUTRAL)


def _unsupported(body: dict, allowed: set) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise ApiError(
            400, f"unknown field '{unknown[0]}'; this server accepts {', '.join(sorted(allowed))}.", unknown[0]
        )
    for name, neutral in NEUTRAL.items():
        if name not in body or body[name] is None:
            continue
        if body[name] not in neutral or isinstance(body[name], bool) != isinstance(neutral[0], bool):
            why = (
                "one completion per request (send several requests)"
                if name in ("n", "best_of")
                else "it is not implemented"
            )
            raise ApiError(400, f"'{name}'={_short(body[name])} is not supported: {why}. Fix: drop '{name}'.", name)


def common_fields(body: dict, vocab: int) -> dict:
    """The fields completions and chat share, checked -> keyword arguments of `Sampling`."""
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "a string (GET /v1/models lists the one served)", model)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise _bad("stream_options", 'an object {"include_usage": bool}', opts)
    return dict(
        model=model,
        temperature=_number(body, "temperature", 0.0, 100.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        seed=_int(body, "seed", 0, MAX_SEED, None),
        stop=_stops(body),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids", vocab),
        stream=_bool(body, "stream", False),
        include_usage=_bool(opts or {}, "include_usage", False),
    )


def completion_request(body: Any, tokenizer, vocab: int) -> Sampling:
    """A /v1/completions body -> Sampling. prompt: a string, a list of token ids, or a one-element list of either."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object.", None)
    _unsupported(body, COMPLETION_FIELDS)
    prompt: Union[str, List[int], None] = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt:
        ids = _token_ids(prompt, "prompt", vocab)
    else:
        raise _bad("prompt", "a string or a list of token ids (one prompt per request)", prompt)
    if not ids:
        raise ApiError(400, "'prompt' is empty: it needs at least one token.", "prompt")
    logprobs = _int(body, "logprobs", 0, 1, None)  # the number of top alternatives: this server gives the top 1
    return Sampling(
        prompt=ids,
        max_tokens=_int(body, "max_tokens", 1, 1 << 30, 16),
        logprobs=logprobs is not None,
        **common_fields(body, vocab),
    )


def chat_request(body: Any, vocab: int) -> tuple:
    """A /v1/chat/completions body -> (Sampling without its prompt, the messages to render)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object.", None)
    _unsupported(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of {role, content} objects", messages)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "an object with a string 'role'", m)
        content = m.get("content")
        parts = content if isinstance(content, list) else None
        if parts is not None and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
        ):
            m["content"] = "".join(p["text"] for p in parts)
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "a string or a list of text parts", content)
    limit = _int(body, "max_completion_tokens", 1, 1 << 30, None)
    limit = _int(body, "max_tokens", 1, 1 << 30, limit)
    top = _int(body, "top_logprobs", 0, 1, None)
    logprobs = _bool(body, "logprobs", False) or top is not None
    return Sampling(prompt=[], max_tokens=limit, logprobs=logprobs, chat=True, **common_fields(body, vocab)), messages


def fit(s: Sampling, max_context: int) -> Sampling:
    """The prompt and its max_tokens within serve.max_context (a prompt and its completion share the cache row)."""
    room = max_context - len(s.prompt)
    if room < 1:
        raise ApiError(
            400,
            f"the prompt is {len(s.prompt)} tokens; this model's context (serve.max_context) is {max_context}, which leaves no room for a completion. Fix: a shorter prompt.",
            "messages" if s.chat else "prompt",
        )
    if s.max_tokens is None:
        s.max_tokens = room
    elif s.max_tokens > room:
        raise ApiError(
            400,
            f"'max_tokens'={s.max_tokens} with a prompt of {len(s.prompt)} tokens exceeds this model's context (serve.max_context={max_context}). Fix: max_tokens <= {room}.",
            "max_tokens",
        )
    return s
