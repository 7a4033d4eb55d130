"""The quart-trio app: every route that is not on the per-token hot path.

Admin and metadata routes live here, and so do the generation routes for connections that hypercorn
already owns (a keep-alive connection whose first request was, say, ``GET /v1/models``). Those stream
through ASGI, slower per event than the fast path but with identical bytes and semantics, because they
share ``Serving`` and the response objects. The WebSocket route multiplexes requests over one socket.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import trio
from quart import Response as QuartResponse
from quart import request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trioserve.frontend.chunks import Kind
from trioserve.frontend.errors import ApiError, error_body
from trioserve.frontend.openai_schema import DetokenizeRequest, TokenizeRequest
from trioserve.frontend.queue_sinks import SseQueueSink, WsSink
from trioserve.frontend.responses import Response
from trioserve.frontend.serving import Serving, message_dicts
from trioserve.frontend.validate import decode_body, resolve_model
from trioserve.sync import Waker


def _json(body: bytes, status: int = 200) -> QuartResponse:
    return QuartResponse(body, status=status, content_type="application/json")


async def _body() -> bytes:
    data = await request.get_data()
    return data if isinstance(data, bytes) else data.encode()


def _error(exc: ApiError) -> QuartResponse:
    response = _json(exc.body(), exc.status)
    if exc.retry_after is not None:
        response.headers["retry-after"] = str(exc.retry_after)
    return response


class WsRequest(msgspec.Struct, tag_field="type", tag="request"):
    id: str
    body: dict[str, Any]
    endpoint: str = "chat.completions"


class WsCancel(msgspec.Struct, tag_field="type", tag="cancel"):
    id: str


_ws_decoder = msgspec.json.Decoder(WsRequest | WsCancel)
_WS_ENDPOINTS: dict[str, Kind] = {"chat.completions": "chat", "completions": "completion"}


def create_app(serving: Serving, metrics_text: Callable[[], str]) -> QuartTrio:
    config = serving.config
    app = QuartTrio("trioserve")
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_body_bytes
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    created = int(time.time())

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> QuartResponse:
        status = exc.code or 500
        return _json(error_body(status, exc.description or exc.name), status)

    @app.errorhandler(ApiError)
    async def api_error(exc: ApiError) -> QuartResponse:
        return _error(exc)

    @app.get("/health")
    async def health() -> QuartResponse:
        if serving.dead_reason is not None:
            return _json(error_body(503, f"the engine is unavailable: {serving.dead_reason}"), 503)
        return QuartResponse(b"", status=200)

    @app.get("/metrics")
    async def metrics() -> QuartResponse:
        return QuartResponse(metrics_text(), status=200, content_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> QuartResponse:
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "trioserve",
                "root": config.model or name,
                "max_model_len": config.max_model_len,
            }
            for name in config.model_names
        ]
        return _json(msgspec.json.encode({"object": "list", "data": data}))

    @app.post("/tokenize")
    async def tokenize() -> QuartResponse:
        req = decode_body(await _body(), TokenizeRequest)
        resolve_model(req.model, config.model_names)
        tok = serving.tokenizer
        if req.messages is not None:
            messages = message_dicts(req.messages)
            ids = await serving.render(tok.apply_chat_template, messages, req.add_generation_prompt, None)
        elif req.prompt is not None:
            ids = await serving.render(tok.encode, req.prompt, req.add_special_tokens)
        else:
            raise ApiError(400, "send either `prompt` or `messages`")
        body = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}
        return _json(msgspec.json.encode(body))

    @app.post("/detokenize")
    async def detokenize() -> QuartResponse:
        req = decode_body(await _body(), DetokenizeRequest)
        resolve_model(req.model, config.model_names)
        vocab = serving.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = await serving.render(serving.tokenizer.decode, req.tokens, False)
        return _json(msgspec.json.encode({"prompt": text}))

    async def generate(kind: Kind) -> QuartResponse:
        sink = SseQueueSink()
        response = await serving.start(kind, await _body(), sink)
        if not response.options.stream:
            try:
                while not sink.ended:
                    await sink.waker.wait()
            finally:
                if not response.done:
                    serving.cancel(response)
            return _json(sink.body, sink.status)
        return QuartResponse(
            _stream(serving, response, sink),
            status=200,
            content_type="text/event-stream; charset=utf-8",
            headers={"cache-control": "no-cache"},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions() -> QuartResponse:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> QuartResponse:
        return await generate("completion")

    @app.websocket("/v1/ws")
    async def ws() -> None:
        await _serve_websocket(serving)

    return app


async def _stream(serving: Serving, response: Response, sink: SseQueueSink) -> AsyncIterator[bytes]:
    try:
        while True:
            if sink.chunks:
                data = sink.take()
                response.on_drained()  # deltas merged while we were away become chunks now
                yield data
            elif sink.ended:
                return
            else:
                await sink.waker.wait()
    finally:
        if not response.done:
            serving.cancel(response)


async def _serve_websocket(serving: Serving) -> None:
    """Several requests over one socket; one writer task drains the shared outbox in order."""
    outbox: list[bytes] = []
    writer = Waker()
    running: dict[str, tuple[Response, WsSink]] = {}

    async def write_loop() -> None:
        while True:
            if not outbox:
                await writer.wait()
                continue
            batch = outbox[:]
            outbox.clear()
            for _, (response, _sink) in list(running.items()):
                response.on_drained()
            for message in batch:
                await websocket.send(message.decode())
            for rid, (_response, sink) in list(running.items()):
                if sink.finished:
                    del running[rid]

    starting: dict[str, bool] = {}  # ids being rendered -> cancelled meanwhile

    async def start(msg: WsRequest, sink: WsSink) -> None:
        kind = _WS_ENDPOINTS.get(msg.endpoint)
        try:
            if kind is None:
                raise ApiError(400, f"unknown endpoint {msg.endpoint!r}; use one of {sorted(_WS_ENDPOINTS)}")
            response = await serving.start(kind, msgspec.json.encode(msg.body), sink)
        except ApiError as exc:
            sink.full(exc.status, exc.body())
            return
        finally:
            cancelled = starting.pop(msg.id)
        if cancelled:
            serving.cancel(response)
            sink.end()
        elif not response.done:
            running[msg.id] = (response, sink)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(write_loop)
            while True:
                raw = await websocket.receive()
                try:
                    msg = _ws_decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    error = msgspec.json.decode(error_body(400, f"bad message: {exc}"))["error"]
                    outbox.append(
                        msgspec.json.encode({"type": "error", "id": None, "status": 400, "error": error})
                    )
                    writer.set()
                    continue
                if isinstance(msg, WsCancel):
                    if msg.id in starting:
                        starting[msg.id] = True  # ``start`` ends it once rendering returns
                    entry = running.pop(msg.id, None)
                    if entry is not None and not entry[1].finished:
                        serving.cancel(entry[0])
                        entry[1].end()
                    continue
                sink = WsSink(outbox, writer, msg.id)
                if msg.id in running or msg.id in starting:
                    error = ApiError(400, f"request id {msg.id!r} is already running on this socket")
                    sink.full(error.status, error.body())
                    continue
                starting[msg.id] = False
                nursery.start_soon(start, msg, sink)
    finally:
        for response, _ in running.values():
            serving.cancel(response)
