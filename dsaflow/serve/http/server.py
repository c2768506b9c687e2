"""The HTTP front end of `dsaflow serve` (aiohttp): OpenAI's /v1/completions, /v1/chat/completions (SSE streaming
or one JSON answer), /v1/models, /health and /metrics, in front of the replicas' workers (`WorkerHub`).

A request's life: check its body (400 naming the field), its model (404) and its fit in serve.max_context (400);
admit it if the queue has room (429 + Retry-After otherwise) on the replica with the fewest requests in flight;
turn the token events its last stage sends into text (`TextStream`: incremental detokenization, stop strings and
stop token ids, top-1 log-probabilities); answer. A request that ends before its worker ends it (a stop string, a
client that left, a drain) is cancelled there, and its row is free at the replica's next tick.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from aiohttp import web

from .chat import encode_rendered
from .detok import IncrementalDetokenizer
from .protocol import ApiError, Sampling, chat_request, completion_request, fit
from .server_metrics import ServerMetrics

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


@dataclass
class Live:
    """A request in flight: its replica, the events its worker sent (token tuples, "done", "error")."""

    rid: int
    replica: int
    s: Sampling
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: float = field(default_factory=time.monotonic)
    first_at: Optional[float] = None
    tokens: int = 0
    ended_by_worker: bool = False


class TextStream:
    """Token events -> text pieces: (text, [(token, logprob, top token, top logprob)], finish reason or None).
    Text that could be the start of a stop string is held back until it cannot; a stop string ends the text before
    it; a stop token id (or serve.eos_id) ends it without its own text."""

    def __init__(self, s: Sampling, tokenizer, eos_id: Optional[int]):
        self.s, self.tok = s, tokenizer
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop_ids = set(s.stop_token_ids) | ({eos_id} if eos_id is not None else set())
        self.hold = max((len(x) for x in s.stop), default=1) - 1
        self.pending = ""
        self.n = 0

    def token(self, tok: int, lp, top, top_lp):
        """One token -> (text, entries, finish reason or None)."""
        self.n += 1
        entry = [(tok, lp, top, top_lp)] if self.s.logprobs else []
        if tok in self.stop_ids:
            return self.end("stop", entry, flush=False)
        self.pending += self.detok.add(tok)
        hit = self._stop_at()
        if hit is not None:
            text, self.pending = self.pending[:hit], ""
            return text, entry, "stop"
        if self.n >= self.s.max_tokens:
            return self.end("length", entry)
        cut = max(0, len(self.pending) - self.hold)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, entry, None

    def end(self, reason: str, entries: List[tuple] = (), flush: bool = True):
        """The last piece: what is held back (and an unfinished character) -> (text, entries, reason)."""
        if flush:
            self.pending += self.detok.flush()
        hit = self._stop_at()
        text = self.pending if hit is None else self.pending[:hit]
        self.pending = ""
        return text, list(entries), reason if hit is None else "stop"

    def _stop_at(self) -> Optional[int]:
        found = [i for i in (self.pending.find(x) for x in self.s.stop) if i >= 0]
        return min(found) if found else None


class Frontend:
    """The server's state: the live requests, each replica's load, draining / dead; the routes (`app`)."""

    def __init__(self, cfg, tokenizer, chat_template, hub, replicas: int, model_name: str):
        self.cfg, self.tok, self.chat, self.hub = cfg, tokenizer, chat_template, hub
        self.model_name = model_name
        self.vocab, self.max_context, self.eos_id = cfg.model.vocab_size, cfg.serve.max_context, cfg.serve.eos_id
        self.capacity = cfg.server.max_queue + replicas * cfg.serve.max_batch  # waiting + running, over replicas
        self.live: Dict[int, Live] = {}
        self.load = [0] * replicas
        self.running = [0] * replicas
        self.next_id = 0
        self.draining = False
        self.dead: Optional[str] = None
        self.metrics = ServerMetrics(model_name)
        self.api_key = cfg.server.api_key
        self.created = int(time.time())

    # --- the workers' events (on the event loop) ----------------------------------------------------------------
    def on_message(self, rank: int, msg) -> None:
        kind = msg[0]
        if kind == "tokens":
            _, out, done, _queued, running = msg
            replica = rank // self.hub.ranks
            self.running[replica] = running
            for rid, _k, tok, lp, top, top_lp in out:
                live = self.live.get(rid)
                if live is not None:
                    live.events.put_nowait(("token", tok, lp, top, top_lp))
            for rid in done:
                live = self.live.get(rid)
                if live is not None:
                    live.ended_by_worker = True
                    live.events.put_nowait(("done",))
            self.metrics.running.set(sum(self.running))
        elif kind == "stats":
            _, global_rank, busy, _tokens, _wall = msg
            self.metrics.busy.labels(rank=str(global_rank)).set(busy)

    def fail_all(self, why: str) -> None:
        """Every request in flight ends with 503 `why` (a worker died, or the drain ran out)."""
        for live in self.live.values():
            live.events.put_nowait(("error", why))

    # --- admission ----------------------------------------------------------------------------------------------
    def admit(self, s: Sampling) -> Live:
        if self.dead:
            raise ApiError(503, f"the server cannot generate: {self.dead}.")
        if self.draining:
            raise ApiError(503, "the server is shutting down and admits no new request.")
        if len(self.live) >= self.capacity:
            raise ApiError(
                429,
                f"the queue is full ({len(self.live)} requests in flight; server.max_queue={self.cfg.server.max_queue}"
                f" waiting). Retry after {RETRY_AFTER_S} s.",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        from dsaflow.serve.online import float_bits, sampling_key

        rid, self.next_id = self.next_id, self.next_id + 1
        replica = min(range(len(self.load)), key=lambda d: self.load[d])
        live = Live(rid, replica, s)
        key = (sampling_key(s.seed, rid), float_bits(s.temperature), float_bits(s.top_p))
        if not self.hub.send(replica, ("add", rid, s.prompt, s.max_tokens, key, s.logprobs)):
            raise ApiError(503, f"replica {replica} is gone.")
        self.live[rid] = live
        self.load[replica] += 1
        self.metrics.prompt.inc(len(s.prompt))
        self.metrics.queue_depth.inc()
        return live

    def release(self, live: Live) -> None:
        """The request is answered (or its client left): forget it; cancel it on its replica unless it ended there."""
        if self.live.pop(live.rid, None) is None:
            return
        self.load[live.replica] -= 1
        if live.first_at is None:
            self.metrics.queue_depth.dec()
        if not live.ended_by_worker:
            self.hub.send(live.replica, ("cancel", live.rid))

    async def pieces(self, live: Live):
        """Async iterator of (text, entries, finish reason) until the request ends; ApiError(503) if it cannot."""
        text = TextStream(live.s, self.tok, self.eos_id)
        while True:
            ev = await live.events.get()
            if ev[0] == "error":
                raise ApiError(503, f"the request stopped: {ev[1]}.")
            if ev[0] == "done":
                yield text.end("stop" if text.n < live.s.max_tokens else "length")
                return
            now = time.monotonic()
            if live.first_at is None:
                live.first_at = now
                self.metrics.queue_depth.dec()
                self.metrics.ttft.observe(now - live.started)
            live.tokens += 1
            self.metrics.tokens(1)
            piece = text.token(*ev[1:])
            yield piece
            if piece[2] is not None:
                return

    def observe_end(self, live: Live, reason: str) -> None:
        now = time.monotonic()
        self.metrics.e2e.observe(now - live.started)
        if live.first_at is not None and live.tokens > 1:
            self.metrics.tpot.observe((now - live.first_at) / (live.tokens - 1))
        self.metrics.finished.labels(finished_reason=reason).inc()

    # --- routes -------------------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.server.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return self.error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            limit = self.cfg.server.max_body_bytes
            return self.error_response(ApiError(413, f"the request body is over server.max_body_bytes={limit}."))
        except web.HTTPException as exc:  # unknown route (404), wrong method (405): as OpenAI error JSON
            return self.error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}."))
        except (asyncio.CancelledError, ConnectionError):  # the client left: nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers 500 in OpenAI's shape; the log has the traceback
            import traceback

            traceback.print_exc()
            return self.error_response(ApiError(500, f"internal error ({type(exc).__name__}); see the server log."))

    def error_response(self, exc: ApiError) -> web.Response:
        self.metrics.errors.labels(status=str(exc.status)).inc()
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)

    @web.middleware
    async def _auth(self, request, handler):
        if self.api_key and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise ApiError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'.")
        return await handler(request)

    async def health(self, request) -> web.Response:
        if self.dead or self.draining:
            why = self.dead or "draining"
            return web.json_response({"status": "unavailable", "reason": why}, status=503)
        return web.json_response({"status": "ok"})

    async def models(self, request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dsaflow"}
        card["max_model_len"] = self.max_context
        return web.json_response({"object": "list", "data": [card]})

    async def metrics_page(self, request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _body(self, request):
        raw = await request.read()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON ({exc}).") from None

    def _checked(self, s: Sampling) -> Sampling:
        if s.model != self.model_name:
            raise ApiError(
                404, f"the model '{s.model}' does not exist; this server serves '{self.model_name}'.", "model"
            )
        return fit(s, self.max_context)

    async def completions(self, request) -> web.StreamResponse:
        s = self._checked(completion_request(await self._body(request), self.tok, self.vocab))
        return await self.answer(request, s, chat=False)

    async def chat_completions(self, request) -> web.StreamResponse:
        s, messages = chat_request(await self._body(request), self.vocab)
        if self.chat is None:
            raise ApiError(
                400,
                "this model has no chat template (none in its tokenizer_config.json, no server.chat_template). Fix: "
                "use /v1/completions, or start the server with server.chat_template=FILE.",
                "messages",
            )
        s.prompt = encode_rendered(self.tok, self.chat.render(messages))
        return await self.answer(request, self._checked(s), chat=True)

    async def answer(self, request, s: Sampling, chat: bool) -> web.StreamResponse:
        live = self.admit(s)
        shape = Shape(chat, self.model_name, self.tok, len(s.prompt))
        try:
            if s.stream:
                return await self._stream(request, live, shape)
            parts = [piece async for piece in self.pieces(live)]
            reason = parts[-1][2]
            self.observe_end(live, reason)
            return web.json_response(shape.whole(parts, reason, live.tokens))
        finally:
            self.release(live)

    async def _stream(self, request, live: Live, shape: Shape) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if shape.chat:
            await resp.write(sse(shape.chunk("", [], None, role=True)))
        reason = None
        try:
            async for text, entries, reason in self.pieces(live):
                if text or entries or reason:
                    await resp.write(sse(shape.chunk(text, entries, reason)))
        except ApiError as exc:  # the status line is gone: the error travels as an event, as OpenAI's does
            self.metrics.errors.labels(status=str(exc.status)).inc()
            await resp.write(sse(exc.body()))
        else:
            self.observe_end(live, reason)
            if live.s.include_usage:
                await resp.write(sse(shape.usage_chunk(live.tokens)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Shape:
    """OpenAI's response objects for one request: completion or chat, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, tokenizer, prompt_tokens: int):
        self.chat, self.model, self.tok, self.prompt_tokens = chat, model, tokenizer, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset of the next token

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion: int) -> dict:
        total = self.prompt_tokens + completion
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion, "total_tokens": total}

    def logprobs(self, entries: List[tuple]) -> Optional[dict]:
        if not entries:
            return None
        texts = [self.tok.decode([t]) for t, *_ in entries]
        tops = [self.tok.decode([top]) if top is not None else "" for _, _, top, _ in entries]
        if self.chat:
            return {
                "content": [
                    {
                        "token": t,
                        "logprob": lp,
                        "bytes": list(t.encode()),
                        "top_logprobs": [{"token": tt, "logprob": tlp, "bytes": list(tt.encode())}],
                    }
                    for t, (_, lp, _, tlp), tt in zip(texts, entries, tops)
                ]
            }
        offsets = []
        for t in texts:
            offsets.append(self.offset)
            self.offset += len(t)
        return {
            "tokens": texts,
            "token_logprobs": [lp for _, lp, _, _ in entries],
            "top_logprobs": [{tt: tlp} for tt, (_, _, _, tlp) in zip(tops, entries)],
            "text_offset": offsets,
        }

    def whole(self, parts: List[tuple], reason: str, completion: int) -> dict:
        """parts: the (text, entries, finish reason) pieces of the request."""
        text = "".join(t for t, _, _ in parts)
        entries = [e for _, es, _ in parts for e in es]
        if self.chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(entries), "finish_reason": reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": self.usage(completion)}
        choice = {"index": 0, "text": text, "logprobs": self.logprobs(entries), "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage(completion)}

    def chunk(self, text: str, entries: List[tuple], reason: Optional[str], role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": self.logprobs(entries), "finish_reason": reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "logprobs": self.logprobs(entries), "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, completion: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self.usage(completion)}
